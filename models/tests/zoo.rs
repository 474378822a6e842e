//! Zoo checkpoints: the managed decoder loaded from a Hugging Face model directory gives
//! the logits and log-probs of candle-transformers' own implementation of the same
//! architecture on the same weights (Llama, Llama with llama3 RoPE scaling, Qwen2, Qwen3
//! with and without biases, Mistral with a sliding window), single-file and sharded
//! weights load the same, and export -> reload is bit-identical and loads in
//! candle-transformers.
//!
//! Every model here is written by the test: random weights (f32, or bf16 for one Qwen3
//! case) saved as safetensors next to an HF-style config.json.

mod support;

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama, mistral, qwen2, qwen3};
use hilore_models::{zoo, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::Cx;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use support::{bits, max_abs, max_magnitude};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hilore-zoo-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Random weights for `cfg` under their HF names: projections and embeddings `N(0, 0.2)`
/// (so the logits spread over several units and the comparison is not of near-constant
/// numbers), norm weights `1 + N(0, 0.1)`, biases `N(0, 0.2)`.
fn random_weights(cfg: &DecoderConfig, seed: u64) -> HashMap<String, Tensor> {
    let m = Decoder::random(cfg, seed, &Device::Cpu).unwrap();
    m.named_params()
        .into_iter()
        .map(|(n, v)| {
            let t = v.tensor().clone();
            let t = if n.contains("norm") {
                t
            } else {
                (t * 10.0).unwrap()
            };
            (n, t)
        })
        .collect()
}

/// Writes `config` and random weights (as `dtype`) to `dir`; returns the weights as saved.
fn write_model(dir: &Path, config: &Value, dtype: DType, seed: u64) -> HashMap<String, Tensor> {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    let cfg: DecoderConfig = serde_json::from_value(config.clone()).unwrap();
    let mut w = random_weights(&cfg, seed);
    for t in w.values_mut() {
        *t = t.to_dtype(dtype).unwrap();
    }
    // A buffer HF checkpoints sometimes carry, which the decoder does not read.
    w.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    w
}

/// Sequences of 13 and 9 token ids below `vocab`.
fn sequences(vocab: usize) -> Vec<Vec<u32>> {
    let mut s = 12345u64;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) % vocab as u64) as u32
    };
    vec![
        (0..13).map(|_| next()).collect(),
        (0..9).map(|_| next()).collect(),
    ]
}

/// The zoo implementation under test: candle-transformers' model of `kind`, built afresh
/// from the config and the weights file for every sequence (so no KV cache carries over).
struct Zoo {
    kind: String,
    config: Value,
    tensors: HashMap<String, Tensor>,
}

impl Zoo {
    fn load(kind: &str, candle_cfg: &Value, dir: &Path) -> Zoo {
        let tensors =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        Zoo {
            kind: kind.to_string(),
            config: candle_cfg.clone(),
            tensors,
        }
    }

    /// Logits `[T, vocab]` of every position of `ids`.
    fn logits(&mut self, ids: &[u32]) -> Tensor {
        let dev = Device::Cpu;
        let t = ids.len();
        let vb = || VarBuilder::from_tensors(self.tensors.clone(), DType::F32, &dev);
        let input = |n: usize| Tensor::new(&ids[..n], &dev).unwrap().unsqueeze(0).unwrap();
        let head = self
            .tensors
            .get("lm_head.weight")
            .or_else(|| self.tensors.get("model.embed_tokens.weight"))
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let c = self.config.clone();
        match self.kind.as_str() {
            // Llama and Mistral return the last position's logits only: one forward per
            // prefix.
            "llama" => {
                let lc: llama::LlamaConfig = serde_json::from_value(c).unwrap();
                let cfg = lc.into_config(false);
                let m = llama::Llama::load(vb(), &cfg).unwrap();
                let rows: Vec<Tensor> = (1..=t)
                    .map(|n| {
                        let mut cache = llama::Cache::new(false, DType::F32, &cfg, &dev).unwrap();
                        m.forward(&input(n), 0, &mut cache)
                            .unwrap()
                            .squeeze(0)
                            .unwrap()
                    })
                    .collect();
                Tensor::stack(&rows, 0).unwrap()
            }
            "mistral" => {
                let cfg: mistral::Config = serde_json::from_value(c).unwrap();
                let mut m = mistral::Model::new(&cfg, vb()).unwrap();
                let rows: Vec<Tensor> = (1..=t)
                    .map(|n| {
                        m.clear_kv_cache();
                        m.forward(&input(n), 0).unwrap().i((0, 0)).unwrap()
                    })
                    .collect();
                Tensor::stack(&rows, 0).unwrap()
            }
            // Qwen2 and Qwen3 return every position's normed hidden state; the head is the
            // matmul with `lm_head.weight` (or the embedding, tied).
            "qwen2" => {
                let cfg: qwen2::Config = serde_json::from_value(c).unwrap();
                let mut m = qwen2::Model::new(&cfg, vb()).unwrap();
                let h = m.forward(&input(t), 0, None).unwrap().squeeze(0).unwrap();
                h.matmul(&head.t().unwrap()).unwrap()
            }
            "qwen3" => {
                let cfg: qwen3::Config = serde_json::from_value(c).unwrap();
                let mut m = qwen3::Model::new(&cfg, vb()).unwrap();
                let h = m.forward(&input(t), 0).unwrap().squeeze(0).unwrap();
                h.matmul(&head.t().unwrap()).unwrap()
            }
            other => panic!("no zoo model {other}"),
        }
    }
}

