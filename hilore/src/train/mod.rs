//! `hilore train`: warm start, then GRPO with rollouts, rewards, pre-backward
//! coefficients and a microbatched actor update under a fidelity policy.
//!
//! The run: build the task and its tokenizer; build a decoder (random init, seeded, or a
//! zoo model directory with `--model`, whose tokenizer.json and `eos_token_id` then replace
//! the built-in tokenizer); warm-start it by supervised fine-tuning on the task's reference
//! solutions (off by default for `--model`); evaluate it on
//! a held-out set that training never draws from; then for every GRPO step sample `G`
//! responses to each of `P` prompts with the KV cache, score them, turn rewards into
//! group-relative advantages, and run `mu` update epochs over the sequences (microbatches
//! packed by a token budget, each under the `--policy` fidelity plan, backward seeded with
//! the per-token coefficients `dL/dlogp`, AdamW with gradient clipping); finally evaluate
//! again, write the summary and, with `--out`, export the trained weights as a model
//! directory.
//!
//! Every random choice is a pure function of `--seed` and the step (counter-based streams),
//! so a checkpoint's RNG state is the seed and the next step; with the weights, the
//! reference weights, the optimizer moments and (`--policy hilore`, the default) the
//! allocator's calibrated state it fixes the rest of the run, and `--resume` continues
//! bit for bit. The allocator's plans depend on measured times only through its one
//! calibration (on the first step with exposure; that step is always checkpointed):
//! `--refresh-costs` folds later measurements in as well, which adapts to drift but gives
//! up bit-exact resume.

mod checkpoint;
mod eval;
pub mod optimizer;
pub mod rollout;
mod sft;
pub mod update;

/// What the actor update ([`update::actor_update`]) and the optimizer
/// ([`optimizer::AdamW`]) need from a policy: its batches, the token log-probs of a batch
/// on the tape, and its parameters by name. The built-in decoder and every zoo model
/// implement it; a model of one's own does by giving these four.
pub trait ActorModel {
    /// The packed batch of `seqs` (prompt and response tokens each; the targets are the
    /// next tokens), with whatever per-row tables the model reads (positions, RoPE).
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<hilore_models::TokenBatch>;

    /// The log-prob of every target of `batch` (`[N]`), recorded on `cx` so its
    /// recovery units take the plan's fidelities.
    fn token_logprobs<'m>(
        &'m self,
        cx: &mut hilore_runtime::Cx<'m>,
        batch: &hilore_models::TokenBatch,
    ) -> hilore_runtime::Result<hilore_runtime::Var>;

    /// Every trainable parameter with its name, in a fixed order.
    fn named_params(&self) -> Vec<(String, hilore_runtime::Var)>;

    /// The same parameters, mutably, in the same order (the optimizer's step).
    fn named_params_mut(&mut self) -> Vec<(String, &mut hilore_runtime::Var)>;
}

impl ActorModel for Decoder {
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<hilore_models::TokenBatch> {
        Ok(hilore_models::TokenBatch::from_sequences(
            seqs,
            self.config(),
            self.head_weight().device(),
        )?)
    }

    fn token_logprobs<'m>(
        &'m self,
        cx: &mut hilore_runtime::Cx<'m>,
        batch: &hilore_models::TokenBatch,
    ) -> hilore_runtime::Result<hilore_runtime::Var> {
        Decoder::token_logprobs(self, cx, batch)
    }

    fn named_params(&self) -> Vec<(String, hilore_runtime::Var)> {
        Decoder::named_params(self)
    }

    fn named_params_mut(&mut self) -> Vec<(String, &mut hilore_runtime::Var)> {
        Decoder::named_params_mut(self)
    }
}

use crate::common::human_bytes;
use crate::tasks::{Example, Task, TaskSpec, TASK_NAMES};
use crate::tokenizer::TrainTokenizer;
use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use checkpoint::{Checkpoint, NamedTensor};
use clap::Args;
use eval::{evaluate, EvalReport};
use hilore_models::generate::SamplingConfig;
use hilore_models::rng::SplitMix64;
use hilore_models::{plans, zoo, Decoder, DecoderConfig};
use hilore_runtime::allocator::{
    AllocatorState, MemoryBudget, OnlineAllocator, StateBytes, DEFAULT_TARGET_REL_L2,
};
use hilore_runtime::grpo::{
    self, AdvantageNorm, Aggregation, GrpoConfig, ImportanceSampling, LossType, Surrogate,
};
use hilore_runtime::{Fidelity, Plan};
use indicatif::{ProgressBar, ProgressStyle};
use optimizer::{AdamW, AdamWConfig};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;
use std::time::Instant;
use update::{actor_update, UpdateSettings};

