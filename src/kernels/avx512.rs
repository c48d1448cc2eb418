//! AVX-512 kernels: `vpdpbusd` (VNNI) for the integer formats, 16-wide FMA for f32/bf16/f16.
//!
//! Every `pub(crate) unsafe fn` here requires that the CPU supports all of [`REQUIRED`] (the
//! dispatcher guarantees it) and that the caller checked the shapes (the safe methods of
//! `Kernels` do). Given both, every pointer read below stays inside the slices it came from.

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::avx2::{prefetch_share, prefetch_share_into};
use super::formats::{
    repeat_table, ByteSpans, Mxfp4Layout, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix,
    ScaleExponents, BLOCK_LEN, CORRECTION_LANE_MXFP4, CORRECTION_LANE_Q4, CORRECTION_LANE_Q8,
    GROUP_BLOCKS, GROUP_LANES, GROUP_LEN, MXFP4_OFFSET, Q4_OFFSET, Q8_OFFSET,
};
use super::{even_batch, GemmScratch, GEMM_TILE_ROWS, GEMM_TILE_SLOTS};

mod nibble_asm;
pub(super) mod tiles;

pub(super) use nibble_asm::call_count as assembly_call_count;

/// Words the MXFP4 loop in assembly packs for its largest call over rows of `cols` columns.
pub(super) fn assembly_packed_words(cols: usize) -> usize {
    tiles::DIRECT_CALL_TOKENS * nibble_asm::PACKED_WORDS * (cols / BLOCK_LEN)
}

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
pub(in crate::kernels) const FORMAT_MXFP4: u8 = 0;
const FORMAT_Q4: u8 = 1;
const FORMAT_Q8: u8 = 2;

/// Which of a block's four lanes of [`Q8Activations::corrections`] holds this format's correction.
const fn correction_lane(format: u8) -> usize {
    match format {
        FORMAT_MXFP4 => CORRECTION_LANE_MXFP4,
        FORMAT_Q4 => CORRECTION_LANE_Q4,
        _ => CORRECTION_LANE_Q8,
    }
}

/// The lanes of [`Q8Activations::corrections`] that hold this format's block corrections (lane
/// 4j + k of block j).
const fn correction_mask(format: u8) -> __mmask16 {
    0x1111 << correction_lane(format)
}

/// MXFP4 sums use doubled FP4 values.
pub(super) const fn format_factor(format: u8) -> f32 {
    if format == FORMAT_MXFP4 {
        0.5
    } else {
        1.0
    }
}

/// What the unsigned operands of `format` add to its signed values (the offset each block's
/// correction takes off again); the matrix unit, which multiplies signed bytes, subtracts it.
pub(super) const fn operand_offset(format: u8) -> i32 {
    match format {
        FORMAT_MXFP4 => MXFP4_OFFSET,
        FORMAT_Q4 => Q4_OFFSET,
        _ => Q8_OFFSET,
    }
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
        // SAFETY: the caller upholds this function's contract (`group < x.groups()` and `token <
        // x.rows()`; the CPU has the module's features), which is what every pointer access and
        // target-feature call below relies on.
        unsafe {
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

/// One Q4 row's group decoded to unsigned (evens, odds) and scale lanes.
///
/// # Safety
/// `row < rows` of the matrix, `group < groups`; the CPU has the module's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_group(w: &Q4Matrix, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
    // SAFETY: the caller upholds this function's contract (row and group inside the Q4 matrix; the CPU features),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
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
}

/// As [`q4_group`], for a Q8 matrix.
///
/// # Safety
/// As [`q4_group`], for a Q8 matrix.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_group(w: &Q8Matrix, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
    // SAFETY: the caller upholds this function's contract (as `q4_group`, for a Q8 matrix),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
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
}

/// A matrix whose groups decode to unsigned weights (evens, odds) and scale lanes.
trait GroupSource: ByteSpans {
    const FORMAT: u8;
    /// The GEMV prefetches the next rows into L2 only (see `avx2::prefetch_share_into`).
    const PREFETCH_L2: bool;
    fn groups(&self) -> usize;
    /// # Safety
    /// `row < rows()`, `group < groups()`; the CPU has the module's features.
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512);

    /// The group's weight bytes as stored, not yet decoded: the 64 nibble bytes (and zeros) for
    /// MXFP4 and Q4, the evens and the odds for Q8. Bytes past a short last group are zero.
    ///
    /// # Safety
    /// As [`GroupSource::load_group`].
    unsafe fn raw_group(&self, row: usize, group: usize) -> (__m512i, __m512i);

    /// Unsigned (evens, odds) from [`GroupSource::raw_group`]'s vectors. Byte-wise, so it gives
    /// the same bytes when applied after any permutation of dwords: the GEMM transposes the raw
    /// bytes (one transpose for the nibble formats) and decodes afterwards.
    ///
    /// # Safety
    /// The CPU has the module's features.
    unsafe fn decode_raw(first: __m512i, second: __m512i) -> (__m512i, __m512i);

    /// Block j's scale of rows `first_row..first_row + count` in lane r of vector j, 0 in the
    /// lanes past `count`: the GEMM tile's scale columns, built without a transpose.
    ///
    /// # Safety
    /// Rows inside the matrix, `count <= 16`, `group < groups()`; the CPU has the module's features.
    unsafe fn scale_columns(&self, first_row: usize, count: usize, group: usize) -> [__m512; 4];

    /// The smallest and largest E8M0 scale byte of `rows`, for a format whose block scales are
    /// powers of two (MXFP4); `None` for the others. The GEMM multiplies by such a scale with an
    /// integer add to the exponent when every product stays a normal float.
    ///
    /// # Safety
    /// Rows inside the matrix; the CPU has the module's features.
    unsafe fn exponent_range(&self, _rows: Range<usize>) -> Option<(u32, u32)> {
        None
    }

    /// Groups `0..full_groups()` hold whole blocks only (the rest: a short last group).
    fn full_groups(&self) -> usize {
        self.groups()
    }

    /// The GEMV's decode of one row's group: [`GroupSource::load_group`] unless the format has a
    /// cheaper one (MXFP4: `vpermb` when `VBMI`, and the scale spread of `e8m0_spread`).
    /// Inlined into the GEMV, whose target features it is compiled with.
    ///
    /// # Safety
    /// As [`GroupSource::load_group`]; the CPU has AVX-512 VBMI if `VBMI`; `group <
    /// full_groups()` if `FULL`.
    #[inline(always)]
    unsafe fn gemv_group<const VBMI: bool, const FULL: bool>(
        &self,
        row: usize,
        group: usize,
    ) -> (__m512i, __m512i, __m512) {
        // SAFETY: the caller upholds `load_group`'s contract.
        unsafe { self.load_group(row, group) }
    }
}

/// Four E8M0 scale bytes of 127 (2^0): the scale lanes of a tile's padding.
const PAD_SCALE_WORD: u32 = 0x7F7F_7F7F;

/// Block j's f16 scale of each of 16 rows (four per row in `bits[r]`) as f32 in lane r of
/// vector j.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn f16_scale_columns(bits: &[u64; 16]) -> [__m512; 4] {
    // SAFETY: `bits` is 16 readable u64 (two vectors); loadu has no alignment requirement.
    let (low, high) = unsafe {
        (
            _mm512_loadu_si512(bits.as_ptr().cast()),
            _mm512_loadu_si512(bits.as_ptr().add(8).cast()),
        )
    };
    std::array::from_fn(|j| {
        let shift = _mm512_set1_epi64(16 * j as i64);
        let words = _mm256_set_m128i(
            _mm512_cvtepi64_epi16(_mm512_srlv_epi64(high, shift)),
            _mm512_cvtepi64_epi16(_mm512_srlv_epi64(low, shift)),
        );
        _mm512_cvtph_ps(words)
    })
}

/// The four f16 scales of `group` in rows `first_row..+count` of a Q8 or Q4 matrix (zeros past
/// `count`), as `f16_scale_columns` takes them.
///
/// # Safety
/// `scales` holds `groups * 4` f16 per row for the rows asked; `count <= 16`.
#[inline]
unsafe fn f16_scale_bits(
    scales: *const f16,
    groups: usize,
    first_row: usize,
    count: usize,
    group: usize,
) -> [u64; 16] {
    let mut bits = [0u64; 16];
    for (r, bits) in bits.iter_mut().enumerate().take(count) {
        // SAFETY: row `first_row + r` exists and its group `group` has four scales.
        *bits = unsafe {
            scales
                .add((first_row + r) * groups * GROUP_BLOCKS + group * GROUP_BLOCKS)
                .cast::<u64>()
                .read_unaligned()
        };
    }
    bits
}

