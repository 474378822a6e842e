//! `hilore export`: write a model back as a Hugging Face model directory.

use crate::common;
use anyhow::{bail, Context};
use candle_core::{DType, Device};
use clap::Args;
use hilore_models::{zoo, Decoder};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["model", "config"])))]
pub struct ExportArgs {
    /// The model directory to export (config.json, safetensors weights, tokenizer.json).
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Instead of --model: an HF `config.json` for a model with seeded random weights
    /// (the same weights `hilore bench-tape --config FILE --seed S` and `hilore check
    /// --config FILE` build), written with no tokenizer. scripts/vs-pytorch.sh exports
    /// the benchmark decoder this way for PyTorch.
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    config: Option<PathBuf>,
    /// Seed of the random weights with --config.
    #[arg(long, default_value_t = 7, requires = "config")]
    seed: u64,
    /// Output directory (created if needed): config.json, model.safetensors with the same
    /// tensor names, and tokenizer.json when the model has one. Loadable by
    /// candle-transformers, `transformers` and `hilore score --model`.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Weight dtype: `f32` (a bit-identical round trip), `bf16` or `f16` (rounded to
    /// nearest, half the size).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Replace the model files of an --out directory that already holds a model (the new
    /// files are written beside them and swapped in only when complete).
    #[arg(long)]
    force: bool,
}

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.model {
        if let (Ok(a), Ok(b)) = (dir.canonicalize(), args.out.canonicalize()) {
            if a == b {
                bail!(
                    "--out {} is the model directory itself; export to another directory",
                    args.out.display()
                );
            }
        }
    }
    if let (false, Some(f)) = (args.force, zoo::model_files_in(&args.out)) {
        bail!(
            "--out {} already holds a model ({f}); pass --force to replace it, or choose another directory",
            args.out.display()
        );
    }
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => bail!("--dtype {other}: expected f32, bf16 or f16"),
    };
    let (model, cfg, tok) = match (&args.model, &args.config) {
        (Some(dir), _) => zoo::load(dir, &Device::Cpu)?,
        (None, Some(file)) => {
            let cfg = common::load_config(Some(file))?;
            let model = Decoder::random(&cfg, args.seed, &Device::Cpu)?;
            (model, cfg, None)
        }
        (None, None) => bail!("give the model to export: --model DIR or --config FILE"),
    };
    zoo::export_with(&model, &cfg, tok.as_ref(), &args.out, dtype)
        .with_context(|| format!("exporting to {}", args.out.display()))?;
    eprintln!(
        "wrote {} ({} parameters, {}{})",
        args.out.display(),
        model.num_params(),
        args.dtype,
        if tok.is_some() { ", tokenizer" } else { "" }
    );
    Ok(ExitCode::SUCCESS)
}
