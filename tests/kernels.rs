//! Every SIMD kernel path against the scalar reference, on random data and ragged shapes, plus the
//! numeric contracts of the block formats.

use std::ops::Range;

use half::f16;
use ossterm::kernels::{
    e8m0_scale, kernels, parse_kernel_path, select_kernel_path, tile_mxfp4, GemmScratch,
    KernelError, KernelPath, Kernels, Mxfp4Layout, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix,
    ScaleRule, FP4_E2M1, MAX_GEMV_TOKENS, MXFP4_TILE_ROWS,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Relative tolerance for float sums computed in a different order, against the sum of magnitudes.
const SUM_ORDER_TOLERANCE: f32 = 1e-5;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn scalar() -> Kernels {
    Kernels::new(KernelPath::Scalar).expect("scalar always runs")
}

/// Every SIMD path this CPU runs, and the AVX-512 path once more without its optional VBMI
/// decode where the CPU has it, so both MXFP4 GEMV decodes meet every cross-path test.
fn simd_paths() -> Vec<Kernels> {
    Kernels::all_supported()
        .into_iter()
        .filter(|k| k.path() != KernelPath::Scalar)
        .flat_map(|k| {
            let without = k.uses_vbmi().then(|| k.without_vbmi());
            std::iter::once(k).chain(without)
        })
        .collect()
}

fn random_f32(rng: &mut ChaCha8Rng, n: usize, spread: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-spread..spread)).collect()
}

fn to_bf16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}

struct Mxfp4Data {
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
    scales: Vec<u8>,
}

impl Mxfp4Data {
    fn random(
        rng: &mut ChaCha8Rng,
        rows: usize,
        cols: usize,
        scale_range: std::ops::RangeInclusive<u8>,
    ) -> Self {
        let blocks = (0..rows * cols / 2).map(|_| rng.gen()).collect();
        let scales = (0..rows * cols / 32)
            .map(|_| rng.gen_range(scale_range.clone()))
            .collect();
        Self {
            rows,
            cols,
            blocks,
            scales,
        }
    }

    fn matrix(&self) -> Mxfp4Matrix<'_> {
        Mxfp4Matrix::new(self.rows, self.cols, &self.blocks, &self.scales)
            .expect("consistent test matrix")
    }
}

/// [`Mxfp4Data`] reordered into the tile layout.
struct TiledData {
    rows: usize,
    cols: usize,
    blocks: Vec<u8>,
    scales: Vec<u8>,
}

impl TiledData {
    fn from(data: &Mxfp4Data) -> Self {
        let (mut blocks, mut scales) = (vec![0; data.blocks.len()], vec![0; data.scales.len()]);
        tile_mxfp4(
            data.rows,
            data.cols,
            &data.blocks,
            &data.scales,
            &mut blocks,
            &mut scales,
        )
        .expect("rows are whole tiles");
        Self {
            rows: data.rows,
            cols: data.cols,
            blocks,
            scales,
        }
    }

    fn matrix(&self) -> Mxfp4Matrix<'_> {
        Mxfp4Matrix::new_tiled(self.rows, self.cols, &self.blocks, &self.scales)
            .expect("consistent tiled matrix")
    }
}

/// Sum over k of |w_k| |x_k| for each (token, row) pair of a row range: the scale of rounding error.
fn magnitude_bounds(
    rows: std::ops::Range<usize>,
    cols: usize,
    weight_row: impl Fn(usize, &mut [f32]),
    x: &Q8Activations,
) -> Vec<f32> {
    let mut bounds = Vec::new();
    let (mut w, mut a) = (vec![0.0; cols], vec![0.0; cols]);
    for t in 0..x.rows() {
        x.dequantize_row(t, &mut a).unwrap();
        for r in rows.clone() {
            weight_row(r, &mut w);
            bounds.push(w.iter().zip(&a).map(|(p, q)| (p * q).abs()).sum());
        }
    }
    bounds
}

/// The scalar reference's MXFP4 GEMM of `range` and each output's sum of magnitudes.
fn mxfp4_reference(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    range: Range<usize>,
    scratch: &mut GemmScratch,
) -> (Vec<f32>, Vec<f32>) {
    let mut expected = vec![0.0; x.rows() * range.len()];
    scalar()
        .mxfp4_gemm(w, x, range.clone(), &mut expected, scratch)
        .unwrap();
    let bounds = magnitude_bounds(
        range,
        w.cols(),
        |r, out| w.dequantize_row(r, out).unwrap(),
        x,
    );
    (expected, bounds)
}

fn assert_close(what: &str, got: &[f32], expected: &[f32], bounds: &[f32]) {
    assert_eq!(got.len(), expected.len(), "{what}: output length");
    for (i, ((g, e), b)) in got.iter().zip(expected).zip(bounds).enumerate() {
        let tolerance = SUM_ORDER_TOLERANCE * b + 1e-30;
        // Equal infinities (scales near the top of E8M0) match too.
        assert!(
            g == e || (g - e).abs() <= tolerance,
            "{what}: output {i}: got {g}, reference {e}, tolerance {tolerance}"
        );
    }
}

/// Shapes: columns hit every MXFP4 tail (1, 2, 3 blocks past the last full group of 4) and the
/// model's 2880; row counts are not multiples of the 4-row or 16-row tiles, and the GEMM's ranges
/// (all rows but the first and last) give pairs of tiles with 1-16 rows in the second (17, 35
/// and 19 rows).
const QUANT_SHAPES: [(usize, usize); 6] =
    [(1, 32), (5, 64), (7, 96), (19, 160), (37, 512), (21, 2880)];

#[test]
fn mxfp4_gemv_and_gemm_match_scalar_on_every_path() {
    let mut rng = rng(1);
    for (rows, cols) in QUANT_SHAPES {
        let data = Mxfp4Data::random(&mut rng, rows, cols, 118..=130);
        let w = data.matrix();
        for tokens in [1usize, 2, 3, 4, 5, 7, 8, 17] {
            let x_values = random_f32(&mut rng, tokens * cols, 3.0);
            let mut x = Q8Activations::new();
            kernels()
                .quantize_activation_rows(&x_values, cols, &mut x)
                .unwrap();
            let range = if rows > 4 { 1..rows - 1 } else { 0..rows };
            let n = range.len();
            let mut scratch = GemmScratch::new(cols);
            let (expected, bounds) = mxfp4_reference(&w, &x, range.clone(), &mut scratch);
            for k in simd_paths() {
                let mut got = vec![f32::NAN; tokens * n];
                k.mxfp4_gemm(&w, &x, range.clone(), &mut got, &mut scratch)
                    .unwrap();
                assert_close(
                    &format!("MXFP4 GEMM {} {rows}x{cols} M={tokens}", k.path()),
                    &got,
                    &expected,
                    &bounds,
                );
                if tokens <= MAX_GEMV_TOKENS {
                    let mut got = vec![f32::NAN; tokens * n];
                    k.mxfp4_gemv(&w, &x, range.clone(), &mut got).unwrap();
                    assert_close(
                        &format!("MXFP4 GEMV {} {rows}x{cols}", k.path()),
                        &got,
                        &expected,
                        &bounds,
                    );
                }
            }
        }
    }
}

/// The AVX-512 MXFP4 GEMV decodes nibbles with `vpermb` where AVX-512 VBMI is present and with
/// `vpshufb` elsewhere; both feed the same integer sums to the same float steps, so they must
/// agree bit for bit, on ragged shapes (rows not a multiple of the row block, a short last group)
/// and at the extreme scale bytes (0 flushes to zero).
#[test]
fn mxfp4_gemv_with_and_without_vbmi_agree_bit_for_bit() {
    let Some(k) = simd_paths().into_iter().find(|k| k.uses_vbmi()) else {
        eprintln!("skipped: this CPU has no AVX-512 VBMI");
        return;
    };
    let mut rng = rng(11);
    for (rows, cols) in [(1, 32), (7, 96), (13, 2880), (38, 160), (9, 4128)] {
        for scales in [118..=130, 0..=3, 250..=254] {
            let data = Mxfp4Data::random(&mut rng, rows, cols, scales);
            let w = data.matrix();
            for tokens in 1..=MAX_GEMV_TOKENS {
                let x_values = random_f32(&mut rng, tokens * cols, 3.0);
                let mut x = Q8Activations::new();
                k.quantize_activation_rows(&x_values, cols, &mut x).unwrap();
                let range = if rows > 2 { 1..rows - 1 } else { 0..rows };
                let mut with = vec![f32::NAN; tokens * range.len()];
                let mut without = with.clone();
                k.mxfp4_gemv(&w, &x, range.clone(), &mut with).unwrap();
                k.without_vbmi()
                    .mxfp4_gemv(&w, &x, range, &mut without)
                    .unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&with), bits(&without), "{rows}x{cols} M={tokens}");
            }
        }
    }
}

