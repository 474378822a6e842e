//! Calibration: measure recompute and codec times and the per-unit sensitivity `kappa`
//! on real passes of a [`Workload`]'s microbatches, each run under a plan.
//!
//! - Recompute time: for every unit that may be recomputed and every calibration
//!   microbatch, a pass with every instance of that unit recomputed; the tape's
//!   recompute time divided by the instance count is one sample of the unit's fit (at
//!   that microbatch's shape). On the kappa microbatch these ride along the compression
//!   passes below (recompute is exact and timed separately from encode / decode).
//! - Codec time and `kappa`: for every class of a unit with activation slots and every
//!   codec, one pass with every instance of the class compressed; the tape's encode /
//!   decode times over the values encoded give the codec's rates, and the
//!   parameter-gradient error against the exact (store-all) gradient, divided by the
//!   exposure and shared equally in quadrature among the class's `n` instances (divided
//!   by `sqrt(n)`), gives `kappa` of each instance (so the risks of that calibration plan,
//!   added in quadrature, equal its measured error). A unit's classes are its instances
//!   of equal cost-expression value at the profile: one class (the whole unit) in most
//!   layouts; two in a shared-prefix layout whose row-wise units run on the prompts' and
//!   the responses' rows apart, whose prompt instances are read by every response's
//!   backward and so can weigh more per value than the response instances.
//! - Additivity: one pass per codec with every unit compressed; measured error over the
//!   summed predictions (the largest over codecs) scales the risk budget
//!   ([`super::RiskModel::additivity_ratio`]).
//! - The gradient-norm scale: `||sum of exact gradients|| / sum of exposures` over the
//!   calibration microbatches.

use super::costs::MicrobatchShape;
use super::planner::{Allocator, MicrobatchInput};
use super::risk::grad_error;
use super::workload::Workload;
use crate::{Fidelity, Plan, Result, TapeTimes};
use std::collections::BTreeMap;

/// What one pass gives back.
#[derive(Debug, Clone)]
pub struct PassResult {
    /// Every parameter gradient, flattened and concatenated in a fixed order.
    pub grads: Vec<f32>,
    /// The tape's time split.
    pub times: TapeTimes,
    /// Forward seconds.
    pub forward_seconds: f64,
}

/// What calibration measured (for reports).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CalibrationReport {
    /// (unit, or `unit [cost c]` for one class of a unit with several, codec, measured
    /// error norm, exposure, instances).
    pub compress_errors: Vec<(String, String, f64, f64, usize)>,
    /// (unit, microbatch, seconds per instance).
    pub recompute_seconds: Vec<(String, usize, f64)>,
    /// (codec, predicted risk (in quadrature), measured error) with every unit compressed.
    pub additivity: Vec<(String, f64, f64)>,
    /// Passes run.
    pub passes: usize,
}

/// Simulations timed at calibration for
/// [`CostModel::simulation_seconds_per_event`](super::costs::CostModel::simulation_seconds_per_event).
const SIMULATION_TIMINGS: usize = 16;

