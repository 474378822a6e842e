//! FP8 E4M3FN conversion against an independent reference.
//!
//! `data/fp8_e4m3fn_vectors.txt` was produced by `data/make_fp8_vectors.py` with
//! ml_dtypes 0.6.0 (`ml_dtypes.float8_e4m3fn`, driven through numpy 2.4.6):
//! `python3 make_fp8_vectors.py > fp8_e4m3fn_vectors.txt`. It lists all 256 codes decoded to
//! f32, and float32 -> E4M3FN encodings of every exact value and its f32 neighbours, every
//! rounding tie (midpoint between adjacent codes) and its neighbours, values above 448,
//! ±Inf, subnormals (of E4M3 and of f32), zeros, and random values.
//!
//! Where the semantics differ: ml_dtypes does not saturate. A finite value whose rounding
//! passes 448 (|x| >= 464 and above, or just past the 448/480 midpoint) and ±Inf become NaN
//! there; HiLoRe's conversion saturates them to ±448 (OCP E4M3 "saturating" conversion,
//! codes 0x7e/0xfe). Those lines are checked for saturation instead of equality; every
//! other line must match the reference code exactly.

use hilore_kernels::fp8::{e4m3_to_f32, f32_to_e4m3};

const VECTORS: &str = include_str!("data/fp8_e4m3fn_vectors.txt");

fn hex_u32(s: &str) -> u32 {
    u32::from_str_radix(s, 16).unwrap_or_else(|e| panic!("bad hex `{s}`: {e}"))
}

fn hex_u8(s: &str) -> u8 {
    u8::from_str_radix(s, 16).unwrap_or_else(|e| panic!("bad hex `{s}`: {e}"))
}

#[test]
fn all_256_codes_decode_like_the_reference() {
    let mut seen = [false; 256];
    for line in VECTORS.lines().filter(|l| l.starts_with("decode ")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let code = hex_u8(f[1]);
        let ours = e4m3_to_f32(code);
        if f[2] == "nan" {
            assert!(
                ours.is_nan(),
                "code {code:#04x}: reference NaN, ours {ours}"
            );
        } else {
            let want = f32::from_bits(hex_u32(f[2]));
            assert_eq!(
                ours.to_bits(),
                want.to_bits(),
                "code {code:#04x}: reference {want:e}, ours {ours:e}"
            );
        }
        seen[code as usize] = true;
    }
    assert!(
        seen.iter().all(|&s| s),
        "the vector file must list all 256 codes"
    );
}

#[test]
fn encodings_match_the_reference_and_saturate_where_it_overflows() {
    let mut by_kind = std::collections::BTreeMap::<String, usize>::new();
    let mut saturated = 0;
    for line in VECTORS.lines().filter(|l| l.starts_with("encode ")) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let x = f32::from_bits(hex_u32(f[1]));
        let reference = hex_u8(f[2]);
        let kind = f[3];
        let ours = f32_to_e4m3(x);
        *by_kind.entry(kind.to_string()).or_default() += 1;
        let reference_is_nan = reference & 0x7f == 0x7f;
        if x.is_nan() {
            assert_eq!(ours & 0x7f, 0x7f, "NaN input must give a NaN code");
        } else if reference_is_nan {
            // ml_dtypes overflows to NaN; the saturating conversion gives ±448. This may only
            // happen for magnitudes above 448.
            assert!(x.abs() > 448.0, "reference NaN for in-range {x:e} ({kind})");
            let sat = if x.is_sign_negative() { 0xfe } else { 0x7e };
            assert_eq!(ours, sat, "{x:e} must saturate to ±448 ({kind})");
            saturated += 1;
        } else {
            assert_eq!(
                ours,
                reference,
                "{x:e} ({:#010x}, {kind}): reference {reference:#04x} = {:e}, ours {ours:#04x} = {:e}",
                x.to_bits(),
                e4m3_to_f32(reference),
                e4m3_to_f32(ours)
            );
        }
    }
    // The file must exercise every category the acceptance asks for.
    for kind in [
        "exact",
        "tie",
        "tie-near",
        "above448",
        "inf",
        "subnormal",
        "zero",
        "random",
    ] {
        assert!(
            by_kind.get(kind).copied().unwrap_or(0) > 0,
            "no `{kind}` vectors in the file"
        );
    }
    assert!(by_kind["tie"] >= 2 * 125, "every midpoint of both signs");
    assert!(saturated >= 20, "overflowing inputs checked for saturation");
}

#[test]
fn values_between_448_and_the_480_midpoint_round_down_in_both() {
    // Below the 464 midpoint both implementations agree (round to 448); at and above it
    // only saturation keeps the value finite.
    for x in [448.5f32, 455.0, 463.99, 464.0] {
        assert_eq!(f32_to_e4m3(x), 0x7e);
    }
    assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
    assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
}
