//! `hilore compare`: paired GRPO runs, full recompute (GC) against one or more arms
//! (HiLoRe at its default risk target, HiLoRe at other targets, compress-all, any
//! `hilore train --policy`), same seeds.
//!
//! Each seed runs [`crate::train::run`] once under `--policy recompute` and once per arm,
//! in this process (`--jobs` at a time, each on its own thread pool), with the same
//! arguments otherwise, and reads the summaries. The runs of a seed share the task, the
//! initial weights, the warm start and the first rollout; they part only through the
//! actor update's gradients (exact for GC, within the risk budget for HiLoRe) and then
//! through everything downstream, so the paired difference of held-out accuracy measures
//! what the lossy fidelities cost. Two or more `hilore@TARGET` arms give a dose-response
//! table: one least-squares slope per seed of the paired difference on log10(target),
//! summarised over seeds (a real effect grows with the target; trajectory noise does not).
//!
//! Every run is unshared (`--no-shared-prefix`, a copy of the prompt per response) unless
//! its arm says `+shared`, so the reference is unshared GC and reports made before shared
//! prefixes were training's default merge with new runs; `--shared-prefix` or
//! `--no-shared-prefix` after `--` sets the layout of every run instead.
//!
//! The runs use [`DEFAULT_TRAIN_ARGS`] for every flag the arguments after `--` do not
//! set: a decoder large enough (2 layers, hidden 192, MLP 512, 0.8 M parameters) that
//! recomputing a unit costs more than encoding and decoding its activations, microbatches
//! of 512 rows so that under full recompute the activation ledger is 35-45% of the
//! actor-update peak (the rest: parameters, gradients and AdamW state), 8 sampled answers
//! per held-out prompt (the accuracy's sampling noise is what a paired difference is
//! measured against), and a run short enough that three seeds finish in minutes on two
//! CPU cores. With the training defaults instead (a 94 k-parameter model) the allocator
//! picks exact plans only and the comparison says nothing about the lossy fidelities; the
//! report's fidelity counts (unit instances per step stored, compressed, recomputed) show
//! which case a run is in.
//!
//! A run's arithmetic does not depend on how many threads it has (the CPU kernels split
//! work by rows and columns, never a reduction), so reports made with other `--jobs`
//! merge; its throughput does, and the report records the threads each run had.

use crate::stats::{slope, Paired};
use anyhow::{bail, Context};
use clap::Args;
use hilore_runtime::allocator::DEFAULT_TARGET_REL_L2;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

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

/// The reference every arm is paired with: per-layer gradient checkpointing, exact.
const REFERENCE: &str = "recompute";

/// Flags compare sets on every run itself.
const OWN_FLAGS: [&str; 7] = [
    "--policy",
    "--seed",
    "--target-rel-l2",
    "--summary",
    "--checkpoint",
    "--force",
    "--resume",
];

#[derive(Args)]
#[command(after_long_help = AFTER_HELP)]
pub struct CompareArgs {
    /// Seeds to run (each: GC and every arm), e.g. `0,1,2` or `100-147` (inclusive);
    /// default 0,1,2, or none with --merge.
    #[arg(long, value_delimiter = ',', value_parser = parse_seed_range, value_name = "SEEDS")]
    seeds: Option<Vec<SeedRange>>,
    /// What is compared with full recompute, each `POLICY[@TARGET][+shared]`: `hilore`
    /// (its default risk target, 1e-2), `hilore@3e-3` (`--target-rel-l2 3e-3`;
    /// `hilore@0`: exact plans only), or any other `hilore train --policy`, e.g.
    /// `compress-fp8-e4m3-b32`; `+shared` trains the arm with `--shared-prefix` (each
    /// prompt once per microbatch), e.g. `recompute+shared`, `hilore+shared`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "hilore",
        value_name = "ARM,..."
    )]
    arms: Vec<String>,
    /// Trainings run at once, each on its own pool of (cores / jobs) threads; default 2
    /// where the machine has two or more cores (at compare's model size two runs of one
    /// thread finish sooner than two runs of two threads one after the other).
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    /// Earlier `compare --json` reports to merge with this run (comma-separated): their
    /// runs count as if run here. They must have the same train arguments; a run (seed
    /// and arm) in several files, or in a file and this invocation, counts once (the
    /// first file's) and is not run again, so a report can gain seeds or arms.
    #[arg(long, value_delimiter = ',', value_name = "FILE,...")]
    merge: Vec<PathBuf>,
    /// Write the result as JSON to FILE (also when a run fails: then with the runs that
    /// finished).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Where the runs' summaries and checkpoints go (default: a temporary directory).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Arguments passed to every `hilore train` run (after `--`), e.g.
    /// `-- --steps 60 --prompts 32`; they replace the compare defaults of the same flags
    /// (--layers 2 --hidden 192 --intermediate 512 --heads 6 --kv-heads 2 --token-budget
    /// 512 --sft-lr 1e-3 --steps 60 --prompts 16 --lr 2e-4 --eval-samples 8).
    #[arg(last = true)]
    train_args: Vec<String>,
}

