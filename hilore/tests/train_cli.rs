//! `hilore train` end to end at a tiny size: metrics and summary files, bit-identical
//! resume (after a clean stop, after a kill, and with the allocator's lossy plans after
//! its calibration), every task and policy, bad input.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{files_of, hilore, run_ok, size_in};

fn tmp(name: &str) -> PathBuf {
    support::tmpdir("train-cli", name)
}

/// A tiny run: a 1-layer model, a short warm start, small groups. Flags in `extra`
/// replace the defaults of the same name.
fn tiny(dir: &Path, extra: &[&str]) -> Vec<String> {
    let defaults: [(&str, &str); 15] = [
        ("--layers", "1"),
        ("--hidden", "16"),
        ("--heads", "2"),
        ("--kv-heads", "1"),
        ("--intermediate", "32"),
        ("--sft-steps", "30"),
        ("--sft-target-loss", "0"),
        ("--sft-batch", "16"),
        ("--prompts", "4"),
        ("--group-size", "4"),
        ("--heldout", "16"),
        ("--eval-samples", "1"),
        ("--lr", "1e-3"),
        ("--seed", "3"),
        ("--steps", "2"),
    ];
    support::train_args(&defaults, dir, extra)
}

/// The metrics lines without their timing fields (wall times and rates differ between
/// runs; everything else is determined by the seed).
fn deterministic_metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.retain(|k, _| !k.ends_with("_seconds") && !k.ends_with("_per_s"));
            v
        })
        .collect()
}

fn summary(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap()
}

/// The checkpoint's tensor bytes (everything after the header; format version 2: magic,
/// version, header length, header CRC-32, header).
fn checkpoint_tensors(dir: &Path) -> Vec<u8> {
    let b = std::fs::read(dir.join("run.ckpt")).unwrap();
    let n = u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize;
    b[28 + n..].to_vec()
}

/// The checkpoint's JSON header.
fn checkpoint_header(dir: &Path) -> serde_json::Value {
    let b = std::fs::read(dir.join("run.ckpt")).unwrap();
    let n = u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize;
    serde_json::from_slice(&b[28..28 + n]).unwrap()
}

/// Rewrites the checkpoint with `header` (same tensors, the header's checksum updated).
fn write_checkpoint_header(dir: &Path, header: &serde_json::Value) {
    let b = std::fs::read(dir.join("run.ckpt")).unwrap();
    let n = u64::from_le_bytes(b[16..24].try_into().unwrap()) as usize;
    let h = serde_json::to_vec(header).unwrap();
    let mut out = b[..16].to_vec();
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&h).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&b[28 + n..]);
    std::fs::write(dir.join("run.ckpt"), out).unwrap();
}

