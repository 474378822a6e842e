//! The report: what `--json` writes and the table printed.

use super::measure::{median, PolicyRow, RiskValidation, UNSHARED_COMPRESS_ALL, UNSHARED_GC};
use super::policies::Kind;
use crate::common::human_bytes;
use hilore_models::DecoderConfig;
use hilore_runtime::allocator::StateBytes;
use serde::Serialize;

#[derive(Serialize)]
pub(super) struct ConfigOut {
    pub(super) model: DecoderConfig,
    pub(super) params: usize,
    pub(super) layers: usize,
    pub(super) rows_per_microbatch: usize,
    pub(super) shape: super::workload::StepShape,
    pub(super) shared_prefix: bool,
    pub(super) microbatches: usize,
    /// With shared prefixes: the microbatches of the same draw unshared (full recompute's
    /// reference row runs them).
    pub(super) unshared_microbatches: Option<usize>,
    /// Full recompute's ledger peak in the layout the policies run (with shared prefixes,
    /// `gc_peak_activation_bytes` is the unshared layout's: the budget's reference).
    pub(super) layout_gc_peak_activation_bytes: usize,
    pub(super) sequences: usize,
    pub(super) zero_advantage_sequences: usize,
    pub(super) exposure_per_microbatch: Vec<f64>,
    pub(super) sum_sq_lengths_per_microbatch: Vec<usize>,
    pub(super) reps: usize,
    pub(super) seed: u64,
    pub(super) codecs: Vec<&'static str>,
    pub(super) state_bytes: StateBytes,
    pub(super) gc_peak_activation_bytes: usize,
    pub(super) gc_peak_total_bytes: usize,
    pub(super) gc_activation_share_of_total: f64,
    pub(super) budget_bytes: usize,
    pub(super) budget_factor: f64,
    pub(super) target_rel_l2: f64,
    pub(super) risk_budget: Option<f64>,
    /// Calibrated `||exact gradient|| / exposure` and measured/predicted error ratio.
    pub(super) grad_norm_per_exposure: Option<f64>,
    pub(super) risk_additivity_ratio: Option<f64>,
    /// Measured / predicted error (risks in quadrature) with every unit compressed (before validation).
    pub(super) risk_additivity_ratio_all_compressed: Option<f64>,
    /// Validation rounds of the risk budget on a held-out step.
    pub(super) risk_validation: Vec<RiskValidation>,
    pub(super) calibration_passes: usize,
    pub(super) calibration_seconds: f64,
    /// 1, 5 and 15 minute load averages at the start and the end of the run.
    pub(super) load_average_start: Option<String>,
    pub(super) load_average_end: Option<String>,
    pub(super) cpus: usize,
}

#[derive(Serialize)]
pub(super) struct Report {
    pub(super) config: ConfigOut,
    pub(super) policies: Vec<PolicyRow>,
    pub(super) budget_sweep: Vec<PolicyRow>,
    pub(super) risk_sweep: Vec<PolicyRow>,
    pub(super) additivity: Additivity,
    pub(super) acceptance: Acceptance,
    pub(super) calibration: hilore_runtime::allocator::CalibrationReport,
}

#[derive(Serialize, Default)]
pub(super) struct Additivity {
    /// (policy, predicted risk, measured error) per microbatch, every run.
    pub(super) points: Vec<(String, f64, f64)>,
    /// Median of measured / predicted over points with predicted > 0.
    pub(super) median_ratio: f64,
    /// Largest measured / predicted.
    pub(super) max_ratio: f64,
    /// Pearson correlation of log predicted and log measured.
    pub(super) log_correlation: f64,
    /// (policy, predicted step risk, measured step error norm) per run.
    pub(super) step_points: Vec<(String, f64, f64)>,
}