impl GroupSource for Mxfp4Matrix<'_> {
    const PREFETCH_L2: bool = true;
    const FORMAT: u8 = FORMAT_MXFP4;
    fn groups(&self) -> usize {
        self.cols.div_ceil(GROUP_LEN)
    }
    fn full_groups(&self) -> usize {
        self.cols / GROUP_LEN
    }
    /// `vpermb` when `VBMI`; `FULL` keeps the short-group branch and its arithmetic out of the
    /// GEMV's main loop.
    #[inline(always)]
    unsafe fn gemv_group<const VBMI: bool, const FULL: bool>(
        &self,
        row: usize,
        group: usize,
    ) -> (__m512i, __m512i, __m512) {
        // SAFETY: the caller upholds the trait's contract (row and group inside the matrix; the
        // CPU features), so every load below stays inside the row.
        unsafe {
            let blocks_per_row = self.cols / BLOCK_LEN;
            let blocks_here = if FULL {
                GROUP_BLOCKS
            } else {
                (blocks_per_row - group * GROUP_BLOCKS).min(GROUP_BLOCKS)
            };
            let bytes = self
                .blocks
                .as_ptr()
                .add(row * (self.cols / 2) + group * GROUP_LEN / 2);
            let scales = self
                .scales
                .as_ptr()
                .add(row * blocks_per_row + group * GROUP_BLOCKS);
            let (nibbles, scale_word) = if blocks_here == GROUP_BLOCKS {
                (
                    _mm512_loadu_si512(bytes.cast()),
                    _mm512_set1_epi32(scales.cast::<i32>().read_unaligned()),
                )
            } else {
                // A row's last group may hold 1-3 blocks; masked-off bytes are not read (no
                // fault) and become nibble 0, whose weight meets zero padding activations.
                let mask = (1u64 << (blocks_here * 16)) - 1;
                let mut word = 0u32;
                for j in 0..blocks_here {
                    word |= (*scales.add(j) as u32) << (8 * j);
                }
                (
                    _mm512_maskz_loadu_epi8(mask, bytes.cast()),
                    _mm512_set1_epi32(word as i32),
                )
            };
            let (evens, odds) = if VBMI {
                // `vpermb` ignores the index bits 6-7, so neither nibble needs a mask: three
                // operations instead of the five of `split_nibbles`.
                let table = _mm512_loadu_si512(MXFP4_UNSIGNED_64.as_ptr().cast());
                (
                    _mm512_permutexvar_epi8(nibbles, table),
                    _mm512_permutexvar_epi8(_mm512_srli_epi16::<4>(nibbles), table),
                )
            } else {
                split_nibbles::<FORMAT_MXFP4>(nibbles)
            };
            (evens, odds, e8m0_spread(scale_word))
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe { self.gemv_group::<false, false>(row, group) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn raw_group(&self, row: usize, group: usize) -> (__m512i, __m512i) {
        let blocks_here = (self.cols / BLOCK_LEN - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
        // A short last group: masked-off bytes are not read (no fault) and stay zero.
        let mask = u64::MAX >> (64 - 16 * blocks_here);
        // SAFETY: the caller upholds the trait's contract (row and group inside the matrix); the
        // mask keeps the load inside the row's bytes.
        let nibbles = unsafe {
            _mm512_maskz_loadu_epi8(
                mask,
                self.blocks
                    .as_ptr()
                    .add(row * (self.cols / 2) + group * GROUP_LEN / 2)
                    .cast(),
            )
        };
        (nibbles, _mm512_setzero_si512())
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode_raw(first: __m512i, _: __m512i) -> (__m512i, __m512i) {
        split_nibbles::<FORMAT_MXFP4>(first)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn scale_columns(&self, first_row: usize, count: usize, group: usize) -> [__m512; 4] {
        let blocks_per_row = self.cols / BLOCK_LEN;
        let blocks_here = (blocks_per_row - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
        // Lanes of rows past `count` and of blocks past a short last group get scale 1
        // (E8M0 127), not 0: their integer sums are 0 (zero weights against zero padding), so
        // the product is 0 either way, and 1 keeps the exponent-add kernel's combined scale a
        // finite number there (see `gemm_tile_pair`).
        let mut bytes = [PAD_SCALE_WORD; 16];
        let scales = self.scales.as_ptr();
        for (r, word) in bytes.iter_mut().enumerate().take(count) {
            let at = (first_row + r) * blocks_per_row + group * GROUP_BLOCKS;
            // SAFETY: the caller upholds the trait's contract (row `first_row + r` and `group`
            // inside the matrix), so the group's `blocks_here` scale bytes exist.
            *word = unsafe {
                if blocks_here == GROUP_BLOCKS {
                    scales.add(at).cast::<u32>().read_unaligned()
                } else {
                    (0..blocks_here).fold(PAD_SCALE_WORD, |word, j| {
                        word & !(0xFF << (8 * j)) | (*scales.add(at + j) as u32) << (8 * j)
                    })
                }
            };
        }
        // SAFETY: `bytes` is 64 readable bytes; loadu has no alignment requirement.
        let v = unsafe { _mm512_loadu_si512(bytes.as_ptr().cast()) };
        let byte = _mm512_set1_epi32(0xFF);
        std::array::from_fn(|j| {
            let e = _mm512_and_si512(_mm512_srlv_epi32(v, _mm512_set1_epi32(8 * j as i32)), byte);
            // 2^(s - 127) as f32 bits, s = 0 flushing to 0: as `e8m0_spread`.
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(e))
        })
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn exponent_range(&self, rows: Range<usize>) -> Option<(u32, u32)> {
        let blocks_per_row = self.cols / BLOCK_LEN;
        let mut low = _mm512_set1_epi8(-1);
        let mut high = _mm512_setzero_si512();
        for row in rows {
            let mut block = 0;
            while block < blocks_per_row {
                let n = (blocks_per_row - block).min(64);
                let mask = u64::MAX >> (64 - n);
                // SAFETY: the caller upholds the trait's contract (rows inside the matrix); the
                // mask keeps the load inside the row's scale bytes.
                let v = unsafe {
                    _mm512_maskz_loadu_epi8(
                        mask,
                        self.scales
                            .as_ptr()
                            .add(row * blocks_per_row + block)
                            .cast(),
                    )
                };
                low = _mm512_mask_min_epu8(low, mask, low, v);
                high = _mm512_max_epu8(high, v);
                block += 64;
            }
        }
        let (mut lows, mut highs) = ([0u8; 64], [0u8; 64]);
        // SAFETY: both arrays are 64 writable bytes; storeu has no alignment requirement.
        unsafe {
            _mm512_storeu_si512(lows.as_mut_ptr().cast(), low);
            _mm512_storeu_si512(highs.as_mut_ptr().cast(), high);
        }
        let low = lows.iter().copied().min().unwrap_or(u8::MAX);
        let high = highs.iter().copied().max().unwrap_or(0);
        Some((low as u32, high as u32))
    }
}

impl GroupSource for Q4Matrix {
    const PREFETCH_L2: bool = true;
    const FORMAT: u8 = FORMAT_Q4;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe { q4_group(self, row, group) }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn raw_group(&self, row: usize, group: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract; rows are padded to whole groups.
        let nibbles = unsafe {
            _mm512_loadu_si512(
                self.row_nibbles(row)
                    .as_ptr()
                    .add(group * GROUP_LEN / 2)
                    .cast(),
            )
        };
        (nibbles, _mm512_setzero_si512())
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode_raw(first: __m512i, _: __m512i) -> (__m512i, __m512i) {
        split_nibbles::<FORMAT_Q4>(first)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn scale_columns(&self, first_row: usize, count: usize, group: usize) -> [__m512; 4] {
        // SAFETY: the caller upholds the trait's contract (rows inside the matrix, count <= 16).
        let bits =
            unsafe { f16_scale_bits(self.scales.as_ptr(), self.groups, first_row, count, group) };
        f16_scale_columns(&bits)
    }
}

impl GroupSource for Q8Matrix {
    const PREFETCH_L2: bool = true;
    const FORMAT: u8 = FORMAT_Q8;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn load_group(&self, row: usize, group: usize) -> (__m512i, __m512i, __m512) {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe { q8_group(self, row, group) }
    }
    unsafe fn exponent_range(&self, rows: Range<usize>) -> Option<(u32, u32)> {
        self.scale_exponents(rows)
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn raw_group(&self, row: usize, group: usize) -> (__m512i, __m512i) {
        // SAFETY: the caller upholds the trait's contract; rows are padded to whole groups.
        unsafe {
            let quants = self.row_quants(row).as_ptr().add(group * GROUP_LEN);
            (
                _mm512_loadu_si512(quants.cast()),
                _mm512_loadu_si512(quants.add(GROUP_LEN / 2).cast()),
            )
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn decode_raw(first: __m512i, second: __m512i) -> (__m512i, __m512i) {
        // q ^ 0x80 = q + 128 as an unsigned byte.
        let sign = _mm512_set1_epi8(i8::MIN);
        (
            _mm512_xor_si512(first, sign),
            _mm512_xor_si512(second, sign),
        )
    }
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    unsafe fn scale_columns(&self, first_row: usize, count: usize, group: usize) -> [__m512; 4] {
        // SAFETY: the caller upholds the trait's contract (rows inside the matrix, count <= 16).
        let bits =
            unsafe { f16_scale_bits(self.scales.as_ptr(), self.groups, first_row, count, group) };
        f16_scale_columns(&bits)
    }
}

/// [`MXFP4_UNSIGNED`] four times over: a `vpermb` table, which indexes with a byte's low six
/// bits, so the neighbouring nibble's bits 4-5 that a byte carries select the same entry.
const MXFP4_UNSIGNED_64: [i8; 64] = repeat_table(&MXFP4_UNSIGNED);
/// The doubled E2M1 values as signed bytes (the unsigned table less [`MXFP4_OFFSET`]), repeated
/// for `vpermb`: the operands of the matrix unit's signed products.
const MXFP4_SIGNED_64: [i8; 64] = repeat_table(&MXFP4_SIGNED);
const MXFP4_SIGNED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
const _: () = {
    let mut i = 0;
    while i < 16 {
        assert!(MXFP4_SIGNED[i] as i32 == MXFP4_UNSIGNED[i] as i32 - MXFP4_OFFSET);
        i += 1;
    }
};

/// The same kind of table for Q4, whose unsigned operands are the nibbles themselves: with it
/// `vpermb` masks a nibble as `vpandd` would.
const Q4_UNSIGNED_64: [i8; 64] =
    repeat_table(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]);

/// `vpshufb` control that puts scale byte j of a broadcast dword into the top byte of lanes
/// 4j..4j+3 (the 128-bit lane j) and zeros the rest: `s << 24`, one shift away from the f32 bits
/// of 2^(s-127).
const E8M0_SPREAD: [i8; 64] = {
    let mut control = [-1i8; 64];
    let mut lane = 0;
    while lane < 16 {
        control[4 * lane + 3] = (lane / 4) as i8;
        lane += 1;
    }
    control
};

/// Sixteen lanes of 2^(s-127) (0 for s = 0) from four E8M0 bytes held in every dword of `word`
/// (lanes 4j..4j+3 from byte j): one shuffle and one shift, where a widening from the four bytes
/// takes a move, a shuffle, a cross-lane widening and a shift.
///
/// # Safety
/// The CPU has the module's features.
#[inline(always)]
unsafe fn e8m0_spread(word: __m512i) -> __m512 {
    // SAFETY: the caller guarantees the CPU features; the control is 64 readable bytes.
    unsafe {
        let control = _mm512_loadu_si512(E8M0_SPREAD.as_ptr().cast());
        _mm512_castsi512_ps(_mm512_srli_epi32::<1>(_mm512_shuffle_epi8(word, control)))
    }
}

/// The integer sums of four tokens (lanes 4j..4j+3 of `sums[t]`: block j) folded into one
/// vector whose lane 4j+t holds token t's whole block-j sum. Exact integer adds, so each row and
/// group then needs one convert, one multiply and one FMA for all four tokens instead of one
/// each. Generic only so that `gemv_rows` compiles for every `T`; called with `T == 4`.
#[inline(always)]
fn fold_tokens<const T: usize>(sums: &[__m512i; T]) -> __m512i {
    debug_assert_eq!(T, 4);
    // SAFETY: only register operations of AVX-512F, which every caller's target features hold.
    unsafe {
        let pair = |a: __m512i, b: __m512i| {
            _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
        };
        let (low, high) = (pair(sums[0], sums[1]), pair(sums[2], sums[3]));
        _mm512_add_epi32(
            _mm512_unpacklo_epi64(low, high),
            _mm512_unpackhi_epi64(low, high),
        )
    }
}

/// The four tokens' activation scales in [`fold_tokens`]' lane order (lane 4j+t: token t's
/// block-j scale). Called with `T == 4`.
#[inline(always)]
fn fold_scales<const T: usize>(a: &[ActGroup; T]) -> __m512 {
    debug_assert_eq!(T, 4);
    // SAFETY: only register operations of AVX-512F, which every caller's target features hold.
    unsafe {
        let v = _mm512_mask_blend_ps(0x2222, a[0].scales, a[1].scales);
        let v = _mm512_mask_blend_ps(0x4444, v, a[2].scales);
        _mm512_mask_blend_ps(0x8888, v, a[3].scales)
    }
}

/// `R` rows against the `T` tokens of `x` (1 to 4), decoding each weight group once for all
/// tokens and sharing each activation load across the rows, while prefetching the rows
/// `prefetch`. Writes `out[t * stride + at + i]`.
///
/// Inlined into [`gemv`] or [`gemv_vbmi`], whose target features it is compiled with.
///
/// # Safety
/// `first_row + R <= w.rows()`, `x` has `T` tokens of `w`'s columns, the writes are in bounds;
/// the CPU has the features of the function it is inlined into.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_rows<W: GroupSource, const R: usize, const T: usize, const VBMI: bool>(
    w: &W,
    x: &Q8Activations,
    first_row: usize,
    prefetch: Range<usize>,
    out: &mut [f32],
    stride: usize,
    at: usize,
) {
    /// One group of the `R` rows; `FULL` as in [`GroupSource::gemv_group`].
    ///
    /// # Safety
    /// As `gemv_rows`, with `group < w.groups()` (`< w.full_groups()` if `FULL`).
    #[inline(always)]
    unsafe fn step<
        W: GroupSource,
        const R: usize,
        const T: usize,
        const VBMI: bool,
        const FULL: bool,
    >(
        w: &W,
        x: &Q8Activations,
        first_row: usize,
        group: usize,
        acc: &mut [[__m512; T]; R],
    ) {
        // SAFETY: the caller upholds this function's contract.
        unsafe {
            let a: [ActGroup; T] =
                std::array::from_fn(|t| ActGroup::load(x, t, group, correction_mask(W::FORMAT)));
            if T < 4 {
                for (i, acc_row) in acc.iter_mut().enumerate() {
                    let (evens, odds, scales) = w.gemv_group::<VBMI, FULL>(first_row + i, group);
                    for (acc_t, a_t) in acc_row.iter_mut().zip(&a) {
                        *acc_t = group_fma(*acc_t, evens, odds, scales, a_t);
                    }
                }
            } else {
                // Four tokens share one accumulator per row (`fold_tokens`' lane order): one
                // convert, multiply and FMA per row and group instead of four, for nine integer
                // shuffles and adds (measured +12% with the weights in L2, Zen 4; two tokens
                // folded measured 6% slower and three no better, so they keep one accumulator
                // each).
                let a_scales = fold_scales(&a);
                for (i, acc_row) in acc.iter_mut().enumerate() {
                    let (evens, odds, scales) = w.gemv_group::<VBMI, FULL>(first_row + i, group);
                    let sums: [__m512i; T] = std::array::from_fn(|t| {
                        _mm512_dpbusd_epi32(
                            _mm512_dpbusd_epi32(a[t].correction, evens, a[t].evens),
                            odds,
                            a[t].odds,
                        )
                    });
                    acc_row[0] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(fold_tokens(&sums)),
                        _mm512_mul_ps(scales, a_scales),
                        acc_row[0],
                    );
                }
            }
        }
    }

    // SAFETY: the caller upholds this function's contract (`first_row + R <= w.rows()`, `x` has `T`
    // tokens of `w`'s columns, the writes are in bounds), which is what every pointer access and
    // target-feature call below relies on.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let (groups, full) = (w.groups(), w.full_groups());
        let spans = w.byte_spans(prefetch);
        // Whole groups first, with no per-group test for a short one: on a CPU that splits
        // 512-bit operations in two (Zen 4) the scalar bookkeeping of that test cost as much
        // front-end bandwidth as the vector work.
        for group in 0..full {
            if W::PREFETCH_L2 {
                prefetch_share_into::<true>(&spans, group, groups)
            } else {
                prefetch_share_into::<false>(&spans, group, groups)
            }
            step::<W, R, T, VBMI, true>(w, x, first_row, group, &mut acc);
        }
        for group in full..groups {
            prefetch_share_into::<false>(&spans, group, groups);
            step::<W, R, T, VBMI, false>(w, x, first_row, group, &mut acc);
        }
        for (i, acc_row) in acc.iter().enumerate() {
            if T < 4 {
                for (t, acc_t) in acc_row.iter().enumerate() {
                    out[t * stride + at + i] =
                        format_factor(W::FORMAT) * _mm512_reduce_add_ps(*acc_t);
                }
            } else {
                let mut lanes = [0.0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), acc_row[0]);
                // Token t's lanes: those whose index is t modulo 4.
                for t in 0..T {
                    let sum: f32 = lanes.iter().skip(t).step_by(4).sum();
                    out[t * stride + at + i] = format_factor(W::FORMAT) * sum;
                }
            }
        }
    }
}

/// # Safety
/// The CPU has the module's features; shapes were checked by `Kernels` (1 to
/// [`super::MAX_GEMV_TOKENS`] tokens of `w`'s columns, `rows` inside the matrix, `out.len() ==
/// tokens x rows.len()`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn gemv<W: GroupSource>(w: &W, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract, which `gemv_tokens` shares.
    unsafe { gemv_tokens::<W, false>(w, x, rows, out) }
}

/// [`gemv`] with the MXFP4 nibbles decoded by `vpermb`.
///
/// # Safety
/// As [`gemv`], and the CPU has AVX-512 VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn gemv_vbmi<W: GroupSource>(w: &W, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract, which `gemv_tokens` shares.
    unsafe { gemv_tokens::<W, true>(w, x, rows, out) }
}

/// # Safety
/// As [`gemv`] (and AVX-512 VBMI if `VBMI`); inlined into it.
#[inline(always)]
unsafe fn gemv_tokens<W: GroupSource, const VBMI: bool>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's contract, which every arm's callee shares.
    unsafe {
        // Four rows share each activation load. Four tokens fold their sums into one accumulator
        // per row (`fold_tokens`), which keeps four rows inside the 32 registers.
        match x.rows() {
            1 => gemv_row_blocks::<W, 4, 1, VBMI>(w, x, rows, out),
            2 => gemv_row_blocks::<W, 4, 2, VBMI>(w, x, rows, out),
            3 => gemv_row_blocks::<W, 4, 3, VBMI>(w, x, rows, out),
            _ => gemv_row_blocks::<W, 4, 4, VBMI>(w, x, rows, out),
        }
    }
}

/// # Safety
/// As [`gemv_tokens`], with `x` holding exactly `T` tokens.
#[inline(always)]
unsafe fn gemv_row_blocks<W: GroupSource, const R: usize, const T: usize, const VBMI: bool>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's contract (As [`gemv_tokens`]), which is what
    // every pointer access and target-feature call below relies on.
    unsafe {
        // About eight rows ahead measured best (4 and 16 were slower in decode).
        let prefetch_ahead = 8;
        let stride = rows.len();
        // Past the end of `rows` into the matrix's next rows: a caller that walks a matrix in
        // blocks (the GEMV passes of a batch's split rows, 64 rows at a time) has the next
        // block's first rows in flight instead of starting each block on a cold miss; at the
        // end of a row task the few extra lines are the next task's, which another core reads.
        let limit = w.row_count();
        let ahead = |row: usize, count: usize| {
            (row + prefetch_ahead).min(limit)..(row + prefetch_ahead + count).min(limit)
        };
        let mut at = 0;
        while at < stride {
            let row = rows.start + at;
            if stride - at >= R {
                gemv_rows::<W, R, T, VBMI>(w, x, row, ahead(row, R), out, stride, at);
                at += R;
            } else {
                gemv_rows::<W, 1, T, VBMI>(w, x, row, ahead(row, 0), out, stride, at);
                at += 1;
            }
        }
    }
}

/// Whether the MXFP4 GEMV may decode with `vpermb`: AVX-512 VBMI detected and not switched off
/// (`Kernels::without_vbmi`, which tests and the benchmark use to run the other decode).
pub(crate) fn vbmi_detected() -> bool {
    is_x86_feature_detected!("avx512vbmi")
}

pub(crate) fn bf16_detected() -> bool {
    is_x86_feature_detected!("avx512bf16")
}

/// Whether this CPU has AVX-512 BF16 and issues `vdpbf16ps` at least about as fast as an f32
/// FMA, so bf16 attention does more multiply-adds per cycle (Zen 4: one 512-bit instruction of
/// either kind per cycle, so twice the multiply-adds; a CPU with two FMA units and one bf16 unit
/// would gain nothing after the conversions). Measured once, best of a few short rounds of
/// independent chains of each (about a millisecond in all). The two cases sit at time ratios
/// of about 1 and 2, so the cut is between them (1.5): a noisy host moves a best-of-five ratio
/// far less than that, and the choice, which changes the default path's numerics, does not
/// flip from one start to the next.
pub(crate) fn bf16_dot_pays() -> bool {
    static PAYS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PAYS.get_or_init(|| {
        if !bf16_detected() {
            return false;
        }
        let (mut bf16, mut fma) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            // SAFETY: the CPU has AVX-512 F and BF16 (checked above).
            let (b, f) = unsafe { dot_chain_times() };
            bf16 = bf16.min(b);
            fma = fma.min(f);
        }
        bf16 <= 1.5 * fma
    })
}

/// Seconds for the same count of `vdpbf16ps` and of `vfmadd231ps` (512-bit, 12 independent
/// chains each).
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_chain_times() -> (f64, f64) {
    const CHAINS: usize = 12;
    const ROUNDS: usize = 4000;
    // SAFETY: both are 64 bytes of plain SIMD lanes, valid for every bit pattern.
    let pair: __m512bh = unsafe {
        std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi16(std::hint::black_box(0x3f80)))
    };
    let (a, b) = (
        _mm512_set1_ps(std::hint::black_box(1.0)),
        _mm512_set1_ps(std::hint::black_box(1e-9)),
    );
    let mut chains = [_mm512_setzero_ps(); CHAINS];
    let started = std::time::Instant::now();
    for _ in 0..ROUNDS {
        for c in chains.iter_mut() {
            *c = _mm512_dpbf16_ps(*c, pair, pair);
        }
    }
    std::hint::black_box(&chains);
    let bf16 = started.elapsed().as_secs_f64();
    let started = std::time::Instant::now();
    for _ in 0..ROUNDS {
        for c in chains.iter_mut() {
            *c = _mm512_fmadd_ps(a, b, *c);
        }
    }
    std::hint::black_box(&chains);
    (bf16, started.elapsed().as_secs_f64())
}