const AFTER_HELP: &str = "\
Examples:
  hilore compare --seeds 0,1,2
      GC against HiLoRe at its default target, three seeds.
  hilore compare --seeds 100,101 --arms hilore@3e-2,hilore@1e-2,hilore@3e-3 --json d.json
      A dose-response table: the paired difference at three risk targets and its trend.
  hilore compare --merge d.json --seeds 102,103 --arms hilore@3e-2,hilore@1e-2,hilore@3e-3
      Two more seeds added to d.json's; its runs are not repeated.
  hilore compare --seeds 0,1 --arms compress-fp8-e4m3-b32
      Compress-all FP8 (COAT style) against GC.
  hilore compare --seeds 0-7 --arms recompute+shared,hilore,hilore+shared
      Shared prefixes against none: GC and HiLoRe with each prompt once per microbatch,
      each paired with unshared GC.";

/// A seed or an inclusive range of seeds (`100-147`).
#[derive(Clone, Copy, Debug)]
struct SeedRange(u64, u64);

fn parse_seed_range(s: &str) -> Result<SeedRange, String> {
    let num = |t: &str| {
        t.trim().parse::<u64>().map_err(|_| {
            format!("`{t}` is not a seed (a whole number >= 0); write e.g. `0,1,2` or `100-147`")
        })
    };
    match s.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            if a > b {
                return Err(format!("`{s}`: the range runs backwards; write `{b}-{a}`"));
            }
            Ok(SeedRange(a, b))
        }
        None => num(s).map(|a| SeedRange(a, a)),
    }
}

/// One arm: a train policy, for `hilore` a risk target, and whether its actor update
/// holds each prompt once per microbatch (`hilore train --shared-prefix`).
#[derive(Clone, Debug, PartialEq)]
struct Arm {
    /// `policy`, `hilore@TARGET`, either with `+shared`; `hilore` at the default target is
    /// `hilore`.
    label: String,
    policy: String,
    target_rel_l2: Option<f64>,
    shared_prefix: bool,
}

/// The suffix of an arm whose runs train with shared prefixes.
const SHARED: &str = "+shared";

impl Arm {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let (body, shared_prefix) = match s.trim().strip_suffix(SHARED) {
            Some(b) => (b, true),
            None => (s.trim(), false),
        };
        if body.contains('+') {
            bail!("--arms `{s}`: the only suffix an arm takes is `{SHARED}` (e.g. `hilore@3e-3{SHARED}`)");
        }
        let (policy, target) = match body.split_once('@') {
            Some((p, t)) => {
                let t: f64 = t.trim().parse().map_err(|_| {
                    anyhow::anyhow!(
                        "--arms `{s}`: `{t}` is not a risk target; write e.g. `hilore@3e-3`"
                    )
                })?;
                if !(t.is_finite() && t >= 0.0) {
                    bail!("--arms `{s}`: the risk target must be finite and >= 0");
                }
                (p.trim(), Some(t))
            }
            None => (body.trim(), None),
        };
        if policy == REFERENCE && !shared_prefix {
            bail!("--arms `{s}`: full recompute is the reference every arm is paired with; name the other policies (or `{REFERENCE}{SHARED}`: full recompute with shared prefixes)");
        }
        crate::train::policy_plan(policy).with_context(|| format!("--arms `{s}`"))?;
        if target.is_some() && policy != "hilore" {
            bail!("--arms `{s}`: a risk target (`@TARGET`) applies to `hilore` only");
        }
        let target = target.filter(|t| t.to_bits() != DEFAULT_TARGET_REL_L2.to_bits());
        let base = match target {
            Some(0.0) => format!("{policy}@0"),
            Some(t) => format!("{policy}@{t:e}"),
            None => policy.to_string(),
        };
        Ok(Arm {
            label: if shared_prefix {
                format!("{base}{SHARED}")
            } else {
                base
            },
            policy: policy.to_string(),
            target_rel_l2: target,
            shared_prefix,
        })
    }

    fn reference() -> Self {
        Arm {
            label: REFERENCE.into(),
            policy: REFERENCE.into(),
            target_rel_l2: None,
            shared_prefix: false,
        }
    }

    /// The risk target the arm plans with (`hilore` arms only).
    fn target(&self) -> Option<f64> {
        (self.policy == "hilore").then(|| self.target_rel_l2.unwrap_or(DEFAULT_TARGET_REL_L2))
    }
}

