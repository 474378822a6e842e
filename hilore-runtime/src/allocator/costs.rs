//! Measured recovery costs: how long recomputing a unit instance takes, and how long a
//! codec takes to encode and decode its saved activations, on the device in use.
//!
//! Recompute time is modelled per unit (all calls of a unit have the same shapes) as
//! `t = a * tokens + b * sum_sq_lengths` with `a, b >= 0`, fitted by non-negative least
//! squares to measured recomputes of microbatches of different shapes: the projections,
//! norms and the LM head grow with the token count, attention with the squared sequence
//! lengths. Codec time is modelled as seconds per encoded value (encode and decode
//! separately), fitted through the origin. Before a unit is measured, its cost
//! expression (the `cost = ...` of `#[recovery_unit]`) times a global seconds-per-cost
//! rate is the prior. During training, [`CostModel::refresh`] folds each step's measured
//! recompute / encode / decode totals into multiplicative corrections (exponential moving
//! average), so drift (thermal, contention, another batch shape) is tracked without
//! re-profiling.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The microbatch features costs depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MicrobatchShape {
    /// Rows (tokens) of the microbatch.
    pub tokens: usize,
    /// Sum over its sequences of the squared length ([`crate::Packing::sum_sq_lengths`]).
    pub sum_sq_lengths: usize,
    /// Rows of the prompts in a shared-prefix layout with every prompt first
    /// ([`crate::Packing::shared_prefix_rows`]), 0 in any other layout. A model may run its
    /// row-wise units on the prompts' and the responses' rows apart, so two microbatches
    /// of the same rows but other prompt rows can save other bytes per unit instance.
    pub prompt_rows: usize,
    /// Log-probs the microbatch computes: one per row without shared prefixes; with them,
    /// a prompt's rows but its last and every response token (a response's first one is
    /// read from its prompt's last row), so it depends on how many prompts and responses
    /// the rows hold. A model's head saves what it computes per log-prob.
    pub logprobs: usize,
}

/// What a profile's byte figures are exact for ([`MicrobatchShape::profile_key`]): rows,
/// prompt rows and log-probs.
pub type ProfileKey = (usize, usize, usize);

impl MicrobatchShape {
    /// The shape of a packing, with one log-prob per row (every layout without shared
    /// prefixes; for a shared-prefix packing give the batch's count with
    /// [`MicrobatchShape::with_logprobs`]).
    pub fn of(packing: &crate::Packing) -> Self {
        MicrobatchShape {
            tokens: packing.total_tokens(),
            sum_sq_lengths: packing.sum_sq_lengths(),
            prompt_rows: packing.shared_prefix_rows().unwrap_or(0),
            logprobs: packing.total_tokens(),
        }
    }

    /// The same shape computing `logprobs` log-probs.
    pub fn with_logprobs(self, logprobs: usize) -> Self {
        MicrobatchShape { logprobs, ..self }
    }

    /// What a profile's byte figures are exact for: microbatches of the same rows, prompt
    /// rows and log-probs (every saved tensor is linear in the rows of the part it is
    /// computed on, or in the log-probs for the head's, and none depends on how they split
    /// into sequences).
    pub fn profile_key(&self) -> ProfileKey {
        (self.tokens, self.prompt_rows, self.logprobs)
    }
}

/// `t = a * tokens + b * sum_sq_lengths`, non-negative coefficients.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RecomputeFit {
    /// Seconds per token.
    pub a: f64,
    /// Seconds per squared sequence length.
    pub b: f64,
    /// Measurements: (tokens, sum of squared lengths, seconds for one instance).
    pub samples: Vec<(f64, f64, f64)>,
}

