//! Exact searches from a plan: the local search, the greedy starts (and the greedy
//! policy of its own), and the last steps of a microbatch's plan.

use super::super::solver::{Choice, Pick, Problem, Selection};
use super::{others_risk, Allocator, Decision, Peaks, Start, StepContext, REFINE_SIMULATIONS};
use crate::{Error, Fidelity, Result};
use std::collections::HashMap;

impl Allocator {
    /// Exact local search from `picks` (whose exact peak fits `avail`): repeatedly apply
    /// the change of one group (another whole choice, opening it, or one part's choice)
    /// that saves the most predicted time among those whose summed squared risk stays
    /// within `risk_cap` and whose exact peak fits. `None` when no change helps. At most
    /// [`REFINE_SIMULATIONS`] new simulations per call, and only while they pay for
    /// themselves ([`Allocator::simulation_seconds`]: see the module docs); `peaks`
    /// caches them by plan.
    pub(super) fn refine(
        &self,
        p: &Problem,
        picks: &[Pick],
        avail: i64,
        risk_cap: f64,
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<Option<(Vec<Pick>, usize)>> {
        let mut cur = picks.to_vec();
        let mut found: Option<usize> = None;
        let mut sims = 0;
        // The search pays for itself: a simulation is run only while the time the search
        // has saved, plus what the change simulated would save, covers every simulation
        // it has run with this one (so it never costs more than one change's saving over
        // what it gains).
        let sim_cost = self.simulation_seconds();
        let start_seconds = p.totals(&cur).0;
        // Changes whose plan did not fit: the changes taken mostly add bytes, so they are not
        // simulated again.
        let mut failed: std::collections::HashSet<(usize, Pick)> = Default::default();
        'search: loop {
            let (_, risk, _) = p.totals(&cur);
            let mut moves: Vec<(f64, usize, Pick)> = Vec::new();
            for (g, group) in p.groups.iter().enumerate() {
                let (cs, cr, _) = group.totals(&cur[g]);
                let mut push = |pick: Pick| {
                    let (s, r, _) = group.totals(&pick);
                    if s < cs - 1e-12 && risk - cr + r <= risk_cap {
                        moves.push((s - cs, g, pick));
                    }
                };
                for k in 0..group.whole.len() {
                    if cur[g] != Pick::Whole(k) {
                        push(Pick::Whole(k));
                    }
                }
                if let Some(o) = &group.opened {
                    // From a whole choice, open the group at its least-bytes parts, alone
                    // or with one part changed; from an opened one, change one part.
                    let base: Vec<usize> = match &cur[g] {
                        Pick::Opened(ks) => ks.clone(),
                        Pick::Whole(_) => {
                            let least = o.parts.iter().map(|part| {
                                (0..part.len()).min_by_key(|&k| part[k].bytes).unwrap_or(0)
                            });
                            let ks: Vec<usize> = least.collect();
                            push(Pick::Opened(ks.clone()));
                            ks
                        }
                    };
                    for (pi, part) in o.parts.iter().enumerate() {
                        for k in (0..part.len()).filter(|&k| k != base[pi]) {
                            let mut ks = base.clone();
                            ks[pi] = k;
                            push(Pick::Opened(ks));
                        }
                    }
                }
            }
            moves.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            let gained = start_seconds - p.totals(&cur).0;
            for (delta, g, pick) in moves {
                if failed.contains(&(g, pick.clone())) {
                    continue;
                }
                let mut trial = cur.clone();
                trial[g] = pick.clone();
                let key = self.fids_of(p, &trial);
                let peak = match peaks.get(&key) {
                    Some(&pk) => pk,
                    None => {
                        // Moves are sorted by saving: past the first that cannot pay for its
                        // simulation, none can.
                        if sims >= REFINE_SIMULATIONS
                            || (sims + 1) as f64 * sim_cost > gained - delta
                        {
                            break 'search;
                        }
                        sims += 1;
                        *checks += 1;
                        let pk = self.profile.simulate_fidelities(&key)?.peak_bytes;
                        peaks.insert(key, pk);
                        pk
                    }
                };
                if peak as i64 <= avail {
                    cur = trial;
                    found = Some(peak);
                    continue 'search;
                }
                failed.insert((g, pick));
            }
            break;
        }
        Ok(found.map(|peak| (cur, peak)))
    }

