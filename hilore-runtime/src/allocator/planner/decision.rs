//! Planning a step (one risk multiplier over its microbatches) and turning a selection
//! into a [`Decision`].

use super::super::solver::{Infeasible, Problem, Selection, StepSelection};
use super::{
    others_risk, split_seconds, sqrt_at_least, Allocator, Decision, MicrobatchInput, Offer, Peaks,
    Replan, Start, StepContext,
};
use crate::Fidelity;
use crate::{Error, Plan, Result};
use std::collections::HashMap;
use std::time::Instant;

impl Allocator {
    /// Plans one microbatch for the fastest predicted step under `total_budget` (the whole
    /// actor-update peak) and `risk_budget`, with the risk computed from the microbatch's
    /// own exposure.
    pub fn plan(
        &self,
        mb: &MicrobatchInput,
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
    ) -> Result<Decision> {
        Ok(self
            .plan_step(
                std::slice::from_ref(mb),
                total_budget,
                risk_budget,
                offer,
                None,
            )?
            .remove(0))
    }

    /// Plans every microbatch of a step under one shared risk budget (one Lagrange
    /// multiplier for the whole step, so risk goes where it buys the most time: to the
    /// microbatches with little exposure). `assumed_exposure`, when given, replaces every
    /// microbatch's exposure in the risk (an exposure-blind planner).
    ///
    /// The steps: (1) per microbatch, the DP capacity whose memory-first plan fits
    /// exactly, or an exact plan where none does or where a selective-shaped one is faster
    /// ([`Allocator::start_microbatch`]); (2) one risk multiplier for the step over every
    /// microbatch's time-risk frontier; (3-5) per microbatch, the exact check, the local
    /// search and the greedy starts ([`Allocator::finish_microbatch`]).
    pub fn plan_step(
        &self,
        mbs: &[MicrobatchInput],
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
        assumed_exposure: Option<f64>,
    ) -> Result<Vec<Decision>> {
        Allocator::plan_step_across(
            &vec![self; mbs.len()],
            mbs,
            total_budget,
            risk_budget,
            offer,
            assumed_exposure,
        )
    }

