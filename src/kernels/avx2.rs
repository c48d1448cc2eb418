//! AVX2 kernels: `vpmaddubsw` + `vpmaddwd` for the integer formats, 8-wide FMA for f32/bf16/f16.
//!
//! Works on half groups ("pairs" of two blocks, 32 bytes of unsigned weights per parity). MXFP4 and
//! Q4 weights are small unsigned bytes (at most 24), so two `vpmaddubsw` results add in int16
//! without saturating; Q8 weights move their sign onto the activation (`vpsignb`) because
//! |q| x 127 x 2 would not fit after adding.
//!
//! Every `pub(crate) unsafe fn` here requires that the CPU supports all of [`REQUIRED`] (the
//! dispatcher guarantees it) and that the caller checked the shapes (the safe methods of
//! `Kernels` do). Given both, every pointer read below stays inside the slices it came from.

use std::arch::x86_64::*;
use std::ops::Range;

use half::f16;

use super::formats::{
    ByteSpans, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix, BLOCK_LEN, GROUP_BLOCKS,
    GROUP_LANES, GROUP_LEN, MXFP4_OFFSET, Q4_OFFSET,
};
use super::{GemmScratch, GEMM_TILE_ROWS};

pub(super) mod tiles;

const REQUIRED: [&str; 3] = ["avx2", "fma", "f16c"];

pub(crate) fn missing_features() -> Vec<&'static str> {
    let detected = [
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

/// How this CPU runs a 256-bit `vpdpbusd`, if it does: AVX-VNNI, else AVX-512 VNNI with VL.
pub(crate) fn vnni_encoding() -> Option<super::Avx2Dot> {
    if is_x86_feature_detected!("avxvnni") {
        Some(super::Avx2Dot::VnniVex)
    } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        Some(super::Avx2Dot::VnniEvex)
    } else {
        None
    }
}

/// Doubled FP4 values plus 12, so they are unsigned bytes for `vpmaddubsw`.
const MXFP4_UNSIGNED: [i8; 16] = [12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0];

const PAIR_LEN: usize = GROUP_LEN / 2;
const PAIR_LANES: usize = GROUP_LANES / 2;

/// Eight lanes of 2^(s-127) from two E8M0 bytes (lanes 4j..4j+3 from byte j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn e8m0_lanes(bytes: u32) -> __m256 {
    let spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    let exponents = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128(bytes as i32), spread));
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponents))
}

/// Eight lanes from two f16 scales (lanes 4j..4j+3 from scale j).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_lanes(bits: u32) -> __m256 {
    let two = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), spread)
}

/// Activation operands of one pair of blocks of one token.
#[derive(Clone, Copy)]
struct ActPair {
    evens: __m256i,
    odds: __m256i,
    correction: __m256i,
    scales: __m256,
}

impl ActPair {
    /// # Safety
    /// `group < x.groups()`, `pair < 2`, `token < x.rows()`; the CPU has the module's features.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(
        x: &Q8Activations,
        token: usize,
        group: usize,
        pair: usize,
        offset: i32,
    ) -> Self {
        // SAFETY: the caller upholds this function's contract (`group < x.groups()`, `pair < 2`,
        // `token < x.rows()`; the CPU has the module's features), which is what every pointer
        // access and target-feature call below relies on.
        unsafe {
            let quants = x
                .row_quants(token)
                .as_ptr()
                .add(group * GROUP_LEN + pair * PAIR_LEN / 2);
            let lanes = group * GROUP_LANES + pair * PAIR_LANES;
            let sums = _mm256_loadu_si256(x.row_sum_lanes(token).as_ptr().add(lanes).cast());
            Self {
                evens: _mm256_loadu_si256(quants.cast()),
                odds: _mm256_loadu_si256(quants.add(GROUP_LEN / 2).cast()),
                correction: _mm256_mullo_epi32(sums, _mm256_set1_epi32(-offset)),
                scales: _mm256_loadu_ps(x.row_scale_lanes(token).as_ptr().add(lanes)),
            }
        }
    }
}

