//! TRL's `GRPOConfig`, read from its own keys (a YAML or JSON file's mapping, as
//! `trl grpo --config` takes), and a batch's advantages and coefficients computed under it
//! ([`compute`]), so a user can put HiLoRe's numbers beside their TRL trainer's.
//!
//! Keys are TRL 1.16's names with its defaults. A key that changes the loss in a way
//! HiLoRe does not compute is an error naming it (e.g. `top_entropy_quantile` below 1); a
//! key of TRL's that does not touch the GRPO math (`output_dir`, `logging_steps`, ...) is
//! listed in [`TrlSettings::ignored`]; a key TRL does not have is an error with the
//! nearest name.

use super::{
    advantages, aggregation_weights_layout, known_before_forward, AdvantageNorm, Coefficients,
    GrpoConfig, ImportanceSampling, LossType, Sequences, StepLayout, Surrogate, TokenLogprobs,
};
use crate::{Error, Result};
use serde_json::Value;

/// Every field of TRL 1.16's `GRPOConfig` (with the `TrainingArguments` it extends).
pub const TRL_KEYS: &[&str] = &[
    "accelerator_config",
    "activation_checkpointing",
    "activation_checkpointing_kwargs",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "auto_find_batch_size",
    "average_tokens_across_devices",
    "batch_eval_metrics",
    "beta",
    "bf16",
    "bf16_full_eval",
    "cache_implementation",
    "cast_lm_head_to_fp32",
    "chat_template_kwargs",
    "data_seed",
    "dataloader_drop_last",
    "dataloader_in_order",
    "dataloader_multiprocessing_context",
    "dataloader_num_workers",
    "dataloader_persistent_workers",
    "dataloader_pin_memory",
    "dataloader_prefetch_factor",
    "ddp_backend",
    "ddp_broadcast_buffers",
    "ddp_bucket_cap_mb",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
    "ddp_timeout",
    "debug",
    "deepspeed",
    "delta",
    "disable_dropout",
    "disable_tqdm",
    "do_eval",
    "do_predict",
    "do_train",
    "ds3_gather_for_generation",
    "enable_jit_checkpoint",
    "entropy_coef",
    "entropy_coef_delta",
    "entropy_coef_max",
    "entropy_coef_min",
    "entropy_target",
    "epsilon",
    "epsilon_high",
    "eval_accumulation_steps",
    "eval_delay",
    "eval_do_concat_batches",
    "eval_on_start",
    "eval_steps",
    "eval_strategy",
    "eval_use_gather_object",
    "fp16",
    "fp16_full_eval",
    "fsdp",
    "fsdp_config",
    "full_determinism",
    "generation_batch_size",
    "generation_kwargs",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "gradient_checkpointing_kwargs",
    "greater_is_better",
    "hub_always_push",
    "hub_model_id",
    "hub_private_repo",
    "hub_revision",
    "hub_strategy",
    "hub_token",
    "ignore_data_skip",
    "importance_sampling_level",
    "include_for_metrics",
    "include_num_input_tokens_seen",
    "label_names",
    "label_smoothing_factor",
    "learning_rate",
    "length_column_name",
    "liger_kernel_config",
    "load_best_model_at_end",
    "local_rank",
    "log_completions",
    "log_completions_hub_repo",
    "log_level",
    "log_level_replica",
    "log_multimodal",
    "log_on_each_node",
    "log_unique_prompts",
    "logging_first_step",
    "logging_nan_inf_filter",
    "logging_steps",
    "logging_strategy",
    "loss_type",
    "lr_scheduler_kwargs",
    "lr_scheduler_type",
    "mask_truncated_completions",
    "max_completion_length",
    "max_grad_norm",
    "max_steps",
    "max_tool_calling_iterations",
    "metric_for_best_model",
    "min_p",
    "model_init_kwargs",
    "multi_objective_aggregation",
    "neftune_noise_alpha",
    "num_completions_to_print",
    "num_generations",
    "num_generations_eval",
    "num_iterations",
    "num_train_epochs",
    "off_policy_mask_threshold",
    "optim",
    "optim_args",
    "optim_target_modules",
    "output_dir",
    "pad_to_multiple_of",
    "parallelism_config",
    "per_device_eval_batch_size",
    "per_device_train_batch_size",
    "prediction_loss_only",
    "project",
    "push_to_hub",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "remove_unused_columns",
    "repetition_penalty",
    "report_to",
    "restore_callback_states_from_checkpoint",
    "resume_from_checkpoint",
    "reward_weights",
    "router_aux_loss_coef",
    "run_name",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "save_on_each_node",
    "save_only_model",
    "save_steps",
    "save_strategy",
    "save_total_limit",
    "scale_rewards",
    "seed",
    "shuffle_dataset",
    "skip_memory_metrics",
    "steps_per_generation",
    "sync_ref_model",
    "temperature",
    "tf32",
    "top_entropy_quantile",
    "top_k",
    "top_p",
    "torch_compile",
    "torch_compile_backend",
    "torch_compile_mode",
    "torch_empty_cache_steps",
    "trackio_bucket_id",
    "trackio_space_id",
    "trackio_static_space_id",
    "train_sampling_strategy",
    "transformers_continuous_batching_config",
    "trust_remote_code",
    "use_adaptive_entropy",
    "use_bias_correction_kl",
    "use_cache",
    "use_cpu",
    "use_liger_kernel",
    "use_transformers_continuous_batching",
    "use_transformers_paged",
    "use_vllm",
    "vespo_k_neg",
    "vespo_k_pos",
    "vespo_lambda_neg",
    "vespo_lambda_pos",
    "vllm_enable_sleep_mode",
    "vllm_gpu_memory_utilization",
    "vllm_group_port",
    "vllm_importance_sampling_cap",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_max_model_length",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_structured_outputs_regex",
    "vllm_tensor_parallel_size",
    "warmup_steps",
    "weight_decay",
];

