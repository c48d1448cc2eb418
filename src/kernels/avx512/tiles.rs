//! AVX-512 products of MXFP4 and Q8 matrices in their tile layouts ([`Mxfp4Layout::Tiles`],
//! [`Q8Matrix::to_tiles`]).
//!
//! A tile vector holds one dword of each of 16 rows (MXFP4: 8 nibbles, whose two decoded halves
//! meet an even and an odd activation dword; Q8: 4 unsigned bytes), so a block's sums for 16 rows
//! build up in one register per token and the float convert, scale and FMA run once per (16
//! rows, block, token), with nothing transposed at run time. Up to [`DIRECT_CALL_TOKENS`] tokens
//! the operands are formed in registers as they are used ([`tile_tokens`]); more tokens form two
//! tiles' operands in the GEMM scratch once and reuse the row-order GEMM's micro-kernels.
//!
//! The integer sums are the row-order kernels' sums and the float steps run block by block in
//! the same order as [`super::gemm_tile`], so results are bit for bit those of the row-order GEMM.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::avx2::prefetch_share_into;
use super::super::formats::{
    tile_lanes, tile_out, ByteSpans, Mxfp4Layout, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix,
    BLOCK_LEN, GROUP_BLOCKS, GROUP_LANES, GROUP_LEN, MXFP4_TILE_ROWS,
};
use super::super::{even_batch, GemmScratch, GEMM_TILE_ROWS, GEMM_TILE_SLOTS};
use super::{
    accumulate, by_tokens_and_scaling, correction_lane, format_factor, nibble_asm, operand_offset,
    scale_offsets, scaling, split_nibbles, DecodedTiles, Prefetch, FORMAT_MXFP4, FORMAT_Q4,
    FORMAT_Q8, GEMM_PAIR_TOKENS, GROUP_DWORDS, MXFP4_SIGNED_64, MXFP4_UNSIGNED_64,
    SCALE_EXPONENT_ADD, SCALE_MULTIPLY, SCALE_SHIFTED_SUM,
};

/// Most tokens [`tile_tokens`] takes at once for the nibble formats: their sums and
/// accumulators (2 x 12 registers), the two decoded operands and the nibble table stay inside
/// the 32 zmm registers. Q8 keeps 8 ([`TileSource::DIRECT_TOKENS`]).
pub(super) const DIRECT_TOKENS: usize = 12;

/// Most tokens of a call that run through [`direct`] (in groups of at most [`DIRECT_TOKENS`],
/// each decoding the tile again from L1); beyond, a tile is decoded once into scratch. Measured
/// on Zen 4, 2 threads, one expert matrix (`bench --kernels`): with groups of 8, M = 16 direct
/// 76% of the int8 peak against 65% through scratch, M = 32 58% against 73%; with groups of 12,
/// M = 24 (two groups) 78-80% against 68-72% through scratch (alternating twice). In the model a
/// 153-token prompt (about 19 tokens an expert) spent 1665-1690 ms in its experts against
/// 1687-1727 with groups of 8 and scratch from 17 tokens (`bench --profile --prompt-tokens 153`,
/// three alternations).
pub(super) const DIRECT_CALL_TOKENS: usize = 24;

/// [`DIRECT_CALL_TOKENS`] for Q8, whose operands cost nothing to form again.
pub(super) const Q8_DIRECT_CALL_TOKENS: usize = 64;

/// The tiles' 64-byte dword vectors per block of 32 columns.
const BLOCK_VECTORS: usize = BLOCK_LEN / 8;

