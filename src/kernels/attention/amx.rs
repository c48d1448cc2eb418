//! The bf16 attention of [`super::bf16`] on Intel's AMX matrix unit (`tdpbf16ps`, AMX-BF16):
//! the same arithmetic, stated by [`super::attend_block_bf16_reference`] (scaled queries, keys,
//! values and probabilities rounded to bf16, every product summed in f32), with both products of
//! a tile, the logits and the probability-weighted values, on the matrix unit. One `tdpbf16ps`
//! does 16 x 16 x 32 multiply-adds, 256 `vdpbf16ps`' worth; what is left for the vector units is
//! the softmax.
//!
//! # Transposed tiles
//! The products are computed transposed, keys (or head dims) down the tile and the 16 query rows
//! across its lanes, so the softmax runs lane-parallel: each query row's running maximum, sum
//! and rescale factor live in one lane of a vector, and a tile's maximum and sum are vertical
//! `vmaxps` / `vaddps` over its keys, with no horizontal reduction and no scalar exponential per
//! row. Per key tile (the other paths' tiles: [`TILE_KEYS`] keys at multiples of it, walked by
//! [`TileWalk`]) and 16 query rows (token-major, then head; a block's rows padded to a multiple
//! of 16 with zero queries that see every key):
//! * logits^T (16 keys x 16 rows a sum tile) = keys (A: 16 keys x 32 elements, the cache rows in
//!   bf16 as they stand) x queries^T (B: 16 pairs of elements x 16 rows, transposed once per
//!   block), `head_dim / 32` products each;
//! * the online softmax over the stored logits, 16 rows at a time; the probabilities rounded to
//!   bf16 and paired key by key into the B operand of the next product (a conversion and a
//!   permute per two keys);
//! * outputs^T (16 head dims x 16 rows) = values^T (A: 16 dims x 32 keys, staged per key tile as
//!   pairs of consecutive value rows transposed) x probabilities^T, from zero, added to the f32
//!   accumulators (also transposed) after these are scaled by the rescale factor.
//!
//! # The same bits alone or in a block
//! Each column of a tile product depends on its own query row alone, and the softmax is lane by
//! lane, so a token's result does not depend on the other rows of its block: a decoded token (one
//! token, its G rows of a tile) gets the bits it gets inside any prefill block. Keys a row does
//! not see get probability 0 (masked per lane where a tile is not whole for every row), and
//! values never read (before the block's window, past the tile) are staged as zeros, so they add
//! exact zeros.

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::bf16::{f16_to_bf16, stage_queries, stage_value_pair, BF16_LANES};
use super::{
    prefetch_row_of_next_tile, AmxScratch, AttentionScratch, BlockQuery, KvHead, RowLayout,
    TileWalk, TILE_KEYS,
};
use crate::kernels::amx::{TileSession, FULL_CONFIG};
use crate::kernels::avx512::transpose_16x16;

/// Query rows of a tile: the lanes of its transposed products.
pub(super) const ROWS: usize = 16;
/// Keys of a logit tile, and head dims of an output tile: the rows of a sum tile.
const LANES: usize = 16;
/// bf16 elements of an A tile row: the K of one product.
const K: usize = 32;
/// Bytes of a tile row of 16 f32 or 16 pairs of bf16: the stride of every transposed operand.
const ROW_BYTES: usize = 64;
/// bf16 elements of a B tile of paired value rows: 16 key pairs x 16 head dims x 2.
const PAIR_TILE: usize = K / 2 * K;

