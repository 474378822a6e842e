//! Held-out evaluation: greedy and sampled accuracy on examples training never draws.

use crate::tasks::{Example, Task};
use crate::tokenizer::TrainTokenizer;
use hilore_models::generate::{generate, SamplingConfig};
use hilore_models::Decoder;

/// Prompts per generation call (bounds the KV cache).
const CHUNK: usize = 256;

/// Held-out results.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EvalReport {
    /// Fraction of correct responses sampled at the rollout temperature
    /// (`samples` per prompt).
    pub accuracy: f64,
    /// Fraction of prompts answered correctly by greedy decoding.
    pub greedy_accuracy: f64,
    /// Mean reward of the sampled responses.
    pub reward_mean: f64,
    pub prompts: usize,
    pub samples: usize,
}

/// Evaluates `model` on `examples`: greedy decoding, and `samples` responses per prompt
/// sampled with `sampling` (seeded, so the same weights give the same numbers).
pub fn evaluate(
    model: &Decoder,
    task: &Task,
    tokenizer: &TrainTokenizer,
    examples: &[Example],
    sampling: &SamplingConfig,
    samples: usize,
) -> anyhow::Result<EvalReport> {
    let mut greedy_ok = 0usize;
    let (mut ok, mut reward, mut n) = (0usize, 0f64, 0usize);
    for (c, chunk) in examples.chunks(CHUNK).enumerate() {
        let prompts = chunk
            .iter()
            .map(|e| tokenizer.encode_prompt(&e.prompt))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let greedy = SamplingConfig {
            temperature: 0.0,
            stop_token: Some(tokenizer.eos()),
            ..sampling.clone()
        };
        for (g, ex) in generate(model, &prompts, &greedy)?.iter().zip(chunk) {
            greedy_ok += task.reward(ex, &tokenizer.decode(&g.tokens)?).correct as usize;
        }
        for s in 0..samples {
            let cfg = SamplingConfig {
                stop_token: Some(tokenizer.eos()),
                seed: sampling
                    .seed
                    .wrapping_add((c * samples.max(1) + s) as u64 * 0x9E37_79B9),
                ..sampling.clone()
            };
            for (g, ex) in generate(model, &prompts, &cfg)?.iter().zip(chunk) {
                let r = task.reward(ex, &tokenizer.decode(&g.tokens)?);
                ok += r.correct as usize;
                reward += r.value as f64;
                n += 1;
            }
        }
    }
    let frac = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Ok(EvalReport {
        accuracy: frac(ok, n),
        greedy_accuracy: frac(greedy_ok, examples.len()),
        reward_mean: if n == 0 { 0.0 } else { reward / n as f64 },
        prompts: examples.len(),
        samples,
    })
}