impl RecomputeFit {
    fn refit(&mut self) {
        let s = &self.samples;
        let (mut xx, mut xy, mut yy, mut xt, mut yt) = (0.0, 0.0, 0.0, 0.0, 0.0);
        for &(n, q, t) in s {
            xx += n * n;
            xy += n * q;
            yy += q * q;
            xt += n * t;
            yt += q * t;
        }
        let sse = |a: f64, b: f64| -> f64 {
            s.iter()
                .map(|&(n, q, t)| (a * n + b * q - t).powi(2))
                .sum::<f64>()
        };
        // Candidates of the non-negative least squares: both coefficients free (when the
        // normal matrix is well conditioned), or one of them zero.
        let mut cands = Vec::new();
        let det = xx * yy - xy * xy;
        if det > 1e-9 * xx * yy && xx > 0.0 && yy > 0.0 {
            let a = (xt * yy - yt * xy) / det;
            let b = (yt * xx - xt * xy) / det;
            if a >= 0.0 && b >= 0.0 {
                cands.push((a, b));
            }
        }
        if xx > 0.0 {
            cands.push(((xt / xx).max(0.0), 0.0));
        }
        if yy > 0.0 {
            cands.push((0.0, (yt / yy).max(0.0)));
        }
        if let Some(&(a, b)) = cands
            .iter()
            .min_by(|x, y| sse(x.0, x.1).total_cmp(&sse(y.0, y.1)))
        {
            self.a = a;
            self.b = b;
        }
    }

    /// Predicted seconds for one instance at `shape`.
    pub fn predict(&self, shape: MicrobatchShape) -> f64 {
        self.a * shape.tokens as f64 + self.b * shape.sum_sq_lengths as f64
    }
}

/// Seconds per value for one codec.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CodecRate {
    /// Encode seconds per value.
    pub encode: f64,
    /// Decode seconds per value.
    pub decode: f64,
    values: f64,
    encode_seconds: f64,
    decode_seconds: f64,
}

/// Multiplicative corrections from training steps (1.0 until refreshed).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Corrections {
    /// Measured / predicted recompute time.
    pub recompute: f64,
    /// Measured / predicted encode + decode time.
    pub codec: f64,
    /// Weight of the newest step in the moving average.
    pub weight: f64,
}

impl Default for Corrections {
    fn default() -> Self {
        Corrections {
            recompute: 1.0,
            codec: 1.0,
            weight: 0.3,
        }
    }
}

/// The cost model: recompute fits per unit, codec rates, the cost-expression prior and
/// the running corrections.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CostModel {
    /// Per unit name.
    pub recompute: BTreeMap<String, RecomputeFit>,
    /// Per codec name.
    pub codecs: BTreeMap<String, CodecRate>,
    /// Seconds per unit of cost expression (the prior), if known.
    pub seconds_per_cost: Option<f64>,
    /// Running corrections.
    pub corrections: Corrections,
    /// Seconds one exact simulation of a profile takes per recorded event (measured at
    /// calibration; [`crate::simulate::Profile::num_events`]), if known. The planner's
    /// exact searches weigh what a simulation costs against the time it may save: the
    /// plan's solve is part of the step it plans.
    #[serde(default)]
    pub simulation_seconds_per_event: Option<f64>,
}

impl CostModel {
    /// Records that recomputing one instance of `unit` at `shape` took `seconds`.
    pub fn observe_recompute(&mut self, unit: &str, shape: MicrobatchShape, seconds: f64) {
        let fit = self.recompute.entry(unit.to_string()).or_default();
        fit.samples
            .push((shape.tokens as f64, shape.sum_sq_lengths as f64, seconds));
        fit.refit();
    }

    /// Records that encoding `values` values with `codec` took `encode` seconds and
    /// decoding them `decode` seconds.
    pub fn observe_codec(&mut self, codec: &str, values: usize, encode: f64, decode: f64) {
        let r = self.codecs.entry(codec.to_string()).or_default();
        r.values += values as f64;
        r.encode_seconds += encode;
        r.decode_seconds += decode;
        if r.values > 0.0 {
            r.encode = r.encode_seconds / r.values;
            r.decode = r.decode_seconds / r.values;
        }
    }

    /// Sets the prior from a pass: `seconds` of forward for `total_cost` units of cost
    /// expression.
    pub fn set_prior(&mut self, seconds: f64, total_cost: f64) {
        if total_cost > 0.0 && seconds > 0.0 {
            self.seconds_per_cost = Some(seconds / total_cost);
        }
    }

