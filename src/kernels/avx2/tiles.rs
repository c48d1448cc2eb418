//! AVX2 products of MXFP4 matrices in the tile layout ([`Mxfp4Layout::Tiles`]).
//!
//! A 64-byte tile vector holds one dword of nibbles of each of 16 rows; AVX2 reads it as two
//! 32-byte halves of 8 rows. `vpmaddubsw` of a half's decoded weights (unsigned, at most 24) and
//! a token's activation dword broadcast gives each row's pair sums in int16 lanes, `vpmaddwd`
//! widens them, and a block's sums for 8 rows build up in one register per token: the float
//! convert, scale and FMA run once per (8 rows, block, token) instead of once per (row, pair of
//! blocks, token) as in row order, and a row's result needs no horizontal sum. Nothing is
//! transposed at run time and every token count takes the same kernel, in passes of up to
//! [`PASS_TOKENS`] tokens per decoded tile.
//!
//! Q8 matrices stay in row order on this path: their tiles hold `q + 128`, whose `vpmaddubsw`
//! pair sums (up to 2 x 255 x 127) would saturate int16.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::formats::{
    tile_lanes, tile_out, ByteSpans, Mxfp4Layout, Mxfp4Matrix, Q8Activations, BLOCK_LEN,
    CORRECTION_LANE_MXFP4, GROUP_BLOCKS, GROUP_LANES, GROUP_LEN, MXFP4_TILE_ROWS,
};
use super::{prefetch_share_into, MXFP4_UNSIGNED};

/// Rows of a tile half: one 256-bit vector holds a dword of each.
const HALF_ROWS: usize = MXFP4_TILE_ROWS / 2;

/// The tiles' 64-byte dword vectors per block of 32 columns.
const BLOCK_VECTORS: usize = BLOCK_LEN / 8;

/// Most tokens one pass over a tile half carries: their sums and accumulators (2 x 4
/// registers), the two decoded operands and three constants fit the 16 ymm registers.
const PASS_TOKENS: usize = 4;

/// Tile half `half` of tile `tile` against tokens `first_token..first_token + T` of `x`,
/// writing rows `lanes` of the half (`out` at lane 0 for token 0, possibly before the caller's
/// buffer: only lanes inside are written) while spreading prefetches of `prefetch` over the
/// blocks.
///
/// # Safety
/// `tile` inside the tiled `w`, the tokens inside `x` (whose columns are `w`'s), every written
/// lane's address inside the output; the CPU has AVX2, FMA and F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn half_tokens<const T: usize>(
    w: &Mxfp4Matrix,
    (tile, half): (usize, usize),
    x: &Q8Activations,
    first_token: usize,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: &[(*const u8, usize); 2],
) {
    // SAFETY: the caller upholds the contract; every offset below stays inside the tile's bytes
    // (blocks_per_row x 4 vectors of 64 bytes, 16 scale bytes per block) and the tokens' rows.
    unsafe {
        let blocks_per_row = w.cols / BLOCK_LEN;
        let (bytes_at, scales_at) = w.tile_offsets(tile);
        let vectors = w.blocks.as_ptr().add(bytes_at + half * 32);
        let scales = w.scales.as_ptr().add(scales_at + half * HALF_ROWS);
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        let quants = x.quants.as_ptr().add(first_token * quant_stride);
        let corrections = x
            .corrections
            .as_ptr()
            .add(first_token * lane_stride + CORRECTION_LANE_MXFP4);
        let act_scales = x.scale_lanes.as_ptr().add(first_token * lane_stride);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(MXFP4_UNSIGNED.as_ptr().cast()));
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for block in 0..blocks_per_row {
            prefetch_share_into::<true>(prefetch, block, blocks_per_row);
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let lane = group * GROUP_LANES + 4 * j;
            let mut sums: [__m256i; T] = std::array::from_fn(|t| {
                _mm256_set1_epi32(*corrections.add(t * lane_stride + lane))
            });
            for s in 0..BLOCK_VECTORS {
                let bytes =
                    _mm256_loadu_si256(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
                let evens = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low));
                let odds = _mm256_shuffle_epi8(
                    table,
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low),
                );
                // Activation dword 4j + s meets the low nibbles, dword 16 + 4j + s the high ones.
                let at = group * GROUP_LEN + 4 * (4 * j + s);
                for (t, sum) in sums.iter_mut().enumerate() {
                    let q = quants.add(t * quant_stride + at);
                    let even = _mm256_set1_epi32(q.cast::<i32>().read_unaligned());
                    let odd =
                        _mm256_set1_epi32(q.add(GROUP_LEN / 2).cast::<i32>().read_unaligned());
                    // Two pair sums of at most 2 x 24 x 127 each: no int16 saturation.
                    let pairs = _mm256_add_epi16(
                        _mm256_maddubs_epi16(evens, even),
                        _mm256_maddubs_epi16(odds, odd),
                    );
                    *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
                }
            }
            // 2^(s - 127) from the shifted byte (0 for s = 0, as on every path).
            let scale_bytes = _mm_loadl_epi64(scales.add(block * MXFP4_TILE_ROWS).cast());
            let w_scales =
                _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_cvtepu8_epi32(scale_bytes)));
            for (t, (acc_t, sum)) in acc.iter_mut().zip(sums).enumerate() {
                let a_scale = _mm256_set1_ps(*act_scales.add(t * lane_stride + lane));
                *acc_t = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(sum),
                    _mm256_mul_ps(w_scales, a_scale),
                    *acc_t,
                );
            }
        }
        // Doubled FP4 values: halve once at the end.
        let factor = _mm256_set1_ps(0.5);
        for (t, acc_t) in acc.iter().enumerate() {
            let values = _mm256_mul_ps(*acc_t, factor);
            let row_out = out.wrapping_add(t * stride);
            if lanes == (0..HALF_ROWS) {
                _mm256_storeu_ps(row_out, values);
            } else {
                let mut staged = [0.0f32; HALF_ROWS];
                _mm256_storeu_ps(staged.as_mut_ptr(), values);
                for lane in lanes.clone() {
                    *row_out.wrapping_add(lane) = staged[lane];
                }
            }
        }
    }
}

