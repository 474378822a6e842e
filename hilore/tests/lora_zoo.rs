//! LoRA on a zoo model, as a user would write it: load a model directory (HF
//! `config.json` + `model.safetensors`), freeze its weights and add adapters
//! (`Decoder::add_lora`), then train the adapters alone with GRPO through the library's
//! actor update and the allocator. The frozen weights get no gradient, no optimizer state,
//! are never activation memory and never compressed; a checkpoint holds the adapters.

use candle_core::{DType, Device, Tensor};
use hilore::train::checkpoint::{model_tensors, restore_model, Checkpoint};
use hilore::train::optimizer::{AdamW, AdamWConfig};
use hilore::train::rollout::Rollout;
use hilore::train::update::{actor_update, UpdateSettings};
use hilore::train::ActorModel;
use hilore_models::rng::{normal_vec, SplitMix64};
use hilore_models::{zoo, Decoder, DecoderConfig, LoraConfig};
use hilore_runtime::allocator::{MemoryBudget, OnlineAllocator, StateBytes};
use hilore_runtime::grpo::{advantages, GrpoConfig, StepLayout};
use hilore_runtime::{Cx, Grads, Plan, Var};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

const RANK: usize = 4;
const ALPHA: f64 = 8.0;
const TARGETS: [&str; 2] = ["q_proj", "v_proj"];

/// A zoo model directory: a random Llama-style decoder exported as HF files, as a model
/// downloaded from the hub would be.
fn zoo_dir(tag: &str) -> (std::path::PathBuf, DecoderConfig) {
    let dir = std::env::temp_dir().join(format!("hilore-lora-{tag}-{}", std::process::id()));
    let cfg = DecoderConfig {
        num_hidden_layers: 2,
        ..DecoderConfig::tiny()
    };
    let m = Decoder::random(&cfg, 5, &Device::Cpu).unwrap();
    zoo::export_with(&m, &cfg, None, &dir, DType::F32).unwrap();
    (dir, cfg)
}

fn load(dir: &std::path::Path) -> Decoder {
    let cfg = zoo::load_config(dir).unwrap();
    let w = zoo::load_weights(dir, &cfg, &Device::Cpu).unwrap();
    Decoder::from_tensors(&cfg, &w).unwrap()
}

fn lora_config() -> LoraConfig {
    LoraConfig {
        rank: RANK,
        alpha: ALPHA,
        targets: TARGETS.iter().map(|t| t.to_string()).collect(),
    }
}

fn seqs(seed: u64, n: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut r = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let len = 6 + r.below(14) as usize;
            (0..len).map(|_| r.below(vocab as u64) as u32).collect()
        })
        .collect()
}

fn values(v: &Var) -> Vec<f32> {
    v.tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Forward + backward of `m` on `seqs` with seed coefficients from `seed`: the log-probs,
/// every gradient by name and the ledger's peak.
fn pass(m: &Decoder, s: &[Vec<u32>], seed: u64) -> (Vec<f32>, HashMap<String, Vec<f32>>, usize) {
    let batch = ActorModel::batch(m, s).unwrap();
    let n = batch.num_tokens();
    let coeff = Tensor::from_vec(normal_vec(n, 0.0, 1.0, seed), n, &Device::Cpu).unwrap();
    let mut cx = Cx::new(Plan::store_all());
    let logp = m.token_logprobs(&mut cx, &batch).unwrap();
    let mut g = Grads::new();
    cx.backward(&logp, &coeff, &mut g).unwrap();
    let grads = m
        .named_params()
        .into_iter()
        .filter_map(|(name, v)| {
            let t = g.get(v.id())?;
            Some((name, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        })
        .collect();
    (values(&logp), grads, cx.memory().peak_saved_bytes())
}

/// `[r, c]` row-major product helpers in f64 (the reference's own rounding is negligible
/// next to the f32 bound below).
fn matmul(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * m];
    for i in 0..n {
        for j in 0..m {
            let s: f64 = (0..k)
                .map(|t| a[i * k + t] as f64 * b[t * m + j] as f64)
                .sum();
            out[i * m + j] = s as f32;
        }
    }
    out
}

fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0f32; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = a[i * c + j];
        }
    }
    out
}

/// Relative L2 bound on the adapters' gradients against the merged model's chain rule,
/// and on the log-probs.
///
/// The LoRA model computes `x W^T + s (x A^T) B^T` and the merged one `x (W + s B A)^T`,
/// both in f32 (unit roundoff `u = 2^-24 ~ 6e-8`): per projection output the two differ by
/// the rounding of sums of `in = 64` products, `~sqrt(64) u ~ 5e-7` relative, carried
/// through two layers of attention and MLP and the head's log-softmax, and the gradients
/// are sums over ~80 rows of such terms: `~1e-6..1e-5`. 1e-4 leaves 10x; a real error (a
/// missing `alpha / rank`, a transposed `A`, a gradient reaching a frozen weight) is O(1).
const BOUND: f64 = 1e-4;

