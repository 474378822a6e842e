//! The multiple-choice knapsack behind the allocator: pick one recovery choice per group
//! so that the time is smallest, the additive memory model stays under a capacity and the
//! summed risk under a risk budget.
//!
//! Method: a Lagrangian on the risk (minimise `seconds + lambda * risk`, bisecting
//! `lambda` until the risk fits) and, for each `lambda`, an exact dynamic program over
//! memory discretised into at most [`Solver::buckets`] buckets. Each choice's bytes are
//! rounded *up* to whole buckets, so a selection the DP accepts always fits the exact
//! capacity; the price is that the DP may miss selections that fit only without
//! rounding: it is optimal among selections whose rounded bytes fit ("optimal within the
//! discretisation"). Groups with children (a decoder `layer` and its seven units) are
//! either taken whole (e.g. Recompute the layer) or *opened*: a base plus one choice per
//! child, combined by an inner DP, so nesting is solved exactly rather than flattened.
//!
//! The Lagrangian solution for a given `lambda` is optimal for the risk budget it reaches
//! (a standard property of Lagrangian relaxation); between two `lambda`s the risk of the
//! optimum can jump past the budget (the duality gap), in which case the feasible side is
//! returned.

use crate::{Error, Fidelity, Result};

/// One way of recovering a unit instance, or a whole group of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    /// Fidelities this choice sets: (unit name, call index, fidelity).
    pub fidelities: Vec<(String, usize, Fidelity)>,
    /// Predicted seconds it adds to the step (recompute, encode + decode).
    pub seconds: f64,
    /// Predicted risk (gradient error norm it may add).
    pub risk: f64,
    /// Bytes it keeps between forward and backward in the additive memory model
    /// (relative to any fixed reference; may be negative).
    pub bytes: i64,
}

impl Choice {
    /// A choice setting one instance.
    pub fn one(
        unit: impl Into<String>,
        call: usize,
        fidelity: Fidelity,
        seconds: f64,
        risk: f64,
        bytes: i64,
    ) -> Self {
        Choice {
            fidelities: vec![(unit.into(), call, fidelity)],
            seconds,
            risk,
            bytes,
        }
    }
}

/// A group opened into its parts: `base` (e.g. the enclosing unit stored, which keeps
/// nothing itself) plus one choice from every part.
#[derive(Debug, Clone, PartialEq)]
pub struct Opened {
    /// Always taken when the group is opened.
    pub base: Choice,
    /// One choice list per child instance.
    pub parts: Vec<Vec<Choice>>,
}

/// A top-level unit instance and what can be chosen for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// For reports (e.g. `layer#3`).
    pub name: String,
    /// Choices that decide the whole group at once.
    pub whole: Vec<Choice>,
    /// The group opened into its children, if it has any.
    pub opened: Option<Opened>,
}

/// The knapsack: groups, the memory capacity of the additive model, the risk budget.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// In forward order.
    pub groups: Vec<Group>,
    /// Largest allowed sum of the chosen choices' bytes.
    pub capacity: i64,
    /// Largest allowed sum of the chosen choices' risks.
    pub risk_budget: f64,
}

/// What was picked for one group.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Pick {
    /// `whole[i]`.
    Whole(usize),
    /// Opened, with `parts[p][picks[p]]` for every part.
    Opened(Vec<usize>),
}

/// A solution of a [`Problem`].
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// One pick per group.
    pub picks: Vec<Pick>,
    /// Total predicted seconds.
    pub seconds: f64,
    /// Total predicted risk.
    pub risk: f64,
    /// Total bytes in the additive model.
    pub bytes: i64,
    /// The Lagrange multiplier of the risk that produced it (0 when the risk budget did
    /// not bind).
    pub lambda: f64,
}

/// A step's selections from [`Solver::solve_step`].
#[derive(Debug, Clone, PartialEq)]
pub struct StepSelection {
    /// One per problem, in order.
    pub selections: Vec<Selection>,
    /// The multiplier on the summed risks (0 when the budget did not bind).
    pub lambda: f64,
    /// DP solves it took.
    pub solves: usize,
}

impl Group {
    /// The choices one pick of this group takes.
    pub fn chosen<'a>(&'a self, pick: &'a Pick) -> Box<dyn Iterator<Item = &'a Choice> + 'a> {
        match pick {
            Pick::Whole(i) => Box::new(std::iter::once(&self.whole[*i])),
            Pick::Opened(ks) => {
                let o = self
                    .opened
                    .as_ref()
                    .expect("opened pick of a group without parts");
                Box::new(
                    std::iter::once(&o.base)
                        .chain(o.parts.iter().zip(ks).map(|(part, &k)| &part[k])),
                )
            }
        }
    }

    /// Seconds, risk and bytes of one pick of this group.
    pub fn totals(&self, pick: &Pick) -> (f64, f64, i64) {
        sum_choices(self.chosen(pick))
    }
}

fn sum_choices<'a>(cs: impl Iterator<Item = &'a Choice>) -> (f64, f64, i64) {
    cs.fold((0.0, 0.0, 0), |(s, r, b), c| {
        (s + c.seconds, r + c.risk, b + c.bytes)
    })
}

