//! A packed batch of token sequences, ready for the decoder.

use crate::rng::SplitMix64;
use crate::{DecoderConfig, ModelError};
use candle_core::{DType, Device, Tensor};
use hilore_runtime::{Packing, RopeTables};

/// Token sequences packed back to back on one axis, with their next-token targets.
///
/// A sequence of `L` tokens contributes its first `L - 1` tokens as inputs and its last
/// `L - 1` as targets (token `i + 1` is the target at input position `i`), so the batch
/// has `N = sum(L - 1)` rows. `packing` says where each sequence's rows are (attention
/// never crosses them) and `rope` holds the rotary tables of every row's position within
/// its sequence, built once and shared by every layer; a model with learned or no
/// positions packs without them ([`TokenBatch::pack`]). Cloning is cheap.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Input token ids, `u32 [N]`.
    pub inputs: Tensor,
    /// Target token ids, `u32 [N]`: the log-probs are those of these tokens.
    pub targets: Tensor,
    /// Sequence boundaries and positions.
    pub packing: Packing,
    /// RoPE cosines and sines of every row, `f32 [N, head_dim / 2]` each (none from
    /// [`TokenBatch::pack`]).
    pub rope: Option<RopeTables>,
    /// The row whose hidden state predicts each target, `u32 [M]`, where that is not row
    /// `i` for target `i`: in a batch with shared prefixes
    /// ([`TokenBatch::from_shared_prefixes`]) a prompt's last row predicts the first token
    /// of each of its responses. `None`: `M = N`, row `i` predicts `targets[i]`.
    pub logprob_rows: Option<Tensor>,
}

/// A prompt and the responses sampled from it: one group of a shared-prefix batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptGroup {
    /// The prompt's tokens (at least 1).
    pub prompt: Vec<u32>,
    /// Each response's tokens (at least 1 each), which continue the prompt.
    pub responses: Vec<Vec<u32>>,
}

impl PromptGroup {
    /// The log-probs it adds to a shared-prefix batch: its prompt's tokens but the first
    /// (each predicted by the row before it), then every response token (a response's
    /// first one predicted by the prompt's last row).
    pub fn num_logprobs(&self) -> usize {
        self.prompt.len().saturating_sub(1) + self.responses.iter().map(Vec::len).sum::<usize>()
    }
}

impl TokenBatch {
    /// Packs `seqs` (each at least 2 tokens, every id below `cfg.vocab_size`, at most
    /// `cfg.max_position_embeddings + 1` tokens) with the config's RoPE tables.
    pub fn from_sequences(
        seqs: &[Vec<u32>],
        cfg: &DecoderConfig,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut b = Self::pack(seqs, cfg.vocab_size, cfg.max_position_embeddings, device)?;
        // The config's tables: RoPE scaling included.
        b.rope =
            Some(cfg.rope_tables(&b.packing.positions().to_vec1::<u32>()?, DType::F32, device)?);
        Ok(b)
    }

    /// Packs `seqs` (each at least 2 tokens, every id below `vocab_size`, at most
    /// `max_positions + 1` tokens) without RoPE tables: the batch of a model with learned
    /// or no positions (the packing's positions restart at 0 in every sequence).
    pub fn pack(
        seqs: &[Vec<u32>],
        vocab_size: usize,
        max_positions: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if seqs.is_empty() {
            return Err(ModelError::Batch(
                "no sequences: a batch needs at least one sequence of 2 or more tokens".into(),
            ));
        }
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        let mut lengths = Vec::with_capacity(seqs.len());
        for (i, s) in seqs.iter().enumerate() {
            if s.len() < 2 {
                return Err(ModelError::Batch(format!(
                    "sequence {i} has {} token(s); each sequence needs at least 2 (one input and one target)",
                    s.len()
                )));
            }
            if s.len() - 1 > max_positions {
                return Err(ModelError::Batch(format!(
                    "sequence {i} has {} tokens, so {} input positions, more than the model's {} positions (max_position_embeddings)",
                    s.len(),
                    s.len() - 1,
                    max_positions
                )));
            }
            if let Some((j, &t)) = s
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= vocab_size)
            {
                return Err(ModelError::Batch(format!(
                    "sequence {i}, token {j} is id {t}, outside the vocabulary of {} ids",
                    vocab_size
                )));
            }
            inputs.extend_from_slice(&s[..s.len() - 1]);
            targets.extend_from_slice(&s[1..]);
            lengths.push(s.len() - 1);
        }
        let n = inputs.len();
        let packing = Packing::new(&lengths, device)?;
        Ok(TokenBatch {
            inputs: Tensor::from_vec(inputs, n, device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            packing,
            rope: None,
            logprob_rows: None,
        })
    }

