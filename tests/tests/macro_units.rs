//! What `#[recovery_unit]` generates, observed at run time: the registered descriptors, the
//! semantics of nested units under every mix of fidelities, the memory ledger, the refusals
//! (Recompute of a non-deterministic unit, a codec the unit excludes), errors raised inside
//! a unit, and the recompute check that proves a replay bit-identical (or not).

use candle_core::{DType, Device, Tensor};
use hilore_runtime::memory::EventKind;
use hilore_runtime::{
    recovery_unit, registered_units, Cx, Error, Fidelity, Grads, MemClass, ParamKind, Plan, Result,
    UnitDescriptor, Var,
};
use std::cell::Cell;

// ----- units under test ---------------------------------------------------------------

const PROJECT_LINE: u32 = line!() + 2;
#[recovery_unit(cost = 2 * x.dim(0)? * w.dim(0)? * w.dim(1)?, deterministic, codecs = ["bf16"])]
fn project(cx: &mut Cx, x: &Var, w: &Var, gain: f64) -> Result<Var> {
    let h = cx.linear(x, w, None)?;
    cx.scale(&h, gain)
}

struct Mlp {
    up: Var,
    down: Var,
}

impl Mlp {
    #[recovery_unit(cost = 4 * x.elem_count() * self.up.dim(0)?, deterministic, name = "mlp")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.up, None)?;
        let h = cx.silu(&h)?;
        cx.linear(&h, &self.down, None)
    }
}

struct Block {
    norm: Var,
    mlp: Mlp,
}

const BLOCK_LINE: u32 = line!() + 3;
impl Block {
    #[recovery_unit(cost = 3 * x.elem_count(), deterministic, name = "block")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.rms_norm(x, &self.norm, 1e-6)?;
        let h = self.mlp.forward(cx, &h)?;
        cx.add(x, &h)
    }

    fn params(&self) -> [&Var; 3] {
        [&self.norm, &self.mlp.up, &self.mlp.down]
    }
}

/// Not `deterministic`: may be stored or compressed, never recomputed.
#[recovery_unit(cost = x.elem_count(), name = "opaque")]
fn opaque(cx: &mut Cx, x: &Var) -> Result<Var> {
    cx.mul(x, x)
}

/// Fails inside its body: `w` does not fit `x`.
#[recovery_unit(cost = x.elem_count(), deterministic, name = "broken")]
fn broken(cx: &mut Cx, x: &Var, w: &Var) -> Result<Var> {
    let h = cx.silu(x)?;
    cx.linear(&h, w, None)
}

/// Wrongly marked `deterministic`: reads and bumps a counter, so a recompute computes
/// something else than the forward did. The bump goes through a helper method, which the
/// compile-time check cannot see into (a direct `self.calls.set(..)` would not compile);
/// the run-time recompute check must catch it.
struct Drifting {
    calls: Cell<u32>,
}

impl Drifting {
    fn bump(&self) -> u32 {
        let n = self.calls.get();
        self.calls.set(n + 1);
        n
    }

    #[recovery_unit(cost = x.elem_count(), deterministic, name = "drifting")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let n = self.bump();
        let h = cx.mul(x, x)?;
        cx.scale(&h, 1.0 + n as f64)
    }
}

/// Makes a constant (a mask) inside its body, so it is a new `Var` every time the body
/// runs: it must replay under Recompute all the same.
#[recovery_unit(cost = x.elem_count(), deterministic, name = "masked")]
fn masked(cx: &mut Cx, x: &Var) -> Result<Var> {
    let t = x.tensor();
    let mask = Var::constant((Tensor::ones(t.shape(), t.dtype(), t.device())? * 0.5)?);
    let h = cx.mul(x, &mask)?;
    cx.mul(&h, &h)
}

/// LoRA: a frozen base weight plus a trained low-rank update `B A`.
struct Lora {
    w: Var,
    a: Var,
    b: Var,
}

