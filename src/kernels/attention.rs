//! Grouped-query attention over one KV head: the G query heads that share a KV head read each key
//! and value row once, with the per-head sink logit in the softmax denominator. [`attend_group`]
//! is one token (decode); [`attend_block`] is a block of consecutive tokens (prefill), flash-style.
//!
//! ```text
//! m_g   = max(S_g, max_j l_gj)            l_gj = scale * q_g . k_j
//! out_g = sum_j exp(l_gj - m_g) v_j / (exp(S_g - m_g) + sum_j exp(l_gj - m_g))
//! ```
//!
//! # Algorithm (SIMD paths)
//! Keys are processed in tiles of [`TILE_KEYS`]. An f16 tile is widened to f32 once (an f32 cache
//! whose head_dim is a multiple of 16 is read in place). The G x tile logits are computed with the
//! key rows loaded once per head from L1 and the horizontal sums of 16 (AVX-512) or 8 (AVX2) keys
//! reduced together by a transpose-and-add tree, so no per-key reduction is paid. The softmax is
//! online across tiles: the running maximum starts at the sink, each tile's exponentials come from a
//! vectorized polynomial ([`fast_exp`] lane by lane), and the accumulators are rescaled once per tile
//! and head. Then each value row (widened once) feeds all G heads: blocks of up to four heads times
//! 64 (AVX-512) or 16 (AVX2) columns stay in registers across the whole tile.
//!
//! A block of tokens runs the same steps over tokens x G query rows: a tile is widened once for
//! the whole block (not once per token), tiles no token sees are skipped, and the keys of a tile
//! past a token's causal end or before its window get a -inf logit. At depth the cache then
//! streams from memory once per block instead of once per token.
//!
//! Tiles start at cache rows that are multiples of [`TILE_KEYS`], for one token as for a block,
//! so a token's result does not depend on the block or chunk it came in: a key's tile and lane,
//! and with them the order of every sum, follow from its row alone, and a masked key adds exact
//! zeros. A prompt prefilled in any chunks, or decoded token by token, gives the same bits. Value
//! rows of a tile before the first key any token of the block sees are not read at all.
//!
//! The scalar path is the straightforward reference: token by token, one key at a time, online
//! softmax with `f32::exp`.
//!
//! Where the CPU issues AVX-512 BF16's `vdpbf16ps` as fast as an FMA ([`runs_bf16`]), attention
//! over an f16 cache takes the same tiles on bf16 dot products instead (`bf16.rs`, with the
//! scalar statement of its arithmetic in [`attend_block_bf16_reference`]).
//!
//! Everything is single-threaded and allocation-free; [`AttentionScratch`] holds the buffers.

use std::ops::Range;

use super::aligned::AlignedVec;
use super::{dispatch, KernelError, Kernels};
use half::f16;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod bf16;
#[cfg(target_arch = "x86_64")]
mod int8;

/// Keys per tile: a widened f16 tile of keys plus one of values (2 x 64 x 64 x 4 bytes for
/// head_dim 64) stays in L1 while every head of the group uses it. Tiles start at rows that are
/// multiples of this, so a caller that passes part of a cache starts it at such a row to keep
/// the results of the whole cache.
pub const TILE_KEYS: usize = 64;

/// Keys widened and turned into logits at a time: a multiple of every path's vector width.
const SUB_KEYS: usize = 16;

/// Up to this many query rows (one token's group of 8 in gpt-oss) read an f16 value tile straight
/// from the cache: staging it would store and reload every value row for only a few heads. More
/// rows reuse a staged tile enough to pay for it.
const FUSED_VALUE_ROWS: usize = 8;

/// Head dims are padded to a multiple of this in scratch, so SIMD loops need no column tails.
const PAD_LANES: usize = 16;

/// Below this, [`fast_exp`] returns 0: e^-87 is about 1.6e-38, the smallest normal f32 is 1.2e-38,
/// and every softmax denominator here is at least 1 (the maximum's own term).
const EXP_MIN: f32 = -87.0;
const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 split in two so `x - n ln2` is exact for |n| <= 127 (Cody-Waite).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Minimax polynomial for (e^r - 1 - r) / r^2 on [-ln2/2, ln2/2] (Cephes `expf`).
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Errors of the attention kernel: operands whose shapes do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum AttentionError {
    #[error("attention head_dim is 0, expected at least 1")]
    ZeroHeadDim,
    #[error(
        "attention queries: length {len} is not a positive multiple of head_dim {head_dim} \
         (query heads x head_dim)"
    )]
    QueryLength { len: usize, head_dim: usize },
    #[error("attention sinks: {got} values, expected one per query head ({expected})")]
    SinkCount { expected: usize, got: usize },
    #[error("attention output: length {got}, expected {expected} (query heads x head_dim)")]
    OutputLength { expected: usize, got: usize },
    #[error(
        "attention KV rows: a head at offset {offset} of head_dim {head_dim} does not fit in rows \
         of {row_stride} elements"
    )]
    HeadOutsideRow {
        offset: usize,
        head_dim: usize,
        row_stride: usize,
    },
    #[error("attention key positions {start}..{end}: the start is past the end")]
    Positions { start: usize, end: usize },
    #[error(
        "attention block: token {token} sees keys starting or ending before the previous \
         token's (visible ranges must grow with the token)"
    )]
    VisibleNotMonotone { token: usize },
    #[error(
        "attention block queries: {tokens} tokens {stride} elements apart, each {width} wide, \
         do not fit in {len} elements (or the stride is below the width)"
    )]
    BlockQueries {
        tokens: usize,
        stride: usize,
        width: usize,
        len: usize,
    },
    #[error(
        "attention {operand} cache: positions up to {last} need {needed} elements, the slice has {got}"
    )]
    CacheTooShort {
        operand: &'static str,
        last: usize,
        needed: usize,
        got: usize,
    },
    #[error(
        "attention scratch holds {have_heads} heads of head_dim {have_dim}, the call needs \
         {heads} heads of head_dim {dim}"
    )]
    ScratchTooSmall {
        have_heads: usize,
        have_dim: usize,
        heads: usize,
        dim: usize,
    },
    #[error(
        "int8 attention: the {path} kernels do not run it for head_dim {head_dim} (it needs \
         AVX-512 VNNI and a head_dim that is a multiple of 64)"
    )]
    NoInt8Path { path: &'static str, head_dim: usize },
    #[error("attention benchmark: {0}")]
    Kernel(#[from] KernelError),
    #[error(
        "attention benchmark: tiled and per-key results differ at {keys} keys (max relative \
         difference {difference:e})"
    )]
    BenchMismatch { keys: usize, difference: f32 },
}

/// The query side of one call: the G heads that share a KV head.
#[derive(Clone, Copy, Debug)]
pub struct GroupQuery<'a> {
    /// G x head_dim, contiguous (rotary embedding already applied).
    pub queries: &'a [f32],
    /// One sink logit per query head (G values).
    pub sinks: &'a [f32],
    pub head_dim: usize,
    /// Multiplies every logit (1/sqrt(head_dim) for gpt-oss); not applied to the sinks.
    pub scale: f32,
}

/// One KV head in a layer's cache: position j's key is `keys[j * row_stride + offset..][..head_dim]`,
/// and likewise its value.
#[derive(Clone, Copy, Debug)]
pub struct KvHead<'a, T> {
    pub keys: &'a [T],
    pub values: &'a [T],
    /// Elements per cache row (kv_width: all KV heads of one position).
    pub row_stride: usize,
    /// Where this head's head_dim elements start in a row (kv_head * head_dim).
    pub offset: usize,
}

impl<T> KvHead<'_, T> {
    /// How this head's rows of `head_dim` elements are staged by the SIMD paths (padded to
    /// whole 16-lane vectors: the bf16 paths' head dims are whole already).
    fn row_layout(&self, head_dim: usize) -> RowLayout {
        RowLayout {
            row_stride: self.row_stride,
            offset: self.offset,
            head_dim,
            padded: head_dim.next_multiple_of(PAD_LANES),
        }
    }
}

mod sealed {
    use super::Kernels;

    /// How a tile of cache rows is laid out in f32 for the SIMD paths.
    #[derive(Clone, Copy, Debug)]
    pub struct RowLayout {
        pub row_stride: usize,
        pub offset: usize,
        pub head_dim: usize,
        /// head_dim rounded up to a multiple of 16.
        pub padded: usize,
    }

    pub trait Sealed: Copy + Send + Sync {
        fn widen(self) -> f32;

        /// The cache as f16, if it is one: the SIMD paths can then widen value rows as they
        /// use them instead of staging a tile.
        fn as_f16(cache: &[Self]) -> Option<&[half::f16]>;

