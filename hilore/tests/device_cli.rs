//! `--device`: parsed for every command; without the `gpu` feature, `cuda` is a clear error.

use std::process::Command;

#[cfg(not(feature = "gpu"))]
#[test]
fn cuda_without_the_gpu_feature_exits_2_with_the_fix() {
    let out = Command::new(env!("CARGO_BIN_EXE_hilore"))
        .args(["--device", "cuda", "check"])
        .output()
        .expect("running hilore");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("built without GPU support"), "{err}");
    assert!(err.contains("scripts/build-gpu.sh"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_unknown_device_is_a_usage_error() {
    let out = Command::new(env!("CARGO_BIN_EXE_hilore"))
        .args(["units", "--device", "tpu"])
        .output()
        .expect("running hilore");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown device `tpu`"), "{err}");
}
