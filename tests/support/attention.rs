//! What the attention kernel tests share: outputs compared with an f64 reference.
//!
//! Tolerance: relative to the largest |value| of the value rows a head sees (an output is a convex
//! combination of them, times at most 1). f32 arithmetic in a different order plus the <= 2 ulp
//! exp give errors up to about 4e-7 there (measured); we allow 2e-6.

pub const TOLERANCE: f64 = 2e-6;

/// Every element of `got` within [`TOLERANCE`] x `magnitude` of `want`.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], magnitude: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let error = (*g as f64 - w).abs() / magnitude;
        assert!(
            error <= TOLERANCE,
            "{what}: element {i} is {g}, expected {w} (error {error:e} of the value magnitude)"
        );
    }
}

/// An f32 result as the f64 `want` of [`assert_close`].
pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

/// Every path this CPU runs, with f32 attention arithmetic: what the 2e-6 tolerance holds
/// (the bf16 dot products have their own tests and tolerances, tests/attention_bf16.rs).
pub fn f32_attention_kernels() -> Vec<ossterm::kernels::Kernels> {
    ossterm::kernels::Kernels::all_supported()
        .into_iter()
        .map(|k| k.without_bf16_attention())
        .collect()
}
