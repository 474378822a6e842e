//! The settings that fix a run's trajectory (stored in checkpoints, compared on resume),
//! derived from the flags and checked before any work.

use super::args::TrainArgs;
use super::optimizer::AdamWConfig;
use crate::tasks::TaskSpec;
use crate::tokenizer::TrainTokenizer;
use anyhow::{bail, Context};
use hilore_models::generate::SamplingConfig;
use hilore_models::{plans, zoo, DecoderConfig};
use hilore_runtime::allocator::DEFAULT_TARGET_REL_L2;
use hilore_runtime::grpo::{
    self, AdvantageNorm, Aggregation, GrpoConfig, ImportanceSampling, LossType, Surrogate,
};
use hilore_runtime::{Fidelity, Plan};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Everything that fixes the run's trajectory; stored in checkpoints and compared on
/// resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct RunSettings {
    pub(super) task: TaskSpec,
    pub(super) heldout: usize,
    pub(super) eval_samples: usize,
    pub(super) model: DecoderConfig,
    /// The zoo model directory the run started from (absent for a random init).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) model_dir: Option<PathBuf>,
    pub(super) tokenizer: String,
    pub(super) sft_steps: usize,
    pub(super) sft_target_loss: f64,
    pub(super) sft_batch: usize,
    pub(super) sft_lr: f64,
    pub(super) prompts: usize,
    pub(super) group_size: usize,
    pub(super) grpo: GrpoConfig,
    /// TRL's `gradient_accumulation_steps` and `steps_per_generation` (1 and 1, absent,
    /// in checkpoints written before they existed).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(super) gradient_accumulation_steps: usize,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub(super) steps_per_generation: usize,
    /// `--reward-weights` (absent: the task's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) reward_weights: Option<[f32; 2]>,
    pub(super) adamw: AdamWConfig,
    pub(super) temperature: f64,
    pub(super) top_p: f64,
    pub(super) max_new_tokens: usize,
    pub(super) policy: String,
    /// `--refresh-costs` (absent when off, as in checkpoints written before it existed).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(super) refresh_costs: bool,
    /// `--target-rel-l2` (absent at the default, as in checkpoints written before it
    /// existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) target_rel_l2: Option<f64>,
    pub(super) token_budget: usize,
    pub(super) skip_zero_exposure: bool,
    /// Shared prefixes (the default; `--no-shared-prefix` turns them off): absent when
    /// off, as in checkpoints written before they existed.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(super) shared_prefix: bool,
    pub(super) seed: u64,
}

pub(super) fn is_false(b: &bool) -> bool {
    !*b
}

pub(super) fn one() -> usize {
    1
}

pub(super) fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The fidelity plan of `--policy`.
pub(crate) fn policy_plan(policy: &str) -> anyhow::Result<Plan> {
    match policy {
        "store" => Ok(plans::store_all()),
        "recompute" => Ok(plans::gradient_checkpointing()),
        // HiLoRe plans each step itself; full recompute is its plan when the coefficients
        // are not known before the forward (later epochs, or a KL term).
        "hilore" => Ok(plans::gradient_checkpointing().named("hilore")),
        other => match other.strip_prefix("compress-") {
            Some(codec) => plans::compress_all(codec)
                .with_context(|| format!("--policy {other}: unknown codec `{codec}`")),
            None => {
                // Reuse the runtime's wording of the valid fidelities.
                let e = Fidelity::parse(other).err();
                bail!(
                    "unknown --policy `{other}`; the policies are `store`, `recompute`, `hilore` and `compress-<codec>`{}",
                    e.map(|e| format!(" ({e})")).unwrap_or_default()
                )
            }
        },
    }
}