#[derive(Args, Debug)]
pub struct TrainArgs {
    // ----- task
    /// The task: `arithmetic`, `countdown`, or `jsonl` (a dataset given by --data).
    /// Default: `jsonl` when --data or --model is given, else `arithmetic`.
    #[arg(long, help_heading = "Task")]
    task: Option<String>,
    /// Arithmetic: digits per operand.
    #[arg(long, default_value_t = 2, help_heading = "Task")]
    digits: usize,
    /// Arithmetic: operators to draw from (any of `+-*`).
    #[arg(long, default_value = "+", help_heading = "Task")]
    ops: String,
    /// Countdown: how many numbers per problem.
    #[arg(long, default_value_t = 3, help_heading = "Task")]
    numbers: usize,
    /// Countdown: numbers are drawn from 1..=N.
    #[arg(long, default_value_t = 9, help_heading = "Task")]
    max_number: u32,
    /// JSONL dataset: one `{"prompt": ..., "answer": ...}` object per line; the reward
    /// compares GSM8K-style final answers (`#### 42`, else the last number).
    #[arg(long, value_name = "FILE", help_heading = "Task")]
    data: Option<PathBuf>,
    /// JSONL held-out set (default: the last --heldout lines of --data).
    #[arg(long, value_name = "FILE", help_heading = "Task")]
    heldout_data: Option<PathBuf>,
    /// Held-out prompts (procedural tasks never train on them).
    #[arg(long, default_value_t = 400, help_heading = "Task")]
    heldout: usize,
    /// Sampled responses per held-out prompt for the sampled accuracy.
    #[arg(long, default_value_t = 2, help_heading = "Task")]
    eval_samples: usize,

    // ----- model
    /// A Hugging Face / candle-zoo model directory (config.json, model.safetensors or a
    /// sharded index, tokenizer.json) to train instead of a random init: prompts and
    /// responses go through its tokenizer.json, generation stops at the config's
    /// `eos_token_id`, and the warm start is off unless --sft-steps is given. Needs a
    /// dataset task (--data FILE.jsonl).
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    model: Option<PathBuf>,
    /// An HF config.json for the policy (random init); default: a small decoder sized by
    /// the flags below, with the task tokenizer's vocabulary.
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    config: Option<PathBuf>,
    #[arg(long, default_value_t = 2, help_heading = "Model")]
    layers: usize,
    #[arg(long, default_value_t = 64, help_heading = "Model")]
    hidden: usize,
    #[arg(long, default_value_t = 4, help_heading = "Model")]
    heads: usize,
    #[arg(long, default_value_t = 2, help_heading = "Model")]
    kv_heads: usize,
    #[arg(long, default_value_t = 176, help_heading = "Model")]
    intermediate: usize,

    // ----- warm start
    /// Most supervised warm-start steps (0: start GRPO from the initial weights).
    /// Default: 2000, or 0 with --model (a zoo model is already trained).
    #[arg(long, help_heading = "Warm start")]
    sft_steps: Option<usize>,
    /// Stop the warm start once the moving average of its loss (nats per solution token)
    /// falls below this, so GRPO starts from a partly competent policy whatever the seed;
    /// 0 runs all --sft-steps.
    #[arg(long, default_value_t = 0.35, help_heading = "Warm start")]
    sft_target_loss: f64,
    /// Examples per warm-start step.
    #[arg(long, default_value_t = 64, help_heading = "Warm start")]
    sft_batch: usize,
    #[arg(long, default_value_t = 3e-3, help_heading = "Warm start")]
    sft_lr: f64,

