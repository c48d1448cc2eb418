//! The clamped SwiGLU of the fast path's experts (spec section 3): for each interleaved (gate,
//! up) pair, `gate = min(gate, limit)`, `up` clamped to ±limit, and
//! `gate / (1 + e^(-alpha gate)) x (up + 1)`. The exact path keeps libm's `expf`
//! ([`crate::model::ops::swiglu`]); here the exponential is [`fast_exp`] (within 2 ulp), which
//! every path computes with the same operations in the same order, so every path gives the
//! scalar reference's bits. One call per expert output: a 512-token prefill runs about 140
//! million of these, which through libm (one call per element, SSE around it) took 3% of its
//! time on the leader alone.

use super::attention::fast_exp;
use super::{dispatch, Kernels};

/// Above this e^x would overflow f32. Where `-alpha gate` exceeds it the result is 0 (libm's
/// formula gives -0: `gate / inf`; the true value is under 1e-36 in magnitude for any gate
/// below 1e2, and a larger one means broken weights), and the exponential is taken of the
/// bound instead so no lane computes garbage.
const EXP_MAX: f32 = 88.0;

/// `out[i] = swiglu(gate_up[2i], gate_up[2i + 1])` for `i < out.len()`.
///
/// # Panics
/// If `gate_up` holds fewer than `2 x out.len()` values (the callers size both from the model's
/// shape).
pub fn swiglu(k: Kernels, gate_up: &[f32], limit: f32, alpha: f32, out: &mut [f32]) {
    let gate_up = &gate_up[..2 * out.len()];
    dispatch!(
        k,
        avx512: avx512(gate_up, limit, alpha, out),
        avx2: avx2(gate_up, limit, alpha, out),
        scalar: swiglu_scalar(gate_up, limit, alpha, out),
    )
}

/// The reference of [`swiglu`]: `min`/`max` as the vector instructions take them (a NaN input
/// gives the bound), then the formula.
pub fn swiglu_scalar(gate_up: &[f32], limit: f32, alpha: f32, out: &mut [f32]) {
    for (o, pair) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        *o = one(pair[0], pair[1], limit, alpha);
    }
}

#[inline(always)]
fn one(gate: f32, up: f32, limit: f32, alpha: f32) -> f32 {
    let gate = gate.min(limit);
    let up = up.min(limit).max(-limit);
    let z = -alpha * gate;
    if z > EXP_MAX {
        return 0.0;
    }
    gate / (1.0 + fast_exp(z)) * (up + 1.0)
}

/// # Safety
/// The CPU has the features of the `Avx512` kernel path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn avx512(gate_up: &[f32], limit: f32, alpha: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    const LANES: usize = 16;
    let (hi, lo) = (_mm512_set1_ps(limit), _mm512_set1_ps(-limit));
    let (minus_alpha, one_v) = (_mm512_set1_ps(-alpha), _mm512_set1_ps(1.0));
    let exp_max = _mm512_set1_ps(EXP_MAX);
    // Gates at the even lanes of two loads, ups at the odd ones.
    let evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    let odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    let mut pairs = gate_up.chunks_exact(2 * LANES);
    let mut outs = out.chunks_exact_mut(LANES);
    for (pair, o) in (&mut pairs).zip(&mut outs) {
        // SAFETY: 32 values in, 16 out: both chunks hold exactly that many; the features are
        // the function's.
        unsafe {
            let a = _mm512_loadu_ps(pair.as_ptr());
            let b = _mm512_loadu_ps(pair.as_ptr().add(LANES));
            let gate = _mm512_min_ps(_mm512_permutex2var_ps(a, evens, b), hi);
            let up = _mm512_max_ps(_mm512_min_ps(_mm512_permutex2var_ps(a, odds, b), hi), lo);
            let z = _mm512_mul_ps(minus_alpha, gate);
            // NaN cannot reach here: min() turned a NaN gate into the limit.
            let finite = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(z, exp_max);
            let e = super::attention::avx512::exp(_mm512_min_ps(z, exp_max));
            let glu = _mm512_div_ps(gate, _mm512_add_ps(one_v, e));
            let result = _mm512_maskz_mul_ps(finite, glu, _mm512_add_ps(up, one_v));
            _mm512_storeu_ps(o.as_mut_ptr(), result);
        }
    }
    for (o, pair) in outs
        .into_remainder()
        .iter_mut()
        .zip(pairs.remainder().chunks_exact(2))
    {
        *o = one(pair[0], pair[1], limit, alpha);
    }
}

