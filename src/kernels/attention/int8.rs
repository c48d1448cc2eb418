//! The tiled attention of [`super::attend_tiled`] on int8 dot products (AVX-512 VNNI,
//! `vpdpbusd`) over an int8 cache, whose rows already are int8 with one scale each: the cache is
//! read as it is stored, with no widening, and one `vpdpbusd` does 64 multiply-adds (an f32 FMA
//! 16, a `vdpbf16ps` 32). What it computes is stated plainly in
//! [`super::attend_block_q8_reference`]:
//!
//! - each query row, scaled, is rounded to int8 with its own scale (`max |x| / 127`), and a logit
//!   is the exact integer dot product with the key row times both rows' scales;
//! - the softmax is the online one of the other paths, in f32, and the denominator sums the
//!   exact (f32) probabilities;
//! - per tile and query row, each probability times its value row's scale is rounded to an
//!   unsigned byte against the row's largest in the tile (`255 / max`), so the values' products
//!   are exact integer sums too, scaled once per tile and row.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes. Keys are stored with 128 added (as unsigned
//! bytes) and each query row's `128 x sum(q)` is taken off its integer logits; the probabilities
//! are unsigned already and the values stay signed.
//!
//! Layouts per tile: keys transposed to 4-byte groups of elements, one key per lane (a broadcast
//! query group and one `vpdpbusd` give 16 keys' partial logits, as the bf16 path's pairs do);
//! values in quads of consecutive keys interleaved column by column (`vpdpbusd` adds the four
//! products of one lane), quads starting at rows that are multiples of 4, so which keys share a
//! quad depends on their rows alone and a token's result is the same bits alone or in any
//! block. Value rows before the block's first visible key are not read (zeros with a zero
//! scale: their probability is zero too).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{fast_exp, finish_rows, AttentionScratch, BlockQuery, Q8KvHead, TileWalk, TILE_KEYS};

/// f32 (or i32) lanes of a 512-bit vector.
const W: usize = 16;
/// Bytes of a 512-bit vector: a row is whole vectors of int8.
const BYTES: usize = 64;

/// Below this (in base 2) a probability is exactly 0: 2^-173 is far under the smallest f32.
const EXP2_FLOOR: f32 = -173.0;

/// A degree-3 polynomial for 2^f on [-1/2, 1/2] (least squares on the relative error, 1.8e-4
/// at worst), lowest degree first after the constant 1: the probabilities are rounded to bytes
/// next (steps of 1/255 of the largest), and their f32 sum moves by as little.
const EXP2_POLY: [f32; 3] = [0.693_316_6, 0.241_924_8, 0.054_602_28];

/// 2^t (t <= 0, finite or below [`EXP2_FLOOR`]) in 16 lanes: 2^n (`vscalefps`) times 2^f by the
/// polynomial, n the nearest integer.
#[inline(always)]
unsafe fn exp2_for_bytes(t: __m512) -> __m512 {
    // SAFETY: plain arithmetic on registers; the caller's target features include AVX-512 F.
    unsafe {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let y = _mm512_fmadd_ps(
            _mm512_set1_ps(EXP2_POLY[2]),
            f,
            _mm512_set1_ps(EXP2_POLY[1]),
        );
        let y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(EXP2_POLY[0]));
        let y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, n)
    }
}

/// Whether the int8 path takes this head size: whole vectors of int8 (gpt-oss: 64).
pub(super) fn takes(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(BYTES)
}

