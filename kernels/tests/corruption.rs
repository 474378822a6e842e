//! Decoding a truncated or corrupted encoding returns an error; it never panics and never
//! reads out of bounds. Any encoding that does decode gives finite values only.

use hilore_kernels::bench::fill_gaussian;
use hilore_kernels::{codecs, Codec, CodecError, Encoded};
use proptest::prelude::*;

const LENS: [usize; 8] = [1, 2, 31, 32, 33, 127, 129, 300];

fn encoded(codec: &dyn Codec, n: usize) -> Encoded {
    let mut x = vec![0.0f32; n];
    fill_gaussian(n as u64 + 7, &mut x);
    let mut enc = Encoded::default();
    codec.encode(&x, &mut enc).unwrap();
    enc
}

fn decode(codec: &dyn Codec, enc: &Encoded, n: usize) -> Result<Vec<f32>, CodecError> {
    let mut y = vec![0.0f32; n];
    codec.decode(enc, &mut y).map(|()| y)
}

fn block_of(name: &str) -> Option<(usize, f32)> {
    match name {
        "bf16" => None,
        "fp8-e4m3-b32" => Some((32, 448.0)),
        "fp8-e4m3-b128" => Some((128, 448.0)),
        "int8-b32" => Some((32, 127.0)),
        "int4-g32" => Some((32, 7.0)),
        "int4-g64" => Some((64, 7.0)),
        "int4-g128" => Some((128, 7.0)),
        other => panic!("unknown codec {other}"),
    }
}

#[test]
fn wrong_sizes_are_reported() {
    for codec in codecs() {
        for n in LENS {
            let good = encoded(codec, n);
            decode(codec, &good, n).unwrap();

            let mut e = good.clone();
            e.data.pop();
            assert!(
                matches!(
                    decode(codec, &e, n),
                    Err(CodecError::Corrupted { what: "data", .. })
                ),
                "{} n {n}: data truncated by one byte",
                codec.name()
            );
            let mut e = good.clone();
            e.data.push(0);
            assert!(matches!(
                decode(codec, &e, n),
                Err(CodecError::Corrupted { what: "data", .. })
            ));

            let mut e = good.clone();
            if e.scales.pop().is_some() {
                assert!(
                    matches!(
                        decode(codec, &e, n),
                        Err(CodecError::Corrupted { what: "scales", .. })
                    ),
                    "{} n {n}: scales truncated by one byte",
                    codec.name()
                );
            }
            let mut e = good.clone();
            e.scales.push(0);
            assert!(matches!(
                decode(codec, &e, n),
                Err(CodecError::Corrupted { what: "scales", .. })
            ));

            let mut e = good.clone();
            e.data.clear();
            e.scales.clear();
            assert!(matches!(
                decode(codec, &e, n),
                Err(CodecError::Corrupted { .. })
            ));

            for m in [n - 1, n + 1] {
                assert!(
                    matches!(
                        decode(codec, &good, m),
                        Err(CodecError::LengthMismatch { .. })
                    ),
                    "{} n {n}: destination of {m}",
                    codec.name()
                );
            }

            let mut e = good.clone();
            e.len = usize::MAX;
            assert!(decode(codec, &e, n).is_err());
        }
    }
}

#[test]
fn wrong_codec_is_reported() {
    let all = codecs();
    for a in &all {
        let enc = encoded(*a, 64);
        for b in &all {
            if a.name() == b.name() {
                continue;
            }
            match decode(*b, &enc, 64) {
                Err(CodecError::WrongCodec { expected, found }) => {
                    assert_eq!((expected, found), (b.name(), a.name()));
                }
                other => panic!("{} decoding {}: {other:?}", b.name(), a.name()),
            }
        }
    }
}

#[test]
fn invalid_scales_are_reported_with_their_block() {
    for codec in codecs() {
        let Some((block, q)) = block_of(codec.name()) else {
            continue;
        };
        let n = 3 * block + 5;
        let good = encoded(codec, n);
        let too_large = f32::MAX / q * 1.01;
        for bad in [f32::NAN, -1.0, -0.0, f32::INFINITY, 1e-40, too_large] {
            for b in [0usize, 2, 3] {
                let mut e = good.clone();
                e.scales[4 * b..4 * b + 4].copy_from_slice(&bad.to_le_bytes());
                match decode(codec, &e, n) {
                    Err(CodecError::InvalidScale { block, bits, .. }) => {
                        assert_eq!(block, b);
                        assert_eq!(bits, bad.to_bits());
                    }
                    other => panic!("{}: scale {bad:e} in block {b}: {other:?}", codec.name()),
                }
            }
        }
    }
}

