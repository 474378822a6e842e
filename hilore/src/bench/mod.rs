//! `hilore bench`: HiLoRe against the baselines on the same model, batches, seeds, tape
//! and kernels, under the same memory budget.
//!
//! Phases: (1) draw a GRPO-like step (the measured one) and a calibration step; (2)
//! profile one store-all pass (the simulator's record) and build the allocator; (3)
//! calibrate recompute / codec times and `kappa` on the calibration step; (4) plan every
//! policy (with an allocator per profile key of the step's microbatches: shared-prefix
//! microbatches of other prompt rows or log-probs save other bytes per unit instance, each
//! key is profiled; HiLoRe plans the step as one across them); (5) run the policies
//! interleaved (every microbatch of policy A, of B, ..., then
//! again), several repetitions; (6) optionally sweep the memory budget and the risk
//! target; (7) print the table, write JSON and SVG charts.

mod workload;

mod args;
mod measure;
mod plots;
mod policies;
mod report;

use crate::common::progress_bar;
pub use args::BenchArgs;
use measure::{
    allocators_per_key, calibrate_step_norm_and_validate, load_average, measure, set_ratios,
    BenchWorkload, PolicyRow, UnsharedReference, UNSHARED_COMPRESS_ALL, UNSHARED_GC,
};
use plots::write_plots;
use policies::{Ctx, Kind, PlannedPolicy};
use report::{print_report, Acceptance, Additivity, ConfigOut, Report};

