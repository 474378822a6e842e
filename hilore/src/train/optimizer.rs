//! AdamW with global gradient-norm clipping, on the decoder's parameters.
//!
//! The update runs elementwise in plain `f32` loops over each parameter's values, in a
//! fixed order, so it is deterministic (a resumed run reproduces an uninterrupted one bit
//! for bit) and its state is two `f32` buffers per parameter, counted exactly by
//! [`AdamW::optimizer_state_bytes`].

use super::checkpoint::{Checkpoint, NamedTensor};
use super::ActorModel;
use anyhow::{bail, Context};
use candle_core::Tensor;
use hilore_runtime::Grads;

/// AdamW's hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (not to norm weights or biases).
    pub weight_decay: f64,
    /// Gradients are scaled so their global L2 norm is at most this (0: no clipping).
    pub max_grad_norm: f64,
}

/// The optimizer: the step count and the first and second moments of every parameter,
/// in [`ActorModel::named_params`] order.
#[derive(Debug, Clone)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken.
    pub t: u64,
    /// `(name, m, v)` per parameter.
    pub state: Vec<(String, Vec<f32>, Vec<f32>)>,
}

/// What one step did.
#[derive(Debug, Clone, Copy)]
pub struct StepInfo {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
}

impl AdamW {
    /// Zero moments for every parameter of `model`.
    pub fn new<M: ActorModel>(cfg: AdamWConfig, model: &M) -> Self {
        let state = model
            .named_params()
            .into_iter()
            .map(|(name, v)| (name, vec![0.0; v.elem_count()], vec![0.0; v.elem_count()]))
            .collect();
        AdamW { cfg, t: 0, state }
    }

    /// Both moments of every parameter as checkpoint tensors (`adam.m/{name}`,
    /// `adam.v/{name}`); the step count [`AdamW::t`] goes in the checkpoint's state.
    pub fn moment_tensors(&self) -> Vec<NamedTensor> {
        let mut out = Vec::with_capacity(2 * self.state.len());
        for (name, m, v) in &self.state {
            for (kind, x) in [("m", m), ("v", v)] {
                out.push(NamedTensor {
                    name: format!("adam.{kind}/{name}"),
                    shape: vec![x.len()],
                    data: x.clone(),
                });
            }
        }
        out
    }

    /// Sets both moments of every parameter from `ck` (see [`AdamW::moment_tensors`]); a
    /// missing tensor, or one of another length, is an error naming it.
    pub fn restore_moments(&mut self, ck: &Checkpoint) -> anyhow::Result<()> {
        for (name, m, v) in &mut self.state {
            for (kind, x) in [("m", &mut *m), ("v", &mut *v)] {
                let t = ck.tensor(&format!("adam.{kind}/{name}"))?;
                if t.data.len() != x.len() {
                    bail!(
                        "checkpoint tensor adam.{kind}/{name} has {} values, the parameter {}: the checkpoint is of another model",
                        t.data.len(),
                        x.len()
                    );
                }
                x.copy_from_slice(&t.data);
            }
        }
        Ok(())
    }

    /// Bytes of optimizer state (both moments, `f32`): what the actor update's memory
    /// budget must hold besides parameters, gradients and activations.
    pub fn optimizer_state_bytes(&self) -> usize {
        self.state
            .iter()
            .map(|(_, m, v)| (m.len() + v.len()) * std::mem::size_of::<f32>())
            .sum()
    }

    /// One step on `model` from the accumulated `grads` (a parameter no backward reached
    /// has a zero gradient).
    pub fn step<M: ActorModel>(
        &mut self,
        model: &mut M,
        grads: &Grads,
    ) -> anyhow::Result<StepInfo> {
        let mut params = model.named_params_mut();
        if params.len() != self.state.len() {
            bail!(
                "optimizer state has {} parameters, the model {}",
                self.state.len(),
                params.len()
            );
        }
        let mut gs: Vec<Option<Vec<f32>>> = Vec::with_capacity(params.len());
        let mut sq = 0f64;
        for ((name, p), (sname, _, _)) in params.iter().zip(&self.state) {
            if name != sname {
                bail!("optimizer state is for parameter {sname}, the model has {name} there");
            }
            let g = match grads.get(p.id()) {
                Some(g) => {
                    let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
                    sq += g.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
                    Some(g)
                }
                None => None,
            };
            gs.push(g);
        }
        let grad_norm = sq.sqrt();
        if !grad_norm.is_finite() {
            bail!("gradient norm is {grad_norm}; the update diverged (lower the learning rate)");
        }
        let c = self.cfg;
        let clip = if c.max_grad_norm > 0.0 && grad_norm > c.max_grad_norm {
            (c.max_grad_norm / (grad_norm + 1e-6)) as f32
        } else {
            1.0
        };
        self.t += 1;
        let t = self.t as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2 = 1.0 - c.beta2.powi(t);
        let step_size = (c.lr / bc1) as f32;
        let (b1, b2, eps) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32);
        let inv_sqrt_bc2 = (1.0 / bc2.sqrt()) as f32;
        for (((_, p), (name, m, v)), g) in params.iter_mut().zip(&mut self.state).zip(gs) {
            let mut w: Vec<f32> = p.tensor().flatten_all()?.to_vec1()?;
            let decay = if p.dims().len() >= 2 {
                (c.lr * c.weight_decay) as f32
            } else {
                0.0
            };
            let g = g.unwrap_or_else(|| vec![0.0; w.len()]);
            for i in 0..w.len() {
                let gi = g[i] * clip;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let denom = v[i].sqrt() * inv_sqrt_bc2 + eps;
                w[i] -= decay * w[i] + step_size * m[i] / denom;
            }
            let shape = p.tensor().shape().clone();
            let device = p.device().clone();
            p.set_tensor(Tensor::from_vec(w, shape, &device)?)
                .with_context(|| format!("updating {name}"))?;
        }
        Ok(StepInfo { grad_norm })
    }
}
