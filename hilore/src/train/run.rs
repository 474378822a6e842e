//! The training loop: the warm start, GRPO steps (rollout, advantages, the actor update,
//! AdamW), checkpoints and resume, the final evaluation and the summary.

use super::args::{apply_trl_config, TrainArgs};
use super::checkpoint::Checkpoint;
use super::eval::evaluate;
use super::metrics::{
    truncate_metrics, InstanceMeans, RngState, RunTotals, StepMetrics, Summary, TrainState,
    WarmStart,
};
use super::optimizer::AdamW;
use super::settings::{earlier_outputs, json_diff, policy_plan, spec_of, RunSettings};
use super::update::{actor_update, UpdateSettings};
use super::{checkpoint, rollout, sft};
use crate::common::{human_bytes, progress_bar};
use crate::tasks::{Example, Task, TASK_NAMES};
use crate::tokenizer::TrainTokenizer;
use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use hilore_models::rng::SplitMix64;
use hilore_models::{zoo, Decoder, DecoderConfig};
use hilore_runtime::allocator::{
    AllocatorState, MemoryBudget, OnlineAllocator, StateBytes, DEFAULT_TARGET_REL_L2,
};
use hilore_runtime::grpo::{self};
use hilore_runtime::Plan;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;

/// Decay of the warm start's loss moving average (about the last 10 steps).
pub(super) const SFT_EMA: f64 = 0.9;
/// The warm start runs at least this many steps before its target loss can stop it.
pub(super) const SFT_MIN_STEPS: usize = 20;

pub(super) fn stream_seed(seed: u64, name: &str) -> u64 {
    SplitMix64::for_stream(seed, name).next_u64()
}

/// Draws the examples of one phase's step: `n` examples from the streams
/// `(seed, "{phase}-{step}-{i}")`, redrawing procedural prompts that are held out.
pub(super) fn draw_examples(
    task: &Task,
    seed: u64,
    phase: &str,
    step: usize,
    n: usize,
    heldout: &HashSet<String>,
) -> anyhow::Result<Vec<Example>> {
    (0..n)
        .map(|i| {
            let mut rng = SplitMix64::for_stream(seed, &format!("{phase}-{step}-{i}"));
            for _ in 0..1000 {
                let ex = task.sample(&mut rng);
                if !task.is_procedural() || !heldout.contains(&ex.prompt) {
                    return Ok(ex);
                }
            }
            bail!(
                "{}: 1000 draws in a row were held-out prompts; the task has too few distinct problems for --heldout {} (lower it, or make the task larger)",
                task.describe(),
                heldout.len()
            )
        })
        .collect()
}

pub(super) fn model_from_checkpoint(
    ck: &Checkpoint,
    prefix: &str,
    cfg: &DecoderConfig,
    device: &Device,
) -> anyhow::Result<Decoder> {
    let mut map = HashMap::new();
    for t in &ck.tensors {
        if let Some(name) = t
            .name
            .strip_prefix(prefix)
            .and_then(|n| n.strip_prefix('/'))
        {
            map.insert(
                name.to_string(),
                Tensor::from_vec(t.data.clone(), t.shape.clone(), device)?,
            );
        }
    }
    Ok(Decoder::from_tensors(cfg, &map)?)
}

pub(super) struct Run {
    pub(super) settings: RunSettings,
    pub(super) state: TrainState,
    pub(super) model: Decoder,
    pub(super) reference: Decoder,
    pub(super) opt: AdamW,
    /// `--policy hilore`'s allocator (its state is checkpointed).
    pub(super) allocator: Option<Rc<RefCell<OnlineAllocator>>>,
}

/// The codecs `--policy hilore` offers (and `hilore bench`'s knapsack policies, by
/// default).
pub(crate) const HILORE_CODECS: [&str; 4] = ["bf16", "fp8-e4m3-b32", "int8-b32", "int4-g32"];