/// The GRPO settings of a TRL config.
#[derive(Debug, Clone, PartialEq)]
pub struct TrlSettings {
    /// The loss: `loss_type`, `scale_rewards`, `epsilon`, `epsilon_high`, `delta`,
    /// `beta`, `use_bias_correction_kl`, `importance_sampling_level`,
    /// `mask_truncated_completions`, `num_iterations`, `sapo_temperature_pos/neg`.
    pub grpo: GrpoConfig,
    /// `num_generations` (G; TRL's default 8).
    pub num_generations: usize,
    /// `per_device_train_batch_size`, when given (TRL's default 8).
    pub per_device_train_batch_size: Option<usize>,
    /// `gradient_accumulation_steps` (default 1).
    pub gradient_accumulation_steps: usize,
    /// `steps_per_generation`, when given (TRL's default: `gradient_accumulation_steps`).
    pub steps_per_generation: Option<usize>,
    /// `generation_batch_size`, when given (excludes `steps_per_generation`).
    pub generation_batch_size: Option<usize>,
    /// `max_completion_length` (default 512; `dr_grpo`'s normaliser).
    pub max_completion_length: usize,
    /// `temperature` (default 1.0): sampling, and the training log-probs' `logits / T`.
    pub temperature: f64,
    /// `top_p` (default 1.0).
    pub top_p: f64,
    /// `reward_weights`, when given (default: 1 for every reward function).
    pub reward_weights: Option<Vec<f32>>,
    /// `learning_rate`, `max_grad_norm`, `weight_decay`, `seed`, `max_steps`, when given.
    pub learning_rate: Option<f64>,
    pub max_grad_norm: Option<f64>,
    pub weight_decay: Option<f64>,
    pub seed: Option<u64>,
    pub max_steps: Option<i64>,
    /// `adam_beta1`, `adam_beta2`, `adam_epsilon`, when given.
    pub adam_beta1: Option<f64>,
    pub adam_beta2: Option<f64>,
    pub adam_epsilon: Option<f64>,
    /// The TRL keys given that do not touch the GRPO math, in key order.
    pub ignored: Vec<String>,
    /// The keys given that HiLoRe reads (so a caller can tell a default from a choice).
    pub given: Vec<String>,
}