/// A matrix in a tile layout as the kernels here read it: per tile of 16 rows, block and dword
/// pair `s` (0..4) the unsigned operands for the block's even activation dword `s` and odd
/// dword `s`, and per block 16 scales as f32 lanes.
pub(in crate::kernels) trait TileSource {
    const FORMAT: u8;
    /// Most tokens of a call that run through [`direct`]; beyond, tiles are formed into
    /// scratch once (see [`DIRECT_CALL_TOKENS`]).
    const DIRECT_CALL_TOKENS: usize;
    /// Most tokens a pass of [`tile_tokens`] takes.
    const DIRECT_TOKENS: usize = DIRECT_TOKENS;
    /// Whether the scales are powers of two, so the exponent-add scaling may run with any
    /// activations (with others, only with power-of-two activation scales).
    const POWER_OF_TWO_SCALES: bool;
    /// Whether [`product`] runs the GEMM's calls of [`ASSEMBLY_TOKENS`] to
    /// [`DIRECT_CALL_TOKENS`] tokens on the assembly loop of [`super::nibble_asm`] (MXFP4 with
    /// `vpermb`; [`direct_assembly`]).
    const ASSEMBLY: bool = false;
    /// The matrix the tiles are read from, which knows its rows and their bytes.
    type Matrix: ByteSpans;
    fn matrix(&self) -> &Self::Matrix;
    fn cols(&self) -> usize;
    fn rows(&self) -> usize {
        self.matrix().row_count()
    }
    fn spans(&self, rows: Range<usize>) -> [(*const u8, usize); 2] {
        self.matrix().byte_spans(rows)
    }
    /// The lowest and highest biased f32 exponent of the scales of `rows` (see
    /// [`super::exponent_mode`]), `None` where the format does not say.
    fn scale_exponents(&self, _rows: Range<usize>) -> Option<(u32, u32)> {
        None
    }
    /// Where tile `tile`'s vectors and scales start.
    fn tile_base(&self, tile: usize) -> (*const u8, *const u8);
    /// # Safety
    /// `vectors` from `tile_base`, `block` a block of the row, `s < 4`; AVX-512 F/BW (and what
    /// the source's decode needs) available.
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i);
    /// [`TileSource::operands`] less the format's offset: the signed bytes of the matrix unit's
    /// products (`tdpbssd`).
    ///
    /// # Safety
    /// As [`TileSource::operands`].
    #[inline(always)]
    unsafe fn signed_operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the contract of `operands`.
        unsafe { less_offset::<Self>(Self::operands(vectors, block, s)) }
    }
    /// # Safety
    /// `scales` from `tile_base`, `block` a block of the row.
    unsafe fn scales(scales: *const u8, block: usize) -> __m512;
}

/// Unsigned operands less `W`'s format offset (128 wraps to -128 as a byte, and the
/// subtraction wraps alike).
#[inline(always)]
unsafe fn less_offset<W: TileSource + ?Sized>(
    (evens, odds): (__m512i, __m512i),
) -> (__m512i, __m512i) {
    // SAFETY: register arithmetic; the callers' target features include AVX-512 BW.
    unsafe {
        let offset = _mm512_set1_epi8(operand_offset(W::FORMAT) as i8);
        (
            _mm512_sub_epi8(evens, offset),
            _mm512_sub_epi8(odds, offset),
        )
    }
}

/// Dword `s` of block `block` of a nibble tile (evens, odds), each nibble looked up in `table`
/// (a 16-entry table repeated four times) with `vpermb`.
///
/// # Safety
/// As [`TileSource::operands`]; the CPU has AVX-512 VBMI.
#[inline(always)]
unsafe fn nibbles_through(
    table: &[i8; 64],
    vectors: *const u8,
    block: usize,
    s: usize,
) -> (__m512i, __m512i) {
    // SAFETY: the caller upholds the contract: the 64 bytes lie inside the tile.
    unsafe {
        let bytes = _mm512_loadu_si512(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
        let table = _mm512_loadu_si512(table.as_ptr().cast());
        (
            _mm512_permutexvar_epi8(bytes, table),
            _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(bytes), table),
        )
    }
}

/// A tiled MXFP4 matrix, decoded with `vpermb` when `VBMI` (no masks: it ignores index bits 6-7
/// and the table repeats every 16), else with `vpshufb` after masking.
pub(in crate::kernels) struct Mxfp4Tiles<'a, const VBMI: bool>(
    pub(in crate::kernels) &'a Mxfp4Matrix<'a>,
);