/// The adapters' gradients are the chain rule of the merged weight's: with
/// `W' = W + s B A`, `dL/dB = s G A^T` and `dL/dA = s B^T G` where `G = dL/dW'`; the base
/// weights get none.
#[test]
fn adapter_gradients_follow_the_merged_weights() {
    let (dir, cfg) = zoo_dir("grad");
    let mut m = load(&dir);
    m.add_lora(&lora_config(), 11).unwrap();
    // B is zero at init; give it values so that A's gradient is not zero too.
    let mut r = 0u64;
    for (name, v) in m.named_params_mut() {
        if name.ends_with("lora_B.weight") {
            let dims = v.dims().to_vec();
            r += 1;
            let t = Tensor::from_vec(
                normal_vec(dims[0] * dims[1], 0.0, 0.05, 40 + r),
                dims.as_slice(),
                &Device::Cpu,
            )
            .unwrap();
            v.set_tensor(t).unwrap();
        }
    }
    // The trainable parameters are the adapters alone.
    let trainable: Vec<String> = ActorModel::named_params(&m)
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(trainable.len(), cfg.num_hidden_layers * TARGETS.len() * 2);
    assert!(
        trainable.iter().all(|n| n.contains(".lora_")),
        "{trainable:?}"
    );

    // The merged model: every weight as loaded, q_proj / v_proj replaced by W + s B A.
    let scale = ALPHA / RANK as f64;
    let all: HashMap<String, Vec<f32>> = m
        .named_params()
        .into_iter()
        .map(|(n, v)| (n, values(&v)))
        .collect();
    let shapes: HashMap<String, Vec<usize>> = m
        .named_params()
        .into_iter()
        .map(|(n, v)| (n, v.dims().to_vec()))
        .collect();
    let mut merged_w: HashMap<String, Tensor> = HashMap::new();
    for (name, v) in m.named_params() {
        if name.contains(".lora_") {
            continue;
        }
        let mut w = values(&v);
        if let Some(base) = name.strip_suffix(".weight") {
            if let (Some(a), Some(b)) = (
                all.get(&format!("{base}.lora_A.weight")),
                all.get(&format!("{base}.lora_B.weight")),
            ) {
                let (out, inp) = (shapes[&name][0], shapes[&name][1]);
                let ba = matmul(b, a, out, RANK, inp);
                for (x, d) in w.iter_mut().zip(ba) {
                    *x = (*x as f64 + scale * d as f64) as f32;
                }
            }
        }
        merged_w.insert(
            name.clone(),
            Tensor::from_vec(w, shapes[&name].as_slice(), &Device::Cpu).unwrap(),
        );
    }
    let merged = Decoder::from_tensors(&cfg, &merged_w).unwrap();

    let s = seqs(3, 5, cfg.vocab_size);
    let (lp_lora, g_lora, _) = pass(&m, &s, 7);
    let (lp_merged, g_merged, _) = pass(&merged, &s, 7);
    let e = rel_l2(&lp_lora, &lp_merged);
    assert!(e < BOUND, "log-probs differ: rel L2 {e:e}");
    // No gradient reaches a frozen weight.
    assert!(
        g_lora.keys().all(|n| n.contains(".lora_")),
        "{:?}",
        g_lora.keys().collect::<Vec<_>>()
    );
    let mut checked = 0;
    for l in 0..cfg.num_hidden_layers {
        for t in TARGETS {
            let base = format!("model.layers.{l}.self_attn.{t}");
            let g = &g_merged[&format!("{base}.weight")];
            let (out, inp) = (
                shapes[&format!("{base}.weight")][0],
                shapes[&format!("{base}.weight")][1],
            );
            let a = &all[&format!("{base}.lora_A.weight")];
            let b = &all[&format!("{base}.lora_B.weight")];
            let s_ = scale as f32;
            let want_b: Vec<f32> = matmul(g, &transpose(a, RANK, inp), out, inp, RANK)
                .into_iter()
                .map(|x| x * s_)
                .collect();
            let want_a: Vec<f32> = matmul(&transpose(b, out, RANK), g, RANK, out, inp)
                .into_iter()
                .map(|x| x * s_)
                .collect();
            let eb = rel_l2(&g_lora[&format!("{base}.lora_B.weight")], &want_b);
            let ea = rel_l2(&g_lora[&format!("{base}.lora_A.weight")], &want_a);
            assert!(eb < BOUND, "{base} lora_B: rel L2 {eb:e}");
            assert!(ea < BOUND, "{base} lora_A: rel L2 {ea:e}");
            checked += 2;
        }
    }
    assert_eq!(checked, 8);
    std::fs::remove_dir_all(&dir).ok();
}

