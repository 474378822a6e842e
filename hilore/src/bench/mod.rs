//! `hilore bench`: HiLoRe against the baselines on the same model, batches, seeds, tape
//! and kernels, under the same memory budget.
//!
//! Phases: (1) draw a GRPO-like step (the measured one) and a calibration step; (2)
//! profile one store-all pass (the simulator's record) and build the allocator; (3)
//! calibrate recompute / codec times and `kappa` on the calibration step; (4) plan every
//! policy; (5) run the policies interleaved (every microbatch of policy A, of B, ..., then
//! again), several repetitions; (6) optionally sweep the memory budget and the risk
//! target; (7) print the table, write JSON and SVG charts.

mod workload;

use crate::alloc;
use crate::common::human_bytes;
use crate::plot::{Chart, Scale, Series};
use anyhow::Context;
use candle_core::{DType, Device};
use clap::Args;
use hilore_models::baselines;
use hilore_models::{Decoder, DecoderConfig};
use hilore_runtime::allocator::{
    calibrate, risk::grad_error, Allocator, MemoryBudget, MicrobatchInput, Offer, PassResult,
    Runner, StateBytes, DEFAULT_TARGET_REL_L2,
};
use hilore_runtime::{Cx, Grads, MemoryEvent, Plan, TapeTimes};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;
use workload::{grpo_step, Microbatch, StepSpec};

#[derive(Args)]
pub struct BenchArgs {
    /// An HF `config.json` for the model (random weights). Default: the built-in benchmark
    /// decoder (4 layers, hidden 192, MLP 512, 6 query / 2 key-value heads of 32,
    /// vocabulary 1024: 2.0 M parameters).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// A built-in model size instead of --config: `2m` (the default benchmark decoder) or
    /// `10m` (6 layers, hidden 384, MLP 1024, 6 query / 2 key-value heads of 64: about
    /// 10 M parameters, where parameters, gradients and AdamW dominate the peak). Run
    /// once per size for a size sweep (scripts/bench-sizes.sh).
    #[arg(long, value_parser = ["2m", "10m"], conflicts_with = "config")]
    size: Option<String>,
    /// Rows (tokens) of every microbatch.
    #[arg(long, default_value_t = 896)]
    rows: usize,
    /// Prompts per GRPO step.
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// Responses per prompt.
    #[arg(long, default_value_t = 8)]
    group: usize,
    /// Interleaved repetitions of the main comparison (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seed of weights and batches.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Memory budget on the whole actor-update peak: a factor of full recompute's peak
    /// (`1.1`) or bytes (`300MiB`).
    #[arg(long, default_value = "1.1")]
    budget: String,
    /// Target relative L2 error of the step's gradient (sets the risk budget).
    #[arg(long, default_value_t = DEFAULT_TARGET_REL_L2)]
    target_rel_l2: f64,
    /// Codecs the allocators may use (default: those `hilore train --policy hilore`
    /// offers).
    #[arg(long, value_delimiter = ',', default_values = crate::train::HILORE_CODECS)]
    codecs: Vec<String>,
    /// Budget factors to sweep (e.g. `1.0,1.05,1.1,1.25,1.5,2`): a Pareto chart of
    /// throughput against memory for every policy.
    #[arg(long, value_delimiter = ',')]
    budgets: Vec<f64>,
    /// Risk targets (relative L2) to sweep for HiLoRe, its exposure-blind ablation and the
    /// Adacc-style policy at the main budget: time against measured gradient error.
    #[arg(long, value_delimiter = ',', default_value = "0.003,0.03")]
    risk_targets: Vec<f64>,
    /// Repetitions of each sweep point.
    #[arg(long, default_value_t = 1)]
    sweep_reps: usize,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write SVG charts into DIR.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Kind {
    StoreAll,
    Gc,
    Selective,
    BudgetedRecompute,
    CompressAll,
    AdaccStyle,
    Hilore,
    /// HiLoRe's planner with every microbatch at the step's mean exposure: an ablation
    /// (not a baseline) that separates what exposure buys from what the solver buys.
    HiloreBlind,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::StoreAll,
        Kind::Gc,
        Kind::Selective,
        Kind::BudgetedRecompute,
        Kind::CompressAll,
        Kind::AdaccStyle,
        Kind::Hilore,
        Kind::HiloreBlind,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::StoreAll => "store-all",
            Kind::Gc => "full-recompute (GC)",
            Kind::Selective => "selective (Megatron)",
            Kind::BudgetedRecompute => "budgeted-recompute",
            Kind::CompressAll => "compress-all (fp8)",
            Kind::AdaccStyle => "adacc-style",
            Kind::Hilore => "hilore",
            Kind::HiloreBlind => "hilore (exposure-blind)",
        }
    }

    fn budgeted(self) -> bool {
        matches!(
            self,
            Kind::Selective
                | Kind::BudgetedRecompute
                | Kind::AdaccStyle
                | Kind::Hilore
                | Kind::HiloreBlind
        )
    }

    /// The policies HiLoRe is compared with (not HiLoRe, not its ablation).
    fn baseline(self) -> bool {
        !matches!(self, Kind::Hilore | Kind::HiloreBlind)
    }

    fn of_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// Plans of one policy for every microbatch.
struct Planned {
    plans: Vec<Plan>,
    predicted_activation: Vec<usize>,
    predicted_risk: Vec<Option<f64>>,
    /// The cost model's recompute + encode + decode seconds of the step (knapsack
    /// policies only).
    predicted_overhead_seconds: Option<f64>,
    solve_seconds: f64,
    note: String,
}

struct Ctx<'a> {
    alloc: &'a Allocator,
    mbs: &'a [Microbatch],
    num_layers: usize,
    codecs: Vec<&'static str>,
}