/// Attention of a block over one KV head of an int8 cache.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VNNI, AVX2, FMA and F16C; [`takes`] holds for the head_dim; the shapes
/// were checked as for [`super::attend_block_q8`]; `query.tokens` > 0.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn attend(
    query: &BlockQuery<'_>,
    kv: &Q8KvHead<'_>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let d = query.head_dim;
    let (heads, tokens) = (query.sinks.len(), query.tokens);
    // The scratch's f32 buffers hold the byte rows: each is at least four times as large as
    // needed.
    let queries = scratch.queries.as_mut_ptr().cast::<i8>();
    let keys = scratch.keys.as_mut_ptr().cast::<u32>();
    let value_quads = scratch.values.as_mut_ptr().cast::<i8>();
    let probs = scratch.probs_bf16.as_mut_ptr().cast::<u8>();
    for r in 0..tokens * heads {
        let (t, g) = (r / heads, r % heads);
        let src = &query.queries[t * query.token_stride + g * d..][..d];
        // SAFETY: r < tokens x heads <= max_heads and d <= max_head_dim (checked by the caller),
        // so the row's d bytes lie inside the queries buffer.
        let (scale, offset) = unsafe { quantize_query(src, query.scale, queries.add(r * d)) };
        scratch.query_scales[r] = scale;
        scratch.query_offsets[r] = offset;
        scratch.running_max[r] = query.sinks[g];
    }
    scratch.running_sum[..tokens * heads].fill(0.0);
    scratch.acc[..tokens * heads * d].fill(0.0);

    for (tile, seeing) in TileWalk::new(tokens, visible) {
        let (first, count) = (seeing.start, tile.len());
        let rows = first * heads..seeing.end * heads;
        // Value rows before the block's first visible key are not read.
        let skip = visible(first).start.clamp(tile.start, tile.end) - tile.start;
        let (key_scales, value_scales) = scratch.tile_scales.split_at_mut(TILE_KEYS);
        key_scales[..count].copy_from_slice(&kv.key_scales[tile.clone()]);
        key_scales[count..].fill(0.0);
        value_scales[..skip].fill(0.0);
        value_scales[skip..count].copy_from_slice(&kv.value_scales[tile.start + skip..tile.end]);
        value_scales[count..].fill(0.0);
        let key_row = |j: usize| kv.keys[j * d..][..d].as_ptr();
        // SAFETY: rows of the tile lie inside the cache (checked by the caller); the transposed
        // tile holds d/4 x TILE_KEYS u32 (the f32 key tile is TILE_KEYS x padded >= d f32).
        unsafe {
            let mut group = [std::ptr::null(); W];
            for first_key in (0..count).step_by(W) {
                for (i, row) in group.iter_mut().enumerate() {
                    let key = first_key + i;
                    *row = if key < count {
                        let from = key_row(tile.start + key);
                        prefetch_next_tile(from, d);
                        from
                    } else {
                        std::ptr::null()
                    };
                }
                transpose_keys(&group, d, keys.add(first_key));
            }
            let state = RowState {
                running_max: scratch.running_max.as_mut_ptr(),
                running_sum: scratch.running_sum.as_mut_ptr(),
                rescale: scratch.rescale.as_mut_ptr(),
                prob_scales: scratch.prob_scales.as_mut_ptr(),
                probs,
            };
            let seen = |r: usize| {
                let visible = visible(r / heads);
                let from = visible.start.clamp(tile.start, tile.end) - tile.start;
                let to = visible.end.clamp(tile.start, tile.end) - tile.start;
                (from, to.max(from))
            };
            let operands = Operands {
                queries,
                query_scales: scratch.query_scales.as_ptr(),
                query_offsets: scratch.query_offsets.as_ptr(),
                d,
                keys,
                key_scales: scratch.tile_scales.as_ptr(),
                value_scales: scratch.tile_scales.as_ptr().add(TILE_KEYS),
            };
            probabilities(&operands, rows.clone(), count, &seen, state);
        }
        let first_quad = skip / 4;
        let quads = count.div_ceil(4) - first_quad;
        let value_row = |j: usize| kv.values[j * d..][..d].as_ptr();
        // SAFETY: value rows skip..count of the tile lie inside the cache; `value_quads` holds
        // TILE_KEYS / 4 quads of 4d bytes (the f32 value tile is TILE_KEYS x padded >= d f32);
        // probabilities are read up to count rounded up to 4, which `probabilities` wrote (zeros
        // past count up to the next multiple of 16), inside each row of TILE_KEYS bytes.
        unsafe {
            for quad in first_quad..first_quad + quads {
                let mut four = [std::ptr::null(); 4];
                for (i, row) in four.iter_mut().enumerate() {
                    let j = 4 * quad + i;
                    if j >= skip && j < count {
                        *row = value_row(tile.start + j);
                        prefetch_next_tile(*row, d);
                    }
                }
                interleave_values(&four, d, value_quads.add(quad * 4 * d));
            }
            let mut r = rows.start;
            while r < rows.end {
                let block = if rows.end - r >= 4 { 4 } else { 1 };
                for c in (0..d).step_by(BYTES) {
                    let args = Accumulate {
                        probs: probs.add(r * TILE_KEYS).cast_const(),
                        rescale: scratch.rescale.as_ptr().add(r),
                        prob_scales: scratch.prob_scales.as_ptr().add(r),
                        values: value_quads.add(4 * c).cast_const(),
                        quads: first_quad..first_quad + quads,
                        d,
                        acc: scratch.acc.as_mut_ptr().add(r * d + c),
                    };
                    match block {
                        4 => accumulate::<4>(args),
                        _ => accumulate::<1>(args),
                    }
                }
                r += block;
            }
        }
    }

    finish_rows(query, scratch, d, out);
}

