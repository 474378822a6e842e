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
//! - Ratio (per token): `rho = exp(logp - logp_old)`.
//! - Per-token loss: `l = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * kl`,
//!   with the k3 estimator of `KL(pi || pi_ref)`, `k3 = exp(ref - logp) - (ref - logp) - 1`,
//!   importance-weighted by default (`kl = rho * k3`, TRL's `use_bias_correction_kl`: the
//!   samples come from `pi_old`, so `rho * k3` is the unbiased estimate under `pi`) or as
//!   is (`kl = k3`, [`GrpoConfig::kl_bias_correction`] off).
//! - Aggregation: `L = sum_i w_i sum_t l_it`, with the weight `w_i` of every token of
//!   sequence `i` ([`Aggregation`]): token-mean over the whole optimizer step,
//!   `w_i = 1 / sum_j |o_j|` (TRL's `dapo`, its default), seq-mean-token-mean,
//!   `w_i = 1 / (S * |o_i|)` over the `S` sequences of the step, empty ones counted
//!   (TRL's `grpo`), or a constant, `w = 1 / (S * max_completion_length)` (`dr_grpo`).
//!
//! ## The coefficients
//!
//! Differentiating `l` through `logp` (`d rho / d logp = rho`,
//! `d k3 / d logp = 1 - exp(ref - logp)`):
//!
//! `c = w * ( -A * rho * [branch not clipped] + beta * rho * (1 - exp(ref - logp) + k3) )`
//!
//! with the bias correction (`rho = 1` in the first epoch, where the KL part is
//! `beta * (1 - exp(ref - logp) + k3)`), `c = w * ( ... + beta * (1 - exp(ref - logp)) )`
//! without it.
//!
//! where the clipped branch is active (and its gradient zero) exactly when the min picks
//! the clamped term with `rho` outside the clip range: `A > 0` and `rho > 1 + eps_high`, or
//! `A < 0` and `rho < 1 - eps_low`. At a tie the unclipped branch is taken. With two-sided
//! clipping (TRL's `delta > 1 + eps_high`) the unclipped term is `min(rho, delta) * A`, so
//! `A < 0` and `rho > delta` has zero gradient too.
//!
//! **Known before the forward**: with one update epoch per rollout (`mu = 1`: the policy
//! has not moved since the rollout, so `logp_old = logp` and `rho = 1` exactly, the way
//! TRL sets `old = logp.detach()`) and no KL term (`beta = 0`), `c = -A * w`: a function of
//! the rewards and the response lengths alone, known before the actor update's forward
//! ([`Coefficients::before_forward`], [`known_before_forward`]). This is what lets an
//! allocator plan a microbatch's fidelities from its exposure before running it.
//!
//! Two-sided clipping (`delta`) does not change this: in the first epoch `rho = 1 < delta`.
//!
//! **Known only after the forward** (but before backward, with no extra backward pass):
//! with `beta > 0` (the KL term needs the current `logp`), or in epochs after the first
//! (`rho != 1`, and the clip branch depends on it). [`Coefficients::after_forward`]
//! computes them from the forward's log-probs.
//!
//! ## Exposure
//!
//! The exposure of a sequence is the root of its squared coefficients,
//! `sqrt(sum_t c_it^2)` ([`exposure_per_sequence`]); of a microbatch (and of every unit
//! instance in it, whose rows are the microbatch's tokens) the root of its sequences'
//! squared exposures ([`microbatch_exposure`]), i.e. the L2 norm of its rows'
//! coefficients. Rounding a unit's saved activations perturbs every row independently,
//! and row `t`'s share of the parameter-gradient error is proportional to `c_t`, so the
//! error adds in quadrature over rows: it grows with this norm, not with `sum |c|` (on
//! the benchmark's GRPO step, compress-all's error per unit of `sum |c|` spanned a
//! factor 1.97 across microbatches, per unit of this norm a factor 1.37). A sequence
//! with zero exposure contributes exactly zero gradient: with `beta = 0` that is every
//! sequence whose advantage is 0 (e.g. every sequence of a group whose rewards are all
//! equal), whatever the epoch.

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