/// Attention of a block over one KV head of an f16 cache, on the matrix unit.
///
/// # Safety
/// [`crate::kernels::amx::bf16_available`] holds; the CPU has AVX-512 F/BW/BF16, AVX2, FMA and
/// F16C; [`super::bf16::takes`] holds for the head_dim; the shapes were checked as for
/// [`super::attend_tiled`]; `query.tokens` > 0.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn attend(
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, f16>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let d = query.head_dim;
    let (heads, tokens) = (query.sinks.len(), query.tokens);
    let total = tokens * heads;
    let row_tiles = total.div_ceil(ROWS);
    let layout = kv.row_layout(d);
    debug_assert_eq!(
        layout.padded, d,
        "the bf16 paths take whole 32-lane head dims"
    );
    let amx = &mut scratch.amx;
    // SAFETY: the caller checked the shapes: the scratch holds max_heads rounded up to 16 query
    // rows of d >= every row tile of the block.
    unsafe {
        let queries = amx.queries.as_mut_ptr();
        stage_queries(query, queries);
        std::ptr::write_bytes(queries.add(total * d), 0, (row_tiles * ROWS - total) * d);
        let pairs = amx.query_pairs.as_mut_ptr();
        for row_tile in 0..row_tiles {
            for c in (0..d).step_by(BF16_LANES) {
                let mut rows = [_mm512_setzero_si512(); ROWS];
                for (i, row) in rows.iter_mut().enumerate() {
                    *row = _mm512_loadu_si512(queries.add((row_tile * ROWS + i) * d + c).cast());
                }
                for (p, column) in transpose_16x16(rows).into_iter().enumerate() {
                    let at = (row_tile * d / 2 + c / 2 + p) * ROWS;
                    _mm512_storeu_si512(pairs.add(at).cast(), column);
                }
            }
        }
    }
    for r in 0..row_tiles * ROWS {
        // Padding rows (zero queries, results dropped) see what the last row sees, so the ends
        // of the rows' visible ranges grow lane by lane across every row tile.
        let (seen, sink) = if r < total {
            (visible(r / heads), query.sinks[r % heads])
        } else {
            (visible(tokens - 1), 0.0)
        };
        amx.seen_from[r] = seen.start;
        amx.seen_to[r] = seen.end;
        amx.running_max[r] = sink;
        amx.running_sum[r] = 0.0;
    }
    amx.acc[..row_tiles * ROWS * d].fill(0.0);

    // SAFETY: the caller checked that the OS granted the tile state.
    let session = unsafe { TileSession::start(&FULL_CONFIG) };
    if row_tiles == 1 {
        // SAFETY: the session holds FULL_CONFIG; the caller's contract.
        unsafe { attend_one_row_tile(&session, kv, layout, visible, (tokens, total), amx) };
    } else {
        // SAFETY: as above.
        unsafe { attend_row_tiles(&session, kv, layout, visible, (tokens, heads), amx) };
    }
    drop(session);

    for (r, out) in out.chunks_exact_mut(d).take(total).enumerate() {
        let sink = query.sinks[r % heads];
        let denominator = amx.running_sum[r] + (sink - amx.running_max[r]).exp();
        let inverse = 1.0 / denominator;
        // A lone row tile leaves its accumulators untransposed (`attend_one_row_tile`).
        if row_tiles == 1 {
            for (o, a) in out.iter_mut().zip(&amx.acc[r * d..]) {
                *o = a * inverse;
            }
        } else {
            let acc = &amx.acc[(r / ROWS) * d * ROWS + r % ROWS..];
            for (c, o) in out.iter_mut().enumerate() {
                *o = acc[c * ROWS] * inverse;
            }
        }
    }
}

/// Stages key tile `tile` for the products: its keys as bf16 rows of d (zeros up to a whole 16)
/// at `keys`, its values at `values` transposed ([`stage_values_transposed`]) or, with
/// `PAIRED`, as pairs of rows ([`stage_values_paired`]), values before row `skip` of the tile
/// (the block's first visible key) and past its end as zeros; asks for the next tile's rows
/// meanwhile.
///
/// # Safety
/// The tile's rows lie inside the cache; `keys` and `values` have room for TILE_KEYS x d bf16;
/// the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn stage_tile<const PAIRED: bool>(
    kv: &KvHead<'_, f16>,
    layout: RowLayout,
    tile: Range<usize>,
    skip: usize,
    (keys, values): (*mut u16, *mut u16),
) {
    let d = layout.head_dim;
    let count = tile.len();
    let (groups, halves) = (count.div_ceil(LANES), count.div_ceil(K));
    // Row pointers by arithmetic, not a bounds-checked slice per row (which showed in the
    // profile of a decoded token: about 3% of its attention, measured alternating). The
    // contract puts the tile's rows inside both caches.
    debug_assert!(kv.keys.len() >= (tile.end - 1) * kv.row_stride + kv.offset + d);
    debug_assert!(kv.values.len() >= (tile.end - 1) * kv.row_stride + kv.offset + d);
    let (key_base, value_base) = (kv.keys.as_ptr(), kv.values.as_ptr());
    let key_row = |j: usize| key_base.wrapping_add(j * kv.row_stride + kv.offset);
    let value_row = |j: usize| value_base.wrapping_add(j * kv.row_stride + kv.offset);
    // SAFETY: the caller upholds the contract.
    unsafe {
        for key in 0..groups * LANES {
            let to = keys.add(key * d);
            if key < count {
                let from = key_row(tile.start + key);
                prefetch_row_of_next_tile(from, layout);
                for c in (0..d).step_by(BF16_LANES) {
                    _mm512_storeu_si512(to.add(c).cast(), f16_to_bf16(from.add(c)));
                }
            } else {
                std::ptr::write_bytes(to, 0, d);
            }
        }
        let mut value_rows = [std::ptr::null(); TILE_KEYS];
        for (j, row) in value_rows.iter_mut().enumerate().take(count).skip(skip) {
            *row = value_row(tile.start + j);
            prefetch_row_of_next_tile(*row, layout);
        }
        if PAIRED {
            stage_values_paired(&value_rows, halves, d, values);
        } else {
            stage_values_transposed(&value_rows, halves, d, values);
        }
    }
}

