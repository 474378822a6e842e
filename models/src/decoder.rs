//! The decoder, written with recovery units.

use crate::rng::SplitMix64;
use crate::{DecoderConfig, ModelError, TokenBatch};
use candle_core::{DType, Device, Tensor};
use hilore_runtime::{recovery_unit, Cx, Error, Packing, Result, RopeTables, Var};
use std::collections::HashMap;

/// Standard deviation of the random projection and embedding weights (HF's
/// `initializer_range` default).
pub const INIT_STD: f64 = 0.02;
/// Standard deviation of the random perturbation of RMSNorm weights around 1, so that
/// gradient checks see a non-trivial norm weight.
pub const NORM_INIT_STD: f64 = 0.1;

/// How many `f32` logits the LM head computes at once by default (`rows x vocab`): 16 MiB.
pub const DEFAULT_LOGITS_CHUNK_ELEMS: usize = 1 << 22;

/// The sizes every unit's cost expression needs (a `Copy` summary of the config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    /// `vocab_size`.
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size`.
    pub inter: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub eps: f64,
}

/// Forward FLOP estimates of the units, for `n` rows (tokens) and, for attention, the
/// sum of squared sequence lengths. A multiply-add counts 2; elementwise ops count one per
/// element and op.
impl Dims {
    fn of(cfg: &DecoderConfig) -> Self {
        Dims {
            vocab: cfg.vocab_size,
            hidden: cfg.hidden_size,
            inter: cfg.intermediate_size,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            eps: cfg.rms_norm_eps,
        }
    }

    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// A row copy per token (no arithmetic; counted as one op per element).
    pub fn embed_cost(&self, n: usize) -> usize {
        n * self.hidden
    }

    /// Square, mean, scale, weight: about 4 ops per element.
    pub fn norm_cost(&self, n: usize) -> usize {
        4 * n * self.hidden
    }

    /// Three projections, and RoPE (6 ops per element) on q and k.
    pub fn qkv_cost(&self, n: usize) -> usize {
        2 * n * self.hidden * (self.q_dim() + 2 * self.kv_dim())
            + 6 * n * (self.q_dim() + self.kv_dim())
    }

    /// `Q K^T` and `P V` over the full `T x T` block of each sequence (the op computes the
    /// masked half too), plus about 5 softmax ops per score.
    pub fn attn_core_cost(&self, sum_sq_lengths: usize) -> usize {
        4 * sum_sq_lengths * self.q_dim() + 5 * sum_sq_lengths * self.heads
    }

    /// The output projection and the residual add.
    pub fn attn_out_cost(&self, n: usize) -> usize {
        2 * n * self.q_dim() * self.hidden + n * self.hidden
    }

    /// Gate and up projections and SwiGLU (about 5 ops per element).
    pub fn gate_up_cost(&self, n: usize) -> usize {
        4 * n * self.hidden * self.inter + 5 * n * self.inter
    }

    /// The down projection and the residual add.
    pub fn down_cost(&self, n: usize) -> usize {
        2 * n * self.inter * self.hidden + n * self.hidden
    }

    /// A whole decoder layer.
    pub fn layer_cost(&self, n: usize, sum_sq_lengths: usize) -> usize {
        2 * self.norm_cost(n)
            + self.qkv_cost(n)
            + self.attn_core_cost(sum_sq_lengths)
            + self.attn_out_cost(n)
            + self.gate_up_cost(n)
            + self.down_cost(n)
    }

    /// Final norm, logits (chunked) and their log-sum-exp (about 4 ops per logit).
    pub fn head_cost(&self, n: usize) -> usize {
        self.norm_cost(n) + 2 * n * self.hidden * self.vocab + 4 * n * self.vocab
    }
}

/// Calls `$f(name, &[mut] param)` for every parameter of the decoder `$m` in the one order
/// [`Decoder::named_params`] documents (a projection's LoRA adapter right after its weight
/// and bias): the single list behind `named_params` and `named_params_mut`.
macro_rules! for_each_param {
    ($m:expr, $f:expr, $iter:ident, $($mut:ident)?) => {{
        let m = $m;
        let mut f = $f;
        f("model.embed_tokens.weight".into(), &$($mut)? m.embed_tokens);
        for (l, layer) in m.layers.$iter().enumerate() {
            let p = format!("model.layers.{l}");
            f(format!("{p}.input_layernorm.weight"), &$($mut)? layer.input_layernorm);
            let a = &$($mut)? layer.self_attn;
            for (name, lin) in [
                ("q_proj", &$($mut)? a.q_proj),
                ("k_proj", &$($mut)? a.k_proj),
                ("v_proj", &$($mut)? a.v_proj),
                ("o_proj", &$($mut)? a.o_proj),
            ] {
                let q = format!("{p}.self_attn.{name}");
                f(format!("{q}.weight"), &$($mut)? lin.weight);
                if let Some(b) = &$($mut)? lin.bias {
                    f(format!("{q}.bias"), b);
                }
                if let Some(lora) = &$($mut)? lin.lora {
                    f(format!("{q}.lora_A.weight"), &$($mut)? lora.a);
                    f(format!("{q}.lora_B.weight"), &$($mut)? lora.b);
                }
            }
            if let Some(w) = &$($mut)? a.q_norm {
                f(format!("{p}.self_attn.q_norm.weight"), w);
            }
            if let Some(w) = &$($mut)? a.k_norm {
                f(format!("{p}.self_attn.k_norm.weight"), w);
            }
            f(
                format!("{p}.post_attention_layernorm.weight"),
                &$($mut)? layer.post_attention_layernorm,
            );
            let mlp = &$($mut)? layer.mlp;
            for (name, lin) in [
                ("gate_proj", &$($mut)? mlp.gate_proj),
                ("up_proj", &$($mut)? mlp.up_proj),
                ("down_proj", &$($mut)? mlp.down_proj),
            ] {
                let q = format!("{p}.mlp.{name}");
                f(format!("{q}.weight"), &$($mut)? lin.weight);
                if let Some(lora) = &$($mut)? lin.lora {
                    f(format!("{q}.lora_A.weight"), &$($mut)? lora.a);
                    f(format!("{q}.lora_B.weight"), &$($mut)? lora.b);
                }
            }
        }
        f("model.norm.weight".into(), &$($mut)? m.norm);
        if let Some(w) = &$($mut)? m.lm_head {
            f("lm_head.weight".into(), w);
        }
    }};
}

/// A projection `x W^T (+ b)`, with HF's `[out, in]` weight layout, and optionally a
/// low-rank adapter.
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Var,
    /// `[out]`, if the projection has a bias.
    pub bias: Option<Var>,
    /// A LoRA adapter ([`Decoder::add_lora`]).
    pub lora: Option<Lora>,
}

/// A low-rank adapter (LoRA, Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large
/// Language Models"): the projection becomes `x W^T (+ b) + scale * (x A^T) B^T`, with
/// `W` frozen and only `A` and `B` trained. PEFT's layout and names: `A` is
/// `lora_A.weight`, `B` is `lora_B.weight`, `scale` is `alpha / rank`.
#[derive(Debug, Clone)]
pub struct Lora {
    /// `[rank, in]`.
    pub a: Var,
    /// `[out, rank]`.
    pub b: Var,
    /// `alpha / rank`.
    pub scale: f64,
}

/// Which projections get adapters and how ([`Decoder::add_lora`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r`.
    pub rank: usize,
    /// The scale's numerator: the update is `alpha / rank * B A`.
    pub alpha: f64,
    /// The projections adapted, by their HF names (`q_proj`, `k_proj`, `v_proj`,
    /// `o_proj`, `gate_proj`, `up_proj`, `down_proj`).
    pub targets: Vec<String>,
}