/// `--policy hilore`'s allocator for a model of `num_params` parameters (`None` for the
/// other policies).
pub(super) fn new_allocator(
    settings: &RunSettings,
    num_params: usize,
) -> Option<Rc<RefCell<OnlineAllocator>>> {
    (settings.policy == "hilore").then(|| {
        Rc::new(RefCell::new(
            OnlineAllocator::new(
                StateBytes::adamw_f32(num_params),
                MemoryBudget::default(),
                settings.target_rel_l2.unwrap_or(DEFAULT_TARGET_REL_L2),
                &HILORE_CODECS,
            )
            .with_refresh(settings.refresh_costs),
        ))
    })
}

impl Run {
    fn save(&self, path: &Path) -> anyhow::Result<()> {
        let mut tensors = checkpoint::model_tensors("model", &self.model)?;
        tensors.extend(checkpoint::model_tensors("reference", &self.reference)?);
        tensors.extend(self.opt.moment_tensors());
        let mut state = self.state.clone();
        state.adam_t = self.opt.t;
        state.rng.next_step = state.step;
        state.allocator = match &self.allocator {
            Some(a) => Some(checkpoint::floats_to_bits(serde_json::to_value(
                a.borrow().state(),
            )?)),
            None => None,
        };
        Checkpoint {
            run: serde_json::to_value(&self.settings)?,
            state: serde_json::to_value(&state)?,
            tensors,
        }
        .save_atomic(path)
    }

    fn load(path: &Path, settings: RunSettings, device: &Device) -> anyhow::Result<Self> {
        let ck = Checkpoint::load(path)?;
        let now = serde_json::to_value(&settings)?;
        let mut diffs = Vec::new();
        json_diff(&ck.run, &now, "", &mut diffs);
        if !diffs.is_empty() {
            // Shared prefixes became the default: an older checkpoint was written without.
            let layout = if diffs.iter().any(|d| d.starts_with("shared_prefix")) {
                if settings.shared_prefix {
                    " (it packed a copy of the prompt per response: resume with --no-shared-prefix)"
                } else {
                    " (it held each prompt once per microbatch: resume without --no-shared-prefix)"
                }
            } else {
                ""
            };
            bail!(
                "cannot resume from {}: it was written with other settings ({}){layout}; pass the same flags as the run that wrote it",
                path.display(),
                diffs.join("; ")
            );
        }
        let state: TrainState = serde_json::from_value(ck.state.clone())
            .with_context(|| format!("checkpoint {} has a corrupt state", path.display()))?;
        let model = model_from_checkpoint(&ck, "model", &settings.model, device)
            .with_context(|| format!("checkpoint {}: the policy", path.display()))?;
        let reference = model_from_checkpoint(&ck, "reference", &settings.model, device)
            .with_context(|| format!("checkpoint {}: the reference policy", path.display()))?;
        let mut opt = AdamW::new(settings.adamw, &model);
        opt.t = state.adam_t;
        opt.restore_moments(&ck)
            .with_context(|| format!("checkpoint {}: the optimizer", path.display()))?;
        let allocator = new_allocator(&settings, model.num_params());
        if let Some(a) = &allocator {
            match &state.allocator {
                Some(v) => {
                    let stored: AllocatorState =
                        serde_json::from_value(checkpoint::floats_from_bits(v.clone())?)
                            .with_context(|| {
                                format!(
                                    "checkpoint {} has a corrupt allocator state",
                                    path.display()
                                )
                            })?;
                    a.borrow_mut().restore(&stored).with_context(|| {
                        format!("resuming the allocator from {}", path.display())
                    })?;
                }
                None => println!(
                    "note: checkpoint {} holds no allocator state (written by an older hilore); the allocator calibrates again on the next step with exposure, so the resumed run may plan differently from an uninterrupted one",
                    path.display()
                ),
            }
        }
        Ok(Run {
            settings,
            state,
            model,
            reference,
            opt,
            allocator,
        })
    }
}