/// Frozen weights are saved by reference, never as activations: the same LoRA model
/// with its base weights made constants instead (the only way to hold an untrained weight
/// before `Var::frozen`) saves every weight an op reads in backward as activation memory,
/// byte for byte more than the frozen model's saved state.
#[test]
fn frozen_weights_are_never_activation_memory() {
    let (dir, cfg) = zoo_dir("mem");
    let mut m = load(&dir);
    m.add_lora(&lora_config(), 1).unwrap();
    let mut c = load(&dir);
    c.add_lora(&lora_config(), 1).unwrap();
    for (_, v) in c.named_params_mut() {
        if !v.requires_grad() {
            *v = Var::constant(v.tensor().clone());
        }
    }
    let s = seqs(4, 5, cfg.vocab_size);
    let (lp_f, g_f, saved_frozen) = pass(&m, &s, 2);
    let (lp_c, g_c, saved_constant) = pass(&c, &s, 2);
    // The same function and the same adapter gradients either way.
    assert_eq!(lp_f, lp_c);
    assert_eq!(g_f, g_c);
    // Every projection's backward needs its weight for the input's gradient, so a
    // constant weight is saved by its op (all of them alive at the end of the forward,
    // where the saved state peaks); a frozen one is referenced like a parameter.
    let projections: usize = m
        .named_params()
        .iter()
        .filter(|(n, v)| !v.requires_grad() && n.contains("_proj."))
        .map(|(_, v)| v.elem_count() * 4)
        .sum();
    assert!(projections > 0);
    assert!(
        saved_constant >= saved_frozen + projections,
        "saved state {saved_frozen} bytes with frozen weights, {saved_constant} with constants: the {projections} bytes of projection weights are not all kept out of activation memory"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// GRPO on the adapters alone, through the library's actor update with the allocator:
/// the adapters move, every frozen weight stays bit for bit, AdamW keeps moments for the
/// adapters only, and a checkpoint of the trainable parameters restores them exactly.
#[test]
fn grpo_trains_the_adapters_alone() {
    let (dir, cfg) = zoo_dir("grpo");
    let mut m = load(&dir);
    m.add_lora(&lora_config(), 3).unwrap();
    let frozen_before: Vec<(String, Vec<f32>)> = m
        .named_params()
        .into_iter()
        .filter(|(n, _)| !n.contains(".lora_"))
        .map(|(n, v)| (n, values(&v)))
        .collect();
    let s = seqs(10, 8, cfg.vocab_size);
    let rewards: Vec<f32> = (0..s.len()).map(|i| (i % 3 == 0) as u8 as f32).collect();
    let prompt_lens = vec![3; s.len()];
    let rollout = Rollout::scored(s, prompt_lens, rewards.clone());
    let adv = advantages(&rewards, 4, Default::default(), 1e-4).unwrap();
    let trainable: usize = ActorModel::named_params(&m)
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    let alloc = OnlineAllocator::new(
        StateBytes::adamw_f32(trainable),
        MemoryBudget::Factor(1.1),
        1e-2,
        &["bf16", "fp8-e4m3-b32"],
    );
    let settings = UpdateSettings {
        grpo: GrpoConfig::default(),
        layout: StepLayout::single(8),
        token_budget: 96,
        plan: Plan::store_all(),
        skip_zero_exposure: false,
        shared_prefix: false,
        allocator: Some(Rc::new(RefCell::new(alloc))),
    };
    let mut opt = AdamW::new(
        AdamWConfig {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
        },
        &m,
    );
    assert_eq!(opt.state.len(), cfg.num_hidden_layers * TARGETS.len() * 2);
    let rep = actor_update(&mut m, None, &mut opt, &rollout, &adv, &settings).unwrap();
    assert!(
        rep.grad_norm.is_finite() && rep.grad_norm > 0.0,
        "{}",
        rep.grad_norm
    );
    assert!(
        rep.planned_microbatches > 0,
        "the allocator planned nothing"
    );
    for (name, before) in &frozen_before {
        let now = values(
            &m.named_params()
                .into_iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1,
        );
        let same = now
            .iter()
            .zip(before)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "frozen weight {name} changed");
    }
    // B started at zero; AdamW moved every B.
    for (name, v) in ActorModel::named_params(&m) {
        if name.ends_with("lora_B.weight") {
            assert!(values(&v).iter().any(|x| *x != 0.0), "{name} did not move");
        }
    }
    // A checkpoint of the trainable parameters is the adapters; restoring it into a fresh
    // LoRA model of the same directory gives the trained one bit for bit.
    let tensors = model_tensors("model", &m).unwrap();
    assert!(tensors.iter().all(|t| t.name.contains(".lora_")));
    let ck = Checkpoint {
        run: serde_json::json!({}),
        state: serde_json::json!({}),
        tensors,
    };
    let mut fresh = load(&dir);
    fresh.add_lora(&lora_config(), 3).unwrap();
    restore_model(&ck, "model", &mut fresh).unwrap();
    for ((na, a), (nb, b)) in m.named_params().into_iter().zip(fresh.named_params()) {
        assert_eq!(na, nb);
        let same = values(&a)
            .iter()
            .zip(values(&b))
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{na} differs after restore");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad LoRA settings are errors naming the setting and the fix.
#[test]
fn bad_lora_settings_are_refused() {
    let (dir, _) = zoo_dir("bad");
    let mut m = load(&dir);
    let e = m
        .add_lora(
            &LoraConfig {
                targets: vec!["qkv".into()],
                ..lora_config()
            },
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown target `qkv`") && e.contains("q_proj"),
        "{e}"
    );
    let e = m
        .add_lora(
            &LoraConfig {
                rank: 0,
                ..lora_config()
            },
            0,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 0"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
