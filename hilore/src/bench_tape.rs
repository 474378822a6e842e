//! `hilore bench-tape`: forward+backward of the HiLoRe tape on a whole model, timed and
//! measured the way a comparison with another framework needs it.
//!
//! Per case (a batch of sequences, `--lengths`) and plan (`--plans`), interleaved over
//! repetitions: wall and CPU seconds of the process, peak growth of its resident set and of
//! its heap; per unit, the forward and backward seconds of each unit timed in isolation;
//! with `--attention`, the attention core alone. scripts/vs-pytorch.sh runs this command
//! next to PyTorch on the same model and shapes.

use crate::alloc;
use crate::check::describe;
use crate::common::{self, human_bytes, LengthCase, LengthCases};
use anyhow::{anyhow, Context};
use candle_core::{Device, Tensor};
use clap::{Args, ValueEnum};
use hilore_models::reference::CandleDecoder;
use hilore_models::{plans, zoo, Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{Cx, Grads, Packing, Plan, Var};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// The cases timed when neither `--lengths` nor `--attention` is given.
const DEFAULT_LENGTHS: &str = "256,192,320,256";

/// The units of the decoder whose forward and backward are timed one by one, in forward
/// order: every unit but `layer`, which encloses the seven layer units.
fn timed_units() -> impl Iterator<Item = &'static str> {
    plans::UNIT_NAMES.into_iter().filter(|&u| u != "layer")
}

/// Appended to `hilore bench-tape --help`.
pub const AFTER_HELP: &str = "\
What is timed: for every case and plan, one forward of the whole model (embedding, the \
layers, the head's per-token log-probs of the next tokens) and one backward seeded with \
random per-token coefficients c, i.e. the gradient of sum(c * logp) for every parameter, \
on a fresh tape. The passes run interleaved (case 1: plan A, plan B; case 2: ...; then \
the next repetition), after --warmup untimed rounds and one untimed memory round. \
Reported per (case, plan): median wall \
seconds, median CPU seconds of the whole process (getrusage: user + system, every \
thread), peak resident-set growth and peak heap growth (below), and the tape's own \
activation peak.

Memory: after the warm-ups, every (case, plan) runs one memory pass (untimed): the \
allocator first hands its free memory back to the kernel (malloc_trim), the kernel's \
resident-set high-water mark (VmHWM) is reset through /proc/self/clear_refs, and \
peak_rss_growth_bytes is VmHWM after the pass less the resident set (VmRSS) before it: \
what one forward+backward adds to the process's resident set once code, thread pools and \
lazy state are resident, whatever plan ran before it. first_pass_rss_growth_bytes is the \
same reading on the first warm-up (one-time costs included), rss_growth_bytes on each \
timed pass (no trim before it: memory kept from the previous pass is reused, so these \
read low). peak_heap_growth_bytes counts every heap byte a pass allocated above the level \
before it (a counting allocator), largest over all passes.

Per unit (unless --no-per-unit): each unit (embed, attn_norm, qkv, attn_core, attn_out, \
mlp_norm, gate_up, down, head) is timed in isolation: its real inputs come from one \
forward of the model, it runs on a fresh tape with those inputs as gradient-requiring \
leaves, and backward starts from a random gradient of its output (qkv's three outputs \
are joined by one cat). Seconds are summed over the layers and the median over \
repetitions is reported; the sum over units is close to, not equal to, the store-all \
pass (no shared tape, no recompute).

Comparing with PyTorch: scripts/vs-pytorch.sh builds this binary, exports the benchmark \
decoder with `hilore export --config`, loads it in transformers, checks that both give \
the same log-probs (--logprobs), and times PyTorch eager and PyTorch with per-layer \
checkpointing against this command's store-all and recompute-all, each measurement in \
its own process, at 1 and 2 threads; `scripts/vs-pytorch.sh --quick` is a smoke test.

Examples:
  hilore bench-tape --lengths 128x7,512x4 --threads 1 --reps 5 --json tape.json
  hilore bench-tape --model DIR --lengths 128x7 --plans store-all --reps 1
  hilore bench-tape --attention 512,2048 --threads 2";

/// What a (case, plan) pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum PlanArg {
    /// Every unit stored.
    StoreAll,
    /// Per-layer gradient checkpointing: each layer keeps only its input, backward re-runs
    /// it.
    RecomputeAll,
    /// The same model written with plain candle ops and differentiated by candle's own
    /// autograd: the reference (its gradients are compared with store-all's).
    CandleAutograd,
}

impl PlanArg {
    fn name(self) -> &'static str {
        match self {
            PlanArg::StoreAll => "store-all",
            PlanArg::RecomputeAll => "recompute-all",
            PlanArg::CandleAutograd => "candle-autograd",
        }
    }
}