/// Calibrates `alloc`'s cost and risk models on microbatches `mbs` of `w` (indices; their
/// shapes should differ in squared lengths so the attention fit is determined);
/// `kappa_mb` (a position in `mbs`) is the one whose passes calibrate `kappa` and the
/// codecs; `codecs` the codecs to calibrate. `progress` is called after every pass.
pub fn calibrate(
    alloc: &mut Allocator,
    w: &mut dyn Workload,
    mbs: &[usize],
    kappa_mb: usize,
    codecs: &[&'static str],
    progress: &mut dyn FnMut(&str),
) -> Result<CalibrationReport> {
    let mut report = CalibrationReport::default();
    let inputs: Vec<MicrobatchInput> = mbs.iter().map(|&i| w.input(i)).collect();
    // Units by name, with their instances and what they offer.
    let units = units_of(alloc);
    let mut exact = Vec::with_capacity(mbs.len());
    let mut sum_grad: Vec<f64> = Vec::new();
    let mut fwd = 0.0;
    for (m, _) in mbs.iter().enumerate() {
        let r = w.run(mbs[m], &Plan::store_all())?;
        report.passes += 1;
        progress("exact");
        fwd += r.forward_seconds;
        if sum_grad.is_empty() {
            sum_grad = vec![0.0; r.grads.len()];
        }
        for (s, g) in sum_grad.iter_mut().zip(&r.grads) {
            *s += *g as f64;
        }
        exact.push(r.grads);
    }
    // Microbatch gradients add in quadrature (see `risk`): the exact gradient's norm is
    // modelled as gamma * sqrt(sum E_m^2).
    let exposure_norm: f64 = inputs
        .iter()
        .map(|m| m.exposure * m.exposure)
        .sum::<f64>()
        .sqrt();
    let norm = sum_grad.iter().map(|g| g * g).sum::<f64>().sqrt();
    if exposure_norm > 0.0 {
        alloc.risk.grad_norm_per_exposure = Some(norm / exposure_norm);
    }
    // Prior: forward seconds per unit of cost expression (top-level instances only, so
    // nested costs are not counted twice).
    let top_cost: f64 = alloc
        .groups()
        .iter()
        .map(|(t, _)| alloc.cost_at_profile(*t))
        .sum();
    alloc
        .costs
        .set_prior(fwd / mbs.len().max(1) as f64, top_cost);
    // What one exact simulation costs the planner, per event of the profile: the mean of
    // a few simulations of two plans at the ends of the range (every group recomputed,
    // everything stored).
    {
        let plans = [
            super::baselines::gradient_checkpointing(alloc),
            Plan::store_all(),
        ];
        let t = std::time::Instant::now();
        for k in 0..SIMULATION_TIMINGS {
            alloc.simulate_peak(&plans[k % plans.len()])?;
        }
        let per = t.elapsed().as_secs_f64() / SIMULATION_TIMINGS as f64;
        let events = alloc.profile().num_events().max(1);
        alloc.costs.simulation_seconds_per_event = Some(per / events as f64);
    }

    // Units that may be recomputed; units with activation slots x codecs.
    let recomputable = recomputable_units(alloc, &units);
    let compress = compress_passes(alloc, &units, codecs);
    // On the kappa microbatch a compress pass also times one recompute (of a unit that
    // neither encloses nor is enclosed by the compressed one, so the two timings do not
    // overlap; recompute is exact, so the gradient error is the compression's alone).
    let inst_copy = alloc.instances().to_vec();
    let nested = |a: &str, b: &str| {
        let inst = &inst_copy;
        let inside = |x: &str, y: &str| {
            inst.iter().any(|i| {
                i.unit == y && {
                    let mut p = i.parent;
                    let mut hit = false;
                    while let Some(k) = p {
                        hit |= inst[k].unit == x;
                        p = inst[k].parent;
                    }
                    hit
                }
            })
        };
        a == b || inside(a, b) || inside(b, a)
    };
    let mut pending: Vec<&'static str> = recomputable.clone();
    let kmb = &inputs[kappa_mb];
    for (unit, label, members, codec, values) in &compress {
        let (unit, codec) = (*unit, *codec);
        let rc = pending
            .iter()
            .position(|r| !nested(r, unit))
            .map(|k| pending.remove(k));
        let f = Fidelity::Compress(codec);
        let mut plan = if members.len() == units[unit].len() {
            Plan::store_all().with_unit(unit, f)
        } else {
            let mut p = Plan::store_all();
            for &i in members {
                p.set_instance(unit, inst_copy[i].call, f);
            }
            p
        }
        .named(format!("calibrate {label} {codec}"));
        if let Some(r) = rc {
            plan = plan.with_unit(r, Fidelity::Recompute);
        }
        let r = w.run(mbs[kappa_mb], &plan)?;
        report.passes += 1;
        progress(unit);
        if let Some(rcu) = rc {
            let per = r.times.recompute.as_secs_f64() / units[rcu].len() as f64;
            alloc.costs.observe_recompute(rcu, kmb.shape, per);
            report
                .recompute_seconds
                .push((rcu.to_string(), kappa_mb, per));
        }
        alloc.costs.observe_codec(
            codec,
            *values,
            r.times.encode.as_secs_f64(),
            r.times.decode.as_secs_f64(),
        );
        let (err, _, _) = grad_error(&r.grads, &exact[kappa_mb]);
        report.compress_errors.push((
            label.clone(),
            codec.to_string(),
            err,
            kmb.exposure,
            members.len(),
        ));
        // The class's instances were compressed together and their errors add in
        // quadrature (see `risk`), so each carries err / sqrt(n): their risks' root sum
        // of squares is then the measured error.
        let kappa = if kmb.exposure > 0.0 {
            err / kmb.exposure / (members.len() as f64).sqrt()
        } else {
            0.0
        };
        for &i in members {
            let b = &inst_copy[i];
            alloc.risk.set_kappa(b.unit, b.call, codec, kappa);
        }
    }
    // Additivity: every compressible unit compressed at once with each codec; the
    // measured error against the per-unit predictions added in quadrature. The largest ratio (the
    // least favourable) calibrates the risk budget.
    let mut rho: Option<f64> = None;
    for &codec in codecs {
        let f = Fidelity::Compress(codec);
        let mut plan = Plan::store_all().named(format!("calibrate all {codec}"));
        let mut predicted = 0.0;
        for (&unit, idx) in &units {
            if compress
                .iter()
                .any(|(u, _, _, c, _)| *u == unit && *c == codec)
            {
                plan = plan.with_unit(unit, f);
                for &i in idx {
                    let b = &inst_copy[i];
                    // Squares: independent errors add in quadrature (see `risk`).
                    predicted += alloc
                        .risk
                        .risk(b.unit, b.call, codec, kmb.exposure)
                        .unwrap_or(0.0)
                        .powi(2);
                }
            }
        }
        if predicted <= 0.0 {
            continue;
        }
        let predicted = predicted.sqrt();
        let r = w.run(mbs[kappa_mb], &plan)?;
        report.passes += 1;
        progress("additivity");
        let (err, _, _) = grad_error(&r.grads, &exact[kappa_mb]);
        report.additivity.push((codec.to_string(), predicted, err));
        let ratio = err / predicted;
        rho = Some(rho.map_or(ratio, |x: f64| x.max(ratio)));
    }
    alloc.risk.additivity_ratio = rho;
    // Recompute timings not yet taken: every other microbatch, and what is left on the
    // kappa microbatch.
    for (m, mb) in inputs.iter().enumerate() {
        let todo: Vec<&'static str> = if m == kappa_mb {
            pending.clone()
        } else {
            recomputable.clone()
        };
        for unit in todo {
            let plan = Plan::store_all()
                .with_unit(unit, Fidelity::Recompute)
                .named(format!("calibrate recompute {unit}"));
            let r = w.run(mbs[m], &plan)?;
            report.passes += 1;
            progress(unit);
            let per = r.times.recompute.as_secs_f64() / units[unit].len() as f64;
            alloc.costs.observe_recompute(unit, mb.shape, per);
            report.recompute_seconds.push((unit.to_string(), m, per));
        }
    }
    Ok(report)
}

