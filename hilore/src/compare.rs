//! `hilore compare`: paired GRPO runs, full recompute (GC) against HiLoRe, same seeds.
//!
//! Each seed runs `hilore train` twice with the same arguments except `--policy`
//! (`recompute`, then `hilore`), in child processes of this binary, and reads both
//! summaries. The two runs of a seed share the task, the initial weights, the warm start
//! and the first rollout; they part only through the actor update's gradients (exact for
//! GC, within the risk budget for HiLoRe) and then through everything downstream, so the
//! paired difference of held-out accuracy measures what the lossy fidelities cost.
//!
//! The runs use [`DEFAULT_TRAIN_ARGS`] for every flag the arguments after `--` do not
//! set: a decoder large enough (2 layers, hidden 192, MLP 512, 0.8 M parameters) that
//! recomputing a unit costs more than encoding and decoding its activations, microbatches
//! of 512 rows so that under full recompute the activation ledger is 35-45% of the
//! actor-update peak (the rest: parameters, gradients and AdamW state), 8 sampled answers
//! per held-out prompt (the accuracy's sampling noise is what a paired difference is
//! measured against), and a run short enough that three seeds finish in minutes on two
//! CPU cores. With the training
//! defaults instead (a 94 k-parameter model) the allocator picks exact plans only and the
//! comparison says nothing about the lossy fidelities; the report's fidelity counts (unit
//! instances per step stored, compressed, recomputed) show which case a run is in.

use crate::stats::Paired;
use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::process::{Command, ExitCode};

/// `hilore train` flags of every compared run, unless the arguments after `--` set them.
pub const DEFAULT_TRAIN_ARGS: [(&str, &str); 11] = [
    ("--layers", "2"),
    ("--hidden", "192"),
    ("--intermediate", "512"),
    ("--heads", "6"),
    ("--kv-heads", "2"),
    ("--token-budget", "512"),
    ("--sft-lr", "1e-3"),
    ("--steps", "60"),
    ("--prompts", "16"),
    ("--lr", "2e-4"),
    ("--eval-samples", "8"),
];

#[derive(Args)]
pub struct CompareArgs {
    /// Seeds to run (each: GC and HiLoRe); default 0,1,2, or none with --merge.
    #[arg(long, value_delimiter = ',')]
    seeds: Option<Vec<u64>>,
    /// Earlier `compare --json` reports to merge with this run (comma-separated): their
    /// runs count as if run here. They must have the same train arguments; a seed in
    /// several files, or in a file and --seeds, counts once (the first file's runs) and
    /// is not run again.
    #[arg(long, value_delimiter = ',', value_name = "FILE,...")]
    merge: Vec<PathBuf>,
    /// Write the result as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the runs' summaries, metrics and checkpoints go (default: a temporary
    /// directory).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Arguments passed to every `hilore train` run (after `--`), e.g.
    /// `-- --steps 60 --prompts 32`; they replace the compare defaults of the same flags
    /// (--layers 2 --hidden 192 --intermediate 512 --heads 6 --kv-heads 2 --token-budget
    /// 512 --sft-lr 1e-3 --steps 60 --prompts 16 --lr 2e-4 --eval-samples 8).
    #[arg(last = true)]
    train_args: Vec<String>,
}

#[derive(Serialize, Deserialize, Clone)]
struct RunSummary {
    seed: u64,
    policy: String,
    heldout_accuracy_before: f64,
    heldout_accuracy_after: f64,
    /// Greedy held-out accuracy (no sampling noise), after the warm start and after GRPO.
    /// Absent in reports written before it existed.
    #[serde(default = "nan")]
    heldout_greedy_accuracy_before: f64,
    #[serde(default = "nan")]
    heldout_greedy_accuracy_after: f64,
    update_tokens_per_s: f64,
    peak_activation_bytes: u64,
    /// Parameters + gradients + AdamW state (16 bytes per parameter).
    state_bytes: u64,
    /// The activation ledger's share of the actor-update peak (ledger + state).
    ledger_share: f64,
    /// Unit instances per GRPO step (mean) stored, compressed and recomputed.
    instances_store: f64,
    instances_compress: f64,
    instances_recompute: f64,
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
    /// The paired difference of sampled held-out accuracy (pp): mean, standard error,
    /// 95% interval (Student's t), sign test.
    sampled: Paired,
    /// The same for greedy held-out accuracy (absent when a merged report lacks it).
    greedy: Option<Paired>,
    /// The reports merged into this one.
    merged_from: Vec<String>,
    gc_update_tokens_per_s: Vec<f64>,
    hilore_update_tokens_per_s: Vec<f64>,
    /// Means over seeds of the actor-update tokens/s.
    gc_update_tokens_per_s_mean: f64,
    hilore_update_tokens_per_s_mean: f64,
    /// HiLoRe's unit instances per step (mean over steps and seeds) by fidelity.
    hilore_instances_per_step: Fidelities,
    /// GC's, for reference (recompute and store only).
    gc_instances_per_step: Fidelities,
    /// GC's activation ledger share of the actor-update peak (mean over seeds).
    gc_ledger_share: f64,
    runs: Vec<RunSummary>,
    train_args: Vec<String>,
}