/// The AVX-512 GEMM multiplies MXFP4's power-of-two scales by adding exponents where every
/// product stays a normal float, and multiplies elsewhere: a weight scale byte of 0, an all-zero
/// activation block (scale 0), products below the normal range (tiny activations against small
/// scales) and the extreme exponents 1 and 254 must all give the scalar results, with no NaN
/// from the padding lanes of ragged tiles.
#[test]
fn mxfp4_gemm_matches_scalar_at_zero_and_extreme_scales() {
    let mut rng = rng(11);
    for (rows, cols) in [(37, 160), (21, 2880), (19, 96)] {
        for case in 0..6 {
            let mut data = Mxfp4Data::random(&mut rng, rows, cols, 118..=130);
            let mut x_values = random_f32(&mut rng, 7 * cols, 3.0);
            match case {
                // One zero scale byte in one row: that tile pair multiplies.
                0 => data.scales[(rows / 2) * (cols / 32) + 1] = 0,
                // An all-zero activation block: the whole call multiplies.
                1 => x_values[cols + 32..cols + 64].fill(0.0),
                // Tiny activations against small scales: products below the normal range.
                2 => {
                    data.scales.iter_mut().for_each(|s| *s = 1 + *s % 8);
                    x_values.iter_mut().for_each(|v| *v *= 1e-30);
                }
                // The smallest scale byte with activations that keep every product just
                // normal: exponents added.
                3 => {
                    data.scales.fill(1);
                    x_values.iter_mut().for_each(|v| *v *= 150.0);
                }
                // Large and small scale bytes side by side, products normal: exponents added.
                4 => {
                    for (i, s) in data.scales.iter_mut().enumerate() {
                        *s = if i % 3 == 0 { 240 } else { 14 };
                    }
                }
                // Only the padding of ragged tiles differs from the usual case.
                _ => {}
            }
            let w = data.matrix();
            // Tight scales meet one scaling of MXFP4's; split rows' powers of two the other.
            let rule = if case % 2 == 0 {
                ScaleRule::Tight
            } else {
                ScaleRule::PowerOfTwo
            };
            let mut x = Q8Activations::new();
            kernels()
                .quantize_activation_rows_with(&x_values, cols, rule, true, &mut x)
                .unwrap();
            let range = 1..rows;
            let n = range.len();
            let mut scratch = GemmScratch::new(cols);
            let mut expected = vec![0.0; 7 * n];
            scalar()
                .mxfp4_gemm(&w, &x, range.clone(), &mut expected, &mut scratch)
                .unwrap();
            let bounds = magnitude_bounds(
                range.clone(),
                cols,
                |r, out| w.dequantize_row(r, out).unwrap(),
                &x,
            );
            for k in simd_paths() {
                let mut got = vec![f32::NAN; 7 * n];
                k.mxfp4_gemm(&w, &x, range.clone(), &mut got, &mut scratch)
                    .unwrap();
                let what = format!("MXFP4 GEMM {} {rows}x{cols} case {case}", k.path());
                assert!(got.iter().all(|v| v.is_finite()), "{what}: not finite");
                assert_close(&what, &got, &expected, &bounds);
            }
        }
    }
}

/// Activations whose blocks each hold +-127 (so the scale is exactly 1/8) and small integers
/// elsewhere: every product and partial sum is exact in f32, so all paths must agree bit for bit.
fn exact_activations(rng: &mut ChaCha8Rng, tokens: usize, cols: usize) -> Vec<f32> {
    let mut values: Vec<f32> = (0..tokens * cols)
        .map(|_| rng.gen_range(-20i32..=20) as f32 / 8.0)
        .collect();
    for block in values.chunks_mut(32) {
        let at = rng.gen_range(0..32);
        block[at] = if rng.gen() { 127.0 / 8.0 } else { -127.0 / 8.0 };
    }
    values
}

#[test]
fn integer_exact_inputs_give_identical_results_on_every_path() {
    let mut rng = rng(2);
    // 35 rows: a pair of tiles (32 rows) and a 3-row tile; 13 tokens: two batches of 6 and one.
    for (rows, cols) in [(9, 96), (13, 2880), (35, 160)] {
        let data = Mxfp4Data::random(&mut rng, rows, cols, 126..=128);
        let mut x = Q8Activations::new();
        for tokens in [1, 5, 13] {
            kernels()
                .quantize_activation_rows(&exact_activations(&mut rng, tokens, cols), cols, &mut x)
                .unwrap();
            // Q8 weights: +-127 in each block and small integers, so the f16 scale is exactly 1.
            let mut q8_values: Vec<f32> = (0..rows * cols)
                .map(|_| rng.gen_range(-20i32..=20) as f32)
                .collect();
            for block in q8_values.chunks_mut(32) {
                block[rng.gen_range(0..32)] = 127.0;
            }
            let q8 = Q8Matrix::from_bf16(rows, cols, &to_bf16(&q8_values)).unwrap();
            // Q4 weights: -8 in each block, so the scale is exactly 1.
            let mut q4_values: Vec<f32> = (0..rows * cols)
                .map(|_| rng.gen_range(-7i32..=7) as f32)
                .collect();
            for block in q4_values.chunks_mut(32) {
                block[rng.gen_range(0..32)] = -8.0;
            }
            let q4 = Q4Matrix::from_bf16(rows, cols, &to_bf16(&q4_values)).unwrap();
            let mut scratch = GemmScratch::new(cols);
            let run = |k: Kernels, scratch: &mut GemmScratch| {
                let mut outs = vec![vec![0.0f32; tokens * rows]; 3];
                k.mxfp4_gemm(&data.matrix(), &x, 0..rows, &mut outs[0], scratch)
                    .unwrap();
                k.q8_gemm(&q8, &x, 0..rows, &mut outs[1], scratch).unwrap();
                k.q4_gemm(&q4, &x, 0..rows, &mut outs[2], scratch).unwrap();
                outs
            };
            let expected = run(scalar(), &mut scratch);
            for k in simd_paths() {
                assert_eq!(
                    run(k, &mut scratch),
                    expected,
                    "{} {rows}x{cols} M={tokens}",
                    k.path()
                );
            }
        }
    }
}

#[test]
fn q8_and_q4_gemv_and_gemm_match_scalar_on_every_path() {
    let mut rng = rng(3);
    for (rows, cols) in QUANT_SHAPES {
        let weights = to_bf16(&random_f32(&mut rng, rows * cols, 0.2));
        let q8 = Q8Matrix::from_bf16(rows, cols, &weights).unwrap();
        let q4 = Q4Matrix::from_bf16(rows, cols, &weights).unwrap();
        for tokens in [1usize, 2, 3, 6, 8, 17] {
            let mut x = Q8Activations::new();
            kernels()
                .quantize_activation_rows(&random_f32(&mut rng, tokens * cols, 2.0), cols, &mut x)
                .unwrap();
            let range = if rows > 2 { 2..rows } else { 0..rows };
            let n = range.len();
            let mut scratch = GemmScratch::new(cols);
            let (mut expected8, mut expected4) = (vec![0.0; tokens * n], vec![0.0; tokens * n]);
            scalar()
                .q8_gemm(&q8, &x, range.clone(), &mut expected8, &mut scratch)
                .unwrap();
            scalar()
                .q4_gemm(&q4, &x, range.clone(), &mut expected4, &mut scratch)
                .unwrap();
            let bounds8 = magnitude_bounds(
                range.clone(),
                cols,
                |r, o| q8.dequantize_row(r, o).unwrap(),
                &x,
            );
            let bounds4 = magnitude_bounds(
                range.clone(),
                cols,
                |r, o| q4.dequantize_row(r, o).unwrap(),
                &x,
            );
            for k in simd_paths() {
                let what = format!("{} {rows}x{cols} M={tokens}", k.path());
                let mut got = vec![f32::NAN; tokens * n];
                k.q8_gemm(&q8, &x, range.clone(), &mut got, &mut scratch)
                    .unwrap();
                assert_close(&format!("Q8 GEMM {what}"), &got, &expected8, &bounds8);
                k.q4_gemm(&q4, &x, range.clone(), &mut got, &mut scratch)
                    .unwrap();
                assert_close(&format!("Q4 GEMM {what}"), &got, &expected4, &bounds4);
                if tokens <= MAX_GEMV_TOKENS {
                    // NaN first, so an output the GEMV leaves unwritten fails.
                    got.fill(f32::NAN);
                    k.q8_gemv(&q8, &x, range.clone(), &mut got).unwrap();
                    assert_close(&format!("Q8 GEMV {what}"), &got, &expected8, &bounds8);
                    got.fill(f32::NAN);
                    k.q4_gemv(&q4, &x, range.clone(), &mut got).unwrap();
                    assert_close(&format!("Q4 GEMV {what}"), &got, &expected4, &bounds4);
                }
            }
        }
    }
}

