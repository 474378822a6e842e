//! Character and byte tokenizers for the built-in tasks and for JSONL datasets.
//!
//! Ids 0 and 1 are the special tokens BOS (starts every prompt) and EOS (ends every
//! response: the stop token of generation). A character tokenizer maps each character of
//! a fixed alphabet to one id (the built-in tasks use a handful of characters, so the LM
//! head stays small); a byte tokenizer maps each UTF-8 byte to one id (any text, 258 ids).

use anyhow::bail;

/// Beginning of a prompt.
pub const BOS: u32 = 0;
/// End of a response; generation stops after it.
pub const EOS: u32 = 1;
const SPECIALS: u32 = 2;

/// How text becomes token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tokenizer {
    /// One id per character of the alphabet (`2 + index`).
    Chars(Vec<char>),
    /// One id per UTF-8 byte (`2 + byte`).
    Bytes,
}

impl Tokenizer {
    /// A character tokenizer over the distinct characters of `alphabet`, in order.
    pub fn chars(alphabet: &str) -> Self {
        let mut v: Vec<char> = Vec::new();
        for c in alphabet.chars() {
            if !v.contains(&c) {
                v.push(c);
            }
        }
        Tokenizer::Chars(v)
    }

    /// Number of ids, the specials included.
    pub fn vocab_size(&self) -> usize {
        SPECIALS as usize
            + match self {
                Tokenizer::Chars(a) => a.len(),
                Tokenizer::Bytes => 256,
            }
    }

    /// A description that identifies the tokenizer (stored in checkpoints).
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Chars(a) => format!("chars:{}", a.iter().collect::<String>()),
            Tokenizer::Bytes => "bytes".into(),
        }
    }

    /// The ids of `text` (no specials). A character outside a character tokenizer's
    /// alphabet is an error naming it.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(|b| SPECIALS + b as u32).collect()),
            Tokenizer::Chars(a) => text
                .chars()
                .map(|c| match a.iter().position(|&x| x == c) {
                    Some(i) => Ok(SPECIALS + i as u32),
                    None => bail!(
                        "character {c:?} of {text:?} is not in the task's alphabet {:?}",
                        a.iter().collect::<String>()
                    ),
                })
                .collect(),
        }
    }

    /// BOS followed by the ids of `text`.
    pub fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let mut v = vec![BOS];
        v.extend(self.encode(text)?);
        Ok(v)
    }

    /// The text of `ids`, up to (not including) the first EOS; BOS and ids outside the
    /// vocabulary are skipped, invalid UTF-8 is replaced.
    pub fn decode(&self, ids: &[u32]) -> String {
        let body = ids.iter().take_while(|&&t| t != EOS);
        match self {
            Tokenizer::Chars(a) => body
                .filter_map(|&t| t.checked_sub(SPECIALS).and_then(|i| a.get(i as usize)))
                .collect(),
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = body
                    .filter_map(|&t| t.checked_sub(SPECIALS).and_then(|b| u8::try_from(b).ok()))
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
        }
    }
}

/// The tokenizer of a training run: the built-in character/byte tokenizer of a task, or a
/// zoo model's `tokenizer.json` with the config's end-of-sequence token.
///
/// Prompts and responses are encoded separately and concatenated, as GRPO trainers do:
/// a prompt gets the special tokens the tokenizer adds to a sequence (the built-in BOS, or
/// whatever the zoo tokenizer's post-processor adds), a response none; every response
/// ends with the stop token.
#[derive(Debug, Clone)]
pub enum TrainTokenizer {
    Builtin(Tokenizer),
    Zoo {
        tokenizer: Box<hilore_models::Tokenizer>,
        /// The stop token of generation (the first of the config's `eos_token_id`s).
        eos: u32,
        /// Every end-of-sequence id; decoding stops at the first of any of them.
        eos_ids: Vec<u32>,
    },
}

impl TrainTokenizer {
    /// A description that identifies the tokenizer (stored in checkpoints): for a zoo
    /// tokenizer a hash of its `tokenizer.json` text, so a resume with another file is
    /// refused.
    pub fn describe(&self) -> String {
        match self {
            TrainTokenizer::Builtin(t) => t.describe(),
            TrainTokenizer::Zoo {
                tokenizer, eos_ids, ..
            } => {
                // FNV-1a, 64 bits: stable across builds and platforms.
                let mut h: u64 = 0xcbf2_9ce4_8422_2325;
                for b in tokenizer.json().bytes() {
                    h ^= b as u64;
                    h = h.wrapping_mul(0x0100_0000_01b3);
                }
                format!(
                    "tokenizer.json fnv1a64:{h:016x} ({} ids), eos {eos_ids:?}",
                    tokenizer.vocab_size()
                )
            }
        }
    }

    /// The stop token of generation, appended to every warm-start solution.
    pub fn eos(&self) -> u32 {
        match self {
            TrainTokenizer::Builtin(_) => EOS,
            TrainTokenizer::Zoo { eos, .. } => *eos,
        }
    }

    /// The ids of a prompt, with the tokenizer's special tokens (the built-in BOS, or the
    /// zoo tokenizer's post-processor).
    pub fn encode_prompt(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            TrainTokenizer::Builtin(t) => t.encode_prompt(text),
            TrainTokenizer::Zoo { tokenizer, .. } => Ok(tokenizer.encode_prompt(text)?),
        }
    }

    /// The ids of a response (no special tokens, no stop token).
    pub fn encode_completion(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            TrainTokenizer::Builtin(t) => t.encode(text),
            TrainTokenizer::Zoo { tokenizer, .. } => Ok(tokenizer.encode_completion(text)?),
        }
    }

    /// The text of a response's ids, up to (not including) the first end-of-sequence id;
    /// special tokens are skipped.
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match self {
            TrainTokenizer::Builtin(t) => Ok(t.decode(ids)),
            TrainTokenizer::Zoo {
                tokenizer, eos_ids, ..
            } => {
                let end = ids
                    .iter()
                    .position(|t| eos_ids.contains(t))
                    .unwrap_or(ids.len());
                Ok(tokenizer.decode(&ids[..end], true)?)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chars_round_trip_and_reject_unknown() {
        let t = Tokenizer::chars("0123456789+=");
        assert_eq!(t.vocab_size(), 14);
        let ids = t.encode_prompt("12+7=").unwrap();
        assert_eq!(ids[0], BOS);
        assert_eq!(t.decode(&ids), "12+7=");
        let mut with_eos = t.encode("19").unwrap();
        with_eos.push(EOS);
        with_eos.extend(t.encode("55").unwrap());
        assert_eq!(t.decode(&with_eos), "19");
        let err = t.encode("1x").unwrap_err().to_string();
        assert!(err.contains("'x'"), "{err}");
    }

    #[test]
    fn bytes_round_trip_any_text() {
        let t = Tokenizer::Bytes;
        assert_eq!(t.vocab_size(), 258);
        let s = "Natalia sold 48/2 = 24 clips. #### 72 — ok";
        assert_eq!(t.decode(&t.encode(s).unwrap()), s);
        // Out-of-vocabulary ids are skipped, never a panic.
        assert_eq!(t.decode(&[1000, 2 + b'a' as u32]), "a");
    }
}
