//! `hilore bench`'s flags.

use clap::Args;
use hilore_models::DecoderConfig;
use hilore_runtime::allocator::DEFAULT_TARGET_REL_L2;
use std::path::PathBuf;

#[derive(Args)]
pub struct BenchArgs {
    /// An HF `config.json` for the model (random weights). Default: the built-in benchmark
    /// decoder (4 layers, hidden 192, MLP 512, 6 query / 2 key-value heads of 32,
    /// vocabulary 1024: 2.0 M parameters).
    #[arg(long, value_name = "FILE")]
    pub(super) config: Option<PathBuf>,
    /// A built-in model size instead of --config: `2m` (the default benchmark decoder) or
    /// `10m` (6 layers, hidden 384, MLP 1024, 6 query / 2 key-value heads of 64: about
    /// 10 M parameters, where parameters, gradients and AdamW dominate the peak). Run
    /// once per size for a size sweep (scripts/bench-sizes.sh).
    #[arg(long, value_parser = ["2m", "10m"], conflicts_with = "config")]
    pub(super) size: Option<String>,
    /// Rows (tokens) of every microbatch.
    #[arg(long, default_value_t = 896)]
    pub(super) rows: usize,
    /// Prompts per GRPO step.
    #[arg(long, default_value_t = 8)]
    pub(super) prompts: usize,
    /// Prompt and response lengths: `default` (prompts 24-96 tokens, responses 32 +
    /// Exp(110)), `math` (prompts 80-120, responses about 300) or `long-prompt` (prompts
    /// 1024-2048, responses about 256; needs --rows of at least 2049).
    #[arg(long, value_enum, default_value = "default")]
    pub(super) shape: super::workload::StepShape,
    /// Every policy runs the shared-prefix layout: a microbatch holds each prompt once with
    /// the responses of it that it packs (`hilore train --shared-prefix`). Throughputs
    /// count the rows the sequences have unshared.
    #[arg(long)]
    pub(super) shared_prefix: bool,
    /// Responses per prompt.
    #[arg(long, default_value_t = 8)]
    pub(super) group: usize,
    /// Interleaved repetitions of the main comparison (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub(super) reps: usize,
    /// Seed of weights and batches.
    #[arg(long, default_value_t = 7)]
    pub(super) seed: u64,
    /// Memory budget on the whole actor-update peak: a factor of full recompute's peak
    /// (`1.1`) or bytes (`300MiB`).
    #[arg(long, default_value = "1.1")]
    pub(super) budget: String,
    /// Target relative L2 error of the step's gradient (sets the risk budget).
    #[arg(long, default_value_t = DEFAULT_TARGET_REL_L2)]
    pub(super) target_rel_l2: f64,
    /// Codecs the allocators may use (default: those `hilore train --policy hilore`
    /// offers).
    #[arg(long, value_delimiter = ',', default_values = crate::train::HILORE_CODECS)]
    pub(super) codecs: Vec<String>,
    /// Budget factors to sweep (e.g. `1.0,1.05,1.1,1.25,1.5,2`): a Pareto chart of
    /// throughput against memory for every policy.
    #[arg(long, value_delimiter = ',')]
    pub(super) budgets: Vec<f64>,
    /// Risk targets (relative L2) to sweep for HiLoRe, its exposure-blind ablation and the
    /// Adacc-style policy at the main budget: time against measured gradient error.
    #[arg(long, value_delimiter = ',', default_value = "0.003,0.03")]
    pub(super) risk_targets: Vec<f64>,
    /// Repetitions of each sweep point.
    #[arg(long, default_value_t = 1)]
    pub(super) sweep_reps: usize,
    /// Write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub(super) json: Option<PathBuf>,
    /// Write SVG charts into DIR.
    #[arg(long, value_name = "DIR")]
    pub(super) plot: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub(super) quiet: bool,
}

impl BenchArgs {
    /// Refuses a count or factor no benchmark can use, naming the flag and what it means.
    pub(super) fn check(&self) -> anyhow::Result<()> {
        use crate::common::{check_count, check_flag, Range};
        check_count(
            "--reps",
            self.reps,
            1,
            "the median of that many repetitions is reported",
        )?;
        check_count(
            "--sweep-reps",
            self.sweep_reps,
            1,
            "repetitions of each sweep point",
        )?;
        check_count("--rows", self.rows, 1, "rows (tokens) of every microbatch")?;
        check_count("--prompts", self.prompts, 1, "prompts of the GRPO step")?;
        check_count(
            "--group",
            self.group,
            2,
            "with one response per prompt every advantage is 0 and no microbatch has exposure",
        )?;
        check_flag(
            "--target-rel-l2",
            self.target_rel_l2,
            Range::Positive,
            "the gradient's relative L2 error to allow; 1e-2 is the default",
        )?;
        for &b in &self.budgets {
            check_flag(
                "--budgets",
                b,
                Range::Positive,
                "factors of full recompute's peak, e.g. 1,1.1,1.5",
            )?;
        }
        for &t in &self.risk_targets {
            check_flag(
                "--risk-targets",
                t,
                Range::Positive,
                "relative L2 errors, e.g. 0.003,0.03",
            )?;
        }
        Ok(())
    }

    /// The model measured: `--config`, else the `--size` preset (`2m`, the benchmark
    /// decoder, by default).
    pub(super) fn model_config(&self) -> anyhow::Result<DecoderConfig> {
        Ok(match (&self.config, self.size.as_deref()) {
            (Some(p), _) => crate::common::load_config(Some(p))?,
            (None, Some("10m")) => DecoderConfig {
                hidden_size: 384,
                intermediate_size: 1024,
                num_hidden_layers: 6,
                head_dim: 64,
                ..DecoderConfig::bench()
            },
            (None, _) => DecoderConfig::bench(),
        })
    }
}
