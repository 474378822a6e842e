//! `hilore codecs`: error, compression ratio and speed of every codec on this device.

use clap::Args;
use serde::Serialize;
use std::process::ExitCode;

#[derive(Args)]
pub struct CodecsArgs {
    /// Print a JSON array (`codec`, `device`, `compression_ratio`, `rel_l2_gaussian`,
    /// `rel_l2_heavy_tail`, `encode_gbps`, `decode_gbps`, `memcpy_gbps`, ...).
    #[arg(long)]
    json: bool,
    /// Values per test tensor (4 bytes each uncompressed).
    #[arg(long, default_value_t = 1 << 22)]
    n: usize,
    /// Timed repetitions per codec (fresh random inputs each; the median is reported).
    #[arg(long, default_value_t = 15)]
    reps: usize,
}

#[derive(Serialize)]
struct Row {
    codec: &'static str,
    device: String,
    n: usize,
    encoded_bytes: usize,
    compression_ratio: f64,
    rel_l2_gaussian: f64,
    max_abs_gaussian: f64,
    rel_l2_heavy_tail: f64,
    max_abs_heavy_tail: f64,
    encode_gbps: f64,
    decode_gbps: f64,
    memcpy_gbps: f64,
    encode_to_memcpy: f64,
    decode_to_memcpy: f64,
}

pub fn run(args: CodecsArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.n > 0, "--n must be at least 1");
    // The input, its encoding, the decoded copy and a memcpy target: about 4 x 4 bytes a
    // value, checked before anything is allocated.
    if let Some(mem) = hilore_models::machine_memory_bytes() {
        let need = (args.n as u128).saturating_mul(16);
        if need > mem as u128 {
            anyhow::bail!(
                "--n {} needs about {:.1} GiB (input, encoded, decoded and copied buffers of 4 bytes a value), more than this machine's {:.1} GiB; use a smaller --n (default 4194304)",
                args.n,
                need as f64 / (1u64 << 30) as f64,
                mem as f64 / (1u64 << 30) as f64
            );
        }
    }
    let mut rows = Vec::new();
    for codec in hilore_kernels::codecs() {
        if !args.json {
            eprintln!("measuring {} ...", codec.name());
        }
        let r = hilore_kernels::bench_codec(codec, args.n, args.reps)?;
        rows.push(Row {
            codec: r.codec,
            device: r.device,
            n: r.n,
            encoded_bytes: r.encoded_bytes,
            compression_ratio: r.compression_ratio,
            rel_l2_gaussian: r.rel_l2_gaussian,
            max_abs_gaussian: r.max_abs_gaussian,
            rel_l2_heavy_tail: r.rel_l2_heavy_tail,
            max_abs_heavy_tail: r.max_abs_heavy_tail,
            encode_gbps: r.encode_gbps,
            decode_gbps: r.decode_gbps,
            memcpy_gbps: r.memcpy_gbps,
            encode_to_memcpy: r.encode_gbps / r.memcpy_gbps,
            decode_to_memcpy: r.decode_gbps / r.memcpy_gbps,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<15} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "codec",
        "ratio",
        "relL2 gau",
        "relL2 tail",
        "enc GB/s",
        "dec GB/s",
        "cpy GB/s",
        "enc/cpy",
        "dec/cpy"
    );
    for r in &rows {
        println!(
            "{:<15} {:>6.2} {:>10.2e} {:>10.2e} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2}",
            r.codec,
            r.compression_ratio,
            r.rel_l2_gaussian,
            r.rel_l2_heavy_tail,
            r.encode_gbps,
            r.decode_gbps,
            r.memcpy_gbps,
            r.encode_to_memcpy,
            r.decode_to_memcpy
        );
    }
    if let Some(r) = rows.first() {
        println!("device: {}; {} values per tensor", r.device, r.n);
    }
    Ok(ExitCode::SUCCESS)
}