/// The projections of a layer, by their HF names.
pub const PROJECTIONS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

impl Linear {
    fn forward(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let y = cx.linear(x, &self.weight, self.bias.as_ref())?;
        match &self.lora {
            None => Ok(y),
            Some(l) => {
                let down = cx.linear(x, &l.a, None)?;
                let up = cx.linear(&down, &l.b, None)?;
                let up = cx.scale(&up, l.scale)?;
                cx.add(&y, &up)
            }
        }
    }
}

/// Grouped-query self-attention: three of the layer's units.
#[derive(Debug)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    /// Qwen3's per-head RMSNorm of the queries (`[head_dim]`), applied before RoPE.
    pub q_norm: Option<Var>,
    /// Qwen3's per-head RMSNorm of the keys (`[head_dim]`), applied before RoPE.
    pub k_norm: Option<Var>,
    dims: Dims,
    /// This layer's sliding window (keys per query), if it has one.
    window: Option<usize>,
}

impl Attention {
    /// Unit `qkv`: the q/k/v projections (with their biases when the config has them),
    /// Qwen3's per-head q/k RMSNorm when present, and RoPE on q and k; returns
    /// `q: [N, Hq, D]`, `k, v: [N, Hkv, D]`.
    ///
    /// Saves the normed hidden state `h: [N, hidden]` (one storage, read by all three
    /// projections' weight gradients) and the shared RoPE tables (exact, counted once for
    /// the whole model). The pre-RoPE q and k are not saved: RoPE is linear. With q/k
    /// norms it also saves the projected q and k (`[N, Hq D]`, `[N, Hkv D]`), which the
    /// norms' backward reads.
    #[recovery_unit(name = "qkv", cost = self.dims.qkv_cost(h.dim(0)?), deterministic)]
    pub fn qkv(&self, cx: &mut Cx, h: &Var, rope: &RopeTables) -> Result<(Var, Var, Var)> {
        let n = h.dim(0)?;
        let d = self.dims;
        let q = self.q_proj.forward(cx, h)?;
        let mut q = cx.reshape(&q, (n, d.heads, d.head_dim))?;
        if let Some(w) = &self.q_norm {
            q = cx.rms_norm(&q, w, d.eps)?;
        }
        let q = cx.rope(&q, rope)?;
        let k = self.k_proj.forward(cx, h)?;
        let mut k = cx.reshape(&k, (n, d.kv_heads, d.head_dim))?;
        if let Some(w) = &self.k_norm {
            k = cx.rms_norm(&k, w, d.eps)?;
        }
        let k = cx.rope(&k, rope)?;
        let v = self.v_proj.forward(cx, h)?;
        let v = cx.reshape(&v, (n, d.kv_heads, d.head_dim))?;
        Ok((q, k, v))
    }

