//! The CPU kernels (host `f32` tensors) against the ops' candle path in `f64` on the same
//! values, outputs and gradients. The `f64` path is the one `ops_fd.rs` checks against
//! finite differences, so this ties every kernel to a verified reference.
//!
//! Error bound. The inputs are drawn in `f64`, rounded to `f32`, and the `f64` reference
//! is run on the rounded values, so input rounding does not count: what is measured is the
//! kernels' own `f32` arithmetic. With unit roundoff `u = 2^-24 = 6.0e-8`, an output that
//! is a sum of `K` products is off by at most `gamma_K = K u` times the sum of the terms'
//! magnitudes (a lane-split or blocked sum only lowers the effective `K`); the longest
//! reductions here are the head's `V = 96` logits and `d = 48` features, attention's 130
//! keys times `D = 16`, so `K <= 2100` and the worst case is `1.3e-4` of the magnitudes.
//! Rounding errors of O(1) normal values are random, so their sum grows like `sqrt(K) u`
//! (`2.8e-6`); gradients cancel, with `sum |terms| / |result|` about 3 for these inputs
//! (measured in the printed figures: the observed errors sit at 1e-7 to 1e-6), and the
//! polynomial `exp` adds 2 ulp (`1.2e-7`) per probability. We assert a relative L2 error
//! of at most `2e-5`: twice the random-walk estimate times the cancellation (`2 * 2.8e-6 *
//! 3 = 1.7e-5`), below the worst case, and four orders of magnitude below what a wrong
//! mask, index, scale or missing term produces (O(1e-2) to O(1)).

use candle_core::{DType, Device, Tensor};
use hilore_runtime::{Cx, Grads, Packing, Plan, Result, RopeTables, Var};

/// Relative L2 bound of the kernels' `f32` results against `f64` (see the module docs).
const BOUND: f64 = 2e-5;

mod support;
use support::Rng;

impl Rng {
    /// Normal values, rounded to f32 (so the f64 run sees exactly the f32 inputs).
    fn values(&mut self, dims: &[usize], scale: f64) -> Vec<f64> {
        let n: usize = dims.iter().product();
        (0..n)
            .map(|_| (scale * self.normal()) as f32 as f64)
            .collect()
    }
}

