//! AVX-512 products of MXFP4 matrices in the tile layout ([`Mxfp4Layout::Tiles`]).
//!
//! One 64-byte vector of a tile is one dword (8 nibbles) of 16 rows, so its two decoded halves
//! are `vpdpbusd` operands for an even and an odd activation dword as they stand: a block's sums
//! for 16 rows build up in one register per token, and the float convert, scale and FMA run once
//! per (16 rows, block, token), with nothing transposed at run time. Up to [`DIRECT_TOKENS`]
//! tokens the nibbles are decoded in registers as they are used ([`tile_tokens`]); more tokens
//! decode two tiles into the GEMM scratch once and reuse the row-order GEMM's micro-kernels.
//!
//! The integer sums are the row-order kernels' sums and the float steps run block by block in
//! the same order as [`super::gemm_tile`], so results are bit for bit those of the row-order GEMM.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::avx2::prefetch_share_into;
use super::super::formats::{
    ByteSpans, Mxfp4Layout, Mxfp4Matrix, Q8Activations, BLOCK_LEN, CORRECTION_LANE_MXFP4,
    GROUP_BLOCKS, GROUP_LANES, GROUP_LEN, MXFP4_TILE_ROWS,
};
use super::super::{GemmScratch, GEMM_TILE_ROWS, GEMM_TILE_SLOTS};
use super::{
    activation_exponent_range, combined_scale, exponent_mode, exponent_offsets, format_factor,
    gemm_tile, gemm_tile_pair, split_nibbles, Prefetch, FORMAT_MXFP4, GEMM_PAIR_TOKENS,
    GEMM_TOKENS, GROUP_DWORDS, MXFP4_UNSIGNED_64,
};

/// Most tokens [`tile_tokens`] takes at once: their sums and accumulators (2 x 8 registers)
/// and the two decoded operands stay inside the 32 zmm registers.
pub(super) const DIRECT_TOKENS: usize = 8;

/// Most tokens of a call that run through [`direct`] (in groups of [`DIRECT_TOKENS`], each
/// decoding the tile again from L1); beyond, a tile is decoded once into scratch. Measured on
/// Zen 4, 2 threads, one expert matrix (`bench --kernels`): M = 16 direct 76% of the int8 peak
/// against 65% through scratch; M = 32 58% against 73%.
pub(super) const DIRECT_CALL_TOKENS: usize = 16;

/// The tiles' 64-byte dword vectors per block of 32 columns.
const BLOCK_VECTORS: usize = BLOCK_LEN / 8;

/// Unsigned weights for the even (low nibbles) and odd (high nibbles) activation dwords of one
/// tile vector: `vpermb` when `VBMI` (no masks: it ignores index bits 6-7 and the table repeats
/// every 16), else `vpshufb` after masking.
#[inline(always)]
unsafe fn decode<const VBMI: bool>(bytes: __m512i) -> (__m512i, __m512i) {
    // SAFETY: register operations and a 64-byte table read; the callers' target features hold
    // AVX-512 F/BW (and VBMI when `VBMI`).
    unsafe {
        if VBMI {
            let table = _mm512_loadu_si512(MXFP4_UNSIGNED_64.as_ptr().cast());
            (
                _mm512_permutexvar_epi8(bytes, table),
                _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(bytes), table),
            )
        } else {
            split_nibbles::<FORMAT_MXFP4>(bytes)
        }
    }
}

/// Sixteen rows' scales of one block, 2^(s - 127) (0 for s = 0, as everywhere else).
#[inline(always)]
unsafe fn block_scales(scales: *const u8) -> __m512 {
    // SAFETY: the caller points `scales` at 16 readable bytes; AVX-512F holds.
    unsafe {
        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(scales.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bytes))
    }
}

/// Lanes `lanes` of each token's 16 results, times the format's factor, to
/// `out[t * stride + lane]`; `out` points at lane 0 of the tile for token 0 (it may lie before
/// the caller's buffer when the tile starts before its rows: masked-off lanes are never touched).
#[inline(always)]
unsafe fn store_tile<const T: usize>(
    acc: &[__m512; T],
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
) {
    // SAFETY: the caller guarantees that every unmasked lane's address is inside its output;
    // masked stores do not access masked-off lanes.
    unsafe {
        let mask = (((1u32 << lanes.end) - 1) & !((1u32 << lanes.start) - 1)) as __mmask16;
        let factor = _mm512_set1_ps(format_factor(FORMAT_MXFP4));
        for (t, acc_t) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(
                out.wrapping_add(t * stride),
                mask,
                _mm512_mul_ps(*acc_t, factor),
            );
        }
    }
}