impl Lora {
    #[recovery_unit(cost = 2 * x.elem_count() * self.w.dim(0)?, deterministic, name = "lora")]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let base = cx.linear(x, &self.w, None)?;
        let h = cx.linear(x, &self.a, None)?;
        let d = cx.linear(&h, &self.b, None)?;
        cx.add(&base, &d)
    }
}

/// Two unnamed units of one name, `forward`, in two types.
struct Up(Var);
struct Down(Var);

impl Up {
    #[recovery_unit(cost = x.elem_count(), deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.linear(x, &self.0, None)
    }
}

impl Down {
    #[recovery_unit(cost = x.elem_count(), deterministic)]
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.linear(x, &self.0, None)
    }
}

// ----- helpers -------------------------------------------------------------------------

const TOKENS: usize = 4;
const DIM: usize = 8;
const HIDDEN: usize = 16;

fn randn(shape: (usize, usize), std: f32) -> Result<Var> {
    Ok(Var::param(Tensor::randn(0f32, std, shape, &Device::Cpu)?))
}

fn stack(layers: usize) -> Result<Vec<Block>> {
    (0..layers)
        .map(|_| {
            Ok(Block {
                norm: Var::param(Tensor::randn(1f32, 0.1, DIM, &Device::Cpu)?),
                mlp: Mlp {
                    up: randn((HIDDEN, DIM), 0.3)?,
                    down: randn((DIM, HIDDEN), 0.3)?,
                },
            })
        })
        .collect()
}

fn input() -> Result<Var> {
    Ok(Var::constant(Tensor::randn(
        0f32,
        1.0,
        (TOKENS, DIM),
        &Device::Cpu,
    )?))
}

/// What one forward + backward left behind.
struct Run {
    grads: Vec<Vec<f32>>,
    live_after_forward: usize,
    inputs_after_forward: usize,
    peak: usize,
    peak_saved: usize,
    live_after_backward: usize,
    events: Vec<(EventKind, String)>,
    checks: Vec<(String, bool)>,
}

fn run(blocks: &[Block], x: &Var, seed: &Tensor, plan: Plan, verify: bool) -> Result<Run> {
    let mut cx = Cx::new(plan).verify_recompute(verify);
    let mut h = x.clone();
    for b in blocks {
        h = b.forward(&mut cx, &h)?;
    }
    let live_after_forward = cx.memory().live_bytes();
    let inputs_after_forward = cx.memory().live_bytes_of(MemClass::Inputs);
    let mut grads = Grads::new();
    let report = cx.backward(&h, seed, &mut grads)?;
    let mut g = Vec::new();
    for b in blocks {
        for p in b.params() {
            g.push(
                grads
                    .get(p.id())
                    .expect("every parameter has a gradient")
                    .flatten_all()?
                    .to_vec1()?,
            );
        }
    }
    Ok(Run {
        grads: g,
        live_after_forward,
        inputs_after_forward,
        peak: cx.memory().peak_bytes(),
        peak_saved: cx.memory().peak_saved_bytes(),
        live_after_backward: cx.memory().live_bytes(),
        events: cx
            .memory()
            .events()
            .iter()
            .map(|e| (e.kind, e.unit.clone()))
            .collect(),
        checks: report
            .checks
            .iter()
            .map(|c| (c.unit.clone(), c.bit_identical))
            .collect(),
    })
}

fn bits(g: &[Vec<f32>]) -> Vec<Vec<u32>> {
    g.iter()
        .map(|t| t.iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn unit(name: &str) -> &'static UnitDescriptor {
    registered_units()
        .into_iter()
        .find(|u| u.module == module_path!() && u.name == name)
        .unwrap_or_else(|| panic!("unit `{name}` is not registered"))
}

fn seed_like(x: &Var) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, x.dims(), &Device::Cpu)?)
}

// ----- descriptors -----------------------------------------------------------------------

#[test]
fn every_unit_of_this_file_is_registered() {
    let mut names: Vec<&str> = registered_units()
        .into_iter()
        .filter(|u| u.module == module_path!())
        .map(|u| u.name)
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "block", "broken", "drifting", "forward", "forward", "lora", "masked", "mlp", "opaque",
            "project"
        ]
    );
}

