//! A corpus of bad inputs and faults against the `hilore` binary: bad flags, configs,
//! model directories, tokenizers, JSONL files, checkpoints, special files and absurd
//! sizes. Every case must exit 2 (no panic, no abort, no hang), with a message that names
//! the flag, file or field and says what to do, and must change no file.

mod support;

use candle_core::Device;
use hilore_models::{zoo, DecoderConfig};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use support::run_ok;

/// Every entry under `dir` (recursively): relative path, kind, and a regular file's bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            let rel = e.path().strip_prefix(dir).unwrap().to_path_buf();
            if t.is_dir() {
                stack.push(e.path());
                out.push((rel, "dir".into(), Vec::new()));
            } else if t.is_file() {
                out.push((rel, "file".into(), std::fs::read(e.path()).unwrap()));
            } else {
                out.push((rel, format!("{t:?}"), Vec::new()));
            }
        }
    }
    out.sort();
    out
}

fn tokenizer_json() -> String {
    support::word_level_tokenizer(
        &[(1, "<s>"), (8, "</s>")],
        json!({"<unk>": 0, "<s>": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6, "a": 7, "</s>": 8}),
    )
}

fn qwen3() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 12,
        "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "max_position_embeddings": 32, "tie_word_embeddings": true, "rope_theta": 1e6,
    })
}

/// A config file `name` in `w`: the Qwen3 test config with `patch` applied (a `null`
/// value removes the field).
fn config(w: &Path, name: &str, patch: Value) -> String {
    let mut v = qwen3();
    for (k, x) in patch.as_object().unwrap() {
        if x.is_null() {
            v.as_object_mut().unwrap().remove(k);
        } else {
            v[k] = x.clone();
        }
    }
    let p = w.join(name);
    std::fs::write(&p, v.to_string()).unwrap();
    p.display().to_string()
}