pub(crate) unsafe fn mxfp4_gemv(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    vbmi: bool,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED` (and passes `vbmi` only where `vbmi_detected`), and the safe
    // `Kernels` method checked the shapes, which is all the code below relies on.
    unsafe {
        if w.layout == Mxfp4Layout::Tiles {
            tiles::mxfp4_product(w, x, rows, out, None, vbmi)
        } else if vbmi {
            gemv_vbmi(w, x, rows, out)
        } else {
            gemv(w, x, rows, out)
        }
    }
}

pub(crate) unsafe fn q4_gemv(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    vbmi: bool,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED` (and passes `vbmi` only where `vbmi_detected`), and the safe
    // `Kernels` method checked the shapes, which is all the code below relies on.
    unsafe {
        if w.tiled {
            tiles::q4_product(w, x, rows, out, None, vbmi)
        } else {
            gemv(w, x, rows, out)
        }
    }
}

pub(crate) unsafe fn q8_gemv(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe {
        if w.tiled {
            tiles::q8_product(w, x, rows, out, None)
        } else {
            gemv(w, x, rows, out)
        }
    }
}

/// Transpose a 16 x 16 matrix of 32-bit values held as 16 row vectors: result i holds dword i of
/// every row, row k in lane k (also the bf16 and int8 attention kernels' key tiles).
///
/// # Safety
/// The CPU has AVX-512 F; inlined into callers that enable it (whatever else they enable).
#[inline(always)]
pub(super) unsafe fn transpose_16x16(rows: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: register shuffles only; the caller's target features include AVX-512 F.
    unsafe {
        // Within each 128-bit lane: pairs of rows interleaved by dword, then by qword, so u[4i + k]
        // holds rows 4i..4i+3 of column 4L + k in its 128-bit lane L.
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        // Gather 128-bit lane L of u[k], u[4 + k], u[8 + k], u[12 + k] into column 4L + k.
        const EVEN_LANES: i32 = 0b10_00_10_00;
        const ODD_LANES: i32 = 0b11_01_11_01;
        let mut columns = [_mm512_setzero_si512(); 16];
        for k in 0..4 {
            let x0 = _mm512_shuffle_i32x4::<EVEN_LANES>(u[k], u[4 + k]);
            let x1 = _mm512_shuffle_i32x4::<ODD_LANES>(u[k], u[4 + k]);
            let y0 = _mm512_shuffle_i32x4::<EVEN_LANES>(u[8 + k], u[12 + k]);
            let y1 = _mm512_shuffle_i32x4::<ODD_LANES>(u[8 + k], u[12 + k]);
            columns[k] = _mm512_shuffle_i32x4::<EVEN_LANES>(x0, y0);
            columns[4 + k] = _mm512_shuffle_i32x4::<EVEN_LANES>(x1, y1);
            columns[8 + k] = _mm512_shuffle_i32x4::<ODD_LANES>(x0, y0);
            columns[12 + k] = _mm512_shuffle_i32x4::<ODD_LANES>(x1, y1);
        }
        columns
    }
}

