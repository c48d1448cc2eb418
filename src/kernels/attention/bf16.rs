//! The tiled attention of [`super::attend_tiled`] with bf16 dot products (AVX-512 BF16,
//! `vdpbf16ps`) over an f16 cache: queries (scaled), keys, values and probabilities are rounded
//! to bf16 and every product sums in f32. One `vdpbf16ps` does the multiply-adds of two f32 FMAs,
//! and on CPUs that issue it as fast as an FMA (Zen 4: one 512-bit instruction per cycle either
//! way) the attention's arithmetic takes about half the time; where it is slower
//! ([`super::super::Kernels`] probes this at start) the f32 path runs.
//!
//! The tiles are those of the f32 path (starting at multiples of [`TILE_KEYS`]) and the softmax
//! is the same online one in f32, but each tile's keys are transposed into pairs of elements
//! (one key per lane), so a broadcast query pair and one `vdpbf16ps` give 16 keys' partial
//! logits with no reduction tree, and the logits never leave registers: masking, the running
//! maximum and sum, the exponentials and their rounding to bf16 follow in place. Values are
//! staged per tile as pairs of consecutive keys interleaved column by column (`vdpbf16ps` adds
//! the products of one lane pair), and the pairs start at even cache rows, so which keys share a
//! pair depends on their rows alone: a token's result is the same bits alone or in any block, as
//! on the f32 path. Value rows before the block's first visible key are not read (their half of
//! a pair is zero; its probability is zero too).

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::{
    fast_exp, finish_rows, prefetch_row_of_next_tile, AttentionScratch, BlockQuery, KvHead,
    TileWalk, TILE_KEYS,
};

/// f32 lanes of a 512-bit vector.
pub(super) const W: usize = 16;
/// bf16 elements of a 512-bit vector.
pub(super) const BF16_LANES: usize = 32;

/// Below this a probability is exactly 0: 2^(-120 log2 e) is far under the smallest f32.
const EXP_FLOOR: f32 = -120.0;

/// A degree-5 polynomial for 2^f on [-1/2, 1/2] (least squares on the relative error, 1.1e-7
/// at worst), lowest degree first after the constant 1.
const EXP2_POLY: [f32; 5] = [
    0.693_146_9,
    0.240_222_38,
    0.055_508_93,
    0.009_671_703,
    0.001_321_867_5,
];

/// e^x (x <= 0) in 16 lanes, for probabilities that are rounded to bf16 next: `fast_exp`'s
/// Cody-Waite reduction, range masks and exponent arithmetic cost 17 operations per 16 keys on
/// the pipes the `vdpbf16ps` need; this takes 10: 2^(x log2 e) split into 2^n (`vscalefps`) and
/// 2^f by the polynomial. Degree 5, not 4 (3e-6, still far under bf16's 2e-3): degree 4 moved
/// one near-tied top-1 of the fixtures. -inf (a masked key) and NaN give 0.
#[inline(always)]
pub(super) unsafe fn exp_for_bf16(x: __m512) -> __m512 {
    // SAFETY: plain arithmetic on registers; the caller's target features include AVX-512 F.
    unsafe {
        // max returns the second operand for a NaN first one: NaN and -inf both become the floor.
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
        let t = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
        let f = _mm512_sub_ps(t, n);
        let mut y = _mm512_set1_ps(EXP2_POLY[4]);
        for c in EXP2_POLY[..4].iter().rev() {
            y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, n)
    }
}

/// Whether the bf16 path takes this head size: whole vectors of bf16 (gpt-oss: 64).
pub(super) fn takes(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(BF16_LANES)
}

#[inline(always)]
fn as_bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain SIMD lanes, valid for every bit pattern.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

#[inline(always)]
fn as_bits(x: __m512bh) -> __m512i {
    // SAFETY: as above.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(x) }
}

