//! AVX2 products of MXFP4, Q4 and Q8 matrices in their tile layouts ([`Mxfp4Layout::Tiles`],
//! [`Q4Matrix::to_tiles`], [`Q8Matrix::to_tiles`]).
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
//! With VNNI (the `avx2-vnni` path: AVX-VNNI or AVX-512 VNNI/VL) two 256-bit `vpdpbusd` take
//! the place of the two `vpmaddubsw`, their int16 sum, `vpmaddwd` and `vpaddd`, on two
//! accumulator chains per token (the even and the odd dwords), since one chain would wait on
//! the instruction's latency; the integer sums are the same.
//!
//! Q8 tiles hold `q + 128`, whose `vpmaddubsw` pair sums (up to 2 x 255 x 127) would saturate
//! int16: plain AVX2 flips each operand back to the signed `q` once per pass and sums
//! `|q| x (a signed by q)` ([`SignedMaddubs`], the row-order kernel's sign trick), at most
//! 2 x 128 x 127 a pair, so the integer sums are `vpdpbusd`'s less its offset correction. Q4
//! tiles hold `q + 8` (at most 15), which every way of summing takes.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::formats::{
    tile_lanes, tile_out, ByteSpans, Mxfp4Layout, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix,
    BLOCK_LEN, CORRECTION_LANE_MXFP4, CORRECTION_LANE_Q4, CORRECTION_LANE_Q8, GROUP_BLOCKS,
    GROUP_LANES, GROUP_LEN, MXFP4_TILE_ROWS,
};
use super::super::{even_batch, Avx2Dot};
use super::{prefetch_share_into, MXFP4_UNSIGNED};

/// How a pass adds a token's products of one dword pair to its block sums: `sums` are the
/// token's two accumulator chains (the second may stay unused), the pairs are (the weights as
/// [`PairDot::operand`] formed them from the stored unsigned bytes, the token's signed
/// activation dword broadcast) for the even and the odd dword.
pub(in crate::kernels) trait PairDot {
    /// A tile operand as the sums take it, formed once per pass from the stored bytes.
    type Operand: Copy;
    /// Whether the sums take the stored unsigned bytes as they are, so each block's sum starts
    /// at the activations' offset correction (else at zero: the operands were made signed).
    const OFFSET: bool = true;
    /// Whether a four-token pass over one half takes two steps at once
    /// ([`Self::add_two_pairs`]): only where that saves instructions (Maddubs' one `vpmaddwd`
    /// per two steps). For the others it would only reorder the same instructions (on Zen 4
    /// their tile GEMMs read the same either way), so they stay on single steps.
    const TWO_STEPS: bool = false;
    /// # Safety
    /// The CPU has AVX2 and the instructions of the implementation.
    unsafe fn operand(stored: __m256i) -> Self::Operand;
    /// # Safety
    /// The CPU has AVX2 and the instructions of the implementation.
    unsafe fn add_pairs(
        sums: &mut [__m256i; 2],
        evens: (Self::Operand, __m256i),
        odds: (Self::Operand, __m256i),
    );
    /// Two dword pairs' products (consecutive `s`), the same integer sums as two
    /// [`Self::add_pairs`].
    ///
    /// # Safety
    /// As [`Self::add_pairs`].
    #[inline(always)]
    unsafe fn add_two_pairs(
        sums: &mut [__m256i; 2],
        first: [(Self::Operand, __m256i); 2],
        second: [(Self::Operand, __m256i); 2],
    ) {
        // SAFETY: the caller upholds the contract.
        unsafe {
            let [evens, odds] = first;
            Self::add_pairs(sums, evens, odds);
            let [evens, odds] = second;
            Self::add_pairs(sums, evens, odds);
        }
    }
}

