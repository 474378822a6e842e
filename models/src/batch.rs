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
/// its sequence, built once and shared by every layer. Cloning is cheap.
#[derive(Debug, Clone)]
pub struct TokenBatch {
    /// Input token ids, `u32 [N]`.
    pub inputs: Tensor,
    /// Target token ids, `u32 [N]`: the log-probs are those of these tokens.
    pub targets: Tensor,
    /// Sequence boundaries and positions.
    pub packing: Packing,
    /// RoPE cosines and sines of every row, `f32 [N, head_dim / 2]` each.
    pub rope: RopeTables,
}

impl TokenBatch {
    /// Packs `seqs` (each at least 2 tokens, every id below `cfg.vocab_size`, at most
    /// `cfg.max_position_embeddings + 1` tokens).
    pub fn from_sequences(
        seqs: &[Vec<u32>],
        cfg: &DecoderConfig,
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
            if s.len() - 1 > cfg.max_position_embeddings {
                return Err(ModelError::Batch(format!(
                    "sequence {i} has {} tokens, so {} input positions, more than max_position_embeddings = {}",
                    s.len(),
                    s.len() - 1,
                    cfg.max_position_embeddings
                )));
            }
            if let Some((j, &t)) = s
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= cfg.vocab_size)
            {
                return Err(ModelError::Batch(format!(
                    "sequence {i}, token {j} is id {t}, outside the vocabulary of {} ids",
                    cfg.vocab_size
                )));
            }
            inputs.extend_from_slice(&s[..s.len() - 1]);
            targets.extend_from_slice(&s[1..]);
            lengths.push(s.len() - 1);
        }
        let n = inputs.len();
        let packing = Packing::new(&lengths, device)?;
        // The config's tables: RoPE scaling included.
        let rope = cfg.rope_tables(&packing.positions().to_vec1::<u32>()?, DType::F32, device)?;
        Ok(TokenBatch {
            inputs: Tensor::from_vec(inputs, n, device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            packing,
            rope,
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

    /// Number of rows `N` (input tokens, one log-prob each).
    pub fn num_tokens(&self) -> usize {
        self.packing.total_tokens()
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