/// Unit roundoff of f32.
const U: f64 = f32::EPSILON as f64 / 2.0;

/// The max abs difference allowed between two f32 evaluations of the same logits.
///
/// Each side computes every value by dot products in f32; a dot product of length `K`
/// carries an error of at most `K u sum|a_i b_i|` (`u = 2^-24`, first order), and the two
/// implementations sum in different orders (matmul blocking, fused vs composed RMSNorm and
/// softmax, RoPE tables from f32 vs f64 angles), so their difference is at most twice one
/// side's error. Along the longest dependency chain from the embedding to a logit, the
/// dot lengths add up: per layer the input norm (`hidden`), the q/k projection (`hidden`),
/// q/k norms (`head_dim`, Qwen3), the scores (`head_dim`), the softmax and `P V` (`T`), the
/// output projection (`q_dim`), the MLP norm (`hidden`), gate/up (`hidden`) and down
/// (`intermediate`); then the final norm and the head (`hidden` each). With the values on
/// the chain of order `scale` (measured: the reference's largest |logit|, at least 1), the
/// first-order bound is
/// `2 u K_chain scale x (1 + residual growth)`; the RoPE angle differs by at most
/// `2 u pos |inv_freq|` (f32 product and f32 frequency on candle's side), which is inside
/// the `T` term. A safety factor of 4 covers the second-order terms and the residual
/// stream adding each layer's error to the next.
fn logits_bound(cfg: &DecoderConfig, t: usize, scale: f64) -> f64 {
    let qk_norm = if cfg.qk_norm() { cfg.head_dim } else { 0 };
    let per_layer =
        cfg.hidden_size * 4 + qk_norm + cfg.head_dim + t + cfg.q_dim() + cfg.intermediate_size;
    let chain = cfg.num_hidden_layers * per_layer + 2 * cfg.hidden_size;
    4.0 * 2.0 * U * chain as f64 * scale.max(1.0)
}

/// Log-probs are `logit - logsumexp(logits)`: `logsumexp` is 1-Lipschitz in the max norm,
/// so the logit bound enters twice, plus the f32 error of a `vocab`-term sum of
/// exponentials (`vocab u`) and of the subtraction (`u |logp|`, `|logp| <= 2 scale + ln V`).
fn logp_bound(cfg: &DecoderConfig, logits: f64, scale: f64) -> f64 {
    let v = cfg.vocab_size as f64;
    2.0 * logits + 2.0 * U * (v + 2.0 * scale + v.ln())
}

struct Case {
    name: &'static str,
    kind: &'static str,
    hf: Value,
    /// What candle-transformers' config struct reads, where it differs from `hf`.
    candle: Option<Value>,
    dtype: DType,
}

fn base(kind: &str) -> Value {
    json!({
        "model_type": kind,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "hidden_act": "silu",
        "tie_word_embeddings": false,
        "bos_token_id": 1,
        "eos_token_id": 2,
    })
}

fn merge(mut a: Value, b: Value) -> Value {
    for (k, v) in b.as_object().unwrap() {
        a[k] = v.clone();
    }
    a
}