/// Rounds `src x scale` to int8 at `to` against its largest magnitude: returns the row's scale
/// (`max / 127`; 0 for a zero row) and `128 x sum(q)`, what the keys' offset of 128 adds to each
/// integer logit.
///
/// # Safety
/// `to` has room for `src.len()` bytes, a multiple of 16; the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn quantize_query(src: &[f32], scale: f32, to: *mut i8) -> (f32, i32) {
    // SAFETY: the caller upholds the contract; loads stay inside `src` (a multiple of 16).
    unsafe {
        let factor = _mm512_set1_ps(scale);
        let mut largest = _mm512_setzero_ps();
        for c in (0..src.len()).step_by(W) {
            let x = _mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(c)), factor);
            largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
        }
        let largest = _mm512_reduce_max_ps(largest);
        if largest == 0.0 || !largest.is_finite() {
            std::ptr::write_bytes(to, 0, src.len());
            return (0.0, 0);
        }
        let inverse = _mm512_set1_ps(127.0 / largest);
        let mut sum = _mm512_setzero_si512();
        for c in (0..src.len()).step_by(W) {
            let x = _mm512_mul_ps(_mm512_loadu_ps(src.as_ptr().add(c)), factor);
            let q = _mm512_cvtps_epi32(_mm512_mul_ps(x, inverse));
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128(to.add(c).cast(), _mm512_cvtsepi32_epi8(q));
        }
        (largest / 127.0, 128 * _mm512_reduce_add_epi32(sum))
    }
}

/// Asks for the same row of the next tile (`TILE_KEYS` rows on) while this one is used, as the
/// f16 paths do: at depth the cache streams from memory. A prefetch never faults.
#[inline(always)]
fn prefetch_next_tile(row: *const i8, d: usize) {
    let ahead = row.wrapping_add(TILE_KEYS * d);
    for at in (0..d).step_by(BYTES) {
        // SAFETY: a prefetch is a hint: it reads nothing the program sees and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(at)) };
    }
}

/// 16 key rows (`null` for keys past the tile's end: zeros) with 128 added, transposed in
/// 4-byte groups: group p (elements 4p..4p + 4) of key i at `to[p * TILE_KEYS + i]` (u32 units;
/// `to` points at the group's first key). A 16 x 16 transpose of dwords per 64 bytes of the rows.
///
/// # Safety
/// Each non-null row has d readable bytes; `to` has room for d/4 rows of TILE_KEYS u32 from its
/// start; the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn transpose_keys(rows: &[*const i8; W], d: usize, to: *mut u32) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        // A zero key row is 128 in every byte once offset.
        let offset = _mm512_set1_epi8(-128);
        for c in (0..d).step_by(BYTES) {
            let mut r = [offset; W];
            for (x, row) in r.iter_mut().zip(rows) {
                if !row.is_null() {
                    *x = _mm512_xor_si512(_mm512_loadu_si512(row.add(c).cast()), offset);
                }
            }
            for (group, column) in crate::kernels::avx512::transpose_16x16(r)
                .into_iter()
                .enumerate()
            {
                let group = c / 4 + group;
                _mm512_storeu_si512(to.add(group * TILE_KEYS).cast(), column);
            }
        }
    }
}