/// The tile walk of a block whose rows fill one row tile (a decoded token's G rows, or a few
/// tokens), pipelined over the key tiles instead of the row tiles, each product issued a phase
/// of other work before its result is read (see [`attend_row_tiles`]): step i runs tile i's
/// softmax, stages tile i + 2, issues tile i's value products and tile i + 1's logits, and adds
/// tile i - 1's value products.
///
/// The value products are untransposed here: probabilities as rows (A, the softmax's pairs
/// transposed once per 32 keys) times the values as pairs of rows (B), into 16 query rows x 16
/// head dims, so staging a tile's values needs no transpose of head_dim x 64 elements, and only
/// the block's `rows` real rows are added up. Every output is the same sum of the same bf16
/// products in the same order as in [`attend_row_tiles`] (a product of two bf16 is exact in f32,
/// whichever operand it comes from), and each accumulator takes the same rescale and add, so a
/// row gets the same bits either way. One Xeon thread, G = 8, head_dim 64, one token at depth
/// 4096 (the attention benchmark, builds alternated, three rounds): 2.95-3.3 ns per (query
/// head, key) transposed, 2.45-2.9 untransposed (with the row pointers of [`stage_tile`]), 13-18%
/// less in each round. In a decode step at depth 4096 the attention kernels' share of the
/// samples fell from 8.0% to 7.1% (`perf`, two threads): they wait for the cache's rows.
///
/// # Safety
/// As [`attend`]'s after its staging of the queries and state; `session` holds [`FULL_CONFIG`];
/// `rows` <= 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn attend_one_row_tile(
    session: &TileSession,
    kv: &KvHead<'_, f16>,
    layout: RowLayout,
    visible: &dyn Fn(usize) -> Range<usize>,
    (tokens, rows): (usize, usize),
    amx: &mut AmxScratch,
) {
    let d = layout.head_dim;
    let staged = TILE_KEYS * d;
    let (keys_base, values_base) = (amx.keys.as_mut_ptr(), amx.values.as_mut_ptr());
    let keys = |i: usize| keys_base.wrapping_add(i % 3 * staged);
    let values = |i: usize| values_base.wrapping_add(i % 3 * staged);
    let (logits_base, probs_base) = (amx.logits.as_mut_ptr(), amx.probs.as_mut_ptr());
    let logits = |i: usize| logits_base.wrapping_add(i % 2 * TILE_KEYS * ROWS);
    let probs = |i: usize| probs_base.wrapping_add(i % 2 * TILE_KEYS / 2 * ROWS);
    let prob_rows_base = amx.prob_rows.as_mut_ptr();
    let prob_rows = |i: usize| prob_rows_base.wrapping_add(i % 2 * TILE_KEYS / 2 * ROWS);
    let partial_base = amx.partial.as_mut_ptr();
    let partial = |i: usize| partial_base.wrapping_add(i % 2 * d * ROWS);
    let query_pairs = amx.query_pairs.as_ptr();
    let acc = amx.acc.as_mut_ptr();
    let skip = |(tile, seeing): &(Range<usize>, Range<usize>)| {
        visible(seeing.start).start.clamp(tile.start, tile.end) - tile.start
    };
    let mut walk = TileWalk::new(tokens, visible);
    // Tiles i, i + 1 and i + 2 are staged at step i, in three buffers.
    let mut ahead: [Option<(Range<usize>, Range<usize>)>; 2] = [walk.next(), walk.next()];
    // SAFETY (every block below): the staged tiles, logits, probabilities and products are
    // written and read inside their buffers (3 x TILE_KEYS x d bf16, 2 x TILE_KEYS x 16 f32,
    // 2 x TILE_KEYS / 2 x 16 pairs twice, 2 x d x 16 f32); the tiles' rows lie in the cache.
    unsafe {
        for (i, next) in ahead.iter().enumerate() {
            if let Some(next) = next {
                let buffers = (keys(i), values(i));
                stage_tile::<true>(kv, layout, next.0.clone(), skip(next), buffers);
            }
        }
        if let Some((first, _)) = &ahead[0] {
            logits_step(session, query_pairs, keys(0), d, first.len(), logits(0));
        }
        let mut pending: Option<(usize, __m512)> = None;
        let mut i = 0;
        while let Some((tile, _)) = ahead[0].take() {
            let after = walk.next();
            let halves = tile.len().div_ceil(K);
            let state = LaneState {
                running_max: amx.running_max.as_mut_ptr(),
                running_sum: amx.running_sum.as_mut_ptr(),
                seen_from: &amx.seen_from[..ROWS],
                seen_to: &amx.seen_to[..ROWS],
            };
            let rescale = softmax_step(logits(i), tile.clone(), halves, probs(i), state);
            pairs_to_rows(probs(i), halves, prob_rows(i));
            if let Some(after) = &after {
                let buffers = (keys(i + 2), values(i + 2));
                stage_tile::<true>(kv, layout, after.0.clone(), skip(after), buffers);
            }
            values_step::<true>(session, prob_rows(i), values(i), d, halves, partial(i));
            if let Some((next, _)) = &ahead[1] {
                logits_step(
                    session,
                    query_pairs,
                    keys(i + 1),
                    d,
                    next.len(),
                    logits(i + 1),
                );
            }
            if let Some((step, rescale)) = pending {
                add_product_rows(acc, d, rows, rescale, partial(step));
            }
            pending = Some((i, rescale));
            ahead = [ahead[1].take(), after];
            i += 1;
        }
        if let Some((step, rescale)) = pending {
            add_product_rows(acc, d, rows, rescale, partial(step));
        }
    }
}

