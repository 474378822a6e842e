//! Fixtures shared by the end-to-end tests of the `hilore` binary: running it, scratch
//! directories, and zoo model directories with random weights and a WordLevel tokenizer.

// Each test crate that declares `mod support;` uses only part of this module.
#![allow(dead_code)]

use candle_core::Device;
use hilore_models::{zoo, Decoder, DecoderConfig};
use serde_json::{json, Value};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs the `hilore` binary with `args`: its exit code (-1 when it has none), stdout and
/// stderr.
pub fn hilore<S: AsRef<OsStr>>(args: &[S]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hilore"))
        .args(args)
        .output()
        .expect("the hilore binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `hilore` with `args`, asserts that it exits 0 and returns its stdout.
pub fn run_ok<S: AsRef<OsStr>>(args: &[S]) -> String {
    let (code, out, err) = hilore(args);
    let line: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
    assert_eq!(
        code,
        0,
        "hilore {}\nstdout:\n{out}\nstderr:\n{err}",
        line.join(" ")
    );
    out
}

/// Runs `hilore` with `args`, asserts that it fails and returns its stderr.
pub fn run_refused<S: AsRef<OsStr>>(args: &[S]) -> String {
    let (code, _, err) = hilore(args);
    assert_ne!(code, 0);
    err
}

/// An empty directory `hilore-{prefix}-{pid}-{name}` under the system temp directory.
pub fn tmpdir(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hilore-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A WordLevel tokenizer.json with the special tokens `added` (id, content) and the
/// vocabulary `vocab`: whitespace pre-tokenizer, `<s>` (id 1) prepended to a single
/// sequence by the post-processor.
pub fn word_level_tokenizer(added: &[(u32, &str)], vocab: Value) -> String {
    let added: Vec<Value> = added
        .iter()
        .map(|&(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "<unk>", "vocab": vocab}
    })
    .to_string()
}

/// Writes a zoo model directory at `dir`: random weights for `cfg` from `seed`, and
/// `tokenizer` as tokenizer.json when given.
pub fn write_model(dir: &Path, cfg: &DecoderConfig, seed: u64, tokenizer: Option<&str>) {
    let m = Decoder::random(cfg, seed, &Device::Cpu).unwrap();
    zoo::export(&m, cfg, dir).unwrap();
    if let Some(t) = tokenizer {
        std::fs::write(dir.join("tokenizer.json"), t).unwrap();
    }
}
