//! Update-conditioned risk: how much gradient error a lossy fidelity may add, given how
//! much the microbatch can move the policy update.
//!
//! A compressed unit perturbs its saved activations; backward turns the perturbation into
//! a parameter-gradient error whose size is proportional to the upstream gradient, which
//! starts from the per-token coefficients `c = dL/dlogp`. So the error of compressing
//! unit instance `u` with codec `k` on microbatch `m` is modelled as
//!
//! `r(u, k, m) = kappa(u, k) * exposure(u, m)`,
//! `exposure(u, m) = sqrt(sum over u's rows of c^2)`
//!
//! (a row weighted by its sequence's squared exposure per row; every unit of the decoder
//! sees every row of the microbatch, so `exposure(u, m)` is the microbatch's exposure).
//! The rows' shares of the error are independent rounding noise scaled by their
//! coefficients, so they add in quadrature like everything below ([`crate::grpo`]'s
//! exposure docs give the measurement that chose this over `sum |c|`). `kappa`
//! is calibrated by measurement: the L2 norm of the parameter-gradient error when only
//! that unit is compressed, divided by the calibration microbatch's exposure (and by the
//! square root of the unit's number of calls when they were compressed together).
//!
//! Risks add in quadrature. Compressing two units perturbs their activations with
//! independent rounding noise, and two microbatches are different data, so their
//! gradient errors are independent: the error of a step is about
//! `sqrt(sum over compressed instances and microbatches of r^2)`. (A plain sum is a
//! triangle-inequality bound; it overstates the error more the more units are
//! compressed, so its slack depended on the plan mix: a
//! tight budget that forces a few lossy units into the microbatches that carry the
//! update then overshot the target.) The allocator's knapsack therefore carries squared
//! risks, which are additive. The microbatches' own gradients are independent too (GRPO
//! advantages are centred per group), so the exact gradient's norm is about
//! `gamma * sqrt(sum E_m^2)` and the risk budget of a step is a bound on the root of the
//! summed squares:
//!
//! `B = target_rel_l2 * gamma * sqrt(sum E_m^2) / rho`,
//!
//! with `gamma` calibrated as `||sum of the calibration microbatches' exact gradients|| /
//! sqrt(sum of their E_m^2)` (or from a whole step's gradient, which is better:
//! [`RiskModel::calibrate_step_norm`]) and `rho` the calibrated ratio of measured to
//! predicted error when every unit is compressed at once (a held-out validation can
//! rescale it; `hilore bench` does).
//!
//! Microbatches with little exposure (most sequences with advantage 0) then carry little
//! risk and can take cheap lossy fidelities; that is what exposure buys.

use serde::Serialize;
use std::collections::BTreeMap;

/// The default target: relative L2 error of the step's gradient.
pub const DEFAULT_TARGET_REL_L2: f64 = 1e-2;

/// Calibrated sensitivities and the gradient-norm scale.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RiskModel {
    /// Gradient-error norm per unit of exposure, per (unit, call, codec).
    pub kappa: BTreeMap<(String, usize, String), f64>,
    /// `||exact gradient|| / sqrt(sum of squared microbatch exposures)` of the
    /// calibration data.
    pub grad_norm_per_exposure: Option<f64>,
    /// Measured / predicted error (risks in quadrature) when many units are compressed
    /// at once (calibrated; 1 until then); the risk budget is scaled by it to hit the
    /// target fidelity.
    pub additivity_ratio: Option<f64>,
}

impl RiskModel {
    /// Sets `kappa` of one instance and codec.
    pub fn set_kappa(&mut self, unit: &str, call: usize, codec: &str, kappa: f64) {
        self.kappa
            .insert((unit.to_string(), call, codec.to_string()), kappa);
    }

    /// `kappa` of one instance and codec, if calibrated.
    pub fn kappa(&self, unit: &str, call: usize, codec: &str) -> Option<f64> {
        self.kappa
            .get(&(unit.to_string(), call, codec.to_string()))
            .copied()
    }

    /// The predicted risk of compressing one instance with `codec` on a microbatch of the
    /// given exposure; `None` when uncalibrated (the allocator then does not offer it).
    pub fn risk(&self, unit: &str, call: usize, codec: &str, exposure: f64) -> Option<f64> {
        self.kappa(unit, call, codec).map(|k| k * exposure)
    }