/// One pair's contribution. `signed`: weights are int8 (Q8); otherwise small unsigned bytes
/// offset so the activation correction applies.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_fma(
    signed: bool,
    acc: __m256,
    w_evens: __m256i,
    w_odds: __m256i,
    w_scales: __m256,
    a: &ActPair,
) -> __m256 {
    let ones = _mm256_set1_epi16(1);
    let sums = if signed {
        let evens =
            _mm256_maddubs_epi16(_mm256_abs_epi8(w_evens), _mm256_sign_epi8(a.evens, w_evens));
        let odds = _mm256_maddubs_epi16(_mm256_abs_epi8(w_odds), _mm256_sign_epi8(a.odds, w_odds));
        _mm256_add_epi32(
            _mm256_madd_epi16(evens, ones),
            _mm256_madd_epi16(odds, ones),
        )
    } else {
        let both = _mm256_add_epi16(
            _mm256_maddubs_epi16(w_evens, a.evens),
            _mm256_maddubs_epi16(w_odds, a.odds),
        );
        _mm256_add_epi32(_mm256_madd_epi16(both, ones), a.correction)
    };
    _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(sums),
        _mm256_mul_ps(w_scales, a.scales),
        acc,
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn split_nibbles(bytes: __m256i, mxfp4: bool) -> (__m256i, __m256i) {
    let low = _mm256_set1_epi8(0x0F);
    let evens = _mm256_and_si256(bytes, low);
    let odds = _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), low);
    if mxfp4 {
        // SAFETY: the table is 16 bytes; loadu has no alignment requirement.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(MXFP4_UNSIGNED.as_ptr().cast()) });
        (
            _mm256_shuffle_epi8(table, evens),
            _mm256_shuffle_epi8(table, odds),
        )
    } else {
        (evens, odds)
    }
}

/// A matrix whose pairs of blocks decode to weights (evens, odds) and scale lanes.
trait PairSource: ByteSpans {
    /// Weights are signed int8 (use the sign trick) rather than offset unsigned bytes.
    const SIGNED: bool;
    /// The GEMV prefetches the next rows into L2 only (see [`prefetch_share_into`]).
    const PREFETCH_L2: bool;
    const OFFSET: i32;
    const FACTOR: f32;
    fn groups(&self) -> usize;
    /// `None` when the pair lies past the row's last block (MXFP4 rows end mid-group).
    ///
    /// # Safety
    /// `row` inside the matrix, `group < groups()`, `pair < 2`; the CPU has the module's features.
    unsafe fn load_pair(
        &self,
        row: usize,
        group: usize,
        pair: usize,
    ) -> Option<(__m256i, __m256i, __m256)>;
}

impl PairSource for Mxfp4Matrix<'_> {
    const PREFETCH_L2: bool = false;
    const SIGNED: bool = false;
    const OFFSET: i32 = MXFP4_OFFSET;
    const FACTOR: f32 = 0.5;
    fn groups(&self) -> usize {
        self.cols.div_ceil(GROUP_LEN)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_pair(
        &self,
        row: usize,
        group: usize,
        pair: usize,
    ) -> Option<(__m256i, __m256i, __m256)> {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe {
            let blocks_per_row = self.cols / BLOCK_LEN;
            let first_block = group * GROUP_BLOCKS + pair * 2;
            if first_block >= blocks_per_row {
                return None;
            }
            let bytes = self
                .blocks
                .as_ptr()
                .add(row * (self.cols / 2) + first_block * BLOCK_LEN / 2);
            let scales = self.scales.as_ptr().add(row * blocks_per_row + first_block);
            let (nibbles, scale_bytes) = if first_block + 1 < blocks_per_row {
                (
                    _mm256_loadu_si256(bytes.cast()),
                    scales.cast::<u16>().read_unaligned() as u32,
                )
            } else {
                // The row's last block: read only its 16 bytes; the zero upper half meets zero padding.
                (
                    _mm256_zextsi128_si256(_mm_loadu_si128(bytes.cast())),
                    *scales as u32,
                )
            };
            let (evens, odds) = split_nibbles(nibbles, true);
            Some((evens, odds, e8m0_lanes(scale_bytes)))
        }
    }
}