#[derive(Serialize, Deserialize, Clone)]
struct RunSummary {
    seed: u64,
    policy: String,
    /// The arm's label (`hilore@3e-3`); absent in reports written before arms existed,
    /// where it is the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    arm: Option<String>,
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
    /// Compute threads the run had (absent in reports written before `--jobs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// The compare invocation that ran it (its start, seconds since the Unix epoch);
    /// absent in reports written before, each of which one invocation made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    invocation: Option<u64>,
}

impl RunSummary {
    fn arm(&self) -> &str {
        self.arm.as_deref().unwrap_or(&self.policy)
    }
}

/// One arm against GC over the seeds that have both.
#[derive(Serialize)]
struct ArmReport {
    arm: String,
    policy: String,
    /// The risk target it planned with (`hilore` arms).
    target_rel_l2: Option<f64>,
    /// Whether its runs held each prompt once per microbatch (`--shared-prefix`).
    #[serde(default)]
    shared_prefix: bool,
    seeds: Vec<u64>,
    gc_accuracy: Vec<f64>,
    accuracy: Vec<f64>,
    /// The arm minus GC, sampled held-out accuracy in percentage points, per seed.
    paired_diff_pp: Vec<f64>,
    greedy_diff_pp: Vec<f64>,
    sampled: Paired,
    /// Absent when a merged run lacks greedy accuracy.
    greedy: Option<Paired>,
    /// Actor-update tokens/s, means over the seeds whose two runs one invocation made
    /// side by side (runs merged from other invocations are not compared for speed);
    /// NaN when there is none.
    update_tokens_per_s_mean: f64,
    gc_update_tokens_per_s_mean: f64,
    /// How many seeds those speed means cover.
    speed_seeds: usize,
    instances_per_step: Fidelities,
}

/// The paired difference's trend over risk targets.
#[derive(Serialize)]
struct DoseResponse {
    /// The `hilore` arms' targets, ascending.
    targets: Vec<f64>,
    /// Seeds with GC and every target above 0 (a target-0 arm is listed only when it has
    /// them all).
    seeds: Vec<u64>,
    /// Per target: the paired difference (pp) over those seeds, sampled and greedy.
    sampled: Vec<Paired>,
    greedy: Vec<Option<Paired>>,
    /// Per seed: the least-squares slope of the paired difference (pp) on log10(target),
    /// in pp per decade, summarised over seeds; a loss growing with the target shows as a
    /// negative mean whose interval excludes 0. Targets of 0 (exact plans) are left out of
    /// the slope (no logarithm); their differences are in `sampled`.
    slope_sampled_pp_per_decade: Paired,
    slope_greedy_pp_per_decade: Option<Paired>,
}

