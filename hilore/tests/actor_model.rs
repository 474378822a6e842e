//! The GRPO actor update as a library, on a model of one's own: a model that is not the
//! built-in decoder implements `ActorModel` (its batches, token log-probs on the tape,
//! its parameters) and trains through `actor_update` and AdamW; recomputing its unit
//! leaves the update bit for bit the same as storing it.

use candle_core::{Device, Tensor};
use hilore::train::optimizer::{AdamW, AdamWConfig};
use hilore::train::rollout::Rollout;
use hilore::train::update::{actor_update, UpdateSettings};
use hilore::train::ActorModel;
use hilore_models::{DecoderConfig, TokenBatch};
use hilore_runtime::grpo::{advantages, GrpoConfig, StepLayout};
use hilore_runtime::{recovery_unit, Cx, Fidelity, Plan, Result, Var};

const VOCAB: usize = 11;
const HIDDEN: usize = 8;

/// An embedding, one mixing unit (a projection and GELU) and a head tied to the
/// embedding.
struct Tiny {
    embed: Var,
    mix: Var,
}

impl Tiny {
    #[recovery_unit(cost = 2 * x.elem_count() * HIDDEN, deterministic, name = "tiny.mix")]
    fn mix(&self, cx: &mut Cx, x: &Var) -> Result<Var> {
        let h = cx.linear(x, &self.mix, None)?;
        let h = cx.gelu_tanh(&h)?;
        cx.add(x, &h)
    }
}

impl ActorModel for Tiny {
    fn batch(&self, seqs: &[Vec<u32>]) -> anyhow::Result<TokenBatch> {
        // The packing and targets; the RoPE tables it also builds go unused here.
        let cfg = DecoderConfig {
            vocab_size: VOCAB,
            ..DecoderConfig::tiny()
        };
        Ok(TokenBatch::from_sequences(seqs, &cfg, &Device::Cpu)?)
    }

    fn token_logprobs<'m>(&'m self, cx: &mut Cx<'m>, batch: &TokenBatch) -> Result<Var> {
        let x = cx.embedding(&self.embed, &batch.inputs)?;
        let h = self.mix(cx, &x)?;
        cx.token_logprobs(&h, &self.embed, &batch.targets, 64)
    }

    fn named_params(&self) -> Vec<(String, Var)> {
        vec![
            ("embed".into(), self.embed.clone()),
            ("mix".into(), self.mix.clone()),
        ]
    }

    fn named_params_mut(&mut self) -> Vec<(String, &mut Var)> {
        vec![
            ("embed".into(), &mut self.embed),
            ("mix".into(), &mut self.mix),
        ]
    }
}

fn model() -> Tiny {
    let dev = Device::Cpu;
    Tiny {
        embed: Var::param(Tensor::randn(0f32, 0.5, (VOCAB, HIDDEN), &dev).unwrap()),
        mix: Var::param(Tensor::randn(0f32, 0.3, (HIDDEN, HIDDEN), &dev).unwrap()),
    }
}

fn weights(m: &Tiny) -> Vec<u32> {
    m.named_params()
        .iter()
        .flat_map(|(_, v)| v.tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .map(f32::to_bits)
        .collect()
}

#[test]
fn a_model_of_ones_own_trains_through_the_actor_update() {
    // Two prompt groups of two responses, rewards that differ within each group.
    let seqs: Vec<Vec<u32>> = vec![
        vec![1, 2, 3, 4],
        vec![1, 2, 5, 6, 7],
        vec![8, 9, 3],
        vec![8, 9, 4, 10],
    ];
    let rewards = vec![1.0, 0.0, 0.0, 1.0];
    let prompt_lens = vec![2; seqs.len()];
    let rollout = Rollout::scored(seqs, prompt_lens, rewards.clone());
    let adv = advantages(&rewards, 2, Default::default(), 1e-4).unwrap();
    let run = |fidelity: Fidelity| {
        let mut m = model_seeded();
        let before = weights(&m);
        let mut opt = AdamW::new(
            AdamWConfig {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.0,
                max_grad_norm: 1.0,
            },
            &m,
        );
        let settings = UpdateSettings {
            grpo: GrpoConfig::default(),
            layout: StepLayout::single(4),
            token_budget: 64,
            plan: Plan::store_all().with_unit("tiny.mix", fidelity),
            skip_zero_exposure: false,
            shared_prefix: false,
            allocator: None,
        };
        let rep = actor_update(&mut m, None, &mut opt, &rollout, &adv, &settings).unwrap();
        assert!(rep.grad_norm > 0.0, "no gradient reached the model");
        assert_eq!(rep.optimizer_steps, 1);
        let after = weights(&m);
        assert_ne!(before, after, "the step changed nothing");
        (after, rep.fidelities)
    };
    let (stored, fs) = run(Fidelity::Store);
    let (recomputed, fr) = run(Fidelity::Recompute);
    assert_eq!((fs.store, fr.recompute), (1, 1), "{fs:?} {fr:?}");
    assert_eq!(stored, recomputed, "recompute changed the update");
}

/// The same weights every call (candle's RNG is seeded per process, not per call).
fn model_seeded() -> Tiny {
    thread_local! {
        static M: (Tensor, Tensor) = {
            let m = model();
            (m.embed.tensor().clone(), m.mix.tensor().clone())
        };
    }
    M.with(|(e, w)| Tiny {
        embed: Var::param(e.copy().unwrap()),
        mix: Var::param(w.copy().unwrap()),
    })
}
