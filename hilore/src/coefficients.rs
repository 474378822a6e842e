//! `hilore coefficients`: a batch's GRPO advantages and per-token `dL/dlogp` under a TRL
//! config, as JSON, to put beside another trainer's numbers.

use anyhow::{bail, Context};
use clap::Args;
use hilore_runtime::grpo::trl::{compute, Batch, TrlSettings};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub const AFTER_HELP: &str = r#"INPUT (a JSON file; the whole generation, prompt group after prompt group):

  {
    "config": { "loss_type": "grpo", "beta": 0.04, "num_generations": 2 },
    "update": 0,
    "groups": [
      { "rewards": [1.0, 0.0],
        "completions": [
          { "logps": [-0.7, -1.2, -0.1], "ref_logps": [-0.6, -1.3, -0.2] },
          { "logps": [-2.1, -0.4], "ref_logps": [-2.0, -0.5], "truncated": true } ] } ]
  }

  config       TRL GRPOConfig keys (TRL 1.16's names and defaults; --config FILE
               replaces it). HiLoRe reads loss_type, scale_rewards, epsilon,
               epsilon_high, delta, beta, use_bias_correction_kl,
               importance_sampling_level, mask_truncated_completions, num_iterations,
               sapo_temperature_pos/neg, num_generations, per_device_train_batch_size,
               gradient_accumulation_steps, steps_per_generation,
               generation_batch_size, max_completion_length, reward_weights; the
               other TRL keys are listed on stderr as ignored; keys that change the
               loss in ways HiLoRe does not compute (top_entropy_quantile < 1,
               entropy_coef, off_policy_mask_threshold, ...) are errors.
  update       the optimizer step since the generation, 0-based: iteration x
               (steps_per_generation / gradient_accumulation_steps) + step. Default 0.
  groups       num_generations completions each, in generation order.
  rewards      one number per completion, or one list per completion with a value per
               reward function (weighted by reward_weights and summed).
  logps        per-token log-probs under the current policy (at TRL's temperature:
               log_softmax(logits / T)). May be left out, with "length" given, for a
               completion outside the update's optimizer step.
  old_logps    under the policy that sampled; needed from update 1 on.
  ref_logps    under the reference model; needed when beta > 0.
  truncated    cut at max_completion_length without an end token (default false).

OUTPUT (JSON on stdout or --out):
  loss_type, importance_sampling_level, scale_rewards, update,
  optimizer_steps_per_generation, known_before_forward (whether these coefficients
  were known before the actor update's forward: the first update without a KL term),
  and per completion: group, completion, reward, advantage, weight (the aggregation
  weight of each token), step, coefficients (dL/dlogp per token, null outside the
  update's step).

The numbers equal TRL 1.16.0's own (its GRPOTrainer's advantages and the autograd
gradient of its loss per microbatch) within float32 rounding on the cases in
hilore-runtime/tests/fixtures/trl, except that an all-equal group gets advantage exactly
0 (TRL leaves a float residue). See docs/grpo.md."#;

/// Arguments of `hilore coefficients`.
#[derive(Args)]
pub struct CoefficientsArgs {
    /// The batch (JSON; the schema is below).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// A TRL GRPOConfig file (YAML or JSON, as `trl grpo --config` takes); replaces the
    /// batch's "config".
    #[arg(long, alias = "grpo-config", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Write the JSON to FILE (atomically) instead of stdout.
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Indent the JSON.
    #[arg(long)]
    pretty: bool,
}

/// Reads a TRL GRPOConfig file: JSON when it ends in `.json`, YAML otherwise (YAML also
/// reads JSON). Prints the TRL keys it ignores to stderr.
pub fn read_trl_config(path: &Path) -> anyhow::Result<TrlSettings> {
    let text = hilore_models::read_text_file(path)
        .with_context(|| format!("reading the TRL config {}", path.display()))?;
    let value: serde_json::Value = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?
    } else {
        serde_saphyr::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("{}: not valid YAML", path.display()))?
    };
    let s = TrlSettings::from_value(&value, &path.display().to_string())?;
    note_ignored(&s, &path.display().to_string());
    Ok(s)
}

fn note_ignored(s: &TrlSettings, source: &str) {
    if !s.ignored.is_empty() {
        eprintln!(
            "note: {source}: TRL keys that do not change the GRPO math, ignored: {}",
            s.ignored.join(", ")
        );
    }
}

pub fn run(a: CoefficientsArgs) -> anyhow::Result<ExitCode> {
    let text = hilore_models::read_text_file(&a.input)
        .with_context(|| format!("reading the batch {}", a.input.display()))?;
    let batch: Batch = serde_json::from_str(&text).with_context(|| {
        format!(
            "{}: not a batch (see `hilore coefficients --help` for the schema)",
            a.input.display()
        )
    })?;
    let settings = match (&a.config, &batch.config) {
        (Some(p), Some(_)) => {
            eprintln!(
                "note: --config {} replaces the batch's \"config\"",
                p.display()
            );
            read_trl_config(p)?
        }
        (Some(p), None) => read_trl_config(p)?,
        (None, Some(v)) => {
            let source = format!("{} (\"config\")", a.input.display());
            let s = TrlSettings::from_value(v, &source)?;
            note_ignored(&s, &source);
            s
        }
        (None, None) => TrlSettings::default(),
    };
    if batch.groups.is_empty() {
        bail!(
            "{}: \"groups\" is empty; give at least one prompt group",
            a.input.display()
        );
    }
    let out = compute(&settings, &batch).with_context(|| format!("{}", a.input.display()))?;
    let json = if a.pretty {
        serde_json::to_string_pretty(&out)?
    } else {
        serde_json::to_string(&out)?
    };
    match &a.out {
        Some(p) => hilore_models::atomic::write_bytes_atomic(p, format!("{json}\n").as_bytes())
            .with_context(|| format!("writing {}", p.display()))?,
        None => println!("{json}"),
    }
    Ok(ExitCode::SUCCESS)
}