    /// Every instance stored (every group opened where it can be): where the greedy by
    /// cost per byte starts.
    pub(super) fn store_picks(p: &Problem) -> Vec<Pick> {
        let store_idx = |part: &Vec<Choice>| {
            part.iter()
                .position(|c| c.fidelities[0].2 == Fidelity::Store)
                .unwrap_or(0)
        };
        p.groups
            .iter()
            .map(|g| match &g.opened {
                Some(o) => Pick::Opened(o.parts.iter().map(store_idx).collect()),
                None => Pick::Whole(store_idx(&g.whole)),
            })
            .collect()
    }

    /// The greedy's next change by cost per byte from `picks`: the change of one group
    /// that adds the least `seconds + lambda * risk` per byte saved (additive bytes),
    /// among changes whose summed squared risk stays within `risk_cap`. `None` when no
    /// change saves bytes.
    pub(super) fn greedy_step(
        p: &Problem,
        picks: &[Pick],
        risk_cap: f64,
        lambda: f64,
    ) -> Option<(usize, Pick)> {
        let (_, risk, _) = p.totals(picks);
        // Best move: (cost per byte saved, group, whole choice or (part, choice)).
        enum Move {
            Whole(usize),
            Part(usize, usize),
        }
        let mut best: Option<(f64, usize, Move)> = None;
        for (g, group) in p.groups.iter().enumerate() {
            let cur = group.totals(&picks[g]);
            let mut consider = |(s, r, b): (f64, f64, i64), m: Move| {
                let saved = cur.2 - b;
                if saved <= 0 || risk - cur.1 + r > risk_cap {
                    return;
                }
                let cost = (s - cur.0) + lambda * (r - cur.1);
                let rate = cost.max(0.0) / saved as f64;
                if best.as_ref().is_none_or(|(br, _, _)| rate < *br) {
                    best = Some((rate, g, m));
                }
            };
            for (k, c) in group.whole.iter().enumerate() {
                consider((c.seconds, c.risk, c.bytes), Move::Whole(k));
            }
            if let (Some(o), Pick::Opened(ks)) = (&group.opened, &picks[g]) {
                // One part changed: the group's totals move by that part's difference.
                for (pi, part) in o.parts.iter().enumerate() {
                    let was = &part[ks[pi]];
                    for (k, c) in part.iter().enumerate().filter(|&(k, _)| k != ks[pi]) {
                        let t = (
                            cur.0 - was.seconds + c.seconds,
                            cur.1 - was.risk + c.risk,
                            cur.2 - was.bytes + c.bytes,
                        );
                        consider(t, Move::Part(pi, k));
                    }
                }
            }
        }
        let (_, g, m) = best?;
        let pick = match (m, &picks[g]) {
            (Move::Whole(k), _) => Pick::Whole(k),
            (Move::Part(pi, k), Pick::Opened(ks)) => {
                let mut ks = ks.clone();
                ks[pi] = k;
                Pick::Opened(ks)
            }
            (Move::Part(..), Pick::Whole(_)) => unreachable!("a part change of an opened pick"),
        };
        Some((g, pick))
    }

