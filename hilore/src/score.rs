//! `hilore score`: per-token log-probs of completions under a zoo model.

use anyhow::{bail, Context};
use candle_core::Device;
use clap::Args;
use hilore_models::{zoo, Decoder, DecoderConfig, TokenBatch, Tokenizer};
use hilore_runtime::Cx;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args)]
pub struct ScoreArgs {
    /// Model directory: config.json, model.safetensors (or model.safetensors.index.json and
    /// its shards) and tokenizer.json.
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// JSONL file: one `{"prompt": ..., "completion": ...}` object per line (blank lines
    /// are skipped).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Print one JSON object per input line (`line`, `prompt_tokens`, `token_ids`,
    /// `tokens`, `logprobs`, `sum_logprob`) instead of a table.
    #[arg(long)]
    json: bool,
    /// Most tokens per forward pass (lines are packed into batches up to this size).
    #[arg(long, default_value_t = 4096)]
    batch_tokens: usize,
}

/// One input line, tokenized.
struct Item {
    line: usize,
    prompt: Vec<u32>,
    completion: Vec<u32>,
}

/// The log-probs of one line's completion tokens.
#[derive(serde::Serialize)]
struct Scored {
    line: usize,
    prompt_tokens: usize,
    token_ids: Vec<u32>,
    tokens: Vec<String>,
    logprobs: Vec<f32>,
    sum_logprob: f64,
}

fn field<'a>(v: &'a serde_json::Value, key: &str, at: &str) -> anyhow::Result<&'a str> {
    match v.get(key) {
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(other) => bail!("{at}: field `{key}` is {other}, expected a string"),
        None => bail!(
            "{at}: no field `{key}`; expected {{\"prompt\": \"...\", \"completion\": \"...\"}}"
        ),
    }
}

fn read_items(path: &Path, tok: &Tokenizer, cfg: &DecoderConfig) -> anyhow::Result<Vec<Item>> {
    let text = hilore_models::read_text_file(path)
        .with_context(|| format!("cannot read the input file {}", path.display()))?;
    let mut items = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{line}", path.display());
        let v: serde_json::Value = serde_json::from_str(raw).map_err(|e| {
            anyhow::anyhow!(
                "{at}: not a JSON object ({e}); expected {{\"prompt\": \"...\", \"completion\": \"...\"}}"
            )
        })?;
        let prompt = tok.encode_prompt(field(&v, "prompt", &at)?)?;
        let completion = tok.encode_completion(field(&v, "completion", &at)?)?;
        if prompt.is_empty() && !completion.is_empty() {
            bail!(
                "{at}: the prompt encodes to no tokens, so the first completion token has nothing to be predicted from; give a prompt (or a tokenizer whose post-processor adds a BOS)"
            );
        }
        let positions = (prompt.len() + completion.len()).saturating_sub(1);
        if positions > cfg.max_position_embeddings {
            bail!(
                "{at}: prompt and completion are {} tokens, more than the model's max_position_embeddings = {} allows",
                prompt.len() + completion.len(),
                cfg.max_position_embeddings
            );
        }
        items.push(Item {
            line,
            prompt,
            completion,
        });
    }
    Ok(items)
}

/// Scores `items` under `model`, packing them into batches of at most `batch_tokens`
/// tokens: per line, the log-prob of each completion token given everything before it.
fn score(
    model: &Decoder,
    tok: &Tokenizer,
    items: &[Item],
    batch_tokens: usize,
    device: &Device,
) -> anyhow::Result<Vec<Scored>> {
    let mut out = Vec::with_capacity(items.len());
    let mut start = 0;
    while start < items.len() {
        // Lines with a completion go into the batch; the others have nothing to score.
        let mut end = start;
        let mut tokens = 0;
        while end < items.len() {
            let len = items[end].prompt.len() + items[end].completion.len();
            if end > start && tokens + len > batch_tokens {
                break;
            }
            tokens += len;
            end += 1;
        }
        let chunk = &items[start..end];
        let seqs: Vec<Vec<u32>> = chunk
            .iter()
            .filter(|it| !it.completion.is_empty())
            .map(|it| [it.prompt.as_slice(), it.completion.as_slice()].concat())
            .collect();
        let logp: Vec<f32> = if seqs.is_empty() {
            Vec::new()
        } else {
            let batch = TokenBatch::from_sequences(&seqs, model.config(), device)?;
            let mut cx = Cx::inference();
            model
                .token_logprobs(&mut cx, &batch)?
                .tensor()
                .to_vec1::<f32>()?
        };
        // Sequence of length L has rows for targets 1..L; the completion's are the last.
        let mut row = 0;
        for it in chunk {
            let c = it.completion.len();
            let mut s = Scored {
                line: it.line,
                prompt_tokens: it.prompt.len(),
                token_ids: it.completion.clone(),
                tokens: it.completion.iter().map(|&id| tok.token(id)).collect(),
                logprobs: Vec::new(),
                sum_logprob: 0.0,
            };
            if c > 0 {
                let rows = it.prompt.len() + c - 1;
                s.logprobs = logp[row + rows - c..row + rows].to_vec();
                s.sum_logprob = s.logprobs.iter().map(|&v| v as f64).sum();
                row += rows;
            }
            out.push(s);
        }
        start = end;
    }
    Ok(out)
}

pub fn run(args: ScoreArgs) -> anyhow::Result<ExitCode> {
    let device = Device::Cpu;
    let (model, cfg, tok) = zoo::load(&args.model, &device)?;
    let Some(tok) = tok else {
        bail!(
            "{} has no {}: score needs the model's tokenizer to tokenize prompts and completions",
            args.model.display(),
            zoo::TOKENIZER_FILE
        );
    };
    let items = read_items(&args.input, &tok, &cfg)?;
    let scored = score(&model, &tok, &items, args.batch_tokens.max(1), &device)?;
    let stdout = std::io::stdout();
    let mut w = std::io::BufWriter::new(stdout.lock());
    for s in &scored {
        if args.json {
            writeln!(w, "{}", serde_json::to_string(s)?)?;
        } else {
            writeln!(
                w,
                "line {}: {} prompt tokens, {} completion tokens, sum logp {:.6}",
                s.line,
                s.prompt_tokens,
                s.token_ids.len(),
                s.sum_logprob
            )?;
            for ((id, t), lp) in s.token_ids.iter().zip(&s.tokens).zip(&s.logprobs) {
                writeln!(w, "  {id:>8}  {:<24} {lp:>12.6}", format!("{t:?}"))?;
            }
        }
    }
    w.flush()?;
    Ok(ExitCode::SUCCESS)
}