impl<'a, const VBMI: bool> TileSource for Mxfp4Tiles<'a, VBMI> {
    const FORMAT: u8 = FORMAT_MXFP4;
    const DIRECT_CALL_TOKENS: usize = DIRECT_CALL_TOKENS;
    const POWER_OF_TWO_SCALES: bool = true;
    const ASSEMBLY: bool = VBMI;
    type Matrix = Mxfp4Matrix<'a>;
    fn matrix(&self) -> &Mxfp4Matrix<'a> {
        self.0
    }
    fn cols(&self) -> usize {
        self.0.cols
    }
    /// The E8M0 bytes are the exponents: the tiles `rows` touches keep theirs contiguous, so
    /// one pass over them finds the range.
    fn scale_exponents(&self, rows: Range<usize>) -> Option<(u32, u32)> {
        let [_, (scales, len)] = self.spans(rows);
        if len == 0 {
            return None;
        }
        // SAFETY: the spans of rows inside the matrix are a range of its scale bytes.
        let bytes = unsafe { std::slice::from_raw_parts(scales, len) };
        let (low, high) = bytes
            .iter()
            .fold((u8::MAX, 0u8), |(lo, hi), &b| (lo.min(b), hi.max(b)));
        Some((low as u32, high as u32))
    }
    fn tile_base(&self, tile: usize) -> (*const u8, *const u8) {
        let (bytes, scales) = self.0.tile_offsets(tile);
        (
            self.0.blocks.as_ptr().wrapping_add(bytes),
            self.0.scales.as_ptr().wrapping_add(scales),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract.
        unsafe {
            if VBMI {
                nibbles_through(&MXFP4_UNSIGNED_64, vectors, block, s)
            } else {
                let bytes =
                    _mm512_loadu_si512(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
                split_nibbles::<FORMAT_MXFP4>(bytes)
            }
        }
    }
    /// With `vpermb`, straight through the signed table: no subtraction.
    #[inline(always)]
    unsafe fn signed_operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract.
        unsafe {
            if VBMI {
                nibbles_through(&MXFP4_SIGNED_64, vectors, block, s)
            } else {
                less_offset::<Self>(Self::operands(vectors, block, s))
            }
        }
    }
    /// 2^(s - 127) (0 for s = 0, as everywhere else).
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m512 {
        // SAFETY: the caller upholds the trait's contract: 16 scale bytes per block.
        unsafe {
            let bytes =
                _mm512_cvtepu8_epi32(_mm_loadu_si128(scales.add(block * MXFP4_TILE_ROWS).cast()));
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bytes))
        }
    }
}

/// A tiled Q8 matrix: its vectors are the operands as stored.
pub(in crate::kernels) struct Q8Tiles<'a>(pub(in crate::kernels) &'a Q8Matrix);

impl<'a> TileSource for Q8Tiles<'a> {
    const FORMAT: u8 = FORMAT_Q8;
    const DIRECT_CALL_TOKENS: usize = Q8_DIRECT_CALL_TOKENS;
    /// With 12, a batch of 16 sequences (32 split rows in three groups instead of four) spent
    /// 82 ms a step in attention against 73-75 (`bench --batch 8,16`, alternating twice).
    const DIRECT_TOKENS: usize = 8;
    const POWER_OF_TWO_SCALES: bool = false;
    type Matrix = Q8Matrix;
    fn matrix(&self) -> &Q8Matrix {
        self.0
    }
    fn cols(&self) -> usize {
        self.0.cols
    }
    /// Found once per tile ([`Q8Matrix::scale_exponents`]).
    fn scale_exponents(&self, rows: Range<usize>) -> Option<(u32, u32)> {
        self.0.scale_exponents(rows)
    }
    fn tile_base(&self, tile: usize) -> (*const u8, *const u8) {
        (
            self.0
                .quants
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(self.0.tile_vector(tile, 0, 0)),
            self.0
                .scales
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(2 * self.0.tile_scales(tile, 0)),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract: a group's 32 vectors follow each
        // other, evens (dwords 0..16) first.
        unsafe {
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let even = vectors.add((group * GROUP_DWORDS + 4 * j + s) * 64);
            (
                _mm512_loadu_si512(even.cast()),
                _mm512_loadu_si512(even.add(GROUP_DWORDS / 2 * 64).cast()),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m512 {
        // SAFETY: the caller upholds the trait's contract: 16 f16 scales per block.
        unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(
                scales.add(2 * block * MXFP4_TILE_ROWS).cast(),
            ))
        }
    }
}

/// A tiled Q4 matrix: its nibbles are the unsigned operands as stored (the offset of 8 comes
/// back through the activations' Q4 correction), split as MXFP4's are.
struct Q4Tiles<'a, const VBMI: bool>(&'a Q4Matrix);

impl<'a, const VBMI: bool> TileSource for Q4Tiles<'a, VBMI> {
    const FORMAT: u8 = FORMAT_Q4;
    const DIRECT_CALL_TOKENS: usize = DIRECT_CALL_TOKENS;
    const POWER_OF_TWO_SCALES: bool = false;
    const ASSEMBLY: bool = VBMI;
    type Matrix = Q4Matrix;
    fn matrix(&self) -> &Q4Matrix {
        self.0
    }
    fn cols(&self) -> usize {
        self.0.cols
    }
    fn tile_base(&self, tile: usize) -> (*const u8, *const u8) {
        let (bytes, scales) = self.0.tile_offsets(tile);
        (
            self.0.nibbles.as_ptr().wrapping_add(bytes),
            self.0.scales.as_ptr().cast::<u8>().wrapping_add(2 * scales),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract.
        unsafe {
            let bytes = _mm512_loadu_si512(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
            split_nibbles::<FORMAT_Q4>(bytes)
        }
    }
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m512 {
        // SAFETY: the caller upholds the trait's contract: 16 f16 scales per block.
        unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(
                scales.add(2 * block * MXFP4_TILE_ROWS).cast(),
            ))
        }
    }
}

/// Lanes `lanes` of each token's 16 results, times the format's factor, to
/// `out[t * stride + lane]`; `out` points at lane 0 of the tile for token 0 (it may lie before
/// the caller's buffer when the tile starts before its rows: masked-off lanes are never touched).
#[inline(always)]
unsafe fn store_tile<const T: usize>(
    acc: &[__m512; T],
    factor: f32,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
) {
    // SAFETY: the caller guarantees that every unmasked lane's address is inside its output;
    // masked stores do not access masked-off lanes.
    unsafe {
        let mask = (((1u32 << lanes.end) - 1) & !((1u32 << lanes.start) - 1)) as __mmask16;
        let factor = _mm512_set1_ps(factor);
        for (t, acc_t) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(
                out.wrapping_add(t * stride),
                mask,
                _mm512_mul_ps(*acc_t, factor),
            );
        }
    }
}