fn cases() -> Vec<Case> {
    let qwen = json!({"sliding_window": 64, "max_window_layers": 2, "use_sliding_window": false});
    vec![
        Case {
            name: "llama",
            kind: "llama",
            hf: merge(
                base("llama"),
                json!({"architectures": ["LlamaForCausalLM"]}),
            ),
            candle: None,
            dtype: DType::F32,
        },
        Case {
            name: "llama3-rope-scaling",
            kind: "llama",
            // Frequencies in all three bands: wavelength 2 pi < 8 (kept), 2 pi sqrt(10)
            // in the smoothed band below 32, the rest divided by 8.
            hf: merge(
                base("llama"),
                json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                    "low_freq_factor": 0.5, "high_freq_factor": 2.0,
                    "original_max_position_embeddings": 16}, "tie_word_embeddings": true}),
            ),
            candle: None,
            dtype: DType::F32,
        },
        Case {
            name: "qwen2",
            kind: "qwen2",
            hf: merge(
                merge(base("qwen2"), qwen.clone()),
                json!({"architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6,
                    "tie_word_embeddings": true}),
            ),
            candle: None,
            dtype: DType::F32,
        },
        Case {
            name: "qwen3-bf16",
            kind: "qwen3",
            // Qwen3-0.6B's layout: head_dim larger than hidden / heads, tied head, no bias;
            // bf16 weights; RoPE in the newer nested layout.
            hf: {
                let mut v = merge(
                    merge(base("qwen3"), qwen.clone()),
                    json!({"head_dim": 16, "attention_bias": false, "tie_word_embeddings": true,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
                );
                v.as_object_mut().unwrap().remove("rope_theta");
                v
            },
            candle: Some(merge(
                merge(base("qwen3"), qwen.clone()),
                json!({"head_dim": 16, "attention_bias": false, "tie_word_embeddings": true,
                    "rope_theta": 1e6}),
            )),
            dtype: DType::BF16,
        },
        Case {
            name: "qwen3-bias-untied",
            kind: "qwen3",
            hf: merge(
                merge(base("qwen3"), qwen),
                json!({"head_dim": 8, "attention_bias": true}),
            ),
            candle: None,
            dtype: DType::F32,
        },
        Case {
            name: "mistral-window",
            kind: "mistral",
            // A window of 4 keys per query cuts into both sequences. candle-transformers
            // masks `j + W < i` (W + 1 keys), Hugging Face `j <= i - W` (W keys): the zoo
            // model is given W - 1 so both compute HF's window.
            hf: merge(base("mistral"), json!({"head_dim": 8, "sliding_window": 4})),
            candle: Some(merge(
                base("mistral"),
                json!({"head_dim": 8, "sliding_window": 3}),
            )),
            dtype: DType::F32,
        },
    ]
}