impl Default for TrlSettings {
    fn default() -> Self {
        TrlSettings {
            grpo: GrpoConfig::default(),
            num_generations: 8,
            per_device_train_batch_size: None,
            gradient_accumulation_steps: 1,
            steps_per_generation: None,
            generation_batch_size: None,
            max_completion_length: 512,
            temperature: 1.0,
            top_p: 1.0,
            reward_weights: None,
            learning_rate: None,
            max_grad_norm: None,
            weight_decay: None,
            seed: None,
            max_steps: None,
            adam_beta1: None,
            adam_beta2: None,
            adam_epsilon: None,
            ignored: Vec::new(),
            given: Vec::new(),
        }
    }
}

/// Keys HiLoRe reads.
const READ: &[&str] = &[
    "loss_type",
    "scale_rewards",
    "epsilon",
    "epsilon_high",
    "delta",
    "beta",
    "use_bias_correction_kl",
    "importance_sampling_level",
    "mask_truncated_completions",
    "num_iterations",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "num_generations",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "max_completion_length",
    "temperature",
    "top_p",
    "reward_weights",
    "learning_rate",
    "max_grad_norm",
    "weight_decay",
    "seed",
    "max_steps",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
];

/// Keys that change the loss or the sampling in ways HiLoRe does not compute, with the
/// value that leaves them off (TRL's default) and why.
const REFUSED: &[(&str, &str, &str)] = &[
    (
        "top_entropy_quantile",
        "1.0",
        "the high-entropy token mask is not implemented",
    ),
    (
        "off_policy_mask_threshold",
        "null",
        "off-policy sequence masking is not implemented",
    ),
    (
        "entropy_coef",
        "0.0",
        "the entropy bonus is not implemented",
    ),
    (
        "use_adaptive_entropy",
        "false",
        "the adaptive entropy bonus is not implemented",
    ),
    (
        "multi_objective_aggregation",
        "\"sum_then_normalize\"",
        "only sum_then_normalize is implemented",
    ),
    ("top_k", "0", "top-k sampling is not implemented (top_p is)"),
    (
        "min_p",
        "null",
        "min-p sampling is not implemented (top_p is)",
    ),
    (
        "repetition_penalty",
        "1.0",
        "a repetition penalty is not implemented",
    ),
    (
        "num_generations_eval",
        "null",
        "evaluation uses its own settings (`hilore train --eval-*`)",
    ),
];

fn is_off(key: &str, v: &Value) -> bool {
    match key {
        "top_entropy_quantile" | "repetition_penalty" => v.as_f64() == Some(1.0),
        "entropy_coef" | "top_k" => v.as_f64() == Some(0.0),
        "use_adaptive_entropy" => v.as_bool() == Some(false),
        "multi_objective_aggregation" => v.as_str() == Some("sum_then_normalize"),
        _ => v.is_null(),
    }
}

/// Levenshtein distance, for "did you mean".
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + (ca != cb) as usize)
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