#[test]
fn free_fn_descriptor() {
    let d = unit("project");
    assert_eq!(d.function, "project");
    assert_eq!(d.module, module_path!());
    assert_eq!(d.file, file!());
    assert_eq!(
        d.line, PROJECT_LINE,
        "the line of the `fn`, not of the attribute"
    );
    assert!(d.deterministic);
    assert_eq!(d.cost, "2 * x.dim(0)? * w.dim(0)? * w.dim(1)?");
    assert_eq!(d.codecs, Some(&["bf16"][..]));
    let params: Vec<(&str, &str, ParamKind)> =
        d.params.iter().map(|p| (p.name, p.ty, p.kind)).collect();
    assert_eq!(
        params,
        [
            ("cx", "&mut Cx", ParamKind::Context),
            ("x", "&Var", ParamKind::Tape),
            ("w", "&Var", ParamKind::Tape),
            ("gain", "f64", ParamKind::Config),
        ]
    );
    let json = serde_json::to_value(d).expect("descriptors serialize");
    for key in [
        "name",
        "module",
        "file",
        "line",
        "deterministic",
        "params",
        "cost",
        "codecs",
    ] {
        assert!(json.get(key).is_some(), "`{key}` missing from {json}");
    }
    assert_eq!(json["params"][3]["kind"], "config");
}

#[test]
fn method_descriptors() {
    let b = unit("block");
    assert_eq!(b.function, "forward");
    assert_eq!(b.line, BLOCK_LINE);
    assert!(b.deterministic);
    assert_eq!(b.cost, "3 * x.elem_count()");
    assert_eq!(b.codecs, None);
    let params: Vec<(&str, &str, ParamKind)> =
        b.params.iter().map(|p| (p.name, p.ty, p.kind)).collect();
    assert_eq!(
        params,
        [
            ("self", "&Self", ParamKind::Module),
            ("cx", "&mut Cx", ParamKind::Context),
            ("x", "&Var", ParamKind::Tape),
        ]
    );
    assert_eq!(unit("mlp").cost, "4 * x.elem_count() * self.up.dim(0)?");
    assert!(!unit("opaque").deterministic);
    assert!(!unit("opaque").offers(Fidelity::Recompute));
    assert!(unit("block").offers(Fidelity::Recompute));
}

// ----- nested units ------------------------------------------------------------------------

/// Under every mix of Store and Recompute for the block (outer) and its MLP (inner), the
/// gradients are bit-identical to store-all: a recompute replays exactly the same ops on
/// exactly the same inputs. Inner Compress(bf16) under an outer Recompute is lossy: bf16
/// keeps 8 significant bits, so each saved activation is off by at most 2^-8 relatively;
/// the gradients, linear in those activations through two matmuls and a SiLU derivative,
/// stay within a few times that: relative L2 <= 4 * 2^-8 per tensor.
#[test]
fn nested_units_under_every_mix_of_fidelities() -> Result<()> {
    let blocks = stack(2)?;
    let x = input()?;
    let seed = seed_like(&x)?;
    let stored = run(&blocks, &x, &seed, Plan::store_all(), false)?;
    assert_eq!(stored.live_after_backward, 0);
    assert_eq!(
        stored.peak_saved, stored.live_after_forward,
        "store-all's saved state peaks at the end of the forward"
    );
    let exact = [
        (Fidelity::Recompute, Fidelity::Store),
        (Fidelity::Store, Fidelity::Recompute),
        (Fidelity::Recompute, Fidelity::Recompute),
    ];
    for (outer, inner) in exact {
        let plan = Plan::store_all()
            .with_unit("block", outer)
            .with_unit("mlp", inner);
        let r = run(&blocks, &x, &seed, plan, false)?;
        assert_eq!(
            bits(&r.grads),
            bits(&stored.grads),
            "block {outer}, mlp {inner}"
        );
        assert_eq!(
            r.live_after_backward, 0,
            "block {outer}, mlp {inner}: backward frees everything"
        );
        assert!(
            r.live_after_forward < stored.live_after_forward,
            "block {outer}, mlp {inner}"
        );
        let recomputed: Vec<&str> = r
            .events
            .iter()
            .filter(|(k, _)| *k == EventKind::Recomputed)
            .map(|(_, u)| u.as_str())
            .collect();
        // A recomputed block rebuilds its MLP with it, under the MLP's own plan: a
        // Recompute MLP is dropped again when the block's replay closes it, and re-run
        // when backward reaches its ops (nested checkpointing: least memory, most compute).
        let want: &[&str] = match (outer, inner) {
            (Fidelity::Recompute, Fidelity::Store) => &["block", "block"],
            (Fidelity::Store, Fidelity::Recompute) => &["mlp", "mlp"],
            _ => &["block", "mlp", "block", "mlp"],
        };
        assert_eq!(recomputed, want, "block {outer}, mlp {inner}");
    }
    let plan = Plan::store_all()
        .with_unit("block", Fidelity::Recompute)
        .with_unit("mlp", Fidelity::Compress("bf16"));
    let r = run(&blocks, &x, &seed, plan, false)?;
    let bound = 4.0 * 2f64.powi(-8);
    for (i, (a, b)) in stored.grads.iter().zip(&r.grads).enumerate() {
        let e = rel_l2(a, b);
        assert!(e <= bound, "tensor {i}: relative L2 error {e} > {bound}");
    }
    assert_eq!(r.live_after_backward, 0);
    assert!(r
        .events
        .iter()
        .any(|(k, u)| *k == EventKind::Decoded && u == "mlp"));
    Ok(())
}