/// The softmax's paired probabilities of `halves` x 32 keys (key pair p's 16 rows at
/// `pairs[p x 16]`, dwords) as rows: per 32 keys, row r's 16 pairs at `rows[r x 16]`, the A
/// operand of [`values_tile`].
///
/// # Safety
/// Both hold `halves` x 256 dwords, 64-byte aligned; the CPU has AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn pairs_to_rows(pairs: *const u32, halves: usize, rows: *mut u32) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        for h in 0..halves {
            let half = h * K / 2 * ROWS;
            let columns: [__m512i; K / 2] =
                std::array::from_fn(|p| _mm512_load_si512(pairs.add(half + p * ROWS).cast()));
            for (r, row) in transpose_16x16(columns).into_iter().enumerate() {
                _mm512_store_si512(rows.add(half + r * ROWS).cast(), row);
            }
        }
    }
}

/// The first `rows` accumulators of a lone row tile (row r's d outputs at `acc[r x d]`) scaled
/// by lane r of `rescale` plus their value products (`partial`, as [`values_tile`] stores
/// them): the operations of [`add_products`] on the same numbers.
///
/// # Safety
/// `acc` holds rows x d floats and `partial` d x 16, both 64-byte aligned; `rows` <= 16; the CPU
/// has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn add_product_rows(
    acc: *mut f32,
    d: usize,
    rows: usize,
    rescale: __m512,
    partial: *const f32,
) {
    let mut factors = [0.0f32; ROWS];
    // SAFETY: the caller upholds the contract.
    unsafe {
        _mm512_storeu_ps(factors.as_mut_ptr(), rescale);
        for (r, factor) in factors.iter().enumerate().take(rows) {
            let factor = _mm512_set1_ps(*factor);
            for c in 0..d / LANES {
                let (acc, add) = (
                    acc.add(r * d + c * LANES),
                    partial.add((c * ROWS + r) * LANES),
                );
                let sum = _mm512_fmadd_ps(_mm512_load_ps(acc), factor, _mm512_load_ps(add));
                _mm512_store_ps(acc, sum);
            }
        }
    }
}

/// [`logits_tile`] for a tile of `count` keys.
///
/// # Safety
/// As [`logits_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn logits_step(
    session: &TileSession,
    query_pairs: *const u32,
    keys: *const u16,
    d: usize,
    count: usize,
    logits: *mut f32,
) {
    let args = (query_pairs, keys, d, logits);
    // SAFETY: the caller upholds the contract.
    unsafe {
        match count.div_ceil(LANES) {
            4 => logits_tile::<4>(session, args),
            3 => logits_tile::<3>(session, args),
            2 => logits_tile::<2>(session, args),
            _ => logits_tile::<1>(session, args),
        }
    }
}

/// [`values_tile`] for a tile of `halves` x 32 keys.
///
/// # Safety
/// As [`values_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn values_step<const PAIRED: bool>(
    session: &TileSession,
    probs: *const u32,
    values: *const u16,
    d: usize,
    halves: usize,
    partial: *mut f32,
) {
    let args = (probs, values, d, partial);
    // SAFETY: the caller upholds the contract.
    unsafe {
        match halves {
            2 => values_tile::<2, PAIRED>(session, args),
            _ => values_tile::<1, PAIRED>(session, args),
        }
    }
}