/// Copies every file of `from` into a fresh directory `to`.
fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn metrics_and_summary_have_the_documented_fields() {
    let dir = tmp("fields");
    let out = run_ok(&tiny(&dir, &["--steps", "3"]));
    assert!(out.contains("held-out accuracy"), "{out}");
    assert!(out.contains("tok/s"), "{out}");
    let m = deterministic_metrics(&dir);
    assert_eq!(m.len(), 3);
    let raw: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (i, line) in raw.iter().enumerate() {
        assert_eq!(line["step"], i + 1);
        for key in [
            "reward_mean",
            "accuracy",
            "response_len_mean",
            "kl",
            "clip_fraction",
            "update_tokens_per_s",
            "rollout_tokens_per_s",
            "peak_activation_bytes",
            "optimizer_state_bytes",
            "instances_store",
            "instances_compress",
            "instances_recompute",
        ] {
            assert!(
                line[key].is_number(),
                "metrics line {i} lacks a numeric `{key}`: {line}"
            );
        }
        assert!(line["peak_activation_bytes"].as_u64().unwrap() > 0);
        // The log-probs recorded while sampling (KV cache) and those of the update's
        // forward (the training path) are the same policy's: within the f32 bound of the
        // generation tests (2e-5, see models/tests/generate.rs).
        let mismatch = line["logp_mismatch_max"].as_f64().unwrap();
        assert!(
            mismatch <= 2e-5,
            "step {i}: rollout vs update log-probs differ by {mismatch}"
        );
        assert!(line["update_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let s = summary(&dir);
    for key in [
        "heldout_accuracy_before",
        "heldout_accuracy_after",
        "seconds",
    ] {
        assert!(s[key].is_number(), "summary lacks `{key}`: {s}");
    }
    assert_eq!(s["steps"], 3);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_after_a_stop_is_bit_identical() {
    // Countdown's format reward makes groups differ even for a tiny model, so the
    // policy moves every step and the comparison is not between frozen weights.
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        [&["--task", "countdown"][..], extra].concat()
    };
    let a = tmp("resume-a");
    run_ok(&tiny(
        &a,
        &with(&["--steps", "6", "--checkpoint-every", "2"]),
    ));
    let m = deterministic_metrics(&a);
    assert!(
        m.iter()
            .all(|l| l["exposure_total"].as_f64().unwrap() > 0.0),
        "every step updates the policy"
    );
    assert!(
        m[5]["kl"].as_f64().unwrap() > 0.0,
        "the policy moved away from the warm start"
    );
    let b = tmp("resume-b");
    let out = run_ok(&tiny(
        &b,
        &with(&[
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--stop-after",
            "3",
        ]),
    ));
    assert!(out.contains("stopped after step 3"), "{out}");
    assert!(
        !b.join("summary.json").exists(),
        "a stopped run writes no summary"
    );
    let out = run_ok(&tiny(
        &b,
        &with(&["--steps", "6", "--checkpoint-every", "2", "--resume"]),
    ));
    assert!(out.contains("resumed from"), "{out}");
    assert_eq!(deterministic_metrics(&a), deterministic_metrics(&b));
    assert_eq!(
        checkpoint_tensors(&a),
        checkpoint_tensors(&b),
        "final weights and optimizer state"
    );
    // The default policy: the allocator planned every step (here every plan is exact, so
    // the two runs' separate calibrations cannot part them; see the lossy test below).
    assert_eq!(summary(&a)["policy"], "hilore");
    assert_eq!(
        checkpoint_header(&b)["state"]["allocator"]["calibrated"],
        true
    );
    let (sa, sb) = (summary(&a), summary(&b));
    for key in [
        "heldout_accuracy_before",
        "heldout_accuracy_after",
        "heldout_greedy_accuracy_after",
        "heldout_reward_mean_after",
        "final_reward_mean",
        "steps",
    ] {
        assert_eq!(sa[key], sb[key], "{key}");
    }
    assert_eq!(sb["resumed_from_step"], 3);
    // --steps may grow on resume: the first 6 steps stay what they were.
    run_ok(&tiny(&b, &with(&["--steps", "7", "--resume"])));
    let m = deterministic_metrics(&b);
    assert_eq!(m.len(), 7);
    assert_eq!(m[..6], deterministic_metrics(&a)[..]);
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

#[test]
fn resume_after_a_kill_matches_an_uninterrupted_run() {
    // Enough steps (a few milliseconds each) that the kill lands mid-run.
    const STEPS: usize = 120;
    let steps = STEPS.to_string();
    let a = tmp("kill-a");
    run_ok(&tiny(&a, &["--task", "countdown", "--steps", &steps]));
    let b = tmp("kill-b");
    let args = tiny(
        &b,
        &[
            "--task",
            "countdown",
            "--steps",
            &steps,
            "--checkpoint-every",
            "1",
        ],
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_hilore"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Kill it (SIGKILL: no cleanup, possibly mid-write) once it has logged a few steps.
    let t0 = Instant::now();
    let mut logged = 0;
    while logged < 3 && t0.elapsed() < Duration::from_secs(300) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        logged = std::fs::read_to_string(b.join("metrics.jsonl"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let at_kill = std::fs::read_to_string(b.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert!(
        at_kill < STEPS,
        "killed mid-run (after {at_kill} of {STEPS} steps)"
    );
    let mut resume = args.clone();
    resume.push("--resume".into());
    run_ok(&resume);
    assert_eq!(deterministic_metrics(&a), deterministic_metrics(&b));
    // The summary too, but for wall times and rates and where it was resumed from: the
    // run's totals (final reward and accuracy, peak activations, instances per step)
    // came through the checkpoint.
    let untimed = |dir: &Path| {
        let mut v = summary(dir);
        let o = v.as_object_mut().unwrap();
        for k in [
            "seconds",
            "seconds_total",
            "warm_start_seconds",
            "rollout_tokens_per_s",
            "update_tokens_per_s",
            "resumed_from_step",
        ] {
            assert!(o.remove(k).is_some(), "summary has no {k}");
        }
        v
    };
    let (sa, sb) = (untimed(&a), untimed(&b));
    assert!(sa["final_reward_mean"].is_number(), "{sa}");
    assert!(sa["peak_activation_bytes"].as_u64().unwrap() > 0, "{sa}");
    assert_eq!(sa, sb);
    assert_eq!(checkpoint_tensors(&a), checkpoint_tensors(&b));
    // A temporary the kill may have left mid-write is gone after the resumed run.
    let temps: Vec<_> = std::fs::read_dir(&b)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(temps.is_empty(), "temporaries left: {temps:?}");
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// A size at which the allocator compresses: hidden 192 makes recomputing a unit cost
/// more than encoding and decoding its activations, two layers make full recompute save
/// memory (with one, backward re-creates all of it at once), and at 1.10 x full
/// recompute's peak there is room for compressed units but not for stored ones. With
/// seed 3 the first step has no exposure, so the allocator calibrates on step 2.
const LOSSY: [&str; 18] = [
    "--task",
    "countdown",
    "--layers",
    "2",
    "--hidden",
    "192",
    "--intermediate",
    "512",
    "--heads",
    "6",
    "--kv-heads",
    "2",
    "--token-budget",
    "512",
    "--prompts",
    "8",
    "--steps",
    "6",
];

#[test]
fn resume_after_calibration_with_lossy_plans_is_bit_identical() {
    // Two runs calibrate separately (measured times differ), so they are compared from a
    // common checkpoint written after the calibration: one continues uninterrupted, the
    // other stops and resumes. Their plans, which decide which units are compressed and
    // so the gradients' bits, must be the same.
    let base = tmp("lossy-base");
    let out = run_ok(&tiny(&base, &[&LOSSY[..], &["--stop-after", "2"]].concat()));
    assert!(out.contains("stopped after step 2"), "{out}");
    let header = checkpoint_header(&base);
    let alloc = &header["state"]["allocator"];
    assert_eq!(
        alloc["calibrated"], true,
        "calibrated before the copy: {alloc}"
    );
    let a = tmp("lossy-a");
    let b = tmp("lossy-b");
    copy_dir(&base, &a);
    copy_dir(&base, &b);
    run_ok(&tiny(&a, &[&LOSSY[..], &["--resume"]].concat()));
    let out = run_ok(&tiny(
        &b,
        &[&LOSSY[..], &["--resume", "--stop-after", "4"]].concat(),
    ));
    assert!(out.contains("stopped after step 4"), "{out}");
    run_ok(&tiny(&b, &[&LOSSY[..], &["--resume"]].concat()));
    let (ma, mb) = (deterministic_metrics(&a), deterministic_metrics(&b));
    assert_eq!(ma.len(), 6);
    // Not vacuous: after the resume point the plans compressed unit instances.
    let compressed: u64 = ma[4..]
        .iter()
        .map(|l| l["instances_compress"].as_u64().unwrap())
        .sum();
    assert!(compressed > 0, "no lossy plan after the resume: {ma:?}");
    assert_eq!(ma, mb);
    assert_eq!(checkpoint_tensors(&a), checkpoint_tensors(&b));
    // The resumed runs measured nothing again: their cost models (timings) are the one
    // that was checkpointed, bit for bit (a new calibration's times would differ), and
    // their whole allocator states agree (the gradient-norm scale moves with each step's
    // gradient, deterministically).
    for d in [&a, &b] {
        assert_eq!(
            checkpoint_header(d)["state"]["allocator"]["costs"],
            alloc["costs"]
        );
    }
    assert_eq!(
        checkpoint_header(&a)["state"]["allocator"],
        checkpoint_header(&b)["state"]["allocator"]
    );
    // A checkpoint without the allocator's state (as older versions wrote) resumes with a
    // note and a new calibration, not an error or a panic.
    let mut h = checkpoint_header(&base);
    h["state"].as_object_mut().unwrap().remove("allocator");
    let c = tmp("lossy-old");
    copy_dir(&base, &c);
    write_checkpoint_header(&c, &h);
    let out = run_ok(&tiny(&c, &[&LOSSY[..], &["--resume"]].concat()));
    assert!(out.contains("holds no allocator state"), "{out}");
    assert_eq!(deterministic_metrics(&c).len(), 6);
    // A corrupt allocator state is a clear error (the header of `c`'s own checkpoint, so
    // its tensors' checksums hold).
    let mut h = checkpoint_header(&c);
    h["state"]["allocator"] = serde_json::json!({"calibrated": "yes"});
    write_checkpoint_header(&c, &h);
    let args = tiny(&c, &[&LOSSY[..], &["--resume"]].concat());
    let a2: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, _, err) = hilore(&a2);
    assert_ne!(code, 0);
    assert!(err.contains("corrupt allocator state"), "{err}");
    for d in [base, a, b, c] {
        std::fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn every_task_and_policy_runs() {
    let dir = tmp("tasks");
    let data = dir.join("data.jsonl");
    let mut lines = String::new();
    for i in 0..40 {
        lines.push_str(&format!(
            "{{\"prompt\": \"{i}+1=\", \"answer\": \"add one #### {}\"}}\n",
            i + 1
        ));
    }
    std::fs::write(&data, lines).unwrap();
    let data = data.display().to_string();
    for extra in [
        vec!["--task", "countdown", "--steps", "2"],
        vec![
            "--task",
            "jsonl",
            "--data",
            &data,
            "--heldout",
            "8",
            "--steps",
            "2",
        ],
        vec![
            "--policy",
            "recompute",
            "--steps",
            "2",
            "--epochs",
            "2",
            "--beta",
            "0.1",
        ],
        vec![
            "--policy",
            "compress-int8-b32",
            "--steps",
            "2",
            "--aggregation",
            "seq-mean-token-mean",
        ],
        vec![
            "--steps",
            "2",
            "--skip-zero-exposure",
            "--scale-rewards",
            "none",
            "--group-size",
            "1",
        ],
        vec![
            "--steps",
            "2",
            "--token-budget",
            "12",
            "--temperature",
            "0.7",
            "--top-p",
            "0.9",
            "--mask-truncated-completions",
            "--loss-type",
            "dr_grpo",
            "--delta",
            "1.6",
        ],
    ] {
        // One directory for every run: each replaces the one before.
        let out = run_ok(&tiny(&dir, &[&extra[..], &["--force"]].concat()));
        assert!(out.contains("done:"), "{extra:?}: {out}");
        let m = deterministic_metrics(&dir);
        assert_eq!(m.len(), 2, "{extra:?}");
        if extra.contains(&"--group-size") {
            // G = 1: every advantage is 0, every sequence skipped, nothing run.
            assert_eq!(m[0]["update_tokens"], 0, "{extra:?}");
            assert_eq!(m[0]["skipped_sequences"], 4, "{extra:?}");
        }
        if extra.contains(&"12") {
            assert!(
                m[0]["microbatches"].as_u64().unwrap() > 1,
                "a small budget packs several microbatches"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tmp("bad");
    let err_of = |extra: &[&str]| {
        let args = tiny(&dir, extra);
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, err) = hilore(&a);
        assert_eq!(code, 2, "{extra:?} should fail: {err}");
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    let e = err_of(&["--task", "sudoku"]);
    assert!(
        e.contains("unknown task `sudoku`") && e.contains("arithmetic, countdown, jsonl"),
        "{e}"
    );
    let e = err_of(&["--task", "jsonl"]);
    assert!(e.contains("--data"), "{e}");
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n\n{\"prompt\": \"2+2=\", \"answer\": 4}\n{\"prompt\": \"3+3=\" \"answer\": \"6\"}\n",
    )
    .unwrap();
    let bads = bad.display().to_string();
    let e = err_of(&["--task", "jsonl", "--data", &bads]);
    assert!(
        e.contains(&format!("{bads}:4")),
        "file and line number: {e}"
    );
    std::fs::write(&bad, "{\"prompt\": \"q\", \"answer\": \"none\"}\n").unwrap();
    let e = err_of(&["--task", "jsonl", "--data", &bads]);
    assert!(
        e.contains(&format!("{bads}:1")) && e.contains("final number"),
        "{e}"
    );
    std::fs::write(&bad, "{\"prompt\": 5, \"answer\": \"1\"}\n").unwrap();
    let e = err_of(&["--task", "jsonl", "--data", &bads]);
    assert!(
        e.contains(&format!("{bads}:1")) && e.contains("\"prompt\""),
        "{e}"
    );
    let e = err_of(&["--task", "jsonl", "--data", "/nonexistent/data.jsonl"]);
    assert!(e.contains("/nonexistent/data.jsonl"), "{e}");
    let e = err_of(&["--token-budget", "4"]);
    assert!(
        e.contains("--token-budget 4 is smaller than one sequence"),
        "{e}"
    );
    let e = err_of(&["--policy", "fast"]);
    assert!(
        e.contains("unknown --policy `fast`") && e.contains("compress-<codec>"),
        "{e}"
    );
    let e = err_of(&["--policy", "store", "--refresh-costs"]);
    assert!(
        e.contains("--refresh-costs") && e.contains("--policy hilore"),
        "{e}"
    );
    let e = err_of(&["--policy", "compress-fp3"]);
    assert!(e.contains("fp3"), "{e}");
    // The older name is an alias of TRL's.
    let e = err_of(&["--eps-low", "1.5"]);
    assert!(e.contains("--epsilon") && e.contains("[0, 1)"), "{e}");
    let e = err_of(&["--aggregation", "sum"]);
    assert!(e.contains("--loss-type") && e.contains("dapo"), "{e}");
    let e = err_of(&["--digits", "0"]);
    assert!(e.contains("--digits"), "{e}");
    let e = err_of(&["--hidden", "15"]);
    assert!(e.contains("--hidden 15"), "{e}");
    let e = err_of(&["--resume"]);
    assert!(e.contains("run.ckpt"), "a missing checkpoint is named: {e}");
    // A checkpoint from other settings is refused, naming what differs.
    run_ok(&tiny(&dir, &["--steps", "1"]));
    let e = err_of(&["--steps", "2", "--resume", "--group-size", "2"]);
    assert!(e.contains("group_size: checkpoint 4, now 2"), "{e}");
    // A run without shared prefixes (as every run before they were the default) resumes
    // with --no-shared-prefix, and the refusal says so.
    run_ok(&tiny(
        &dir,
        &["--steps", "1", "--no-shared-prefix", "--force"],
    ));
    let e = err_of(&["--steps", "2", "--resume"]);
    assert!(e.contains("resume with --no-shared-prefix"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_new_run_never_replaces_an_earlier_runs_files_unless_forced() {
    let dir = tmp("guard");
    // Exact plans, so a rerun gives the same tensors.
    let args = tiny(&dir, &["--steps", "1", "--policy", "recompute"]);
    run_ok(&args);
    let before = files_of(&dir);
    let tensors_before = checkpoint_tensors(&dir);
    let names: Vec<&str> = before.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["metrics.jsonl", "run.ckpt", "summary.json"]);

    // The same command again: refused before any work, every file named, both flags given.
    let (code, out, err) = hilore(&args);
    assert_eq!(code, 2, "{err}");
    assert!(out.is_empty(), "work started: {out}");
    for f in [
        "run.ckpt",
        "metrics.jsonl",
        "summary.json",
        "--resume",
        "--force",
    ] {
        assert!(err.contains(f), "{f} not named: {err}");
    }
    assert_eq!(files_of(&dir), before);

    // A checkpoint write that fails (a file-size limit below the checkpoint's size,
    // SIGXFSZ ignored so the write gets EFBIG as on a full disk) leaves the old one whole
    // and no temporary beside it.
    let mut forced = args.clone();
    forced.push("--force".into());
    let (code, err) = support::hilore_with_file_limit(size_in(&before, "run.ckpt") / 2, &forced);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("run.ckpt"), "the checkpoint is named: {err}");
    // The same files, so no temporary either.
    assert_eq!(
        files_of(&dir),
        before,
        "a failed checkpoint write changed the run's files"
    );

    // --force starts over; the run is the same as the first (same seed).
    run_ok(&forced);
    assert_eq!(checkpoint_tensors(&dir), tensors_before);
    // --force and --resume contradict each other.
    let mut both = forced.clone();
    both.push("--resume".into());
    let (code, _, err) = hilore(&both);
    assert_eq!(code, 2);
    assert!(err.contains("--force") && err.contains("--resume"), "{err}");
}

#[test]
fn a_failed_export_of_the_trained_policy_keeps_the_old_model_in_out() {
    let dir = tmp("out-full");
    let out = dir.join("policy");
    let out_s = out.display().to_string();
    let args = tiny(
        &dir,
        &["--steps", "1", "--policy", "recompute", "--out", &out_s],
    );
    run_ok(&args);
    let before = files_of(&out);
    // Resumed at its last step the run trains nothing and writes no checkpoint, only the
    // export, here limited to half the weights' size.
    let mut again = args.clone();
    again.push("--resume".into());
    let (code, err) =
        support::hilore_with_file_limit(size_in(&before, "model.safetensors") / 2, &again);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.safetensors"),
        "the file is named: {err}"
    );
    assert_eq!(files_of(&out), before, "a failed export changed --out");
    // Without the limit the same resume exports again: the same weights.
    run_ok(&again);
    assert_eq!(files_of(&out), before);
}
