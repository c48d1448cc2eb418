//! AVX-512 kernels: `vpdpbusd` (VNNI) for the integer formats, 16-wide FMA for f32/bf16/f16.
//!
//! Every `pub(crate) unsafe fn` here requires that the CPU supports all of [`REQUIRED`] (the
//! dispatcher guarantees it) and that the caller checked the shapes (the safe methods of
//! `Kernels` do). Given both, every pointer read below stays inside the slices it came from.

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::avx2::prefetch_share;
use super::formats::{
    ByteSpans, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix, BLOCK_LEN, CORRECTION_LANE_MXFP4,
    CORRECTION_LANE_Q4, CORRECTION_LANE_Q8, GROUP_BLOCKS, GROUP_LANES, GROUP_LEN,
};
use super::{GemmScratch, GEMM_TILE_ROWS};

const REQUIRED: [&str; 6] = ["avx512f", "avx512bw", "avx512vnni", "avx2", "fma", "f16c"];

pub(crate) fn missing_features() -> Vec<&'static str> {
    let detected = [
        is_x86_feature_detected!("avx512f"),
        is_x86_feature_detected!("avx512bw"),
        is_x86_feature_detected!("avx512vnni"),
        is_x86_feature_detected!("avx2"),
        is_x86_feature_detected!("fma"),
        is_x86_feature_detected!("f16c"),
    ];
    REQUIRED
        .iter()
        .zip(detected)
        .filter(|(_, ok)| !ok)
        .map(|(name, _)| *name)
        .collect()
}

/// Doubled FP4 values plus 12, so they are unsigned bytes for `vpdpbusd`.
const MXFP4_UNSIGNED: [i8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

/// Which integer format a kernel instance reads; fixed at compile time.
const FORMAT_MXFP4: u8 = 0;
const FORMAT_Q4: u8 = 1;
const FORMAT_Q8: u8 = 2;

/// The lanes of [`Q8Activations::corrections`] that hold this format's block corrections (one
/// per block, lane 4j + k).
const fn correction_mask(format: u8) -> __mmask16 {
    let lane = match format {
        FORMAT_MXFP4 => CORRECTION_LANE_MXFP4,
        FORMAT_Q4 => CORRECTION_LANE_Q4,
        _ => CORRECTION_LANE_Q8,
    };
    0x1111 << lane
}

/// MXFP4 sums use doubled FP4 values.
const fn format_factor(format: u8) -> f32 {
    if format == FORMAT_MXFP4 {
        0.5
    } else {
        1.0
    }
}

/// Sixteen lanes of 2^(s-127) from four E8M0 bytes (lanes 4j..4j+3 from byte j).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn e8m0_lanes(bytes: u32) -> __m512 {
    let spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let exponents = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(bytes as i32), spread));
    _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponents))
}

/// Sixteen lanes from four f16 scales (lanes 4j..4j+3 from scale j).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn f16_lanes(bits: u64) -> __m512 {
    let four = _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64));
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four))
}

/// Activation operands of one group of one token.
#[derive(Clone, Copy)]
struct ActGroup {
    evens: __m512i,
    odds: __m512i,
    /// `-offset x block sum` in one of lanes 4j..4j+3, zeros elsewhere: the starting value of
    /// block j's integer sum.
    correction: __m512i,
    scales: __m512,
}

impl ActGroup {
    /// # Safety
    /// `group < x.groups()` and `token < x.rows()`; the CPU has the module's features.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load(x: &Q8Activations, token: usize, group: usize, mask: __mmask16) -> Self {
        // Tokens are stored back to back, so (token, group) indexes whole groups; raw offsets keep
        // bounds checks out of the inner loops (the caller guarantees both indices are in range).
        let at = token * x.groups + group;
        let quants = x.quants.as_ptr().add(at * GROUP_LEN);
        Self {
            evens: _mm512_loadu_si512(quants.cast()),
            odds: _mm512_loadu_si512(quants.add(GROUP_LEN / 2).cast()),
            correction: _mm512_maskz_loadu_epi32(
                mask,
                x.corrections.as_ptr().add(at * GROUP_LANES),
            ),
            scales: _mm512_loadu_ps(x.scale_lanes.as_ptr().add(at * GROUP_LANES)),
        }
    }
}