/// `vpmaddubsw` x 2, `vpaddw`, `vpmaddwd`, `vpaddd` on one chain. Each int16 pair sum is at most
/// 2 x 24 x 128 and their sum twice that: no saturation, so the sums are `vpdpbusd`'s.
pub(in crate::kernels) struct Maddubs;

impl PairDot for Maddubs {
    type Operand = __m256i;
    const TWO_STEPS: bool = true;
    #[inline(always)]
    unsafe fn operand(stored: __m256i) -> __m256i {
        stored
    }
    #[inline(always)]
    unsafe fn add_pairs(
        sums: &mut [__m256i; 2],
        (w_evens, evens): (__m256i, __m256i),
        (w_odds, odds): (__m256i, __m256i),
    ) {
        // SAFETY: the caller upholds the contract (AVX2).
        unsafe {
            let pairs = _mm256_add_epi16(
                _mm256_maddubs_epi16(w_evens, evens),
                _mm256_maddubs_epi16(w_odds, odds),
            );
            sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
    }
    /// The four `vpmaddubsw` summed in int16 before one `vpmaddwd`: at most 4 x 2 x 24 x 128 =
    /// 24,576 in a lane, still no saturation.
    #[inline(always)]
    unsafe fn add_two_pairs(
        sums: &mut [__m256i; 2],
        [(w_evens, evens), (w_odds, odds)]: [(__m256i, __m256i); 2],
        [(w_evens_2, evens_2), (w_odds_2, odds_2)]: [(__m256i, __m256i); 2],
    ) {
        // SAFETY: the caller upholds the contract (AVX2).
        unsafe {
            let pairs = _mm256_add_epi16(
                _mm256_add_epi16(
                    _mm256_maddubs_epi16(w_evens, evens),
                    _mm256_maddubs_epi16(w_odds, odds),
                ),
                _mm256_add_epi16(
                    _mm256_maddubs_epi16(w_evens_2, evens_2),
                    _mm256_maddubs_epi16(w_odds_2, odds_2),
                ),
            );
            sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
        }
    }
}

/// A [`PairDot`] of 256-bit `vpdpbusd` in one encoding, the even and odd dwords on their own
/// chains.
macro_rules! vnni_dot {
    ($(#[$doc:meta])* $name:ident, $dpbusd:ident) => {
        $(#[$doc])*
        pub(in crate::kernels) struct $name;

        impl PairDot for $name {
            type Operand = __m256i;
            #[inline(always)]
            unsafe fn operand(stored: __m256i) -> __m256i {
                stored
            }
            #[inline(always)]
            unsafe fn add_pairs(
                sums: &mut [__m256i; 2],
                (w_evens, evens): (__m256i, __m256i),
                (w_odds, odds): (__m256i, __m256i),
            ) {
                // SAFETY: the caller upholds the contract (the encoding's features).
                unsafe {
                    sums[0] = $dpbusd(sums[0], w_evens, evens);
                    sums[1] = $dpbusd(sums[1], w_odds, odds);
                }
            }
        }
    };
}

vnni_dot!(
    /// AVX-VNNI (VEX encoded).
    VnniVex,
    _mm256_dpbusd_avx_epi32
);
vnni_dot!(
    /// AVX-512 VNNI with VL (EVEX encoded).
    VnniEvex,
    _mm256_dpbusd_epi32
);

/// Plain AVX2 on Q8 tiles (`q + 128`): each operand flipped back to the signed `q` and its
/// magnitude (once per pass), then per token `vpsignb` moves `q`'s sign onto the activations
/// and `vpmaddubsw` multiplies by `|q|`: a pair sums at most 2 x 128 x 127, below int16's
/// limit, so the even and odd dwords are widened apart (their int16 sum could saturate) and the
/// integer sums are exactly `sum q x a`, `vpdpbusd`'s less its offset correction.
pub(in crate::kernels) struct SignedMaddubs;

impl PairDot for SignedMaddubs {
    /// (`|q|`, `q`).
    type Operand = (__m256i, __m256i);
    const OFFSET: bool = false;
    #[inline(always)]
    unsafe fn operand(stored: __m256i) -> (__m256i, __m256i) {
        // SAFETY: the caller upholds the contract (AVX2).
        unsafe {
            let signed = _mm256_xor_si256(stored, _mm256_set1_epi8(i8::MIN));
            (_mm256_abs_epi8(signed), signed)
        }
    }
    #[inline(always)]
    unsafe fn add_pairs(
        sums: &mut [__m256i; 2],
        ((w_evens, s_evens), evens): ((__m256i, __m256i), __m256i),
        ((w_odds, s_odds), odds): ((__m256i, __m256i), __m256i),
    ) {
        // SAFETY: the caller upholds the contract (AVX2).
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let evens = _mm256_maddubs_epi16(w_evens, _mm256_sign_epi8(evens, s_evens));
            let odds = _mm256_maddubs_epi16(w_odds, _mm256_sign_epi8(odds, s_odds));
            sums[0] = _mm256_add_epi32(
                sums[0],
                _mm256_add_epi32(
                    _mm256_madd_epi16(evens, ones),
                    _mm256_madd_epi16(odds, ones),
                ),
            );
        }
    }
}

/// A matrix in a tile layout as the pass reads one half (8 rows) of a tile: per block and
/// dword pair `s` (0..4) the unsigned operands for the block's even and odd activation dword,
/// and per block 8 scales as f32 lanes.
trait HalfTiles: ByteSpans {
    /// Which of a block's lanes of [`Q8Activations::corrections`] holds this format's offset.
    const CORRECTION_LANE: usize;
    /// What the float sums are multiplied by at the end (MXFP4's values are doubled).
    const FACTOR: f32;
    fn cols(&self) -> usize;
    /// Where half `half` of tile `tile`'s vectors and scales start.
    fn half_base(&self, tile: usize, half: usize) -> (*const u8, *const u8);
    /// # Safety
    /// `vectors` from `half_base`, `block` a block of the row, `s < 4`; AVX2 available.
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m256i, __m256i);
    /// # Safety
    /// `scales` from `half_base`, `block` a block of the row; AVX2 and F16C available.
    unsafe fn scales(scales: *const u8, block: usize) -> __m256;
}

impl HalfTiles for Mxfp4Matrix<'_> {
    const CORRECTION_LANE: usize = CORRECTION_LANE_MXFP4;
    const FACTOR: f32 = 0.5;
    fn cols(&self) -> usize {
        self.cols
    }
    fn half_base(&self, tile: usize, half: usize) -> (*const u8, *const u8) {
        let (bytes, scales) = self.tile_offsets(tile);
        (
            self.blocks.as_ptr().wrapping_add(bytes + half * 32),
            self.scales.as_ptr().wrapping_add(scales + half * HALF_ROWS),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller upholds the trait's contract.
        unsafe {
            let table =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(MXFP4_UNSIGNED.as_ptr().cast()));
            let low = _mm256_set1_epi8(0x0F);
            let bytes = _mm256_loadu_si256(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
            (
                _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low)),
                _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low)),
            )
        }
    }
    /// 2^(s - 127) from the shifted byte (0 for s = 0, as on every path).
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m256 {
        // SAFETY: the caller upholds the trait's contract: 16 scale bytes per block.
        unsafe {
            let bytes = _mm_loadl_epi64(scales.add(block * MXFP4_TILE_ROWS).cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_cvtepu8_epi32(bytes)))
        }
    }
}

