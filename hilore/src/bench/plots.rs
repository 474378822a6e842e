//! The SVG charts of `--plot`.

use super::policies::Kind;
use super::report::Report;
use crate::plot::{Chart, Scale, Series};
use hilore_runtime::MemoryEvent;

pub(super) fn write_plots(
    dir: &std::path::Path,
    r: &Report,
    events: &[(String, Vec<MemoryEvent>)],
) -> anyhow::Result<()> {
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let budget = mib(r.config.budget_bytes);
    // Throughput against memory, one point per policy (wall clock and CPU time).
    for (file, label, cpu) in [
        (
            "throughput_vs_memory.svg",
            "tokens / s (median, wall clock)",
            false,
        ),
        (
            "throughput_vs_memory_cpu.svg",
            "tokens / CPU-second (median)",
            true,
        ),
    ] {
        let mut c = Chart::new(
            "actor-update throughput vs total peak memory",
            "total peak (MiB): params + grads + AdamW + ledger peak",
            label,
        );
        for p in &r.policies {
            let y = if cpu {
                p.tokens_per_cpu_s
            } else {
                p.tokens_per_s
            };
            c.series.push(Series::scatter(
                &p.policy,
                vec![(mib(p.peak_total_bytes), y)],
            ));
        }
        c.vlines
            .push((budget, format!("budget {:.2}x GC", r.config.budget_factor)));
        c.write(&dir.join(file))?;
    }
    // Memory timeline of the first microbatch per policy.
    let mut c = Chart::new(
        "ledger timeline of one microbatch",
        "event (unit closes in forward, decodes / recomputes / frees in backward)",
        "live ledger bytes (MiB)",
    );
    for (name, ev) in events {
        c.series.push(Series::plain_line(
            name,
            ev.iter()
                .enumerate()
                .map(|(i, e)| (i as f64, mib(e.live_bytes)))
                .collect(),
        ));
    }
    c.write(&dir.join("memory_timeline.svg"))?;
    // Predicted vs measured risk.
    let mut c = Chart::new(
        "gradient error: predicted risk vs measured (per microbatch)",
        "predicted risk (kappa x exposure, in quadrature)",
        "measured ||g - g_exact||",
    );
    let mut names: Vec<&str> = r.additivity.points.iter().map(|p| p.0.as_str()).collect();
    names.sort();
    names.dedup();
    for n in names {
        c.series.push(Series::scatter(
            n,
            r.additivity
                .points
                .iter()
                .filter(|p| p.0 == n && p.1 > 0.0 && p.2 > 0.0)
                .map(|p| (p.1, p.2))
                .collect(),
        ));
    }
    for n in [
        Kind::Hilore.name(),
        Kind::HiloreBlind.name(),
        Kind::AdaccStyle.name(),
    ] {
        c.series.push(Series::scatter(
            format!("step: {n}"),
            r.additivity
                .step_points
                .iter()
                .filter(|p| p.0 == n && p.1 > 0.0 && p.2 > 0.0)
                .map(|p| (p.1, p.2))
                .collect(),
        ));
    }
    c.diagonal = true;
    c.x_scale = Scale::Log;
    c.y_scale = Scale::Log;
    c.write(&dir.join("risk_predicted_vs_measured.svg"))?;
    // Pareto.
    if !r.budget_sweep.is_empty() {
        let mut c = Chart::new(
            "budget sweep: throughput vs measured total peak",
            "total peak / GC's total peak",
            "throughput / GC's (CPU time, same phase)",
        );
        let gc = r.config.gc_peak_total_bytes as f64;
        let mut names: Vec<&str> = r.budget_sweep.iter().map(|p| p.policy.as_str()).collect();
        names.dedup();
        names.sort();
        names.dedup();
        for n in names {
            let mut pts: Vec<(f64, f64)> = r
                .budget_sweep
                .iter()
                .filter(|p| p.policy == n && p.fits_budget == Some(true))
                .map(|p| (p.peak_total_bytes as f64 / gc, p.cpu_ratio_to_gc))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            c.series.push(Series::line(n, pts));
        }
        for p in &r.policies {
            if p.budget_bytes.is_none() {
                c.series.push(Series::scatter(
                    &p.policy,
                    vec![(p.peak_total_bytes as f64 / gc, p.cpu_ratio_to_gc)],
                ));
            }
        }
        c.write(&dir.join("pareto_budget_sweep.svg"))?;
    }
    if !r.risk_sweep.is_empty() {
        let mut c = Chart::new(
            "time vs measured gradient error at the main budget",
            "measured relative L2 error of the step gradient",
            "throughput / GC's (CPU time, same phase)",
        );
        for n in [
            Kind::Hilore.name(),
            Kind::HiloreBlind.name(),
            Kind::AdaccStyle.name(),
        ] {
            let mut pts: Vec<(f64, f64)> = r
                .risk_sweep
                .iter()
                .chain(&r.policies)
                .filter(|p| p.policy == n && p.grad_rel_l2 > 0.0)
                .map(|p| (p.grad_rel_l2, p.cpu_ratio_to_gc))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            c.series.push(Series::line(n, pts));
        }
        c.x_scale = Scale::Log;
        c.write(&dir.join("throughput_vs_grad_error.svg"))?;
    }
    Ok(())
}
