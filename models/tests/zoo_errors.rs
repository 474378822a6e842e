//! Bad model directories: every error names the file, the tensor or field, and what was
//! expected, and nothing panics. And the tokenizer: prompts get the post-processor's
//! special tokens, completions none.

use candle_core::{DType, Device, Tensor};
use hilore_models::{zoo, Decoder, DecoderConfig, ModelError, Tokenizer};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hilore-zoo-err-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config() -> DecoderConfig {
    let v = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 16,
        "hidden_size": 8,
        "intermediate_size": 12,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 32,
    });
    serde_json::from_value(v).unwrap()
}

/// A valid model directory (random weights, f32), with a tokenizer when `words` is given.
fn model_dir(name: &str) -> PathBuf {
    let dir = tmpdir(name);
    let cfg = config();
    let m = Decoder::random(&cfg, 1, &Device::Cpu).unwrap();
    zoo::export(&m, &cfg, &dir).unwrap();
    dir
}

/// A WordLevel tokenizer over `words` (ids in order), whitespace pre-tokenizer, `<s>`
/// prepended to single sequences by the post-processor; saved as `dir/tokenizer.json`.
fn write_tokenizer(dir: &Path, words: &[&str]) {
    let wl = WordLevel::builder()
        .vocab(
            words
                .iter()
                .enumerate()
                .map(|(i, w)| (w.to_string(), i as u32))
                .collect(),
        )
        .unk_token("<unk>".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(wl);
    tok.with_pre_tokenizer(Some(Whitespace {}));
    tok.with_post_processor(Some(
        TemplateProcessing::builder()
            .try_single("<s> $A")
            .unwrap()
            .special_tokens(vec![("<s>", 1)])
            .build()
            .unwrap(),
    ));
    tok.add_special_tokens(&[
        AddedToken::from("<s>", true),
        AddedToken::from("</s>", true),
    ]);
    tok.save(dir.join("tokenizer.json"), false).unwrap();
}

const WORDS: [&str; 8] = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat"];

/// Loads `dir`, expects an error whose message contains every one of `parts`.
fn expect_err(dir: &Path, parts: &[&str]) -> String {
    let e = match zoo::load(dir, &Device::Cpu) {
        Ok(_) => panic!(
            "{} loaded, expected an error mentioning {parts:?}",
            dir.display()
        ),
        Err(e) => e.to_string(),
    };
    for p in parts {
        assert!(e.contains(p), "error does not mention `{p}`: {e}");
    }
    println!("{e}");
    e
}

fn weights(dir: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn save(dir: &Path, w: &HashMap<String, Tensor>) {
    candle_core::safetensors::save(w, dir.join("model.safetensors")).unwrap();
}

#[test]
fn missing_files() {
    let nowhere = std::env::temp_dir().join("hilore-zoo-err-no-such-model");
    expect_err(&nowhere, &["no-such-model", "not a directory", "expected"]);

    let dir = model_dir("no-config");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = zoo::load(&dir, &Device::Cpu).unwrap_err();
    assert!(matches!(e, ModelError::ConfigIo { .. }), "{e}");
    assert!(e.to_string().contains("config.json"), "{e}");

    let dir = model_dir("no-weights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    expect_err(
        &dir,
        &[
            "no-weights",
            "expected model.safetensors or model.safetensors.index.json",
        ],
    );
}

#[test]
fn truncated_weights() {
    let dir = model_dir("truncated");
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    expect_err(
        &dir,
        &[
            "model.safetensors",
            "truncated",
            &format!("expected a file of {} bytes", bytes.len()),
        ],
    );
    // Cut inside the JSON header, and before the header size.
    std::fs::write(&path, &bytes[..40]).unwrap();
    expect_err(&dir, &["model.safetensors", "truncated", "JSON header"]);
    std::fs::write(&path, &bytes[..5]).unwrap();
    expect_err(&dir, &["model.safetensors", "5 bytes", "8-byte header"]);
    std::fs::write(&path, b"").unwrap();
    expect_err(&dir, &["model.safetensors", "0 bytes"]);
}

#[test]
fn wrong_shape_dtype_or_missing_tensor() {
    let dir = model_dir("shape");
    let mut w = weights(&dir);
    let q = "model.layers.0.self_attn.q_proj.weight";
    w.insert(
        q.into(),
        Tensor::zeros((8, 4), DType::F32, &Device::Cpu).unwrap(),
    );
    save(&dir, &w);
    expect_err(
        &dir,
        &["model.safetensors", q, "has shape [8, 4]", "needs [8, 8]"],
    );

    let dir = model_dir("dtype");
    let mut w = weights(&dir);
    let e = "model.embed_tokens.weight";
    w.insert(
        e.into(),
        Tensor::zeros((16, 8), DType::I64, &Device::Cpu).unwrap(),
    );
    save(&dir, &w);
    expect_err(
        &dir,
        &[
            "model.safetensors",
            e,
            "I64",
            "expected a floating-point dtype",
        ],
    );

    let dir = model_dir("missing");
    let mut w = weights(&dir);
    w.remove("lm_head.weight");
    save(&dir, &w);
    expect_err(
        &dir,
        &[
            "model.safetensors",
            "lm_head.weight",
            "is missing",
            "[16, 8]",
            "tie_word_embeddings",
        ],
    );

    // bf16 and f16 weights are converted, not rejected.
    for dt in [DType::BF16, DType::F16] {
        let dir = model_dir("half");
        let w: HashMap<String, Tensor> = weights(&dir)
            .into_iter()
            .map(|(n, t)| (n, t.to_dtype(dt).unwrap()))
            .collect();
        save(&dir, &w);
        let (m, _, _) = zoo::load(&dir, &Device::Cpu).unwrap();
        assert!(m
            .named_params()
            .iter()
            .all(|(_, v)| v.dtype() == DType::F32));
    }
}

#[test]
fn bad_shards() {
    let dir = model_dir("shards");
    let w = weights(&dir);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    let mut first = HashMap::new();
    for (n, t) in &w {
        if n.starts_with("model.layers") {
            map.insert(n.clone(), "model-00002-of-00002.safetensors".into());
        } else {
            map.insert(n.clone(), "model-00001-of-00002.safetensors".into());
            first.insert(n.clone(), t.clone());
        }
    }
    candle_core::safetensors::save(&first, dir.join("model-00001-of-00002.safetensors")).unwrap();
    let index = |map: &serde_json::Map<String, Value>| {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string(&json!({ "weight_map": map })).unwrap(),
        )
        .unwrap()
    };
    index(&map);
    // The second shard is listed but absent.
    expect_err(
        &dir,
        &[
            "model-00002-of-00002.safetensors",
            "cannot read this shard",
            "model.safetensors.index.json",
        ],
    );
    // A needed tensor is not in the index at all.
    let mut short = map.clone();
    short.remove("model.norm.weight");
    index(&short);
    expect_err(
        &dir,
        &[
            "model.safetensors.index.json",
            "model.norm.weight",
            "not in the shard index",
        ],
    );
    // The index says a tensor is in a shard that does not hold it.
    let mut wrong = map.clone();
    for v in wrong.values_mut() {
        *v = "model-00001-of-00002.safetensors".into();
    }
    index(&wrong);
    expect_err(
        &dir,
        &[
            "model-00001-of-00002.safetensors",
            "model.layers.0",
            "is listed in",
            "not in this file",
        ],
    );
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": 3}",
    )
    .unwrap();
    expect_err(&dir, &["model.safetensors.index.json", "weight_map"]);
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn unsupported_architecture_or_rope() {
    let dir = model_dir("arch");
    edit_config(&dir, |v| {
        v["architectures"] = json!(["GPT2LMHeadModel"]);
        v.as_object_mut().unwrap().remove("model_type");
    });
    expect_err(
        &dir,
        &[
            "config.json",
            "`architectures`",
            "GPT2LMHeadModel",
            "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM",
        ],
    );

    let dir = model_dir("model-type");
    edit_config(&dir, |v| {
        v["model_type"] = json!("gemma");
        v.as_object_mut().unwrap().remove("architectures");
    });
    expect_err(
        &dir,
        &[
            "config.json",
            "`model_type`",
            "gemma",
            "llama, qwen2, qwen3, mistral",
        ],
    );

    let dir = model_dir("yarn");
    edit_config(&dir, |v| {
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
    });
    expect_err(
        &dir,
        &[
            "config.json",
            "`rope_scaling`",
            "yarn",
            "default, linear, llama3",
        ],
    );

    let dir = model_dir("rope-params");
    edit_config(&dir, |v| {
        v["rope_parameters"] = json!({"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5});
    });
    expect_err(
        &dir,
        &["config.json", "`rope_parameters`", "low_freq_factor"],
    );

    let dir = model_dir("window");
    edit_config(&dir, |v| {
        v["model_type"] = json!("mistral");
        v["architectures"] = json!(["MistralForCausalLM"]);
        v["sliding_window"] = json!(0);
    });
    expect_err(&dir, &["config.json", "`sliding_window`", "is 0"]);
}

#[test]
fn tokenizer_loads_checks_vocab_and_encodes_like_a_grpo_trainer() {
    let dir = model_dir("tokenizer");
    write_tokenizer(&dir, &WORDS);
    let (_, cfg, tok) = zoo::load(&dir, &Device::Cpu).unwrap();
    let tok = tok.expect("tokenizer.json is loaded");
    assert_eq!(tok.vocab_size(), WORDS.len());
    // The prompt gets the post-processor's <s>; the completion continues it without one.
    let p = tok.encode_prompt("the cat").unwrap();
    let c = tok.encode_completion("sat on the mat").unwrap();
    assert_eq!(p, vec![1, 3, 4]);
    assert_eq!(c, vec![5, 6, 3, 7]);
    assert_eq!(tok.token(5), "sat");
    assert_eq!(tok.decode(&c, true).unwrap(), "sat on the mat");
    assert!(cfg.vocab_size >= tok.vocab_size());

    // An export copies the tokenizer byte for byte.
    let (m, cfg, tok) = zoo::load(&dir, &Device::Cpu).unwrap();
    let out = tmpdir("tokenizer-out");
    zoo::export_with(&m, &cfg, tok.as_ref(), &out, DType::F32).unwrap();
    assert_eq!(
        std::fs::read(dir.join("tokenizer.json")).unwrap(),
        std::fs::read(out.join("tokenizer.json")).unwrap()
    );

    // A tokenizer with more ids than the model has embedding rows.
    let words: Vec<String> = (0..20).map(|i| format!("w{i}")).collect();
    let mut big: Vec<&str> = WORDS.to_vec();
    big.extend(words.iter().map(String::as_str));
    write_tokenizer(&dir, &big);
    expect_err(
        &dir,
        &[
            "tokenizer.json",
            "token id 27",
            "`vocab_size`",
            "config.json",
            "is 16",
            "expected every token id below 16",
        ],
    );

    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 1}").unwrap();
    expect_err(
        &dir,
        &["tokenizer.json", "expected a Hugging Face tokenizer.json"],
    );
    let e = Tokenizer::from_file(dir.join("nope.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("nope.json") && e.contains("cannot read"), "{e}");
}