    /// Unit `attn_core`: causal attention within each packed sequence, query head `h`
    /// reading key/value head `h / (Hq / Hkv)`, scores scaled by `1 / sqrt(D)`, limited to
    /// the layer's sliding window when it has one ([`DecoderConfig::layer_window`]).
    ///
    /// Saves q, k, v, the output o and the per-row log-sum-exp (`[Hq, N]`, exact): the
    /// flash-attention set, never the `T x T` probabilities.
    #[recovery_unit(name = "attn_core", cost = self.dims.attn_core_cost(packing.sum_sq_lengths()), deterministic)]
    pub fn core(&self, cx: &mut Cx, q: &Var, k: &Var, v: &Var, packing: &Packing) -> Result<Var> {
        let scale = 1.0 / (self.dims.head_dim as f64).sqrt();
        cx.attention_windowed(q, k, v, packing, scale, self.window)
    }

    /// This layer's sliding window (keys per query), if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Unit `attn_out`: the output projection of the concatenated heads, plus the
    /// residual. Saves o (the same storage `attn_core` saves: counted once while both
    /// hold it); the add saves nothing.
    #[recovery_unit(name = "attn_out", cost = self.dims.attn_out_cost(o.dim(0)?), deterministic)]
    pub fn out(&self, cx: &mut Cx, o: &Var, residual: &Var) -> Result<Var> {
        let n = o.dim(0)?;
        let o = cx.reshape(o, (n, self.dims.q_dim()))?;
        let y = self.o_proj.forward(cx, &o)?;
        cx.add(residual, &y)
    }
}

/// The SwiGLU MLP: two of the layer's units.
#[derive(Debug)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    dims: Dims,
}

impl Mlp {
    /// Unit `gate_up`: `silu(h W_gate^T) * (h W_up^T)`. Saves the normed input
    /// `[N, hidden]` and both projections `[N, inter]`: the widest unit of the layer.
    #[recovery_unit(name = "gate_up", cost = self.dims.gate_up_cost(h.dim(0)?), deterministic)]
    pub fn gate_up(&self, cx: &mut Cx, h: &Var) -> Result<Var> {
        let gate = self.gate_proj.forward(cx, h)?;
        let up = self.up_proj.forward(cx, h)?;
        cx.swiglu(&gate, &up)
    }

    /// Unit `down`: the down projection plus the residual. Saves the SwiGLU output
    /// `[N, inter]`.
    #[recovery_unit(name = "down", cost = self.dims.down_cost(a.dim(0)?), deterministic)]
    pub fn down(&self, cx: &mut Cx, a: &Var, residual: &Var) -> Result<Var> {
        let y = self.down_proj.forward(cx, a)?;
        cx.add(residual, &y)
    }
}

/// One pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
#[derive(Debug)]
pub struct DecoderLayer {
    pub input_layernorm: Var,
    pub self_attn: Attention,
    pub post_attention_layernorm: Var,
    pub mlp: Mlp,
    dims: Dims,
}

impl DecoderLayer {
    /// Unit `attn_norm`: RMSNorm before attention. Saves the layer input `[N, hidden]`.
    #[recovery_unit(name = "attn_norm", cost = self.dims.norm_cost(x.dim(0)?), deterministic)]
    pub fn attn_norm(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.rms_norm(x, &self.input_layernorm, self.dims.eps)
    }

    /// Unit `mlp_norm`: RMSNorm before the MLP. Saves the residual stream after
    /// attention `[N, hidden]`.
    #[recovery_unit(name = "mlp_norm", cost = self.dims.norm_cost(x.dim(0)?), deterministic)]
    pub fn mlp_norm(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        cx.rms_norm(x, &self.post_attention_layernorm, self.dims.eps)
    }

