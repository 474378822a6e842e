//! A batch of variable-length sequences packed along one token axis.

use crate::{Error, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// Where each sequence of a packed batch starts and ends (`cu_seqlens` in flash-attention
/// terms), plus every token's position within its own sequence.
///
/// Tokens of all sequences sit back to back on one axis of length `total_tokens()`;
/// attention never crosses a sequence boundary. Cloning is cheap.
#[derive(Clone, Debug)]
pub struct Packing {
    inner: Arc<PackingInner>,
}

#[derive(Debug)]
struct PackingInner {
    offsets: Vec<usize>,
    positions: Tensor,
}

impl Packing {
    /// Packs sequences of the given lengths (each at least 1) on `device`.
    pub fn new(lengths: &[usize], device: &Device) -> Result<Self> {
        if lengths.is_empty() {
            return Err(Error::Tape(
                "Packing::new: a packed batch needs at least one sequence".into(),
            ));
        }
        if let Some(i) = lengths.iter().position(|&l| l == 0) {
            return Err(Error::Tape(format!(
                "Packing::new: sequence {i} has length 0; drop empty sequences before packing"
            )));
        }
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        offsets.push(0);
        let mut positions = Vec::new();
        for &l in lengths {
            offsets.push(offsets.last().copied().unwrap_or(0) + l);
            positions.extend((0..l).map(|p| p as u32));
        }
        let n = positions.len();
        let positions = Tensor::from_vec(positions, n, device)?;
        Ok(Packing {
            inner: Arc::new(PackingInner { offsets, positions }),
        })
    }

    /// `offsets[i]..offsets[i + 1]` are the tokens of sequence `i`; `offsets.len()` is
    /// `num_sequences() + 1`.
    pub fn offsets(&self) -> &[usize] {
        &self.inner.offsets
    }

    /// Number of sequences.
    pub fn num_sequences(&self) -> usize {
        self.inner.offsets.len() - 1
    }

    /// Total number of tokens.
    pub fn total_tokens(&self) -> usize {
        *self.inner.offsets.last().unwrap_or(&0)
    }

    /// Length of every sequence.
    pub fn lengths(&self) -> Vec<usize> {
        self.inner.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Sum of squared sequence lengths (attention cost grows with it).
    pub fn sum_sq_lengths(&self) -> usize {
        self.lengths().iter().map(|l| l * l).sum()
    }

    /// Each token's position in its own sequence, `u32` of shape `[total_tokens]`.
    pub fn positions(&self) -> &Tensor {
        &self.inner.positions
    }
}