/// One tile (16 rows) against tokens `first_token..first_token + T` of `x`, forming each
/// block's operands in registers once for all `T` tokens, while prefetching part `part` of
/// `parts` of `prefetch` into L2.
///
/// # Safety
/// `tile` is inside `w`, the tokens exist in `x`, `out` as in [`store_tile`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_tokens<W: TileSource, const T: usize, const SCALING: u8>(
    w: &W,
    tile: usize,
    x: &Q8Activations,
    first_token: usize,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: &[(*const u8, usize); 2],
    (part, parts): (usize, usize),
) {
    // SAFETY: the caller upholds the contract; every offset below stays inside the tile's bytes
    // and the tokens' activation rows.
    unsafe {
        let blocks_per_row = w.cols() / BLOCK_LEN;
        let (vectors, scales) = w.tile_base(tile);
        let token_quants = x.quants.as_ptr().add(first_token * x.groups * GROUP_LEN);
        let token_lanes = first_token * x.groups * GROUP_LANES;
        let corrections = x
            .corrections
            .as_ptr()
            .add(token_lanes + correction_lane(W::FORMAT));
        let act_scales = x.scale_lanes.as_ptr().add(token_lanes);
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        let mut acc = [_mm512_setzero_ps(); T];
        for block in 0..blocks_per_row {
            prefetch_share_into::<true>(
                prefetch,
                part * blocks_per_row + block,
                parts * blocks_per_row,
            );
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let lane = group * GROUP_LANES + 4 * j;
            let mut sums: [__m512i; T] = std::array::from_fn(|t| {
                _mm512_set1_epi32(*corrections.add(t * lane_stride + lane))
            });
            for s in 0..BLOCK_VECTORS {
                let (evens, odds) = W::operands(vectors, block, s);
                // Activation dword 4j + s holds the evens, dword 16 + 4j + s the odds.
                let at = group * GROUP_LEN + 4 * (4 * j + s);
                for (t, sum) in sums.iter_mut().enumerate() {
                    let quants = token_quants.add(t * quant_stride + at);
                    let even = _mm512_set1_epi32(quants.cast::<i32>().read_unaligned());
                    let odd =
                        _mm512_set1_epi32(quants.add(GROUP_LEN / 2).cast::<i32>().read_unaligned());
                    *sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*sum, evens, even), odds, odd);
                }
            }
            let w_scales = W::scales(scales, block);
            let w_offsets = scale_offsets::<SCALING>(w_scales);
            for (t, (acc_t, sum)) in acc.iter_mut().zip(sums).enumerate() {
                let a_scale = act_scales.add(t * lane_stride + lane);
                *acc_t = accumulate::<SCALING>(*acc_t, sum, w_scales, w_offsets, a_scale);
            }
        }
        store_tile(&acc, format_factor(W::FORMAT), out, stride, lanes);
    }
}