    /// [`Allocator::plan_step`] for a step whose microbatches have allocators of their
    /// own: `allocs[k]` plans `mbs[k]` (an allocator per profile key, e.g. the
    /// microbatches of a shared-prefix step, whose prompt rows differ). The step is
    /// planned as one, with one risk multiplier over every microbatch, so the risk goes
    /// where it buys the most time whichever allocator a microbatch has; knapsacks of the
    /// same structure share one time-risk frontier
    /// ([`Solver::solve_step_in_classes`](super::super::solver::Solver::solve_step_in_classes)).
    /// Every decision's predicted peak is its own allocator's exact simulation. The
    /// allocators must share their fixed state bytes (one model and optimizer); the first
    /// one's solver settings are used.
    pub fn plan_step_across(
        allocs: &[&Allocator],
        mbs: &[MicrobatchInput],
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
        assumed_exposure: Option<f64>,
    ) -> Result<Vec<Decision>> {
        let t0 = Instant::now();
        if allocs.len() != mbs.len() {
            return Err(Error::Tape(format!(
                "allocator: {} allocators for {} microbatches; give one per microbatch",
                allocs.len(),
                mbs.len()
            )));
        }
        let Some(&first) = allocs.first() else {
            return Ok(Vec::new());
        };
        // The distinct allocators in order of first use; `id[k]` is microbatch k's.
        let mut distinct: Vec<(&Allocator, usize)> = Vec::new();
        let mut id = Vec::with_capacity(allocs.len());
        for (k, &a) in allocs.iter().enumerate() {
            match distinct.iter().position(|&(d, _)| std::ptr::eq(d, a)) {
                Some(i) => id.push(i),
                None => {
                    if a.state != first.state {
                        return Err(Error::Tape(format!(
                            "allocator: a step's allocators must share their fixed state bytes ({:?} and {:?}); make them for one model and optimizer",
                            first.state, a.state
                        )));
                    }
                    distinct.push((a, k));
                    id.push(distinct.len() - 1);
                }
            }
        }
        let avail = first
            .activation_budget(total_budget)
            .ok_or_else(|| first.infeasible_memory(total_budget, offer))?
            as i64;
        let mut ctx = StepContext {
            mbs,
            allocs,
            total_budget,
            offer,
            assumed_exposure,
            avail,
            checks: 0,
            starts: Default::default(),
        };
        // 1. Per microbatch, where its searches start. Per allocator, the capacity found
        // for its previous microbatch, and the selective-recompute-shaped exact plans and
        // whether each fits (byte figures do not depend on the microbatch, so each is
        // simulated at most once per step).
        let mut last_cap: Vec<Option<i64>> = vec![None; distinct.len()];
        let selective: Vec<Vec<HashMap<usize, Fidelity>>> = distinct
            .iter()
            .map(|&(a, k)| a.selective_candidates(offer, mbs[k].shape))
            .collect();
        let mut selective_fits: Vec<Vec<Option<bool>>> =
            selective.iter().map(|s| vec![None; s.len()]).collect();
        let mut starts = Vec::with_capacity(mbs.len());
        for (k, mb) in mbs.iter().enumerate() {
            let (a, i) = (allocs[k], id[k]);
            starts.push(a.start_microbatch(
                &mut ctx,
                mb,
                avail - a.reference_eof,
                &mut last_cap[i],
                &selective[i],
                &mut selective_fits[i],
            )?);
        }
        // 2. Risks add in quadrature (errors of different units and microbatches are
        // independent): the choices carry squared risks, and the step keeps their sum
        // within `B^2`.
        let b2 = if risk_budget.is_finite() {
            risk_budget.max(0.0).powi(2)
        } else {
            f64::INFINITY
        };
        let step = solve_step_risk(&mut ctx, &mut starts, b2)?;
        ctx.checks += step.solves;
        let lambda = step.lambda;
        // 3-5. Per microbatch: exact check, local search, greedy starts.
        let mut out: Vec<Decision> = Vec::with_capacity(mbs.len());
        let mut risks: Vec<f64> = step.selections.iter().map(|s| s.risk).collect();
        // Exact peaks by plan, per allocator (its byte figures do not depend on the
        // microbatch).
        let mut peaks: Vec<Peaks> = vec![Peaks::default(); distinct.len()];
        // Per allocator, the plan its previous microbatch ended with (a warm start).
        let mut warm: Vec<Option<HashMap<usize, Fidelity>>> = vec![None; distinct.len()];
        // Steps 3-5 are a function of the microbatch's allocator, shape, exposure and
        // capacity, its selection and seed, the risk the others leave it, and the warm
        // start its allocator's previous microbatch left. Microbatches that agree on all
        // of these but the last (those without exposure, whose choices carry no risk,
        // need not agree on the risk left either) take the plan found for the first of
        // them: the same problem's plan, which fits them as it fitted it.
        let mut planned: Vec<(Replan, usize)> = Vec::new();
        for (k, (start, s)) in starts.into_iter().zip(step.selections).enumerate() {
            let e = assumed_exposure.unwrap_or(mbs[k].exposure);
            let key = Replan {
                alloc: id[k],
                shape: mbs[k].shape,
                capacity: start.problem.capacity,
                exposure: e.to_bits(),
                room: if e == 0.0 {
                    0
                } else {
                    (b2 - others_risk(&risks, k)).to_bits()
                },
                picks: s.picks.clone(),
                seed: start.seed.clone(),
            };
            if let Some(&(_, j)) = planned.iter().find(|(r, _)| *r == key) {
                let d: Decision = out[j].clone();
                risks[k] = risks[j];
                out.push(d);
                continue;
            }
            planned.push((key, k));
            let d = allocs[k].finish_microbatch(
                &mut ctx,
                k,
                start,
                s,
                b2,
                lambda,
                &mut risks,
                &mut peaks[id[k]],
                &mut warm[id[k]],
            )?;
            out.push(d);
        }
        let per = t0.elapsed().as_secs_f64() / mbs.len().max(1) as f64;
        for d in &mut out {
            d.solve_seconds = per;
        }
        Ok(out)
    }

