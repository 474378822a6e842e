//! Parameter gradients, accumulated across microbatches.

use crate::{Result, VarId};
use candle_core::Tensor;
use std::collections::HashMap;

/// Gradients of parameters, keyed by the parameter's [`VarId`]. Each backward pass adds
/// into it, so several microbatches accumulate before an optimizer step.
#[derive(Debug, Default, Clone)]
pub struct Grads {
    map: HashMap<VarId, Tensor>,
}

impl Grads {
    /// No gradients.
    pub fn new() -> Self {
        Self::default()
    }

    /// The gradient of parameter `id`, if any backward reached it.
    pub fn get(&self, id: VarId) -> Option<&Tensor> {
        self.map.get(&id)
    }

    /// Removes and returns the gradient of `id`.
    pub fn remove(&mut self, id: VarId) -> Option<Tensor> {
        self.map.remove(&id)
    }

    /// Adds `g` into the gradient of `id`.
    pub fn accumulate(&mut self, id: VarId, g: Tensor) -> Result<()> {
        let g = match self.map.remove(&id) {
            Some(prev) => crate::ops::add_same(&prev, &g)?,
            None => g,
        };
        self.map.insert(id, g);
        Ok(())
    }

    /// Number of parameters with a gradient.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no gradient is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Drops every gradient.
    pub fn clear(&mut self) {
        self.map.clear()
    }

    /// Every `(id, gradient)`.
    pub fn iter(&self) -> impl Iterator<Item = (&VarId, &Tensor)> {
        self.map.iter()
    }

    /// Exact bytes held by the gradients.
    pub fn nbytes(&self) -> usize {
        self.map
            .values()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}