/// [`softmax_lanes`] for a tile of `halves` x 32 keys (its own count of 16-key groups).
///
/// # Safety
/// As [`softmax_lanes`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn softmax_step(
    logits: *const f32,
    tile: Range<usize>,
    halves: usize,
    probs: *mut u32,
    state: LaneState<'_>,
) -> __m512 {
    let groups = tile.len().div_ceil(LANES);
    let args = (logits, tile, halves * K / 2, probs, state);
    // SAFETY: the caller upholds the contract.
    unsafe {
        match groups {
            4 => softmax_lanes::<4>(args),
            3 => softmax_lanes::<3>(args),
            2 => softmax_lanes::<2>(args),
            _ => softmax_lanes::<1>(args),
        }
    }
}

/// The tile walk of a block of several row tiles, pipelined over the row tiles of each key tile.
///
/// # Safety
/// As [`attend`]'s after its staging of the queries and state; `session` holds [`FULL_CONFIG`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn attend_row_tiles(
    session: &TileSession,
    kv: &KvHead<'_, f16>,
    layout: RowLayout,
    visible: &dyn Fn(usize) -> Range<usize>,
    (tokens, heads): (usize, usize),
    amx: &mut AmxScratch,
) {
    let d = layout.head_dim;
    for (tile, seeing) in TileWalk::new(tokens, visible) {
        let count = tile.len();
        let halves = count.div_ceil(K);
        // Values before the block's first visible key and past the tile are staged as zeros.
        let skip = visible(seeing.start).start.clamp(tile.start, tile.end) - tile.start;
        // SAFETY: rows of the tile lie inside the cache (checked by the caller); the keys take
        // TILE_KEYS x d bf16 and the values TILE_KEYS x d, inside buffers of that size.
        unsafe {
            let buffers = (amx.keys.as_mut_ptr(), amx.values.as_mut_ptr());
            stage_tile::<false>(kv, layout, tile.clone(), skip, buffers);
        }
        let rows = seeing.start * heads..seeing.end * heads;
        let row_tiles = rows.start / ROWS..rows.end.div_ceil(ROWS);
        let (logits_base, probs_base) = (amx.logits.as_mut_ptr(), amx.probs.as_mut_ptr());
        let logits = |i: usize| logits_base.wrapping_add(i % 2 * TILE_KEYS * ROWS);
        let probs = |i: usize| probs_base.wrapping_add(i % 2 * TILE_KEYS / 2 * ROWS);
        let (query_pairs, keys, values) = (
            amx.query_pairs.as_ptr(),
            amx.keys.as_ptr(),
            amx.values.as_ptr(),
        );
        let partial_base = amx.partial.as_mut_ptr();
        let partial = |i: usize| partial_base.wrapping_add(i % 2 * d * ROWS);
        // A software pipeline over the row tiles. The matrix unit reads memory the vector units
        // wrote only once those stores have left the core (and the vector units read tile
        // stores only once the products are done), so every product is issued at least one
        // phase of other work before its result is read: step i runs the softmax of row tile i
        // (logits issued two steps before), adds row tile i - 1's value products (issued a step
        // before), then issues row tile i's value products (its probabilities written before
        // that add) and row tile i + 2's logits.
        // SAFETY (every block below): the session holds FULL_CONFIG; the operands read are those
        // staged above (groups x 16 keys, halves x 32 values, a row tile's queries); logits,
        // probabilities and products are written inside their double buffers (TILE_KEYS x 16
        // f32, TILE_KEYS / 2 x 16 pairs, d x 16 f32 each).
        let step_logits = |i: usize| unsafe {
            let query_pairs = query_pairs.add((row_tiles.start + i) * d / 2 * ROWS);
            logits_step(session, query_pairs, keys, d, count, logits(i));
        };
        let count_tiles = row_tiles.len();
        step_logits(0);
        if count_tiles > 1 {
            step_logits(1);
        }
        let mut pending: Option<(usize, usize, __m512)> = None;
        for i in 0..count_tiles {
            let row_tile = row_tiles.start + i;
            let lanes = row_tile * ROWS..(row_tile + 1) * ROWS;
            // SAFETY: as above; the state is the row tile's 16 lanes.
            let rescale = unsafe {
                let state = LaneState {
                    running_max: amx.running_max.as_mut_ptr().add(lanes.start),
                    running_sum: amx.running_sum.as_mut_ptr().add(lanes.start),
                    seen_from: &amx.seen_from[lanes.clone()],
                    seen_to: &amx.seen_to[lanes.clone()],
                };
                softmax_step(logits(i), tile.clone(), halves, probs(i), state)
            };
            // SAFETY: as above.
            unsafe {
                if let Some((step, row_tile, rescale)) = pending {
                    add_products(amx.acc.as_mut_ptr(), row_tile, d, rescale, partial(step));
                }
                values_step::<false>(session, probs(i), values, d, halves, partial(i));
                if i + 2 < count_tiles {
                    step_logits(i + 2);
                }
            }
            pending = Some((i, row_tile, rescale));
        }
        if let Some((step, row_tile, rescale)) = pending {
            // SAFETY: as above.
            unsafe { add_products(amx.acc.as_mut_ptr(), row_tile, d, rescale, partial(step)) };
        }
    }
}

