//! The benchmark's model and GRPO-like batches.

use crate::train::update::padding_groups;
use candle_core::{Device, Tensor};
use hilore_models::rng::SplitMix64;
use hilore_models::{DecoderConfig, PromptGroup, TokenBatch};
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
    /// The rows throughput counts: the batch's, or with shared prefixes the rows its
    /// sequences and padding have unshared (so that throughputs compare).
    pub rows_counted: usize,
}

/// The lengths a GRPO step is drawn with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum StepShape {
    /// Prompts of 24-96 tokens, responses of `32 + Exp(mean 110)` tokens (capped at 384).
    Default,
    /// Math reasoning: prompts of 80-120 tokens, responses of `100 + Exp(mean 200)`
    /// (capped at 768; about 300 on average).
    Math,
    /// Long prompts (retrieval, long context): 1024-2048 tokens, responses of
    /// `128 + Exp(mean 128)` (capped at 512; about 256).
    LongPrompt,
}

impl StepShape {
    /// Shortest and longest prompt.
    pub fn prompt_range(self) -> (usize, usize) {
        match self {
            StepShape::Default => (24, 96),
            StepShape::Math => (80, 120),
            StepShape::LongPrompt => (1024, 2048),
        }
    }

    /// A response's base length, the mean of its exponential part, and its cap.
    fn response(self) -> (f64, f64, usize) {
        match self {
            StepShape::Default => (32.0, 110.0, 384),
            StepShape::Math => (100.0, 200.0, 768),
            StepShape::LongPrompt => (128.0, 128.0, 512),
        }
    }
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
    /// Prompt and response lengths.
    pub shape: StepShape,
    /// Each prompt once per microbatch ([`TokenBatch::from_shared_prefixes`]).
    pub shared_prefix: bool,
}

/// A GRPO-like optimizer step, packed into microbatches of exactly
/// `spec.rows_per_microbatch` rows.
///
/// Per prompt: a length uniform in the shape's range ([`StepShape`]; 24..=96 tokens by
/// default) and a solve rate `p` that is 0 with probability 0.15 (too hard), 1 with
/// probability 0.10 (too easy) and uniform in (0.1, 0.9) otherwise. Each of the `group`
/// responses is correct with probability `p` (reward 1, else 0) and has the shape's length
/// (`32 + Exp(mean 110)` tokens, capped at 384, by default), correct ones 30% shorter.
/// Advantages are GRPO's `(R - mean) / (std + 1e-6)` within the group, so a group whose
/// rewards are all equal has advantage 0 (about a third of the groups with these rates
/// and 8 responses per prompt: the familiar share of GRPO groups that carry no signal); per-token coefficients are
/// `c = -A / (response tokens of the step)` on response tokens (token-mean aggregation,
/// one update epoch, no KL: `rho = 1`, the case where `c` is known before the forward) and
/// 0 on prompt tokens. Sequences are packed in group order; a microbatch's leftover rows
/// are filled by a padding sequence with zero coefficients. With `shared_prefix`, a
/// microbatch holds each prompt once with the responses of it that it packs, a group that
/// does not fit continuing in the next microbatch with its prompt again (as the actor
/// update's packer does), and the coefficients are per log-prob.
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
        group: usize,
    }
    let vocab = cfg.vocab_size as u64;
    let mut tok_rng = SplitMix64::for_stream(seed, "bench-grpo-tokens");
    let mut seqs = Vec::new();
    let mut response_tokens = 0usize;
    let cap = spec.rows_per_microbatch;
    let (lo, hi) = spec.shape.prompt_range();
    let (base, mean_exp, rcap) = spec.shape.response();
    anyhow::ensure!(
        cap > hi,
        "--rows {cap}: the {:?} shape draws prompts of up to {hi} tokens, and a prompt and one response token must fit a microbatch; give --rows of at least {}",
        spec.shape,
        hi + 1
    );
    for g in 0..spec.prompts {
        let plen = lo + (unit() * (hi - lo + 1) as f64) as usize;
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
            let mut rlen = base + (-mean_exp * (1.0 - unit()).ln());
            if correct {
                rlen *= 0.7;
            }
            let rlen = (rlen as usize).clamp(2, rcap).min(cap + 1 - plen.min(cap));
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
                group: g,
            });
        }
    }
    let w = 1.0 / response_tokens.max(1) as f64;
    if spec.shared_prefix {
        let seqs: Vec<SharedSeq> = seqs
            .into_iter()
            .map(|s| SharedSeq {
                coefficient: (-s.advantage * w) as f32,
                tokens: s.tokens,
                prompt: s.prompt,
                group: s.group,
            })
            .collect();
        return pack_shared(cfg, &seqs, cap, &mut tok_rng, device);
    }
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
            rows_counted: batch.num_tokens(),
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