    // ----- GRPO
    /// GRPO steps (rollout + update).
    #[arg(long, default_value_t = 100, help_heading = "GRPO")]
    steps: usize,
    /// Prompts per step (P); P x G sequences are TRL's generation batch
    /// (`per_device_train_batch_size` x `steps_per_generation`).
    #[arg(long, default_value_t = 32, help_heading = "GRPO")]
    prompts: usize,
    /// Responses per prompt (G; TRL's `num_generations`, default 8 there too).
    #[arg(
        long,
        visible_alias = "num-generations",
        default_value_t = 8,
        help_heading = "GRPO"
    )]
    group_size: usize,
    /// AdamW's learning rate (TRL's `learning_rate`; TRL's default 1e-6 is for
    /// pretrained LLMs, 2e-4 suits the small policies trained from scratch here).
    #[arg(
        long,
        visible_alias = "learning-rate",
        default_value_t = 2e-4,
        help_heading = "GRPO"
    )]
    lr: f64,
    /// AdamW's first-moment decay (TRL's `adam_beta1`).
    #[arg(long, default_value_t = 0.9, help_heading = "GRPO")]
    adam_beta1: f64,
    /// AdamW's second-moment decay (TRL's `adam_beta2`; its default 0.999 averages over
    /// about 1000 steps, longer than the runs here, so 0.99).
    #[arg(long, default_value_t = 0.99, help_heading = "GRPO")]
    adam_beta2: f64,
    /// AdamW's epsilon (TRL's `adam_epsilon`).
    #[arg(long, default_value_t = 1e-8, help_heading = "GRPO")]
    adam_epsilon: f64,
    /// Update epochs per rollout batch (mu; TRL's `num_iterations`); with 1 and --beta 0
    /// the first optimizer step's coefficients are known before the forward.
    #[arg(
        long,
        visible_alias = "num-iterations",
        default_value_t = 1,
        help_heading = "GRPO"
    )]
    epochs: usize,
    /// Loss microbatches per optimizer step (TRL's `gradient_accumulation_steps`). With
    /// --steps-per-generation it cuts the rollout's prompts x group sequences as TRL
    /// cuts its generation batch: steps-per-generation microbatches of equal size,
    /// steps-per-generation / gradient-accumulation-steps optimizer steps per rollout
    /// and epoch. Only the loss's weights (bnpo, dr_grpo, grpo) and the number of
    /// optimizer steps depend on it; memory microbatches are packed by --token-budget.
    #[arg(long, default_value_t = 1, help_heading = "GRPO")]
    gradient_accumulation_steps: usize,
    /// Loss microbatches per rollout (TRL's `steps_per_generation`; default:
    /// --gradient-accumulation-steps, one optimizer step per rollout and epoch, as TRL).
    #[arg(long, help_heading = "GRPO")]
    steps_per_generation: Option<usize>,
    /// Weights of the task's reward functions `correct,format` (TRL's `reward_weights`,
    /// summed as its `sum_then_normalize`); default: the task's own, 1,0 (arithmetic,
    /// JSONL) or 0.9,0.1 (Countdown).
    #[arg(long, value_name = "W_CORRECT,W_FORMAT", help_heading = "GRPO")]
    reward_weights: Option<String>,
    /// A TRL GRPOConfig file (YAML or JSON, as `trl grpo --config` takes): its keys set
    /// the GRPO flags they name (loss_type, beta, epsilon, num_generations,
    /// per_device_train_batch_size x steps_per_generation = prompts x group, ...), flags
    /// given on the command line win; see `hilore coefficients --help` for the keys read.
    #[arg(long, value_name = "FILE", help_heading = "GRPO")]
    grpo_config: Option<PathBuf>,
    /// Lower clip range (TRL's `epsilon`): the ratio is clamped at 1 - epsilon.
    #[arg(long, alias = "eps-low", default_value_t = 0.2, help_heading = "GRPO")]
    epsilon: f32,
    /// Upper clip range (TRL's `epsilon_high`; default: --epsilon, as TRL). 0.28 is
    /// DAPO's clip-higher.
    #[arg(
        long,
        alias = "eps-high",
        value_name = "EPSILON_HIGH",
        help_heading = "GRPO"
    )]
    epsilon_high: Option<f32>,
    /// Weight of the k3 KL to the warm-start policy (TRL's `beta`).
    #[arg(long, default_value_t = 0.0, help_heading = "GRPO")]
    beta: f32,
    /// Importance-weight the KL term by the ratio, `beta * rho * k3` (TRL's
    /// `use_bias_correction_kl`); `false` uses `beta * k3`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL", help_heading = "GRPO")]
    use_bias_correction_kl: bool,
    /// TRL's `scale_rewards`: `group` (divide by the group's standard deviation: GRPO),
    /// `batch` (by the batch's) or `none` (Dr. GRPO). Standard deviations are sample ones
    /// (n - 1), as TRL's.
    #[arg(
        long,
        alias = "adv-norm",
        default_value = "group",
        help_heading = "GRPO"
    )]
    scale_rewards: String,
    /// Leave responses cut at --max-new-tokens (no end token) out of the loss (TRL's
    /// `mask_truncated_completions`); `grpo`'s mean over sequences still counts them.
    #[arg(long, help_heading = "GRPO")]
    mask_truncated_completions: bool,
    /// Two-sided clipping (TRL's `delta`): a token with negative advantage and ratio
    /// above delta gets no gradient; must exceed 1 + --epsilon-high. Default: off.
    #[arg(long, help_heading = "GRPO")]
    delta: Option<f32>,
    /// TRL's `loss_type`: `dapo` (token mean over the step), `grpo` (mean of the
    /// sequences' token means), `dr_grpo` (sum over sequences x --max-completion-length),
    /// `bnpo` (token mean per loss microbatch), `cispo` (the importance weight truncated
    /// at --epsilon-high and detached; set --epsilon-high to e.g. 5) or `sapo` (a soft
    /// gate instead of the clip). `token-mean` and `seq-mean-token-mean` name the first
    /// two.
    #[arg(
        long,
        alias = "aggregation",
        value_name = "LOSS_TYPE",
        default_value = "dapo",
        help_heading = "GRPO"
    )]
    loss_type: String,
    /// TRL's `importance_sampling_level`: `token` (a ratio per token: GRPO) or
    /// `sequence` (one per sequence, the geometric mean of its tokens': GSPO).
    #[arg(long, default_value = "token", help_heading = "GRPO")]
    importance_sampling_level: String,
    /// SAPO's gate temperature where the advantage is positive (TRL's
    /// `sapo_temperature_pos`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    sapo_temperature_pos: f32,
    /// SAPO's gate temperature elsewhere (TRL's `sapo_temperature_neg`).
    #[arg(long, default_value_t = 1.05, help_heading = "GRPO")]
    sapo_temperature_neg: f32,
    /// Sampling temperature (TRL's `temperature`); the actor update's log-probs are
    /// taken at it too, `log_softmax(logits / T)`, as TRL trains on logits / T.
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    temperature: f64,
    /// Nucleus sampling (TRL's `top_p`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    top_p: f64,
    /// Most new tokens per response (TRL's `max_completion_length`; default: the task's
    /// longest solution + EOS, where TRL's is 512).
    #[arg(long, visible_alias = "max-completion-length", help_heading = "GRPO")]
    max_new_tokens: Option<usize>,
    /// Gradient-norm clipping of each optimizer step (TRL's `max_grad_norm`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    max_grad_norm: f64,
    /// AdamW's decoupled weight decay (TRL's `weight_decay`).
    #[arg(long, default_value_t = 0.0, help_heading = "GRPO")]
    weight_decay: f64,

    // ----- actor update
    /// Fidelity of the units in the actor update: `hilore` (the default: the allocator
    /// plans every microbatch from measured costs and the step's exposures under 1.10 x
    /// full recompute's peak; microbatches are padded to a multiple of 128 rows;
    /// calibration runs once, on the first step with exposure, and is checkpointed, so a
    /// run resumed after it continues bit for bit; calibration measures times, so two
    /// separate runs may choose different lossy plans), `store`, `recompute` (per-layer
    /// gradient checkpointing) or `compress-<codec>`: exact and reproducible.
    #[arg(long, default_value = "hilore", help_heading = "Actor update")]
    policy: String,
    /// With --policy hilore: fold every microbatch's measured recompute and codec times
    /// into the cost model (tracks drift, e.g. contention). Trades bit-exact --resume and
    /// seed-for-seed reproducibility for adaptivity: later plans then depend on wall-clock
    /// times. Off: plans depend only on the calibration and the step's data.
    #[arg(long, help_heading = "Actor update")]
    refresh_costs: bool,
    /// With --policy hilore: the target relative L2 error of each step's gradient, which
    /// sets the allocator's risk budget (default 1e-2; 0 allows exact plans only: store
    /// and recompute). `hilore compare --arms hilore@3e-3,...` runs several.
    #[arg(long, value_name = "REL_L2", help_heading = "Actor update")]
    target_rel_l2: Option<f64>,
    /// Most tokens (rows) per microbatch; one sequence must fit.
    #[arg(long, default_value_t = 1024, help_heading = "Actor update")]
    token_budget: usize,
    /// Skip the forward and backward of sequences with zero exposure (advantage 0 with
    /// beta 0: exactly zero gradient); they are counted separately in the log.
    #[arg(long, help_heading = "Actor update")]
    skip_zero_exposure: bool,

    // ----- run
    #[arg(long, default_value_t = 0, help_heading = "Run")]
    seed: u64,
    /// Append one JSON object per GRPO step to FILE.
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    metrics: Option<PathBuf>,
    /// Write a JSON summary of the run to FILE.
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    summary: Option<PathBuf>,
    /// Checkpoint file (weights, optimizer, RNG state, step), written atomically.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "hilore-train.ckpt",
        help_heading = "Run"
    )]
    checkpoint: PathBuf,
    /// Write the checkpoint every N GRPO steps (and after the warm start and at the end).
    #[arg(long, default_value_t = 10, help_heading = "Run")]
    checkpoint_every: usize,
    /// Continue from --checkpoint (same settings required; --steps may grow).
    #[arg(long, help_heading = "Run")]
    resume: bool,
    /// Start a new run even where --checkpoint, --metrics, --summary or --out already
    /// hold an earlier run's files, replacing them (without it, and without --resume, the
    /// run stops before doing anything and names them).
    #[arg(long, help_heading = "Run", conflicts_with = "resume")]
    force: bool,
    /// Stop after GRPO step N, after writing the checkpoint, as an interrupted run would.
    #[arg(long, value_name = "N", help_heading = "Run")]
    stop_after: Option<usize>,
    /// After the last GRPO step, write the trained policy to DIR as a Hugging Face model
    /// directory (config.json, model.safetensors in f32 with the same tensor names and,
    /// with --model, the model's tokenizer.json).
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long, help_heading = "Run")]
    no_progress: bool,
    /// The flags given on the command line (clap ids), which a --grpo-config leaves alone.
    #[arg(skip)]
    pub explicit: Vec<String>,
    /// No log lines on stdout (set by callers that run several trainings at once).
    #[arg(skip)]
    pub quiet: bool,
}

