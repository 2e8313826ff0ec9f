//! Token selection on the device, through the runtime's `argmax` and
//! `sample`: greedy with a tie (the lowest index must win, as on the CPU)
//! and top-p at several temperatures, on f32, f16 and bf16 logits.

use super::check::{round, Cx};
use crate::reference as r;
use crate::runtime::DType;

pub(super) fn cases(cx: &mut Cx) {
    for dt in [DType::F32, DType::F16, DType::Bf16] {
        sampling_case(cx, dt);
    }
}

/// argmax and `sample` on `dt` logits (rounded to it: bf16 makes many
/// ties, which the lowest index must win, as on the CPU).
fn sampling_case(cx: &mut Cx, dt: DType) {
    let (rows, vocab) = (4, 49_152);
    let mut logits = cx.rng.vec(rows * vocab, 8.0);
    // A tie on row 0: the lower index must win.
    logits[100] = 50.0;
    logits[200] = 50.0;
    let logits = round(dt, &logits);
    let (argmax_entry, sample_entry) = (
        format!("argmax_{}", dt.suffix()),
        format!("sample_{}", dt.suffix()),
    );
    let want: Vec<f32> = logits.chunks(vocab).map(|l| r::argmax(l) as f32).collect();
    let g = cx.gpu;
    let got = (|| {
        let lb = g.upload_f32(dt, &logits)?;
        let toks = g.argmax(&lb, rows, vocab)?;
        Ok(toks.iter().map(|&t| t as f32).collect())
    })();
    cx.check_exact(
        &format!("argmax 4x49152 with a tie, {dt:?}"),
        &argmax_entry,
        got,
        &want,
        None,
    );

    // `sample`: per-row (temperature, top_p, u); row 0 greedy (with the
    // tie above), the others top-p at different settings.
    let settings = [(0.0f32, 1.0f32), (0.8, 0.9), (1.3, 0.5), (0.6, 1.0)];
    let mut params = Vec::with_capacity(rows * 3);
    for &(t, p) in &settings {
        params.extend([t, p, cx.rng.unit()]);
    }
    let refs: Vec<Option<r::TopP>> = logits
        .chunks(vocab)
        .zip(params.chunks(3))
        .map(|(l, p)| (p[0] > 0.0).then(|| r::top_p_sample(l, p[0], p[1], p[2])))
        .collect();
    let want: Vec<f32> = logits
        .chunks(vocab)
        .zip(&refs)
        .map(|(l, r)| r.as_ref().map_or(r::argmax(l), |r| r.token) as f32)
        .collect();
    let got = (|| {
        let lb = g.upload_f32(dt, &logits)?;
        g.sample(&lb, rows, vocab, &params)
    })();
    // Sums in a different order can move a boundary: a sampled GPU token
    // counts as right when it is in the reference's nucleus (0.1% slack on
    // the threshold); greedy rows must be exact. Exact agreement is in the
    // note.
    let (gpu, note) = match got {
        Ok(toks) => {
            let exact = toks
                .iter()
                .zip(&want)
                .filter(|(t, w)| **t as f32 == **w)
                .count();
            let judged: Vec<f32> = toks
                .iter()
                .zip(&refs)
                .zip(&want)
                .map(|((&t, r), &w)| match r {
                    Some(r)
                        if (t as usize) < vocab && r.weights[t as usize] >= r.threshold * 0.999 =>
                    {
                        w
                    }
                    _ => t as f32,
                })
                .collect();
            (
                Ok(judged),
                Some(format!(
                    "{exact}/{rows} tokens equal to the reference; sampled rows may be anywhere inside its nucleus"
                )),
            )
        }
        Err(e) => (Err(e), None),
    };
    cx.check_exact(
        &format!("sample 4x49152, {dt:?}: greedy, T 0.8 p 0.9, T 1.3 p 0.5, T 0.6 p 1"),
        &sample_entry,
        gpu,
        &want,
        note,
    );
}
