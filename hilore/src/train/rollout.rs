//! Rollout: `G` sampled responses per prompt with the KV cache, their rewards.

use crate::tasks::{Example, Task};
use crate::tokenizer::TrainTokenizer;
use hilore_models::generate::{generate, Finish, SamplingConfig};
use hilore_models::Decoder;
use std::time::Instant;

/// The sequences of one GRPO step, laid out group by group: sequence `g * G + j` is
/// response `j` to prompt `g`.
#[derive(Debug, Clone)]
pub struct Rollout {
    /// The step's prompts.
    pub examples: Vec<Example>,
    /// Prompt ids followed by response ids, per sequence.
    pub seqs: Vec<Vec<u32>>,
    /// Prompt tokens of each sequence (the tokenizer's special tokens included).
    pub prompt_lens: Vec<usize>,
    /// Response tokens of each sequence (the stop token included when sampled).
    pub response_lens: Vec<usize>,
    /// Log-prob of every response token as recorded during sampling.
    pub sampled_logp: Vec<Vec<f32>>,
    /// Decoded responses.
    pub texts: Vec<String>,
    pub rewards: Vec<f32>,
    /// Whether each response was cut at `max_new_tokens` (no stop token sampled).
    pub truncated: Vec<bool>,
    pub correct: Vec<bool>,
    pub seconds: f64,
}

impl Rollout {
    /// A rollout of sequences sampled elsewhere (one's own generator, a dataset of scored
    /// responses): sequence `i` is `prompt_lens[i]` prompt tokens followed by its response,
    /// laid out group by group, with its reward. What the sampler recorded is unknown: no
    /// sampling log-probs (the update's mismatch check skips them), no texts, none counted
    /// correct or truncated.
    pub fn scored(seqs: Vec<Vec<u32>>, prompt_lens: Vec<usize>, rewards: Vec<f32>) -> Self {
        let n = seqs.len();
        let response_lens = seqs
            .iter()
            .zip(&prompt_lens)
            .map(|(s, &p)| s.len().saturating_sub(p))
            .collect();
        Rollout {
            examples: Vec::new(),
            seqs,
            prompt_lens,
            response_lens,
            sampled_logp: vec![Vec::new(); n],
            texts: vec![String::new(); n],
            rewards,
            truncated: vec![false; n],
            correct: vec![false; n],
            seconds: 0.0,
        }
    }

    /// Tokens sampled.
    pub fn generated_tokens(&self) -> usize {
        self.response_lens.iter().sum()
    }

    /// Mean reward.
    pub fn reward_mean(&self) -> f64 {
        mean(self.rewards.iter().map(|&r| r as f64))
    }

    /// Fraction of fully correct responses.
    pub fn accuracy(&self) -> f64 {
        mean(self.correct.iter().map(|&c| c as u8 as f64))
    }

    /// Mean response length in tokens.
    pub fn response_len_mean(&self) -> f64 {
        mean(self.response_lens.iter().map(|&l| l as f64))
    }
}

fn mean(it: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut n) = (0.0, 0usize);
    for x in it {
        s += x;
        n += 1;
    }
    if n == 0 {
        0.0
    } else {
        s / n as f64
    }
}

/// Samples `group_size` responses to each example and scores them.
pub fn rollout(
    model: &Decoder,
    task: &Task,
    tokenizer: &TrainTokenizer,
    examples: Vec<Example>,
    group_size: usize,
    sampling: &SamplingConfig,
    reward_weights: [f32; 2],
) -> anyhow::Result<Rollout> {
    let t0 = Instant::now();
    let mut prompts = Vec::with_capacity(examples.len() * group_size);
    for ex in &examples {
        let p = tokenizer.encode_prompt(&ex.prompt)?;
        for _ in 0..group_size {
            prompts.push(p.clone());
        }
    }
    let sampling = SamplingConfig {
        stop_token: Some(tokenizer.eos()),
        ..sampling.clone()
    };
    let gens = generate(model, &prompts, &sampling)?;
    let n = prompts.len();
    let mut r = Rollout {
        seqs: Vec::with_capacity(n),
        prompt_lens: Vec::with_capacity(n),
        response_lens: Vec::with_capacity(n),
        sampled_logp: Vec::with_capacity(n),
        texts: Vec::with_capacity(n),
        rewards: Vec::with_capacity(n),
        truncated: Vec::with_capacity(n),
        correct: Vec::with_capacity(n),
        seconds: 0.0,
        examples: Vec::new(),
    };
    for (i, (p, g)) in prompts.into_iter().zip(gens).enumerate() {
        let ex = &examples[i / group_size];
        let text = tokenizer.decode(&g.tokens)?;
        let reward = task.reward(ex, &text);
        r.prompt_lens.push(p.len());
        r.response_lens.push(g.tokens.len());
        let mut s = p;
        s.extend_from_slice(&g.tokens);
        r.seqs.push(s);
        r.sampled_logp.push(g.logprobs);
        r.texts.push(text);
        r.rewards.push(reward.weighted(reward_weights));
        r.truncated.push(g.finish == Finish::Length);
        r.correct.push(reward.correct);
    }
    r.examples = examples;
    r.seconds = t0.elapsed().as_secs_f64();
    Ok(r)
}
