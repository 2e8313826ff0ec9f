//! SVG plots (plotters) of one configuration: output tokens/s and ITL/TTFT
//! p95 against concurrency (or offered rate, for open-loop sweeps), one
//! series per bucket, with the safe point and the knee marked; with repeats
//! of the search, error bars from the lowest to the highest repeat at each
//! probed level, and the safe point's range (over the repeats, or the
//! interval one search decided it within). Made from the profile alone,
//! like the reports.

use envelope_profile::{BucketResult, ConfigResult, ProbeSummary, Slo};
use plotters::prelude::*;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The x value of a probe: offered rate for open-loop probes, else concurrency.
fn x_of(p: &ProbeSummary) -> f64 {
    p.offered_rate_per_s.unwrap_or(p.concurrency as f64)
}

fn sorted(b: &BucketResult) -> Vec<&ProbeSummary> {
    let mut v: Vec<&ProbeSummary> = b.probes.iter().collect();
    v.sort_by(|a, b| x_of(a).total_cmp(&x_of(b)));
    v
}

/// The x value of the safe point.
fn safe_x(b: &BucketResult) -> f64 {
    b.safe_rate_per_s.unwrap_or(b.safe_concurrency as f64)
}

type Metric = fn(&ProbeSummary) -> f64;

/// With two or more repeats: at each level probed valid in at least two,
/// (x, lowest, mean, highest) of `metric` over them.
fn spread(b: &BucketResult, metric: Metric) -> Vec<(f64, f64, f64, f64)> {
    if b.repeats.len() < 2 {
        return vec![];
    }
    let mut by_x: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for r in &b.repeats {
        for p in r.probes.iter().filter(|p| p.valid) {
            by_x.entry(x_of(p).to_bits()).or_default().push(metric(p));
        }
    }
    by_x.into_iter()
        .filter(|(_, v)| v.len() >= 2)
        .map(|(x, v)| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (
                f64::from_bits(x),
                lo,
                v.iter().sum::<f64>() / v.len() as f64,
                hi,
            )
        })
        .collect()
}

fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    c: &ConfigResult,
    title: &str,
    y_label: &str,
    metric: Metric,
    x_label: &str,
    slo: Option<f64>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let repeats = c
        .buckets
        .iter()
        .flat_map(|b| b.repeats.iter().flat_map(|r| r.probes.iter()));
    let probes = c
        .buckets
        .iter()
        .flat_map(|b| b.probes.iter())
        .chain(repeats);
    let x_max = probes.clone().map(x_of).fold(1.0, f64::max) * 1.1;
    let y_max = probes.map(metric).fold(slo.unwrap_or(1e-9), f64::max) * 1.15;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(err)?;
    if let Some(limit) = slo {
        let red = RGBColor(200, 0, 0);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, limit), (x_max, limit)],
                3,
                3,
                red.stroke_width(1),
            ))
            .map_err(err)?;
        chart
            .draw_series(std::iter::once(Text::new(
                "SLO",
                (x_max * 0.9, limit),
                ("sans-serif", 11).into_font().color(&red),
            )))
            .map_err(err)?;
    }
    for (i, b) in c.buckets.iter().enumerate() {
        // A warm bucket: dashed, in the colour of the cold bucket of its
        // shape where the sweep has one, so the two read side by side.
        let shape = c.buckets.iter().position(|x| {
            x.is_cold() && (x.input_tokens, x.output_tokens) == (b.input_tokens, b.output_tokens)
        });
        let color = COLORS[shape.unwrap_or(i) % COLORS.len()];
        let pts = sorted(b);
        let line = pts.iter().map(|p| (x_of(p), metric(p)));
        let label = match &b.cached_prefix {
            None => b.label(),
            Some(p) if p.held => format!("{} warm", b.label()),
            Some(_) => format!("{} (cache did not hold: cold)", b.label()),
        };
        let drawn = if b.is_cold() {
            chart.draw_series(LineSeries::new(line, color.stroke_width(2)))
        } else {
            chart.draw_series(DashedLineSeries::new(line, 6, 4, color.stroke_width(2)))
        };
        drawn
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        // Probes inside the SLOs filled, breaches hollow.
        chart
            .draw_series(pts.iter().map(|p| {
                let style = if p.breaches.is_empty() {
                    color.filled()
                } else {
                    color.stroke_width(1)
                };
                Circle::new((x_of(p), metric(p)), 3, style)
            }))
            .map_err(err)?;
        // Repeats: how far the figure moved from one search to the next.
        chart
            .draw_series(spread(b, metric).into_iter().map(|(x, lo, mean, hi)| {
                ErrorBar::new_vertical(x, lo, mean, hi, color.stroke_width(1), 6)
            }))
            .map_err(err)?;
        // The safe point's range: over the repeats, or with one search the
        // interval its verdicts decided it within.
        let safe_range = b.repeats.iter().map(|r| r.safe_concurrency as f64);
        let range = if b.repeats.len() > 1 && b.safe_rate_per_s.is_none() {
            safe_range
                .clone()
                .reduce(f64::min)
                .zip(safe_range.reduce(f64::max))
        } else {
            b.safe_upper
                .filter(|u| *u > safe_x(b))
                .map(|u| (safe_x(b), u))
        };
        if let Some((lo, hi)) = range {
            let y = y_max * (0.93 - 0.05 * i as f64);
            chart
                .draw_series(std::iter::once(ErrorBar::new_horizontal(
                    y,
                    lo,
                    safe_x(b),
                    hi,
                    color.stroke_width(2),
                    6,
                )))
                .map_err(err)?;
        }
        // The safe point: a dashed vertical line in the bucket's colour.
        let sx = safe_x(b);
        if sx > 0.0 {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(sx, 0.0), (sx, y_max)],
                    6,
                    4,
                    color.stroke_width(1),
                ))
                .map_err(err)?;
            chart
                .draw_series(std::iter::once(Text::new(
                    "safe",
                    (sx, y_max * (0.97 - 0.05 * i as f64)),
                    ("sans-serif", 11).into_font().color(&color),
                )))
                .map_err(err)?;
        }
        if let Some(k) = b.knee_concurrency {
            if let Some(p) = pts.iter().find(|p| p.concurrency == k) {
                chart
                    .draw_series(std::iter::once(TriangleMarker::new(
                        (x_of(p), metric(p)),
                        7,
                        color.filled(),
                    )))
                    .map_err(err)?;
            }
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// One SVG for a configuration: throughput, ITL p95 and TTFT p95 panels
/// (the latency SLOs as red dotted lines).
pub fn config_svg(c: &ConfigResult, slo: &Slo) -> Result<String, String> {
    let open_loop = c
        .buckets
        .iter()
        .any(|b| b.probes.iter().any(|p| p.offered_rate_per_s.is_some()));
    let x_label = if open_loop {
        "offered rate (req/s)"
    } else {
        "concurrency (sequences)"
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, 400)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root
            .titled(
                &format!(
                    "{}: dashed = safe point, triangle = knee, hollow = SLO breach",
                    c.name
                ),
                ("sans-serif", 18),
            )
            .map_err(|e| e.to_string())?;
        let panels = root.split_evenly((1, 3));
        panel(
            &panels[0],
            c,
            "output throughput",
            "tokens/s",
            |p| p.output_tok_per_s,
            x_label,
            None,
        )?;
        let itl = |p: &ProbeSummary| p.itl_ms.p95;
        let ttft = |p: &ProbeSummary| p.ttft_ms.p95;
        panel(&panels[1], c, "ITL p95", "ms", itl, x_label, slo.itl_p95_ms)?;
        panel(
            &panels[2],
            c,
            "TTFT p95",
            "ms",
            ttft,
            x_label,
            slo.ttft_p95_ms,
        )?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// A scaled load searched after the buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scaled {
    /// `load.workload`: scale x the workload's rates.
    Workload,
    /// `[load.trace]`: the trace's arrivals, time-scaled.
    Trace,
}

impl Scaled {
    pub fn of(self, c: &ConfigResult) -> Option<&envelope_profile::WorkloadResult> {
        match self {
            Scaled::Workload => c.workload.as_ref(),
            Scaled::Trace => c.trace.as_ref(),
        }
    }

    /// `workload` or `trace`.
    pub fn word(self) -> &'static str {
        match self {
            Scaled::Workload => "workload",
            Scaled::Trace => "trace",
        }
    }

    /// What a scale of 2 means.
    pub fn unit(self) -> &'static str {
        match self {
            Scaled::Workload => "x the workload's rates",
            Scaled::Trace => "x the trace's arrival rate",
        }
    }
}