#[test]
fn invalid_codes_are_reported_with_their_index() {
    for codec in codecs() {
        let name = codec.name();
        let n = 301;
        let good = encoded(codec, n);
        for at in [0usize, 5, 150, 299, 300] {
            let mut e = good.clone();
            match name {
                "bf16" => continue, // every 16-bit pattern is a bf16 value
                "int8-b32" => e.data[at] = 0x80,
                "int4-g32" | "int4-g64" | "int4-g128" => {
                    let byte = &mut e.data[at / 2];
                    *byte = if at % 2 == 0 {
                        (*byte & 0xf0) | 0x08
                    } else {
                        (*byte & 0x0f) | 0x80
                    };
                }
                _ => e.data[at] = 0x7f | (e.data[at] & 0x80),
            }
            match decode(codec, &e, n) {
                Err(CodecError::InvalidCode { index, .. }) => assert_eq!(index, at, "{name}"),
                other => panic!("{name}: bad code at {at}: {other:?}"),
            }
        }
    }
}

#[test]
fn int4_padding_nibble_must_be_zero() {
    for codec in codecs()
        .into_iter()
        .filter(|c| c.name().starts_with("int4"))
    {
        for n in [1usize, 33, 301] {
            let mut e = encoded(codec, n);
            assert_eq!(e.data[n / 2] >> 4, 0, "encoder writes zero padding");
            e.data[n / 2] |= 0x30;
            match decode(codec, &e, n) {
                Err(CodecError::InvalidCode { index, code, .. }) => {
                    assert_eq!((index, code), (n, 3));
                }
                other => panic!("{}: {other:?}", codec.name()),
            }
        }
    }
}

#[test]
fn the_first_fault_in_value_order_is_reported_on_the_parallel_path() {
    let n = 1_000_000 + 3;
    for codec in codecs() {
        let Some((block, _)) = block_of(codec.name()) else {
            continue;
        };
        let mut e = encoded(codec, n);
        // A bad scale late and a bad code early: the code is reported.
        let last = n.div_ceil(block) - 1;
        e.scales[4 * last..4 * last + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
        let at = 70_001;
        if codec.name().starts_with("int4") {
            e.data[at / 2] = (e.data[at / 2] & 0x0f) | 0x80;
        } else if codec.name() == "int8-b32" {
            e.data[at] = 0x80;
        } else {
            e.data[at] = 0xff;
        }
        match decode(codec, &e, n) {
            Err(CodecError::InvalidCode { index, .. }) => assert_eq!(index, at),
            other => panic!("{}: {other:?}", codec.name()),
        }
    }
}

/// An arbitrary encoding: a codec's name with random length fields and random bytes, sized
/// right about half of the time so the content checks are reached too.
fn arbitrary_encoding() -> impl Strategy<Value = (usize, usize, Vec<u8>, Vec<u8>, bool)> {
    (
        0usize..7,
        0usize..400,
        prop::collection::vec(any::<u8>(), 0..500),
        prop::collection::vec(any::<u8>(), 0..60),
        any::<bool>(),
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic_and_success_means_finite(
        (which, n, mut data, mut scales, fit) in arbitrary_encoding()
    ) {
        let codec = codecs()[which];
        if fit {
            // Right sizes, random content (scales biased towards plausible values).
            let enc = encoded(codec, n);
            data.resize(enc.data.len(), 0x11);
            scales.resize(enc.scales.len(), 0x3c);
        }
        let enc = Encoded { codec: codec.name(), len: n, data, scales };
        let mut y = vec![0.0f32; n];
        if codec.decode(&enc, &mut y).is_ok() && codec.name() != "bf16" {
            prop_assert!(y.iter().all(|v| v.is_finite()), "{} decoded a non-finite value", codec.name());
        }
    }
}
