//! An unmodified zoo layer as an opaque unit inside the managed decoder: every layer's MLP
//! block (post-attention RMSNorm, gate/up, SwiGLU, down, residual) is a
//! candle-transformers block (`with_tracing::RmsNorm`, `with_tracing::Linear`) run on
//! candle's autograd inside one recovery unit; the rest of the model is the tape's units.
//! Under Store and under Recompute the gradients are bit-identical, and they match candle's
//! own autograd on the whole model ([`CandleDecoder`]).

mod support;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::with_tracing::{linear_no_bias, RmsNorm};
use hilore_models::reference::CandleDecoder;
use hilore_models::{Decoder, DecoderConfig, TokenBatch};
use hilore_runtime::{opaque_unit, Cx, Fidelity, Grads, OpaqueUnit, Plan, Result, Var};
use std::collections::HashMap;
use support::{bits, rel_l2};

opaque_unit!(static ZOO_MLP = "zoo_mlp", deterministic);

/// Same bounds and reasons as the tape-vs-candle reference test (`tests/reference.rs`):
/// f32 on both sides, different summation orders, a few hundred terms per gradient entry
/// through two layers: ~1e-6 relative, 10x margin.
const GRAD_BOUND: f64 = 1e-5;
const LOGP_BOUND: f64 = 2e-5;

fn config() -> DecoderConfig {
    DecoderConfig {
        vocab_size: 61,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        max_position_embeddings: 64,
        ..DecoderConfig::tiny()
    }
}

/// Layer `l`'s MLP block built the zoo's way from the decoder's weights (copied into
/// candle Vars), with the names it has in the decoder.
fn zoo_mlp(model: &Decoder, l: usize) -> (OpaqueUnit<impl Module>, Vec<String>) {
    let cfg = model.config();
    let params: HashMap<String, Var> = model.named_params().into_iter().collect();
    let p = format!("model.layers.{l}");
    let varmap = VarMap::new();
    let names = [
        (
            "norm.weight",
            format!("{p}.post_attention_layernorm.weight"),
        ),
        ("gate_proj.weight", format!("{p}.mlp.gate_proj.weight")),
        ("up_proj.weight", format!("{p}.mlp.up_proj.weight")),
        ("down_proj.weight", format!("{p}.mlp.down_proj.weight")),
    ];
    {
        let mut data = varmap.data().lock().unwrap();
        for (local, global) in &names {
            let t = params[global].tensor();
            data.insert(local.to_string(), candle_core::Var::from_tensor(t).unwrap());
        }
    }
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let norm = RmsNorm::new(h, cfg.rms_norm_eps, vb.pp("norm")).unwrap();
    let gate = linear_no_bias(h, i, vb.pp("gate_proj")).unwrap();
    let up = linear_no_bias(h, i, vb.pp("up_proj")).unwrap();
    let down = linear_no_bias(i, h, vb.pp("down_proj")).unwrap();
    let block = move |x: &Tensor| -> candle_core::Result<Tensor> {
        let hn = norm.forward_diff(x)?;
        let a = (candle_nn::ops::silu(&gate.forward(&hn)?)? * up.forward(&hn)?)?;
        x + down.forward(&a)?
    };
    let data = varmap.data().lock().unwrap();
    let vars: Vec<candle_core::Var> = names.iter().map(|(n, _)| data[*n].clone()).collect();
    let global = names.iter().map(|(_, g)| g.clone()).collect();
    (OpaqueUnit::new(&ZOO_MLP, block, vars).unwrap(), global)
}

