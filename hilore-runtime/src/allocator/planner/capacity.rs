//! Memory: the DP capacity whose plan fits exactly, the exact fallbacks, the least-memory
//! plans and the infeasible-budget error.

use super::super::solver::{Infeasible, Problem, Selection};
use super::{Allocator, MicrobatchInput, Offer, Start, StepContext};
use crate::{Error, Fidelity, Plan, Result};
use std::collections::HashMap;

impl Allocator {
    /// Exact fallback assignments, fastest first: gradient checkpointing (every group with
    /// children recomputed, the rest stored: [`Allocator::gc_assignment`]), then the same
    /// with their children recomputed as well, then the reference plan.
    pub(super) fn fallbacks(&self, offer: &Offer) -> Vec<HashMap<usize, Fidelity>> {
        let gc: HashMap<usize, Fidelity> = if offer.recompute {
            self.gc_assignment()
        } else {
            HashMap::new()
        };
        let mut deep = gc.clone();
        for l in &self.layout {
            if gc.contains_key(&l.top) {
                for &c in &l.children {
                    if self.descs[c].offers(Fidelity::Recompute) {
                        deep.insert(c, Fidelity::Recompute);
                    }
                }
            }
        }
        vec![gc, deep, self.reference.clone()]
    }

    /// The smallest ledger peak among the least-memory plans the allocator can build
    /// (every group recomputed, with and without its children recomputed too, and with
    /// every compressible instance at each codec), and that plan.
    pub fn least_memory(&self, offer: &Offer) -> Result<(usize, Plan)> {
        let mut cands: Vec<HashMap<usize, Fidelity>> = vec![self.reference.clone()];
        let mut deep = self.reference.clone();
        for l in &self.layout {
            if deep.get(&l.top) == Some(&Fidelity::Recompute) {
                for &c in &l.children {
                    if offer.recompute && self.descs[c].offers(Fidelity::Recompute) {
                        deep.insert(c, Fidelity::Recompute);
                    }
                }
            }
        }
        cands.push(deep.clone());
        for codec in &offer.codecs {
            for base in [&self.reference, &deep] {
                let mut a = base.clone();
                for (i, _) in self.instances.iter().enumerate() {
                    let f = Fidelity::Compress(codec);
                    if self.act_values(i) > 0
                        && self.descs[i].offers(f)
                        && a.get(&i) != Some(&Fidelity::Recompute)
                    {
                        a.insert(i, f);
                    }
                }
                cands.push(a);
            }
        }
        let mut best: Option<(usize, Plan)> = None;
        for a in cands {
            let plan = self.plan_of("least-memory", &a);
            let p = self.simulate_peak(&plan)?;
            if best.as_ref().is_none_or(|(b, _)| p < *b) {
                best = Some((p, plan));
            }
        }
        best.ok_or_else(|| Error::Tape("allocator: no unit instances".into()))
    }

    pub(super) fn infeasible_memory(&self, total_budget: usize, offer: &Offer) -> Error {
        match self.least_memory(offer) {
            Ok((p, _)) => Error::InfeasibleMemory {
                budget_bytes: total_budget,
                fixed_bytes: self.state.total(),
                param_bytes: self.state.params,
                grad_bytes: self.state.grads,
                optimizer_bytes: self.state.optimizer,
                least_activation_bytes: p,
                smallest_feasible_bytes: self.state.total() + p,
            },
            Err(e) => e,
        }
    }