/// 32 f16 at `at` as 32 bf16 (each rounded to nearest even).
///
/// # Safety
/// 32 elements are readable from `at`; the CPU has AVX-512 F/BF16 and F16C.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn f16_to_bf16(at: *const f16) -> __m512i {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let low = _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
        let high = _mm512_cvtph_ps(_mm256_loadu_si256(at.add(W).cast()));
        as_bits(_mm512_cvtne2ps_pbh(high, low))
    }
}

/// Attention of a block over one KV head of an f16 cache, on the bf16 path.
///
/// # Safety
/// The CPU has AVX-512 F/BW/BF16, AVX2, FMA and F16C; [`takes`] holds for the head_dim; the
/// shapes were checked as for [`super::attend_tiled`]; `query.tokens` > 0.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn attend(
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, f16>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let d = query.head_dim;
    let (heads, tokens) = (query.sinks.len(), query.tokens);
    let layout = kv.row_layout(d);
    debug_assert_eq!(
        layout.padded, d,
        "the bf16 paths take whole 32-lane head dims"
    );
    // The scratch's f32 buffers hold the bf16 rows: each is at least twice as large as needed.
    let queries = scratch.queries.as_mut_ptr().cast::<u16>();
    let keys = scratch.keys.as_mut_ptr().cast::<u16>();
    let value_pairs = scratch.values.as_mut_ptr().cast::<u16>();
    let probs = scratch.probs_bf16.as_mut_ptr();
    // SAFETY: the caller checked the shapes: rows r < tokens x heads <= max_heads, each source
    // query row holds d elements, and d <= max_head_dim, so every write stays in the buffers.
    unsafe { stage_queries(query, queries) };
    for r in 0..tokens * heads {
        scratch.running_max[r] = query.sinks[r % heads];
    }
    scratch.running_sum[..tokens * heads].fill(0.0);
    scratch.acc[..tokens * heads * d].fill(0.0);

    for (tile, seeing) in TileWalk::new(tokens, visible) {
        let (first, count) = (seeing.start, tile.len());
        let rows = first * heads..seeing.end * heads;
        let cache_row = |j: usize| kv.keys[j * kv.row_stride + kv.offset..][..d].as_ptr();
        // SAFETY: rows of the tile lie inside the cache (checked by the caller); the transposed
        // tile holds d/2 x TILE_KEYS pairs (the f32 key tile is TILE_KEYS x padded >= d f32).
        unsafe {
            let mut group = [std::ptr::null(); W];
            for first_key in (0..count).step_by(W) {
                for (i, row) in group.iter_mut().enumerate() {
                    let key = first_key + i;
                    *row = if key < count {
                        let from = cache_row(tile.start + key);
                        prefetch_row_of_next_tile(from, layout);
                        from
                    } else {
                        std::ptr::null()
                    };
                }
                transpose_keys(&group, d, keys.add(2 * first_key));
            }
            let state = RowState {
                running_max: scratch.running_max.as_mut_ptr(),
                running_sum: scratch.running_sum.as_mut_ptr(),
                rescale: scratch.rescale.as_mut_ptr(),
                probs,
            };
            let seen = |r: usize| {
                let visible = visible(r / heads);
                let from = visible.start.clamp(tile.start, tile.end) - tile.start;
                let to = visible.end.clamp(tile.start, tile.end) - tile.start;
                (from, to.max(from))
            };
            probabilities(queries, rows.clone(), d, keys, count, &seen, state);
        }
        // Pairs start at even rows; a row before the block's first visible key is not read.
        let skip = visible(first).start.clamp(tile.start, tile.end) - tile.start;
        let first_pair = skip / 2;
        let pairs = count.div_ceil(2) - first_pair;
        let value_row = |j: usize| kv.values[j * kv.row_stride + kv.offset..][..d].as_ptr();
        // SAFETY: value rows skip..count of the tile lie inside the cache; `value_pairs` holds
        // TILE_KEYS / 2 pairs of 2d bf16 (the f32 value tile is TILE_KEYS x padded >= d f32);
        // probabilities are read up to count rounded up to 16, which `probabilities` wrote
        // (zeros past count), inside each row of TILE_KEYS.
        unsafe {
            for p in 0..pairs {
                let j = 2 * (first_pair + p);
                let even = (j >= skip).then(|| value_row(tile.start + j));
                let odd = (j + 1 < count).then(|| value_row(tile.start + j + 1));
                for row in [even, odd].into_iter().flatten() {
                    prefetch_row_of_next_tile(row, layout);
                }
                stage_value_pair([even, odd], d, value_pairs.add(p * 2 * d), 2 * W);
            }
            let mut r = rows.start;
            while r < rows.end {
                let block = if rows.end - r >= 4 { 4 } else { 1 };
                let mut c = 0;
                while c < d {
                    let args = (
                        probs.add(r * TILE_KEYS + 2 * first_pair).cast_const(),
                        scratch.rescale.as_ptr().add(r),
                        value_pairs.add(2 * c).cast_const(),
                        pairs,
                        d,
                        scratch.acc.as_mut_ptr().add(r * d + c),
                    );
                    match (block, d - c >= 4 * W) {
                        (4, true) => accumulate::<4, 4>(args),
                        (4, false) => accumulate::<4, 2>(args),
                        (_, true) => accumulate::<1, 4>(args),
                        (_, false) => accumulate::<1, 2>(args),
                    }
                    c += if d - c >= 4 * W { 4 * W } else { 2 * W };
                }
                r += block;
            }
        }
    }

    finish_rows(query, scratch, d, out);
}