#[derive(Serialize, Default)]
pub(super) struct Acceptance {
    pub(super) hilore_ratio_to_gc: f64,
    pub(super) hilore_cpu_ratio_to_gc: f64,
    pub(super) fastest_in_budget_baseline: String,
    pub(super) hilore_ratio_to_fastest_in_budget_baseline: f64,
    pub(super) fastest_in_budget_baseline_by_cpu: String,
    pub(super) hilore_cpu_ratio_to_fastest_in_budget_baseline: f64,
    /// The same comparison among the baselines whose measured relative L2 gradient error
    /// also meets the fidelity target (the risk budget), wall clock and CPU time.
    pub(super) fastest_on_target_baseline: String,
    pub(super) hilore_ratio_to_fastest_on_target_baseline: f64,
    pub(super) fastest_on_target_baseline_by_cpu: String,
    pub(super) hilore_cpu_ratio_to_fastest_on_target_baseline: f64,
    /// The same among the in-budget baselines whose measured error is no larger than
    /// HiLoRe's own (a baseline that is faster only by being less exact is left out).
    pub(super) fastest_as_exact_baseline: String,
    pub(super) hilore_ratio_to_fastest_as_exact_baseline: f64,
    pub(super) fastest_as_exact_baseline_by_cpu: String,
    pub(super) hilore_cpu_ratio_to_fastest_as_exact_baseline: f64,
    /// Whether HiLoRe's own measured relative L2 error meets the target.
    pub(super) hilore_meets_target: bool,
    pub(super) hilore_grad_cosine: f64,
    pub(super) every_budgeted_peak_within_budget: bool,
    pub(super) every_budgeted_peak_equals_prediction: bool,
    /// With shared prefixes: HiLoRe (on shared microbatches) against full recompute on the
    /// unshared microbatches of the same draw, measured interleaved in the same run; wall
    /// clock and CPU time (the inverse ratio of step times: the same sequences).
    pub(super) hilore_shared_ratio_to_unshared_gc: Option<f64>,
    pub(super) hilore_shared_cpu_ratio_to_unshared_gc: Option<f64>,
    /// The same for every policy on shared microbatches, by CPU time.
    pub(super) cpu_ratios_to_unshared_gc: Vec<(String, f64)>,
    /// Compress-all's measured step error (relative L2) on the shared microbatches over
    /// the same on the unshared ones: what holding a prompt once does to a codec's error
    /// (the exposure model counts the same coefficients in both layouts, so it predicts 1).
    pub(super) compress_all_error_shared_over_unshared: Option<f64>,
}

impl Additivity {
    /// Predicted risk against measured error over every measured run of `rows`, per
    /// microbatch and per step: the ratios' median and largest, and the correlation of
    /// their logarithms.
    pub(super) fn of_rows<'a>(rows: impl Iterator<Item = &'a PolicyRow> + Clone) -> Self {
        let mut add = Additivity::default();
        for r in rows.clone() {
            for &(m, p) in &r.microbatch_errors {
                if let Some(p) = p {
                    add.points.push((r.policy.clone(), p, m));
                }
            }
        }
        for r in rows.clone() {
            if let Some(p) = r.predicted_risk {
                add.step_points.push((r.policy.clone(), p, r.step_error));
            }
        }
        let ratios: Vec<f64> = add
            .points
            .iter()
            .filter(|p| p.1 > 0.0)
            .map(|p| p.2 / p.1)
            .collect();
        add.median_ratio = median(&ratios);
        add.max_ratio = ratios.iter().copied().fold(0.0, f64::max);
        {
            let v: Vec<(f64, f64)> = add
                .points
                .iter()
                .filter(|p| p.1 > 0.0 && p.2 > 0.0)
                .map(|p| (p.1.ln(), p.2.ln()))
                .collect();
            let n = v.len() as f64;
            if n > 2.0 {
                let mx = v.iter().map(|p| p.0).sum::<f64>() / n;
                let my = v.iter().map(|p| p.1).sum::<f64>() / n;
                let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
                for (x, y) in &v {
                    sxy += (x - mx) * (y - my);
                    sxx += (x - mx).powi(2);
                    syy += (y - my).powi(2);
                }
                add.log_correlation = sxy / (sxx * syy).sqrt();
            }
        }
        add
    }
}

