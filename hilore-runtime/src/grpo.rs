//! GRPO math: advantages, ratios, clipping, KL, aggregation, the per-token coefficients
//! `dL/dlogp`, and exposure.
//!
//! A GRPO step samples `G` responses for each of `P` prompts, scores them (rewards `R_i`)
//! and updates the policy on the `P x G` sequences. Everything the update needs from the
//! loss is, per response token `t` of sequence `i`, one number: the coefficient
//! `c_it = dL/dlogp_it`. The tape's backward starts from these coefficients
//! ([`crate::Cx::backward`]); the loss itself is never differentiated by the tape.
//!
//! ## The loss
//!
//! - Advantage (per sequence): `A_i = (R_i - mean_g R) / (std R + eps)`, the mean over the
//!   sequence's group and the standard deviation over the group
//!   ([`AdvantageNorm::GroupStd`], GRPO; TRL's `scale_rewards="group"`) or over the whole
//!   batch ([`AdvantageNorm::BatchStd`], `scale_rewards="batch"`), or `A_i = R_i - mean_g R`
//!   ([`AdvantageNorm::None`], Dr. GRPO, `scale_rewards="none"`). `std` is the sample
//!   standard deviation (divides by `n - 1`), as TRL's `torch.std`. Kept different from
//!   TRL on purpose: a group whose rewards are all equal (and so a group of one) gets
//!   advantage exactly 0, where TRL's float arithmetic leaves a residue (|A| up to 7e-5)
//!   and `G = 1` gives NaN; exact zeros give those sequences exactly zero exposure.
//! - Ratio: per token, `rho_t = exp(logp_t - logp_old_t)`, or per sequence (GSPO,
//!   [`ImportanceSampling::Sequence`]), `rho = exp(mean_t (logp_t - logp_old_t))` for all
//!   its tokens.
//! - Per-token loss ([`Surrogate`]): the clip,
//!   `l = -min(min(rho, delta) A, clip(rho, 1 - eps_low, 1 + eps_high) A)` (`delta`, two-sided
//!   clipping, off by default); CISPO, `l = -sg(min(rho, eps_high)) A logp` (`sg`: no
//!   gradient); SAPO, `l = -sigmoid(tau (rho - 1)) 4 / tau A` with `tau` by the sign of `A`.
//!   Plus `beta * kl`, the k3 estimator of `KL(pi || pi_ref)`,
//!   `k3 = exp(ref - logp) - (ref - logp) - 1`, importance-weighted by default (`kl = rho * k3`,
//!   TRL's `use_bias_correction_kl`: the samples come from `pi_old`, so `rho * k3` is the
//!   unbiased estimate under `pi`) or as is (`kl = k3`).
//! - Aggregation: `L = sum_i w_i sum_t l_it`, with the weight `w_i` of every token of
//!   sequence `i` ([`Aggregation`], [`aggregation_weights_layout`]): token mean over the
//!   step (TRL's `dapo` and `cispo`), mean of the sequences' token means (`grpo`, `sapo`),
//!   a constant normaliser (`dr_grpo`), token means per loss microbatch (`bnpo`).
//!   [`LossType`] names the pairs as TRL's `loss_type` does.
//!
//! ## The coefficients
//!
//! Differentiating `l` through `logp` (`d rho_t / d logp_t = rho_t`; a sequence ratio's
//! `d rho / d logp_t = rho / |o|`, summed over the sequence's `|o|` equal per-token losses,
//! gives the same `rho` factor), with `g = dl/drho * rho`:
//!
//! - clip: `g = -A rho`, or 0 where the clipped branch is active: `A > 0` and
//!   `rho > 1 + eps_high`, `A < 0` and `rho < 1 - eps_low`, or (with `delta`) `A < 0` and
//!   `rho > delta`. At a tie the unclipped branch is taken.
//! - CISPO: `g = -A min(rho, eps_high)` (the weight is detached; every token keeps a
//!   gradient).
//! - SAPO: `g = -A 4 s (1 - s) rho` with `s = sigmoid(tau (rho - 1))` (`tau` cancels; at
//!   `rho = 1` the slope is exactly 1).
//! - KL: `beta rho (1 - exp(ref - logp) + k3)` with the bias correction (per sequence,
//!   `beta rho (1 - exp(ref - logp) + mean_t k3)`), `beta (1 - exp(ref - logp))` without.
//!
//! and `c = w (g + kl part)`.
//!
//! **Known before the forward**: in the first optimizer step after a rollout (the policy
//! has not moved since it sampled, so `logp_old = logp` and `rho = 1` exactly, per token
//! and per sequence, the way TRL sets `old = logp.detach()`) and without a KL term
//! (`beta = 0`), `c = -A w` (CISPO: `-A min(1, eps_high) w`): a function of the rewards and
//! the response lengths alone, known before the actor update's forward, for every loss
//! type and either ratio level ([`Coefficients::before_forward`], [`known_before_forward`]).
//! This is what lets an allocator plan a microbatch's fidelities from its exposure before
//! running it. Two-sided clipping does not change it (`rho = 1 < delta`).
//!
//! **Known only after the forward** (but before backward, with no extra backward pass):
//! with `beta > 0` (the KL term needs the current `logp`), and in every later optimizer
//! step of the same rollout: epochs after the first (`num_iterations`) and, with
//! `steps_per_generation > gradient_accumulation_steps`, the rollout's later steps
//! (`rho != 1`; the clip branch, CISPO's cap and SAPO's gate depend on it).
//! [`Coefficients::after_forward`] computes them from the forward's log-probs.
//!
//! TRL's own numbers are the check: `hilore-runtime/tests/trl_golden.rs` holds
//! [`trl::compute`] to TRL 1.16.0's trainer on committed cases within a derived float32
//! bound.
//!
//! ## Exposure
//!
//! The exposure of a sequence is the root of its squared coefficients,
//! `sqrt(sum_t c_it^2)` ([`exposure_per_sequence`]); of a microbatch (and of every unit
//! instance in it, whose rows are the microbatch's tokens) the root of its sequences'
//! squared exposures ([`microbatch_exposure`]), i.e. the L2 norm of its rows'
//! coefficients. Rounding a unit's saved activations perturbs every row independently,
//! and row `t`'s share of the parameter-gradient error is proportional to `c_t`, so the
//! error adds in quadrature over rows: it grows with this norm, not with `sum |c|`
//! (docs/allocator.md measures both on the benchmark's GRPO step). A sequence
//! with zero exposure contributes exactly zero gradient: with `beta = 0` that is every
//! sequence whose advantage is 0 (e.g. every sequence of a group whose rewards are all
//! equal), whatever the epoch.