    /// The decision of a selection `s` of `p` whose exact peak is `peak` (solve seconds
    /// left at 0 for the caller).
    pub(super) fn decision(
        &self,
        name: &str,
        p: &Problem,
        s: &Selection,
        peak: usize,
        checks: usize,
    ) -> Decision {
        let mut counts: Vec<(Fidelity, usize)> = Vec::new();
        for (_, _, f) in p.fidelities(&s.picks) {
            match counts.iter_mut().find(|(g, _)| *g == f) {
                Some((_, n)) => *n += 1,
                None => counts.push((f, 1)),
            }
        }
        // In the order of the fidelities' names, as the reports list them.
        counts.sort_by_key(|(f, _)| f.to_string());
        let (rc, codec) = split_seconds(p, &s.picks);
        Decision {
            plan: self.plan_of_selection(name, p, &s.picks),
            predicted_peak_bytes: peak,
            predicted_total_bytes: peak + self.state.total(),
            predicted_seconds: s.seconds,
            predicted_recompute_seconds: rc,
            predicted_codec_seconds: codec,
            predicted_risk: s.risk.sqrt(),
            lambda: s.lambda,
            solve_seconds: 0.0,
            exact_checks: checks,
            search_checks: 0,
            counts,
        }
    }

    /// A decision that is a given plan (no solve): its exact peak, no risk model.
    pub fn fixed_decision(&self, plan: Plan) -> Result<Decision> {
        let peak = self.simulate_peak(&plan)?;
        Ok(Decision {
            plan,
            predicted_peak_bytes: peak,
            predicted_total_bytes: peak + self.state.total(),
            predicted_seconds: 0.0,
            predicted_recompute_seconds: 0.0,
            predicted_codec_seconds: 0.0,
            predicted_risk: 0.0,
            lambda: 0.0,
            solve_seconds: 0.0,
            exact_checks: 1,
            search_checks: 0,
            counts: Vec::new(),
        })
    }
}

/// Step 2 of [`Allocator::plan_step_across`]: every microbatch's time-risk frontier comes
/// from the Lagrangian (one frontier per class of knapsacks of the same structure, its
/// picks evaluated on each member's own times, risks and bytes); one multiplier for the
/// step then picks a frontier point per microbatch, keeping the summed squared risk
/// within `b2`. Where the DP's fastest plans carry too much risk, every microbatch
/// restarts from its exact plan.
fn solve_step_risk(ctx: &mut StepContext, starts: &mut [Start], b2: f64) -> Result<StepSelection> {
    let infeasible = |e: Infeasible| match e {
        Infeasible::Risk { min_risk, budget } => Error::InfeasibleRisk {
            budget: budget.sqrt(),
            least_risk: sqrt_at_least(min_risk),
        },
        e => Error::Tape(e.to_string()),
    };
    let solver = ctx.allocs[0].solver;
    // One class label for all: the solver splits it by structure.
    let classes = vec![0; starts.len()];
    let mut problems: Vec<Problem> = starts.iter().map(|s| s.problem.clone()).collect();
    let step = match solver.solve_step_in_classes(&problems, b2, &classes) {
        Ok(step) => step,
        Err(e @ Infeasible::Risk { .. }) if !ctx.offer.codecs.is_empty() => {
            // The capacities were searched for the DP's fastest plans; where those
            // carry too much risk, a plan with less may still fit exactly (e.g. full
            // recompute at its own peak) that the additive model does not show. Start
            // every microbatch from the exact (Store / Recompute) plan, which carries
            // none; the searches of steps 4 and 5 then add compression within the
            // risk budget.
            let exact = Offer {
                codecs: Vec::new(),
                ..ctx.offer.clone()
            };
            let Ok(plans) = Allocator::plan_step_across(
                ctx.allocs,
                ctx.mbs,
                ctx.total_budget,
                f64::INFINITY,
                &exact,
                None,
            ) else {
                return Err(infeasible(e));
            };
            for (k, d) in plans.iter().enumerate() {
                let a = ctx.allocs[k];
                let assign = a.assignment_of(&d.plan);
                let e = ctx.assumed_exposure.unwrap_or(ctx.mbs[k].exposure);
                problems[k] = a.fixed_problem(&ctx.mbs[k], e, &assign)?;
                starts[k].seed = a.picks_of(&starts[k].full, &assign);
                ctx.checks += d.exact_checks;
            }
            solver
                .solve_step_in_classes(&problems, b2, &classes)
                .map_err(infeasible)?
        }
        Err(e) => return Err(infeasible(e)),
    };
    for (s, p) in starts.iter_mut().zip(problems) {
        s.problem = p;
    }
    Ok(step)
}
