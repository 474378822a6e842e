//! The allocator on a real tape: its predicted peak equals the measured ledger peak byte
//! for byte, it respects the budget, never recomputes a unit that is not deterministic,
//! names the smallest feasible budget when asked for less, and gives zero-exposure
//! microbatches the cheapest feasible fidelity.
//!
//! Costs are set by hand (not measured) so the expected choices are unambiguous: recompute
//! is 20x slower than encode + decode of the same unit.

use candle_core::{DType, Device, Tensor};
use hilore_runtime::allocator::{Allocator, MicrobatchInput, MicrobatchShape, Offer, StateBytes};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Grads, Plan, Result, Var};

struct Block {
    w1: Var,
    w2: Var,
}

impl Block {
    #[recovery_unit(name = "up", cost = 2 * x.dim(0)? * x.dim(1)? * 64, deterministic)]
    fn up(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.w1, None)?;
        cx.silu(&h)
    }

    #[recovery_unit(name = "down", cost = 2 * h.dim(0)? * h.dim(1)? * 16, deterministic)]
    fn down(&self, cx: &mut Cx, h: &Var, x: &Var) -> Result<Var> {
        let y = cx.linear(h, &self.w2, None)?;
        cx.add(x, &y)
    }

    #[recovery_unit(name = "block", cost = 4 * x.dim(0)? * x.dim(1)? * 64, deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = self.up(cx, x)?;
        self.down(cx, &h, x)
    }
}

struct Model {
    blocks: Vec<Block>,
    out: Var,
}

impl Model {
    /// Not `deterministic`: the allocator must never offer it Recompute.
    #[recovery_unit(name = "noisy_head", cost = 2 * x.dim(0)? * x.dim(1)? * 16)]
    fn head(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let y = cx.linear(x, &self.out, None)?;
        cx.silu(&y)
    }

    fn forward<'m>(&'m self, cx: &mut Cx<'m>, x: &Var) -> Result<Var> {
        let mut x = x.clone();
        for b in &self.blocks {
            x = b.forward(cx, &x)?;
        }
        self.head(cx, &x)
    }
}

const N: usize = 96;
const D: usize = 16;

fn model(dev: &Device) -> Model {
    let w = |o: usize, i: usize, s: u64| {
        let v: Vec<f32> = (0..o * i)
            .map(|k| (((k as u64 * 2654435761 + s * 97) % 1000) as f32 / 1000.0 - 0.5) * 0.3)
            .collect();
        Var::param(Tensor::from_vec(v, (o, i), dev).unwrap())
    };
    Model {
        blocks: (0..3)
            .map(|b| Block {
                w1: w(64, D, 2 * b),
                w2: w(D, 64, 2 * b + 1),
            })
            .collect(),
        out: w(D, D, 99),
    }
}

