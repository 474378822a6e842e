//! Prints every codec's CPU measurements: `cargo run --release -p hilore-kernels --example
//! codec_bench [n] [reps]` (defaults: n = 4Mi values, 10 repetitions).

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 22);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(10);
    println!(
        "{:<14} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>6} {:>6}",
        "codec",
        "ratio",
        "relL2 gau",
        "maxabs gau",
        "relL2 tail",
        "maxabs tl",
        "enc GB/s",
        "dec GB/s",
        "cpy GB/s",
        "enc/c",
        "dec/c"
    );
    for codec in hilore_kernels::codecs() {
        match hilore_kernels::bench_codec(codec, n, reps) {
            Ok(r) => println!(
                "{:<14} {:>6.2} {:>10.3e} {:>10.3e} {:>10.3e} {:>10.3e} {:>8.2} {:>8.2} {:>8.2} {:>6.2} {:>6.2}",
                r.codec,
                r.compression_ratio,
                r.rel_l2_gaussian,
                r.max_abs_gaussian,
                r.rel_l2_heavy_tail,
                r.max_abs_heavy_tail,
                r.encode_gbps,
                r.decode_gbps,
                r.memcpy_gbps,
                r.encode_gbps / r.memcpy_gbps,
                r.decode_gbps / r.memcpy_gbps
            ),
            Err(e) => println!("{:<14} error: {e}", codec.name()),
        }
    }
}