#[derive(Serialize)]
struct Report {
    /// The first arm's comparison, in the fields reports had before arms existed.
    seeds: Vec<u64>,
    gc_accuracy: Vec<f64>,
    hilore_accuracy: Vec<f64>,
    /// The first arm minus GC, held-out accuracy in percentage points, per seed.
    paired_diff_pp: Vec<f64>,
    paired_diff_pp_mean: f64,
    /// Sample standard deviation over seeds.
    paired_diff_pp_std: f64,
    /// The paired difference of sampled held-out accuracy (pp): mean, standard error,
    /// 95% interval (Student's t), sign test.
    sampled: Paired,
    /// The same for greedy held-out accuracy (absent when a merged report lacks it).
    greedy: Option<Paired>,
    /// Every arm against GC.
    arms: Vec<ArmReport>,
    /// With two or more `hilore` targets.
    dose_response: Option<DoseResponse>,
    /// The reports merged into this one.
    merged_from: Vec<String>,
    gc_update_tokens_per_s: Vec<f64>,
    hilore_update_tokens_per_s: Vec<f64>,
    /// Means over seeds of the actor-update tokens/s.
    gc_update_tokens_per_s_mean: f64,
    hilore_update_tokens_per_s_mean: f64,
    /// The first arm's unit instances per step (mean over steps and seeds) by fidelity.
    hilore_instances_per_step: Fidelities,
    /// GC's, for reference (recompute and store only).
    gc_instances_per_step: Fidelities,
    /// GC's activation ledger share of the actor-update peak (mean over seeds).
    gc_ledger_share: f64,
    /// Trainings at once in this invocation, and its wall seconds.
    jobs: usize,
    wall_seconds: f64,
    /// Runs that failed in this invocation (seed, arm, error); the report holds the rest.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    failed: Vec<String>,
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

/// Where one run's `what` file (`summary`, `checkpoint`) goes.
fn run_file(dir: &Path, what: &str, arm: &Arm, seed: u64, ext: &str) -> PathBuf {
    dir.join(format!("{what}-{}-{seed}{ext}", arm.label))
}

/// The `hilore train` arguments of one run.
fn run_argv(seed: u64, arm: &Arm, dir: &Path, train_args: &[String]) -> Vec<String> {
    let file = |what: &str, ext: &str| run_file(dir, what, arm, seed, ext).display().to_string();
    let mut v: Vec<String> = vec![
        "--policy".into(),
        arm.policy.clone(),
        "--seed".into(),
        seed.to_string(),
        "--summary".into(),
        file("summary", ".json"),
        "--checkpoint".into(),
        file("checkpoint", ""),
        // The work directory is this comparison's own: a rerun replaces its files.
        "--force".into(),
        "--no-progress".into(),
    ];
    if let Some(t) = arm.target_rel_l2 {
        v.extend(["--target-rel-l2".into(), format!("{t:e}")]);
    }
    // Each run states its layout (unless the arguments after `--` set one for all): an arm
    // is unshared unless `+shared`, as every run before shared prefixes became training's
    // default, so that earlier reports merge.
    if !layout_given(train_args) {
        v.push(if arm.shared_prefix {
            "--shared-prefix".into()
        } else {
            "--no-shared-prefix".into()
        });
    }
    v.extend(train_args.iter().cloned());
    v
}

/// Whether `train_args` choose the actor update's layout for every run.
fn layout_given(train_args: &[String]) -> bool {
    train_args
        .iter()
        .any(|a| a == "--shared-prefix" || a == "--no-shared-prefix")
}

/// One training in this process, on a pool of `threads`, and its summary.
fn run_one(
    seed: u64,
    arm: &Arm,
    dir: &Path,
    train_args: &[String],
    threads: usize,
    invocation: u64,
) -> anyhow::Result<RunSummary> {
    let argv = run_argv(seed, arm, dir, train_args);
    let summary = run_file(dir, "summary", arm, seed, ".json");
    let mut args = crate::train::parse_args(&argv)?;
    args.quiet = true;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("starting a training's thread pool")?;
    pool.install(|| crate::train::run(args))
        .with_context(|| format!("hilore train {}", argv.join(" ")))?;
    let v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(&summary)
            .with_context(|| format!("reading {}", summary.display()))?,
    )
    .with_context(|| format!("{}: not a training summary", summary.display()))?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let inst = |k: &str| v["instances_per_step"][k].as_f64().unwrap_or(f64::NAN);
    let peak = v["peak_activation_bytes"].as_u64().unwrap_or(0);
    // AdamW keeps two f32 moments (8 bytes per parameter); parameters and gradients
    // another 8.
    let state = 2 * v["optimizer_state_bytes"].as_u64().unwrap_or(0);
    Ok(RunSummary {
        seed,
        policy: arm.policy.clone(),
        arm: (arm.label != arm.policy).then(|| arm.label.clone()),
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
        threads: Some(threads),
        invocation: Some(invocation),
    })
}

fn nan() -> f64 {
    f64::NAN
}

/// The runs of earlier reports, in file order, each (seed, arm) once; errors when a file
/// was made with other train arguments.
fn merged_runs(files: &[PathBuf], train_args: &[String]) -> anyhow::Result<Vec<RunSummary>> {
    #[derive(Deserialize)]
    struct Earlier {
        runs: Vec<RunSummary>,
        train_args: Vec<String>,
    }
    let mut runs: Vec<RunSummary> = Vec::new();
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
        for mut r in e.runs {
            // Labels as this version writes them (`hilore@0.003` and `hilore@3e-3` are one
            // arm).
            if let Ok(a) = Arm::parse(r.arm()) {
                r.arm = (a.label != a.policy).then_some(a.label);
            }
            if let Some(i) = runs
                .iter()
                .position(|a| a.seed == r.seed && a.arm() == r.arm())
            {
                eprintln!(
                    "note: seed {} `{}` is in {} and {}: counted once, from {}",
                    r.seed,
                    r.arm(),
                    from[i],
                    f.display(),
                    from[i]
                );
                continue;
            }
            runs.push(r);
            from.push(f.display().to_string());
        }
    }
    Ok(runs)
}

/// Runs `work` (seed, arm) `jobs` at a time; the summaries of those that finished and
/// the errors of those that failed (a failure stops the queue, the running ones finish).
fn run_all(
    work: Vec<(u64, Arm)>,
    jobs: usize,
    threads: usize,
    dir: &Path,
    train_args: &[String],
    progress: bool,
) -> (Vec<RunSummary>, Vec<String>) {
    let invocation = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let pb = crate::common::progress_bar(work.len(), progress, "compare");
    let queue = Mutex::new(work.into_iter().collect::<VecDeque<_>>());
    let done = Mutex::new(Vec::new());
    let failed = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                if !failed.lock().map(|f| f.is_empty()).unwrap_or(false) {
                    return;
                }
                let Some((seed, arm)) = queue.lock().ok().and_then(|mut q| q.pop_front()) else {
                    return;
                };
                match run_one(seed, &arm, dir, train_args, threads, invocation) {
                    Ok(r) => {
                        pb.suspend(|| {
                            eprintln!(
                                "seed {seed} {}: held-out accuracy {:.4} (greedy {:.4}), update {:.0} tok/s, {:.1} s",
                                arm.label,
                                r.heldout_accuracy_after,
                                r.heldout_greedy_accuracy_after,
                                r.update_tokens_per_s,
                                r.seconds
                            )
                        });
                        pb.inc(1);
                        if let Ok(mut d) = done.lock() {
                            d.push(r);
                        }
                    }
                    Err(e) => {
                        if let Ok(mut f) = failed.lock() {
                            f.push(format!("seed {seed} {}: {e:#}", arm.label));
                        }
                    }
                }
            });
        }
    });
    pb.finish_and_clear();
    (
        done.into_inner().unwrap_or_default(),
        failed.into_inner().unwrap_or_default(),
    )
}