pub mod trl;

use crate::{Error, Result};
use std::fmt;

/// How rewards become advantages within a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdvantageNorm {
    /// `(R - mean) / (std + eps)`, both over the group: GRPO.
    #[default]
    GroupStd,
    /// `(R - group mean) / (std + eps)`, the standard deviation over the whole batch (TRL's
    /// `scale_rewards="batch"`).
    BatchStd,
    /// `R - mean`: Dr. GRPO (no division by a standard deviation).
    None,
}

impl AdvantageNorm {
    /// Parses TRL's `scale_rewards` names, `group`, `batch` or `none` (also `true` and
    /// `false`, TRL's older spelling of `group` and `none`, and `group-std`).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "group" | "group-std" | "std" | "true" => Ok(Self::GroupStd),
            "batch" => Ok(Self::BatchStd),
            "none" | "false" => Ok(Self::None),
            _ => Err(Error::Tape(format!(
                "unknown reward scaling `{s}`; use `group` (GRPO), `batch` (the standard deviation over the batch) or `none` (Dr. GRPO)"
            ))),
        }
    }
}

impl fmt::Display for AdvantageNorm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::GroupStd => "group",
            Self::BatchStd => "batch",
            Self::None => "none",
        })
    }
}

/// How per-token losses are summed into the step's loss: the aggregation half of TRL's
/// `loss_type` ([`LossType`] names the pairs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Mean over every response token of the optimizer step: `w = 1 / sum_j |o_j|`
    /// (TRL's `dapo`, its default, and `cispo`). With several optimizer steps per
    /// generation, TRL divides by the generation batch's tokens over the number of steps,
    /// `w = K / sum_gen |o_j|`, and so does [`aggregation_weights_layout`].
    #[default]
    TokenMean,
    /// Mean over the step's `S` sequences of each sequence's token mean:
    /// `w_i = 1 / (S |o_i|)` (TRL's `grpo` and `sapo`). `S` counts every sequence, empty
    /// ones too, as TRL's mean over the batch does.
    SeqMeanTokenMean,
    /// A constant normaliser: `w = 1 / (S * max_completion_length)` over the step's `S`
    /// sequences (TRL's `dr_grpo`, Dr. GRPO's unbiased sum).
    DrGrpo {
        /// The longest a completion may be (`--max-new-tokens`).
        max_completion_length: usize,
    },
    /// Token mean within each loss microbatch of `per_device_train_batch_size`
    /// sequences, averaged over the step's `gradient_accumulation_steps` microbatches:
    /// `w_i = 1 / (GA * sum_{j in mb(i)} |o_j|)` (TRL's `bnpo`; see [`StepLayout`]).
    Bnpo,
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TokenMean => "token-mean",
            Self::SeqMeanTokenMean => "seq-mean-token-mean",
            Self::DrGrpo { .. } => "dr-grpo",
            Self::Bnpo => "bnpo",
        })
    }
}

/// What the per-token loss is made of, before aggregation: the surrogate half of TRL's
/// `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Surrogate {
    /// PPO's clipped surrogate, `-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)`
    /// (TRL's `grpo`, `bnpo`, `dr_grpo`, `dapo`), with the optional two-sided cap `delta`.
    #[default]
    Clip,
    /// CISPO: the importance weight truncated at `eps_high` and detached,
    /// `-min(rho, eps_high) A logp` (TRL's `cispo`; `eps_high` is ScaleRL's `eps_max`,
    /// e.g. 5, not a distance from 1). Every token keeps a gradient.
    Cispo,
    /// SAPO: a soft gate instead of the clip, `-sigmoid(tau (rho - 1)) 4 / tau A`, with
    /// `tau = temperature_pos` where `A > 0` and `temperature_neg` elsewhere (TRL's
    /// `sapo`; its defaults 1.0 and 1.05).
    Sapo {
        /// `sapo_temperature_pos`.
        temperature_pos: f32,
        /// `sapo_temperature_neg`.
        temperature_neg: f32,
    },
}

/// TRL's `loss_type`: a [`Surrogate`] and an [`Aggregation`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossType {
    /// The per-token loss.
    pub surrogate: Surrogate,
    /// How per-token losses are summed.
    pub aggregation: Aggregation,
}