/// The ids of the flags in `m` given on the command line (not defaults): what a
/// `--grpo-config` leaves alone.
pub fn explicit_ids(m: &clap::ArgMatches) -> Vec<String> {
    m.ids()
        .filter(|id| m.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
        .map(|id| id.to_string())
        .collect()
}

/// `hilore train`'s arguments parsed from `argv` (the flags after `train`) as the command
/// line parses them, negative numbers taken as values, with [`TrainArgs::explicit`] set:
/// how `hilore compare` and a caller's own driver start trainings in-process.
pub fn parse_args(argv: &[String]) -> anyhow::Result<TrainArgs> {
    use clap::FromArgMatches;
    let cmd = TrainArgs::augment_args(clap::Command::new("train").no_binary_name(true))
        .allow_negative_numbers(true);
    let m = cmd
        .try_get_matches_from(argv)
        .map_err(|e| anyhow::anyhow!("hilore train {}: {}", argv.join(" "), e.render()))?;
    let mut a = TrainArgs::from_arg_matches(&m)?;
    a.explicit = explicit_ids(&m);
    Ok(a)
}

impl TrainArgs {
    /// The task's name: --task, else `jsonl` when a dataset or a zoo model is given.
    fn task_name(&self) -> String {
        match &self.task {
            Some(t) => t.clone(),
            None if self.data.is_some() || self.model.is_some() => "jsonl".into(),
            None => "arithmetic".into(),
        }
    }

    /// The warm start's most steps: --sft-steps, else 2000 (built-in) or 0 (--model).
    fn sft_steps(&self) -> usize {
        self.sft_steps
            .unwrap_or(if self.model.is_some() { 0 } else { 2000 })
    }
}

/// Everything that fixes the run's trajectory; stored in checkpoints and compared on
/// resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct RunSettings {
    task: TaskSpec,
    heldout: usize,
    eval_samples: usize,
    model: DecoderConfig,
    /// The zoo model directory the run started from (absent for a random init).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_dir: Option<PathBuf>,
    tokenizer: String,
    sft_steps: usize,
    sft_target_loss: f64,
    sft_batch: usize,
    sft_lr: f64,
    prompts: usize,
    group_size: usize,
    grpo: GrpoConfig,
    /// TRL's `gradient_accumulation_steps` and `steps_per_generation` (1 and 1, absent,
    /// in checkpoints written before they existed).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    gradient_accumulation_steps: usize,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    steps_per_generation: usize,
    /// `--reward-weights` (absent: the task's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reward_weights: Option<[f32; 2]>,
    adamw: AdamWConfig,
    temperature: f64,
    top_p: f64,
    max_new_tokens: usize,
    policy: String,
    /// `--refresh-costs` (absent when off, as in checkpoints written before it existed).
    #[serde(default, skip_serializing_if = "is_false")]
    refresh_costs: bool,
    /// `--target-rel-l2` (absent at the default, as in checkpoints written before it
    /// existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    target_rel_l2: Option<f64>,
    token_budget: usize,
    skip_zero_exposure: bool,
    seed: u64,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// The training state a checkpoint carries besides tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainState {
    /// GRPO steps completed.
    step: usize,
    /// Counter-based RNG: every stream is keyed by this seed and a step.
    rng: RngState,
    /// Optimizer steps taken.
    adam_t: u64,
    warm_start: WarmStart,
    /// Held-out results after the warm start.
    before: EvalReport,
    /// Wall time of all processes of this run so far.
    seconds_total: f64,
    /// `--policy hilore`: the allocator's state ([`OnlineAllocator::state`], floats as
    /// bits: see [`checkpoint::floats_to_bits`]). Absent in checkpoints of other policies
    /// and of versions before it was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    allocator: Option<serde_json::Value>,
    /// Totals over the GRPO steps taken so far by every process of the run, so that a
    /// resumed run's summary is an uninterrupted one's (zero in checkpoints written
    /// before they were stored).
    #[serde(default)]
    totals: RunTotals,
}