impl RunSettings {
    /// The settings of `a`; `zoo` is the config of --model, `default_max_new_tokens` the
    /// task's longest solution in tokens + 1.
    pub(super) fn from_args(
        a: &TrainArgs,
        tokenizer: &TrainTokenizer,
        zoo: Option<&DecoderConfig>,
        default_max_new_tokens: usize,
    ) -> anyhow::Result<Self> {
        use crate::common::{check_count, check_flag, Range};
        check_count(
            "--eval-samples",
            a.eval_samples,
            1,
            "held-out accuracy is measured on that many samples per prompt",
        )?;
        for (flag, v, range, hint) in [
            ("--lr", a.lr, Range::Positive, "2e-4 is usual"),
            ("--sft-lr", a.sft_lr, Range::Positive, "3e-3 is usual"),
            (
                "--sft-target-loss",
                a.sft_target_loss,
                Range::NonNegative,
                "0 runs every --sft-steps",
            ),
            (
                "--epsilon",
                a.epsilon as f64,
                Range::Fraction,
                "0.2 is usual",
            ),
            (
                "--epsilon-high",
                a.epsilon_high.unwrap_or(a.epsilon) as f64,
                Range::NonNegative,
                "0.2, or 0.28 for DAPO's clip-higher",
            ),
            (
                "--beta",
                a.beta as f64,
                Range::NonNegative,
                "0 turns the KL term off",
            ),
            (
                "--temperature",
                a.temperature,
                Range::Positive,
                "1 samples from the policy as it is",
            ),
            ("--top-p", a.top_p, Range::UpToOne, "1 keeps every token"),
            (
                "--max-grad-norm",
                a.max_grad_norm,
                Range::NonNegative,
                "0 turns clipping off",
            ),
            (
                "--weight-decay",
                a.weight_decay,
                Range::NonNegative,
                "0 turns it off",
            ),
        ] {
            check_flag(flag, v, range, hint)?;
        }
        if let Some(d) = a.delta {
            let hi = a.epsilon_high.unwrap_or(a.epsilon);
            if !(d.is_finite() && d > 1.0 + hi) {
                bail!(
                    "--delta is {d}; it must be a number above 1 + --epsilon-high = {} (TRL suggests 1 + 2 x epsilon_high or more)",
                    1.0 + hi
                );
            }
        }
        let grpo = GrpoConfig {
            eps_low: a.epsilon,
            eps_high: a.epsilon_high.unwrap_or(a.epsilon),
            beta: a.beta,
            advantage_norm: AdvantageNorm::parse(&a.scale_rewards).context("--scale-rewards")?,
            std_eps: 1e-4,
            aggregation: Aggregation::default(),
            epochs: a.epochs,
            kl_bias_correction: a.use_bias_correction_kl,
            mask_truncated_completions: a.mask_truncated_completions,
            delta: a.delta,
            surrogate: Surrogate::default(),
            importance_sampling: ImportanceSampling::parse(&a.importance_sampling_level)
                .context("--importance-sampling-level")?,
        }
        .with_loss_type(sapo_temperatures(
            LossType::parse(
                &a.loss_type,
                a.max_new_tokens.unwrap_or(default_max_new_tokens),
            )
            .context("--loss-type")?,
            a.sapo_temperature_pos,
            a.sapo_temperature_neg,
        ));
        grpo.validate().context("GRPO settings")?;
        for (flag, v, range, hint) in [
            (
                "--adam-beta1",
                a.adam_beta1,
                Range::Fraction,
                "0.9 is usual",
            ),
            (
                "--adam-beta2",
                a.adam_beta2,
                Range::Fraction,
                "0.99 or 0.999",
            ),
            (
                "--adam-epsilon",
                a.adam_epsilon,
                Range::Positive,
                "1e-8 is usual",
            ),
        ] {
            check_flag(flag, v, range, hint)?;
        }
        let reward_weights = match &a.reward_weights {
            None => None,
            Some(text) => {
                let w: Vec<f32> = text
                    .split(',')
                    .map(|x| x.trim().parse::<f32>())
                    .collect::<Result<_, _>>()
                    .ok()
                    .filter(|w: &Vec<f32>| w.len() == 2 && w.iter().all(|x| x.is_finite()))
                    .with_context(|| {
                        format!(
                            "--reward-weights `{text}`: give two numbers, the weights of the reward functions {}, e.g. 1,0.1",
                            crate::tasks::REWARD_FUNCTIONS.join(" and ")
                        )
                    })?;
                Some([w[0], w[1]])
            }
        };
        let model = match (&a.config, zoo, tokenizer) {
            (Some(_), Some(_), _) => bail!(
                "--config and --model both give the model; --model DIR uses DIR/config.json, so drop --config"
            ),
            (None, Some(cfg), _) => cfg.clone(),
            (_, None, TrainTokenizer::Zoo { .. }) => {
                bail!("a zoo tokenizer needs its model: pass --model DIR")
            }
            (Some(p), None, TrainTokenizer::Builtin(tokenizer)) => {
                let cfg = DecoderConfig::from_json_file(p)?;
                if cfg.vocab_size < tokenizer.vocab_size() {
                    bail!(
                        "{}: vocab_size {} is smaller than the task tokenizer's {} ids; use a config with vocab_size >= {}",
                        p.display(),
                        cfg.vocab_size,
                        tokenizer.vocab_size(),
                        tokenizer.vocab_size()
                    );
                }
                cfg
            }
            (None, None, TrainTokenizer::Builtin(tokenizer)) => {
                if a.heads == 0 || a.hidden % a.heads != 0 {
                    bail!(
                        "--hidden {} is not a multiple of --heads {}; the head size is hidden / heads",
                        a.hidden,
                        a.heads
                    );
                }
                let cfg = DecoderConfig {
                    vocab_size: tokenizer.vocab_size(),
                    hidden_size: a.hidden,
                    intermediate_size: a.intermediate,
                    num_hidden_layers: a.layers,
                    num_attention_heads: a.heads,
                    num_key_value_heads: a.kv_heads,
                    head_dim: a.hidden / a.heads,
                    ..DecoderConfig::tiny()
                };
                cfg.validate()
                    .context("model flags (--layers, --hidden, --heads, --kv-heads, --intermediate)")?;
                cfg
            }
        };
        let positive = [
            ("--prompts", a.prompts),
            ("--group-size", a.group_size),
            ("--sft-batch", a.sft_batch),
            ("--heldout", a.heldout),
        ];
        for (flag, v) in positive {
            if v == 0 {
                bail!("{flag} is 0; it must be at least 1");
            }
        }
        let steps_per_generation = a
            .steps_per_generation
            .unwrap_or(a.gradient_accumulation_steps);
        grpo::StepLayout::new(
            a.prompts * a.group_size,
            a.gradient_accumulation_steps,
            steps_per_generation,
        )
        .context(
            "--prompts x --group-size, --gradient-accumulation-steps and --steps-per-generation",
        )?;
        if a.refresh_costs && a.policy != "hilore" {
            bail!(
                "--refresh-costs refreshes the allocator's cost model: it needs --policy hilore (the policy is `{}`)",
                a.policy
            );
        }
        if let Some(t) = a.target_rel_l2 {
            if a.policy != "hilore" {
                bail!(
                    "--target-rel-l2 sets the allocator's risk budget: it needs --policy hilore (the policy is `{}`)",
                    a.policy
                );
            }
            if !(t.is_finite() && t >= 0.0) {
                bail!("--target-rel-l2 is {t}; it must be a finite relative error >= 0 (e.g. 1e-2; 0 for exact plans only)");
            }
        }
        if a.checkpoint_every == 0 {
            bail!("--checkpoint-every is 0; it must be at least 1");
        }
        let max_new_tokens = a.max_new_tokens.unwrap_or(default_max_new_tokens);
        if max_new_tokens == 0 {
            bail!("--max-new-tokens is 0; responses need at least one token");
        }
        check_sizes(a, &model, max_new_tokens)?;
        Ok(RunSettings {
            task: spec_of(a),
            heldout: a.heldout,
            eval_samples: a.eval_samples,
            model,
            model_dir: a.model.clone(),
            tokenizer: tokenizer.describe(),
            sft_steps: a.sft_steps(),
            sft_target_loss: a.sft_target_loss,
            sft_batch: a.sft_batch,
            sft_lr: a.sft_lr,
            prompts: a.prompts,
            group_size: a.group_size,
            grpo,
            gradient_accumulation_steps: a.gradient_accumulation_steps,
            steps_per_generation,
            reward_weights,
            adamw: AdamWConfig {
                lr: a.lr,
                beta1: a.adam_beta1,
                beta2: a.adam_beta2,
                eps: a.adam_epsilon,
                weight_decay: a.weight_decay,
                max_grad_norm: a.max_grad_norm,
            },
            temperature: a.temperature,
            top_p: a.top_p,
            max_new_tokens,
            policy: a.policy.clone(),
            refresh_costs: a.refresh_costs,
            // The default is written as absent, so a checkpoint of a default run reads
            // the same before and after this flag existed.
            target_rel_l2: a
                .target_rel_l2
                .filter(|t| t.to_bits() != DEFAULT_TARGET_REL_L2.to_bits()),
            token_budget: a.token_budget,
            skip_zero_exposure: a.skip_zero_exposure,
            // On unless --no-shared-prefix (--shared-prefix says so explicitly).
            shared_prefix: !a.no_shared_prefix,
            seed: a.seed,
        })
    }