impl TrlSettings {
    /// Reads a TRL config mapping (a YAML or JSON file's top level, already parsed);
    /// `source` names the file in errors.
    pub fn from_value(v: &Value, source: &str) -> Result<Self> {
        let map = v.as_object().ok_or_else(|| {
            Error::Tape(format!(
                "{source}: a TRL config is a mapping of GRPOConfig keys to values (e.g. `loss_type: dapo`), not {}",
                kind(v)
            ))
        })?;
        let mut s = TrlSettings::default();
        let bad = |key: &str, v: &Value, want: &str| {
            Error::Tape(format!("{source}: `{key}` is {v}; {want}"))
        };
        let f64_of = |key: &str, v: &Value| -> Result<f64> {
            v.as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| bad(key, v, "it must be a number"))
        };
        let count = |key: &str, v: &Value| -> Result<usize> {
            v.as_u64()
                .filter(|&x| x >= 1)
                .map(|x| x as usize)
                .ok_or_else(|| bad(key, v, "it must be a whole number of at least 1"))
        };
        let bool_of = |key: &str, v: &Value| -> Result<bool> {
            v.as_bool()
                .ok_or_else(|| bad(key, v, "it must be true or false"))
        };
        let mut loss_type = "dapo".to_string();
        let mut sapo = (1.0f32, 1.05f32);
        for (key, v) in map {
            if let Some(&(_, off, why)) = REFUSED.iter().find(|(k, _, _)| k == key) {
                if !is_off(key, v) {
                    return Err(Error::Tape(format!(
                        "{source}: `{key}: {v}` is not supported: {why}; remove it or set it to {off}"
                    )));
                }
                s.ignored.push(key.clone());
                continue;
            }
            if !READ.contains(&key.as_str()) {
                if TRL_KEYS.contains(&key.as_str()) {
                    s.ignored.push(key.clone());
                    continue;
                }
                let near = TRL_KEYS
                    .iter()
                    .min_by_key(|k| distance(k, key))
                    .filter(|k| distance(k, key) <= 3);
                return Err(Error::Tape(match near {
                    Some(k) => format!(
                        "{source}: `{key}` is not a key of TRL's GRPOConfig; did you mean `{k}`?"
                    ),
                    None => format!("{source}: `{key}` is not a key of TRL's GRPOConfig"),
                }));
            }
            s.given.push(key.clone());
            let g = &mut s.grpo;
            match key.as_str() {
                "loss_type" => {
                    loss_type = v
                        .as_str()
                        .ok_or_else(|| bad(key, v, "it must be a string such as \"dapo\""))?
                        .to_string()
                }
                "scale_rewards" => {
                    let name = match v {
                        Value::Bool(true) => "true".to_string(),
                        Value::Bool(false) => "false".to_string(),
                        Value::String(x) => x.clone(),
                        _ => return Err(bad(key, v, "use \"group\", \"batch\" or \"none\"")),
                    };
                    g.advantage_norm = AdvantageNorm::parse(&name)
                        .map_err(|e| Error::Tape(format!("{source}: `scale_rewards`: {e}")))?;
                }
                "epsilon" => g.eps_low = f64_of(key, v)? as f32,
                "epsilon_high" => {
                    if !v.is_null() {
                        g.eps_high = f64_of(key, v)? as f32
                    }
                }
                "delta" => {
                    g.delta = if v.is_null() {
                        None
                    } else {
                        Some(f64_of(key, v)? as f32)
                    }
                }
                "beta" => g.beta = f64_of(key, v)? as f32,
                "use_bias_correction_kl" => g.kl_bias_correction = bool_of(key, v)?,
                "importance_sampling_level" => {
                    g.importance_sampling = ImportanceSampling::parse(v.as_str().unwrap_or(""))
                        .map_err(|e| Error::Tape(format!("{source}: `{key}`: {e}")))?
                }
                "mask_truncated_completions" => g.mask_truncated_completions = bool_of(key, v)?,
                "num_iterations" => g.epochs = count(key, v)?,
                "sapo_temperature_pos" => sapo.0 = f64_of(key, v)? as f32,
                "sapo_temperature_neg" => sapo.1 = f64_of(key, v)? as f32,
                "num_generations" => s.num_generations = count(key, v)?,
                "per_device_train_batch_size" => {
                    s.per_device_train_batch_size = Some(count(key, v)?)
                }
                "gradient_accumulation_steps" => s.gradient_accumulation_steps = count(key, v)?,
                "steps_per_generation" => {
                    s.steps_per_generation = (!v.is_null()).then(|| count(key, v)).transpose()?
                }
                "generation_batch_size" => {
                    s.generation_batch_size = (!v.is_null()).then(|| count(key, v)).transpose()?
                }
                "max_completion_length" => s.max_completion_length = count(key, v)?,
                "temperature" => s.temperature = f64_of(key, v)?,
                "top_p" => s.top_p = f64_of(key, v)?,
                "reward_weights" => {
                    s.reward_weights = match v {
                        Value::Null => None,
                        Value::Array(xs) => Some(
                            xs.iter()
                                .map(|x| f64_of(key, x).map(|x| x as f32))
                                .collect::<Result<_>>()?,
                        ),
                        _ => {
                            return Err(bad(
                                key,
                                v,
                                "it must be a list of numbers, one per reward function",
                            ))
                        }
                    }
                }
                "learning_rate" => s.learning_rate = Some(f64_of(key, v)?),
                "adam_beta1" => s.adam_beta1 = Some(f64_of(key, v)?),
                "adam_beta2" => s.adam_beta2 = Some(f64_of(key, v)?),
                "adam_epsilon" => s.adam_epsilon = Some(f64_of(key, v)?),
                "max_grad_norm" => s.max_grad_norm = Some(f64_of(key, v)?),
                "weight_decay" => s.weight_decay = Some(f64_of(key, v)?),
                "seed" => {
                    s.seed = Some(
                        v.as_u64()
                            .ok_or_else(|| bad(key, v, "it must be a whole number >= 0"))?,
                    )
                }
                "max_steps" => {
                    s.max_steps =
                        Some(v.as_i64().ok_or_else(|| {
                            bad(key, v, "it must be a whole number (-1: no limit)")
                        })?)
                }
                _ => unreachable!("every key of READ is matched"),
            }
        }
        if !map.contains_key("epsilon_high") || map["epsilon_high"].is_null() {
            s.grpo.eps_high = s.grpo.eps_low;
        }
        if s.steps_per_generation.is_some() && s.generation_batch_size.is_some() {
            return Err(Error::Tape(format!(
                "{source}: `steps_per_generation` and `generation_batch_size` cannot both be set (TRL refuses it too); keep one"
            )));
        }
        let t = LossType::parse(&loss_type, s.max_completion_length)
            .map_err(|e| Error::Tape(format!("{source}: `loss_type`: {e}")))?;
        let t = match t.surrogate {
            Surrogate::Sapo { .. } => LossType {
                surrogate: Surrogate::Sapo {
                    temperature_pos: sapo.0,
                    temperature_neg: sapo.1,
                },
                ..t
            },
            _ => t,
        };
        s.grpo = s.grpo.with_loss_type(t);
        s.grpo
            .validate()
            .map_err(|e| Error::Tape(format!("{source}: {e}")))?;
        if s.temperature.is_nan() || s.temperature <= 0.0 {
            return Err(bad("temperature", &s.temperature.into(), "it must be > 0"));
        }
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(bad("top_p", &s.top_p.into(), "it must be in (0, 1]"));
        }
        Ok(s)
    }

    /// How a generation of `sequences` splits into loss microbatches and optimizer
    /// steps. `per_device_train_batch_size` defaults to the generation's sequences over
    /// `steps_per_generation` (TRL's 8 would have to match the batch anyway);
    /// `steps_per_generation` to `gradient_accumulation_steps`, as TRL.
    pub fn layout(&self, sequences: usize) -> Result<StepLayout> {
        let ga = self.gradient_accumulation_steps;
        let spg = match (self.steps_per_generation, self.generation_batch_size) {
            (Some(spg), _) => spg,
            (None, Some(gbs)) => {
                let b = self
                    .per_device_train_batch_size
                    .unwrap_or(sequences / ga.max(1));
                if b == 0 || gbs % b != 0 {
                    return Err(Error::Tape(format!(
                        "generation_batch_size ({gbs}) must be a multiple of per_device_train_batch_size ({b})"
                    )));
                }
                gbs / b
            }
            (None, None) => ga,
        };
        let layout = StepLayout::new(sequences, ga, spg)?;
        if let Some(b) = self.per_device_train_batch_size {
            if b != layout.batch_size {
                return Err(Error::Tape(format!(
                    "per_device_train_batch_size {b} x steps_per_generation {spg} is {} sequences, but the generation has {sequences}; make them agree",
                    b * spg
                )));
            }
        }
        Ok(layout)
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a mapping",
    }
}

