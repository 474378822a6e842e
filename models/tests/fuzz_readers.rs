//! Fuzzing the model-directory readers: a valid directory (config.json, model.safetensors,
//! tokenizer.json) with one file damaged at random (bytes flipped, cut short, spliced,
//! replaced by random text). Loading must return a model or an error naming the file:
//! no panic, no abort, no allocation the file cannot back.

use candle_core::Device;
use hilore_models::{zoo, Decoder, DecoderConfig};
use proptest::prelude::*;
use std::path::PathBuf;

fn valid_dir() -> (PathBuf, [Vec<u8>; 3]) {
    let dir = std::env::temp_dir().join(format!("hilore-fuzz-src-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg: DecoderConfig = serde_json::from_value(serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 10,
        "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "max_position_embeddings": 16, "tie_word_embeddings": false,
    }))
    .unwrap();
    let m = Decoder::random(&cfg, 1, &Device::Cpu).unwrap();
    zoo::export(&m, &cfg, &dir).unwrap();
    let tok = r#"{"version": "1.0", "added_tokens": [{"id": 1, "content": "<s>", "special": true}], "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<s>": 1, "a": 2, "b": 3}, "unk_token": "<unk>"}, "pre_tokenizer": {"type": "Whitespace"}}"#;
    std::fs::write(dir.join("tokenizer.json"), tok).unwrap();
    let read = |f: &str| std::fs::read(dir.join(f)).unwrap();
    let files = [
        read("config.json"),
        read("model.safetensors"),
        read("tokenizer.json"),
    ];
    (dir, files)
}

const NAMES: [&str; 3] = ["config.json", "model.safetensors", "tokenizer.json"];

/// One damage to a file's bytes.
#[derive(Debug, Clone)]
enum Damage {
    Flip(usize, u8),
    Cut(usize),
    Splice(usize, Vec<u8>),
    Replace(Vec<u8>),
    /// The safetensors header length (its first 8 bytes) set to this.
    HeaderLen(u64),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Damage::Flip(i, x)),
        any::<usize>().prop_map(Damage::Cut),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(i, b)| Damage::Splice(i, b)),
        prop::collection::vec(any::<u8>(), 0..256).prop_map(Damage::Replace),
        prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40), 0u64..4096]
            .prop_map(Damage::HeaderLen),
    ]
}

fn apply(bytes: &[u8], d: &Damage) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match d {
        Damage::Flip(i, x) => {
            let i = i % b.len();
            b[i] ^= x;
        }
        Damage::Cut(i) => b.truncate(i % b.len()),
        Damage::Splice(i, s) => {
            let i = i % b.len();
            b.splice(i..i, s.iter().copied());
        }
        Damage::Replace(r) => b = r.clone(),
        Damage::HeaderLen(n) => {
            if b.len() >= 8 {
                b[..8].copy_from_slice(&n.to_le_bytes());
            }
        }
    }
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]

    #[test]
    fn a_damaged_model_directory_loads_or_is_an_error_naming_the_file(
        which in 0usize..3,
        d in damage(),
        case in any::<u32>(),
    ) {
        let (src, files) = valid_dir();
        let dir = std::env::temp_dir()
            .join(format!("hilore-fuzz-{}-{case}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (k, name) in NAMES.iter().enumerate() {
            let bytes = if k == which { apply(&files[k], &d) } else { files[k].clone() };
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        match zoo::load(&dir, &Device::Cpu) {
            Ok(_) => {}
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains(&dir.display().to_string()), "no path named: {msg}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&src);
    }
}
