//! Measuring the planned policies: interleaved passes, wall and CPU time, the ledger's and
//! the heap's peaks, gradients against the exact ones.

use super::policies::{Kind, Planned};
use super::workload::Microbatch;
use crate::alloc;
use anyhow::Context;
use candle_core::DType;
use hilore_models::Decoder;
use hilore_runtime::allocator::{
    risk::grad_error, Allocator, MicrobatchInput, Offer, PassResult, ProfileKey, StateBytes,
    Workload,
};
use hilore_runtime::{Cx, Grads, MemoryEvent, Plan, TapeTimes, UnitInstanceInfo};
use indicatif::ProgressBar;
use serde::Serialize;
use std::time::Instant;

/// One measured pass.
pub(super) struct Measured {
    pub(super) seconds: f64,
    pub(super) cpu_seconds: f64,
    pub(super) forward: f64,
    pub(super) times: TapeTimes,
    pub(super) ledger_peak: usize,
    pub(super) heap_peak: usize,
    pub(super) grads: Option<Vec<f32>>,
    pub(super) events: Option<Vec<MemoryEvent>>,
}

/// CPU seconds used by every thread of this process so far (Linux: the sum of
/// `/proc/self/task/*/schedstat`, nanosecond resolution; elsewhere `None`). On a machine
/// shared with other work, CPU time is far less disturbed than wall time.
pub(super) fn process_cpu_seconds() -> Option<f64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(path) {
            total += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(total as f64 * 1e-9)
}

pub(super) fn load_average() -> Option<String> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