#[derive(Args)]
pub struct BenchTapeArgs {
    /// A zoo model directory (Hugging Face config.json and model.safetensors or a sharded
    /// index; tokenizer.json optional), loaded with its weights: the model to time.
    /// `hilore export --config FILE --out DIR` writes one with random weights.
    #[arg(long, value_name = "DIR", conflicts_with = "config")]
    model: Option<PathBuf>,
    /// An HF `config.json` to build the model from (random weights from --seed). Default,
    /// without --model or --config: the built-in tiny decoder (6 layers, hidden 64).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The cases, lengths in tokens (a sequence of L tokens gives L - 1 log-probs): a plain
    /// list `256,192,320` is ONE case, a batch of those sequences; `128x7,512x4` is one
    /// case per group (7 sequences of 128 tokens; then, timed separately, 4 of 512).
    /// Default: 256,192,320,256, or none when --attention is given.
    #[arg(long, value_name = "L1,L2,..|LxN,..")]
    lengths: Option<LengthCases>,
    /// The plans to time on every case, interleaved.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "store-all,recompute-all"
    )]
    plans: Vec<PlanArg>,
    /// Also time the attention core alone (the tape's attention op, forward and backward)
    /// on one sequence of each length T: the model's query and key/value heads, random q,
    /// k and v, a random output gradient. Reported as cases with plan `attention`.
    #[arg(long, value_delimiter = ',', value_name = "T1,T2,..")]
    attention: Vec<usize>,
    /// Compute threads: sets RAYON_NUM_THREADS (candle's matmul reads it) and sizes rayon's
    /// global pool (the tape's CPU kernels), before any tensor op. Default: the
    /// environment's RAYON_NUM_THREADS, else one per core.
    #[arg(long, value_name = "N")]
    threads: Option<usize>,
    /// Timed repetitions of every (case, plan); the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Untimed warm-up passes of every (case, plan), before the memory pass and the timed
    /// ones.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Skip the per-unit timing (each unit in isolation), which costs about one more
    /// store-all pass per case and repetition.
    #[arg(long)]
    no_per_unit: bool,
    /// Seed of weights (without --model), tokens, coefficients and gradients.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write every case's token sequences and the tape's log-probs of them as JSON to FILE
    /// (`{"cases": [{"lengths", "sequences", "logprobs"}]}`, log-probs in packing order),
    /// then exit without timing anything.
    #[arg(long, value_name = "FILE")]
    logprobs: Option<PathBuf>,
}

/// One measured pass.
#[derive(Debug, Clone, Copy)]
struct Sample {
    wall: f64,
    cpu: f64,
    heap_growth: usize,
    rss_growth: Option<usize>,
    ledger_peak: Option<usize>,
}

/// A measurement window over one pass.
struct Meter {
    rss_base: Option<usize>,
    heap_base: usize,
    cpu0: f64,
    t0: Instant,
}

impl Meter {
    /// Starts measuring; with `trim`, first returns the allocator's free memory to the
    /// kernel, so that the pass's resident-set growth is not hidden by memory it reuses.
    fn start(trim: bool) -> Meter {
        if trim {
            procmem::trim_heap();
        }
        let rss_base = if procmem::reset_peak_rss() {
            procmem::status_bytes("VmRSS")
        } else {
            None
        };
        let heap_base = alloc::reset_peak();
        let cpu0 = cpu_seconds();
        Meter {
            rss_base,
            heap_base,
            cpu0,
            t0: Instant::now(),
        }
    }

    fn stop(self, ledger_peak: Option<usize>) -> Sample {
        let wall = self.t0.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - self.cpu0;
        let heap_growth = alloc::peak().saturating_sub(self.heap_base);
        let rss_growth = match (self.rss_base, procmem::status_bytes("VmHWM")) {
            (Some(base), Some(hwm)) => Some(hwm.saturating_sub(base)),
            _ => None,
        };
        Sample {
            wall,
            cpu,
            heap_growth,
            rss_growth,
            ledger_peak,
        }
    }
}

/// CPU seconds of this process so far, user plus system, over every thread (exited ones
/// included): `getrusage(RUSAGE_SELF)`, microsecond resolution. NaN where unavailable.
fn cpu_seconds() -> f64 {
    #[cfg(unix)]
    {
        let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the rusage it is pointed to; the memory is zeroed and
        // the right size.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr()) };
        if rc != 0 {
            return f64::NAN;
        }
        // SAFETY: rc == 0, so getrusage wrote the whole struct (it was zeroed anyway).
        let u = unsafe { u.assume_init() };
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        tv(u.ru_utime) + tv(u.ru_stime)
    }
    #[cfg(not(unix))]
    {
        f64::NAN
    }
}

