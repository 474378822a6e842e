//! `hilore bench` end to end on a tiny decoder: the JSON has the documented fields, every
//! budgeted policy's measured peak is within its budget and equal to the simulator's
//! prediction byte for byte, the exact policies reproduce the exact gradient, and the
//! charts are written. Timings are not asserted (they depend on the machine).

mod support;

use std::path::Path;
use support::{hilore, run_ok, tmpdir};

const TINY: &str = r#"{"vocab_size":128,"hidden_size":32,"intermediate_size":88,"num_hidden_layers":3,
"num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"model_type":"llama"}"#;

/// `hilore bench` on the tiny decoder (its config written into `dir`), one repetition,
/// groups of 4, quiet, followed by `extra`.
fn tiny_bench(dir: &Path, extra: &[&str]) -> Vec<String> {
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, TINY).unwrap();
    let mut v: Vec<String> = ["bench", "--quiet", "--config"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(cfg.display().to_string());
    v.extend(
        ["--group", "4", "--reps", "1"]
            .iter()
            .map(|s| s.to_string()),
    );
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn bench_json_and_plots() {
    let dir = tmpdir("bench-test", "json");
    let json = dir.join("bench.json");
    let plots = dir.join("plots");
    run_ok(&tiny_bench(
        &dir,
        &[
            "--rows",
            "160",
            "--prompts",
            "3",
            "--budgets",
            "1.05,1.5",
            "--risk-targets",
            "0.03",
            "--json",
            path(&json),
            "--plot",
            path(&plots),
        ],
    ));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(v["config"].is_object());
    let policies = v["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    for want in [
        "store-all",
        "full-recompute (GC)",
        "selective (Megatron)",
        "budgeted-recompute",
        "compress-all (fp8)",
        "adacc-style",
        "hilore",
        "hilore (exposure-blind)",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    // HiLoRe is compared with baselines only, never with itself or its ablation.
    for key in [
        "fastest_in_budget_baseline",
        "fastest_in_budget_baseline_by_cpu",
        "fastest_on_target_baseline",
        "fastest_on_target_baseline_by_cpu",
    ] {
        let b = v["acceptance"][key].as_str().unwrap();
        assert!(!b.starts_with("hilore"), "{key} is {b}");
    }
    for p in policies
        .iter()
        .chain(v["budget_sweep"].as_array().unwrap())
        .chain(v["risk_sweep"].as_array().unwrap())
    {
        for key in [
            "policy",
            "budget_factor",
            "tokens_per_s",
            "ratio_to_gc",
            "peak_total_bytes",
            "peak_activation_bytes",
            "budget_bytes",
            "predicted_peak_bytes",
            "grad_cosine",
            "grad_rel_l2",
            "solve_seconds",
        ] {
            assert!(p.get(key).is_some(), "{} lacks {key}", p["policy"]);
        }
        // The simulator's prediction is the measured peak, for every policy.
        assert_eq!(p["peak_matches_prediction"], true, "{}", p["policy"]);
        assert_eq!(
            p["predicted_peak_bytes"], p["peak_total_bytes"],
            "{}",
            p["policy"]
        );
        if !p["budget_bytes"].is_null() {
            assert!(
                p["peak_total_bytes"].as_u64().unwrap() <= p["budget_bytes"].as_u64().unwrap(),
                "{} over budget",
                p["policy"]
            );
        }
    }
    // The on-target comparison only names baselines whose measured error meets the
    // target (the exact ones always do, so it is never empty).
    let target = v["config"]["target_rel_l2"].as_f64().unwrap();
    for key in [
        "fastest_on_target_baseline",
        "fastest_on_target_baseline_by_cpu",
    ] {
        let b = v["acceptance"][key].as_str().unwrap();
        let p = policies.iter().find(|p| p["policy"] == b).unwrap();
        assert!(p["grad_rel_l2"].as_f64().unwrap() <= target, "{key} is {b}");
    }
    // Exact policies reproduce the exact gradient bit for bit.
    for exact in ["store-all", "full-recompute (GC)", "budgeted-recompute"] {
        let p = policies.iter().find(|p| p["policy"] == exact).unwrap();
        assert_eq!(p["grad_rel_l2"].as_f64().unwrap(), 0.0, "{exact}");
    }
    let gc = policies
        .iter()
        .find(|p| p["policy"] == "full-recompute (GC)")
        .unwrap();
    assert_eq!(gc["ratio_to_gc"].as_f64().unwrap(), 1.0);
    for f in [
        "throughput_vs_memory.svg",
        "memory_timeline.svg",
        "risk_predicted_vs_measured.svg",
        "pareto_budget_sweep.svg",
        "throughput_vs_grad_error.svg",
    ] {
        let s = std::fs::read_to_string(plots.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(s.starts_with("<svg"), "{f}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `hilore bench --shared-prefix` (the math shape) runs every policy on shared-prefix
/// microbatches: each peak equal to the prediction and within its budget, the exact
/// policies' gradients the exact one bit for bit; the report says the layout, and full
/// recompute on the same draw unshared is measured beside them and named in the
/// acceptance figures. A shape
/// whose prompts cannot fit `--rows` is refused naming the rows it needs.
#[test]
fn bench_with_shared_prefixes() {
    let dir = tmpdir("bench-test", "shared");
    let json = dir.join("bench.json");
    run_ok(&tiny_bench(
        &dir,
        &[
            "--rows",
            "512",
            "--prompts",
            "2",
            "--shape",
            "math",
            "--shared-prefix",
            "--risk-targets",
            "0.03",
            // A draw whose groups do not all have equal rewards (seed 0's do): the
            // gradients compared below are nonzero.
            "--seed",
            "2",
            "--json",
            path(&json),
        ],
    ));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["config"]["shared_prefix"], true);
    assert!(
        v["config"]["zero_advantage_sequences"].as_u64() < v["config"]["sequences"].as_u64(),
        "the draw has no exposure: {}",
        v["config"]
    );
    assert_eq!(v["config"]["shape"], "math");
    for p in v["policies"].as_array().unwrap() {
        assert_eq!(p["peak_matches_prediction"], true, "{}", p["policy"]);
        if !p["budget_bytes"].is_null() {
            assert!(
                p["peak_total_bytes"].as_u64().unwrap() <= p["budget_bytes"].as_u64().unwrap(),
                "{} over budget",
                p["policy"]
            );
        }
        if ["store-all", "full-recompute (GC)", "budgeted-recompute"]
            .contains(&p["policy"].as_str().unwrap())
        {
            assert_eq!(p["grad_rel_l2"].as_f64().unwrap(), 0.0, "{}", p["policy"]);
        }
    }
    // Full recompute on the same draw unshared, measured in the same run: the budget's
    // reference. Its step gradient sums other microbatches in another order: within the
    // shared-prefix decoder tests' float32 bound of 1e-5 relative L2 (the same model's
    // sums), and not bit-identical (it is another summation, so a 0 would mean the row
    // ran the shared microbatches).
    let policies = v["policies"].as_array().unwrap();
    let unshared = policies
        .iter()
        .find(|p| p["policy"] == "full-recompute, unshared")
        .expect("the unshared reference row");
    assert_eq!(unshared["peak_matches_prediction"], true);
    let e = unshared["grad_rel_l2"].as_f64().unwrap();
    assert!(e > 0.0 && e <= 1e-5, "{e}");
    assert_eq!(
        unshared["peak_activation_bytes"],
        v["config"]["gc_peak_activation_bytes"]
    );
    assert!(
        v["config"]["unshared_microbatches"].as_u64().unwrap()
            >= v["config"]["microbatches"].as_u64().unwrap()
    );
    let acc = &v["acceptance"];
    let hil = policies.iter().find(|p| p["policy"] == "hilore").unwrap();
    let ratio = acc["hilore_shared_cpu_ratio_to_unshared_gc"]
        .as_f64()
        .unwrap();
    let expect =
        hil["tokens_per_cpu_s"].as_f64().unwrap() / unshared["tokens_per_cpu_s"].as_f64().unwrap();
    assert!(
        (ratio - expect).abs() <= 1e-12 * expect,
        "{ratio} vs {expect}"
    );
    // Every policy on shared microbatches; not the two unshared rows.
    assert_eq!(
        acc["cpu_ratios_to_unshared_gc"].as_array().unwrap().len(),
        policies.len() - 2
    );
    let compress = |name: &str| {
        let p = policies.iter().find(|p| p["policy"] == name).unwrap();
        assert_eq!(p["peak_matches_prediction"], true, "{name}");
        p["grad_rel_l2"].as_f64().unwrap()
    };
    let (shared, unshared) = (
        compress("compress-all (fp8)"),
        compress("compress-all (fp8), unshared"),
    );
    assert!(unshared > 0.0 && shared > 0.0, "{unshared} {shared}");
    let r = acc["compress_all_error_shared_over_unshared"]
        .as_f64()
        .unwrap();
    assert!((r - shared / unshared).abs() <= 1e-12 * r, "{r}");
    let (_, _, stderr) = hilore(&tiny_bench(
        &dir,
        &["--rows", "512", "--prompts", "2", "--shape", "long-prompt"],
    ));
    assert!(stderr.contains("give --rows of at least 2049"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn infeasible_budget_is_a_clear_error() {
    let dir = tmpdir("bench-test", "infeasible");
    let (_, _, stderr) = hilore(&tiny_bench(
        &dir,
        &[
            "--rows",
            "128",
            "--prompts",
            "2",
            "--budget",
            "0.5",
            "--risk-targets",
            "0.03",
        ],
    ));
    assert!(
        stderr.contains("smallest feasible budget is"),
        "expected the budgeted policies to name the smallest feasible budget: {stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `hilore compare` runs `hilore train` under full recompute and under `--policy hilore`
/// for each seed and reports the paired difference with the documented fields.
#[test]
fn compare_runs_paired_training() {
    let dir = tmpdir("bench-test", "compare");
    let json = dir.join("compare.json");
    run_ok(&[
        "compare",
        "--seeds",
        "0,1",
        "--json",
        path(&json),
        "--dir",
        path(&dir),
        "--",
        "--steps",
        "2",
        "--prompts",
        "8",
        "--sft-steps",
        "20",
        "--heldout",
        "10",
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for key in [
        "seeds",
        "gc_accuracy",
        "hilore_accuracy",
        "paired_diff_pp_mean",
        "paired_diff_pp_std",
        "gc_update_tokens_per_s",
        "hilore_update_tokens_per_s",
    ] {
        assert!(v.get(key).is_some(), "compare JSON lacks {key}");
    }
    assert_eq!(v["gc_accuracy"].as_array().unwrap().len(), 2);
    let runs = v["runs"].as_array().unwrap();
    assert!(runs.iter().any(|r| r["policy"] == "hilore"));
    // The statistics of the paired differences, sampled and greedy, from the per-seed
    // values in the same report.
    let diffs: Vec<f64> = v["paired_diff_pp"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let mean = (diffs[0] + diffs[1]) / 2.0;
    assert!((v["sampled"]["mean"].as_f64().unwrap() - mean).abs() < 1e-9);
    assert_eq!(v["sampled"]["n"], 2);
    for key in ["se", "ci95_low", "ci95_high", "sign_test_p"] {
        assert!(
            v["sampled"][key].is_number(),
            "sampled.{key}: {}",
            v["sampled"]
        );
    }
    assert_eq!(v["greedy"]["n"], 2);
    // Merging: the report and one new seed; seed 1 is in the report, so it is not run
    // again and counts once.
    let json2 = dir.join("merged.json");
    let args = |out: &std::path::Path, seeds: &str, merge: &std::path::Path| -> Vec<String> {
        [
            "compare",
            "--seeds",
            seeds,
            "--merge",
            path(merge),
            "--json",
            path(out),
            "--dir",
            path(&dir),
            "--",
            "--steps",
            "2",
            "--prompts",
            "8",
            "--sft-steps",
            "20",
            "--heldout",
            "10",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    run_ok(&args(&json2, "1,2", &json));
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json2).unwrap()).unwrap();
    assert_eq!(m["seeds"], serde_json::json!([0, 1, 2]));
    assert_eq!(m["sampled"]["n"], 3);
    assert_eq!(m["paired_diff_pp"][0], v["paired_diff_pp"][0]);
    // A report of other settings is refused, naming the file.
    let other = dir.join("other.json");
    let mut o = v.clone();
    o["train_args"] = serde_json::json!(["--steps", "99"]);
    std::fs::write(&other, o.to_string()).unwrap();
    let err = support::run_refused(&args(&json2, "3", &other));
    assert!(
        err.contains("other train arguments") && err.contains("other.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `hilore compare --arms`: each arm paired with GC, the dose-response trend over two risk
/// targets (a `+shared` arm at the default target stays out of it), and runs whose arithmetic does not depend on `--jobs` (an exact arm and GC
/// give the same accuracies with one job of two threads and two jobs of one thread).
#[test]
fn compare_arms_give_a_dose_response_and_jobs_change_no_result() {
    let dir = tmpdir("bench-test", "compare-arms");
    let tiny = [
        "--",
        "--steps",
        "2",
        "--prompts",
        "8",
        "--sft-steps",
        "20",
        "--heldout",
        "10",
    ];
    let compare = |json: &Path, seeds: &str, arms: &str, jobs: &str| {
        let mut a: Vec<String> = [
            "compare",
            "--seeds",
            seeds,
            "--arms",
            arms,
            "--jobs",
            jobs,
            "--json",
            path(json),
            "--dir",
            path(&dir),
            "--no-progress",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(tiny.iter().map(|s| s.to_string()));
        run_ok(&a);
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    let a = compare(
        &dir.join("a.json"),
        "0-1",
        "hilore@3e-2,hilore@3e-3,compress-bf16,hilore+shared",
        "2",
    );
    let arms = a["arms"].as_array().unwrap();
    let labels: Vec<&str> = arms.iter().map(|x| x["arm"].as_str().unwrap()).collect();
    assert_eq!(
        labels,
        [
            "hilore@3e-2",
            "hilore@3e-3",
            "compress-bf16",
            "hilore+shared"
        ]
    );
    for arm in arms {
        assert_eq!(arm["sampled"]["n"], 2, "{arm}");
        assert_eq!(arm["shared_prefix"], arm["arm"] == "hilore+shared", "{arm}");
    }
    // A `+shared` arm trains with shared prefixes, its reference without.
    let settings = |file: &str| {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap();
        // Absent when off.
        v["settings"]["shared_prefix"].as_bool().unwrap_or(false)
    };
    assert!(settings("summary-hilore+shared-0.json"));
    assert!(!settings("summary-recompute-0.json"));
    // The first arm fills the fields reports had before arms.
    assert_eq!(a["paired_diff_pp"], arms[0]["paired_diff_pp"]);
    let d = &a["dose_response"];
    assert_eq!(d["targets"], serde_json::json!([3e-3, 3e-2]));
    assert_eq!(d["seeds"], serde_json::json!([0, 1]));
    // log10(3e-2) - log10(3e-3) = 1 decade, so each seed's slope is its difference at
    // 3e-2 minus its difference at 3e-3 (up to the rounding of two log10s, < 1e-12 of
    // differences of at most 100 pp).
    let col = |i: usize| -> Vec<f64> {
        arms[i]["paired_diff_pp"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let (hi, lo) = (col(0), col(1));
    let want = ((hi[0] - lo[0]) + (hi[1] - lo[1])) / 2.0;
    let got = d["slope_sampled_pp_per_decade"]["mean"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-9, "slope {got}, want {want}");
    // One job of two threads: GC's and compress-bf16's accuracies of seed 0 bit for bit.
    let b = compare(&dir.join("b.json"), "0", "compress-bf16", "1");
    let acc = |v: &serde_json::Value, arm: &str| {
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["seed"] == 0 && r.get("arm").unwrap_or(&r["policy"]) == arm)
            .map(|r| {
                (
                    r["heldout_accuracy_after"].as_f64().unwrap().to_bits(),
                    r["heldout_greedy_accuracy_after"]
                        .as_f64()
                        .unwrap()
                        .to_bits(),
                )
            })
            .unwrap()
    };
    for arm in ["recompute", "compress-bf16"] {
        assert_eq!(
            acc(&a, arm),
            acc(&b, arm),
            "{arm}: --jobs changed the result"
        );
    }
    // The flags compare sets itself, and the reference as an arm, are refused.
    let err = support::run_refused(&[
        "compare",
        "--seeds",
        "0",
        "--dir",
        path(&dir),
        "--",
        "--policy",
        "store",
    ]);
    assert!(err.contains("--policy after `--`"), "{err}");
    let err = support::run_refused(&[
        "compare",
        "--seeds",
        "0",
        "--arms",
        "recompute",
        "--dir",
        path(&dir),
    ]);
    assert!(err.contains("reference"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