/// The transposed logits of one row tile over `G` x 16 keys: per 16 keys a sum tile of the keys
/// (A, bf16 rows of d) times the row tile's query pairs (B), stored as key j's 16 rows at
/// `logits[j x 16]`.
///
/// # Safety
/// `session` holds [`FULL_CONFIG`]; `query_pairs` holds d / 2 x 16 dwords, `keys` G x 16 rows of d
/// bf16, `logits` room for G x 256 f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn logits_tile<const G: usize>(
    session: &TileSession,
    (query_pairs, keys, d, logits): (*const u32, *const u16, usize, *mut f32),
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        for g in 0..G {
            session.zero(g);
        }
        for k in 0..d / K {
            let b = 6 + k % 2;
            session.load(b, query_pairs.add(k * K / 2 * ROWS).cast(), ROW_BYTES);
            for g in 0..G {
                let a = 4 + g % 2;
                session.load(a, keys.add(g * LANES * d + k * K).cast(), 2 * d);
                session.dot_bf16(g, a, b);
            }
        }
        for g in 0..G {
            session.store(g, logits.add(g * LANES * ROWS).cast(), ROW_BYTES);
        }
    }
}

/// The value products of one row tile over `H` x 32 keys, stored as 16 rows of 16 f32 per
/// chunk c of 16 head dims at `partial[c x 256]`. Transposed: the tile's values transposed (A: d
/// rows of TILE_KEYS bf16) times the probabilities (B: `H` x 16 pairs of keys x 16 query rows),
/// chunk c's row i head dim 16c + i. With `PAIRED`, untransposed: the probabilities as rows (A:
/// per 32 keys 16 query rows of 16 pairs, [`pairs_to_rows`]) times the values as pairs of rows
/// (B: per 32 keys and chunk 16 pairs x 16 dims, [`stage_values_paired`]), chunk c's row r query
/// row r. Either way, an output is the sum over the same pairs of keys in the same order.
///
/// # Safety
/// `session` holds [`FULL_CONFIG`]; `probs` holds H x 256 dwords, `values` d x TILE_KEYS bf16,
/// `partial` room for d x 16 f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn values_tile<const H: usize, const PAIRED: bool>(
    session: &TileSession,
    (probs, values, d, partial): (*const u32, *const u16, usize, *mut f32),
) {
    let chunks = d / LANES;
    // The probabilities are the B operand transposed, the A operand paired.
    let (prob_tile, value_tile) = if PAIRED { (4, 6) } else { (6, 4) };
    // SAFETY: the caller upholds the contract.
    unsafe {
        for first in (0..chunks).step_by(4) {
            let count = (chunks - first).min(4);
            for c in 0..count {
                session.zero(c);
            }
            for h in 0..H {
                let p = prob_tile + h % 2;
                session.load(p, probs.add(h * K / 2 * ROWS).cast(), ROW_BYTES);
                for c in 0..count {
                    let v = value_tile + c % 2;
                    let chunk = first + c;
                    if PAIRED {
                        let at = (h * chunks + chunk) * PAIR_TILE;
                        session.load(v, values.add(at).cast(), ROW_BYTES);
                        session.dot_bf16(c, p, v);
                    } else {
                        let at = chunk * LANES * TILE_KEYS + h * K;
                        session.load(v, values.add(at).cast(), 2 * TILE_KEYS);
                        session.dot_bf16(c, v, p);
                    }
                }
            }
            for c in 0..count {
                let to = partial.add((first + c) * LANES * ROWS);
                session.store(c, to.cast(), ROW_BYTES);
            }
        }
    }
}

/// Row tile `row_tile`'s accumulators (d x 16 from `acc[row_tile x d x 16]`) scaled by
/// `rescale` (per lane) plus its value products `partial` (d x 16).
///
/// # Safety
/// Both hold those floats, 64-byte aligned; the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn add_products(
    acc: *mut f32,
    row_tile: usize,
    d: usize,
    rescale: __m512,
    partial: *const f32,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let acc = acc.add(row_tile * d * ROWS);
        for c in 0..d {
            let (acc, add) = (acc.add(c * ROWS), partial.add(c * ROWS));
            let sum = _mm512_fmadd_ps(_mm512_load_ps(acc), rescale, _mm512_load_ps(add));
            _mm512_store_ps(acc, sum);
        }
    }
}