/// The block's query rows (token-major, then head) scaled and rounded to bf16, as rows of d
/// elements from `to`.
///
/// # Safety
/// `to` has room for `tokens x heads` rows of d; the shapes were checked as for [`attend`]; the
/// CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn stage_queries(query: &BlockQuery<'_>, to: *mut u16) {
    let (d, heads) = (query.head_dim, query.sinks.len());
    // SAFETY: the caller upholds the contract.
    unsafe {
        let scale = _mm512_set1_ps(query.scale);
        for r in 0..query.tokens * heads {
            let (t, g) = (r / heads, r % heads);
            let src = query.queries[t * query.token_stride + g * d..][..d].as_ptr();
            for c in (0..d).step_by(BF16_LANES) {
                let low = _mm512_mul_ps(_mm512_loadu_ps(src.add(c)), scale);
                let high = _mm512_mul_ps(_mm512_loadu_ps(src.add(c + W)), scale);
                let bits = as_bits(_mm512_cvtne2ps_pbh(high, low));
                _mm512_storeu_si512(to.add(r * d + c).cast(), bits);
            }
        }
    }
}

/// Two consecutive value rows (f16; `None`: zeros) as one pair of bf16 rows interleaved column
/// by column, the operand `vdpbf16ps` and `tdpbf16ps` take for a pair of keys: per 16 columns
/// (chunk k, `chunk_stride` bf16 apart, 32 for a contiguous pair of rows) element c of the even
/// row at `to[k * chunk_stride + 2c]`, of the odd row at `to[k * chunk_stride + 2c + 1]`.
///
/// # Safety
/// Each row has d readable f16; `to` has room for d / 16 chunks of 32 bf16 `chunk_stride`
/// apart; the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn stage_value_pair(
    rows: [Option<*const f16>; 2],
    d: usize,
    to: *mut u16,
    chunk_stride: usize,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for c in (0..d).step_by(W) {
            let mut halves = [_mm512_setzero_ps(); 2];
            for (half, row) in halves.iter_mut().zip(rows) {
                if let Some(at) = row {
                    *half = _mm512_cvtph_ps(_mm256_loadu_si256(at.add(c).cast()));
                }
            }
            let both = as_bits(_mm512_cvtne2ps_pbh(halves[1], halves[0]));
            let pair = _mm512_permutexvar_epi16(interleave, both);
            _mm512_storeu_si512(to.add(c / W * chunk_stride).cast(), pair);
        }
    }
}