/// Tokens `tokens` of `x` against the rows `lanes` of tile `tile`, in groups of at most
/// `W::DIRECT_TOKENS`, writing `out` (lane 0 of the tile for token 0, as [`store_tile`]); the
/// groups prefetch `prefetch` in equal parts. Spread over every group, not asked for in the
/// first: a Q8 tile (46 KB at 2,880 columns) fetched during one group of 8 tokens asks for about
/// 14 GB/s per thread, what two threads of a small machine read at most, while the other groups
/// leave memory idle.
///
/// # Safety
/// As [`tile_tokens`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_all_tokens<W: TileSource>(
    w: &W,
    tile: usize,
    x: &Q8Activations,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: [(*const u8, usize); 2],
    scaling: u8,
) {
    // SAFETY: the caller upholds the contract, which every call below shares.
    unsafe {
        let tokens = x.rows();
        let batch = even_batch(tokens, W::DIRECT_TOKENS);
        let parts = tokens.div_ceil(batch);
        let p = prefetch;
        let mut token = 0;
        while token < tokens {
            let count = (tokens - token).min(batch);
            let o = out.wrapping_add(token * stride);
            let part = (token / batch, parts);
            let l = lanes.clone();
            macro_rules! tokens {
                ($n:literal, $scaling:ident) => {
                    tile_tokens::<W, $n, $scaling>(w, tile, x, token, o, stride, l, &p, part)
                };
            }
            // Sources with passes of at most 8 (Q8) never get the wider ones built.
            if W::DIRECT_TOKENS > 8 {
                by_tokens_and_scaling!(tokens, count, scaling, [12 11 10 9 8 7 6 5 4 3 2]);
            } else {
                by_tokens_and_scaling!(tokens, count, scaling, [8 7 6 5 4 3 2]);
            }
            token += count;
        }
    }
}

/// Tiles covering `rows`, each against every token of `x`, prefetching one tile ahead (past
/// `rows` up to the matrix's end, so the next task's first tile is not a cold miss either).
///
/// # Safety
/// `x` matches `w`, `rows` inside it, `out.len() == x.rows() * rows.len()`; the CPU has the
/// features of the function this is inlined into.
#[inline(always)]
unsafe fn direct<W: TileSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scaling: u8,
) {
    // SAFETY: the caller upholds the contract; `store_tile` writes only lanes of `rows`.
    unsafe {
        let stride = rows.len();
        let mut tile = rows.start / MXFP4_TILE_ROWS;
        while tile * MXFP4_TILE_ROWS < rows.end {
            let spans = next_tile_spans(w, tile);
            let o = tile_out(out, tile * MXFP4_TILE_ROWS, rows.start);
            tile_all_tokens(
                w,
                tile,
                x,
                o,
                stride,
                tile_lanes(tile, &rows),
                spans,
                scaling,
            );
            tile += 1;
        }
    }
}

/// Fewest tokens of a call for [`direct_assembly`], which needs the GEMM's scratch to pack
/// them into (`Kernels::mxfp4_product` sends calls of 2-4 tokens to the GEMM entry where this
/// loop runs). One token keeps the intrinsics loop, which decoded 2-4% faster (one token an
/// expert: `bench --synthetic 20b --prompt-tokens 8 --gen-tokens 64`, 10.58 / 10.45 against
/// 10.19 / 10.16 tokens/s alternating, Xeon with AMX). From two tokens, batched decode's
/// experts (16 sequences, 2-4 tokens an expert) spent 418 / 428 / 417 ms a step against 448 /
/// 442 / 423 through the intrinsics (`bench --batch 1,16`, alternating three times), one
/// token's decode unchanged.
const ASSEMBLY_TOKENS: usize = 2;

/// Fewest tokens of a group for which [`direct_assembly`] asks for at most two lines a block
/// of the next tile (half of a call's lone group's share: the first two lines of each 256
/// bytes), leaving the rest to the hardware prefetchers. Each `prefetcht1` holds one of the
/// core's few L1 miss buffers until its line arrives, and with the loop bound by the core from
/// about 6 tokens, four a block stalled it more than the lines they fetched early saved. Xeon
/// with AMX, two threads, 460 tiled 2880 x 2880 matrices (2 GB, past the L3) on huge pages,
/// ms a matrix with four / two lines a block, alternating twice: 6 tokens 0.274 / 0.265 against
/// 0.268 / 0.239, 8 tokens 0.289 / 0.279 against 0.258 / 0.265, 11 tokens 0.372 / 0.317
/// against 0.270 / 0.293; at 2 tokens, bound by memory, four lines a block were faster (0.199 /
/// 0.200 against 0.215 / 0.216), at 4 the same. Calls of more than 12 tokens form two or more
/// groups, each already asking for its half or less.
const HALF_PREFETCH_TOKENS: usize = 6;