impl Ctx<'_> {
    fn fixed(&self, plan: Plan) -> anyhow::Result<Planned> {
        let p = self.alloc.simulate_peak(&plan)?;
        Ok(Planned {
            plans: vec![plan; self.mbs.len()],
            predicted_activation: vec![p; self.mbs.len()],
            predicted_risk: vec![None; self.mbs.len()],
            predicted_overhead_seconds: None,
            solve_seconds: 0.0,
            note: String::new(),
        })
    }

    fn plan(&self, kind: Kind, total_budget: usize, target: f64) -> anyhow::Result<Planned> {
        let a = self.alloc;
        let inputs: Vec<_> = self.mbs.iter().map(|m| m.input).collect();
        let step_exposure: f64 = inputs.iter().map(|m| m.exposure).sum();
        // The exposure-blind policies plan every microbatch at the step's mean exposure.
        let mean = step_exposure / inputs.len() as f64;
        let exposures: Vec<f64> = inputs.iter().map(|m| m.exposure).collect();
        let risk_budget = a
            .risk
            .step_budget(target, &exposures)
            .unwrap_or(f64::INFINITY);
        let full = Offer {
            codecs: self.codecs.clone(),
            recompute: true,
            open_groups: true,
        };
        let t0 = Instant::now();
        let decisions = match kind {
            Kind::StoreAll => return self.fixed(baselines::store_all()),
            Kind::Gc => return self.fixed(baselines::gradient_checkpointing()),
            Kind::CompressAll => return self.fixed(baselines::compress_all()?),
            Kind::Selective => {
                let avail = a.activation_budget(total_budget).unwrap_or(0);
                let found = baselines::selective_recompute(a, self.num_layers, avail)?;
                let secs = t0.elapsed().as_secs_f64();
                let Some((plan, _)) = found else {
                    anyhow::bail!(
                        "not even full recompute fits the budget of {total_budget} bytes"
                    );
                };
                let note = plan.name().to_string();
                let mut out = self.fixed(plan)?;
                out.solve_seconds = secs;
                out.note = note;
                return Ok(out);
            }
            Kind::BudgetedRecompute => inputs
                .iter()
                .map(|mb| baselines::budgeted_recompute(a, mb, total_budget))
                .collect::<hilore_runtime::Result<Vec<_>>>()?,
            Kind::AdaccStyle => {
                // Equal shares whose squares add up to the step's budget (microbatch
                // risks add in quadrature), each planned at the mean exposure.
                let share = risk_budget / (inputs.len() as f64).sqrt();
                inputs
                    .iter()
                    .map(|mb| {
                        baselines::adacc_style(a, mb, total_budget, share, mean, &self.codecs)
                    })
                    .collect::<hilore_runtime::Result<Vec<_>>>()?
            }
            Kind::Hilore => a.plan_step(&inputs, total_budget, risk_budget, &full, None)?,
            Kind::HiloreBlind => {
                a.plan_step(&inputs, total_budget, risk_budget, &full, Some(mean))?
            }
        };
        let secs = t0.elapsed().as_secs_f64();
        // Instances per fidelity over the whole step (every microbatch's plan).
        let mut per_step: std::collections::BTreeMap<&str, usize> = Default::default();
        for (f, n) in decisions.iter().flat_map(|d| &d.counts) {
            *per_step.entry(f.as_str()).or_default() += n;
        }
        let note = per_step
            .iter()
            .map(|(f, n)| format!("{n} {f}"))
            .collect::<Vec<_>>()
            .join(", ");
        // The risk each plan carries on its real microbatch: the exposure-blind
        // policies planned with the mean exposure; risk is linear in exposure.
        let real_risk = |d: &hilore_runtime::allocator::Decision, mb: &MicrobatchInput| match kind {
            Kind::AdaccStyle | Kind::HiloreBlind if mean > 0.0 => {
                d.predicted_risk * mb.exposure / mean
            }
            _ => d.predicted_risk,
        };
        Ok(Planned {
            plans: decisions.iter().map(|d| d.plan.clone()).collect(),
            predicted_activation: decisions.iter().map(|d| d.predicted_peak_bytes).collect(),
            predicted_risk: decisions
                .iter()
                .zip(&inputs)
                .map(|(d, mb)| (kind != Kind::BudgetedRecompute).then(|| real_risk(d, mb)))
                .collect(),
            predicted_overhead_seconds: Some(decisions.iter().map(|d| d.predicted_seconds).sum()),
            solve_seconds: secs,
            note,
        })
    }
}

/// One measured pass.
struct Measured {
    seconds: f64,
    cpu_seconds: f64,
    forward: f64,
    times: TapeTimes,
    ledger_peak: usize,
    heap_peak: usize,
    grads: Option<Vec<f32>>,
    events: Option<Vec<MemoryEvent>>,
}

/// CPU seconds used by every thread of this process so far (Linux: the sum of
/// `/proc/self/task/*/schedstat`, nanosecond resolution; elsewhere `None`). On a machine
/// shared with other work, CPU time is far less disturbed than wall time.
fn process_cpu_seconds() -> Option<f64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(path) {
            total += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(total as f64 * 1e-9)
}

fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn run_pass(
    model: &Decoder,
    mb: &Microbatch,
    plan: &Plan,
    want_grads: bool,
    want_events: bool,
) -> anyhow::Result<Measured> {
    let base = alloc::reset_peak();
    let c0 = process_cpu_seconds();
    let t0 = Instant::now();
    let mut cx = Cx::new(plan.clone());
    let logp = model.token_logprobs(&mut cx, &mb.batch)?;
    let forward = t0.elapsed().as_secs_f64();
    let mut grads = Grads::new();
    cx.backward(&logp, &mb.coeff_tensor, &mut grads)?;
    let seconds = t0.elapsed().as_secs_f64();
    let cpu_seconds = match (c0, process_cpu_seconds()) {
        (Some(a), Some(b)) => b - a,
        _ => f64::NAN,
    };
    let heap_peak = alloc::peak().saturating_sub(base);
    let flat = if want_grads {
        Some(flatten(model, &grads)?)
    } else {
        None
    };
    Ok(Measured {
        seconds,
        cpu_seconds,
        forward,
        times: cx.times().clone(),
        ledger_peak: cx.memory().peak_bytes(),
        heap_peak,
        grads: flat,
        events: want_events.then(|| cx.memory().events().to_vec()),
    })
}

fn flatten(model: &Decoder, grads: &Grads) -> anyhow::Result<Vec<f32>> {
    let mut out = Vec::with_capacity(model.num_params());
    for (name, p) in model.named_params() {
        let g = grads
            .get(p.id())
            .with_context(|| format!("no gradient reached {name}"))?;
        out.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

struct CalRunner<'a> {
    model: &'a Decoder,
    mbs: &'a [Microbatch],
    bar: &'a ProgressBar,
}

impl Runner for CalRunner<'_> {
    fn run(&mut self, mb: usize, plan: &Plan) -> hilore_runtime::Result<PassResult> {
        let m = run_pass(self.model, &self.mbs[mb], plan, true, false)
            .map_err(|e| hilore_runtime::Error::Tape(format!("{e:#}")))?;
        self.bar.inc(1);
        Ok(PassResult {
            grads: m.grads.unwrap_or_default(),
            times: m.times,
            forward_seconds: m.forward,
        })
    }
}

#[derive(Serialize, Clone, Default)]
struct TimeSplit {
    forward: f64,
    backward: f64,
    recompute: f64,
    encode: f64,
    decode: f64,
    solve: f64,
}

/// One validation round of the risk budget on the held-out step.
#[derive(Serialize, Clone, Debug)]
struct RiskValidation {
    /// The risk budget scale it planned with.
    additivity_ratio: f64,
    /// The plan's predicted step risk (microbatch risks in quadrature).
    predicted_risk: f64,
    /// Measured gradient error norm of the step.
    measured_error: f64,
    /// The same relative to the exact step gradient.
    measured_rel_l2: f64,
}