impl Problem {
    /// The choices a selection takes, in group order.
    pub fn chosen<'a>(&'a self, picks: &'a [Pick]) -> impl Iterator<Item = &'a Choice> + 'a {
        self.groups.iter().zip(picks).flat_map(|(g, p)| g.chosen(p))
    }

    /// Seconds, risk and bytes of a selection's picks.
    pub fn totals(&self, picks: &[Pick]) -> (f64, f64, i64) {
        sum_choices(self.chosen(picks))
    }

    /// The selection of `picks` with its totals (`lambda`: the multiplier behind it).
    pub fn selection(&self, picks: Vec<Pick>, lambda: f64) -> Selection {
        let (seconds, risk, bytes) = self.totals(&picks);
        Selection {
            picks,
            seconds,
            risk,
            bytes,
            lambda,
        }
    }

    /// Every fidelity a selection sets.
    pub fn fidelities(&self, picks: &[Pick]) -> Vec<(String, usize, Fidelity)> {
        self.chosen(picks)
            .flat_map(|c| c.fidelities.iter().cloned())
            .collect()
    }

    fn check(&self) -> Result<()> {
        for g in &self.groups {
            let has_whole = !g.whole.is_empty();
            let opened_ok = g
                .opened
                .as_ref()
                .is_some_and(|o| o.parts.iter().all(|p| !p.is_empty()));
            if !has_whole && !opened_ok {
                return Err(Error::Tape(format!(
                    "allocator: group `{}` has no choice at all",
                    g.name
                )));
            }
            let all = g.whole.iter().chain(
                g.opened
                    .iter()
                    .flat_map(|o| std::iter::once(&o.base).chain(o.parts.iter().flatten())),
            );
            for c in all {
                if !(c.seconds.is_finite() && c.risk.is_finite() && c.risk >= 0.0) {
                    return Err(Error::Tape(format!(
                        "allocator: group `{}` has a choice with seconds {} and risk {}; both must be finite and the risk non-negative",
                        g.name, c.seconds, c.risk
                    )));
                }
            }
        }
        Ok(())
    }

    /// The least bytes any selection needs in the additive model.
    pub fn min_bytes(&self) -> i64 {
        self.groups.iter().map(group_min_bytes).sum()
    }
}

fn group_min_bytes(g: &Group) -> i64 {
    let whole = g.whole.iter().map(|c| c.bytes).min();
    let opened = g.opened.as_ref().map(|o| {
        o.base.bytes
            + o.parts
                .iter()
                .map(|p| p.iter().map(|c| c.bytes).min().unwrap_or(0))
                .sum::<i64>()
    });
    match (whole, opened) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) => a,
        (None, Some(b)) => b,
        (None, None) => 0,
    }
}

/// The solver's settings.
#[derive(Debug, Clone, Copy)]
pub struct Solver {
    /// Memory buckets of the DP (the capacity above the least possible bytes is cut into
    /// this many). More is closer to exact and slower (linear in groups, quadratic for
    /// opened groups).
    pub buckets: usize,
    /// Bisection steps on `lambda` when the risk budget binds.
    pub lambda_steps: usize,
}

impl Default for Solver {
    fn default() -> Self {
        Solver {
            buckets: 256,
            lambda_steps: 24,
        }
    }
}

/// Why a problem has no solution.
#[derive(Debug, Clone, PartialEq)]
pub enum Infeasible {
    /// Even the least-memory selection exceeds the capacity.
    Memory {
        /// The least bytes any selection needs.
        min_bytes: i64,
        /// The capacity asked for.
        capacity: i64,
    },
    /// Every selection that fits the memory exceeds the risk budget.
    Risk {
        /// The least risk among selections that fit.
        min_risk: f64,
        /// The budget asked for.
        budget: f64,
    },
    /// The problem itself is malformed (a group without choices, a non-finite figure).
    Invalid(String),
}

impl std::fmt::Display for Infeasible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Infeasible::Memory {
                min_bytes,
                capacity,
            } => write!(
                f,
                "no selection fits {capacity} bytes; the least any selection needs is {min_bytes} bytes"
            ),
            Infeasible::Risk { min_risk, budget } => write!(
                f,
                "every selection that fits the memory has risk above {budget:.4e}; the least is {min_risk:.4e}"
            ),
            Infeasible::Invalid(m) => f.write_str(m),
        }
    }
}

/// The DP tables of one `lambda`, enough to backtrack any capacity.
struct Table {
    bucket: i64,
    units_cap: usize,
    /// `f[g][c]`: least cost of groups `0..=g` in at most `c` buckets.
    f: Vec<Vec<f64>>,
    /// How group `g` was decided at capacity `c`: `option << 32 | buckets it used`
    /// ([`pack_arg`]; one 64-bit word, as wide as the costs beside it, so the DP's
    /// updates compile to vector selects).
    arg: Vec<Vec<u64>>,
    /// Opened groups: per part, per capacity, the chosen part choice.
    sub: Vec<Option<Vec<Vec<u64>>>>,
}