/// Dwords per group of 128 int8 values: 0..16 hold the evens of the four blocks (block j in
/// 4j..4j+4), 16..32 the odds.
const GROUP_DWORDS: usize = GROUP_LEN / 4;

/// The dword positions of block `j` within a group, in the order the GEMM reads them.
#[inline(always)]
fn block_dword(j: usize, step: usize) -> usize {
    if step < 4 {
        4 * j + step
    } else {
        GROUP_DWORDS / 2 + 4 * j + step - 4
    }
}

/// Bytes of one decoded tile of a matrix with `groups` groups per row: the scratch holds
/// [`GEMM_TILE_SLOTS`] tiles this far apart.
#[inline(always)]
fn tile_slot_bytes(groups: usize) -> usize {
    groups * GEMM_TILE_ROWS * GROUP_LEN
}

/// Scale lanes of one decoded tile, likewise.
#[inline(always)]
fn tile_slot_scales(groups: usize) -> usize {
    groups * GROUP_BLOCKS * GEMM_TILE_ROWS
}

/// Decode rows `first_row..first_row + count` into tile `slot` of the scratch, transposed: for each group
/// and dword position q (four weights of one block), one vector whose lane r holds those four
/// unsigned weights of row r. Scales likewise: per group and block j, lane r = row r's scale.
/// Rows past `count` are zero with scale 0.
///
/// # Safety
/// Rows inside the matrix, `count <= GEMM_TILE_ROWS` (16), `slot < GEMM_TILE_SLOTS`, scratch sized
/// for the matrix's columns.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn decode_tile<W: GroupSource>(
    w: &W,
    first_row: usize,
    count: usize,
    scratch: &mut GemmScratch,
    slot: usize,
    prefetch: Prefetch,
) {
    // SAFETY: the caller upholds this function's contract (rows inside the matrix, `count <=
    // GEMM_TILE_ROWS` (16), `slot < GEMM_TILE_SLOTS`, scratch sized for the matrix's columns),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
        let groups = w.groups();
        let tile = scratch
            .tile
            .as_mut_ptr()
            .add(slot * tile_slot_bytes(groups));
        let tile_scales = scratch
            .tile_scales
            .as_mut_ptr()
            .add(slot * tile_slot_scales(groups));
        for group in 0..groups {
            prefetch.share(group, groups);
            let mut first = [_mm512_setzero_si512(); GEMM_TILE_ROWS];
            let mut second = [_mm512_setzero_si512(); GEMM_TILE_ROWS];
            for r in 0..count {
                (first[r], second[r]) = w.raw_group(first_row + r, group);
            }
            let at = tile.add(group * GEMM_TILE_ROWS * GROUP_LEN);
            // Decoding is byte-wise, so it can follow the transpose: the nibble formats need one
            // transpose for evens and odds together.
            let first = transpose_16x16(first);
            let second = if W::FORMAT == FORMAT_Q8 {
                transpose_16x16(second)
            } else {
                second
            };
            for q in 0..GROUP_DWORDS / 2 {
                let (evens, odds) = W::decode_raw(first[q], second[q]);
                _mm512_storeu_si512(at.add(q * 64).cast(), evens);
                _mm512_storeu_si512(at.add((GROUP_DWORDS / 2 + q) * 64).cast(), odds);
            }
            let columns = w.scale_columns(first_row, count, group);
            for (j, column) in columns.into_iter().enumerate() {
                let to = tile_scales.add((group * GROUP_BLOCKS + j) * GEMM_TILE_ROWS);
                _mm512_storeu_ps(to, column);
            }
        }
    }
}