/// The saturation curve of a configuration's workload or trace search:
/// goodput (requests within the SLOs per second) against the scale, with
/// the safe scale, the knee and the collapse marked, and each class's e2e
/// p95; the recovery time in the title.
pub fn workload_svg(c: &ConfigResult, slo: &Slo, which: Scaled) -> Result<Option<String>, String> {
    let Some(w) = which.of(c) else {
        return Ok(None);
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 400)).into_drawing_area();
        let err = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
        root.fill(&WHITE).map_err(err)?;
        let recovery = match &w.recovery {
            Some(r) => match r.recovery_s {
                Some(t) => format!(
                    "; from scale {:.2} back to {:.2}, SLOs held again after {t:.1} s",
                    r.from_scale, r.to_scale
                ),
                None => format!(
                    "; from scale {:.2} back to {:.2}: not recovered within {:.0} s",
                    r.from_scale, r.to_scale, r.window_s
                ),
            },
            None => String::new(),
        };
        let root = root
            .titled(
                &format!(
                    "{} {} `{}`: dashed = safe, triangle = knee, cross = collapse{recovery}",
                    c.name,
                    which.word(),
                    w.name
                ),
                ("sans-serif", 15),
            )
            .map_err(err)?;
        let panels = root.split_evenly((1, 2));
        let x_max = w.probes.iter().map(|p| p.scale).fold(1.0, f64::max) * 1.1;
        let blue = COLORS[0];
        let good: Vec<(f64, f64, bool)> = w
            .probes
            .iter()
            .map(|p| {
                (
                    p.scale,
                    p.summary.goodput_req_per_s,
                    p.summary.breaches.is_empty(),
                )
            })
            .collect();
        let y_max = good.iter().map(|g| g.1).fold(1e-9, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&panels[0])
            .caption("goodput", ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(format!("scale ({})", which.unit()))
            .y_desc("requests within SLOs / s")
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new(
                good.iter().map(|g| (g.0, g.1)),
                blue.stroke_width(2),
            ))
            .map_err(err)?;
        chart
            .draw_series(good.iter().map(|&(x, y, ok)| {
                Circle::new(
                    (x, y),
                    3,
                    if ok {
                        blue.filled()
                    } else {
                        blue.stroke_width(1)
                    },
                )
            }))
            .map_err(err)?;
        if w.safe_scale > 0.0 {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(w.safe_scale, 0.0), (w.safe_scale, y_max)],
                    6,
                    4,
                    blue.stroke_width(1),
                ))
                .map_err(err)?;
        }
        let at = |s: f64| good.iter().find(|g| g.0 == s).map(|g| (g.0, g.1));
        if let Some(p) = w.knee_scale.and_then(at) {
            chart
                .draw_series(std::iter::once(TriangleMarker::new(
                    p,
                    7,
                    COLORS[2].filled(),
                )))
                .map_err(err)?;
        }
        if let Some(p) = w.collapse_scale.and_then(at) {
            chart
                .draw_series(std::iter::once(Cross::new(p, 7, COLORS[3].stroke_width(2))))
                .map_err(err)?;
        }
        // Each class's e2e p95, with the e2e SLO.
        let classes: Vec<&String> = w
            .probes
            .first()
            .map(|p| p.classes.keys().collect())
            .unwrap_or_default();
        let e2e = |p: &envelope_profile::WorkloadProbe, k: &str| {
            p.classes.get(k).map_or(0.0, |c| c.e2e_ms.p95)
        };
        let y_max = w
            .probes
            .iter()
            .flat_map(|p| classes.iter().map(move |k| e2e(p, k)))
            .fold(slo.e2e_p99_ms.unwrap_or(1e-9), f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(&panels[1])
            .caption("e2e p95 per class", ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("scale")
            .y_desc("ms")
            .draw()
            .map_err(err)?;
        if let Some(limit) = slo.e2e_p99_ms {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(0.0, limit), (x_max, limit)],
                    3,
                    3,
                    RGBColor(200, 0, 0).stroke_width(1),
                ))
                .map_err(err)?;
        }
        for (i, k) in classes.iter().enumerate() {
            let color = COLORS[(i + 1) % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    w.probes.iter().map(|p| (p.scale, e2e(p, k))),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(k.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(Some(svg))
}

/// The file name of a configuration's workload (or trace) plot.
pub fn workload_file_name(c: &ConfigResult, which: Scaled) -> String {
    file_name(c).replace(".svg", &format!("-{}.svg", which.word()))
}

/// The file name of a configuration's plot.
pub fn file_name(c: &ConfigResult) -> String {
    let safe: String = c
        .name
        .chars()
        .map(|ch| {
            if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' || ch == '.' {
                ch
            } else {
                '_'
            }
        })
        .collect();
    format!("plots/{safe}.svg")
}

#[cfg(test)]
mod tests {
    use super::*;
    use envelope_profile::{Constraint, MemoryReport, Percentiles};

    fn probe(c: u32, tok: f64, ok: bool) -> ProbeSummary {
        ProbeSummary {
            concurrency: c,
            requests: 8,
            warmup_requests: 0,
            errors: 0,
            refused: 0,
            duration_s: 1.0,
            ttft_ms: Percentiles {
                p95: 10.0 * c as f64,
                ..Default::default()
            },
            itl_ms: Percentiles {
                p95: 5.0 + c as f64,
                ..Default::default()
            },
            tpot_ms: Percentiles::default(),
            e2e_ms: Percentiles::default(),
            prefill_tok_per_s: 0.0,
            decode_tok_per_s: tok,
            output_tok_per_s: tok,
            total_tok_per_s: tok,
            request_per_s: 1.0,
            goodput_req_per_s: 1.0,
            offered_rate_per_s: None,
            kv_usage_max: None,
            preemptions: None,
            prefix_cache_hit_rate: None,
            peak_memory_bytes: None,
            breaches: if ok {
                vec![]
            } else {
                vec![Constraint::KvCache]
            },
            client_cpu_fraction: None,
            valid: true,
            error_reasons: Default::default(),
            slo_checks: vec![],
        }
    }

    /// Two buckets; with `repeats`, each has that many searches, the
    /// figures 10% apart from one to the next.
    fn config(repeats: u32) -> ConfigResult {
        let bucket = |i: u32| BucketResult {
            input_tokens: i,
            output_tokens: 16,
            feasible_concurrency: 4,
            infeasible_concurrency: Some(5),
            safe_concurrency: 3,
            binding_constraint: Constraint::KvCache,
            knee_concurrency: Some(2),
            at_feasible: None,
            feasible_rate_per_s: None,
            safe_rate_per_s: None,
            feasible_upper: None,
            safe_upper: None,
            cached_prefix: None,
            repeats: vec![],
            probes: vec![
                probe(1, 100.0, true),
                probe(2, 180.0, true),
                probe(4, 190.0, true),
                probe(8, 120.0, false),
            ],
        };
        let mut c = ConfigResult {
            name: "f32-f32-continuous".into(),
            precision: "f32".into(),
            kv_dtype: "f32".into(),
            batch_policy: "continuous".into(),
            max_num_seqs: 8,
            memory: MemoryReport::default(),
            backend: None,
            buckets: vec![bucket(32), bucket(64)],
            error: None,
            server_checks: None,
            time_to_ready_s: None,
            workload: None,
            trace: None,
        };
        for b in &mut c.buckets {
            b.repeats = (0..repeats)
                .map(|k| envelope_profile::BucketRepeat {
                    feasible_concurrency: 4,
                    safe_concurrency: 2 + k,
                    probes: b
                        .probes
                        .iter()
                        .map(|p| ProbeSummary {
                            output_tok_per_s: p.output_tok_per_s * (1.0 + 0.1 * k as f64),
                            ..p.clone()
                        })
                        .collect(),
                })
                .collect();
        }
        c
    }

    #[test]
    fn plots_carry_every_bucket_the_safe_point_and_the_knee() {
        let c = config(0);
        let slo = Slo {
            itl_p95_ms: Some(40.0),
            ..Slo::default()
        };
        let svg = config_svg(&c, &slo).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        for needle in [
            "32x16",
            "64x16",
            "safe",
            "concurrency (sequences)",
            "ITL p95",
            "SLO",
        ] {
            assert!(svg.contains(needle), "missing {needle}");
        }
        // Two knee triangles per panel (one per bucket), three panels.
        assert_eq!(svg.matches("<polygon").count(), 6);
        assert_eq!(file_name(&c), "plots/f32-f32-continuous.svg");
    }

    #[test]
    fn repeats_draw_error_bars_and_the_safe_range() {
        let slo = Slo {
            itl_p95_ms: Some(40.0),
            ..Slo::default()
        };
        let lines = |repeats: u32| {
            let svg = config_svg(&config(repeats), &slo).unwrap();
            svg.matches("<line").count() + svg.matches("<polyline").count()
        };
        // One repeat: nothing to spread. Three: a bar at each of the
        // three valid levels (1, 2, 4) of each bucket in each of the
        // three panels, and the safe point's range, each of three lines.
        assert_eq!(lines(1), lines(0));
        assert!(lines(3) > lines(0), "{} vs {}", lines(3), lines(0));
        // One search whose safe point was decided within [3, 5]: the
        // interval's bar, in each of the three panels.
        let mut c = config(0);
        for b in &mut c.buckets {
            b.safe_upper = Some(5.0);
        }
        let svg = config_svg(&c, &slo).unwrap();
        let with = svg.matches("<line").count() + svg.matches("<polyline").count();
        assert!(with > lines(0), "{with} vs {}", lines(0));
    }
}
