//! Trace replay (`[load.trace]`): a recorded trace sent again, open loop,
//! at its arrival times divided by a time-scale factor (2.0 = twice the
//! rate). A session's calls go in order: each at the later of its scaled
//! time and its predecessor's end. Prompts are synthesised to the recorded
//! token counts; a trace's shared-prefix blocks become the same token ids
//! wherever the same block id appears (so a server with prefix caching
//! sees the sharing the trace had), and a session's call without blocks
//! starts with its predecessor's prompt (a conversation grows). The sweep
//! searches the largest factor that holds the SLOs.

use crate::load::ScheduledCall;
use crate::record::LoadRequest;
use envelope_profile::trace::TraceRequest;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

pub use crate::config::TraceLoad;

impl TraceLoad {
    /// The sessions of `seconds` of replay at `scale` from trace time
    /// `from_s` (the trace repeats past its end; each lap's own tokens are
    /// new), due times in the probe's seconds. A session is in the window
    /// its first call is in, whole. `vocab` bounds token ids.
    pub fn sessions(
        &self,
        scale: f64,
        from_s: f64,
        seconds: f64,
        vocab: usize,
    ) -> Vec<Vec<ScheduledCall>> {
        let period = self.period_s();
        let to_s = from_s + seconds * scale;
        let vocab = vocab.max(2) as u32;
        let mut blocks: HashMap<u64, Vec<u32>> = HashMap::new();
        // (lap, session) -> its calls, and the last prompt of each.
        let mut sessions: Vec<Vec<ScheduledCall>> = vec![];
        let mut by_id: HashMap<(u64, &str), usize> = HashMap::new();
        let mut first: HashMap<&str, f64> = HashMap::new();
        for r in &self.trace.requests {
            if let Some(s) = &r.session {
                first.entry(s.as_str()).or_insert(r.t_s);
            }
        }
        let first_lap = (from_s / period).floor().max(0.0) as u64;
        let mut lap = first_lap;
        while (lap as f64) * period < to_s {
            for (i, r) in self.trace.requests.iter().enumerate() {
                let t = lap as f64 * period + r.t_s;
                let opened = r
                    .session
                    .as_deref()
                    .map_or(t, |s| lap as f64 * period + first[s]);
                if opened < from_s || opened >= to_s {
                    continue;
                }
                let slot = match &r.session {
                    Some(s) => *by_id.entry((lap, s.as_str())).or_insert_with(|| {
                        sessions.push(vec![]);
                        sessions.len() - 1
                    }),
                    None => {
                        sessions.push(vec![]);
                        sessions.len() - 1
                    }
                };
                let prev = sessions[slot]
                    .last()
                    .map(|c| c.request.prompt_tokens.as_slice());
                let seed = (lap << 32) ^ i as u64;
                let prompt = prompt_for(r, prev, vocab, seed, &mut blocks);
                sessions[slot].push(ScheduledCall {
                    due_s: (t - from_s) / scale,
                    class: r.class.clone(),
                    tenant: r.tenant.clone(),
                    request: LoadRequest {
                        prompt_tokens: prompt,
                        prompt_text: None,
                        output_tokens: r.output_tokens.max(1),
                    },
                });
            }
            lap += 1;
        }
        sessions
    }
}

/// The token ids of a block: the same for the same id, anywhere.
fn block_tokens(id: u64, n: usize, vocab: u32, cache: &mut HashMap<u64, Vec<u32>>) -> &[u32] {
    let b = cache.entry(id).or_insert_with(|| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(id ^ 0xb10c);
        (0..n).map(|_| 1 + rng.random_range(0..vocab - 1)).collect()
    });
    if b.len() < n {
        let mut rng = rand::rngs::StdRng::seed_from_u64(id ^ 0xb10c ^ b.len() as u64);
        b.extend((b.len()..n).map(|_| 1 + rng.random_range(0..vocab - 1)));
    }
    &b[..n]
}

/// A prompt of `r.input_tokens` ids: its prefix blocks, else its
/// session predecessor's prompt, then ids of its own (from `seed`).
fn prompt_for(
    r: &TraceRequest,
    prev: Option<&[u32]>,
    vocab: u32,
    seed: u64,
    blocks: &mut HashMap<u64, Vec<u32>>,
) -> Vec<u32> {
    let n = r.input_tokens.max(1) as usize;
    let mut p = Vec::with_capacity(n);
    match (r.block_tokens, prev) {
        (Some(bt), _) if !r.prefix_blocks.is_empty() => {
            for id in &r.prefix_blocks {
                let take = (bt as usize).min(n - p.len());
                p.extend_from_slice(block_tokens(*id, take, vocab, blocks));
                if p.len() == n {
                    break;
                }
            }
        }
        (_, Some(prev)) => p.extend_from_slice(&prev[..prev.len().min(n)]),
        _ => {}
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x0de7);
    p.extend((p.len()..n).map(|_| 1 + rng.random_range(0..vocab - 1)));
    p
}

#[cfg(test)]
mod tests;
