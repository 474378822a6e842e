//! User datasets in JSONL, `{"prompt": ..., "answer": ...}` per line, with a GSM8K-style
//! final-answer reward.

use super::{Example, Reward};
use anyhow::{bail, Context};
use hilore_models::rng::SplitMix64;
use std::path::{Path, PathBuf};

/// A JSONL dataset split into training and held-out examples.
#[derive(Debug, Clone)]
pub struct Jsonl {
    path: PathBuf,
    train: Vec<Example>,
    heldout: Vec<Example>,
}

/// The final answer of a GSM8K-style text: the first number after the last `####` when
/// there is one, else the last number in the text; commas, a leading `$` and a trailing
/// `.` are dropped. `None` when there is no number.
pub fn final_answer(text: &str) -> Option<String> {
    let (tail, first) = match text.rfind("####") {
        Some(i) => (&text[i + 4..], true),
        None => (text, false),
    };
    let numbers = numbers_in(tail);
    let n = if first {
        numbers.first()
    } else {
        numbers.last()
    }?;
    Some(n.clone())
}

/// Every number `-?[0-9][0-9,]*(.[0-9]+)?` in `s`, commas removed.
fn numbers_in(s: &str) -> Vec<String> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let neg = i > 0 && b[i - 1] == b'-';
            let mut j = i;
            while j < b.len()
                && (b[j].is_ascii_digit()
                    || (b[j] == b',' && j + 1 < b.len() && b[j + 1].is_ascii_digit()))
            {
                j += 1;
            }
            if j + 1 < b.len() && b[j] == b'.' && b[j + 1].is_ascii_digit() {
                j += 1;
                while j < b.len() && b[j].is_ascii_digit() {
                    j += 1;
                }
            }
            let mut n: String = s[i..j].chars().filter(|&c| c != ',').collect();
            if neg {
                n.insert(0, '-');
            }
            out.push(n);
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Whether two extracted answers are the same number (exactly for integers; to a relative
/// 1e-9 for decimals, which absorbs `0.50` vs `0.5`).
fn same_number(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => (x - y).abs() <= 1e-9 * y.abs().max(1.0),
        _ => false,
    }
}

#[derive(serde::Deserialize)]
struct Line {
    prompt: serde_json::Value,
    answer: serde_json::Value,
}

/// Reads every example of a JSONL file; errors name the file and the line.
fn read_examples(path: &Path) -> anyhow::Result<Vec<Example>> {
    let text = hilore_models::read_text_file(path)
        .with_context(|| format!("cannot read dataset {}", path.display()))?;
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let at = || format!("{}:{n}", path.display());
        if raw.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(raw).map_err(|e| {
            anyhow::anyhow!(
                "{}: not a JSON object with string fields \"prompt\" and \"answer\": {e}",
                at()
            )
        })?;
        let field = |name: &str, v: serde_json::Value| -> anyhow::Result<String> {
            match v {
                serde_json::Value::String(s) => Ok(s),
                serde_json::Value::Number(x) if name == "answer" => Ok(x.to_string()),
                other => bail!("{}: field \"{name}\" must be a string, found {other}", at()),
            }
        };
        let prompt = field("prompt", line.prompt)?;
        let answer = field("answer", line.answer)?;
        let Some(final_ans) = final_answer(&answer) else {
            bail!(
                "{}: answer {answer:?} has no final number; write it GSM8K style (`... #### 42`) or end it with the number",
                at()
            );
        };
        out.push(Example {
            prompt,
            solution: answer,
            answer: final_ans,
        });
    }
    if out.is_empty() {
        bail!(
            "dataset {} has no examples; expected one {{\"prompt\": ..., \"answer\": ...}} object per line",
            path.display()
        );
    }
    Ok(out)
}