/// With every block recomputed, the forward keeps only the blocks' inputs (counted
/// exactly: one `[tokens, dim]` f32 buffer per block), and the peak, one block rebuilt at a
/// time, stays below store-all's.
#[test]
fn recompute_keeps_only_unit_inputs() -> Result<()> {
    let layers = 3;
    let blocks = stack(layers)?;
    let x = input()?;
    let seed = seed_like(&x)?;
    let stored = run(&blocks, &x, &seed, Plan::store_all(), false)?;
    let r = run(
        &blocks,
        &x,
        &seed,
        Plan::store_all().with_unit("block", Fidelity::Recompute),
        false,
    )?;
    let input_bytes = layers * TOKENS * DIM * DType::F32.size_in_bytes();
    assert_eq!(r.live_after_forward, input_bytes);
    assert_eq!(r.inputs_after_forward, input_bytes);
    assert!(
        r.peak < stored.peak,
        "recompute peak {} >= store-all peak {}",
        r.peak,
        stored.peak
    );
    assert!(r.peak_saved < stored.peak_saved);
    assert_eq!(r.live_after_backward, 0);
    assert_eq!(bits(&r.grads), bits(&stored.grads));
    let recomputed = r
        .events
        .iter()
        .filter(|(k, u)| *k == EventKind::Recomputed && u == "block")
        .count();
    assert_eq!(recomputed, layers);
    Ok(())
}

// ----- refusals and errors ---------------------------------------------------------------

#[test]
fn recompute_is_refused_for_a_non_deterministic_unit() -> Result<()> {
    let x = Var::param(Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?);
    let mut cx = Cx::new(Plan::store_all().with_unit("opaque", Fidelity::Recompute));
    match opaque(&mut cx, &x) {
        Err(e @ Error::NotDeterministic { .. }) => {
            let Error::NotDeterministic { unit } = &e else {
                unreachable!()
            };
            assert_eq!(unit, "opaque");
            assert!(e.to_string().contains("`opaque`"), "{e}");
        }
        other => panic!("expected NotDeterministic, got {other:?}"),
    }
    // Store and Compress are fine.
    for f in [Fidelity::Store, Fidelity::Compress("bf16")] {
        let mut cx = Cx::new(Plan::store_all().with_unit("opaque", f));
        let y = opaque(&mut cx, &x)?;
        cx.backward(&y, &seed_like(&y)?, &mut Grads::new())?;
    }
    Ok(())
}