impl LossType {
    /// The loss types HiLoRe computes, by TRL's names.
    pub const NAMES: [&'static str; 6] = ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"];

    /// Parses TRL's loss types `dapo`, `grpo`, `dr_grpo`, `bnpo`, `cispo` or `sapo` (also
    /// `token-mean`, `seq-mean-token-mean` and `dr-grpo`). `dr_grpo` normalises by
    /// `max_completion_length`; `sapo` takes TRL's default temperatures (1.0 where
    /// `A > 0`, 1.05 elsewhere), which a caller may replace.
    pub fn parse(s: &str, max_completion_length: usize) -> Result<Self> {
        let clip = |aggregation| {
            Ok(Self {
                surrogate: Surrogate::Clip,
                aggregation,
            })
        };
        match s {
            "dapo" | "token-mean" => clip(Aggregation::TokenMean),
            "grpo" | "seq-mean-token-mean" => clip(Aggregation::SeqMeanTokenMean),
            "dr_grpo" | "dr-grpo" => clip(Aggregation::DrGrpo {
                max_completion_length,
            }),
            "bnpo" => clip(Aggregation::Bnpo),
            "cispo" => Ok(Self {
                surrogate: Surrogate::Cispo,
                aggregation: Aggregation::TokenMean,
            }),
            "sapo" => Ok(Self {
                surrogate: Surrogate::Sapo {
                    temperature_pos: 1.0,
                    temperature_neg: 1.05,
                },
                aggregation: Aggregation::SeqMeanTokenMean,
            }),
            "luspo" | "vespo" => Err(Error::Tape(format!(
                "loss type `{s}` is not implemented; use one of {}",
                Self::NAMES.join(", ")
            ))),
            _ => Err(Error::Tape(format!(
                "unknown loss type `{s}`; use `dapo` (token mean over the step), `grpo` (mean of the sequences' token means), `dr_grpo` (sum over max_completion_length), `bnpo` (token mean per loss microbatch), `cispo` (truncated importance weights) or `sapo` (soft gate)"
            ))),
        }
    }

    /// TRL's name of this pair; `None` for a pair TRL has no name for (e.g. CISPO's
    /// surrogate under `grpo`'s aggregation).
    pub fn name(&self) -> Option<&'static str> {
        Some(match (self.surrogate, self.aggregation) {
            (Surrogate::Clip, Aggregation::TokenMean) => "dapo",
            (Surrogate::Clip, Aggregation::SeqMeanTokenMean) => "grpo",
            (Surrogate::Clip, Aggregation::DrGrpo { .. }) => "dr_grpo",
            (Surrogate::Clip, Aggregation::Bnpo) => "bnpo",
            (Surrogate::Cispo, Aggregation::TokenMean) => "cispo",
            (Surrogate::Sapo { .. }, Aggregation::SeqMeanTokenMean) => "sapo",
            _ => return None,
        })
    }
}

impl fmt::Display for LossType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "{:?} with {}", self.surrogate, self.aggregation),
        }
    }
}

/// Where the importance ratio is taken (TRL's `importance_sampling_level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ImportanceSampling {
    /// One ratio per token, `rho_t = exp(logp_t - old_t)` (GRPO).
    #[default]
    Token,
    /// One ratio per sequence, the geometric mean of its tokens' ratios,
    /// `rho = exp(mean_t (logp_t - old_t))`, shared by every token of the sequence (GSPO).
    Sequence,
}

impl ImportanceSampling {
    /// Parses `token` or `sequence`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "token" => Ok(Self::Token),
            "sequence" => Ok(Self::Sequence),
            _ => Err(Error::Tape(format!(
                "unknown importance sampling level `{s}`; use `token` (GRPO) or `sequence` (GSPO)"
            ))),
        }
    }
}

impl fmt::Display for ImportanceSampling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Token => "token",
            Self::Sequence => "sequence",
        })
    }
}

/// The GRPO loss's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GrpoConfig {
    /// Lower clip range: the ratio is clamped at `1 - eps_low`.
    pub eps_low: f32,
    /// Upper clip range: the ratio is clamped at `1 + eps_high` (DAPO's clip-higher when
    /// larger than `eps_low`).
    pub eps_high: f32,
    /// Weight of the k3 KL term to the reference policy; 0 disables it.
    pub beta: f32,
    /// Advantage normalisation.
    pub advantage_norm: AdvantageNorm,
    /// Added to the standard deviation before dividing (TRL's 1e-4).
    pub std_eps: f32,
    /// Token aggregation.
    pub aggregation: Aggregation,
    /// Update epochs per rollout batch (`mu >= 1`).
    pub epochs: usize,
    /// Importance-weight the KL term by the ratio (`beta * rho * k3`; TRL's
    /// `use_bias_correction_kl`, on by default there and here). Absent in settings
    /// written before it existed, where it was off.
    #[serde(default)]
    pub kl_bias_correction: bool,
    /// Leave responses cut at the length limit (no stop token) out of the loss (TRL's
    /// `mask_truncated_completions`, off by default there and here); see
    /// [`aggregation_weights_masked`].
    #[serde(default)]
    pub mask_truncated_completions: bool,
    /// Two-sided clipping (TRL's `delta`, INTELLECT-2): the unclipped term's ratio is
    /// capped at `delta`, so a token with `A < 0` and `rho > delta` gets no gradient.
    /// `None` (the default) disables it; it should exceed `1 + eps_high`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<f32>,
    /// The per-token loss (TRL's `loss_type` names it with [`GrpoConfig::aggregation`];
    /// see [`LossType`]). Absent in settings written before it existed: the clip.
    #[serde(default)]
    pub surrogate: Surrogate,
    /// Token or sequence importance ratios (TRL's `importance_sampling_level`).
    #[serde(default)]
    pub importance_sampling: ImportanceSampling,
}

impl Default for GrpoConfig {
    /// TRL's defaults: `epsilon = epsilon_high = 0.2`, `beta = 0`, `scale_rewards="group"`,
    /// token-mean aggregation (`loss_type="dapo"`), one iteration, the bias-corrected KL.
    fn default() -> Self {
        GrpoConfig {
            eps_low: 0.2,
            eps_high: 0.2,
            beta: 0.0,
            advantage_norm: AdvantageNorm::GroupStd,
            std_eps: 1e-4,
            aggregation: Aggregation::TokenMean,
            epochs: 1,
            kl_bias_correction: true,
            mask_truncated_completions: false,
            delta: None,
            surrogate: Surrogate::Clip,
            importance_sampling: ImportanceSampling::Token,
        }
    }
}

impl GrpoConfig {
    /// TRL's `loss_type` of this configuration.
    pub fn loss_type(&self) -> LossType {
        LossType {
            surrogate: self.surrogate,
            aggregation: self.aggregation,
        }
    }

    /// Sets the surrogate and aggregation of TRL's `loss_type`.
    pub fn with_loss_type(self, t: LossType) -> Self {
        GrpoConfig {
            surrogate: t.surrogate,
            aggregation: t.aggregation,
            ..self
        }
    }

