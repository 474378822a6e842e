//! `hilore score` and `hilore export` on a zoo model directory written by the test.

mod support;

use candle_core::Device;
use hilore_models::{zoo, DecoderConfig, TokenBatch};
use hilore_runtime::Cx;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use support::{files_of, hilore, run_ok, size_in};

fn tmpdir(name: &str) -> PathBuf {
    support::tmpdir("cli-zoo", name)
}

/// A WordLevel tokenizer.json: whitespace pre-tokenizer, `<s>` prepended to a single
/// sequence by the post-processor.
fn tokenizer_json() -> String {
    support::word_level_tokenizer(
        &[(1, "<s>")],
        json!({"<unk>": 0, "<s>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, "a": 7}),
    )
}

/// A Qwen3-style model directory with random weights and the tokenizer.
fn model_dir(name: &str) -> PathBuf {
    let dir = tmpdir(name);
    let cfg: DecoderConfig = serde_json::from_value(json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 12,
        "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 32, "tie_word_embeddings": true, "rope_theta": 1e6,
    }))
    .unwrap();
    support::write_model(&dir, &cfg, 3, Some(&tokenizer_json()));
    dir
}

/// `hilore <command> --model dir <flag> path` followed by the flags in `extra`.
fn on_model<'a>(
    command: &'a str,
    dir: &'a Path,
    flag: &'a str,
    path: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    let mut args = vec![
        command,
        "--model",
        dir.to_str().unwrap(),
        flag,
        path.to_str().unwrap(),
    ];
    args.extend(extra);
    args
}

fn write_input(dir: &Path, lines: &[&str]) -> PathBuf {
    let p = dir.join("input.jsonl");
    std::fs::write(&p, lines.join("\n")).unwrap();
    p
}

#[test]
fn score_prints_completion_logprobs_given_the_prompt() {
    let dir = model_dir("score");
    let input = write_input(
        &dir,
        &[
            r#"{"prompt": "the cat", "completion": "sat on the mat"}"#,
            "",
            r#"{"prompt": "a", "completion": ""}"#,
            r#"{"prompt": "the", "completion": "cat cat"}"#,
        ],
    );
    let out = run_ok(&on_model("score", &dir, "--input", &input, &["--json"]));
    let rows: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["line"], 1);
    assert_eq!(rows[0]["token_ids"], json!([4, 5, 2, 6]));
    assert_eq!(rows[0]["tokens"], json!(["sat", "on", "the", "mat"]));
    assert_eq!(rows[0]["prompt_tokens"], 3, "<s> the cat");
    assert_eq!(rows[1]["token_ids"], json!([]));
    assert_eq!(rows[1]["logprobs"], json!([]));
    assert_eq!(rows[2]["line"], 4);

    // The same numbers from the library, one sequence at a time: <s> prompt completion.
    let (model, cfg, _) = zoo::load(&dir, &Device::Cpu).unwrap();
    for (row, seq) in [(0, vec![1u32, 2, 3, 4, 5, 2, 6]), (2, vec![1, 2, 3, 3])] {
        let b = TokenBatch::from_sequences(std::slice::from_ref(&seq), &cfg, &Device::Cpu).unwrap();
        let lp: Vec<f32> = model
            .token_logprobs(&mut Cx::inference(), &b)
            .unwrap()
            .tensor()
            .to_vec1()
            .unwrap();
        let got: Vec<f64> = rows[row]["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let c = got.len();
        let want = &lp[lp.len() - c..];
        for (g, w) in got.iter().zip(want) {
            // Packed with other lines vs alone: the same per-row math; only a different
            // matmul blocking could differ, by f32 ulps of values of order 1.
            assert!((g - *w as f64).abs() < 1e-5, "{g} vs {w}");
        }
        // The sum is of the f32 values; the JSON prints each f32 in its shortest decimal
        // form, which reads back as a slightly different f64: a few f32 ulps per term.
        let sum: f64 = got.iter().sum();
        assert!((rows[row]["sum_logprob"].as_f64().unwrap() - sum).abs() < 1e-5);
    }

    let out = run_ok(&on_model("score", &dir, "--input", &input, &[]));
    assert!(
        out.contains("line 1: 3 prompt tokens, 4 completion tokens"),
        "{out}"
    );
    assert!(out.contains("\"mat\""), "{out}");
}