    /// The whole layer on the residual stream `x`: [`DecoderLayer::forward_rows`] on `x`
    /// as one part, or, on a shared-prefix layout with every prompt first
    /// ([`Packing::shared_prefix_rows`]), split into the prompts' and the responses' rows
    /// and concatenated again (a stack of layers splits once, [`Decoder::token_logprobs`]).
    pub fn forward<'m>(
        &'m self,
        cx: &mut Cx<'m>,
        x: &Var,
        packing: &Packing,
        rope: &RopeTables,
    ) -> Result<Var> {
        let parts = stream_parts(cx, x, packing)?;
        let y = self.forward_rows(cx, &parts, packing, rope)?;
        join_parts(cx, y)
    }

    /// Unit `layer`: the whole layer, made of the seven units above, on the residual
    /// stream in row parts: one part (every row), or, on a shared-prefix layout with every
    /// prompt first ([`Packing::shared_prefix_rows`]), two: the prompts' rows and the
    /// responses' rows, each in a storage of its own ([`stream_parts`]); the output has the
    /// input's parts. It records no op of its own that saves anything; as Recompute it is
    /// classic per-layer gradient checkpointing: after the forward only its input parts
    /// (and the batch's shared positions and RoPE tables) are kept, and backward re-runs
    /// the layer, each inner unit with its own fidelity.
    ///
    /// With two parts each row-wise unit runs twice, on the prompts' rows and then on the
    /// responses' rows, so it has a prompt instance and a response instance per layer
    /// (calls `2 l` and `2 l + 1` of layer `l`), which the allocator plans apart: a prompt
    /// row's saved state is read by the backward of every response of its group. The two
    /// parts meet in `attn_core`, whose instance covers both. The stream stays in its parts
    /// from layer to layer, so the split costs one copy of q, k and v per layer and none of
    /// the stream.
    #[recovery_unit(name = "layer", cost = self.dims.layer_cost(rows_of(x)?, packing.sum_sq_lengths()), deterministic)]
    pub fn forward_rows(
        &self,
        cx: &mut Cx,
        x: &[Var],
        packing: &Packing,
        rope: &RopeTables,
    ) -> Result<Vec<Var>> {
        match x {
            [x] => {
                let h = self.attn_norm(cx, x)?;
                let (q, k, v) = self.self_attn.qkv(cx, &h, rope)?;
                let o = self.self_attn.core(cx, &q, &k, &v, packing)?;
                let x = self.self_attn.out(cx, &o, x)?;
                let h = self.mlp_norm(cx, &x)?;
                let a = self.mlp.gate_up(cx, &h)?;
                Ok(vec![self.mlp.down(cx, &a, &x)?])
            }
            [xp, xr] => {
                let (p, r) = (xp.dim(0)?, xr.dim(0)?);
                if packing.shared_prefix_rows() != Some(p) {
                    return Err(Error::Tape(format!(
                        "layer: the residual stream comes in parts of {p} and {r} rows, but the packing's prompts end at row {:?}; split it with stream_parts",
                        packing.shared_prefix_rows()
                    )));
                }
                let (rope_p, rope_r) = (rope.rows(0, p)?, rope.rows(p, r)?);
                let hp = self.attn_norm(cx, xp)?;
                let hr = self.attn_norm(cx, xr)?;
                let (qp, kp, vp) = self.self_attn.qkv(cx, &hp, &rope_p)?;
                let (qr, kr, vr) = self.self_attn.qkv(cx, &hr, &rope_r)?;
                let q = cx.cat(&[&qp, &qr], 0)?;
                let k = cx.cat(&[&kp, &kr], 0)?;
                let v = cx.cat(&[&vp, &vr], 0)?;
                let o = self.self_attn.core(cx, &q, &k, &v, packing)?;
                let op = cx.narrow(&o, 0, 0, p)?;
                let or = cx.narrow(&o, 0, p, r)?;
                let xp = self.self_attn.out(cx, &op, xp)?;
                let xr = self.self_attn.out(cx, &or, xr)?;
                let hp = self.mlp_norm(cx, &xp)?;
                let hr = self.mlp_norm(cx, &xr)?;
                let ap = self.mlp.gate_up(cx, &hp)?;
                let ar = self.mlp.gate_up(cx, &hr)?;
                let yp = self.mlp.down(cx, &ap, &xp)?;
                let yr = self.mlp.down(cx, &ar, &xr)?;
                Ok(vec![yp, yr])
            }
            _ => Err(Error::Tape(format!(
                "layer: the residual stream comes in {} parts; it takes one (every row) or two (the prompts' rows, the responses' rows)",
                x.len()
            ))),
        }
    }
}

/// Rows of the residual stream given in parts.
fn rows_of(x: &[Var]) -> Result<usize> {
    x.iter().map(|v| v.dim(0)).sum()
}

/// The residual stream `x` in the parts [`DecoderLayer::forward_rows`] takes: `x` whole,
/// or, on a shared-prefix layout with every prompt first, its prompt rows and its
/// response rows, each copied into a storage of its own ([`Cx::split_rows`]), so a unit's
/// prompt instance saves only prompt rows.
pub fn stream_parts(cx: &mut Cx, x: &Var, packing: &Packing) -> Result<Vec<Var>> {
    Ok(match packing.shared_prefix_rows() {
        Some(p) => {
            let (xp, xr) = cx.split_rows(x, p)?;
            vec![xp, xr]
        }
        None => vec![x.clone()],
    })
}

/// The residual stream in parts, joined back into one `[N, hidden]`.
fn join_parts(cx: &mut Cx, mut parts: Vec<Var>) -> Result<Var> {
    match parts.len() {
        1 => Ok(parts.pop().expect("one part")),
        _ => {
            let refs: Vec<&Var> = parts.iter().collect();
            cx.cat(&refs, 0)
        }
    }
}

/// A Llama/Qwen2-family decoder whose parameters are `f32` tape parameters.
#[derive(Debug)]
pub struct Decoder {
    cfg: DecoderConfig,
    dims: Dims,
    embed_tokens: Var,
    layers: Vec<DecoderLayer>,
    norm: Var,
    lm_head: Option<Var>,
    logits_chunk_rows: usize,
    /// The log-probs' softmax temperature: `log_softmax(logits / T)` (1 by default).
    logit_temperature: f64,
}

