//! Planning a step (one risk multiplier over its microbatches) and turning a selection
//! into a [`Decision`].

use super::super::solver::{Infeasible, Problem, Selection, StepSelection};
use super::{
    others_risk, split_seconds, sqrt_at_least, Allocator, Decision, MicrobatchInput, Offer, Peaks,
    Replan, Start, StepContext,
};
use crate::Fidelity;
use crate::{Error, Plan, Result};
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
    /// microbatch's time-risk frontier ([`Allocator::solve_step_risk`]); (3-5) per
    /// microbatch, the exact check, the local search and the greedy starts
    /// ([`Allocator::finish_microbatch`]).
    pub fn plan_step(
        &self,
        mbs: &[MicrobatchInput],
        total_budget: usize,
        risk_budget: f64,
        offer: &Offer,
        assumed_exposure: Option<f64>,
    ) -> Result<Vec<Decision>> {
        let t0 = Instant::now();
        let avail = self
            .activation_budget(total_budget)
            .ok_or_else(|| self.infeasible_memory(total_budget, offer))? as i64;
        let mut ctx = StepContext {
            mbs,
            total_budget,
            offer,
            assumed_exposure,
            avail,
            checks: 0,
        };
        // 1. Per microbatch, where its searches start.
        let hi0 = avail - self.reference_eof;
        let mut last_cap: Option<i64> = None;
        // Selective-recompute-shaped exact plans and whether each fits (byte figures do
        // not depend on the microbatch, so each is simulated at most once per step).
        let selective = mbs
            .first()
            .map(|mb| self.selective_candidates(offer, mb.shape))
            .unwrap_or_default();
        let mut selective_fits: Vec<Option<bool>> = vec![None; selective.len()];
        let mut starts = Vec::with_capacity(mbs.len());
        for mb in mbs {
            starts.push(self.start_microbatch(
                &mut ctx,
                mb,
                hi0,
                &mut last_cap,
                &selective,
                &mut selective_fits,
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
        let step = self.solve_step_risk(&mut ctx, &mut starts, b2)?;
        ctx.checks += step.solves;
        let lambda = step.lambda;
        // 3-5. Per microbatch: exact check, local search, greedy starts.
        let mut out: Vec<Decision> = Vec::with_capacity(mbs.len());
        let mut risks: Vec<f64> = step.selections.iter().map(|s| s.risk).collect();
        // Exact peaks by plan (byte figures do not depend on the microbatch).
        let mut peaks = Peaks::default();
        // Steps 3-5 are a function of the microbatch's shape, exposure and capacity, its
        // selection and seed, and the risk the others leave it. Microbatches that agree on
        // all of these (those without exposure, whose choices carry no risk, need not
        // agree on the last) take the plan found for the first of them.
        let mut planned: Vec<(Replan, usize)> = Vec::new();
        for (k, (start, s)) in starts.into_iter().zip(step.selections).enumerate() {
            let e = assumed_exposure.unwrap_or(mbs[k].exposure);
            let key = Replan {
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
            let d =
                self.finish_microbatch(&mut ctx, k, start, s, b2, lambda, &mut risks, &mut peaks)?;
            out.push(d);
        }
        let per = t0.elapsed().as_secs_f64() / mbs.len().max(1) as f64;
        for d in &mut out {
            d.solve_seconds = per;
        }
        Ok(out)
    }

    /// Step 2 of [`Allocator::plan_step`]: every microbatch's time-risk frontier comes from
    /// the Lagrangian (one frontier per byte shape, its picks evaluated on each member's
    /// own times and risks); one multiplier for the step then picks a frontier point per
    /// microbatch, keeping the summed squared risk within `b2`. Where the DP's fastest
    /// plans carry too much risk, every microbatch restarts from its exact plan.
    pub(super) fn solve_step_risk(
        &self,
        ctx: &mut StepContext,
        starts: &mut [Start],
        b2: f64,
    ) -> Result<StepSelection> {
        let infeasible = |e: Infeasible| match e {
            Infeasible::Risk { min_risk, budget } => Error::InfeasibleRisk {
                budget: budget.sqrt(),
                least_risk: sqrt_at_least(min_risk),
            },
            e => Error::Tape(e.to_string()),
        };
        let mut problems: Vec<Problem> = starts.iter().map(|s| s.problem.clone()).collect();
        let step = match self.solver.solve_step(&problems, b2) {
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
                let Ok(plans) =
                    self.plan_step(ctx.mbs, ctx.total_budget, f64::INFINITY, &exact, None)
                else {
                    return Err(infeasible(e));
                };
                for (k, d) in plans.iter().enumerate() {
                    let assign = self.assignment_of(&d.plan);
                    let e = ctx.assumed_exposure.unwrap_or(ctx.mbs[k].exposure);
                    problems[k] = self.fixed_problem(&ctx.mbs[k], e, &assign)?;
                    starts[k].seed = self.picks_of(&starts[k].full, &assign);
                    ctx.checks += d.exact_checks;
                }
                self.solver.solve_step(&problems, b2).map_err(infeasible)?
            }
            Err(e) => return Err(infeasible(e)),
        };
        for (s, p) in starts.iter_mut().zip(problems) {
            s.problem = p;
        }
        Ok(step)
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
            counts: Vec::new(),
        })
    }
}
