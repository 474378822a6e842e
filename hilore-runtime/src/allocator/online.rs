//! The allocator inside a training loop: profiles each microbatch size once, calibrates on
//! the first step, plans every step's microbatches under one risk budget and, when asked,
//! folds the measured times back into the cost model.
//!
//! Byte figures of a profile are exact for microbatches of the profiled token count (and,
//! in a shared-prefix layout with every prompt first, of the profiled prompt rows and
//! log-probs: [`super::MicrobatchShape::profile_key`]), so a training loop that wants
//! exact peaks pads its microbatches to a few sizes (e.g. the token budget, and with
//! shared prefixes the prompt rows and log-probs to multiples of a quantum); each new size
//! costs one profiling pass (a store-all forward and backward that keeps every tensor: do
//! it where memory allows). A step whose microbatches have several sizes is still planned
//! as one ([`super::Allocator::plan_step_across`]).
//!
//! # Reproducible plans
//!
//! Plans decide which units are compressed, so they decide the gradients bit for bit.
//! Byte figures are deterministic; measured times are not. After calibration a plan is a
//! function of the [`AllocatorState`] (the calibrated cost model with its corrections,
//! the risk model, the budgets and codecs) and of the step's microbatches (their shapes,
//! exposures and profiles, which are re-derived exactly), nothing else:
//!
//! - calibration runs once, on the first step with exposure, and is never repeated;
//! - [`OnlineAllocator::observe`] changes nothing unless the online refresh is switched on
//!   ([`OnlineAllocator::with_refresh`]): refreshing folds every microbatch's measured
//!   times into the cost model's corrections, which tracks drift (contention, thermal
//!   throttling) but makes later plans depend on wall-clock times, so two runs of the same
//!   seed, or a run and its resumed copy, may then plan differently;
//! - [`OnlineAllocator::state`] captures everything plans depend on besides profiles, and
//!   [`OnlineAllocator::restore`] puts it back, so a training loop that checkpoints it
//!   continues with the very plans an uninterrupted run would have made, without
//!   measuring again what was measured before the checkpoint.

use super::budget::{MemoryBudget, StateBytes};
use super::calibrate::{calibrate, CalibrationReport};
use super::costs::{CostModel, ProfileKey};
use super::planner::{Allocator, Decision, MicrobatchInput, Offer};
use super::risk::RiskModel;
use super::workload::Workload;
use crate::{Error, Result, TapeTimes};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Plans a training run's steps; see the module docs.
pub struct OnlineAllocator {
    state: StateBytes,
    budget: MemoryBudget,
    target_rel_l2: f64,
    codecs: Vec<&'static str>,
    costs: CostModel,
    risk: RiskModel,
    by_shape: BTreeMap<ProfileKey, Allocator>,
    /// Whether costs and risk are calibrated (here or in the run a state was restored
    /// from).
    calibrated: bool,
    /// What this process's calibration measured (none after a restore).
    calibration: Option<CalibrationReport>,
    gc_peak: BTreeMap<ProfileKey, usize>,
    refresh: bool,
}

/// The risk model as stored: `kappa` as a list (its keys are tuples).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RiskState {
    /// `(unit, call, codec, kappa)`.
    pub kappa: Vec<(String, usize, String, f64)>,
    /// [`RiskModel::grad_norm_per_exposure`].
    pub grad_norm_per_exposure: Option<f64>,
    /// [`RiskModel::additivity_ratio`].
    pub additivity_ratio: Option<f64>,
}

impl From<&RiskModel> for RiskState {
    fn from(r: &RiskModel) -> Self {
        // Destructured in full so that a new field of the risk model cannot be left out
        // of the stored state unnoticed.
        let RiskModel {
            kappa,
            grad_norm_per_exposure,
            additivity_ratio,
        } = r;
        RiskState {
            kappa: kappa
                .iter()
                .map(|((u, c, k), &v)| (u.clone(), *c, k.clone(), v))
                .collect(),
            grad_norm_per_exposure: *grad_norm_per_exposure,
            additivity_ratio: *additivity_ratio,
        }
    }
}