/// A compress pass of calibration: (unit, label, the class's instances, codec, values).
type CompressPass = (&'static str, String, Vec<usize>, &'static str, usize);

/// The units of `alloc` by name, with their instances.
fn units_of(alloc: &Allocator) -> BTreeMap<&'static str, Vec<usize>> {
    let mut units: BTreeMap<&'static str, Vec<usize>> = BTreeMap::new();
    for (i, b) in alloc.instances().iter().enumerate() {
        units.entry(b.unit).or_default().push(i);
    }
    units
}

/// The units that may be recomputed.
fn recomputable_units(
    alloc: &Allocator,
    units: &BTreeMap<&'static str, Vec<usize>>,
) -> Vec<&'static str> {
    units
        .iter()
        .filter(|(_, idx)| alloc.descriptor(idx[0]).offers(Fidelity::Recompute))
        .map(|(u, _)| *u)
        .collect()
}

/// A compress pass per class of a unit (its instances of equal cost at the profile) and
/// codec the unit offers, for units with activation slots.
fn compress_passes(
    alloc: &Allocator,
    units: &BTreeMap<&'static str, Vec<usize>>,
    codecs: &[&'static str],
) -> Vec<CompressPass> {
    let mut compress: Vec<CompressPass> = Vec::new();
    for (&unit, idx) in units {
        let mut classes: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for &i in idx {
            classes
                .entry(alloc.cost_at_profile(i).to_bits())
                .or_default()
                .push(i);
        }
        let several = classes.len() > 1;
        for (cost, members) in classes {
            let values: usize = members
                .iter()
                .map(|&i| alloc.instances()[i].own_act_elems.iter().sum::<usize>())
                .sum();
            if values == 0 {
                continue;
            }
            let label = if several {
                format!("{unit} [cost {}]", f64::from_bits(cost))
            } else {
                unit.to_string()
            };
            for &codec in codecs {
                if alloc
                    .descriptor(members[0])
                    .offers(Fidelity::Compress(codec))
                {
                    compress.push((unit, label.clone(), members.clone(), codec, values));
                }
            }
        }
    }
    compress
}

/// The passes [`calibrate`] runs on `mbs` microbatches with `codecs` (for a progress
/// bar): the exact passes, a compress pass per class and codec (each timing one recompute
/// on the kappa microbatch), at most one additivity pass per codec, and the recompute
/// timings left.
pub fn calibration_passes(alloc: &Allocator, mbs: usize, codecs: &[&'static str]) -> usize {
    let units = units_of(alloc);
    let compress = compress_passes(alloc, &units, codecs);
    let recomputable = recomputable_units(alloc, &units).len();
    let additivity = codecs
        .iter()
        .filter(|c| compress.iter().any(|p| p.3 == **c))
        .count();
    mbs + compress.len() + additivity + recomputable * mbs - recomputable.min(compress.len())
}

/// The shape and exposure of a microbatch from its packing offsets and coefficients.
pub fn microbatch_input(packing: &crate::Packing, coefficients: &[f32]) -> MicrobatchInput {
    let exposure = crate::grpo::exposure(coefficients);
    MicrobatchInput {
        shape: MicrobatchShape::of(packing).with_logprobs(coefficients.len()),
        exposure,
    }
}
