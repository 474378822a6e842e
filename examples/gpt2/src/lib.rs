//! A GPT-2-style decoder written as a model author outside HiLoRe would write it: learned
//! positions, pre-LayerNorm blocks with biases, fused QKV multi-head attention, a GELU
//! MLP, a final LayerNorm and a head tied to the token embedding. Each block is one
//! recovery unit with two child units, so a plan can store, compress or recompute the
//! whole block or either half; [`ActorModel`] makes it trainable with GRPO through
//! `hilore::train::update::actor_update`, and [`reference`] is the same function on
//! candle's own autograd, which the tests compare gradients against.
//!
//! Units are registered wherever the crate is linked; a binary that uses the model only
//! through a trait object (and so might let the linker drop the crate) calls
//! [`keep_registered`] once, which names the crate and keeps its units in
//! `hilore_runtime::registered_units()`.

use anyhow::Context;
use candle_core::Device;
use hilore::train::ActorModel;
use hilore_models::{rng::normal_tensor, TokenBatch};
use hilore_runtime::{recovery_unit, Cx, Packing, Result, Var};

pub mod reference;

/// The model's sizes (Hugging Face `GPT2Config` names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_layer: usize,
    pub layer_norm_epsilon: f64,
}

impl Gpt2Config {
    /// A small model for tests and examples.
    pub fn tiny() -> Self {
        Gpt2Config {
            vocab_size: 61,
            n_positions: 64,
            n_embd: 32,
            n_head: 4,
            n_layer: 2,
            layer_norm_epsilon: 1e-5,
        }
    }

    fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }
}

/// One block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Debug)]
pub struct Block {
    pub ln_1: (Var, Var),
    /// `c_attn`: `[3C, C]` and `[3C]` (q, k, v stacked).
    pub attn: (Var, Var),
    /// `c_proj` of the attention: `[C, C]`, `[C]`.
    pub attn_proj: (Var, Var),
    pub ln_2: (Var, Var),
    /// `c_fc`: `[4C, C]`, `[4C]`.
    pub fc: (Var, Var),
    /// `c_proj` of the MLP: `[C, 4C]`, `[C]`.
    pub mlp_proj: (Var, Var),
    cfg: Gpt2Config,
}

impl Block {
    /// Unit `gpt2.block`: the whole block (recomputing it is per-block gradient
    /// checkpointing).
    #[recovery_unit(name = "gpt2.block", cost = 24 * x.dim(0)? * self.cfg.n_embd * self.cfg.n_embd + 4 * packing.sum_sq_lengths() * self.cfg.n_embd, deterministic)]
    pub fn forward(&self, cx: &mut Cx, x: &Var, packing: &Packing) -> Result<Var> {
        let x = self.attention(cx, x, packing)?;
        self.mlp(cx, &x)
    }

    /// Unit `gpt2.attn`: LayerNorm, fused QKV, causal attention within each sequence, the
    /// output projection and the residual.
    #[recovery_unit(name = "gpt2.attn", cost = 8 * x.dim(0)? * self.cfg.n_embd * self.cfg.n_embd + 4 * packing.sum_sq_lengths() * self.cfg.n_embd, deterministic)]
    pub fn attention(&self, cx: &mut Cx, x: &Var, packing: &Packing) -> Result<Var> {
        let (n, c) = (x.dim(0)?, self.cfg.n_embd);
        let (h, d) = (self.cfg.n_head, self.cfg.head_dim());
        let a = cx.layer_norm(
            x,
            &self.ln_1.0,
            Some(&self.ln_1.1),
            self.cfg.layer_norm_epsilon,
        )?;
        let qkv = cx.linear(&a, &self.attn.0, Some(&self.attn.1))?;
        let split = |cx: &mut Cx, i: usize| -> Result<Var> {
            let t = cx.narrow(&qkv, 1, i * c, c)?;
            cx.reshape(&t, (n, h, d))
        };
        let (q, k, v) = (split(cx, 0)?, split(cx, 1)?, split(cx, 2)?);
        let o = cx.attention(&q, &k, &v, packing, 1.0 / (d as f64).sqrt())?;
        let o = cx.reshape(&o, (n, c))?;
        let y = cx.linear(&o, &self.attn_proj.0, Some(&self.attn_proj.1))?;
        cx.add(x, &y)
    }

    /// Unit `gpt2.mlp`: LayerNorm, `c_fc`, GELU (tanh form, GPT-2's `gelu_new`), `c_proj`
    /// and the residual.
    #[recovery_unit(name = "gpt2.mlp", cost = 16 * x.dim(0)? * self.cfg.n_embd * self.cfg.n_embd, deterministic)]
    pub fn mlp(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let a = cx.layer_norm(
            x,
            &self.ln_2.0,
            Some(&self.ln_2.1),
            self.cfg.layer_norm_epsilon,
        )?;
        let hdn = cx.linear(&a, &self.fc.0, Some(&self.fc.1))?;
        let hdn = cx.gelu_tanh(&hdn)?;
        let y = cx.linear(&hdn, &self.mlp_proj.0, Some(&self.mlp_proj.1))?;
        cx.add(x, &y)
    }
}

/// The decoder.
#[derive(Debug)]
pub struct Gpt2 {
    pub cfg: Gpt2Config,
    /// `wte`: `[V, C]`, also the LM head.
    pub wte: Var,
    /// `wpe`: `[n_positions, C]`.
    pub wpe: Var,
    pub blocks: Vec<Block>,
    pub ln_f: (Var, Var),
}