    /// The exact peak of `picks`, from `peaks` or simulated (and kept there).
    pub(super) fn cached_peak(
        &self,
        p: &Problem,
        picks: &[Pick],
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<usize> {
        let key = self.fids_of(p, picks);
        if let Some(&pk) = peaks.get(&key) {
            return Ok(pk);
        }
        *checks += 1;
        let pk = self.profile.simulate_fidelities(&key)?.peak_bytes;
        peaks.insert(key, pk);
        Ok(pk)
    }

    /// The greedy by cost per byte ([`Allocator::greedy_step`] from
    /// [`Allocator::store_picks`]), stopped at the first plan along its path whose exact
    /// peak fits `avail` (each step simulated, as the Adacc-style baseline does), or, with
    /// `bisect`, at a plan found by galloping then bisecting along the path (a fitting plan
    /// right after one that does not: the first when exact peaks fall along the path, in a
    /// logarithmic number of simulations). `None` when no plan on the path fits.
    pub(super) fn greedy(
        &self,
        p: &Problem,
        avail: i64,
        (risk_cap, lambda): (f64, f64),
        bisect: bool,
        peaks: &mut Peaks,
        checks: &mut usize,
    ) -> Result<Option<(Vec<Pick>, usize)>> {
        let mut path = vec![Self::store_picks(p)];
        // Extends the path to hold index `i` (or as far as it goes); whether it does.
        let extend = |path: &mut Vec<Vec<Pick>>, i: usize| -> bool {
            while path.len() <= i {
                let last = &path[path.len() - 1];
                match Self::greedy_step(p, last, risk_cap, lambda) {
                    Some((g, pick)) => {
                        let mut next = last.clone();
                        next[g] = pick;
                        path.push(next);
                    }
                    None => return false,
                }
            }
            true
        };
        let mut fits = |picks: &[Pick]| -> Result<Option<usize>> {
            let pk = self.cached_peak(p, picks, peaks, checks)?;
            Ok((pk as i64 <= avail).then_some(pk))
        };
        if !bisect {
            let mut i = 0;
            loop {
                if let Some(pk) = fits(&path[i])? {
                    return Ok(Some((path.swap_remove(i), pk)));
                }
                i += 1;
                if !extend(&mut path, i) {
                    return Ok(None);
                }
            }
        }
        if let Some(pk) = fits(&path[0])? {
            return Ok(Some((path.swap_remove(0), pk)));
        }
        // Gallop: path[lo] does not fit; find an index that does.
        let (mut lo, mut step) = (0, 1);
        let (mut hi, mut hi_peak) = loop {
            let i = lo + step;
            let i = if extend(&mut path, i) {
                i
            } else {
                path.len() - 1
            };
            if i == lo {
                return Ok(None);
            }
            match fits(&path[i])? {
                Some(pk) => break (i, pk),
                None if i < lo + step => return Ok(None),
                None => (lo, step) = (i, step * 2),
            }
        };
        // Bisect: path[lo] does not fit, path[hi] does.
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            match fits(&path[mid])? {
                Some(pk) => (hi, hi_peak) = (mid, pk),
                None => lo = mid,
            }
        }
        Ok(Some((path.swap_remove(hi), hi_peak)))
    }