    /// The mean `kappa` of a codec over every calibrated instance (an exposure-blind,
    /// unit-blind sensitivity, as a generic allocator would assume).
    pub fn mean_kappa(&self, codec: &str) -> Option<f64> {
        let v: Vec<f64> = self
            .kappa
            .iter()
            .filter(|((_, _, c), _)| c == codec)
            .map(|(_, &k)| k)
            .collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// Sets `gamma` from one whole step's exact gradient norm and its microbatches'
    /// exposures: `gamma = ||G|| / sqrt(sum E_m^2)` (see the module docs). Better than the
    /// calibration microbatches' estimate when a step's microbatch gradients cancel in
    /// part (GRPO advantages are centred per group, and a group may span microbatches).
    /// No-op when the step has no exposure.
    pub fn calibrate_step_norm(&mut self, step_grad_norm: f64, exposures: &[f64]) {
        if let Some(g) = step_gamma(step_grad_norm, exposures) {
            self.grad_norm_per_exposure = Some(g);
        }
    }

    /// The absolute risk budget of a step whose microbatches have the given exposures, a
    /// bound on the root of the summed squared risks (see the module docs):
    /// `target * gamma * sqrt(sum E_m^2) / additivity_ratio`.
    pub fn step_budget(&self, target_rel_l2: f64, exposures: &[f64]) -> Option<f64> {
        let rho = self
            .additivity_ratio
            .filter(|r| *r > 0.0 && r.is_finite())
            .unwrap_or(1.0);
        let norm = exposures.iter().map(|e| e * e).sum::<f64>().sqrt();
        self.grad_norm_per_exposure
            .map(|g| target_rel_l2 * g * norm / rho)
    }
}

/// One step's `gamma = ||G|| / sqrt(sum E_m^2)`; `None` when the step has no exposure or
/// the norm is not finite.
pub fn step_gamma(step_grad_norm: f64, exposures: &[f64]) -> Option<f64> {
    let e = exposures.iter().map(|e| e * e).sum::<f64>().sqrt();
    (e > 0.0 && step_grad_norm.is_finite()).then(|| step_grad_norm / e)
}

/// Exposure of a unit instance that reads the given rows: every row weighted by its
/// sequence's squared exposure per row (`sequence exposure^2 / sequence length`), the
/// root of the sum. For a unit that reads every row this is the sequences' exposures
/// added in quadrature.
pub fn instance_exposure(
    sequence_exposure: &[f64],
    offsets: &[usize],
    rows: impl IntoIterator<Item = usize>,
) -> f64 {
    rows.into_iter()
        .map(|r| {
            let s = offsets.partition_point(|&o| o <= r) - 1;
            let len = (offsets[s + 1] - offsets[s]).max(1) as f64;
            sequence_exposure[s] * sequence_exposure[s] / len
        })
        .sum::<f64>()
        .sqrt()
}

/// Relative L2 error and cosine of `got` against `want` (flattened gradients).
pub fn grad_error(got: &[f32], want: &[f32]) -> (f64, f64, f64) {
    let (mut d2, mut w2, mut g2, mut dot) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        let (a, b) = (a as f64, b as f64);
        d2 += (a - b) * (a - b);
        w2 += b * b;
        g2 += a * a;
        dot += a * b;
    }
    let rel = if w2 > 0.0 {
        (d2 / w2).sqrt()
    } else {
        d2.sqrt()
    };
    let cos = if g2 > 0.0 && w2 > 0.0 {
        dot / (g2.sqrt() * w2.sqrt())
    } else {
        1.0
    };
    (d2.sqrt(), rel, cos)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposure_of_rows() {
        let c = [1.0f32, -1.0, 0.0, 0.0, 0.5, 0.5, 0.5];
        let off = [0, 2, 4, 7];
        let e = crate::grpo::exposure_per_sequence(&c, &off);
        // sqrt(1 + 1), 0, sqrt(3 * 0.25): exact in f64 up to the roots' rounding.
        assert!((e[0] - 2f64.sqrt()).abs() < 1e-15);
        assert_eq!(e[1], 0.0);
        assert!((e[2] - 0.75f64.sqrt()).abs() < 1e-15);
        // Every row: sqrt(2 + 0.75), the root of the summed squares.
        let all = instance_exposure(&e, &off, 0..7);
        assert!((all - 2.75f64.sqrt()).abs() < 1e-12);
        // Rows of the zero-exposure sequence carry nothing.
        assert_eq!(instance_exposure(&e, &off, 2..4), 0.0);
        // One row of each: sqrt(2 / 2 + 0.75 / 3) = sqrt(1.25).
        assert!((instance_exposure(&e, &off, [0, 4]) - 1.25f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn budget_scales_with_exposure() {
        let mut r = RiskModel {
            grad_norm_per_exposure: Some(0.5),
            ..Default::default()
        };
        r.set_kappa("u", 0, "fp8", 2e-3);
        assert_eq!(r.risk("u", 0, "fp8", 10.0), Some(2e-2));
        assert_eq!(r.risk("u", 1, "fp8", 10.0), None);
        // One microbatch: 1e-2 * 0.5 * 100.
        assert_eq!(r.step_budget(1e-2, &[100.0]), Some(0.5));
        // Two of 30 and 40 add in quadrature: sqrt(900 + 1600) = 50.
        assert_eq!(r.step_budget(1e-2, &[30.0, 40.0]), Some(0.25));
        // A step of norm 10 over exposures 30 and 40: gamma = 10 / 50.
        r.calibrate_step_norm(10.0, &[30.0, 40.0]);
        assert_eq!(r.grad_norm_per_exposure, Some(0.2));
        r.calibrate_step_norm(10.0, &[0.0]);
        assert_eq!(r.grad_norm_per_exposure, Some(0.2));
    }
}