/// How a parameter is initialized by [`Decoder::random`].
#[derive(Clone, Copy)]
enum Init {
    /// `N(0, INIT_STD)`.
    Weight,
    /// `1 + N(0, NORM_INIT_STD)`.
    Norm,
    /// `N(0, INIT_STD)`: small, but nonzero so its gradient path is exercised.
    Bias,
}

/// Every parameter of a config, name and shape, in [`Decoder::named_params`] order: the
/// decoder's one construction ([`build`]) run with a source that records each request
/// and hands back an empty placeholder, so no weight is allocated.
pub(crate) fn param_shapes(cfg: &DecoderConfig) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
    let seen = std::cell::RefCell::new(Vec::new());
    let record = |name: &str, shape: &[usize], _: Init| -> Result<Var, ModelError> {
        seen.borrow_mut().push((name.to_string(), shape.to_vec()));
        Ok(Var::constant(Tensor::zeros(0, DType::F32, &Device::Cpu)?))
    };
    build(cfg, &record)?;
    Ok(seen.into_inner())
}

/// Where [`build`] gets parameter `name` of shape `shape` (a `Var::param` of that shape),
/// given how [`Decoder::random`] would initialize it.
type ParamSource<'a> = dyn Fn(&str, &[usize], Init) -> Result<Var, ModelError> + 'a;

/// The decoder's structure: every parameter it has, by name, shape and initialization,
/// in [`Decoder::named_params`] order, each taken from `take`. The single list behind
/// [`Decoder::random`], [`Decoder::from_tensors`] and [`param_shapes`]
/// ([`for_each_param`] walks the built decoder in the same order).
fn build(cfg: &DecoderConfig, take: &ParamSource<'_>) -> Result<Decoder, ModelError> {
    cfg.validate()?;
    let dims = Dims::of(cfg);
    let (h, i, q, kv) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let embed_tokens = take(
        "model.embed_tokens.weight",
        &[cfg.vocab_size, h],
        Init::Weight,
    )?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let proj = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear, ModelError> {
            Ok(Linear {
                weight: take(&format!("{p}.{name}.weight"), &[out, inp], Init::Weight)?,
                bias: if bias {
                    Some(take(&format!("{p}.{name}.bias"), &[out], Init::Bias)?)
                } else {
                    None
                },
                lora: None,
            })
        };
        let norm = |name: &str| -> Result<Var, ModelError> {
            take(&format!("{p}.{name}.weight"), &[h], Init::Norm)
        };
        let qk_norm = |name: &str| -> Result<Option<Var>, ModelError> {
            if cfg.qk_norm() {
                let name = format!("{p}.self_attn.{name}.weight");
                Ok(Some(take(&name, &[cfg.head_dim], Init::Norm)?))
            } else {
                Ok(None)
            }
        };
        let b = cfg.attention_bias;
        let input_layernorm = norm("input_layernorm")?;
        let self_attn = Attention {
            q_proj: proj("self_attn.q_proj", q, h, b)?,
            k_proj: proj("self_attn.k_proj", kv, h, b)?,
            v_proj: proj("self_attn.v_proj", kv, h, b)?,
            o_proj: proj("self_attn.o_proj", h, q, cfg.o_proj_bias())?,
            q_norm: qk_norm("q_norm")?,
            k_norm: qk_norm("k_norm")?,
            dims,
            window: cfg.layer_window(l),
        };
        let post_attention_layernorm = norm("post_attention_layernorm")?;
        let mlp = Mlp {
            gate_proj: proj("mlp.gate_proj", i, h, false)?,
            up_proj: proj("mlp.up_proj", i, h, false)?,
            down_proj: proj("mlp.down_proj", h, i, false)?,
            dims,
        };
        layers.push(DecoderLayer {
            input_layernorm,
            self_attn,
            post_attention_layernorm,
            mlp,
            dims,
        });
    }
    let norm = take("model.norm.weight", &[h], Init::Norm)?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(take("lm_head.weight", &[cfg.vocab_size, h], Init::Weight)?)
    };
    Ok(Decoder {
        cfg: cfg.clone(),
        dims,
        embed_tokens,
        layers,
        norm,
        lm_head,
        logits_chunk_rows: (DEFAULT_LOGITS_CHUNK_ELEMS / cfg.vocab_size).max(1),
        logit_temperature: 1.0,
    })
}

impl Decoder {
    /// A decoder with seeded random weights: projections and embeddings `N(0, 0.02)`,
    /// RMSNorm weights `1 + N(0, 0.1)`, biases `N(0, 0.02)`. Each parameter draws from its
    /// own stream (seed x parameter name), so the values do not depend on the order of
    /// construction.
    pub fn random(cfg: &DecoderConfig, seed: u64, device: &Device) -> Result<Self, ModelError> {
        build(cfg, &|name, shape, init| {
            let mut rng = SplitMix64::for_stream(seed, name);
            let n: usize = shape.iter().product();
            let (mean, std) = match init {
                Init::Weight | Init::Bias => (0.0, INIT_STD),
                Init::Norm => (1.0, NORM_INIT_STD),
            };
            let data: Vec<f32> = (0..n).map(|_| (mean + std * rng.normal()) as f32).collect();
            Ok(Var::param(Tensor::from_vec(data, shape, device)?))
        })
    }

