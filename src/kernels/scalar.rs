//! Plain reference kernels: one element at a time, the math exactly as documented.
//! The SIMD paths are tested against these. Callers (the dispatch in `mod.rs`) check shapes first.

use std::ops::Range;

use half::f16;

use super::GemmScratch;

use super::formats::{
    e8m0_kernel_scale, interleaved_position, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix,
    BLOCK_LEN, FP4_DOUBLED,
};

fn mxfp4_dot(w: &Mxfp4Matrix, row: usize, x: &Q8Activations, token: usize) -> f32 {
    let quants = x.row_quants(token);
    let mut total = 0.0f32;
    for block in 0..w.cols / BLOCK_LEN {
        let mut sum = 0i32;
        for e in 0..BLOCK_LEN {
            let k = block * BLOCK_LEN + e;
            sum += FP4_DOUBLED[w.nibble(row, k) as usize] as i32
                * quants[interleaved_position(k)] as i32;
        }
        let scale = e8m0_kernel_scale(w.scale_byte(row, block)) * x.block_scale(token, block);
        total += sum as f32 * scale;
    }
    // The doubled FP4 table made every product twice too large.
    0.5 * total
}

fn q8_dot(w: &Q8Matrix, row: usize, x: &Q8Activations, token: usize) -> f32 {
    let quants = x.row_quants(token);
    let mut total = 0.0f32;
    for block in 0..w.cols / BLOCK_LEN {
        let mut sum = 0i32;
        for e in 0..BLOCK_LEN {
            let p = interleaved_position(block * BLOCK_LEN + e);
            sum += w.quant(row, p) as i32 * quants[p] as i32;
        }
        total += sum as f32 * (w.scale(row, block).to_f32() * x.block_scale(token, block));
    }
    total
}

fn q4_dot(w: &Q4Matrix, row: usize, x: &Q8Activations, token: usize) -> f32 {
    let quants = x.row_quants(token);
    let mut total = 0.0f32;
    for block in 0..w.cols / BLOCK_LEN {
        let scale = w.scale(row, block);
        let mut sum = 0i32;
        for e in 0..BLOCK_LEN {
            let k = block * BLOCK_LEN + e;
            sum += w.value(row, k) * quants[interleaved_position(k)] as i32;
        }
        total += sum as f32 * (scale.to_f32() * x.block_scale(token, block));
    }
    total
}

/// out[t * rows.len() + i] = dot(row rows.start + i, token t), for every token of `x`.
fn for_each_output(
    rows: Range<usize>,
    tokens: usize,
    out: &mut [f32],
    dot: impl Fn(usize, usize) -> f32,
) {
    let n = rows.len();
    for t in 0..tokens {
        for (i, row) in rows.clone().enumerate() {
            out[t * n + i] = dot(row, t);
        }
    }
}

pub(crate) fn mxfp4_gemv(w: &Mxfp4Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    for_each_output(rows, x.rows(), out, |r, t| mxfp4_dot(w, r, x, t));
}

/// The reference decodes nothing ahead, so it needs no scratch.
pub(crate) fn mxfp4_gemm(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    _scratch: &mut GemmScratch,
) {
    mxfp4_gemv(w, x, rows, out)
}

pub(crate) fn q8_gemv(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    for_each_output(rows, x.rows(), out, |r, t| q8_dot(w, r, x, t));
}

/// The reference decodes nothing ahead, so it needs no scratch.
pub(crate) fn q8_gemm(
    w: &Q8Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    _scratch: &mut GemmScratch,
) {
    q8_gemv(w, x, rows, out)
}

pub(crate) fn q4_gemv(w: &Q4Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    for_each_output(rows, x.rows(), out, |r, t| q4_dot(w, r, x, t));
}

/// The reference decodes nothing ahead, so it needs no scratch.
pub(crate) fn q4_gemm(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    _scratch: &mut GemmScratch,
) {
    q4_gemv(w, x, rows, out)
}

/// Exact f32 math: each bf16 weight widened (a shift), multiplied and added with one rounding (FMA).
pub(crate) fn bf16_gemm(w: &[u16], cols: usize, x: &[f32], rows: Range<usize>, out: &mut [f32]) {
    let tokens = x.len() / cols;
    for_each_output(rows, tokens, out, |r, t| {
        let weights = &w[r * cols..(r + 1) * cols];
        let input = &x[t * cols..(t + 1) * cols];
        weights.iter().zip(input).fold(0.0f32, |acc, (&wb, &xv)| {
            f32::from_bits((wb as u32) << 16).mul_add(xv, acc)
        })
    });
}

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc))
}

pub(crate) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = alpha.mul_add(xv, *yv);
    }
}

pub(crate) fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    a.iter()
        .zip(b)
        .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y.to_f32(), acc))
}

pub(crate) fn axpy_f16(alpha: f32, x: &[f16], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = alpha.mul_add(xv.to_f32(), *yv);
    }
}

pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s);
    }
}

pub(crate) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// The reference of the int8 peak probe: the same products, summed plainly.
pub(crate) fn int8_mac_probe(rounds: usize) -> i64 {
    let mut total = 0i64;
    for _ in 0..rounds {
        for g in 0..super::PROBE_GROUPS {
            let (u, s) = std::hint::black_box(super::probe_operands(g));
            total += (0..super::PROBE_GROUP_MACS)
                .map(|_| u as i64 * s as i64)
                .sum::<i64>();
        }
    }
    total
}