/// The paired comparison of `arm` with GC over the seeds (in `seeds`' order) that have
/// both; `None` when none has.
fn arm_report(arm: &Arm, seeds: &[u64], runs: &[RunSummary]) -> anyhow::Result<Option<ArmReport>> {
    let find = |seed: u64, label: &str| runs.iter().find(|r| r.seed == seed && r.arm() == label);
    let pairs: Vec<(&RunSummary, &RunSummary)> = seeds
        .iter()
        .filter_map(|&s| Some((find(s, REFERENCE)?, find(s, &arm.label)?)))
        .collect();
    if pairs.is_empty() {
        return Ok(None);
    }
    let pp = |a: f64, b: f64| 100.0 * (b - a);
    let diff: Vec<f64> = pairs
        .iter()
        .map(|(g, h)| pp(g.heldout_accuracy_after, h.heldout_accuracy_after))
        .collect();
    let greedy: Vec<f64> = pairs
        .iter()
        .map(|(g, h)| {
            pp(
                g.heldout_greedy_accuracy_after,
                h.heldout_greedy_accuracy_after,
            )
        })
        .collect();
    let mean = |v: &mut dyn Iterator<Item = f64>| {
        let (s, n) = v.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        if n == 0 {
            f64::NAN
        } else {
            s / n as f64
        }
    };
    // Throughput depends on the threads a run had and on the machine's load while it ran:
    // only pairs run by the same invocation (side by side, alike) are compared.
    let same_threads: Vec<&(&RunSummary, &RunSummary)> = pairs
        .iter()
        .filter(|p| p.0.invocation == p.1.invocation && p.0.threads == p.1.threads)
        .collect();
    let arm_runs: Vec<&RunSummary> = pairs.iter().map(|p| p.1).collect();
    Ok(Some(ArmReport {
        arm: arm.label.clone(),
        policy: arm.policy.clone(),
        target_rel_l2: arm.target(),
        shared_prefix: arm.shared_prefix,
        seeds: pairs.iter().map(|p| p.0.seed).collect(),
        gc_accuracy: pairs.iter().map(|p| p.0.heldout_accuracy_after).collect(),
        accuracy: pairs.iter().map(|p| p.1.heldout_accuracy_after).collect(),
        sampled: Paired::of(&diff)?,
        greedy: if greedy.iter().all(|g| g.is_finite()) {
            Some(Paired::of(&greedy)?)
        } else {
            None
        },
        paired_diff_pp: diff,
        greedy_diff_pp: greedy,
        update_tokens_per_s_mean: mean(&mut same_threads.iter().map(|p| p.1.update_tokens_per_s)),
        gc_update_tokens_per_s_mean: mean(
            &mut same_threads.iter().map(|p| p.0.update_tokens_per_s),
        ),
        speed_seeds: same_threads.len(),
        instances_per_step: Fidelities::mean_of(&arm_runs),
    }))
}