/// One group's contribution: unsigned weights (evens, odds) x int8 activations, scaled.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn group_fma(
    acc: __m512,
    w_evens: __m512i,
    w_odds: __m512i,
    w_scales: __m512,
    a: &ActGroup,
) -> __m512 {
    let sums = _mm512_dpbusd_epi32(
        _mm512_dpbusd_epi32(a.correction, w_evens, a.evens),
        w_odds,
        a.odds,
    );
    _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(sums),
        _mm512_mul_ps(w_scales, a.scales),
        acc,
    )
}

/// Unsigned weights (evens, odds) from 64 bytes of nibbles: MXFP4 through the table, Q4 as they are.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn split_nibbles<const FORMAT: u8>(bytes: __m512i) -> (__m512i, __m512i) {
    let low = _mm512_set1_epi8(0x0F);
    let evens = _mm512_and_si512(bytes, low);
    let odds = _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), low);
    if FORMAT == FORMAT_MXFP4 {
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let table =
            _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(MXFP4_UNSIGNED.as_ptr().cast()) });
        (
            _mm512_shuffle_epi8(table, evens),
            _mm512_shuffle_epi8(table, odds),
        )
    } else {
        (evens, odds)
    }
}

/// Where one weight row's group lives, decoded to (evens, odds, scales).
///
/// # Safety
/// `row < rows` of the matrix, `group < ceil(cols / 128)`; the CPU has the module's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn mxfp4_group(w: &Mxfp4Matrix, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
    let blocks_per_row = w.cols / BLOCK_LEN;
    let blocks_here = (blocks_per_row - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
    let bytes = w
        .blocks
        .as_ptr()
        .add(row * (w.cols / 2) + group * GROUP_LEN / 2);
    let scales = w
        .scales
        .as_ptr()
        .add(row * blocks_per_row + group * GROUP_BLOCKS);
    let (nibbles, scale_bytes) = if blocks_here == GROUP_BLOCKS {
        (
            _mm512_loadu_si512(bytes.cast()),
            scales.cast::<u32>().read_unaligned(),
        )
    } else {
        // A row's last group may hold 1-3 blocks; masked-off bytes are not read (no fault) and
        // become nibble 0, whose weight meets zero padding activations.
        let mask = (1u64 << (blocks_here * 16)) - 1;
        let mut scale_bytes = 0u32;
        for j in 0..blocks_here {
            scale_bytes |= (*scales.add(j) as u32) << (8 * j);
        }
        (_mm512_maskz_loadu_epi8(mask, bytes.cast()), scale_bytes)
    };
    let (evens, odds) = split_nibbles::<FORMAT_MXFP4>(nibbles);
    (evens, odds, e8m0_lanes(scale_bytes))
}

/// # Safety
/// As [`mxfp4_group`], for a Q4 matrix.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_group(w: &Q4Matrix, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
    let nibbles = _mm512_loadu_si512(
        w.row_nibbles(row)
            .as_ptr()
            .add(group * GROUP_LEN / 2)
            .cast(),
    );
    let scale_bits = w
        .row_scales(row)
        .as_ptr()
        .add(group * GROUP_BLOCKS)
        .cast::<u64>()
        .read_unaligned();
    let (evens, odds) = split_nibbles::<FORMAT_Q4>(nibbles);
    (evens, odds, f16_lanes(scale_bits))
}

/// # Safety
/// As [`mxfp4_group`], for a Q8 matrix.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_group(w: &Q8Matrix, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
    let quants = w.row_quants(row).as_ptr().add(group * GROUP_LEN);
    let sign = _mm512_set1_epi8(i8::MIN);
    // q ^ 0x80 = q + 128 as an unsigned byte.
    let evens = _mm512_xor_si512(_mm512_loadu_si512(quants.cast()), sign);
    let odds = _mm512_xor_si512(_mm512_loadu_si512(quants.add(GROUP_LEN / 2).cast()), sign);
    let scale_bits = w
        .row_scales(row)
        .as_ptr()
        .add(group * GROUP_BLOCKS)
        .cast::<u64>()
        .read_unaligned();
    (evens, odds, f16_lanes(scale_bits))
}

/// A matrix whose groups decode to unsigned weights (evens, odds) and scale lanes.
trait GroupSource: ByteSpans {
    const FORMAT: u8;
    fn groups(&self) -> usize;
    /// # Safety
    /// `row < rows()`, `group < groups()`; the CPU has the module's features.
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512);
}