use anyhow::Context;
use candle_core::Device;
use hilore_models::Decoder;
use hilore_runtime::allocator::baselines;
use hilore_runtime::allocator::Workload;
use hilore_runtime::allocator::{
    calibrate, calibration_passes, Allocator, MemoryBudget, StateBytes,
};
use std::process::ExitCode;
use std::time::Instant;
use workload::{grpo_step, Microbatch, StepSpec};

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let t_start = Instant::now();
    let load_start = load_average();
    args.check()?;
    let device: Device = crate::common::device();
    let cfg = args.model_config()?;
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
        shape: args.shape,
        shared_prefix: args.shared_prefix,
    };
    let mbs = grpo_step(&cfg, spec, args.seed.wrapping_add(1), &device)?;
    // With shared prefixes, the same draw packed without them: full recompute there is the
    // reference whose peak sets the budget and against which the shared layout's speed is
    // measured, interleaved in this run.
    let unshared_mbs = if args.shared_prefix {
        let unshared = StepSpec {
            shared_prefix: false,
            ..spec
        };
        Some(grpo_step(
            &cfg,
            unshared,
            args.seed.wrapping_add(1),
            &device,
        )?)
    } else {
        None
    };
    // Two calibration microbatches with different squared lengths and nonzero exposure,
    // from a separate step (redrawn with the next seed while none has any exposure).
    let mut cal_mbs: Vec<Microbatch> = Vec::new();
    for k in 0..32u64 {
        let step = grpo_step(&cfg, spec, args.seed.wrapping_add(1001 + k), &device)?;
        cal_mbs.extend(step.into_iter().filter(|m| m.input.exposure > 0.0));
        if cal_mbs.len() >= 2 {
            break;
        }
    }
    // A held-out step, drawn apart from the calibration microbatches (a step's
    // microbatches share prompts, so one that held the kappa microbatch would validate
    // the sensitivities on the data they were fitted to): its exact gradient calibrates
    // the step's gradient norm against its microbatches' exposures, and its planned
    // error validates the risk budget's scale.
    let mut norm_step: Vec<Microbatch> = Vec::new();
    for k in 0..32u64 {
        let step = grpo_step(&cfg, spec, args.seed.wrapping_add(2001 + k), &device)?;
        if step.iter().any(|m| m.input.exposure > 0.0) {
            norm_step = step;
            break;
        }
    }
    anyhow::ensure!(
        !norm_step.is_empty(),
        "32 held-out steps drew no microbatch with nonzero exposure"
    );
    cal_mbs.sort_by_key(|m| m.input.shape.sum_sq_lengths);
    let cal_mbs: Vec<Microbatch> = match cal_mbs.len() {
        0 => anyhow::bail!("32 calibration steps drew no microbatch with nonzero exposure"),
        1 => cal_mbs,
        n => vec![cal_mbs[0].clone(), cal_mbs[n - 1].clone()],
    };
    let state = StateBytes::adamw_f32(model.num_params());
    let quiet = args.quiet;
    let bar = |len: usize, phase: &str| progress_bar(len, !quiet, phase);
    eprintln!(
        "model: {} layers, hidden {}, MLP {}, {} params; {} microbatches of {} rows{} ({} sequences, {} with zero advantage)",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.intermediate_size,
        model.num_params(),
        mbs.len(),
        args.rows,
        match &unshared_mbs {
            Some(u) => format!(" with shared prefixes ({} unshared)", u.len()),
            None => String::new(),
        },
        mbs.iter().map(|m| m.sequences).sum::<usize>(),
        mbs.iter().map(|m| m.zero_advantage_sequences).sum::<usize>(),
    );

    // Profile: one store-all pass of the measured step's first microbatch.
    let (profile, instances) = BenchWorkload {
        model: &model,
        mbs: &mbs,
        bar: &indicatif::ProgressBar::hidden(),
    }
    .profile(0)?;
    let mut allocator = Allocator::new(profile, &instances, state, &codecs)?;
    // The unshared layout's own record, for full recompute's peak and plans there.
    let unshared_allocator = match &unshared_mbs {
        Some(u) => {
            let (profile, instances) = BenchWorkload {
                model: &model,
                mbs: u,
                bar: &indicatif::ProgressBar::hidden(),
            }
            .profile(0)?;
            Some(Allocator::new(profile, &instances, state, &codecs)?)
        }
        None => None,
    };

    // Calibrate.
    let t_cal = Instant::now();
    // Exact passes, a compression pass per class of a unit and codec (each also timing one
    // recompute on the kappa microbatch), additivity, the remaining recompute timings; then
    // the held-out step's passes.
    let cal_passes = calibration_passes(&allocator, cal_mbs.len(), &codecs);
    let cal_bar = bar(
        cal_passes + (1 + measure::VALIDATION_ROUNDS) * norm_step.len(),
        "calibrating",
    );
    let cal_report = {
        let mut runner = BenchWorkload {
            model: &model,
            mbs: &cal_mbs,
            bar: &cal_bar,
        };
        let all: Vec<usize> = (0..cal_mbs.len()).collect();
        calibrate(
            &mut allocator,
            &mut runner,
            &all,
            all.len() - 1,
            &codecs,
            &mut |_| {},
        )?
    };
    let gc_peak_of = |a: &Allocator| a.simulate_peak(&baselines::gradient_checkpointing(a));
    let layout_gc_peak = gc_peak_of(&allocator)?;
    // The budget is relative to full recompute of the unshared update, also when the
    // policies run shared prefixes.
    let gc_peak = match &unshared_allocator {
        Some(a) => gc_peak_of(a)?,
        None => layout_gc_peak,
    };
    let gc_total = gc_peak + state.total();
    let budget_bytes = budget.bytes(gc_total);
    // The gradient-norm scale of a whole held-out step (microbatch gradients partly
    // cancel: GRPO advantages are centred per group), instead of two microbatches'.
    let gamma_microbatches = allocator.risk.grad_norm_per_exposure;
    let rho_all_compressed = allocator.risk.additivity_ratio;
    let validation = calibrate_step_norm_and_validate(
        &mut allocator,
        &model,
        &norm_step,
        &cal_bar,
        &codecs,
        budget_bytes,
        args.target_rel_l2,
    )?;
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

    // Byte figures are exact per profile key (the rows and, with every prompt first, the
    // prompt rows and log-probs, which can differ between shared microbatches): an
    // allocator per key of the step, each with the calibrated costs and risk.
    let base_key = mbs[0].input.shape.profile_key();
    let (allocs, of) = allocators_per_key(&model, &mbs, &allocator, Some(base_key), &codecs)?;
    let ctx = Ctx {
        allocs: &allocs,
        of,
        mbs: &mbs,
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
    let reference = match (&unshared_allocator, &unshared_mbs) {
        (Some(a), Some(u)) => {
            // The unshared microbatches all have the same rows and no prompt rows.
            let ctx = Ctx::single(a, u, codecs.clone());
            let plan = |k: Kind| ctx.plan(k, budget_bytes, args.target_rel_l2);
            Some(UnsharedReference {
                mbs: u,
                arms: vec![
                    (UNSHARED_GC, plan(Kind::Gc)?),
                    (UNSHARED_COMPRESS_ALL, plan(Kind::CompressAll)?),
                ],
            })
        }
        _ => None,
    };
    let passes = (policies.len() * mbs.len()
        + reference.as_ref().map_or(0, |r| r.arms.len() * r.mbs.len()))
        * args.reps;
    let main_bar = bar(passes, "policies");
    let mut exact = None;
    let mut events = Vec::new();
    let mut rows = measure(
        &model,
        &mbs,
        &policies,
        reference.as_ref(),
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
            let b = bar(planned.len() * mbs.len() * args.sweep_reps, label);
            let mut r = measure(
                &model,
                &mbs,
                &planned,
                None,
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

    let all = || rows.iter().chain(&sweep).chain(&risk_sweep);
    let add = Additivity::of_rows(all());
    let acc = Acceptance::of(&rows, all(), budget_bytes, args.target_rel_l2);
    let exposures: Vec<f64> = mbs.iter().map(|m| m.input.exposure).collect();
    let report = Report {
        config: ConfigOut {
            model: cfg.clone(),
            params: model.num_params(),
            layers: cfg.num_hidden_layers,
            rows_per_microbatch: args.rows,
            shape: args.shape,
            shared_prefix: args.shared_prefix,
            microbatches: mbs.len(),
            unshared_microbatches: unshared_mbs.as_ref().map(Vec::len),
            layout_gc_peak_activation_bytes: layout_gc_peak,
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