/// The trend of the `hilore` arms' paired differences over their targets, on the seeds
/// that have every one of them; `None` with fewer than two targets above 0.
fn dose_response(arms: &[ArmReport]) -> anyhow::Result<Option<DoseResponse>> {
    // The unshared `hilore` arms: a shared one at the same target is another treatment.
    let mut hil: Vec<&ArmReport> = arms
        .iter()
        .filter(|a| a.target_rel_l2.is_some() && !a.shared_prefix)
        .collect();
    hil.sort_by(|a, b| a.target_rel_l2.partial_cmp(&b.target_rel_l2).unwrap());
    let positive: Vec<&ArmReport> = hil
        .iter()
        .copied()
        .filter(|a| a.target_rel_l2.is_some_and(|t| t > 0.0))
        .collect();
    if positive.len() < 2 {
        return Ok(None);
    }
    // The seeds with every target above 0; an exact arm (target 0) joins the table only
    // where it covers them all (it is in `arms` either way).
    let seeds: Vec<u64> = positive[0]
        .seeds
        .iter()
        .copied()
        .filter(|s| positive.iter().all(|a| a.seeds.contains(s)))
        .collect();
    if seeds.len() < 2 {
        return Ok(None);
    }
    hil.retain(|a| seeds.iter().all(|s| a.seeds.contains(s)));
    let at = |a: &ArmReport, s: u64, greedy: bool| {
        let i = a.seeds.iter().position(|&x| x == s).unwrap();
        if greedy {
            a.greedy_diff_pp[i]
        } else {
            a.paired_diff_pp[i]
        }
    };
    let column = |a: &ArmReport, greedy: bool| -> Vec<f64> {
        seeds.iter().map(|&s| at(a, s, greedy)).collect()
    };
    let xs: Vec<f64> = positive
        .iter()
        .map(|a| a.target_rel_l2.unwrap().log10())
        .collect();
    let slopes = |greedy: bool| -> anyhow::Result<Vec<f64>> {
        seeds
            .iter()
            .map(|&s| {
                let ys: Vec<f64> = positive.iter().map(|a| at(a, s, greedy)).collect();
                slope(&xs, &ys)
            })
            .collect()
    };
    let greedy_ok = hil.iter().all(|a| a.greedy.is_some());
    Ok(Some(DoseResponse {
        targets: hil.iter().map(|a| a.target_rel_l2.unwrap()).collect(),
        sampled: hil
            .iter()
            .map(|a| Paired::of(&column(a, false)))
            .collect::<anyhow::Result<_>>()?,
        greedy: hil
            .iter()
            .map(|a| {
                let c = column(a, true);
                if c.iter().all(|x| x.is_finite()) {
                    Paired::of(&c).map(Some)
                } else {
                    Ok(None)
                }
            })
            .collect::<anyhow::Result<_>>()?,
        slope_sampled_pp_per_decade: Paired::of(&slopes(false)?)?,
        slope_greedy_pp_per_decade: if greedy_ok {
            let s = slopes(true)?;
            if s.iter().all(|x| x.is_finite()) {
                Some(Paired::of(&s)?)
            } else {
                None
            }
        } else {
            None
        },
        seeds,
    }))
}

fn paired_line(what: &str, p: &Paired) -> String {
    format!(
        "{what}: {:+.2} pp mean, standard error {:.2} pp, 95% interval {:+.2} to {:+.2} pp over {} seeds; {} up / {} down / {} equal, sign test p = {:.3}",
        p.mean, p.se, p.ci95_low, p.ci95_high, p.n, p.positive, p.negative, p.zero, p.sign_test_p
    )
}

