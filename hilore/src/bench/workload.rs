//! The benchmark's model and GRPO-like batches.

use candle_core::{Device, Tensor};
use hilore_models::rng::SplitMix64;
use hilore_models::{DecoderConfig, TokenBatch};
use hilore_runtime::allocator::{microbatch_input, MicrobatchInput};

/// One microbatch of the actor update.
#[derive(Debug, Clone)]
pub struct Microbatch {
    /// Packed tokens.
    pub batch: TokenBatch,
    /// `dL/dlogp` per row, as a tensor.
    pub coeff_tensor: Tensor,
    /// Shape and exposure.
    pub input: MicrobatchInput,
    /// Sequences (padding excluded) and how many of them have zero advantage.
    pub sequences: usize,
    pub zero_advantage_sequences: usize,
}

/// How a GRPO step is drawn.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct StepSpec {
    /// Prompts per step.
    pub prompts: usize,
    /// Responses per prompt.
    pub group: usize,
    /// Rows (tokens) of every microbatch.
    pub rows_per_microbatch: usize,
}

/// A GRPO-like optimizer step, packed into microbatches of exactly
/// `spec.rows_per_microbatch` rows.
///
/// Per prompt: a length uniform in 24..=96 tokens and a solve rate `p` that is 0 with
/// probability 0.15 (too hard), 1 with probability 0.10 (too easy) and uniform in
/// (0.1, 0.9) otherwise. Each of the `group` responses is correct with probability `p` (reward 1,
/// else 0) and has `32 + Exp(mean 110)` tokens (capped at 384), correct ones 30% shorter.
/// Advantages are GRPO's `(R - mean) / (std + 1e-6)` within the group, so a group whose
/// rewards are all equal has advantage 0 (about a third of the groups with these rates
/// and 8 responses per prompt: the familiar share of GRPO groups that carry no signal); per-token coefficients are
/// `c = -A / (response tokens of the step)` on response tokens (token-mean aggregation,
/// one update epoch, no KL: `rho = 1`, the case where `c` is known before the forward) and
/// 0 on prompt tokens. Sequences are packed in group order; a microbatch's leftover rows
/// are filled by a padding sequence with zero coefficients.
pub fn grpo_step(
    cfg: &DecoderConfig,
    spec: StepSpec,
    seed: u64,
    device: &Device,
) -> anyhow::Result<Vec<Microbatch>> {
    let mut rng = SplitMix64::for_stream(seed, "bench-grpo-step");
    let mut unit = move || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    struct Seq {
        tokens: Vec<u32>,
        prompt: usize,
        advantage: f64,
    }
    let vocab = cfg.vocab_size as u64;
    let mut tok_rng = SplitMix64::for_stream(seed, "bench-grpo-tokens");
    let mut seqs = Vec::new();
    let mut response_tokens = 0usize;
    let cap = spec.rows_per_microbatch;
    for _ in 0..spec.prompts {
        let plen = 24 + (unit() * 73.0) as usize;
        let prompt: Vec<u32> = (0..plen).map(|_| tok_rng.below(vocab) as u32).collect();
        let u = unit();
        let p = if u < 0.15 {
            0.0
        } else if u < 0.25 {
            1.0
        } else {
            0.1 + 0.8 * unit()
        };
        let mut group = Vec::new();
        for _ in 0..spec.group {
            let correct = unit() < p;
            let mut rlen = 32.0 + (-110.0 * (1.0 - unit()).ln());
            if correct {
                rlen *= 0.7;
            }
            let rlen = (rlen as usize).clamp(2, 384).min(cap + 1 - plen.min(cap));
            let mut t = prompt.clone();
            t.extend((0..rlen).map(|_| tok_rng.below(vocab) as u32));
            t.truncate(cap + 1);
            group.push((t, if correct { 1.0 } else { 0.0 }));
        }
        let mean = group.iter().map(|g| g.1).sum::<f64>() / group.len() as f64;
        let var = group.iter().map(|g| (g.1 - mean).powi(2)).sum::<f64>() / group.len() as f64;
        for (t, r) in group {
            let adv = (r - mean) / (var.sqrt() + 1e-6);
            response_tokens += t.len() - plen;
            seqs.push(Seq {
                tokens: t,
                prompt: plen,
                advantage: adv,
            });
        }
    }
    let w = 1.0 / response_tokens.max(1) as f64;
    // Pack.
    let mut out = Vec::new();
    let mut cur: Vec<Vec<u32>> = Vec::new();
    let mut cur_c: Vec<f32> = Vec::new();
    let mut rows = 0usize;
    let (mut nseq, mut nzero) = (0usize, 0usize);
    let mut flush = |cur: &mut Vec<Vec<u32>>,
                     cur_c: &mut Vec<f32>,
                     rows: &mut usize,
                     nseq: &mut usize,
                     nzero: &mut usize|
     -> anyhow::Result<()> {
        if *rows < cap {
            let pad = cap - *rows;
            cur.push((0..=pad).map(|_| tok_rng.below(vocab) as u32).collect());
            cur_c.extend(std::iter::repeat_n(0.0, pad));
        }
        let batch = TokenBatch::from_sequences(cur, cfg, device)?;
        let coeff_tensor = Tensor::from_vec(cur_c.clone(), cur_c.len(), device)?;
        let input = microbatch_input(&batch.packing, cur_c);
        cur_c.clear();
        out.push(Microbatch {
            batch,
            coeff_tensor,
            input,
            sequences: *nseq,
            zero_advantage_sequences: *nzero,
        });
        cur.clear();
        *rows = 0;
        *nseq = 0;
        *nzero = 0;
        Ok(())
    };
    for s in seqs {
        let r = s.tokens.len() - 1;
        if rows + r > cap {
            flush(&mut cur, &mut cur_c, &mut rows, &mut nseq, &mut nzero)?;
        }
        // Row i predicts token i + 1: response rows are i >= prompt - 1.
        for i in 0..r {
            let c = if i + 1 >= s.prompt {
                (-s.advantage * w) as f32
            } else {
                0.0
            };
            cur_c.push(c);
        }
        rows += r;
        nseq += 1;
        if s.advantage == 0.0 {
            nzero += 1;
        }
        cur.push(s.tokens);
    }
    if rows > 0 {
        flush(&mut cur, &mut cur_c, &mut rows, &mut nseq, &mut nzero)?;
    }
    Ok(out)
}