const NONE: u32 = u32::MAX;

/// A table entry of [`Table::arg`].
fn pack_arg(option: u32, used: u32) -> u64 {
    (option as u64) << 32 | used as u64
}

/// `cur[c] = min(cur[c], prev[c - shift] + cost)` for `c >= shift`, and `arg[c] = word`
/// where it improves (strictly: the first option tried keeps ties). Written without
/// branches so that it vectorises (the DP spends most of its time here), on AVX2 where the
/// CPU has it: every element is computed on its own, so the lanes change no bit.
fn relax(cur: &mut [f64], arg: &mut [u64], prev: &[f64], shift: usize, cost: f64, word: u64) {
    #[inline(always)]
    fn body(cur: &mut [f64], arg: &mut [u64], prev: &[f64], shift: usize, cost: f64, word: u64) {
        let n = cur.len().min(arg.len());
        if shift >= n {
            return;
        }
        for ((cv, av), &pv) in cur[shift..n]
            .iter_mut()
            .zip(arg[shift..n].iter_mut())
            .zip(&prev[..n - shift])
        {
            let v = pv + cost;
            let better = v < *cv;
            *cv = if better { v } else { *cv };
            *av = if better { word } else { *av };
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn avx2(
        cur: &mut [f64],
        arg: &mut [u64],
        prev: &[f64],
        shift: usize,
        cost: f64,
        word: u64,
    ) {
        body(cur, arg, prev, shift, cost, word)
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { avx2(cur, arg, prev, shift, cost, word) };
    }
    body(cur, arg, prev, shift, cost, word)
}

impl Solver {
    /// Checks that `problem` is well formed and that its least-memory selection fits.
    fn admissible(&self, problem: &Problem) -> std::result::Result<(), Infeasible> {
        problem
            .check()
            .map_err(|e| Infeasible::Invalid(e.to_string()))?;
        let min_bytes = problem.min_bytes();
        if min_bytes > problem.capacity {
            return Err(Infeasible::Memory {
                min_bytes,
                capacity: problem.capacity,
            });
        }
        Ok(())
    }

    /// The optimum of `seconds + lambda * risk` within the capacity (one DP table).
    fn optimum(&self, problem: &Problem, lambda: f64) -> Selection {
        let t = self.table(problem, lambda);
        problem.selection(backtrack(problem, &t, t.units_cap), lambda)
    }

    /// Solves `problem`. Errors with [`Infeasible`] (as the message) when nothing fits.
    pub fn solve(&self, problem: &Problem) -> std::result::Result<Selection, Infeasible> {
        self.admissible(problem)?;
        let at = |lambda: f64| self.optimum(problem, lambda);
        let s0 = at(0.0);
        if s0.risk <= problem.risk_budget {
            return Ok(s0);
        }
        // Find a lambda whose optimum fits the risk budget.
        let scale = s0.seconds.max(1e-12) / s0.risk.max(1e-300);
        let mut hi = scale;
        let mut best = None;
        for _ in 0..80 {
            let s = at(hi);
            if s.risk <= problem.risk_budget {
                best = Some(s);
                break;
            }
            hi *= 4.0;
        }
        let Some(mut best) = best else {
            let s = at(hi);
            return Err(Infeasible::Risk {
                min_risk: s.risk,
                budget: problem.risk_budget,
            });
        };
        let mut lo = 0.0;
        for _ in 0..self.lambda_steps {
            let mid = if lo == 0.0 {
                hi / 16.0
            } else {
                (lo * hi).sqrt()
            };
            let s = at(mid);
            if s.risk <= problem.risk_budget {
                hi = mid;
                if s.seconds <= best.seconds {
                    best = s;
                }
            } else {
                lo = mid;
            }
            if lo > 0.0 && hi / lo < 1.0 + 1e-6 {
                break;
            }
        }
        Ok(best)
    }

    /// [`Solver::solve`] started from a multiplier `hint` known to be near the answer
    /// (the step's multiplier, when one microbatch is re-planned within the risk the
    /// others leave): the least multiplier that meets the risk budget is bracketed by
    /// halving or doubling from `hint`, then bisected to a ratio of 1.01, about ten DP
    /// tables where [`Solver::solve`] from scratch takes up to thirty. The selection
    /// returned meets the risk budget, as `solve`'s does; between the two brackets'
    /// selections it is the faster. Without a usable hint (not finite and positive) it is
    /// `solve`.
    pub fn solve_near(
        &self,
        problem: &Problem,
        hint: f64,
    ) -> std::result::Result<Selection, Infeasible> {
        if !(hint.is_finite() && hint > 0.0) {
            return self.solve(problem);
        }
        self.admissible(problem)?;
        let at = |lambda: f64| self.optimum(problem, lambda);
        let fits = |s: &Selection| s.risk <= problem.risk_budget;
        let s0 = at(0.0);
        if fits(&s0) {
            return Ok(s0);
        }
        let keep = |best: &mut Option<Selection>, s: Selection| {
            if best.as_ref().is_none_or(|b| s.seconds <= b.seconds) {
                *best = Some(s);
            }
        };
        let mut best: Option<Selection> = None;
        // Bracket: `lo` does not meet the budget, `hi` does.
        let s = at(hint);
        let (mut lo, mut hi) = if fits(&s) {
            keep(&mut best, s);
            let mut hi = hint;
            let mut lo = hint / 2.0;
            let mut bracketed = false;
            for _ in 0..16 {
                let s = at(lo);
                if !fits(&s) {
                    bracketed = true;
                    break;
                }
                keep(&mut best, s);
                hi = lo;
                lo /= 2.0;
            }
            if !bracketed {
                // Every multiplier down to hint / 2^16 meets the budget: that is close
                // enough to the unconstrained optimum, which did not.
                return Ok(best.expect("kept above"));
            }
            (lo, hi)
        } else {
            let mut lo = hint;
            let mut hi = hint * 2.0;
            let mut found = false;
            for _ in 0..64 {
                let s = at(hi);
                if fits(&s) {
                    keep(&mut best, s);
                    found = true;
                    break;
                }
                lo = hi;
                hi *= 2.0;
            }
            if !found {
                // Far from the hint: the search from scratch (and its error).
                return self.solve(problem);
            }
            (lo, hi)
        };
        while hi / lo > 1.01 {
            let mid = (lo * hi).sqrt();
            let s = at(mid);
            if fits(&s) {
                hi = mid;
                keep(&mut best, s);
            } else {
                lo = mid;
            }
        }
        Ok(best.expect("a selection that meets the risk budget was kept"))
    }

    /// The optimum of `seconds + lambda * risk` within the capacity, ignoring the risk
    /// budget (one point of the Lagrangian).
    pub fn solve_at(
        &self,
        problem: &Problem,
        lambda: f64,
    ) -> std::result::Result<Selection, Infeasible> {
        self.admissible(problem)?;
        Ok(self.optimum(problem, lambda))
    }

    fn table(&self, problem: &Problem, lambda: f64) -> Table {
        let offsets: Vec<i64> = problem.groups.iter().map(group_min_bytes).collect();
        let room = problem.capacity - offsets.iter().sum::<i64>();
        let q = self.buckets.max(1) as i64;
        let bucket = ((room + q - 1) / q).max(1);
        let units_cap = (room / bucket) as usize;
        let units = |bytes: i64, base: i64| -> usize {
            let d = (bytes - base).max(0);
            ((d + bucket - 1) / bucket) as usize
        };
        let cost = |c: &Choice| c.seconds + lambda * c.risk;
        let n = units_cap + 1;
        let mut f: Vec<Vec<f64>> = Vec::with_capacity(problem.groups.len());
        let mut arg = Vec::with_capacity(problem.groups.len());
        let mut sub = Vec::with_capacity(problem.groups.len());
        let mut prev = vec![0.0f64; n];
        for (g, group) in problem.groups.iter().enumerate() {
            let mut cur = vec![f64::INFINITY; n];
            let mut a = vec![pack_arg(NONE, 0); n];
            for (k, ch) in group.whole.iter().enumerate() {
                let u = units(ch.bytes, offsets[g]);
                if u > units_cap {
                    continue;
                }
                relax(
                    &mut cur,
                    &mut a,
                    &prev,
                    u,
                    cost(ch),
                    pack_arg(k as u32, u as u32),
                );
            }
            let mut sub_g = None;
            if let Some(o) = &group.opened {
                // Inner DP over the parts: h[c] = least cost of the parts in <= c buckets.
                let part_min: Vec<i64> = o
                    .parts
                    .iter()
                    .map(|p| p.iter().map(|c| c.bytes).min().unwrap_or(0))
                    .collect();
                let open_base = o.base.bytes + part_min.iter().sum::<i64>();
                let extra = units(open_base, offsets[g]);
                if extra <= units_cap {
                    let m = n - extra;
                    let mut h = vec![cost(&o.base); m];
                    let mut picks = Vec::with_capacity(o.parts.len());
                    for (p, part) in o.parts.iter().enumerate() {
                        let mut nh = vec![f64::INFINITY; m];
                        let mut pk = vec![NONE as u64; m];
                        for (k, ch) in part.iter().enumerate() {
                            let u = units(ch.bytes, part_min[p]);
                            if u >= m {
                                continue;
                            }
                            relax(&mut nh, &mut pk, &h, u, cost(ch), k as u64);
                        }
                        h = nh;
                        picks.push(pk);
                    }
                    // Breakpoints of h (where it strictly improves) are the only useful
                    // opened options.
                    let mut best = f64::INFINITY;
                    let open_id = group.whole.len() as u32;
                    for (j, &hj) in h.iter().enumerate().take(m) {
                        if hj < best {
                            best = hj;
                            let used = j + extra;
                            relax(
                                &mut cur,
                                &mut a,
                                &prev,
                                used,
                                hj,
                                pack_arg(open_id, used as u32),
                            );
                        }
                    }
                    sub_g = Some(picks);
                }
            }
            f.push(cur.clone());
            arg.push(a);
            sub.push(sub_g);
            prev = cur;
        }
        Table {
            bucket,
            units_cap,
            f,
            arg,
            sub,
        }
    }

    /// The vertices of a problem's time-risk frontier within its capacity, most risk
    /// first: the selections that minimise `seconds + mu * risk` for some `mu >= 0`.
    /// Found by solving where two known vertices tie (Eisner-Severance: one solve per
    /// vertex and one per edge; at most 64 solves). Returns the vertices and the number
    /// of solves.
    pub fn frontier(
        &self,
        problem: &Problem,
    ) -> std::result::Result<(Vec<Selection>, usize), Infeasible> {
        let fast = self.solve_at(problem, 0.0)?;
        let (vertices, solves) = self.frontier_from(problem, fast)?;
        Ok((vertices, solves + 1))
    }

    /// [`Solver::frontier`] given the problem's optimum at `mu = 0` (the fastest
    /// selection); the count excludes that solve.
    fn frontier_from(
        &self,
        problem: &Problem,
        fast: Selection,
    ) -> std::result::Result<(Vec<Selection>, usize), Infeasible> {
        if fast.risk <= 0.0 {
            return Ok((vec![fast], 0));
        }
        let safe = self.solve_at(problem, risk_only(&fast))?;
        let mut out = vec![fast.clone(), safe.clone()];
        let mut stack = vec![(fast, safe)];
        let mut solves = 1;
        while let Some((a, b)) = stack.pop() {
            // a: more risk, less time; b: less risk, more time.
            let dr = a.risk - b.risk;
            if dr <= 1e-12 * a.risk || solves >= 63 {
                continue;
            }
            let mu = (b.seconds - a.seconds) / dr;
            if !(mu.is_finite() && mu > 0.0) {
                continue;
            }
            let m = self.solve_at(problem, mu)?;
            solves += 1;
            let vm = m.seconds + mu * m.risk;
            let va = a.seconds + mu * a.risk;
            // No vertex strictly below the line through a and b: the edge is on the hull.
            if vm >= va - 1e-12 * va.abs().max(1e-12) || m.risk >= a.risk || m.risk <= b.risk {
                continue;
            }
            out.push(m.clone());
            stack.push((a, m.clone()));
            stack.push((m, b));
        }
        out.sort_by(|x, y| y.risk.total_cmp(&x.risk));
        out.dedup_by(|x, y| x.picks == y.picks);
        Ok((out, solves))
    }

    /// Plans the microbatches of one step under one risk budget on their summed risks,
    /// `sum_m R_m <= risk_budget`, each within its own capacity, minimising the summed
    /// time. (The allocator's choices carry squared risks, which add across units and
    /// microbatches; see [`super::risk`].)
    ///
    /// Each microbatch's choices are the vertices of its time-risk frontier (problems
    /// with the same byte figures share one frontier, computed on the member with the
    /// most risk, and evaluated on every member's own times and risks); one multiplier
    /// `lambda` on the squares then gives every microbatch the vertex minimising
    /// `seconds + lambda * R^2`, and `lambda` is bisected to the least value that meets
    /// the budget. The risk a microbatch may take therefore falls with its exposure:
    /// microbatches that can barely move the update absorb the lossy fidelities.
    pub fn solve_step(
        &self,
        problems: &[Problem],
        risk_budget: f64,
    ) -> std::result::Result<StepSelection, Infeasible> {
        let mut class_of: Vec<usize> = Vec::with_capacity(problems.len());
        for (k, p) in problems.iter().enumerate() {
            let c = (0..k)
                .find(|&j| same_shape(&problems[j], p))
                .map_or(k, |j| class_of[j]);
            class_of.push(c);
        }
        self.solve_step_in_classes(problems, risk_budget, &class_of)
    }

    /// [`Solver::solve_step`] with the frontier classes given: `class_of[k]` names the
    /// class of problem `k` (any label; problems with equal labels share one frontier).
    /// A class may hold problems of the same structure ([`same_structure`]: the same
    /// groups and choices, setting the same fidelities) whose bytes or capacities differ,
    /// e.g. the microbatches of one step whose profiles differ in their prompt rows: the
    /// frontier is then computed once, on the member with the most risk, and a member
    /// whose byte figures differ from it takes the vertices that fit its own capacity in
    /// its own bytes, its own fastest and least-risk selections, and its own optimum at
    /// each multiplier the step settles on (searched again after each, until no member
    /// gains a vertex, at most [`STEP_VERTEX_ROUNDS`] times): a DP per vertex it adds
    /// instead of a frontier of its own (tens of DPs). Problems of one class that do not
    /// share the structure are given classes of their own.
    pub fn solve_step_in_classes(
        &self,
        problems: &[Problem],
        risk_budget: f64,
        class_of: &[usize],
    ) -> std::result::Result<StepSelection, Infeasible> {
        if class_of.len() != problems.len() {
            return Err(Infeasible::Invalid(format!(
                "{} class labels for {} problems; give one label per problem",
                class_of.len(),
                problems.len()
            )));
        }
        let budget = if risk_budget.is_finite() {
            risk_budget.max(0.0)
        } else {
            f64::INFINITY
        };
        let mut solves = 0;
        let fastest: Vec<Selection> = problems
            .iter()
            .map(|p| {
                solves += 1;
                self.solve_at(p, 0.0)
            })
            .collect::<std::result::Result<_, _>>()?;
        let sum_of = |r: &mut dyn Iterator<Item = f64>| r.sum::<f64>();
        if sum_of(&mut fastest.iter().map(|s| s.risk)) <= budget {
            return Ok(StepSelection {
                selections: fastest,
                lambda: 0.0,
                solves,
            });
        }
        // Classes: the labels given, split by structure; the member with the most risk
        // represents its class (a zero-exposure representative has a flat frontier).
        let mut reps: Vec<usize> = Vec::new();
        let mut labels: Vec<usize> = Vec::new();
        let mut class: Vec<usize> = Vec::with_capacity(problems.len());
        for (k, p) in problems.iter().enumerate() {
            let found = (0..reps.len())
                .find(|&c| labels[c] == class_of[k] && same_structure(&problems[reps[c]], p));
            match found {
                Some(c) => {
                    if fastest[k].risk > fastest[reps[c]].risk {
                        reps[c] = k;
                    }
                    class.push(c);
                }
                None => {
                    reps.push(k);
                    labels.push(class_of[k]);
                    class.push(reps.len() - 1);
                }
            }
        }
        let mut frontiers: Vec<Vec<Vec<Pick>>> = Vec::with_capacity(reps.len());
        for &r in &reps {
            let (f, n) = self.frontier_from(&problems[r], fastest[r].clone())?;
            solves += n;
            frontiers.push(f.into_iter().map(|s| s.picks).collect());
        }
        // Every member's candidates in its own figures: index 0 is its own fastest
        // selection, then its class's frontier vertices that fit its capacity, then (for a
        // member whose byte figures differ from its representative's) its own least-risk
        // selection.
        let mut cand_picks: Vec<Vec<Vec<Pick>>> = Vec::with_capacity(problems.len());
        let mut cands: Vec<Vec<(f64, f64)>> = Vec::with_capacity(problems.len());
        for (k, p) in problems.iter().enumerate() {
            let rep = reps[class[k]];
            let mut picks = vec![fastest[k].picks.clone()];
            let mut tr = vec![(fastest[k].seconds, fastest[k].risk)];
            for v in &frontiers[class[k]] {
                let (t, r, b) = p.totals(v);
                if b <= p.capacity {
                    picks.push(v.clone());
                    tr.push((t, r));
                }
            }
            if fastest[k].risk > 0.0 && !same_shape(&problems[rep], p) {
                let safe = self.solve_at(p, risk_only(&fastest[k]))?;
                solves += 1;
                tr.push((safe.seconds, safe.risk));
                picks.push(safe.picks);
            }
            cand_picks.push(picks);
            cands.push(tr);
        }
        // The least reachable: every microbatch at its least-risk candidate.
        let least: Vec<usize> = cands
            .iter()
            .map(|c| {
                (0..c.len())
                    .min_by(|&a, &b| c[a].1.total_cmp(&c[b].1).then(c[a].0.total_cmp(&c[b].0)))
                    .unwrap_or(0)
            })
            .collect();
        if risk_of(&cands, &least) > budget {
            return Err(Infeasible::Risk {
                min_risk: risk_of(&cands, &least),
                budget: risk_budget,
            });
        }
        let t0: f64 = fastest.iter().map(|s| s.seconds).sum();
        let r0: f64 = sum_of(&mut fastest.iter().map(|s| s.risk));
        let (mut hi, mut best) = step_multiplier(&cands, budget, t0, r0, &least);
        // A member that does not share its representative's byte figures has only part of
        // its own frontier among its candidates: add its own optimum at the multiplier
        // found (a vertex of its own frontier, which is what it would take there) and
        // search the multiplier again, until no member gains a new vertex.
        let partial: Vec<usize> = (0..problems.len())
            .filter(|&k| {
                fastest[k].risk > 0.0 && !same_shape(&problems[reps[class[k]]], &problems[k])
            })
            .collect();
        for _ in 0..STEP_VERTEX_ROUNDS {
            let mut added = false;
            for &k in &partial {
                let v = self.solve_at(&problems[k], hi)?;
                solves += 1;
                if !cand_picks[k].contains(&v.picks) {
                    cands[k].push((v.seconds, v.risk));
                    cand_picks[k].push(v.picks);
                    added = true;
                }
            }
            if !added {
                break;
            }
            (hi, best) = step_multiplier(&cands, budget, t0, r0, &least);
        }
        let sum_at = |ch: &[usize]| risk_of(&cands, ch);
        // The multiplier's choice can leave budget unused (the frontier is discrete):
        // spend the slack greedily on the largest time gains. Equal shares
        // (`R_m <= B / M`, the fastest vertex within) are a second feasible start;
        // the faster of the two is kept.
        let fill = |mut ch: Vec<usize>| -> Vec<usize> {
            loop {
                let slack = budget - sum_at(&ch);
                let mut mv: Option<(usize, usize, f64)> = None;
                for (k, c) in cands.iter().enumerate() {
                    let (t, r) = c[ch[k]];
                    for (j, &(tj, rj)) in c.iter().enumerate() {
                        let gain = t - tj;
                        if gain > 1e-15 && rj - r <= slack && mv.is_none_or(|m| gain > m.2) {
                            mv = Some((k, j, gain));
                        }
                    }
                }
                match mv {
                    Some((k, j, _)) => ch[k] = j,
                    None => return ch,
                }
            }
        };
        let secs_of = |ch: &[usize]| -> f64 { ch.iter().zip(&cands).map(|(&j, c)| c[j].0).sum() };
        let best = fill(best);
        let share = budget / problems.len() as f64;
        let equal: Option<Vec<usize>> = cands
            .iter()
            .map(|c| {
                (0..c.len())
                    .filter(|&j| c[j].1 <= share)
                    .min_by(|&a, &b| c[a].0.total_cmp(&c[b].0))
            })
            .collect();
        let best = match equal.map(fill) {
            Some(e) if sum_at(&e) <= budget && secs_of(&e) < secs_of(&best) => e,
            _ => best,
        };
        let selections = best
            .iter()
            .enumerate()
            .map(|(k, &j)| {
                if j == 0 {
                    return fastest[k].clone();
                }
                let picks = cand_picks[k][j].clone();
                let (seconds, risk, bytes) = problems[k].totals(&picks);
                Selection {
                    picks,
                    seconds,
                    risk,
                    bytes,
                    lambda: hi,
                }
            })
            .collect();
        Ok(StepSelection {
            selections,
            lambda: hi,
            solves,
        })
    }

    /// The bucket size (bytes) the DP would use for `problem`.
    pub fn bucket_bytes(&self, problem: &Problem) -> i64 {
        let room = problem.capacity - problem.min_bytes();
        let q = self.buckets.max(1) as i64;
        ((room + q - 1) / q).max(1)
    }
}

/// Rounds of [`Solver::solve_step_in_classes`] that add a member's own vertex at the
/// multiplier found (each one DP per member whose bytes differ from its class's
/// representative).
const STEP_VERTEX_ROUNDS: usize = 8;

/// A multiplier so large that only risk matters against `fast` (a problem's fastest
/// selection, with risk): ties among the least-risk selections broken by time when that
/// risk is zero.
fn risk_only(fast: &Selection) -> f64 {
    1e9 * fast.seconds.abs().max(1e-12) / fast.risk
}

/// The summed risk of one candidate per member (`choice[k]` of `cands[k]`, each
/// `(seconds, risk)`).
fn risk_of(cands: &[Vec<(f64, f64)>], choice: &[usize]) -> f64 {
    choice.iter().zip(cands).map(|(&j, c)| c[j].1).sum()
}

/// Every member's candidate minimising `seconds + lambda * risk` (ties to less risk).
fn choose_at(cands: &[Vec<(f64, f64)>], lambda: f64) -> Vec<usize> {
    cands
        .iter()
        .map(|c| {
            let mut best = 0;
            for (j, &(t, r)) in c.iter().enumerate() {
                let (bt, br) = c[best];
                let v = t + lambda * r;
                let bv = bt + lambda * br;
                if v < bv || (v == bv && r < br) {
                    best = j;
                }
            }
            best
        })
        .collect()
}

/// The least multiplier (to a ratio of `1 + 1e-9`) whose choice over `cands` meets
/// `budget` on the summed risks, and that choice; `least` (every member at its least-risk
/// candidate, which meets it) past every multiplier tried. `t0`, `r0`: the fastest
/// choice's summed time and risk, which scale the first multiplier tried.
fn step_multiplier(
    cands: &[Vec<(f64, f64)>],
    budget: f64,
    t0: f64,
    r0: f64,
    least: &[usize],
) -> (f64, Vec<usize>) {
    let sum_at = |ch: &[usize]| risk_of(cands, ch);
    let mut hi = t0.abs().max(1e-12) / r0.max(1e-300);
    let mut best = None;
    for _ in 0..400 {
        let c = choose_at(cands, hi);
        if sum_at(&c) <= budget {
            best = Some(c);
            break;
        }
        hi *= 4.0;
    }
    // Past every multiplier tried, fall back to the least-risk candidates (they fit).
    let mut best = best.unwrap_or_else(|| least.to_vec());
    let mut lo = 0.0f64;
    for _ in 0..200 {
        let mid = if lo == 0.0 {
            hi / 16.0
        } else {
            (lo * hi).sqrt()
        };
        let c = choose_at(cands, mid);
        if sum_at(&c) <= budget {
            hi = mid;
            best = c;
        } else {
            lo = mid;
        }
        if lo > 0.0 && hi / lo < 1.0 + 1e-9 {
            break;
        }
    }
    (hi, best)
}

fn backtrack(problem: &Problem, t: &Table, cap: usize) -> Vec<Pick> {
    let mut picks = vec![Pick::Whole(0); problem.groups.len()];
    let mut c = cap;
    for g in (0..problem.groups.len()).rev() {
        debug_assert!(t.f[g][c].is_finite());
        let w = t.arg[g][c];
        let (k, used) = ((w >> 32) as u32, w as u32);
        let group = &problem.groups[g];
        if (k as usize) < group.whole.len() {
            picks[g] = Pick::Whole(k as usize);
        } else {
            let o = group.opened.as_ref().expect("opened pick");
            let subt = t.sub[g].as_ref().expect("opened table");
            // Which inner capacity j was used: the first breakpoint reaching used - extra.
            let extra = {
                let offset = group_min_bytes(group);
                let part_min: i64 = o
                    .parts
                    .iter()
                    .map(|p| p.iter().map(|c| c.bytes).min().unwrap_or(0))
                    .sum();
                let d = (o.base.bytes + part_min - offset).max(0);
                ((d + t.bucket - 1) / t.bucket) as usize
            };
            let mut j = used as usize - extra;
            let mut ks = vec![0usize; o.parts.len()];
            for p in (0..o.parts.len()).rev() {
                let k = subt[p][j] as usize;
                ks[p] = k;
                let pmin = o.parts[p].iter().map(|c| c.bytes).min().unwrap_or(0);
                let d = (o.parts[p][k].bytes - pmin).max(0);
                j -= ((d + t.bucket - 1) / t.bucket) as usize;
            }
            picks[g] = Pick::Opened(ks);
        }
        c -= used as usize;
    }
    picks
}

/// Every selection of `problem`, for brute-force checks of small problems.
pub fn enumerate(problem: &Problem) -> Vec<Vec<Pick>> {
    let mut out: Vec<Vec<Pick>> = vec![Vec::new()];
    for g in &problem.groups {
        let mut options: Vec<Pick> = (0..g.whole.len()).map(Pick::Whole).collect();
        if let Some(o) = &g.opened {
            let mut combos: Vec<Vec<usize>> = vec![Vec::new()];
            for part in &o.parts {
                combos = combos
                    .into_iter()
                    .flat_map(|c| {
                        (0..part.len()).map(move |k| {
                            let mut c = c.clone();
                            c.push(k);
                            c
                        })
                    })
                    .collect();
            }
            options.extend(combos.into_iter().map(Pick::Opened));
        }
        out = out
            .into_iter()
            .flat_map(|s| {
                options.iter().map(move |p| {
                    let mut s = s.clone();
                    s.push(p.clone());
                    s
                })
            })
            .collect();
    }
    out
}

/// The fastest selection within `capacity` bytes and `risk_budget`, by enumeration.
pub fn brute_force(problem: &Problem, capacity: i64, risk_budget: f64) -> Option<(Vec<Pick>, f64)> {
    let mut best: Option<(Vec<Pick>, f64)> = None;
    for picks in enumerate(problem) {
        let (s, r, b) = problem.totals(&picks);
        if b <= capacity && r <= risk_budget && best.as_ref().is_none_or(|(_, bs)| s < *bs) {
            best = Some((picks, s));
        }
    }
    best
}

/// Whether two problems have the same groups and choices, each choice setting the same
/// fidelities (their bytes, times, risks and capacities may differ): a selection of one
/// is a selection of the other.
pub fn same_structure(a: &Problem, b: &Problem) -> bool {
    let same_choices = |x: &[Choice], y: &[Choice]| {
        x.len() == y.len() && x.iter().zip(y).all(|(c, d)| c.fidelities == d.fidelities)
    };
    a.groups.len() == b.groups.len()
        && a.groups.iter().zip(&b.groups).all(|(g, h)| {
            same_choices(&g.whole, &h.whole)
                && match (&g.opened, &h.opened) {
                    (None, None) => true,
                    (Some(o), Some(q)) => {
                        o.base.fidelities == q.base.fidelities
                            && o.parts.len() == q.parts.len()
                            && o.parts
                                .iter()
                                .zip(&q.parts)
                                .all(|(x, y)| same_choices(x, y))
                    }
                    _ => false,
                }
        })
}

/// Whether two problems share their choices' bytes and capacity (microbatches of one
/// size: their selections are interchangeable, only times and risks differ).
pub fn same_shape(a: &Problem, b: &Problem) -> bool {
    fn bytes(p: &Problem) -> Vec<i64> {
        let mut v = Vec::new();
        for g in &p.groups {
            v.push(g.whole.len() as i64);
            v.extend(g.whole.iter().map(|c| c.bytes));
            if let Some(o) = &g.opened {
                v.push(o.parts.len() as i64);
                v.push(o.base.bytes);
                for part in &o.parts {
                    v.push(part.len() as i64);
                    v.extend(part.iter().map(|c| c.bytes));
                }
            } else {
                v.push(-1);
            }
        }
        v
    }
    a.capacity == b.capacity && a.groups.len() == b.groups.len() && bytes(a) == bytes(b)
}