#[test]
fn logits_and_logprobs_match_candle_transformers() {
    let dev = Device::Cpu;
    let mut report = Vec::new();
    for (i, case) in cases().into_iter().enumerate() {
        let dir = tmpdir(case.name);
        write_model(&dir, &case.hf, case.dtype, 100 + i as u64);
        let (model, cfg, tok) = zoo::load(&dir, &dev).unwrap();
        assert!(tok.is_none());
        if case.name == "mistral-window" {
            assert_eq!(model.layers()[1].self_attn.window(), Some(4));
        }
        let mut zoo = Zoo::load(case.kind, case.candle.as_ref().unwrap_or(&case.hf), &dir);
        let seqs = sequences(cfg.vocab_size);
        let batch = TokenBatch::from_sequences(&seqs, &cfg, &dev).unwrap();
        let mut cx = Cx::inference();
        let ours = model.logits(&mut cx, &batch).unwrap().tensor().clone();
        let logp = model
            .token_logprobs(&mut Cx::inference(), &batch)
            .unwrap()
            .tensor()
            .clone();
        let (mut worst_logit, mut worst_logp, mut scale) = (0f64, 0f64, 0f64);
        let tmax = seqs.iter().map(Vec::len).max().unwrap();
        for (s, w) in seqs.iter().zip(batch.packing.offsets().windows(2)) {
            let inputs = &s[..s.len() - 1];
            let theirs = zoo.logits(inputs);
            let mine = ours.narrow(0, w[0], w[1] - w[0]).unwrap();
            worst_logit = worst_logit.max(max_abs(&mine, &theirs));
            scale = scale.max(max_magnitude(&theirs));
            let lsm = candle_nn::ops::log_softmax(&theirs, D::Minus1).unwrap();
            let targets = Tensor::new(&s[1..], &dev).unwrap().unsqueeze(1).unwrap();
            let their_logp = lsm.gather(&targets, 1).unwrap().squeeze(1).unwrap();
            let my_logp = logp.narrow(0, w[0], w[1] - w[0]).unwrap();
            worst_logp = worst_logp.max(max_abs(&my_logp, &their_logp));
        }
        let lb = logits_bound(&cfg, tmax, scale);
        let pb = logp_bound(&cfg, lb, scale);
        report.push(format!(
            "{:<20} max|dlogit| {worst_logit:.3e} (bound {lb:.2e}), max|dlogp| {worst_logp:.3e} (bound {pb:.2e}), max|logit| {scale:.2}",
            case.name
        ));
        assert!(
            worst_logit <= lb && worst_logp <= pb,
            "{}: logits differ by {worst_logit:e} (bound {lb:e}), log-probs by {worst_logp:e} (bound {pb:e})",
            case.name
        );
        // And the logits are not trivially equal: the model is doing something.
        assert!(
            scale > 1.0,
            "{}: logits too small to compare ({scale})",
            case.name
        );
        if case.kind == "mistral" {
            // The bound is tight enough to see a one-key difference in the window:
            // candle-transformers given HF's W itself attends to W + 1 keys.
            let off_by_one = merge(case.candle.clone().unwrap(), json!({"sliding_window": 4}));
            let mut wide = Zoo::load(case.kind, &off_by_one, &dir);
            let s = &seqs[0];
            let d = max_abs(
                &ours.narrow(0, 0, s.len() - 1).unwrap(),
                &wide.logits(&s[..s.len() - 1]),
            );
            assert!(
                d > 100.0 * lb,
                "a window of W + 1 keys differs by only {d:e}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!("{}", report.join("\n"));
}

#[test]
fn sharded_weights_load_like_a_single_file() {
    let dev = Device::Cpu;
    let hf = merge(base("llama"), json!({}));
    let one = tmpdir("single");
    let w = write_model(&one, &hf, DType::F32, 7);
    let sharded = tmpdir("sharded");
    std::fs::copy(one.join("config.json"), sharded.join("config.json")).unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", a),
        ("model-00002-of-00002.safetensors", b),
    ] {
        let t: HashMap<&str, Tensor> = part.iter().map(|n| (n.as_str(), w[*n].clone())).collect();
        candle_core::safetensors::save(&t, sharded.join(file)).unwrap();
        for n in part {
            map.insert(n.to_string(), file.into());
        }
    }
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_string(&json!({"metadata": {"total_size": 0}, "weight_map": map})).unwrap(),
    )
    .unwrap();
    let (m1, _, _) = zoo::load(&one, &dev).unwrap();
    let (m2, _, _) = zoo::load(&sharded, &dev).unwrap();
    for ((n1, v1), (n2, v2)) in m1.named_params().iter().zip(m2.named_params()) {
        assert_eq!(n1, &n2);
        assert_bits_equal(v1.tensor(), v2.tensor(), n1);
    }
    let _ = std::fs::remove_dir_all(&one);
    let _ = std::fs::remove_dir_all(&sharded);
}

fn assert_bits_equal(a: &Tensor, b: &Tensor, what: &str) {
    assert!(bits(a) == bits(b), "{what}: not bit-identical");
}

#[test]
fn export_reload_is_bit_identical_and_loads_in_candle_transformers() {
    let dev = Device::Cpu;
    for (i, case) in cases().into_iter().enumerate() {
        let src = tmpdir(&format!("export-src-{}", case.name));
        write_model(&src, &case.hf, case.dtype, 200 + i as u64);
        let (model, cfg, _) = zoo::load(&src, &dev).unwrap();
        let out = tmpdir(&format!("export-out-{}", case.name));
        zoo::export(&model, &cfg, &out).unwrap();

        // Reload: the same parameters bit for bit, the same config (up to the dtype).
        let (again, cfg2, _) = zoo::load(&out, &dev).unwrap();
        let (p1, p2) = (model.named_params(), again.named_params());
        assert_eq!(p1.len(), p2.len());
        for ((n1, v1), (n2, v2)) in p1.iter().zip(&p2) {
            assert_eq!(n1, n2);
            assert_bits_equal(v1.tensor(), v2.tensor(), n1);
        }
        assert_eq!(cfg2.model_type, cfg.model_type);
        assert_eq!(cfg2.rope_scaling, cfg.rope_scaling);
        assert_eq!(cfg2.eos_token_ids(), vec![2]);
        assert_eq!(cfg2.extra.get("torch_dtype"), Some(&Value::from("float32")));
        for l in 0..cfg.num_hidden_layers {
            assert_eq!(cfg2.layer_window(l), cfg.layer_window(l));
        }

        // candle-transformers reads the exported config.json with its own config struct
        // and the exported weights, and computes what it computes on the originals.
        let exported: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                .unwrap();
        let candle_cfg = match &case.candle {
            // The window is the one place candle's semantics differ (see `cases`).
            Some(c) if case.kind == "mistral" => merge(
                exported.clone(),
                json!({"sliding_window": c["sliding_window"]}),
            ),
            _ => exported.clone(),
        };
        let seq = &sequences(cfg.vocab_size)[0];
        let mut from_src = Zoo::load(case.kind, case.candle.as_ref().unwrap_or(&case.hf), &src);
        let mut from_out = Zoo::load(case.kind, &candle_cfg, &out);
        let (a, b) = (from_src.logits(seq), from_out.logits(seq));
        assert_bits_equal(&a, &b, case.name);
        let _ = std::fs::remove_dir_all(&src);
        let _ = std::fs::remove_dir_all(&out);
    }
}
