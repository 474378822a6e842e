//! `hilore compare`: paired GRPO runs, full recompute (GC) against HiLoRe, same seeds.
//!
//! Each seed runs `hilore train` twice with the same arguments except `--policy`
//! (`recompute`, then `hilore`), in child processes of this binary, and reads both
//! summaries. The two runs of a seed share the task, the initial weights, the warm start
//! and the first rollout; they part only through the actor update's gradients (exact for
//! GC, within the risk budget for HiLoRe) and then through everything downstream, so the
//! paired difference of held-out accuracy measures what the lossy fidelities cost.

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

#[derive(Args)]
pub struct CompareArgs {
    /// Seeds to run (each: GC and HiLoRe).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2")]
    seeds: Vec<u64>,
    /// Write the result as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the runs' summaries, metrics and checkpoints go (default: a temporary
    /// directory).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Arguments passed to every `hilore train` run (after `--`), e.g.
    /// `-- --steps 40 --prompts 16`.
    #[arg(last = true)]
    train_args: Vec<String>,
}

#[derive(Serialize, Clone)]
struct RunSummary {
    seed: u64,
    policy: String,
    heldout_accuracy_before: f64,
    heldout_accuracy_after: f64,
    update_tokens_per_s: f64,
    peak_activation_bytes: u64,
    seconds: f64,
}

#[derive(Serialize)]
struct Report {
    seeds: Vec<u64>,
    gc_accuracy: Vec<f64>,
    hilore_accuracy: Vec<f64>,
    /// HiLoRe minus GC, held-out accuracy in percentage points, per seed.
    paired_diff_pp: Vec<f64>,
    paired_diff_pp_mean: f64,
    /// Sample standard deviation over seeds.
    paired_diff_pp_std: f64,
    gc_update_tokens_per_s: Vec<f64>,
    hilore_update_tokens_per_s: Vec<f64>,
    runs: Vec<RunSummary>,
    train_args: Vec<String>,
}

fn run_one(
    seed: u64,
    policy: &str,
    dir: &std::path::Path,
    extra: &[String],
) -> anyhow::Result<RunSummary> {
    let exe = std::env::current_exe().context("finding the hilore binary")?;
    let summary = dir.join(format!("summary-{policy}-{seed}.json"));
    let checkpoint = dir.join(format!("checkpoint-{policy}-{seed}"));
    let status = Command::new(exe)
        .arg("train")
        .args(["--policy", policy, "--seed", &seed.to_string()])
        .arg("--summary")
        .arg(&summary)
        .arg("--checkpoint")
        .arg(&checkpoint)
        .args(extra)
        .status()
        .context("running hilore train")?;
    anyhow::ensure!(
        status.success(),
        "hilore train --policy {policy} --seed {seed} failed ({status})"
    );
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&summary)
            .with_context(|| format!("reading {}", summary.display()))?,
    )?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Ok(RunSummary {
        seed,
        policy: policy.to_string(),
        heldout_accuracy_before: f("heldout_accuracy_before"),
        heldout_accuracy_after: f("heldout_accuracy_after"),
        update_tokens_per_s: f("update_tokens_per_s"),
        peak_activation_bytes: v["peak_activation_bytes"].as_u64().unwrap_or(0),
        seconds: f("seconds"),
    })
}

pub fn run(args: CompareArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(!args.seeds.is_empty(), "--seeds needs at least one seed");
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("hilore-compare-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut runs = Vec::new();
    let (mut gc, mut hil, mut gct, mut hit, mut diff) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for &seed in &args.seeds {
        eprintln!("seed {seed}: full recompute");
        let a = run_one(seed, "recompute", &dir, &args.train_args)?;
        eprintln!("seed {seed}: hilore");
        let b = run_one(seed, "hilore", &dir, &args.train_args)?;
        gc.push(a.heldout_accuracy_after);
        hil.push(b.heldout_accuracy_after);
        gct.push(a.update_tokens_per_s);
        hit.push(b.update_tokens_per_s);
        diff.push(100.0 * (b.heldout_accuracy_after - a.heldout_accuracy_after));
        runs.push(a);
        runs.push(b);
    }
    let n = diff.len() as f64;
    let mean = diff.iter().sum::<f64>() / n;
    let std = if diff.len() > 1 {
        (diff.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    let report = Report {
        seeds: args.seeds.clone(),
        gc_accuracy: gc,
        hilore_accuracy: hil,
        paired_diff_pp: diff,
        paired_diff_pp_mean: mean,
        paired_diff_pp_std: std,
        gc_update_tokens_per_s: gct,
        hilore_update_tokens_per_s: hit,
        runs,
        train_args: args.train_args.clone(),
    };
    println!(
        "{:>6} {:>12} {:>12} {:>10} {:>14} {:>14}",
        "seed", "GC acc", "HiLoRe acc", "diff pp", "GC upd tok/s", "HiLoRe tok/s"
    );
    for i in 0..report.seeds.len() {
        println!(
            "{:>6} {:>12.4} {:>12.4} {:>10.2} {:>14.0} {:>14.0}",
            report.seeds[i],
            report.gc_accuracy[i],
            report.hilore_accuracy[i],
            report.paired_diff_pp[i],
            report.gc_update_tokens_per_s[i],
            report.hilore_update_tokens_per_s[i]
        );
    }
    println!(
        "paired held-out accuracy difference (HiLoRe - GC): {:+.2} pp mean, {:.2} pp std over {} seeds",
        mean,
        std,
        report.seeds.len()
    );
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