pub fn run(mut args: TrainArgs) -> anyhow::Result<ExitCode> {
    let t_start = Instant::now();
    if let Some(p) = args.grpo_config.clone() {
        let trl = crate::coefficients::read_trl_config(&p)?;
        let set = apply_trl_config(&mut args, &trl)
            .with_context(|| format!("--grpo-config {}", p.display()))?;
        if !set.is_empty() {
            eprintln!(
                "note: --grpo-config {} sets {}",
                p.display(),
                set.join(", ")
            );
        }
    }
    check_outputs(&args)?;
    let device = Device::Cpu;
    let task_name = args.task_name();
    if !TASK_NAMES.contains(&task_name.as_str()) {
        bail!(
            "unknown task `{task_name}`; the tasks are {} (jsonl reads --data FILE)",
            TASK_NAMES.join(", ")
        );
    }
    if args.model.is_some() && task_name != "jsonl" {
        bail!(
            "--model trains a zoo model on a dataset, but --task is `{task_name}`: pass --data FILE.jsonl (task jsonl); the procedural tasks use the built-in tokenizer and a random init"
        );
    }
    let task = Task::new(&spec_of(&args), args.heldout)?;
    let (tokenizer, zoo_cfg) = match &args.model {
        Some(dir) => {
            let (tok, cfg) = zoo_tokenizer(dir)?;
            (tok, Some(cfg))
        }
        None => (TrainTokenizer::Builtin(task.tokenizer()), None),
    };
    let heldout = task.heldout(args.heldout, args.seed);
    if heldout.is_empty() {
        bail!("the held-out set is empty; raise --heldout");
    }
    // The longest prompt and solution in tokens: the built-in tokenizers give at most one
    // token per byte after BOS; a zoo tokenizer encodes every example of the dataset.
    let (longest_prompt, longest_solution) = match (&tokenizer, task.dataset_examples()) {
        (TrainTokenizer::Zoo { .. }, Some(examples)) => {
            let (mut p, mut s) = (0usize, 0usize);
            for e in examples {
                p = p.max(tokenizer.encode_prompt(&e.prompt)?.len());
                s = s.max(tokenizer.encode_completion(&e.solution)?.len());
            }
            (p, s)
        }
        _ => (
            1 + heldout
                .iter()
                .map(|e| e.prompt.len())
                .max()
                .unwrap_or(0)
                .max(task.max_prompt_chars()),
            task.max_solution_chars(),
        ),
    };
    let settings =
        RunSettings::from_args(&args, &tokenizer, zoo_cfg.as_ref(), longest_solution + 1)?;
    let plan = policy_plan(&settings.policy)?;
    if let (Some(out), Some(dir)) = (&args.out, &args.model) {
        if let (Ok(a), Ok(b)) = (out.canonicalize(), dir.canonicalize()) {
            if a == b {
                bail!(
                    "--out {} is the --model directory; the export would overwrite the original weights: pick another directory",
                    out.display()
                );
            }
        }
    }
    let heldout_prompts: HashSet<String> = heldout.iter().map(|e| e.prompt.clone()).collect();
    // An impossible budget is an error before any work: the longest sequence a step can
    // make must fit one microbatch.
    let longest = longest_prompt + settings.max_new_tokens.max(longest_solution + 1);
    if settings.token_budget < longest - 1 {
        bail!(
            "--token-budget {} is smaller than one sequence: the longest prompt + response is {} tokens ({} rows); raise --token-budget to at least {}",
            settings.token_budget,
            longest,
            longest - 1,
            longest - 1
        );
    }
    let positions = longest;
    if positions > settings.model.max_position_embeddings {
        bail!(
            "sequences need {positions} positions, more than the model's max_position_embeddings = {}",
            settings.model.max_position_embeddings
        );
    }
    let progress = !args.no_progress;
    // `quiet` (a caller running several trainings, as `hilore compare` does) keeps the
    // log lines off stdout; the summary and metrics files are written as always.
    let quiet = args.quiet;
    macro_rules! say {
        ($($t:tt)*) => {
            if !quiet {
                println!($($t)*)
            }
        };
    }
    let eval_sampling = settings.sampling(stream_seed(settings.seed, "eval"), tokenizer.eos());
    say!(
        "task {} | policy {} | seed {} | {} held-out prompts",
        task.describe(),
        plan.name(),
        settings.seed,
        heldout.len()
    );

    let (mut run, resumed_from) = if args.resume {
        let run = Run::load(&args.checkpoint, settings.clone(), &device)?;
        say!(
            "resumed from {} at step {}",
            args.checkpoint.display(),
            run.state.step
        );
        if let Some(m) = &args.metrics {
            truncate_metrics(m, run.state.step)?;
        }
        let step = run.state.step;
        (run, Some(step))
    } else {
        let mut model = match &args.model {
            Some(dir) => {
                let tensors = zoo::load_weights(dir, &settings.model, &device)?;
                say!("model: {}", dir.display());
                Decoder::from_tensors(&settings.model, &tensors)?
            }
            None => Decoder::random(&settings.model, settings.seed, &device)?,
        };
        say!(
            "model: {} layers, hidden {}, {} heads ({} kv), vocab {}, {} parameters",
            settings.model.num_hidden_layers,
            settings.model.hidden_size,
            settings.model.num_attention_heads,
            settings.model.num_key_value_heads,
            settings.model.vocab_size,
            model.num_params()
        );
        let (warm_start, last_loss) = warm_start(
            &mut model,
            &task,
            &tokenizer,
            &settings,
            &plan,
            &heldout_prompts,
            progress,
        )?;
        say!(
            "warm start: {} steps, loss {:.4} (moving average; last step {last_loss:.4}), {:.1}s ({:.0} tok/s)",
            warm_start.steps, warm_start.final_loss, warm_start.seconds, warm_start.tokens_per_s
        );
        let before = evaluate(
            &model,
            &task,
            &tokenizer,
            &heldout,
            &eval_sampling,
            settings.eval_samples,
        )?;
        say!(
            "held-out after warm start: accuracy {:.3} (sampled, T={}), greedy {:.3}, reward {:.3}",
            before.accuracy,
            settings.temperature,
            before.greedy_accuracy,
            before.reward_mean
        );
        let reference = model_copy(&model, &settings.model)?;
        let opt = AdamW::new(settings.adamw, &model);
        let allocator = new_allocator(&settings, model.num_params());
        let run = Run {
            state: TrainState {
                step: 0,
                rng: RngState {
                    kind: "counter-based splitmix64 streams keyed by (seed, phase, step)".into(),
                    seed: settings.seed,
                    next_step: 0,
                },
                adam_t: 0,
                warm_start,
                before,
                seconds_total: 0.0,
                allocator: None,
                totals: RunTotals::default(),
            },
            settings: settings.clone(),
            model,
            reference,
            opt,
            allocator,
        };
        let mut run = run;
        run.state.seconds_total = t_start.elapsed().as_secs_f64();
        run.save(&args.checkpoint)?;
        // After the first checkpoint, so a run that cannot write one leaves an earlier
        // run's metrics as they were.
        if let Some(m) = &args.metrics {
            hilore_models::atomic::write_bytes_atomic(m, b"")
                .with_context(|| format!("creating metrics file {}", m.display()))?;
        }
        (run, None)
    };
    // Wall time of earlier processes of this run (a fresh run's own time is t_start's).
    let seconds_before = if resumed_from.is_some() {
        run.state.seconds_total
    } else {
        0.0
    };

    // The actor update's log-probs at the sampling temperature (greedy sampling: the
    // model's own distribution), as TRL trains on logits / T; the warm start before this
    // trained at 1.
    let logit_t = if settings.temperature > 0.0 {
        settings.temperature
    } else {
        1.0
    };
    run.model.set_logit_temperature(logit_t)?;
    run.reference.set_logit_temperature(logit_t)?;
    let reward_weights = settings
        .reward_weights
        .unwrap_or_else(|| task.reward_weights());
    let upd = UpdateSettings {
        layout: grpo::StepLayout::new(
            settings.prompts * settings.group_size,
            settings.gradient_accumulation_steps,
            settings.steps_per_generation,
        )?,
        grpo: settings.grpo,
        token_budget: settings.token_budget,
        plan: plan.clone(),
        skip_zero_exposure: settings.skip_zero_exposure,
        shared_prefix: settings.shared_prefix,
        allocator: run.allocator.clone(),
    };
    let mut metrics_file = match &args.metrics {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening metrics file {}", p.display()))?,
        ),
        None => None,
    };
    let total_steps = args.steps;
    let pb = progress_bar(total_steps, progress, "grpo");
    pb.set_position(run.state.step.min(total_steps) as u64);
    while run.state.step < total_steps {
        let step = run.state.step;
        let calibrated_before = run
            .allocator
            .as_ref()
            .is_some_and(|a| a.borrow().is_calibrated());
        let t_step = Instant::now();
        let examples = draw_examples(
            &task,
            settings.seed,
            "grpo",
            step,
            settings.prompts,
            &heldout_prompts,
        )?;
        let sampling = settings.sampling(
            stream_seed(settings.seed, &format!("grpo-sample-{step}")),
            tokenizer.eos(),
        );
        let ro = rollout::rollout(
            &run.model,
            &task,
            &tokenizer,
            examples,
            settings.group_size,
            &sampling,
            reward_weights,
        )?;
        let adv = grpo::advantages(
            &ro.rewards,
            settings.group_size,
            settings.grpo.advantage_norm,
            settings.grpo.std_eps,
        )
        .with_context(|| format!("GRPO step {}", step + 1))?;
        let rep = actor_update(
            &mut run.model,
            Some(&run.reference),
            &mut run.opt,
            &ro,
            &adv,
            &upd,
        )
        .with_context(|| format!("GRPO step {}", step + 1))?;
        run.state.step += 1;
        let m = StepMetrics::new(
            run.state.step,
            &ro,
            &rep,
            run.opt.optimizer_state_bytes(),
            t_step.elapsed().as_secs_f64(),
        );
        run.state.totals.add(&m);
        let line = m.line(total_steps, settings.skip_zero_exposure);
        if !quiet {
            pb.suspend(|| println!("{line}"));
        }
        pb.set_message(format!("reward {:.3}", m.reward_mean));
        pb.inc(1);
        if let Some(f) = &mut metrics_file {
            writeln!(f, "{}", serde_json::to_string(&m)?)?;
            f.flush()?;
        }
        let stop = args.stop_after == Some(run.state.step);
        // The step that calibrated the allocator is always checkpointed: a run resumed
        // from an earlier checkpoint would measure again (other times, other plans).
        let calibrated_now = !calibrated_before
            && run
                .allocator
                .as_ref()
                .is_some_and(|a| a.borrow().is_calibrated());
        if run.state.step % args.checkpoint_every == 0
            || run.state.step == total_steps
            || stop
            || calibrated_now
        {
            run.state.seconds_total = seconds_before + t_start.elapsed().as_secs_f64();
            run.save(&args.checkpoint)?;
        }
        if stop {
            pb.finish_and_clear();
            say!(
                "stopped after step {}; continue with --resume (checkpoint {})",
                run.state.step,
                args.checkpoint.display()
            );
            return Ok(ExitCode::SUCCESS);
        }
    }
    pb.finish_and_clear();
    let after = evaluate(
        &run.model,
        &task,
        &tokenizer,
        &heldout,
        &eval_sampling,
        settings.eval_samples,
    )?;
    let before = run.state.before;
    say!(
        "held-out accuracy: {:.3} -> {:.3} (sampled, T={}), greedy {:.3} -> {:.3}, reward {:.3} -> {:.3}",
        before.accuracy,
        after.accuracy,
        settings.temperature,
        before.greedy_accuracy,
        after.greedy_accuracy,
        before.reward_mean,
        after.reward_mean
    );
    let totals = run.state.totals.clone();
    let per_step = |sum: f64| sum / totals.steps.max(1) as f64;
    let exported_to = match &args.out {
        Some(out) => {
            let zoo_tok = match &tokenizer {
                TrainTokenizer::Zoo { tokenizer, .. } => Some(&**tokenizer),
                TrainTokenizer::Builtin(_) => None,
            };
            zoo::export_with(&run.model, run.model.config(), zoo_tok, out, DType::F32)
                .with_context(|| format!("exporting the trained weights to {}", out.display()))?;
            say!(
                "exported the trained weights to {} (config.json, model.safetensors{})",
                out.display(),
                if zoo_tok.is_some() {
                    ", tokenizer.json"
                } else {
                    ""
                }
            );
            Some(out.display().to_string())
        }
        None => None,
    };
    let seconds = t_start.elapsed().as_secs_f64();
    let summary = Summary {
        task: task.describe(),
        model_dir: args.model.as_ref().map(|d| d.display().to_string()),
        tokenizer: settings.tokenizer.clone(),
        exported_to,
        model_params: run.model.num_params(),
        policy: plan.name().to_string(),
        seed: settings.seed,
        steps: run.state.step,
        resumed_from_step: resumed_from,
        seconds,
        seconds_total: seconds_before + seconds,
        warm_start_steps: run.state.warm_start.steps,
        warm_start_loss: run.state.warm_start.final_loss,
        warm_start_seconds: run.state.warm_start.seconds,
        heldout_prompts: heldout.len(),
        heldout_accuracy_before: before.accuracy,
        heldout_accuracy_after: after.accuracy,
        heldout_greedy_accuracy_before: before.greedy_accuracy,
        heldout_greedy_accuracy_after: after.greedy_accuracy,
        heldout_reward_mean_before: before.reward_mean,
        heldout_reward_mean_after: after.reward_mean,
        final_reward_mean: totals.final_reward_mean_bits.map(f64::from_bits),
        final_accuracy: totals.final_accuracy_bits.map(f64::from_bits),
        rollout_tokens_per_s: per_step(totals.rollout_tokens_per_s_sum),
        update_tokens_per_s: per_step(totals.update_tokens_per_s_sum),
        peak_activation_bytes: totals.peak_activation_bytes,
        optimizer_state_bytes: run.opt.optimizer_state_bytes(),
        instances_per_step: InstanceMeans {
            store: per_step(totals.instances_store as f64),
            compress: per_step(totals.instances_compress as f64),
            recompute: per_step(totals.instances_recompute as f64),
        },
        settings: settings.clone(),
    };
    say!(
        "done: {} steps in {:.1}s; rollout {:.0} tok/s, update {:.0} tok/s, peak activations {}, optimizer state {}",
        summary.steps,
        summary.seconds,
        summary.rollout_tokens_per_s,
        summary.update_tokens_per_s,
        human_bytes(summary.peak_activation_bytes),
        human_bytes(summary.optimizer_state_bytes)
    );
    if let Some(p) = &args.summary {
        let json = serde_json::to_string_pretty(&summary)? + "\n";
        hilore_models::atomic::write_bytes_atomic(p, json.as_bytes())
            .with_context(|| format!("writing summary {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses, before any work, outputs that could never be written and (without `--resume`
/// or `--force`) an earlier run's files that a new one would replace.
fn check_outputs(args: &TrainArgs) -> anyhow::Result<()> {
    for (flag, p) in [
        ("--checkpoint", Some(&args.checkpoint)),
        ("--metrics", args.metrics.as_ref()),
        ("--summary", args.summary.as_ref()),
    ] {
        if let Some(p) = p {
            if std::fs::metadata(p).is_ok_and(|m| !m.is_file()) {
                bail!(
                    "{flag} {}: it exists and is not a regular file (a directory, FIFO or device); give the path of a plain file",
                    p.display()
                );
            }
        }
    }
    if let Some(dir) = &args.out {
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            bail!(
                "--out {}: it exists and is not a directory; give a directory for the model",
                dir.display()
            );
        }
    }
    if !args.resume && !args.force {
        let found = earlier_outputs(args);
        if !found.is_empty() {
            bail!(
                "an earlier run's files are in the way: {}; pass --resume to continue that run, --force to start over and replace them, or other paths",
                found.join(", ")
            );
        }
    }
    Ok(())
}

/// The warm start: supervised fine-tuning of `model` on the task's reference solutions
/// (never a held-out prompt) under `plan`, until `sft_steps` or until the loss's moving
/// average falls below `sft_target_loss`; returns its record and the last step's loss.
fn warm_start(
    model: &mut Decoder,
    task: &Task,
    tokenizer: &TrainTokenizer,
    settings: &RunSettings,
    plan: &Plan,
    heldout_prompts: &HashSet<String>,
    progress: bool,
) -> anyhow::Result<(WarmStart, f64)> {
    let t = Instant::now();
    let mut sft_opt = AdamW::new(settings.sft_adamw(), model);
    let pb = progress_bar(settings.sft_steps, progress, "warm start");
    let (mut final_loss, mut tokens, mut steps) = (f64::NAN, 0usize, 0usize);
    let mut ema = f64::NAN;
    for s in 0..settings.sft_steps {
        let exs = draw_examples(
            task,
            settings.seed,
            "sft",
            s,
            settings.sft_batch,
            heldout_prompts,
        )?;
        let r = sft::sft_step(
            model,
            &mut sft_opt,
            tokenizer,
            &exs,
            settings.token_budget,
            plan,
        )?;
        final_loss = r.loss;
        tokens += r.tokens;
        steps += 1;
        ema = if s == 0 {
            r.loss
        } else {
            SFT_EMA * ema + (1.0 - SFT_EMA) * r.loss
        };
        pb.set_message(format!("loss {:.4}", ema));
        pb.inc(1);
        if settings.sft_target_loss > 0.0
            && s + 1 >= SFT_MIN_STEPS
            && ema < settings.sft_target_loss
        {
            break;
        }
    }
    pb.finish_and_clear();
    let seconds = t.elapsed().as_secs_f64();
    let warm_start = WarmStart {
        steps,
        final_loss: ema,
        seconds,
        tokens_per_s: tokens as f64 / seconds.max(1e-9),
    };
    Ok((warm_start, final_loss))
}

/// The tokenizer of a zoo model directory and its config: `tokenizer.json` is required,
/// and the stop token is the config's `eos_token_id` (the first, if a list), else the
/// tokenizer's `</s>`-style end token.
pub(super) fn zoo_tokenizer(dir: &Path) -> anyhow::Result<(TrainTokenizer, DecoderConfig)> {
    let cfg = zoo::load_config(dir)?;
    let path = dir.join(zoo::TOKENIZER_FILE);
    let Some(tok) = zoo::load_tokenizer(dir, &cfg)? else {
        bail!(
            "{}: not found; `hilore train --model` needs the model's tokenizer.json to turn prompts and responses into ids: copy it from the model's repository into {}",
            path.display(),
            dir.display()
        );
    };
    let config = dir.join(zoo::CONFIG_FILE);
    let mut eos_ids = cfg.eos_token_ids();
    if eos_ids.is_empty() {
        const END_TOKENS: [&str; 4] = ["</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"];
        eos_ids.extend(END_TOKENS.iter().filter_map(|t| tok.token_id(t)).take(1));
        if eos_ids.is_empty() {
            bail!(
                "{}: no `eos_token_id`, and {} has none of the end tokens {END_TOKENS:?}: generation needs a stop token; add `\"eos_token_id\": <id of the end-of-sequence token>` to {}",
                config.display(),
                path.display(),
                config.display()
            );
        }
    }
    if let Some(&bad) = eos_ids.iter().find(|&&e| e as usize >= cfg.vocab_size) {
        bail!(
            "{}: `eos_token_id` {bad} is not below `vocab_size` {}; expected the id of the end-of-sequence token",
            config.display(),
            cfg.vocab_size
        );
    }
    Ok((
        TrainTokenizer::Zoo {
            tokenizer: Box::new(tok),
            eos: eos_ids[0],
            eos_ids,
        },
        cfg,
    ))
}

/// A separate copy of `model`'s weights (the frozen reference policy).
pub(super) fn model_copy(model: &Decoder, cfg: &DecoderConfig) -> anyhow::Result<Decoder> {
    let map: HashMap<String, Tensor> = model
        .named_params()
        .into_iter()
        .map(|(n, v)| Ok((n, v.tensor().copy()?)))
        .collect::<anyhow::Result<_>>()?;
    Ok(Decoder::from_tensors(cfg, &map)?)
}