        /// Rows `rows` of one head as f32 rows of `layout.padded` elements, zero past head_dim:
        /// `(slice starting at the first row, elements between rows)`. Either the cache itself
        /// (f32 with head_dim a multiple of 16) or `tile`, filled here. The caller checked that
        /// the rows lie inside `cache` and that `tile` holds `rows.len() * padded` elements.
        fn f32_rows<'a>(
            k: Kernels,
            cache: &'a [Self],
            layout: RowLayout,
            rows: std::ops::Range<usize>,
            tile: &'a mut [f32],
        ) -> (&'a [f32], usize);
    }
}

use sealed::RowLayout;

/// Element type of a KV cache: `half::f16` (the default cache) or `f32`.
pub trait KvElem: sealed::Sealed {}

impl KvElem for f16 {}
impl KvElem for f32 {}

impl sealed::Sealed for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }

    fn as_f16(cache: &[f16]) -> Option<&[f16]> {
        Some(cache)
    }

    fn f32_rows<'a>(
        k: Kernels,
        cache: &'a [f16],
        layout: RowLayout,
        rows: Range<usize>,
        tile: &'a mut [f32],
    ) -> (&'a [f32], usize) {
        let count = rows.len();
        let first = rows.start * layout.row_stride + layout.offset;
        let tile = &mut tile[..count * layout.padded];
        let (src, dst) = (cache[first..].as_ptr(), tile.as_mut_ptr());
        // The caller checked that rows `rows` lie inside `cache`, so every source row read
        // (head_dim elements from `first + t * row_stride`) is in bounds, and `tile` holds
        // count x padded elements: the SIMD arms' contract.
        dispatch!(
            k,
            avx512: avx512::widen_f16_rows(src, layout, count, dst),
            avx2: avx2::widen_f16_rows(src, layout, count, dst),
            scalar: widen_rows_scalar(&cache[first..], layout, count, tile),
        );
        (tile, layout.padded)
    }
}

impl sealed::Sealed for f32 {
    fn widen(self) -> f32 {
        self
    }

    fn as_f16(_: &[f32]) -> Option<&[f16]> {
        None
    }

    fn f32_rows<'a>(
        _: Kernels,
        cache: &'a [f32],
        layout: RowLayout,
        rows: Range<usize>,
        tile: &'a mut [f32],
    ) -> (&'a [f32], usize) {
        let first = rows.start * layout.row_stride + layout.offset;
        if layout.head_dim == layout.padded {
            return (&cache[first..], layout.row_stride);
        }
        let count = rows.len();
        let tile = &mut tile[..count * layout.padded];
        widen_rows_scalar(&cache[first..], layout, count, tile);
        (tile, layout.padded)
    }
}

fn widen_rows_scalar<T: sealed::Sealed>(
    src: &[T],
    layout: RowLayout,
    count: usize,
    dst: &mut [f32],
) {
    for (t, row) in dst.chunks_exact_mut(layout.padded).take(count).enumerate() {
        let from = &src[t * layout.row_stride..t * layout.row_stride + layout.head_dim];
        for (d, s) in row.iter_mut().zip(from) {
            *d = s.widen();
        }
        row[layout.head_dim..].fill(0.0);
    }
}

/// Buffers of [`attend_group`] and [`attend_block`], sized once for the most query rows (G heads
/// of one token, or tokens x G of a block) and the largest head_dim.
#[derive(Clone, Debug)]
pub struct AttentionScratch {
    max_heads: usize,
    max_head_dim: usize,
    /// Scaled queries, heads x padded.
    queries: AlignedVec<f32>,
    /// Widened key tile, TILE_KEYS x padded.
    keys: AlignedVec<f32>,
    /// Widened value tile, TILE_KEYS x padded.
    values: AlignedVec<f32>,
    /// Logits, then probabilities, heads x TILE_KEYS.
    logits: AlignedVec<f32>,
    /// Unnormalized outputs, heads x padded.
    acc: AlignedVec<f32>,
    /// The bf16 path's probabilities, heads x TILE_KEYS.
    probs_bf16: AlignedVec<u16>,
    /// The AMX path's operands and state.
    amx: AmxScratch,
    /// Stands in for the keys past the end of a ragged tile (padded zeros).
    zero_row: AlignedVec<f32>,
    running_max: Vec<f32>,
    running_sum: Vec<f32>,
    rescale: Vec<f32>,
    /// The int8 path's per query row: the row's scale, `128 x sum(q)`, and this tile's
    /// probability scale.
    query_scales: Vec<f32>,
    query_offsets: Vec<i32>,
    prob_scales: Vec<f32>,
    /// The int8 path's key scales then value scales of one tile.
    tile_scales: Vec<f32>,
}

impl AttentionScratch {
    /// Scratch for up to `max_heads` query rows (heads of a group, or tokens x heads of a block)
    /// of up to `max_head_dim` each.
    pub fn new(max_heads: usize, max_head_dim: usize) -> Self {
        let padded = max_head_dim.next_multiple_of(PAD_LANES);
        Self {
            max_heads,
            max_head_dim,
            queries: AlignedVec::filled(max_heads * padded, 0.0),
            keys: AlignedVec::filled(TILE_KEYS * padded, 0.0),
            values: AlignedVec::filled(TILE_KEYS * padded, 0.0),
            logits: AlignedVec::filled(max_heads * TILE_KEYS, 0.0),
            acc: AlignedVec::filled(max_heads * padded, 0.0),
            probs_bf16: AlignedVec::filled(max_heads * TILE_KEYS, 0),
            amx: AmxScratch::new(max_heads, padded),
            zero_row: AlignedVec::filled(padded, 0.0),
            running_max: vec![0.0; max_heads],
            running_sum: vec![0.0; max_heads],
            rescale: vec![0.0; max_heads],
            query_scales: vec![0.0; max_heads],
            query_offsets: vec![0; max_heads],
            prob_scales: vec![0.0; max_heads],
            tile_scales: vec![0.0; 2 * TILE_KEYS],
        }
    }

    fn check(&self, heads: usize, head_dim: usize) -> Result<(), AttentionError> {
        if heads > self.max_heads || head_dim > self.max_head_dim {
            return Err(AttentionError::ScratchTooSmall {
                have_heads: self.max_heads,
                have_dim: self.max_head_dim,
                heads,
                dim: head_dim,
            });
        }
        Ok(())
    }
}

/// The buffers of the AMX path (`amx.rs`), whose logits are transposed: query rows across the
/// 16 lanes of a row tile, keys down it; so are the value products of blocks of several row
/// tiles, while a block of one row tile (a decoded token) takes them untransposed, query rows
/// down the tile. Rows are the block's query rows rounded up to a multiple of 16.
#[derive(Clone, Debug)]
struct AmxScratch {
    /// bf16 queries, rows x head_dim; then per row tile its pairs of elements transposed
    /// (head_dim / 2 x 16 dwords).
    queries: AlignedVec<u16>,
    query_pairs: AlignedVec<u32>,
    /// Each row's visible cache rows, running maximum and sum.
    seen_from: Vec<usize>,
    seen_to: Vec<usize>,
    running_max: Vec<f32>,
    running_sum: Vec<f32>,
    /// Unnormalized outputs, per row tile head_dim x 16 (one row tile: 16 x head_dim).
    acc: AlignedVec<f32>,
    /// Three key tiles in bf16 (TILE_KEYS x head_dim each), their values transposed (head_dim x
    /// TILE_KEYS each; one row tile: pairs of value rows interleaved, the same size): a pipeline
    /// stages one while the others are multiplied.
    keys: AlignedVec<u16>,
    values: AlignedVec<u16>,
    /// Two steps' logits (TILE_KEYS x 16 each), paired bf16 probabilities (TILE_KEYS / 2 x 16
    /// each), those transposed to rows (one row tile) and value products (head_dim x 16 each).
    logits: AlignedVec<f32>,
    probs: AlignedVec<u32>,
    prob_rows: AlignedVec<u32>,
    partial: AlignedVec<f32>,
}

impl AmxScratch {
    fn new(max_heads: usize, padded: usize) -> Self {
        let rows = max_heads.next_multiple_of(16);
        Self {
            queries: AlignedVec::filled(rows * padded, 0),
            query_pairs: AlignedVec::filled(rows * padded / 2, 0),
            seen_from: vec![0; rows],
            seen_to: vec![0; rows],
            running_max: vec![0.0; rows],
            running_sum: vec![0.0; rows],
            acc: AlignedVec::filled(rows * padded, 0.0),
            keys: AlignedVec::filled(3 * TILE_KEYS * padded, 0),
            values: AlignedVec::filled(3 * TILE_KEYS * padded, 0),
            logits: AlignedVec::filled(2 * TILE_KEYS * 16, 0.0),
            probs: AlignedVec::filled(2 * TILE_KEYS / 2 * 16, 0),
            prob_rows: AlignedVec::filled(2 * TILE_KEYS / 2 * 16, 0),
            partial: AlignedVec::filled(2 * padded * 16, 0.0),
        }
    }
}