#[derive(Serialize, Default, Clone, Copy)]
struct Fidelities {
    store: f64,
    compress: f64,
    recompute: f64,
}

impl Fidelities {
    fn mean_of(runs: &[&RunSummary]) -> Self {
        let n = runs.len().max(1) as f64;
        Fidelities {
            store: runs.iter().map(|r| r.instances_store).sum::<f64>() / n,
            compress: runs.iter().map(|r| r.instances_compress).sum::<f64>() / n,
            recompute: runs.iter().map(|r| r.instances_recompute).sum::<f64>() / n,
        }
    }
}

/// `extra` with every default flag it does not set.
fn with_defaults(extra: &[String]) -> Vec<String> {
    let given = |flag: &str| {
        extra
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    let mut v = Vec::new();
    for (flag, value) in DEFAULT_TRAIN_ARGS {
        if !given(flag) {
            v.push(flag.to_string());
            v.push(value.to_string());
        }
    }
    v.extend(extra.iter().cloned());
    v
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
        // The work directory is this comparison's own: a rerun replaces its files.
        .arg("--force")
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
    let inst = |k: &str| v["instances_per_step"][k].as_f64().unwrap_or(f64::NAN);
    let peak = v["peak_activation_bytes"].as_u64().unwrap_or(0);
    // AdamW keeps two f32 moments (8 bytes per parameter); parameters and gradients
    // another 8.
    let state = 2 * v["optimizer_state_bytes"].as_u64().unwrap_or(0);
    Ok(RunSummary {
        seed,
        policy: policy.to_string(),
        heldout_accuracy_before: f("heldout_accuracy_before"),
        heldout_accuracy_after: f("heldout_accuracy_after"),
        heldout_greedy_accuracy_before: f("heldout_greedy_accuracy_before"),
        heldout_greedy_accuracy_after: f("heldout_greedy_accuracy_after"),
        update_tokens_per_s: f("update_tokens_per_s"),
        peak_activation_bytes: peak,
        state_bytes: state,
        ledger_share: peak as f64 / (peak + state).max(1) as f64,
        instances_store: inst("store"),
        instances_compress: inst("compress"),
        instances_recompute: inst("recompute"),
        seconds: f("seconds"),
    })
}

fn nan() -> f64 {
    f64::NAN
}

/// The runs of earlier reports, in file order, each seed's pair once; errors when a file
/// was made with other train arguments or lacks a seed's pair.
fn merged_runs(
    files: &[PathBuf],
    train_args: &[String],
) -> anyhow::Result<Vec<(RunSummary, RunSummary)>> {
    #[derive(Deserialize)]
    struct Earlier {
        runs: Vec<RunSummary>,
        train_args: Vec<String>,
    }
    let mut pairs: Vec<(RunSummary, RunSummary)> = Vec::new();
    let mut from: Vec<String> = Vec::new();
    for f in files {
        let text = hilore_models::read_text_file(f)
            .with_context(|| format!("reading --merge {}", f.display()))?;
        let e: Earlier = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a `hilore compare --json` report", f.display()))?;
        if e.train_args != train_args {
            bail!(
                "{}: made with other train arguments ({}) than this comparison ({}); merge only reports of the same settings",
                f.display(),
                e.train_args.join(" "),
                train_args.join(" ")
            );
        }
        let mut seeds: Vec<u64> = e.runs.iter().map(|r| r.seed).collect();
        seeds.dedup();
        for seed in seeds {
            let of = |p: &str| {
                e.runs
                    .iter()
                    .find(|r| r.seed == seed && r.policy == p)
                    .cloned()
            };
            let (Some(gc), Some(h)) = (of("recompute"), of("hilore")) else {
                bail!("{}: seed {seed} lacks one of its two runs", f.display());
            };
            if let Some(i) = pairs.iter().position(|(a, _)| a.seed == seed) {
                eprintln!(
                    "note: seed {seed} is in {} and {}: counted once, from {}",
                    from[i],
                    f.display(),
                    from[i]
                );
                continue;
            }
            pairs.push((gc, h));
            from.push(f.display().to_string());
        }
    }
    Ok(pairs)
}

pub fn run(args: CompareArgs) -> anyhow::Result<ExitCode> {
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("hilore-compare-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let train_args = with_defaults(&args.train_args);
    let mut pairs = merged_runs(&args.merge, &train_args)?;
    let seeds = match &args.seeds {
        Some(s) => s.clone(),
        None if args.merge.is_empty() => vec![0, 1, 2],
        None => Vec::new(),
    };
    for &seed in &seeds {
        if pairs.iter().any(|(a, _)| a.seed == seed) {
            eprintln!("note: seed {seed} is in a merged report: not run again");
            continue;
        }
        eprintln!("seed {seed}: full recompute");
        let a = run_one(seed, "recompute", &dir, &train_args)?;
        eprintln!("seed {seed}: hilore");
        let b = run_one(seed, "hilore", &dir, &train_args)?;
        pairs.push((a, b));
    }
    anyhow::ensure!(
        !pairs.is_empty(),
        "nothing to compare: give --seeds, or --merge reports that hold runs"
    );
    let mut runs = Vec::new();
    let (mut gc, mut hil, mut gct, mut hit, mut diff, mut greedy) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut seeds = Vec::new();
    for (a, b) in pairs {
        seeds.push(a.seed);
        gc.push(a.heldout_accuracy_after);
        hil.push(b.heldout_accuracy_after);
        gct.push(a.update_tokens_per_s);
        hit.push(b.update_tokens_per_s);
        diff.push(100.0 * (b.heldout_accuracy_after - a.heldout_accuracy_after));
        greedy.push(100.0 * (b.heldout_greedy_accuracy_after - a.heldout_greedy_accuracy_after));
        runs.push(a);
        runs.push(b);
    }
    let sampled = Paired::of(&diff)?;
    let greedy = if greedy.iter().all(|g| g.is_finite()) {
        Some(Paired::of(&greedy)?)
    } else {
        None
    };
    let n = diff.len() as f64;
    let mean = diff.iter().sum::<f64>() / n;
    let std = if diff.len() > 1 {
        (diff.iter().map(|d| (d - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt()
    } else {
        0.0
    };
    let mean_of = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let of = |p: &str| runs.iter().filter(|r| r.policy == p).collect::<Vec<_>>();
    let (gc_runs, hilore_runs) = (of("recompute"), of("hilore"));
    let report = Report {
        gc_update_tokens_per_s_mean: mean_of(&gct),
        hilore_update_tokens_per_s_mean: mean_of(&hit),
        hilore_instances_per_step: Fidelities::mean_of(&hilore_runs),
        gc_instances_per_step: Fidelities::mean_of(&gc_runs),
        gc_ledger_share: gc_runs.iter().map(|r| r.ledger_share).sum::<f64>()
            / gc_runs.len().max(1) as f64,
        seeds,
        gc_accuracy: gc,
        hilore_accuracy: hil,
        paired_diff_pp: diff,
        paired_diff_pp_mean: mean,
        paired_diff_pp_std: std,
        sampled,
        greedy,
        merged_from: args.merge.iter().map(|p| p.display().to_string()).collect(),
        gc_update_tokens_per_s: gct,
        hilore_update_tokens_per_s: hit,
        runs,
        train_args,
    };
    println!(
        "{:>6} {:>12} {:>12} {:>10} {:>14} {:>14} {:>22}",
        "seed",
        "GC acc",
        "HiLoRe acc",
        "diff pp",
        "GC upd tok/s",
        "HiLoRe tok/s",
        "HiLoRe units s/c/r"
    );
    for i in 0..report.seeds.len() {
        let h = &report.runs[2 * i + 1];
        println!(
            "{:>6} {:>12.4} {:>12.4} {:>10.2} {:>14.0} {:>14.0} {:>22}",
            report.seeds[i],
            report.gc_accuracy[i],
            report.hilore_accuracy[i],
            report.paired_diff_pp[i],
            report.gc_update_tokens_per_s[i],
            report.hilore_update_tokens_per_s[i],
            format!(
                "{:.1}/{:.1}/{:.1}",
                h.instances_store, h.instances_compress, h.instances_recompute
            )
        );
    }
    let (hf, gf) = (
        report.hilore_instances_per_step,
        report.gc_instances_per_step,
    );
    println!(
        "unit instances per step (mean), stored / compressed / recomputed: HiLoRe {:.1} / {:.1} / {:.1}, GC {:.1} / {:.1} / {:.1}",
        hf.store, hf.compress, hf.recompute, gf.store, gf.compress, gf.recompute
    );
    println!(
        "GC's activation ledger: {:.1}% of the actor-update peak (the rest: parameters, gradients, AdamW state); actor update {:.0} tok/s GC, {:.0} tok/s HiLoRe (mean)",
        100.0 * report.gc_ledger_share,
        report.gc_update_tokens_per_s_mean,
        report.hilore_update_tokens_per_s_mean
    );
    let line = |what: &str, p: &Paired| {
        println!(
            "paired {what} held-out accuracy difference (HiLoRe - GC) over {} seeds: {:+.2} pp mean, standard error {:.2} pp, 95% interval {:+.2} to {:+.2} pp; {} up / {} down / {} equal, sign test p = {:.3}",
            p.n, p.mean, p.se, p.ci95_low, p.ci95_high, p.positive, p.negative, p.zero, p.sign_test_p
        )
    };
    line("sampled", &report.sampled);
    match &report.greedy {
        Some(g) => line("greedy", g),
        None => println!("greedy held-out accuracy: not in every merged report"),
    }
    if let Some(p) = &args.json {
        hilore_models::atomic::write_bytes_atomic(
            p,
            serde_json::to_string_pretty(&report)?.as_bytes(),
        )
        .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