    /// Step 1 of [`Allocator::plan_step`] for one microbatch: the DP capacity whose
    /// memory-first plan fits exactly (microbatches of one size share their byte figures,
    /// so `last_cap`, the capacity found for the previous one, is tried before bisecting
    /// again); where not even the least-bytes selection fits, the first exact fallback
    /// that does; where an exact selective-shaped plan is faster than the DP's fastest at
    /// the capacity found (its additive bytes may exceed the capacity while its exact peak
    /// fits), that plan, with its picks in the full problem as the local search's seed.
    pub(super) fn start_microbatch(
        &self,
        ctx: &mut StepContext,
        mb: &MicrobatchInput,
        hi0: i64,
        last_cap: &mut Option<i64>,
        selective: &[HashMap<usize, Fidelity>],
        selective_fits: &mut [Option<bool>],
    ) -> Result<Start> {
        let (avail, offer, total_budget) = (ctx.avail, ctx.offer, ctx.total_budget);
        let e = ctx.assumed_exposure.unwrap_or(mb.exposure);
        let mut p = self.problem(mb, e, offer, hi0, f64::INFINITY)?;
        let min = p.min_bytes();
        if min > hi0 {
            return Err(self.infeasible_memory(total_budget, offer));
        }
        let fits = |p: &Problem, checks: &mut usize| -> Result<Option<Selection>> {
            match self.solver.solve(p) {
                Ok(s) => {
                    *checks += 1;
                    Ok((self.peak_of(p, &s.picks)? as i64 <= avail).then_some(s))
                }
                Err(Infeasible::Memory { .. }) => Ok(None),
                Err(e) => Err(Error::Tape(e.to_string())),
            }
        };
        let checks = &mut ctx.checks;
        // The DP's fastest selection at the capacity chosen (kept for the selective
        // candidates below).
        let mut at_cap: Option<Selection> = fits(&p, checks)?;
        let cap = if at_cap.is_some() {
            hi0
        } else if let Some(c) = last_cap.filter(|&c| {
            p.capacity = c;
            at_cap = fits(&p, checks).ok().flatten();
            at_cap.is_some()
        }) {
            c
        } else {
            let (mut lo, mut hi) = (min, hi0);
            p.capacity = lo;
            at_cap = fits(&p, checks)?;
            if at_cap.is_none() {
                // The additive model's least-bytes selection does not fit (exact peaks
                // are not monotone in it: recomputing the last units saves bytes but not
                // peak). Fall back to the first exact plan that fits among full recompute
                // of the groups with children, and the same with their children
                // recomputed too.
                for a in self.fallbacks(offer) {
                    let plan = self.plan_of("fallback", &a);
                    *checks += 1;
                    if self.simulate_peak(&plan)? as i64 <= avail {
                        return Ok(Start {
                            problem: self.fixed_problem(mb, e, &a)?,
                            full: p,
                            seed: None,
                        });
                    }
                }
                return Err(self.infeasible_memory(total_budget, offer));
            }
            while hi - lo > ((hi0 - min) / 512).max(1) {
                let mid = lo + (hi - lo) / 2;
                p.capacity = mid;
                if let Some(s) = fits(&p, checks)? {
                    lo = mid;
                    at_cap = Some(s);
                } else {
                    hi = mid;
                }
            }
            lo
        };
        *last_cap = Some(cap);
        p.capacity = cap;
        if let Some(dp) = at_cap.filter(|_| !selective.is_empty()) {
            let mut faster: Vec<(f64, usize)> = selective
                .iter()
                .enumerate()
                .map(|(i, a)| (self.assignment_seconds(a, mb.shape), i))
                .filter(|(t, _)| *t < dp.seconds)
                .collect();
            faster.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for (_, i) in faster {
                let fits = match selective_fits[i] {
                    Some(f) => f,
                    None => {
                        *checks += 1;
                        let plan = self.plan_of("selective", &selective[i]);
                        let f = self.simulate_peak(&plan)? as i64 <= avail;
                        selective_fits[i] = Some(f);
                        f
                    }
                };
                if fits {
                    return Ok(Start {
                        problem: self.fixed_problem(mb, e, &selective[i])?,
                        seed: self.picks_of(&p, &selective[i]),
                        full: p,
                    });
                }
            }
        }
        Ok(Start {
            problem: p.clone(),
            full: p,
            seed: None,
        })
    }
}