/// How a micro-kernel applies a block's two scales (weights' and activations') to its integer
/// sums: a const parameter of the kernels, chosen per call by [`scaling`].
///
/// A `vcvtdq2ps` of the sums and a `vfmadd` by the scales' product, formed by a `vmulps`.
pub(super) const SCALE_MULTIPLY: u8 = 0;
/// As [`SCALE_MULTIPLY`], the product formed by adding exponents ([`combined_scale`]).
pub(super) const SCALE_EXPONENT_ADD: u8 = 1;
/// Both scales powers of two: no float multiply at all ([`accumulate`]).
pub(super) const SCALE_SHIFTED_SUM: u8 = 2;

/// Calls `$call!(T, SCALING)`, a caller's macro around one micro-kernel, with the token count
/// `T` among `$counts` that `$count` equals (1 for any other) and the scaling `$scaling` names:
/// the const parameters every micro-kernel takes, matched in one place.
macro_rules! by_tokens_and_scaling {
    ($call:ident, $count:expr, $scaling:expr, [$($n:literal)*]) => {
        match ($count, $scaling) {
            $(($n, SCALE_MULTIPLY) => $call!($n, SCALE_MULTIPLY),
            ($n, SCALE_EXPONENT_ADD) => $call!($n, SCALE_EXPONENT_ADD),
            ($n, _) => $call!($n, SCALE_SHIFTED_SUM),)*
            (_, SCALE_MULTIPLY) => $call!(1, SCALE_MULTIPLY),
            (_, SCALE_EXPONENT_ADD) => $call!(1, SCALE_EXPONENT_ADD),
            (_, _) => $call!(1, SCALE_SHIFTED_SUM),
        }
    };
}
use by_tokens_and_scaling;

/// [`SCALE_SHIFTED_SUM`]'s offset: `bits(w) + bits(a) - SHIFTED_SUM_BIAS` are the bits of
/// 1.5 x 2^23 x the scales' product `2^c`, whose mantissa (2^22) takes an integer sum of
/// magnitude below 2^22 without a carry into the exponent.
const SHIFTED_SUM_BIAS: i32 = (104 << 23) - (1 << 22);

/// Weight scale lanes less the bias `SCALING` adds them with to an activation scale's bits:
/// with one side a power of two (`2^(e - 127)`, MXFP4's weights or split rows' activations)
/// `bits - (127 << 23)` makes the sum the product's bits (0 for the tile's padding lanes, whose
/// scale is 1); with both, `bits - SHIFTED_SUM_BIAS` (see [`accumulate`]). Unused when the
/// kernel multiplies; the compiler drops it then.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
fn scale_offsets<const SCALING: u8>(w_scales: __m512) -> __m512i {
    let bias = if SCALING == SCALE_SHIFTED_SUM {
        SHIFTED_SUM_BIAS
    } else {
        127 << 23
    };
    _mm512_sub_epi32(_mm512_castps_si512(w_scales), _mm512_set1_epi32(bias))
}