/// [`direct`] on the assembly loop: the tokens packed once per call ([`nibble_asm::pack`]) in
/// the groups [`tile_all_tokens`] forms, then every tile against each group, each group asking
/// for its share of the next tile's bytes as it goes.
///
/// # Safety
/// As [`direct`]; `W` is MXFP4 in tiles, the CPU has AVX-512 VBMI, `scaling` is what
/// [`call_scaling`] chose, `x` has
/// [`ASSEMBLY_TOKENS`] to [`DIRECT_CALL_TOKENS`] tokens, and `packed` has
/// [`super::assembly_packed_words`] of `w`'s columns.
#[inline(always)]
unsafe fn direct_assembly<W: TileSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scaling: u8,
    packed: &mut [u32],
) {
    let tokens = x.rows();
    debug_assert!((ASSEMBLY_TOKENS..=DIRECT_CALL_TOKENS).contains(&tokens));
    nibble_asm::count_call();
    let blocks = w.cols() / BLOCK_LEN;
    let batch = even_batch(tokens, DIRECT_TOKENS);
    let parts = tokens.div_ceil(batch);
    let words = nibble_asm::PACKED_WORDS * blocks;
    for part in 0..parts {
        let group = part * batch..((part + 1) * batch).min(tokens);
        let to = &mut packed[group.start * words..group.end * words];
        nibble_asm::pack(x, correction_lane(W::FORMAT), group, blocks, to);
    }
    let factor = format_factor(W::FORMAT);
    let stride = rows.len();
    let mut tile = rows.start / MXFP4_TILE_ROWS;
    while tile * MXFP4_TILE_ROWS < rows.end {
        let [(vectors_next, vectors_len), scales_next] = next_tile_spans(w, tile);
        let o = tile_out(out, tile * MXFP4_TILE_ROWS, rows.start);
        let (vectors, scales) = w.tile_base(tile);
        let share = vectors_len.div_ceil(parts * blocks);
        for part in 0..parts {
            let first = part * batch;
            let count = (tokens - first).min(batch);
            // Each group asks for its share of the next tile's scales at once and for its
            // share of the vectors block by block, as `prefetch_share_into` spreads them.
            prefetch_share_into::<true>(&[scales_next, (std::ptr::null(), 0)], part, parts);
            let prefetch = nibble_asm::LinePrefetch {
                first: vectors_next.wrapping_add(part * blocks * share),
                step: share,
                lines: if vectors_len == 0 {
                    0
                } else if count >= HALF_PREFETCH_TOKENS {
                    share.div_ceil(64).min(2)
                } else {
                    share.div_ceil(64).min(4)
                },
            };
            let group = packed.as_ptr().wrapping_add(first * words);
            let o = o.wrapping_add(first * stride);
            let lanes = tile_lanes(tile, &rows);
            macro_rules! tokens {
                ($n:literal, $scaling:ident) => {{
                    // SAFETY: the tile lies in `w` (`blocks` blocks a row), the group's
                    // packed words were written above, the scaling is one the loop takes
                    // (the caller's contract) and the CPU has VBMI (W::ASSEMBLY).
                    unsafe {
                        let mut acc = [_mm512_setzero_ps(); $n];
                        if W::FORMAT == FORMAT_Q4 {
                            nibble_asm::tile_tokens::<$n, $scaling, FORMAT_Q4>(
                                vectors, scales, group, blocks, prefetch, &mut acc,
                            );
                        } else {
                            nibble_asm::tile_tokens::<$n, $scaling, FORMAT_MXFP4>(
                                vectors, scales, group, blocks, prefetch, &mut acc,
                            );
                        }
                        store_tile(&acc, factor, o, stride, lanes);
                    }
                }};
            }
            // Calls of 2-24 tokens form groups of 2-12 (`even_batch` above).
            macro_rules! groups {
                ($($n:literal)*) => {
                    match (count, scaling) {
                        $(($n, SCALE_MULTIPLY) => tokens!($n, SCALE_MULTIPLY),
                        ($n, SCALE_EXPONENT_ADD) => tokens!($n, SCALE_EXPONENT_ADD),
                        ($n, _) => tokens!($n, SCALE_SHIFTED_SUM),)*
                        _ => unreachable!("calls of 2-24 tokens form groups of 2-12"),
                    }
                };
            }
            groups!(2 3 4 5 6 7 8 9 10 11 12);
        }
        tile += 1;
    }
}

/// The byte spans of the tile after `tile` (empty past the matrix's last rows), which a tile's
/// product asks the memory for while it runs.
#[inline(always)]
fn next_tile_spans<W: TileSource>(w: &W, tile: usize) -> [(*const u8, usize); 2] {
    let limit = w.rows();
    let next = ((tile + 1) * MXFP4_TILE_ROWS).min(limit);
    w.spans(next..(next + MXFP4_TILE_ROWS).min(limit))
}