fn check_cache<T>(
    operand: &'static str,
    cache: &[T],
    kv: &KvHead<'_, T>,
    head_dim: usize,
    positions: &Range<usize>,
) -> Result<(), AttentionError> {
    if positions.is_empty() {
        return Ok(());
    }
    let last = positions.end - 1;
    let needed = last * kv.row_stride + kv.offset + head_dim;
    if cache.len() < needed {
        return Err(AttentionError::CacheTooShort {
            operand,
            last,
            needed,
            got: cache.len(),
        });
    }
    Ok(())
}

/// Number of query heads, after checking every shape.
fn check_shapes<T>(
    query: &GroupQuery<'_>,
    kv: &KvHead<'_, T>,
    positions: &Range<usize>,
    out: &[f32],
) -> Result<usize, AttentionError> {
    let head_dim = query.head_dim;
    if head_dim == 0 {
        return Err(AttentionError::ZeroHeadDim);
    }
    if query.queries.is_empty() || !query.queries.len().is_multiple_of(head_dim) {
        return Err(AttentionError::QueryLength {
            len: query.queries.len(),
            head_dim,
        });
    }
    let heads = query.queries.len() / head_dim;
    if query.sinks.len() != heads {
        return Err(AttentionError::SinkCount {
            expected: heads,
            got: query.sinks.len(),
        });
    }
    if out.len() != query.queries.len() {
        return Err(AttentionError::OutputLength {
            expected: query.queries.len(),
            got: out.len(),
        });
    }
    if kv.offset + head_dim > kv.row_stride {
        return Err(AttentionError::HeadOutsideRow {
            offset: kv.offset,
            head_dim,
            row_stride: kv.row_stride,
        });
    }
    if positions.start > positions.end {
        return Err(AttentionError::Positions {
            start: positions.start,
            end: positions.end,
        });
    }
    check_cache("key", kv.keys, kv, head_dim, positions)?;
    check_cache("value", kv.values, kv, head_dim, positions)?;
    Ok(heads)
}

/// Attention of one token's G query heads over the cache rows `positions` of one KV head, into
/// `out` (G x head_dim). An empty `positions` gives zeros (all weight on the sinks).
///
/// Allocation-free; runs on the path of `k`.
pub fn attend_group<T: KvElem>(
    k: Kernels,
    query: &GroupQuery<'_>,
    kv: &KvHead<'_, T>,
    positions: Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) -> Result<(), AttentionError> {
    let heads = check_shapes(query, kv, &positions, out)?;
    scratch.check(heads, query.head_dim)?;
    let block = BlockQuery {
        queries: query.queries,
        token_stride: query.queries.len(),
        tokens: 1,
        sinks: query.sinks,
        head_dim: query.head_dim,
        scale: query.scale,
    };
    // check_shapes and scratch.check validated every shape the block kernels rely on.
    attend_checked(k, &block, kv, &|_| positions.clone(), out, scratch);
    Ok(())
}

/// The query side of a block: `tokens` consecutive tokens, each with the G = `sinks.len()` query
/// heads that share one KV head.
#[derive(Clone, Copy, Debug)]
pub struct BlockQuery<'a> {
    /// Token t's G x head_dim queries start at `t * token_stride` (rotary embedding applied).
    pub queries: &'a [f32],
    /// Elements from one token's queries to the next's (at least G x head_dim).
    pub token_stride: usize,
    pub tokens: usize,
    /// One sink logit per query head (G values), the same for every token.
    pub sinks: &'a [f32],
    pub head_dim: usize,
    /// Multiplies every logit (1/sqrt(head_dim) for gpt-oss); not applied to the sinks.
    pub scale: f32,
}

/// Attention of a block of tokens over one KV head, flash-style: each tile of keys and values is
/// read (and widened) once for all `tokens x G` query rows instead of once per token, and tiles no
/// token of the block can see are skipped. Token t sees the cache rows `visible(t)`; both ends must
/// be non-decreasing in t (causal masks and sliding windows are). Writes token t's G x head_dim
/// outputs at `out[t * G * head_dim..]`.
///
/// The scratch must hold `tokens x G` heads ([`AttentionScratch::new`]). Allocation-free; runs
/// on the path of `k`; every token's result is, bit for bit, what [`attend_group`] gives over its
/// own rows, whatever the block it is in.
pub fn attend_block<T: KvElem>(
    k: Kernels,
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, T>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) -> Result<(), AttentionError> {
    check_block(query, kv, visible, out)?;
    scratch.check(query.tokens * query.sinks.len(), query.head_dim)?;
    attend_checked(k, query, kv, visible, out, scratch);
    Ok(())
}

/// Checks what [`attend_block`] relies on beyond the scratch's size.
fn check_block<T>(
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, T>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &[f32],
) -> Result<(), AttentionError> {
    let (d, heads) = (query.head_dim, query.sinks.len());
    if d == 0 {
        return Err(AttentionError::ZeroHeadDim);
    }
    if heads == 0 {
        return Err(AttentionError::SinkCount {
            expected: 1,
            got: 0,
        });
    }
    let width = heads * d;
    let needed = match query.tokens {
        0 => 0,
        tokens => (tokens - 1) * query.token_stride + width,
    };
    if query.token_stride < width || query.queries.len() < needed {
        return Err(AttentionError::BlockQueries {
            tokens: query.tokens,
            stride: query.token_stride,
            width,
            len: query.queries.len(),
        });
    }
    if out.len() != query.tokens * width {
        return Err(AttentionError::OutputLength {
            expected: query.tokens * width,
            got: out.len(),
        });
    }
    if kv.offset + d > kv.row_stride {
        return Err(AttentionError::HeadOutsideRow {
            offset: kv.offset,
            head_dim: d,
            row_stride: kv.row_stride,
        });
    }
    let mut previous = 0..0;
    for t in 0..query.tokens {
        let range = visible(t);
        if range.start > range.end {
            return Err(AttentionError::Positions {
                start: range.start,
                end: range.end,
            });
        }
        if t > 0 && (range.start < previous.start || range.end < previous.end) {
            return Err(AttentionError::VisibleNotMonotone { token: t });
        }
        check_cache("key", kv.keys, kv, d, &range)?;
        check_cache("value", kv.values, kv, d, &range)?;
        previous = range;
    }
    Ok(())
}