    /// Steps 3-5 of [`Allocator::plan_step`] for microbatch `k` with the selection `s` the
    /// step's multiplier `lambda` gave it: (3) the exact check, shrinking its capacity by
    /// the overshoot while the plan does not fit (exact fallbacks after 32 tries); (4) the
    /// exact local search; (5) the greedy starts, the fastest plan kept. `risks` holds
    /// every microbatch's squared risk, updated for `k`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_microbatch(
        &self,
        ctx: &mut StepContext,
        k: usize,
        start: Start,
        mut s: Selection,
        b2: f64,
        lambda: f64,
        risks: &mut [f64],
        peaks: &mut Peaks,
        warm: &mut Option<HashMap<usize, Fidelity>>,
    ) -> Result<Decision> {
        let (avail, total_budget) = (ctx.avail, ctx.total_budget);
        let Start {
            problem: p,
            full,
            seed,
        } = start;
        let checks = &mut ctx.checks;
        let mut peak = self.peak_of(&p, &s.picks)?;
        *checks += 1;
        let mut q = p.clone();
        let mut tries = 0;
        // 3. The exact check (the capacity was searched without the risk term; a
        // different selection may have another transient).
        while peak as i64 > avail {
            // Shrink this microbatch's capacity by the overshoot and re-solve it within
            // the risk the other microbatches leave.
            tries += 1;
            q.capacity -= (peak as i64 - avail).max(1);
            if tries > 32 || q.capacity < q.min_bytes() {
                // Exact fallbacks (no risk), fastest first.
                let mut found = None;
                for a in self.fallbacks(ctx.offer) {
                    let fplan = self.plan_of("fallback", &a);
                    *checks += 1;
                    let fpeak = self.simulate_peak(&fplan)?;
                    if fpeak as i64 <= avail {
                        found = Some((self.fixed_problem(&ctx.mbs[k], 0.0, &a)?, fpeak));
                        break;
                    }
                }
                let Some((fq, fpeak)) = found else {
                    return Err(self.infeasible_memory(total_budget, ctx.offer));
                };
                q = fq;
                s = self
                    .solver
                    .solve(&q)
                    .map_err(|e| Error::Tape(e.to_string()))?;
                risks[k] = s.risk;
                peak = fpeak;
                break;
            }
            q.risk_budget = (b2 - others_risk(risks, k)).max(0.0);
            // The step's multiplier first (one DP table); where its selection takes more
            // risk than is left, the least multiplier that meets it.
            s = match self.solver.solve_at(&q, lambda) {
                Ok(at) if at.risk <= q.risk_budget => at,
                _ => self.solver.solve_near(&q, lambda).map_err(|e| {
                    Error::Tape(format!(
                        "no plan fits the memory budget of {total_budget} bytes within the risk budget: {e}"
                    ))
                })?,
            };
            risks[k] = s.risk;
            peak = self.peak_of(&q, &s.picks)?;
            *checks += 1;
        }
        // 4. Exact local search: the additive byte model is only a proxy for the exact
        // peak (and the DP rounds bytes up), so the plan usually leaves memory unused.
        // Take time-saving changes while the exact peak and the step's risk budget allow.
        let risk_cap = if b2.is_finite() {
            (b2 - others_risk(risks, k)).max(risks[k])
        } else {
            f64::INFINITY
        };
        let searches_from = *checks;
        if let Some(picks) = seed.filter(|_| tries == 0) {
            // The fixed plan fitted as it was: search from it in the full problem.
            s = full.selection(picks, s.lambda);
            q = full.clone();
        }
        // A warm start: the plan the step's previous microbatch of this allocator ended
        // with, where it is faster for this one and within the risk left. Its exact peak
        // is this microbatch's too (byte figures do not depend on the microbatch), so it
        // is known, and so are most of its neighbours' the search tries.
        if let Some(w) = warm.as_ref().and_then(|a| self.picks_of(&full, a)) {
            let w = full.selection(w, s.lambda);
            if w.seconds < s.seconds - 1e-9 && w.risk <= risk_cap {
                let wpeak = self.cached_peak(&full, &w.picks, peaks, checks)?;
                if wpeak as i64 <= avail {
                    s = w;
                    q = full.clone();
                    risks[k] = s.risk;
                    peak = wpeak;
                }
            }
        }
        let refined = self.refine(&q, &s.picks, avail, risk_cap, peaks, checks)?;
        if let Some((picks, rpeak)) = refined {
            s = q.selection(picks, s.lambda);
            risks[k] = s.risk;
            peak = rpeak;
        }
        // 5. Other starts: the greedy by time per byte saved (with the step's risk
        // multiplier on the risk, and without it: the Adacc-style order, within the same
        // risk), walked down from every instance stored until the exact peak fits, then
        // searched the same way. They reach plans of another shape than the knapsack's
        // (many instances compressed where the budget is tight); the fastest is kept.
        // They pay for themselves across the step: a start runs while what its kind has
        // cost the step's microbatches so far, with one more simulation, is covered by
        // what it has saved them plus the most it could save this one (the plan's whole
        // predicted seconds); so a kind that does not find faster plans costs the step at
        // most about one microbatch's overhead. Before calibration prices simulations
        // every start runs.
        let sim_cost = self.simulation_seconds();
        let mut lambdas = vec![lambda];
        if lambda > 0.0 {
            lambdas.push(0.0);
        }
        for (kind, l) in lambdas.into_iter().enumerate() {
            let account = ctx.starts[kind];
            if account.spent + sim_cost > account.saved + s.seconds {
                continue;
            }
            let before = *checks;
            let cap = (risk_cap, l);
            let found = match self.greedy(&full, avail, cap, true, peaks, checks)? {
                Some((gpicks, gpeak)) => Some(
                    self.refine(&full, &gpicks, avail, risk_cap, peaks, checks)?
                        .unwrap_or((gpicks, gpeak)),
                ),
                None => None,
            };
            let account = &mut ctx.starts[kind];
            account.spent += (*checks - before) as f64 * sim_cost;
            let Some((gpicks, gpeak)) = found else {
                continue;
            };
            let g = full.selection(gpicks, lambda);
            if g.seconds < s.seconds - 1e-9 {
                account.saved += s.seconds - g.seconds;
                s = g;
                q = full.clone();
                risks[k] = s.risk;
                peak = gpeak;
            }
        }
        *warm = Some(
            self.fids_of(&q, &s.picks)
                .into_iter()
                .enumerate()
                .filter(|(_, f)| *f != Fidelity::Store)
                .collect(),
        );
        let mut d = self.decision("hilore", &q, &s, peak, *checks);
        d.search_checks = *checks - searches_from;
        Ok(d)
    }
}
