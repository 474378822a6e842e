//! GPU check of the codecs: byte parity with the CPU and bandwidth against a device copy.
//!
//! Build on any machine (no CUDA needed) and run where a GPU is:
//!
//! ```text
//! cargo build --release -p hilore-kernels --features cuda --example device_check
//! kernels/device-check.sh            # finds the binary and the CUDA libraries
//! ```
//!
//! 1. Parity: for every codec and several sizes (including sizes that are not multiples of
//!    any block), on fresh activation-like random data, the GPU's encoding must equal the
//!    CPU's byte for byte, the GPU's decode of the CPU's encoding must equal the CPU's decode
//!    bit for bit, and NaN/Inf and corrupted encodings must give the same errors.
//! 2. Speed: encode and decode of 2^26 values (256 MiB of f32) timed with CUDA events after
//!    warm-up, median of many runs, each on fresh random input made on the GPU, against a
//!    device-to-device copy of the same 4n bytes. GB/s count the uncompressed f32 bytes.
//!
//! Prints a table; writes `device_check.json` into `$OUT` when that is set. Exit status 0
//! when every parity check passed, 1 when one failed or CUDA could not be used, 2 when
//! this binary was built without the `cuda` feature.

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("device_check: {}", hilore_kernels::DeviceError::NotCompiled);
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
fn main() {
    match gpu::run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("device_check: {e}");
            std::process::exit(1);
        }
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use std::fmt::Write as _;

    use cudarc::driver::sys::CUevent_flags;
    use hilore_kernels::bench::fill_heavy_tailed;
    use hilore_kernels::cuda::CudaCodecs;
    use hilore_kernels::{codecs, Codec, CodecError, DeviceError, Encoded};

    const SIZES: [usize; 10] = [
        1,
        3,
        31,
        33,
        127,
        129,
        1000,
        4097,
        65_536 + 17,
        (1 << 20) + 3,
    ];
    const BENCH_N: usize = 1 << 26;
    const WARMUP: usize = 3;
    const REPS: usize = 30;

    fn drv(e: cudarc::driver::DriverError) -> DeviceError {
        DeviceError::Driver {
            context: "benchmarking",
            message: e.to_string(),
        }
    }

    /// Compares the GPU with the CPU for one codec and size; returns a description of each
    /// difference.
    fn parity(
        gpu: &CudaCodecs,
        codec: &dyn Codec,
        n: usize,
        seed: u64,
    ) -> Result<Vec<String>, DeviceError> {
        let mut problems = Vec::new();
        let mut x = vec![0.0f32; n];
        fill_heavy_tailed(seed, &mut x);
        // Blocks of special content: zeros, tiny and huge magnitudes.
        for (i, v) in x.iter_mut().enumerate() {
            match (i / 128) % 5 {
                1 => *v = 0.0,
                2 => *v *= 1e-37,
                3 => *v *= 1e30,
                _ => {}
            }
        }
        let (mut cpu, mut dev) = (Encoded::default(), Encoded::default());
        codec.encode(&x, &mut cpu)?;
        gpu.encode_host(codec, &x, &mut dev)?;
        if cpu.data != dev.data {
            let i = cpu.data.iter().zip(&dev.data).position(|(a, b)| a != b);
            problems.push(format!("data differs (first at byte {i:?})"));
        }
        if cpu.scales != dev.scales {
            problems.push("scales differ".into());
        }
        let (mut ycpu, mut ygpu) = (vec![0.0f32; n], vec![0.0f32; n]);
        codec.decode(&cpu, &mut ycpu)?;
        gpu.decode_host(&cpu, &mut ygpu)?;
        if let Some(i) = ycpu
            .iter()
            .zip(&ygpu)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            problems.push(format!(
                "decode differs at {i}: cpu {:e} gpu {:e}",
                ycpu[i], ygpu[i]
            ));
        }
        // Non-finite input: the same error.
        let mut xn = x.clone();
        xn[n * 3 / 5] = f32::NAN;
        if n > 1 {
            xn[n - 1] = f32::INFINITY;
        }
        let c = codec.encode(&xn, &mut cpu).err();
        let g = match gpu.encode_host(codec, &xn, &mut dev) {
            Err(DeviceError::Codec(e)) => Some(e),
            Err(e) => return Err(e),
            Ok(()) => None,
        };
        if !same_error(&c, &g) {
            problems.push(format!("NaN/Inf: cpu {c:?} gpu {g:?}"));
        }
        // A corrupted encoding: the same error.
        codec.encode(&x, &mut cpu)?;
        if !cpu.scales.is_empty() {
            let b = (cpu.scales.len() / 4) / 2;
            cpu.scales[4 * b..4 * b + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
            let c = codec.decode(&cpu, &mut ycpu).err();
            let g = match gpu.decode_host(&cpu, &mut ygpu) {
                Err(DeviceError::Codec(e)) => Some(e),
                Err(e) => return Err(e),
                Ok(()) => None,
            };
            if c != g {
                problems.push(format!("corrupted scale: cpu {c:?} gpu {g:?}"));
            }
        }
        Ok(problems)
    }

    fn same_error(a: &Option<CodecError>, b: &Option<CodecError>) -> bool {
        match (a, b) {
            (
                Some(CodecError::NonFinite {
                    index: i, value: u, ..
                }),
                Some(CodecError::NonFinite {
                    index: j, value: v, ..
                }),
            ) => i == j && u.to_bits() == v.to_bits(),
            _ => a == b,
        }
    }

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    struct Speed {
        encode_gbps: f64,
        decode_gbps: f64,
        memcpy_gbps: f64,
    }

    fn speed(gpu: &CudaCodecs, codec: &dyn Codec) -> Result<Speed, DeviceError> {
        let stream = gpu.stream();
        let mut x = stream.alloc_zeros::<f32>(BENCH_N).map_err(drv)?;
        let mut y = stream.alloc_zeros::<f32>(BENCH_N).map_err(drv)?;
        let mut copy = stream.alloc_zeros::<f32>(BENCH_N).map_err(drv)?;
        let mut enc = gpu.alloc_encoded(codec, BENCH_N)?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let (mut te, mut td, mut tc) = (Vec::new(), Vec::new(), Vec::new());
        for rep in 0..WARMUP + REPS {
            gpu.fill_heavy_tailed(0x5eed + rep as u64, &mut x)?;
            let e0 = stream.record_event(timing).map_err(drv)?;
            gpu.encode_unchecked(codec, &x, &mut enc)?;
            let e1 = stream.record_event(timing).map_err(drv)?;
            gpu.decode_unchecked(&enc, &mut y)?;
            let e2 = stream.record_event(timing).map_err(drv)?;
            stream.memcpy_dtod(&x, &mut copy).map_err(drv)?;
            let e3 = stream.record_event(timing).map_err(drv)?;
            if rep >= WARMUP {
                te.push(f64::from(e0.elapsed_ms(&e1).map_err(drv)?));
                td.push(f64::from(e1.elapsed_ms(&e2).map_err(drv)?));
                tc.push(f64::from(e2.elapsed_ms(&e3).map_err(drv)?));
            }
        }
        // The inputs were valid: a checked encode of the last one must succeed.
        gpu.encode(codec, &x, &mut enc)?;
        let gb = 4.0 * BENCH_N as f64 / 1e9;
        Ok(Speed {
            encode_gbps: gb / (median(te) / 1e3),
            decode_gbps: gb / (median(td) / 1e3),
            memcpy_gbps: gb / (median(tc) / 1e3),
        })
    }

    pub fn run() -> Result<bool, DeviceError> {
        let gpu = CudaCodecs::new(0)?;
        let device = gpu.device_name();
        println!("device: {device}");
        let mut all_ok = true;
        let mut json = String::from("{\n");
        let _ = writeln!(json, "  \"device\": \"{}\",", device.replace('"', "'"));
        let _ = writeln!(
            json,
            "  \"bench_values\": {BENCH_N},\n  \"reps\": {REPS},\n  \"codecs\": ["
        );
        println!(
            "{:<14} {:>7} {:>9} {:>9} {:>9} {:>7} {:>7}",
            "codec", "parity", "enc GB/s", "dec GB/s", "cpy GB/s", "enc/cpy", "dec/cpy"
        );
        let list = codecs();
        for (ci, codec) in list.iter().enumerate() {
            let mut problems = Vec::new();
            for (si, &n) in SIZES.iter().enumerate() {
                for p in parity(&gpu, *codec, n, (ci * 100 + si) as u64)? {
                    problems.push(format!("n {n}: {p}"));
                }
            }
            let ok = problems.is_empty();
            all_ok &= ok;
            let s = speed(&gpu, *codec)?;
            println!(
                "{:<14} {:>7} {:>9.1} {:>9.1} {:>9.1} {:>7.2} {:>7.2}",
                codec.name(),
                if ok { "ok" } else { "FAIL" },
                s.encode_gbps,
                s.decode_gbps,
                s.memcpy_gbps,
                s.encode_gbps / s.memcpy_gbps,
                s.decode_gbps / s.memcpy_gbps
            );
            for p in &problems {
                println!("    {p}");
            }
            let _ = writeln!(
                json,
                "    {{\"codec\": \"{}\", \"byte_identical\": {ok}, \"sizes\": {SIZES:?}, \"problems\": {}, \"encode_gbps\": {:.3}, \"decode_gbps\": {:.3}, \"memcpy_gbps\": {:.3}}}{}",
                codec.name(),
                problems.len(),
                s.encode_gbps,
                s.decode_gbps,
                s.memcpy_gbps,
                if ci + 1 < list.len() { "," } else { "" }
            );
        }
        let _ = writeln!(json, "  ],\n  \"all_byte_identical\": {all_ok}\n}}");
        if let Some(out) = std::env::var_os("OUT") {
            let path = std::path::Path::new(&out).join("device_check.json");
            match std::fs::write(&path, &json) {
                Ok(()) => println!("wrote {}", path.display()),
                Err(e) => eprintln!("could not write {}: {e}", path.display()),
            }
        }
        println!(
            "{}",
            if all_ok {
                "parity: all codecs byte-identical"
            } else {
                "parity: FAILED"
            }
        );
        Ok(all_ok)
    }
}