/// One policy's results, as `--json` writes them.
#[derive(Serialize, Clone)]
struct PolicyRow {
    policy: String,
    /// The plan: its name, or unit instances per fidelity over the step's microbatches.
    plan: String,
    budget_factor: Option<f64>,
    tokens_per_s: f64,
    ratio_to_gc: f64,
    /// Tokens per CPU-second of this process (all threads): the same ranking, far less
    /// disturbed by other work on a shared machine.
    tokens_per_cpu_s: f64,
    cpu_ratio_to_gc: f64,
    step_cpu_seconds: Vec<f64>,
    step_seconds_median: f64,
    step_seconds: Vec<f64>,
    peak_total_bytes: usize,
    peak_activation_bytes: usize,
    peak_activation_ratio_to_gc: f64,
    budget_bytes: Option<usize>,
    fits_budget: Option<bool>,
    /// Total (state + ledger) peak the simulator predicted.
    predicted_peak_bytes: usize,
    predicted_peak_activation_bytes: usize,
    peak_matches_prediction: bool,
    process_peak_heap_bytes: usize,
    grad_cosine: f64,
    grad_rel_l2: f64,
    /// The allocator's predicted risk of the step: microbatch risks added in quadrature
    /// (None when not modelled).
    predicted_risk: Option<f64>,
    solve_seconds: f64,
    solve_fraction_of_step: f64,
    time_split_seconds: TimeSplit,
    /// The cost model's recompute + encode + decode seconds of the step, to set against
    /// the measured ones in `time_split_seconds` (knapsack policies only).
    predicted_overhead_seconds: Option<f64>,
    /// Measured gradient error norm per microbatch and the predicted risk.
    microbatch_errors: Vec<(f64, Option<f64>)>,
    /// Measured error norm of the step gradient (sum over microbatches).
    step_error: f64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

struct Exact {
    per_mb: Vec<Vec<f32>>,
    step: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn measure(
    model: &Decoder,
    mbs: &[Microbatch],
    policies: &[(Kind, Planned, Option<usize>, Option<f64>)],
    reps: usize,
    exact: &mut Option<Exact>,
    state: StateBytes,
    bar: &ProgressBar,
    events_of: &mut Vec<(String, Vec<MemoryEvent>)>,
) -> anyhow::Result<Vec<PolicyRow>> {
    let n = policies.len();
    let mut step_secs = vec![Vec::new(); n];
    let mut step_cpu = vec![Vec::new(); n];
    let mut splits = vec![Vec::<TimeSplit>::new(); n];
    let mut ledger = vec![0usize; n];
    let mut heap = vec![0usize; n];
    let mut matches = vec![true; n];
    let mut mb_errs: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut step_grads: Vec<Vec<f32>> = vec![Vec::new(); n];
    let building_exact = exact.is_none();
    if building_exact && policies.first().map(|p| p.0) != Some(Kind::StoreAll) {
        anyhow::bail!("the exact gradient needs the store-all policy first");
    }
    let mut exact_mb: Vec<Vec<f32>> = match exact {
        Some(e) => e.per_mb.clone(),
        None => Vec::with_capacity(mbs.len()),
    };
    // Interleaved per microbatch (A B C ... on microbatch 0, then on microbatch 1, ...),
    // so that a burst of other work on the machine hits every policy alike.
    for rep in 0..reps {
        let mut step = vec![0.0; n];
        let mut cpu = vec![0.0; n];
        let mut split: Vec<TimeSplit> = policies
            .iter()
            .map(|p| TimeSplit {
                solve: p.1.solve_seconds,
                ..Default::default()
            })
            .collect();
        for (m, mb) in mbs.iter().enumerate() {
            for (i, (kind, planned, _, _)) in policies.iter().enumerate() {
                let want_events =
                    rep == 0 && m == 0 && !events_of.iter().any(|e| e.0 == kind.name());
                let r = run_pass(model, mb, &planned.plans[m], rep == 0, want_events)?;
                bar.inc(1);
                step[i] += r.seconds;
                cpu[i] += r.cpu_seconds;
                let sp = &mut split[i];
                sp.forward += r.forward - r.times.encode.as_secs_f64();
                sp.encode += r.times.encode.as_secs_f64();
                sp.recompute += r.times.recompute.as_secs_f64();
                sp.decode += r.times.decode.as_secs_f64();
                sp.backward +=
                    (r.times.backward - r.times.recompute - r.times.decode).as_secs_f64();
                ledger[i] = ledger[i].max(r.ledger_peak);
                heap[i] = heap[i].max(r.heap_peak);
                matches[i] &= r.ledger_peak == planned.predicted_activation[m];
                if let Some(gr) = r.grads {
                    if building_exact && i == 0 {
                        exact_mb.push(gr.clone());
                    }
                    mb_errs[i].push(grad_error(&gr, &exact_mb[m]).0);
                    if step_grads[i].is_empty() {
                        step_grads[i] = gr;
                    } else {
                        for (s, v) in step_grads[i].iter_mut().zip(&gr) {
                            *s += v;
                        }
                    }
                }
                if let Some(ev) = r.events {
                    events_of.push((kind.name().to_string(), ev));
                }
            }
        }
        for i in 0..n {
            step_secs[i].push(step[i] + policies[i].1.solve_seconds);
            step_cpu[i].push(cpu[i] + policies[i].1.solve_seconds);
            splits[i].push(split[i].clone());
        }
        if rep == 0 && building_exact {
            *exact = Some(Exact {
                step: step_grads[0].clone(),
                per_mb: std::mem::take(&mut exact_mb),
            });
        }
    }
    let exact = exact.as_ref().context("no exact gradient")?;
    let rows_total: usize = mbs.iter().map(|m| m.batch.num_tokens()).sum();
    let mut out = Vec::with_capacity(n);
    for (i, (kind, planned, budget, factor)) in policies.iter().enumerate() {
        let (step_err, rel, cos) = grad_error(&step_grads[i], &exact.step);
        let mb_err: Vec<(f64, Option<f64>)> = mb_errs[i]
            .iter()
            .zip(&planned.predicted_risk)
            .map(|(e, r)| (*e, *r))
            .collect();
        let med = median(&step_secs[i]);
        let cpu_med = median(&step_cpu[i]);
        let pick = |f: fn(&TimeSplit) -> f64| median(&splits[i].iter().map(f).collect::<Vec<_>>());
        let pred = planned
            .predicted_activation
            .iter()
            .copied()
            .max()
            .unwrap_or(0);
        out.push(PolicyRow {
            policy: kind.name().to_string(),
            plan: planned.note.clone(),
            budget_factor: *factor,
            tokens_per_s: rows_total as f64 / med,
            ratio_to_gc: f64::NAN,
            tokens_per_cpu_s: rows_total as f64 / cpu_med,
            cpu_ratio_to_gc: f64::NAN,
            step_cpu_seconds: step_cpu[i].clone(),
            step_seconds_median: med,
            step_seconds: step_secs[i].clone(),
            peak_total_bytes: ledger[i] + state.total(),
            peak_activation_bytes: ledger[i],
            peak_activation_ratio_to_gc: f64::NAN,
            budget_bytes: *budget,
            fits_budget: budget.map(|b| ledger[i] + state.total() <= b),
            predicted_peak_bytes: pred + state.total(),
            predicted_peak_activation_bytes: pred,
            peak_matches_prediction: matches[i],
            process_peak_heap_bytes: heap[i],
            grad_cosine: cos,
            grad_rel_l2: rel,
            // Microbatch risks add in quadrature across the step.
            predicted_risk: planned
                .predicted_risk
                .iter()
                .map(|r| r.map(|r| r * r))
                .sum::<Option<f64>>()
                .map(f64::sqrt),
            solve_seconds: planned.solve_seconds,
            solve_fraction_of_step: planned.solve_seconds / med,
            time_split_seconds: TimeSplit {
                forward: pick(|s| s.forward),
                backward: pick(|s| s.backward),
                recompute: pick(|s| s.recompute),
                encode: pick(|s| s.encode),
                decode: pick(|s| s.decode),
                solve: planned.solve_seconds,
            },
            predicted_overhead_seconds: planned.predicted_overhead_seconds,
            microbatch_errors: mb_err,
            step_error: step_err,
        });
    }
    Ok(out)
}

fn set_ratios(rows: &mut [PolicyRow], gc: &PolicyRow) {
    for r in rows {
        r.ratio_to_gc = r.tokens_per_s / gc.tokens_per_s;
        r.cpu_ratio_to_gc = r.tokens_per_cpu_s / gc.tokens_per_cpu_s;
        r.peak_activation_ratio_to_gc =
            r.peak_activation_bytes as f64 / gc.peak_activation_bytes as f64;
    }
}

#[derive(Serialize)]
struct ConfigOut {
    model: DecoderConfig,
    params: usize,
    layers: usize,
    rows_per_microbatch: usize,
    microbatches: usize,
    sequences: usize,
    zero_advantage_sequences: usize,
    exposure_per_microbatch: Vec<f64>,
    sum_sq_lengths_per_microbatch: Vec<usize>,
    reps: usize,
    seed: u64,
    codecs: Vec<&'static str>,
    state_bytes: StateBytes,
    gc_peak_activation_bytes: usize,
    gc_peak_total_bytes: usize,
    gc_activation_share_of_total: f64,
    budget_bytes: usize,
    budget_factor: f64,
    target_rel_l2: f64,
    risk_budget: Option<f64>,
    /// Calibrated `||exact gradient|| / exposure` and measured/predicted error ratio.
    grad_norm_per_exposure: Option<f64>,
    risk_additivity_ratio: Option<f64>,
    /// Measured / predicted error (risks in quadrature) with every unit compressed (before validation).
    risk_additivity_ratio_all_compressed: Option<f64>,
    /// Validation rounds of the risk budget on a held-out step.
    risk_validation: Vec<RiskValidation>,
    calibration_passes: usize,
    calibration_seconds: f64,
    /// 1, 5 and 15 minute load averages at the start and the end of the run.
    load_average_start: Option<String>,
    load_average_end: Option<String>,
    cpus: usize,
}

#[derive(Serialize)]
struct Report {
    config: ConfigOut,
    policies: Vec<PolicyRow>,
    budget_sweep: Vec<PolicyRow>,
    risk_sweep: Vec<PolicyRow>,
    additivity: Additivity,
    acceptance: Acceptance,
    calibration: hilore_runtime::allocator::CalibrationReport,
}

#[derive(Serialize, Default)]
struct Additivity {
    /// (policy, predicted risk, measured error) per microbatch, every run.
    points: Vec<(String, f64, f64)>,
    /// Median of measured / predicted over points with predicted > 0.
    median_ratio: f64,
    /// Largest measured / predicted.
    max_ratio: f64,
    /// Pearson correlation of log predicted and log measured.
    log_correlation: f64,
    /// (policy, predicted step risk, measured step error norm) per run.
    step_points: Vec<(String, f64, f64)>,
}

#[derive(Serialize, Default)]
struct Acceptance {
    hilore_ratio_to_gc: f64,
    hilore_cpu_ratio_to_gc: f64,
    fastest_in_budget_baseline: String,
    hilore_ratio_to_fastest_in_budget_baseline: f64,
    fastest_in_budget_baseline_by_cpu: String,
    hilore_cpu_ratio_to_fastest_in_budget_baseline: f64,
    /// The same comparison among the baselines whose measured relative L2 gradient error
    /// also meets the fidelity target (the risk budget), wall clock and CPU time.
    fastest_on_target_baseline: String,
    hilore_ratio_to_fastest_on_target_baseline: f64,
    fastest_on_target_baseline_by_cpu: String,
    hilore_cpu_ratio_to_fastest_on_target_baseline: f64,
    /// The same among the in-budget baselines whose measured error is no larger than
    /// HiLoRe's own (a baseline that is faster only by being less exact is left out).
    fastest_as_exact_baseline: String,
    hilore_ratio_to_fastest_as_exact_baseline: f64,
    fastest_as_exact_baseline_by_cpu: String,
    hilore_cpu_ratio_to_fastest_as_exact_baseline: f64,
    /// Whether HiLoRe's own measured relative L2 error meets the target.
    hilore_meets_target: bool,
    hilore_grad_cosine: f64,
    every_budgeted_peak_within_budget: bool,
    every_budgeted_peak_equals_prediction: bool,
}

/// A planned policy: its kind, its plan, its budget in bytes and its budget factor.
type PlannedPolicy = (Kind, Planned, Option<usize>, Option<f64>);

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let t_start = Instant::now();
    let load_start = load_average();
    {
        use crate::common::{check_count, check_flag, Range};
        check_count(
            "--reps",
            args.reps,
            1,
            "the median of that many repetitions is reported",
        )?;
        check_count(
            "--sweep-reps",
            args.sweep_reps,
            1,
            "repetitions of each sweep point",
        )?;
        check_count("--rows", args.rows, 1, "rows (tokens) of every microbatch")?;
        check_count("--prompts", args.prompts, 1, "prompts of the GRPO step")?;
        check_count(
            "--group",
            args.group,
            2,
            "with one response per prompt every advantage is 0 and no microbatch has exposure",
        )?;
        check_flag(
            "--target-rel-l2",
            args.target_rel_l2,
            Range::Positive,
            "the gradient's relative L2 error to allow; 1e-2 is the default",
        )?;
        for &b in &args.budgets {
            check_flag(
                "--budgets",
                b,
                Range::Positive,
                "factors of full recompute's peak, e.g. 1,1.1,1.5",
            )?;
        }
        for &t in &args.risk_targets {
            check_flag(
                "--risk-targets",
                t,
                Range::Positive,
                "relative L2 errors, e.g. 0.003,0.03",
            )?;
        }
    }
    let device: Device = crate::common::device();
    let cfg = match (&args.config, args.size.as_deref()) {
        (Some(p), _) => crate::common::load_config(Some(p))?,
        (None, Some("10m")) => DecoderConfig {
            hidden_size: 384,
            intermediate_size: 1024,
            num_hidden_layers: 6,
            head_dim: 64,
            ..DecoderConfig::bench()
        },
        (None, _) => DecoderConfig::bench(),
    };
    let codecs: Vec<&'static str> = args
        .codecs
        .iter()
        .map(|c| hilore_kernels::codec_by_name(c).map(|c| c.name()))
        .collect::<Result<_, _>>()?;
    let budget: MemoryBudget = args.budget.parse()?;
    crate::common::check_activation_size(&cfg, args.rows, "--rows")?;
    let model = Decoder::random(&cfg, args.seed, &device)?;
    let spec = StepSpec {
        prompts: args.prompts,
        group: args.group,
        rows_per_microbatch: args.rows,
    };
    let mbs = grpo_step(&cfg, spec, args.seed.wrapping_add(1), &device)?;
    // Two calibration microbatches with different squared lengths and nonzero exposure,
    // from a separate step (redrawn with the next seed while none has any exposure).
    let mut cal_mbs: Vec<Microbatch> = Vec::new();
    // The first of those steps, whole: its exact gradient calibrates the step's
    // gradient norm against its microbatches' exposures.
    let mut norm_step: Vec<Microbatch> = Vec::new();
    for k in 0..32u64 {
        let step = grpo_step(&cfg, spec, args.seed.wrapping_add(1001 + k), &device)?;
        if norm_step.is_empty() && step.iter().any(|m| m.input.exposure > 0.0) {
            norm_step = step.clone();
        }
        cal_mbs.extend(step.into_iter().filter(|m| m.input.exposure > 0.0));
        if cal_mbs.len() >= 2 {
            break;
        }
    }
    cal_mbs.sort_by_key(|m| m.input.shape.sum_sq_lengths);
    let cal_mbs: Vec<Microbatch> = match cal_mbs.len() {
        0 => anyhow::bail!("32 calibration steps drew no microbatch with nonzero exposure"),
        1 => cal_mbs,
        n => vec![cal_mbs[0].clone(), cal_mbs[n - 1].clone()],
    };
    let state = StateBytes::adamw_f32(model.num_params());
    let quiet = args.quiet;
    let bar = |len: u64, msg: &str| {
        let b = ProgressBar::new(len);
        if quiet {
            b.set_draw_target(ProgressDrawTarget::hidden());
        }
        b.set_style(
            ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} passes, {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b.set_message(msg.to_string());
        b
    };
    eprintln!(
        "model: {} layers, hidden {}, MLP {}, {} params; {} microbatches of {} rows ({} sequences, {} with zero advantage)",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        model.num_params(),
        mbs.len(),
        args.rows,
        mbs.iter().map(|m| m.sequences).sum::<usize>(),
        mbs.iter().map(|m| m.zero_advantage_sequences).sum::<usize>(),
    );

    // Profile.
    let (profile, instances) = {
        let mut cx = Cx::new(Plan::store_all()).profiling(true);
        let logp = model.token_logprobs(&mut cx, &mbs[0].batch)?;
        let mut g = Grads::new();
        cx.backward(&logp, &mbs[0].coeff_tensor, &mut g)?;
        (cx.profile()?, cx.unit_instances())
    };
    let mut allocator = Allocator::new(profile, &instances, state, &codecs)?;

    // Calibrate.
    let t_cal = Instant::now();
    let recomputable = {
        let mut names: Vec<&str> = allocator.instances().iter().map(|b| b.unit).collect();
        names.sort();
        names.dedup();
        names
            .iter()
            .filter(|n| {
                allocator
                    .instances()
                    .iter()
                    .position(|b| b.unit == **n)
                    .is_some_and(|i| allocator.descriptor(i).deterministic)
            })
            .count()
    };
    let compressible = {
        let mut names: Vec<&str> = allocator
            .instances()
            .iter()
            .filter(|b| !b.own_act_elems.is_empty())
            .map(|b| b.unit)
            .collect();
        names.sort();
        names.dedup();
        names.len()
    };
    // Exact passes, compression passes (each also timing one recompute on the kappa
    // microbatch), the remaining recompute timings.
    let compress_passes = compressible * codecs.len();
    let cal_passes = cal_mbs.len() + compress_passes + recomputable * cal_mbs.len()
        - recomputable.min(compress_passes);
    let cal_bar = bar((cal_passes + 3 * norm_step.len()) as u64, "calibrating");
    let cal_inputs: Vec<_> = cal_mbs.iter().map(|m| m.input).collect();
    let cal_report = {
        let mut runner = CalRunner {
            model: &model,
            mbs: &cal_mbs,
            bar: &cal_bar,
        };
        calibrate(
            &mut allocator,
            &mut runner,
            &cal_inputs,
            cal_inputs.len() - 1,
            &codecs,
            &mut |_| {},
        )?
    };
    let gc_peak = allocator.simulate_peak(&baselines::gradient_checkpointing())?;
    let gc_total = gc_peak + state.total();
    let budget_bytes = budget.bytes(gc_total);
    // The gradient-norm scale of a whole held-out step (microbatch gradients partly
    // cancel: GRPO advantages are centred per group), instead of two microbatches'.
    let gamma_microbatches = allocator.risk.grad_norm_per_exposure;
    let rho_all_compressed = allocator.risk.additivity_ratio;
    let mut validation: Vec<RiskValidation> = Vec::new();
    {
        let mut runner = CalRunner {
            model: &model,
            mbs: &norm_step,
            bar: &cal_bar,
        };
        let mut run_step = |plans: &[Plan]| -> anyhow::Result<Vec<f64>> {
            let mut sum: Vec<f64> = Vec::new();
            for (m, plan) in plans.iter().enumerate() {
                let r = runner.run(m, plan)?;
                if sum.is_empty() {
                    sum = vec![0.0; r.grads.len()];
                }
                for (s, g) in sum.iter_mut().zip(&r.grads) {
                    *s += f64::from(*g);
                }
            }
            Ok(sum)
        };
        let exact = run_step(&vec![Plan::store_all(); norm_step.len()])?;
        let norm = exact.iter().map(|g| g * g).sum::<f64>().sqrt();
        let exposures: Vec<f64> = norm_step.iter().map(|m| m.input.exposure).collect();
        allocator.risk.calibrate_step_norm(norm, &exposures);
        // Validation on the held-out step: plan it at the main budget and target, measure
        // the step's gradient error, and tighten the risk budget when the measured error
        // exceeds the target (errors of different units are not quite independent, so the
        // quadrature sum can fall short for some plan mixes). It only tightens: the scale
        // calibrated with every unit compressed is the least it may be. Up to two rounds,
        // each correction clamped to [1, 4].
        let inputs: Vec<MicrobatchInput> = norm_step.iter().map(|m| m.input).collect();
        let offer = Offer {
            codecs: codecs.clone(),
            recompute: true,
            open_groups: true,
        };
        for _ in 0..2 {
            let Some(rb) = allocator.risk.step_budget(args.target_rel_l2, &exposures) else {
                break;
            };
            let ds = allocator.plan_step(&inputs, budget_bytes, rb, &offer, None)?;
            let predicted = ds
                .iter()
                .map(|d| d.predicted_risk * d.predicted_risk)
                .sum::<f64>()
                .sqrt();
            if predicted <= 0.0 {
                break;
            }
            let plans: Vec<Plan> = ds.iter().map(|d| d.plan.clone()).collect();
            let got = run_step(&plans)?;
            let err = got
                .iter()
                .zip(&exact)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f64>()
                .sqrt();
            let rho = allocator.risk.additivity_ratio.unwrap_or(1.0);
            validation.push(RiskValidation {
                additivity_ratio: rho,
                predicted_risk: predicted,
                measured_error: err,
                measured_rel_l2: err / norm,
            });
            let over = err / (args.target_rel_l2 * norm);
            if over <= 1.0 {
                break;
            }
            allocator.risk.additivity_ratio = Some(rho * over.min(4.0));
        }
    }
    cal_bar.finish_and_clear();
    let cal_seconds = t_cal.elapsed().as_secs_f64();
    eprintln!(
        "calibrated in {:.1} s ({} passes); measured / predicted error (risks in quadrature) with every unit compressed = {:.3}",
        cal_seconds,
        cal_report.passes + norm_step.len() * (1 + validation.len()),
        rho_all_compressed.unwrap_or(f64::NAN)
    );
    eprintln!(
        "gradient norm per unit of exposure (gamma): {:.4e} from a whole held-out step of {} microbatches ({:.4e} from the two calibration microbatches)",
        allocator.risk.grad_norm_per_exposure.unwrap_or(f64::NAN),
        norm_step.len(),
        gamma_microbatches.unwrap_or(f64::NAN)
    );
    for (k, v) in validation.iter().enumerate() {
        eprintln!(
            "risk validation {} on the held-out step: scale {:.3}, predicted risk {:.3e}, measured error {:.3e} (rel L2 {:.3e} for a target of {:.0e})",
            k + 1,
            v.additivity_ratio,
            v.predicted_risk,
            v.measured_error,
            v.measured_rel_l2,
            args.target_rel_l2
        );
    }
    eprintln!(
        "risk budget scale used: {:.3}",
        allocator.risk.additivity_ratio.unwrap_or(f64::NAN)
    );

    let ctx = Ctx {
        alloc: &allocator,
        mbs: &mbs,
        num_layers: cfg.num_hidden_layers,
        codecs: codecs.clone(),
    };
    let plan_all =
        |factor_budget: usize, target: f64, kinds: &[Kind]| -> anyhow::Result<Vec<PlannedPolicy>> {
            let mut v = Vec::new();
            for &k in kinds {
                match ctx.plan(k, factor_budget, target) {
                    Ok(p) => {
                        let (b, f) = if k.budgeted() {
                            (
                                Some(factor_budget),
                                Some(factor_budget as f64 / gc_total as f64),
                            )
                        } else {
                            (None, None)
                        };
                        v.push((k, p, b, f));
                    }
                    Err(e) => eprintln!("  {}: not planned: {e:#}", k.name()),
                }
            }
            Ok(v)
        };
    let policies = plan_all(budget_bytes, args.target_rel_l2, &Kind::ALL)?;
    let passes = (policies.len() * mbs.len() * args.reps) as u64;
    let main_bar = bar(passes, "policies");
    let mut exact = None;
    let mut events = Vec::new();
    let mut rows = measure(
        &model,
        &mbs,
        &policies,
        args.reps,
        &mut exact,
        state,
        &main_bar,
        &mut events,
    )?;
    main_bar.finish_and_clear();
    let gc_row = rows
        .iter()
        .find(|r| r.policy == Kind::Gc.name())
        .cloned()
        .context("GC was not measured")?;
    set_ratios(&mut rows, &gc_row);

    // A sweep phase: its policies after full recompute, measured interleaved; ratios to
    // the GC measured in the same phase are immune to the machine's load changing
    // between phases.
    let mut sweep_phase =
        |planned: Vec<PlannedPolicy>, label: &str| -> anyhow::Result<Vec<PolicyRow>> {
            let b = bar((planned.len() * mbs.len() * args.sweep_reps) as u64, label);
            let mut r = measure(
                &model,
                &mbs,
                &planned,
                args.sweep_reps,
                &mut exact,
                state,
                &b,
                &mut Vec::new(),
            )?;
            b.finish_and_clear();
            let gc = r.remove(0);
            set_ratios(&mut r, &gc);
            Ok(r)
        };
    // Budget sweep.
    let mut sweep = Vec::new();
    if !args.budgets.is_empty() {
        let kinds: Vec<Kind> = Kind::ALL.iter().copied().filter(|k| k.budgeted()).collect();
        let mut planned = plan_all(budget_bytes, args.target_rel_l2, &[Kind::Gc])?;
        for &f in &args.budgets {
            planned.extend(plan_all(
                (f * gc_total as f64) as usize,
                args.target_rel_l2,
                &kinds,
            )?);
        }
        sweep = sweep_phase(planned, "budget sweep")?;
    }
    // Risk sweep.
    let mut risk_sweep = Vec::new();
    if !args.risk_targets.is_empty() {
        let mut planned = plan_all(budget_bytes, args.target_rel_l2, &[Kind::Gc])?;
        for &t in &args.risk_targets {
            for mut p in plan_all(
                budget_bytes,
                t,
                &[Kind::AdaccStyle, Kind::Hilore, Kind::HiloreBlind],
            )? {
                p.1.note = format!("target {t:e}: {}", p.1.note);
                planned.push(p);
            }
        }
        risk_sweep = sweep_phase(planned, "risk sweep")?;
    }

    // Additivity.
    let mut add = Additivity::default();
    for r in rows.iter().chain(&sweep).chain(&risk_sweep) {
        for &(m, p) in &r.microbatch_errors {
            if let Some(p) = p {
                add.points.push((r.policy.clone(), p, m));
            }
        }
    }
    for r in rows.iter().chain(&sweep).chain(&risk_sweep) {
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

    // Acceptance figures.
    let hil = rows.iter().find(|r| r.policy == Kind::Hilore.name());
    let mut acc = Acceptance::default();
    if let Some(h) = hil {
        acc.hilore_ratio_to_gc = h.ratio_to_gc;
        acc.hilore_grad_cosine = h.grad_cosine;
        acc.hilore_cpu_ratio_to_gc = h.cpu_ratio_to_gc;
        acc.hilore_meets_target = h.grad_rel_l2 <= args.target_rel_l2;
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
        ) = fastest(wall, Some(args.target_rel_l2)).unwrap_or_default();
        (
            acc.fastest_on_target_baseline_by_cpu,
            acc.hilore_cpu_ratio_to_fastest_on_target_baseline,
        ) = fastest(cpu, Some(args.target_rel_l2)).unwrap_or_default();
        (
            acc.fastest_as_exact_baseline,
            acc.hilore_ratio_to_fastest_as_exact_baseline,
        ) = fastest(wall, Some(h.grad_rel_l2)).unwrap_or_default();
        (
            acc.fastest_as_exact_baseline_by_cpu,
            acc.hilore_cpu_ratio_to_fastest_as_exact_baseline,
        ) = fastest(cpu, Some(h.grad_rel_l2)).unwrap_or_default();
    }
    let budgeted = || {
        rows.iter()
            .chain(&sweep)
            .chain(&risk_sweep)
            .filter(|r| r.budget_bytes.is_some())
    };
    acc.every_budgeted_peak_within_budget = budgeted().all(|r| r.fits_budget == Some(true));
    acc.every_budgeted_peak_equals_prediction = budgeted().all(|r| r.peak_matches_prediction);

    let exposures: Vec<f64> = mbs.iter().map(|m| m.input.exposure).collect();
    let report = Report {
        config: ConfigOut {
            model: cfg.clone(),
            params: model.num_params(),
            layers: cfg.num_hidden_layers,
            rows_per_microbatch: args.rows,
            microbatches: mbs.len(),
            sequences: mbs.iter().map(|m| m.sequences).sum(),
            zero_advantage_sequences: mbs.iter().map(|m| m.zero_advantage_sequences).sum(),
            exposure_per_microbatch: mbs.iter().map(|m| m.input.exposure).collect(),
            sum_sq_lengths_per_microbatch: mbs
                .iter()
                .map(|m| m.input.shape.sum_sq_lengths)
                .collect(),
            reps: args.reps,
            seed: args.seed,
            codecs: codecs.clone(),
            state_bytes: state,
            gc_peak_activation_bytes: gc_peak,
            gc_peak_total_bytes: gc_total,
            gc_activation_share_of_total: gc_peak as f64 / gc_total as f64,
            budget_bytes,
            budget_factor: budget.factor(gc_total),
            target_rel_l2: args.target_rel_l2,
            risk_budget: allocator.risk.step_budget(args.target_rel_l2, &exposures),
            grad_norm_per_exposure: allocator.risk.grad_norm_per_exposure,
            risk_additivity_ratio: allocator.risk.additivity_ratio,
            risk_additivity_ratio_all_compressed: rho_all_compressed,
            risk_validation: validation.clone(),
            calibration_passes: cal_report.passes,
            calibration_seconds: cal_seconds,
            load_average_start: load_start,
            load_average_end: load_average(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
        policies: rows,
        budget_sweep: sweep,
        risk_sweep,
        additivity: add,
        acceptance: acc,
        calibration: cal_report,
    };
    print_report(&report);
    if let Some(path) = &args.json {
        hilore_models::atomic::write_bytes_atomic(
            path,
            serde_json::to_string_pretty(&report)?.as_bytes(),
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plot {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_plots(dir, &report, &events)?;
        eprintln!("charts written to {}", dir.display());
    }
    eprintln!("bench finished in {:.0} s", t_start.elapsed().as_secs_f64());
    Ok(ExitCode::SUCCESS)
}

fn print_report(r: &Report) {
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
        "{:<22} {:>9} {:>6} {:>11} {:>11} {:>6} {:>5} {:>10} {:>9} {:>9} {:>34}",
        "policy",
        "tok/s",
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
            "{:<22} {:>9.0} {:>6.3} {:>9.0} {:>6.3} {:>11} {:>11} {:>6.2} {:>5} {:>10} {:>9.6} {:>9.2e} {:>34}",
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

fn write_plots(
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
