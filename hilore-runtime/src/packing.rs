//! A batch of variable-length sequences packed along one token axis.

use crate::{Error, Result};
use candle_core::{Device, Tensor};
use std::sync::Arc;

/// Where each sequence of a packed batch starts and ends (`cu_seqlens` in flash-attention
/// terms), plus every token's position within its own sequence.
///
/// Tokens of all sequences sit back to back on one axis of length `total_tokens()`;
/// attention never crosses a sequence boundary, except into a shared prefix
/// ([`Packing::with_shared_prefixes`]): a sequence may continue an earlier one (a
/// prompt's response continuing the prompt, held once for all of its responses), and
/// then attends to all of that prefix's tokens and causally to its own, its positions
/// counting on from the prefix's length. Cloning is cheap.
#[derive(Clone, Debug)]
pub struct Packing {
    inner: Arc<PackingInner>,
}

#[derive(Debug)]
struct PackingInner {
    offsets: Vec<usize>,
    /// For each sequence, the sequence it continues (its shared prefix), if any.
    prefix_of: Vec<Option<usize>>,
    positions: Tensor,
}

impl Packing {
    /// Packs sequences of the given lengths (each at least 1) on `device`.
    pub fn new(lengths: &[usize], device: &Device) -> Result<Self> {
        Self::build(lengths, vec![None; lengths.len()], device)
    }

    /// Packs sequences of which some continue an earlier one: `prefix_of[i] = Some(j)`
    /// makes sequence `i` a continuation of sequence `j` (its shared prefix), so `i`'s
    /// tokens attend to every token of `j` and causally to `i`'s own, at positions
    /// `len(j)..len(j) + len(i)`, exactly as the concatenation `j ++ i` would. A prefix is
    /// itself no continuation (`prefix_of[j]` is `None`) and comes before its
    /// continuations: either right before them (`j, i1, i2, ...`, one group after another)
    /// or with every prefix first (`j1, j2, ..., i11, i12, ..., i21, ...`), the layout in
    /// which a model runs its row-wise units on the prompts' rows and the responses' rows
    /// apart ([`Packing::shared_prefix_rows`]). Every length is at least 1.
    pub fn with_shared_prefixes(
        lengths: &[usize],
        prefix_of: &[Option<usize>],
        device: &Device,
    ) -> Result<Self> {
        if prefix_of.len() != lengths.len() {
            return Err(Error::Tape(format!(
                "Packing::with_shared_prefixes: {} sequence lengths but {} prefix entries; give one entry per sequence (None for a sequence of its own)",
                lengths.len(),
                prefix_of.len()
            )));
        }
        for (i, p) in prefix_of.iter().enumerate() {
            match *p {
                None => {}
                Some(j) if j >= i => {
                    return Err(Error::Tape(format!(
                        "Packing::with_shared_prefixes: sequence {i} continues sequence {j}, which does not come before it; a prefix is packed before its continuations"
                    )))
                }
                Some(j) if prefix_of[j].is_some() => {
                    return Err(Error::Tape(format!(
                        "Packing::with_shared_prefixes: sequence {i} continues sequence {j}, which itself continues sequence {}; prefixes are one level deep (pack the whole prompt as the prefix)",
                        prefix_of[j].unwrap_or(j)
                    )))
                }
                Some(_) => {}
            }
        }
        Self::build(lengths, prefix_of.to_vec(), device)
    }

    fn build(lengths: &[usize], prefix_of: Vec<Option<usize>>, device: &Device) -> Result<Self> {
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
        for (i, &l) in lengths.iter().enumerate() {
            offsets.push(offsets.last().copied().unwrap_or(0) + l);
            let first = prefix_of[i].map_or(0, |j| lengths[j]);
            positions.extend((first..first + l).map(|p| p as u32));
        }
        let n = positions.len();
        let positions = Tensor::from_vec(positions, n, device)?;
        Ok(Packing {
            inner: Arc::new(PackingInner {
                offsets,
                prefix_of,
                positions,
            }),
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

    /// The attention work in units of query-key pairs counted as a causal sequence of
    /// length `T` counts them, `T^2`: the sum of squared sequence lengths, where a
    /// continuation of length `R` of a prefix of length `P` adds `R^2 + 2 P R` (what
    /// `(P + R)^2` adds to the prefix's `P^2`), so a shared layout counts the same work as
    /// the concatenations it replaces, less the prefix's repeats.
    pub fn sum_sq_lengths(&self) -> usize {
        let lengths = self.lengths();
        (0..lengths.len())
            .map(|i| {
                let l = lengths[i];
                l * l + 2 * l * self.inner.prefix_of[i].map_or(0, |j| lengths[j])
            })
            .sum()
    }

    /// The sequence that sequence `i` continues (its shared prefix), if any
    /// ([`Packing::with_shared_prefixes`]).
    pub fn prefix_of(&self, i: usize) -> Option<usize> {
        self.inner.prefix_of.get(i).copied().flatten()
    }

    /// The rows of the prompts in a layout with every prefix first
    /// ([`Packing::with_shared_prefixes`]): `Some(r)` when some sequence continues a
    /// shared prefix and every prefix lies in the first `r` rows, which hold no
    /// continuation (the rows before the first continuation); rows `r..` are the
    /// continuations and sequences of their own that no one continues. `None` otherwise
    /// (no shared prefix, or a prefix after a continuation, as in a layout of one group
    /// after another).
    pub fn shared_prefix_rows(&self) -> Option<usize> {
        let prefix_of = &self.inner.prefix_of;
        let first = prefix_of.iter().position(Option::is_some)?;
        prefix_of[first..]
            .iter()
            .all(|p| p.is_none_or(|j| j < first))
            .then(|| self.inner.offsets[first])
    }

    /// Whether some sequence continues a shared prefix.
    pub fn has_shared_prefixes(&self) -> bool {
        self.inner.prefix_of.iter().any(Option::is_some)
    }

    /// Each token's position in its own sequence (counting on from its prefix's length in
    /// a continuation), `u32` of shape `[total_tokens]`.
    pub fn positions(&self) -> &Tensor {
        &self.inner.positions
    }
}