#[test]
fn bf16_gemv_and_gemm_match_scalar_on_every_path() {
    let mut rng = rng(4);
    // bf16 takes any column count, including ones that leave a partial vector.
    for (rows, cols) in [(1, 7), (5, 64), (9, 100), (17, 2880), (6, 4096)] {
        let w_values = random_f32(&mut rng, rows * cols, 1.0);
        let w = to_bf16(&w_values);
        for tokens in [1usize, 2, 3, 4, 17] {
            let x = random_f32(&mut rng, tokens * cols, 1.0);
            let range = if rows > 3 { 1..rows - 1 } else { 0..rows };
            let n = range.len();
            let mut expected = vec![0.0; tokens * n];
            scalar()
                .bf16_gemm(&w, cols, &x, range.clone(), &mut expected)
                .unwrap();
            let mut bounds = Vec::new();
            for t in 0..tokens {
                for r in range.clone() {
                    let row = &w_values[r * cols..(r + 1) * cols];
                    bounds.push(
                        row.iter()
                            .zip(&x[t * cols..])
                            .map(|(a, b)| (a * b).abs())
                            .sum::<f32>(),
                    );
                }
            }
            for k in simd_paths() {
                let mut got = vec![f32::NAN; tokens * n];
                k.bf16_gemm(&w, cols, &x, range.clone(), &mut got).unwrap();
                assert_close(
                    &format!("BF16 GEMM {} {rows}x{cols} M={tokens}", k.path()),
                    &got,
                    &expected,
                    &bounds,
                );
                if tokens == 1 {
                    k.bf16_gemv(&w, cols, &x, range.clone(), &mut got).unwrap();
                    assert_close(
                        &format!("BF16 GEMV {} {rows}x{cols}", k.path()),
                        &got,
                        &expected,
                        &bounds,
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_on_small_integers_is_exact_on_every_path() {
    let mut rng = rng(5);
    let (rows, cols, tokens) = (11, 2880, 4);
    let w: Vec<f32> = (0..rows * cols)
        .map(|_| rng.gen_range(-8i32..=8) as f32)
        .collect();
    let x: Vec<f32> = (0..tokens * cols)
        .map(|_| rng.gen_range(-8i32..=8) as f32 * 0.25)
        .collect();
    let w = to_bf16(&w);
    let mut expected = vec![0.0; tokens * rows];
    scalar()
        .bf16_gemm(&w, cols, &x, 0..rows, &mut expected)
        .unwrap();
    for (t, row) in [(0usize, 0usize), (3, 10)] {
        let exact: f64 = (0..cols)
            .map(|c| {
                f32::from_bits((w[row * cols + c] as u32) << 16) as f64 * x[t * cols + c] as f64
            })
            .sum();
        assert_eq!(expected[t * rows + row] as f64, exact);
    }
    for k in simd_paths() {
        let mut got = vec![0.0; tokens * rows];
        k.bf16_gemm(&w, cols, &x, 0..rows, &mut got).unwrap();
        assert_eq!(got, expected, "{}", k.path());
    }
}

#[test]
fn attention_helpers_match_scalar_on_every_path() {
    let mut rng = rng(6);
    for len in [1usize, 7, 16, 33, 64, 100, 2880] {
        let a = random_f32(&mut rng, len, 2.0);
        let b = random_f32(&mut rng, len, 2.0);
        let b16: Vec<f16> = b.iter().map(|v| f16::from_f32(*v)).collect();
        let bound: f32 = a.iter().zip(&b).map(|(p, q)| (p * q).abs()).sum::<f32>() * 1.01;
        let s = scalar();
        let dot = s.dot(&a, &b).unwrap();
        let dot16 = s.dot_f16(&a, &b16).unwrap();
        let mut y = random_f32(&mut rng, len, 1.0);
        let y_start = y.clone();
        s.axpy(0.7, &a, &mut y).unwrap();
        let mut y16 = y_start.clone();
        s.axpy_f16(-1.3, &b16, &mut y16).unwrap();
        let mut halves = vec![f16::ZERO; len];
        s.f32_to_f16(&a, &mut halves).unwrap();
        let mut widened = vec![0.0; len];
        s.f16_to_f32(&b16, &mut widened).unwrap();
        for k in simd_paths() {
            let what = format!("{} len {len}", k.path());
            assert!(
                (k.dot(&a, &b).unwrap() - dot).abs() <= SUM_ORDER_TOLERANCE * bound,
                "dot {what}"
            );
            assert!(
                (k.dot_f16(&a, &b16).unwrap() - dot16).abs() <= SUM_ORDER_TOLERANCE * bound,
                "dot_f16 {what}"
            );
            // axpy does one FMA per element on every path: identical results.
            let mut got = y_start.clone();
            k.axpy(0.7, &a, &mut got).unwrap();
            assert_eq!(got, y, "axpy {what}");
            let mut got = y_start.clone();
            k.axpy_f16(-1.3, &b16, &mut got).unwrap();
            assert_eq!(got, y16, "axpy_f16 {what}");
            let mut got = vec![f16::ZERO; len];
            k.f32_to_f16(&a, &mut got).unwrap();
            assert_eq!(got, halves, "f32_to_f16 {what}");
            let mut got = vec![0.0; len];
            k.f16_to_f32(&b16, &mut got).unwrap();
            assert_eq!(got, widened, "f16_to_f32 {what}");
        }
    }
}

#[test]
fn f16_conversion_rounds_to_nearest_even_including_subnormals() {
    // 1 + 2^-11 is halfway between two f16 values: ties go to the even one (1.0).
    let src = [
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        3.0e-6,
        -65504.0,
        70000.0,
        0.0,
    ];
    for k in Kernels::all_supported() {
        let mut dst = vec![f16::ZERO; src.len()];
        k.f32_to_f16(&src, &mut dst).unwrap();
        let expected: Vec<f16> = src.iter().map(|v| f16::from_f32(*v)).collect();
        assert_eq!(dst, expected, "{}", k.path());
        assert_eq!(dst[0], f16::ONE);
        assert!(dst[4].is_infinite());
    }
}

#[test]
fn mxfp4_dequantization_follows_the_table() {
    // Row 0: block of bytes n | (n+1) << 4 for n = 0..16 (wrapping), scale 128 (x2).
    // Row 1: all bytes 0xF7 (even element 6.0, odd -6.0), scale 120 (x 2^-7).
    let mut blocks = Vec::new();
    for n in 0..16u8 {
        blocks.push(n | (((n + 1) % 16) << 4));
    }
    blocks.extend([0xF7u8; 16]);
    let scales = [128u8, 120];
    let w = Mxfp4Matrix::new(2, 32, &blocks, &scales).unwrap();
    let mut row = vec![0.0; 32];
    w.dequantize_row(0, &mut row).unwrap();
    for n in 0..16 {
        assert_eq!(row[2 * n], FP4_E2M1[n] * 2.0);
        assert_eq!(row[2 * n + 1], FP4_E2M1[(n + 1) % 16] * 2.0);
    }
    assert_eq!(&row[..6], &[0.0, 1.0, 1.0, 2.0, 2.0, 3.0]);
    w.dequantize_row(1, &mut row).unwrap();
    assert!(row.chunks(2).all(|p| p == [6.0 / 128.0, -6.0 / 128.0]));
    assert_eq!(e8m0_scale(127), 1.0);

    // The kernels see the same values: a one-hot activation picks single weights out.
    for k in Kernels::all_supported() {
        for pick in [0usize, 1, 13, 30, 31] {
            let mut x = vec![0.0f32; 32];
            x[pick] = 1.0;
            let mut q = Q8Activations::new();
            kernels().quantize_activations(&x, &mut q).unwrap();
            let mut out = [0.0f32; 2];
            k.mxfp4_gemv(&w, &q, 0..2, &mut out).unwrap();
            let (mut r0, mut r1) = (vec![0.0; 32], vec![0.0; 32]);
            w.dequantize_row(0, &mut r0).unwrap();
            w.dequantize_row(1, &mut r1).unwrap();
            assert_eq!(out, [r0[pick], r1[pick]], "{} element {pick}", k.path());
        }
    }
}

#[test]
fn quantized_dot_approximates_the_exact_dot_within_quantization_error() {
    let mut rng = rng(7);
    let (rows, cols) = (16, 2880);
    let data = Mxfp4Data::random(&mut rng, rows, cols, 120..=124);
    let w = data.matrix();
    let x_values = random_f32(&mut rng, cols, 1.5);
    let mut x = Q8Activations::new();
    kernels().quantize_activations(&x_values, &mut x).unwrap();
    let mut weight_row = vec![0.0; cols];
    for k in Kernels::all_supported() {
        let mut out = vec![0.0; rows];
        k.mxfp4_gemv(&w, &x, 0..rows, &mut out).unwrap();
        for (r, &got) in out.iter().enumerate() {
            w.dequantize_row(r, &mut weight_row).unwrap();
            let exact: f64 = weight_row
                .iter()
                .zip(&x_values)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            // Rounding each activation to its block's int8 grid moves it by at most half a step.
            let bound: f64 = weight_row
                .chunks(32)
                .zip(x_values.chunks(32))
                .map(|(wb, xb)| {
                    let step = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                    wb.iter().map(|v| v.abs() as f64).sum::<f64>() * step / 2.0
                })
                .sum();
            assert!(
                (got as f64 - exact).abs() <= bound * 1.001 + 1e-6,
                "{} row {r}: got {got}, exact {exact}, bound {bound}",
                k.path()
            );
        }
    }
}

#[test]
fn q8_and_q4_quantizers_stay_within_half_a_step() {
    let mut rng = rng(8);
    let (rows, cols) = (3, 160);
    let values = random_f32(&mut rng, rows * cols, 0.5);
    let bits = to_bf16(&values);
    let exact: Vec<f32> = bits
        .iter()
        .map(|b| f32::from_bits((*b as u32) << 16))
        .collect();
    let q8 = Q8Matrix::from_bf16(rows, cols, &bits).unwrap();
    let q4 = Q4Matrix::from_bf16(rows, cols, &bits).unwrap();
    let (mut row8, mut row4) = (vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        q8.dequantize_row(r, &mut row8).unwrap();
        q4.dequantize_row(r, &mut row4).unwrap();
        for block in 0..cols / 32 {
            let span = r * cols + block * 32..r * cols + block * 32 + 32;
            let amax = exact[span.clone()]
                .iter()
                .fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, k) in span.enumerate() {
                let c = block * 32 + i;
                // Half a step, plus the f16 rounding of the scale (relative 2^-11, times |q| <= 127 or 8).
                assert!(
                    (row8[c] - exact[k]).abs() <= amax / 254.0 + amax * 2f32.powi(-11) * 1.01,
                    "Q8 {r},{c}"
                );
                // Q4 reaches -8 steps on the extreme's side but only +7 on the other: values beyond
                // 7 steps there are clamped.
                let clamped = (exact[k].abs() - 7.0 * amax / 8.0).max(0.0);
                let bound4 = amax / 16.0 + clamped + amax * 2f32.powi(-11) * 1.01;
                assert!((row4[c] - exact[k]).abs() <= bound4, "Q4 {r},{c}");
            }
        }
    }
    // 160 columns pad to 2 groups of 128: int8 or nibbles plus four f16 scales per group.
    assert_eq!(q8.size_bytes(), rows * 2 * (128 + 8));
    assert_eq!(q4.size_bytes(), rows * 2 * (64 + 8));
}

#[test]
fn kernel_path_names_parse_and_unsupported_paths_are_refused() {
    assert_eq!(
        parse_kernel_path("scalar").unwrap(),
        Some(KernelPath::Scalar)
    );
    assert_eq!(parse_kernel_path(" AVX2 ").unwrap(), Some(KernelPath::Avx2));
    assert_eq!(
        parse_kernel_path("avx2-vnni").unwrap(),
        Some(KernelPath::Avx2Vnni)
    );
    assert_eq!(
        parse_kernel_path("avx512").unwrap(),
        Some(KernelPath::Avx512)
    );
    assert_eq!(parse_kernel_path("AMX").unwrap(), Some(KernelPath::Amx));
    assert_eq!(parse_kernel_path("auto").unwrap(), None);
    assert_eq!(parse_kernel_path("").unwrap(), None);
    let err = parse_kernel_path("neon").unwrap_err();
    assert!(matches!(err, KernelError::UnknownPath { .. }));
    assert!(err.to_string().contains("OSSTERM_KERNELS"), "{err}");
    assert!(select_kernel_path(Some("sse9")).is_err());

    assert_eq!(
        select_kernel_path(None).unwrap(),
        ossterm::kernels::best_supported_path()
    );
    assert_eq!(
        select_kernel_path(Some("scalar")).unwrap(),
        KernelPath::Scalar
    );
    for path in KernelPath::ALL {
        match select_kernel_path(Some(path.name())) {
            Ok(selected) => {
                assert!(path.is_supported());
                assert_eq!(selected, path);
            }
            Err(KernelError::UnsupportedPath {
                path: refused,
                missing,
            }) => {
                assert!(!path.is_supported());
                assert_eq!(refused, path);
                assert_eq!(missing, path.missing_features().join(", "));
            }
            Err(other) => panic!("unexpected error for {path}: {other}"),
        }
    }
    assert!(ossterm::kernels::kernel_path().is_supported());
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let data = Mxfp4Data {
        rows: 4,
        cols: 64,
        blocks: vec![0; 4 * 32],
        scales: vec![127; 8],
    };
    assert!(Mxfp4Matrix::new(4, 64, &data.blocks[1..], &data.scales).is_err());
    assert!(Mxfp4Matrix::new(4, 48, &data.blocks, &data.scales).is_err());
    assert!(Q8Matrix::from_bf16(2, 64, &[0u16; 100]).is_err());
    assert!(Q4Matrix::from_bf16(2, 30, &[0u16; 60]).is_err());
    let mut x = Q8Activations::new();
    assert!(kernels().quantize_activations(&[0.0; 33], &mut x).is_err());
    kernels()
        .quantize_activation_rows(&[0.5; 128], 64, &mut x)
        .unwrap();
    let w = data.matrix();
    let mut scratch = GemmScratch::new(32);
    for k in Kernels::all_supported() {
        let mut out = vec![0.0; 8];
        // Too many tokens for a GEMV, rows past the end, short output, too small scratch.
        let mut five = Q8Activations::new();
        kernels()
            .quantize_activation_rows(&[0.5; 320], 64, &mut five)
            .unwrap();
        assert!(matches!(
            k.mxfp4_gemv(&w, &five, 0..2, &mut out[..8]),
            Err(KernelError::TooManyGemvTokens { .. })
        ));
        assert!(matches!(
            k.mxfp4_gemm(&w, &x, 2..5, &mut out[..6], &mut scratch),
            Err(KernelError::RowRange { .. })
        ));
        let mut big_scratch = GemmScratch::new(64);
        assert!(k
            .mxfp4_gemm(&w, &x, 0..4, &mut out[..7], &mut big_scratch)
            .is_err());
        assert!(matches!(
            k.mxfp4_gemm(&w, &x, 0..4, &mut out, &mut scratch),
            Err(KernelError::ScratchTooSmall { .. })
        ));
        assert!(k
            .mxfp4_gemm(&w, &x, 0..4, &mut out, &mut big_scratch)
            .is_ok());
        assert!(k
            .bf16_gemv(&[0u16; 10], 3, &[0.0; 3], 0..1, &mut out[..1])
            .is_err());
        assert!(k
            .bf16_gemv(&[0u16; 9], 3, &[0.0; 3], 0..4, &mut out[..4])
            .is_err());
        assert!(k.dot(&[1.0; 3], &[1.0; 4]).is_err());
        assert!(k.axpy_f16(1.0, &[f16::ONE; 3], &mut [0.0; 2]).is_err());
    }
}

#[test]
fn gathered_activation_rows_equal_quantizing_those_tokens() {
    let mut rng = rng(9);
    let cols = 96;
    let all = random_f32(&mut rng, 5 * cols, 1.0);
    let mut x = Q8Activations::new();
    kernels()
        .quantize_activation_rows(&all, cols, &mut x)
        .unwrap();
    let mut gathered = Q8Activations::new();
    gathered.gather_rows(&x, &[4, 1]).unwrap();
    let mut direct = Q8Activations::new();
    let picked: Vec<f32> = all[4 * cols..5 * cols]
        .iter()
        .chain(&all[cols..2 * cols])
        .copied()
        .collect();
    kernels()
        .quantize_activation_rows(&picked, cols, &mut direct)
        .unwrap();
    let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
    for t in 0..2 {
        gathered.dequantize_row(t, &mut a).unwrap();
        direct.dequantize_row(t, &mut b).unwrap();
        assert_eq!(a, b);
    }
    assert!(gathered.gather_rows(&x, &[5]).is_err());
}

#[test]
fn kernel_bench_reports_every_kernel_with_positive_rates() {
    let config = ossterm::bench::kernels::KernelBenchConfig::quick();
    let report = ossterm::bench::kernels::run_kernel_bench(kernels(), &config).unwrap();
    // Per thread count and format: a GEMV of each token count it takes (the quick config's
    // largest token count is above that), plus one GEMM per token count.
    let max_gemv = ossterm::kernels::MAX_GEMV_TOKENS;
    assert!(config.gemm_tokens.iter().any(|&t| t >= max_gemv));
    // Where the kernels prefer tiles (every SIMD path; the quick shape's rows fill whole tiles),
    // every format and the streamed products are measured again in tiles.
    let per_format = max_gemv + config.gemm_tokens.len();
    let layouts = if kernels().prefers_tiled_mxfp4() {
        2
    } else {
        1
    };
    assert_eq!(
        report.results.len(),
        config.thread_counts.len() * layouts * (3 * per_format + config.stream_tokens.len())
    );
    // The streamed products read every matrix once per run, with each token count asked for.
    let streamed: Vec<usize> = report
        .results
        .iter()
        .filter(|r| r.kernel == "mxfp4_stream" && r.threads == config.thread_counts[0])
        .map(|r| {
            assert_eq!(
                r.weight_bytes,
                config.experts * config.rows * config.cols / 32 * 17
            );
            assert_eq!(
                r.macs,
                config.experts * config.rows * config.cols * r.tokens
            );
            r.tokens
        })
        .collect();
    assert_eq!(streamed, config.stream_tokens);
    for r in &report.results {
        assert!(
            r.best_seconds > 0.0 && r.best_seconds <= r.median_seconds,
            "{r:?}"
        );
        assert!(
            r.best_gb_per_s.is_finite() && r.best_gb_per_s > 0.0,
            "{r:?}"
        );
        assert!(
            r.best_gmac_per_s.is_finite() && r.best_gmac_per_s > 0.0,
            "{r:?}"
        );
    }
    for (tokens, gemv) in report.results[..max_gemv].iter().enumerate() {
        assert_eq!(gemv.kernel, "mxfp4_gemv");
        assert_eq!(gemv.tokens, tokens + 1);
        assert_eq!(
            gemv.weight_bytes,
            config.experts * config.rows * config.cols / 32 * 17
        );
        assert_eq!(
            gemv.macs,
            config.experts * config.rows * config.cols * (tokens + 1)
        );
    }
    assert!(report.to_string().contains("mxfp4_gemm"));
    // Every report names its CPU; SIMD paths measure the int8 peak per thread count and relate
    // every GEMM (and only the GEMMs) to it.
    let text = report.to_string();
    assert!(text.starts_with("cpu "), "{text}");
    assert!(!report.cpu.name.is_empty());
    if kernels().path() == KernelPath::Scalar {
        assert!(report.int8_peak.is_empty());
    } else {
        let threads: Vec<usize> = report.int8_peak.iter().map(|p| p.threads).collect();
        assert_eq!(threads, config.thread_counts);
        assert!(report.int8_peak.iter().all(|p| p.gmac_per_s > 0.0));
        assert!(text.contains("int8 MAC peak"), "{text}");
        for r in &report.results {
            assert_eq!(
                r.peak_fraction.is_some(),
                !r.kernel.ends_with("gemv"),
                "{r:?}"
            );
        }
    }
    // The plain read bandwidth per thread count, and every GEMV and streamed product (never a
    // GEMM) as a fraction of it.
    let threads: Vec<usize> = report.read_bandwidth.iter().map(|b| b.threads).collect();
    assert_eq!(threads, config.thread_counts);
    assert!(report
        .read_bandwidth
        .iter()
        .all(|b| b.best_gb_per_s > 0.0 && b.best_gb_per_s >= b.median_gb_per_s));
    assert!(
        text.contains("read bandwidth") && text.contains("% read"),
        "{text}"
    );
    for r in &report.results {
        assert_eq!(
            r.bandwidth_fraction.is_some(),
            !r.kernel.ends_with("gemm"),
            "{r:?}"
        );
    }
    // The `amx` path also measures the matrix unit's peak and relates its GEMM rows to it (those
    // the matrix unit runs); other paths have neither.
    if kernels().path() == KernelPath::Amx {
        let threads: Vec<usize> = report.tile_peak.iter().map(|p| p.threads).collect();
        assert_eq!(threads, config.thread_counts);
        assert!(report.tile_peak.iter().all(|p| p.gmac_per_s > 0.0));
        assert!(text.contains("AMX tile peak"), "{text}");
    } else {
        assert!(report.tile_peak.is_empty());
    }
    for r in &report.results {
        let on_tiles = kernels().path() == KernelPath::Amx
            && matches!(r.kernel.as_str(), "mxfp4_tiles_gemm" | "q8_tiles_gemm")
            && r.tokens >= ossterm::kernels::AMX_MIN_ROWS;
        assert_eq!(r.tile_fraction.is_some(), on_tiles, "{r:?}");
    }
    let json = serde_json::to_value(&report).unwrap();
    assert!(json["cpu"]["flags"].is_array() && json["int8_peak"].is_array());
    assert!(json["read_bandwidth"].is_array() && json["tile_peak"].is_array());
}

/// The AMX peak probe multiplies what it says: four `tdpbssd` of ones (K = 64) a round, so the
/// first sum tile holds 64 per round; `None` off the `amx` path.
#[test]
fn the_tile_peak_probe_computes_its_products() {
    use ossterm::kernels::TILE_PROBE_ROUND_MACS;
    assert_eq!(TILE_PROBE_ROUND_MACS, 4 * 16 * 16 * 64);
    for k in Kernels::all_supported() {
        for rounds in [0usize, 1, 7, 1000] {
            let want = (k.path() == KernelPath::Amx).then_some(64 * rounds as i32);
            assert_eq!(k.tile_mac_probe(rounds), want, "{:?}", k.path());
        }
    }
}

#[test]
fn the_int8_peak_probe_computes_the_same_products_on_every_path() {
    use ossterm::kernels::PROBE_ROUND_MACS;
    // Chain g multiplies (1 + g % 3) by (g % 5 - 2); a round is 64 of each of 16 chains.
    let per_round: i64 = (0..16).map(|g| 64 * (1 + g % 3) * (g % 5 - 2)).sum();
    assert_eq!(PROBE_ROUND_MACS, 16 * 64);
    for rounds in [0usize, 1, 7, 1000] {
        for k in Kernels::all_supported() {
            assert_eq!(
                k.int8_mac_probe(rounds),
                per_round * rounds as i64,
                "{} with {rounds} rounds",
                k.path()
            );
        }
    }
}

#[test]
fn split_rows_hold_exactly_what_int8_missed() {
    let mut rng = rng(41);
    for cols in [32usize, 96, 2880] {
        let rows = 3;
        let x = random_f32(&mut rng, rows * cols, 4.0);
        let mut staged = vec![f32::NAN; 2 * rows * cols];
        kernels().split_rows(&x, cols, &mut staged).unwrap();
        let mut first = Q8Activations::new();
        kernels()
            .quantize_activation_rows_with(&x, cols, ScaleRule::PowerOfTwo, true, &mut first)
            .unwrap();
        let mut dequantized = vec![0.0; cols];
        for r in 0..rows {
            first.dequantize_row(r, &mut dequantized).unwrap();
            let exact = &staged[2 * r * cols..(2 * r + 1) * cols];
            let missed = &staged[(2 * r + 1) * cols..(2 * r + 2) * cols];
            assert_eq!(exact, &x[r * cols..(r + 1) * cols]);
            for k in 0..cols {
                assert_eq!(
                    missed[k],
                    x[r * cols + k] - dequantized[k],
                    "cols {cols} row {r} element {k}"
                );
            }
        }
        // Two int8 rows carry the value to within the second row's rounding: half a step of at
        // most 2 x max|missed| / 127, where max|missed| is half a step of at most 2 x max / 127.
        let mut both = Q8Activations::new();
        kernels()
            .quantize_activation_rows_with(&staged, cols, ScaleRule::PowerOfTwo, true, &mut both)
            .unwrap();
        let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
        both.dequantize_row(0, &mut a).unwrap();
        both.dequantize_row(1, &mut b).unwrap();
        let amax = x[..cols].iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for k in 0..cols {
            assert!(
                (a[k] + b[k] - x[k]).abs() <= amax / 127.0 / 127.0 * 1.01,
                "element {k}"
            );
        }
    }
    let mut small = vec![0.0; 10];
    assert!(kernels().split_rows(&[0.0; 32], 32, &mut small).is_err());
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn tiling_keeps_every_weight_and_scale_and_refuses_partial_tiles() {
    let mut rng = rng(21);
    for (rows, cols) in [(16, 32), (32, 96), (48, 2880)] {
        let data = Mxfp4Data::random(&mut rng, rows, cols, 0..=254);
        let tiled = TiledData::from(&data);
        assert_ne!(tiled.blocks, data.blocks, "{rows}x{cols}: bytes moved");
        let (w, t) = (data.matrix(), tiled.matrix());
        assert_eq!(t.layout(), Mxfp4Layout::Tiles);
        let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
        for r in 0..rows {
            w.dequantize_row(r, &mut a).unwrap();
            t.dequantize_row(r, &mut b).unwrap();
            assert_eq!(bits(&a), bits(&b), "{rows}x{cols} row {r}");
        }
    }
    let data = Mxfp4Data::random(&mut rng, 20, 64, 120..=130);
    let (mut blocks, mut scales) = (vec![0; data.blocks.len()], vec![0; data.scales.len()]);
    assert!(tile_mxfp4(20, 64, &data.blocks, &data.scales, &mut blocks, &mut scales).is_err());
    assert!(Mxfp4Matrix::new_tiled(20, 64, &blocks, &scales).is_err());
    assert!(tile_mxfp4(16, 64, &data.blocks, &data.scales, &mut blocks, &mut scales).is_err());
}

/// A product on row-order (`tiled` false) or tiled weights, as the tiled-layout tests run it.
type Product<'a> = &'a dyn Fn(Kernels, bool, &Q8Activations, Range<usize>, &mut [f32]);

/// One matrix's tiled products on every path in `paths`, for the tokens of `x`: against the
/// scalar reference on the row order, over row ranges that start and end inside tiles; on
/// AVX-512 bit for bit the row-order GEMM (from 2 tokens: one token in row order takes the
/// GEMV, another summing order), the GEMV entry (up to its token limit) and, where the CPU has
/// VBMI, the other nibble decode. `gemm` and `gemv` run the product; `dequantize` gives a
/// row-order row for the error bounds.
fn check_tiled_products(
    what: &str,
    (rows, cols): (usize, usize),
    x: &Q8Activations,
    paths: &[Kernels],
    dequantize: &dyn Fn(usize, &mut [f32]),
    gemm: Product<'_>,
    gemv: Product<'_>,
) {
    let tokens = x.rows();
    for range in [0..rows, 3..rows - 5, 16..rows, 1..MXFP4_TILE_ROWS - 1] {
        let n = range.len();
        let what = format!("{what} {rows}x{cols} M={tokens} rows {range:?}");
        let mut expected = vec![0.0; tokens * n];
        gemm(scalar(), false, x, range.clone(), &mut expected);
        let bounds = magnitude_bounds(range.clone(), cols, dequantize, x);
        for &k in paths {
            let mut got = vec![f32::NAN; tokens * n];
            gemm(k, true, x, range.clone(), &mut got);
            let what = format!("{what} {}", k.path());
            assert_close(&what, &got, &expected, &bounds);
            let mut other = vec![f32::NAN; tokens * n];
            if k.path() == KernelPath::Scalar {
                continue;
            }
            if matches!(k.path(), KernelPath::Avx2 | KernelPath::Avx2Vnni) {
                // One tile kernel behind both entries.
                if tokens <= MAX_GEMV_TOKENS {
                    gemv(k, true, x, range.clone(), &mut other);
                    assert_eq!(bits(&got), bits(&other), "{what}: GEMV entry");
                }
                continue;
            }
            if tokens > 1 {
                gemm(k, false, x, range.clone(), &mut other);
                assert_eq!(bits(&got), bits(&other), "{what}: row order");
            }
            if tokens <= MAX_GEMV_TOKENS {
                gemv(k, true, x, range.clone(), &mut other);
                assert_eq!(bits(&got), bits(&other), "{what}: GEMV entry");
            }
            if k.uses_vbmi() {
                gemm(k.without_vbmi(), true, x, range.clone(), &mut other);
                assert_eq!(bits(&got), bits(&other), "{what}: other nibble decode");
            }
        }
    }
}

/// Token counts on both sides of the in-register limits and into the scratch path; for the
/// nibble formats (passes of up to 12) they run passes of every width from 1 to 12 (21 as 11 +
/// 10), and 24 is the last call in registers.
const TILED_TOKENS: [usize; 13] = [1, 2, 3, 4, 5, 8, 9, 12, 13, 17, 21, 24, 40];

/// Ragged columns (short last groups) and the model's 2880.
const TILED_SHAPES: [(usize, usize); 5] = [(16, 32), (48, 160), (32, 96), (64, 2880), (32, 4128)];

/// Tiled MXFP4 products ([`check_tiled_products`]), also at extreme and zero scales.
#[test]
fn tiled_mxfp4_products_match_the_row_order_on_every_path() {
    let mut rng = rng(22);
    let mut paths = vec![scalar()];
    paths.extend(simd_paths());
    for shape @ (rows, cols) in TILED_SHAPES {
        // The top range stays below f32 overflow (infinite sums cannot be compared closely).
        for scales in [118..=130, 0..=3, 225..=235] {
            let data = Mxfp4Data::random(&mut rng, rows, cols, scales.clone());
            let tiled = TiledData::from(&data);
            let (w, t) = (data.matrix(), tiled.matrix());
            let mut scratch = GemmScratch::new(cols);
            let scratch = std::cell::RefCell::new(&mut scratch);
            let pick = |tiled: bool| if tiled { t } else { w };
            for tokens in TILED_TOKENS {
                let mut x = Q8Activations::new();
                kernels()
                    .quantize_activation_rows(
                        &random_f32(&mut rng, tokens * cols, 3.0),
                        cols,
                        &mut x,
                    )
                    .unwrap();
                check_tiled_products(
                    &format!("tiled MXFP4 scales {scales:?}"),
                    shape,
                    &x,
                    &paths,
                    &|r, out| w.dequantize_row(r, out).unwrap(),
                    &|k, tiled, x, range, out| {
                        let mut scratch = scratch.borrow_mut();
                        k.mxfp4_gemm(&pick(tiled), x, range, out, &mut scratch)
                            .unwrap()
                    },
                    &|k, tiled, x, range, out| k.mxfp4_gemv(&pick(tiled), x, range, out).unwrap(),
                );
            }
        }
    }
}

/// A block-quantized matrix with a tile layout, as the tiled-product tests take it.
trait TiledMatrix: Sized {
    const NAME: &'static str;
    fn from_bf16(rows: usize, cols: usize, bits: &[u16]) -> Result<Self, KernelError>;
    fn to_tiles(&self) -> Result<Self, KernelError>;
    fn is_tiled(&self) -> bool;
    fn size_bytes(&self) -> usize;
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError>;
    fn gemm(
        &self,
        k: Kernels,
        x: &Q8Activations,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError>;
    fn gemv(
        &self,
        k: Kernels,
        x: &Q8Activations,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError>;
}

macro_rules! tiled_matrix {
    ($matrix:ty, $name:literal, $gemm:ident, $gemv:ident) => {
        impl TiledMatrix for $matrix {
            const NAME: &'static str = $name;
            fn from_bf16(rows: usize, cols: usize, bits: &[u16]) -> Result<Self, KernelError> {
                <$matrix>::from_bf16(rows, cols, bits)
            }
            fn to_tiles(&self) -> Result<Self, KernelError> {
                <$matrix>::to_tiles(self)
            }
            fn is_tiled(&self) -> bool {
                <$matrix>::is_tiled(self)
            }
            fn size_bytes(&self) -> usize {
                <$matrix>::size_bytes(self)
            }
            fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
                <$matrix>::dequantize_row(self, row, out)
            }
            fn gemm(
                &self,
                k: Kernels,
                x: &Q8Activations,
                rows: std::ops::Range<usize>,
                out: &mut [f32],
                scratch: &mut GemmScratch,
            ) -> Result<(), KernelError> {
                k.$gemm(self, x, rows, out, scratch)
            }
            fn gemv(
                &self,
                k: Kernels,
                x: &Q8Activations,
                rows: std::ops::Range<usize>,
                out: &mut [f32],
            ) -> Result<(), KernelError> {
                k.$gemv(self, x, rows, out)
            }
        }
    };
}

tiled_matrix!(Q8Matrix, "tiled Q8", q8_gemm, q8_gemv);
tiled_matrix!(Q4Matrix, "tiled Q4", q4_gemm, q4_gemv);

/// Tiled products of `M` ([`check_tiled_products`]) on random weights: the tiled copy holds the
/// same values in no more bytes; rows that do not fill whole tiles are refused.
fn check_tiled_matrix<M: TiledMatrix>(seed: u64) {
    let mut rng = rng(seed);
    let mut paths = vec![scalar()];
    paths.extend(simd_paths());
    for shape @ (rows, cols) in TILED_SHAPES {
        let weights = to_bf16(&random_f32(&mut rng, rows * cols, 0.2));
        let plain = M::from_bf16(rows, cols, &weights).unwrap();
        let tiled = plain.to_tiles().unwrap();
        assert!(tiled.is_tiled() && !plain.is_tiled());
        assert!(tiled.size_bytes() <= plain.size_bytes());
        let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
        for r in 0..rows {
            plain.dequantize_row(r, &mut a).unwrap();
            tiled.dequantize_row(r, &mut b).unwrap();
            assert_eq!(bits(&a), bits(&b), "{} {rows}x{cols} row {r}", M::NAME);
        }
        let mut scratch = GemmScratch::new(cols);
        let scratch = std::cell::RefCell::new(&mut scratch);
        let pick = |is_tiled: bool| if is_tiled { &tiled } else { &plain };
        for tokens in TILED_TOKENS {
            let mut x = Q8Activations::new();
            kernels()
                .quantize_activation_rows(&random_f32(&mut rng, tokens * cols, 2.0), cols, &mut x)
                .unwrap();
            check_tiled_products(
                M::NAME,
                shape,
                &x,
                &paths,
                &|r, o| plain.dequantize_row(r, o).unwrap(),
                &|k, is_tiled, x, range, out| {
                    let mut scratch = scratch.borrow_mut();
                    pick(is_tiled).gemm(k, x, range, out, &mut scratch).unwrap()
                },
                &|k, is_tiled, x, range, out| pick(is_tiled).gemv(k, x, range, out).unwrap(),
            );
        }
    }
    let weights = to_bf16(&random_f32(&mut rng, 20 * 64, 0.2));
    assert!(M::from_bf16(20, 64, &weights).unwrap().to_tiles().is_err());
}

/// The attention projections' and unembedding's layout on AVX-512.
#[test]
fn tiled_q8_products_match_the_row_order_on_every_path() {
    check_tiled_matrix::<Q8Matrix>(23);
}

/// `x_values` quantized as split rows are (power-of-two scales) through `product(tiled, x, out)`:
/// a batch must give each token, bit for bit, its results alone in the tile layout (one token
/// multiplies the scales, a batch adds exponents or shifts sums), and on AVX-512 the row order's
/// results (the same sum order there; the AVX2 paths' row order is another kernel).
fn check_power_of_two_batch(
    k: Kernels,
    what: &str,
    (rows, cols): (usize, usize),
    x_values: &[f32],
    product: &mut dyn FnMut(bool, &Q8Activations, &mut [f32]),
) {
    let quantize = |values: &[f32]| {
        let mut x = Q8Activations::new();
        k.quantize_activation_rows_with(values, cols, ScaleRule::PowerOfTwo, true, &mut x)
            .unwrap();
        x
    };
    let x = quantize(x_values);
    let mut batch = vec![f32::NAN; x.rows() * rows];
    product(true, &x, &mut batch);
    if !matches!(k.path(), KernelPath::Avx2 | KernelPath::Avx2Vnni) {
        let mut row_order = vec![f32::NAN; x.rows() * rows];
        product(false, &x, &mut row_order);
        assert_eq!(bits(&batch), bits(&row_order), "{what}: row order");
    }
    for (t, token) in x_values.chunks_exact(cols).enumerate() {
        let mut alone = vec![f32::NAN; rows];
        product(true, &quantize(token), &mut alone);
        assert_eq!(
            bits(&batch[t * rows..(t + 1) * rows]),
            bits(&alone),
            "{what}: token {t}"
        );
    }
}

/// Split rows' power-of-two activation scales let the AVX-512 Q8 products scale by adding
/// exponents (from 4 tokens on): a token's results in a batch must be, bit for bit, its results
/// alone in the tile layout (one token multiplies the scales), through registers and scratch,
/// and the row-order GEMM's; a zero weight scale (no exponent for it) falls back to multiplying.
#[test]
fn q8_products_with_power_of_two_activations_match_single_tokens() {
    let mut rng = rng(31);
    for (rows, cols) in [(32, 96), (64, 2880), (48, 4128)] {
        let mut values = random_f32(&mut rng, rows * cols, 0.2);
        for zero_block in [false, true] {
            if zero_block {
                values[5 * cols + 32..5 * cols + 64].fill(0.0);
            }
            let plain = Q8Matrix::from_bf16(rows, cols, &to_bf16(&values)).unwrap();
            let tiled_matrix = plain.to_tiles().unwrap();
            let mut scratch = GemmScratch::new(cols);
            for tokens in [4, 5, 9, 12, 17, 40, 70] {
                let x_values = random_f32(&mut rng, tokens * cols, 2.0);
                for k in simd_paths() {
                    let what = format!(
                        "{} {rows}x{cols} M={tokens} zero block {zero_block}",
                        k.path()
                    );
                    check_power_of_two_batch(
                        k,
                        &what,
                        (rows, cols),
                        &x_values,
                        &mut |tiled, x, out| {
                            let w = if tiled { &tiled_matrix } else { &plain };
                            k.q8_gemm(w, x, 0..rows, out, &mut scratch).unwrap()
                        },
                    );
                }
            }
        }
    }
}

/// MXFP4 weights against split rows: both scales powers of two, so the AVX-512 products apply
/// them with no float multiply (from 4 tokens on, where every product and its shifted form are
/// normal floats) and with an exponent add or a multiply elsewhere: a token's results in a
/// batch must be, bit for bit, its results alone (one token multiplies), in the tile layout and
/// in row order, at ordinary and at extreme scale bytes.
#[test]
fn mxfp4_products_with_power_of_two_activations_match_single_tokens() {
    let mut rng = rng(37);
    for (rows, cols) in [(32, 96), (64, 2880), (48, 4128)] {
        for scales in [118..=130, 1..=12, 226..=254] {
            let data = Mxfp4Data::random(&mut rng, rows, cols, scales);
            let tiled = TiledData::from(&data);
            let (plain, tiled_matrix) = (data.matrix(), tiled.matrix());
            let mut scratch = GemmScratch::new(cols);
            // 5 and 13 (7 + 6) give the assembly loop's narrowest groups too.
            for tokens in [4, 5, 7, 9, 12, 13, 17, 21, 24, 40] {
                let x_values = random_f32(&mut rng, tokens * cols, 3.0);
                for k in simd_paths() {
                    let what = format!("{} {rows}x{cols} M={tokens}", k.path());
                    check_power_of_two_batch(
                        k,
                        &what,
                        (rows, cols),
                        &x_values,
                        &mut |tiled, x, out| {
                            let w = if tiled { &tiled_matrix } else { &plain };
                            k.mxfp4_gemm(w, x, 0..rows, out, &mut scratch).unwrap()
                        },
                    );
                }
            }
        }
    }
}

/// On a CPU with AVX-512 VBMI, the tiled MXFP4 and Q4 GEMMs of 2-24 tokens run the loop in
/// assembly, and so do `mxfp4_product` and `q4_product` from 2 tokens (they send 2-4 to the GEMM
/// entry): the
/// loop's bits are the intrinsics kernel's (which the tests above compare with the row-order
/// GEMM), so only its count shows that it ran. Other tests may run it meanwhile: the count only
/// has to grow.
#[test]
fn the_assembly_loop_runs_the_calls_of_two_to_twenty_four_tokens() {
    let Some(vbmi) = simd_paths().into_iter().find(|k| k.uses_vbmi()) else {
        eprintln!("skipped: this CPU has no AVX-512 VBMI");
        return;
    };
    let (rows, cols) = (32, 2880);
    let data = Mxfp4Data::random(&mut rng(41), rows, cols, 118..=130);
    let tiled = TiledData::from(&data);
    let w = tiled.matrix();
    let q4 = Q4Matrix::from_bf16(
        rows,
        cols,
        &to_bf16(&random_f32(&mut rng(43), rows * cols, 0.2)),
    )
    .unwrap()
    .to_tiles()
    .unwrap();
    let mut scratch = GemmScratch::new(cols);
    #[derive(Clone, Copy, Debug)]
    enum Call {
        Mxfp4Gemm,
        Mxfp4Product,
        Q4Gemm,
        Q4Product,
    }
    let run = |k: Kernels, tokens: usize, call: Call, scratch: &mut GemmScratch| {
        let mut x = Q8Activations::new();
        let values = random_f32(&mut rng(7), tokens * cols, 3.0);
        kernels()
            .quantize_activation_rows(&values, cols, &mut x)
            .unwrap();
        let mut out = vec![0.0; tokens * rows];
        let before = ossterm::kernels::nibble_assembly_count();
        match call {
            Call::Mxfp4Gemm => k.mxfp4_gemm(&w, &x, 0..rows, &mut out, scratch),
            Call::Mxfp4Product => k.mxfp4_product(&w, &x, 0..rows, &mut out, scratch),
            Call::Q4Gemm => k.q4_gemm(&q4, &x, 0..rows, &mut out, scratch),
            Call::Q4Product => k.q4_product(&q4, &x, 0..rows, &mut out, scratch),
        }
        .unwrap();
        ossterm::kernels::nibble_assembly_count() > before
    };
    for tokens in [2, 3, 4, 5, 8, 12, 13, 24] {
        for call in [
            Call::Mxfp4Gemm,
            Call::Mxfp4Product,
            Call::Q4Gemm,
            Call::Q4Product,
        ] {
            assert!(
                run(vbmi, tokens, call, &mut scratch),
                "{tokens} tokens ({call:?}): the loop did not run"
            );
        }
    }
}

/// The draft unembedding's layout (and `--weights q4`'s) on AVX-512.
#[test]
fn tiled_q4_products_match_the_row_order_on_every_path() {
    check_tiled_matrix::<Q4Matrix>(29);
}

/// The `avx2-vnni` path's tile products give plain AVX2's bits (`vpdpbusd` sums what
/// `vpmaddubsw` + `vpmaddwd` sum; for Q8, what the sign trick on the signed bytes sums), and on
/// both AVX2 paths a token's result does not depend on the tokens beside it (one or two tokens
/// take a pass over the whole tile, more take passes over each half), for MXFP4, Q8 and Q4.
#[test]
fn avx2_tile_products_match_across_paths_and_batches() {
    let Ok(vnni) = Kernels::new(KernelPath::Avx2Vnni) else {
        eprintln!("skipped: this CPU runs no 256-bit vpdpbusd");
        return;
    };
    let plain = Kernels::new(KernelPath::Avx2).expect("a CPU with VNNI has AVX2");
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Tiles {
        Mxfp4,
        Q8,
        Q4,
    }
    let mut rng = rng(31);
    for (rows, cols) in [(48, 160), (64, 2880)] {
        let data = Mxfp4Data::random(&mut rng, rows, cols, 118..=130);
        let tiled = TiledData::from(&data);
        let mxfp4 = tiled.matrix();
        let mut bf16 = || to_bf16(&random_f32(&mut rng, rows * cols, 0.2));
        let q8 = Q8Matrix::from_bf16(rows, cols, &bf16())
            .unwrap()
            .to_tiles()
            .unwrap();
        let q4 = Q4Matrix::from_bf16(rows, cols, &bf16())
            .unwrap()
            .to_tiles()
            .unwrap();
        let tokens = 6;
        let values = random_f32(&mut rng, tokens * cols, 3.0);
        let quantize = |values: &[f32]| {
            let mut x = Q8Activations::new();
            kernels()
                .quantize_activation_rows(values, cols, &mut x)
                .unwrap();
            x
        };
        let mut scratch = GemmScratch::new(cols);
        let mut product = |k: Kernels, tiles: Tiles, x: &Q8Activations| {
            let mut out = vec![f32::NAN; x.rows() * rows];
            let s = &mut scratch;
            match tiles {
                Tiles::Mxfp4 => k.mxfp4_gemm(&mxfp4, x, 0..rows, &mut out, s),
                Tiles::Q8 => k.q8_gemm(&q8, x, 0..rows, &mut out, s),
                Tiles::Q4 => k.q4_gemm(&q4, x, 0..rows, &mut out, s),
            }
            .unwrap();
            out
        };
        for n in 1..=tokens {
            let x = quantize(&values[..n * cols]);
            let what = format!("{rows}x{cols} M={n}");
            for tiles in [Tiles::Mxfp4, Tiles::Q8, Tiles::Q4] {
                assert_eq!(
                    bits(&product(vnni, tiles, &x)),
                    bits(&product(plain, tiles, &x)),
                    "{what} {tiles:?}: avx2"
                );
            }
            let cases = [
                (plain, Tiles::Mxfp4),
                (vnni, Tiles::Mxfp4),
                (plain, Tiles::Q8),
                (vnni, Tiles::Q8),
                (plain, Tiles::Q4),
                (vnni, Tiles::Q4),
            ];
            for (k, tiles) in cases {
                let batch = product(k, tiles, &x);
                for t in 0..n {
                    let alone = product(k, tiles, &quantize(&values[t * cols..][..cols]));
                    assert_eq!(
                        bits(&batch[t * rows..][..rows]),
                        bits(&alone),
                        "{what} {} {tiles:?}: token {t} alone",
                        k.path()
                    );
                }
            }
        }
    }
}

/// The `amx` and `avx512` kernels, or `None` after saying why where the CPU or OS has no AMX.
fn amx_and_avx512() -> Option<(Kernels, Kernels)> {
    let Some(amx) = Kernels::all_supported()
        .into_iter()
        .find(|k| k.path() == KernelPath::Amx)
    else {
        eprintln!(
            "skipped: no AMX here ({})",
            KernelPath::amx_unavailable_reason().unwrap_or_default()
        );
        return None;
    };
    let avx512 = Kernels::new(KernelPath::Avx512).expect("AMX CPUs have AVX-512");
    Some((amx, avx512))
}

/// Runs `check(x, rows, what)` for the AMX cases of a `rows x cols` matrix: token counts from the
/// fewest the matrix unit takes to past a pass of 128, with last token tiles of each size the
/// kernel scales apart (1-4, 5-8, 9-12, 13-16 tokens), `max / 127` and power-of-two activation
/// scales, all rows and a range that cuts tiles.
fn for_each_amx_case(
    rng: &mut ChaCha8Rng,
    amx: &Kernels,
    (rows, cols): (usize, usize),
    mut check: impl FnMut(&Q8Activations, Range<usize>, &str),
) {
    let fewest = ossterm::kernels::AMX_MIN_ROWS;
    for tokens in [fewest, fewest + 1, 16, 17, 24, 31, 44, 65, 130] {
        let values = random_f32(rng, tokens * cols, 3.0);
        for rule in [ScaleRule::Tight, ScaleRule::PowerOfTwo] {
            let mut x = Q8Activations::new();
            amx.quantize_activation_rows_with(&values, cols, rule, true, &mut x)
                .unwrap();
            for range in [0..rows, 5..rows - 3] {
                let what = format!("M={tokens} {rule:?} rows {range:?}");
                check(&x, range, &what);
            }
        }
    }
}

/// `product` on the `amx` path runs on the matrix unit, is within the sum-order tolerance of
/// `expected` and has the `avx512` path's bits.
fn assert_amx_product(
    what: &str,
    (amx, avx512): (&Kernels, &Kernels),
    (expected, bounds): (&[f32], &[f32]),
    mut product: impl FnMut(&Kernels, &mut [f32]),
) {
    let mut got = vec![f32::NAN; expected.len()];
    // Other tests may run GEMMs on the matrix unit meanwhile: the count only has to grow.
    let before = ossterm::kernels::amx_gemm_count();
    product(amx, &mut got);
    assert!(
        ossterm::kernels::amx_gemm_count() > before,
        "{what}: the amx path did not use the matrix unit"
    );
    assert_close(what, &got, expected, bounds);
    let mut other = vec![f32::NAN; expected.len()];
    product(avx512, &mut other);
    assert_eq!(bits(&got), bits(&other), "{what}: AVX-512 bits");
}

/// The AMX GEMM (the `amx` path's tiled MXFP4 products of `AMX_MIN_ROWS` rows and more) gives
/// the AVX-512 tile GEMM's bits, and so the scalar reference's results within the sum-order tolerance, in
/// every case of [`for_each_amx_case`], with odd numbers of token and weight tiles and zero and
/// extreme weight scales. Skipped, saying so, where the CPU or OS has no AMX.
#[test]
fn amx_gemm_gives_the_avx512_bits_across_passes_and_scales() {
    let Some((amx, avx512)) = amx_and_avx512() else {
        return;
    };
    let mut rng = rng(41);
    for (rows, cols, scales) in [
        (48, 160, 118..=130),
        (64, 2880, 118..=130),
        (80, 96, 0..=3),
        (32, 128, 225..=235),
    ] {
        let data = Mxfp4Data::random(&mut rng, rows, cols, scales.clone());
        let tiled = TiledData::from(&data);
        let (w, t) = (data.matrix(), tiled.matrix());
        let mut scratch = GemmScratch::new(cols);
        for_each_amx_case(&mut rng, &amx, (rows, cols), |x, range, case| {
            let what = format!("AMX {rows}x{cols} scales {scales:?} {case}");
            let (expected, bounds) = mxfp4_reference(&w, x, range.clone(), &mut scratch);
            assert_amx_product(&what, (&amx, &avx512), (&expected, &bounds), |k, out| {
                k.mxfp4_gemm(&t, x, range.clone(), out, &mut scratch)
                    .unwrap()
            });
        });
    }
}

/// The matrix unit keeps each thread's last packed activations and reuses them while their
/// buffer holds the same quantization (every task of a product packs the same rows): a buffer
/// quantized again with new values of the same shape, then with fewer rows, must give the new
/// values' products, the AVX-512 path's bits.
#[test]
fn amx_gemm_packs_again_what_is_quantized_again_into_the_same_buffer() {
    let Some((amx, avx512)) = amx_and_avx512() else {
        return;
    };
    let mut rng = rng(47);
    let (rows, cols) = (32, 2880);
    let data = Mxfp4Data::random(&mut rng, rows, cols, 118..=130);
    let tiled = TiledData::from(&data);
    let t = tiled.matrix();
    let mut scratch = GemmScratch::new(cols);
    let mut x = Q8Activations::new();
    for (round, tokens) in [40, 40, 17].into_iter().enumerate() {
        let values = random_f32(&mut rng, tokens * cols, 3.0);
        amx.quantize_activation_rows(&values, cols, &mut x).unwrap();
        let [on_the_matrix_unit, on_avx512] = [&amx, &avx512].map(|k| {
            let mut out = vec![f32::NAN; tokens * rows];
            k.mxfp4_gemm(&t, &x, 0..rows, &mut out, &mut scratch)
                .unwrap();
            out
        });
        assert_eq!(
            bits(&on_the_matrix_unit),
            bits(&on_avx512),
            "round {round} ({tokens} tokens): AVX-512 bits"
        );
    }
}

/// The AMX Q8 GEMM (the `amx` path's tiled Q8 products of `AMX_MIN_ROWS` rows and more: the
/// attention projections of a prompt) gives the AVX-512 tile GEMM's bits, and the scalar reference's
/// results within the sum-order tolerance, in every case of [`for_each_amx_case`], with odd
/// token and weight tiles, column counts with a short last group or a single partial one, and
/// weights small enough for subnormal f16 scales or large. Skipped, saying so, where the CPU or
/// OS has no AMX.
#[test]
fn amx_q8_gemm_gives_the_avx512_bits_across_passes_and_scales() {
    let Some((amx, avx512)) = amx_and_avx512() else {
        return;
    };
    let mut rng = rng(43);
    for (rows, cols, magnitude) in [
        (48, 2880, 0.2),
        (32, 160, 1.0),
        (80, 96, 3e-6),
        (16, 4096, 2e3),
    ] {
        let weights = to_bf16(&random_f32(&mut rng, rows * cols, magnitude));
        let q8 = Q8Matrix::from_bf16(rows, cols, &weights).unwrap();
        let tiled = q8.to_tiles().unwrap();
        let mut scratch = GemmScratch::new(cols);
        for_each_amx_case(&mut rng, &amx, (rows, cols), |x, range, case| {
            let what = format!("AMX Q8 {rows}x{cols} weights {magnitude} {case}");
            let mut expected = vec![0.0; x.rows() * range.len()];
            scalar()
                .q8_gemm(&q8, x, range.clone(), &mut expected, &mut scratch)
                .unwrap();
            let bounds = magnitude_bounds(
                range.clone(),
                cols,
                |r, o| q8.dequantize_row(r, o).unwrap(),
                x,
            );
            assert_amx_product(&what, (&amx, &avx512), (&expected, &bounds), |k, out| {
                k.q8_gemm(&tiled, x, range.clone(), out, &mut scratch)
                    .unwrap()
            });
        });
    }
}