    pub(super) fn sampling(&self, seed: u64, stop_token: u32) -> SamplingConfig {
        SamplingConfig {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            stop_token: Some(stop_token),
            seed,
        }
    }

    pub(super) fn sft_adamw(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.sft_lr,
            weight_decay: 0.0,
            ..self.adamw
        }
    }
}

pub(super) fn spec_of(a: &TrainArgs) -> TaskSpec {
    TaskSpec {
        name: a.task_name(),
        digits: a.digits,
        ops: a.ops.clone(),
        numbers: a.numbers,
        max_number: a.max_number,
        data: a.data.clone(),
        heldout_data: a.heldout_data.clone(),
    }
}

/// Paths where two JSON values differ (for a resume with other settings).
pub(super) fn json_diff(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let null = serde_json::Value::Null;
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                json_diff(
                    x.get(k).unwrap_or(&null),
                    y.get(k).unwrap_or(&null),
                    &p,
                    out,
                );
            }
        }
        _ if a != b => out.push(format!("{path}: checkpoint {a}, now {b}")),
        _ => {}
    }
}

/// Checks what a run would allocate against this machine's memory before anything is:
/// the training state (weights, the reference policy, gradients and AdamW's two moments:
/// five `f32` copies of the parameters) and the step's rollout (every response's tokens
/// and key/value cache, a lower bound), with the size asked for, the limit and the fix.
pub(super) fn check_sizes(
    a: &TrainArgs,
    model: &DecoderConfig,
    max_new_tokens: usize,
) -> anyhow::Result<()> {
    let Some(mem) = hilore_models::machine_memory_bytes() else {
        return Ok(());
    };
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    let state = model.param_count().saturating_mul(5 * 4);
    if state > mem as u128 {
        bail!(
            "the model has {} parameters: its training state (weights, reference policy, gradients, AdamW moments: 5 x 4 bytes each) needs {:.1} GiB, more than this machine's {:.1} GiB; use fewer or smaller layers (--layers, --hidden, --intermediate) or a smaller --config",
            model.param_count(),
            gib(state),
            gib(mem as u128)
        );
    }
    let responses = (a.prompts as u128).saturating_mul(a.group_size as u128);
    let kv_per_token = 2 * model.num_hidden_layers as u128 * model.kv_dim() as u128 * 4;
    let rollout = responses
        .saturating_mul(max_new_tokens as u128)
        .saturating_mul(kv_per_token.saturating_add(4));
    if rollout > mem as u128 {
        bail!(
            "--prompts {} x --group-size {} = {responses} responses of up to {max_new_tokens} tokens: their key/value caches alone need {:.1} GiB, more than this machine's {:.1} GiB; use fewer --prompts or a smaller --group-size",
            a.prompts,
            a.group_size,
            gib(rollout),
            gib(mem as u128)
        );
    }
    Ok(())
}

/// The files of an earlier run that a new one (without `--resume` or `--force`) would
/// replace: the checkpoint, a non-empty metrics or summary file, a model in `--out`.
pub(super) fn earlier_outputs(args: &TrainArgs) -> Vec<String> {
    let mut found = Vec::new();
    if args.checkpoint.exists() {
        found.push(format!("checkpoint {}", args.checkpoint.display()));
    }
    for (what, p) in [("metrics", &args.metrics), ("summary", &args.summary)] {
        if let Some(p) = p {
            if std::fs::metadata(p).is_ok_and(|m| m.len() > 0) {
                found.push(format!("{what} {}", p.display()));
            }
        }
    }
    if let Some(dir) = &args.out {
        if let Some(f) = zoo::model_files_in(dir) {
            found.push(format!("--out {} (holds {f})", dir.display()));
        }
    }
    found
}

/// `t` with SAPO's gate temperatures set (other loss types have none).
fn sapo_temperatures(t: LossType, pos: f32, neg: f32) -> LossType {
    match t.surrogate {
        Surrogate::Sapo { .. } => LossType {
            surrogate: Surrogate::Sapo {
                temperature_pos: pos,
                temperature_neg: neg,
            },
            ..t
        },
        _ => t,
    }
}