/// Whether attention of this head size over an f16 cache runs on bf16 dot products with these
/// kernels (f32 and int8 caches always run in f32): the one place that decides.
pub fn runs_bf16(k: Kernels, head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return k.uses_bf16_attention() && bf16::takes(head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// One KV head of an int8 cache: position j's key is `keys[j * head_dim..][..head_dim]` times
/// `key_scales[j]`, and likewise its value (rows of one head are contiguous, as the int8 cache
/// stores them).
#[derive(Clone, Copy, Debug)]
pub struct Q8KvHead<'a> {
    pub keys: &'a [i8],
    pub key_scales: &'a [f32],
    pub values: &'a [i8],
    pub value_scales: &'a [f32],
}

/// Whether attention of this head size over an int8 cache runs on int8 dot products with these
/// kernels ([`attend_block_q8`]); otherwise the cache is widened to f32 for [`attend_block`].
pub fn runs_int8(k: Kernels, head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return k.uses_int8_attention() && int8::takes(head_dim);
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}

/// Checks what [`attend_block_q8`] and its reference rely on beyond the scratch's size.
fn check_block_q8(
    query: &BlockQuery<'_>,
    kv: &Q8KvHead<'_>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &[f32],
) -> Result<(), AttentionError> {
    let rows = KvHead {
        keys: kv.keys,
        values: kv.values,
        row_stride: query.head_dim,
        offset: 0,
    };
    check_block(query, &rows, visible, out)?;
    if query.tokens > 0 {
        let last = visible(query.tokens - 1);
        for (operand, scales) in [
            ("key scale", kv.key_scales),
            ("value scale", kv.value_scales),
        ] {
            if !last.is_empty() && scales.len() < last.end {
                return Err(AttentionError::CacheTooShort {
                    operand,
                    last: last.end - 1,
                    needed: last.end,
                    got: scales.len(),
                });
            }
        }
    }
    Ok(())
}

/// [`attend_block`] over an int8 cache on int8 dot products (AVX-512 VNNI): the cache is read as
/// stored. What it computes is [`attend_block_q8_reference`]'s; like the other paths, tiles start
/// at multiples of [`TILE_KEYS`], so every token's result is the same bits alone as in any block.
/// Refused where [`runs_int8`] does not hold (the caller widens the cache instead).
pub fn attend_block_q8(
    k: Kernels,
    query: &BlockQuery<'_>,
    kv: &Q8KvHead<'_>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) -> Result<(), AttentionError> {
    if !runs_int8(k, query.head_dim) {
        return Err(AttentionError::NoInt8Path {
            path: k.path().name(),
            head_dim: query.head_dim,
        });
    }
    check_block_q8(query, kv, visible, out)?;
    scratch.check(query.tokens * query.sinks.len(), query.head_dim)?;
    if query.tokens == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the kernels use int8 attention only on the AVX-512 path (which needs VNNI); the
    // shapes were checked above and `takes` the head_dim.
    unsafe {
        int8::attend(query, kv, visible, out, scratch)
    };
    Ok(())
}

/// What [`attend_block_q8`] computes, written plainly: the reference its SIMD kernel is tested
/// against. Token by token and head by head: the scaled query rounded to int8 against its
/// largest magnitude (`x x (127 / max)`, nearest even); logits the integer dot products with
/// the key rows times the query's scale (`max / 127`) and the key's; a two-pass softmax whose
/// denominator sums the f32 probabilities; then per tile of [`TILE_KEYS`] keys (tiles starting at
/// multiples of it) each probability times its value row's scale rounded to a byte against the
/// tile's largest (`x 255 / largest`), and the output the integer sums with the value rows times
/// `largest / 255`. Allocates (it is for tests).
pub fn attend_block_q8_reference(
    query: &BlockQuery<'_>,
    kv: &Q8KvHead<'_>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    check_block_q8(query, kv, visible, out)?;
    let (d, heads) = (query.head_dim, query.sinks.len());
    for (t, out) in out.chunks_exact_mut(heads * d).enumerate() {
        let seen = visible(t);
        for (g, out) in out.chunks_exact_mut(d).enumerate() {
            let x: Vec<f32> = query.queries[t * query.token_stride + g * d..][..d]
                .iter()
                .map(|x| x * query.scale)
                .collect();
            let largest = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (q, query_scale): (Vec<i32>, f32) = if largest > 0.0 && largest.is_finite() {
                let inverse = 127.0 / largest;
                let q = x.iter().map(|v| (v * inverse).round_ties_even() as i32);
                (q.collect(), largest / 127.0)
            } else {
                (vec![0; d], 0.0)
            };
            let logits: Vec<f32> = seen
                .clone()
                .map(|j| {
                    let key = &kv.keys[j * d..][..d];
                    let dot: i32 = q.iter().zip(key).map(|(a, k)| a * *k as i32).sum();
                    dot as f32 * (kv.key_scales[j] * query_scale)
                })
                .collect();
            let sink = query.sinks[g];
            let max = logits.iter().fold(sink, |m, &l| m.max(l));
            let probs: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
            let denominator = (sink - max).exp() + probs.iter().sum::<f32>();
            out.fill(0.0);
            let mut j = seen.start;
            while j < seen.end {
                let tile = j..(j - j % TILE_KEYS + TILE_KEYS).min(seen.end);
                let weighted: Vec<f32> = tile
                    .clone()
                    .map(|i| probs[i - seen.start] * kv.value_scales[i])
                    .collect();
                let largest = weighted.iter().fold(0.0f32, |m, w| m.max(*w));
                if largest > 0.0 {
                    let to_bytes = 255.0 / largest;
                    let mut sums = vec![0i32; d];
                    for (i, w) in tile.clone().zip(&weighted) {
                        let byte = (w * to_bytes).round_ties_even() as i32;
                        for (s, v) in sums.iter_mut().zip(&kv.values[i * d..][..d]) {
                            *s += byte * *v as i32;
                        }
                    }
                    for (o, s) in out.iter_mut().zip(&sums) {
                        *o += *s as f32 * (largest / 255.0);
                    }
                }
                j = tile.end;
            }
            out.iter_mut().for_each(|o| *o /= denominator);
        }
    }
    Ok(())
}

/// [`attend_block`] after its checks.
fn attend_checked<T: KvElem>(
    k: Kernels,
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, T>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    if query.tokens == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if runs_bf16(k, query.head_dim) {
        if let (Some(keys), Some(values)) = (T::as_f16(kv.keys), T::as_f16(kv.values)) {
            let kv = KvHead {
                keys,
                values,
                row_stride: kv.row_stride,
                offset: kv.offset,
            };
            // SAFETY: the kernels use bf16 attention only where the CPU has AVX-512 BF16 (with
            // the AVX-512 path's features), on the matrix unit only where it runs bf16 tiles;
            // the callers validated the shapes and `takes` the head_dim.
            unsafe {
                if k.uses_amx_attention() {
                    amx::attend(query, &kv, visible, out, scratch);
                } else {
                    bf16::attend(query, &kv, visible, out, scratch);
                }
            }
            return;
        }
    }
    // The callers validated every shape attend_tiled relies on.
    dispatch!(
        k,
        avx512: attend_tiled::<avx512::Tiles, T>(k, query, kv, visible, out, scratch),
        avx2: attend_tiled::<avx2::Tiles, T>(k, query, kv, visible, out, scratch),
        scalar: attend_scalar(query, kv, visible, out, scratch),
    );
}

/// The reference: token by token, one key at a time (widened once for all heads), online softmax
/// per head with `f32::exp`.
fn attend_scalar<T: KvElem>(
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, T>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let d = query.head_dim;
    let heads = query.sinks.len();
    for (t, out) in out.chunks_exact_mut(heads * d).enumerate() {
        let queries = &query.queries[t * query.token_stride..][..heads * d];
        let (max, sum) = (
            &mut scratch.running_max[..heads],
            &mut scratch.running_sum[..heads],
        );
        max.copy_from_slice(query.sinks);
        sum.fill(0.0);
        out.fill(0.0);
        let (key, value) = (&mut scratch.keys[..d], &mut scratch.values[..d]);
        for j in visible(t) {
            let at = j * kv.row_stride + kv.offset;
            for (dst, src) in key.iter_mut().zip(&kv.keys[at..at + d]) {
                *dst = src.widen();
            }
            for (dst, src) in value.iter_mut().zip(&kv.values[at..at + d]) {
                *dst = src.widen();
            }
            for (g, (q, acc)) in queries
                .chunks_exact(d)
                .zip(out.chunks_exact_mut(d))
                .enumerate()
            {
                let dot: f32 = q.iter().zip(key.iter()).map(|(a, b)| a * b).sum();
                let logit = query.scale * dot;
                if logit > max[g] {
                    let rescale = (max[g] - logit).exp();
                    sum[g] *= rescale;
                    acc.iter_mut().for_each(|o| *o *= rescale);
                    max[g] = logit;
                }
                let weight = (logit - max[g]).exp();
                sum[g] += weight;
                for (o, v) in acc.iter_mut().zip(value.iter()) {
                    *o += weight * v;
                }
            }
        }
        for (g, acc) in out.chunks_exact_mut(d).enumerate() {
            let denominator = sum[g] + (query.sinks[g] - max[g]).exp();
            acc.iter_mut().for_each(|o| *o /= denominator);
        }
    }
}

/// What the bf16 path ([`Kernels::uses_bf16_attention`]) computes, written plainly: the
/// reference its SIMD kernel is tested against. Token by token and head by head, the scaled
/// query, the keys, the values and the probabilities are rounded to bf16 (nearest even) and every
/// product is summed in f32; the softmax takes two passes. Allocates (it is for tests).
pub fn attend_block_bf16_reference(
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, f16>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    check_block(query, kv, visible, out)?;
    let round = |x: f32| half::bf16::from_f32(x).to_f32();
    let (d, heads) = (query.head_dim, query.sinks.len());
    for (t, out) in out.chunks_exact_mut(heads * d).enumerate() {
        let seen = visible(t);
        for (g, out) in out.chunks_exact_mut(d).enumerate() {
            let q: Vec<f32> = query.queries[t * query.token_stride + g * d..][..d]
                .iter()
                .map(|x| round(x * query.scale))
                .collect();
            let logits: Vec<f32> = seen
                .clone()
                .map(|j| {
                    let key = &kv.keys[j * kv.row_stride + kv.offset..][..d];
                    q.iter().zip(key).map(|(a, k)| a * round(k.to_f32())).sum()
                })
                .collect();
            let sink = query.sinks[g];
            let max = logits.iter().fold(sink, |m, &l| m.max(l));
            let mut denominator = (sink - max).exp();
            out.fill(0.0);
            for (j, logit) in seen.clone().zip(&logits) {
                let p = (logit - max).exp();
                denominator += p;
                let value = &kv.values[j * kv.row_stride + kv.offset..][..d];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += round(p) * round(v.to_f32());
                }
            }
            out.iter_mut().for_each(|o| *o /= denominator);
        }
    }
    Ok(())
}