/// Forms tile `tile`'s operands into slot `slot` of the scratch in the layout
/// [`super::decode_tile`] writes (per group: vector q < 16 the evens of dword q, 16 + q the
/// odds; scale lanes per block), prefetching `prefetch`'s share. Blocks past a short last group
/// get scale 1 and keep whatever integers the scratch held: they meet zero activations and a
/// zero correction.
///
/// # Safety
/// `tile` inside `w`, scratch sized for its columns, `slot < GEMM_TILE_SLOTS`.
#[inline(always)]
unsafe fn decode_tile<W: TileSource>(
    w: &W,
    tile: usize,
    scratch: &mut GemmScratch,
    slot: usize,
    prefetch: Prefetch,
) {
    // SAFETY: the caller upholds the contract; writes stay inside the slot.
    unsafe {
        let blocks_per_row = w.cols() / BLOCK_LEN;
        let groups = blocks_per_row.div_ceil(GROUP_BLOCKS);
        let (vectors, scales) = w.tile_base(tile);
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
                    let (evens, odds) = W::operands(vectors, block, s);
                    let q = 4 * j + s;
                    _mm512_storeu_si512(at.add(q * 64).cast(), evens);
                    _mm512_storeu_si512(at.add((GROUP_DWORDS / 2 + q) * 64).cast(), odds);
                }
                _mm512_storeu_ps(to, W::scales(scales, block));
            }
        }
    }
}

/// Many tokens: pairs of whole tiles inside `rows` formed into scratch once, then the
/// row-order GEMM's micro-kernels over every token; tiles `rows` covers only in part (never in
/// the model, whose tasks are whole tiles) go through [`tile_all_tokens`].
///
/// # Safety
/// As [`direct`], scratch sized for `w`'s columns.
#[inline(always)]
unsafe fn gemm<W: TileSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
    scaling: u8,
) {
    // SAFETY: the caller upholds the contract; the pair and single micro-kernels write
    // `tokens x count` values inside `out` for whole tiles inside `rows`.
    unsafe {
        let whole = rows.start.next_multiple_of(MXFP4_TILE_ROWS)
            ..rows.end / MXFP4_TILE_ROWS * MXFP4_TILE_ROWS;
        if whole.start >= whole.end {
            return direct(w, x, rows, out, scaling);
        }
        let stride = rows.len();
        let tokens = x.rows();
        let lane = correction_lane(W::FORMAT);
        let factor = format_factor(W::FORMAT);
        let groups = (w.cols() / BLOCK_LEN).div_ceil(GROUP_BLOCKS);
        let none = [(std::ptr::null(), 0); 2];
        for edge in [rows.start..whole.start, whole.end..rows.end] {
            if !edge.is_empty() {
                let tile = edge.start / MXFP4_TILE_ROWS;
                let o = tile_out(out, tile * MXFP4_TILE_ROWS, rows.start);
                tile_all_tokens(
                    w,
                    tile,
                    x,
                    o,
                    stride,
                    tile_lanes(tile, &edge),
                    none,
                    scaling,
                );
            }
        }
        let pair_rows = GEMM_TILE_SLOTS * GEMM_TILE_ROWS;
        let spans_from = |start: usize| w.spans(start..(start + pair_rows).min(w.rows()));
        super::prefetch_share(&spans_from(whole.start), 0, 1);
        let mut tile_start = whole.start;
        while tile_start < whole.end {
            let count = (whole.end - tile_start).min(pair_rows);
            let out_column = out.as_mut_ptr().add(tile_start - rows.start);
            let next = spans_from((tile_start + pair_rows).min(w.rows()));
            let tile = tile_start / MXFP4_TILE_ROWS;
            if count > GEMM_TILE_ROWS {
                let batch = even_batch(tokens, GEMM_PAIR_TOKENS);
                let parts = GEMM_TILE_SLOTS + tokens.div_ceil(batch);
                let part = |index: usize| Prefetch {
                    spans: next,
                    batch: index,
                    batches: parts,
                };
                decode_tile(w, tile, scratch, 0, part(0));
                decode_tile(w, tile + 1, scratch, 1, part(1));
                let tiles = DecodedTiles {
                    scratch,
                    groups,
                    lane,
                    factor,
                    scaling,
                };
                tiles.pair_tokens(x, batch, out_column, stride, count, part);
            } else {
                decode_tile(w, tile, scratch, 0, Prefetch::NOTHING);
                let tiles = DecodedTiles {
                    scratch,
                    groups,
                    lane,
                    factor,
                    scaling,
                };
                tiles.single_tokens(x, out_column, stride, count);
            }
            tile_start += count;
        }
    }
}

