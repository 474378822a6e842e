//! Every fidelity recovers the gradient: Store/Recompute plans bit for bit, bf16
//! compression within a bound derived from bf16's significand.

use candle_core::{Device, Tensor};
use hilore_models::{plans, rng, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{BackwardReport, Cx, Fidelity, Grads, Plan};

struct Setup {
    model: Decoder,
    batch: TokenBatch,
    coeffs: Tensor,
}

/// A small tiny-like model (3 layers, GQA, qkv bias) so that many plans run quickly.
fn setup() -> Setup {
    let dev = Device::Cpu;
    let cfg = DecoderConfig {
        num_hidden_layers: 3,
        attention_bias: true,
        ..DecoderConfig::tiny()
    };
    let model = Decoder::random(&cfg, 5, &dev).unwrap();
    let batch = TokenBatch::random(&[17, 33, 9, 25], &cfg, 6, &dev).unwrap();
    let coeffs = rng::normal_tensor(batch.num_tokens(), 0.0, 1.0, 7, &dev).unwrap();
    Setup {
        model,
        batch,
        coeffs,
    }
}

struct Pass {
    /// Every parameter gradient, in `named_params` order.
    grads: Vec<(String, Vec<f32>)>,
    report: BackwardReport,
}

fn run(s: &Setup, plan: Plan, verify: bool) -> Pass {
    let mut cx = Cx::new(plan).verify_recompute(verify);
    let logp = s.model.token_logprobs(&mut cx, &s.batch).unwrap();
    let mut grads = Grads::new();
    let report = cx.backward(&logp, &s.coeffs, &mut grads).unwrap();
    let grads = s
        .model
        .named_params()
        .into_iter()
        .map(|(n, v)| {
            let g = grads
                .get(v.id())
                .unwrap_or_else(|| panic!("no gradient for {n}"));
            (n, g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    Pass { grads, report }
}

fn assert_bit_identical(what: &str, got: &Pass, want: &Pass) {
    assert_eq!(got.grads.len(), want.grads.len());
    for ((name, g), (_, w)) in got.grads.iter().zip(&want.grads) {
        let differ = g
            .iter()
            .zip(w)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ,
            0,
            "{what}: {differ} of {} entries of {name}'s gradient differ from store-all",
            g.len()
        );
    }
}

/// Relative L2 error per tensor, and over all parameters together.
fn rel_errors(got: &Pass, want: &Pass) -> (Vec<(String, f64)>, f64) {
    let (mut num, mut den) = (0f64, 0f64);
    let mut per = Vec::new();
    for ((name, g), (_, w)) in got.grads.iter().zip(&want.grads) {
        let (mut n, mut d) = (0f64, 0f64);
        for (a, b) in g.iter().zip(w) {
            n += (*a as f64 - *b as f64).powi(2);
            d += (*b as f64).powi(2);
        }
        per.push((name.clone(), (n / d).sqrt()));
        num += n;
        den += d;
    }
    (per, (num / den).sqrt())
}

#[test]
fn store_and_recompute_plans_give_store_all_gradients_bit_for_bit() {
    let s = setup();
    let layers = s.model.config().num_hidden_layers;
    let store = run(&s, plans::store_all(), false);

    let gc = run(&s, plans::gradient_checkpointing(), true);
    assert_bit_identical("gradient checkpointing", &gc, &store);
    assert_eq!(gc.report.recomputed_units, layers);
    assert_eq!(gc.report.checks.len(), layers);
    assert!(
        gc.report.checks.iter().all(|c| c.bit_identical),
        "{:?}",
        gc.report.checks
    );

    // Every unit recomputed, layers and inner units alike: inner units re-run twice.
    let all = run(
        &s,
        Plan::uniform("recompute-everything", Fidelity::Recompute),
        true,
    );
    assert_bit_identical("recompute everything", &all, &store);
    assert!(!all.report.checks.is_empty());
    assert!(
        all.report.checks.iter().all(|c| c.bit_identical),
        "{:?}",
        all.report.checks
    );

    for seed in 1..=6 {
        let plan = plans::random_mixed(seed, layers, None);
        let name = plan.name().to_string();
        let p = run(&s, plan, true);
        assert_bit_identical(&name, &p, &store);
        assert!(p.report.recomputed_units > 0, "{name} recomputed nothing");
        assert!(
            p.report.checks.iter().all(|c| c.bit_identical),
            "{name}: {:?}",
            p.report.checks
        );
    }
}

#[test]
fn recompute_next_to_compressed_units_changes_no_bit() {
    // A mixed Store/Recompute/bf16 plan and the same plan with every Recompute turned into
    // Store: a unit's forward output never depends on how its saved state is kept, so the
    // recomputes must reproduce the compressed plan's gradients exactly.
    let s = setup();
    let layers = s.model.config().num_hidden_layers;
    let bf16 = Fidelity::parse("compress-bf16").unwrap();
    for seed in 1..=3u64 {
        let mut r = rng::SplitMix64::new(seed);
        let mut mixed = Plan::store_all().named("mixed");
        let mut no_recompute = Plan::store_all().named("mixed, recompute -> store");
        let mut instances = vec![("embed", 0), ("head", 0)];
        for l in 0..layers {
            instances.push(("layer", l));
            instances.extend(plans::LAYER_UNITS.iter().map(|&u| (u, l)));
        }
        for (u, call) in instances {
            let f = [Fidelity::Store, Fidelity::Recompute, bf16][r.below(3) as usize];
            mixed.set_instance(u, call, f);
            no_recompute.set_instance(
                u,
                call,
                if f == Fidelity::Recompute {
                    Fidelity::Store
                } else {
                    f
                },
            );
        }
        let a = run(&s, mixed, true);
        let b = run(&s, no_recompute, false);
        assert!(a.report.recomputed_units > 0 && a.report.decoded_units > 0);
        assert_bit_identical(&format!("seed {seed}"), &a, &b);
        assert!(a.report.checks.iter().all(|c| c.bit_identical));
    }
}

/// bf16's unit roundoff: 8 significand bits (7 stored + the implicit one), round to
/// nearest even, so every decoded value is `x (1 + d)` with `|d| <= 2^-8`.
const BF16_U: f64 = 1.0 / 256.0;

/// How many compressed values the backward reads on the longest path from the log-probs to
/// the gradient of `name`, in a decoder of `layers` layers under compress-all.
///
/// The reads that carry the incoming gradient down through a layer (the `dx` path): the
/// RMSNorm backward reads its input (attn_norm: 1, mlp_norm: 1), attention reads q, k, v
/// and o (4), SwiGLU reads gate and up (2); linear layers' `dx` reads only the (exact)
/// weight. That is 8 per layer. The head reads the normed hidden state (token log-probs)
/// and its input (final RMSNorm): 2. A parameter's own gradient then reads one more saved
/// input (`dW = g^T x`), except biases, and the embedding (which reads the exact ids).
fn compressed_reads(name: &str, layers: usize) -> usize {
    let head = 2;
    match name {
        "lm_head.weight" => 1,
        "model.norm.weight" => 2,
        "model.embed_tokens.weight" => head + 8 * layers,
        _ => {
            let rest = name.strip_prefix("model.layers.").expect(name);
            let (l, field) = rest.split_once('.').expect(name);
            let l: usize = l.parse().expect(name);
            let above = head + 8 * (layers - 1 - l);
            above
                + match field {
                    "mlp.down_proj.weight" => 1,                            // act
                    "mlp.gate_proj.weight" | "mlp.up_proj.weight" => 2 + 1, // swiglu, h
                    "post_attention_layernorm.weight" => 2 + 1,             // swiglu, x
                    "self_attn.o_proj.weight" => 3 + 1,                     // mlp, o
                    f if f.ends_with("_proj.bias") => 3 + 4,                // mlp, attention
                    f if f.ends_with("_proj.weight") => 3 + 4 + 1,          // mlp, attention, h
                    "input_layernorm.weight" => 3 + 4 + 1,                  // mlp, attention, x
                    other => panic!("unknown parameter {other}"),
                }
        }
    }
}

#[test]
fn bf16_compression_error_is_within_its_bound() {
    let s = setup();
    let layers = s.model.config().num_hidden_layers;
    let store = run(&s, plans::store_all(), false);
    let bf16 = run(&s, plans::compress_all("bf16").unwrap(), false);
    assert!(bf16.report.decoded_units > 0);
    let (per, total) = rel_errors(&bf16, &store);
    // The bound. Each compressed read replaces a saved value x by x (1 + d), |d| <= u =
    // 2^-8, so the saved tensor moves by at most u in relative L2. To first order the
    // backward is linear in each saved tensor, and bf16 rounding errors are uncorrelated
    // with the data, so each read perturbs what flows through it by about u relative to
    // that flow, and the K reads on a path add at most linearly: a gradient whose longest
    // path reads K compressed tensors has relative L2 error <= K u (second-order terms are
    // O(K^2 u^2), below 1% of the bound here). K per parameter: `compressed_reads`; it
    // runs from 1 (lm_head, u = 0.39%) to 2 + 8 L (the embedding: 26 u = 10% for 3 layers).
    let mut worst_ratio = (String::new(), 0.0, 0.0);
    for (name, e) in &per {
        let bound = compressed_reads(name, layers) as f64 * BF16_U;
        assert!(
            *e <= bound,
            "{name}: bf16 relative L2 error {e:e} > bound {bound:e}"
        );
        assert!(*e > 0.0, "{name}: compression changed nothing");
        if e / bound > worst_ratio.2 {
            worst_ratio = (name.clone(), *e, e / bound);
        }
    }
    println!(
        "bf16 compress-all: rel L2 over all params {total:e}; closest to its bound: {} at {:e} ({:.2} of K u)",
        worst_ratio.0, worst_ratio.1, worst_ratio.2
    );
}

#[test]
fn inference_forward_computes_the_same_log_probs() {
    // `Cx::inference` runs the same unit bodies without recording: same bits, nothing saved.
    let s = setup();
    let mut rec = Cx::new(plans::store_all());
    let a = s.model.token_logprobs(&mut rec, &s.batch).unwrap();
    let mut inf = Cx::inference();
    let b = s.model.token_logprobs(&mut inf, &s.batch).unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    assert_eq!(bits(a.tensor()), bits(b.tensor()));
    assert_eq!(inf.num_ops(), 0);
    assert_eq!(inf.memory().peak_bytes(), 0);
    assert!(b
        .tensor()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|&l| l < 0.0 && l.is_finite()));
}
