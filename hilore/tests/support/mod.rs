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

/// Every regular file directly in `dir`: name and bytes, sorted by name (to tell that a
/// command changed nothing).
pub fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

/// The size of file `name` in a [`files_of`] listing.
pub fn size_in(files: &[(String, Vec<u8>)], name: &str) -> usize {
    files
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, b)| b.len())
        .unwrap_or_else(|| panic!("no {name} in the listing"))
}

/// Runs `hilore args` with every file it writes limited to `max_bytes` (rounded down to
/// `ulimit -f`'s 512-byte blocks) and SIGXFSZ ignored, so a write past the limit fails
/// with EFBIG as on a full disk: its exit code (-1 when it has none) and stderr.
pub fn hilore_with_file_limit<S: AsRef<OsStr>>(max_bytes: usize, args: &[S]) -> (i32, String) {
    let blocks = max_bytes / 512;
    assert!(
        blocks > 0,
        "a limit of {max_bytes} bytes is below one block"
    );
    let script = format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\"");
    let o = Command::new("sh")
        .args(["-c", &script, env!("CARGO_BIN_EXE_hilore")])
        .args(args)
        .output()
        .expect("sh runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A `hilore train` command line writing its checkpoint, metrics and summary into `dir`
/// (`run.ckpt`, `metrics.jsonl`, `summary.json`): the flags `defaults` except those that
/// `extra` gives, then `extra`.
pub fn train_args(defaults: &[(&str, &str)], dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec!["train".into(), "--no-progress".into()];
    for (flag, value) in defaults {
        if !extra.contains(flag) {
            v.push(flag.to_string());
            v.push(value.to_string());
        }
    }
    for (flag, file) in [
        ("--checkpoint", "run.ckpt"),
        ("--metrics", "metrics.jsonl"),
        ("--summary", "summary.json"),
    ] {
        v.push(flag.into());
        v.push(dir.join(file).display().to_string());
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}