impl GroupSource for Mxfp4Matrix<'_> {
    const FORMAT: u8 = FORMAT_MXFP4;
    fn groups(&self) -> usize {
        self.cols.div_ceil(GROUP_LEN)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        mxfp4_group(self, row, group)
    }
}

impl GroupSource for Q4Matrix {
    const FORMAT: u8 = FORMAT_Q4;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        q4_group(self, row, group)
    }
}

impl GroupSource for Q8Matrix {
    const FORMAT: u8 = FORMAT_Q8;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        q8_group(self, row, group)
    }
}

/// `R` rows against one token, sharing each activation load across the rows, while prefetching
/// the rows `prefetch`.
///
/// # Safety
/// `first_row + R <= w.rows()`, `x` has one token of `w`'s columns, `out.len() >= R`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv_rows<W: GroupSource, const R: usize>(
    w: &W,
    x: &Q8Activations,
    first_row: usize,
    prefetch: Range<usize>,
    out: &mut [f32],
) {
    let mut acc = [_mm512_setzero_ps(); R];
    let groups = w.groups();
    let spans = w.byte_spans(prefetch);
    for group in 0..groups {
        prefetch_share(&spans, group, groups);
        let a = ActGroup::load(x, 0, group, correction_mask(W::FORMAT));
        for (i, acc_row) in acc.iter_mut().enumerate() {
            let (evens, odds, scales) = w.load_group(first_row + i, group);
            *acc_row = group_fma(*acc_row, evens, odds, scales, &a);
        }
    }
    for (o, acc_row) in out.iter_mut().zip(acc) {
        *o = format_factor(W::FORMAT) * _mm512_reduce_add_ps(acc_row);
    }
}

/// # Safety
/// The CPU has the module's features; shapes were checked by `Kernels` (one token of `w`'s columns,
/// `rows` inside the matrix, `out.len() == rows.len()`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv<W: GroupSource>(w: &W, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    const ROWS_AT_ONCE: usize = 4;
    const PREFETCH_AHEAD: usize = 2 * ROWS_AT_ONCE;
    let mut row = rows.start;
    let ahead = |row: usize, count: usize| {
        (row + PREFETCH_AHEAD).min(rows.end)..(row + PREFETCH_AHEAD + count).min(rows.end)
    };
    for chunk in out.chunks_mut(ROWS_AT_ONCE) {
        if chunk.len() == ROWS_AT_ONCE {
            gemv_rows::<W, ROWS_AT_ONCE>(w, x, row, ahead(row, ROWS_AT_ONCE), chunk);
        } else {
            for (i, o) in chunk.iter_mut().enumerate() {
                gemv_rows::<W, 1>(w, x, row + i, ahead(row + i, 0), std::slice::from_mut(o));
            }
        }
        row += chunk.len();
    }
}

pub(crate) unsafe fn mxfp4_gemv(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    gemv(w, x, rows, out)
}

pub(crate) unsafe fn q4_gemv(w: &Q4Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    gemv(w, x, rows, out)
}

pub(crate) unsafe fn q8_gemv(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    gemv(w, x, rows, out)
}

/// Decode rows `first_row..first_row + count` into the scratch tile as unsigned bytes in activation
/// order, and their scales into one lane vector per quad of rows and group (lane 4j + r: block j
/// of row r of the quad). Rows past `count` up to the next multiple of 4 are zero with scale 0, so
/// the micro-kernel always works on whole quads.
///
/// # Safety
/// Rows inside the matrix, `count <= GEMM_TILE_ROWS`, scratch sized for the matrix's columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn decode_tile<W: GroupSource>(
    w: &W,
    first_row: usize,
    count: usize,
    scratch: &mut GemmScratch,
) {
    let groups = w.groups();
    let tile = scratch.tile.as_mut_ptr();
    let quad_scales = scratch.tile_scales.as_mut_ptr();
    for quad in 0..count.div_ceil(4) {
        for group in 0..groups {
            let mut scales = _mm512_setzero_ps();
            for r in 0..4 {
                let i = quad * 4 + r;
                let (evens, odds, row_scales) = if i < count {
                    w.load_group(first_row + i, group)
                } else {
                    (
                        _mm512_setzero_si512(),
                        _mm512_setzero_si512(),
                        _mm512_setzero_ps(),
                    )
                };
                let at = tile.add((i * groups + group) * GROUP_LEN);
                _mm512_storeu_si512(at.cast(), evens);
                _mm512_storeu_si512(at.add(GROUP_LEN / 2).cast(), odds);
                // Row r's scale lanes all hold its block scales (4j..4j+3 = block j); keep lane 4j + r.
                scales = _mm512_mask_blend_ps(0x1111 << r, scales, row_scales);
            }
            _mm512_storeu_ps(
                quad_scales.add((quad * groups + group) * GROUP_LANES),
                scales,
            );
        }
    }
}