    /// Whether `unit` has been measured.
    pub fn is_measured(&self, unit: &str) -> bool {
        self.recompute
            .get(unit)
            .is_some_and(|f| !f.samples.is_empty())
    }

    /// Predicted seconds to recompute one instance of `unit` at `shape`; `cost` is the
    /// instance's cost-expression value, used (times the prior rate) when the unit has no
    /// measurement. `None` when neither is known.
    pub fn recompute_seconds(
        &self,
        unit: &str,
        shape: MicrobatchShape,
        cost: Option<f64>,
    ) -> Option<f64> {
        let raw = match self.recompute.get(unit) {
            Some(f) if !f.samples.is_empty() => Some(f.predict(shape)),
            _ => match (self.seconds_per_cost, cost) {
                (Some(r), Some(c)) => Some(r * c),
                _ => None,
            },
        };
        raw.map(|t| t * self.corrections.recompute)
    }

    /// Predicted encode + decode seconds of `values` values with `codec`.
    pub fn codec_seconds(&self, codec: &str, values: usize) -> Option<f64> {
        self.codecs
            .get(codec)
            .filter(|r| r.values > 0.0)
            .map(|r| (r.encode + r.decode) * values as f64 * self.corrections.codec)
    }

    /// Folds one step's measured times into the corrections: `predicted_*` are what the
    /// model said before the correction, `measured_*` what the tape reported.
    pub fn refresh(
        &mut self,
        predicted_recompute: f64,
        measured_recompute: f64,
        predicted_codec: f64,
        measured_codec: f64,
    ) {
        let w = self.corrections.weight;
        if predicted_recompute > 0.0 && measured_recompute > 0.0 {
            let ratio = measured_recompute / predicted_recompute;
            self.corrections.recompute = (1.0 - w) * self.corrections.recompute + w * ratio;
        }
        if predicted_codec > 0.0 && measured_codec > 0.0 {
            let ratio = measured_codec / predicted_codec;
            self.corrections.codec = (1.0 - w) * self.corrections.codec + w * ratio;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, s: usize) -> MicrobatchShape {
        MicrobatchShape {
            tokens: n,
            sum_sq_lengths: s,
            prompt_rows: 0,
            logprobs: n,
        }
    }

    #[test]
    fn fit_recovers_a_linear_model() {
        let mut m = CostModel::default();
        for (n, s) in [(100, 5_000), (200, 7_000), (150, 20_000)] {
            m.observe_recompute("u", shape(n, s), 2e-4 * n as f64 + 3e-8 * s as f64);
        }
        let f = &m.recompute["u"];
        assert!(
            (f.a - 2e-4).abs() < 1e-12 && (f.b - 3e-8).abs() < 1e-15,
            "{f:?}"
        );
    }

    #[test]
    fn fit_stays_non_negative() {
        let mut m = CostModel::default();
        // Time falls with the squared lengths here: the NNLS drops that feature.
        m.observe_recompute("u", shape(100, 1_000), 1.0);
        m.observe_recompute("u", shape(100, 9_000), 0.9);
        let f = &m.recompute["u"];
        assert!(f.a >= 0.0 && f.b >= 0.0);
        assert!(m.recompute_seconds("u", shape(100, 5_000), None).unwrap() > 0.0);
    }

    #[test]
    fn prior_until_measured() {
        let mut m = CostModel::default();
        assert_eq!(m.recompute_seconds("u", shape(1, 1), Some(10.0)), None);
        m.set_prior(2.0, 1000.0);
        assert_eq!(
            m.recompute_seconds("u", shape(1, 1), Some(10.0)),
            Some(0.02)
        );
        m.observe_recompute("u", shape(10, 0), 1.0);
        assert!((m.recompute_seconds("u", shape(20, 0), Some(10.0)).unwrap() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn refresh_tracks_drift() {
        let mut m = CostModel::default();
        m.observe_recompute("u", shape(10, 0), 1.0);
        for _ in 0..40 {
            let p = m.recompute_seconds("u", shape(10, 0), None).unwrap();
            m.refresh(p / m.corrections.recompute, 2.0, 0.0, 0.0);
        }
        assert!((m.corrections.recompute - 2.0).abs() < 1e-3);
    }
}
