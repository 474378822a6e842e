//! Parity of the CUDA kernels with the CPU code, without a GPU: `cuda/host_emulation.cpp`
//! compiles `cuda/codecs.cu` as C++ with each GPU thread run as a host thread (warps meet at
//! barriers for their shuffles) and compares its bytes with the CPU encodings written here.
//! The real GPU is checked by `device-check.sh`; this catches indexing, packing, tail and
//! rounding mistakes in the kernels on every machine with a C++20 compiler. Without one the
//! test says so and passes.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use hilore_kernels::bench::fill_heavy_tailed;
use hilore_kernels::{codecs, CodecError, Encoded};

const SIZES: [usize; 14] = [1, 2, 3, 5, 31, 32, 33, 63, 65, 127, 129, 257, 1000, 4097];

fn compiler() -> Option<String> {
    let candidates = [
        std::env::var("CXX").ok(),
        Some("c++".into()),
        Some("g++".into()),
        Some("clang++".into()),
    ];
    candidates.into_iter().flatten().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

fn write(path: PathBuf, bytes: &[u8]) {
    std::fs::File::create(&path)
        .and_then(|mut f| f.write_all(bytes))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes the inputs and the CPU's outputs the harness compares against.
fn write_cases(dir: &Path) -> usize {
    let mut cases = String::new();
    let mut count = 0;
    for &n in &SIZES {
        let mut x = vec![0.0f32; n];
        fill_heavy_tailed(n as u64, &mut x);
        // Blocks of special content: zeros, values whose scale would be subnormal, huge
        // values, f32 subnormals, and values at f32::MAX.
        for (i, v) in x.iter_mut().enumerate() {
            match (i / 32) % 6 {
                1 => *v = 0.0,
                2 => *v *= 1e-37,
                3 => *v *= 1e30,
                4 => *v = f32::from_bits((i as u32).wrapping_mul(7919) & 0x807f_ffff),
                _ => {}
            }
        }
        if n > 41 {
            x[40] = f32::MAX;
            x[41] = -f32::MAX;
        }
        write(dir.join(format!("in_{n}.f32")), &f32_bytes(&x));
        for codec in codecs() {
            let name = codec.name();
            let mut enc = Encoded::default();
            codec.encode(&x, &mut enc).unwrap();
            let mut y = vec![0.0f32; n];
            codec.decode(&enc, &mut y).unwrap();
            write(dir.join(format!("cpu_{name}_{n}.data")), &enc.data);
            write(dir.join(format!("cpu_{name}_{n}.scales")), &enc.scales);
            write(dir.join(format!("cpu_{name}_{n}.dec")), &f32_bytes(&y));
            let mut xn = x.clone();
            xn[n * 3 / 5] = f32::NAN;
            if n > 1 {
                xn[n - 1] = f32::INFINITY;
            }
            let index = match codec.encode(&xn, &mut enc) {
                Err(CodecError::NonFinite { index, .. }) => index as i64,
                Ok(()) => -1,
                Err(e) => panic!("{e}"),
            };
            cases.push_str(&format!("{name} {n} {index}\n"));
            count += 1;
        }
    }
    write(dir.join("cases.txt"), cases.as_bytes());
    count
}

#[test]
fn cuda_kernels_match_the_cpu_bytes_under_host_emulation() {
    let Some(cxx) = compiler() else {
        eprintln!("skipped: no C++ compiler found (set CXX)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("hilore-cuda-emulation-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // A compiler too old for <barrier> cannot run the harness: say so and pass.
    let probe = dir.join("probe.cpp");
    write(
        probe.clone(),
        b"#include <barrier>\nint main() { std::barrier<> b{1}; b.arrive_and_wait(); }\n",
    );
    let probe_ok = Command::new(&cxx)
        .args(["-std=c++20", "-pthread", "-o"])
        .arg(dir.join("probe"))
        .arg(&probe)
        .output()
        .is_ok_and(|o| o.status.success());
    if !probe_ok {
        eprintln!("skipped: {cxx} cannot build C++20 <barrier> programs");
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }

    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda/host_emulation.cpp");
    let exe = dir.join("host_emulation");
    let build = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-pthread",
            "-o",
        ])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run the C++ compiler");
    assert!(
        build.status.success(),
        "codecs.cu does not build under host emulation:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );

    let cases = write_cases(&dir);
    let run = Command::new(&exe)
        .arg(&dir)
        .output()
        .expect("run the harness");
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "GPU kernels differ from the CPU:\n{stdout}"
    );
    assert!(
        stdout.contains(&format!("{cases} ok, 0 mismatched")),
        "expected {cases} cases:\n{stdout}"
    );
}