/// Sum each block's four lanes of four rows' integer sums: lane 4j + r of the result is block j
/// of row r. Unpacks and adds run beside `vpdpbusd`, unlike the float convert, multiply and FMA
/// they save (one each per quad instead of per row).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn sum_block_lanes(rows: [__m512i; 4]) -> __m512i {
    // Within each 128-bit lane (one block): (a0 b0 a1 b1) + (a2 b2 a3 b3).
    let ab = _mm512_add_epi32(
        _mm512_unpacklo_epi32(rows[0], rows[1]),
        _mm512_unpackhi_epi32(rows[0], rows[1]),
    );
    let cd = _mm512_add_epi32(
        _mm512_unpacklo_epi32(rows[2], rows[3]),
        _mm512_unpackhi_epi32(rows[2], rows[3]),
    );
    // (a02 b02 c02 d02) + (a13 b13 c13 d13).
    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
}

/// One quad of decoded tile rows x `T` tokens. Each (row, token) pair costs two `vpdpbusd` per
/// group; the four rows' sums are folded into one vector before the float work.
///
/// # Safety
/// Quad `quad` was decoded into `scratch` for `groups` groups; tokens `first_token..+T` exist in
/// `x`; `out[t * stride + r]` is in bounds for t < T, r < `rows`; `rows <= 4`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_quad<const T: usize>(
    scratch: &GemmScratch,
    groups: usize,
    quad: usize,
    x: &Q8Activations,
    first_token: usize,
    mask: __mmask16,
    factor: f32,
    out: *mut f32,
    stride: usize,
    rows: usize,
) {
    let mut acc = [_mm512_setzero_ps(); T];
    let tile = scratch.tile.as_ptr();
    let quad_scales = scratch.tile_scales.as_ptr();
    let quants = x.quants.as_ptr();
    let corrections = x.corrections.as_ptr();
    let act_scales = x.scale_lanes.as_ptr();
    for group in 0..groups {
        let mut weights = [(_mm512_setzero_si512(), _mm512_setzero_si512()); 4];
        for (r, w) in weights.iter_mut().enumerate() {
            let at = tile.add(((quad * 4 + r) * groups + group) * GROUP_LEN);
            *w = (
                _mm512_loadu_si512(at.cast()),
                _mm512_loadu_si512(at.add(GROUP_LEN / 2).cast()),
            );
        }
        let w_scales = _mm512_loadu_ps(quad_scales.add((quad * groups + group) * GROUP_LANES));
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let at = (first_token + t) * x.groups + group;
            let a_evens = _mm512_loadu_si512(quants.add(at * GROUP_LEN).cast());
            let a_odds = _mm512_loadu_si512(quants.add(at * GROUP_LEN + GROUP_LEN / 2).cast());
            let correction = _mm512_maskz_loadu_epi32(mask, corrections.add(at * GROUP_LANES));
            let sums = weights.map(|(evens, odds)| {
                _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(correction, evens, a_evens),
                    odds,
                    a_odds,
                )
            });
            let scales = _mm512_mul_ps(w_scales, _mm512_loadu_ps(act_scales.add(at * GROUP_LANES)));
            *acc_t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum_block_lanes(sums)), scales, *acc_t);
        }
    }
    for (t, acc_t) in acc.iter().enumerate() {
        // Lane 4j + r holds row r's blocks j, j+4, ...: add the four 128-bit lanes.
        let upper = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*acc_t));
        let halves = _mm256_add_ps(_mm512_castps512_ps256(*acc_t), _mm256_castpd_ps(upper));
        let quarters = _mm_add_ps(
            _mm256_castps256_ps128(halves),
            _mm256_extractf128_ps::<1>(halves),
        );
        let totals = _mm_mul_ps(quarters, _mm_set1_ps(factor));
        _mm_mask_storeu_ps(
            out.add(t * stride),
            ((1u32 << rows) - 1) as __mmask8,
            totals,
        );
    }
}