impl PairSource for Q4Matrix {
    const PREFETCH_L2: bool = false;
    const SIGNED: bool = false;
    const OFFSET: i32 = Q4_OFFSET;
    const FACTOR: f32 = 1.0;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_pair(
        &self,
        row: usize,
        group: usize,
        pair: usize,
    ) -> Option<(__m256i, __m256i, __m256)> {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe {
            let nibbles = _mm256_loadu_si256(
                self.row_nibbles(row)
                    .as_ptr()
                    .add(group * GROUP_LEN / 2 + pair * 32)
                    .cast(),
            );
            let scale_bits = self
                .row_scales(row)
                .as_ptr()
                .add(group * GROUP_BLOCKS + pair * 2)
                .cast::<u32>()
                .read_unaligned();
            let (evens, odds) = split_nibbles(nibbles, false);
            Some((evens, odds, f16_lanes(scale_bits)))
        }
    }
}

impl PairSource for Q8Matrix {
    const PREFETCH_L2: bool = true;
    const SIGNED: bool = true;
    const OFFSET: i32 = 0;
    const FACTOR: f32 = 1.0;
    fn groups(&self) -> usize {
        self.groups
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_pair(
        &self,
        row: usize,
        group: usize,
        pair: usize,
    ) -> Option<(__m256i, __m256i, __m256)> {
        // SAFETY: the caller upholds the trait's contract for this method (row and group inside the
        // matrix; the CPU has this module's features), so every load below stays inside the row.
        unsafe {
            let quants = self
                .row_quants(row)
                .as_ptr()
                .add(group * GROUP_LEN + pair * PAIR_LEN / 2);
            let evens = _mm256_loadu_si256(quants.cast());
            let odds = _mm256_loadu_si256(quants.add(GROUP_LEN / 2).cast());
            let scale_bits = self
                .row_scales(row)
                .as_ptr()
                .add(group * GROUP_BLOCKS + pair * 2)
                .cast::<u32>()
                .read_unaligned();
            Some((evens, odds, f16_lanes(scale_bits)))
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce_add(v: __m256) -> f32 {
    let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let dual = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
    _mm_cvtss_f32(_mm_add_ss(dual, _mm_movehdup_ps(dual)))
}

/// Prefetch the share of `spans` that belongs to `group` of `groups`. Spreading the next rows'
/// lines over the current rows' loop keeps memory busy across the jump from one set of short rows
/// (1.5 KB each) to the next, which the hardware prefetcher alone does not (on the AVX-512 path
/// MXFP4 GEMV went from 11 to 35 GB/s with it).
#[inline]
pub(super) fn prefetch_share(spans: &[(*const u8, usize); 2], group: usize, groups: usize) {
    prefetch_share_into::<false>(spans, group, groups)
}

/// [`prefetch_share`] into L1 (`prefetcht0`) or, with `L2`, into L2 only (`prefetcht1`).
///
/// Why L2 for the GEMVs of large rows (Q8): a `prefetcht0` holds one of the core's few L1 miss
/// buffers until its line arrives, so the lines in flight, and with them one core's streaming
/// rate, are capped by that count. Into L2 the requests queue in L2's larger miss queue and the
/// demand loads then hit L2. On a Zen 4 guest (family 25 model 17) the Q8 GEMV for a token and
/// its split remainder went from 14-18 to 24 GB/s on one thread and from 29-35 to 47-49 GB/s on
/// two (a plain load loop: 32 / 62); Intel cores likewise have more L2 miss slots (the super
/// queue) than L1 fill buffers, and on Zen 5 the L2 hit costs nothing the out-of-order window
/// does not hide at the GEMV's rate. The AVX-512 MXFP4 and Q4 GEMVs prefetch into L2 as well
/// (same Zen 4 guest, `bench --kernels`, two A/B rounds each: MXFP4 GEMV on two threads at M = 1
/// 3.5-4.5 ms against 7.4-7.7 ms, Q4 at M = 2 5.0-5.2 against 5.4-8.0 ms); this file's AVX2
/// MXFP4 and Q4 GEMVs keep `prefetcht0`: with their lower compute rate per byte the two
/// measured the same or worse into L2.
#[inline]
pub(super) fn prefetch_share_into<const L2: bool>(
    spans: &[(*const u8, usize); 2],
    group: usize,
    groups: usize,
) {
    prefetch_share_capped::<L2>(spans, group, groups, usize::MAX)
}

/// [`prefetch_share_into`] asking for at most the first `most` bytes of each span's share: for
/// a loop bound by the core, where every line in flight holds one of its few L1 miss buffers
/// and the hardware prefetchers fetch the rest (see `amx::tile_product`).
#[inline]
pub(super) fn prefetch_share_capped<const L2: bool>(
    spans: &[(*const u8, usize); 2],
    group: usize,
    groups: usize,
    most: usize,
) {
    for &(start, len) in spans {
        let share = len.div_ceil(groups);
        let mut offset = group * share;
        let end = ((group + 1) * share)
            .min(len)
            .min(offset.saturating_add(most));
        while offset < end {
            let line = start.wrapping_add(offset).cast();
            // SAFETY: a prefetch is a hint that never faults, SSE is part of the x86-64 baseline,
            // and wrapping_add makes no claim that the address is inside an allocation.
            unsafe {
                if L2 {
                    _mm_prefetch::<_MM_HINT_T1>(line)
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(line)
                }
            };
            offset += 64;
        }
    }
}

/// `R` rows against `T` tokens (1 or 2), decoding each weight pair once for all tokens, while
/// prefetching the rows `prefetch`. Writes `out[t * stride + at + i]`.
///
/// # Safety
/// `first_row + R` rows exist, `x` has `T` tokens of the matrix's columns, writes in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemv_rows<W: PairSource, const R: usize, const T: usize>(
    w: &W,
    x: &Q8Activations,
    first_row: usize,
    prefetch: Range<usize>,
    out: &mut [f32],
    stride: usize,
    at: usize,
) {
    // SAFETY: the caller upholds this function's contract (`first_row + R` rows exist, `x` has `T`
    // tokens of the matrix's columns, writes in bounds), which is what every pointer access and
    // target-feature call below relies on.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let groups = w.groups();
        let spans = w.byte_spans(prefetch);
        for group in 0..groups {
            if W::PREFETCH_L2 {
                prefetch_share_into::<true>(&spans, group, groups)
            } else {
                prefetch_share_into::<false>(&spans, group, groups)
            }
            for pair in 0..2 {
                let a: [ActPair; T] =
                    std::array::from_fn(|t| ActPair::load(x, t, group, pair, W::OFFSET));
                for (i, acc_row) in acc.iter_mut().enumerate() {
                    if let Some((evens, odds, scales)) = w.load_pair(first_row + i, group, pair) {
                        for (acc_t, a_t) in acc_row.iter_mut().zip(&a) {
                            *acc_t = pair_fma(W::SIGNED, *acc_t, evens, odds, scales, a_t);
                        }
                    }
                }
            }
        }
        for (i, acc_row) in acc.iter().enumerate() {
            for (t, acc_t) in acc_row.iter().enumerate() {
                out[t * stride + at + i] = W::FACTOR * reduce_add(*acc_t);
            }
        }
    }
}

/// # Safety
/// The CPU has the module's features; shapes were checked by `Kernels`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<W: PairSource>(w: &W, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // shapes were checked by `Kernels`), which is what every pointer access and target-feature
    // call below relies on.
    unsafe {
        match x.rows() {
            1 => gemv_tokens::<W, 1>(w, x, rows, out),
            2 => gemv_tokens::<W, 2>(w, x, rows, out),
            3 => gemv_tokens::<W, 3>(w, x, rows, out),
            _ => gemv_tokens::<W, 4>(w, x, rows, out),
        }
    }
}

/// # Safety
/// As [`gemv`], with `x` holding exactly `T` tokens.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_tokens<W: PairSource, const T: usize>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's contract (As [`gemv`], with `x` holding exactly
    // `T` tokens), which is what every pointer access and target-feature call below relies on.
    unsafe {
        // Past two tokens, four rows' accumulators and the tokens' operands outgrow the 16 registers.
        if T > 2 {
            gemv_row_blocks::<W, 2, T>(w, x, rows, out)
        } else {
            gemv_row_blocks::<W, 4, T>(w, x, rows, out)
        }
    }
}

