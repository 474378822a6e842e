//! The knapsack of one microbatch: its groups and choices (times from the cost model,
//! risks from the risk model, bytes from the reference plan's marginals), and the
//! translations between selections, assignments, plans and exact peaks.

use super::super::costs::MicrobatchShape;
use super::super::solver::{Choice, Group, Opened, Pick, Problem};
use super::{Allocator, MicrobatchInput, Offer};
use crate::{Error, Fidelity, Plan, Result};
use std::collections::HashMap;

impl Allocator {
    pub(super) fn eof(&self, assign: &HashMap<usize, Fidelity>) -> Result<i64> {
        Ok(self
            .profile
            .simulate(&self.plan_of("probe", assign))?
            .end_of_forward_bytes as i64)
    }

    /// Measures the marginal bytes of every choice by exact simulation.
    pub(super) fn probe(&mut self, codecs: &[&'static str]) -> Result<()> {
        let all = Offer {
            codecs: codecs.to_vec(),
            recompute: true,
            open_groups: true,
        };
        // Reference: every top-level group recomputed where it can be, stored otherwise.
        let mut reference = HashMap::new();
        for l in &self.layout {
            let f = if self.descs[l.top].offers(Fidelity::Recompute) {
                Fidelity::Recompute
            } else {
                Fidelity::Store
            };
            reference.insert(l.top, f);
        }
        let ref_eof = self.eof(&reference)?;
        let layout = self.layout.clone();
        for l in &layout {
            if l.children.is_empty() {
                for f in self.candidates(l.top, &all) {
                    let mut a = reference.clone();
                    a.insert(l.top, f);
                    let m = self.eof(&a)? - ref_eof;
                    self.marginal.insert((l.top, f), m);
                }
                continue;
            }
            if self.descs[l.top].offers(Fidelity::Recompute) {
                let mut a = reference.clone();
                a.insert(l.top, Fidelity::Recompute);
                let m = self.eof(&a)? - ref_eof;
                self.marginal.insert((l.top, Fidelity::Recompute), m);
            }
            let mut open = reference.clone();
            open.insert(l.top, Fidelity::Store);
            let open_eof = self.eof(&open)?;
            self.opened_base.insert(l.top, open_eof - ref_eof);
            for &c in &l.children {
                for f in self.candidates(c, &all) {
                    if f == Fidelity::Store {
                        self.marginal.insert((c, f), 0);
                        continue;
                    }
                    let mut a = open.clone();
                    a.insert(c, f);
                    let m = self.eof(&a)? - open_eof;
                    self.marginal.insert((c, f), m);
                }
            }
        }
        self.reference = reference;
        self.reference_eof = ref_eof;
        Ok(())
    }

    pub(super) fn seconds(&self, i: usize, f: Fidelity, shape: MicrobatchShape) -> Option<f64> {
        match f {
            Fidelity::Store => Some(0.0),
            Fidelity::Compress(c) => self.costs.codec_seconds(c, self.act_values(i)),
            Fidelity::Recompute => {
                let unit = self.instances[i].unit;
                let t =
                    self.costs
                        .recompute_seconds(unit, shape, Some(self.costs_at_profile[i]))?;
                // A unit's fit predicts its mean instance; the prior is per instance.
                Some(if self.costs.is_measured(unit) {
                    t * self.recompute_share[i]
                } else {
                    t
                })
            }
        }
    }

    pub(super) fn choice(
        &self,
        i: usize,
        f: Fidelity,
        mb: &MicrobatchInput,
        exposure_for_risk: f64,
    ) -> Option<Choice> {
        let b = &self.instances[i];
        let seconds = self.seconds(i, f, mb.shape)?;
        // The knapsack adds squared risks: independent errors add in quadrature.
        let risk = match f {
            Fidelity::Compress(c) => self
                .risk
                .risk(b.unit, b.call, c, exposure_for_risk)?
                .powi(2),
            _ => 0.0,
        };
        let bytes = *self.marginal.get(&(i, f))?;
        Some(Choice::one(b.unit, b.call, f, seconds, risk, bytes))
    }

    /// The knapsack for one microbatch. `exposure_for_risk` is the exposure the risk is
    /// computed with (the microbatch's own for HiLoRe; an assumed one for exposure-blind
    /// strategies).
    pub fn problem(
        &self,
        mb: &MicrobatchInput,
        exposure_for_risk: f64,
        offer: &Offer,
        capacity: i64,
        risk_budget: f64,
    ) -> Result<Problem> {
        let mut groups = Vec::with_capacity(self.layout.len());
        for l in &self.layout {
            let b = &self.instances[l.top];
            let name = format!("{}#{}", b.unit, b.call);
            let mut whole = Vec::new();
            let mut opened = None;
            if l.children.is_empty() {
                for f in self.candidates(l.top, offer) {
                    if let Some(c) = self.choice(l.top, f, mb, exposure_for_risk) {
                        whole.push(c);
                    }
                }
            } else {
                if offer.recompute && self.descs[l.top].offers(Fidelity::Recompute) {
                    if let Some(mut c) = self.choice(l.top, Fidelity::Recompute, mb, 0.0) {
                        // Children stored inside the recomputed group.
                        for &ch in &l.children {
                            let cb = &self.instances[ch];
                            c.fidelities
                                .push((cb.unit.to_string(), cb.call, Fidelity::Store));
                        }
                        whole.push(c);
                    }
                }
                let base = Choice::one(
                    b.unit,
                    b.call,
                    Fidelity::Store,
                    0.0,
                    0.0,
                    self.opened_base[&l.top],
                );
                let child_offer = if offer.open_groups {
                    offer.clone()
                } else {
                    Offer {
                        codecs: Vec::new(),
                        recompute: false,
                        open_groups: false,
                    }
                };
                let mut parts = Vec::with_capacity(l.children.len());
                for &ch in &l.children {
                    let cs: Vec<Choice> = self
                        .candidates(ch, &child_offer)
                        .into_iter()
                        .filter_map(|f| self.choice(ch, f, mb, exposure_for_risk))
                        .collect();
                    parts.push(cs);
                }
                opened = Some(Opened { base, parts });
            }
            groups.push(Group {
                name,
                whole,
                opened,
            });
        }
        let problem = Problem {
            groups,
            capacity,
            risk_budget,
        };
        for g in &problem.groups {
            let ok = !g.whole.is_empty()
                || g.opened
                    .as_ref()
                    .is_some_and(|o| o.parts.iter().all(|p| !p.is_empty()));
            if !ok {
                return Err(Error::Tape(format!(
                    "allocator: group `{}` has no choice with a known time; measure its recompute time or set a cost prior",
                    g.name
                )));
            }
        }
        Ok(problem)
    }

    /// Every instance's fidelity under a selection (`[i]` for instance `i`; Store where
    /// the selection sets nothing). A problem lists its groups' choices in layout order,
    /// each group's instance first and then its children, so the selection's fidelities
    /// fall on the layout's instances in that order.
    pub(super) fn fids_of(&self, problem: &Problem, picks: &[Pick]) -> Vec<Fidelity> {
        let mut fids = vec![Fidelity::Store; self.instances.len()];
        let order = self
            .layout
            .iter()
            .flat_map(|l| std::iter::once(l.top).chain(l.children.iter().copied()));
        let mut chosen = problem
            .chosen(picks)
            .flat_map(|c| c.fidelities.iter().map(|f| f.2));
        for i in order {
            match chosen.next() {
                Some(f) => fids[i] = f,
                None => debug_assert!(false, "a selection sets fewer fidelities than the layout"),
            }
        }
        debug_assert!(
            chosen.next().is_none(),
            "a selection sets more fidelities than the layout"
        );
        fids
    }

    /// The exact ledger peak of a selection.
    pub(super) fn peak_of(&self, problem: &Problem, picks: &[Pick]) -> Result<usize> {
        Ok(self
            .profile
            .simulate_fidelities(&self.fids_of(problem, picks))?
            .peak_bytes)
    }

    pub(super) fn plan_of_selection(&self, name: &str, problem: &Problem, picks: &[Pick]) -> Plan {
        let mut plan = Plan::store_all().named(name);
        for b in &self.instances {
            plan.set_instance(b.unit, b.call, Fidelity::Store);
        }
        for (u, c, f) in problem.fidelities(picks) {
            plan.set_instance(&u, c, f);
        }
        plan
    }

    /// An exact plan (`assign`: instance -> fidelity, Store where absent) as picks in
    /// `p` (a problem from [`Allocator::problem`]), when `p` offers every fidelity it sets.
    pub(super) fn picks_of(
        &self,
        p: &Problem,
        assign: &HashMap<usize, Fidelity>,
    ) -> Option<Vec<Pick>> {
        let find = |cs: &[Choice], f: Fidelity| cs.iter().position(|c| c.fidelities[0].2 == f);
        let get = |i: usize| assign.get(&i).copied().unwrap_or(Fidelity::Store);
        self.layout
            .iter()
            .zip(&p.groups)
            .map(|(l, g)| {
                if l.children.is_empty() || get(l.top) == Fidelity::Recompute {
                    return find(&g.whole, get(l.top)).map(Pick::Whole);
                }
                let o = g.opened.as_ref()?;
                let ks: Option<Vec<usize>> = l
                    .children
                    .iter()
                    .zip(&o.parts)
                    .map(|(&ch, part)| find(part, get(ch)))
                    .collect();
                ks.map(Pick::Opened)
            })
            .collect()
    }

    /// A plan as an assignment: every instance's fidelity under it (Store ones left out).
    pub(super) fn assignment_of(&self, plan: &Plan) -> HashMap<usize, Fidelity> {
        self.instances
            .iter()
            .enumerate()
            .map(|(i, b)| (i, plan.fidelity_for(self.descs[i], b.call)))
            .filter(|(_, f)| *f != Fidelity::Store)
            .collect()
    }

    /// Predicted recompute, encode and decode seconds of `plan` on a microbatch of
    /// `shape`, by the cost model (what a [`Decision`](super::Decision)'s
    /// `predicted_seconds` is for the plan it chose).
    pub fn plan_seconds(&self, plan: &Plan, shape: MicrobatchShape) -> f64 {
        self.assignment_seconds(&self.assignment_of(plan), shape)
    }

    /// Predicted seconds of an exact plan (`assign`: instance -> fidelity, Store where
    /// absent) on a microbatch of `shape`.
    pub(super) fn assignment_seconds(
        &self,
        assign: &HashMap<usize, Fidelity>,
        shape: MicrobatchShape,
    ) -> f64 {
        assign
            .iter()
            .map(|(&i, &f)| self.seconds(i, f, shape).unwrap_or(f64::INFINITY))
            .sum()
    }

    /// A knapsack with one choice per group: exactly `assign`.
    pub(super) fn fixed_problem(
        &self,
        mb: &MicrobatchInput,
        exposure: f64,
        assign: &HashMap<usize, Fidelity>,
    ) -> Result<Problem> {
        let mut groups = Vec::with_capacity(self.layout.len());
        for l in &self.layout {
            let mut c = Choice {
                fidelities: Vec::new(),
                seconds: 0.0,
                risk: 0.0,
                bytes: 0,
            };
            for &i in std::iter::once(&l.top).chain(&l.children) {
                let f = assign.get(&i).copied().unwrap_or(Fidelity::Store);
                let b = &self.instances[i];
                c.fidelities.push((b.unit.to_string(), b.call, f));
                c.seconds += self.seconds(i, f, mb.shape).unwrap_or(0.0);
                if let Fidelity::Compress(k) = f {
                    c.risk += self
                        .risk
                        .risk(b.unit, b.call, k, exposure)
                        .unwrap_or(0.0)
                        .powi(2);
                }
            }
            let b = &self.instances[l.top];
            groups.push(Group {
                name: format!("{}#{}", b.unit, b.call),
                whole: vec![c],
                opened: None,
            });
        }
        Ok(Problem {
            groups,
            capacity: 0,
            risk_budget: f64::INFINITY,
        })
    }
}