    /// Checks the ranges: `0 <= eps_low < 1`, `eps_high >= 0`, `beta >= 0`, `std_eps > 0`,
    /// `epochs >= 1`, all finite.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, v: String, want: &str| {
            Err(Error::Tape(format!("GRPO config: {field} is {v}; {want}")))
        };
        if !(self.eps_low.is_finite() && (0.0..1.0).contains(&self.eps_low)) {
            return bad(
                "eps_low",
                self.eps_low.to_string(),
                "it must be in [0, 1) (0.2 is usual)",
            );
        }
        if !(self.eps_high.is_finite() && self.eps_high >= 0.0) {
            return bad(
                "eps_high",
                self.eps_high.to_string(),
                "it must be >= 0 (0.2, or 0.28 for DAPO's clip-higher)",
            );
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return bad(
                "beta",
                self.beta.to_string(),
                "it must be >= 0 (0 disables the KL term)",
            );
        }
        if !(self.std_eps.is_finite() && self.std_eps > 0.0) {
            return bad(
                "std_eps",
                self.std_eps.to_string(),
                "it must be > 0 (1e-4 is usual)",
            );
        }
        if self.epochs == 0 {
            return bad(
                "epochs",
                "0".into(),
                "it must be at least 1 (update epochs per rollout batch)",
            );
        }
        if let Surrogate::Sapo {
            temperature_pos,
            temperature_neg,
        } = self.surrogate
        {
            for (field, t) in [
                ("sapo_temperature_pos", temperature_pos),
                ("sapo_temperature_neg", temperature_neg),
            ] {
                if !(t.is_finite() && t > 0.0) {
                    return bad(field, t.to_string(), "it must be > 0 (TRL: 1.0 and 1.05)");
                }
            }
        }
        if self.delta.is_some() && self.surrogate != Surrogate::Clip {
            return bad(
                "delta",
                format!("set with loss type {}", self.loss_type()),
                "two-sided clipping applies to the clipped losses (dapo, grpo, dr_grpo, bnpo) only; drop delta",
            );
        }
        if let Some(d) = self.delta {
            // Above the clip range, the capped term is the min exactly where A < 0 and
            // rho > delta; at or below it the two clips would interleave.
            if !(d.is_finite() && d > 1.0 + self.eps_high) {
                return bad(
                    "delta",
                    d.to_string(),
                    "it must be a number above 1 + eps_high (TRL suggests 1 + 2 eps_high or more)",
                );
            }
        }
        Ok(())
    }
}

/// Whether the coefficients of an optimizer step are known before the actor update's
/// forward. `update` counts the optimizer steps since the rollout (0-based: epoch x steps
/// per generation + step): only the first (`rho = 1`: the policy has not moved since it
/// sampled), and only without a KL term. Every [`Surrogate`] and either
/// [`ImportanceSampling`] level qualifies then: at `rho = 1` (a sequence's mean log-ratio
/// is exactly 0 too) the clip is inactive, CISPO's weight is `min(1, eps_high)`, SAPO's
/// gate has slope 1, and `delta > 1` caps nothing.
pub fn known_before_forward(cfg: &GrpoConfig, update: usize) -> bool {
    update == 0 && cfg.beta == 0.0
}