/// # Safety
/// The CPU has the features of the `Avx2` kernel path.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2(gate_up: &[f32], limit: f32, alpha: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    let (hi, lo) = (_mm256_set1_ps(limit), _mm256_set1_ps(-limit));
    let (minus_alpha, one_v) = (_mm256_set1_ps(-alpha), _mm256_set1_ps(1.0));
    let exp_max = _mm256_set1_ps(EXP_MAX);
    let mut pairs = gate_up.chunks_exact(2 * LANES);
    let mut outs = out.chunks_exact_mut(LANES);
    for (pair, o) in (&mut pairs).zip(&mut outs) {
        // SAFETY: 16 values in, 8 out: both chunks hold exactly that many; the features are the
        // function's.
        unsafe {
            let a = _mm256_loadu_ps(pair.as_ptr());
            let b = _mm256_loadu_ps(pair.as_ptr().add(LANES));
            // Per 128-bit lane the evens (a0 a2 b0 b2 | a4 a6 b4 b6) and the odds; their 64-bit
            // quarters then go in the order 0 2 1 3 (a0 a2 a4 a6 b0 b2 b4 b6).
            let gates = _mm256_shuffle_ps::<0b10_00_10_00>(a, b);
            let ups = _mm256_shuffle_ps::<0b11_01_11_01>(a, b);
            let order = |v: __m256| {
                _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)))
            };
            let gate = _mm256_min_ps(order(gates), hi);
            let up = _mm256_max_ps(_mm256_min_ps(order(ups), hi), lo);
            let z = _mm256_mul_ps(minus_alpha, gate);
            let overflows = _mm256_cmp_ps::<_CMP_GT_OQ>(z, exp_max);
            let e = super::attention::avx2::exp(_mm256_min_ps(z, exp_max));
            let glu = _mm256_div_ps(gate, _mm256_add_ps(one_v, e));
            let result = _mm256_mul_ps(glu, _mm256_add_ps(up, one_v));
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_andnot_ps(overflows, result));
        }
    }
    for (o, pair) in outs
        .into_remainder()
        .iter_mut()
        .zip(pairs.remainder().chunks_exact(2))
    {
        *o = one(pair[0], pair[1], limit, alpha);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KernelPath;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn every_swiglu_path_gives_the_reference_bits_on_ragged_rows() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for len in [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 2880] {
            let mut gate_up: Vec<f32> = (0..2 * len + 5)
                .map(|_| rng.gen_range(-12.0..12.0))
                .collect();
            // The extremes: far past the limit either way, a gate whose exponential overflows,
            // infinities and a NaN.
            for (i, v) in [
                1e30,
                -1e30,
                -200.0,
                7.0,
                -7.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
            ]
            .into_iter()
            .enumerate()
            {
                if 3 * i < gate_up.len() {
                    gate_up[3 * i] = v;
                }
            }
            let mut want = vec![0.0; len];
            swiglu_scalar(&gate_up, 7.0, 1.702, &mut want);
            for path in KernelPath::ALL.into_iter().filter(|p| p.is_supported()) {
                let k = Kernels::new(path).unwrap();
                let mut got = vec![f32::NAN; len];
                swiglu(k, &gate_up, 7.0, 1.702, &mut got);
                let same = want
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{path:?} len {len}: {want:?} vs {got:?}");
            }
        }
    }

    #[test]
    fn the_reference_stays_within_a_few_ulp_of_the_libm_formula() {
        let config = crate::model::config::ModelConfig::gpt_oss_20b();
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let gate_up: Vec<f32> = (0..20_000).map(|_| rng.gen_range(-20.0..12.0)).collect();
        let (mut want, mut got) = (vec![0.0; 10_000], vec![0.0; 10_000]);
        crate::model::ops::swiglu(&config, &gate_up, &mut want);
        swiglu_scalar(&gate_up, config.swiglu_limit, config.swiglu_alpha, &mut got);
        for (w, g) in want.iter().zip(&got) {
            let error = (w - g).abs();
            assert!(
                error <= 4.0 * f32::EPSILON * w.abs().max(1e-30),
                "{w} vs {g}"
            );
        }
        // The limits: the gate clamped from above, the up value on both sides.
        let mut out = [0.0; 3];
        swiglu_scalar(
            &[100.0, 100.0, 0.0, -100.0, -1e30, 1.0],
            7.0,
            1.702,
            &mut out,
        );
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert!((out[0] - 7.0 * sigmoid(1.702 * 7.0) * 8.0).abs() < 1e-4);
        assert_eq!(out[1], 0.0);
        assert_eq!(out[2], 0.0);
    }
}