    /// Packs prompt groups with each prompt held once ([`Packing::with_shared_prefixes`]),
    /// with the config's RoPE tables: every group's prompt of `P` tokens first, group by
    /// group, then for each response of `R >= 2` tokens its first `R - 1` tokens,
    /// attending to its whole prompt and causally to themselves at positions
    /// `P..P + R - 1`: the rows of the concatenations `prompt ++ response` less the
    /// prompts' repeats. With every prompt first, the prompts' rows are
    /// `0..`[`Packing::shared_prefix_rows`] and the responses' the rest, and the decoder
    /// runs its row-wise units on the two apart (prompt and response instances of each
    /// unit, which the allocator plans apart).
    ///
    /// The log-probs (targets) come group by group: the prompt's tokens `1..P` (from its
    /// rows but the last), then each response's `R` tokens in order, its first from the
    /// prompt's last row. So the log-probs of `prompt ++ response_i` are the group's prompt
    /// part followed by response `i`'s part; each `prompt ++ response` must fit the
    /// model's positions.
    pub fn from_shared_prefixes(
        groups: &[PromptGroup],
        cfg: &DecoderConfig,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut b = Self::pack_shared_prefixes(
            groups,
            cfg.vocab_size,
            cfg.max_position_embeddings,
            device,
        )?;
        b.rope =
            Some(cfg.rope_tables(&b.packing.positions().to_vec1::<u32>()?, DType::F32, device)?);
        Ok(b)
    }

    /// [`TokenBatch::from_shared_prefixes`] without RoPE tables (a model with learned or no
    /// positions; the positions of a response's rows count on from its prompt's length).
    pub fn pack_shared_prefixes(
        groups: &[PromptGroup],
        vocab_size: usize,
        max_positions: usize,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if groups.is_empty() {
            return Err(ModelError::Batch(
                "no prompt groups: a shared-prefix batch needs at least one prompt with a response"
                    .into(),
            ));
        }
        let (mut inputs, mut targets, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        let (mut lengths, mut prefix_of) = (Vec::new(), Vec::new());
        let bad_id = |gi: usize, what: String, s: &[u32]| -> Result<(), ModelError> {
            match s.iter().enumerate().find(|(_, &t)| t as usize >= vocab_size) {
                Some((j, &t)) => Err(ModelError::Batch(format!(
                    "prompt group {gi}, {what}, token {j} is id {t}, outside the vocabulary of {vocab_size} ids"
                ))),
                None => Ok(()),
            }
        };
        // The prompts' rows first: each prompt's sequence index and first row.
        let mut prompt_at = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            let p = g.prompt.len();
            if p == 0 || g.responses.is_empty() {
                return Err(ModelError::Batch(format!(
                    "prompt group {gi} has {p} prompt token(s) and {} response(s); each group needs a prompt of at least 1 token and at least 1 response",
                    g.responses.len()
                )));
            }
            bad_id(gi, "prompt".into(), &g.prompt)?;
            prompt_at.push((lengths.len(), inputs.len()));
            inputs.extend_from_slice(&g.prompt);
            lengths.push(p);
            prefix_of.push(None);
        }
        // Then the responses' rows, group by group: each response's first row (`None` for
        // a 1-token response, which has no rows of its own).
        let mut response_at = Vec::with_capacity(groups.len());
        for (gi, g) in groups.iter().enumerate() {
            let p = g.prompt.len();
            let mut at = Vec::with_capacity(g.responses.len());
            for (ri, r) in g.responses.iter().enumerate() {
                if r.is_empty() {
                    return Err(ModelError::Batch(format!(
                        "prompt group {gi}, response {ri} has no tokens; drop empty responses before packing"
                    )));
                }
                if p + r.len() - 1 > max_positions {
                    return Err(ModelError::Batch(format!(
                        "prompt group {gi}, response {ri}: prompt ({p}) and response ({}) make {} input positions, more than the model's {max_positions} positions (max_position_embeddings)",
                        r.len(),
                        p + r.len() - 1
                    )));
                }
                bad_id(gi, format!("response {ri}"), r)?;
                at.push((r.len() >= 2).then_some(inputs.len()));
                if r.len() >= 2 {
                    inputs.extend_from_slice(&r[..r.len() - 1]);
                    lengths.push(r.len() - 1);
                    prefix_of.push(Some(prompt_at[gi].0));
                }
            }
            response_at.push(at);
        }
        // The log-probs, group by group.
        for (gi, g) in groups.iter().enumerate() {
            let (p, start) = (g.prompt.len(), prompt_at[gi].1);
            for t in 1..p {
                targets.push(g.prompt[t]);
                rows.push((start + t - 1) as u32);
            }
            for (r, at) in g.responses.iter().zip(&response_at[gi]) {
                targets.push(r[0]);
                rows.push((start + p - 1) as u32);
                if let Some(at) = *at {
                    for (t, &token) in r.iter().enumerate().skip(1) {
                        targets.push(token);
                        rows.push((at + t - 1) as u32);
                    }
                }
            }
        }
        let (n, m) = (inputs.len(), targets.len());
        Ok(TokenBatch {
            inputs: Tensor::from_vec(inputs, n, device)?,
            targets: Tensor::from_vec(targets, m, device)?,
            packing: Packing::with_shared_prefixes(&lengths, &prefix_of, device)?,
            rope: None,
            logprob_rows: Some(Tensor::from_vec(rows, m, device)?),
        })
    }