/// One completion of a batch: its per-token log-probs under the current policy, the
/// sampling (old) policy and the reference, and whether it was cut at the length limit.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Completion {
    /// Under the current policy; may be absent for a completion outside the requested
    /// optimizer step (with several steps per generation).
    #[serde(default)]
    pub logps: Option<Vec<f32>>,
    /// Under the policy that sampled it (needed after the first optimizer step).
    #[serde(default)]
    pub old_logps: Option<Vec<f32>>,
    /// Under the reference policy (needed with `beta > 0`).
    #[serde(default)]
    pub ref_logps: Option<Vec<f32>>,
    /// Response tokens; required when `logps` is absent, else their count.
    #[serde(default)]
    pub length: Option<usize>,
    /// Cut at `max_completion_length` without an end token (for
    /// `mask_truncated_completions`).
    #[serde(default)]
    pub truncated: bool,
}

/// One prompt's group of completions and their rewards.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// One reward per completion, or one list per completion with a value per reward
    /// function (weighted by `reward_weights` and summed, TRL's `sum_then_normalize`).
    pub rewards: Vec<Value>,
    /// The group's completions, in generation order.
    pub completions: Vec<Completion>,
}

/// A batch for [`compute`]: a whole generation, prompt group after prompt group.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batch {
    /// TRL config keys; a config file given beside the batch replaces this.
    #[serde(default)]
    pub config: Option<Value>,
    /// The optimizer step since the generation: `iteration x steps_per_step + step`,
    /// 0-based (default 0: the policy that sampled).
    #[serde(default)]
    pub update: usize,
    /// The prompt groups.
    pub groups: Vec<Group>,
}