/// One tile (16 rows) against tokens `first_token..first_token + T` of `x`, decoding each
/// vector in registers once for all `T` tokens, while prefetching `prefetch` into L2.
///
/// # Safety
/// `tile` is inside `w` (tiled), the tokens exist in `x`, `out` as in [`store_tile`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_tokens<const T: usize, const VBMI: bool, const EXP: bool>(
    w: &Mxfp4Matrix,
    tile: usize,
    x: &Q8Activations,
    first_token: usize,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: &[(*const u8, usize); 2],
) {
    // SAFETY: the caller upholds the contract; every offset below stays inside the tile's bytes
    // and the tokens' activation rows.
    unsafe {
        let blocks_per_row = w.cols / BLOCK_LEN;
        let (bytes_at, scales_at) = w.tile_offsets(tile);
        let vectors = w.blocks.as_ptr().add(bytes_at);
        let scales = w.scales.as_ptr().add(scales_at);
        let token_quants = x.quants.as_ptr().add(first_token * x.groups * GROUP_LEN);
        let token_lanes = first_token * x.groups * GROUP_LANES;
        let corrections = x.corrections.as_ptr().add(token_lanes);
        let act_scales = x.scale_lanes.as_ptr().add(token_lanes);
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        let mut acc = [_mm512_setzero_ps(); T];
        for block in 0..blocks_per_row {
            prefetch_share_into::<true>(prefetch, block, blocks_per_row);
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let lane = group * GROUP_LANES + 4 * j;
            let mut sums: [__m512i; T] = std::array::from_fn(|t| {
                _mm512_set1_epi32(*corrections.add(t * lane_stride + lane + CORRECTION_LANE_MXFP4))
            });
            for s in 0..BLOCK_VECTORS {
                let bytes =
                    _mm512_loadu_si512(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
                let (evens, odds) = decode::<VBMI>(bytes);
                // Activation dword 4j + s holds the evens this vector's low nibbles meet, dword
                // 16 + 4j + s the odds.
                let at = group * GROUP_LEN + 4 * (4 * j + s);
                for (t, sum) in sums.iter_mut().enumerate() {
                    let quants = token_quants.add(t * quant_stride + at);
                    let even = _mm512_set1_epi32(quants.cast::<i32>().read_unaligned());
                    let odd =
                        _mm512_set1_epi32(quants.add(GROUP_LEN / 2).cast::<i32>().read_unaligned());
                    *sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*sum, evens, even), odds, odd);
                }
            }
            let w_scales = block_scales(scales.add(block * MXFP4_TILE_ROWS));
            let w_exponents = exponent_offsets(w_scales);
            for (t, (acc_t, sum)) in acc.iter_mut().zip(sums).enumerate() {
                *acc_t = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(sum),
                    combined_scale::<EXP>(
                        w_scales,
                        w_exponents,
                        act_scales.add(t * lane_stride + lane),
                    ),
                    *acc_t,
                );
            }
        }
        store_tile(&acc, out, stride, lanes);
    }
}