fn tensor(v: &[f64], dims: &[usize], dt: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

fn flat(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// An op's output and the gradients of its grad-requiring inputs, in `dt`.
type Run = (Vec<f64>, Vec<Option<Vec<f64>>>);

fn run<F>(f: &F, inputs: &[(Vec<f64>, Vec<usize>, bool)], seed: &[f64], dt: DType) -> Run
where
    F: Fn(&mut Cx<'static>, &[Var], DType) -> Result<Var>,
{
    let vars: Vec<Var> = inputs
        .iter()
        .map(|(v, d, g)| {
            let t = tensor(v, d, dt);
            if *g {
                Var::param(t)
            } else {
                Var::constant(t)
            }
        })
        .collect();
    let mut cx = Cx::new(Plan::store_all());
    let y = f(&mut cx, &vars, dt).unwrap();
    let r = tensor(seed, y.dims(), dt);
    let mut grads = Grads::new();
    cx.backward(&y, &r, &mut grads).unwrap();
    let gs = vars
        .iter()
        .zip(inputs)
        .map(|(v, (_, _, g))| g.then(|| flat(grads.get(v.id()).unwrap())))
        .collect();
    (flat(y.tensor()), gs)
}

/// Runs `f` in f32 (the kernels) and f64 (candle's ops) on the same values and checks the
/// output and every gradient against [`BOUND`].
fn check<F>(name: &str, inputs: &[(Vec<f64>, Vec<usize>, bool)], out_len: usize, f: F)
where
    F: Fn(&mut Cx<'static>, &[Var], DType) -> Result<Var>,
{
    let seed = Rng(0xfeed ^ out_len as u64).values(&[out_len], 1.0);
    let f32_run = run(&f, inputs, &seed, DType::F32);
    let f64_run = run(&f, inputs, &seed, DType::F64);
    assert_within_bound(name, &f32_run, &f64_run);
}

/// An `f32` run's output and gradients against the `f64` reference's, each within
/// [`BOUND`].
fn assert_within_bound(name: &str, (y32, g32): &Run, (y64, g64): &Run) {
    let e = rel_l2(y32, y64);
    println!("{name}: output rel L2 {e:.2e}");
    assert!(e <= BOUND, "{name}: output off by {e:.2e} > {BOUND:e}");
    for (i, (a, b)) in g32.iter().zip(g64).enumerate() {
        if let (Some(a), Some(b)) = (a, b) {
            let e = rel_l2(a, b);
            println!("{name}: d input {i} rel L2 {e:.2e}");
            assert!(
                e <= BOUND,
                "{name}: gradient of input {i} off by {e:.2e} > {BOUND:e}"
            );
        }
    }
}

#[test]
fn rms_norm_rows_and_heads() {
    let mut r = Rng(1);
    let x = r.values(&[37, 48], 1.0);
    let w = r.values(&[48], 0.3).iter().map(|v| 1.0 + v).collect();
    check(
        "rms_norm",
        &[(x, vec![37, 48], true), (w, vec![48], true)],
        37 * 48,
        |cx, v, _| cx.rms_norm(&v[0], &v[1], 1e-6),
    );
    // Per-head norms (Qwen3's q/k norms): rows of D inside [N, H, D]; and a frozen weight.
    let x = r.values(&[9, 3, 16], 1.0);
    let w = r.values(&[16], 1.0);
    check(
        "rms_norm heads",
        &[(x, vec![9, 3, 16], true), (w, vec![16], false)],
        9 * 3 * 16,
        |cx, v, _| cx.rms_norm(&v[0], &v[1], 1e-5),
    );
}

#[test]
fn silu_swiglu_add_bias() {
    let mut r = Rng(2);
    let a = r.values(&[23, 40], 3.0);
    let b = r.values(&[23, 40], 3.0);
    check(
        "silu",
        &[(a.clone(), vec![23, 40], true)],
        23 * 40,
        |cx, v, _| cx.silu(&v[0]),
    );
    check(
        "swiglu",
        &[
            (a.clone(), vec![23, 40], true),
            (b.clone(), vec![23, 40], true),
        ],
        23 * 40,
        |cx, v, _| cx.swiglu(&v[0], &v[1]),
    );
    check(
        "swiglu, up only",
        &[
            (a.clone(), vec![23, 40], false),
            (b.clone(), vec![23, 40], true),
        ],
        23 * 40,
        |cx, v, _| cx.swiglu(&v[0], &v[1]),
    );
    check(
        "add",
        &[(a.clone(), vec![23, 40], true), (b, vec![23, 40], true)],
        23 * 40,
        |cx, v, _| cx.add(&v[0], &v[1]),
    );
    let bias = r.values(&[40], 1.0);
    check(
        "add bias",
        &[
            (a.clone(), vec![23, 40], true),
            (bias.clone(), vec![40], true),
        ],
        23 * 40,
        |cx, v, _| cx.add(&v[1], &v[0]),
    );
    let w = r.values(&[40, 40], 0.2);
    check(
        "linear with bias",
        &[
            (a, vec![23, 40], true),
            (w, vec![40, 40], true),
            (bias, vec![40], true),
        ],
        23 * 40,
        |cx, v, _| cx.linear(&v[0], &v[1], Some(&v[2])),
    );
}

#[test]
fn rope_kernel() {
    let mut r = Rng(3);
    let lengths = [5, 12, 3];
    let n: usize = lengths.iter().sum();
    let x = r.values(&[n, 3, 16], 1.0);
    check(
        "rope",
        &[(x, vec![n, 3, 16], true)],
        n * 3 * 16,
        |cx, v, dt| {
            let packing = Packing::new(&lengths, &Device::Cpu)?;
            let tables = RopeTables::new(&packing, 16, 10_000.0, dt, &Device::Cpu)?;
            cx.rope(&v[0], &tables)
        },
    );
}

/// Packed sequences longer and shorter than a tile (64), a single token, partial tiles on
/// the diagonal; grouped-query heads (6 query heads over 2 kv heads).
const ATTN_LENGTHS: [usize; 4] = [1, 70, 130, 5];

fn attention_case(window: Option<usize>, grad: [bool; 3]) {
    let mut r = Rng(4 + window.unwrap_or(0) as u64);
    let n: usize = ATTN_LENGTHS.iter().sum();
    let (hq, hkv, d) = (6, 2, 16);
    let q = r.values(&[n, hq, d], 1.0);
    let k = r.values(&[n, hkv, d], 1.0);
    let v = r.values(&[n, hkv, d], 1.0);
    let name = format!("attention window {window:?} grads {grad:?}");
    check(
        &name,
        &[
            (q, vec![n, hq, d], grad[0]),
            (k, vec![n, hkv, d], grad[1]),
            (v, vec![n, hkv, d], grad[2]),
        ],
        n * hq * d,
        |cx, vs, _| {
            let packing = Packing::new(&ATTN_LENGTHS, &Device::Cpu)?;
            cx.attention_windowed(&vs[0], &vs[1], &vs[2], &packing, 0.25, window)
        },
    );
}

#[test]
fn attention_causal() {
    attention_case(None, [true, true, true]);
}

#[test]
fn attention_sliding_windows() {
    // Windows inside one tile, one that spans tiles, one longer than every sequence. (A
    // window of 1 makes every softmax a single 1, so dQ and dK are exactly zero and a
    // relative error is undefined; 2 is the smallest window with a gradient.)
    for w in [2, 7, 100, 1000] {
        attention_case(Some(w), [true, true, true]);
    }
}

#[test]
fn attention_partial_gradients() {
    // Only dV (v and o are then not saved), only dQ, only dK.
    attention_case(None, [false, false, true]);
    attention_case(Some(9), [true, false, false]);
    attention_case(None, [false, true, false]);
}

/// A shared-prefix layout: a prompt of 70 rows with responses of 30, 1 and 60 (the
/// last crossing a key tile), a sequence of its own, a prompt of 5 with responses of 64
/// and 3. The longest concatenation has 130 keys, as [`ATTN_LENGTHS`], so the module's
/// error bound holds as derived.
const SHARED_LENGTHS: [usize; 7] = [70, 30, 1, 60, 20, 5, 64];
const SHARED_PREFIX_OF: [Option<usize>; 7] = [None, Some(0), Some(0), Some(0), None, None, Some(5)];

/// The same sequences with every prefix first (the layout a model splits its row-wise
/// units on): the prompts and the sequence of its own, then the continuations.
const PROMPTS_FIRST_LENGTHS: [usize; 7] = [70, 20, 5, 30, 1, 60, 64];
const PROMPTS_FIRST_PREFIX_OF: [Option<usize>; 7] =
    [None, None, None, Some(0), Some(0), Some(0), Some(2)];

/// The concatenations a shared layout replaces: for each sequence that no other continues
/// its own rows, and for each continuation its prefix's rows then its own; as row ranges
/// of the shared layout.
fn concatenations(
    lengths: &[usize],
    prefix_of: &[Option<usize>],
) -> Vec<Vec<std::ops::Range<usize>>> {
    let mut start = vec![0];
    for l in lengths {
        start.push(start.last().unwrap() + l);
    }
    let rows = |i: usize| start[i]..start[i + 1];
    let continued: Vec<bool> = (0..lengths.len())
        .map(|i| prefix_of.contains(&Some(i)))
        .collect();
    (0..lengths.len())
        .filter_map(|i| match prefix_of[i] {
            Some(j) => Some(vec![rows(j), rows(i)]),
            None if !continued[i] => Some(vec![rows(i)]),
            None => None,
        })
        .collect()
}

/// The shared layout's rows `x: [N, ...]` laid out as the concatenations, on the tape
/// (narrow + cat: the backward sums a prefix row's copies).
fn concatenate(cx: &mut Cx<'static>, x: &Var, seqs: &[Vec<std::ops::Range<usize>>]) -> Result<Var> {
    let mut parts = Vec::new();
    for seq in seqs {
        for r in seq {
            parts.push(cx.narrow(x, 0, r.start, r.len())?);
        }
    }
    let refs: Vec<&Var> = parts.iter().collect();
    cx.cat(&refs, 0)
}

/// Attention over shared prefixes (the CPU kernel, `f32`) equals attention over the
/// concatenations it replaces (candle's path in `f64`, the reference `ops_fd.rs` checks):
/// the shared output laid out as the concatenations, and the gradients of `q`, `k`, `v`
/// where the concatenations' gradients sum over a prefix row's copies. With and without a
/// sliding window (one shorter than the prefix, so it cuts into it), with GQA; in the
/// layout of one group after another and with every prefix first.
/// A layout's name, sequence lengths and prefixes.
type Layout<'a> = (&'a str, &'a [usize], &'a [Option<usize>]);

#[test]
fn attention_shared_prefix_equals_its_concatenations() {
    let layouts: [Layout; 2] = [
        ("grouped", &SHARED_LENGTHS, &SHARED_PREFIX_OF),
        (
            "prompts first",
            &PROMPTS_FIRST_LENGTHS,
            &PROMPTS_FIRST_PREFIX_OF,
        ),
    ];
    for ((layout, lengths, prefix_of), window) in layouts
        .into_iter()
        .flat_map(|l| [None, Some(40)].map(|w| (l, w)))
    {
        let seqs = concatenations(lengths, prefix_of);
        let concat_lengths: Vec<usize> = seqs
            .iter()
            .map(|s| s.iter().map(|r| r.len()).sum())
            .collect();
        let n: usize = lengths.iter().sum();
        let (hq, hkv, d) = (6, 2, 16);
        {
            let mut r = Rng(11 + window.unwrap_or(0) as u64);
            let inputs = [
                (r.values(&[n, hq, d], 1.0), vec![n, hq, d]),
                (r.values(&[n, hkv, d], 1.0), vec![n, hkv, d]),
                (r.values(&[n, hkv, d], 1.0), vec![n, hkv, d]),
            ];
            let rows: usize = concat_lengths.iter().sum();
            let seed = r.values(&[rows, hq, d], 1.0);
            let run = |dt: DType, shared: bool| {
                let vars: Vec<Var> = inputs
                    .iter()
                    .map(|(v, dims)| Var::param(tensor(v, dims, dt)))
                    .collect();
                let mut cx = Cx::new(Plan::store_all());
                let y = if shared {
                    let packing =
                        Packing::with_shared_prefixes(lengths, prefix_of, &Device::Cpu).unwrap();
                    let o = cx
                        .attention_windowed(&vars[0], &vars[1], &vars[2], &packing, 0.25, window)
                        .unwrap();
                    concatenate(&mut cx, &o, &seqs).unwrap()
                } else {
                    let packing = Packing::new(&concat_lengths, &Device::Cpu).unwrap();
                    let [q, k, v] =
                        [0, 1, 2].map(|i| concatenate(&mut cx, &vars[i], &seqs).unwrap());
                    cx.attention_windowed(&q, &k, &v, &packing, 0.25, window)
                        .unwrap()
                };
                let mut grads = Grads::new();
                cx.backward(&y, &tensor(&seed, y.dims(), dt), &mut grads)
                    .unwrap();
                let gs: Vec<Option<Vec<f64>>> = vars
                    .iter()
                    .map(|v| Some(flat(grads.get(v.id()).unwrap())))
                    .collect();
                (flat(y.tensor()), gs)
            };
            let name = format!("shared-prefix attention, {layout}, window {window:?}");
            let reference = run(DType::F64, false);
            assert_within_bound(&name, &run(DType::F32, true), &reference);
            // Candle's path (here f64; a GPU's tensors take it too) with shared prefixes
            // against the same path over the concatenations.
            let (y, g) = run(DType::F64, true);
            let (y_ref, g_ref) = &reference;
            let mut worst = rel_l2(&y, y_ref);
            for (a, b) in g.iter().zip(g_ref) {
                if let (Some(a), Some(b)) = (a, b) {
                    worst = worst.max(rel_l2(a, b));
                }
            }
            println!("{name}: candle path f64, worst rel L2 {worst:.2e}");
            assert!(worst <= F64_BOUND, "{name}: candle path off by {worst:.2e}");
        }
    }
}

/// [`BOUND`]'s derivation at `f64`'s unit roundoff `2^-53 = 1.1e-16`, both sides in `f64`
/// on candle's path in different summation orders: the random walk `sqrt(2100) u =
/// 5.1e-15`, times 2 and the cancellation 3, `3.1e-14`.
const F64_BOUND: f64 = 3.1e-14;

/// A shared layout the kernel cannot attend is refused with the rule it breaks.
#[test]
fn shared_prefix_packings_are_checked() {
    let dev = Device::Cpu;
    // (lengths, prefix_of, what the error says)
    type Case<'a> = (&'a [usize], &'a [Option<usize>], &'a str);
    let bad: [Case; 3] = [
        (&[3, 2], &[None], "one entry per sequence"),
        (&[3, 2], &[Some(1), None], "does not come before it"),
        (&[3, 2, 2], &[None, Some(0), Some(1)], "one level deep"),
    ];
    for (lengths, prefix_of, expected) in bad {
        let e = Packing::with_shared_prefixes(lengths, prefix_of, &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{lengths:?} {prefix_of:?}: {e}");
    }
    let p = Packing::with_shared_prefixes(&[3, 2, 4], &[None, Some(0), Some(0)], &dev).unwrap();
    assert_eq!(
        p.positions().to_vec1::<u32>().unwrap(),
        [0, 1, 2, 3, 4, 3, 4, 5, 6]
    );
    // 3^2 + (2^2 + 2*3*2) + (4^2 + 2*3*4): the concatenations' 5^2 + 7^2 less one 3^2.
    assert_eq!(p.sum_sq_lengths(), 9 + 16 + 40);
    // One group: its prompt's 3 rows come before every continuation.
    assert_eq!(p.shared_prefix_rows(), Some(3));
    // Every prefix first, a sequence of its own among them or after the continuations.
    let first = |lengths: &[usize], prefix_of: &[Option<usize>]| {
        Packing::with_shared_prefixes(lengths, prefix_of, &dev)
            .unwrap()
            .shared_prefix_rows()
    };
    assert_eq!(
        first(&[3, 1, 2, 2, 4], &[None, None, None, Some(0), Some(2)]),
        Some(6)
    );
    assert_eq!(first(&[3, 2, 5], &[None, Some(0), None]), Some(3));
    // A prefix after a continuation (one group after another), and no prefix at all.
    assert_eq!(first(&[3, 2, 4, 1], &[None, Some(0), None, Some(2)]), None);
    assert_eq!(first(&[3, 2], &[None, None]), None);
}

#[test]
fn token_logprobs_chunks() {
    let mut r = Rng(5);
    let (n, d, vocab) = (29, 48, 96);
    let h = r.values(&[n, d], 1.0);
    let w = r.values(&[vocab, d], 0.5);
    let ids: Vec<u32> = (0..n)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect();
    // 7 rows a chunk: row chunks 7,7,7,7,1 forward, vocabulary chunks of 24 backward.
    for chunk in [7, 64] {
        let ids = ids.clone();
        check(
            &format!("token_logprobs chunk {chunk}"),
            &[
                (h.clone(), vec![n, d], true),
                (w.clone(), vec![vocab, d], true),
            ],
            n,
            move |cx, v, _| {
                let t = Tensor::from_vec(ids.clone(), n, &Device::Cpu)?;
                cx.token_logprobs(&v[0], &v[1], &t, chunk)
            },
        );
    }
}

#[test]
fn token_logprobs_rejects_targets_outside_the_vocabulary() {
    let h = Var::param(Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap());
    let w = Var::param(Tensor::zeros((5, 4), DType::F32, &Device::Cpu).unwrap());
    let t = Tensor::from_vec(vec![1u32, 5], 2, &Device::Cpu).unwrap();
    let mut cx = Cx::new(Plan::store_all());
    let err = cx.token_logprobs(&h, &w, &t, 4).unwrap_err().to_string();
    assert!(err.contains("target 1 is token 5"), "{err}");
}