/// Per-run totals of the GRPO steps (see [`TrainState::totals`]); the last step's reward
/// and accuracy as `f64` bits, so they survive the JSON text exactly.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct RunTotals {
    steps: usize,
    rollout_tokens_per_s_sum: f64,
    update_tokens_per_s_sum: f64,
    peak_activation_bytes: usize,
    instances_store: usize,
    instances_compress: usize,
    instances_recompute: usize,
    final_reward_mean_bits: Option<u64>,
    final_accuracy_bits: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RngState {
    kind: String,
    seed: u64,
    next_step: usize,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct WarmStart {
    steps: usize,
    /// NaN (JSON null) when the warm start ran no step.
    #[serde(deserialize_with = "nan_if_null")]
    final_loss: f64,
    seconds: f64,
    tokens_per_s: f64,
}

/// An `f64` that JSON stores as null when it is NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One `--metrics` line.
#[derive(Debug, Clone, Serialize)]
struct StepMetrics {
    step: usize,
    reward_mean: f64,
    accuracy: f64,
    response_len_mean: f64,
    kl: f64,
    clip_fraction: f64,
    loss: f64,
    grad_norm: f64,
    exposure_total: f64,
    exposure_max_microbatch: f64,
    zero_exposure_sequences: usize,
    /// Optimizer steps of this GRPO step (epochs x steps per rollout).
    optimizer_steps: usize,
    /// Microbatches the allocator planned before their forward (`--policy hilore`).
    planned_microbatches: usize,
    skipped_sequences: usize,
    skipped_tokens: usize,
    empty_sequences: usize,
    microbatches: usize,
    update_tokens: usize,
    rollout_tokens: usize,
    peak_activation_bytes: usize,
    optimizer_state_bytes: usize,
    logp_mismatch_max: f64,
    rollout_seconds: f64,
    rollout_tokens_per_s: f64,
    update_seconds: f64,
    update_tokens_per_s: f64,
    reference_seconds: f64,
    step_seconds: f64,
    /// Unit instances of the step's microbatches (all epochs) that were stored,
    /// compressed and recomputed (inside a recomputed instance counts as recomputed).
    instances_store: usize,
    instances_compress: usize,
    instances_recompute: usize,
}

/// The `--summary` object.
#[derive(Debug, Serialize)]
struct Summary {
    task: String,
    /// The zoo model directory trained (absent for a random init).
    model_dir: Option<String>,
    tokenizer: String,
    /// Where --out wrote the trained weights.
    exported_to: Option<String>,
    model_params: usize,
    policy: String,
    seed: u64,
    steps: usize,
    resumed_from_step: Option<usize>,
    /// Wall time of this process.
    seconds: f64,
    /// Wall time of every process of this run.
    seconds_total: f64,
    warm_start_steps: usize,
    warm_start_loss: f64,
    warm_start_seconds: f64,
    heldout_prompts: usize,
    /// Sampled accuracy on the held-out set (rollout temperature) after the warm start.
    heldout_accuracy_before: f64,
    /// The same after GRPO.
    heldout_accuracy_after: f64,
    heldout_greedy_accuracy_before: f64,
    heldout_greedy_accuracy_after: f64,
    heldout_reward_mean_before: f64,
    heldout_reward_mean_after: f64,
    final_reward_mean: Option<f64>,
    final_accuracy: Option<f64>,
    rollout_tokens_per_s: f64,
    update_tokens_per_s: f64,
    peak_activation_bytes: usize,
    optimizer_state_bytes: usize,
    /// Unit instances per GRPO step (mean over the run's steps, every process's) that
    /// were stored, compressed and recomputed.
    instances_per_step: InstanceMeans,
    /// Everything that fixed the run's trajectory (flags and a --grpo-config resolved).
    settings: RunSettings,
}

/// Mean unit instances per step by fidelity.
#[derive(Debug, Default, Serialize)]
struct InstanceMeans {
    store: f64,
    compress: f64,
    recompute: f64,
}

/// Decay of the warm start's loss moving average (about the last 10 steps).
const SFT_EMA: f64 = 0.9;
/// The warm start runs at least this many steps before its target loss can stop it.
const SFT_MIN_STEPS: usize = 20;

fn stream_seed(seed: u64, name: &str) -> u64 {
    SplitMix64::for_stream(seed, name).next_u64()
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
    fn from_args(
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
            seed: a.seed,
        })
    }

    fn sampling(&self, seed: u64, stop_token: u32) -> SamplingConfig {
        SamplingConfig {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            stop_token: Some(stop_token),
            seed,
        }
    }

    fn sft_adamw(&self) -> AdamWConfig {
        AdamWConfig {
            lr: self.sft_lr,
            weight_decay: 0.0,
            ..self.adamw
        }
    }
}

