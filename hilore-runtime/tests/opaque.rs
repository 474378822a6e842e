//! Opaque units: a candle closure managed as a recovery unit. Store and Recompute give
//! bit-identical gradients equal to candle's own autograd on the closure; the ledger
//! counts candle's graph under Store and only the input under Recompute; Compress, and
//! Recompute of a unit not declared deterministic, are refused; inference records nothing.

use candle_core::{DType, Device, Module, Tensor};
use hilore_runtime::{
    opaque_unit, registered_units, Cx, Fidelity, Grads, MemClass, OpaqueUnit, Plan, Var,
};

opaque_unit!(static SILU_PROJ = "test_silu_proj", deterministic);
opaque_unit!(
    /// Not deterministic: offered Store only.
    static STORE_ONLY = "test_store_only"
);

const N: usize = 6;
const IN: usize = 5;
const OUT: usize = 7;

fn randn(shape: &[usize], seed: u64) -> Tensor {
    // Deterministic values without candle's RNG (whose seeding is global).
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `silu(x W^T) * s` with candle Vars `w: [OUT, IN]`, `s: [OUT]`.
fn unit(desc: &'static hilore_runtime::UnitDescriptor) -> OpaqueUnit<impl Module> {
    let w = candle_core::Var::from_tensor(&randn(&[OUT, IN], 1)).unwrap();
    let s = candle_core::Var::from_tensor(&randn(&[OUT], 2)).unwrap();
    let (wt, st) = (w.as_tensor().clone(), s.as_tensor().clone());
    let f = move |x: &Tensor| -> candle_core::Result<Tensor> {
        x.matmul(&wt.t()?)?.silu()?.broadcast_mul(&st)
    };
    OpaqueUnit::new(desc, f, vec![w, s]).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn store_and_recompute_match_candle_bit_for_bit() {
    let u = unit(&SILU_PROJ);
    let x = Var::param(randn(&[N, IN], 3));
    let g = randn(&[N, OUT], 4);
    let mut results = Vec::new();
    for f in [Fidelity::Store, Fidelity::Recompute] {
        let mut cx =
            Cx::new(Plan::store_all().with_unit("test_silu_proj", f)).verify_recompute(true);
        let y = u.forward(&mut cx, &x).unwrap();
        let mut grads = Grads::new();
        let report = cx.backward(&y, &g, &mut grads).unwrap();
        if f == Fidelity::Recompute {
            assert_eq!(report.recomputed_units, 1);
            assert!(report.checks.iter().all(|c| c.bit_identical));
        }
        let mut gs = vec![grads.get(x.id()).unwrap().clone()];
        gs.extend(u.params().map(|p| grads.get(p.id()).unwrap().clone()));
        results.push((y.tensor().clone(), gs));
    }
    // candle's own autograd on the same closure: d sum(y * g).
    let xv = candle_core::Var::from_tensor(&randn(&[N, IN], 3)).unwrap();
    let y = u.module().forward(xv.as_tensor()).unwrap();
    let cg = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let mut want = vec![cg.get(xv.as_tensor()).unwrap().clone()];
    want.extend(
        u.candle_params()
            .map(|p| cg.get(p.as_tensor()).unwrap().clone()),
    );
    for (y_tape, gs) in &results {
        assert_eq!(bits(y_tape), bits(&y));
        for (a, b) in gs.iter().zip(&want) {
            assert_eq!(bits(a), bits(b));
        }
    }
}

#[test]
fn ledger_counts_candles_graph_under_store_and_the_input_under_recompute() {
    let u = unit(&SILU_PROJ);
    // An input that wants a gradient: candle gets a copy of it as a Var.
    let x = Var::param(randn(&[N, IN], 5));
    let mut cx = Cx::new(Plan::store_all());
    let _y = u.forward(&mut cx, &x).unwrap();
    // Kept: the input copy [N, IN], the product [N, OUT] (silu's input), silu's output
    // [N, OUT] (the product's input), and the output [N, OUT]; W^T is a view of the
    // parameter and not counted.
    let expected = 4 * (N * IN + 3 * N * OUT);
    assert_eq!(cx.memory().live_bytes_of(MemClass::Stored), expected);

    // Recompute keeps the unit's input only; a parameter input costs nothing, a constant
    // one its bytes.
    let mut cx = Cx::new(Plan::store_all().with_unit("test_silu_proj", Fidelity::Recompute));
    let _y = u.forward(&mut cx, &x).unwrap();
    assert_eq!(cx.memory().live_bytes(), 0);
    let xc = Var::constant(randn(&[N, IN], 5));
    let mut cx = Cx::new(Plan::store_all().with_unit("test_silu_proj", Fidelity::Recompute));
    let _y = u.forward(&mut cx, &xc).unwrap();
    assert_eq!(cx.memory().live_bytes(), 4 * N * IN);
    assert_eq!(cx.memory().live_bytes_of(MemClass::Inputs), 4 * N * IN);
}

#[test]
fn refusals_and_inference() {
    let u = unit(&SILU_PROJ);
    let x = Var::param(randn(&[N, IN], 6));
    let mut cx = Cx::new(Plan::store_all().with_unit("test_silu_proj", Fidelity::Compress("bf16")));
    let e = u.forward(&mut cx, &x).unwrap_err().to_string();
    assert!(e.contains("test_silu_proj") && e.contains("bf16"), "{e}");

    let s = unit(&STORE_ONLY);
    let mut cx = Cx::new(Plan::store_all().with_unit("test_store_only", Fidelity::Recompute));
    let e = s.forward(&mut cx, &x).unwrap_err().to_string();
    assert!(e.contains("deterministic"), "{e}");

    let mut cx = Cx::inference();
    let y = u.forward(&mut cx, &x).unwrap();
    assert_eq!(
        bits(y.tensor()),
        bits(&u.module().forward(x.tensor()).unwrap())
    );
    assert_eq!(cx.num_ops(), 0);
    assert_eq!(cx.memory().live_bytes(), 0);

    // Both descriptors are registered, with no codec offered.
    for name in ["test_silu_proj", "test_store_only"] {
        let d = registered_units()
            .into_iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("{name} is not registered"));
        assert_eq!(d.codecs, Some(&[][..]));
        assert!(!d.offers(Fidelity::Compress("bf16")));
        assert_eq!(d.deterministic, name == "test_silu_proj");
    }
}

#[test]
fn a_module_without_backward_is_an_error_not_a_zero_gradient() {
    // candle-nn's fused RmsNorm records no backward: the gradient would silently vanish.
    let w = candle_core::Var::from_tensor(&randn(&[IN], 7)).unwrap();
    let norm = candle_nn::RmsNorm::new(w.as_tensor().clone(), 1e-6);
    let u = OpaqueUnit::new(&SILU_PROJ, norm, vec![w]).unwrap();
    let x = Var::param(randn(&[N, IN], 8));
    let mut cx = Cx::new(Plan::store_all());
    let y = u.forward(&mut cx, &x).unwrap();
    let e = cx
        .backward(
            &y,
            &Tensor::ones((N, IN), DType::F32, &Device::Cpu).unwrap(),
            &mut Grads::new(),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("forward_diff"), "{e}");
}