/// # Safety
/// As [`gemv_tokens`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_row_blocks<W: PairSource, const R: usize, const T: usize>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's contract (As [`gemv_tokens`]), which is what
    // every pointer access and target-feature call below relies on.
    unsafe {
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
                gemv_rows::<W, R, T>(w, x, row, ahead(row, R), out, stride, at);
                at += R;
            } else {
                gemv_rows::<W, 1, T>(w, x, row, ahead(row, 0), out, stride, at);
                at += 1;
            }
        }
    }
}

pub(crate) unsafe fn mxfp4_gemv(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe { gemv(w, x, rows, out) }
}

pub(crate) unsafe fn q4_gemv(w: &Q4Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe { gemv(w, x, rows, out) }
}

pub(crate) unsafe fn q8_gemv(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe { gemv(w, x, rows, out) }
}

/// Decode rows into the scratch tile (weights in activation order, scales as lanes); pairs past a
/// row's end are written as zero weights with zero scales.
///
/// # Safety
/// Rows inside the matrix, `count <= GEMM_TILE_ROWS`, scratch sized for the matrix's columns.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_tile<W: PairSource>(
    w: &W,
    first_row: usize,
    count: usize,
    scratch: &mut GemmScratch,
) {
    // SAFETY: the caller upholds this function's contract (Rows inside the matrix, `count <=
    // GEMM_TILE_ROWS`, scratch sized for the matrix's columns), which is what every pointer access
    // and target-feature call below relies on.
    unsafe {
        let groups = w.groups();
        let tile = scratch.tile.as_mut_ptr();
        let tile_scales = scratch.tile_scales.as_mut_ptr();
        for i in 0..count {
            for group in 0..groups {
                for pair in 0..2 {
                    let (evens, odds, scales) =
                        w.load_pair(first_row + i, group, pair).unwrap_or((
                            _mm256_setzero_si256(),
                            _mm256_setzero_si256(),
                            _mm256_setzero_ps(),
                        ));
                    let at = tile.add((i * groups + group) * GROUP_LEN + pair * PAIR_LEN / 2);
                    _mm256_storeu_si256(at.cast(), evens);
                    _mm256_storeu_si256(at.add(GROUP_LEN / 2).cast(), odds);
                    _mm256_storeu_ps(
                        tile_scales.add((i * groups + group) * GROUP_LANES + pair * PAIR_LANES),
                        scales,
                    );
                }
            }
        }
    }
}