fn spec_of(a: &TrainArgs) -> TaskSpec {
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
fn json_diff(a: &serde_json::Value, b: &serde_json::Value, path: &str, out: &mut Vec<String>) {
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

/// Draws the examples of one phase's step: `n` examples from the streams
/// `(seed, "{phase}-{step}-{i}")`, redrawing procedural prompts that are held out.
fn draw_examples(
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

/// A progress bar of `len` items (hidden unless `enabled`), as every long loop shows it.
pub(crate) fn bar(len: usize, enabled: bool, prefix: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed}, eta {eta})",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(prefix.to_string());
    pb
}

fn params_to_tensors(prefix: &str, model: &Decoder) -> anyhow::Result<Vec<NamedTensor>> {
    model
        .named_params()
        .into_iter()
        .map(|(name, v)| {
            Ok(NamedTensor {
                name: format!("{prefix}/{name}"),
                shape: v.dims().to_vec(),
                data: v.tensor().flatten_all()?.to_vec1::<f32>()?,
            })
        })
        .collect()
}

fn model_from_checkpoint(
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

struct Run {
    settings: RunSettings,
    state: TrainState,
    model: Decoder,
    reference: Decoder,
    opt: AdamW,
    /// `--policy hilore`'s allocator (its state is checkpointed).
    allocator: Option<Rc<RefCell<OnlineAllocator>>>,
}

/// The codecs `--policy hilore` offers (and `hilore bench`'s knapsack policies, by
/// default).
pub(crate) const HILORE_CODECS: [&str; 4] = ["bf16", "fp8-e4m3-b32", "int8-b32", "int4-g32"];

/// `--policy hilore`'s allocator for a model of `num_params` parameters (`None` for the
/// other policies).
fn new_allocator(
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
        let mut tensors = params_to_tensors("model", &self.model)?;
        tensors.extend(params_to_tensors("reference", &self.reference)?);
        for (name, m, v) in &self.opt.state {
            let shape = vec![m.len()];
            tensors.push(NamedTensor {
                name: format!("adam.m/{name}"),
                shape: shape.clone(),
                data: m.clone(),
            });
            tensors.push(NamedTensor {
                name: format!("adam.v/{name}"),
                shape,
                data: v.clone(),
            });
        }
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
            bail!(
                "cannot resume from {}: it was written with other settings ({}); pass the same flags as the run that wrote it",
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
        for (name, m, v) in &mut opt.state {
            *m = ck.tensor(&format!("adam.m/{name}"))?.data.clone();
            *v = ck.tensor(&format!("adam.v/{name}"))?.data.clone();
        }
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

/// Keeps the metrics lines of steps `<= step` (a resumed run rewrites what came after).
fn truncate_metrics(path: &Path, step: usize) -> anyhow::Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_some_and(|s| s as usize <= step)
        })
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    hilore_models::atomic::write_bytes_atomic(path, out.as_bytes())
        .with_context(|| format!("rewriting metrics {}", path.display()))
}

/// Checks what a run would allocate against this machine's memory before anything is:
/// the training state (weights, the reference policy, gradients and AdamW's two moments:
/// five `f32` copies of the parameters) and the step's rollout (every response's tokens
/// and key/value cache, a lower bound), with the size asked for, the limit and the fix.
fn check_sizes(a: &TrainArgs, model: &DecoderConfig, max_new_tokens: usize) -> anyhow::Result<()> {
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
fn earlier_outputs(args: &TrainArgs) -> Vec<String> {
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
    // Outputs that could never be written are refused before any work.
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
        let found = earlier_outputs(&args);
        if !found.is_empty() {
            bail!(
                "an earlier run's files are in the way: {}; pass --resume to continue that run, --force to start over and replace them, or other paths",
                found.join(", ")
            );
        }
    }
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
        let t = Instant::now();
        let mut sft_opt = AdamW::new(settings.sft_adamw(), &model);
        let pb = bar(settings.sft_steps, progress, "warm start");
        let (mut final_loss, mut tokens, mut steps) = (f64::NAN, 0usize, 0usize);
        let mut ema = f64::NAN;
        for s in 0..settings.sft_steps {
            let exs = draw_examples(
                &task,
                settings.seed,
                "sft",
                s,
                settings.sft_batch,
                &heldout_prompts,
            )?;
            let r = sft::sft_step(
                &mut model,
                &mut sft_opt,
                &tokenizer,
                &exs,
                settings.token_budget,
                &plan,
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
        say!(
            "warm start: {} steps, loss {:.4} (moving average; last step {final_loss:.4}), {:.1}s ({:.0} tok/s)",
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
    let pb = bar(total_steps, progress, "grpo");
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
        let m = StepMetrics {
            step: run.state.step,
            reward_mean: ro.reward_mean(),
            accuracy: ro.accuracy(),
            response_len_mean: ro.response_len_mean(),
            kl: rep.stats.kl_mean(),
            clip_fraction: rep.stats.clip_fraction(),
            loss: rep.stats.loss / rep.optimizer_steps.max(1) as f64,
            grad_norm: rep.grad_norm,
            exposure_total: rep.exposure_total,
            exposure_max_microbatch: rep.exposure_max_microbatch,
            zero_exposure_sequences: rep.zero_exposure_sequences,
            skipped_sequences: rep.skipped_sequences,
            skipped_tokens: rep.skipped_tokens,
            empty_sequences: rep.empty_sequences,
            microbatches: rep.microbatches,
            optimizer_steps: rep.optimizer_steps,
            planned_microbatches: rep.planned_microbatches,
            update_tokens: rep.update_tokens,
            rollout_tokens: ro.generated_tokens(),
            peak_activation_bytes: rep.peak_activation_bytes,
            optimizer_state_bytes: run.opt.optimizer_state_bytes(),
            logp_mismatch_max: rep.logp_mismatch_max,
            rollout_seconds: ro.seconds,
            rollout_tokens_per_s: ro.generated_tokens() as f64 / ro.seconds.max(1e-9),
            update_seconds: rep.seconds,
            update_tokens_per_s: rep.update_tokens as f64 / rep.seconds.max(1e-9),
            reference_seconds: rep.reference_seconds,
            step_seconds: t_step.elapsed().as_secs_f64(),
            instances_store: rep.fidelities.store,
            instances_compress: rep.fidelities.compress,
            instances_recompute: rep.fidelities.recompute,
        };
        {
            let t = &mut run.state.totals;
            t.steps += 1;
            t.instances_store += m.instances_store;
            t.instances_compress += m.instances_compress;
            t.instances_recompute += m.instances_recompute;
            t.rollout_tokens_per_s_sum += m.rollout_tokens_per_s;
            t.update_tokens_per_s_sum += m.update_tokens_per_s;
            t.peak_activation_bytes = t.peak_activation_bytes.max(m.peak_activation_bytes);
            t.final_reward_mean_bits = Some(m.reward_mean.to_bits());
            t.final_accuracy_bits = Some(m.accuracy.to_bits());
        }
        let line = format!(
            "step {:>4}/{total_steps}  reward {:.3}  acc {:.3}  len {:.2}  kl {:.4}  clip {:.3}  |g| {:.3}  rollout {:>6.0} tok/s  update {:>6.0} tok/s  peak act {}  units s/c/r {}/{}/{}{}",
            m.step,
            m.reward_mean,
            m.accuracy,
            m.response_len_mean,
            m.kl,
            m.clip_fraction,
            m.grad_norm,
            m.rollout_tokens_per_s,
            m.update_tokens_per_s,
            human_bytes(m.peak_activation_bytes),
            m.instances_store,
            m.instances_compress,
            m.instances_recompute,
            if settings.skip_zero_exposure {
                format!("  skipped {} seq / {} tok", m.skipped_sequences, m.skipped_tokens)
            } else {
                format!("  zero-exposure {} seq", m.zero_exposure_sequences)
            }
        );
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

/// The tokenizer of a zoo model directory and its config: `tokenizer.json` is required,
/// and the stop token is the config's `eos_token_id` (the first, if a list), else the
/// tokenizer's `</s>`-style end token.
fn zoo_tokenizer(dir: &Path) -> anyhow::Result<(TrainTokenizer, DecoderConfig)> {
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
fn model_copy(model: &Decoder, cfg: &DecoderConfig) -> anyhow::Result<Decoder> {
    let map: HashMap<String, Tensor> = model
        .named_params()
        .into_iter()
        .map(|(n, v)| Ok((n, v.tensor().copy()?)))
        .collect::<anyhow::Result<_>>()?;
    Ok(Decoder::from_tensors(cfg, &map)?)
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

/// Sets the flags a TRL config's keys name, except those given on the command line;
/// returns the flags set. The rollout's prompts follow TRL's generation batch,
/// `per_device_train_batch_size x steps_per_generation` sequences (or
/// `generation_batch_size`), when the file gives either.
fn apply_trl_config(
    a: &mut TrainArgs,
    s: &hilore_runtime::grpo::trl::TrlSettings,
) -> anyhow::Result<Vec<String>> {
    let mut t = Taker {
        given: &s.given,
        explicit: a.explicit.clone(),
        set: Vec::new(),
    };
    let given = |k: &str| s.given.iter().any(|g| g == k);
    let g = &s.grpo;
    if t.take("loss_type", "loss_type") {
        a.loss_type = g.loss_type().to_string();
    }
    if t.take("scale_rewards", "scale_rewards") {
        a.scale_rewards = g.advantage_norm.to_string();
    }
    if t.take("epsilon", "epsilon") {
        a.epsilon = g.eps_low;
    }
    if t.take("epsilon_high", "epsilon_high") {
        a.epsilon_high = Some(g.eps_high);
    }
    if t.take("delta", "delta") {
        a.delta = g.delta;
    }
    if t.take("beta", "beta") {
        a.beta = g.beta;
    }
    if t.take("use_bias_correction_kl", "use_bias_correction_kl") {
        a.use_bias_correction_kl = g.kl_bias_correction;
    }
    if t.take("importance_sampling_level", "importance_sampling_level") {
        a.importance_sampling_level = g.importance_sampling.to_string();
    }
    if t.take("mask_truncated_completions", "mask_truncated_completions") {
        a.mask_truncated_completions = g.mask_truncated_completions;
    }
    if t.take("num_iterations", "epochs") {
        a.epochs = g.epochs;
    }
    if let grpo::Surrogate::Sapo {
        temperature_pos,
        temperature_neg,
    } = g.surrogate
    {
        if t.take("sapo_temperature_pos", "sapo_temperature_pos") {
            a.sapo_temperature_pos = temperature_pos;
        }
        if t.take("sapo_temperature_neg", "sapo_temperature_neg") {
            a.sapo_temperature_neg = temperature_neg;
        }
    }
    if t.take("num_generations", "group_size") {
        a.group_size = s.num_generations;
    }
    if t.take("max_completion_length", "max_new_tokens") {
        a.max_new_tokens = Some(s.max_completion_length);
    }
    if t.take("temperature", "temperature") {
        a.temperature = s.temperature;
    }
    if t.take("top_p", "top_p") {
        a.top_p = s.top_p;
    }
    if t.take("reward_weights", "reward_weights") {
        if let Some(w) = &s.reward_weights {
            if w.len() != 2 {
                bail!(
                    "reward_weights has {} entries; the tasks score two reward functions, `correct` and `format`",
                    w.len()
                );
            }
            a.reward_weights = Some(format!("{},{}", w[0], w[1]));
        }
    }
    if t.take("gradient_accumulation_steps", "gradient_accumulation_steps") {
        a.gradient_accumulation_steps = s.gradient_accumulation_steps;
    }
    let batch = s.per_device_train_batch_size;
    if given("steps_per_generation") || given("generation_batch_size") {
        let spg = match (s.steps_per_generation, s.generation_batch_size) {
            (Some(spg), _) => spg,
            (None, Some(gbs)) => {
                let b = batch.unwrap_or(8);
                if gbs % b != 0 {
                    bail!(
                        "generation_batch_size ({gbs}) must be a multiple of per_device_train_batch_size ({b})"
                    );
                }
                gbs / b
            }
            (None, None) => a.gradient_accumulation_steps,
        };
        if t.take("steps_per_generation", "steps_per_generation")
            || t.take("generation_batch_size", "steps_per_generation")
        {
            a.steps_per_generation = Some(spg);
        }
    }
    if batch.is_some() || s.generation_batch_size.is_some() {
        let spg = a
            .steps_per_generation
            .unwrap_or(a.gradient_accumulation_steps);
        let sequences = s.generation_batch_size.unwrap_or(batch.unwrap_or(8) * spg);
        if t.explicit.iter().any(|e| e == "prompts") {
            if a.prompts * a.group_size != sequences {
                bail!(
                    "--prompts {} x --group-size {} is {} sequences, but the file's generation batch (per_device_train_batch_size x steps_per_generation, or generation_batch_size) is {sequences}; drop --prompts or make them agree",
                    a.prompts,
                    a.group_size,
                    a.prompts * a.group_size
                );
            }
        } else {
            if sequences % a.group_size != 0 {
                bail!(
                    "the generation batch of {sequences} sequences (per_device_train_batch_size x steps_per_generation) is not a whole number of groups of num_generations = {}",
                    a.group_size
                );
            }
            a.prompts = sequences / a.group_size;
            t.set.push("--prompts".into());
        }
    }
    if let (true, Some(v)) = (t.take("learning_rate", "lr"), s.learning_rate) {
        a.lr = v;
    }
    if let (true, Some(v)) = (t.take("max_grad_norm", "max_grad_norm"), s.max_grad_norm) {
        a.max_grad_norm = v;
    }
    if let (true, Some(v)) = (t.take("weight_decay", "weight_decay"), s.weight_decay) {
        a.weight_decay = v;
    }
    if let (true, Some(v)) = (t.take("adam_beta1", "adam_beta1"), s.adam_beta1) {
        a.adam_beta1 = v;
    }
    if let (true, Some(v)) = (t.take("adam_beta2", "adam_beta2"), s.adam_beta2) {
        a.adam_beta2 = v;
    }
    if let (true, Some(v)) = (t.take("adam_epsilon", "adam_epsilon"), s.adam_epsilon) {
        a.adam_epsilon = v;
    }
    if let (true, Some(v)) = (t.take("seed", "seed"), s.seed) {
        a.seed = v;
    }
    if let Some(m) = s.max_steps.filter(|&m| m > 0) {
        if t.take("max_steps", "steps") {
            a.steps = m as usize;
        }
    }
    Ok(t.set)
}

/// Which flags a TRL config may set: the keys it gives, less the flags given on the
/// command line; records the flags it set.
struct Taker<'a> {
    given: &'a [String],
    explicit: Vec<String>,
    set: Vec<String>,
}

impl Taker<'_> {
    /// Whether the file's `key` sets the flag with clap id `id` (and records it).
    fn take(&mut self, key: &str, id: &str) -> bool {
        let yes = self.given.iter().any(|g| g == key) && !self.explicit.iter().any(|e| e == id);
        if yes {
            self.set.push(format!("--{}", id.replace('_', "-")));
        }
        yes
    }
}