/// Tokens per micro-kernel call: eight accumulators plus the quad's eight weight registers and
/// the per-token temporaries fit the 32 zmm registers without spills.
const GEMM_TOKENS: usize = 4;

/// # Safety
/// The CPU has the module's features; shapes and scratch size were checked by `Kernels`
/// (`out.len() == x.rows() * rows.len()`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn gemm<W: GroupSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    if x.rows() == 1 {
        return gemv(w, x, rows, out);
    }
    let (mask, factor) = (correction_mask(W::FORMAT), format_factor(W::FORMAT));
    let groups = w.groups();
    let stride = rows.len();
    let tokens = x.rows();
    let mut tile_start = rows.start;
    while tile_start < rows.end {
        let count = (rows.end - tile_start).min(GEMM_TILE_ROWS);
        decode_tile(w, tile_start, count, scratch);
        let out_column = out.as_mut_ptr().add(tile_start - rows.start);
        let mut token = 0;
        while token < tokens {
            let t_count = (tokens - token).min(GEMM_TOKENS);
            for quad in 0..count.div_ceil(4) {
                let quad_rows = (count - quad * 4).min(4);
                let o = out_column.add(token * stride + quad * 4);
                let args = (
                    scratch as &GemmScratch,
                    groups,
                    quad,
                    x,
                    token,
                    mask,
                    factor,
                );
                let (s, g, q, x, t, m, f) = args;
                match t_count {
                    8 => gemm_quad::<8>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    7 => gemm_quad::<7>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    6 => gemm_quad::<6>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    5 => gemm_quad::<5>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    4 => gemm_quad::<4>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    3 => gemm_quad::<3>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    2 => gemm_quad::<2>(s, g, q, x, t, m, f, o, stride, quad_rows),
                    _ => gemm_quad::<1>(s, g, q, x, t, m, f, o, stride, quad_rows),
                }
            }
            token += t_count;
        }
        tile_start += count;
    }
}

pub(crate) unsafe fn mxfp4_gemm(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    gemm(w, x, rows, out, scratch)
}

pub(crate) unsafe fn q4_gemm(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    gemm(w, x, rows, out, scratch)
}

pub(crate) unsafe fn q8_gemm(
    w: &Q8Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    gemm(w, x, rows, out, scratch)
}

/// Sixteen bf16 weights at `ptr` (only the first `len` when `len < 16`) widened to f32.
///
/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_bf16(ptr: *const u16, len: usize) -> __m512 {
    let bits = if len >= 16 {
        _mm256_loadu_si256(ptr.cast())
    } else {
        _mm256_maskz_loadu_epi16(((1u32 << len) - 1) as u16, ptr.cast())
    };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
}

/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_f32(ptr: *const f32, len: usize) -> __m512 {
    if len >= 16 {
        _mm512_loadu_ps(ptr)
    } else {
        _mm512_maskz_loadu_ps(((1u32 << len) - 1) as u16, ptr)
    }
}

/// `R` bf16 rows x `T` tokens over all columns.
///
/// # Safety
/// Rows `row..row + R` and tokens `token..token + T` exist; `out[t * stride + i]` in bounds.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn bf16_micro<const R: usize, const T: usize>(
    w: &[u16],
    cols: usize,
    x: &[f32],
    row: usize,
    token: usize,
    out: *mut f32,
    stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut c = 0;
    while c < cols {
        let len = cols - c;
        let mut xs = [_mm512_setzero_ps(); T];
        for (t, xv) in xs.iter_mut().enumerate() {
            *xv = load_f32(x.as_ptr().add((token + t) * cols + c), len);
        }
        for (i, acc_row) in acc.iter_mut().enumerate() {
            let wv = load_bf16(w.as_ptr().add((row + i) * cols + c), len);
            for (acc_cell, xv) in acc_row.iter_mut().zip(&xs) {
                *acc_cell = _mm512_fmadd_ps(wv, *xv, *acc_cell);
            }
        }
        c += 16;
    }
    for (i, acc_row) in acc.iter().enumerate() {
        for (t, acc_cell) in acc_row.iter().enumerate() {
            *out.add(t * stride + i) = _mm512_reduce_add_ps(*acc_cell);
        }
    }
}