/// `acc + sums x (weight scales x the activation scale at a_scale)`, one rounding, in the way
/// `SCALING` names. With [`SCALE_SHIFTED_SUM`] the product of the scales is `2^c` and `magic`
/// the bits of `1.5 x 2^(23 + c)`: adding a sum `s` (`|s| < 2^22`) to those bits gives
/// `1.5 x 2^(23 + c) + s x 2^c`, and subtracting `magic` leaves `s x 2^c` exactly (Sterbenz), so
/// the final add rounds once, as the `vfmadd` does: the same bits, from a `vpaddd`, a `vsubps`
/// and a `vaddps`, none of which shares the pipes of `vpdpbusd` on Zen 4 (the `vfmadd` does: see
/// [`combined_scale`]). [`shifted_sum_mode`] proves every `magic` and product a normal float.
///
/// # Safety
/// `a_scale` is readable; the CPU has the module's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn accumulate<const SCALING: u8>(
    acc: __m512,
    sums: __m512i,
    w_scales: __m512,
    w_offsets: __m512i,
    a_scale: *const f32,
) -> __m512 {
    // SAFETY: the caller upholds the contract (`a_scale` readable, the module's features).
    unsafe {
        if SCALING == SCALE_SHIFTED_SUM {
            let magic =
                _mm512_add_epi32(_mm512_set1_epi32(a_scale.cast::<i32>().read()), w_offsets);
            let shifted = _mm512_castsi512_ps(_mm512_add_epi32(sums, magic));
            _mm512_add_ps(acc, _mm512_sub_ps(shifted, _mm512_castsi512_ps(magic)))
        } else if SCALING == SCALE_EXPONENT_ADD {
            let scale = combined_scale::<true>(w_scales, w_offsets, a_scale);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc)
        } else {
            let scale = combined_scale::<false>(w_scales, w_offsets, a_scale);
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc)
        }
    }
}

/// A block's weight scales times one token's activation scale at `a_scale`.
///
/// Without `EXP` a `vmulps`. With `EXP` (one side's scales powers of two: MXFP4's weights or
/// split rows' activations, and a tile for which [`exponent_mode`] proved every product a
/// normal float) the same bits from an integer add of the two scales' bits less the bias. On Zen 4 and Zen 5 `vmulps` and `vfmadd`
/// issue on the two pipes that run `vpdpbusd`, so with the convert (another pipe) a block's 8
/// `vpdpbusd` per token and tile shared their pipes with 2 float operations: at most 80% of the
/// `vpdpbusd` peak (measured on Zen 4: 8 `vpdpbusd` + `vmulps` + `vfmadd` ran at 80%, with a
/// `vpaddd` or `vcvtdq2ps` instead at 100%). The add leaves one (89%).
///
/// # Safety
/// `a_scale` is readable; the CPU has the module's features.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn combined_scale<const EXP: bool>(
    w_scales: __m512,
    w_exponents: __m512i,
    a_scale: *const f32,
) -> __m512 {
    // SAFETY: the caller upholds the contract (`a_scale` readable, the module's features).
    unsafe {
        if EXP {
            _mm512_castsi512_ps(_mm512_add_epi32(
                _mm512_set1_epi32(a_scale.cast::<i32>().read()),
                w_exponents,
            ))
        } else {
            _mm512_mul_ps(w_scales, _mm512_set1_ps(*a_scale))
        }
    }
}

/// How a call applies its scales (see [`SCALE_MULTIPLY`]): without a multiply where both
/// sides' scales are powers of two and [`shifted_sum_mode`] holds, by adding exponents where one
/// side's are and [`exponent_mode`] holds, else by multiplying. `weights` are the weight scales'
/// biased exponents; every choice gives the same bits.
fn scaling(
    activations: Option<ScaleExponents>,
    weights_powers_of_two: bool,
    weights: Option<(u32, u32)>,
) -> u8 {
    match activations {
        Some(a)
            if weights_powers_of_two && a.powers_of_two && shifted_sum_mode(a.range, weights) =>
        {
            SCALE_SHIFTED_SUM
        }
        Some(a)
            if (weights_powers_of_two || a.powers_of_two)
                && exponent_mode(Some(a.range), weights) =>
        {
            SCALE_EXPONENT_ADD
        }
        _ => SCALE_MULTIPLY,
    }
}

/// Whether, with both sides' scales powers of two, every product `2^c` of an activation scale
/// and a weight scale is a normal float and so is [`accumulate`]'s `1.5 x 2^(23 + c)`: biased
/// `c` in 1..=231.
fn shifted_sum_mode(activations: (u32, u32), weights: Option<(u32, u32)>) -> bool {
    match weights {
        Some((w_low, w_high)) => {
            let (a_low, a_high) = activations;
            w_low >= 1 && a_low + w_low >= 128 && a_high + w_high <= 127 + 231
        }
        None => false,
    }
}

/// Whether every product of an activation scale (biased exponents `activations`) and a weight
/// scale (biased exponents `weights`: E8M0 bytes, or the f32 exponents of Q8's f16 scales) is
/// a normal float, so adding exponents gives `vmulps`'s bits. A weight scale of 0 must be
/// multiplied, not added.
fn exponent_mode(activations: Option<(u32, u32)>, weights: Option<(u32, u32)>) -> bool {
    match (activations, weights) {
        (Some((a_low, a_high)), Some((w_low, w_high))) => {
            w_low >= 1 && a_low + w_low >= 128 && a_high + w_high <= 381
        }
        _ => false,
    }
}

/// Sixteen decoded tile rows x `T` tokens. Each of a block's eight dword positions is one weight
/// vector (16 rows) times that token's four activations broadcast, so a block's integer sums
/// for 16 rows build up in one register without any lane shuffling, and the float convert,
/// scale and FMA run once per (block, token) for all 16 rows.
///
/// # Safety
/// The tile was decoded into `scratch` for `groups` groups; tokens `first_token..+T` exist in
/// `x`; `out[t * stride + r]` is in bounds for t < T, r < `rows`; `rows <= 16`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tile<const T: usize, const SCALING: u8>(
    scratch: &GemmScratch,
    groups: usize,
    x: &Q8Activations,
    first_token: usize,
    correction_lane: usize,
    factor: f32,
    out: *mut f32,
    stride: usize,
    rows: usize,
    prefetch: Prefetch,
) {
    // SAFETY: the caller upholds this function's contract (The tile was decoded into `scratch` for
    // `groups` groups; tokens `first_token..+T` exist in `x`; `out[t * stride + r]` is in bounds
    // for t < T, r < `rows`; `rows <= 16`), which is what every pointer access and target-feature
    // call below relies on.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        let tile = scratch.tile.as_ptr();
        let tile_scales = scratch.tile_scales.as_ptr();
        let token_quants = x.quants.as_ptr().add(first_token * x.groups * GROUP_LEN);
        let token_lanes = first_token * x.groups * GROUP_LANES;
        let corrections = x.corrections.as_ptr().add(token_lanes);
        let act_scales = x.scale_lanes.as_ptr().add(token_lanes);
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        for group in 0..groups {
            prefetch.share(group, groups);
            let weights = tile.add(group * GEMM_TILE_ROWS * GROUP_LEN);
            let quants = token_quants.add(group * GROUP_LEN);
            let lanes = group * GROUP_LANES;
            for j in 0..GROUP_BLOCKS {
                let mut sums: [__m512i; T] = std::array::from_fn(|t| {
                    _mm512_set1_epi32(
                        *corrections.add(t * lane_stride + lanes + 4 * j + correction_lane),
                    )
                });
                for step in 0..8 {
                    let q = block_dword(j, step);
                    let w = _mm512_loadu_si512(weights.add(q * 64).cast());
                    for (t, sum) in sums.iter_mut().enumerate() {
                        let a = quants
                            .add(t * quant_stride + 4 * q)
                            .cast::<i32>()
                            .read_unaligned();
                        *sum = _mm512_dpbusd_epi32(*sum, w, _mm512_set1_epi32(a));
                    }
                }
                let w_scales =
                    _mm512_loadu_ps(tile_scales.add((group * GROUP_BLOCKS + j) * GEMM_TILE_ROWS));
                let w_offsets = scale_offsets::<SCALING>(w_scales);
                for (t, (acc_t, sum)) in acc.iter_mut().zip(sums).enumerate() {
                    let a_scale = act_scales.add(t * lane_stride + lanes + 4 * j);
                    *acc_t = accumulate::<SCALING>(*acc_t, sum, w_scales, w_offsets, a_scale);
                }
            }
        }
        let mask = ((1u32 << rows) - 1) as __mmask16;
        for (t, acc_t) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(
                out.add(t * stride),
                mask,
                _mm512_mul_ps(*acc_t, _mm512_set1_ps(factor)),
            );
        }
    }
}