/// The tile's values transposed for the A operand: per head dim c a row of TILE_KEYS bf16 at
/// `to[c * TILE_KEYS]`, the keys in order (a pair of consecutive keys is a dword); `rows[j]` is
/// key j's row, null for keys not read (zeros). Per 32 keys and 16 dims: 16 pairs of rows
/// interleaved column by column, then a 16 x 16 transpose of dwords.
///
/// # Safety
/// Every non-null row has d readable f16; `to` has room for d x TILE_KEYS bf16; the CPU has
/// the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn stage_values_transposed(
    rows: &[*const f16; TILE_KEYS],
    halves: usize,
    d: usize,
    to: *mut u16,
) {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for h in 0..halves {
            for c in (0..d).step_by(LANES) {
                let mut pairs = [_mm512_setzero_si512(); K / 2];
                for (p, pair) in pairs.iter_mut().enumerate() {
                    let (even, odd) = (rows[h * K + 2 * p], rows[h * K + 2 * p + 1]);
                    let mut both = [_mm512_setzero_ps(); 2];
                    for (half, row) in both.iter_mut().zip([even, odd]) {
                        if !row.is_null() {
                            *half = _mm512_cvtph_ps(_mm256_loadu_si256(row.add(c).cast()));
                        }
                    }
                    let bits = _mm512_cvtne2ps_pbh(both[1], both[0]);
                    *pair = _mm512_permutexvar_epi16(
                        interleave,
                        std::mem::transmute::<__m512bh, __m512i>(bits),
                    );
                }
                for (i, dim) in transpose_16x16(pairs).into_iter().enumerate() {
                    _mm512_storeu_si512(to.add((c + i) * TILE_KEYS + h * K).cast(), dim);
                }
            }
        }
    }
}

/// The tile's values as pairs of rows for the B operand of [`values_tile`]: per 32 keys
/// and 16 head dims (chunk c) a tile of 16 key pairs, pair p's row the 16 dims of its even and
/// odd key interleaved (dim n's two values a dword), at `to[((h x d / 16 + c) x 16 + p) x 32]`
/// for half h; `rows[j]` is key j's row, null for keys not read (zeros). The rows
/// [`stage_values_transposed`] builds before its transpose.
///
/// # Safety
/// As [`stage_values_transposed`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
unsafe fn stage_values_paired(
    rows: &[*const f16; TILE_KEYS],
    halves: usize,
    d: usize,
    to: *mut u16,
) {
    let chunks = d / LANES;
    let row = |j: usize| (!rows[j].is_null()).then_some(rows[j]);
    for h in 0..halves {
        for p in 0..K / 2 {
            let pair = [row(h * K + 2 * p), row(h * K + 2 * p + 1)];
            // SAFETY: the caller upholds the contract; pair p of half h starts at its row of
            // the half's first chunk tile, and the chunks' tiles are PAIR_TILE apart.
            unsafe { stage_value_pair(pair, d, to.add((h * chunks * K / 2 + p) * K), PAIR_TILE) };
        }
    }
}

/// A degree-5 polynomial for 2^f on [0, 1), 2^0 = 1 exactly (least squares on the relative
/// error, 2.3e-7 at worst), lowest degree first after the constant 1.
const EXP2_UNIT_POLY: [f32; 5] = [
    0.693_151_6,
    0.240_164_38,
    0.055_793_706,
    0.009_031_213,
    0.001_858_732_4,
];

/// Below this t, 2^t is 0 (2^-150 rounds to 0 in f32).
const EXP2_FLOOR: f32 = -150.0;

/// e^(s - max) in 16 lanes, for probabilities rounded to bf16 next, given `neg_scaled_max` =
/// -max log2 e: t = s log2 e - max log2 e in one FMA, `vreduceps` splits off f = t - floor(t)
/// and `vscalefps` applies 2^floor(t) to the polynomial's 2^f: 9 operations, against 12 for the
/// bf16 path's shift and [`super::bf16::exp_for_bf16`] (whose `vrndscaleps` is two). NaN and
/// -inf give 0.
///
/// # Safety
/// The CPU has AVX-512 F and DQ.
#[inline(always)]
unsafe fn exp_shifted(s: __m512, neg_scaled_max: __m512) -> __m512 {
    // SAFETY: plain arithmetic on registers; the caller's target features include AVX-512 F/DQ.
    unsafe {
        let t = _mm512_fmadd_ps(s, _mm512_set1_ps(std::f32::consts::LOG2_E), neg_scaled_max);
        // max returns the second operand for a NaN first one.
        let t = _mm512_max_ps(t, _mm512_set1_ps(EXP2_FLOOR));
        let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
        let mut y = _mm512_set1_ps(EXP2_UNIT_POLY[4]);
        for c in EXP2_UNIT_POLY[..4].iter().rev() {
            y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(*c));
        }
        let y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0));
        _mm512_scalef_ps(y, t)
    }
}

