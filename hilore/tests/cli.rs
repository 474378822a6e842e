//! End-to-end tests of the `hilore` binary.

mod support;

use support::hilore;

#[test]
fn units_json_lists_every_model_unit() {
    let (code, stdout, stderr) = hilore(&["units", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("units --json is valid JSON");
    let units = v.as_array().expect("an array");
    for key in [
        "name",
        "module",
        "file",
        "line",
        "deterministic",
        "params",
        "cost",
    ] {
        assert!(
            units.iter().all(|u| u.get(key).is_some()),
            "every unit has `{key}`"
        );
    }
    let model_units: Vec<&str> = units
        .iter()
        .filter(|u| {
            u["module"]
                .as_str()
                .unwrap_or("")
                .starts_with("hilore_models")
        })
        .map(|u| u["name"].as_str().unwrap_or(""))
        .collect();
    // The decoder's units must survive linking into the binary.
    for name in [
        "embed",
        "layer",
        "attn_norm",
        "qkv",
        "attn_core",
        "attn_out",
        "mlp_norm",
        "gate_up",
        "down",
        "head",
    ] {
        assert!(
            model_units.contains(&name),
            "unit `{name}` missing from {model_units:?}"
        );
    }
}

#[test]
fn check_passes_on_the_builtin_decoder() {
    let (code, stdout, stderr) = hilore(&["check", "--json"]);
    assert_eq!(code, 0, "hilore check failed:\n{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("check --json is valid JSON");
    let plans = v["plans"].as_array().expect("`plans` is an array");
    for key in [
        "plan",
        "max_abs_diff",
        "rel_l2",
        "peak_activation_bytes",
        "bit_identical",
    ] {
        assert!(
            plans.iter().all(|p| p.get(key).is_some()),
            "every plan has `{key}`"
        );
    }
    let find = |name: &str| {
        plans
            .iter()
            .find(|p| p["plan"] == name)
            .unwrap_or_else(|| panic!("plan {name} missing"))
    };
    let store = find("store-all");
    let gc = find("recompute-all");
    assert_eq!(gc["bit_identical"], true);
    assert_eq!(gc["max_abs_diff"], 0.0);
    let store_peak = store["peak_activation_bytes"].as_f64().unwrap();
    let gc_peak = gc["peak_activation_bytes"].as_f64().unwrap();
    // Per-layer checkpointing keeps one hidden state per layer plus one layer's saved
    // state in backward: on the default config that is well under a third of store-all.
    assert!(
        gc_peak * 3.0 <= store_peak,
        "recompute-all peak {gc_peak} vs store-all {store_peak}"
    );
    let bf16 = find("compress-all(bf16)");
    assert!(bf16["bit_identical"].is_null());
    assert!(bf16["peak_activation_bytes"].as_f64().unwrap() < store_peak);
}

#[test]
fn check_table_and_bad_arguments() {
    let (code, stdout, stderr) = hilore(&["check", "--lengths", "9,5"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("recompute-all"), "{stdout}");
    let (code, _, stderr) = hilore(&["check", "--lengths", "9,1"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("below 2"), "{stderr}");
    let (code, _, stderr) = hilore(&["check", "--config", "/nonexistent/config.json"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("config.json"), "{stderr}");
}
