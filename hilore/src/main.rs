//! The `hilore` command line: parses the arguments and calls the library.

use hilore::{
    alloc, bench, bench_tape, check, codecs, coefficients, common, compare, export, score, train,
    units,
};

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: alloc::Counting = alloc::Counting;

/// HiLoRe decides, for every recovery unit of a model and every microbatch, whether the
/// activations its backward needs are stored, compressed or recomputed.
///
/// Start with `hilore units` to see the recovery units compiled into this binary, then
/// `hilore check` to verify that every fidelity recovers the exact (or a bounded) gradient
/// on the built-in decoder.
#[derive(Parser)]
#[command(name = "hilore", version, about, long_about = None, propagate_version = true)]
struct Cli {
    /// Where `check` and `bench` put tensors and run the math: `cpu`, or `cuda` / `cuda:N`
    /// for NVIDIA GPU N (needs the GPU binary, built by scripts/build-gpu.sh). The other
    /// commands run on the CPU.
    #[arg(
        long,
        global = true,
        value_name = "cpu|cuda[:N]",
        default_value = "cpu"
    )]
    device: common::DeviceArg,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every recovery unit registered in this binary (name, module, file:line,
    /// deterministic, parameters, cost expression).
    Units(units::UnitsArgs),
    /// Verify a model's recovery on random data: run forward+backward under store-all,
    /// recompute-all (per-layer gradient checkpointing), compress-all for every codec and
    /// random mixed plans; compare every parameter gradient with store-all's. Exits 1 when
    /// a recompute is not bit-identical.
    Check(check::CheckArgs),
    /// Time forward+backward of the tape on a whole model under store-all and
    /// recompute-all (and candle's own autograd, optionally): wall and CPU seconds, peak
    /// RSS and heap growth, per-unit times, the attention core alone; the tape side of
    /// scripts/vs-pytorch.sh.
    #[command(after_long_help = bench_tape::AFTER_HELP)]
    BenchTape(bench_tape::BenchTapeArgs),
    /// Measure every codec on this device: round-trip error on Gaussian and heavy-tailed
    /// data, compression ratio, encode and decode bandwidth against a copy of the same
    /// bytes.
    Codecs(codecs::CodecsArgs),
    /// Compare HiLoRe with the baselines (store-all, full recompute, selective recompute,
    /// budgeted recompute, compress-all, Adacc-style) on the same model, GRPO batches and
    /// seeds, interleaved, under one memory budget: throughput, peak memory (predicted and
    /// measured), gradient error, time split; `--budgets` sweeps the budget.
    Bench(Box<bench::BenchArgs>),
    /// Paired GRPO training runs, full recompute against HiLoRe (or other arms: risk
    /// targets, compress-all), same seeds: the paired difference of held-out accuracy,
    /// its trend over risk targets, and the actor-update throughput.
    Compare(compare::CompareArgs),
    /// Train a policy with GRPO on a task with verifiable rewards: warm start by supervised
    /// fine-tuning, then rollouts with a KV cache, rewards, group-relative advantages and
    /// a microbatched actor update under a fidelity policy; held-out accuracy before and
    /// after, per-step log and metrics, atomic checkpoints, bit-identical --resume.
    Train(Box<train::TrainArgs>),
    /// Per-token log-probs of completions under a zoo model (a Hugging Face model
    /// directory): for each `{"prompt": ..., "completion": ...}` line, the completion's
    /// token ids, tokens and log-probs given the prompt.
    Score(score::ScoreArgs),
    /// A batch's GRPO advantages and per-token dL/dlogp under a TRL GRPOConfig (its own
    /// keys and defaults), as JSON: to put HiLoRe's numbers beside another trainer's.
    #[command(after_long_help = coefficients::AFTER_HELP)]
    Coefficients(coefficients::CoefficientsArgs),
    /// Write a zoo model (or, with --config, a model with random weights) as a Hugging
    /// Face model directory (config.json, model.safetensors with the same tensor names,
    /// tokenizer.json), loadable by candle-transformers and transformers.
    Export(export::ExportArgs),
}

/// The command line with negative numbers taken as values by every command: `--lr -1`
/// is the value -1, which the command then checks and refuses naming the flag and its
/// range, rather than an unknown flag `-1`.
fn command_line() -> clap::Command {
    let mut cmd = Cli::command().allow_negative_numbers(true);
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_string())
        .collect();
    for n in names {
        cmd = cmd.mut_subcommand(n, |s| s.allow_negative_numbers(true));
    }
    cmd
}

fn main() -> ExitCode {
    let matches = command_line().get_matches();
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // The flags given on the command line, which `train --grpo-config` leaves alone.
    if let (Command::Train(a), Some(("train", sub))) = (&mut cli.command, matches.subcommand()) {
        a.explicit = train::explicit_ids(sub);
    }
    if let Err(e) = common::select_device(cli.device) {
        eprintln!("error: {e:#}");
        return ExitCode::from(2);
    }
    let on_device = matches!(cli.command, Command::Check(_) | Command::Bench(_));
    if cli.device != common::DeviceArg::Cpu && !on_device {
        eprintln!(
            "note: --device {} applies to `check` and `bench`; this command runs on the CPU",
            cli.device
        );
    }
    let result = match cli.command {
        Command::Units(a) => units::run(a),
        Command::Check(a) => check::run(a),
        Command::BenchTape(a) => bench_tape::run(a),
        Command::Codecs(a) => codecs::run(a),
        Command::Bench(a) => bench::run(*a),
        Command::Compare(a) => compare::run(a),
        Command::Train(a) => train::run(*a),
        Command::Score(a) => score::run(a),
        Command::Export(a) => export::run(a),
        Command::Coefficients(a) => coefficients::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
