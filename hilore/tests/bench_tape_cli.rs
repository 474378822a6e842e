//! `hilore bench-tape` end to end on a tiny decoder: `LxN` lengths are separate cases, the
//! JSON has the documented fields, a directory written by `hilore export --config` loads
//! with `--model`, `--logprobs` writes tokens and log-probs, and bad lengths are refused
//! with an error that names the fix. Timings are not asserted (they depend on the machine).

mod support;

use serde_json::Value;
use std::path::Path;
use support::{run_ok, run_refused, tmpdir};

const TINY: &str = r#"{"vocab_size":128,"hidden_size":32,"intermediate_size":88,"num_hidden_layers":2,
"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"model_type":"llama"}"#;

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn lxn_lengths_are_cases_and_the_json_has_every_field() {
    let dir = tmpdir("bench-tape", "cases");
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, TINY).unwrap();
    let json = dir.join("tape.json");
    let stdout = run_ok(&[
        "bench-tape",
        "--config",
        path(&cfg),
        "--lengths",
        "16x3,24x2",
        "--plans",
        "store-all,recompute-all,candle-autograd",
        "--attention",
        "32",
        "--threads",
        "1",
        "--reps",
        "1",
        "--json",
        path(&json),
    ]);
    assert!(stdout.contains("per unit"), "{stdout}");
    let v = read_json(&json);
    assert_eq!(v["threads"], 1);
    assert_eq!(v["gemm_threads"], 1);
    assert!(v["model"].as_str().unwrap().contains("2 layers"));
    let cases = v["cases"].as_array().unwrap();
    let key = |c: &Value| {
        (
            c["lengths"].as_str().unwrap().to_string(),
            c["plan"].as_str().unwrap().to_string(),
        )
    };
    let got: Vec<(String, String)> = cases.iter().map(key).collect();
    let want: Vec<(String, String)> = [
        ("16x3", "store-all"),
        ("16x3", "recompute-all"),
        ("16x3", "candle-autograd"),
        ("24x2", "store-all"),
        ("24x2", "recompute-all"),
        ("24x2", "candle-autograd"),
        ("32", "attention"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(got, want);
    for c in cases {
        for k in [
            "lengths",
            "plan",
            "sequences",
            "tokens",
            "wall_seconds_median",
            "cpu_seconds_median",
            "cpu_per_wall",
            "peak_rss_growth_bytes",
            "first_pass_rss_growth_bytes",
            "peak_heap_growth_bytes",
            "per_unit_seconds",
            "wall_seconds",
            "cpu_seconds",
            "warmup_wall_seconds",
        ] {
            assert!(c.get(k).is_some(), "{:?} lacks {k}", key(c));
        }
        assert_eq!(c["wall_seconds"].as_array().unwrap().len(), 1);
        assert!(c["wall_seconds_median"].as_f64().unwrap() > 0.0);
        assert!(c["cpu_seconds_median"].as_f64().unwrap() >= 0.0);
        assert!(c["peak_heap_growth_bytes"].as_u64().unwrap() > 0);
    }
    // A sequence of L tokens gives L - 1 rows.
    assert_eq!(cases[0]["sequences"], 3);
    assert_eq!(cases[0]["tokens"], 3 * 15);
    assert_eq!(cases[3]["sequences"], 2);
    assert_eq!(cases[3]["tokens"], 2 * 23);
    assert_eq!(cases[6]["tokens"], 32);
    // Per-unit times for the tape's plans, none for the reference or the attention case.
    for c in [&cases[0], &cases[1], &cases[4]] {
        let u = c["per_unit_seconds"].as_object().unwrap();
        for name in hilore_models::plans::UNIT_NAMES
            .into_iter()
            .filter(|&u| u != "layer")
        {
            assert!(u[name].as_f64().unwrap() > 0.0, "{name}");
        }
    }
    assert!(cases[2]["per_unit_seconds"].is_null());
    assert!(cases[6]["per_unit_seconds"].is_null());
    // The reference's gradients are the tape's.
    let rel = cases[2]["grad_rel_l2_vs_store_all"].as_f64().unwrap();
    assert!(rel < 1e-4, "{rel}");
    // Recompute-all keeps less than store-all.
    assert!(
        cases[1]["peak_activation_bytes"].as_u64().unwrap()
            < cases[0]["peak_activation_bytes"].as_u64().unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_directory_written_by_export_loads_with_model() {
    let dir = tmpdir("bench-tape", "model");
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, TINY).unwrap();
    let model = dir.join("model");
    run_ok(&[
        "export",
        "--config",
        path(&cfg),
        "--seed",
        "3",
        "--out",
        path(&model),
    ]);
    assert!(model.join("model.safetensors").exists());
    let json = dir.join("tape.json");
    run_ok(&[
        "bench-tape",
        "--model",
        path(&model),
        "--lengths",
        "12,9",
        "--plans",
        "store-all",
        "--reps",
        "1",
        "--no-per-unit",
        "--json",
        path(&json),
    ]);
    let v = read_json(&json);
    assert!(v["model_source"].as_str().unwrap().starts_with("zoo model"));
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 1);
    assert_eq!(cases[0]["lengths"], "12,9");
    assert_eq!(cases[0]["sequences"], 2);
    assert_eq!(cases[0]["tokens"], 11 + 8);
    assert!(cases[0]["per_unit_seconds"].is_null());

    // The tokens and log-probs a comparison checks against.
    let lp = dir.join("logprobs.json");
    run_ok(&[
        "bench-tape",
        "--model",
        path(&model),
        "--lengths",
        "12x2",
        "--logprobs",
        path(&lp),
    ]);
    let v = read_json(&lp);
    let c = &v["cases"][0];
    assert_eq!(c["lengths"], "12x2");
    let seqs = c["sequences"].as_array().unwrap();
    assert_eq!(seqs.len(), 2);
    assert!(seqs.iter().all(|s| s.as_array().unwrap().len() == 12));
    let logp = c["logprobs"].as_array().unwrap();
    assert_eq!(logp.len(), 22);
    assert!(logp.iter().all(|x| x.as_f64().unwrap() < 0.0));

    let err = run_refused(&[
        "bench-tape",
        "--model",
        path(&model),
        "--config",
        path(&cfg),
    ]);
    assert!(err.contains("cannot be used with"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_lengths_are_refused_with_the_fix() {
    for (lengths, want) in [
        ("16x3,24", "write `24x1`"),
        ("16xq", "expected LENGTHxCOUNT, like `128x7`"),
        ("16x0", "at least one sequence"),
        ("1x4", "below 2"),
        ("16,,8", "item 2 is empty"),
    ] {
        let err = run_refused(&["bench-tape", "--lengths", lengths, "--reps", "1"]);
        assert!(err.contains(want), "--lengths {lengths}: {err}");
    }
}