/// e^x for x <= 0, as the SIMD paths compute it lane by lane: Cody-Waite reduction to
/// r in [-ln2/2, ln2/2], a degree-7 polynomial, then 2^n by exponent arithmetic. Within 2 ulp of
/// e^x on [-87, 0]; exactly 0 below -87 (and for -inf and NaN).
pub fn fast_exp(x: f32) -> f32 {
    if x.is_nan() || x < EXP_MIN {
        return 0.0;
    }
    let n = (x * LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let mut y = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        y = y.mul_add(r, *c);
    }
    let p = y.mul_add(r * r, r) + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The steps of one tile on a SIMD path. Every function requires the CPU features of its path
/// and pointers to buffers at least as large as the doc says. Raw pointers because the f32 rows may
/// be the caller's cache or the scratch tile, and the SIMD loops index them with strides.
#[allow(clippy::too_many_arguments)]
trait TilePath {
    /// `logits[g * TILE_KEYS + t] = queries_g . row_t` for t < count (rows `stride` apart, each
    /// `padded` long), -inf for count <= t < count rounded up to the path's vector width.
    /// `zero_row`: `padded` zeros.
    unsafe fn logits(
        queries: *const f32,
        heads: usize,
        padded: usize,
        rows: *const f32,
        stride: usize,
        count: usize,
        zero_row: *const f32,
        logits: *mut f32,
    );

    /// Turn one head's tile of logits (count, then -inf up to the vector width) into
    /// exp(logit - new running max) in place, update the running max and sum, return the factor
    /// the earlier accumulation must be scaled by.
    unsafe fn softmax(logits: *mut f32, count: usize, max: &mut f32, sum: &mut f32) -> f32;

    /// `acc_g = acc_g * rescale_g + sum_t p_gt v_t` for all heads, columns 0..padded, t < count
    /// (`p_gt` at `probs[g * TILE_KEYS + t]`, value rows `stride` apart).
    unsafe fn accumulate(
        probs: *const f32,
        heads: usize,
        rescale: *const f32,
        values: *const f32,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    );

    /// [`TilePath::accumulate`] reading the value rows straight from an f16 cache (`values`,
    /// rows `layout.row_stride` apart, head_dim == padded), widening each as it is used: the
    /// same products summed in the same order, without storing and reloading a widened tile.
    /// Returns false, having done nothing, on a path without it.
    unsafe fn accumulate_f16(
        _probs: *const f32,
        _heads: usize,
        _rescale: *const f32,
        _values: *const f16,
        _layout: RowLayout,
        _count: usize,
        _acc: *mut f32,
    ) -> bool {
        false
    }
}

/// # Safety
/// The CPU has the features of `P`'s path; shapes were checked by [`check_shapes`] or
/// [`check_block`] and the scratch by [`AttentionScratch::check`]; `query.tokens` > 0.
unsafe fn attend_tiled<P: TilePath, T: KvElem>(
    k: Kernels,
    query: &BlockQuery<'_>,
    kv: &KvHead<'_, T>,
    visible: &dyn Fn(usize) -> Range<usize>,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    let d = query.head_dim;
    let (heads, tokens) = (query.sinks.len(), query.tokens);
    let layout = kv.row_layout(d);
    let padded = layout.padded;
    // Rows are token-major: row t * heads + g is token t's head g.
    for (r, dst) in scratch
        .queries
        .chunks_exact_mut(padded)
        .take(tokens * heads)
        .enumerate()
    {
        let (t, g) = (r / heads, r % heads);
        let src = &query.queries[t * query.token_stride + g * d..][..d];
        for (s, q) in dst.iter_mut().zip(src) {
            *s = q * query.scale;
        }
        dst[d..].fill(0.0);
        scratch.running_max[r] = query.sinks[g];
    }
    scratch.running_sum[..tokens * heads].fill(0.0);
    scratch.acc[..tokens * heads * padded].fill(0.0);

    for (tile, seeing) in TileWalk::new(tokens, visible) {
        let (first, last, count) = (seeing.start, seeing.end, tile.len());
        let rows = first * heads..last * heads;
        // Keys are widened SUB_KEYS rows at a time, just before their logits: the staged rows stay
        // in L1 next to the value tile. Each logit is a sum over its own key only, so this
        // changes no bit.
        let mut sub = 0;
        while sub < count {
            let n = SUB_KEYS.min(count - sub);
            let part = tile.start + sub..tile.start + sub + n;
            let (keys, key_stride) = T::f32_rows(k, kv.keys, layout, part, &mut scratch.keys);
            // SAFETY: `keys` holds `n` rows of `padded` readable elements `key_stride` apart
            // (f32_rows' contract, rows checked against the cache); the scratch buffers have the
            // sizes TilePath asks for (scratch.check: rows <= max_heads, padded <= padded max),
            // and logits `sub..sub + n` rounded up to the vector width stay inside a row.
            unsafe {
                P::logits(
                    scratch.queries.as_ptr().add(rows.start * padded),
                    rows.len(),
                    padded,
                    keys.as_ptr(),
                    key_stride,
                    n,
                    scratch.zero_row.as_ptr(),
                    scratch
                        .logits
                        .as_mut_ptr()
                        .add(rows.start * TILE_KEYS + sub),
                );
            }
            sub += n;
        }
        // Keys of the tile a token must not see (causal or window edge) get a -inf logit.
        for t in first..last {
            let seen = visible(t);
            let (from, to) = (
                seen.start.max(tile.start) - tile.start,
                seen.end.min(tile.end).max(seen.start.max(tile.start)) - tile.start,
            );
            if from == 0 && to == count {
                continue;
            }
            for g in 0..heads {
                let row = &mut scratch.logits[(t * heads + g) * TILE_KEYS..][..count];
                row[..from].fill(f32::NEG_INFINITY);
                row[to..].fill(f32::NEG_INFINITY);
            }
        }
        for r in rows.clone() {
            // SAFETY: row r's logits lie inside the scratch (r < tokens x heads <= max_heads).
            scratch.rescale[r] = unsafe {
                P::softmax(
                    scratch.logits.as_mut_ptr().add(r * TILE_KEYS),
                    count,
                    &mut scratch.running_max[r],
                    &mut scratch.running_sum[r],
                )
            };
        }
        // The tile's value rows before the block's first visible key are never read: each would
        // add exact zeros, and they may be rows a window-trimmed restore did not fill.
        let skip = visible(first).start.clamp(tile.start, tile.end) - tile.start;
        let seen = tile.start + skip..tile.end;
        if rows.len() <= FUSED_VALUE_ROWS && padded == d {
            if let Some(cache) = T::as_f16(kv.values) {
                let from = &cache[seen.start * kv.row_stride + kv.offset..];
                // SAFETY: rows `seen` were checked against the cache, `from` starts at the first
                // of them, and the scratch pointers are as for `P::accumulate` below.
                let done = unsafe {
                    P::accumulate_f16(
                        scratch.logits.as_ptr().add(rows.start * TILE_KEYS + skip),
                        rows.len(),
                        scratch.rescale.as_ptr().add(rows.start),
                        from.as_ptr(),
                        layout,
                        count - skip,
                        scratch.acc.as_mut_ptr().add(rows.start * padded),
                    )
                };
                if done {
                    continue;
                }
            }
        }
        let (values, value_stride) = T::f32_rows(k, kv.values, layout, seen, &mut scratch.values);
        // SAFETY: as for the keys; probabilities `skip..count` of each row lie inside the row.
        unsafe {
            P::accumulate(
                scratch.logits.as_ptr().add(rows.start * TILE_KEYS + skip),
                rows.len(),
                scratch.rescale.as_ptr().add(rows.start),
                values.as_ptr(),
                value_stride,
                count - skip,
                scratch.acc.as_mut_ptr().add(rows.start * padded),
                padded,
            );
        }
    }

    finish_rows(query, scratch, padded, out);
}

/// The tiled paths' last step: each query row's accumulator (rows `acc_stride` apart in the
/// scratch) over its softmax denominator, the sink's share included.
fn finish_rows(
    query: &BlockQuery<'_>,
    scratch: &AttentionScratch,
    acc_stride: usize,
    out: &mut [f32],
) {
    let (d, heads) = (query.head_dim, query.sinks.len());
    for (r, out) in out
        .chunks_exact_mut(d)
        .take(query.tokens * heads)
        .enumerate()
    {
        let sink = query.sinks[r % heads];
        let denominator = scratch.running_sum[r] + (sink - scratch.running_max[r]).exp();
        let inverse = 1.0 / denominator;
        for (o, a) in out.iter_mut().zip(&scratch.acc[r * acc_stride..]) {
            *o = a * inverse;
        }
    }
}

/// The tiles of keys a block's tokens see, in order, with the tokens `first..last` that see any
/// key of each (gaps between windows, which no token sees, are skipped). Both ends of the
/// visible ranges grow with the token, so those tokens are a contiguous run that only moves
/// forward.
///
/// Tiles start at multiples of [`TILE_KEYS`], whatever the block: which tile a key falls in, and
/// its lane there, then depend only on its row, so each token's logits, maxima and sums are
/// reduced in the same order in any block or chunk (and alone, as a decoded token). Keys of a
/// tile a token does not see get a -inf logit and add exact zeros.
struct TileWalk<'a> {
    visible: &'a dyn Fn(usize) -> Range<usize>,
    tokens: usize,
    start: usize,
    end: usize,
    first: usize,
    last: usize,
}

