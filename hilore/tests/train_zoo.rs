//! `hilore train --model DIR`: GRPO on a zoo model directory written by the test (random
//! Llama-style weights, a WordLevel tokenizer.json), export of the trained weights, resume,
//! and errors for a directory that cannot be trained.

mod support;

use candle_core::Device;
use hilore_models::{zoo, DecoderConfig};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use support::{run_ok, run_refused};

fn tmpdir(name: &str) -> PathBuf {
    support::tmpdir("train-zoo", name)
}

/// A WordLevel tokenizer.json: whitespace pre-tokenizer, `<s>` prepended to a single
/// sequence by the post-processor, `</s>` the end token. A small vocabulary, so a random
/// policy answers right often enough for GRPO groups with mixed rewards.
fn tokenizer_json() -> String {
    support::word_level_tokenizer(
        &[(1, "<s>"), (2, "</s>")],
        json!({"<unk>": 0, "<s>": 1, "</s>": 2, "1": 3, "2": 4, "3": 5, "####": 6,
               "what": 7, "is": 8, "plus": 9}),
    )
}

fn llama_config(eos: Option<u32>) -> DecoderConfig {
    let mut v = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 12,
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 64, "tie_word_embeddings": false, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "bos_token_id": 1,
    });
    if let Some(e) = eos {
        v["eos_token_id"] = json!(e);
    }
    serde_json::from_value(v).unwrap()
}

/// A Llama-style model directory with random weights and, unless `tokenizer` is false,
/// the tokenizer.
fn model_dir(name: &str, eos: Option<u32>, tokenizer: bool) -> PathBuf {
    let dir = tmpdir(name).join("model");
    let tok = tokenizer.then(tokenizer_json);
    support::write_model(&dir, &llama_config(eos), 7, tok.as_deref());
    dir
}

/// Four problems; the last is held out.
fn dataset(dir: &Path) -> PathBuf {
    let p = dir.join("data.jsonl");
    let lines = [
        r#####"{"prompt": "what is 1 plus 2", "answer": "#### 3"}"#####,
        r#####"{"prompt": "what is 1 plus 1", "answer": "#### 2"}"#####,
        r#####"{"prompt": "what is 2 plus 1", "answer": "#### 3"}"#####,
        r#####"{"prompt": "what is 2 plus 2", "answer": "#### 4"}"#####,
    ];
    std::fs::write(&p, lines.join("\n") + "\n").unwrap();
    p
}

fn params(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let (model, _, tok) = zoo::load(dir, &Device::Cpu).unwrap();
    assert!(tok.is_some(), "{} has a tokenizer.json", dir.display());
    model
        .named_params()
        .into_iter()
        .map(|(n, v)| {
            let data = v.tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (n, (v.dims().to_vec(), data))
        })
        .collect()
}

/// The flags of a tiny run on `model` with `data`, writing under `work`.
fn train_args(model: &Path, data: &Path, work: &Path, steps: &str) -> Vec<String> {
    let s = |p: &Path| p.to_str().unwrap().to_string();
    [
        "train",
        "--model",
        &s(model),
        "--data",
        &s(data),
        "--heldout",
        "1",
        "--steps",
        steps,
        "--prompts",
        "2",
        "--group-size",
        "8",
        "--lr",
        "0.05",
        "--seed",
        "3",
        "--no-progress",
        "--checkpoint",
        &s(&work.join("run.ckpt")),
        "--metrics",
        &s(&work.join("metrics.jsonl")),
        "--summary",
        &s(&work.join("summary.json")),
    ]
    .iter()
    .map(|x| x.to_string())
    .collect()
}

#[test]
fn grpo_on_a_zoo_model_moves_its_weights_and_exports_them() {
    let model = model_dir("train", Some(2), true);
    let work = model.parent().unwrap().to_path_buf();
    let data = dataset(&work);
    let out = work.join("trained");
    let mut args = train_args(&model, &data, &work, "2");
    args.extend(["--out".into(), out.to_str().unwrap().into()]);
    let stdout = run_ok(&args);
    assert!(stdout.contains("exported the trained weights"), "{stdout}");

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(work.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 2);
    assert_eq!(
        summary["warm_start_steps"], 0,
        "no warm start on a zoo model"
    );
    assert_eq!(summary["model_dir"], model.to_str().unwrap());
    assert_eq!(summary["exported_to"], out.to_str().unwrap());
    assert_eq!(summary["heldout_prompts"], 1);
    assert!(summary["tokenizer"]
        .as_str()
        .unwrap()
        .starts_with("tokenizer.json fnv1a64:"));
    assert!(summary["task"]
        .as_str()
        .unwrap()
        .contains("3 train, 1 held out"));
    let metrics: Vec<Value> = std::fs::read_to_string(work.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(metrics.len(), 2);
    for (i, m) in metrics.iter().enumerate() {
        assert_eq!(m["step"], i + 1);
        let r = m["reward_mean"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&r), "{m}");
        // Responses are at most the longest solution (`#### 3`: 2 tokens) + `</s>`.
        assert!(m["response_len_mean"].as_f64().unwrap() <= 3.0, "{m}");
        assert!(m["logp_mismatch_max"].as_f64().unwrap() < 1e-3, "{m}");
    }
    assert!(
        metrics
            .iter()
            .any(|m| m["grad_norm"].as_f64().unwrap() > 0.0),
        "some group had mixed rewards: {metrics:?}"
    );

    // The export reloads with the zoo loader, keeps every tensor name and shape, and holds
    // the trained (moved) weights; the tokenizer is copied byte for byte.
    let before = params(&model);
    let after = params(&out);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    let mut moved = 0;
    for (name, (shape, w0)) in &before {
        let (shape1, w1) = &after[name];
        assert_eq!(shape, shape1, "{name}");
        moved += (w0 != w1) as usize;
    }
    assert!(moved > 0, "training changed no tensor");
    assert_eq!(
        std::fs::read_to_string(out.join("tokenizer.json")).unwrap(),
        tokenizer_json()
    );
    let cfg0 = zoo::load_config(&model).unwrap();
    let cfg1 = zoo::load_config(&out).unwrap();
    assert_eq!(cfg1.eos_token_ids(), vec![2]);
    assert_eq!(cfg0.vocab_size, cfg1.vocab_size);
    assert_eq!(cfg0.num_hidden_layers, cfg1.num_hidden_layers);
}