/// Four consecutive value rows (`null`: zeros) interleaved column by column at `to`: column i's
/// four bytes (one per row) at `to[4i..4i + 4]`.
///
/// # Safety
/// Each non-null row has d readable bytes; `to` has room for 4d bytes; the CPU has the features
/// below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn interleave_values(rows: &[*const i8; 4], d: usize, to: *mut i8) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        for c in (0..d).step_by(BYTES) {
            let mut r = [_mm512_setzero_si512(); 4];
            for (x, row) in r.iter_mut().zip(rows) {
                if !row.is_null() {
                    *x = _mm512_loadu_si512(row.add(c).cast());
                }
            }
            // Within each 128-bit lane L (columns 16L..16L + 16): pairs of rows 0/1 and 2/3,
            // then the four rows, columns 16L + 4k.. in u[k].
            let low01 = _mm512_unpacklo_epi8(r[0], r[1]);
            let high01 = _mm512_unpackhi_epi8(r[0], r[1]);
            let low23 = _mm512_unpacklo_epi8(r[2], r[3]);
            let high23 = _mm512_unpackhi_epi8(r[2], r[3]);
            let u = [
                _mm512_unpacklo_epi16(low01, low23),
                _mm512_unpackhi_epi16(low01, low23),
                _mm512_unpacklo_epi16(high01, high23),
                _mm512_unpackhi_epi16(high01, high23),
            ];
            // A 4 x 4 transpose of 128-bit lanes: vector m gets lane m of u[0..4], columns
            // 16m..16m + 16 in order.
            let a = _mm512_shuffle_i32x4::<0x44>(u[0], u[1]);
            let b = _mm512_shuffle_i32x4::<0xEE>(u[0], u[1]);
            let e = _mm512_shuffle_i32x4::<0x44>(u[2], u[3]);
            let f = _mm512_shuffle_i32x4::<0xEE>(u[2], u[3]);
            let columns = [
                _mm512_shuffle_i32x4::<0x88>(a, e),
                _mm512_shuffle_i32x4::<0xDD>(a, e),
                _mm512_shuffle_i32x4::<0x88>(b, f),
                _mm512_shuffle_i32x4::<0xDD>(b, f),
            ];
            for (m, column) in columns.into_iter().enumerate() {
                _mm512_storeu_si512(to.add(4 * c + m * BYTES).cast(), column);
            }
        }
    }
}

/// Where [`probabilities`] keeps each query row's online softmax: running maximum and sum, the
/// factor this tile rescales the row's accumulator by, the tile's probability scale, and the
/// tile's probabilities as bytes (rows of TILE_KEYS).
#[derive(Clone, Copy)]
struct RowState {
    running_max: *mut f32,
    running_sum: *mut f32,
    rescale: *mut f32,
    prob_scales: *mut f32,
    probs: *mut u8,
}

/// One tile's operands: the int8 query rows (d bytes each) with their scales and offsets, the
/// transposed keys ([`transpose_keys`]), and the tile's key and value scales (TILE_KEYS each,
/// zero past the tile and for value rows not read).
struct Operands {
    queries: *const i8,
    query_scales: *const f32,
    query_offsets: *const i32,
    d: usize,
    keys: *const u32,
    key_scales: *const f32,
    value_scales: *const f32,
}