impl From<&RiskState> for RiskModel {
    fn from(s: &RiskState) -> Self {
        RiskModel {
            kappa: s
                .kappa
                .iter()
                .map(|(u, c, k, v)| ((u.clone(), *c, k.clone()), *v))
                .collect(),
            grad_norm_per_exposure: s.grad_norm_per_exposure,
            additivity_ratio: s.additivity_ratio,
        }
    }
}

/// Everything an [`OnlineAllocator`]'s plans depend on besides the profiles (which are
/// re-derived exactly from the microbatches): what a training checkpoint stores.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllocatorState {
    /// The fixed state bytes of the update.
    pub state: StateBytes,
    /// The memory budget.
    pub budget: MemoryBudget,
    /// The relative gradient-error target.
    pub target_rel_l2: f64,
    /// The codecs offered.
    pub codecs: Vec<String>,
    /// Whether measured times refresh the cost model.
    pub refresh: bool,
    /// Whether costs and risk are calibrated.
    pub calibrated: bool,
    /// The cost model (fits, codec rates, prior, corrections).
    pub costs: CostModel,
    /// The risk model.
    pub risk: RiskState,
    /// Microbatch sizes (tokens) profiled so far (informational: profiles are re-derived).
    pub profiled_tokens: Vec<usize>,
}