#[test]
fn a_codec_outside_the_units_list_is_refused() -> Result<()> {
    let x = input()?;
    let w = randn((3, DIM), 1.0)?;
    let mut cx = Cx::new(Plan::store_all().with_unit("project", Fidelity::Compress("int8-b32")));
    match project(&mut cx, &x, &w, 0.5) {
        Err(e) if matches!(e, Error::CodecNotAllowed { .. }) => {
            // The message names the unit, the codec, what it allows and the fix.
            let text = e.to_string();
            for part in [
                "`project`",
                "`int8-b32`",
                "it allows bf16",
                "add `int8-b32` to its list",
            ] {
                assert!(text.contains(part), "{text}");
            }
            let Error::CodecNotAllowed {
                unit,
                codec,
                allowed,
            } = e
            else {
                unreachable!()
            };
            assert_eq!(
                (unit.as_str(), codec.as_str(), allowed.as_str()),
                ("project", "int8-b32", "bf16")
            );
        }
        other => panic!("expected CodecNotAllowed, got {other:?}"),
    }
    let mut cx = Cx::new(Plan::store_all().with_unit("project", Fidelity::Compress("bf16")));
    let y = project(&mut cx, &x, &w, 0.5)?;
    cx.backward(&y, &seed_like(&y)?, &mut Grads::new())?;
    Ok(())
}

#[test]
fn an_error_inside_a_unit_is_returned_not_panicked() -> Result<()> {
    let x = Var::param(Tensor::randn(0f32, 1.0, (TOKENS, DIM), &Device::Cpu)?);
    let w = randn((3, DIM + 1), 1.0)?;
    let mut cx = Cx::new(Plan::store_all());
    let err = broken(&mut cx, &x, &w).expect_err("the shapes do not fit");
    assert!(!err.to_string().is_empty());
    // The tape refuses to go on with a half-recorded unit.
    let seed = Tensor::ones((TOKENS, DIM), DType::F32, &Device::Cpu)?;
    assert!(cx.backward(&x, &seed, &mut Grads::new()).is_err());
    Ok(())
}

// ----- the recompute check -----------------------------------------------------------------

#[test]
fn verify_recompute_confirms_a_deterministic_unit() -> Result<()> {
    let blocks = stack(2)?;
    let x = input()?;
    let seed = seed_like(&x)?;
    let r = run(
        &blocks,
        &x,
        &seed,
        Plan::store_all().with_unit("block", Fidelity::Recompute),
        true,
    )?;
    assert_eq!(
        r.checks,
        [("block".to_string(), true), ("block".to_string(), true)]
    );
    Ok(())
}