    /// A decoder from named tensors (the HF / candle-transformers names of
    /// [`Decoder::named_params`]), converted to `f32`. Every tensor the config needs must
    /// be present with the right shape; extra tensors are ignored.
    pub fn from_tensors(
        cfg: &DecoderConfig,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Self, ModelError> {
        build(cfg, &|name, shape, _| {
            let t = tensors.get(name).ok_or_else(|| ModelError::Param {
                name: name.to_string(),
                problem: format!("missing; the config needs it with shape {shape:?}"),
            })?;
            if t.dims() != shape {
                return Err(ModelError::Param {
                    name: name.to_string(),
                    problem: format!("has shape {:?}, the config needs {shape:?}", t.dims()),
                });
            }
            if !t.dtype().is_float() {
                return Err(ModelError::Param {
                    name: name.to_string(),
                    problem: format!(
                        "has dtype {:?}, expected a floating-point tensor",
                        t.dtype()
                    ),
                });
            }
            Ok(Var::param(t.to_dtype(DType::F32)?.contiguous()?))
        })
    }

    /// Computes [`Decoder::token_logprobs`] at softmax temperature `t`,
    /// `log_softmax(logits / t)`: the distribution a sampler at temperature `t` draws
    /// from, which a GRPO trainer that samples at `t` trains (TRL does). Errors unless
    /// `t` is finite and > 0. [`Decoder::logits`] stays the raw logits.
    pub fn set_logit_temperature(&mut self, t: f64) -> Result<()> {
        if !(t.is_finite() && t > 0.0) {
            return Err(Error::Tape(format!(
                "the log-probs' temperature is {t}; it must be a number > 0 (1 is the model's own distribution)"
            )));
        }
        self.logit_temperature = t;
        Ok(())
    }

    /// The log-probs' softmax temperature ([`Decoder::set_logit_temperature`]).
    pub fn logit_temperature(&self) -> f64 {
        self.logit_temperature
    }

    /// Computes the LM head's logits `rows` tokens at a time (default: as many rows as
    /// fit [`DEFAULT_LOGITS_CHUNK_ELEMS`] logits).
    pub fn with_logits_chunk_rows(mut self, rows: usize) -> Self {
        self.logits_chunk_rows = rows.max(1);
        self
    }

    /// The config.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The sizes the units' cost expressions use.
    pub fn dims(&self) -> Dims {
        self.dims
    }

    /// The layers.
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// Every parameter with its Hugging Face / candle-transformers name, in a stable order:
    /// the embedding, each layer (input norm, q/k/v projections with their biases when
    /// present, o projection and its bias when present, Qwen3's q/k norms, post-attention
    /// norm, gate/up/down), the final norm, and `lm_head.weight` unless the embeddings are
    /// tied. A projection's LoRA adapter ([`Decoder::add_lora`]) follows its weight and
    /// bias, PEFT's `lora_A.weight` then `lora_B.weight`.
    pub fn named_params(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        self.visit(|name, v| out.push((name, v.clone())));
        out
    }

    /// Mutable access to every parameter (e.g. for an optimizer step with
    /// [`Var::set_tensor`]), in [`Decoder::named_params`] order.
    pub fn named_params_mut(&mut self) -> Vec<(String, &mut Var)> {
        let mut out: Vec<(String, &mut Var)> = Vec::new();
        for_each_param!(self, |name, v| out.push((name, v)), iter_mut, mut);
        out
    }

    fn visit(&self, mut f: impl FnMut(String, &Var)) {
        for_each_param!(self, |name, v| f(name, v), iter,);
    }

    /// Turns the model into a LoRA model: every weight is frozen ([`Var::frozen`]: no
    /// gradient, never activation memory, never compressed) and each projection named in
    /// `cfg.targets` gets an adapter, `A` uniform in `±1/sqrt(in)` from `seed` (a
    /// counter-based stream per adapter) and `B` zero, so the model computes what it did.
    /// The trainable parameters ([`Var::requires_grad`]) are then the adapters alone.
    pub fn add_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<()> {
        if cfg.rank == 0 || !(cfg.alpha.is_finite() && cfg.alpha > 0.0) {
            return Err(Error::Tape(format!(
                "LoRA: rank {} and alpha {} must be positive (rank 8 and alpha 16 are common)",
                cfg.rank, cfg.alpha
            )));
        }
        if let Some(t) = cfg
            .targets
            .iter()
            .find(|t| !PROJECTIONS.contains(&t.as_str()))
        {
            return Err(Error::Tape(format!(
                "LoRA: unknown target `{t}`; the projections are {}",
                PROJECTIONS.join(", ")
            )));
        }
        for (_, v) in self.named_params_mut() {
            *v = Var::frozen(v.tensor().clone());
        }
        let scale = cfg.alpha / cfg.rank as f64;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let a = &mut layer.self_attn;
            let m = &mut layer.mlp;
            for (name, lin) in [
                ("q_proj", &mut a.q_proj),
                ("k_proj", &mut a.k_proj),
                ("v_proj", &mut a.v_proj),
                ("o_proj", &mut a.o_proj),
                ("gate_proj", &mut m.gate_proj),
                ("up_proj", &mut m.up_proj),
                ("down_proj", &mut m.down_proj),
            ] {
                if !cfg.targets.iter().any(|t| t == name) {
                    continue;
                }
                let (out, inp) = lin.weight.tensor().dims2()?;
                let device = lin.weight.tensor().device().clone();
                let bound = 1.0 / (inp as f64).sqrt();
                let mut rng = SplitMix64::for_stream(seed, &format!("lora-{l}-{name}"));
                let av: Vec<f32> = (0..cfg.rank * inp)
                    .map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32)
                    .collect();
                lin.lora = Some(Lora {
                    a: Var::param(Tensor::from_vec(av, (cfg.rank, inp), &device)?),
                    b: Var::param(Tensor::zeros((out, cfg.rank), DType::F32, &device)?),
                    scale,
                });
            }
        }
        Ok(())
    }

    /// Number of scalar parameters (a tied head counted once).
    pub fn num_params(&self) -> usize {
        let mut n = 0;
        self.visit(|_, v| n += v.elem_count());
        n
    }

    /// The LM head's weight: `lm_head.weight`, or the embedding matrix when tied.
    pub fn head_weight(&self) -> &Var {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Unit `embed`: the embedding lookup. Saves the input ids (exact, `u32 [N]`).
    #[recovery_unit(name = "embed", cost = self.dims.embed_cost(ids.elem_count()), deterministic)]
    pub fn embed(&self, cx: &mut Cx, ids: &Var) -> Result<Var> {
        cx.embedding(&self.embed_tokens, ids.tensor())
    }

    /// Unit `head`: the final RMSNorm and the log-probs of `targets` under the LM head,
    /// chunked so the `[N, vocab]` logits never exist at once. Saves the last layer's
    /// output and the normed hidden state (`[N, hidden]` each), the targets and the
    /// per-token log-sum-exp (exact, `[N]` each). At a logit temperature `T != 1` the
    /// normed hidden state is scaled by `1 / T` first (`(h / T) W^T = logits / T`).
    #[recovery_unit(name = "head", cost = self.dims.head_cost(x.dim(0)?), deterministic)]
    pub fn head(&self, cx: &mut Cx, x: &Var, targets: &Var) -> Result<Var> {
        let mut h = cx.rms_norm(x, &self.norm, self.dims.eps)?;
        if self.logit_temperature != 1.0 {
            h = cx.scale(&h, 1.0 / self.logit_temperature)?;
        }
        cx.token_logprobs(
            &h,
            self.head_weight(),
            targets.tensor(),
            self.logits_chunk_rows,
        )
    }

    /// Every layer on the embedded rows `x`: the stream split into its parts once
    /// ([`stream_parts`]), through the layers in those parts, joined after the last.
    fn layers_forward<'m>(
        &'m self,
        cx: &mut Cx<'m>,
        x: Var,
        packing: &Packing,
        rope: &RopeTables,
    ) -> Result<Var> {
        let mut parts = stream_parts(cx, &x, packing)?;
        drop(x);
        for layer in &self.layers {
            parts = layer.forward_rows(cx, &parts, packing, rope)?;
        }
        join_parts(cx, parts)
    }

    /// Per-token log-probs `[N]` of `batch.targets`: embedding, the layers, the head, each
    /// a recovery unit whose fidelity comes from `cx`'s plan. With [`Cx::inference`] the
    /// same code only computes.
    pub fn token_logprobs<'m>(&'m self, cx: &mut Cx<'m>, batch: &TokenBatch) -> Result<Var> {
        let rope = self.check_batch(batch)?;
        let ids = Var::constant(batch.inputs.clone());
        let targets = Var::constant(batch.targets.clone());
        let x = self.embed(cx, &ids)?;
        let mut x = self.layers_forward(cx, x, &batch.packing, rope)?;
        if let Some(rows) = &batch.logprob_rows {
            // Shared prefixes: the row predicting each target (a prompt's last row once
            // per response); the backward sums a row's uses in a fixed order.
            x = cx.embedding(&x, rows)?;
        }
        self.head(cx, &x, &targets)
    }

    /// The full logits `[N, vocab]` of every input token of `batch` (embedding, layers,
    /// final norm, LM head), through the same units as [`Decoder::token_logprobs`] up to
    /// the head. Materializes all `N x vocab` logits at once: for inspection, tests and
    /// small batches (training and scoring use the chunked log-probs of the `head` unit).
    pub fn logits<'m>(&'m self, cx: &mut Cx<'m>, batch: &TokenBatch) -> Result<Var> {
        let rope = self.check_batch(batch)?;
        let ids = Var::constant(batch.inputs.clone());
        let x = self.embed(cx, &ids)?;
        let x = self.layers_forward(cx, x, &batch.packing, rope)?;
        let h = cx.rms_norm(&x, &self.norm, self.dims.eps)?;
        cx.linear(&h, self.head_weight(), None)
    }

    /// Checks that `batch` fits the model; gives its RoPE tables.
    fn check_batch<'b>(&self, batch: &'b TokenBatch) -> Result<&'b RopeTables> {
        let n = batch.num_tokens();
        let bad = |what: String| {
            Err(Error::Tape(format!("token batch does not fit the model: {what}; build it with TokenBatch::from_sequences for this model's config")))
        };
        let rope = batch
            .rope_tables()
            .map_err(|e| Error::Tape(e.to_string()))?;
        let m = match &batch.logprob_rows {
            Some(rows) => rows.dim(0).unwrap_or(usize::MAX),
            None => n,
        };
        if batch.inputs.dims() != [n] || batch.targets.dims() != [m] || rope.num_tokens() != n {
            return bad(format!(
                "inputs {:?} and rope tables of {} rows should have the packing's {n} rows, targets {:?} the {m} log-prob rows",
                batch.inputs.dims(),
                rope.num_tokens(),
                batch.targets.dims(),
            ));
        }
        if let Some(rows) = &batch.logprob_rows {
            let max = if m == 0 {
                0
            } else {
                rows.max(0)?.to_scalar::<u32>()? as usize
            };
            if rows.rank() != 1 || max >= n {
                return bad(format!(
                    "logprob_rows {:?} should be u32 [M] of rows below {n}, got a largest row {max}",
                    rows.dims()
                ));
            }
        }
        if rope.head_dim() != self.cfg.head_dim {
            return bad(format!(
                "rope tables are for head_dim {}, the model has {}",
                rope.head_dim(),
                self.cfg.head_dim
            ));
        }
        for (what, t) in [("input", &batch.inputs), ("target", &batch.targets)] {
            let max = t.max(0)?.to_scalar::<u32>()? as usize;
            if max >= self.cfg.vocab_size {
                return bad(format!(
                    "{what} id {max} is outside the vocabulary of {} ids",
                    self.cfg.vocab_size
                ));
            }
        }
        Ok(rope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `layer` unit takes the residual stream in the parts the packing implies: one
    /// part on a packing without shared prefixes; two or three parts there are an error
    /// that names the layout, not a panic.
    #[test]
    fn layer_rejects_parts_the_packing_does_not_have() {
        let cfg = DecoderConfig {
            num_hidden_layers: 1,
            ..DecoderConfig::tiny()
        };
        let device = Device::Cpu;
        let model = Decoder::random(&cfg, 3, &device).unwrap();
        let packing = Packing::new(&[3, 2], &device).unwrap();
        let positions: Vec<u32> = packing.positions().to_vec1().unwrap();
        let rope = cfg.rope_tables(&positions, DType::F32, &device).unwrap();
        let rows = |n: usize| {
            Var::constant(Tensor::zeros((n, cfg.hidden_size), DType::F32, &device).unwrap())
        };
        let layer = &model.layers()[0];
        let mut cx = Cx::inference();
        let one = layer
            .forward_rows(&mut cx, &[rows(5)], &packing, &rope)
            .unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].dims(), [5, cfg.hidden_size]);
        let two = layer.forward_rows(&mut cx, &[rows(3), rows(2)], &packing, &rope);
        let err = two
            .expect_err("two parts on an unshared packing")
            .to_string();
        assert!(err.contains("parts of 3 and 2 rows"), "{err}");
        let three = layer.forward_rows(&mut cx, &[rows(2), rows(2), rows(1)], &packing, &rope);
        let err = three.expect_err("three parts").to_string();
        assert!(err.contains("3 parts"), "{err}");
    }

    /// The parameter list a config implies (read by the weight loader and the exporter
    /// without building a model) is the built model's, name for name and shape for shape,
    /// in every architecture variant that adds or removes parameters.
    #[test]
    fn param_shapes_are_the_built_models_parameters() {
        let variants = [
            ("llama", false, false),
            ("llama", true, true),
            ("qwen2", true, false),
            ("qwen3", true, true),
            ("qwen3", false, false),
            ("mistral", false, true),
        ];
        for (model_type, attention_bias, tie_word_embeddings) in variants {
            let cfg = DecoderConfig {
                model_type: Some(model_type.into()),
                attention_bias,
                tie_word_embeddings,
                num_hidden_layers: 2,
                ..DecoderConfig::tiny()
            };
            let shapes = param_shapes(&cfg).unwrap();
            let model = Decoder::random(&cfg, 7, &Device::Cpu).unwrap();
            let built: Vec<(String, Vec<usize>)> = model
                .named_params()
                .into_iter()
                .map(|(n, v)| (n, v.dims().to_vec()))
                .collect();
            assert_eq!(
                shapes, built,
                "{model_type} bias {attention_bias} tied {tie_word_embeddings}"
            );
        }
    }
}