/// 16 key rows (f16, `null` for keys past the tile's end: zeros) as bf16 pairs transposed:
/// pair p (elements 2p and 2p + 1) of key i at `to[p * TILE_KEYS + i]` (u32 units; `to` points
/// at the group's first key). A 16 x 16 transpose of dwords per 32 elements of the rows.
///
/// # Safety
/// Each non-null row has d readable f16; `to` has room for d/2 rows of TILE_KEYS u32 from its
/// start; the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn transpose_keys(rows: &[*const f16; W], d: usize, to: *mut u16) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let to = to.cast::<u32>();
        for c in (0..d).step_by(BF16_LANES) {
            let mut r = [_mm512_setzero_si512(); W];
            for (x, row) in r.iter_mut().zip(rows) {
                if !row.is_null() {
                    *x = f16_to_bf16(row.add(c));
                }
            }
            for (group, column) in crate::kernels::avx512::transpose_16x16(r)
                .into_iter()
                .enumerate()
            {
                let group = c / 2 + group;
                _mm512_storeu_si512(to.add(group * TILE_KEYS).cast(), column);
            }
        }
    }
}

/// Where [`probabilities`] keeps each query row's online softmax: running maximum and sum, the
/// factor this tile rescales the row's accumulator by, and the tile's probabilities in bf16
/// (rows of TILE_KEYS).
#[derive(Clone, Copy)]
struct RowState {
    running_max: *mut f32,
    running_sum: *mut f32,
    rescale: *mut f32,
    probs: *mut u16,
}

/// One tile's softmax step for query rows `rows`, the logits kept in registers: per row the
/// logits `queries_r . keys_t` (bf16 rows of d, products summed in f32 pair by pair, one key per
/// lane) of the keys `seen(r)` (tile-relative; others -inf), the running maximum and sum
/// updated, the rescale factor of the accumulator, and exp(logit - maximum) rounded to bf16 for
/// the tile's count keys (zeros for the others up to the next multiple of 16).
///
/// # Safety
/// As [`attend`]: `queries` holds the rows of d, `keys` the transposed tile
/// ([`transpose_keys`]), the state's arrays the rows.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn probabilities(
    queries: *const u16,
    rows: Range<usize>,
    d: usize,
    keys: *const u16,
    count: usize,
    seen: &dyn Fn(usize) -> (usize, usize),
    state: RowState,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let groups = count.div_ceil(W);
        let mut r = rows.start;
        while r < rows.end {
            let args = (queries, r, d, keys, seen, state);
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

/// What [`softmax_rows`] takes: the queries, the first row, d, the transposed keys, each row's
/// visible keys, the rows' state.
type SoftmaxRows<'a> = (
    *const u16,
    usize,
    usize,
    *const u16,
    &'a dyn Fn(usize) -> (usize, usize),
    RowState,
);