/// What [`compute`] gives per completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SequenceOut {
    pub group: usize,
    pub completion: usize,
    /// The weighted reward.
    pub reward: f32,
    pub advantage: f32,
    /// The aggregation weight of each of its tokens.
    pub weight: f32,
    /// The optimizer step (within the generation) that trains it.
    pub step: usize,
    /// `dL/dlogp` per token; `None` for a completion outside the requested step.
    pub coefficients: Option<Vec<f32>>,
}

/// The output of [`compute`].
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BatchOut {
    pub loss_type: String,
    pub importance_sampling_level: String,
    pub scale_rewards: String,
    pub update: usize,
    pub optimizer_steps_per_generation: usize,
    /// Whether these coefficients were known before the actor update's forward.
    pub known_before_forward: bool,
    pub sequences: Vec<SequenceOut>,
}

/// The advantages and coefficients of a batch under TRL settings: the update's
/// optimizer step's completions get coefficients (all of them when a generation is one
/// step).
pub fn compute(settings: &TrlSettings, batch: &Batch) -> Result<BatchOut> {
    let g_size = settings.num_generations;
    let mut rewards = Vec::new();
    let mut lengths = Vec::new();
    let mut truncated = Vec::new();
    let mut members = Vec::new();
    let mut n_funcs = None;
    for (gi, group) in batch.groups.iter().enumerate() {
        let at = |j: usize| format!("groups[{gi}].completions[{j}]");
        if group.completions.len() != g_size || group.rewards.len() != g_size {
            return Err(Error::Tape(format!(
                "groups[{gi}] has {} completions and {} rewards; num_generations is {g_size}, and every group needs that many of each",
                group.completions.len(),
                group.rewards.len()
            )));
        }
        for (j, (c, r)) in group.completions.iter().zip(&group.rewards).enumerate() {
            let per_func: Vec<f32> = match r {
                Value::Number(x) => vec![x.as_f64().unwrap_or(f64::NAN) as f32],
                Value::Array(xs) => xs
                    .iter()
                    .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
                    .collect(),
                _ => {
                    return Err(Error::Tape(format!(
                        "groups[{gi}].rewards[{j}] is {r}; a reward is a number or a list of numbers (one per reward function)"
                    )))
                }
            };
            if per_func.iter().any(|x| !x.is_finite()) {
                return Err(Error::Tape(format!(
                    "groups[{gi}].rewards[{j}] is {r}; rewards must be finite numbers"
                )));
            }
            match n_funcs {
                None => n_funcs = Some(per_func.len()),
                Some(n) if n != per_func.len() => {
                    return Err(Error::Tape(format!(
                        "groups[{gi}].rewards[{j}] has {} values, earlier rewards {n}; give every completion one value per reward function",
                        per_func.len()
                    )))
                }
                _ => {}
            }
            let weights = match &settings.reward_weights {
                Some(w) if w.len() != per_func.len() => {
                    return Err(Error::Tape(format!(
                        "reward_weights has {} entries for {} reward functions",
                        w.len(),
                        per_func.len()
                    )))
                }
                Some(w) => w.clone(),
                None => vec![1.0; per_func.len()],
            };
            // TRL: (rewards_per_func * weights).nansum(dim=1), in float32.
            rewards.push(
                per_func
                    .iter()
                    .zip(&weights)
                    .fold(0.0f32, |s, (&r, &w)| s + r * w),
            );
            let len = match (&c.logps, c.length) {
                (Some(l), Some(n)) if l.len() != n => {
                    return Err(Error::Tape(format!(
                        "{}: length is {n} but logps has {} entries",
                        at(j),
                        l.len()
                    )))
                }
                (Some(l), _) => l.len(),
                (None, Some(n)) => n,
                (None, None) => {
                    return Err(Error::Tape(format!(
                        "{}: give its per-token `logps` (or its `length` when it is outside the requested update's step)",
                        at(j)
                    )))
                }
            };
            for (what, v) in [("old_logps", &c.old_logps), ("ref_logps", &c.ref_logps)] {
                if let Some(v) = v {
                    if v.len() != len {
                        return Err(Error::Tape(format!(
                            "{}: {what} has {} entries for {len} tokens",
                            at(j),
                            v.len()
                        )));
                    }
                }
            }
            lengths.push(len);
            truncated.push(c.truncated);
            members.push((gi, j));
        }
    }
    let n = lengths.len();
    let layout = settings.layout(n)?;
    let cfg = settings.grpo;
    let steps = layout.steps();
    let total_updates = steps * cfg.epochs;
    if batch.update >= total_updates {
        return Err(Error::Tape(format!(
            "update {} is past this generation's last: {} iteration(s) x {steps} optimizer step(s) = {total_updates} updates, numbered from 0",
            batch.update, cfg.epochs
        )));
    }
    let step = batch.update % steps;
    let adv = advantages(&rewards, g_size, cfg.advantage_norm, cfg.std_eps)?;
    let weights = aggregation_weights_layout(
        &lengths,
        cfg.mask_truncated_completions
            .then_some(truncated.as_slice()),
        cfg.aggregation,
        layout,
    );
    let per_step = layout.sequences_per_step();
    let in_step: Vec<usize> = (step * per_step..(step + 1) * per_step).collect();
    let completion = |i: usize| &batch.groups[members[i].0].completions[members[i].1];
    let at = |i: usize| format!("groups[{}].completions[{}]", members[i].0, members[i].1);
    let mut logp = Vec::new();
    let mut old = Vec::new();
    let mut reference = Vec::new();
    let moved = batch.update > 0;
    for &i in &in_step {
        let c = completion(i);
        logp.extend(c.logps.as_ref().ok_or_else(|| {
            Error::Tape(format!(
                "{}: update {} trains it, so give its `logps`",
                at(i),
                batch.update
            ))
        })?);
        match (&c.old_logps, moved) {
            (Some(o), _) => old.extend(o),
            (None, true) => {
                return Err(Error::Tape(format!(
                    "{}: after the first optimizer step the ratio needs the sampling policy's `old_logps`",
                    at(i)
                )))
            }
            (None, false) => {}
        }
        match (&c.ref_logps, cfg.beta > 0.0) {
            (Some(r), true) => reference.extend(r),
            (None, true) => {
                return Err(Error::Tape(format!(
                    "{}: beta is {} so the KL term needs its `ref_logps`",
                    at(i),
                    cfg.beta
                )))
            }
            _ => {}
        }
    }
    let has_old = in_step.iter().all(|&i| completion(i).old_logps.is_some());
    let sub = |v: &[f32]| -> Vec<f32> { in_step.iter().map(|&i| v[i]).collect() };
    let sub_len: Vec<usize> = in_step.iter().map(|&i| lengths[i]).collect();
    let (sub_adv, sub_w) = (sub(&adv), sub(&weights));
    let seqs = Sequences {
        lengths: &sub_len,
        advantages: &sub_adv,
        weights: &sub_w,
    };
    let coeffs = Coefficients::after_forward(
        &cfg,
        seqs,
        TokenLogprobs {
            logp: &logp,
            old: has_old.then_some(old.as_slice()),
            reference: (cfg.beta > 0.0).then_some(reference.as_slice()),
        },
    )?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let k = in_step.iter().position(|&x| x == i);
        out.push(SequenceOut {
            group: members[i].0,
            completion: members[i].1,
            reward: rewards[i],
            advantage: adv[i],
            weight: weights[i],
            step: i / per_step,
            coefficients: k.map(|k| coeffs.sequence(k).to_vec()),
        });
    }
    Ok(BatchOut {
        loss_type: cfg.loss_type().to_string(),
        importance_sampling_level: cfg.importance_sampling.to_string(),
        scale_rewards: cfg.advantage_norm.to_string(),
        update: batch.update,
        optimizer_steps_per_generation: steps,
        known_before_forward: known_before_forward(&cfg, batch.update),
        sequences: out,
    })
}