impl<'a> TileWalk<'a> {
    /// `tokens` > 0.
    fn new(tokens: usize, visible: &'a dyn Fn(usize) -> Range<usize>) -> Self {
        let span = visible(0).start..visible(tokens - 1).end;
        Self {
            visible,
            tokens,
            start: span.start - span.start % TILE_KEYS,
            end: span.end,
            first: 0,
            last: 0,
        }
    }
}

impl Iterator for TileWalk<'_> {
    /// (the tile's cache rows, the tokens that see any of them)
    type Item = (Range<usize>, Range<usize>);

    fn next(&mut self) -> Option<Self::Item> {
        while self.start < self.end {
            let tile = self.start..self.start + TILE_KEYS.min(self.end - self.start);
            self.start = tile.end;
            while self.first < self.tokens && (self.visible)(self.first).end <= tile.start {
                self.first += 1;
            }
            self.last = self.last.max(self.first);
            while self.last < self.tokens && (self.visible)(self.last).start < tile.end {
                self.last += 1;
            }
            if self.first < self.last {
                return Some((tile, self.first..self.last));
            }
        }
        None
    }
}

/// Asks for the row `TILE_KEYS` rows after `row` (the same row of the next tile) while this tile
/// is widened, so the tile's arithmetic hides the memory latency of the next: at depth the cache
/// streams from DRAM once per token, and without this each tile waited for its own lines.
/// A prefetch never faults, so the row past the end of the cache costs nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_row_of_next_tile(row: *const f16, layout: RowLayout) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = row.wrapping_add(TILE_KEYS * layout.row_stride).cast::<i8>();
    let mut at = 0;
    while at < layout.head_dim * std::mem::size_of::<f16>() {
        // SAFETY: a prefetch is a hint: it reads nothing the program sees and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(at)) };
        at += 64;
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    //! The AVX-512 steps. Each function requires the features of the `Avx512` kernel path (the
    //! subset enabled here: F and BW, with AVX2, FMA and F16C) and the buffer sizes of `TilePath`.

    use std::arch::x86_64::*;

    use half::f16;

    use super::{RowLayout, TilePath, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E, TILE_KEYS};

    const W: usize = 16;

    pub(super) struct Tiles;

    /// # Safety
    /// The CPU has AVX-512 F/BW and F16C; `src` has `count` rows `row_stride` apart with
    /// `head_dim` readable elements each; `dst` has `count * padded` writable elements.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(super) unsafe fn widen_f16_rows(
        src: *const f16,
        layout: RowLayout,
        count: usize,
        dst: *mut f32,
    ) {
        // SAFETY: the caller upholds this function's contract (The CPU has AVX-512 F/BW and F16C;
        // `src` has `count` rows `row_stride` apart with `head_dim` readable elements each; `dst`
        // has `count * padded` writable elements), which is what every pointer access and
        // target-feature call below relies on.
        unsafe {
            for t in 0..count {
                let from = src.add(t * layout.row_stride);
                super::prefetch_row_of_next_tile(from, layout);
                let to = dst.add(t * layout.padded);
                if layout.head_dim == layout.padded {
                    // Whole chunks only: no mask to build per chunk.
                    for c in (0..layout.padded).step_by(W) {
                        let bits = _mm256_loadu_si256(from.add(c).cast());
                        _mm512_storeu_ps(to.add(c), _mm512_cvtph_ps(bits));
                    }
                    continue;
                }
                let mut c = 0;
                while c < layout.padded {
                    let len = layout.head_dim.saturating_sub(c).min(W);
                    // Masked-off lanes are neither read nor faulted on, and load as zero: the padding.
                    let bits = _mm512_maskz_loadu_epi16((1u32 << len) - 1, from.add(c).cast());
                    _mm512_storeu_ps(to.add(c), _mm512_cvtph_ps(_mm512_castsi512_si256(bits)));
                    c += W;
                }
            }
        }
    }

    /// `fast_exp` in 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn exp(x: __m512) -> __m512 {
        let in_range = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_MIN));
        let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut y = _mm512_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
        }
        let p = _mm512_add_ps(
            _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        let exponent = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponent));
        _mm512_maskz_mul_ps(in_range, p, two_n)
    }

    /// The first two levels of [`transpose_sum`] over 4 of its 16 vectors: lanes of the result
    /// hold partial sums of `v[0..4]`. Split out so 4 keys can be reduced while the next 4 are
    /// still being multiplied; the operations, and so the bits, are those of the whole tree.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn quarter_transpose_sum(v: &[__m512; 4]) -> __m512 {
        // Each level halves the vectors: pairs interleave and add, so a vector holds partial sums
        // of twice as many keys over half as many lanes.
        let mut s1 = [_mm512_setzero_ps(); 2];
        for i in 0..2 {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        let (a, b) = (_mm512_castps_pd(s1[0]), _mm512_castps_pd(s1[1]));
        // The pd unpacks move pairs of f32 lanes; the sum is of f32 lanes.
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
        )
    }

    /// The third level of [`transpose_sum`]: two quarters (keys 8i..8i+4 and 8i+4..8i+8) into
    /// a half.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn join_quarters(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    }

    /// The last level of [`transpose_sum`]: the halves of keys 0..8 and 8..16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn join_halves(low: __m512, high: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(low, high),
            _mm512_shuffle_f32x4::<0xDD>(low, high),
        )
    }

    /// Lane t of the result: the sum of all lanes of `v[t]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn transpose_sum(v: [__m512; W]) -> __m512 {
        let mut q = [_mm512_setzero_ps(); 4];
        for (i, x) in q.iter_mut().enumerate() {
            let four: &[__m512; 4] = v[4 * i..4 * i + 4].try_into().expect("16 vectors");
            // SAFETY: the caller has this path's features, all the helper needs.
            *x = unsafe { quarter_transpose_sum(four) };
        }
        // SAFETY: as above.
        unsafe { join_halves(join_quarters(q[0], q[1]), join_quarters(q[2], q[3])) }
    }

    /// Head dims of 64 (gpt-oss): two heads at a time with their queries in registers, so each
    /// key chunk loaded from the tile feeds two FMAs instead of one. Per logit the same FMAs in
    /// the same order and the same reduction tree as the general loop.
    ///
    /// # Safety
    /// As `logits`, with padded == 64; `row` holds 16 readable rows of 64 (the zero row past the
    /// tile); `out` points at head g's logits of this block of 16 keys, `heads` >= g + 2.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn logits_pair_64(q: *const f32, row: &[*const f32; W], keep: u16, out: *mut f32) {
        const CHUNKS: usize = 4;
        // SAFETY: the caller upholds this function's contract, which is all the code below
        // relies on.
        unsafe {
            // Chunk c of both heads' queries.
            let mut qs = [[_mm512_setzero_ps(); 2]; CHUNKS];
            for (c, pair) in qs.iter_mut().enumerate() {
                for (h, x) in pair.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(q.add(h * CHUNKS * W + c * W));
                }
            }
            let mut quarters = [[_mm512_setzero_ps(); 4]; 2];
            for (quarter, rows) in row.chunks_exact(4).enumerate() {
                let mut partial = [[_mm512_setzero_ps(); 4]; 2];
                for (c, [q0, q1]) in qs.iter().enumerate() {
                    for (t, r) in rows.iter().enumerate() {
                        let key = _mm512_loadu_ps(r.add(c * W));
                        partial[0][t] = _mm512_fmadd_ps(*q0, key, partial[0][t]);
                        partial[1][t] = _mm512_fmadd_ps(*q1, key, partial[1][t]);
                    }
                }
                for h in 0..2 {
                    quarters[h][quarter] = quarter_transpose_sum(&partial[h]);
                }
            }
            let mut halves = [[_mm512_setzero_ps(); 2]; 2];
            for (half, q) in halves.iter_mut().zip(&quarters) {
                *half = [join_quarters(q[0], q[1]), join_quarters(q[2], q[3])];
            }
            for (h, [low, high]) in halves.into_iter().enumerate() {
                let sums = _mm512_mask_blend_ps(
                    keep,
                    _mm512_set1_ps(f32::NEG_INFINITY),
                    join_halves(low, high),
                );
                _mm512_storeu_ps(out.add(h * TILE_KEYS), sums);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn logits(
        queries: *const f32,
        heads: usize,
        padded: usize,
        rows: *const f32,
        stride: usize,
        count: usize,
        zero_row: *const f32,
        logits: *mut f32,
    ) {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let mut block = 0;
            while block < count {
                let valid = (count - block).min(W);
                let mut row = [zero_row; W];
                for (t, r) in row.iter_mut().enumerate().take(valid) {
                    *r = rows.add((block + t) * stride);
                }
                let keep = ((1u32 << valid) - 1) as u16;
                let mut g = 0;
                if padded == 64 {
                    while g + 2 <= heads {
                        let out = logits.add(g * TILE_KEYS + block);
                        logits_pair_64(queries.add(g * padded), &row, keep, out);
                        g += 2;
                    }
                }
                for g in g..heads {
                    let q = queries.add(g * padded);
                    let mut partial = [_mm512_setzero_ps(); W];
                    let mut c = 0;
                    while c < padded {
                        let qc = _mm512_loadu_ps(q.add(c));
                        for t in 0..W {
                            partial[t] =
                                _mm512_fmadd_ps(qc, _mm512_loadu_ps(row[t].add(c)), partial[t]);
                        }
                        c += W;
                    }
                    let sums = _mm512_mask_blend_ps(
                        keep,
                        _mm512_set1_ps(f32::NEG_INFINITY),
                        transpose_sum(partial),
                    );
                    _mm512_storeu_ps(logits.add(g * TILE_KEYS + block), sums);
                }
                block += W;
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn softmax(logits: *mut f32, count: usize, max: &mut f32, sum: &mut f32) -> f32 {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let blocks = count.div_ceil(W);
            let mut tile_max = _mm512_set1_ps(f32::NEG_INFINITY);
            for b in 0..blocks {
                tile_max = _mm512_max_ps(tile_max, _mm512_loadu_ps(logits.add(b * W)));
            }
            let new_max = max.max(_mm512_reduce_max_ps(tile_max));
            let rescale = (*max - new_max).exp();
            let shift = _mm512_set1_ps(new_max);
            let mut total = _mm512_setzero_ps();
            for b in 0..blocks {
                let p = exp(_mm512_sub_ps(_mm512_loadu_ps(logits.add(b * W)), shift));
                _mm512_storeu_ps(logits.add(b * W), p);
                total = _mm512_add_ps(total, p);
            }
            *sum = *sum * rescale + _mm512_reduce_add_ps(total);
            *max = new_max;
            rescale
        }
    }

    /// A value element the accumulation reads 16 at a time as f32 lanes: an f32 tile row, or an
    /// f16 cache row widened in registers as it is used.
    trait ValueLanes: Copy {
        /// # Safety
        /// 16 elements are readable from `at`; the CPU has AVX-512 F and F16C.
        unsafe fn lanes(at: *const Self) -> __m512;
    }

    impl ValueLanes for f32 {
        #[inline(always)]
        unsafe fn lanes(at: *const f32) -> __m512 {
            // SAFETY: the caller upholds this method's contract.
            unsafe { _mm512_loadu_ps(at) }
        }
    }

    impl ValueLanes for f16 {
        #[inline(always)]
        unsafe fn lanes(at: *const f16) -> __m512 {
            // SAFETY: the caller upholds this method's contract.
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(at.cast())) }
        }
    }

    /// HEADS heads x CHUNKS x 16 columns, held in registers across the tile; each value row is
    /// read (and for f16 widened) once for all HEADS heads.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_block<V: ValueLanes, const HEADS: usize, const CHUNKS: usize>(
        probs: *const f32,
        rescale: *const f32,
        values: *const V,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    ) {
        // SAFETY: the caller upholds `TilePath::accumulate`'s (or `accumulate_f16`'s) contract for
        // this step (the CPU has this path's features; every buffer is as large as the trait's
        // doc says, each value row has CHUNKS x 16 readable elements from `values`), which is all
        // the code below relies on.
        unsafe {
            let mut sums = [[_mm512_setzero_ps(); CHUNKS]; HEADS];
            for (h, row) in sums.iter_mut().enumerate() {
                let factor = _mm512_set1_ps(*rescale.add(h));
                for (c, s) in row.iter_mut().enumerate() {
                    *s = _mm512_mul_ps(_mm512_loadu_ps(acc.add(h * padded + c * W)), factor);
                }
            }
            for t in 0..count {
                let v = values.add(t * stride);
                let mut value = [_mm512_setzero_ps(); CHUNKS];
                for (c, x) in value.iter_mut().enumerate() {
                    *x = V::lanes(v.add(c * W));
                }
                for (h, row) in sums.iter_mut().enumerate() {
                    let p = _mm512_set1_ps(*probs.add(h * TILE_KEYS + t));
                    for (s, x) in row.iter_mut().zip(&value) {
                        *s = _mm512_fmadd_ps(p, *x, *s);
                    }
                }
            }
            for (h, row) in sums.iter().enumerate() {
                for (c, s) in row.iter().enumerate() {
                    _mm512_storeu_ps(acc.add(h * padded + c * W), *s);
                }
            }
        }
    }

    /// All `heads` x `padded` columns in [`accumulate_block`]s of the largest power-of-two
    /// sizes up to `(most_heads, most_chunks)` that fit what is left.
    ///
    /// # Safety
    /// `accumulate_block`'s contract for the whole range.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_tiles<V: ValueLanes>(
        probs: *const f32,
        heads: usize,
        rescale: *const f32,
        values: *const V,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
        (most_heads, most_chunks): (usize, usize),
    ) {
        let step = |left: usize, most: usize| {
            let fit = left.min(most).max(1);
            1 << fit.ilog2()
        };
        // SAFETY: the caller upholds `accumulate_block`'s contract for every block below.
        unsafe {
            let mut column = 0;
            while column < padded {
                let chunks = step((padded - column) / W, most_chunks);
                let mut g = 0;
                while g < heads {
                    let block = step(heads - g, most_heads);
                    accumulate_heads(
                        block,
                        chunks,
                        probs.add(g * TILE_KEYS),
                        rescale.add(g),
                        values.add(column),
                        stride,
                        count,
                        acc.add(g * padded + column),
                        padded,
                    );
                    g += block;
                }
                column += chunks * W;
            }
        }
    }

    /// [`accumulate_block`] for `block` heads (1, 2, 4 or 8) and `chunks` x 16 columns (1, 2 or
    /// 4).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_heads<V: ValueLanes>(
        block: usize,
        chunks: usize,
        probs: *const f32,
        rescale: *const f32,
        values: *const V,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    ) {
        let (p, r, v, a) = (probs, rescale, values, acc);
        // SAFETY: the caller upholds `accumulate_block`'s contract for these sizes.
        unsafe {
            match (block, chunks) {
                (8, 2) => accumulate_block::<V, 8, 2>(p, r, v, stride, count, a, padded),
                (8, _) => accumulate_block::<V, 8, 1>(p, r, v, stride, count, a, padded),
                (4, 4) => accumulate_block::<V, 4, 4>(p, r, v, stride, count, a, padded),
                (4, 2) => accumulate_block::<V, 4, 2>(p, r, v, stride, count, a, padded),
                (4, _) => accumulate_block::<V, 4, 1>(p, r, v, stride, count, a, padded),
                (2, 4) => accumulate_block::<V, 2, 4>(p, r, v, stride, count, a, padded),
                (2, 2) => accumulate_block::<V, 2, 2>(p, r, v, stride, count, a, padded),
                (2, _) => accumulate_block::<V, 2, 1>(p, r, v, stride, count, a, padded),
                (_, 4) => accumulate_block::<V, 1, 4>(p, r, v, stride, count, a, padded),
                (_, 2) => accumulate_block::<V, 1, 2>(p, r, v, stride, count, a, padded),
                _ => accumulate_block::<V, 1, 1>(p, r, v, stride, count, a, padded),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(
        probs: *const f32,
        heads: usize,
        rescale: *const f32,
        values: *const f32,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    ) {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let sizes = (4, 4);
            accumulate_tiles(
                probs, heads, rescale, values, stride, count, acc, padded, sizes,
            );
        }
    }

    /// # Safety
    /// `TilePath::accumulate_f16`'s contract.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate_f16(
        probs: *const f32,
        heads: usize,
        rescale: *const f32,
        values: *const f16,
        layout: RowLayout,
        count: usize,
        acc: *mut f32,
    ) {
        // SAFETY: the caller upholds `TilePath::accumulate_f16`'s contract (the CPU has this
        // path's features; every buffer is as large as the trait's doc says; head_dim == padded,
        // a multiple of 16), which is all the code below relies on.
        unsafe {
            let (stride, padded) = (layout.row_stride, layout.padded);
            for t in 0..count {
                super::prefetch_row_of_next_tile(values.add(t * stride), layout);
            }
            // Eight heads of two chunks: 16 accumulators and the row's two widened chunks.
            let sizes = (8, 2);
            accumulate_tiles(
                probs, heads, rescale, values, stride, count, acc, padded, sizes,
            );
        }
    }

    #[allow(clippy::too_many_arguments)]
    impl TilePath for Tiles {
        unsafe fn logits(
            queries: *const f32,
            heads: usize,
            padded: usize,
            rows: *const f32,
            stride: usize,
            count: usize,
            zero_row: *const f32,
            out: *mut f32,
        ) {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { logits(queries, heads, padded, rows, stride, count, zero_row, out) }
        }

        unsafe fn softmax(logits: *mut f32, count: usize, max: &mut f32, sum: &mut f32) -> f32 {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { softmax(logits, count, max, sum) }
        }

        unsafe fn accumulate(
            probs: *const f32,
            heads: usize,
            rescale: *const f32,
            values: *const f32,
            stride: usize,
            count: usize,
            acc: *mut f32,
            padded: usize,
        ) {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { accumulate(probs, heads, rescale, values, stride, count, acc, padded) }
        }

        unsafe fn accumulate_f16(
            probs: *const f32,
            heads: usize,
            rescale: *const f32,
            values: *const f16,
            layout: RowLayout,
            count: usize,
            acc: *mut f32,
        ) -> bool {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { accumulate_f16(probs, heads, rescale, values, layout, count, acc) };
            true
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    //! The AVX2 steps: 8 lanes, blocks of 8 keys for the logits and up to 4 heads x 16 columns for
    //! the values. Each function requires AVX2, FMA and F16C and the buffer sizes of `TilePath`.

    use std::arch::x86_64::*;

    use half::f16;

    use super::{RowLayout, TilePath, EXP_MIN, EXP_POLY, LN2_HI, LN2_LO, LOG2_E, TILE_KEYS};

    const W: usize = 8;
    /// Columns per value block: two registers of 8.
    const COLUMNS: usize = 16;

    pub(super) struct Tiles;

    /// # Safety
    /// The CPU has AVX2 and F16C; `src` has `count` rows `row_stride` apart with `head_dim`
    /// readable elements each; `dst` has `count * padded` writable elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn widen_f16_rows(
        src: *const f16,
        layout: RowLayout,
        count: usize,
        dst: *mut f32,
    ) {
        // SAFETY: the caller upholds this function's contract (The CPU has AVX2 and F16C; `src` has
        // `count` rows `row_stride` apart with `head_dim` readable elements each; `dst` has `count
        // * padded` writable elements), which is what every pointer access and target-feature call
        // below relies on.
        unsafe {
            for t in 0..count {
                let from = src.add(t * layout.row_stride);
                super::prefetch_row_of_next_tile(from, layout);
                let to = dst.add(t * layout.padded);
                let mut c = 0;
                while c + W <= layout.head_dim {
                    let bits = _mm_loadu_si128(from.add(c).cast());
                    _mm256_storeu_ps(to.add(c), _mm256_cvtph_ps(bits));
                    c += W;
                }
                // A whole-register load here could read past the end of the cache.
                while c < layout.head_dim {
                    *to.add(c) = (*from.add(c)).to_f32();
                    c += 1;
                }
                while c < layout.padded {
                    *to.add(c) = 0.0;
                    c += 1;
                }
            }
        }
    }

    /// `fast_exp` in 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::kernels) unsafe fn exp(x: __m256) -> __m256 {
        let in_range = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut y = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
        }
        let p = _mm256_add_ps(
            _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
            _mm256_set1_ps(1.0),
        );
        let exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
        _mm256_and_ps(_mm256_mul_ps(p, two_n), in_range)
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn horizontal_max(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Lane t of the result: the sum of all lanes of `v[t]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn transpose_sum(v: [__m256; W]) -> __m256 {
        let mut s1 = [_mm256_setzero_ps(); 4];
        for i in 0..4 {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
        }
        let mut s2 = [_mm256_setzero_ps(); 2];
        for i in 0..2 {
            let (a, b) = (_mm256_castps_pd(s1[2 * i]), _mm256_castps_pd(s1[2 * i + 1]));
            // The pd unpacks move pairs of f32 lanes; the sum is of f32 lanes.
            s2[i] = _mm256_add_ps(
                _mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)),
            );
        }
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(s2[0], s2[1]),
            _mm256_permute2f128_ps::<0x31>(s2[0], s2[1]),
        )
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn logits(
        queries: *const f32,
        heads: usize,
        padded: usize,
        rows: *const f32,
        stride: usize,
        count: usize,
        zero_row: *const f32,
        logits: *mut f32,
    ) {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let mut block = 0;
            while block < count {
                let valid = (count - block).min(W);
                let mut row = [zero_row; W];
                for (t, r) in row.iter_mut().enumerate().take(valid) {
                    *r = rows.add((block + t) * stride);
                }
                for g in 0..heads {
                    let q = queries.add(g * padded);
                    let mut partial = [_mm256_setzero_ps(); W];
                    let mut c = 0;
                    while c < padded {
                        let qc = _mm256_loadu_ps(q.add(c));
                        for t in 0..W {
                            partial[t] =
                                _mm256_fmadd_ps(qc, _mm256_loadu_ps(row[t].add(c)), partial[t]);
                        }
                        c += W;
                    }
                    let out = logits.add(g * TILE_KEYS + block);
                    _mm256_storeu_ps(out, transpose_sum(partial));
                    // Softmax reads whole vectors: past the tile's end the logits must be -inf.
                    for t in valid..W {
                        *out.add(t) = f32::NEG_INFINITY;
                    }
                }
                block += W;
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn softmax(logits: *mut f32, count: usize, max: &mut f32, sum: &mut f32) -> f32 {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let blocks = count.div_ceil(W);
            let mut tile_max = _mm256_set1_ps(f32::NEG_INFINITY);
            for b in 0..blocks {
                tile_max = _mm256_max_ps(tile_max, _mm256_loadu_ps(logits.add(b * W)));
            }
            let new_max = max.max(horizontal_max(tile_max));
            let rescale = (*max - new_max).exp();
            let shift = _mm256_set1_ps(new_max);
            let mut total = _mm256_setzero_ps();
            for b in 0..blocks {
                let p = exp(_mm256_sub_ps(_mm256_loadu_ps(logits.add(b * W)), shift));
                _mm256_storeu_ps(logits.add(b * W), p);
                total = _mm256_add_ps(total, p);
            }
            *sum = *sum * rescale + horizontal_sum(total);
            *max = new_max;
            rescale
        }
    }

    /// HEADS heads x 16 columns, held in registers across the tile.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn accumulate_block<const HEADS: usize>(
        probs: *const f32,
        rescale: *const f32,
        values: *const f32,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    ) {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let mut sums = [[_mm256_setzero_ps(); 2]; HEADS];
            for (h, row) in sums.iter_mut().enumerate() {
                let factor = _mm256_set1_ps(*rescale.add(h));
                for (c, s) in row.iter_mut().enumerate() {
                    *s = _mm256_mul_ps(_mm256_loadu_ps(acc.add(h * padded + c * W)), factor);
                }
            }
            for t in 0..count {
                let v = values.add(t * stride);
                let value = [_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(W))];
                for (h, row) in sums.iter_mut().enumerate() {
                    let p = _mm256_set1_ps(*probs.add(h * TILE_KEYS + t));
                    for (s, x) in row.iter_mut().zip(&value) {
                        *s = _mm256_fmadd_ps(p, *x, *s);
                    }
                }
            }
            for (h, row) in sums.iter().enumerate() {
                for (c, s) in row.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(h * padded + c * W), *s);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(
        probs: *const f32,
        heads: usize,
        rescale: *const f32,
        values: *const f32,
        stride: usize,
        count: usize,
        acc: *mut f32,
        padded: usize,
    ) {
        // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this path's
        // features; every buffer is as large as the trait's doc says), which is all the code below
        // relies on.
        unsafe {
            let mut column = 0;
            while column < padded {
                let mut g = 0;
                while g < heads {
                    let (p, r, v, a) = (
                        probs.add(g * TILE_KEYS),
                        rescale.add(g),
                        values.add(column),
                        acc.add(g * padded + column),
                    );
                    let block = match heads - g {
                        1 => {
                            accumulate_block::<1>(p, r, v, stride, count, a, padded);
                            1
                        }
                        2 | 3 => {
                            accumulate_block::<2>(p, r, v, stride, count, a, padded);
                            2
                        }
                        _ => {
                            accumulate_block::<4>(p, r, v, stride, count, a, padded);
                            4
                        }
                    };
                    g += block;
                }
                column += COLUMNS;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    impl TilePath for Tiles {
        unsafe fn logits(
            queries: *const f32,
            heads: usize,
            padded: usize,
            rows: *const f32,
            stride: usize,
            count: usize,
            zero_row: *const f32,
            out: *mut f32,
        ) {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { logits(queries, heads, padded, rows, stride, count, zero_row, out) }
        }

        unsafe fn softmax(logits: *mut f32, count: usize, max: &mut f32, sum: &mut f32) -> f32 {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { softmax(logits, count, max, sum) }
        }

        unsafe fn accumulate(
            probs: *const f32,
            heads: usize,
            rescale: *const f32,
            values: *const f32,
            stride: usize,
            count: usize,
            acc: *mut f32,
            padded: usize,
        ) {
            // SAFETY: the caller upholds `TilePath`'s contract for this step (the CPU has this
            // path's features; every buffer is as large as the trait's doc says), which is all the
            // code below relies on.
            unsafe { accumulate(probs, heads, rescale, values, stride, count, acc, padded) }
        }
    }
}