impl Acceptance {
    /// The acceptance figures of the main table `rows` (HiLoRe against GC and against the
    /// fastest in-budget baselines: by wall and CPU time, at any error, on target, and as
    /// exact as HiLoRe) and whether every budgeted run of `all` kept its budget and its
    /// predicted peak.
    pub(super) fn of<'a>(
        rows: &[PolicyRow],
        all: impl Iterator<Item = &'a PolicyRow> + Clone,
        budget_bytes: usize,
        target_rel_l2: f64,
    ) -> Self {
        let hil = rows.iter().find(|r| r.policy == Kind::Hilore.name());
        let mut acc = Acceptance::default();
        if let Some(h) = hil {
            acc.hilore_ratio_to_gc = h.ratio_to_gc;
            acc.hilore_grad_cosine = h.grad_cosine;
            acc.hilore_cpu_ratio_to_gc = h.cpu_ratio_to_gc;
            acc.hilore_meets_target = h.grad_rel_l2 <= target_rel_l2;
            // The fastest baseline whose measured peak is within the memory budget (and, with
            // `on_target`, whose measured gradient error also meets the fidelity target).
            let fastest = |speed: fn(&PolicyRow) -> f64, max_error: Option<f64>| {
                rows.iter()
                    .filter(|r| Kind::of_name(&r.policy).is_some_and(Kind::baseline))
                    .filter(|r| r.peak_total_bytes <= budget_bytes)
                    .filter(|r| max_error.is_none_or(|e| r.grad_rel_l2 <= e))
                    .max_by(|a, b| speed(a).total_cmp(&speed(b)))
                    .map(|b| (b.policy.clone(), speed(h) / speed(b)))
            };
            let wall: fn(&PolicyRow) -> f64 = |r| r.tokens_per_s;
            let cpu: fn(&PolicyRow) -> f64 = |r| r.tokens_per_cpu_s;
            // None (no baseline fits) leaves the defaults: no name, ratio 0.
            (
                acc.fastest_in_budget_baseline,
                acc.hilore_ratio_to_fastest_in_budget_baseline,
            ) = fastest(wall, None).unwrap_or_default();
            (
                acc.fastest_in_budget_baseline_by_cpu,
                acc.hilore_cpu_ratio_to_fastest_in_budget_baseline,
            ) = fastest(cpu, None).unwrap_or_default();
            (
                acc.fastest_on_target_baseline,
                acc.hilore_ratio_to_fastest_on_target_baseline,
            ) = fastest(wall, Some(target_rel_l2)).unwrap_or_default();
            (
                acc.fastest_on_target_baseline_by_cpu,
                acc.hilore_cpu_ratio_to_fastest_on_target_baseline,
            ) = fastest(cpu, Some(target_rel_l2)).unwrap_or_default();
            (
                acc.fastest_as_exact_baseline,
                acc.hilore_ratio_to_fastest_as_exact_baseline,
            ) = fastest(wall, Some(h.grad_rel_l2)).unwrap_or_default();
            (
                acc.fastest_as_exact_baseline_by_cpu,
                acc.hilore_cpu_ratio_to_fastest_as_exact_baseline,
            ) = fastest(cpu, Some(h.grad_rel_l2)).unwrap_or_default();
        }
        if let Some(u) = rows.iter().find(|r| r.policy == UNSHARED_GC) {
            if let Some(h) = hil {
                acc.hilore_shared_ratio_to_unshared_gc = Some(h.tokens_per_s / u.tokens_per_s);
                acc.hilore_shared_cpu_ratio_to_unshared_gc =
                    Some(h.tokens_per_cpu_s / u.tokens_per_cpu_s);
            }
            acc.cpu_ratios_to_unshared_gc = rows
                .iter()
                .filter(|r| Kind::of_name(&r.policy).is_some())
                .map(|r| (r.policy.clone(), r.tokens_per_cpu_s / u.tokens_per_cpu_s))
                .collect();
        }
        let rel = |name: &str| {
            rows.iter()
                .find(|r| r.policy == name)
                .map(|r| r.grad_rel_l2)
        };
        if let (Some(s), Some(u)) = (rel(Kind::CompressAll.name()), rel(UNSHARED_COMPRESS_ALL)) {
            // None where the draw has no exposure (both errors 0).
            acc.compress_all_error_shared_over_unshared = (u > 0.0).then(|| s / u);
        }
        let budgeted = || all.clone().filter(|r| r.budget_bytes.is_some());
        acc.every_budgeted_peak_within_budget = budgeted().all(|r| r.fits_budget == Some(true));
        acc.every_budgeted_peak_equals_prediction = budgeted().all(|r| r.peak_matches_prediction);
        acc
    }
}