#[test]
fn score_errors_name_the_line_and_the_field() {
    let dir = model_dir("score-errors");
    let input = write_input(
        &dir,
        &[
            r#"{"prompt": "the cat", "completion": "sat"}"#,
            r#"{"prompt": "the cat"}"#,
        ],
    );
    let (code, _, err) = hilore(&on_model("score", &dir, "--input", &input, &[]));
    assert_eq!(code, 2);
    assert!(
        err.contains("input.jsonl:2") && err.contains("`completion`"),
        "{err}"
    );

    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let (code, _, err) = hilore(&on_model("score", &dir, "--input", &input, &[]));
    assert_eq!(code, 2);
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn export_writes_a_directory_that_reloads_bit_identically() {
    let dir = model_dir("export-src");
    let out = tmpdir("export-out");
    run_ok(&on_model("export", &dir, "--out", &out, &[]));
    let (a, _, _) = zoo::load(&dir, &Device::Cpu).unwrap();
    let (b, _, tok) = zoo::load(&out, &Device::Cpu).unwrap();
    assert!(tok.is_some());
    for ((n1, v1), (n2, v2)) in a.named_params().iter().zip(b.named_params()) {
        assert_eq!(n1, &n2);
        let x: Vec<f32> = v1.tensor().flatten_all().unwrap().to_vec1().unwrap();
        let y: Vec<f32> = v2.tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert!(
            x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{n1}"
        );
    }
    assert_eq!(
        std::fs::read(dir.join("tokenizer.json")).unwrap(),
        std::fs::read(out.join("tokenizer.json")).unwrap()
    );

    let half = tmpdir("export-bf16");
    run_ok(&on_model(
        "export",
        &dir,
        "--out",
        &half,
        &["--dtype", "bf16"],
    ));
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(half.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    zoo::load(&half, &Device::Cpu).unwrap();

    let (code, _, err) = hilore(&on_model("export", &dir, "--out", &dir, &[]));
    assert_eq!(code, 2);
    assert!(err.contains("model directory itself"), "{err}");
}

#[test]
fn export_never_replaces_a_model_unless_forced_and_a_failed_write_keeps_the_old_one() {
    let dir = model_dir("export-guard-src");
    let out = tmpdir("export-guard-out");
    // An older model in --out: another seed's random weights, same files.
    let cfg = dir.join("config.json");
    run_ok(&[
        "export",
        "--config",
        cfg.to_str().unwrap(),
        "--seed",
        "3",
        "--out",
        out.to_str().unwrap(),
    ]);
    let before = files_of(&out);
    assert!(before.iter().any(|(n, _)| n == "model.safetensors"));

    // Without --force: refused before any work, naming the directory, the file and the flag.
    let (code, _, err) = hilore(&on_model("export", &dir, "--out", &out, &[]));
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(out.to_str().unwrap())
            && err.contains("config.json")
            && err.contains("--force"),
        "{err}"
    );
    assert_eq!(files_of(&out), before);

    // With --force, limited to half the weights' size (a write past it fails as on a
    // full disk): an error, and the old model whole, with no temporary left.
    let (code, err) = support::hilore_with_file_limit(
        size_in(&before, "model.safetensors") / 2,
        &on_model("export", &dir, "--out", &out, &["--force"]),
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.safetensors"),
        "the failed file is named: {err}"
    );
    assert_eq!(files_of(&out), before, "a failed export changed --out");
    zoo::load(&out, &Device::Cpu).expect("the old model still loads");

    // With --force and room: replaced, and equal to an export into a fresh directory.
    run_ok(&on_model("export", &dir, "--out", &out, &["--force"]));
    let fresh = tmpdir("export-guard-fresh");
    run_ok(&on_model("export", &dir, "--out", &fresh, &[]));
    assert_eq!(files_of(&out), files_of(&fresh));
}