/// The decoder's forward with each layer's MLP block replaced by the opaque zoo block.
fn forward<'m, M: Module>(
    model: &'m Decoder,
    mlps: &'m [OpaqueUnit<M>],
    cx: &mut Cx<'m>,
    batch: &TokenBatch,
) -> Result<Var> {
    let ids = Var::constant(batch.inputs.clone());
    let targets = Var::constant(batch.targets.clone());
    let mut x = model.embed(cx, &ids)?;
    for (layer, mlp) in model.layers().iter().zip(mlps) {
        let h = layer.attn_norm(cx, &x)?;
        let (q, k, v) = layer.self_attn.qkv(cx, &h, batch.rope_tables().unwrap())?;
        let o = layer.self_attn.core(cx, &q, &k, &v, &batch.packing)?;
        x = layer.self_attn.out(cx, &o, &x)?;
        x = mlp.forward(cx, &x)?;
    }
    model.head(cx, &x, &targets)
}

#[test]
fn opaque_zoo_layer_store_and_recompute_are_bit_identical_and_match_candle() {
    let dev = Device::Cpu;
    let cfg = config();
    let model = Decoder::random(&cfg, 11, &dev).unwrap();
    let mut mlps = Vec::new();
    let mut opaque_names = Vec::new();
    for l in 0..cfg.num_hidden_layers {
        let (u, names) = zoo_mlp(&model, l);
        mlps.push(u);
        opaque_names.push(names);
    }
    let batch = TokenBatch::random(&[17, 9, 12], &cfg, 12, &dev).unwrap();
    let n = batch.num_tokens();
    let coeffs = Tensor::randn(0f32, 1.0, n, &dev).unwrap();

    // Gradient of every parameter by name: tape parameters from the decoder (those of the
    // MLP blocks are the opaque units' now), opaque ones from the units.
    let run = |plan: Plan| -> (Tensor, HashMap<String, Tensor>, usize) {
        let mut cx = Cx::new(plan).verify_recompute(true);
        let logp = forward(&model, &mlps, &mut cx, &batch).unwrap();
        let peak = cx.memory().peak_bytes();
        let mut grads = Grads::new();
        let report = cx.backward(&logp, &coeffs, &mut grads).unwrap();
        assert!(report.checks.iter().all(|c| c.bit_identical));
        let mut by_name = HashMap::new();
        for (name, v) in model.named_params() {
            if let Some(g) = grads.get(v.id()) {
                by_name.insert(name, g.clone());
            }
        }
        for (u, names) in mlps.iter().zip(&opaque_names) {
            for (p, name) in u.params().zip(names) {
                by_name.insert(name.clone(), grads.get(p.id()).unwrap().clone());
            }
        }
        (logp.tensor().clone(), by_name, peak)
    };
    let (logp_s, store, peak_store) = run(Plan::store_all());
    let (logp_r, recompute, peak_rc) =
        run(Plan::store_all().with_unit("zoo_mlp", Fidelity::Recompute));
    assert_eq!(
        store.len(),
        model.named_params().len(),
        "every parameter got a gradient"
    );
    assert_eq!(bits(&logp_s), bits(&logp_r));
    for (name, g) in &store {
        assert_eq!(
            bits(g),
            bits(&recompute[name]),
            "{name}: Store and Recompute differ"
        );
    }
    // Recompute keeps each block's input instead of candle's graph of the block.
    assert!(
        peak_rc < peak_store,
        "recompute peak {peak_rc} >= store peak {peak_store}"
    );

    // candle's own autograd on the whole model.
    let reference = CandleDecoder::from_decoder(&model).unwrap();
    let (logp_c, grads_c) = reference.logprobs_and_gradients(&batch, &coeffs).unwrap();
    let dlogp = (&logp_s - &logp_c)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    assert!(
        dlogp < LOGP_BOUND,
        "log-probs differ from candle by {dlogp:e}"
    );
    let mut worst = (String::new(), 0f64);
    for (name, g) in grads_c {
        let r = rel_l2(&store[&name], &g);
        if r > worst.1 {
            worst = (name, r);
        }
    }
    println!(
        "max |dlogp| {dlogp:.3e}; worst gradient {} rel L2 {:.3e}",
        worst.0, worst.1
    );
    assert!(
        worst.1 < GRAD_BOUND,
        "{}: rel L2 {:e} vs candle",
        worst.0,
        worst.1
    );
}
