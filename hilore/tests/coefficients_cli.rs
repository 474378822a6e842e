//! `hilore coefficients` on the committed TRL cases: for every case and update, the
//! command's JSON equals the library's [`compute`] bit for bit (which
//! hilore-runtime/tests/trl_golden.rs holds against TRL's own numbers), with the config
//! inside the batch and as a YAML file; bad input is refused, naming the field and the fix.

mod support;

use hilore_runtime::grpo::trl::{compute, Batch, TrlSettings};
use serde_json::{json, Value};
use std::path::Path;
use support::{run_ok, run_refused, tmpdir};

fn cases() -> Vec<Value> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hilore-runtime/tests/fixtures/trl");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap())
        .collect()
}

/// A YAML mapping of a flat JSON object (numbers, strings, booleans, null, lists).
fn yaml(config: &Value) -> String {
    config
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("{k}: {v}\n"))
        .collect()
}

#[test]
fn the_command_gives_the_committed_cases_numbers() {
    let dir = tmpdir("coefficients", "cases");
    let mut runs = 0;
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let settings = TrlSettings::from_value(&case["config"], name).unwrap();
        let config_file = dir.join(format!("{name}.yaml"));
        std::fs::write(&config_file, yaml(&case["config"])).unwrap();
        for (k, b) in case["batches"].as_array().unwrap().iter().enumerate() {
            // Through the same text the command prints (f32s written shortest-exact).
            let want: Value = serde_json::from_str(
                &serde_json::to_string(
                    &compute(
                        &settings,
                        &serde_json::from_value::<Batch>(b.clone()).unwrap(),
                    )
                    .unwrap(),
                )
                .unwrap(),
            )
            .unwrap();
            // The config inside the batch, then as a YAML file beside it (every other
            // update, to keep the test short).
            let mut with_config = b.clone();
            with_config["config"] = case["config"].clone();
            let input = dir.join(format!("{name}-{k}.json"));
            std::fs::write(&input, with_config.to_string()).unwrap();
            let got: Value = serde_json::from_str(&run_ok(&[
                "coefficients",
                "--input",
                input.to_str().unwrap(),
            ]))
            .unwrap();
            assert_eq!(got, want, "{name}, update {k}");
            if k % 2 == 0 {
                let bare = dir.join(format!("{name}-{k}-bare.json"));
                std::fs::write(&bare, b.to_string()).unwrap();
                let out = dir.join(format!("{name}-{k}-out.json"));
                run_ok(&[
                    "coefficients",
                    "--input",
                    bare.to_str().unwrap(),
                    "--config",
                    config_file.to_str().unwrap(),
                    "--out",
                    out.to_str().unwrap(),
                ]);
                let got: Value =
                    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
                assert_eq!(got, want, "{name}, update {k}, YAML config");
            }
            runs += 1;
        }
    }
    assert!(runs >= 30, "{runs} runs");
}

#[test]
fn bad_batches_and_configs_are_refused_naming_the_field() {
    let dir = tmpdir("coefficients", "bad");
    let two = |extra: Value| -> Value {
        let mut b = json!({
            "config": {"num_generations": 2},
            "groups": [{"rewards": [1.0, 0.0], "completions": [
                {"logps": [-0.5, -1.0]}, {"logps": [-0.2]}]}]
        });
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "group size",
            json!({"config": {"num_generations": 3}}),
            "num_generations is 3",
        ),
        (
            "past the last update",
            json!({"update": 1}),
            "update 1 is past",
        ),
        (
            "old log-probs after the first update",
            json!({"update": 1, "config": {"num_generations": 2, "num_iterations": 2}}),
            "old_logps",
        ),
        (
            "reference for beta",
            json!({"config": {"num_generations": 2, "beta": 0.1}}),
            "ref_logps",
        ),
        (
            "unknown key",
            json!({"config": {"num_generations": 2, "betta": 0.1}}),
            "did you mean `beta`",
        ),
        (
            "unsupported option",
            json!({"config": {"num_generations": 2, "entropy_coef": 0.01}}),
            "entropy bonus is not implemented",
        ),
        (
            "delta inside the clip",
            json!({"config": {"num_generations": 2, "delta": 1.1}}),
            "delta",
        ),
        (
            "a loss type HiLoRe lacks",
            json!({"config": {"num_generations": 2, "loss_type": "vespo"}}),
            "not implemented",
        ),
        (
            "layout",
            json!({"config": {"num_generations": 2, "steps_per_generation": 4}}),
            "steps_per_generation = 4",
        ),
        (
            "reward weights",
            json!({"config": {"num_generations": 2, "reward_weights": [1.0, 2.0]}}),
            "reward_weights has 2 entries",
        ),
    ];
    for (what, extra, want) in cases {
        let p = dir.join("b.json");
        std::fs::write(&p, two(extra).to_string()).unwrap();
        let err = run_refused(&["coefficients", "--input", p.to_str().unwrap()]);
        assert!(err.contains(want), "{what}: {err}");
    }
    // Malformed files: the parser's position.
    let p = dir.join("bad.yaml");
    std::fs::write(&p, "loss_type: [dapo\n").unwrap();
    let b = dir.join("b.json");
    std::fs::write(&b, two(json!({})).to_string()).unwrap();
    let err = run_refused(&[
        "coefficients",
        "--input",
        b.to_str().unwrap(),
        "--config",
        p.to_str().unwrap(),
    ]);
    assert!(err.contains("line 1 column 12"), "{err}");
    std::fs::write(&b, "{\"groups\": [{\"rewards\": [1.0]}]}").unwrap();
    let err = run_refused(&["coefficients", "--input", b.to_str().unwrap()]);
    assert!(
        err.contains("completions") && err.contains("--help"),
        "{err}"
    );
}
