//! Widening of the int8 KV cache: int8 rows of `head_dim` values with one f32 scale each become
//! f32 rows (`dst = q * scale`) that attention reads. Every path gives the scalar reference's
//! bits: the int8 to f32 conversion is exact and each element is one rounded product, with no
//! reassociation anywhere.

use super::{dispatch, Kernels};

/// Widens `scales.len()` int8 rows of `head_dim` (`rows`, one scale each in `scales`) into the
/// first `scales.len() * head_dim` values of `dst`.
///
/// # Panics
/// If `rows` or `dst` holds fewer than `scales.len() * head_dim` values (the callers size both
/// from the cache's shape).
pub fn widen_q8_rows(k: Kernels, rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    if head_dim == 0 {
        return;
    }
    let values = scales.len() * head_dim;
    let (rows, dst) = (&rows[..values], &mut dst[..values]);
    dispatch!(
        k,
        avx512: avx512(rows, scales, head_dim, dst),
        avx2: avx2(rows, scales, head_dim, dst),
        scalar: widen_q8_scalar(rows, scales, head_dim, dst),
    )
}

/// The reference of [`widen_q8_rows`].
pub fn widen_q8_scalar(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    if head_dim == 0 {
        return;
    }
    for ((row, &scale), out) in rows
        .chunks_exact(head_dim)
        .zip(scales)
        .zip(dst.chunks_exact_mut(head_dim))
    {
        for (o, &q) in out.iter_mut().zip(row) {
            *o = q as f32 * scale;
        }
    }
}

/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    const LANES: usize = 16;
    for ((row, &scale), out) in rows
        .chunks_exact(head_dim)
        .zip(scales)
        .zip(dst.chunks_exact_mut(head_dim))
    {
        let s = _mm512_set1_ps(scale);
        let mut src = row.chunks_exact(LANES);
        let mut dst = out.chunks_exact_mut(LANES);
        for (q, o) in (&mut src).zip(&mut dst) {
            // SAFETY: 16 int8 in, 16 f32 out: both chunks hold exactly that many.
            unsafe {
                // Sign-extended to 16 int32, converted exactly to f32.
                let q = _mm_loadu_si128(q.as_ptr().cast());
                let x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(x, s));
            }
        }
        for (o, &q) in dst.into_remainder().iter_mut().zip(src.remainder()) {
            *o = q as f32 * scale;
        }
    }
}

/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    const LANES: usize = 16;
    for ((row, &scale), out) in rows
        .chunks_exact(head_dim)
        .zip(scales)
        .zip(dst.chunks_exact_mut(head_dim))
    {
        let s = _mm256_set1_ps(scale);
        let mut src = row.chunks_exact(LANES);
        let mut dst = out.chunks_exact_mut(LANES);
        for (q, o) in (&mut src).zip(&mut dst) {
            // SAFETY: 16 int8 in, 16 f32 out: both chunks hold exactly that many.
            unsafe {
                // One load, widened as two halves of 8.
                let q = _mm_loadu_si128(q.as_ptr().cast());
                let low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                let high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(q, q)));
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(low, s));
                _mm256_storeu_ps(o.as_mut_ptr().add(8), _mm256_mul_ps(high, s));
            }
        }
        for (o, &q) in dst.into_remainder().iter_mut().zip(src.remainder()) {
            *o = q as f32 * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KernelPath;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn every_widen_path_matches_the_scalar_reference_on_ragged_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for head_dim in [1, 7, 8, 15, 16, 17, 31, 33, 64, 100, 128] {
            for count in [0, 1, 3, 17] {
                let rows: Vec<i8> = (0..count * head_dim).map(|_| rng.gen()).collect();
                let mut scales: Vec<f32> = (0..count).map(|_| rng.gen_range(1e-4..2.0)).collect();
                // The extremes a row can hold: a zero row and a huge scale.
                if count > 2 {
                    scales[1] = 0.0;
                    scales[2] = 3.0e38;
                }
                let mut want = vec![0.0; count * head_dim + 3];
                widen_q8_scalar(&rows, &scales, head_dim, &mut want);
                for path in KernelPath::ALL.into_iter().filter(|p| p.is_supported()) {
                    let k = Kernels::new(path).unwrap();
                    // A longer destination: the values past the rows stay untouched.
                    let mut got = vec![0.0; count * head_dim + 3];
                    widen_q8_rows(k, &rows, &scales, head_dim, &mut got);
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{path:?} head_dim {head_dim} count {count}");
                }
            }
        }
    }

    #[test]
    fn the_reference_multiplies_each_value_by_its_rows_scale() {
        let mut out = [0.0; 6];
        widen_q8_scalar(&[1, -2, 127, -128, 0, 5], &[0.5, 2.0], 3, &mut out);
        assert_eq!(out, [0.5, -1.0, 63.5, -256.0, 0.0, 10.0]);
    }
}