/// A tiled Q4 matrix (the draft unembedding): its nibbles are the unsigned operands as stored,
/// `q + 8`, split as MXFP4's are but with no table; the offset comes back through the
/// activations' Q4 correction. A `vpmaddubsw` pair sum is at most 2 x 15 x 128: no saturation.
impl HalfTiles for Q4Matrix {
    const CORRECTION_LANE: usize = CORRECTION_LANE_Q4;
    const FACTOR: f32 = 1.0;
    fn cols(&self) -> usize {
        self.cols
    }
    fn half_base(&self, tile: usize, half: usize) -> (*const u8, *const u8) {
        let (bytes, scales) = self.tile_offsets(tile);
        (
            self.nibbles.as_ptr().wrapping_add(bytes + half * 32),
            self.scales
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(2 * (scales + half * HALF_ROWS)),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller upholds the trait's contract.
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            let bytes = _mm256_loadu_si256(vectors.add((block * BLOCK_VECTORS + s) * 64).cast());
            (
                _mm256_and_si256(bytes, low),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m256 {
        // SAFETY: the caller upholds the trait's contract: 16 f16 scales per block.
        unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(
                scales.add(2 * block * MXFP4_TILE_ROWS).cast(),
            ))
        }
    }
}

/// A tiled Q8 matrix: its vectors hold `q + 128`, the operands as stored (`vpdpbusd` takes
/// them as they are, plain AVX2 through [`SignedMaddubs`]: `vpmaddubsw`'s int16 pair sums of the
/// unsigned bytes could saturate).
impl HalfTiles for Q8Matrix {
    const CORRECTION_LANE: usize = CORRECTION_LANE_Q8;
    const FACTOR: f32 = 1.0;
    fn cols(&self) -> usize {
        self.cols
    }
    fn half_base(&self, tile: usize, half: usize) -> (*const u8, *const u8) {
        (
            self.quants
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(self.tile_vector(tile, 0, 0) + half * 32),
            self.scales
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(2 * (self.tile_scales(tile, 0) + half * HALF_ROWS)),
        )
    }
    #[inline(always)]
    unsafe fn operands(vectors: *const u8, block: usize, s: usize) -> (__m256i, __m256i) {
        // SAFETY: the caller upholds the trait's contract: a group's 32 vectors follow each
        // other, evens (dwords 0..16) first.
        unsafe {
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let even = vectors.add((group * GROUP_DWORDS + 4 * j + s) * 64);
            (
                _mm256_loadu_si256(even.cast()),
                _mm256_loadu_si256(even.add(GROUP_DWORDS / 2 * 64).cast()),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(scales: *const u8, block: usize) -> __m256 {
        // SAFETY: the caller upholds the trait's contract: 16 f16 scales per block.
        unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(
                scales.add(2 * block * MXFP4_TILE_ROWS).cast(),
            ))
        }
    }
}

/// Dwords of a group of 128 columns: a tile has one 64-byte vector per dword.
const GROUP_DWORDS: usize = GROUP_LEN / 4;

/// Rows of a tile half: one 256-bit vector holds a dword of each.
const HALF_ROWS: usize = MXFP4_TILE_ROWS / 2;

/// The tiles' 64-byte dword vectors per block of 32 columns.
const BLOCK_VECTORS: usize = BLOCK_LEN / 8;

/// Most tokens one pass over a tile half carries: their sums and accumulators (2 x 4
/// registers), the two decoded operands and three constants fit the 16 ymm registers.
const PASS_TOKENS: usize = 4;

/// `H` halves of tile `tile` from half `first_half` (one, or both in one pass) against tokens
/// `first_token..first_token + T` of `x`, writing the pass's rows `lanes` (0..8H; `out` at the
/// pass's first row for token 0, possibly before the caller's buffer: only lanes inside are
/// written) while spreading prefetches of `prefetch` over the blocks. Both halves at once read
/// each of the tile's cache lines once, as a GEMV of a token (and its split remainder) should:
/// two passes over the halves read each line twice, the second time from L2, and streamed a Q8
/// tile at 85% of the read bandwidth where the row order reached 100%; with more tokens, a
/// pass over each half keeps its sums in the 16 registers.
///
/// # Safety
/// `tile` inside the tiled `w`, the tokens inside `x` (whose columns are `w`'s), every written
/// lane's address inside the output; the CPU has AVX2, FMA, F16C and what `D` needs.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_pass<S: HalfTiles, D: PairDot, const H: usize, const T: usize>(
    w: &S,
    (tile, first_half): (usize, usize),
    x: &Q8Activations,
    first_token: usize,
    out: *mut f32,
    stride: usize,
    lanes: Range<usize>,
    prefetch: &[(*const u8, usize); 2],
) {
    // SAFETY: the caller upholds the contract; every offset below stays inside the tile's bytes
    // (blocks_per_row x 4 vectors of 64 bytes and the block scales) and the tokens' rows.
    unsafe {
        let blocks_per_row = w.cols() / BLOCK_LEN;
        let bases: [_; H] = std::array::from_fn(|h| w.half_base(tile, first_half + h));
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        let quants = x.quants.as_ptr().add(first_token * quant_stride);
        let corrections = x
            .corrections
            .as_ptr()
            .add(first_token * lane_stride + S::CORRECTION_LANE);
        let act_scales = x.scale_lanes.as_ptr().add(first_token * lane_stride);
        let mut acc = [[_mm256_setzero_ps(); H]; T];
        for block in 0..blocks_per_row {
            prefetch_share_into::<true>(prefetch, block, blocks_per_row);
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let lane = group * GROUP_LANES + 4 * j;
            let mut sums: [[[__m256i; 2]; H]; T] = std::array::from_fn(|t| {
                let start = if D::OFFSET {
                    _mm256_set1_epi32(*corrections.add(t * lane_stride + lane))
                } else {
                    _mm256_setzero_si256()
                };
                [[start, _mm256_setzero_si256()]; H]
            });
            // Activation dword 4j + s meets the even operands, dword 16 + 4j + s the odd.
            let at = |s: usize| group * GROUP_LEN + 4 * (4 * j + s);
            let broadcast = |t: usize, s: usize| {
                let q = quants.add(t * quant_stride + at(s));
                (
                    _mm256_set1_epi32(q.cast::<i32>().read_unaligned()),
                    _mm256_set1_epi32(q.add(GROUP_LEN / 2).cast::<i32>().read_unaligned()),
                )
            };
            let operands = |h: usize, s: usize| {
                let (evens, odds) = S::operands(bases[h].0, block, s);
                (D::operand(evens), D::operand(odds))
            };
            if D::TWO_STEPS && H == 1 && T == PASS_TOKENS {
                // A four-token pass over one half (every pass of a GEMM-sized call) holds two
                // steps' operands beside its sums, so the sums may take both steps at once
                // (`vpmaddubsw` then widens once per two). Three-token passes, the rest of a
                // short prompt's experts, spilled with the extra operands: on Zen 4 with
                // OSSTERM_KERNELS=avx2 taking both steps in every one-half pass made the
                // 58-token prefill's experts 6% slower, in four-token passes only 6% faster.
                for s in (0..BLOCK_VECTORS).step_by(2) {
                    let (first, second) = (operands(0, s), operands(0, s + 1));
                    for (t, halves) in sums.iter_mut().enumerate() {
                        let ((even, odd), (even_2, odd_2)) = (broadcast(t, s), broadcast(t, s + 1));
                        D::add_two_pairs(
                            &mut halves[0],
                            [(first.0, even), (first.1, odd)],
                            [(second.0, even_2), (second.1, odd_2)],
                        );
                    }
                }
            } else {
                for s in 0..BLOCK_VECTORS {
                    let operands: [_; H] = std::array::from_fn(|h| operands(h, s));
                    for (t, halves) in sums.iter_mut().enumerate() {
                        let (even, odd) = broadcast(t, s);
                        for (sum, (evens, odds)) in halves.iter_mut().zip(operands) {
                            D::add_pairs(sum, (evens, even), (odds, odd));
                        }
                    }
                }
            }
            let w_scales: [_; H] = std::array::from_fn(|h| S::scales(bases[h].1, block));
            for (t, (acc_t, halves)) in acc.iter_mut().zip(sums).enumerate() {
                let a_scale = _mm256_set1_ps(*act_scales.add(t * lane_stride + lane));
                for ((acc_h, [first, second]), w_scale) in
                    acc_t.iter_mut().zip(halves).zip(w_scales)
                {
                    *acc_h = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(_mm256_add_epi32(first, second)),
                        _mm256_mul_ps(w_scale, a_scale),
                        *acc_h,
                    );
                }
            }
        }
        let factor = _mm256_set1_ps(S::FACTOR);
        for (t, acc_t) in acc.iter().enumerate() {
            let row_out = out.wrapping_add(t * stride);
            if lanes == (0..H * HALF_ROWS) {
                for (h, acc_h) in acc_t.iter().enumerate() {
                    _mm256_storeu_ps(row_out.add(h * HALF_ROWS), _mm256_mul_ps(*acc_h, factor));
                }
            } else {
                let mut staged = [0.0f32; MXFP4_TILE_ROWS];
                for (h, acc_h) in acc_t.iter().enumerate() {
                    let values = _mm256_mul_ps(*acc_h, factor);
                    _mm256_storeu_ps(staged.as_mut_ptr().add(h * HALF_ROWS), values);
                }
                for lane in lanes.clone() {
                    *row_out.wrapping_add(lane) = staged[lane];
                }
            }
        }
    }
}