    /// Random sequences of the given token `lengths` (each at least 2, so a sequence of
    /// length `L` gives `L - 1` rows), uniform over the vocabulary, seeded.
    pub fn random(
        lengths: &[usize],
        cfg: &DecoderConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut rng = SplitMix64::for_stream(seed, "token-batch");
        let seqs: Vec<Vec<u32>> = lengths
            .iter()
            .map(|&l| {
                (0..l)
                    .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                    .collect()
            })
            .collect();
        Self::from_sequences(&seqs, cfg, device)
    }

    /// The RoPE tables, or an error saying how to build a batch that has them.
    pub fn rope_tables(&self) -> Result<&RopeTables, ModelError> {
        self.rope.as_ref().ok_or_else(|| {
            ModelError::Batch(
                "this batch has no RoPE tables (TokenBatch::pack makes none): a model with rotary positions needs them; build the batch with TokenBatch::from_sequences(seqs, config, device)".into(),
            )
        })
    }

    /// Number of rows `N` (input tokens; one log-prob each unless the batch has shared
    /// prefixes).
    pub fn num_tokens(&self) -> usize {
        self.packing.total_tokens()
    }

    /// Number of log-probs `M` (targets): `N`, or with shared prefixes one more per
    /// response than it has rows.
    pub fn num_logprobs(&self) -> usize {
        self.targets.dim(0).unwrap_or(0)
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.packing.num_sequences()
    }

    /// Rows of each sequence (its token count minus one).
    pub fn lengths(&self) -> Vec<usize> {
        self.packing.lengths()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Decoder;
    use hilore_runtime::{Cx, Plan};

    /// A batch packed without RoPE tables (for a model with learned positions) has the
    /// same rows, targets and packing as the decoder's; the decoder refuses it with the
    /// constructor that makes its tables, instead of failing inside a layer.
    #[test]
    fn a_batch_without_rope_is_the_same_packing_and_the_decoder_names_the_fix() {
        let cfg = DecoderConfig::tiny();
        let dev = Device::Cpu;
        let seqs = vec![vec![1u32, 2, 3, 4], vec![5, 6, 7]];
        let plain =
            TokenBatch::pack(&seqs, cfg.vocab_size, cfg.max_position_embeddings, &dev).unwrap();
        let full = TokenBatch::from_sequences(&seqs, &cfg, &dev).unwrap();
        assert!(plain.rope.is_none() && full.rope.is_some());
        let ids = |t: &Tensor| t.to_vec1::<u32>().unwrap();
        assert_eq!(ids(&plain.inputs), ids(&full.inputs));
        assert_eq!(ids(&plain.targets), ids(&full.targets));
        assert_eq!(
            plain.packing.offsets().to_vec(),
            full.packing.offsets().to_vec()
        );
        let m = Decoder::random(&cfg, 0, &dev).unwrap();
        let e = m
            .token_logprobs(&mut Cx::new(Plan::store_all()), &plain)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no RoPE tables") && e.contains("TokenBatch::from_sequences"),
            "{e}"
        );
        // The checks on sequences are the same for both constructors.
        let e = TokenBatch::pack(&[vec![1u32]], cfg.vocab_size, 8, &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains("at least 2"), "{e}");
        let e = TokenBatch::pack(&[vec![1u32; 12]], cfg.vocab_size, 8, &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than the model's 8 positions"), "{e}");
    }
}
