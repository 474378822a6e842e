//! Reading HF config.json files, and the errors for configs and batches the decoder
//! cannot use.

use candle_core::Device;
use hilore_models::{DecoderConfig, ModelError, TokenBatch};
use std::path::PathBuf;

fn write(name: &str, json: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hilore-models-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, json).unwrap();
    p
}

/// The fields of a Llama-family config.json as the Hub writes them (TinyLlama-1.1B's
/// shape), including fields the decoder ignores.
const LLAMA: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0",
  "use_cache": true,
  "vocab_size": 32000
}"#;

/// A Qwen2-family config.json (Qwen2.5-0.5B's shape): no `attention_bias` field, yet its
/// q/k/v projections have biases.
const QWEN2: &str = r#"{
  "architectures": ["Qwen2ForCausalLM"],
  "hidden_act": "silu",
  "hidden_size": 896,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 24,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

#[test]
fn reads_llama_and_qwen2_configs() {
    let c = DecoderConfig::from_json_file(write("llama.json", LLAMA)).unwrap();
    assert_eq!(
        (c.hidden_size, c.num_hidden_layers, c.vocab_size),
        (2048, 22, 32000)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (32, 4, 64)
    );
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(!c.attention_bias && !c.tie_word_embeddings);
    assert_eq!(c.model_type.as_deref(), Some("llama"));

    let q = DecoderConfig::from_json_file(write("qwen2.json", QWEN2)).unwrap();
    assert!(q.attention_bias, "qwen2 implies q/k/v bias");
    assert!(q.tie_word_embeddings);
    assert_eq!(
        (q.head_dim, q.rope_theta, q.max_position_embeddings),
        (64, 1e6, 32768)
    );

    // Defaults for everything optional.
    let m = DecoderConfig::from_json_file(write(
        "minimal.json",
        r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}"#,
    ))
    .unwrap();
    assert_eq!(m.num_key_value_heads, 2);
    assert_eq!(m.head_dim, 4);
    assert_eq!((m.rms_norm_eps, m.rope_theta), (1e-6, 10000.0));
    assert_eq!(m.max_position_embeddings, 4096);
    assert!(!m.attention_bias && !m.tie_word_embeddings && m.model_type.is_none());

    // What serializes reads back to the same config.
    let json = serde_json::to_string(&q).unwrap();
    assert_eq!(serde_json::from_str::<DecoderConfig>(&json).unwrap(), q);
    DecoderConfig::tiny().validate().unwrap();
}

fn err(name: &str, json: &str) -> String {
    let p = write(name, json);
    let e = DecoderConfig::from_json_file(&p).unwrap_err().to_string();
    assert!(
        e.contains(&p.display().to_string()),
        "error does not name the file: {e}"
    );
    println!("{e}");
    e
}