/// `R` decoded tile rows x `T` tokens.
///
/// # Safety
/// Tile rows `tile_row..+R` decoded for `groups` groups; tokens `first_token..+T` exist in `x`;
/// `out[t * stride + i]` in bounds for t < T, i < R.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_micro<W: PairSource, const R: usize, const T: usize>(
    scratch: &GemmScratch,
    groups: usize,
    tile_row: usize,
    x: &Q8Activations,
    first_token: usize,
    out: *mut f32,
    stride: usize,
) {
    // SAFETY: the caller upholds this function's contract (Tile rows `tile_row..+R` decoded for
    // `groups` groups; tokens `first_token..+T` exist in `x`; `out[t * stride + i]` in bounds for t
    // < T, i < R), which is what every pointer access and target-feature call below relies on.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let tile = scratch.tile.as_ptr();
        let tile_scales = scratch.tile_scales.as_ptr();
        for group in 0..groups {
            for pair in 0..2 {
                let mut a = [ActPair {
                    evens: _mm256_setzero_si256(),
                    odds: _mm256_setzero_si256(),
                    correction: _mm256_setzero_si256(),
                    scales: _mm256_setzero_ps(),
                }; T];
                for (t, a_t) in a.iter_mut().enumerate() {
                    *a_t = ActPair::load(x, first_token + t, group, pair, W::OFFSET);
                }
                for (i, acc_row) in acc.iter_mut().enumerate() {
                    let at = ((tile_row + i) * groups + group) * GROUP_LEN + pair * PAIR_LEN / 2;
                    let evens = _mm256_loadu_si256(tile.add(at).cast());
                    let odds = _mm256_loadu_si256(tile.add(at + GROUP_LEN / 2).cast());
                    let scales =
                        _mm256_loadu_ps(tile_scales.add(
                            ((tile_row + i) * groups + group) * GROUP_LANES + pair * PAIR_LANES,
                        ));
                    for (acc_cell, a_t) in acc_row.iter_mut().zip(&a) {
                        *acc_cell = pair_fma(W::SIGNED, *acc_cell, evens, odds, scales, a_t);
                    }
                }
            }
        }
        for (i, acc_row) in acc.iter().enumerate() {
            for (t, acc_cell) in acc_row.iter().enumerate() {
                *out.add(t * stride + i) = W::FACTOR * reduce_add(*acc_cell);
            }
        }
    }
}