/// [`probabilities`] for `H` rows from `first` against `G` groups of 16 keys: per pair of
/// elements one `vdpbf16ps` per (row, group), the query pair broadcast.
///
/// # Safety
/// As [`probabilities`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn softmax_rows<const H: usize, const G: usize>(
    (queries, first, d, keys, seen, state): SoftmaxRows<'_>,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let keys = keys.cast::<u32>();
        let q = queries.add(first * d);
        let mut sums = [[_mm512_setzero_ps(); G]; H];
        for p in 0..d / 2 {
            let mut k = [as_bh(_mm512_setzero_si512()); G];
            for (g, x) in k.iter_mut().enumerate() {
                *x = as_bh(_mm512_loadu_si512(keys.add(p * TILE_KEYS + g * W).cast()));
            }
            for (h, row) in sums.iter_mut().enumerate() {
                let pair = q.add(h * d + 2 * p).cast::<i32>().read_unaligned();
                let pair = as_bh(_mm512_set1_epi32(pair));
                for (s, x) in row.iter_mut().zip(&k) {
                    *s = _mm512_dpbf16_ps(*s, pair, *x);
                }
            }
        }
        for (h, row) in sums.iter_mut().enumerate() {
            let r = first + h;
            let (from, to) = seen(r);
            let below = |n: usize| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
            let visible = below(to) & !below(from);
            let mut tile_max = _mm512_set1_ps(f32::NEG_INFINITY);
            for (g, s) in row.iter_mut().enumerate() {
                let keep = (visible >> (g * W)) as u16;
                *s = _mm512_mask_blend_ps(keep, _mm512_set1_ps(f32::NEG_INFINITY), *s);
                tile_max = _mm512_max_ps(tile_max, *s);
            }
            let max = *state.running_max.add(r);
            let new_max = max.max(_mm512_reduce_max_ps(tile_max));
            // The vector path's polynomial in one lane: libm's expf here cost about a cycle per
            // (row, key) of a tile.
            let rescale = fast_exp(max - new_max);
            let shift = _mm512_set1_ps(new_max);
            let mut total = _mm512_setzero_ps();
            for (g, s) in row.iter().enumerate() {
                let p = exp_for_bf16(_mm512_sub_ps(*s, shift));
                total = _mm512_add_ps(total, p);
                let bits = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(p));
                _mm256_storeu_si256(state.probs.add(r * TILE_KEYS + g * W).cast(), bits);
            }
            let sum = state.running_sum.add(r);
            *sum = *sum * rescale + _mm512_reduce_add_ps(total);
            *state.running_max.add(r) = new_max;
            *state.rescale.add(r) = rescale;
        }
    }
}

/// `acc_h = acc_h * rescale_h + sum_p probs_h[p] . pairs[p]` for H rows and C x 16 columns:
/// one `vdpbf16ps` per (row, pair of keys, 16 columns), the accumulators in registers across
/// the tile.
///
/// # Safety
/// `probs` row h (TILE_KEYS apart) holds 2 x `pairs` bf16; `pairs` value pairs of 2d bf16 start
/// at `values` (offset to this block's columns); `acc` rows of d hold C x 16 columns from here.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn accumulate<const H: usize, const C: usize>(
    (probs, rescale, values, pairs, d, acc): (
        *const u16,
        *const f32,
        *const u16,
        usize,
        usize,
        *mut f32,
    ),
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let mut sums = [[_mm512_setzero_ps(); C]; H];
        for (h, row) in sums.iter_mut().enumerate() {
            let factor = _mm512_set1_ps(*rescale.add(h));
            for (c, s) in row.iter_mut().enumerate() {
                *s = _mm512_mul_ps(_mm512_loadu_ps(acc.add(h * d + c * W)), factor);
            }
        }
        for p in 0..pairs {
            let pair = values.add(p * 2 * d);
            let mut v = [as_bh(_mm512_setzero_si512()); C];
            for (c, x) in v.iter_mut().enumerate() {
                *x = as_bh(_mm512_loadu_si512(pair.add(c * 2 * W).cast()));
            }
            for (h, row) in sums.iter_mut().enumerate() {
                let both = probs
                    .add(h * TILE_KEYS + 2 * p)
                    .cast::<i32>()
                    .read_unaligned();
                let weights = as_bh(_mm512_set1_epi32(both));
                for (s, x) in row.iter_mut().zip(&v) {
                    *s = _mm512_dpbf16_ps(*s, weights, *x);
                }
            }
        }
        for (h, row) in sums.iter().enumerate() {
            for (c, s) in row.iter().enumerate() {
                _mm512_storeu_ps(acc.add(h * d + c * W), *s);
            }
        }
    }
}