impl Jsonl {
    /// Loads `data`; the held-out examples are those of `heldout_data`, or else the last
    /// `heldout` lines of `data` (which must leave at least one training example).
    pub fn load(data: &Path, heldout_data: Option<&Path>, heldout: usize) -> anyhow::Result<Self> {
        let mut train = read_examples(data)?;
        let heldout = match heldout_data {
            Some(h) => read_examples(h)?,
            None => {
                if heldout >= train.len() {
                    bail!(
                        "dataset {} has {} examples, not enough to hold out {heldout} and train on the rest; lower --heldout or pass --heldout-data FILE",
                        data.display(),
                        train.len()
                    );
                }
                train.split_off(train.len() - heldout)
            }
        };
        Ok(Jsonl {
            path: data.to_path_buf(),
            train,
            heldout,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "jsonl {} ({} train, {} held out)",
            self.path.display(),
            self.train.len(),
            self.heldout.len()
        )
    }

    pub fn sample(&self, rng: &mut SplitMix64) -> Example {
        self.train[rng.below(self.train.len() as u64) as usize].clone()
    }

    pub fn heldout(&self) -> &[Example] {
        &self.heldout
    }

    /// Every example, training and held out.
    pub fn examples(&self) -> impl Iterator<Item = &Example> {
        self.train.iter().chain(&self.heldout)
    }

    /// 1 when the response's final answer equals the reference's, else 0 (no final
    /// number: 0).
    pub fn reward(&self, ex: &Example, response: &str) -> Reward {
        match final_answer(response) {
            Some(got) if same_number(&got, &ex.answer) => Reward::CORRECT,
            Some(_) => Reward {
                well_formed: true,
                ..Reward::ZERO
            },
            None => Reward::ZERO,
        }
    }

    pub fn max_prompt_chars(&self) -> usize {
        self.train
            .iter()
            .chain(&self.heldout)
            .map(|e| e.prompt.len())
            .max()
            .unwrap_or(0)
    }

    pub fn max_solution_chars(&self) -> usize {
        self.train
            .iter()
            .chain(&self.heldout)
            .map(|e| e.solution.len())
            .max()
            .unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gsm8k_final_answers() {
        assert_eq!(
            final_answer("so 48/2 = 24.\n#### 72").as_deref(),
            Some("72")
        );
        assert_eq!(final_answer("#### 1,234").as_deref(), Some("1234"));
        assert_eq!(
            final_answer("The answer is $-3.50.").as_deref(),
            Some("-3.50")
        );
        assert_eq!(final_answer("12 then 7 then 9").as_deref(), Some("9"));
        assert_eq!(final_answer("#### 5 not 6").as_deref(), Some("5"));
        assert_eq!(final_answer("no number here"), None);
        assert_eq!(final_answer("####"), None);
        assert_eq!(final_answer(""), None);
        assert!(same_number("-3.50", "-3.5"));
        assert!(!same_number("72", "27"));
    }

    #[test]
    fn malformed_responses_score_zero() {
        let ds = Jsonl {
            path: "x".into(),
            train: vec![],
            heldout: vec![],
        };
        let ex = Example {
            prompt: "q".into(),
            solution: "#### 72".into(),
            answer: "72".into(),
        };
        for bad in [
            "",
            "####",
            "seventy-two",
            "\u{fffd}\u{fffd}",
            "#### 27",
            "72 no 71",
        ] {
            let r = ds.reward(&ex, bad);
            assert_eq!((r.value, r.correct), (0.0, false), "{bad:?}");
            // A final number, wrong, is well formed; none is not.
            let has_number = bad.chars().any(|c| c.is_ascii_digit());
            assert_eq!(r.well_formed, has_number, "{bad:?}");
        }
        for good in ["#### 72", "it is 72", "72.0", "#### 72 apples"] {
            assert_eq!(ds.reward(&ex, good), Reward::CORRECT, "{good:?}");
        }
    }

    use proptest::prelude::*;

    /// Pieces JSONL lines are made of, valid and not.
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("{\"prompt\": \"1+1=\", \"answer\": \"#### 2\"}".to_string()),
            Just("{\"prompt\": 3, \"answer\": 4}".to_string()),
            Just("{\"prompt\": \"q\"}".to_string()),
            Just("\u{feff}".to_string()),
            Just("\n".to_string()),
            Just("\r\n".to_string()),
            Just("####".to_string()),
            Just("{".to_string()),
            "[ -~]{0,12}",
            any::<String>(),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Any text as a dataset: examples or an error naming the file, never a panic;
        /// every example has a final answer that its solution gives.
        #[test]
        fn any_dataset_text_reads_or_is_an_error_naming_the_file(
            parts in prop::collection::vec(piece(), 0..12),
            case in any::<u32>(),
        ) {
            let dir = std::env::temp_dir()
                .join(format!("hilore-jsonl-fuzz-{}-{case}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("d.jsonl");
            std::fs::write(&path, parts.concat()).unwrap();
            match read_examples(&path) {
                Ok(ex) => {
                    for e in ex {
                        prop_assert_eq!(final_answer(&e.solution), Some(e.answer));
                    }
                }
                Err(e) => {
                    let msg = format!("{e:#}");
                    prop_assert!(msg.contains("d.jsonl"), "no path named: {}", msg);
                }
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