/// How per-token losses are summed into the step's loss (TRL's `loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Mean over every response token of the optimizer step: `w = 1 / sum_j |o_j|`
    /// (TRL's `dapo`, its default).
    #[default]
    TokenMean,
    /// Mean over the step's `S` sequences of each sequence's token mean:
    /// `w_i = 1 / (S |o_i|)` (TRL's `grpo`). `S` counts every sequence, empty ones too, as
    /// TRL's mean over the batch does.
    SeqMeanTokenMean,
    /// A constant normaliser: `w = 1 / (S * max_completion_length)` over the step's `S`
    /// sequences (TRL's `dr_grpo`, Dr. GRPO's unbiased sum).
    DrGrpo {
        /// The longest a completion may be (`--max-new-tokens`).
        max_completion_length: usize,
    },
}

impl Aggregation {
    /// Parses TRL's loss types `dapo`, `grpo` or `dr_grpo` (also `token-mean`,
    /// `seq-mean-token-mean`, `dr-grpo`); `dr_grpo` normalises by
    /// `max_completion_length`.
    pub fn parse(s: &str, max_completion_length: usize) -> Result<Self> {
        match s {
            "dapo" | "token-mean" => Ok(Self::TokenMean),
            "grpo" | "seq-mean-token-mean" => Ok(Self::SeqMeanTokenMean),
            "dr_grpo" | "dr-grpo" => Ok(Self::DrGrpo {
                max_completion_length,
            }),
            _ => Err(Error::Tape(format!(
                "unknown loss type `{s}`; use `dapo` (token mean over the step), `grpo` (mean of the sequences' token means) or `dr_grpo` (sum over max_completion_length)"
            ))),
        }
    }
}

impl fmt::Display for Aggregation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::TokenMean => "dapo",
            Self::SeqMeanTokenMean => "grpo",
            Self::DrGrpo { .. } => "dr_grpo",
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
        }
    }
}