/// The process's resident set, from `/proc/self` (Linux).
mod procmem {
    /// A `kB` field of /proc/self/status (`VmRSS`, `VmHWM`) in bytes.
    pub fn status_bytes(field: &str) -> Option<usize> {
        let s = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = s.lines().find(|l| l.starts_with(field))?;
        let kb: usize = line[field.len()..]
            .trim_start_matches(':')
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kb * 1024)
    }

    /// Returns the allocator's free memory to the kernel (glibc's `malloc_trim(0)`); a
    /// no-op elsewhere.
    pub fn trim_heap() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only releases free memory of the allocator's arenas; it is
        // safe to call at any time.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Resets the resident-set high-water mark (VmHWM) to the current resident set
    /// (`echo 5 > /proc/self/clear_refs`, Linux 4.0 and later); false where it cannot.
    pub fn reset_peak_rss() -> bool {
        std::fs::write("/proc/self/clear_refs", "5").is_ok()
    }
}

/// A (case, plan) row of the report.
#[derive(Serialize)]
struct CaseRow {
    /// The case: `128x7`, the plain list `256,192,320`, or T for `attention`.
    lengths: String,
    /// `store-all`, `recompute-all`, `candle-autograd` or `attention`.
    plan: String,
    sequences: usize,
    /// Rows of the batch: the log-probs computed (each sequence's tokens minus one); for
    /// `attention`, T.
    tokens: usize,
    wall_seconds_median: f64,
    cpu_seconds_median: f64,
    /// CPU seconds over wall seconds (medians): the threads kept busy.
    cpu_per_wall: f64,
    tokens_per_s: f64,
    /// Resident-set growth over the memory pass (freed memory handed back first; see
    /// `--help`); null where /proc/self/clear_refs is unavailable.
    peak_rss_growth_bytes: Option<usize>,
    /// The same reading over the first warm-up pass (one-time costs included).
    first_pass_rss_growth_bytes: Option<usize>,
    /// Largest heap growth over one pass, warm-up included.
    peak_heap_growth_bytes: usize,
    /// The tape's ledger peak (saved activations, transients, activation gradients); null
    /// for candle's autograd.
    peak_activation_bytes: Option<usize>,
    /// Per unit, forward + backward seconds of the unit timed in isolation, summed over
    /// the layers (median over repetitions); the same for every plan of a case. Null for
    /// `attention`, `candle-autograd`, or with --no-per-unit.
    per_unit_seconds: Option<BTreeMap<String, f64>>,
    /// The forward part of `per_unit_seconds`.
    per_unit_forward_seconds: Option<BTreeMap<String, f64>>,
    wall_seconds: Vec<f64>,
    cpu_seconds: Vec<f64>,
    warmup_wall_seconds: Vec<f64>,
    memory_pass_wall_seconds: f64,
    /// Resident-set growth of every timed pass (no trim before it).
    rss_growth_bytes: Vec<Option<usize>>,
    /// candle-autograd only: relative L2 distance of its parameter gradients from the
    /// tape's store-all ones.
    grad_rel_l2_vs_store_all: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    model_source: String,
    /// rayon's global pool (the tape's CPU kernels).
    threads: usize,
    /// Threads candle's matmul uses (RAYON_NUM_THREADS, else one per core).
    gemm_threads: usize,
    reps: usize,
    warmup: usize,
    seed: u64,
    /// The process's resident set once the model and the batches are built.
    rss_after_load_bytes: Option<usize>,
    cases: Vec<CaseRow>,
}

/// A model case: its batch and coefficients.
struct ModelCase {
    spec: LengthCase,
    batch: TokenBatch,
    coeffs: Tensor,
}

/// An attention-core case: one sequence of `t` rows.
struct AttnCase {
    t: usize,
    packing: Packing,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    scale: f64,
}

/// What the measurements of one (case, plan) gathered.
#[derive(Default)]
struct Acc {
    warm: Vec<Sample>,
    mem: Option<Sample>,
    timed: Vec<Sample>,
}

impl Acc {
    fn all(&self) -> impl Iterator<Item = &Sample> {
        self.warm.iter().chain(&self.mem).chain(&self.timed)
    }

    fn push(&mut self, phase: Phase, s: Sample) {
        match phase {
            Phase::Warmup => self.warm.push(s),
            Phase::Memory => self.mem = Some(s),
            Phase::Timed => self.timed.push(s),
        }
    }
}

