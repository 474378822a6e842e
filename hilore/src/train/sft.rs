//! Warm start: supervised fine-tuning on the task's reference solutions, so that GRPO
//! starts from a policy with a non-trivial success rate (GRPO learns nothing from groups
//! whose rewards are all equal).

use super::optimizer::AdamW;
use super::update::Micro;
use crate::tasks::Example;
use crate::tokenizer::TrainTokenizer;
use anyhow::Context;
use hilore_models::Decoder;
use hilore_runtime::grpo::pack_by_token_budget;
use hilore_runtime::{Cx, Grads, Plan};

/// The result of one warm-start step.
#[derive(Debug, Clone, Copy)]
pub struct SftStep {
    /// Mean negative log-likelihood per solution token.
    pub loss: f64,
    /// Rows through forward and backward.
    pub tokens: usize,
}

/// One step of cross-entropy on `examples`' solutions (EOS included): the loss is
/// `-mean logp` over solution tokens, so every solution token's coefficient is
/// `-1 / (solution tokens in the step)`.
pub fn sft_step(
    model: &mut Decoder,
    opt: &mut AdamW,
    tokenizer: &TrainTokenizer,
    examples: &[Example],
    token_budget: usize,
    plan: &Plan,
) -> anyhow::Result<SftStep> {
    let mut seqs = Vec::with_capacity(examples.len());
    let mut prompt_lens = Vec::with_capacity(examples.len());
    for ex in examples {
        let mut s = tokenizer.encode_prompt(&ex.prompt)?;
        prompt_lens.push(s.len());
        s.extend(tokenizer.encode_completion(&ex.solution)?);
        s.push(tokenizer.eos());
        seqs.push(s);
    }
    let targets: usize = seqs
        .iter()
        .zip(&prompt_lens)
        .map(|(s, p)| s.len() - p)
        .sum();
    let c = -1.0 / targets as f64;
    let rows: Vec<usize> = seqs.iter().map(|s| s.len() - 1).collect();
    let packs = pack_by_token_budget(&rows, token_budget)
        .context("packing the warm start's microbatches")?;
    let mut grads = Grads::new();
    let (mut nll, mut tokens) = (0f64, 0usize);
    let m: &Decoder = model;
    for pack in &packs {
        let micro = Micro::new(m, &seqs, &prompt_lens, pack)?;
        let mut cx = Cx::new(plan.clone());
        let logp = m.token_logprobs(&mut cx, &micro.batch)?;
        let lp = micro.gather(&logp.tensor().to_vec1::<f32>()?);
        nll -= lp.iter().map(|&x| x as f64).sum::<f64>();
        let seed = micro.seed(&vec![c as f32; lp.len()])?;
        cx.backward(&logp, &seed, &mut grads)?;
        tokens += micro.batch.num_tokens();
    }
    opt.step(model, &grads)?;
    Ok(SftStep {
        loss: nll / targets as f64,
        tokens,
    })
}
