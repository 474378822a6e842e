//! What a run records: its checkpointed state and totals, one metrics line per GRPO step,
//! and the summary.

use super::eval::EvalReport;
use super::rollout::Rollout;
use super::settings::RunSettings;
use super::update::UpdateReport;
use crate::common::human_bytes;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The training state a checkpoint carries besides tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct TrainState {
    /// GRPO steps completed.
    pub(super) step: usize,
    /// Counter-based RNG: every stream is keyed by this seed and a step.
    pub(super) rng: RngState,
    /// Optimizer steps taken.
    pub(super) adam_t: u64,
    pub(super) warm_start: WarmStart,
    /// Held-out results after the warm start.
    pub(super) before: EvalReport,
    /// Wall time of all processes of this run so far.
    pub(super) seconds_total: f64,
    /// `--policy hilore`: the allocator's state ([`OnlineAllocator::state`], floats as
    /// bits: see [`checkpoint::floats_to_bits`]). Absent in checkpoints of other policies
    /// and of versions before it was stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) allocator: Option<serde_json::Value>,
    /// Totals over the GRPO steps taken so far by every process of the run, so that a
    /// resumed run's summary is an uninterrupted one's (zero in checkpoints written
    /// before they were stored).
    #[serde(default)]
    pub(super) totals: RunTotals,
}