impl Gpt2 {
    /// Random weights from `seed` (N(0, 0.02) matrices, LayerNorm weights near 1 and
    /// biases near 0, perturbed so that their gradients are not degenerate).
    pub fn new(cfg: Gpt2Config, seed: u64, dev: &Device) -> anyhow::Result<Self> {
        anyhow::ensure!(
            cfg.n_head > 0 && cfg.n_embd % cfg.n_head == 0,
            "n_embd {} must be a multiple of n_head {}",
            cfg.n_embd,
            cfg.n_head
        );
        let mut k = 0u64;
        let mut p = |shape: &[usize], mean: f64, std: f64| -> anyhow::Result<Var> {
            k += 1;
            Ok(Var::param(normal_tensor(
                shape,
                mean,
                std,
                seed * 1000 + k,
                dev,
            )?))
        };
        let c = cfg.n_embd;
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for _ in 0..cfg.n_layer {
            blocks.push(Block {
                ln_1: (p(&[c], 1.0, 0.1)?, p(&[c], 0.0, 0.02)?),
                attn: (p(&[3 * c, c], 0.0, 0.02)?, p(&[3 * c], 0.0, 0.02)?),
                attn_proj: (p(&[c, c], 0.0, 0.02)?, p(&[c], 0.0, 0.02)?),
                ln_2: (p(&[c], 1.0, 0.1)?, p(&[c], 0.0, 0.02)?),
                fc: (p(&[4 * c, c], 0.0, 0.02)?, p(&[4 * c], 0.0, 0.02)?),
                mlp_proj: (p(&[c, 4 * c], 0.0, 0.02)?, p(&[c], 0.0, 0.02)?),
                cfg,
            });
        }
        Ok(Gpt2 {
            cfg,
            wte: p(&[cfg.vocab_size, c], 0.0, 0.02)?,
            wpe: p(&[cfg.n_positions, c], 0.0, 0.01)?,
            blocks,
            ln_f: (p(&[c], 1.0, 0.1)?, p(&[c], 0.0, 0.02)?),
        })
    }

    /// The last hidden states `[N, C]` of a packed batch.
    pub fn hidden<'m>(&'m self, cx: &mut Cx<'m>, batch: &TokenBatch) -> Result<Var> {
        let tok = cx.embedding(&self.wte, &batch.inputs)?;
        let pos = cx.embedding(&self.wpe, batch.packing.positions())?;
        let mut x = cx.add(&tok, &pos)?;
        for b in &self.blocks {
            x = b.forward(cx, &x, &batch.packing)?;
        }
        cx.layer_norm(
            &x,
            &self.ln_f.0,
            Some(&self.ln_f.1),
            self.cfg.layer_norm_epsilon,
        )
    }
}

impl ActorModel for Gpt2 {
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<TokenBatch> {
        // The packing (positions restart per sequence) and the targets; learned
        // positions need no RoPE tables.
        TokenBatch::pack(
            seqs,
            self.cfg.vocab_size,
            self.cfg.n_positions,
            self.wte.device(),
        )
        .context("packing a GPT-2 batch")
    }

    fn token_logprobs<'m>(&'m self, cx: &mut Cx<'m>, batch: &TokenBatch) -> Result<Var> {
        let h = self.hidden(cx, batch)?;
        cx.token_logprobs(&h, &self.wte, &batch.targets, 256)
    }

    fn named_params(&self) -> Vec<(String, Var)> {
        let mut v = vec![
            ("wte".to_string(), self.wte.clone()),
            ("wpe".to_string(), self.wpe.clone()),
        ];
        for (i, b) in self.blocks.iter().enumerate() {
            for (name, (w, bias)) in block_params(b) {
                v.push((format!("h.{i}.{name}.weight"), w.clone()));
                v.push((format!("h.{i}.{name}.bias"), bias.clone()));
            }
        }
        v.push(("ln_f.weight".into(), self.ln_f.0.clone()));
        v.push(("ln_f.bias".into(), self.ln_f.1.clone()));
        v
    }

    fn named_params_mut(&mut self) -> Vec<(String, &mut Var)> {
        let mut v: Vec<(String, &mut Var)> = vec![
            ("wte".to_string(), &mut self.wte),
            ("wpe".to_string(), &mut self.wpe),
        ];
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let Block {
                ln_1,
                attn,
                attn_proj,
                ln_2,
                fc,
                mlp_proj,
                ..
            } = b;
            for (name, (w, bias)) in [
                ("ln_1", ln_1),
                ("attn.c_attn", attn),
                ("attn.c_proj", attn_proj),
                ("ln_2", ln_2),
                ("mlp.c_fc", fc),
                ("mlp.c_proj", mlp_proj),
            ] {
                v.push((format!("h.{i}.{name}.weight"), w));
                v.push((format!("h.{i}.{name}.bias"), bias));
            }
        }
        let (w, b) = &mut self.ln_f;
        v.push(("ln_f.weight".into(), w));
        v.push(("ln_f.bias".into(), b));
        v
    }
}

/// A block's (weight, bias) pairs in checkpoint order, with their Hugging Face names.
fn block_params(b: &Block) -> [(&'static str, &(Var, Var)); 6] {
    [
        ("ln_1", &b.ln_1),
        ("attn.c_attn", &b.attn),
        ("attn.c_proj", &b.attn_proj),
        ("ln_2", &b.ln_2),
        ("mlp.c_fc", &b.fc),
        ("mlp.c_proj", &b.mlp_proj),
    ]
}

/// Names this crate so that a binary reaching the model only through trait objects
/// still links it, and with it the `gpt2.*` units' registrations; returns how many of
/// them `hilore_runtime::registered_units()` holds.
pub fn keep_registered() -> usize {
    hilore_runtime::registered_units()
        .iter()
        .filter(|u| u.name.starts_with("gpt2."))
        .count()
}