/// # Safety
/// The CPU has the module's features; shapes and scratch size were checked by `Kernels`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemm<W: PairSource>(
    w: &W,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // shapes and scratch size were checked by `Kernels`), which is what every pointer access and
    // target-feature call below relies on.
    unsafe {
        if x.rows() == 1 {
            return gemv(w, x, rows, out);
        }
        let groups = w.groups();
        let stride = rows.len();
        let tokens = x.rows();
        // While one tile is multiplied, the next tile's weights are prefetched, a share before
        // each micro-kernel call: with few tokens per expert (a short prompt) the tile decode
        // would otherwise wait on every cache miss.
        let spans_from = |start: usize| w.byte_spans(start..(start + GEMM_TILE_ROWS).min(rows.end));
        prefetch_share(&spans_from(rows.start), 0, 1);
        let mut tile_start = rows.start;
        while tile_start < rows.end {
            let count = (rows.end - tile_start).min(GEMM_TILE_ROWS);
            decode_tile(w, tile_start, count, scratch);
            let next = spans_from(tile_start + count);
            let calls = tokens.div_ceil(2) * count.div_ceil(2);
            let mut call = 0;
            let out_column = out.as_mut_ptr().add(tile_start - rows.start);
            let mut token = 0;
            while token < tokens {
                let t_count = (tokens - token).min(2);
                let mut i = 0;
                while i < count {
                    prefetch_share(&next, call, calls);
                    call += 1;
                    let r_count = if count - i >= 2 { 2 } else { 1 };
                    let o = out_column.add(token * stride + i);
                    match (r_count, t_count) {
                        (2, 2) => gemm_micro::<W, 2, 2>(scratch, groups, i, x, token, o, stride),
                        (2, _) => gemm_micro::<W, 2, 1>(scratch, groups, i, x, token, o, stride),
                        (_, 2) => gemm_micro::<W, 1, 2>(scratch, groups, i, x, token, o, stride),
                        _ => gemm_micro::<W, 1, 1>(scratch, groups, i, x, token, o, stride),
                    }
                    i += r_count;
                }
                token += t_count;
            }
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
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe { gemm(w, x, rows, out, scratch) }
}

pub(crate) unsafe fn q4_gemm(
    w: &Q4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
    scratch: &mut GemmScratch,
) {
    // SAFETY: the module's contract holds: the dispatcher runs this only on a CPU with every
    // feature in `REQUIRED`, and the safe `Kernels` method checked the shapes, which is all the
    // code below relies on.
    unsafe { gemm(w, x, rows, out, scratch) }
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
    unsafe { gemm(w, x, rows, out, scratch) }
}

/// `R` bf16 rows x `T` tokens over the columns that fill whole vectors; the rest in scalar FMA.
///
/// # Safety
/// Rows `row..+R`, tokens `token..+T` exist; `out[t * stride + i]` in bounds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_micro<const R: usize, const T: usize>(
    w: &[u16],
    cols: usize,
    x: &[f32],
    row: usize,
    token: usize,
    out: *mut f32,
    stride: usize,
) {
    // SAFETY: the caller upholds this function's contract (Rows `row..+R`, tokens `token..+T`
    // exist; `out[t * stride + i]` in bounds), which is what every pointer access and
    // target-feature call below relies on.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        let whole = cols / 8 * 8;
        let mut c = 0;
        while c < whole {
            let mut xs = [_mm256_setzero_ps(); T];
            for (t, xv) in xs.iter_mut().enumerate() {
                *xv = _mm256_loadu_ps(x.as_ptr().add((token + t) * cols + c));
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let bits = _mm_loadu_si128(w.as_ptr().add((row + i) * cols + c).cast());
                let wv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(bits)));
                for (acc_cell, xv) in acc_row.iter_mut().zip(&xs) {
                    *acc_cell = _mm256_fmadd_ps(wv, *xv, *acc_cell);
                }
            }
            c += 8;
        }
        for (i, acc_row) in acc.iter().enumerate() {
            for (t, acc_cell) in acc_row.iter().enumerate() {
                let mut sum = reduce_add(*acc_cell);
                for k in whole..cols {
                    let wv = f32::from_bits((*w.get_unchecked((row + i) * cols + k) as u32) << 16);
                    sum = wv.mul_add(*x.get_unchecked((token + t) * cols + k), sum);
                }
                *out.add(t * stride + i) = sum;
            }
        }
    }
}