/// Group-relative advantages of `rewards`, laid out group by group (`rewards[g * G + j]`
/// is response `j` of prompt `g`). Errors when the rewards do not fill whole groups or
/// are not finite.
pub fn advantages(
    rewards: &[f32],
    group_size: usize,
    norm: AdvantageNorm,
    std_eps: f32,
) -> Result<Vec<f32>> {
    if group_size == 0 {
        return Err(Error::Tape(
            "advantages: the group size must be at least 1".into(),
        ));
    }
    if rewards.len() % group_size != 0 {
        return Err(Error::Tape(format!(
            "advantages: {} rewards do not form whole groups of {group_size}",
            rewards.len()
        )));
    }
    if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(Error::Tape(format!(
            "advantages: reward {i} is {}; rewards must be finite",
            rewards[i]
        )));
    }
    // The sample standard deviation (divides by n - 1, as torch.std; 0 for one value).
    let sample_std = |xs: &[f32]| -> f64 {
        let n = xs.len() as f64;
        if xs.len() < 2 {
            return 0.0;
        }
        let mean = xs.iter().map(|&r| r as f64).sum::<f64>() / n;
        (xs.iter().map(|&r| (r as f64 - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    let batch_std = sample_std(rewards);
    let mut out = Vec::with_capacity(rewards.len());
    for group in rewards.chunks(group_size) {
        let n = group.len() as f64;
        let mean = group.iter().map(|&r| r as f64).sum::<f64>() / n;
        let denom = match norm {
            AdvantageNorm::GroupStd => sample_std(group) + std_eps as f64,
            AdvantageNorm::BatchStd => batch_std + std_eps as f64,
            AdvantageNorm::None => 1.0,
        };
        // An all-equal group gives exactly 0 (never a rounding residue), so its sequences
        // have exactly zero exposure.
        let all_equal = group.iter().all(|&x| x == group[0]);
        out.extend(group.iter().map(|&r| {
            if all_equal {
                0.0
            } else {
                ((r as f64 - mean) / denom) as f32
            }
        }));
    }
    Ok(out)
}

/// How TRL cuts a generation batch into loss microbatches and optimizer steps: the
/// sequences of one generation (HiLoRe's rollout batch, `prompts x group`) are
/// `steps_per_generation` loss microbatches of `batch_size` consecutive sequences
/// (TRL's `per_device_train_batch_size`), and every `accumulation` of them
/// (`gradient_accumulation_steps`) make one optimizer step, so a generation feeds
/// `steps_per_generation / accumulation` optimizer steps.
///
/// Only the loss weights depend on it (`bnpo`'s token means per microbatch, the number of
/// sequences per step of `grpo` and `dr_grpo`, `dapo`'s steps per generation); HiLoRe packs
/// its own microbatches by a token budget, independently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepLayout {
    /// Sequences per loss microbatch (`per_device_train_batch_size`).
    pub batch_size: usize,
    /// Loss microbatches per optimizer step (`gradient_accumulation_steps`).
    pub accumulation: usize,
    /// Loss microbatches per generation (`steps_per_generation`).
    pub steps_per_generation: usize,
}

impl StepLayout {
    /// One optimizer step of one microbatch over all `sequences` of the generation.
    pub fn single(sequences: usize) -> Self {
        StepLayout {
            batch_size: sequences.max(1),
            accumulation: 1,
            steps_per_generation: 1,
        }
    }

    /// The layout of a generation of `sequences` with `accumulation` microbatches per
    /// optimizer step and `steps_per_generation` microbatches per generation; errors,
    /// naming the fix, unless they divide evenly.
    pub fn new(sequences: usize, accumulation: usize, steps_per_generation: usize) -> Result<Self> {
        if accumulation == 0 || steps_per_generation == 0 {
            return Err(Error::Tape(format!(
                "gradient_accumulation_steps is {accumulation} and steps_per_generation {steps_per_generation}; both must be at least 1"
            )));
        }
        if steps_per_generation % accumulation != 0 {
            return Err(Error::Tape(format!(
                "steps_per_generation ({steps_per_generation}) must be a multiple of gradient_accumulation_steps ({accumulation}): each optimizer step takes {accumulation} microbatches of the generation"
            )));
        }
        if sequences == 0 || sequences % steps_per_generation != 0 {
            return Err(Error::Tape(format!(
                "a generation of {sequences} sequences does not split into steps_per_generation = {steps_per_generation} equal microbatches; make prompts x group a multiple of {steps_per_generation}"
            )));
        }
        Ok(StepLayout {
            batch_size: sequences / steps_per_generation,
            accumulation,
            steps_per_generation,
        })
    }

    /// Optimizer steps per generation.
    pub fn steps(&self) -> usize {
        self.steps_per_generation / self.accumulation
    }

    /// Sequences per optimizer step.
    pub fn sequences_per_step(&self) -> usize {
        self.batch_size * self.accumulation
    }
}

/// The aggregation weight `w_i` of every token of each sequence, for the sequences of one
/// optimizer step with `lengths[i]` response tokens each. Empty sequences get weight 0.
pub fn aggregation_weights(lengths: &[usize], aggregation: Aggregation) -> Vec<f32> {
    aggregation_weights_masked(lengths, None, aggregation)
}

/// [`aggregation_weights`] with the sequences where `masked[i]` is true left out of the
/// loss (TRL's `mask_truncated_completions`: responses cut at the length limit): their
/// weight is 0 and their tokens leave `dapo`'s and `bnpo`'s token counts, while `grpo`'s
/// mean and `dr_grpo`'s normaliser still count them, as TRL's per-batch means do.
pub fn aggregation_weights_masked(
    lengths: &[usize],
    masked: Option<&[bool]>,
    aggregation: Aggregation,
) -> Vec<f32> {
    aggregation_weights_layout(
        lengths,
        masked,
        aggregation,
        StepLayout::single(lengths.len()),
    )
}

/// The aggregation weights of a whole generation's sequences (`lengths`, in TRL's
/// microbatch order) cut by `layout` into loss microbatches and optimizer steps, as TRL
/// weighs them (each optimizer step's gradient is its microbatches' sum):
///
/// - `dapo` / `cispo`: `w = 1 / (N * GA / SPG)` with `N` the generation's kept tokens
///   (TRL's `num_items_in_batch`, rescaled to one accumulation window);
/// - `grpo` / `sapo`: `w_i = 1 / (B * GA * |o_i|)`;
/// - `dr_grpo`: `w = 1 / (B * GA * max_completion_length)`;
/// - `bnpo`: `w_i = 1 / (GA * n_mb(i))`, `n_mb(i)` the kept tokens of sequence `i`'s
///   microbatch (at least 1).
///
/// `layout` must fit `lengths.len()` sequences ([`StepLayout::new`]).
pub fn aggregation_weights_layout(
    lengths: &[usize],
    masked: Option<&[bool]>,
    aggregation: Aggregation,
    layout: StepLayout,
) -> Vec<f32> {
    let kept = |i: usize| lengths[i] > 0 && !masked.is_some_and(|m| m[i]);
    let kept_tokens =
        |r: std::ops::Range<usize>| -> usize { r.filter(|&i| kept(i)).map(|i| lengths[i]).sum() };
    let b = layout.batch_size.max(1);
    let ga = layout.accumulation.max(1) as f64;
    let per_sequence = |w: &dyn Fn(usize) -> f64| -> Vec<f32> {
        (0..lengths.len())
            .map(|i| if kept(i) { w(i) as f32 } else { 0.0 })
            .collect()
    };
    match aggregation {
        Aggregation::TokenMean => {
            let n = kept_tokens(0..lengths.len()).max(1) as f64;
            let normaliser = n * ga / layout.steps_per_generation.max(1) as f64;
            per_sequence(&|_| 1.0 / normaliser)
        }
        Aggregation::DrGrpo {
            max_completion_length,
        } => {
            let d = b as f64 * ga * max_completion_length.max(1) as f64;
            per_sequence(&|_| 1.0 / d)
        }
        Aggregation::SeqMeanTokenMean => {
            per_sequence(&|i| 1.0 / (b as f64 * ga * lengths[i] as f64))
        }
        Aggregation::Bnpo => per_sequence(&|i| {
            let start = i / b * b;
            let n = kept_tokens(start..(start + b).min(lengths.len())).max(1);
            1.0 / (ga * n as f64)
        }),
    }
}

/// The per-sequence quantities of a batch of responses: response lengths, advantages and
/// aggregation weights, one entry per sequence, in the order of the token arrays.
#[derive(Debug, Clone, Copy)]
pub struct Sequences<'a> {
    /// Response tokens of each sequence.
    pub lengths: &'a [usize],
    /// Advantage of each sequence.
    pub advantages: &'a [f32],
    /// Aggregation weight of each sequence's tokens ([`aggregation_weights`] over the
    /// whole optimizer step, not just this microbatch).
    pub weights: &'a [f32],
}

impl Sequences<'_> {
    fn check(&self) -> Result<usize> {
        let n = self.lengths.len();
        if self.advantages.len() != n || self.weights.len() != n {
            return Err(Error::Tape(format!(
                "GRPO: {n} sequence lengths but {} advantages and {} weights",
                self.advantages.len(),
                self.weights.len()
            )));
        }
        Ok(self.lengths.iter().sum())
    }
}

