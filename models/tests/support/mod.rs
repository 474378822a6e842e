//! Tensor comparisons shared by the tests that check the decoder against candle.

// Each test crate that declares `mod support;` uses only part of this module.
#![allow(dead_code)]

use candle_core::Tensor;

/// The bit patterns of an f32 tensor's elements, in row-major order.
pub fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The largest absolute value of an f32 tensor's elements.
pub fn max_magnitude(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64
}

/// The largest absolute elementwise difference of two f32 tensors of the same shape.
pub fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    max_magnitude(&(a - b).unwrap())
}

/// Relative L2 distance `||a - b|| / ||b||` of two f32 tensors of the same size, in f64;
/// `b` (the reference) must not be all zeros.
pub fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    assert!(den > 0.0, "reference gradient is exactly zero");
    (num / den).sqrt()
}
