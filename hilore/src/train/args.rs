//! `hilore train`'s command line: the flags, how `compare` and a caller parse them, and
//! what a TRL config file sets.

use anyhow::bail;
use clap::Args;
use hilore_runtime::grpo;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct TrainArgs {
    // ----- task
    /// The task: `arithmetic`, `countdown`, or `jsonl` (a dataset given by --data).
    /// Default: `jsonl` when --data or --model is given, else `arithmetic`.
    #[arg(long, help_heading = "Task")]
    pub(super) task: Option<String>,
    /// Arithmetic: digits per operand.
    #[arg(long, default_value_t = 2, help_heading = "Task")]
    pub(super) digits: usize,
    /// Arithmetic: operators to draw from (any of `+-*`).
    #[arg(long, default_value = "+", help_heading = "Task")]
    pub(super) ops: String,
    /// Countdown: how many numbers per problem.
    #[arg(long, default_value_t = 3, help_heading = "Task")]
    pub(super) numbers: usize,
    /// Countdown: numbers are drawn from 1..=N.
    #[arg(long, default_value_t = 9, help_heading = "Task")]
    pub(super) max_number: u32,
    /// JSONL dataset: one `{"prompt": ..., "answer": ...}` object per line; the reward
    /// compares GSM8K-style final answers (`#### 42`, else the last number).
    #[arg(long, value_name = "FILE", help_heading = "Task")]
    pub(super) data: Option<PathBuf>,
    /// JSONL held-out set (default: the last --heldout lines of --data).
    #[arg(long, value_name = "FILE", help_heading = "Task")]
    pub(super) heldout_data: Option<PathBuf>,
    /// Held-out prompts (procedural tasks never train on them).
    #[arg(long, default_value_t = 400, help_heading = "Task")]
    pub(super) heldout: usize,
    /// Sampled responses per held-out prompt for the sampled accuracy.
    #[arg(long, default_value_t = 2, help_heading = "Task")]
    pub(super) eval_samples: usize,

    // ----- model
    /// A Hugging Face / candle-zoo model directory (config.json, model.safetensors or a
    /// sharded index, tokenizer.json) to train instead of a random init: prompts and
    /// responses go through its tokenizer.json, generation stops at the config's
    /// `eos_token_id`, and the warm start is off unless --sft-steps is given. Needs a
    /// dataset task (--data FILE.jsonl).
    #[arg(long, value_name = "DIR", help_heading = "Model")]
    pub(super) model: Option<PathBuf>,
    /// An HF config.json for the policy (random init); default: a small decoder sized by
    /// the flags below, with the task tokenizer's vocabulary.
    #[arg(long, value_name = "FILE", help_heading = "Model")]
    pub(super) config: Option<PathBuf>,
    #[arg(long, default_value_t = 2, help_heading = "Model")]
    pub(super) layers: usize,
    #[arg(long, default_value_t = 64, help_heading = "Model")]
    pub(super) hidden: usize,
    #[arg(long, default_value_t = 4, help_heading = "Model")]
    pub(super) heads: usize,
    #[arg(long, default_value_t = 2, help_heading = "Model")]
    pub(super) kv_heads: usize,
    #[arg(long, default_value_t = 176, help_heading = "Model")]
    pub(super) intermediate: usize,

    // ----- warm start
    /// Most supervised warm-start steps (0: start GRPO from the initial weights).
    /// Default: 2000, or 0 with --model (a zoo model is already trained).
    #[arg(long, help_heading = "Warm start")]
    pub(super) sft_steps: Option<usize>,
    /// Stop the warm start once the moving average of its loss (nats per solution token)
    /// falls below this, so GRPO starts from a partly competent policy whatever the seed;
    /// 0 runs all --sft-steps.
    #[arg(long, default_value_t = 0.35, help_heading = "Warm start")]
    pub(super) sft_target_loss: f64,
    /// Examples per warm-start step.
    #[arg(long, default_value_t = 64, help_heading = "Warm start")]
    pub(super) sft_batch: usize,
    #[arg(long, default_value_t = 3e-3, help_heading = "Warm start")]
    pub(super) sft_lr: f64,

    // ----- GRPO
    /// GRPO steps (rollout + update).
    #[arg(long, default_value_t = 100, help_heading = "GRPO")]
    pub(super) steps: usize,
    /// Prompts per step (P); P x G sequences are TRL's generation batch
    /// (`per_device_train_batch_size` x `steps_per_generation`).
    #[arg(long, default_value_t = 32, help_heading = "GRPO")]
    pub(super) prompts: usize,
    /// Responses per prompt (G; TRL's `num_generations`, default 8 there too).
    #[arg(
        long,
        visible_alias = "num-generations",
        default_value_t = 8,
        help_heading = "GRPO"
    )]
    pub(super) group_size: usize,
    /// AdamW's learning rate (TRL's `learning_rate`; TRL's default 1e-6 is for
    /// pretrained LLMs, 2e-4 suits the small policies trained from scratch here).
    #[arg(
        long,
        visible_alias = "learning-rate",
        default_value_t = 2e-4,
        help_heading = "GRPO"
    )]
    pub(super) lr: f64,
    /// AdamW's first-moment decay (TRL's `adam_beta1`).
    #[arg(long, default_value_t = 0.9, help_heading = "GRPO")]
    pub(super) adam_beta1: f64,
    /// AdamW's second-moment decay (TRL's `adam_beta2`; its default 0.999 averages over
    /// about 1000 steps, longer than the runs here, so 0.99).
    #[arg(long, default_value_t = 0.99, help_heading = "GRPO")]
    pub(super) adam_beta2: f64,
    /// AdamW's epsilon (TRL's `adam_epsilon`).
    #[arg(long, default_value_t = 1e-8, help_heading = "GRPO")]
    pub(super) adam_epsilon: f64,
    /// Update epochs per rollout batch (mu; TRL's `num_iterations`); with 1 and --beta 0
    /// the first optimizer step's coefficients are known before the forward.
    #[arg(
        long,
        visible_alias = "num-iterations",
        default_value_t = 1,
        help_heading = "GRPO"
    )]
    pub(super) epochs: usize,
    /// Loss microbatches per optimizer step (TRL's `gradient_accumulation_steps`). With
    /// --steps-per-generation it cuts the rollout's prompts x group sequences as TRL
    /// cuts its generation batch: steps-per-generation microbatches of equal size,
    /// steps-per-generation / gradient-accumulation-steps optimizer steps per rollout
    /// and epoch. Only the loss's weights (bnpo, dr_grpo, grpo) and the number of
    /// optimizer steps depend on it; memory microbatches are packed by --token-budget.
    #[arg(long, default_value_t = 1, help_heading = "GRPO")]
    pub(super) gradient_accumulation_steps: usize,
    /// Loss microbatches per rollout (TRL's `steps_per_generation`; default:
    /// --gradient-accumulation-steps, one optimizer step per rollout and epoch, as TRL).
    #[arg(long, help_heading = "GRPO")]
    pub(super) steps_per_generation: Option<usize>,
    /// Weights of the task's reward functions `correct,format` (TRL's `reward_weights`,
    /// summed as its `sum_then_normalize`); default: the task's own, 1,0 (arithmetic,
    /// JSONL) or 0.9,0.1 (Countdown).
    #[arg(long, value_name = "W_CORRECT,W_FORMAT", help_heading = "GRPO")]
    pub(super) reward_weights: Option<String>,
    /// A TRL GRPOConfig file (YAML or JSON, as `trl grpo --config` takes): its keys set
    /// the GRPO flags they name (loss_type, beta, epsilon, num_generations,
    /// per_device_train_batch_size x steps_per_generation = prompts x group, ...), flags
    /// given on the command line win; see `hilore coefficients --help` for the keys read.
    #[arg(long, value_name = "FILE", help_heading = "GRPO")]
    pub(super) grpo_config: Option<PathBuf>,
    /// Lower clip range (TRL's `epsilon`): the ratio is clamped at 1 - epsilon.
    #[arg(long, alias = "eps-low", default_value_t = 0.2, help_heading = "GRPO")]
    pub(super) epsilon: f32,
    /// Upper clip range (TRL's `epsilon_high`; default: --epsilon, as TRL). 0.28 is
    /// DAPO's clip-higher.
    #[arg(
        long,
        alias = "eps-high",
        value_name = "EPSILON_HIGH",
        help_heading = "GRPO"
    )]
    pub(super) epsilon_high: Option<f32>,
    /// Weight of the k3 KL to the warm-start policy (TRL's `beta`).
    #[arg(long, default_value_t = 0.0, help_heading = "GRPO")]
    pub(super) beta: f32,
    /// Importance-weight the KL term by the ratio, `beta * rho * k3` (TRL's
    /// `use_bias_correction_kl`); `false` uses `beta * k3`.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL", help_heading = "GRPO")]
    pub(super) use_bias_correction_kl: bool,
    /// TRL's `scale_rewards`: `group` (divide by the group's standard deviation: GRPO),
    /// `batch` (by the batch's) or `none` (Dr. GRPO). Standard deviations are sample ones
    /// (n - 1), as TRL's.
    #[arg(
        long,
        alias = "adv-norm",
        default_value = "group",
        help_heading = "GRPO"
    )]
    pub(super) scale_rewards: String,
    /// Leave responses cut at --max-new-tokens (no end token) out of the loss (TRL's
    /// `mask_truncated_completions`); `grpo`'s mean over sequences still counts them.
    #[arg(long, help_heading = "GRPO")]
    pub(super) mask_truncated_completions: bool,
    /// Two-sided clipping (TRL's `delta`): a token with negative advantage and ratio
    /// above delta gets no gradient; must exceed 1 + --epsilon-high. Default: off.
    #[arg(long, help_heading = "GRPO")]
    pub(super) delta: Option<f32>,
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
    pub(super) loss_type: String,
    /// TRL's `importance_sampling_level`: `token` (a ratio per token: GRPO) or
    /// `sequence` (one per sequence, the geometric mean of its tokens': GSPO).
    #[arg(long, default_value = "token", help_heading = "GRPO")]
    pub(super) importance_sampling_level: String,
    /// SAPO's gate temperature where the advantage is positive (TRL's
    /// `sapo_temperature_pos`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    pub(super) sapo_temperature_pos: f32,
    /// SAPO's gate temperature elsewhere (TRL's `sapo_temperature_neg`).
    #[arg(long, default_value_t = 1.05, help_heading = "GRPO")]
    pub(super) sapo_temperature_neg: f32,
    /// Sampling temperature (TRL's `temperature`); the actor update's log-probs are
    /// taken at it too, `log_softmax(logits / T)`, as TRL trains on logits / T.
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    pub(super) temperature: f64,
    /// Nucleus sampling (TRL's `top_p`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    pub(super) top_p: f64,
    /// Most new tokens per response (TRL's `max_completion_length`; default: the task's
    /// longest solution + EOS, where TRL's is 512).
    #[arg(long, visible_alias = "max-completion-length", help_heading = "GRPO")]
    pub(super) max_new_tokens: Option<usize>,
    /// Gradient-norm clipping of each optimizer step (TRL's `max_grad_norm`).
    #[arg(long, default_value_t = 1.0, help_heading = "GRPO")]
    pub(super) max_grad_norm: f64,
    /// AdamW's decoupled weight decay (TRL's `weight_decay`).
    #[arg(long, default_value_t = 0.0, help_heading = "GRPO")]
    pub(super) weight_decay: f64,

    // ----- actor update
    /// Fidelity of the units in the actor update: `hilore` (the default: the allocator
    /// plans every microbatch from measured costs and the step's exposures under 1.10 x
    /// full recompute's peak; microbatches are padded to a multiple of 128 rows;
    /// calibration runs once, on the first step with exposure, and is checkpointed, so a
    /// run resumed after it continues bit for bit; calibration measures times, so two
    /// separate runs may choose different lossy plans), `store`, `recompute` (per-layer
    /// gradient checkpointing) or `compress-<codec>`: exact and reproducible.
    #[arg(long, default_value = "hilore", help_heading = "Actor update")]
    pub(super) policy: String,
    /// With --policy hilore: fold every microbatch's measured recompute and codec times
    /// into the cost model (tracks drift, e.g. contention). Trades bit-exact --resume and
    /// seed-for-seed reproducibility for adaptivity: later plans then depend on wall-clock
    /// times. Off: plans depend only on the calibration and the step's data.
    #[arg(long, help_heading = "Actor update")]
    pub(super) refresh_costs: bool,
    /// With --policy hilore: the target relative L2 error of each step's gradient, which
    /// sets the allocator's risk budget (default 1e-2; 0 allows exact plans only: store
    /// and recompute). `hilore compare --arms hilore@3e-3,...` runs several.
    #[arg(long, value_name = "REL_L2", help_heading = "Actor update")]
    pub(super) target_rel_l2: Option<f64>,
    /// Most tokens (rows) per microbatch; one sequence must fit.
    #[arg(long, default_value_t = 1024, help_heading = "Actor update")]
    pub(super) token_budget: usize,
    /// Skip the forward and backward of sequences with zero exposure (advantage 0 with
    /// beta 0: exactly zero gradient); they are counted separately in the log.
    #[arg(long, help_heading = "Actor update")]
    pub(super) skip_zero_exposure: bool,
    /// Shared prefixes, on by default: a microbatch holds each prompt once with the
    /// responses of it that it packs (they attend to the prompt's rows, the first response
    /// token is read from the prompt's last row), instead of a copy of the prompt per
    /// response. The same gradient up to float rounding from fewer rows; a prompt whose
    /// responses do not fit one microbatch is held again in the next.
    #[arg(
        long,
        overrides_with = "no_shared_prefix",
        help_heading = "Actor update"
    )]
    pub(super) shared_prefix: bool,
    /// Pack a copy of the prompt with every response instead of shared prefixes (the layout
    /// runs had before shared prefixes were the default; resuming their checkpoints needs
    /// it).
    #[arg(long, overrides_with = "shared_prefix", help_heading = "Actor update")]
    pub(super) no_shared_prefix: bool,

    // ----- run
    #[arg(long, default_value_t = 0, help_heading = "Run")]
    pub(super) seed: u64,
    /// Append one JSON object per GRPO step to FILE.
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub(super) metrics: Option<PathBuf>,
    /// Write a JSON summary of the run to FILE.
    #[arg(long, value_name = "FILE", help_heading = "Run")]
    pub(super) summary: Option<PathBuf>,
    /// Checkpoint file (weights, optimizer, RNG state, step), written atomically.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "hilore-train.ckpt",
        help_heading = "Run"
    )]
    pub(super) checkpoint: PathBuf,
    /// Write the checkpoint every N GRPO steps (and after the warm start and at the end).
    #[arg(long, default_value_t = 10, help_heading = "Run")]
    pub(super) checkpoint_every: usize,
    /// Continue from --checkpoint (same settings required; --steps may grow).
    #[arg(long, help_heading = "Run")]
    pub(super) resume: bool,
    /// Start a new run even where --checkpoint, --metrics, --summary or --out already
    /// hold an earlier run's files, replacing them (without it, and without --resume, the
    /// run stops before doing anything and names them).
    #[arg(long, help_heading = "Run", conflicts_with = "resume")]
    pub(super) force: bool,
    /// Stop after GRPO step N, after writing the checkpoint, as an interrupted run would.
    #[arg(long, value_name = "N", help_heading = "Run")]
    pub(super) stop_after: Option<usize>,
    /// After the last GRPO step, write the trained policy to DIR as a Hugging Face model
    /// directory (config.json, model.safetensors in f32 with the same tensor names and,
    /// with --model, the model's tokenizer.json).
    #[arg(long, value_name = "DIR", help_heading = "Run")]
    pub(super) out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long, help_heading = "Run")]
    pub(super) no_progress: bool,
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
    pub(super) fn task_name(&self) -> String {
        match &self.task {
            Some(t) => t.clone(),
            None if self.data.is_some() || self.model.is_some() => "jsonl".into(),
            None => "arithmetic".into(),
        }
    }

    /// The warm start's most steps: --sft-steps, else 2000 (built-in) or 0 (--model).
    pub(super) fn sft_steps(&self) -> usize {
        self.sft_steps
            .unwrap_or(if self.model.is_some() { 0 } else { 2000 })
    }
}

/// Sets the flags a TRL config's keys name, except those given on the command line;
/// returns the flags set. The rollout's prompts follow TRL's generation batch,
/// `per_device_train_batch_size x steps_per_generation` sequences (or
/// `generation_batch_size`), when the file gives either.
pub(super) fn apply_trl_config(
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
pub(super) struct Taker<'a> {
    pub(super) given: &'a [String],
    pub(super) explicit: Vec<String>,
    pub(super) set: Vec<String>,
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