/// # Safety
/// The CPU has the module's features; shapes were checked by `Kernels`.
#[target_feature(enable = "avx2,fma,f16c")]
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
                    let r_count = if count - i >= 2 { 2 } else { 1 };
                    let row = tile_start + i;
                    let o = out.as_mut_ptr().add(token * stride + row - rows.start);
                    match (r_count, t_count) {
                        (2, 3) => bf16_micro::<2, 3>(w, cols, x, row, token, o, stride),
                        (2, 2) => bf16_micro::<2, 2>(w, cols, x, row, token, o, stride),
                        (2, _) => bf16_micro::<2, 1>(w, cols, x, row, token, o, stride),
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
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `a.len() == b.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 2];
        let whole = a.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            let lane = (i / 8) % 2;
            acc[lane] = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc[lane],
            );
            i += 8;
        }
        let mut sum = reduce_add(_mm256_add_ps(acc[0], acc[1]));
        for k in whole..a.len() {
            sum = a[k].mul_add(b[k], sum);
        }
        sum
    }
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `x.len() == y.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let a = _mm256_set1_ps(alpha);
        let whole = x.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                yp,
                _mm256_fmadd_ps(a, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(yp)),
            );
            i += 8;
        }
        for k in whole..x.len() {
            y[k] = alpha.mul_add(x[k], y[k]);
        }
    }
}

/// # Safety
/// The CPU has the module's features; `a.len() == b.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16(a: &[f32], b: &[f16]) -> f32 {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `a.len() == b.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 2];
        let whole = a.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            let lane = (i / 8) % 2;
            let bv = _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(i).cast()));
            acc[lane] = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), bv, acc[lane]);
            i += 8;
        }
        let mut sum = reduce_add(_mm256_add_ps(acc[0], acc[1]));
        for k in whole..a.len() {
            sum = a[k].mul_add(b[k].to_f32(), sum);
        }
        sum
    }
}

/// # Safety
/// The CPU has the module's features; `x.len() == y.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(alpha: f32, x: &[f16], y: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `x.len() == y.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let a = _mm256_set1_ps(alpha);
        let whole = x.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            let yp = y.as_mut_ptr().add(i);
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
            _mm256_storeu_ps(yp, _mm256_fmadd_ps(a, xv, _mm256_loadu_ps(yp)));
            i += 8;
        }
        for k in whole..x.len() {
            y[k] = alpha.mul_add(x[k].to_f32(), y[k]);
        }
    }
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `src.len() == dst.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let whole = src.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            let halves =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), halves);
            i += 8;
        }
        for k in whole..src.len() {
            dst[k] = f16::from_f32(src[k]);
        }
    }
}

/// # Safety
/// The CPU has the module's features; `src.len() == dst.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    // SAFETY: the caller upholds this function's contract (The CPU has the module's features;
    // `src.len() == dst.len()`), which is what every pointer access and target-feature call below
    // relies on.
    unsafe {
        let whole = src.len() / 8 * 8;
        let mut i = 0;
        while i < whole {
            _mm256_storeu_ps(
                dst.as_mut_ptr().add(i),
                _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i).cast())),
            );
            i += 8;
        }
        for k in whole..src.len() {
            dst[k] = src[k].to_f32();
        }
    }
}