#[test]
fn an_interrupted_zoo_run_resumes_bit_for_bit() {
    let model = model_dir("resume", Some(2), true);
    let work = model.parent().unwrap().to_path_buf();
    let data = dataset(&work);
    let (a, b) = (work.join("a"), work.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let with_out = |mut v: Vec<String>, out: &Path| {
        v.extend(["--out".into(), out.join("export").to_str().unwrap().into()]);
        v
    };
    // An uninterrupted run and an interrupted one would each calibrate the allocator
    // (measured times differ, so lossy plans may too): this test of the zoo resume path
    // pins an exact policy. Resuming the allocator after its calibration is tested in
    // train_cli.
    let exact = |mut v: Vec<String>| {
        v.extend(["--policy".into(), "recompute".into()]);
        v
    };
    run_ok(&exact(with_out(train_args(&model, &data, &a, "2"), &a)));
    let mut first = exact(train_args(&model, &data, &b, "2"));
    first.extend(["--stop-after".into(), "1".into()]);
    run_ok(&first);
    let mut second = exact(with_out(train_args(&model, &data, &b, "2"), &b));
    second.push("--resume".into());
    let out = run_ok(&second);
    assert!(out.contains("resumed from"), "{out}");
    assert_eq!(
        params(&a.join("export")),
        params(&b.join("export")),
        "straight and resumed runs end with the same weights"
    );
    // The per-step numbers agree too (timings aside).
    let det = |dir: &Path| -> Vec<Value> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                json!([
                    v["step"],
                    v["reward_mean"],
                    v["loss"],
                    v["grad_norm"],
                    v["kl"]
                ])
            })
            .collect()
    };
    assert_eq!(det(&a), det(&b));
    assert_eq!(det(&a).len(), 2);
}

#[test]
fn a_model_without_tokenizer_json_is_refused_naming_the_file() {
    let model = model_dir("notok", Some(2), false);
    let work = model.parent().unwrap().to_path_buf();
    let data = dataset(&work);
    let args = train_args(&model, &data, &work, "1");
    let err = run_refused(&args);
    let want = model.join("tokenizer.json");
    assert!(err.contains(want.to_str().unwrap()), "{err}");
    assert!(err.contains("not found"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_model_without_an_end_token_is_refused_naming_the_field() {
    let model = model_dir("noeos", None, true);
    // Without eos_token_id the tokenizer's `</s>` is the stop token.
    let work = model.parent().unwrap().to_path_buf();
    let data = dataset(&work);
    run_ok(&train_args(&model, &data, &work, "1"));
    // A tokenizer without any end token and a config without eos_token_id: refused.
    let tok = tokenizer_json().replace("\"</s>\"", "\"<end>\"");
    std::fs::write(model.join("tokenizer.json"), tok).unwrap();
    // --force: the first run's files are in `work`.
    let mut args = train_args(&model, &data, &work, "1");
    args.push("--force".into());
    let err = run_refused(&args);
    assert!(err.contains("eos_token_id"), "{err}");
    assert!(err.contains("config.json"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn model_runs_need_a_dataset_and_refuse_config() {
    let model = model_dir("flags", Some(2), true);
    let work = model.parent().unwrap().to_path_buf();
    let m = model.to_str().unwrap();
    let err = run_refused(&["train", "--model", m, "--task", "arithmetic"]);
    assert!(err.contains("--data FILE.jsonl"), "{err}");
    let data = dataset(&work);
    let cfg = model.join("config.json");
    let mut args = train_args(&model, &data, &work, "1");
    args.extend(["--config".into(), cfg.to_str().unwrap().into()]);
    let err = run_refused(&args);
    assert!(err.contains("--config and --model"), "{err}");
}