fn input(dev: &Device) -> Var {
    let v: Vec<f32> = (0..N * D)
        .map(|k| ((k * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    Var::constant(Tensor::from_vec(v, (N, D), dev).unwrap())
}

fn seed(dev: &Device) -> Tensor {
    let v: Vec<f32> = (0..N * D)
        .map(|k| ((k * 13 % 17) as f32 / 8.0) - 1.0)
        .collect();
    Tensor::from_vec(v, (N, D), dev).unwrap()
}

fn measured_peak(m: &Model, plan: &Plan) -> usize {
    let dev = Device::Cpu;
    let mut cx = Cx::new(plan.clone());
    let y = m.forward(&mut cx, &input(&dev)).unwrap();
    cx.backward(&y, &seed(&dev), &mut Grads::new()).unwrap();
    cx.memory().peak_bytes()
}

const CODEC: &str = "fp8-e4m3-b32";
const STATE: StateBytes = StateBytes {
    params: 1000,
    grads: 1000,
    optimizer: 2000,
};

fn allocator(m: &Model) -> Allocator {
    let dev = Device::Cpu;
    let mut cx = Cx::new(Plan::store_all()).profiling(true);
    let y = m.forward(&mut cx, &input(&dev)).unwrap();
    cx.backward(&y, &seed(&dev), &mut Grads::new()).unwrap();
    let profile = cx.profile().unwrap();
    let mut a = Allocator::new(profile, &cx.unit_instances(), STATE, &[CODEC]).unwrap();
    let shape = shape();
    a.costs.observe_recompute("block", shape, 2e-3);
    a.costs.observe_recompute("up", shape, 1.4e-3);
    a.costs.observe_recompute("down", shape, 0.6e-3);
    a.costs.observe_recompute("noisy_head", shape, 0.5e-3);
    // 1e-8 s per value each way: compressing a unit costs about 1/20 of recomputing it.
    a.costs.observe_codec(CODEC, 1_000_000, 0.01, 0.01);
    for b in a.instances().to_vec() {
        a.risk.set_kappa(b.unit, b.call, CODEC, 1e-3);
    }
    a
}

fn shape() -> MicrobatchShape {
    MicrobatchShape {
        tokens: N,
        sum_sq_lengths: N * N,
        prompt_rows: 0,
        logprobs: N,
    }
}

/// Store and Recompute only.
fn exact_only() -> Offer {
    Offer {
        codecs: Vec::new(),
        recompute: true,
        open_groups: true,
    }
}

fn unit_exposure() -> MicrobatchInput {
    MicrobatchInput {
        shape: shape(),
        exposure: 1.0,
    }
}

fn full() -> Offer {
    Offer {
        codecs: vec![CODEC],
        recompute: true,
        open_groups: true,
    }
}

#[test]
fn predicted_peak_is_measured_and_within_budget() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let (least, _) = a.least_memory(&full()).unwrap();
    let store = measured_peak(&m, &Plan::store_all());
    assert!(least < store);
    let mut planned = 0;
    for k in 0..=8 {
        let act = least + (store - least) * k / 8;
        let budget = STATE.total() + act;
        for (exposure, risk) in [(1.0, f64::INFINITY), (1.0, 5e-3), (0.0, 0.0)] {
            let mb = MicrobatchInput {
                shape: shape(),
                exposure,
            };
            let d = a.plan(&mb, budget, risk, &full()).unwrap();
            let measured = measured_peak(&m, &d.plan);
            assert_eq!(measured, d.predicted_peak_bytes, "budget {budget}");
            assert!(d.predicted_total_bytes <= budget);
            assert!(d.predicted_risk <= risk);
            for b in a.instances() {
                if b.unit == "noisy_head" {
                    assert_ne!(
                        d.plan.fidelity_for(a.descriptor(b.index), b.call),
                        Fidelity::Recompute
                    );
                }
            }
            planned += 1;
        }
    }
    assert_eq!(planned, 27);
}

#[test]
fn infeasible_budget_names_the_smallest_feasible_one() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let mb = MicrobatchInput {
        shape: shape(),
        exposure: 0.0,
    };
    let (least, plan) = a.least_memory(&full()).unwrap();
    assert_eq!(measured_peak(&m, &plan), least);
    let smallest = STATE.total() + least;
    let err = a
        .plan(&mb, smallest - 1, f64::INFINITY, &full())
        .unwrap_err();
    // A caller can match the error and read the figure.
    match &err {
        hilore_runtime::Error::InfeasibleMemory {
            smallest_feasible_bytes,
            budget_bytes,
            ..
        } => assert_eq!(
            (*smallest_feasible_bytes, *budget_bytes),
            (smallest, smallest - 1)
        ),
        other => panic!("not InfeasibleMemory: {other}"),
    }
    let err = err.to_string();
    assert!(
        err.contains(&format!("smallest feasible budget is {smallest} bytes")),
        "{err}"
    );
    let d = a.plan(&mb, smallest, f64::INFINITY, &full()).unwrap();
    assert!(d.predicted_total_bytes <= smallest);
    // Below the fixed state nothing fits either, and the message says so.
    let err = a
        .plan(&mb, 10, f64::INFINITY, &full())
        .unwrap_err()
        .to_string();
    assert!(err.contains("fixed state"), "{err}");
}

#[test]
fn zero_exposure_gets_the_cheapest_feasible_fidelity() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let store = measured_peak(&m, &Plan::store_all());
    let (least, _) = a.least_memory(&full()).unwrap();
    // A budget that forces most units off Store.
    let budget = STATE.total() + least + (store - least) / 3;
    let zero = MicrobatchInput {
        shape: shape(),
        exposure: 0.0,
    };
    let d0 = a.plan(&zero, budget, 0.0, &full()).unwrap();
    // With zero exposure compression is free of risk and 20x cheaper than recompute: the
    // plan uses no more recompute time than the all-compress alternative would.
    let recomputes: Vec<_> = d0
        .counts
        .iter()
        .filter(|(f, _)| *f == Fidelity::Recompute)
        .collect();
    let compressed: usize = d0
        .counts
        .iter()
        .filter(|(f, _)| matches!(f, Fidelity::Compress(_)))
        .map(|(_, n)| n)
        .sum();
    assert!(compressed > 0, "{:?}", d0.counts);
    // The same memory with exposure and no risk allowed must avoid compression and pay
    // for recompute instead.
    let hot = MicrobatchInput {
        shape: shape(),
        exposure: 5.0,
    };
    let d1 = a.plan(&hot, budget, 0.0, &full()).unwrap();
    assert!(d1
        .counts
        .iter()
        .all(|(f, _)| !matches!(f, Fidelity::Compress(_))));
    assert!(d0.predicted_seconds < d1.predicted_seconds);
    // And zero exposure is exactly as fast as an unlimited risk budget allows.
    let free = a.plan(&hot, budget, f64::INFINITY, &full()).unwrap();
    assert!(
        (d0.predicted_seconds - free.predicted_seconds).abs() < 1e-12,
        "{recomputes:?}"
    );
    let _ = DType::F32;
}