/// A drawn sequence for [`pack_shared`]: its tokens, prompt length, group and the
/// coefficient of each of its response tokens.
struct SharedSeq {
    tokens: Vec<u32>,
    prompt: usize,
    group: usize,
    coefficient: f32,
}

/// [`grpo_step`]'s packing with shared prefixes: microbatches of exactly `cap` rows, a
/// prompt's rows once per microbatch, padding with zero coefficients as the training loop
/// packs it ([`padding_groups`]: the prompt rows to a multiple of a quantum where it can),
/// of random tokens.
fn pack_shared(
    cfg: &DecoderConfig,
    seqs: &[SharedSeq],
    cap: usize,
    tok_rng: &mut SplitMix64,
    device: &Device,
) -> anyhow::Result<Vec<Microbatch>> {
    let vocab = cfg.vocab_size as u64;
    /// The microbatch being filled.
    #[derive(Default)]
    struct Open {
        groups: Vec<PromptGroup>,
        coeffs: Vec<f32>,
        rows: usize,
        /// Its sequences' rows unshared, and padding.
        counted: usize,
        sequences: usize,
        zero: usize,
    }
    let mut out = Vec::new();
    let mut flush = |open: &mut Open| -> anyhow::Result<()> {
        let mut o = std::mem::take(open);
        if o.rows < cap {
            let pad = cap - o.rows;
            let prompts: usize = o.groups.iter().map(|g| g.prompt.len()).sum();
            for mut g in padding_groups(pad, prompts, o.coeffs.len(), cap) {
                for t in g.prompt.iter_mut().chain(g.responses.iter_mut().flatten()) {
                    *t = tok_rng.below(vocab) as u32;
                }
                o.coeffs.extend(std::iter::repeat_n(0.0, g.num_logprobs()));
                o.groups.push(g);
            }
            o.counted += pad;
        }
        let batch = TokenBatch::from_shared_prefixes(&o.groups, cfg, device)?;
        anyhow::ensure!(batch.num_logprobs() == o.coeffs.len());
        let input = microbatch_input(&batch.packing, &o.coeffs);
        let n = o.coeffs.len();
        let coeff_tensor = Tensor::from_vec(o.coeffs, n, device)?;
        out.push(Microbatch {
            batch,
            coeff_tensor,
            input,
            sequences: o.sequences,
            zero_advantage_sequences: o.zero,
            rows_counted: o.counted,
        });
        Ok(())
    };
    let mut open = Open::default();
    let mut last_group: Option<usize> = None;
    for s in seqs {
        let full = s.tokens.len() - 1;
        let (prompt, response) = s.tokens.split_at(s.prompt);
        let mut continues = last_group == Some(s.group) && !open.groups.is_empty();
        let cost = if continues { response.len() - 1 } else { full };
        if open.rows + cost > cap {
            flush(&mut open)?;
            continues = false;
        }
        if !continues {
            open.groups.push(PromptGroup {
                prompt: prompt.to_vec(),
                responses: Vec::new(),
            });
            open.coeffs
                .extend(std::iter::repeat_n(0.0, prompt.len() - 1));
            open.rows += prompt.len();
        }
        if let Some(g) = open.groups.last_mut() {
            g.responses.push(response.to_vec());
        }
        open.coeffs
            .extend(std::iter::repeat_n(s.coefficient, response.len()));
        open.rows += response.len() - 1;
        open.counted += full;
        open.sequences += 1;
        open.zero += (s.coefficient == 0.0) as usize;
        last_group = Some(s.group);
    }
    if open.rows > 0 {
        flush(&mut open)?;
    }
    Ok(out)
}