/// The online-softmax state of a row tile's 16 query rows, one per lane, and the cache rows each
/// sees.
struct LaneState<'a> {
    running_max: *mut f32,
    running_sum: *mut f32,
    seen_from: &'a [usize],
    seen_to: &'a [usize],
}

/// One tile's softmax step for 16 query rows over `G` x 16 transposed logits (`logits`: key j's
/// 16 rows at `j x 16`), keys outside a row's visible range masked: the running maxima and sums
/// updated, and the probabilities exp(logit - maximum) rounded to bf16 and paired as the B
/// operand of the value product (key pair p's 16 rows at `probs[p x 16]` as dwords; zeros from
/// G x 8 pairs up to `zero_to`). Returns the factors the accumulators are rescaled by.
///
/// # Safety
/// `logits` holds G x 256 floats, `probs` room for `zero_to` x 16 dwords, the state 16 lanes;
/// the CPU has the features below.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn softmax_lanes<const G: usize>(
    (logits, tile, zero_to, probs, state): (
        *const f32,
        Range<usize>,
        usize,
        *mut u32,
        LaneState<'_>,
    ),
) -> __m512 {
    // SAFETY: the caller upholds the contract.
    unsafe {
        let keys = G * LANES;
        // Per key, the lanes (query rows) that see it; all of them where every row sees the
        // whole tile, the common case at depth: both ends of the visible ranges grow lane by
        // lane, so the last lane starts latest and the first ends earliest.
        let whole = state.seen_from[ROWS - 1] <= tile.start && state.seen_to[0] >= tile.end;
        // Keys past the tile's end (zeros up to a whole 16) are seen by none.
        let mut sees = [0u16; TILE_KEYS];
        sees[..tile.len()].fill(u16::MAX);
        if !whole {
            for (j, lanes) in sees.iter_mut().enumerate().take(tile.len()) {
                let key = tile.start + j;
                *lanes = 0;
                for (lane, (&from, &to)) in state.seen_from.iter().zip(state.seen_to).enumerate() {
                    if from <= key && key < to {
                        *lanes |= 1 << lane;
                    }
                }
            }
        }
        let masked = !whole || tile.len() < keys;
        // Four independent chains (keys is a multiple of 16), unrolled so they stay in registers.
        let mut maxima = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
        for first in (0..keys).step_by(4) {
            for (i, m) in maxima.iter_mut().enumerate() {
                let j = first + i;
                let logit = _mm512_load_ps(logits.add(j * ROWS));
                *m = if masked {
                    _mm512_mask_max_ps(*m, sees[j], *m, logit)
                } else {
                    _mm512_max_ps(*m, logit)
                };
            }
        }
        let tile_max = _mm512_max_ps(
            _mm512_max_ps(maxima[0], maxima[1]),
            _mm512_max_ps(maxima[2], maxima[3]),
        );
        let old_max = _mm512_loadu_ps(state.running_max);
        let new_max = _mm512_max_ps(old_max, tile_max);
        let rescale = super::avx512::exp(_mm512_sub_ps(old_max, new_max));
        let neg_scaled_max = _mm512_mul_ps(new_max, _mm512_set1_ps(-std::f32::consts::LOG2_E));
        let interleave = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        let mut totals = [_mm512_setzero_ps(); 2];
        for p in 0..keys / 2 {
            let (j, k) = (2 * p, 2 * p + 1);
            let mut even = exp_shifted(_mm512_load_ps(logits.add(j * ROWS)), neg_scaled_max);
            let mut odd = exp_shifted(_mm512_load_ps(logits.add(k * ROWS)), neg_scaled_max);
            if masked {
                even = _mm512_maskz_mov_ps(sees[j], even);
                odd = _mm512_maskz_mov_ps(sees[k], odd);
            }
            totals[0] = _mm512_add_ps(totals[0], even);
            totals[1] = _mm512_add_ps(totals[1], odd);
            let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even));
            _mm512_store_si512(
                probs.add(p * ROWS).cast(),
                _mm512_permutexvar_epi16(interleave, both),
            );
        }
        for p in keys / 2..zero_to {
            _mm512_store_si512(probs.add(p * ROWS).cast(), _mm512_setzero_si512());
        }
        let total = _mm512_add_ps(totals[0], totals[1]);
        let old_sum = _mm512_loadu_ps(state.running_sum);
        _mm512_storeu_ps(state.running_sum, _mm512_fmadd_ps(old_sum, rescale, total));
        _mm512_storeu_ps(state.running_max, new_max);
        rescale
    }
}