/// Per-token log-probs of the response tokens, sequence after sequence (the layout of
/// [`Sequences::lengths`]).
#[derive(Debug, Clone, Copy)]
pub struct TokenLogprobs<'a> {
    /// Under the current policy (the actor update's forward).
    pub logp: &'a [f32],
    /// Under the policy that sampled the responses; `None` means the policy has not moved
    /// since (first epoch), so `rho = 1` exactly.
    pub old: Option<&'a [f32]>,
    /// Under the frozen reference policy; needed when `beta > 0`.
    pub reference: Option<&'a [f32]>,
}

/// Counts over the tokens of a coefficient computation, for logs.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CoefficientStats {
    /// Response tokens.
    pub tokens: usize,
    /// Tokens whose clipped branch is active with `A < 0, rho < 1 - eps_low`.
    pub clipped_low: usize,
    /// Tokens whose clipped branch is active with `A > 0, rho > 1 + eps_high`.
    pub clipped_high: usize,
    /// Sum of the k3 KL estimates (0 without a reference).
    pub kl_sum: f64,
    /// The loss `sum_i w_i sum_t l_it` over these tokens.
    pub loss: f64,
}

impl CoefficientStats {
    /// Adds another microbatch's counts.
    pub fn merge(&mut self, o: &CoefficientStats) {
        self.tokens += o.tokens;
        self.clipped_low += o.clipped_low;
        self.clipped_high += o.clipped_high;
        self.kl_sum += o.kl_sum;
        self.loss += o.loss;
    }

    /// Fraction of tokens whose gradient the clip zeroed.
    pub fn clip_fraction(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            (self.clipped_low + self.clipped_high) as f64 / self.tokens as f64
        }
    }

    /// Mean k3 KL per token.
    pub fn kl_mean(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.kl_sum / self.tokens as f64
        }
    }
}

/// The per-token coefficients `dL/dlogp` of a batch of sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct Coefficients {
    /// One coefficient per response token, sequence after sequence.
    pub per_token: Vec<f32>,
    /// `offsets[i]..offsets[i + 1]` are sequence `i`'s tokens in `per_token`.
    pub offsets: Vec<usize>,
    /// Counts for logs.
    pub stats: CoefficientStats,
}

fn offsets_of(lengths: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(lengths.len() + 1);
    o.push(0);
    for &l in lengths {
        o.push(o.last().copied().unwrap_or(0) + l);
    }
    o
}

/// A token's surrogate at importance ratio `rho` (its own, or its sequence's): the
/// derivative of its per-token loss in `logp` through `rho` (`dl/drho * rho`; for CISPO,
/// whose weight is detached, the derivative of `-w A logp` itself), and which side clipped.
/// At a tie the unclipped branch is taken.
struct SurrogateTerms {
    grad: f64,
    clipped_low: bool,
    clipped_high: bool,
}

fn surrogate_terms(cfg: &GrpoConfig, a: f64, rho: f64) -> SurrogateTerms {
    match cfg.surrogate {
        Surrogate::Clip => {
            let clipped_high = a > 0.0 && rho > 1.0 + cfg.eps_high as f64;
            let clipped_low = a < 0.0 && rho < 1.0 - cfg.eps_low as f64;
            // Two-sided clipping: with A < 0 and rho above delta the capped term
            // delta * A is the min (delta > 1 + eps_high), a constant.
            let capped = cfg.delta.is_some_and(|d| a < 0.0 && rho > d as f64);
            SurrogateTerms {
                grad: if clipped_high || clipped_low || capped {
                    0.0
                } else {
                    -a * rho
                },
                clipped_low,
                clipped_high: clipped_high || capped,
            }
        }
        Surrogate::Cispo => {
            let cap = cfg.eps_high as f64;
            SurrogateTerms {
                grad: -a * rho.min(cap),
                clipped_low: false,
                clipped_high: rho > cap,
            }
        }
        Surrogate::Sapo { .. } => {
            // d/drho [sigmoid(tau (rho - 1)) 4 / tau] = 4 s (1 - s): tau cancels, and at
            // rho = 1 (s = 1/2) the slope is exactly 1.
            let s = sapo_gate(cfg, a, rho);
            SurrogateTerms {
                grad: -a * 4.0 * s * (1.0 - s) * rho,
                clipped_low: false,
                clipped_high: false,
            }
        }
    }
}

/// SAPO's gate `sigmoid(tau (rho - 1))`, `tau` by the advantage's sign as TRL picks it
/// (`A > 0`: `temperature_pos`; otherwise `temperature_neg`).
fn sapo_gate(cfg: &GrpoConfig, a: f64, rho: f64) -> f64 {
    let Surrogate::Sapo {
        temperature_pos,
        temperature_neg,
    } = cfg.surrogate
    else {
        return 0.5;
    };
    let tau = if a > 0.0 {
        temperature_pos
    } else {
        temperature_neg
    } as f64;
    1.0 / (1.0 + (-tau * (rho - 1.0)).exp())
}

/// A token's per-token surrogate loss value at ratio `rho` (`detached_rho` is CISPO's
/// weight, frozen; equal to `rho` except when differentiating numerically).
fn surrogate_value(cfg: &GrpoConfig, a: f64, rho: f64, detached_rho: f64, logp: f64) -> f64 {
    match cfg.surrogate {
        Surrogate::Clip => {
            let (lo, hi) = (1.0 - cfg.eps_low as f64, 1.0 + cfg.eps_high as f64);
            let capped = cfg.delta.map_or(rho, |d| rho.min(d as f64));
            -f64::min(capped * a, rho.max(lo).min(hi) * a)
        }
        Surrogate::Cispo => -detached_rho.min(cfg.eps_high as f64) * a * logp,
        Surrogate::Sapo {
            temperature_pos,
            temperature_neg,
        } => {
            let tau = if a > 0.0 {
                temperature_pos
            } else {
                temperature_neg
            } as f64;
            -sapo_gate(cfg, a, rho) * 4.0 / tau * a
        }
    }
}