/// One tile's softmax step for query rows `rows`, the logits kept in registers: per row the
/// logits of the keys `seen(r)` (tile-relative; others -inf), the running maximum and sum
/// updated, the rescale factor of the accumulator, and the probabilities times the value scales
/// as bytes for the tile's count keys (zeros for the others up to the next multiple of 16).
///
/// # Safety
/// As [`attend`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn probabilities(
    operands: &Operands,
    rows: Range<usize>,
    count: usize,
    seen: &dyn Fn(usize) -> (usize, usize),
    state: RowState,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let groups = count.div_ceil(W);
        let mut r = rows.start;
        while r < rows.end {
            let args = (operands, r, seen, state);
            if rows.end - r >= 4 {
                match groups {
                    4 => softmax_rows::<4, 4>(args),
                    3 => softmax_rows::<4, 3>(args),
                    2 => softmax_rows::<4, 2>(args),
                    _ => softmax_rows::<4, 1>(args),
                }
                r += 4;
            } else {
                match groups {
                    4 => softmax_rows::<1, 4>(args),
                    3 => softmax_rows::<1, 3>(args),
                    2 => softmax_rows::<1, 2>(args),
                    _ => softmax_rows::<1, 1>(args),
                }
                r += 1;
            }
        }
    }
}

/// [`probabilities`] for `H` rows from `first` against `G` groups of 16 keys: per 4 elements one
/// `vpdpbusd` per (row, group), the query's 4 bytes broadcast.
///
/// # Safety
/// As [`probabilities`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn softmax_rows<const H: usize, const G: usize>(
    (operands, first, seen, state): (&Operands, usize, &dyn Fn(usize) -> (usize, usize), RowState),
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let d = operands.d;
        let q = operands.queries.add(first * d);
        // Each row's sums start at -128 x sum(q), which the keys' offset adds back.
        let mut sums = [[_mm512_setzero_si512(); G]; H];
        for (h, row) in sums.iter_mut().enumerate() {
            *row = [_mm512_set1_epi32(-*operands.query_offsets.add(first + h)); G];
        }
        for p in 0..d / 4 {
            let mut k = [_mm512_setzero_si512(); G];
            for (g, x) in k.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(operands.keys.add(p * TILE_KEYS + g * W).cast());
            }
            for (h, row) in sums.iter_mut().enumerate() {
                let four = q.add(h * d + 4 * p).cast::<i32>().read_unaligned();
                let four = _mm512_set1_epi32(four);
                for (s, x) in row.iter_mut().zip(&k) {
                    *s = _mm512_dpbusd_epi32(*s, *x, four);
                }
            }
        }
        for (h, row) in sums.iter().enumerate() {
            let r = first + h;
            let (from, to) = seen(r);
            let below = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
            let visible = below(to) & !below(from);
            // Logits without the query's scale (>= 0), which joins the exponent below together
            // with log2(e): one multiply-add per 16 keys instead of three operations.
            let query_scale = *operands.query_scales.add(r);
            let mut logits = [_mm512_setzero_ps(); G];
            let mut tile_max = _mm512_set1_ps(f32::NEG_INFINITY);
            // A row that sees every lane of the tile has no mask to apply.
            let all = visible == below(G * W);
            for (g, (s, logit)) in row.iter().zip(logits.iter_mut()).enumerate() {
                let scales = _mm512_loadu_ps(operands.key_scales.add(g * W));
                *logit = _mm512_mul_ps(_mm512_cvtepi32_ps(*s), scales);
                if !all {
                    let keep = (visible >> (g * W)) as u16;
                    *logit = _mm512_mask_blend_ps(keep, _mm512_set1_ps(f32::NEG_INFINITY), *logit);
                }
                tile_max = _mm512_max_ps(tile_max, *logit);
            }
            let max = *state.running_max.add(r);
            // f32::max keeps the running maximum when a row that sees nothing gives NaN (0 x -inf).
            let new_max = max.max(query_scale * _mm512_reduce_max_ps(tile_max));
            let rescale = fast_exp(max - new_max);
            let factor = _mm512_set1_ps(query_scale * std::f32::consts::LOG2_E);
            let shift = _mm512_set1_ps(new_max * std::f32::consts::LOG2_E);
            let mut total = _mm512_setzero_ps();
            let mut weighted_max = _mm512_setzero_ps();
            for (g, logit) in logits.iter_mut().enumerate() {
                let exponent = _mm512_fmsub_ps(*logit, factor, shift);
                let p = if all {
                    exp2_for_bytes(exponent)
                } else {
                    // Masked keys: -inf (or NaN for a zero query) becomes the floor, then 0.
                    exp2_for_bytes(_mm512_max_ps(exponent, _mm512_set1_ps(EXP2_FLOOR)))
                };
                total = _mm512_add_ps(total, p);
                // The logit's register now holds the probability times its value row's scale.
                *logit = _mm512_mul_ps(p, _mm512_loadu_ps(operands.value_scales.add(g * W)));
                weighted_max = _mm512_max_ps(weighted_max, *logit);
            }
            let weighted_max = _mm512_reduce_max_ps(weighted_max);
            let to_bytes = if weighted_max > 0.0 {
                255.0 / weighted_max
            } else {
                0.0
            };
            let to_bytes = _mm512_set1_ps(to_bytes);
            let mut bytes = [_mm512_setzero_si512(); 4];
            for (b, weighted) in bytes.iter_mut().zip(&logits) {
                *b = _mm512_cvtps_epi32(_mm512_mul_ps(*weighted, to_bytes));
            }
            // Two saturating packs leave 128-bit lane L holding keys 4L.. of each group in
            // turn; a dword permutation puts the 64 bytes in key order.
            let packed = _mm512_packus_epi16(
                _mm512_packus_epi32(bytes[0], bytes[1]),
                _mm512_packus_epi32(bytes[2], bytes[3]),
            );
            let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            _mm512_storeu_si512(
                state.probs.add(r * TILE_KEYS).cast(),
                _mm512_permutexvar_epi32(order, packed),
            );
            let sum = state.running_sum.add(r);
            *sum = *sum * rescale + _mm512_reduce_add_ps(total);
            *state.running_max.add(r) = new_max;
            *state.rescale.add(r) = rescale;
            *state.prob_scales.add(r) = weighted_max / 255.0;
        }
    }
}