/// Tiles covering `rows`, each against every token of `x` in groups of at most
/// [`DIRECT_TOKENS`], prefetching one tile ahead (past `rows` up to the matrix's end, so the
/// next task's first tile is not a cold miss either).
///
/// # Safety
/// `w` tiled, `x` matches it, `rows` inside it, `out.len() == x.rows() * rows.len()`; the CPU
/// has the features of the function this is inlined into.
#[inline(always)]
unsafe fn direct<const VBMI: bool>(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    exp: bool,
) {
    // SAFETY: the caller upholds the contract; `store_tile` writes only lanes of `rows`.
    unsafe {
        let stride = rows.len();
        let tokens = x.rows();
        let batch = tokens.div_ceil(tokens.div_ceil(DIRECT_TOKENS));
        let limit = w.row_count();
        let mut tile = rows.start / MXFP4_TILE_ROWS;
        while tile * MXFP4_TILE_ROWS < rows.end {
            let first_row = tile * MXFP4_TILE_ROWS;
            let lanes =
                rows.start.saturating_sub(first_row)..(rows.end - first_row).min(MXFP4_TILE_ROWS);
            let next = (first_row + MXFP4_TILE_ROWS).min(limit);
            let spans = w.byte_spans(next..(next + MXFP4_TILE_ROWS).min(limit));
            // `out` for row `first_row`: before the buffer when the tile starts before `rows`.
            let tile_out = out
                .as_mut_ptr()
                .wrapping_add(first_row)
                .wrapping_sub(rows.start);
            let mut token = 0;
            while token < tokens {
                let count = (tokens - token).min(batch);
                let o = tile_out.wrapping_add(token * stride);
                // The next tile is prefetched once, during the first token group.
                let p = if token == 0 {
                    spans
                } else {
                    [(std::ptr::null(), 0); 2]
                };
                macro_rules! tokens_for {
                    ($($n:literal)*) => {
                        match (count, exp) {
                            $(($n, false) => tile_tokens::<$n, VBMI, false>(w, tile, x, token, o, stride, lanes.clone(), &p),
                            ($n, true) => tile_tokens::<$n, VBMI, true>(w, tile, x, token, o, stride, lanes.clone(), &p),)*
                            (_, false) => tile_tokens::<1, VBMI, false>(w, tile, x, token, o, stride, lanes.clone(), &p),
                            (_, true) => tile_tokens::<1, VBMI, true>(w, tile, x, token, o, stride, lanes.clone(), &p),
                        }
                    };
                }
                tokens_for!(8 7 6 5 4 3 2);
                token += count;
            }
            tile += 1;
        }
    }
}