/// Where a selective-recompute-shaped plan (the last `k` blocks kept with some of their
/// children recomputed, the others recomputed whole) fits the budget exactly, the
/// allocator finds a plan at least as fast in its own cost model, and that plan fits.
/// The budgets are those plans' own exact peaks, the tightest case: the additive byte
/// model may overstate them, and then only the exact check sees that they fit.
#[test]
fn never_slower_than_a_selective_plan_that_fits() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let (exact, mb) = (exact_only(), unit_exposure());
    // The costs `allocator` observed at this shape.
    let secs = |unit: &str| match unit {
        "block" => 2e-3,
        "up" => 1.4e-3,
        "down" => 0.6e-3,
        _ => unreachable!(),
    };
    let subsets: [&[&str]; 4] = [&[], &["up"], &["down"], &["up", "down"]];
    for k in 1..=3 {
        for sub in subsets {
            let mut plan = Plan::store_all();
            let mut t = 0.0;
            for l in 0..3 {
                if l < 3 - k {
                    plan.set_instance("block", l, Fidelity::Recompute);
                    t += secs("block");
                } else {
                    for &u in sub {
                        plan.set_instance(u, l, Fidelity::Recompute);
                        t += secs(u);
                    }
                }
            }
            let budget = STATE.total() + measured_peak(&m, &plan);
            let d = a.plan(&mb, budget, f64::INFINITY, &exact).unwrap();
            // Sums of at most six f64 costs on both sides: 1e-9 relative covers their
            // rounding and the cost fit's at the observed shape.
            assert!(
                d.predicted_seconds <= t * (1.0 + 1e-9),
                "k {k}, {sub:?}: planned {} s, the selective plan {t} s",
                d.predicted_seconds
            );
            assert!(d.predicted_total_bytes <= budget);
            assert_eq!(measured_peak(&m, &d.plan), d.predicted_peak_bytes);
        }
    }
}

/// Over every Store/Recompute plan of the test model (each block recomputed whole, or kept
/// with any subset of its two children recomputed: 5^3 plans), at a budget equal to each
/// plan's own exact peak, the allocator's plan is as fast as the fastest plan that fits
/// exactly. The additive byte model alone leaves memory unused at several of these
/// budgets; the exact local search after the knapsack takes it.
#[test]
fn exact_plans_are_optimal_at_every_budget() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let (exact, mb) = (exact_only(), unit_exposure());
    // Per block: 0 = recompute whole, 1..=4 = kept with children subset (up, down) bits.
    let mut plans = Vec::new();
    for code in 0..125usize {
        let mut plan = Plan::store_all();
        let mut t = 0.0;
        let mut c = code;
        for l in 0..3 {
            match c % 5 {
                0 => {
                    plan.set_instance("block", l, Fidelity::Recompute);
                    t += 2e-3;
                }
                k => {
                    if (k - 1) & 1 != 0 {
                        plan.set_instance("up", l, Fidelity::Recompute);
                        t += 1.4e-3;
                    }
                    if (k - 1) & 2 != 0 {
                        plan.set_instance("down", l, Fidelity::Recompute);
                        t += 0.6e-3;
                    }
                }
            }
            c /= 5;
        }
        plans.push((measured_peak(&m, &plan), t));
    }
    let mut budgets: Vec<usize> = plans.iter().map(|p| p.0).collect();
    budgets.sort();
    budgets.dedup();
    for peak in budgets {
        let best = plans
            .iter()
            .filter(|p| p.0 <= peak)
            .map(|p| p.1)
            .fold(f64::INFINITY, f64::min);
        let budget = STATE.total() + peak;
        let d = a.plan(&mb, budget, f64::INFINITY, &exact).unwrap();
        // Sums of at most six f64 costs on both sides: 1e-9 relative covers their
        // rounding and the cost fit's at the observed shape.
        assert!(
            d.predicted_seconds <= best * (1.0 + 1e-9) + 1e-15,
            "budget {budget}: planned {} s, the fastest exact plan that fits {best} s",
            d.predicted_seconds
        );
        assert_eq!(measured_peak(&m, &d.plan), d.predicted_peak_bytes);
        assert!(d.predicted_total_bytes <= budget);
    }
}