/// Per-run totals of the GRPO steps (see [`TrainState::totals`]); the last step's reward
/// and accuracy as `f64` bits, so they survive the JSON text exactly.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(super) struct RunTotals {
    pub(super) steps: usize,
    pub(super) rollout_tokens_per_s_sum: f64,
    pub(super) update_tokens_per_s_sum: f64,
    pub(super) peak_activation_bytes: usize,
    pub(super) instances_store: usize,
    pub(super) instances_compress: usize,
    pub(super) instances_recompute: usize,
    pub(super) final_reward_mean_bits: Option<u64>,
    pub(super) final_accuracy_bits: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct RngState {
    pub(super) kind: String,
    pub(super) seed: u64,
    pub(super) next_step: usize,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(super) struct WarmStart {
    pub(super) steps: usize,
    /// NaN (JSON null) when the warm start ran no step.
    #[serde(deserialize_with = "nan_if_null")]
    pub(super) final_loss: f64,
    pub(super) seconds: f64,
    pub(super) tokens_per_s: f64,
}

/// An `f64` that JSON stores as null when it is NaN.
pub(super) fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One `--metrics` line.
#[derive(Debug, Clone, Serialize)]
pub(super) struct StepMetrics {
    pub(super) step: usize,
    pub(super) reward_mean: f64,
    pub(super) accuracy: f64,
    pub(super) response_len_mean: f64,
    pub(super) kl: f64,
    pub(super) clip_fraction: f64,
    pub(super) loss: f64,
    pub(super) grad_norm: f64,
    pub(super) exposure_total: f64,
    pub(super) exposure_max_microbatch: f64,
    pub(super) zero_exposure_sequences: usize,
    /// Optimizer steps of this GRPO step (epochs x steps per rollout).
    pub(super) optimizer_steps: usize,
    /// Microbatches the allocator planned before their forward (`--policy hilore`).
    pub(super) planned_microbatches: usize,
    pub(super) skipped_sequences: usize,
    pub(super) skipped_tokens: usize,
    pub(super) empty_sequences: usize,
    pub(super) microbatches: usize,
    pub(super) update_tokens: usize,
    pub(super) rollout_tokens: usize,
    pub(super) peak_activation_bytes: usize,
    pub(super) optimizer_state_bytes: usize,
    pub(super) logp_mismatch_max: f64,
    pub(super) rollout_seconds: f64,
    pub(super) rollout_tokens_per_s: f64,
    pub(super) update_seconds: f64,
    pub(super) update_tokens_per_s: f64,
    pub(super) reference_seconds: f64,
    pub(super) step_seconds: f64,
    /// Unit instances of the step's microbatches (all epochs) that were stored,
    /// compressed and recomputed (inside a recomputed instance counts as recomputed).
    pub(super) instances_store: usize,
    pub(super) instances_compress: usize,
    pub(super) instances_recompute: usize,
}

/// The `--summary` object.
#[derive(Debug, Serialize)]
pub(super) struct Summary {
    pub(super) task: String,
    /// The zoo model directory trained (absent for a random init).
    pub(super) model_dir: Option<String>,
    pub(super) tokenizer: String,
    /// Where --out wrote the trained weights.
    pub(super) exported_to: Option<String>,
    pub(super) model_params: usize,
    pub(super) policy: String,
    pub(super) seed: u64,
    pub(super) steps: usize,
    pub(super) resumed_from_step: Option<usize>,
    /// Wall time of this process.
    pub(super) seconds: f64,
    /// Wall time of every process of this run.
    pub(super) seconds_total: f64,
    pub(super) warm_start_steps: usize,
    pub(super) warm_start_loss: f64,
    pub(super) warm_start_seconds: f64,
    pub(super) heldout_prompts: usize,
    /// Sampled accuracy on the held-out set (rollout temperature) after the warm start.
    pub(super) heldout_accuracy_before: f64,
    /// The same after GRPO.
    pub(super) heldout_accuracy_after: f64,
    pub(super) heldout_greedy_accuracy_before: f64,
    pub(super) heldout_greedy_accuracy_after: f64,
    pub(super) heldout_reward_mean_before: f64,
    pub(super) heldout_reward_mean_after: f64,
    pub(super) final_reward_mean: Option<f64>,
    pub(super) final_accuracy: Option<f64>,
    pub(super) rollout_tokens_per_s: f64,
    pub(super) update_tokens_per_s: f64,
    pub(super) peak_activation_bytes: usize,
    pub(super) optimizer_state_bytes: usize,
    /// Unit instances per GRPO step (mean over the run's steps, every process's) that
    /// were stored, compressed and recomputed.
    pub(super) instances_per_step: InstanceMeans,
    /// Everything that fixed the run's trajectory (flags and a --grpo-config resolved).
    pub(super) settings: RunSettings,
}

/// Mean unit instances per step by fidelity.
#[derive(Debug, Default, Serialize)]
pub(super) struct InstanceMeans {
    pub(super) store: f64,
    pub(super) compress: f64,
    pub(super) recompute: f64,
}

/// Keeps the metrics lines of steps `<= step` (a resumed run rewrites what came after).
pub(super) fn truncate_metrics(path: &Path, step: usize) -> anyhow::Result<()> {
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

impl StepMetrics {
    /// The metrics of GRPO step `step` (1-based) from its rollout and actor update;
    /// `optimizer_state_bytes` is AdamW's after the step, `step_seconds` the step's wall
    /// time.
    pub(super) fn new(
        step: usize,
        ro: &Rollout,
        rep: &UpdateReport,
        optimizer_state_bytes: usize,
        step_seconds: f64,
    ) -> Self {
        StepMetrics {
            step,
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
            optimizer_state_bytes,
            logp_mismatch_max: rep.logp_mismatch_max,
            rollout_seconds: ro.seconds,
            rollout_tokens_per_s: ro.generated_tokens() as f64 / ro.seconds.max(1e-9),
            update_seconds: rep.seconds,
            update_tokens_per_s: rep.update_tokens as f64 / rep.seconds.max(1e-9),
            reference_seconds: rep.reference_seconds,
            step_seconds,
            instances_store: rep.fidelities.store,
            instances_compress: rep.fidelities.compress,
            instances_recompute: rep.fidelities.recompute,
        }
    }

    /// The step's log line (`skip_zero_exposure`: the skipped sequences and tokens, else
    /// the zero-exposure ones).
    pub(super) fn line(&self, total_steps: usize, skip_zero_exposure: bool) -> String {
        let m = self;
        format!(
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
            if skip_zero_exposure {
                format!("  skipped {} seq / {} tok", m.skipped_sequences, m.skipped_tokens)
            } else {
                format!("  zero-exposure {} seq", m.zero_exposure_sequences)
            }
        )
    }
}

impl RunTotals {
    /// Folds one step's metrics in.
    pub(super) fn add(&mut self, m: &StepMetrics) {
        self.steps += 1;
        self.instances_store += m.instances_store;
        self.instances_compress += m.instances_compress;
        self.instances_recompute += m.instances_recompute;
        self.rollout_tokens_per_s_sum += m.rollout_tokens_per_s;
        self.update_tokens_per_s_sum += m.update_tokens_per_s;
        self.peak_activation_bytes = self.peak_activation_bytes.max(m.peak_activation_bytes);
        self.final_reward_mean_bits = Some(m.reward_mean.to_bits());
        self.final_accuracy_bits = Some(m.accuracy.to_bits());
    }
}
