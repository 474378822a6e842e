//! The knapsack solver against brute force on small random problems.
//!
//! Tolerance: the DP rounds every choice's bytes up to whole buckets, so it may miss a
//! selection that fits only without rounding. It is therefore checked to be (a) feasible
//! at the exact capacity and (b) at least as fast as the brute-force optimum at the
//! capacity shrunk by the largest total rounding (one bucket per rounded choice), which
//! is what "optimal within the discretisation" means. Times are compared with 1e-9
//! slack (sums of the same f64 values in another order).

use hilore_runtime::allocator::solver::{
    brute_force, Choice, Group, Infeasible, Opened, Problem, Solver,
};
use hilore_runtime::Fidelity;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn random_choices(rng: &mut Rng, name: &str, n: usize, with_risk: bool) -> Vec<Choice> {
    let fids = [
        Fidelity::Store,
        Fidelity::Compress("fp8-e4m3-b32"),
        Fidelity::Compress("int4-g32"),
        Fidelity::Recompute,
    ];
    (0..n)
        .map(|k| {
            let f = fids[k % fids.len()];
            let lossy = matches!(f, Fidelity::Compress(_));
            Choice::one(
                name,
                0,
                f,
                rng.unit() * 3.0,
                if with_risk && lossy { rng.unit() } else { 0.0 },
                rng.below(1000) as i64 - 100,
            )
        })
        .collect()
}

fn random_problem(rng: &mut Rng, with_risk: bool) -> Problem {
    let ngroups = 2 + rng.below(3) as usize;
    let groups = (0..ngroups)
        .map(|g| {
            let name = format!("g{g}");
            let opened = if rng.below(2) == 0 {
                let parts = (0..1 + rng.below(3) as usize)
                    .map(|p| {
                        let n = 1 + rng.below(3) as usize;
                        random_choices(rng, &format!("g{g}p{p}"), n, with_risk)
                    })
                    .collect();
                Some(Opened {
                    base: Choice::one(&name, 0, Fidelity::Store, 0.0, 0.0, rng.below(50) as i64),
                    parts,
                })
            } else {
                None
            };
            let nwhole = if opened.is_some() {
                rng.below(2) as usize
            } else {
                1 + rng.below(3) as usize
            };
            Group {
                name: name.clone(),
                whole: random_choices(rng, &name, nwhole, with_risk),
                opened,
            }
        })
        .collect();
    Problem {
        groups,
        capacity: 0,
        risk_budget: f64::INFINITY,
    }
}