/// The rounds of the measurement, each over every (case, plan).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Warmup,
    Memory,
    Timed,
}

/// Parameter gradients by name, in [`Decoder::named_params`] order.
type NamedGrads = Vec<(String, Tensor)>;

/// Per-unit seconds of one repetition: unit -> (forward, backward), summed over layers.
type UnitTimes = BTreeMap<&'static str, (f64, f64)>;

pub fn run(args: BenchTapeArgs) -> anyhow::Result<ExitCode> {
    // Before any tensor op: candle's matmul reads RAYON_NUM_THREADS at every call, rayon
    // sizes its global pool once, at first use.
    if let Some(n) = args.threads {
        anyhow::ensure!(n >= 1, "--threads must be at least 1");
        // The process is still single-threaded here, so setting the environment is safe.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| anyhow!("--threads {n}: cannot size rayon's global pool: {e}"))?;
    }
    anyhow::ensure!(
        args.reps >= 1,
        "--reps must be at least 1 (use --logprobs FILE to compute without timing)"
    );
    anyhow::ensure!(
        !args.plans.is_empty(),
        "--plans is empty; name at least one of store-all, recompute-all, candle-autograd"
    );
    if let Some(t) = args.attention.iter().find(|&&t| t == 0) {
        anyhow::bail!("--attention {t}: a sequence needs at least one row");
    }
    let device = Device::Cpu;
    let (model, cfg, source) = load_model(&args, &device)?;
    let specs: Vec<LengthCase> = match &args.lengths {
        Some(c) => c.0.clone(),
        None if !args.attention.is_empty() => Vec::new(),
        None => {
            DEFAULT_LENGTHS
                .parse::<LengthCases>()
                .map_err(|e| anyhow!(e))?
                .0
        }
    };
    for spec in &specs {
        common::check_activation_size(
            &cfg,
            spec.lengths.iter().sum(),
            &format!("--lengths case `{}`", spec.label),
        )?;
    }
    let mut cases = Vec::with_capacity(specs.len());
    for (i, spec) in specs.into_iter().enumerate() {
        let seed = args.seed.wrapping_add(1 + 2 * i as u64);
        let batch = TokenBatch::random(&spec.lengths, &cfg, seed, &device)
            .with_context(|| format!("--lengths case `{}`", spec.label))?;
        let coeffs = common::coefficients(batch.num_tokens(), seed.wrapping_add(1), &device)?;
        cases.push(ModelCase {
            spec,
            batch,
            coeffs,
        });
    }
    if let Some(path) = &args.logprobs {
        return write_logprobs(&model, &cfg, &cases, path);
    }
    let attn = args
        .attention
        .iter()
        .enumerate()
        .map(|(i, &t)| attention_case(&cfg, t, args.seed.wrapping_add(1000 + i as u64)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let reference = if args.plans.contains(&PlanArg::CandleAutograd) && !cases.is_empty() {
        Some(
            CandleDecoder::from_decoder(&model)
                .context("building the candle-autograd copy of the model")?,
        )
    } else {
        None
    };
    let threads = rayon::current_num_threads();
    let gemm_threads = candle_core::utils::get_num_threads();
    let rss_after_load = procmem::status_bytes("VmRSS");
    eprintln!(
        "model: {} ({source}); {} case(s) x {} plan(s), {} attention case(s); {} threads \
         (matmul {}); {} warm-up + {} timed interleaved repetitions",
        describe(&cfg),
        cases.len(),
        args.plans.len(),
        attn.len(),
        threads,
        gemm_threads,
        args.warmup,
        args.reps
    );

    let mut model_acc: Vec<Vec<Acc>> = cases
        .iter()
        .map(|_| args.plans.iter().map(|_| Acc::default()).collect())
        .collect();
    let mut attn_acc: Vec<Acc> = attn.iter().map(|_| Acc::default()).collect();
    let mut unit_reps: Vec<Vec<UnitTimes>> = cases.iter().map(|_| Vec::new()).collect();
    // Gradients of the first store-all and candle-autograd pass of each case.
    let mut first_grads: Vec<BTreeMap<PlanArg, NamedGrads>> =
        cases.iter().map(|_| BTreeMap::new()).collect();

    let rounds = (0..args.warmup)
        .map(|i| (Phase::Warmup, format!("warm-up {}/{}", i + 1, args.warmup)))
        .chain(std::iter::once((Phase::Memory, "memory".to_string())))
        .chain((0..args.reps).map(|i| (Phase::Timed, format!("rep {}/{}", i + 1, args.reps))));
    for (phase, tag) in rounds {
        let trim = phase == Phase::Memory;
        for (ci, case) in cases.iter().enumerate() {
            for (pi, &plan) in args.plans.iter().enumerate() {
                let keep = matches!(plan, PlanArg::StoreAll | PlanArg::CandleAutograd)
                    && !first_grads[ci].contains_key(&plan)
                    && args.plans.contains(&PlanArg::CandleAutograd);
                let (s, grads) = model_pass(&model, reference.as_ref(), case, plan, keep, trim)?;
                if let Some(g) = grads {
                    first_grads[ci].insert(plan, g);
                }
                progress(&tag, &case.spec.label, plan.name(), &s);
                model_acc[ci][pi].push(phase, s);
            }
            if phase == Phase::Timed && !args.no_per_unit {
                let u = per_unit_round(&model, case, args.seed.wrapping_add(500 + ci as u64))?;
                eprintln!(
                    "  {tag:<14} {:<16} {:<16} {:>8.3} s  (units in isolation, summed)",
                    case.spec.label,
                    "per-unit",
                    u.values().map(|(f, b)| f + b).sum::<f64>()
                );
                unit_reps[ci].push(u);
            }
        }
        for (ai, a) in attn.iter().enumerate() {
            let s = attention_pass(a, trim)?;
            progress(&tag, &a.t.to_string(), "attention", &s);
            attn_acc[ai].push(phase, s);
        }
    }

    let mut rows = Vec::new();
    for (ci, case) in cases.iter().enumerate() {
        let (units, units_fwd) = if unit_reps[ci].is_empty() {
            (None, None)
        } else {
            let med = |f: &dyn Fn(&(f64, f64)) -> f64| -> BTreeMap<String, f64> {
                timed_units()
                    .map(|u| {
                        let v: Vec<f64> = unit_reps[ci].iter().map(|r| f(&r[u])).collect();
                        (u.to_string(), median(&v))
                    })
                    .collect()
            };
            (Some(med(&|(f, b)| f + b)), Some(med(&|(f, _)| *f)))
        };
        for (pi, &plan) in args.plans.iter().enumerate() {
            let grad_rel = match (
                plan,
                first_grads[ci].get(&PlanArg::CandleAutograd),
                first_grads[ci].get(&PlanArg::StoreAll),
            ) {
                (PlanArg::CandleAutograd, Some(c), Some(t)) => Some(common::compare(c, t)?.rel_l2),
                _ => None,
            };
            let tape = plan != PlanArg::CandleAutograd;
            rows.push(row(
                &case.spec.label,
                plan.name(),
                case.batch.num_sequences(),
                case.batch.num_tokens(),
                &model_acc[ci][pi],
                if tape { units.clone() } else { None },
                if tape { units_fwd.clone() } else { None },
                grad_rel,
            ));
        }
    }
    for (ai, a) in attn.iter().enumerate() {
        rows.push(row(
            &a.t.to_string(),
            "attention",
            1,
            a.t,
            &attn_acc[ai],
            None,
            None,
            None,
        ));
    }
    let report = Report {
        model: describe(&cfg),
        model_source: source,
        threads,
        gemm_threads,
        reps: args.reps,
        warmup: args.warmup,
        seed: args.seed,
        rss_after_load_bytes: rss_after_load,
        cases: rows,
    };
    print_tables(&report);
    if let Some(path) = &args.json {
        hilore_models::atomic::write_bytes_atomic(
            path,
            (serde_json::to_string_pretty(&report)? + "\n").as_bytes(),
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The model to time and a description of where it came from.
fn load_model(
    args: &BenchTapeArgs,
    device: &Device,
) -> anyhow::Result<(Decoder, DecoderConfig, String)> {
    match (&args.model, &args.config) {
        (Some(dir), _) => {
            let (model, cfg, _) = zoo::load(dir, device)
                .with_context(|| format!("loading the zoo model {}", dir.display()))?;
            Ok((model, cfg, format!("zoo model {}", dir.display())))
        }
        (None, config) => {
            let cfg = common::load_config(config.as_deref())?;
            let model = Decoder::random(&cfg, args.seed, device).context("building the model")?;
            let what = match config {
                Some(p) => p.display().to_string(),
                None => "built-in tiny decoder".into(),
            };
            Ok((
                model,
                cfg,
                format!("{what}, random weights, seed {}", args.seed),
            ))
        }
    }
}

fn progress(tag: &str, case: &str, plan: &str, s: &Sample) {
    eprintln!(
        "  {tag:<14} {case:<16} {plan:<16} {:>8.3} s  cpu {:>7.3} s  heap +{:<11} rss +{}",
        s.wall,
        s.cpu,
        human_bytes(s.heap_growth),
        s.rss_growth.map(human_bytes).unwrap_or_else(|| "?".into())
    );
}

#[allow(clippy::too_many_arguments)]
fn row(
    lengths: &str,
    plan: &str,
    sequences: usize,
    tokens: usize,
    acc: &Acc,
    per_unit: Option<BTreeMap<String, f64>>,
    per_unit_fwd: Option<BTreeMap<String, f64>>,
    grad_rel: Option<f64>,
) -> CaseRow {
    let wall: Vec<f64> = acc.timed.iter().map(|s| s.wall).collect();
    let cpu: Vec<f64> = acc.timed.iter().map(|s| s.cpu).collect();
    let (w, c) = (median(&wall), median(&cpu));
    let rss: Vec<Option<usize>> = acc.timed.iter().map(|s| s.rss_growth).collect();
    CaseRow {
        lengths: lengths.to_string(),
        plan: plan.to_string(),
        sequences,
        tokens,
        wall_seconds_median: w,
        cpu_seconds_median: c,
        cpu_per_wall: c / w,
        tokens_per_s: tokens as f64 / w,
        peak_rss_growth_bytes: acc.mem.and_then(|s| s.rss_growth),
        first_pass_rss_growth_bytes: acc.all().next().and_then(|s| s.rss_growth),
        peak_heap_growth_bytes: acc.all().map(|s| s.heap_growth).max().unwrap_or(0),
        peak_activation_bytes: acc.all().filter_map(|s| s.ledger_peak).max(),
        per_unit_seconds: per_unit,
        per_unit_forward_seconds: per_unit_fwd,
        wall_seconds: wall,
        cpu_seconds: cpu,
        warmup_wall_seconds: acc.warm.iter().map(|s| s.wall).collect(),
        memory_pass_wall_seconds: acc.mem.map_or(f64::NAN, |s| s.wall),
        rss_growth_bytes: rss,
        grad_rel_l2_vs_store_all: grad_rel,
    }
}

/// One forward + backward of the whole model under `plan`, measured; the parameter
/// gradients too when `keep`.
fn model_pass(
    model: &Decoder,
    reference: Option<&CandleDecoder>,
    case: &ModelCase,
    plan: PlanArg,
    keep: bool,
    trim: bool,
) -> anyhow::Result<(Sample, Option<NamedGrads>)> {
    let tape_plan = match plan {
        PlanArg::StoreAll => Some(plans::store_all()),
        PlanArg::RecomputeAll => Some(plans::gradient_checkpointing()),
        PlanArg::CandleAutograd => None,
    };
    let meter = Meter::start(trim);
    let (sample, grads) = match tape_plan {
        Some(p) => {
            let mut cx = Cx::new(p);
            let logp = model.token_logprobs(&mut cx, &case.batch)?;
            let mut grads = Grads::new();
            cx.backward(&logp, &case.coeffs, &mut grads)?;
            let s = meter.stop(Some(cx.memory().peak_bytes()));
            let named = if keep {
                Some(common::named_grads(model, &grads)?)
            } else {
                None
            };
            (s, named)
        }
        None => {
            let r = reference.context("the candle-autograd reference was not built")?;
            let g = r.gradients(&case.batch, &case.coeffs)?;
            let s = meter.stop(None);
            (s, keep.then_some(g))
        }
    };
    Ok((sample, grads))
}

/// Random q, k, v and output gradient for one sequence of `t` rows with the model's heads.
fn attention_case(cfg: &DecoderConfig, t: usize, seed: u64) -> anyhow::Result<AttnCase> {
    let dev = Device::Cpu;
    let (hq, hkv, d) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    );
    let randn = |shape: (usize, usize, usize), s: u64| -> anyhow::Result<Tensor> {
        let n = shape.0 * shape.1 * shape.2;
        Ok(Tensor::from_vec(common::normal_vec(n, s), shape, &dev)?)
    };
    Ok(AttnCase {
        t,
        packing: Packing::new(&[t], &dev)?,
        q: randn((t, hq, d), seed)?,
        k: randn((t, hkv, d), seed.wrapping_add(1))?,
        v: randn((t, hkv, d), seed.wrapping_add(2))?,
        grad: randn((t, hq, d), seed.wrapping_add(3))?,
        scale: 1.0 / (d as f64).sqrt(),
    })
}

/// The attention core alone: forward and backward on a fresh tape, measured.
fn attention_pass(a: &AttnCase, trim: bool) -> anyhow::Result<Sample> {
    let meter = Meter::start(trim);
    let mut cx = Cx::new(Plan::store_all());
    let (q, k, v) = (
        Var::param(a.q.clone()),
        Var::param(a.k.clone()),
        Var::param(a.v.clone()),
    );
    let o = cx.attention(&q, &k, &v, &a.packing, a.scale)?;
    let mut grads = Grads::new();
    cx.backward(&o, &a.grad, &mut grads)?;
    Ok(meter.stop(Some(cx.memory().peak_bytes())))
}

/// One unit's forward and backward on a fresh store-all tape: `f` runs the unit (its
/// inputs made leaves inside), backward starts from `grad`. Wall seconds (forward,
/// backward).
fn unit_fb<'m>(
    grad: &Tensor,
    f: impl FnOnce(&mut Cx<'m>) -> hilore_runtime::Result<Var>,
) -> anyhow::Result<(f64, f64)> {
    let mut cx = Cx::new(Plan::store_all());
    let t0 = Instant::now();
    let y = f(&mut cx)?;
    let fwd = t0.elapsed().as_secs_f64();
    let mut grads = Grads::new();
    let t1 = Instant::now();
    cx.backward(&y, grad, &mut grads)?;
    let bwd = t1.elapsed().as_secs_f64();
    drop(grads);
    Ok((fwd, bwd))
}

/// Every unit of the model timed in isolation on `case`'s real inputs (one untimed
/// inference forward gives them), summed over layers.
fn per_unit_round(model: &Decoder, case: &ModelCase, seed: u64) -> anyhow::Result<UnitTimes> {
    let cfg = model.config();
    let b = &case.batch;
    let n = b.num_tokens();
    let dev = Device::Cpu;
    let randn = |shape: &[usize], s: u64| -> anyhow::Result<Tensor> {
        let k: usize = shape.iter().product();
        Ok(Tensor::from_vec(common::normal_vec(k, s), shape, &dev)?)
    };
    let g_hidden = randn(&[n, cfg.hidden_size], seed)?;
    let g_qkv = randn(
        &[
            n,
            cfg.num_attention_heads + 2 * cfg.num_key_value_heads,
            cfg.head_dim,
        ],
        seed.wrapping_add(1),
    )?;
    let g_core = randn(
        &[n, cfg.num_attention_heads, cfg.head_dim],
        seed.wrapping_add(2),
    )?;
    let g_inter = randn(&[n, cfg.intermediate_size], seed.wrapping_add(3))?;
    let leaf = |t: &Tensor| Var::param(t.clone());

    let mut times: UnitTimes = timed_units().map(|u| (u, (0.0, 0.0))).collect();
    let mut add = |u: &'static str, (f, bw): (f64, f64)| {
        let e = times.entry(u).or_default();
        e.0 += f;
        e.1 += bw;
    };
    // The real inputs of every unit: one forward without a tape.
    let mut inf = Cx::inference();
    let ids = Var::constant(b.inputs.clone());
    let targets = Var::constant(b.targets.clone());
    let mut x = model.embed(&mut inf, &ids)?;
    add("embed", unit_fb(&g_hidden, |cx| model.embed(cx, &ids))?);
    for layer in model.layers() {
        let attn = &layer.self_attn;
        let h = layer.attn_norm(&mut inf, &x)?;
        let (q, k, v) = attn.qkv(&mut inf, &h, b.rope_tables()?)?;
        let o = attn.core(&mut inf, &q, &k, &v, &b.packing)?;
        let x_attn = attn.out(&mut inf, &o, &x)?;
        let h_mlp = layer.mlp_norm(&mut inf, &x_attn)?;
        let a = layer.mlp.gate_up(&mut inf, &h_mlp)?;
        let x_out = layer.mlp.down(&mut inf, &a, &x_attn)?;
        let t = |v: &Var| v.tensor().clone();
        let (x_t, h_t, q_t, k_t, v_t, o_t, xa_t, hm_t, a_t) = (
            t(&x),
            t(&h),
            t(&q),
            t(&k),
            t(&v),
            t(&o),
            t(&x_attn),
            t(&h_mlp),
            t(&a),
        );
        add(
            "attn_norm",
            unit_fb(&g_hidden, |cx| layer.attn_norm(cx, &leaf(&x_t)))?,
        );
        add(
            "qkv",
            unit_fb(&g_qkv, |cx| {
                let rope = b
                    .rope_tables()
                    .map_err(|e| hilore_runtime::Error::Tape(e.to_string()))?;
                let (q, k, v) = attn.qkv(cx, &leaf(&h_t), rope)?;
                cx.cat(&[&q, &k, &v], 1)
            })?,
        );
        add(
            "attn_core",
            unit_fb(&g_core, |cx| {
                attn.core(cx, &leaf(&q_t), &leaf(&k_t), &leaf(&v_t), &b.packing)
            })?,
        );
        add(
            "attn_out",
            unit_fb(&g_hidden, |cx| attn.out(cx, &leaf(&o_t), &leaf(&x_t)))?,
        );
        add(
            "mlp_norm",
            unit_fb(&g_hidden, |cx| layer.mlp_norm(cx, &leaf(&xa_t)))?,
        );
        add(
            "gate_up",
            unit_fb(&g_inter, |cx| layer.mlp.gate_up(cx, &leaf(&hm_t)))?,
        );
        add(
            "down",
            unit_fb(&g_hidden, |cx| {
                layer.mlp.down(cx, &leaf(&a_t), &leaf(&xa_t))
            })?,
        );
        x = x_out;
    }
    let x_t = x.tensor().clone();
    add(
        "head",
        unit_fb(&case.coeffs, |cx| model.head(cx, &leaf(&x_t), &targets))?,
    );
    Ok(times)
}

/// `--logprobs`: every case's sequences and the tape's log-probs of them.
fn write_logprobs(
    model: &Decoder,
    cfg: &DecoderConfig,
    cases: &[ModelCase],
    path: &std::path::Path,
) -> anyhow::Result<ExitCode> {
    let mut out = Vec::new();
    for case in cases {
        let b = &case.batch;
        let logp = model.token_logprobs(&mut Cx::inference(), b)?;
        let inputs: Vec<u32> = b.inputs.to_vec1()?;
        let targets: Vec<u32> = b.targets.to_vec1()?;
        let mut seqs = Vec::new();
        let mut off = 0;
        for rows in b.lengths() {
            let mut s = inputs[off..off + rows].to_vec();
            s.push(targets[off + rows - 1]);
            seqs.push(s);
            off += rows;
        }
        out.push(serde_json::json!({
            "lengths": case.spec.label,
            "sequences": seqs,
            "logprobs": logp.tensor().to_vec1::<f32>()?,
        }));
    }
    let v = serde_json::json!({"model": describe(cfg), "cases": out});
    hilore_models::atomic::write_bytes_atomic(path, (serde_json::to_string(&v)? + "\n").as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!(
        "wrote the tokens and log-probs of {} case(s) to {}",
        cases.len(),
        path.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn print_tables(r: &Report) {
    println!(
        "{:<18} {:<16} {:>7} {:>10} {:>10} {:>8} {:>11} {:>12} {:>12}",
        "case",
        "plan",
        "tokens",
        "wall s",
        "cpu s",
        "cpu/wall",
        "tokens/s",
        "peak RSS +",
        "peak heap +"
    );
    for c in &r.cases {
        println!(
            "{:<18} {:<16} {:>7} {:>10.4} {:>10.4} {:>8.2} {:>11.0} {:>12} {:>12}",
            c.lengths,
            c.plan,
            c.tokens,
            c.wall_seconds_median,
            c.cpu_seconds_median,
            c.cpu_per_wall,
            c.tokens_per_s,
            c.peak_rss_growth_bytes
                .map(human_bytes)
                .unwrap_or_else(|| "-".into()),
            human_bytes(c.peak_heap_growth_bytes)
        );
    }
    for c in &r.cases {
        if let Some(g) = c.grad_rel_l2_vs_store_all {
            println!(
                "{}: candle-autograd gradients agree with the tape's store-all to rel L2 {g:.2e}",
                c.lengths
            );
        }
    }
    // One per-unit column per case (the first tape plan's row carries it).
    let mut seen = std::collections::BTreeSet::new();
    let with_units: Vec<&CaseRow> = r
        .cases
        .iter()
        .filter(|c| c.per_unit_seconds.is_some() && seen.insert(c.lengths.clone()))
        .collect();
    if with_units.is_empty() {
        return;
    }
    println!();
    println!(
        "forward + backward per unit, each unit in isolation (fresh store-all tape, real \
         inputs, summed over layers), median seconds:"
    );
    print!("{:<10}", "unit");
    for c in &with_units {
        print!(" {:>18}", c.lengths);
    }
    println!();
    for u in timed_units() {
        print!("{u:<10}");
        for c in &with_units {
            let s = c.per_unit_seconds.as_ref().and_then(|m| m.get(u)).copied();
            print!(" {:>18.5}", s.unwrap_or(f64::NAN));
        }
        println!();
    }
    print!("{:<10}", "sum");
    for c in &with_units {
        let s: f64 = c
            .per_unit_seconds
            .as_ref()
            .map_or(0.0, |m| m.values().sum());
        print!(" {s:>18.5}");
    }
    println!();
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}
