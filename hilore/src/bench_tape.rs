//! `hilore bench-tape`: the HiLoRe tape against candle's own autograd, side by side.

use crate::alloc;
use crate::check::describe;
use crate::common::{self, human_bytes};
use anyhow::Context;
use candle_core::Device;
use clap::Args;
use hilore_models::reference::CandleDecoder;
use hilore_models::{plans, Decoder, TokenBatch};
use hilore_runtime::{Cx, Grads, Plan};
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Args)]
pub struct BenchTapeArgs {
    /// An HF `config.json` to build the model from (random weights). Default: the
    /// built-in tiny decoder.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Lengths of the packed sequences.
    #[arg(long, value_name = "L1,L2,...", default_value = "256,192,320,256")]
    lengths: common::Lengths,
    /// Repetitions; the runs are interleaved (tape, candle, tape GC, tape, candle, ...)
    /// and the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Seed of weights, tokens and coefficients.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Serialize, Clone)]
struct Row {
    method: String,
    median_seconds: f64,
    tokens_per_s: f64,
    /// Peak heap bytes above the level before the pass (every allocation of the process).
    peak_heap_bytes: usize,
    /// Peak of what the tape counts for backward, saved state plus activation gradients
    /// (None for candle's autograd, whose graph the tape cannot see).
    peak_activation_bytes: Option<usize>,
    seconds: Vec<f64>,
}

#[derive(Serialize)]
struct Report {
    model: String,
    tokens: usize,
    reps: usize,
    rows: Vec<Row>,
    time_ratio_tape_store_to_candle: f64,
    memory_ratio_tape_store_to_candle: f64,
    max_rel_l2_grad_tape_vs_candle: f64,
}

enum Method {
    Tape(Plan),
    Candle,
}

pub fn run(args: BenchTapeArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.reps >= 1, "--reps must be at least 1");
    let device = Device::Cpu;
    let cfg = common::load_config(args.config.as_deref())?;
    let model = Decoder::random(&cfg, args.seed, &device)?;
    let reference = CandleDecoder::from_decoder(&model)
        .context("building the candle-autograd copy of the model")?;
    let batch = TokenBatch::random(&args.lengths.0, &cfg, args.seed.wrapping_add(1), &device)?;
    let coeffs = common::coefficients(batch.num_tokens(), args.seed.wrapping_add(2), &device)?;
    let tokens = batch.num_tokens();

    let methods = [
        ("tape store-all", Method::Tape(plans::store_all())),
        ("candle autograd", Method::Candle),
        (
            "tape recompute-all",
            Method::Tape(plans::gradient_checkpointing()),
        ),
    ];
    let mut secs = vec![Vec::new(); methods.len()];
    let mut peaks = vec![0usize; methods.len()];
    let mut saved = vec![None; methods.len()];
    let mut grads_of: Vec<Option<Vec<(String, candle_core::Tensor)>>> = vec![None; methods.len()];
    eprintln!(
        "model: {}; {} tokens; {} interleaved repetitions",
        describe(&cfg),
        tokens,
        args.reps
    );
    for rep in 0..args.reps {
        for (i, (name, m)) in methods.iter().enumerate() {
            let base = alloc::reset_peak();
            let t0 = Instant::now();
            let g = match m {
                Method::Tape(plan) => {
                    let mut cx = Cx::new(plan.clone());
                    let logp = model.token_logprobs(&mut cx, &batch)?;
                    let mut grads = Grads::new();
                    cx.backward(&logp, &coeffs, &mut grads)?;
                    saved[i] = Some(cx.memory().peak_bytes());
                    model
                        .named_params()
                        .into_iter()
                        .map(|(n, v)| grads.get(v.id()).cloned().map(|g| (n, g)))
                        .collect::<Option<Vec<_>>>()
                }
                Method::Candle => Some(reference.gradients(&batch, &coeffs)?),
            };
            let dt = t0.elapsed().as_secs_f64();
            let peak = alloc::peak().saturating_sub(base);
            secs[i].push(dt);
            peaks[i] = peaks[i].max(peak);
            if rep == 0 {
                grads_of[i] = g;
            }
            eprintln!(
                "  rep {}/{} {:<20} {:>8.3} s  peak heap {}",
                rep + 1,
                args.reps,
                name,
                dt,
                human_bytes(peak)
            );
        }
    }
    let rows: Vec<Row> = methods
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let med = median(&secs[i]);
            Row {
                method: name.to_string(),
                median_seconds: med,
                tokens_per_s: tokens as f64 / med,
                peak_heap_bytes: peaks[i],
                peak_activation_bytes: saved[i],
                seconds: secs[i].clone(),
            }
        })
        .collect();
    let max_rel = match (&grads_of[0], &grads_of[1]) {
        (Some(a), Some(b)) => {
            let mut worst: f64 = 0.0;
            for ((n, x), (_, y)) in a.iter().zip(b) {
                let d = common::compare(&[(n.clone(), x.clone())], &[(n.clone(), y.clone())])?;
                worst = worst.max(d.rel_l2);
            }
            worst
        }
        _ => anyhow::bail!("a method produced no gradients"),
    };
    let report = Report {
        model: describe(&cfg),
        tokens,
        reps: args.reps,
        time_ratio_tape_store_to_candle: rows[0].median_seconds / rows[1].median_seconds,
        memory_ratio_tape_store_to_candle: rows[0].peak_heap_bytes as f64
            / rows[1].peak_heap_bytes as f64,
        max_rel_l2_grad_tape_vs_candle: max_rel,
        rows,
    };
    println!(
        "{:<20} {:>10} {:>12} {:>14} {:>14}",
        "method", "median s", "tokens/s", "peak heap", "peak act."
    );
    for r in &report.rows {
        println!(
            "{:<20} {:>10.4} {:>12.0} {:>14} {:>14}",
            r.method,
            r.median_seconds,
            r.tokens_per_s,
            human_bytes(r.peak_heap_bytes),
            r.peak_activation_bytes
                .map(human_bytes)
                .unwrap_or_else(|| "-".into())
        );
    }
    println!(
        "tape store-all / candle autograd: time x{:.3}, peak heap x{:.3}; gradients agree to rel L2 {:.2e}",
        report.time_ratio_tape_store_to_candle, report.memory_ratio_tape_store_to_candle, report.max_rel_l2_grad_tape_vs_candle
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}