#[test]
fn matches_brute_force_on_memory() {
    let mut rng = Rng(11);
    let solver = Solver {
        buckets: 64,
        ..Solver::default()
    };
    let mut checked = 0;
    for _ in 0..300 {
        let mut p = random_problem(&mut rng, false);
        let min = p.min_bytes();
        p.capacity = min + rng.below(1500) as i64;
        let bf = brute_force(&p, p.capacity, f64::INFINITY).expect("min fits");
        let s = solver.solve(&p).expect("feasible");
        assert!(
            s.bytes <= p.capacity,
            "over capacity: {} > {}",
            s.bytes,
            p.capacity
        );
        assert!(s.seconds >= bf.1 - 1e-9, "better than brute force?");
        // At most 4 groups of at most 3 parts: at most 16 rounded choices.
        let slack = solver.bucket_bytes(&p) * 16;
        if let Some(bf_tight) = brute_force(&p, p.capacity - slack, f64::INFINITY) {
            assert!(
                s.seconds <= bf_tight.1 + 1e-9,
                "solver {} worse than brute force {} at capacity - {slack}",
                s.seconds,
                bf_tight.1
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} problems compared");
}

#[test]
fn lagrangian_is_optimal_for_the_risk_it_reaches() {
    let mut rng = Rng(5);
    let solver = Solver {
        buckets: 64,
        ..Solver::default()
    };
    let mut binding = 0;
    for _ in 0..300 {
        let mut p = random_problem(&mut rng, true);
        p.capacity = p.min_bytes() + rng.below(2500) as i64;
        let unconstrained = solver.solve(&p).unwrap();
        p.risk_budget = unconstrained.risk * rng.unit();
        match solver.solve(&p) {
            Ok(s) => {
                assert!(s.risk <= p.risk_budget + 1e-12);
                assert!(s.bytes <= p.capacity);
                let bf = brute_force(&p, p.capacity, p.risk_budget).expect("a solution exists");
                assert!(s.seconds >= bf.1 - 1e-9);
                if s.lambda > 0.0 {
                    binding += 1;
                    // Optimal for the risk it reaches, within the discretisation.
                    let slack = solver.bucket_bytes(&p) * 16;
                    if let Some(t) = brute_force(&p, p.capacity - slack, s.risk) {
                        assert!(s.seconds <= t.1 + 1e-9, "{} > {}", s.seconds, t.1);
                    }
                }
            }
            Err(Infeasible::Risk { min_risk, budget }) => {
                assert!(min_risk > budget);
                // Brute force agrees nothing fits, up to the rounding of memory.
                let slack = solver.bucket_bytes(&p) * 16;
                assert!(brute_force(&p, p.capacity - slack, p.risk_budget).is_none());
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(binding > 50, "risk budget bound in only {binding} problems");
}

fn store_recompute_compress(name: &str, store: i64, exposure: f64) -> Group {
    Group {
        name: name.into(),
        whole: vec![
            Choice::one(name, 0, Fidelity::Store, 0.0, 0.0, store),
            Choice::one(
                name,
                0,
                Fidelity::Compress("int4-g32"),
                0.1,
                0.5 * exposure,
                store / 6,
            ),
            Choice::one(name, 0, Fidelity::Recompute, 1.0, 0.0, store / 20),
        ],
        opened: None,
    }
}

#[test]
fn infeasible_memory_names_the_least_bytes() {
    let p = Problem {
        groups: vec![
            store_recompute_compress("a", 1000, 1.0),
            store_recompute_compress("b", 1000, 1.0),
        ],
        capacity: 90,
        risk_budget: f64::INFINITY,
    };
    match Solver::default().solve(&p) {
        Err(Infeasible::Memory {
            min_bytes,
            capacity,
        }) => {
            assert_eq!(min_bytes, 100);
            assert_eq!(capacity, 90);
            let msg = Infeasible::Memory {
                min_bytes,
                capacity,
            }
            .to_string();
            assert!(msg.contains("100 bytes"), "{msg}");
        }
        other => panic!("expected a memory error, got {other:?}"),
    }
}

#[test]
fn zero_exposure_takes_the_cheapest_feasible_fidelity() {
    // Memory forces every instance off Store; with zero exposure compression carries no
    // risk, so the cheap compressed choice wins over the slow recompute even under a zero
    // risk budget.
    let p = Problem {
        groups: vec![
            store_recompute_compress("a", 1200, 0.0),
            store_recompute_compress("b", 1200, 0.0),
        ],
        capacity: 500,
        risk_budget: 0.0,
    };
    let s = Solver::default().solve(&p).unwrap();
    for (_, _, f) in p.fidelities(&s.picks) {
        assert_eq!(f, Fidelity::Compress("int4-g32"));
    }
    // With exposure and a zero risk budget, the same memory needs recompute.
    let p = Problem {
        groups: vec![
            store_recompute_compress("a", 1200, 1.0),
            store_recompute_compress("b", 1200, 1.0),
        ],
        capacity: 500,
        risk_budget: 0.0,
    };
    let s = Solver::default().solve(&p).unwrap();
    for (_, _, f) in p.fidelities(&s.picks) {
        assert_eq!(f, Fidelity::Recompute);
    }
}

#[test]
fn infeasible_risk_is_reported() {
    // Only compression fits, and it carries risk.
    let g = |name: &str| Group {
        name: name.into(),
        whole: vec![
            Choice::one(name, 0, Fidelity::Store, 0.0, 0.0, 1000),
            Choice::one(name, 0, Fidelity::Compress("fp8-e4m3-b32"), 0.1, 1.0, 100),
        ],
        opened: None,
    };
    let p = Problem {
        groups: vec![g("a"), g("b")],
        capacity: 300,
        risk_budget: 1.5,
    };
    match Solver::default().solve(&p) {
        Err(Infeasible::Risk { min_risk, budget }) => {
            assert_eq!(budget, 1.5);
            assert_eq!(min_risk, 2.0);
        }
        other => panic!("expected a risk error, got {other:?}"),
    }
}