pub(super) fn print_report(r: &Report) {
    let c = &r.config;
    println!(
        "fixed state {} (params {}, grads {}, AdamW {}); GC ledger peak {} = {:.1}% of GC's total {}; budget {} ({:.3}x GC)",
        human_bytes(c.state_bytes.total()),
        human_bytes(c.state_bytes.params),
        human_bytes(c.state_bytes.grads),
        human_bytes(c.state_bytes.optimizer),
        human_bytes(c.gc_peak_activation_bytes),
        100.0 * c.gc_activation_share_of_total,
        human_bytes(c.gc_peak_total_bytes),
        human_bytes(c.budget_bytes),
        c.budget_factor
    );
    println!(
        "{:<24} {:>9} {:>6} {:>9} {:>6} {:>11} {:>11} {:>6} {:>5} {:>10} {:>9} {:>9} {:>34}",
        "policy",
        "tok/s",
        "xGC",
        "tok/cpu-s",
        "xGC",
        "peak total",
        "peak act",
        "actxGC",
        "fits",
        "heap",
        "cosine",
        "rel L2",
        "fwd/bwd/rc/enc/dec/solve s"
    );
    for p in &r.policies {
        let t = &p.time_split_seconds;
        println!(
            "{:<24} {:>9.0} {:>6.3} {:>9.0} {:>6.3} {:>11} {:>11} {:>6.2} {:>5} {:>10} {:>9.6} {:>9.2e} {:>34}",
            p.policy,
            p.tokens_per_s,
            p.ratio_to_gc,
            p.tokens_per_cpu_s,
            p.cpu_ratio_to_gc,
            human_bytes(p.peak_total_bytes),
            human_bytes(p.peak_activation_bytes),
            p.peak_activation_ratio_to_gc,
            match p.fits_budget {
                Some(true) => "yes",
                Some(false) => "NO",
                None =>
                    if p.peak_total_bytes <= c.budget_bytes {
                        "(yes)"
                    } else {
                        "(no)"
                    },
            },
            human_bytes(p.process_peak_heap_bytes),
            p.grad_cosine,
            p.grad_rel_l2,
            format!(
                "{:.2}/{:.2}/{:.2}/{:.2}/{:.2}/{:.3}",
                t.forward, t.backward, t.recompute, t.encode, t.decode, t.solve
            )
        );
    }
    println!("plans (unit instances per step, every microbatch; overhead = recompute + encode + decode s, predicted by the cost model / measured):");
    for p in &r.policies {
        if !p.plan.is_empty() {
            let t = &p.time_split_seconds;
            let overhead = match p.predicted_overhead_seconds {
                Some(o) => format!(
                    " [overhead {o:.2} / {:.2} s]",
                    t.recompute + t.encode + t.decode
                ),
                None => String::new(),
            };
            println!("  {}: {}{overhead}", p.policy, p.plan);
        }
    }
    let a = &r.acceptance;
    println!(
        "load average {} -> {} on {} CPUs",
        c.load_average_start.as_deref().unwrap_or("?"),
        c.load_average_end.as_deref().unwrap_or("?"),
        c.cpus
    );
    println!(
        "hilore: wall {:.3}x GC, {:.3}x the fastest in-budget baseline ({}); CPU time {:.3}x GC, {:.3}x the fastest in-budget baseline ({}); gradient cosine {:.6}; budgeted peaks within budget: {}; equal to the prediction byte for byte: {}",
        a.hilore_ratio_to_gc,
        a.hilore_ratio_to_fastest_in_budget_baseline,
        a.fastest_in_budget_baseline,
        a.hilore_cpu_ratio_to_gc,
        a.hilore_cpu_ratio_to_fastest_in_budget_baseline,
        a.fastest_in_budget_baseline_by_cpu,
        a.hilore_grad_cosine,
        a.every_budgeted_peak_within_budget,
        a.every_budgeted_peak_equals_prediction
    );
    println!(
        "among the baselines whose measured error also meets the {:.0e} target: hilore wall {:.3}x the fastest ({}), CPU time {:.3}x the fastest ({}); hilore's own error meets it: {}",
        c.target_rel_l2,
        a.hilore_ratio_to_fastest_on_target_baseline,
        a.fastest_on_target_baseline,
        a.hilore_cpu_ratio_to_fastest_on_target_baseline,
        a.fastest_on_target_baseline_by_cpu,
        a.hilore_meets_target
    );
    println!(
        "among the in-budget baselines whose measured error is no larger than hilore's own: hilore wall {:.3}x the fastest ({}), CPU time {:.3}x the fastest ({})",
        a.hilore_ratio_to_fastest_as_exact_baseline,
        a.fastest_as_exact_baseline,
        a.hilore_cpu_ratio_to_fastest_as_exact_baseline,
        a.fastest_as_exact_baseline_by_cpu
    );
    if let (Some(w), Some(cpu)) = (
        a.hilore_shared_ratio_to_unshared_gc,
        a.hilore_shared_cpu_ratio_to_unshared_gc,
    ) {
        println!(
            "with shared prefixes ({} microbatches; {} unshared): hilore wall {w:.3}x, CPU time {cpu:.3}x full recompute on the unshared microbatches, measured in this run; every policy by CPU time: {}",
            c.microbatches,
            c.unshared_microbatches.unwrap_or(0),
            a.cpu_ratios_to_unshared_gc
                .iter()
                .map(|(p, r)| format!("{p} {r:.3}x"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some(e) = a.compress_all_error_shared_over_unshared {
            println!("compress-all's gradient error with shared prefixes / without: {e:.3}");
        }
    }
    println!(
        "risk additivity: measured/predicted median {:.3}, max {:.3}, log-correlation {:.3} over {} microbatch runs",
        r.additivity.median_ratio,
        r.additivity.max_ratio,
        r.additivity.log_correlation,
        r.additivity.points.len()
    );
    println!(
        "{:<22} {:>14} {:>14} {:>8}",
        "step (policy)", "predicted risk", "measured err", "ratio"
    );
    for (p, pred, meas) in &r.additivity.step_points {
        println!(
            "{p:<22} {pred:>14.4e} {meas:>14.4e} {:>8.3}",
            meas / pred.max(1e-300)
        );
    }
    for (title, rows) in [
        ("budget sweep", &r.budget_sweep),
        ("risk sweep", &r.risk_sweep),
    ] {
        if rows.is_empty() {
            continue;
        }
        println!("{title}:");
        for p in rows.iter() {
            println!(
                "  {:<22} budget {:>5.3}x  {:>8.0} tok/s ({:.3}x GC)  {:>8.0} tok/cpu-s ({:.3}x GC)  peak {:>11}  fits {:<5}  rel L2 {:.2e}  {}",
                p.policy,
                p.budget_factor.unwrap_or(f64::NAN),
                p.tokens_per_s,
                p.ratio_to_gc,
                p.tokens_per_cpu_s,
                p.cpu_ratio_to_gc,
                human_bytes(p.peak_total_bytes),
                p.fits_budget.unwrap_or(false),
                p.grad_rel_l2,
                p.plan
            );
        }
    }
}