/// A memory budget only compression reaches (recompute is not offered, as for a model
/// whose units are not deterministic), with a risk budget smaller than any compressed
/// plan carries: `Error::InfeasibleRisk` with the least risk that fits, and asking for
/// that risk plans.
#[test]
fn infeasible_risk_names_the_least_risk_that_fits() {
    let m = model(&Device::Cpu);
    let a = allocator(&m);
    let compress_only = Offer {
        codecs: vec![CODEC],
        recompute: false,
        open_groups: true,
    };
    let store = measured_peak(&m, &Plan::store_all());
    let (least, _) = a.least_memory(&compress_only).unwrap();
    assert!(
        least < store,
        "compression must reach below store-all: {least} vs {store}"
    );
    let budget = STATE.total() + (least + store) / 2;
    let mb = unit_exposure();
    let err = a.plan(&mb, budget, 0.0, &compress_only).unwrap_err();
    let least_risk = match &err {
        hilore_runtime::Error::InfeasibleRisk { budget, least_risk } => {
            assert_eq!(*budget, 0.0);
            assert!(*least_risk > 0.0, "{err}");
            *least_risk
        }
        other => panic!("not InfeasibleRisk: {other}"),
    };
    assert!(
        err.to_string().contains("least risk any plan that fits"),
        "{err}"
    );
    // The figure is what a plan within the budget reaches: asking for it plans, and the
    // plan carries no more.
    let d = a.plan(&mb, budget, least_risk, &compress_only).unwrap();
    assert!(d.predicted_total_bytes <= budget);
    assert!(
        d.predicted_risk <= least_risk,
        "{} > {least_risk}",
        d.predicted_risk
    );
}

/// [`allocator`] with every exact simulation priced at 1 s (far above what any change of
/// these plans, of milliseconds, could save).
fn dear_allocator(m: &Model) -> Allocator {
    let mut a = allocator(m);
    a.costs.simulation_seconds_per_event = Some(1.0 / a.profile().num_events() as f64);
    a
}

#[test]
fn the_local_search_pays_for_its_simulations() {
    // With simulations that cost nothing the exact searches run as far as their bound;
    // priced above any time a change could save (1 s a simulation, against changes of
    // milliseconds), the local search runs none, so the plan takes fewer simulations, and
    // it still fits and is still measured as predicted.
    let m = model(&Device::Cpu);
    let free = allocator(&m);
    let dear = dear_allocator(&m);
    assert_eq!(dear.simulation_seconds(), 1.0);
    let (least, _) = free.least_memory(&full()).unwrap();
    let store = measured_peak(&m, &Plan::store_all());
    let (mut free_checks, mut dear_checks) = (0, 0);
    for k in 1..8 {
        let budget = STATE.total() + least + (store - least) * k / 8;
        let a = free.plan(&unit_exposure(), budget, 5e-3, &full()).unwrap();
        let b = dear.plan(&unit_exposure(), budget, 5e-3, &full()).unwrap();
        assert_eq!(measured_peak(&m, &b.plan), b.predicted_peak_bytes);
        assert!(b.predicted_total_bytes <= budget && b.predicted_risk <= 5e-3);
        free_checks += a.exact_checks;
        dear_checks += b.exact_checks;
    }
    assert!(
        dear_checks < free_checks,
        "{dear_checks} simulations priced at 1 s, {free_checks} free"
    );
}

#[test]
fn the_greedy_starts_pay_for_their_simulations() {
    // Priced above any time a plan could save (1 s a simulation, against plans of
    // milliseconds), neither the greedy starts nor the local search simulate anything on
    // any microbatch of a step; free, they do. Exposures differ, so no microbatch takes
    // another's plan.
    let m = model(&Device::Cpu);
    let free = allocator(&m);
    let dear = dear_allocator(&m);
    let (least, _) = free.least_memory(&full()).unwrap();
    let store = measured_peak(&m, &Plan::store_all());
    let mbs: Vec<MicrobatchInput> = (1..=6)
        .map(|k| MicrobatchInput {
            shape: shape(),
            exposure: 0.25 * k as f64,
        })
        .collect();
    let mut free_searches = 0;
    for k in 1..8 {
        let budget = STATE.total() + least + (store - least) * k / 8;
        let a = free.plan_step(&mbs, budget, 5e-3, &full(), None).unwrap();
        let b = dear.plan_step(&mbs, budget, 5e-3, &full(), None).unwrap();
        for d in &b {
            assert_eq!(d.search_checks, 0, "budget {k}/8");
            assert_eq!(measured_peak(&m, &d.plan), d.predicted_peak_bytes);
            assert!(d.predicted_total_bytes <= budget);
        }
        free_searches += a.iter().map(|d| d.search_checks).sum::<usize>();
    }
    assert!(free_searches > 0);
}