pub(super) fn run_pass(
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

pub(super) fn flatten(model: &Decoder, grads: &Grads) -> anyhow::Result<Vec<f32>> {
    let mut out = Vec::with_capacity(model.num_params());
    for (name, p) in model.named_params() {
        let g = grads
            .get(p.id())
            .with_context(|| format!("no gradient reached {name}"))?;
        out.extend(g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
    }
    Ok(out)
}

/// The benchmark's microbatches as the allocator's [`Workload`] (calibration and the
/// step-norm validation run through it), each pass ticking `bar`.
pub(super) struct BenchWorkload<'a> {
    pub(super) model: &'a Decoder,
    pub(super) mbs: &'a [Microbatch],
    pub(super) bar: &'a ProgressBar,
}

impl Workload for BenchWorkload<'_> {
    fn len(&self) -> usize {
        self.mbs.len()
    }

    fn input(&self, i: usize) -> MicrobatchInput {
        self.mbs[i].input
    }

    fn profile(
        &mut self,
        i: usize,
    ) -> hilore_runtime::Result<(hilore_runtime::Profile, Vec<UnitInstanceInfo>)> {
        let mb = &self.mbs[i];
        let mut cx = Cx::new(Plan::store_all()).profiling(true);
        let logp = self.model.token_logprobs(&mut cx, &mb.batch)?;
        let mut g = Grads::new();
        cx.backward(&logp, &mb.coeff_tensor, &mut g)?;
        Ok((cx.profile()?, cx.unit_instances()))
    }

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
pub(super) struct TimeSplit {
    pub(super) forward: f64,
    pub(super) backward: f64,
    pub(super) recompute: f64,
    pub(super) encode: f64,
    pub(super) decode: f64,
    pub(super) solve: f64,
}

/// One validation round of the risk budget on the held-out step.
#[derive(Serialize, Clone, Debug)]
pub(super) struct RiskValidation {
    /// The risk budget scale it planned with.
    pub(super) additivity_ratio: f64,
    /// The plan's predicted step risk (microbatch risks in quadrature).
    pub(super) predicted_risk: f64,
    /// Measured gradient error norm of the step.
    pub(super) measured_error: f64,
    /// The same relative to the exact step gradient.
    pub(super) measured_rel_l2: f64,
}

/// One policy's results, as `--json` writes them.
#[derive(Serialize, Clone)]
pub(super) struct PolicyRow {
    pub(super) policy: String,
    /// The plan: its name, or unit instances per fidelity over the step's microbatches.
    pub(super) plan: String,
    pub(super) budget_factor: Option<f64>,
    pub(super) tokens_per_s: f64,
    pub(super) ratio_to_gc: f64,
    /// Tokens per CPU-second of this process (all threads): the same ranking, far less
    /// disturbed by other work on a shared machine.
    pub(super) tokens_per_cpu_s: f64,
    pub(super) cpu_ratio_to_gc: f64,
    pub(super) step_cpu_seconds: Vec<f64>,
    pub(super) step_seconds_median: f64,
    pub(super) step_seconds: Vec<f64>,
    pub(super) peak_total_bytes: usize,
    pub(super) peak_activation_bytes: usize,
    pub(super) peak_activation_ratio_to_gc: f64,
    pub(super) budget_bytes: Option<usize>,
    pub(super) fits_budget: Option<bool>,
    /// Total (state + ledger) peak the simulator predicted.
    pub(super) predicted_peak_bytes: usize,
    pub(super) predicted_peak_activation_bytes: usize,
    pub(super) peak_matches_prediction: bool,
    pub(super) process_peak_heap_bytes: usize,
    pub(super) grad_cosine: f64,
    pub(super) grad_rel_l2: f64,
    /// The allocator's predicted risk of the step: microbatch risks added in quadrature
    /// (None when not modelled).
    pub(super) predicted_risk: Option<f64>,
    pub(super) solve_seconds: f64,
    pub(super) solve_fraction_of_step: f64,
    pub(super) time_split_seconds: TimeSplit,
    /// The cost model's recompute + encode + decode seconds of the step, to set against
    /// the measured ones in `time_split_seconds` (knapsack policies only).
    pub(super) predicted_overhead_seconds: Option<f64>,
    /// Measured gradient error norm per microbatch and the predicted risk.
    pub(super) microbatch_errors: Vec<(f64, Option<f64>)>,
    /// Measured error norm of the step gradient (sum over microbatches).
    pub(super) step_error: f64,
}

pub(super) fn median(v: &[f64]) -> f64 {
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

pub(super) struct Exact {
    pub(super) per_mb: Vec<Vec<f32>>,
    pub(super) step: Vec<f32>,
}

/// The measured step's draw packed without shared prefixes, when the policies run
/// shared-prefix microbatches (`hilore bench --shared-prefix`), and the policies run on
/// it interleaved with them: full recompute, the reference of the shared layout's
/// speed-up, and compress-all, whose step error set against compress-all's on the shared
/// microbatches measures what holding a prompt once does to the error a codec causes.
pub(super) struct UnsharedReference<'a> {
    pub(super) mbs: &'a [Microbatch],
    /// Row name and plans.
    pub(super) arms: Vec<(&'static str, Planned)>,
}

/// The rows of [`UnsharedReference`]'s policies.
pub(super) const UNSHARED_GC: &str = "full-recompute, unshared";
pub(super) const UNSHARED_COMPRESS_ALL: &str = "compress-all (fp8), unshared";

/// Measures `policies` on `mbs` (and `reference`'s on its microbatches), `reps` times,
/// interleaved per microbatch index. Every row's throughput counts the rows of `mbs`
/// (with shared prefixes, the rows its sequences have unshared), so that throughputs
/// compare as the inverse step times of the same sequences.
#[allow(clippy::too_many_arguments)]
pub(super) fn measure(
    model: &Decoder,
    mbs: &[Microbatch],
    policies: &[(Kind, Planned, Option<usize>, Option<f64>)],
    reference: Option<&UnsharedReference<'_>>,
    reps: usize,
    exact: &mut Option<Exact>,
    state: StateBytes,
    bar: &ProgressBar,
    events_of: &mut Vec<(String, Vec<MemoryEvent>)>,
) -> anyhow::Result<Vec<PolicyRow>> {
    // Arm i: its name, plans, microbatches and budget; the reference's last.
    struct ArmOf<'a> {
        name: &'a str,
        planned: &'a Planned,
        mbs: &'a [Microbatch],
        budget: Option<usize>,
        factor: Option<f64>,
        /// Whether it runs `mbs`, whose exact per-microbatch gradients it is held to.
        main_layout: bool,
    }
    let mut arms: Vec<ArmOf<'_>> = policies
        .iter()
        .map(|(kind, planned, budget, factor)| ArmOf {
            name: kind.name(),
            planned,
            mbs,
            budget: *budget,
            factor: *factor,
            main_layout: true,
        })
        .collect();
    if let Some(r) = reference {
        for (name, planned) in &r.arms {
            arms.push(ArmOf {
                name,
                planned,
                mbs: r.mbs,
                budget: None,
                factor: None,
                main_layout: false,
            });
        }
    }
    let n = arms.len();
    let longest = arms.iter().map(|a| a.mbs.len()).max().unwrap_or(0);
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
        let mut split: Vec<TimeSplit> = arms
            .iter()
            .map(|a| TimeSplit {
                solve: a.planned.solve_seconds,
                ..Default::default()
            })
            .collect();
        for m in 0..longest {
            for (i, arm) in arms.iter().enumerate() {
                let Some(mb) = arm.mbs.get(m) else { continue };
                let planned = arm.planned;
                let want_events = rep == 0 && m == 0 && !events_of.iter().any(|e| e.0 == arm.name);
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
                    // Per-microbatch errors only where the microbatches are the exact's.
                    if arm.main_layout {
                        mb_errs[i].push(grad_error(&gr, &exact_mb[m]).0);
                    }
                    if step_grads[i].is_empty() {
                        step_grads[i] = gr;
                    } else {
                        for (s, v) in step_grads[i].iter_mut().zip(&gr) {
                            *s += v;
                        }
                    }
                }
                if let Some(ev) = r.events {
                    events_of.push((arm.name.to_string(), ev));
                }
            }
        }
        for i in 0..n {
            step_secs[i].push(step[i] + arms[i].planned.solve_seconds);
            step_cpu[i].push(cpu[i] + arms[i].planned.solve_seconds);
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
    let rows_total: usize = mbs.iter().map(|m| m.rows_counted).sum();
    let mut out = Vec::with_capacity(n);
    for (i, arm) in arms.iter().enumerate() {
        let (planned, budget, factor) = (arm.planned, &arm.budget, &arm.factor);
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
            policy: arm.name.to_string(),
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

pub(super) fn set_ratios(rows: &mut [PolicyRow], gc: &PolicyRow) {
    for r in rows {
        r.ratio_to_gc = r.tokens_per_s / gc.tokens_per_s;
        r.cpu_ratio_to_gc = r.tokens_per_cpu_s / gc.tokens_per_cpu_s;
        r.peak_activation_ratio_to_gc =
            r.peak_activation_bytes as f64 / gc.peak_activation_bytes as f64;
    }
}

/// An allocator per profile key of `mbs` ([`MicrobatchShape::profile_key`]: byte figures
/// are exact per key, and shared-prefix microbatches can differ in prompt rows and
/// log-probs), each with `base`'s calibrated costs and risk; a key of `base`'s own
/// profile, `base_key` (if given), takes a copy of `base`. Returns the allocators and
/// microbatch `i`'s index among them.
///
/// [`MicrobatchShape::profile_key`]: hilore_runtime::allocator::MicrobatchShape::profile_key
pub(super) fn allocators_per_key(
    model: &Decoder,
    mbs: &[Microbatch],
    base: &Allocator,
    base_key: Option<ProfileKey>,
    codecs: &[&'static str],
) -> anyhow::Result<(Vec<Allocator>, Vec<usize>)> {
    let mut allocs: Vec<Allocator> = Vec::new();
    let mut keys = Vec::new();
    let mut of = Vec::with_capacity(mbs.len());
    for (i, m) in mbs.iter().enumerate() {
        let key = m.input.shape.profile_key();
        let k = match keys.iter().position(|&x| x == key) {
            Some(k) => k,
            None => {
                let a = if Some(key) == base_key {
                    base.clone()
                } else {
                    let (profile, instances) = BenchWorkload {
                        model,
                        mbs,
                        bar: &ProgressBar::hidden(),
                    }
                    .profile(i)?;
                    let mut a = Allocator::new(profile, &instances, base.state(), codecs)?;
                    a.costs = base.costs.clone();
                    a.risk = base.risk.clone();
                    a
                };
                allocs.push(a);
                keys.push(key);
                keys.len() - 1
            }
        };
        of.push(k);
    }
    Ok((allocs, of))
}

/// Held-out steps [`calibrate_step_norm_and_validate`] plans and measures at most.
pub(super) const VALIDATION_ROUNDS: usize = 4;

/// Calibrates the allocator's gradient-norm scale on a whole held-out step `norm_step`
/// (microbatch gradients partly cancel: GRPO advantages are centred per group), then
/// validates the risk model there: plans the step at the main budget and target, measures
/// the step's gradient error, and tightens the risk budget when the measured error
/// exceeds the target (errors of different units are not quite independent, so the
/// quadrature sum can fall short for some plan mixes). It only tightens: the scale
/// calibrated with every unit compressed is the least it may be. Up to
/// [`VALIDATION_ROUNDS`] rounds, each correction clamped to [1, 4] and planned and
/// measured again; returns each round's figures.
pub(super) fn calibrate_step_norm_and_validate(
    allocator: &mut Allocator,
    model: &Decoder,
    norm_step: &[Microbatch],
    cal_bar: &ProgressBar,
    codecs: &[&'static str],
    budget_bytes: usize,
    target_rel_l2: f64,
) -> anyhow::Result<Vec<RiskValidation>> {
    let mut validation: Vec<RiskValidation> = Vec::new();
    let mut runner = BenchWorkload {
        model,
        mbs: norm_step,
        bar: cal_bar,
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
    // the step's gradient error, and tighten the risk budget when it exceeds the target
    // (see above), until a round meets it: the scale the policies plan with is then one
    // whose held-out plan met the target, unless VALIDATION_ROUNDS rounds did not reach
    // it (the report shows every round).
    let inputs: Vec<MicrobatchInput> = norm_step.iter().map(|m| m.input).collect();
    // The held-out step is planned as the measured one is: an allocator per profile key.
    let (mut allocs, of) = allocators_per_key(model, norm_step, allocator, None, codecs)?;
    let offer = Offer {
        codecs: codecs.to_vec(),
        recompute: true,
        open_groups: true,
    };
    for _ in 0..VALIDATION_ROUNDS {
        let Some(rb) = allocator.risk.step_budget(target_rel_l2, &exposures) else {
            break;
        };
        for a in &mut allocs {
            a.risk = allocator.risk.clone();
        }
        let per: Vec<&Allocator> = of.iter().map(|&k| &allocs[k]).collect();
        let ds = Allocator::plan_step_across(&per, &inputs, budget_bytes, rb, &offer, None)?;
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
        let over = err / (target_rel_l2 * norm);
        if over <= 1.0 {
            break;
        }
        allocator.risk.additivity_ratio = Some(rho * over.min(4.0));
    }
    Ok(validation)
}