/// The peak of the AVX2 kernels' integer steps: per 64 multiply-accumulates two `vpmaddubsw`,
/// their int16 sum, one `vpmaddwd` and one `vpaddd` (what the MXFP4 tile kernel does per
/// token and dword pair). Eight accumulator chains of two groups each; the operands pass through
/// an empty `asm!` once per round so the compiler cannot hoist the loop-invariant products.
///
/// (The earlier probe did one `vpmaddubsw` per 64 counted products and rebuilt its operands
/// every round; it measured 38 GMAC/s per thread on Zen 4 where the GEMMs ran at 60.)
///
/// # Safety
/// The CPU runs `dot` (AVX2 for all; AVX-VNNI or AVX-512 VNNI/VL for the `vpdpbusd` ones).
pub(crate) unsafe fn int8_mac_probe(rounds: usize, dot: super::Avx2Dot) -> i64 {
    // SAFETY: the caller upholds the contract: each entry's features are present.
    unsafe {
        match dot {
            super::Avx2Dot::Maddubs => probe_entry_maddubs(rounds),
            super::Avx2Dot::VnniVex => probe_entry_vex(rounds),
            super::Avx2Dot::VnniEvex => probe_entry_evex(rounds),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn probe_entry_maddubs(rounds: usize) -> i64 {
    // SAFETY: this entry's features are what the body needs.
    unsafe { probe::<tiles::Maddubs>(rounds) }
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn probe_entry_vex(rounds: usize) -> i64 {
    // SAFETY: as above, with AVX-VNNI.
    unsafe { probe::<tiles::VnniVex>(rounds) }
}

#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn probe_entry_evex(rounds: usize) -> i64 {
    // SAFETY: as above, with AVX-512 VNNI and VL.
    unsafe { probe::<tiles::VnniEvex>(rounds) }
}

/// Tells the compiler the probe's operands may have changed (an empty `asm!`), so it cannot
/// hoist the loop-invariant products.
#[inline]
#[target_feature(enable = "avx2")]
fn opaque(values: &mut [__m256i; 8]) {
    let [v0, v1, v2, v3, v4, v5, v6, v7] = values;
    // SAFETY: an empty template: it only tells the compiler the values may have changed.
    unsafe {
        std::arch::asm!(
            "/* {0} {1} {2} {3} {4} {5} {6} {7} */",
            inout(ymm_reg) * v0,
            inout(ymm_reg) * v1,
            inout(ymm_reg) * v2,
            inout(ymm_reg) * v3,
            inout(ymm_reg) * v4,
            inout(ymm_reg) * v5,
            inout(ymm_reg) * v6,
            inout(ymm_reg) * v7,
            options(nomem, nostack, preserves_flags)
        )
    };
}

/// [`int8_mac_probe`]'s body, each 64 products summed by `D` as the tile kernel sums them.
///
/// # Safety
/// The CPU has AVX2 and what `D` needs.
#[inline(always)]
unsafe fn probe<D: tiles::PairDot<Operand = __m256i>>(rounds: usize) -> i64 {
    // SAFETY: the caller upholds the contract (AVX2 and what D needs).
    unsafe {
        use super::{probe_operands, PROBE_GROUPS};
        const CHAINS: usize = 8;
        let unsigned = |g: usize| _mm256_set1_epi8(probe_operands(g).0 as i8);
        let signed = |g: usize| _mm256_set1_epi8(probe_operands(g).1);
        let (mut u0, mut u1, mut u2) = (unsigned(0), unsigned(1), unsigned(2));
        let (mut s0, mut s1, mut s2, mut s3, mut s4) =
            (signed(0), signed(1), signed(2), signed(3), signed(4));
        let mut acc = [[_mm256_setzero_si256(); 2]; CHAINS];
        for _ in 0..rounds {
            let mut operands = [u0, u1, u2, s0, s1, s2, s3, s4];
            opaque(&mut operands);
            [u0, u1, u2, s0, s1, s2, s3, s4] = operands;
            let (us, ss) = ([u0, u1, u2], [s0, s1, s2, s3, s4]);
            // Literal group indices (the loop is unrolled), so every operand stays in a register.
            macro_rules! groups {
                ($($g:literal)*) => {$(
                    // Group g: 2 x 32 products u x s, summed as the kernels do (at most 4 x 3 x 2
                    // in an int16 lane, far from saturation).
                    let (u, s) = (us[$g % 3], ss[$g % 5]);
                    D::add_pairs(&mut acc[$g % CHAINS], (u, s), (u, s));
                )*};
            }
            groups!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }
        const _: () = assert!(
            PROBE_GROUPS == 16,
            "the probe's groups are written out above"
        );
        let mut total = 0i64;
        for acc in acc.into_iter().flatten() {
            let mut lanes = [0i32; 8];
            // `lanes` is 32 writable bytes; storeu has no alignment requirement.
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), acc);
            total += lanes.iter().map(|&l| l as i64).sum::<i64>();
        }
        total
    }
}