pub fn run(args: CompareArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    for a in &args.train_args {
        let flag = a.split('=').next().unwrap_or(a);
        if OWN_FLAGS.contains(&flag) {
            bail!(
                "{flag} after `--`: compare sets it on every run itself (seeds with --seeds, policies and risk targets with --arms)"
            );
        }
    }
    let layout_for_all = layout_given(&args.train_args);
    let mut arms: Vec<Arm> = Vec::new();
    for s in &args.arms {
        let a = Arm::parse(s)?;
        if a.shared_prefix && layout_for_all {
            bail!("--arms `{s}`: `--shared-prefix` or `--no-shared-prefix` after `--` sets every run's layout, the reference's too; drop one of them (`{SHARED}` arms are paired with an unshared reference)");
        }
        if !arms.contains(&a) {
            arms.push(a);
        }
    }
    anyhow::ensure!(
        !arms.is_empty(),
        "--arms is empty; name at least one, e.g. `hilore`"
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = args.jobs.unwrap_or(cores.clamp(1, 2));
    anyhow::ensure!(jobs >= 1, "--jobs is 0; it must be at least 1");
    let threads = (cores / jobs).max(1);
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::temp_dir().join(format!("hilore-compare-{}", std::process::id())),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let train_args = with_defaults(&args.train_args);
    // The settings are checked once, before any run (a typo fails here, not after hours).
    crate::train::parse_args(&run_argv(0, &arms[0], &dir, &train_args))?;
    let mut runs = merged_runs(&args.merge, &train_args)?;
    let seeds = match &args.seeds {
        Some(r) => r.iter().flat_map(|r| r.0..=r.1).collect(),
        None if args.merge.is_empty() => vec![0, 1, 2],
        None => Vec::new(),
    };
    let mut work = Vec::new();
    let mut skipped = 0;
    for &seed in &seeds {
        for arm in std::iter::once(Arm::reference()).chain(arms.iter().cloned()) {
            if runs.iter().any(|r| r.seed == seed && r.arm() == arm.label) {
                skipped += 1;
            } else if !work
                .iter()
                .any(|(s, a): &(u64, Arm)| *s == seed && a.label == arm.label)
            {
                work.push((seed, arm));
            }
        }
    }
    if skipped > 0 {
        eprintln!("note: {skipped} runs of these seeds are in the merged reports: not run again");
    }
    if !work.is_empty() {
        eprintln!(
            "{} runs, {jobs} at a time on {threads} thread(s) each; summaries in {}",
            work.len(),
            dir.display()
        );
    }
    let (new_runs, failed) = run_all(work, jobs, threads, &dir, &train_args, !args.no_progress);
    runs.extend(new_runs);
    // Seeds in order of first appearance: merged reports' first, then --seeds.
    let mut all_seeds: Vec<u64> = Vec::new();
    for r in &runs {
        if !all_seeds.contains(&r.seed) {
            all_seeds.push(r.seed);
        }
    }
    // Every arm in the runs, this invocation's first (in --arms order).
    let mut all_arms = arms.clone();
    for r in &runs {
        if r.arm() != REFERENCE && !all_arms.iter().any(|a| a.label == r.arm()) {
            let arm = Arm::parse(r.arm()).unwrap_or(Arm {
                label: r.arm().to_string(),
                policy: r.policy.clone(),
                target_rel_l2: None,
                shared_prefix: r.arm().ends_with(SHARED),
            });
            all_arms.push(arm);
        }
    }
    let mut arm_reports = Vec::new();
    for a in &all_arms {
        if let Some(r) = arm_report(a, &all_seeds, &runs)? {
            arm_reports.push(r);
        }
    }
    let write_json = |report: &Report| -> anyhow::Result<()> {
        if let Some(p) = &args.json {
            hilore_models::atomic::write_bytes_atomic(
                p,
                serde_json::to_string_pretty(report)?.as_bytes(),
            )
            .with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    };
    let Some(first) = arm_reports.first() else {
        if !failed.is_empty() {
            bail!("every run failed or none paired: {}", failed.join("; "));
        }
        bail!("nothing to compare: give --seeds, or --merge reports that hold runs");
    };
    let of = |label: &str| runs.iter().filter(|r| r.arm() == label).collect::<Vec<_>>();
    let gc_runs = of(REFERENCE);
    let first_runs: Vec<&RunSummary> = first
        .seeds
        .iter()
        .filter_map(|&s| runs.iter().find(|r| r.seed == s && r.arm() == first.arm))
        .collect();
    let gc_first: Vec<&RunSummary> = first
        .seeds
        .iter()
        .filter_map(|&s| runs.iter().find(|r| r.seed == s && r.arm() == REFERENCE))
        .collect();
    let std = first.sampled.sd;
    let report = Report {
        seeds: first.seeds.clone(),
        gc_accuracy: first.gc_accuracy.clone(),
        hilore_accuracy: first.accuracy.clone(),
        paired_diff_pp: first.paired_diff_pp.clone(),
        paired_diff_pp_mean: first.sampled.mean,
        paired_diff_pp_std: std,
        sampled: first.sampled.clone(),
        greedy: first.greedy.clone(),
        dose_response: dose_response(&arm_reports)?,
        merged_from: args.merge.iter().map(|p| p.display().to_string()).collect(),
        gc_update_tokens_per_s: gc_first.iter().map(|r| r.update_tokens_per_s).collect(),
        hilore_update_tokens_per_s: first_runs.iter().map(|r| r.update_tokens_per_s).collect(),
        gc_update_tokens_per_s_mean: first.gc_update_tokens_per_s_mean,
        hilore_update_tokens_per_s_mean: first.update_tokens_per_s_mean,
        hilore_instances_per_step: first.instances_per_step,
        gc_instances_per_step: Fidelities::mean_of(&gc_runs),
        gc_ledger_share: gc_runs.iter().map(|r| r.ledger_share).sum::<f64>()
            / gc_runs.len().max(1) as f64,
        arms: arm_reports,
        jobs,
        wall_seconds: t0.elapsed().as_secs_f64(),
        failed: failed.clone(),
        runs,
        train_args,
    };
    print_report(&report);
    write_json(&report)?;
    if !failed.is_empty() {
        bail!(
            "{} run(s) failed (the report holds the {} that finished): {}",
            failed.len(),
            report.runs.len(),
            failed.join("; ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_report(report: &Report) {
    // Per seed: GC's accuracy and each arm's paired difference.
    let mut header = format!("{:>6} {:>9}", "seed", "GC acc");
    for a in &report.arms {
        header += &format!(" {:>16}", format!("{} pp", a.arm));
    }
    println!("{header}");
    let all_seeds: Vec<u64> = {
        let mut v: Vec<u64> = Vec::new();
        for a in &report.arms {
            for &s in &a.seeds {
                if !v.contains(&s) {
                    v.push(s);
                }
            }
        }
        v
    };
    for s in all_seeds {
        let gc = report
            .runs
            .iter()
            .find(|r| r.seed == s && r.arm() == REFERENCE)
            .map_or(f64::NAN, |r| r.heldout_accuracy_after);
        let mut line = format!("{s:>6} {gc:>9.4}");
        for a in &report.arms {
            match a.seeds.iter().position(|&x| x == s) {
                Some(i) => line += &format!(" {:>+16.2}", a.paired_diff_pp[i]),
                None => line += &format!(" {:>16}", "-"),
            }
        }
        println!("{line}");
    }
    let g = report.gc_instances_per_step;
    println!(
        "GC: activation ledger {:.1}% of the actor-update peak (the rest: parameters, gradients, AdamW state); unit instances per step stored / compressed / recomputed {:.1} / {:.1} / {:.1}",
        100.0 * report.gc_ledger_share,
        g.store,
        g.compress,
        g.recompute
    );
    for a in &report.arms {
        let f = a.instances_per_step;
        let speed = if a.speed_seeds == 0 {
            "actor update not compared (no seed has its run and GC's from one invocation)"
                .to_string()
        } else {
            format!(
                "actor update {:.0} tok/s against GC's {:.0} ({:.2} x, {} seeds run side by side)",
                a.update_tokens_per_s_mean,
                a.gc_update_tokens_per_s_mean,
                a.update_tokens_per_s_mean / a.gc_update_tokens_per_s_mean,
                a.speed_seeds
            )
        };
        println!(
            "{}: {speed}, unit instances per step {:.1} / {:.1} / {:.1}",
            a.arm, f.store, f.compress, f.recompute
        );
        println!(
            "  {}",
            paired_line(
                "paired sampled held-out accuracy difference (arm - GC)",
                &a.sampled
            )
        );
        match &a.greedy {
            Some(g) => println!(
                "  {}",
                paired_line("paired greedy held-out accuracy difference", g)
            ),
            None => println!("  greedy held-out accuracy: not in every merged report"),
        }
    }
    if let Some(d) = &report.dose_response {
        println!(
            "dose-response over {} seeds with every target:",
            d.seeds.len()
        );
        println!(
            "{:>10} {:>34} {:>34}",
            "target", "sampled pp (mean +- SE)", "greedy pp (mean +- SE)"
        );
        for (i, t) in d.targets.iter().enumerate() {
            let g = d.greedy[i].as_ref().map_or("-".to_string(), |g| {
                format!("{:+.2} +- {:.2}", g.mean, g.se)
            });
            println!(
                "{:>10} {:>34} {:>34}",
                format!("{t:e}"),
                format!("{:+.2} +- {:.2}", d.sampled[i].mean, d.sampled[i].se),
                g
            );
        }
        println!(
            "  {}",
            paired_line(
                "trend, sampled (slope on log10 target, pp per decade)",
                &d.slope_sampled_pp_per_decade
            )
        );
        if let Some(g) = &d.slope_greedy_pp_per_decade {
            println!("  {}", paired_line("trend, greedy (pp per decade)", g));
        }
    }
    println!(
        "{} runs reported, {} at a time, {:.0} s wall in this invocation",
        report.runs.len(),
        report.jobs,
        report.wall_seconds
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_parse_to_canonical_labels() {
        let a = Arm::parse("hilore@3e-3").unwrap();
        assert_eq!(a.label, "hilore@3e-3");
        assert_eq!(a.target_rel_l2, Some(3e-3));
        // The default target is the plain `hilore` arm (and merges with older reports).
        assert_eq!(
            Arm::parse("hilore@0.01").unwrap(),
            Arm::parse("hilore").unwrap()
        );
        assert_eq!(Arm::parse("hilore@0").unwrap().label, "hilore@0");
        assert_eq!(Arm::parse("hilore@0e0").unwrap().label, "hilore@0");
        assert_eq!(Arm::parse("hilore@0.003").unwrap().label, "hilore@3e-3");
        assert_eq!(Arm::parse("compress-bf16").unwrap().target(), None);
        let shared = Arm::parse("hilore@0.003+shared").unwrap();
        assert_eq!(shared.label, "hilore@3e-3+shared");
        assert!(shared.shared_prefix && !Arm::parse("hilore").unwrap().shared_prefix);
        assert_eq!(Arm::parse("recompute+shared").unwrap().policy, "recompute");
        assert_ne!(
            Arm::parse("hilore+shared").unwrap(),
            Arm::parse("hilore").unwrap()
        );
        assert!(matches!(
            parse_seed_range("100-147"),
            Ok(SeedRange(100, 147))
        ));
        assert!(matches!(parse_seed_range("7"), Ok(SeedRange(7, 7))));
        assert!(parse_seed_range("9-3").is_err() && parse_seed_range("x").is_err());
        for bad in [
            "recompute",
            "hilore@x",
            "hilore@-1",
            "compress-bf16@1e-2",
            "nope",
            "hilore+fast",
            "hilore+shared+shared",
        ] {
            assert!(Arm::parse(bad).is_err(), "{bad}");
        }
    }
}