/// What [`accumulate`] takes: from the block's first row, the probability bytes (rows of
/// TILE_KEYS), rescale factors and probability scales; the interleaved value quads offset to this
/// column block; the quads to sum; d; the accumulators offset to the row and column block.
struct Accumulate {
    probs: *const u8,
    rescale: *const f32,
    prob_scales: *const f32,
    values: *const i8,
    quads: Range<usize>,
    d: usize,
    acc: *mut f32,
}

/// `acc_h = acc_h * rescale_h + prob_scale_h * sum_quads probs_h[quad] . values[quad]` for H rows
/// and 64 columns: one `vpdpbusd` per (row, quad of keys, 16 columns), the integer sums in
/// registers across the tile.
///
/// # Safety
/// The pointers hold what [`Accumulate`] says for H rows and the quads; the CPU has the features
/// below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn accumulate<const H: usize>(args: Accumulate) {
    const C: usize = BYTES / W;
    // SAFETY: the caller upholds the contract.
    unsafe {
        let d = args.d;
        let mut sums = [[_mm512_setzero_si512(); C]; H];
        for quad in args.quads.clone() {
            let from = args.values.add(quad * 4 * d);
            let mut v = [_mm512_setzero_si512(); C];
            for (c, x) in v.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(from.add(c * BYTES).cast());
            }
            for (h, row) in sums.iter_mut().enumerate() {
                let four = args
                    .probs
                    .add(h * TILE_KEYS + 4 * quad)
                    .cast::<i32>()
                    .read_unaligned();
                let weights = _mm512_set1_epi32(four);
                for (s, x) in row.iter_mut().zip(&v) {
                    *s = _mm512_dpbusd_epi32(*s, weights, *x);
                }
            }
        }
        for (h, row) in sums.iter().enumerate() {
            let factor = _mm512_set1_ps(*args.rescale.add(h));
            let scale = _mm512_set1_ps(*args.prob_scales.add(h));
            for (c, s) in row.iter().enumerate() {
                let at = args.acc.add(h * d + c * W);
                let kept = _mm512_mul_ps(_mm512_loadu_ps(at), factor);
                _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(*s), scale, kept));
            }
        }
    }
}