/// Two decoded tiles (32 rows) x `T` tokens: each broadcast activation dword feeds two
/// `vpdpbusd` (one per tile), so a step loads two weight vectors and `T` dwords for `2 T`
/// products, and the `2 T` independent sums cover the instruction's latency on every core. With
/// `T` = [`GEMM_PAIR_TOKENS`] the sums and accumulators take 24 of the 32 zmm registers.
///
/// # Safety
/// Both tiles were decoded into `scratch` (slots 0 and 1) for `groups` groups; tokens
/// `first_token..+T` exist in `x`; `out[t * stride + r]` is in bounds for t < T, r < `rows`;
/// `16 < rows <= 32`. `prefetch` as in [`gemm_tile`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_tile_pair<const T: usize, const SCALING: u8>(
    scratch: &GemmScratch,
    groups: usize,
    x: &Q8Activations,
    first_token: usize,
    correction_lane: usize,
    factor: f32,
    out: *mut f32,
    stride: usize,
    rows: usize,
    prefetch: Prefetch,
) {
    // SAFETY: the caller upholds this function's contract (both tiles decoded for `groups`
    // groups, tokens `first_token..+T` in `x`, `out[t * stride + r]` in bounds for t < T,
    // r < rows <= 32), which is what every pointer access below relies on.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); T]; 2];
        let tile = scratch.tile.as_ptr();
        let second = tile_slot_bytes(groups);
        let tile_scales = scratch.tile_scales.as_ptr();
        let second_scales = tile_slot_scales(groups);
        let token_quants = x.quants.as_ptr().add(first_token * x.groups * GROUP_LEN);
        let token_lanes = first_token * x.groups * GROUP_LANES;
        let corrections = x.corrections.as_ptr().add(token_lanes);
        let act_scales = x.scale_lanes.as_ptr().add(token_lanes);
        let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
        for group in 0..groups {
            prefetch.share(group, groups);
            let weights = tile.add(group * GEMM_TILE_ROWS * GROUP_LEN);
            let quants = token_quants.add(group * GROUP_LEN);
            let lanes = group * GROUP_LANES;
            for j in 0..GROUP_BLOCKS {
                let start: [__m512i; T] = std::array::from_fn(|t| {
                    _mm512_set1_epi32(
                        *corrections.add(t * lane_stride + lanes + 4 * j + correction_lane),
                    )
                });
                let mut sums = [start, start];
                for step in 0..8 {
                    let q = block_dword(j, step);
                    let w0 = _mm512_loadu_si512(weights.add(q * 64).cast());
                    let w1 = _mm512_loadu_si512(weights.add(second + q * 64).cast());
                    let [sums0, sums1] = &mut sums;
                    for (t, (s0, s1)) in sums0.iter_mut().zip(sums1.iter_mut()).enumerate() {
                        let a = _mm512_set1_epi32(
                            quants
                                .add(t * quant_stride + 4 * q)
                                .cast::<i32>()
                                .read_unaligned(),
                        );
                        *s0 = _mm512_dpbusd_epi32(*s0, w0, a);
                        *s1 = _mm512_dpbusd_epi32(*s1, w1, a);
                    }
                }
                let at = (group * GROUP_BLOCKS + j) * GEMM_TILE_ROWS;
                let w_scales = [
                    _mm512_loadu_ps(tile_scales.add(at)),
                    _mm512_loadu_ps(tile_scales.add(second_scales + at)),
                ];
                let w_offsets = [
                    scale_offsets::<SCALING>(w_scales[0]),
                    scale_offsets::<SCALING>(w_scales[1]),
                ];
                for t in 0..T {
                    let a_scale = act_scales.add(t * lane_stride + lanes + 4 * j);
                    for half in 0..2 {
                        acc[half][t] = accumulate::<SCALING>(
                            acc[half][t],
                            sums[half][t],
                            w_scales[half],
                            w_offsets[half],
                            a_scale,
                        );
                    }
                }
            }
        }
        let factor = _mm512_set1_ps(factor);
        let tail = ((1u32 << (rows - GEMM_TILE_ROWS)) - 1) as __mmask16;
        for (t, (a0, a1)) in acc[0].iter().zip(&acc[1]).enumerate() {
            let row_start = out.add(t * stride);
            _mm512_storeu_ps(row_start, _mm512_mul_ps(*a0, factor));
            _mm512_mask_storeu_ps(
                row_start.add(GEMM_TILE_ROWS),
                tail,
                _mm512_mul_ps(*a1, factor),
            );
        }
    }
}

/// Bytes a tile decode or a GEMM micro-kernel call prefetches while it works: its share of
/// `spans` (the next pair of tiles) is part `batch` of `batches`, spread over its groups.
/// Spreading the lines over all the work on a pair, not only its first token batch, keeps the
/// requests below what the core can have in flight (issued in one short batch, M = 8 read half
/// as fast as M = 6 or 12) and memory busy while the tiles are decoded.
#[derive(Clone, Copy)]
struct Prefetch {
    spans: [(*const u8, usize); 2],
    batch: usize,
    batches: usize,
}

impl Prefetch {
    const NOTHING: Prefetch = Prefetch {
        spans: [(std::ptr::null(), 0); 2],
        batch: 0,
        batches: 1,
    };

    /// Prefetches this call's share of the lines for `group` of `groups`.
    #[inline(always)]
    fn share(&self, group: usize, groups: usize) {
        prefetch_share(
            &self.spans,
            self.batch * groups + group,
            self.batches * groups,
        );
    }
}

/// One or two decoded tiles in the GEMM scratch and what their micro-kernels need besides the
/// tokens: the row-order GEMM and the tile-layout GEMM ([`tiles`]) share these token loops.
struct DecodedTiles<'a> {
    scratch: &'a GemmScratch,
    groups: usize,
    lane: usize,
    factor: f32,
    /// How the scales are applied ([`SCALE_MULTIPLY`] and the others).
    scaling: u8,
}

impl DecodedTiles<'_> {
    /// Every token of `x` against the two tiles in slots 0 and 1 (`count` rows, 17 to 32), in
    /// batches of `batch`; batch i prefetches `part(GEMM_TILE_SLOTS + i)`.
    ///
    /// # Safety
    /// As [`gemm_tile_pair`] for every batch: `out_column[t * stride + r]` in bounds for every
    /// token t of `x` and r < `count`; the CPU has the module's features.
    #[inline(always)]
    unsafe fn pair_tokens(
        &self,
        x: &Q8Activations,
        batch: usize,
        out_column: *mut f32,
        stride: usize,
        count: usize,
        part: impl Fn(usize) -> Prefetch,
    ) {
        let Self {
            scratch: s,
            groups,
            lane,
            factor,
            scaling,
        } = *self;
        let tokens = x.rows();
        let mut token = 0;
        while token < tokens {
            let t_count = (tokens - token).min(batch);
            // SAFETY: the caller upholds the contract for every token batch.
            unsafe {
                let o = out_column.add(token * stride);
                let p = part(GEMM_TILE_SLOTS + token / batch);
                macro_rules! pair {
                    ($n:literal, $scaling:ident) => {
                        gemm_tile_pair::<$n, $scaling>(
                            s, groups, x, token, lane, factor, o, stride, count, p,
                        )
                    };
                }
                by_tokens_and_scaling!(pair, t_count, scaling, [6 5 4 3 2]);
            }
            token += t_count;
        }
    }

    /// Every token of `x` against the tile in slot 0 (`count` rows, at most 16), in even
    /// batches of at most [`GEMM_TOKENS`], prefetching nothing.
    ///
    /// # Safety
    /// As [`gemm_tile`] for every batch.
    #[inline(always)]
    unsafe fn single_tokens(
        &self,
        x: &Q8Activations,
        out_column: *mut f32,
        stride: usize,
        count: usize,
    ) {
        let Self {
            scratch: s,
            groups,
            lane,
            factor,
            scaling,
        } = *self;
        let tokens = x.rows();
        let batch = even_batch(tokens, GEMM_TOKENS);
        let p = Prefetch::NOTHING;
        let mut token = 0;
        while token < tokens {
            let t_count = (tokens - token).min(batch);
            // SAFETY: the caller upholds the contract for every token batch.
            unsafe {
                let o = out_column.add(token * stride);
                macro_rules! tile {
                    ($n:literal, $scaling:ident) => {
                        gemm_tile::<$n, $scaling>(
                            s, groups, x, token, lane, factor, o, stride, count, p,
                        )
                    };
                }
                by_tokens_and_scaling!(tile, t_count, scaling, [8 7 6 5 4 3 2]);
            }
            token += t_count;
        }
    }
}

