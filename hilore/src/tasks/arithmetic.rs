//! Multi-digit arithmetic: `37+48=` -> `85`.

use super::{Example, Reward};
use crate::tokenizer::Tokenizer;
use anyhow::bail;
use hilore_models::rng::SplitMix64;

/// Two operands of up to `digits` digits each, one operator drawn from `ops`.
#[derive(Debug, Clone)]
pub struct Arithmetic {
    digits: usize,
    ops: Vec<char>,
}

impl Arithmetic {
    /// `digits` in 1..=9, `ops` a non-empty set of `+`, `-`, `*`.
    pub fn new(digits: usize, ops: &str) -> anyhow::Result<Self> {
        if !(1..=9).contains(&digits) {
            bail!("--digits is {digits}; arithmetic operands need 1 to 9 digits");
        }
        let mut v = Vec::new();
        for c in ops.chars() {
            if !"+-*".contains(c) {
                bail!("--ops contains {c:?}; the arithmetic operators are `+`, `-` and `*`");
            }
            if !v.contains(&c) {
                v.push(c);
            }
        }
        if v.is_empty() {
            bail!("--ops is empty; give at least one of `+`, `-`, `*`");
        }
        Ok(Arithmetic { digits, ops: v })
    }

    pub fn describe(&self) -> String {
        format!(
            "arithmetic ({} digit{}, ops {})",
            self.digits,
            if self.digits == 1 { "" } else { "s" },
            self.ops.iter().collect::<String>()
        )
    }

    pub fn tokenizer(&self) -> Tokenizer {
        Tokenizer::chars("0123456789+-*=")
    }

    pub fn sample(&self, rng: &mut SplitMix64) -> Example {
        let max = 10u64.pow(self.digits as u32);
        let a = rng.below(max) as i64;
        let b = rng.below(max) as i64;
        let op = self.ops[rng.below(self.ops.len() as u64) as usize];
        let value = match op {
            '+' => a + b,
            '-' => a - b,
            _ => a * b,
        };
        Example {
            prompt: format!("{a}{op}{b}="),
            solution: value.to_string(),
            answer: value.to_string(),
        }
    }

    /// 1 when the response is exactly the integer answer (`-?[0-9]+`, no spaces), else 0.
    pub fn reward(&self, ex: &Example, response: &str) -> Reward {
        let digits = response.strip_prefix('-').unwrap_or(response);
        let well_formed = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
        match (
            well_formed,
            response.parse::<i64>(),
            ex.answer.parse::<i64>(),
        ) {
            (true, Ok(got), Ok(want)) if got == want => Reward::CORRECT,
            (true, _, _) => Reward {
                well_formed: true,
                ..Reward::ZERO
            },
            _ => Reward::ZERO,
        }
    }

    pub fn max_prompt_chars(&self) -> usize {
        2 * self.digits + 2
    }

    pub fn max_solution_chars(&self) -> usize {
        let d = self.digits;
        self.ops
            .iter()
            .map(|&op| match op {
                '+' => d + 1,
                '-' => d + 1,
                _ => 2 * d,
            })
            .max()
            .unwrap_or(d + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_are_correct_and_rewarded() {
        let t = Arithmetic::new(3, "+-*").unwrap();
        let tok = t.tokenizer();
        let mut rng = SplitMix64::new(1);
        for _ in 0..200 {
            let ex = t.sample(&mut rng);
            assert_eq!(t.reward(&ex, &ex.solution), Reward::CORRECT, "{ex:?}");
            assert!(ex.solution.len() <= t.max_solution_chars());
            tok.encode(&ex.prompt).unwrap();
            tok.encode(&ex.solution).unwrap();
        }
    }

    #[test]
    fn malformed_and_wrong_responses_score_zero() {
        let t = Arithmetic::new(2, "+").unwrap();
        let ex = Example {
            prompt: "37+48=".into(),
            solution: "85".into(),
            answer: "85".into(),
        };
        for bad in [
            "",
            "-",
            "8 5",
            "85=",
            "+85",
            "84",
            "85+",
            "=",
            "99999999999999999999",
        ] {
            let r = t.reward(&ex, bad);
            assert_eq!((r.value, r.correct), (0.0, false), "{bad:?}");
            // An integer, wrong, is well formed (the `format` reward function).
            let integer = matches!(bad, "84" | "99999999999999999999");
            assert_eq!(r.well_formed, integer, "{bad:?}");
            assert_eq!(r.weighted(t_weights()), r.value, "{bad:?}");
        }
        assert_eq!(t.reward(&ex, "085"), Reward::CORRECT);
    }

    /// Arithmetic's weights of the reward functions (`Task::reward_weights`).
    fn t_weights() -> [f32; 2] {
        [1.0, 0.0]
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(Arithmetic::new(0, "+").is_err());
        assert!(Arithmetic::new(2, "/").is_err());
        assert!(Arithmetic::new(2, "").is_err());
    }
}