impl GrpoConfig {
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

/// Whether the coefficients of update epoch `epoch` (0-based) are known before the
/// actor update's forward: only in the first epoch (`rho = 1`) and without a KL term.
pub fn known_before_forward(cfg: &GrpoConfig, epoch: usize) -> bool {
    epoch == 0 && cfg.beta == 0.0
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

/// The aggregation weight `w_i` of every token of each sequence, for the sequences of one
/// optimizer step with `lengths[i]` response tokens each. Empty sequences get weight 0.
pub fn aggregation_weights(lengths: &[usize], aggregation: Aggregation) -> Vec<f32> {
    aggregation_weights_masked(lengths, None, aggregation)
}

/// [`aggregation_weights`] with the sequences where `masked[i]` is true left out of the
/// loss (TRL's `mask_truncated_completions`: responses cut at the length limit): their
/// weight is 0 and their tokens leave `dapo`'s token count, while `grpo`'s mean and
/// `dr_grpo`'s normaliser still count them, as TRL's per-batch means do.
pub fn aggregation_weights_masked(
    lengths: &[usize],
    masked: Option<&[bool]>,
    aggregation: Aggregation,
) -> Vec<f32> {
    let kept = |i: usize| lengths[i] > 0 && !masked.is_some_and(|m| m[i]);
    let per_sequence = |w: &dyn Fn(usize) -> f64| -> Vec<f32> {
        (0..lengths.len())
            .map(|i| if kept(i) { w(i) as f32 } else { 0.0 })
            .collect()
    };
    match aggregation {
        Aggregation::TokenMean => {
            let total: usize = (0..lengths.len())
                .filter(|&i| kept(i))
                .map(|i| lengths[i])
                .sum();
            per_sequence(&|_| 1.0 / total.max(1) as f64)
        }
        Aggregation::DrGrpo {
            max_completion_length,
        } => {
            let d = lengths.len() as f64 * max_completion_length.max(1) as f64;
            per_sequence(&|_| 1.0 / d)
        }
        Aggregation::SeqMeanTokenMean => {
            let s = lengths.len() as f64;
            per_sequence(&|i| 1.0 / (s * lengths[i] as f64))
        }
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

impl Coefficients {
    /// The coefficients known before the forward: `c = -A * w` (first epoch, so `rho = 1`;
    /// no KL). Errors when `cfg.beta > 0`, where the coefficients need the forward's
    /// log-probs ([`Coefficients::after_forward`]).
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
            let c = -(a as f64) * w as f64;
            per_token.extend(std::iter::repeat_n(c as f32, l));
            // l = -A per token when rho = 1 and beta = 0.
            stats.loss += -(a as f64) * w as f64 * l as f64;
        }
        Ok(Coefficients {
            per_token,
            offsets: offsets_of(seqs.lengths),
            stats,
        })
    }

    /// The coefficients after the forward, from the current log-probs (and the old and
    /// reference ones when given): `c = w (-A rho [not clipped] + beta rho (1 - exp(ref - logp) + k3))`
    /// (`beta (1 - exp(ref - logp))` for the KL part without the bias correction).
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
            for t in w2[0]..w2[1] {
                let logp = lp.logp[t] as f64;
                let rho = match lp.old {
                    Some(old) => (logp - old[t] as f64).exp(),
                    None => 1.0,
                };
                let clipped_high = a > 0.0 && rho > 1.0 + cfg.eps_high as f64;
                let clipped_low = a < 0.0 && rho < 1.0 - cfg.eps_low as f64;
                // Two-sided clipping: with A < 0 and rho above delta the capped term
                // delta * A is the min (delta > 1 + eps_high), a constant.
                let capped = cfg.delta.is_some_and(|d| a < 0.0 && rho > d as f64);
                stats.clipped_high += (clipped_high || capped) as usize;
                stats.clipped_low += clipped_low as usize;
                let mut c = if clipped_high || clipped_low || capped {
                    0.0
                } else {
                    -a * rho
                };
                let clipped_rho = rho.clamp(1.0 - cfg.eps_low as f64, 1.0 + cfg.eps_high as f64);
                let rho1 = cfg.delta.map_or(rho, |d| rho.min(d as f64));
                let mut l = -(rho1 * a).min(clipped_rho * a);
                if let (true, Some(r)) = (cfg.beta > 0.0, lp.reference) {
                    let d = r[t] as f64 - logp;
                    let k3 = d.exp() - d - 1.0;
                    stats.kl_sum += k3;
                    if cfg.kl_bias_correction {
                        // d(rho k3)/dlogp = rho k3 + rho (1 - exp(ref - logp)).
                        c += cfg.beta as f64 * rho * (1.0 - d.exp() + k3);
                        l += cfg.beta as f64 * rho * k3;
                    } else {
                        c += cfg.beta as f64 * (1.0 - d.exp());
                        l += cfg.beta as f64 * k3;
                    }
                } else if let Some(r) = lp.reference {
                    let d = r[t] as f64 - logp;
                    stats.kl_sum += d.exp() - d - 1.0;
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
    let total = seqs.check()?;
    check_logprobs(cfg, total, &lp)?;
    let (lo, hi) = (1.0 - cfg.eps_low as f64, 1.0 + cfg.eps_high as f64);
    let mut sum = 0.0;
    let mut t = 0;
    for i in 0..seqs.lengths.len() {
        let a = seqs.advantages[i] as f64;
        let mut seq = 0.0;
        for _ in 0..seqs.lengths[i] {
            let logp = lp.logp[t] as f64;
            let ratio = lp.old.map_or(1.0, |o| (logp - o[t] as f64).exp());
            let capped = cfg.delta.map_or(ratio, |d| ratio.min(d as f64));
            let surrogate = f64::min(capped * a, ratio.max(lo).min(hi) * a);
            let kl = match lp.reference {
                Some(r) => {
                    let log_q_over_p = r[t] as f64 - logp;
                    let k3 = log_q_over_p.exp() - log_q_over_p - 1.0;
                    if cfg.kl_bias_correction {
                        ratio * k3
                    } else {
                        k3
                    }
                }
                None => 0.0,
            };
            seq += -surrogate + cfg.beta as f64 * kl;
            t += 1;
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