/// Most tokens one pass over a whole tile takes (see [`tile_pass`]).
const WHOLE_TILE_TOKENS: usize = 2;

/// Every token of `x` against the rows `lanes` (0..16) of tile `tile`: up to
/// [`WHOLE_TILE_TOKENS`] in one pass over both halves, more in balanced passes of at most
/// [`PASS_TOKENS`] per half; the first pass prefetches `prefetch`.
///
/// # Safety
/// As [`tile_pass`], `out` at lane 0 of the tile for token 0.
#[inline(always)]
unsafe fn tile_all_tokens<S: HalfTiles, D: PairDot>(
    w: &S,
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
        if tokens <= WHOLE_TILE_TOKENS {
            let (at, p) = ((tile, 0), &prefetch);
            match tokens {
                2 => tile_pass::<S, D, 2, 2>(w, at, x, 0, out, stride, lanes, p),
                _ => tile_pass::<S, D, 2, 1>(w, at, x, 0, out, stride, lanes, p),
            }
            return;
        }
        let batch = even_batch(tokens, PASS_TOKENS);
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
                    4 => tile_pass::<S, D, 1, 4>(w, at, x, token, o, stride, l, p),
                    3 => tile_pass::<S, D, 1, 3>(w, at, x, token, o, stride, l, p),
                    2 => tile_pass::<S, D, 1, 2>(w, at, x, token, o, stride, l, p),
                    _ => tile_pass::<S, D, 1, 1>(w, at, x, token, o, stride, l, p),
                }
                token += count;
            }
        }
    }
}