/// The importance ratios of one sequence's tokens: each its own (`token`) or the
/// sequence's geometric mean for all (`sequence`); all exactly 1 without old log-probs.
fn ratios(cfg: &GrpoConfig, logp: &[f32], old: Option<&[f32]>) -> Vec<f64> {
    let Some(old) = old else {
        return vec![1.0; logp.len()];
    };
    let log_ratio = |t: usize| logp[t] as f64 - old[t] as f64;
    match cfg.importance_sampling {
        ImportanceSampling::Token => (0..logp.len()).map(|t| log_ratio(t).exp()).collect(),
        ImportanceSampling::Sequence => {
            let mean = (0..logp.len()).map(log_ratio).sum::<f64>() / logp.len().max(1) as f64;
            vec![mean.exp(); logp.len()]
        }
    }
}

impl Coefficients {
    /// The coefficients known before the forward (the first optimizer step since the
    /// rollout, so `rho = 1`; no KL): `c = -A * w` (CISPO's `-A * min(1, eps_high) * w`),
    /// bit for bit what [`Coefficients::after_forward`] gives then. Errors when
    /// `cfg.beta > 0`, where the coefficients need the forward's log-probs.
    /// `stats.loss` is the surrogate's value at `rho = 1` (CISPO's needs the log-probs
    /// and counts 0 here).
    pub fn before_forward(cfg: &GrpoConfig, seqs: Sequences<'_>) -> Result<Self> {
        if cfg.beta != 0.0 {
            return Err(Error::Tape(format!(
                "GRPO: with beta = {} the KL term's coefficients need the current log-probs; \
                 use Coefficients::after_forward",
                cfg.beta
            )));
        }
        let total = seqs.check()?;
        let mut per_token = Vec::with_capacity(total);
        let mut stats = CoefficientStats {
            tokens: total,
            ..Default::default()
        };
        for ((&l, &a), &w) in seqs.lengths.iter().zip(seqs.advantages).zip(seqs.weights) {
            let (a, w) = (a as f64, w as f64);
            let terms = surrogate_terms(cfg, a, 1.0);
            per_token.extend(std::iter::repeat_n((w * terms.grad) as f32, l));
            if cfg.surrogate != Surrogate::Cispo {
                stats.loss += w * surrogate_value(cfg, a, 1.0, 1.0, 0.0) * l as f64;
            }
        }
        Ok(Coefficients {
            per_token,
            offsets: offsets_of(seqs.lengths),
            stats,
        })
    }

    /// The coefficients after the forward, from the current log-probs (and the old and
    /// reference ones when given): per token, `w` times the surrogate's derivative at the
    /// token's ratio (see the module docs) plus, with `beta > 0`, the KL term's:
    /// `beta rho (1 - exp(ref - logp) + k3)` with the bias correction (at the sequence
    /// level `beta rho (1 - exp(ref - logp) + mean_t k3)`), `beta (1 - exp(ref - logp))`
    /// without it.
    pub fn after_forward(
        cfg: &GrpoConfig,
        seqs: Sequences<'_>,
        lp: TokenLogprobs<'_>,
    ) -> Result<Self> {
        let total = seqs.check()?;
        check_logprobs(cfg, total, &lp)?;
        let mut per_token = Vec::with_capacity(total);
        let mut stats = CoefficientStats {
            tokens: total,
            ..Default::default()
        };
        let offsets = offsets_of(seqs.lengths);
        for (i, w2) in offsets.windows(2).enumerate() {
            let (a, w) = (seqs.advantages[i] as f64, seqs.weights[i] as f64);
            let span = w2[0]..w2[1];
            let logp = &lp.logp[span.clone()];
            let rho = ratios(cfg, logp, lp.old.map(|o| &o[span.clone()]));
            // The reference's k3 per token, and its mean over the sequence (what a
            // sequence-level ratio's KL weight differentiates into).
            let k3: Vec<f64> = match lp.reference {
                Some(r) => (span.clone())
                    .map(|t| {
                        let d = r[t] as f64 - lp.logp[t] as f64;
                        d.exp() - d - 1.0
                    })
                    .collect(),
                None => Vec::new(),
            };
            let k3_mean = k3.iter().sum::<f64>() / logp.len().max(1) as f64;
            stats.kl_sum += k3.iter().sum::<f64>();
            for (k, t) in span.enumerate() {
                let terms = surrogate_terms(cfg, a, rho[k]);
                stats.clipped_high += terms.clipped_high as usize;
                stats.clipped_low += terms.clipped_low as usize;
                let mut c = terms.grad;
                let mut l = surrogate_value(cfg, a, rho[k], rho[k], logp[k] as f64);
                if let (true, Some(r)) = (cfg.beta > 0.0, lp.reference) {
                    let d = r[t] as f64 - logp[k] as f64;
                    let beta = cfg.beta as f64;
                    if cfg.kl_bias_correction {
                        // d(rho k3)/dlogp_t: rho k3 + rho (1 - exp(ref - logp)) with the
                        // token's own ratio; with the sequence's, the k3 part spreads over
                        // its tokens as their mean.
                        let spread = match cfg.importance_sampling {
                            ImportanceSampling::Token => k3[k],
                            ImportanceSampling::Sequence => k3_mean,
                        };
                        // Without old log-probs TRL's ratio is exp(logp - logp.detach()):
                        // 1, but with its derivative, so the spread term stays.
                        c += beta * rho[k] * (1.0 - d.exp() + spread);
                        l += beta * rho[k] * k3[k];
                    } else {
                        c += beta * (1.0 - d.exp());
                        l += beta * k3[k];
                    }
                }
                stats.loss += w * l;
                per_token.push((w * c) as f32);
            }
        }
        Ok(Coefficients {
            per_token,
            offsets,
            stats,
        })
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Sequence `i`'s coefficients.
    pub fn sequence(&self, i: usize) -> &[f32] {
        &self.per_token[self.offsets[i]..self.offsets[i + 1]]
    }

    /// Exposure of each sequence: `sqrt(sum_t c_it^2)` ([`exposure_per_sequence`]).
    pub fn exposure_per_sequence(&self) -> Vec<f64> {
        exposure_per_sequence(&self.per_token, &self.offsets)
    }

    /// Exposure of all these sequences together (a microbatch's): the L2 norm of every
    /// coefficient.
    pub fn exposure(&self) -> f64 {
        exposure(&self.per_token)
    }
}

fn check_logprobs(cfg: &GrpoConfig, total: usize, lp: &TokenLogprobs<'_>) -> Result<()> {
    let check = |what: &str, v: &[f32]| -> Result<()> {
        if v.len() != total {
            return Err(Error::Tape(format!(
                "GRPO: {what} log-probs have {} entries for {total} response tokens",
                v.len()
            )));
        }
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(Error::Tape(format!(
                "GRPO: {what} log-prob {i} is {}; log-probs must be finite",
                v[i]
            )));
        }
        Ok(())
    };
    check("current", lp.logp)?;
    if let Some(o) = lp.old {
        check("old", o)?;
    }
    match lp.reference {
        Some(r) => check("reference", r)?,
        None if cfg.beta > 0.0 => {
            return Err(Error::Tape(format!(
                "GRPO: beta = {} needs the reference policy's log-probs",
                cfg.beta
            )))
        }
        None => {}
    }
    Ok(())
}