/// Decodes tile `tile` into slot `slot` of the scratch in the layout [`super::decode_tile`]
/// writes (per group: vector q < 16 the evens of dword q, 16 + q the odds; scale lanes per
/// block), prefetching `prefetch`'s share. Blocks past a short last group get scale 1 and keep
/// whatever integers the scratch held: they meet zero activations and a zero correction.
///
/// # Safety
/// `tile` inside the tiled `w`, scratch sized for its columns, `slot < GEMM_TILE_SLOTS`.
#[inline(always)]
unsafe fn decode_tile<const VBMI: bool>(
    w: &Mxfp4Matrix,
    tile: usize,
    scratch: &mut GemmScratch,
    slot: usize,
    prefetch: Prefetch,
) {
    // SAFETY: the caller upholds the contract; writes stay inside the slot.
    unsafe {
        let blocks_per_row = w.cols / BLOCK_LEN;
        let groups = blocks_per_row.div_ceil(GROUP_BLOCKS);
        let (bytes_at, scales_at) = w.tile_offsets(tile);
        let vectors = w.blocks.as_ptr().add(bytes_at);
        let scales = w.scales.as_ptr().add(scales_at);
        let slot_tile = scratch
            .tile
            .as_mut_ptr()
            .add(slot * super::tile_slot_bytes(groups));
        let slot_scales = scratch
            .tile_scales
            .as_mut_ptr()
            .add(slot * super::tile_slot_scales(groups));
        for group in 0..groups {
            prefetch.share(group, groups);
            let at = slot_tile.add(group * GEMM_TILE_ROWS * GROUP_LEN);
            let blocks_here = (blocks_per_row - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
            for j in 0..GROUP_BLOCKS {
                let to = slot_scales.add((group * GROUP_BLOCKS + j) * GEMM_TILE_ROWS);
                if j >= blocks_here {
                    _mm512_storeu_ps(to, _mm512_set1_ps(1.0));
                    continue;
                }
                let block = group * GROUP_BLOCKS + j;
                for s in 0..BLOCK_VECTORS {
                    let bytes =
                        _mm512_loadu_si512(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
                    let (evens, odds) = decode::<VBMI>(bytes);
                    let q = 4 * j + s;
                    _mm512_storeu_si512(at.add(q * 64).cast(), evens);
                    _mm512_storeu_si512(at.add((GROUP_DWORDS / 2 + q) * 64).cast(), odds);
                }
                _mm512_storeu_ps(to, block_scales(scales.add(block * MXFP4_TILE_ROWS)));
            }
        }
    }
}

/// More than [`DIRECT_TOKENS`] tokens: pairs of tiles decoded into scratch once, then the
/// row-order GEMM's micro-kernels over every token; a tile `rows` covers only in part (never
/// in the model, whose tasks are whole tiles) goes through [`direct`].
///
/// # Safety
/// As [`direct`], scratch sized for `w`'s columns.
#[inline(always)]
unsafe fn gemm<const VBMI: bool>(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
    exp: bool,
) {
    // SAFETY: the caller upholds the contract; the pair and single micro-kernels write
    // `tokens x count` values inside `out` for whole tiles inside `rows`.
    unsafe {
        let whole = rows.start.next_multiple_of(MXFP4_TILE_ROWS)
            ..rows.end / MXFP4_TILE_ROWS * MXFP4_TILE_ROWS;
        if whole.start >= whole.end {
            return direct::<VBMI>(w, x, rows, out, exp);
        }
        let stride = rows.len();
        let tokens = x.rows();
        let lane = CORRECTION_LANE_MXFP4;
        let factor = format_factor(FORMAT_MXFP4);
        let groups = (w.cols / BLOCK_LEN).div_ceil(GROUP_BLOCKS);
        // Edge tiles cut by `rows`, one row-range each, through the direct kernel into a view
        // of `out` with the same stride: done as separate passes over the tokens.
        for edge in [rows.start..whole.start, whole.end..rows.end] {
            if edge.is_empty() {
                continue;
            }
            edge_rows::<VBMI>(w, x, rows.clone(), edge, out, exp);
        }
        let pair_rows = GEMM_TILE_SLOTS * GEMM_TILE_ROWS;
        let spans_from = |start: usize| w.byte_spans(start..(start + pair_rows).min(w.row_count()));
        super::prefetch_share(&spans_from(whole.start), 0, 1);
        let mut tile_start = whole.start;
        while tile_start < whole.end {
            let count = (whole.end - tile_start).min(pair_rows);
            let out_column = out.as_mut_ptr().add(tile_start - rows.start);
            let next = spans_from((tile_start + pair_rows).min(w.row_count()));
            let tile = tile_start / MXFP4_TILE_ROWS;
            if count > GEMM_TILE_ROWS {
                let batch = tokens.div_ceil(tokens.div_ceil(GEMM_PAIR_TOKENS));
                let parts = GEMM_TILE_SLOTS + tokens.div_ceil(batch);
                let part = |index: usize| Prefetch {
                    spans: next,
                    batch: index,
                    batches: parts,
                };
                decode_tile::<VBMI>(w, tile, scratch, 0, part(0));
                decode_tile::<VBMI>(w, tile + 1, scratch, 1, part(1));
                let mut token = 0;
                while token < tokens {
                    let t_count = (tokens - token).min(batch);
                    let o = out_column.add(token * stride);
                    let s = &*scratch;
                    let p = part(GEMM_TILE_SLOTS + token / batch);
                    macro_rules! pair_for {
                        ($($n:literal)*) => {
                            match (t_count, exp) {
                                $(($n, false) => gemm_tile_pair::<$n, false>(s, groups, x, token, lane, factor, o, stride, count, p),
                                ($n, true) => gemm_tile_pair::<$n, true>(s, groups, x, token, lane, factor, o, stride, count, p),)*
                                (_, false) => gemm_tile_pair::<1, false>(s, groups, x, token, lane, factor, o, stride, count, p),
                                (_, true) => gemm_tile_pair::<1, true>(s, groups, x, token, lane, factor, o, stride, count, p),
                            }
                        };
                    }
                    pair_for!(6 5 4 3 2);
                    token += t_count;
                }
            } else {
                decode_tile::<VBMI>(w, tile, scratch, 0, Prefetch::NOTHING);
                let batch = tokens.div_ceil(tokens.div_ceil(GEMM_TOKENS));
                let mut token = 0;
                while token < tokens {
                    let t_count = (tokens - token).min(batch);
                    let o = out_column.add(token * stride);
                    let s = &*scratch;
                    let p = Prefetch::NOTHING;
                    macro_rules! tile_for {
                        ($($n:literal)*) => {
                            match (t_count, exp) {
                                $(($n, false) => gemm_tile::<$n, false>(s, groups, x, token, lane, factor, o, stride, count, p),
                                ($n, true) => gemm_tile::<$n, true>(s, groups, x, token, lane, factor, o, stride, count, p),)*
                                (_, false) => gemm_tile::<1, false>(s, groups, x, token, lane, factor, o, stride, count, p),
                                (_, true) => gemm_tile::<1, true>(s, groups, x, token, lane, factor, o, stride, count, p),
                            }
                        };
                    }
                    tile_for!(8 7 6 5 4 3 2);
                    token += t_count;
                }
            }
            tile_start += count;
        }
    }
}

/// Rows `edge` (inside one tile, inside `rows`) of every token through [`direct`], written into
/// `out` (whose rows are `rows`).
///
/// # Safety
/// As [`gemm`].
#[inline(always)]
unsafe fn edge_rows<const VBMI: bool>(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    edge: Range<usize>,
    out: &mut [f32],
    exp: bool,
) {
    // SAFETY: the caller upholds the contract; each token's results land in its own row of
    // `out` at the edge's columns.
    unsafe {
        let stride = rows.len();
        let tokens = x.rows();
        let tile = edge.start / MXFP4_TILE_ROWS;
        let first_row = tile * MXFP4_TILE_ROWS;
        let lanes = edge.start - first_row..edge.end - first_row;
        let tile_out = out
            .as_mut_ptr()
            .wrapping_add(first_row)
            .wrapping_sub(rows.start);
        let none = [(std::ptr::null(), 0); 2];
        let mut token = 0;
        while token < tokens {
            let count = (tokens - token).min(DIRECT_TOKENS);
            let o = tile_out.wrapping_add(token * stride);
            macro_rules! tokens_for {
                ($($n:literal)*) => {
                    match (count, exp) {
                        $(($n, false) => tile_tokens::<$n, VBMI, false>(w, tile, x, token, o, stride, lanes.clone(), &none),
                        ($n, true) => tile_tokens::<$n, VBMI, true>(w, tile, x, token, o, stride, lanes.clone(), &none),)*
                        (_, false) => tile_tokens::<1, VBMI, false>(w, tile, x, token, o, stride, lanes.clone(), &none),
                        (_, true) => tile_tokens::<1, VBMI, true>(w, tile, x, token, o, stride, lanes.clone(), &none),
                    }
                };
            }
            tokens_for!(8 7 6 5 4 3 2);
            token += count;
        }
    }
}

/// Whether the exponent-add scaling may run for these rows and tokens (see
/// [`super::combined_scale`]): the weights' scale bytes of the tiles `rows` touches are
/// contiguous, so one pass finds their range.
fn exponent_add_allowed(w: &Mxfp4Matrix, x: &Q8Activations, rows: &Range<usize>) -> bool {
    let [_, (scales, len)] = w.byte_spans(rows.clone());
    if len == 0 {
        return false;
    }
    // SAFETY: `byte_spans` of rows inside the matrix is a range of its scale bytes.
    let bytes = unsafe { std::slice::from_raw_parts(scales, len) };
    let (low, high) = bytes
        .iter()
        .fold((u8::MAX, 0u8), |(lo, hi), &b| (lo.min(b), hi.max(b)));
    exponent_mode(
        activation_exponent_range(x),
        Some((low as u32, high as u32)),
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn product_plain(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
    exp: bool,
) {
    // SAFETY: the caller upholds `product`'s contract.
    unsafe {
        match scratch {
            Some(scratch) if x.rows() > DIRECT_CALL_TOKENS => {
                gemm::<false>(w, x, rows, out, scratch, exp)
            }
            _ => direct::<false>(w, x, rows, out, exp),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn product_vbmi(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
    exp: bool,
) {
    // SAFETY: the caller upholds `product`'s contract, and the CPU has AVX-512 VBMI.
    unsafe {
        match scratch {
            Some(scratch) if x.rows() > DIRECT_CALL_TOKENS => {
                gemm::<true>(w, x, rows, out, scratch, exp)
            }
            _ => direct::<true>(w, x, rows, out, exp),
        }
    }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled `w`: in registers up to
/// [`DIRECT_TOKENS`] tokens (or without scratch, as the GEMV entry calls it), through decoded
/// scratch tiles beyond.
///
/// # Safety
/// The CPU has the module's features (and VBMI if `vbmi`); `w` is tiled and the shapes were
/// checked by `Kernels`; scratch sized for `w`'s columns.
pub(in crate::kernels) unsafe fn product(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
    vbmi: bool,
) {
    debug_assert_eq!(w.layout, Mxfp4Layout::Tiles);
    if rows.is_empty() || x.rows() == 0 {
        return;
    }
    let exp = exponent_add_allowed(w, x, &rows);
    // SAFETY: the caller upholds the contract, which both entries share.
    unsafe {
        if vbmi {
            product_vbmi(w, x, rows, out, scratch, exp)
        } else {
            product_plain(w, x, rows, out, scratch, exp)
        }
    }
}