/// Copies the model directory `from` to `w/name` and returns it.
fn copy_model(from: &Path, w: &Path, name: &str) -> PathBuf {
    let d = w.join(name);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// Overwrites the first value of tensor `name` in the safetensors file `path` with `x`.
fn poke_tensor(path: &Path, name: &str, x: f32) {
    let mut b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let off = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    assert_eq!(h[name]["dtype"], "F32");
    b[8 + n + off..8 + n + off + 4].copy_from_slice(&x.to_le_bytes());
    std::fs::write(path, b).unwrap();
}

/// A tiny `hilore train` command line writing into `w`; flags in `extra` replace the
/// defaults of the same name.
fn train(w: &Path, extra: &[&str]) -> Vec<String> {
    let defaults = [
        ("--layers", "1"),
        ("--hidden", "16"),
        ("--heads", "2"),
        ("--kv-heads", "1"),
        ("--intermediate", "32"),
        ("--sft-steps", "5"),
        ("--sft-batch", "8"),
        ("--prompts", "2"),
        ("--group-size", "2"),
        ("--heldout", "4"),
        ("--eval-samples", "1"),
        ("--steps", "1"),
        ("--policy", "recompute"),
        ("--seed", "3"),
    ];
    support::train_args(&defaults, w, extra)
}

/// Runs `hilore args` for at most 60 seconds (a hang is a failure, not a stuck suite):
/// its exit code (-1 when killed) and stderr. Output goes to files in `logs`.
fn bounded(args: &[String], logs: &Path) -> (i32, String) {
    let err_path = logs.join("stderr");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hilore"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(logs.join("stdout")).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code().unwrap_or(-1);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break -1;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    (code, std::fs::read_to_string(&err_path).unwrap_or_default())
}

struct Case {
    args: Vec<String>,
    /// Every one of these must be in the message.
    want: Vec<String>,
}

fn case(args: &[&str], want: &[&str]) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        want: want.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn every_bad_input_is_a_clear_error_that_changes_nothing() {
    let w = support::tmpdir("corpus", "work");
    let s = |p: &Path| p.display().to_string();

    // Fixtures: a model directory, a run's files, damaged copies, special files.
    let model = w.join("model");
    let cfg: DecoderConfig = serde_json::from_value(qwen3()).unwrap();
    support::write_model(&model, &cfg, 3, Some(&tokenizer_json()));
    let input = w.join("input.jsonl");
    std::fs::write(
        &input,
        "{\"prompt\": \"the cat\", \"completion\": \"sat on\"}\n",
    )
    .unwrap();
    let run_dir = w.join("run");
    std::fs::create_dir_all(&run_dir).unwrap();
    run_ok(&train(&run_dir, &[]));
    let ckpt = std::fs::read(run_dir.join("run.ckpt")).unwrap();
    let hlen = u64::from_le_bytes(ckpt[16..24].try_into().unwrap()) as usize;
    let damaged = |name: &str, bytes: Vec<u8>| {
        let d = w.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("run.ckpt"), bytes).unwrap();
        d
    };
    let mut flipped = ckpt.clone();
    flipped[28 + hlen + 40] ^= 0x04;
    let ck_flipped = damaged("ck-flipped", flipped);
    let mut hflip = ckpt.clone();
    hflip[28 + hlen / 2] ^= 0x01;
    let ck_header = damaged("ck-header", hflip);
    let ck_trunc = damaged("ck-trunc", ckpt[..ckpt.len() - 100].to_vec());
    let mut huge: Value = serde_json::from_slice(&ckpt[28..28 + hlen]).unwrap();
    huge["tensors"][0]["shape"] = json!([1u64 << 40]);
    let hb = serde_json::to_vec(&huge).unwrap();
    let mut hb_file = ckpt[..16].to_vec();
    hb_file.extend_from_slice(&(hb.len() as u64).to_le_bytes());
    hb_file.extend_from_slice(&crc32fast::hash(&hb).to_le_bytes());
    hb_file.extend_from_slice(&hb);
    hb_file.extend_from_slice(&ckpt[28 + hlen..]);
    let ck_huge = damaged("ck-huge", hb_file);
    let ck_junk = damaged("ck-junk", b"not a checkpoint at all".to_vec());
    let nan_model = copy_model(&model, &w, "nan-model");
    poke_tensor(
        &nan_model.join("model.safetensors"),
        "model.layers.0.mlp.up_proj.weight",
        f32::NAN,
    );
    let inf_model = copy_model(&model, &w, "inf-model");
    poke_tensor(
        &inf_model.join("model.safetensors"),
        "model.embed_tokens.weight",
        f32::INFINITY,
    );
    let arch_model = copy_model(&model, &w, "arch-model");
    let mut c = qwen3();
    c["architectures"] = json!(["LlamaForCausalLM"]);
    std::fs::write(arch_model.join("config.json"), c.to_string()).unwrap();
    let trunc_model = copy_model(&model, &w, "trunc-model");
    let st = std::fs::read(trunc_model.join("model.safetensors")).unwrap();
    std::fs::write(trunc_model.join("model.safetensors"), &st[..st.len() / 2]).unwrap();
    let dup_model = copy_model(&model, &w, "dup-model");
    {
        let st = std::fs::read(dup_model.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&st[8..8 + n]).unwrap();
        let dup = format!(
            "{{\"model.norm.weight\":{{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}},{}",
            &header[1..]
        );
        let mut b = (dup.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(dup.as_bytes());
        b.extend_from_slice(&st[8 + n..]);
        std::fs::write(dup_model.join("model.safetensors"), b).unwrap();
    }
    let notok_model = copy_model(&model, &w, "notok-model");
    std::fs::remove_file(notok_model.join("tokenizer.json")).unwrap();
    let badtok_model = copy_model(&model, &w, "badtok-model");
    std::fs::write(badtok_model.join("tokenizer.json"), "{\"model\": 7}").unwrap();
    let fifo = w.join("fifo");
    assert!(std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let fifo_model = copy_model(&model, &w, "fifo-model");
    std::fs::remove_file(fifo_model.join("model.safetensors")).unwrap();
    assert!(std::process::Command::new("mkfifo")
        .arg(fifo_model.join("model.safetensors"))
        .status()
        .unwrap()
        .success());
    let outside = w.join("outside.safetensors");
    std::fs::copy(model.join("model.safetensors"), &outside).unwrap();
    let link_model = copy_model(&model, &w, "link-model");
    std::fs::remove_file(link_model.join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink(&outside, link_model.join("model.safetensors")).unwrap();
    let bad_jsonl = w.join("bad.jsonl");
    std::fs::write(
        &bad_jsonl,
        "{\"prompt\": \"the\", \"completion\": \"cat\"}\n{\"prompt\": \"a\"}\n",
    )
    .unwrap();
    let data_bad = w.join("data-bad.jsonl");
    std::fs::write(
        &data_bad,
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": 3}\n",
    )
    .unwrap();

    let (m, inp, rd) = (s(&model), s(&input), s(&run_dir));
    let mut cases: Vec<Case> = Vec::new();

    // Numeric flags: negative numbers are values, every value is range-checked.
    for (flag, v, range) in [
        ("--lr", "-1", "> 0"),
        ("--lr", "nan", "> 0"),
        ("--sft-lr", "0", "> 0"),
        ("--sft-target-loss", "-1", ">= 0"),
        ("--epsilon", "1.5", "[0, 1)"),
        ("--epsilon-high", "-0.1", ">= 0"),
        ("--beta", "-1", ">= 0"),
        ("--temperature", "0", "> 0"),
        ("--temperature", "-1", "> 0"),
        ("--top-p", "0", "(0, 1]"),
        ("--top-p", "1.5", "(0, 1]"),
        ("--max-grad-norm", "nan", ">= 0"),
        ("--max-grad-norm", "-1", ">= 0"),
        ("--weight-decay", "-1", ">= 0"),
        ("--weight-decay", "inf", ">= 0"),
    ] {
        let mut a = train(&w, &[flag, v]);
        a.push("--force".into());
        cases.push(Case {
            args: a,
            want: vec![flag.into(), range.into()],
        });
    }
    for (flag, fix) in [
        ("--eval-samples", "at least 1"),
        ("--prompts", "at least 1"),
        ("--group-size", "at least 1"),
        ("--sft-batch", "at least 1"),
        ("--heldout", "raise --heldout"),
        ("--checkpoint-every", "at least 1"),
        ("--max-new-tokens", "at least one token"),
    ] {
        let mut a = train(&w, &[flag, "0"]);
        a.push("--force".into());
        cases.push(Case {
            args: a,
            want: vec![flag.into(), fix.into()],
        });
    }
    let t = |extra: &[&str], want: &[&str]| {
        let mut a = train(&w, extra);
        a.push("--force".into());
        Case {
            args: a,
            want: want.iter().map(|s| s.to_string()).collect(),
        }
    };
    cases.push(t(&["--task", "sudoku"], &["sudoku", "arithmetic"]));
    cases.push(t(&["--delta", "1.1"], &["--delta", "--epsilon-high"]));
    cases.push(t(&["--task", "jsonl"], &["--data"]));
    cases.push(t(
        &["--loss-type", "sum"],
        &["--loss-type", "dapo", "dr_grpo"],
    ));
    cases.push(t(&["--policy", "compress-fp3"], &["fp3"]));
    // TRL's batch layout, reward weights, ratio level and config file.
    cases.push(t(
        &["--gradient-accumulation-steps", "0"],
        &["gradient_accumulation_steps is 0", "at least 1"],
    ));
    cases.push(t(
        &[
            "--gradient-accumulation-steps",
            "2",
            "--steps-per-generation",
            "3",
        ],
        &[
            "--steps-per-generation",
            "multiple of gradient_accumulation_steps",
        ],
    ));
    cases.push(t(
        &["--steps-per-generation", "3"],
        &["steps_per_generation = 3", "multiple of 3"],
    ));
    cases.push(t(
        &["--reward-weights", "1"],
        &["--reward-weights", "correct and format"],
    ));
    cases.push(t(
        &["--importance-sampling-level", "group"],
        &["--importance-sampling-level", "token", "sequence"],
    ));
    cases.push(t(
        &["--loss-type", "sapo", "--delta", "2"],
        &["delta", "clipped losses"],
    ));
    cases.push(t(
        &["--grpo-config", "/nonexistent/grpo.yaml"],
        &["/nonexistent/grpo.yaml"],
    ));
    cases.push(t(
        &["--refresh-costs"],
        &["--refresh-costs", "--policy hilore"],
    ));
    cases.push(t(
        &["--hidden", "30", "--heads", "4"],
        &["--hidden", "--heads"],
    ));
    cases.push(t(
        &["--prompts", "100000000"],
        &["--prompts", "GiB", "fewer --prompts"],
    ));
    cases.push(t(
        &["--layers", "10000000"],
        &["--layers", "GiB", "parameters"],
    ));
    cases.push(t(
        &["--task", "jsonl", "--data", &s(&data_bad)],
        &[&format!("{}:2", s(&data_bad))],
    ));
    cases.push(t(
        &["--task", "jsonl", "--data", &s(&fifo)],
        &[&s(&fifo), "regular file"],
    ));
    // An earlier run's files, --resume and --force.
    cases.push(case(
        &train(&run_dir, &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &[&format!("{rd}/run.ckpt"), "--resume", "--force"],
    ));
    cases.push(case(
        &train(&run_dir, &["--resume", "--force"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &["--resume", "--force"],
    ));
    cases.push(case(
        &train(&w, &["--resume"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        &[&format!("{}/run.ckpt", s(&w))],
    ));
    // Damaged checkpoints, on --resume: each names the file (and the tensor).
    for (d, want) in [
        (&ck_flipped, "does not match its checksum"),
        (&ck_header, "corrupt"),
        (&ck_trunc, "truncated"),
        (&ck_huge, "1099511627776"),
        (&ck_junk, "not a hilore training checkpoint"),
    ] {
        let a = train(d, &["--resume"]);
        cases.push(Case {
            args: a,
            want: vec![format!("{}/run.ckpt", s(d)), want.into()],
        });
    }
    let mut a = train(&w, &["--resume"]);
    let i = a.iter().position(|x| x == "--checkpoint").unwrap();
    a[i + 1] = s(&fifo);
    cases.push(Case {
        args: a,
        want: vec![s(&fifo), "not a regular file".into()],
    });

    // An output that is a device: refused by name, never replaced.
    let mut a = train(&w, &["--force"]);
    let i = a.iter().position(|x| x == "--metrics").unwrap();
    a[i + 1] = "/dev/full".into();
    cases.push(Case {
        args: a,
        want: vec!["/dev/full".into(), "not a regular file".into()],
    });

    // bench and codecs.
    for (args, want) in [
        (
            vec!["bench", "--target-rel-l2", "nan"],
            vec!["--target-rel-l2", "> 0"],
        ),
        (
            vec!["bench", "--target-rel-l2", "0"],
            vec!["--target-rel-l2", "> 0"],
        ),
        (
            vec!["bench", "--target-rel-l2", "-1"],
            vec!["--target-rel-l2", "> 0"],
        ),
        (vec!["bench", "--budgets", "nan"], vec!["--budgets", "> 0"]),
        (vec!["bench", "--budgets", "1,-1"], vec!["--budgets", "> 0"]),
        (
            vec!["bench", "--budget", "-1"],
            vec!["memory budget", "1.1"],
        ),
        (
            vec!["bench", "--budget", "lots"],
            vec!["memory budget", "512MiB"],
        ),
        (vec!["bench", "--rows", "0"], vec!["--rows", "at least 1"]),
        (vec!["bench", "--group", "1"], vec!["--group", "at least 2"]),
        (vec!["bench", "--reps", "0"], vec!["--reps", "at least 1"]),
        (
            vec!["bench", "--risk-targets", "0"],
            vec!["--risk-targets", "> 0"],
        ),
        (vec!["bench", "--codecs", "fp3"], vec!["fp3"]),
        (
            vec!["bench", "--rows", "1000000000"],
            vec!["--rows", "GiB", "fewer or shorter"],
        ),
        (
            vec!["bench-tape", "--lengths", "100000000x100"],
            vec!["--lengths", "GiB", "fewer or shorter"],
        ),
        (
            vec!["check", "--lengths", "1000000000"],
            vec!["--lengths", "GiB"],
        ),
        (vec!["codecs", "--n", "0"], vec!["--n"]),
        (
            vec!["codecs", "--n", "1000000000000"],
            vec!["--n", "GiB", "smaller --n"],
        ),
    ] {
        cases.push(case(&args, &want));
    }

    // Configs, through `hilore check --config`.
    for (name, patch, want) in [
        ("zero-vocab.json", json!({"vocab_size": 0}), "`vocab_size`"),
        ("odd-head.json", json!({"head_dim": 7}), "`head_dim`"),
        (
            "gqa.json",
            json!({"num_key_value_heads": 3, "num_attention_heads": 4}),
            "`num_key_value_heads`",
        ),
        (
            "gpt2.json",
            json!({"model_type": "gpt2", "architectures": null}),
            "`model_type`",
        ),
        (
            "arch.json",
            json!({"architectures": ["LlamaForCausalLM"]}),
            "`architectures`",
        ),
        (
            "arch-unknown.json",
            json!({"architectures": ["GPT2LMHeadModel"]}),
            "`architectures`",
        ),
        (
            "rope7.json",
            json!({"rope_scaling": {"rope_type": 7, "factor": 2.0}}),
            "`rope_scaling`",
        ),
        (
            "rope-yarn.json",
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
            "`rope_scaling`",
        ),
        ("gelu.json", json!({"hidden_act": "gelu"}), "`hidden_act`"),
        ("eps.json", json!({"rms_norm_eps": -1.0}), "`rms_norm_eps`"),
        ("theta.json", json!({"rope_theta": 0.0}), "`rope_theta`"),
        (
            "layers.json",
            json!({"num_hidden_layers": 1_000_000_000u64}),
            "`num_hidden_layers`",
        ),
        (
            "vocab-huge.json",
            json!({"vocab_size": 100_000_000_000u64}),
            "vocab_size",
        ),
        ("missing.json", json!({"hidden_size": null}), "hidden_size"),
    ] {
        let p = config(&w, name, patch);
        cases.push(case(&["check", "--config", &p], &[&p, want]));
    }
    let not_json = w.join("not-json.json");
    std::fs::write(&not_json, "{\"vocab_size\": 12,").unwrap();
    cases.push(case(
        &["check", "--config", &s(&not_json)],
        &[&s(&not_json), "line 1"],
    ));
    cases.push(case(
        &["check", "--config", &s(&fifo)],
        &[&s(&fifo), "regular file"],
    ));
    cases.push(case(&["check", "--config", &s(&w)], &[&s(&w)]));
    let nowhere = w.join("no-such.json");
    cases.push(case(&["check", "--config", &s(&nowhere)], &[&s(&nowhere)]));

    // Model directories, through `hilore score`.
    let sc = |dir: &Path, input: &str, want: &[&str]| Case {
        args: ["score", "--model", &s(dir), "--input", input]
            .iter()
            .map(|x| x.to_string())
            .collect(),
        want: want.iter().map(|x| x.to_string()).collect(),
    };
    cases.push(sc(
        &nan_model,
        &inp,
        &[
            "model.safetensors",
            "model.layers.0.mlp.up_proj.weight",
            "non-finite",
        ],
    ));
    cases.push(sc(
        &inf_model,
        &inp,
        &[
            "model.safetensors",
            "model.embed_tokens.weight",
            "non-finite",
        ],
    ));
    cases.push(sc(
        &arch_model,
        &inp,
        &["config.json", "`architectures`", "qwen3"],
    ));
    cases.push(sc(&trunc_model, &inp, &["model.safetensors", "truncated"]));
    cases.push(sc(
        &dup_model,
        &inp,
        &["model.safetensors", "`model.norm.weight` appears twice"],
    ));
    cases.push(sc(&notok_model, &inp, &["tokenizer.json"]));
    cases.push(sc(&badtok_model, &inp, &["tokenizer.json"]));
    cases.push(sc(
        &fifo_model,
        &inp,
        &["model.safetensors", "regular file"],
    ));
    cases.push(sc(
        &link_model,
        &inp,
        &["model.safetensors", "outside the model directory"],
    ));
    cases.push(sc(
        &model,
        &s(&bad_jsonl),
        &[&format!("{}:2", s(&bad_jsonl)), "completion"],
    ));
    cases.push(sc(&model, &s(&fifo), &[&s(&fifo), "regular file"]));
    cases.push(sc(&model, &s(&nowhere), &[&s(&nowhere)]));
    cases.push(sc(&w.join("no-model"), &inp, &["no-model"]));

    // export.
    cases.push(case(
        &["export", "--model", &m, "--out", &s(&nan_model)],
        &[&s(&nan_model), "--force"],
    ));
    cases.push(case(
        &["export", "--model", &m, "--out", &m],
        &["model directory itself"],
    ));
    cases.push(case(
        &[
            "export",
            "--model",
            &m,
            "--out",
            &s(&w.join("e")),
            "--dtype",
            "f8",
        ],
        &["--dtype", "f32, bf16 or f16"],
    ));

    let logs = support::tmpdir("corpus", "logs");
    let before = snapshot(&w);
    let mut failures = Vec::new();
    for c in &cases {
        let (code, err) = bounded(&c.args, &logs);
        let missing: Vec<&String> = c
            .want
            .iter()
            .filter(|x| !err.contains(x.as_str()))
            .collect();
        if code != 2 || err.contains("panicked") || !missing.is_empty() {
            failures.push(format!(
                "hilore {}\n  exit {code}, missing {missing:?}\n  {}",
                c.args.join(" "),
                err.trim()
            ));
        }
        let now = snapshot(&w);
        if now != before {
            let changed: Vec<_> = now
                .iter()
                .filter(|e| !before.contains(e))
                .map(|e| e.0.display().to_string())
                .chain(
                    before
                        .iter()
                        .filter(|e| !now.contains(e))
                        .map(|e| format!("(gone) {}", e.0.display())),
                )
                .collect();
            panic!("hilore {} changed files: {changed:?}", c.args.join(" "));
        }
    }
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // Not vacuous: the fixtures themselves are good where they should be.
    zoo::load(&model, &Device::Cpu).unwrap();
    std::fs::remove_dir_all(&w).unwrap();
}