/// Every token of `x` against the rows `lanes` (0..16) of tile `tile`, in balanced passes of at
/// most [`PASS_TOKENS`] per half; the first half's first pass prefetches `prefetch`.
///
/// # Safety
/// As [`half_tokens`], `out` at lane 0 of the tile for token 0.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_all_tokens(
    w: &Mxfp4Matrix,
    tile: usize,
    x: &Q8Activations,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: [(*const u8, usize); 2],
) {
    // SAFETY: the caller upholds the contract, which every call below shares.
    unsafe {
        let tokens = x.rows();
        let batch = tokens.div_ceil(tokens.div_ceil(PASS_TOKENS));
        let none = [(std::ptr::null(), 0); 2];
        for half in 0..2 {
            let first = half * HALF_ROWS;
            let half_lanes =
                lanes.start.max(first) - first..lanes.end.min(first + HALF_ROWS).max(first) - first;
            if half_lanes.is_empty() {
                continue;
            }
            let half_out = out.wrapping_add(first);
            let mut token = 0;
            while token < tokens {
                let count = (tokens - token).min(batch);
                let o = half_out.wrapping_add(token * stride);
                let p = if token == 0 && half == 0 {
                    &prefetch
                } else {
                    &none
                };
                let l = half_lanes.clone();
                let at = (tile, half);
                match count {
                    4 => half_tokens::<4>(w, at, x, token, o, stride, l, p),
                    3 => half_tokens::<3>(w, at, x, token, o, stride, l, p),
                    2 => half_tokens::<2>(w, at, x, token, o, stride, l, p),
                    _ => half_tokens::<1>(w, at, x, token, o, stride, l, p),
                }
                token += count;
            }
        }
    }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled MXFP4 `w` and any number of
/// tokens, prefetching one tile ahead (past `rows` up to the matrix's end, so the next task's
/// first tile is not a cold miss either).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `w` is tiled and the shapes were checked by `Kernels`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn mxfp4_product(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    debug_assert_eq!(w.layout, Mxfp4Layout::Tiles);
    if rows.is_empty() || x.rows() == 0 {
        return;
    }
    // SAFETY: the caller upholds the contract; each tile writes only the lanes inside `rows`,
    // at `out` offsets below `x.rows() * rows.len()`.
    unsafe {
        let stride = rows.len();
        let limit = w.rows;
        let mut tile = rows.start / MXFP4_TILE_ROWS;
        while tile * MXFP4_TILE_ROWS < rows.end {
            let first_row = tile * MXFP4_TILE_ROWS;
            let next = (first_row + MXFP4_TILE_ROWS).min(limit);
            let spans = w.byte_spans(next..(next + MXFP4_TILE_ROWS).min(limit));
            let o = tile_out(out, first_row, rows.start);
            tile_all_tokens(w, tile, x, o, stride, tile_lanes(tile, &rows), spans);
            tile += 1;
        }
    }
}