#[test]
fn verify_recompute_fails_the_backward_on_a_unit_that_is_not_deterministic() -> Result<()> {
    let m = Drifting {
        calls: Cell::new(0),
    };
    let x = Var::param(Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?);
    let plan = Plan::store_all().with_unit("drifting", Fidelity::Recompute);
    let mut cx = Cx::new(plan.clone()).verify_recompute(true);
    let y = m.forward(&mut cx, &x)?;
    let err = cx
        .backward(&y, &seed_like(&y)?, &mut Grads::new())
        .unwrap_err();
    assert_eq!(
        m.calls.get(),
        2,
        "run once in the forward, once more in backward"
    );
    // The error names the unit, its call and the op that made its output, and the fix.
    match &err {
        Error::NotBitIdentical { unit, call, op, .. } => {
            assert_eq!((unit.as_str(), *call, *op), ("drifting", 0, "scale"))
        }
        other => panic!("not NotBitIdentical: {other}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("drop `deterministic`"), "{msg}");
    // Report-only checks (what `hilore check` uses) let the backward finish and record it.
    let m = Drifting {
        calls: Cell::new(0),
    };
    let mut cx = Cx::new(plan).report_recompute_checks(true);
    let y = m.forward(&mut cx, &x)?;
    let report = cx.backward(&y, &seed_like(&y)?, &mut Grads::new())?;
    assert_eq!(report.checks.len(), 1);
    assert_eq!(report.checks[0].unit, "drifting");
    assert!(
        !report.checks[0].bit_identical,
        "the drifting recompute must be caught"
    );
    Ok(())
}

#[test]
fn a_plan_naming_a_unit_the_forward_never_ran_is_an_error_listing_those_it_ran() -> Result<()> {
    let blocks = stack(1)?;
    let x = input()?;
    let seed = seed_like(&x)?;
    for plan in [
        Plan::store_all().with_unit("blok", Fidelity::Recompute),
        Plan::store_all().with_instance("mpl", 0, Fidelity::Recompute),
    ] {
        let err = match run(&blocks, &x, &seed, plan, false) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a misspelt unit was ignored"),
        };
        assert!(err.contains("never ran"), "{err}");
        assert!(err.contains("`block`") && err.contains("`mlp`"), "{err}");
    }
    // Named units that did run are fine.
    run(
        &blocks,
        &x,
        &seed,
        Plan::store_all().with_instance("mlp", 0, Fidelity::Recompute),
        false,
    )?;
    Ok(())
}

#[test]
fn a_constant_made_inside_a_unit_replays_under_recompute() -> Result<()> {
    let x = Var::param(Tensor::randn(0f32, 1.0, (3, 4), &Device::Cpu)?);
    let seed = seed_like(&x)?;
    let mut out = Vec::new();
    for f in [Fidelity::Store, Fidelity::Recompute] {
        let mut cx = Cx::new(Plan::store_all().with_unit("masked", f)).verify_recompute(true);
        let y = masked(&mut cx, &x)?;
        let mut grads = Grads::new();
        let report = cx.backward(&y, &seed, &mut grads)?;
        assert_eq!(report.recomputed_units, (f == Fidelity::Recompute) as usize);
        let g: Vec<u32> = grads
            .get(x.id())
            .unwrap()
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        out.push(g);
    }
    assert_eq!(out[0], out[1], "recompute's gradient differs from store's");
    Ok(())
}

/// A frozen weight (`Var::frozen`) gets no gradient, is never activation memory and is
/// never compressed: under compress-all the input's gradient, which reads only weights
/// (`dx = g W + (g B) A`), equals store-all's bit for bit, while the same weight made a
/// `Var::constant` is saved as an activation, counted, and compressed.
#[test]
fn a_frozen_weight_gets_no_gradient_and_is_never_activation_memory() -> Result<()> {
    let dev = Device::Cpu;
    let (n, d, r) = (6, 32, 4);
    let w = Tensor::randn(0f32, 1.0, (d, d), &dev)?;
    let a = Var::param(Tensor::randn(0f32, 0.3, (r, d), &dev)?);
    let b = Var::param(Tensor::randn(0f32, 0.3, (d, r), &dev)?);
    let x = Var::param(Tensor::randn(0f32, 1.0, (n, d), &dev)?);
    let seed = Tensor::randn(0f32, 1.0, (n, d), &dev)?;
    let pass = |w: Var, plan: Plan| -> Result<(Vec<u32>, Grads, Var, usize)> {
        let m = Lora {
            w,
            a: a.clone(),
            b: b.clone(),
        };
        let mut cx = Cx::new(plan);
        let y = m.forward(&mut cx, &x)?;
        let saved = cx.memory().live_bytes_of(MemClass::Stored);
        let mut grads = Grads::new();
        cx.backward(&y, &seed, &mut grads)?;
        let dx: Vec<u32> = grads
            .get(x.id())
            .unwrap()
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        drop(cx);
        Ok((dx, grads, m.w, saved))
    };
    let compress = Plan::compress_all("int8-b32")?;
    let (dx_store, grads, frozen, saved_frozen) = pass(Var::frozen(w.clone()), Plan::store_all())?;
    assert!(
        grads.get(frozen.id()).is_none(),
        "a frozen weight got a gradient"
    );
    assert!(grads.get(a.id()).is_some() && grads.get(b.id()).is_some());
    let (dx_compressed, _, _, _) = pass(Var::frozen(w.clone()), compress.clone())?;
    assert_eq!(dx_store, dx_compressed, "the frozen weight was compressed");
    // The same weight as a constant: saved as an activation (d x d floats more) and
    // compressed, so the input's gradient moves.
    let (_, grads, constant, saved_constant) = pass(Var::constant(w.clone()), Plan::store_all())?;
    assert!(grads.get(constant.id()).is_none());
    assert_eq!(saved_constant - saved_frozen, d * d * 4);
    let (dx_constant_compressed, _, _, _) = pass(Var::constant(w), compress)?;
    assert_ne!(dx_store, dx_constant_compressed);
    Ok(())
}

#[test]
fn a_plan_naming_a_name_two_units_share_is_refused_naming_both() -> Result<()> {
    let dev = Device::Cpu;
    let up = Up(Var::param(Tensor::randn(0f32, 1.0, (8, 4), &dev)?));
    let down = Down(Var::param(Tensor::randn(0f32, 1.0, (4, 8), &dev)?));
    let x = Var::param(Tensor::randn(0f32, 1.0, (3, 4), &dev)?);
    let run = |plan: Plan| -> Result<()> {
        let mut cx = Cx::new(plan);
        let h = up.forward(&mut cx, &x)?;
        let y = down.forward(&mut cx, &h)?;
        cx.backward(&y, &seed_like(&y)?, &mut Grads::new())?;
        Ok(())
    };
    let err = run(Plan::store_all().with_instance("forward", 0, Fidelity::Recompute))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 different units ran under that name"),
        "{err}"
    );
    assert!(err.contains(file!()) && err.contains("name = "), "{err}");
    // A plan that does not name them is fine.
    run(Plan::store_all())
}