#[test]
fn config_errors_name_the_file_the_field_and_the_fix() {
    let base =
        r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1"#;
    let e = err("missing.json", &format!("{{{base}}}"));
    assert!(e.contains("num_attention_heads"), "{e}");

    let e = err(
        "type.json",
        &format!(r#"{{{base}, "num_attention_heads": "four"}}"#),
    );
    assert!(e.contains("line 1 column"), "{e}");

    let e = err(
        "gqa.json",
        &format!(r#"{{{base}, "num_attention_heads": 4, "num_key_value_heads": 3}}"#),
    );
    assert!(
        e.contains("`num_key_value_heads`") && e.contains("does not divide"),
        "{e}"
    );

    let e = err(
        "odd.json",
        &format!(r#"{{{base}, "num_attention_heads": 2, "head_dim": 5}}"#),
    );
    assert!(e.contains("`head_dim`") && e.contains("even"), "{e}");

    let e = err(
        "zero.json",
        r#"{"vocab_size": 0, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}"#,
    );
    assert!(e.contains("`vocab_size`") && e.contains("is 0"), "{e}");

    let e = err(
        "type2.json",
        &format!(r#"{{{base}, "num_attention_heads": 2, "model_type": "gpt2"}}"#),
    );
    assert!(
        e.contains("`model_type`") && e.contains("llama, qwen2, qwen3, mistral"),
        "{e}"
    );

    let e = err(
        "scaling.json",
        &format!(
            r#"{{{base}, "num_attention_heads": 2, "rope_scaling": {{"rope_type": "llama3", "factor": 8.0}}}}"#
        ),
    );
    assert!(e.contains("`rope_scaling`"), "{e}");

    let e = err(
        "act.json",
        &format!(r#"{{{base}, "num_attention_heads": 2, "hidden_act": "gelu"}}"#),
    );
    assert!(e.contains("`hidden_act`") && e.contains("silu"), "{e}");

    let e = err(
        "eps.json",
        &format!(r#"{{{base}, "num_attention_heads": 2, "rms_norm_eps": -1.0}}"#),
    );
    assert!(e.contains("`rms_norm_eps`"), "{e}");

    // Another family's architecture under this model_type: refused, naming both.
    let e = err(
        "family.json",
        &format!(
            r#"{{{base}, "num_attention_heads": 2, "model_type": "llama", "architectures": ["Qwen2ForCausalLM"]}}"#
        ),
    );
    assert!(
        e.contains("`architectures`") && e.contains("Qwen2ForCausalLM") && e.contains("`llama`"),
        "{e}"
    );
    // A rope_type that is not a name is not silently the default.
    let e = err(
        "ropetype.json",
        &format!(r#"{{{base}, "num_attention_heads": 2, "rope_scaling": {{"rope_type": 7}}}}"#),
    );
    assert!(e.contains("`rope_scaling`") && e.contains("7"), "{e}");
    // Sizes beyond the machine: an error before anything is allocated (a billion layers).
    let e = err(
        "huge.json",
        r#"{"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1000000000, "num_attention_heads": 2}"#,
    );
    assert!(
        e.contains("`num_hidden_layers`") && e.contains("GiB of memory"),
        "{e}"
    );

    let missing = std::env::temp_dir().join("hilore-models-no-such-dir/config.json");
    let e = DecoderConfig::from_json_file(&missing).unwrap_err();
    assert!(matches!(e, ModelError::ConfigIo { .. }));
    assert!(e.to_string().contains("no-such-dir"));
}

#[test]
fn batch_errors_name_the_sequence() {
    let cfg = DecoderConfig::tiny();
    let dev = Device::Cpu;
    let b = TokenBatch::from_sequences(&[vec![1, 2, 3], vec![4, 5]], &cfg, &dev).unwrap();
    assert_eq!(b.num_tokens(), 3);
    assert_eq!(b.lengths(), vec![2, 1]);
    assert_eq!(b.inputs.to_vec1::<u32>().unwrap(), vec![1, 2, 4]);
    assert_eq!(b.targets.to_vec1::<u32>().unwrap(), vec![2, 3, 5]);

    let e = TokenBatch::from_sequences(&[vec![1, 2], vec![7]], &cfg, &dev)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence 1") && e.contains("at least 2"), "{e}");
    let e = TokenBatch::from_sequences(&[vec![1, 2], vec![3, 4, 256]], &cfg, &dev)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence 1, token 2") && e.contains("256"),
        "{e}"
    );
    let e = TokenBatch::from_sequences(&[], &cfg, &dev)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no sequences"), "{e}");
    let short = DecoderConfig {
        max_position_embeddings: 4,
        ..cfg.clone()
    };
    let e = TokenBatch::from_sequences(&[vec![1; 6]], &short, &dev)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence 0") && e.contains("max_position_embeddings"),
        "{e}"
    );

    // The same seed gives the same batch.
    let a = TokenBatch::random(&[9, 5], &cfg, 3, &dev).unwrap();
    let c = TokenBatch::random(&[9, 5], &cfg, 3, &dev).unwrap();
    assert_eq!(
        a.inputs.to_vec1::<u32>().unwrap(),
        c.inputs.to_vec1::<u32>().unwrap()
    );
    assert_eq!(a.num_tokens(), 12);
}

#[test]
fn param_count_is_the_decoders() {
    let base = DecoderConfig::tiny();
    let qwen2 = DecoderConfig {
        model_type: Some("qwen2".into()),
        attention_bias: true,
        ..base.clone()
    };
    let qwen3 = DecoderConfig {
        model_type: Some("qwen3".into()),
        ..base.clone()
    };
    let llama_bias = DecoderConfig {
        attention_bias: true,
        ..base.clone()
    };
    let tied = DecoderConfig {
        tie_word_embeddings: true,
        ..DecoderConfig::bench()
    };
    for cfg in [base, DecoderConfig::bench(), qwen2, qwen3, llama_bias, tied] {
        let model = hilore_models::Decoder::random(&cfg, 1, &Device::Cpu).unwrap();
        assert_eq!(cfg.param_count(), model.num_params() as u128, "{cfg:?}");
    }
}

#[test]
fn a_byte_order_mark_is_accepted() {
    let json = r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}"#;
    let plain = DecoderConfig::from_json_file(write("plain.json", json)).unwrap();
    let bom = DecoderConfig::from_json_file(write("bom.json", &format!("\u{feff}{json}"))).unwrap();
    assert_eq!(plain, bom);
}