/// The loss `L = sum_i w_i sum_t l_it` from its definition (the min of the unclipped and
/// clipped surrogate, the k3 term), in f64. Independent of the coefficient formula: tests
/// differentiate it numerically; logs report it.
///
/// `old` and `reference` are constants of the loss. `old: None` gives the value with
/// `rho = 1`; to differentiate the first epoch's loss numerically, pass the unperturbed
/// current log-probs as `old` (the detached copy they stand for).
pub fn loss(cfg: &GrpoConfig, seqs: Sequences<'_>, lp: TokenLogprobs<'_>) -> Result<f64> {
    loss_with_detached(cfg, seqs, lp, None)
}

/// [`loss`] with CISPO's detached weight `min(rho, eps_high)` evaluated at the log-probs
/// `detached` (`None`: at `lp.logp`). A numerical derivative of CISPO's loss holds them
/// at the unperturbed log-probs, as autograd's detach does.
pub fn loss_with_detached(
    cfg: &GrpoConfig,
    seqs: Sequences<'_>,
    lp: TokenLogprobs<'_>,
    detached: Option<&[f32]>,
) -> Result<f64> {
    let total = seqs.check()?;
    check_logprobs(cfg, total, &lp)?;
    if detached.is_some_and(|d| d.len() != total) {
        return Err(Error::Tape(format!(
            "GRPO: detached log-probs for {total} response tokens have another length"
        )));
    }
    let mut sum = 0.0;
    let mut start = 0;
    for i in 0..seqs.lengths.len() {
        let a = seqs.advantages[i] as f64;
        let span = start..start + seqs.lengths[i];
        start = span.end;
        let logp = &lp.logp[span.clone()];
        let old = lp.old.map(|o| &o[span.clone()]);
        let rho = ratios(cfg, logp, old);
        let frozen = match detached {
            Some(d) => ratios(cfg, &d[span.clone()], old),
            None => rho.clone(),
        };
        let mut seq = 0.0;
        for (k, t) in span.enumerate() {
            let surrogate = surrogate_value(cfg, a, rho[k], frozen[k], logp[k] as f64);
            let kl = match lp.reference {
                Some(r) => {
                    let log_q_over_p = r[t] as f64 - logp[k] as f64;
                    let k3 = log_q_over_p.exp() - log_q_over_p - 1.0;
                    if cfg.kl_bias_correction {
                        rho[k] * k3
                    } else {
                        k3
                    }
                }
                None => 0.0,
            };
            seq += surrogate + cfg.beta as f64 * kl;
        }
        sum += seqs.weights[i] as f64 * seq;
    }
    Ok(sum)
}

/// Exposure of a set of rows, `sqrt(sum c^2)`: of a sequence, or of a microbatch from all
/// its rows' coefficients (padding rows carry 0).
pub fn exposure(per_token: &[f32]) -> f64 {
    per_token
        .iter()
        .map(|&c| c as f64 * c as f64)
        .sum::<f64>()
        .sqrt()
}

/// Exposure of each sequence, `sqrt(sum_t c_it^2)`, from per-token coefficients laid out
/// by `offsets` (`offsets[i]..offsets[i + 1]` are sequence `i`'s tokens).
///
/// This is what an allocator weighs risk by: a sequence's gradient contribution is linear
/// in its coefficients, and independent perturbations of its rows' saved state move the
/// gradient by about (a unit-dependent constant) x the root of the rows' squared
/// coefficients (see the module docs). Zero exposure: exactly zero gradient.
pub fn exposure_per_sequence(per_token: &[f32], offsets: &[usize]) -> Vec<f64> {
    offsets
        .windows(2)
        .map(|w| exposure(&per_token[w[0]..w[1]]))
        .collect()
}

/// Exposure of a microbatch made of the sequences `members` (indices into
/// `exposure_per_sequence`): theirs added in quadrature. Every unit instance of the microbatch's
/// forward has this exposure, since its rows are exactly the microbatch's tokens.
pub fn microbatch_exposure(exposure_per_sequence: &[f64], members: &[usize]) -> f64 {
    members
        .iter()
        .map(|&i| exposure_per_sequence[i] * exposure_per_sequence[i])
        .sum::<f64>()
        .sqrt()
}

/// Packs sequences of `rows[i]` rows (in the given order) into microbatches of at most
/// `budget` rows each, first fit in order, so a microbatch holds consecutive sequences.
/// Errors, naming the sequence and the fix, when one sequence alone exceeds the budget.
pub fn pack_by_token_budget(rows: &[usize], budget: usize) -> Result<Vec<Vec<usize>>> {
    if budget == 0 {
        return Err(Error::Tape(
            "microbatch token budget is 0; it must hold at least one whole sequence".into(),
        ));
    }
    if let Some((i, &r)) = rows.iter().enumerate().find(|(_, &r)| r > budget) {
        return Err(Error::Tape(format!(
            "sequence {i} has {r} tokens, more than the microbatch token budget of {budget}; \
             raise the budget to at least {} (the longest sequence) or lower the maximum \
             prompt + response length",
            rows.iter().max().copied().unwrap_or(r)
        )));
    }
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut cur = Vec::new();
    let mut used = 0;
    for (i, &r) in rows.iter().enumerate() {
        if used + r > budget && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
            used = 0;
        }
        cur.push(i);
        used += r;
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}