/// The library's recovery check on a model of this file: every exact plan bit-identical,
/// every codec's error bounded and nonzero; a unit that drifts fails it.
#[test]
fn check_recovery_passes_a_deterministic_model_and_fails_a_drifting_one() -> Result<()> {
    use hilore_runtime::check::check_recovery;
    let blocks = stack(2)?;
    let x = input()?;
    let seed = seed_like(&x)?;
    let params: Vec<Var> = blocks
        .iter()
        .flat_map(|b| b.params().map(|p| p.clone()))
        .collect();
    let report = check_recovery(
        |cx| {
            let mut h = x.clone();
            for b in &blocks {
                h = b.forward(cx, &h)?;
            }
            Ok(h)
        },
        &params,
        &seed,
    )?;
    assert!(report.exact_plans_bit_identical(), "{report:?}");
    let plans: Vec<&str> = report.rows.iter().map(|r| r.plan.as_str()).collect();
    for want in [
        "store-all",
        "recompute block",
        "recompute mlp",
        "recompute-all",
    ] {
        assert!(plans.contains(&want), "{plans:?}");
    }
    for r in report.rows.iter().filter(|r| !r.exact) {
        // Lossy codecs move the gradient, by about their error on the saved
        // activations: the coarsest, int4 (absolute error uniform in +-absmax / 14 per
        // group), has RMS error absmax / (14 sqrt 3) ~ 0.087 sigma on Gaussian groups of
        // 32 (absmax ~ 2.1 sigma); each gradient is linear in the saved values, so its
        // relative error is of that order, and 0.2 leaves a 2x margin. 0 would mean the
        // codec was not applied.
        assert!(r.rel_l2 > 0.0 && r.rel_l2 < 0.2, "{}: {}", r.plan, r.rel_l2);
    }
    let m = Drifting {
        calls: Cell::new(0),
    };
    let xv = Var::param(Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?);
    let s = Tensor::randn(0f32, 1.0, (2, 3), &Device::Cpu)?;
    let report = check_recovery(|cx| m.forward(cx, &xv), std::slice::from_ref(&xv), &s)?;
    assert!(!report.exact_plans_bit_identical(), "{report:?}");
    Ok(())
}

#[test]
fn units_run_unrecorded_under_inference() -> Result<()> {
    let blocks = stack(1)?;
    let x = input()?;
    let mut cx = Cx::inference();
    let y = blocks[0].forward(&mut cx, &x)?;
    assert_eq!(y.dims(), [TOKENS, DIM]);
    assert_eq!(cx.num_ops(), 0);
    assert!(cx.unit_instances().is_empty());
    Ok(())
}