impl std::fmt::Debug for OnlineAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnlineAllocator")
            .field("budget", &self.budget)
            .field("target_rel_l2", &self.target_rel_l2)
            .field("profiles", &self.by_shape.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// The plan of one step.
#[derive(Debug, Clone)]
pub struct StepPlan {
    /// One decision per microbatch.
    pub decisions: Vec<Decision>,
    /// The budget in bytes it was planned under.
    pub budget_bytes: usize,
}

impl OnlineAllocator {
    /// An allocator for a model whose fixed state is `state`.
    pub fn new(
        state: StateBytes,
        budget: MemoryBudget,
        target_rel_l2: f64,
        codecs: &[&'static str],
    ) -> Self {
        OnlineAllocator {
            state,
            budget,
            target_rel_l2,
            codecs: codecs.to_vec(),
            costs: CostModel::default(),
            risk: RiskModel::default(),
            by_shape: BTreeMap::new(),
            calibrated: false,
            calibration: None,
            gc_peak: BTreeMap::new(),
            refresh: false,
        }
    }

    /// Switches the online refresh of the cost model from measured times on or off (off by
    /// default; see the module docs: on, plans depend on wall-clock times).
    pub fn with_refresh(mut self, refresh: bool) -> Self {
        self.refresh = refresh;
        self
    }

    /// What this process's calibration measured, once done (`None` after a restore: the
    /// calibration was made by the run that wrote the state).
    pub fn calibration(&self) -> Option<&CalibrationReport> {
        self.calibration.as_ref()
    }

    /// Whether costs and risk are calibrated.
    pub fn is_calibrated(&self) -> bool {
        self.calibrated
    }

    /// Everything plans depend on besides the profiles; see [`OnlineAllocator::restore`].
    pub fn state(&self) -> AllocatorState {
        AllocatorState {
            state: self.state,
            budget: self.budget,
            target_rel_l2: self.target_rel_l2,
            codecs: self.codecs.iter().map(|c| c.to_string()).collect(),
            refresh: self.refresh,
            calibrated: self.calibrated,
            costs: self.costs.clone(),
            risk: RiskState::from(&self.risk),
            profiled_tokens: {
                // Keys are sorted by rows first; one entry per size.
                let mut t: Vec<usize> = self.by_shape.keys().map(|k| k.0).collect();
                t.dedup();
                t
            },
        }
    }

    /// Continues from `s` (written by [`OnlineAllocator::state`] of an allocator made with
    /// the same state bytes, budget, target and codecs; anything else is an error): the
    /// calibrated costs and risk replace this allocator's, and nothing is measured again.
    pub fn restore(&mut self, s: &AllocatorState) -> Result<()> {
        let codecs: Vec<String> = self.codecs.iter().map(|c| c.to_string()).collect();
        let mut diffs = Vec::new();
        if s.state != self.state {
            diffs.push(format!("state bytes {:?}, now {:?}", s.state, self.state));
        }
        if s.budget != self.budget {
            diffs.push(format!("budget {}, now {}", s.budget, self.budget));
        }
        if s.target_rel_l2.to_bits() != self.target_rel_l2.to_bits() {
            diffs.push(format!(
                "target {}, now {}",
                s.target_rel_l2, self.target_rel_l2
            ));
        }
        if s.codecs != codecs {
            diffs.push(format!("codecs {:?}, now {:?}", s.codecs, codecs));
        }
        if s.refresh != self.refresh {
            diffs.push(format!("refresh {}, now {}", s.refresh, self.refresh));
        }
        if !diffs.is_empty() {
            return Err(Error::Tape(format!(
                "allocator: the stored state was made with other settings ({})",
                diffs.join("; ")
            )));
        }
        self.costs = s.costs.clone();
        self.risk = RiskModel::from(&s.risk);
        self.calibrated = s.calibrated;
        self.calibration = None;
        for a in self.by_shape.values_mut() {
            a.costs = self.costs.clone();
            a.risk = self.risk.clone();
        }
        Ok(())
    }

    /// The cost model (measured, refreshed).
    pub fn costs(&self) -> &CostModel {
        &self.costs
    }

    /// Plans every microbatch of a step (profiling new sizes and calibrating on the
    /// first call).
    pub fn plan_step(&mut self, w: &mut dyn Workload) -> Result<StepPlan> {
        if w.is_empty() {
            return Ok(StepPlan {
                decisions: Vec::new(),
                budget_bytes: 0,
            });
        }
        let inputs: Vec<MicrobatchInput> = (0..w.len()).map(|i| w.input(i)).collect();
        for (i, mb) in inputs.iter().enumerate() {
            let n = mb.shape.profile_key();
            if !self.by_shape.contains_key(&n) {
                let (profile, inst) = w.profile(i)?;
                let mut a = Allocator::new(profile, &inst, self.state, &self.codecs)?;
                let gc = super::baselines::gradient_checkpointing(&a);
                self.gc_peak.insert(n, a.simulate_peak(&gc)?);
                a.costs = self.costs.clone();
                a.risk = self.risk.clone();
                self.by_shape.insert(n, a);
            }
        }
        if !self.calibrated {
            // Calibrate on (up to) the two microbatches with exposure and the most
            // different squared lengths, with the allocator of the first one's size.
            let mut idx: Vec<usize> = (0..inputs.len())
                .filter(|&i| inputs[i].exposure > 0.0)
                .collect();
            if !idx.is_empty() {
                let n = inputs[idx[0]].shape.profile_key();
                idx.retain(|&i| inputs[i].shape.profile_key() == n);
                idx.sort_by_key(|&i| inputs[i].shape.sum_sq_lengths);
                let pick: Vec<usize> = if idx.len() > 1 {
                    vec![idx[0], idx[idx.len() - 1]]
                } else {
                    idx
                };
                let a = self
                    .by_shape
                    .get_mut(&n)
                    .ok_or_else(|| Error::Tape("allocator: no profile".into()))?;
                let report = calibrate(
                    a,
                    w,
                    &pick,
                    pick.len() - 1,
                    &self.codecs.clone(),
                    &mut |_| {},
                )?;
                self.costs = a.costs.clone();
                self.risk = a.risk.clone();
                for a in self.by_shape.values_mut() {
                    a.costs = self.costs.clone();
                    a.risk = self.risk.clone();
                }
                self.calibration = Some(report);
                self.calibrated = true;
            }
        }
        if !self.calibrated {
            // Nothing measured yet (no microbatch with exposure to calibrate on): full
            // recompute, which fits by construction of the budget.
            let decisions = inputs
                .iter()
                .map(|m| {
                    let a = &self.by_shape[&m.shape.profile_key()];
                    a.fixed_decision(super::baselines::gradient_checkpointing(a))
                })
                .collect::<Result<Vec<_>>>()?;
            return Ok(StepPlan {
                decisions,
                budget_bytes: 0,
            });
        }
        // The budget: a factor of full recompute's total peak at the step's largest size.
        let gc_total = inputs
            .iter()
            .map(|m| self.gc_peak[&m.shape.profile_key()])
            .max()
            .unwrap_or(0)
            + self.state.total();
        let budget_bytes = self.budget.bytes(gc_total);
        let exposures: Vec<f64> = inputs.iter().map(|m| m.exposure).collect();
        let risk_budget = self
            .risk
            .step_budget(self.target_rel_l2, &exposures)
            .unwrap_or(0.0);
        let offer = Offer {
            codecs: self.codecs.clone(),
            recompute: true,
            open_groups: true,
        };
        // One solve for the step, each microbatch planned by the allocator of its profile
        // key, under one risk multiplier over the whole step.
        let allocs: Vec<&Allocator> = inputs
            .iter()
            .map(|m| &self.by_shape[&m.shape.profile_key()])
            .collect();
        let decisions =
            Allocator::plan_step_across(&allocs, &inputs, budget_bytes, risk_budget, &offer, None)?;
        Ok(StepPlan {
            decisions,
            budget_bytes,
        })
    }

    /// Folds one step's gradient norm into `gamma`, the gradient norm per unit of
    /// exposure (microbatches in quadrature, see [`super::risk`]): the mean of the old
    /// value and this step's `||G|| / sqrt(sum E_m^2)`. The calibration's two
    /// microbatches give a rough first value; a whole step's gradient, whose microbatch
    /// gradients partly cancel, a better one. Deterministic in the step's numbers (no
    /// timing), so plans stay reproducible on resume. Does nothing before calibration or
    /// for a step without exposure.
    pub fn observe_step_gradient(&mut self, grad_norm: f64, exposures: &[f64]) {
        if !self.calibrated {
            return;
        }
        let Some(old) = self.risk.grad_norm_per_exposure else {
            return;
        };
        let Some(new) =
            super::risk::step_gamma(grad_norm, exposures).filter(|g| *g > 0.0 && *g != old)
        else {
            return;
        };
        self.risk.grad_norm_per_exposure = Some(0.5 * (old + new));
        for a in self.by_shape.values_mut() {
            a.risk.grad_norm_per_exposure = self.risk.grad_norm_per_exposure;
        }
    }

    /// Folds one microbatch's measured times into the cost model's corrections when the
    /// online refresh is on ([`OnlineAllocator::with_refresh`]); does nothing otherwise,
    /// so that plans stay a function of the calibrated state.
    pub fn observe(&mut self, decision: &Decision, times: &TapeTimes) {
        if !self.refresh || !self.calibrated {
            return;
        }
        let c = &self.costs.corrections;
        self.costs.refresh(
            decision.predicted_recompute_seconds / c.recompute.max(1e-12),
            times.recompute.as_secs_f64(),
            decision.predicted_codec_seconds / c.codec.max(1e-12),
            (times.encode + times.decode).as_secs_f64(),
        );
        for a in self.by_shape.values_mut() {
            a.costs.corrections = self.costs.corrections.clone();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Plan;
    use std::time::Duration;

    fn allocator(refresh: bool) -> OnlineAllocator {
        OnlineAllocator::new(
            StateBytes::adamw_f32(1000),
            MemoryBudget::default(),
            1e-2,
            &["bf16"],
        )
        .with_refresh(refresh)
    }

    /// A calibrated state: one unit's recompute fit, a codec rate and a kappa.
    fn calibrated(refresh: bool) -> OnlineAllocator {
        let mut a = allocator(refresh);
        let mut costs = CostModel::default();
        costs.observe_recompute(
            "mlp",
            super::super::MicrobatchShape {
                tokens: 128,
                sum_sq_lengths: 2048,
                prompt_rows: 0,
                logprobs: 128,
            },
            3.7e-4,
        );
        costs.observe_codec("bf16", 1000, 1.1e-6, 0.9e-6);
        let mut risk = RiskModel {
            grad_norm_per_exposure: Some(0.37),
            additivity_ratio: Some(0.61),
            ..Default::default()
        };
        risk.set_kappa("mlp", 1, "bf16", 2.5e-5);
        let mut s = a.state();
        s.costs = costs;
        s.risk = RiskState::from(&risk);
        s.calibrated = true;
        a.restore(&s).unwrap();
        a
    }

    fn decision() -> Decision {
        Decision {
            plan: Plan::store_all(),
            predicted_peak_bytes: 0,
            predicted_total_bytes: 0,
            predicted_seconds: 2e-3,
            predicted_recompute_seconds: 1e-3,
            predicted_codec_seconds: 1e-3,
            predicted_risk: 0.0,
            lambda: 0.0,
            solve_seconds: 0.0,
            exact_checks: 0,
            search_checks: 0,
            counts: Vec::new(),
        }
    }

    fn times() -> TapeTimes {
        TapeTimes {
            encode: Duration::from_millis(2),
            decode: Duration::from_millis(2),
            recompute: Duration::from_millis(3),
            backward: Duration::from_millis(10),
        }
    }

    #[test]
    fn measured_times_change_nothing_unless_refresh_is_on() {
        let mut a = calibrated(false);
        let before = serde_json::to_string(&a.state()).unwrap();
        a.observe(&decision(), &times());
        assert_eq!(serde_json::to_string(&a.state()).unwrap(), before);
        // With the refresh on, the same measurement (3x / 4x the prediction) moves the
        // corrections away from 1.
        let mut a = calibrated(true);
        a.observe(&decision(), &times());
        let c = &a.costs().corrections;
        assert!(c.recompute > 1.0 && c.codec > 1.0, "{c:?}");
    }

    #[test]
    fn a_step_gradient_moves_gamma_halfway() {
        let mut a = allocator(false);
        // Before calibration: nothing.
        a.observe_step_gradient(10.0, &[30.0, 40.0]);
        assert_eq!(a.risk.grad_norm_per_exposure, None);
        let mut a = calibrated(false);
        // ||G|| = 10 over exposures 30 and 40: 10 / sqrt(30^2 + 40^2) = 0.2, and the
        // mean with the calibrated 0.37 is 0.285 (one rounding each: 1e-15).
        a.observe_step_gradient(10.0, &[30.0, 40.0]);
        let g = a.risk.grad_norm_per_exposure.unwrap();
        assert!((g - 0.285).abs() < 1e-15, "{g}");
        assert_eq!(a.state().risk, RiskState::from(&a.risk));
        // A step without exposure changes nothing.
        a.observe_step_gradient(10.0, &[0.0]);
        assert_eq!(a.risk.grad_norm_per_exposure, Some(g));
    }

    #[test]
    fn state_round_trips_and_settings_must_match() {
        let a = calibrated(false);
        let s = a.state();
        let mut b = allocator(false);
        assert!(!b.is_calibrated());
        b.restore(&s).unwrap();
        assert!(b.is_calibrated());
        assert_eq!(
            serde_json::to_value(b.state()).unwrap(),
            serde_json::to_value(&s).unwrap()
        );
        assert_eq!(b.risk.kappa("mlp", 1, "bf16"), Some(2.5e-5));
        // Another budget, or another refresh setting, is an error naming it.
        let mut c = OnlineAllocator::new(
            StateBytes::adamw_f32(1000),
            MemoryBudget::Factor(1.5),
            1e-2,
            &["bf16"],
        );
        let e = c.restore(&s).unwrap_err().to_string();
        assert!(e.contains("budget"), "{e}");
        let e = allocator(true).restore(&s).unwrap_err().to_string();
        assert!(e.contains("refresh"), "{e}");
    }
}