/// Tokens per call of [`gemm_tile_pair`].
const GEMM_PAIR_TOKENS: usize = 6;

/// Tokens per micro-kernel call: enough independent `vpdpbusd` chains to hide its latency, with
/// the sums and accumulators (2 x 8 registers) well inside the 32 zmm registers.
const GEMM_TOKENS: usize = 8;

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
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // shapes and scratch size were checked by `Kernels` (`out.len() == x.rows() * rows.len()`)),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
        if x.rows() == 1 {
            return gemv(w, x, rows, out);
        }
        let (lane, factor) = (correction_lane(W::FORMAT), format_factor(W::FORMAT));
        let groups = w.groups();
        let stride = rows.len();
        let tokens = x.rows();
        let act_exponents = x.scale_exponents();
        // The weights come from memory once per call, so while one pair of tiles is multiplied
        // the next pair's bytes are prefetched: without it, with few tokens per expert (a short
        // prompt) the tile decode waited on every cache miss and 2 threads read 7 GB/s.
        let pair_rows = GEMM_TILE_SLOTS * GEMM_TILE_ROWS;
        let spans_from = |start: usize| w.byte_spans(start..(start + pair_rows).min(rows.end));
        // The first pair has nothing to overlap with: ask for all of it at once.
        prefetch_share(&spans_from(rows.start), 0, 1);
        let mut tile_start = rows.start;
        while tile_start < rows.end {
            let remaining = rows.end - tile_start;
            let out_column = out.as_mut_ptr().add(tile_start - rows.start);
            let next = spans_from((tile_start + pair_rows).min(rows.end));
            let count = remaining.min(pair_rows);
            // Power-of-two weight scales (MXFP4) or activation scales (split rows) are applied
            // by adding exponents, or with both by shifted sums, where every product stays a
            // normal float: the same bits, one or two float operations fewer per block.
            let scaling = scaling(
                act_exponents,
                W::FORMAT == FORMAT_MXFP4,
                w.exponent_range(tile_start..tile_start + count),
            );
            if remaining > GEMM_TILE_ROWS {
                // Two tiles at once: 17 to 32 rows.
                // Even batches: a short last batch would leave too few independent sums to
                // cover the `vpdpbusd` latency (7 tokens run as 4 + 3, not 6 + 1).
                let batch = even_batch(tokens, GEMM_PAIR_TOKENS);
                // The next pair's lines are spread over both decodes and every token batch.
                let parts = GEMM_TILE_SLOTS + tokens.div_ceil(batch);
                let part = |index: usize| Prefetch {
                    spans: next,
                    batch: index,
                    batches: parts,
                };
                decode_tile(w, tile_start, GEMM_TILE_ROWS, scratch, 0, part(0));
                decode_tile(
                    w,
                    tile_start + GEMM_TILE_ROWS,
                    count - GEMM_TILE_ROWS,
                    scratch,
                    1,
                    part(1),
                );
                let tiles = DecodedTiles {
                    scratch,
                    groups,
                    lane,
                    factor,
                    scaling,
                };
                tiles.pair_tokens(x, batch, out_column, stride, count, part);
                tile_start += count;
                continue;
            }
            decode_tile(w, tile_start, count, scratch, 0, Prefetch::NOTHING);
            // A single tile is a call's last: nothing follows it to prefetch.
            let tiles = DecodedTiles {
                scratch,
                groups,
                lane,
                factor,
                scaling,
            };
            tiles.single_tokens(x, out_column, stride, count);
            tile_start += count;
        }
    }
}

pub(crate) unsafe fn mxfp4_gemm(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
    vbmi: bool,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe {
        if w.layout == Mxfp4Layout::Tiles {
            tiles::mxfp4_product(w, x, rows, out, Some(scratch), vbmi)
        } else {
            gemm(w, x, rows, out, scratch)
        }
    }
}

pub(crate) unsafe fn q4_gemm(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
    vbmi: bool,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED` (and passes `vbmi` only where `vbmi_detected`), and the safe
    // `Kernels` method checked the shapes, which is all the code below relies on.
    unsafe {
        if w.tiled {
            tiles::q4_product(w, x, rows, out, Some(scratch), vbmi)
        } else {
            gemm(w, x, rows, out, scratch)
        }
    }
}

pub(crate) unsafe fn q8_gemm(
    w: &Q8Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe {
        if w.tiled {
            tiles::q8_product(w, x, rows, out, Some(scratch))
        } else {
            gemm(w, x, rows, out, scratch)
        }
    }
}

/// Sixteen bf16 weights at `ptr` (only the first `len` when `len < 16`) widened to f32.
///
/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_bf16(ptr: *const u16, len: usize) -> __m512 {
    // SAFETY: the caller upholds this function's contract (`ptr..ptr + min(len, 16)` is readable),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
        let bits = if len >= 16 {
            _mm256_loadu_si256(ptr.cast())
        } else {
            _mm256_maskz_loadu_epi16(((1u32 << len) - 1) as u16, ptr.cast())
        };
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(bits)))
    }
}

/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_f32(ptr: *const f32, len: usize) -> __m512 {
    // SAFETY: the caller upholds this function's contract (`ptr..ptr + min(len, 16)` is readable),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
        if len >= 16 {
            _mm512_loadu_ps(ptr)
        } else {
            _mm512_maskz_loadu_ps(((1u32 << len) - 1) as u16, ptr)
        }
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
    // SAFETY: the caller upholds this function's contract (Rows `row..row + R` and tokens
    // `token..token + T` exist; `out[t * stride + i]` in bounds), which is what every pointer
    // access and target-feature call below relies on.
    unsafe {
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
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // shapes were checked by `Kernels`), which is what every pointer access and target-feature
    // call below relies on.
    unsafe {
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
}

/// # Safety
/// The CPU has the module's features; `a.len() == b.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `a.len() == b.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `x.len() == y.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// Sixteen f16 values at `ptr` (only `len` when `len < 16`) widened to f32.
///
/// # Safety
/// `ptr..ptr + min(len, 16)` is readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn load_f16(ptr: *const f16, len: usize) -> __m512 {
    // SAFETY: the caller upholds this function's contract (`ptr..ptr + min(len, 16)` is readable),
    // which is what every pointer access and target-feature call below relies on.
    unsafe {
        let bits = if len >= 16 {
            _mm256_loadu_si256(ptr.cast())
        } else {
            _mm256_maskz_loadu_epi16(((1u32 << len) - 1) as u16, ptr.cast())
        };
        _mm512_cvtph_ps(bits)
    }
}

/// # Safety
/// The CPU has the module's features; `a.len() == b.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `a.len() == b.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(alpha: f32, x: &[f16], y: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `x.len() == y.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `src.len() == dst.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `src.len() == dst.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
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
}

/// The `vpdpbusd` peak: [`super::PROBE_GROUPS`] independent accumulator chains (enough to hide
/// the instruction's latency on every core so far), no memory traffic.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub(crate) fn int8_mac_probe(rounds: usize) -> i64 {
    use super::{probe_operands, PROBE_GROUPS};
    // Three unsigned and five signed operand vectors: with the sixteen chains, 24 registers.
    let unsigned: [__m512i; 3] =
        std::array::from_fn(|g| _mm512_set1_epi8(probe_operands(g).0 as i8));
    let signed: [__m512i; 5] = std::array::from_fn(|g| _mm512_set1_epi8(probe_operands(g).1));
    let mut acc = [_mm512_setzero_si512(); PROBE_GROUPS];
    for _ in 0..rounds {
        for (g, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_dpbusd_epi32(*acc, unsigned[g % 3], signed[g % 5]);
        }
    }
    let mut total = 0i64;
    for acc in acc {
        let mut lanes = [0i32; 16];
        // SAFETY: `lanes` is 64 writable bytes; storeu has no alignment requirement.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), acc) };
        total += lanes.iter().map(|&l| l as i64).sum::<i64>();
    }
    total
}
