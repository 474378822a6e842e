//! Every op's backward against central finite differences in f64, plus forward references
//! for the ops that compute in pieces (attention, chunked token log-probs).
//!
//! Method: inputs are `Var::param` tensors of random F64 values; `y = op(inputs)`, a random
//! seed `r` of `y`'s shape, `loss = sum(r * y)`. The analytic gradients come from
//! `cx.backward(&y, &r, ..)`; the numeric ones from `(loss(x + h e_j) - loss(x - h e_j)) / 2h`
//! for every element `j` of every input, each loss evaluated on a fresh tape.
//!
//! Error bound (one derivation for all smooth ops). With `h = 1e-5` in f64:
//! - truncation of the central difference: `h^2 / 6 * |f'''|`; our inputs and seeds are
//!   O(1) normals and the ops' third derivatives are O(1)-O(10), so ~1e-10 * 10 = 1e-9;
//! - rounding: each loss carries an absolute error ~ `eps * sum_i |r_i y_i|` with
//!   `eps = 2.2e-16` and `sum |r y| <= ~1e3` for these sizes, divided by `2h`:
//!   2.2e-13 / 2e-5 ~ 1e-8 per component at worst.
//!
//! Gradient components are O(0.1)-O(10), so the relative L2 error is expected around
//! 1e-9 and certainly below 1e-7. We assert `<= 1e-6`: at least 100x above both error
//! sources, and still 10 orders of magnitude below what any real backward bug (a missing
//! term, a wrong sign or index, an unreduced broadcast) produces, which is O(1e-2..1).
//! Ops that are linear in the checked input (embedding, reshape/transpose/narrow/cat,
//! dropout, rope, scale, add) have `f''' = 0`: their error is rounding alone, and they are
//! held to the same bound.

use candle_core::{DType, Device, Tensor};
use hilore_runtime::{Cx, Grads, Packing, Plan, Result, RopeTables, Var};

const H: f64 = 1e-5;
/// Relative L2 bound on `||g_fd - g|| / ||g||` for every op (see the module docs).
const BOUND: f64 = 1e-6;

// ----- deterministic random numbers ---------------------------------------------------

mod support;
use support::Rng;

impl Rng {
    fn tensor(&mut self, dims: &[usize]) -> Tensor {
        let n: usize = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.normal()).collect();
        Tensor::from_vec(v, dims, &Device::Cpu).unwrap()
    }

    fn ids(&mut self, n: usize, below: usize) -> Tensor {
        let v: Vec<u32> = (0..n)
            .map(|_| (self.next_u64() % below as u64) as u32)
            .collect();
        Tensor::from_vec(v, n, &Device::Cpu).unwrap()
    }
}

// ----- the finite-difference harness --------------------------------------------------

fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// `sum(r * y)` with `y = f(inputs)` on a fresh tape; `grad[i]` says which inputs are
/// parameters (the others are constants).
fn loss<F>(f: &F, inputs: &[Tensor], grad: &[bool], r: &Tensor) -> f64
where
    F: Fn(&mut Cx<'static>, &[Var]) -> Result<Var>,
{
    let vars = make_vars(inputs, grad);
    let mut cx = Cx::new(Plan::store_all());
    let y = f(&mut cx, &vars).unwrap();
    (y.tensor() * r)
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn make_vars(inputs: &[Tensor], grad: &[bool]) -> Vec<Var> {
    inputs
        .iter()
        .zip(grad)
        .map(|(t, &g)| {
            if g {
                Var::param(t.clone())
            } else {
                Var::constant(t.clone())
            }
        })
        .collect()
}

/// Checks the analytic gradient of every input marked in `grad` against central finite
/// differences; returns the worst relative error (also printed, for the record).
fn fd_check_mask<F>(name: &str, inputs: &[Tensor], grad: &[bool], f: F) -> f64
where
    F: Fn(&mut Cx<'static>, &[Var]) -> Result<Var>,
{
    let mut rng = Rng(0xC0FF_EE00 ^ name.len() as u64);
    let vars = make_vars(inputs, grad);
    let mut cx = Cx::new(Plan::store_all());
    let y = f(&mut cx, &vars).unwrap();
    let r = rng.tensor(y.dims());
    let mut grads = Grads::new();
    cx.backward(&y, &r, &mut grads).unwrap();
    drop(cx);

    let mut worst = 0.0f64;
    for (i, t) in inputs.iter().enumerate() {
        if !grad[i] {
            assert!(
                grads.get(vars[i].id()).is_none(),
                "{name}: constant input {i} got a gradient"
            );
            continue;
        }
        let g = flat(
            grads
                .get(vars[i].id())
                .unwrap_or_else(|| panic!("{name}: no gradient for input {i}")),
        );
        let base = flat(t);
        assert_eq!(
            g.len(),
            base.len(),
            "{name}: gradient {i} has the wrong size"
        );
        let mut fd = Vec::with_capacity(base.len());
        for j in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[j] += delta;
                let mut xs = inputs.to_vec();
                xs[i] = Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap();
                loss(&f, &xs, grad, &r)
            };
            fd.push((at(H) - at(-H)) / (2.0 * H));
        }
        let diff: Vec<f64> = fd.iter().zip(&g).map(|(a, b)| a - b).collect();
        let gn = norm(&g);
        assert!(
            gn > 1e-3,
            "{name}: gradient {i} is (almost) zero, the check would be vacuous"
        );
        let rel = norm(&diff) / gn;
        println!("fd {name} input {i}: relative error {rel:.3e} (bound {BOUND:.0e})");
        // Bound derived in the module docs: truncation ~1e-9 + rounding ~1e-8, x100 margin.
        assert!(
            rel <= BOUND,
            "{name}: input {i}: relative error {rel:.3e} > {BOUND:.0e}\nanalytic {g:?}\nnumeric {fd:?}"
        );
        worst = worst.max(rel);
    }
    worst
}

fn fd_check<F>(name: &str, inputs: &[Tensor], f: F) -> f64
where
    F: Fn(&mut Cx<'static>, &[Var]) -> Result<Var>,
{
    let grad = vec![true; inputs.len()];
    fd_check_mask(name, inputs, &grad, f)
}

fn cpu() -> Device {
    Device::Cpu
}

// ----- elementwise ----------------------------------------------------------------------

#[test]
fn fd_add_broadcast() {
    let mut rng = Rng(1);
    let (a, b) = (rng.tensor(&[3, 1, 4]), rng.tensor(&[4]));
    fd_check("add [3,1,4]+[4]", &[a, b], |cx, v| cx.add(&v[0], &v[1]));
    let (a, b) = (rng.tensor(&[3, 1, 4]), rng.tensor(&[2, 4]));
    fd_check("add [3,1,4]+[2,4]", &[a, b], |cx, v| cx.add(&v[0], &v[1]));
}

#[test]
fn fd_mul_broadcast() {
    let mut rng = Rng(2);
    let (a, b) = (rng.tensor(&[3, 1, 4]), rng.tensor(&[4]));
    fd_check("mul [3,1,4]*[4]", &[a, b], |cx, v| cx.mul(&v[0], &v[1]));
    let (a, b) = (rng.tensor(&[3, 1, 4]), rng.tensor(&[2, 4]));
    fd_check("mul [3,1,4]*[2,4]", &[a, b], |cx, v| cx.mul(&v[0], &v[1]));
}

#[test]
fn fd_scale() {
    let mut rng = Rng(3);
    fd_check("scale", &[rng.tensor(&[2, 5])], |cx, v| {
        cx.scale(&v[0], -0.7)
    });
}

// ----- linear algebra ------------------------------------------------------------------

#[test]
fn fd_linear() {
    let mut rng = Rng(4);
    let (x, w, b) = (
        rng.tensor(&[2, 3, 5]),
        rng.tensor(&[4, 5]),
        rng.tensor(&[4]),
    );
    fd_check("linear no bias", &[x.clone(), w.clone()], |cx, v| {
        cx.linear(&v[0], &v[1], None)
    });
    fd_check("linear bias", &[x.clone(), w.clone(), b], |cx, v| {
        cx.linear(&v[0], &v[1], Some(&v[2]))
    });
    // Only one side wants a gradient: the op saves only what that gradient reads.
    fd_check_mask(
        "linear x const",
        &[x.clone(), w.clone()],
        &[false, true],
        |cx, v| cx.linear(&v[0], &v[1], None),
    );
    fd_check_mask("linear w const", &[x, w], &[true, false], |cx, v| {
        cx.linear(&v[0], &v[1], None)
    });
}

#[test]
fn fd_matmul() {
    let mut rng = Rng(5);
    let (a, b) = (rng.tensor(&[3, 4]), rng.tensor(&[4, 2]));
    fd_check("matmul 2d", &[a, b], |cx, v| cx.matmul(&v[0], &v[1]));
    let (a, b) = (rng.tensor(&[2, 3, 4]), rng.tensor(&[2, 4, 5]));
    fd_check("matmul batched", &[a, b], |cx, v| cx.matmul(&v[0], &v[1]));
    let (a, b) = (rng.tensor(&[2, 2, 3, 4]), rng.tensor(&[2, 2, 4, 2]));
    fd_check("matmul 2 batch dims", &[a.clone(), b.clone()], |cx, v| {
        cx.matmul(&v[0], &v[1])
    });
    fd_check_mask(
        "matmul a const",
        &[a.clone(), b.clone()],
        &[false, true],
        |cx, v| cx.matmul(&v[0], &v[1]),
    );
    fd_check_mask("matmul b const", &[a, b], &[true, false], |cx, v| {
        cx.matmul(&v[0], &v[1])
    });
    // A transposed (strided) operand.
    let (a, b) = (rng.tensor(&[2, 4, 3]), rng.tensor(&[2, 4, 5]));
    fd_check("matmul of a transpose", &[a, b], |cx, v| {
        let at = cx.transpose(&v[0], 1, 2)?;
        cx.matmul(&at, &v[1])
    });
}

// ----- normalisation, activations, rope -----------------------------------------------

#[test]
fn fd_rms_norm() {
    let mut rng = Rng(6);
    let (x, w) = (rng.tensor(&[2, 3, 6]), rng.tensor(&[6]));
    fd_check("rms_norm", &[x.clone(), w.clone()], |cx, v| {
        cx.rms_norm(&v[0], &v[1], 1e-6)
    });
    fd_check_mask("rms_norm w only", &[x, w], &[false, true], |cx, v| {
        cx.rms_norm(&v[0], &v[1], 1e-6)
    });
}

#[test]
fn fd_silu_swiglu() {
    let mut rng = Rng(7);
    fd_check("silu", &[rng.tensor(&[3, 7])], |cx, v| cx.silu(&v[0]));
    let (g, u) = (rng.tensor(&[3, 7]), rng.tensor(&[3, 7]));
    fd_check("swiglu", &[g.clone(), u.clone()], |cx, v| {
        cx.swiglu(&v[0], &v[1])
    });
    fd_check_mask("swiglu up only", &[g, u], &[false, true], |cx, v| {
        cx.swiglu(&v[0], &v[1])
    });
}

#[test]
fn fd_rope() {
    let mut rng = Rng(8);
    let packing = Packing::new(&[3, 5], &cpu()).unwrap();
    let tables = RopeTables::new(&packing, 8, 100.0, DType::F64, &cpu()).unwrap();
    let x = rng.tensor(&[8, 2, 8]);
    fd_check("rope", &[x], move |cx, v| cx.rope(&v[0], &tables));
}

#[test]
fn rope_matches_hf_formula() {
    // x * cos_full + rotate_half(x) * sin_full, written out per element.
    let mut rng = Rng(9);
    let packing = Packing::new(&[3, 5], &cpu()).unwrap();
    let (n, h, d, theta) = (8usize, 2usize, 8usize, 100.0f64);
    let tables = RopeTables::new(&packing, d, theta, DType::F64, &cpu()).unwrap();
    let x = rng.tensor(&[n, h, d]);
    let mut cx = Cx::new(Plan::store_all());
    let y = cx.rope(&Var::constant(x.clone()), &tables).unwrap();
    let y = y.tensor().to_vec3::<f64>().unwrap();
    let x = x.to_vec3::<f64>().unwrap();
    let pos: Vec<usize> = vec![0, 1, 2, 0, 1, 2, 3, 4];
    for t in 0..n {
        for hh in 0..h {
            for j in 0..d {
                let i = j % (d / 2);
                let a = pos[t] as f64 * theta.powf(-(2.0 * i as f64) / d as f64);
                let rot = if j < d / 2 {
                    -x[t][hh][j + d / 2]
                } else {
                    x[t][hh][j - d / 2]
                };
                let want = x[t][hh][j] * a.cos() + rot * a.sin();
                assert!((y[t][hh][j] - want).abs() < 1e-12, "rope at {t},{hh},{j}");
            }
        }
    }
}

// ----- shape ops ----------------------------------------------------------------------

#[test]
fn fd_shape_ops() {
    let mut rng = Rng(10);
    let x = rng.tensor(&[2, 3, 4]);
    fd_check("reshape", std::slice::from_ref(&x), |cx, v| {
        cx.reshape(&v[0], (4, 6))
    });
    fd_check("reshape hole", std::slice::from_ref(&x), |cx, v| {
        cx.reshape(&v[0], (6, ()))
    });
    fd_check("transpose", std::slice::from_ref(&x), |cx, v| {
        cx.transpose(&v[0], 0, 2)
    });
    fd_check("narrow", std::slice::from_ref(&x), |cx, v| {
        cx.narrow(&v[0], 1, 1, 2)
    });
    let (a, b) = (rng.tensor(&[2, 1, 4]), rng.tensor(&[2, 2, 4]));
    fd_check("cat", &[a, b, x], |cx, v| cx.cat(&[&v[0], &v[1], &v[2]], 1));
    // A chain through views: the gradients of views must compose.
    let x = rng.tensor(&[3, 4]);
    fd_check("transpose-reshape-narrow", &[x], |cx, v| {
        let t = cx.transpose(&v[0], 0, 1)?;
        let r = cx.reshape(&t, (2, 6))?;
        let n = cx.narrow(&r, 1, 2, 3)?;
        cx.mul(&n, &n)
    });
}

// ----- embedding ----------------------------------------------------------------------

#[test]
fn fd_embedding() {
    let mut rng = Rng(11);
    let table = rng.tensor(&[7, 4]);
    // Repeated ids: their gradients must add up.
    let ids = Tensor::new(&[3u32, 0, 3, 6, 1, 3], &cpu()).unwrap();
    fd_check("embedding", &[table], move |cx, v| {
        cx.embedding(&v[0], &ids)
    });
}

// ----- dropout ------------------------------------------------------------------------

#[test]
fn fd_dropout() {
    let mut rng = Rng(12);
    let x = rng.tensor(&[4, 8]);
    fd_check("dropout", std::slice::from_ref(&x), |cx, v| {
        cx.dropout(&v[0], 0.3)
    });
    // The mask is a pure function of the tape's seed and the op's index.
    let run = || {
        let mut cx = Cx::new(Plan::store_all()).with_seed(7);
        let y = cx.dropout(&Var::constant(x.clone()), 0.3).unwrap();
        flat(y.tensor())
    };
    let (y1, y2) = (run(), run());
    assert_eq!(y1, y2);
    let zeros = y1.iter().filter(|v| **v == 0.0).count();
    assert!(
        zeros > 0 && zeros < y1.len(),
        "dropout(0.3) dropped {zeros} of {}",
        y1.len()
    );
    for (y, x) in y1.iter().zip(flat(&x)) {
        assert!(*y == 0.0 || (y - x / 0.7).abs() < 1e-12);
    }
    // In f32: the gradient is the mask times 1 / (1 - p), zero exactly where y is.
    let xv = Var::param(x.to_dtype(DType::F32).unwrap());
    let mut cx = Cx::new(Plan::store_all());
    let y = cx.dropout(&xv, 0.3).unwrap();
    let mut grads = Grads::new();
    let ones = Tensor::ones(y.dims(), DType::F32, &cpu()).unwrap();
    cx.backward(&y, &ones, &mut grads).unwrap();
    let g = grads.get(xv.id()).unwrap().to_vec2::<f32>().unwrap();
    let y = y.tensor().to_vec2::<f32>().unwrap();
    for (gr, yr) in g.iter().zip(&y) {
        for (g, y) in gr.iter().zip(yr) {
            assert!((*g == 0.0) == (*y == 0.0) && (*g == 0.0 || (g - 1.0 / 0.7).abs() < 1e-6));
        }
    }
}

// ----- attention ----------------------------------------------------------------------

const LENS: [usize; 3] = [1, 4, 6];
const HQ: usize = 4;
const HKV: usize = 2;
const HD: usize = 8;

fn attention_inputs(seed: u64) -> (Packing, Tensor, Tensor, Tensor) {
    let mut rng = Rng(seed);
    let n: usize = LENS.iter().sum();
    let packing = Packing::new(&LENS, &cpu()).unwrap();
    (
        packing,
        rng.tensor(&[n, HQ, HD]),
        rng.tensor(&[n, HKV, HD]),
        rng.tensor(&[n, HKV, HD]),
    )
}

/// The largest absolute difference between `o`, the attention output for `q`, `k`, `v`
/// over `packing`, and a naive f64 reference: per sequence, head and query `i`, a full
/// softmax over every key of the sequence with the masked keys at -inf. Keys `j > i` are
/// masked, and with a `window` of `W` also those with `i - j >= W` (Hugging Face's sliding
/// window: the keys `i - W < j <= i` stay).
fn naive_attention_max_diff(
    packing: &Packing,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    o: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> f64 {
    let o = o.to_vec3::<f64>().unwrap();
    let (q, k, v) = (
        q.to_vec3::<f64>().unwrap(),
        k.to_vec3::<f64>().unwrap(),
        v.to_vec3::<f64>().unwrap(),
    );
    let group = HQ / HKV;
    let mut worst = 0.0f64;
    for w in packing.offsets().windows(2) {
        let (s0, s1) = (w[0], w[1]);
        for h in 0..HQ {
            let kv = h / group;
            for i in s0..s1 {
                let scores: Vec<f64> = (s0..s1)
                    .map(|j| {
                        if j > i || window.is_some_and(|w| i - j >= w) {
                            f64::NEG_INFINITY
                        } else {
                            (0..HD).map(|e| q[i][h][e] * k[j][kv][e]).sum::<f64>() * scale
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..HD {
                    let want: f64 = (s0..s1).map(|j| e[j - s0] / z * v[j][kv][d]).sum();
                    worst = worst.max((o[i][h][d] - want).abs());
                }
            }
        }
    }
    worst
}

#[test]
fn fd_attention() {
    let (packing, q, k, v) = attention_inputs(13);
    let scale = 1.0 / (HD as f64).sqrt();
    fd_check("attention", &[q.clone(), k.clone(), v.clone()], |cx, x| {
        cx.attention(&x[0], &x[1], &x[2], &packing, scale)
    });
    // Only some inputs want gradients.
    fd_check_mask(
        "attention q only",
        &[q.clone(), k.clone(), v.clone()],
        &[true, false, false],
        |cx, x| cx.attention(&x[0], &x[1], &x[2], &packing, scale),
    );
    fd_check_mask(
        "attention v only",
        &[q.clone(), k.clone(), v.clone()],
        &[false, false, true],
        |cx, x| cx.attention(&x[0], &x[1], &x[2], &packing, scale),
    );
    fd_check_mask(
        "attention kv only",
        &[q, k, v],
        &[false, true, true],
        |cx, x| cx.attention(&x[0], &x[1], &x[2], &packing, scale),
    );
}

#[test]
fn attention_matches_naive_reference() {
    let (packing, q, k, v) = attention_inputs(14);
    let scale = 0.3;
    let mut cx = Cx::new(Plan::store_all());
    let o = cx
        .attention(
            &Var::param(q.clone()),
            &Var::param(k.clone()),
            &Var::param(v.clone()),
            &packing,
            scale,
        )
        .unwrap();
    let worst = naive_attention_max_diff(&packing, (&q, &k, &v), o.tensor(), scale, None);
    // Same math in f64, different summation order: agreement to ~1e-15; 1e-12 allows for
    // O(T * D) accumulated roundings.
    assert!(worst < 1e-12, "attention vs naive: max abs diff {worst:e}");
}

#[test]
fn attention_saves_no_probabilities() {
    let (packing, q, k, v) = attention_inputs(15);
    let n = packing.total_tokens();
    let mut cx = Cx::new(Plan::store_all());
    // q, k, v are parameters (referenced, not counted); what is counted is O and the lse.
    let _o = cx
        .attention(
            &Var::param(q),
            &Var::param(k),
            &Var::param(v),
            &packing,
            0.5,
        )
        .unwrap();
    let expected = n * HQ * HD * 8 + HQ * n * 8;
    assert_eq!(cx.memory().live_bytes(), expected);

    // Only v wants a gradient: dV = P^T dO reads q, k (activations here: constants are
    // saved as activations) and the lse, not v nor o.
    let (packing, q, k, v) = attention_inputs(15);
    let mut cx = Cx::new(Plan::store_all());
    let _o = cx
        .attention(
            &Var::constant(q),
            &Var::constant(k),
            &Var::param(v),
            &packing,
            0.5,
        )
        .unwrap();
    let expected = n * HQ * HD * 8 + n * HKV * HD * 8 + HQ * n * 8;
    assert_eq!(cx.memory().live_bytes(), expected);
}

#[test]
fn fd_attention_window() {
    // Sequences of 1, 4 and 6 tokens with a window of 2 and of 4: the window cuts into
    // the longer sequences (and is wider than the shortest), so masked, partly masked and
    // unmasked rows all get checked.
    let (packing, q, k, v) = attention_inputs(16);
    let scale = 1.0 / (HD as f64).sqrt();
    for w in [2, 4] {
        fd_check(
            &format!("attention window {w}"),
            &[q.clone(), k.clone(), v.clone()],
            |cx, x| cx.attention_windowed(&x[0], &x[1], &x[2], &packing, scale, Some(w)),
        );
    }
    fd_check_mask(
        "attention window 3, q only",
        &[q.clone(), k.clone(), v.clone()],
        &[true, false, false],
        |cx, x| cx.attention_windowed(&x[0], &x[1], &x[2], &packing, scale, Some(3)),
    );
}

#[test]
fn attention_window_matches_naive_reference() {
    let (packing, q, k, v) = attention_inputs(17);
    let (scale, window) = (0.3, 3usize);
    let mut cx = Cx::new(Plan::store_all());
    let o = cx
        .attention_windowed(
            &Var::param(q.clone()),
            &Var::param(k.clone()),
            &Var::param(v.clone()),
            &packing,
            scale,
            Some(window),
        )
        .unwrap();
    let worst = naive_attention_max_diff(&packing, (&q, &k, &v), o.tensor(), scale, Some(window));
    // Same bound and reason as the unwindowed case.
    assert!(
        worst < 1e-12,
        "windowed attention vs naive: max abs diff {worst:e}"
    );
    let mut cx = Cx::new(Plan::store_all());
    let (packing, q, k, v) = attention_inputs(17);
    let e = cx
        .attention_windowed(
            &Var::param(q),
            &Var::param(k),
            &Var::param(v),
            &packing,
            scale,
            Some(0),
        )
        .unwrap_err();
    assert!(e.to_string().contains("window"), "{e}");
}

// ----- token log-probs ----------------------------------------------------------------

const N: usize = 7;
const DM: usize = 5;
const VOCAB: usize = 11;

fn logprob_inputs(seed: u64) -> (Tensor, Tensor, Tensor) {
    let mut rng = Rng(seed);
    (
        rng.tensor(&[N, DM]),
        rng.tensor(&[VOCAB, DM]),
        rng.ids(N, VOCAB),
    )
}

#[test]
fn fd_token_logprobs() {
    let (h, w, t) = logprob_inputs(16);
    // 3 rows per chunk: 7 = 3 + 3 + 1, so the last chunk is partial.
    fd_check("token_logprobs", &[h.clone(), w.clone()], |cx, x| {
        cx.token_logprobs(&x[0], &x[1], &t, 3)
    });
    fd_check_mask(
        "token_logprobs hidden only",
        &[h.clone(), w.clone()],
        &[true, false],
        |cx, x| cx.token_logprobs(&x[0], &x[1], &t, 2),
    );
    fd_check_mask("token_logprobs w only", &[h, w], &[false, true], |cx, x| {
        cx.token_logprobs(&x[0], &x[1], &t, 4)
    });
}

#[test]
fn token_logprobs_matches_full_log_softmax() {
    let (h, w, t) = logprob_inputs(17);
    // Reference: the full [N, V] logits, log-softmax, gather.
    let logits = h.matmul(&w.t().unwrap()).unwrap().to_vec2::<f64>().unwrap();
    let ids = t.to_vec1::<u32>().unwrap();
    let want: Vec<f64> = logits
        .iter()
        .zip(&ids)
        .map(|(row, &id)| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            row[id as usize] - lse
        })
        .collect();
    for chunk in [1, 3, 7, 100] {
        let mut cx = Cx::new(Plan::store_all());
        let y = cx
            .token_logprobs(&Var::param(h.clone()), &Var::param(w.clone()), &t, chunk)
            .unwrap();
        let got = flat(y.tensor());
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-12, "chunk {chunk}: {a} vs {b}");
        }
        // Saved: targets (u32) and the per-token lse (f64); hidden and w are parameters.
        assert_eq!(cx.memory().live_bytes(), N * 4 + N * 8, "chunk {chunk}");
    }
}

// ----- ops without any gradient-requiring input ---------------------------------------

#[test]
fn ops_without_grad_inputs_compute_and_save_nothing() {
    let mut rng = Rng(18);
    let c = |t: Tensor| Var::constant(t);
    let x = rng.tensor(&[3, 5]);
    let w = rng.tensor(&[4, 5]);
    let mut cx = Cx::new(Plan::store_all());
    let y = cx.linear(&c(x.clone()), &c(w.clone()), None).unwrap();
    assert!(!y.requires_grad());
    let want = x.matmul(&w.t().unwrap()).unwrap();
    assert_eq!(flat(y.tensor()), flat(&want));
    let y = cx.silu(&y).unwrap();
    let y = cx.rms_norm(&y, &c(rng.tensor(&[4])), 1e-6).unwrap();
    assert!(!y.requires_grad());

    let (packing, q, k, v) = attention_inputs(19);
    let o = cx.attention(&c(q), &c(k), &c(v), &packing, 0.5).unwrap();
    assert!(!o.requires_grad());
    let (h, w, t) = logprob_inputs(20);
    let lp = cx.token_logprobs(&c(h), &c(w), &t, 3).unwrap();
    assert!(!lp.requires_grad());
    assert!(flat(lp.tensor()).iter().all(|p| *p <= 0.0 && p.is_finite()));
    assert_eq!(
        cx.memory().live_bytes(),
        0,
        "ops without gradients saved something"
    );

    // The same ops on the inference tape.
    let mut cx = Cx::inference();
    let e = cx
        .embedding(
            &c(rng.tensor(&[6, 3])),
            &Tensor::new(&[1u32, 5], &cpu()).unwrap(),
        )
        .unwrap();
    assert_eq!(e.dims(), &[2, 3]);
}

// ----- a small decoder block in f32 vs f64 ---------------------------------------------

/// Runs a tied-embedding decoder block through every op in `dtype` and returns the
/// gradients of all parameters as f64 vectors.
fn block_grads(dtype: DType) -> Vec<Vec<f64>> {
    let mut rng = Rng(21);
    let (vocab, d, hq, hkv, hd, inter) = (11usize, 8usize, 2usize, 1usize, 4usize, 6usize);
    let lens = [3usize, 4];
    let n: usize = lens.iter().sum();
    let mut p = |dims: &[usize], s: f64| {
        Var::param(
            rng.tensor(dims)
                .affine(s, 0.0)
                .unwrap()
                .to_dtype(dtype)
                .unwrap(),
        )
    };
    let table = p(&[vocab, d], 1.0);
    let wn = p(&[d], 1.0);
    let wq = p(&[hq * hd, d], 0.4);
    let wk = p(&[hkv * hd, d], 0.4);
    let wv = p(&[hkv * hd, d], 0.4);
    let wo = p(&[d, hq * hd], 0.4);
    let bo = p(&[d], 0.1);
    let wg = p(&[inter, d], 0.4);
    let wu = p(&[inter, d], 0.4);
    let wd = p(&[d, inter], 0.4);
    let params = [&table, &wn, &wq, &wk, &wv, &wo, &bo, &wg, &wu, &wd];
    let mut rng = Rng(22);
    let ids = rng.ids(n, vocab);
    let targets = rng.ids(n, vocab);
    let coeff = rng.tensor(&[n]).to_dtype(dtype).unwrap();
    let packing = Packing::new(&lens, &cpu()).unwrap();
    let tables = RopeTables::new(&packing, hd, 10_000.0, dtype, &cpu()).unwrap();

    let mut cx = Cx::new(Plan::store_all());
    let cx = &mut cx;
    let h = cx.embedding(&table, &ids).unwrap();
    let x = cx.rms_norm(&h, &wn, 1e-6).unwrap();
    let q = cx.linear(&x, &wq, None).unwrap();
    let q = cx.reshape(&q, (n, hq, hd)).unwrap();
    let q = cx.rope(&q, &tables).unwrap();
    let k = cx.linear(&x, &wk, None).unwrap();
    let k = cx.reshape(&k, (n, hkv, hd)).unwrap();
    let k = cx.rope(&k, &tables).unwrap();
    let v = cx.linear(&x, &wv, None).unwrap();
    let v = cx.reshape(&v, (n, hkv, hd)).unwrap();
    let a = cx.attention(&q, &k, &v, &packing, 0.5).unwrap();
    let a = cx.reshape(&a, (n, hq * hd)).unwrap();
    let o = cx.linear(&a, &wo, Some(&bo)).unwrap();
    let h2 = cx.add(&h, &o).unwrap();
    let g = cx.linear(&h2, &wg, None).unwrap();
    let u = cx.linear(&h2, &wu, None).unwrap();
    let s = cx.swiglu(&g, &u).unwrap();
    let m = cx.linear(&s, &wd, None).unwrap();
    let h3 = cx.add(&h2, &m).unwrap();
    let lp = cx.token_logprobs(&h3, &table, &targets, 3).unwrap();
    let mut grads = Grads::new();
    cx.backward(&lp, &coeff, &mut grads).unwrap();
    params
        .iter()
        .map(|p| flat(&grads.get(p.id()).unwrap().to_dtype(DType::F64).unwrap()))
        .collect()
}

#[test]
fn decoder_block_f32_matches_f64() {
    let (g32, g64) = (block_grads(DType::F32), block_grads(DType::F64));
    for (i, (a, b)) in g32.iter().zip(&g64).enumerate() {
        let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let rel = norm(&diff) / norm(b);
        println!("f32 vs f64 param {i}: relative error {rel:.3e}");
        // f32 rounds each op at ~6e-8 relative; ~25 ops deep with sums over <= 11 terms and
        // condition numbers O(10) give up to ~1e-5 (measured ~1e-6). 1e-4 allows 10x over
        // that estimate; a dtype bug (a wrong cast, a mask in the wrong type) is O(1).
        assert!(rel < 1e-4, "param {i}: f32 vs f64 relative error {rel:.3e}");
    }
}

// ----- the ops a model beyond the decoder needs -----------------------------------------

#[test]
fn fd_sub_and_unary_functions() {
    let mut rng = Rng(40);
    let (a, b) = (rng.tensor(&[3, 1, 4]), rng.tensor(&[2, 4]));
    fd_check("sub [3,1,4]-[2,4]", &[a, b], |cx, v| cx.sub(&v[0], &v[1]));
    let x = rng.tensor(&[3, 5]);
    fd_check("exp", std::slice::from_ref(&x), |cx, v| cx.exp(&v[0]));
    fd_check("tanh", std::slice::from_ref(&x), |cx, v| cx.tanh(&v[0]));
    fd_check("sigmoid", std::slice::from_ref(&x), |cx, v| {
        cx.sigmoid(&v[0])
    });
    fd_check("gelu_erf", std::slice::from_ref(&x), |cx, v| {
        cx.gelu_erf(&v[0])
    });
    fd_check("gelu_tanh", &[x], |cx, v| cx.gelu_tanh(&v[0]));
}

/// The forwards against their definitions, element by element in f64.
#[test]
fn unary_functions_match_their_definitions() {
    let mut rng = Rng(41);
    let x = rng.tensor(&[4, 6]);
    let xs = flat(&x);
    let mut cx = Cx::new(Plan::store_all());
    let v = Var::constant(x);
    let erf = |z: f64| -> f64 {
        // Abramowitz-Stegun 7.1.26 is too coarse; integrate instead (Simpson, 2000 steps).
        let n = 2000;
        let h = z / n as f64;
        let f = |t: f64| (-t * t).exp();
        let mut s = f(0.0) + f(z);
        for i in 1..n {
            s += f(i as f64 * h) * if i % 2 == 1 { 4.0 } else { 2.0 };
        }
        s * h / 3.0 * 2.0 / std::f64::consts::PI.sqrt()
    };
    type Reference = Box<dyn Fn(f64) -> f64>;
    let cases: Vec<(&str, Var, Reference)> = vec![
        ("exp", cx.exp(&v).unwrap(), Box::new(f64::exp)),
        ("tanh", cx.tanh(&v).unwrap(), Box::new(f64::tanh)),
        (
            "sigmoid",
            cx.sigmoid(&v).unwrap(),
            Box::new(|z: f64| 1.0 / (1.0 + (-z).exp())),
        ),
        (
            "gelu_erf",
            cx.gelu_erf(&v).unwrap(),
            Box::new(move |z: f64| 0.5 * z * (1.0 + erf(z / 2f64.sqrt()))),
        ),
        (
            "gelu_tanh",
            cx.gelu_tanh(&v).unwrap(),
            Box::new(|z: f64| {
                0.5 * z
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (z + 0.044715 * z.powi(3))).tanh())
            }),
        ),
    ];
    for (name, y, f) in cases {
        for (got, &z) in flat(y.tensor()).iter().zip(&xs) {
            // f64 evaluation against f64 (erf by Simpson: error ~1e-13 at 2000 steps).
            assert!(
                (got - f(z)).abs() <= 1e-9,
                "{name}({z}) = {got}, want {}",
                f(z)
            );
        }
    }
}

#[test]
fn fd_softmax_and_reductions() {
    let mut rng = Rng(42);
    let x = rng.tensor(&[3, 2, 5]);
    fd_check("softmax", std::slice::from_ref(&x), |cx, v| {
        cx.softmax(&v[0])
    });
    for dim in 0..3 {
        fd_check(
            &format!("sum dim {dim}"),
            std::slice::from_ref(&x),
            |cx, v| cx.sum(&v[0], dim),
        );
        fd_check(
            &format!("mean dim {dim}"),
            std::slice::from_ref(&x),
            |cx, v| cx.mean(&v[0], dim),
        );
        // Uniform random entries: no ties, and a perturbation of h never changes the
        // argmax unless two entries are within 2h (probability ~1e-5 per slice).
        fd_check(
            &format!("max dim {dim}"),
            std::slice::from_ref(&x),
            |cx, v| cx.max(&v[0], dim),
        );
    }
    // A softmax row sums to 1; the max is the largest entry.
    let mut cx = Cx::new(Plan::store_all());
    let v = Var::constant(x.clone());
    let p = flat(cx.softmax(&v).unwrap().tensor());
    for row in p.chunks(5) {
        assert!((row.iter().sum::<f64>() - 1.0).abs() <= 1e-12);
    }
    let m = flat(cx.max(&v, 2).unwrap().tensor());
    for (row, &mx) in flat(&x).chunks(5).zip(&m) {
        assert_eq!(row.iter().cloned().fold(f64::MIN, f64::max), mx);
    }
}

#[test]
fn fd_layer_norm_pad_and_causal_conv() {
    let mut rng = Rng(43);
    let (x, w, b) = (rng.tensor(&[2, 3, 6]), rng.tensor(&[6]), rng.tensor(&[6]));
    fd_check("layer_norm", &[x.clone(), w.clone(), b.clone()], |cx, v| {
        cx.layer_norm(&v[0], &v[1], Some(&v[2]), 1e-5)
    });
    fd_check("layer_norm no bias", &[x.clone(), w.clone()], |cx, v| {
        cx.layer_norm(&v[0], &v[1], None, 1e-5)
    });
    fd_check_mask(
        "layer_norm w, b only",
        &[x, w, b],
        &[false, true, true],
        |cx, v| cx.layer_norm(&v[0], &v[1], Some(&v[2]), 1e-5),
    );
    fd_check("pad", &[rng.tensor(&[3, 4])], |cx, v| {
        cx.pad(&v[0], 1, 2, 1)
    });
    let (x, w) = (rng.tensor(&[7, 3]), rng.tensor(&[3, 4]));
    fd_check("causal_conv1d", &[x.clone(), w.clone()], |cx, v| {
        cx.causal_conv1d(&v[0], &v[1])
    });
    // The convolution against its definition; row t reads rows t-3..=t only.
    let mut cx = Cx::new(Plan::store_all());
    let y = flat(
        cx.causal_conv1d(&Var::constant(x.clone()), &Var::constant(w.clone()))
            .unwrap()
            .tensor(),
    );
    let (xv, wv) = (flat(&x), flat(&w));
    for t in 0..7 {
        for c in 0..3 {
            let mut want = 0.0;
            for k in 0..4 {
                let src = t as i64 - 3 + k as i64;
                if src >= 0 {
                    want += wv[c * 4 + k] * xv[src as usize * 3 + c];
                }
            }
            assert!((y[t * 3 + c] - want).abs() <= 1e-12, "y[{t}, {c}]");
        }
    }
    // LayerNorm's output rows have mean b and (biased) variance of w^2 ~ 1 each entry.
    let mut cx = Cx::new(Plan::store_all());
    let ones = Var::constant(Tensor::ones(6, DType::F64, &Device::Cpu).unwrap());
    let zeros = Var::constant(Tensor::zeros(6, DType::F64, &Device::Cpu).unwrap());
    let x = rng.tensor(&[4, 6]);
    let y = flat(
        cx.layer_norm(&Var::constant(x), &ones, Some(&zeros), 0.0)
            .unwrap()
            .tensor(),
    );
    for row in y.chunks(6) {
        let m = row.iter().sum::<f64>() / 6.0;
        let v = row.iter().map(|z| (z - m).powi(2)).sum::<f64>() / 6.0;
        assert!(
            m.abs() <= 1e-12 && (v - 1.0).abs() <= 1e-12,
            "mean {m}, var {v}"
        );
    }
}