/// A tiled format's public product, choosing among its three entries (the target features of
/// each way of summing, around one body).
macro_rules! tiled_product {
    ($(#[$doc:meta])* $name:ident, $matrix:ty, $check:expr) => {
        $(#[$doc])*
        pub(in crate::kernels) unsafe fn $name(
            w: &$matrix,
            x: &Q8Activations,
            rows: Range<usize>,
            out: &mut [f32],
            dot: Avx2Dot,
        ) {
            debug_assert!($check(w));

            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn maddubs(w: &$matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
                // SAFETY: the caller upholds the public entry's contract; this has Maddubs'
                // features.
                unsafe { product::<_, Maddubs>(w, x, rows, out) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
            unsafe fn vex(w: &$matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
                // SAFETY: as above, with AVX-VNNI.
                unsafe { product::<_, VnniVex>(w, x, rows, out) }
            }

            #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
            unsafe fn evex(w: &$matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
                // SAFETY: as above, with AVX-512 VNNI and VL.
                unsafe { product::<_, VnniEvex>(w, x, rows, out) }
            }

            // SAFETY: the caller upholds the contract: each entry's features are present.
            unsafe {
                match dot {
                    Avx2Dot::Maddubs => maddubs(w, x, rows, out),
                    Avx2Dot::VnniVex => vex(w, x, rows, out),
                    Avx2Dot::VnniEvex => evex(w, x, rows, out),
                }
            }
        }
    };
}

tiled_product!(
    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled MXFP4 `w` and any number
    /// of tokens, prefetching one tile ahead (past `rows` up to the matrix's end, so the next
    /// task's first tile is not a cold miss either).
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C, and what `dot` names; `w` is tiled and the shapes were
    /// checked by `Kernels`.
    mxfp4_product,
    Mxfp4Matrix,
    |w: &Mxfp4Matrix| w.layout == Mxfp4Layout::Tiles
);

tiled_product!(
    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled Q4 `w`, as
    /// [`mxfp4_product`].
    ///
    /// # Safety
    /// As [`mxfp4_product`], for a tiled Q4 `w`.
    q4_product,
    Q4Matrix,
    |w: &Q4Matrix| w.tiled
);

/// [`mxfp4_product`]'s body for one way of summing.
///
/// # Safety
/// As [`mxfp4_product`], the CPU having what `D` needs.
#[inline(always)]
unsafe fn product<S: HalfTiles, D: PairDot>(
    w: &S,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    if rows.is_empty() || x.rows() == 0 {
        return;
    }
    // SAFETY: the caller upholds the contract; each tile writes only the lanes inside `rows`,
    // at `out` offsets below `x.rows() * rows.len()`.
    unsafe {
        let stride = rows.len();
        let limit = w.row_count();
        let mut tile = rows.start / MXFP4_TILE_ROWS;
        while tile * MXFP4_TILE_ROWS < rows.end {
            let first_row = tile * MXFP4_TILE_ROWS;
            let next = (first_row + MXFP4_TILE_ROWS).min(limit);
            let spans = w.byte_spans(next..(next + MXFP4_TILE_ROWS).min(limit));
            let o = tile_out(out, first_row, rows.start);
            tile_all_tokens::<S, D>(w, tile, x, o, stride, tile_lanes(tile, &rows), spans);
            tile += 1;
        }
    }
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled Q8 `w` and any number of
/// tokens, as [`mxfp4_product`]: in `vpdpbusd` of the encoding `dot` names, or on plain AVX2 in
/// [`SignedMaddubs`] (the same integer sums, so the same bits).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and what `dot` names; `w` is tiled and the shapes were checked
/// by `Kernels`.
pub(in crate::kernels) unsafe fn q8_product(
    w: &Q8Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    dot: Avx2Dot,
) {
    debug_assert!(w.tiled);
    // SAFETY: the caller upholds the contract: the entry's features are present.
    unsafe {
        match dot {
            Avx2Dot::Maddubs => q8_product_signed(w, x, rows, out),
            Avx2Dot::VnniVex => q8_product_vex(w, x, rows, out),
            Avx2Dot::VnniEvex => q8_product_evex(w, x, rows, out),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_product_signed(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the caller upholds `q8_product`'s contract; plain AVX2 suffices.
    unsafe { product::<_, SignedMaddubs>(w, x, rows, out) }
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q8_product_vex(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the caller upholds `q8_product`'s contract; this entry has AVX-VNNI.
    unsafe { product::<_, VnniVex>(w, x, rows, out) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn q8_product_evex(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: as above, with AVX-512 VNNI and VL.
    unsafe { product::<_, VnniEvex>(w, x, rows, out) }
}