/// # Safety
/// The CPU has the module's features; shapes were checked by `Kernels`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn bf16_gemm(
    w: &[u16],
    cols: usize,
    x: &[f32],
    rows: Range<usize>,
    out: &mut [f32],
) {
    let tokens = x.len() / cols;
    let stride = rows.len();
    let mut tile_start = rows.start;
    while tile_start < rows.end {
        let count = (rows.end - tile_start).min(GEMM_TILE_ROWS);
        let mut token = 0;
        while token < tokens {
            let t_count = (tokens - token).min(3);
            let mut i = 0;
            while i < count {
                let r_count = if count - i >= 4 { 4 } else { 1 };
                let row = tile_start + i;
                let o = out.as_mut_ptr().add(token * stride + row - rows.start);
                match (r_count, t_count) {
                    (4, 3) => bf16_micro::<4, 3>(w, cols, x, row, token, o, stride),
                    (4, 2) => bf16_micro::<4, 2>(w, cols, x, row, token, o, stride),
                    (4, _) => bf16_micro::<4, 1>(w, cols, x, row, token, o, stride),
                    (_, 3) => bf16_micro::<1, 3>(w, cols, x, row, token, o, stride),
                    (_, 2) => bf16_micro::<1, 2>(w, cols, x, row, token, o, stride),
                    _ => bf16_micro::<1, 1>(w, cols, x, row, token, o, stride),
                }
                i += r_count;
            }
            token += t_count;
        }
        tile_start += count;
    }
}

/// # Safety
/// The CPU has the module's features; `a.len() == b.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    while i < a.len() {
        let len = a.len() - i;
        let lane = (i / 16) % 2;
        acc[lane] = _mm512_fmadd_ps(
            load_f32(a.as_ptr().add(i), len),
            load_f32(b.as_ptr().add(i), len),
            acc[lane],
        );
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let a = _mm512_set1_ps(alpha);
    let mut i = 0;
    while i < x.len() {
        let len = x.len() - i;
        let mask = if len >= 16 {
            u16::MAX
        } else {
            ((1u32 << len) - 1) as u16
        };
        let yp = y.as_mut_ptr().add(i);
        let result = _mm512_fmadd_ps(a, load_f32(x.as_ptr().add(i), len), load_f32(yp, len));
        _mm512_mask_storeu_ps(yp, mask, result);
        i += 16;
    }
}

/// Sixteen f16 values at `ptr` (only `len` when `len < 16`) widened to f32.
///
/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_f16(ptr: *const f16, len: usize) -> __m512 {
    let bits = if len >= 16 {
        _mm256_loadu_si256(ptr.cast())
    } else {
        _mm256_maskz_loadu_epi16(((1u32 << len) - 1) as u16, ptr.cast())
    };
    _mm512_cvtph_ps(bits)
}

/// # Safety
/// The CPU has the module's features; `a.len() == b.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    while i < a.len() {
        let len = a.len() - i;
        let lane = (i / 16) % 2;
        acc[lane] = _mm512_fmadd_ps(
            load_f32(a.as_ptr().add(i), len),
            load_f16(b.as_ptr().add(i), len),
            acc[lane],
        );
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(alpha: f32, x: &[f16], y: &mut [f32]) {
    let a = _mm512_set1_ps(alpha);
    let mut i = 0;
    while i < x.len() {
        let len = x.len() - i;
        let mask = if len >= 16 {
            u16::MAX
        } else {
            ((1u32 << len) - 1) as u16
        };
        let yp = y.as_mut_ptr().add(i);
        let result = _mm512_fmadd_ps(a, load_f16(x.as_ptr().add(i), len), load_f32(yp, len));
        _mm512_mask_storeu_ps(yp, mask, result);
        i += 16;
    }
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    let mut i = 0;
    while i < src.len() {
        let len = src.len() - i;
        let mask = if len >= 16 {
            u16::MAX
        } else {
            ((1u32 << len) - 1) as u16
        };
        let halves =
            _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(load_f32(src.as_ptr().add(i), len));
        _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i).cast(), mask, halves);
        i += 16;
    }
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    let mut i = 0;
    while i < src.len() {
        let len = src.len() - i;
        let mask = if len >= 16 {
            u16::MAX
        } else {
            ((1u32 << len) - 1) as u16
        };
        _mm512_mask_storeu_ps(
            dst.as_mut_ptr().add(i),
            mask,
            load_f16(src.as_ptr().add(i), len),
        );
        i += 16;
    }
}