/// Fewest tokens for which [`call_scaling`] looks at the scales: below, a call streams
/// its rows at the read bandwidth and the float operation the exponent add saves is not what it
/// waits on, while MXFP4's scan is a second pass over the scale bytes on decode's hot path (one
/// decoded token: about 75 MB of them a step on the 20b).
const EXPONENT_ADD_MIN_TOKENS: usize = 4;

/// How the products of these rows and tokens apply their scales ([`super::scaling`]): without a
/// multiply only where a side's scales are powers of two, every product normal, and with
/// enough tokens. Every answer gives the same bits.
fn call_scaling<W: TileSource>(w: &W, x: &Q8Activations, rows: &Range<usize>) -> u8 {
    if x.rows() < EXPONENT_ADD_MIN_TOKENS {
        return SCALE_MULTIPLY;
    }
    let activations = x.scale_exponents();
    if !W::POWER_OF_TWO_SCALES && !activations.is_some_and(|a| a.powers_of_two) {
        return SCALE_MULTIPLY;
    }
    scaling(
        activations,
        W::POWER_OF_TWO_SCALES,
        w.scale_exponents(rows.clone()),
    )
}

/// In registers up to [`DIRECT_CALL_TOKENS`] tokens (or without scratch, as the GEMV entries
/// call it), through scratch tiles beyond.
///
/// # Safety
/// As [`gemm`].
#[inline(always)]
unsafe fn product<W: TileSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    if rows.is_empty() || x.rows() == 0 {
        return;
    }
    let scaling = call_scaling(w, x, &rows);
    // SAFETY: the caller upholds the contract.
    unsafe {
        match scratch {
            Some(scratch) if x.rows() > W::DIRECT_CALL_TOKENS => {
                gemm(w, x, rows, out, scratch, scaling)
            }
            Some(scratch)
                if W::ASSEMBLY && (ASSEMBLY_TOKENS..=DIRECT_CALL_TOKENS).contains(&x.rows()) =>
            {
                // W::ASSEMBLY holds only for MXFP4 decoded with vpermb, whose kernels run with
                // AVX-512 VBMI; the scratch was sized for w's columns (the caller's contract).
                direct_assembly(w, x, rows, out, scaling, &mut scratch.packed_tokens)
            }
            _ => direct(w, x, rows, out, scaling),
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn mxfp4_plain(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    // SAFETY: the caller upholds `mxfp4_product`'s contract.
    unsafe { product(&Mxfp4Tiles::<false>(w), x, rows, out, scratch) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn mxfp4_vbmi(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    // SAFETY: the caller upholds `mxfp4_product`'s contract, and the CPU has AVX-512 VBMI.
    unsafe { product(&Mxfp4Tiles::<true>(w), x, rows, out, scratch) }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled MXFP4 `w`.
///
/// # Safety
/// The CPU has the module's features (and VBMI if `vbmi`); `w` is tiled and the shapes were
/// checked by `Kernels`; scratch sized for `w`'s columns.
pub(in crate::kernels) unsafe fn mxfp4_product(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
    vbmi: bool,
) {
    debug_assert_eq!(w.layout, Mxfp4Layout::Tiles);
    // SAFETY: the caller upholds the contract, which both entries share.
    unsafe {
        if vbmi {
            mxfp4_vbmi(w, x, rows, out, scratch)
        } else {
            mxfp4_plain(w, x, rows, out, scratch)
        }
    }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled Q8 `w`.
///
/// # Safety
/// As [`mxfp4_product`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(in crate::kernels) unsafe fn q8_product(
    w: &Q8Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    debug_assert!(w.tiled);
    // SAFETY: the caller upholds the contract.
    unsafe { product(&Q8Tiles(w), x, rows, out, scratch) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_plain(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    // SAFETY: the caller upholds `q4_product`'s contract.
    unsafe { product(&Q4Tiles::<false>(w), x, rows, out, scratch) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn q4_vbmi(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
) {
    // SAFETY: the caller upholds `q4_product`'s contract, and the CPU has AVX-512 VBMI (for
    // the assembly loop's `vpermb`).
    unsafe { product(&Q4Tiles::<true>(w), x, rows, out, scratch) }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled Q4 `w`.
///
/// # Safety
/// As [`mxfp4_product`].
pub(in crate::kernels) unsafe fn q4_product(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: Option<&mut GemmScratch>,
    vbmi: bool,
) {
    debug_assert!(w.tiled);
    // SAFETY: the caller upholds the contract, which both entries share.
    unsafe {
        if vbmi {
            q4_vbmi(w, x, rows, out, scratch)
        } else {
            q4_plain(w, x, rows, out, scratch)
        }
    }
}
