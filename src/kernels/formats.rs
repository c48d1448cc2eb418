//! Block formats: quantized activations, MXFP4 checkpoint views, and the Q8/Q4 formats we make at load.
//!
//! Every integer format groups its blocks of 32 in fours ("groups" of 128 elements) and stores each
//! group as the even elements of its four blocks, then the odd elements of its four blocks. That is
//! the order in which the checkpoint's MXFP4 nibbles come out of one 64-byte load (low nibbles are
//! the even elements), so no kernel needs an interleaving shuffle.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use half::f16;
use rayon::prelude::*;

use super::aligned::AlignedVec;
use super::{KernelError, Kernels};

/// Elements per quantization block (one scale each).
pub const BLOCK_LEN: usize = 32;
/// Blocks per group: one 512-bit load of MXFP4 or Q4 nibbles.
pub const GROUP_BLOCKS: usize = 4;
/// Elements per group.
pub const GROUP_LEN: usize = BLOCK_LEN * GROUP_BLOCKS;
/// Per-block lanes in the lane-expanded arrays: a group's four blocks fill sixteen 32-bit lanes,
/// four per block, which is how `vpdpbusd` lays out its sums.
pub(crate) const GROUP_LANES: usize = 16;

/// FP4 E2M1 value of each nibble (bit 3 is the sign).
pub const FP4_E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// A 16-entry byte table four times over: one per 128-bit lane for `vpshufb`, or a `vpermb`
/// table that ignores index bits 4-5.
pub(crate) const fn repeat_table(table: &[i8; 16]) -> [i8; 64] {
    let mut out = [0i8; 64];
    let mut i = 0;
    while i < 64 {
        out[i] = table[i % 16];
        i += 1;
    }
    out
}

/// FP4 values doubled so they are integers; the kernels multiply these and halve the result.
pub(crate) const FP4_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Added to the doubled FP4 values so `vpdpbusd`/`vpmaddubsw` see unsigned weights; each block's
/// sum is corrected by `-offset x (sum of the block's activations)`.
pub(crate) const MXFP4_OFFSET: i32 = 12;
/// Q4 nibbles hold `q + 8` for q in -8..=7.
pub(crate) const Q4_OFFSET: i32 = 8;
/// The AVX-512 Q8 kernels flip the sign bit (`q ^ 0x80 = q + 128`) to get unsigned weights.
pub(crate) const Q8_OFFSET: i32 = 128;

/// Lane (within a block's four) of each format's entry in [`Q8Activations::corrections`].
pub(crate) const CORRECTION_LANE_MXFP4: usize = 0;
pub(crate) const CORRECTION_LANE_Q4: usize = 1;
pub(crate) const CORRECTION_LANE_Q8: usize = 2;

/// The exact MXFP4 block scale of an E8M0 byte, as the spec defines it: 2^(s-127), NaN for 255.
pub fn e8m0_scale(s: u8) -> f32 {
    match s {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000), // 2^-127 is subnormal in f32
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// The scale the kernels apply: `s << 23` as f32 bits, which is 2^(s-127) for s in 1..=254.
/// s = 0 flushes to 0 (its weights are below 4e-38); s = 255 (NaN in the OCP spec) gives infinity,
/// so a corrupt block shows up as a non-finite output instead of a plausible number.
#[inline]
pub(crate) fn e8m0_kernel_scale(s: u8) -> f32 {
    f32::from_bits((s as u32) << 23)
}

/// Position of element `k` of a row in the group-interleaved order.
#[inline]
pub(crate) fn interleaved_position(k: usize) -> usize {
    let group = k / GROUP_LEN;
    let block_in_group = (k % GROUP_LEN) / BLOCK_LEN;
    let element = k % BLOCK_LEN;
    group * GROUP_LEN
        + (element % 2) * (GROUP_LEN / 2)
        + block_in_group * (BLOCK_LEN / 2)
        + element / 2
}

/// Where a range of rows lives in memory: the weight bytes and the scale bytes, each contiguous.
/// The SIMD GEMVs prefetch the next rows from these.
pub(crate) trait ByteSpans {
    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2];
    /// The matrix's row count: how far a GEMV may prefetch past the rows it was given.
    fn row_count(&self) -> usize;
}

/// The rows of the tiles `rows` touches (empty stays empty): what a tiled matrix's byte spans
/// cover, since tiles hold whole groups of rows.
fn whole_tiles(rows: std::ops::Range<usize>) -> std::ops::Range<usize> {
    if rows.is_empty() {
        return rows;
    }
    rows.start / MXFP4_TILE_ROWS * MXFP4_TILE_ROWS
        ..rows.end.div_ceil(MXFP4_TILE_ROWS) * MXFP4_TILE_ROWS
}

impl ByteSpans for Mxfp4Matrix<'_> {
    fn row_count(&self) -> usize {
        self.rows()
    }

    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        let (row_bytes, row_scales) = (self.cols / 2, self.cols / BLOCK_LEN);
        // Tiles hold whole groups of rows: the span of the tiles the rows touch.
        let rows = match self.layout {
            Mxfp4Layout::Rows => rows,
            Mxfp4Layout::Tiles => whole_tiles(rows),
        };
        [
            (
                self.blocks.as_ptr().wrapping_add(rows.start * row_bytes),
                rows.len() * row_bytes,
            ),
            (
                self.scales.as_ptr().wrapping_add(rows.start * row_scales),
                rows.len() * row_scales,
            ),
        ]
    }
}

impl ByteSpans for Q4Matrix {
    fn row_count(&self) -> usize {
        self.rows()
    }

    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        // Tiles hold whole groups of rows and no padding blocks: the span of the tiles the rows
        // touch.
        let (rows, row_bytes, row_scales) = if self.tiled {
            (whole_tiles(rows), self.cols / 2, self.cols / BLOCK_LEN * 2)
        } else {
            (
                rows,
                self.groups * GROUP_LEN / 2,
                self.groups * GROUP_BLOCKS * 2,
            )
        };
        [
            (
                self.nibbles.as_ptr().wrapping_add(rows.start * row_bytes),
                rows.len() * row_bytes,
            ),
            (
                self.scales
                    .as_ptr()
                    .cast::<u8>()
                    .wrapping_add(rows.start * row_scales),
                rows.len() * row_scales,
            ),
        ]
    }
}

impl ByteSpans for Q8Matrix {
    fn row_count(&self) -> usize {
        self.rows()
    }

    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        let (row_bytes, row_scales) = (self.groups * GROUP_LEN, self.groups * GROUP_BLOCKS * 2);
        // Tiles hold whole groups of rows: the span of the tiles the rows touch.
        let rows = if self.tiled { whole_tiles(rows) } else { rows };
        [
            (
                self.quants
                    .as_ptr()
                    .cast::<u8>()
                    .wrapping_add(rows.start * row_bytes),
                rows.len() * row_bytes,
            ),
            (
                self.scales
                    .as_ptr()
                    .cast::<u8>()
                    .wrapping_add(rows.start * row_scales),
                rows.len() * row_scales,
            ),
        ]
    }
}

/// Round half to even without a libm call: adding and subtracting 1.5 x 2^23 leaves the nearest
/// integer in f32 arithmetic (which rounds ties to even) for |v| < 2^22, far beyond the +-127
/// (+-8 for Q4) range quantization clamps to. `f32::round_ties_even` compiles to a `rintf` call on
/// baseline x86-64, which dominated activation quantization.
trait RoundEvenFast {
    fn round_even_fast(self) -> f32;
}

/// 1.5 x 2^23: adding it leaves no fraction bits for values below 2^22 in magnitude.
const ROUND_MAGIC: f32 = 12_582_912.0;

impl RoundEvenFast for f32 {
    #[inline(always)]
    fn round_even_fast(self) -> f32 {
        if self.abs() < 4_194_304.0 {
            (self + ROUND_MAGIC) - ROUND_MAGIC
        } else {
            self
        }
    }
}

/// How an activation block's int8 scale is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleRule {
    /// `max|x| / 127`: the block's largest magnitude lands on +-127, the finest grid one int8
    /// row has. Single rows use it.
    Tight,
    /// The least power of two at or above `max|x| / 127`: up to one bit coarser, which the
    /// second row of a split quantization takes back, and in exchange a weight scale times this
    /// scale is an exponent add, not a multiply, in the AVX-512 kernels (whose multiplies share
    /// the pipes of `vpdpbusd`; see `avx512::combined_scale`). Split rows use it.
    PowerOfTwo,
}

/// The least power of two at or above a positive `s` (infinity stays infinite, 0 stays 0): the
/// mantissa rounded up into the exponent. A subnormal `s` gives 2^-126.
#[inline(always)]
pub(crate) fn power_of_two_at_least(s: f32) -> f32 {
    f32::from_bits((s.to_bits() + 0x007F_FFFF) & 0xFF80_0000)
}

/// A block's scale and the inverse its values are multiplied by, both 0 where its largest
/// magnitude `amax` is not positive. The SIMD quantizers compute the same bits.
#[inline(always)]
fn block_scale(amax: f32, rule: ScaleRule) -> (f32, f32) {
    if amax > 0.0 {
        match rule {
            ScaleRule::Tight => (amax / 127.0, 127.0 / amax),
            ScaleRule::PowerOfTwo => {
                let scale = power_of_two_at_least(amax / 127.0);
                (scale, 1.0 / scale)
            }
        }
    } else {
        (0.0, 0.0)
    }
}

fn check_block_cols(what: &str, cols: usize) -> Result<(), KernelError> {
    if cols == 0 || !cols.is_multiple_of(BLOCK_LEN) {
        return Err(KernelError::BadColumns {
            what: what.to_string(),
            cols,
        });
    }
    Ok(())
}

fn groups_for(cols: usize) -> usize {
    cols.div_ceil(GROUP_LEN)
}

/// Activations quantized to int8 blocks of 32 with one f32 scale per block, `rows` tokens of `cols`.
///
/// Layout per token: `groups = ceil(cols / 128)` groups, padded with zero blocks (scale 0) so every
/// kernel reads whole groups. Quantize once per token; every weight row and every expert reuses it.
#[derive(Clone, Debug, Default)]
pub struct Q8Activations {
    rows: usize,
    cols: usize,
    pub(super) groups: usize,
    /// `rows x groups x 128` int8 values, group-interleaved (evens of 4 blocks, then odds).
    pub(super) quants: AlignedVec<i8>,
    /// `rows x groups x 16`: lanes 4j..4j+3 hold the scale of block j of the group.
    pub(super) scale_lanes: AlignedVec<f32>,
    /// `rows x groups x 16`: lane 4j holds the sum of block j's int8 values, the other lanes 0.
    /// The offset trick subtracts `offset x sum` from each block's unsigned-by-signed dot product.
    pub(super) sum_lanes: AlignedVec<i32>,
    /// `rows x groups x 16`: each format's `-offset x block sum`, ready to start a block's integer
    /// sum: lane `4j + CORRECTION_LANE_*` holds block j's correction for that format, lane 4j + 3
    /// is 0. Only the total of a block's four lanes matters to the kernels, so the AVX-512 path
    /// loads this with one lane per block unmasked instead of multiplying `sum_lanes` each time.
    pub(super) corrections: AlignedVec<i32>,
    /// [`Q8Activations::scale_exponents`], found by the first product that asks after each
    /// quantization (every writer resizes first, which clears it) and shared by every task of
    /// every product that reads these rows.
    scale_exponents: OnceLock<Option<ScaleExponents>>,
    /// [`Q8Activations::generation`]: a number no other quantization in this process had,
    /// taken by every writer (each resizes first); 0 before the first.
    generation: u64,
}

/// The next [`Q8Activations::generation`].
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// What the AVX-512 kernels need to know of a batch's block scales to choose how they apply
/// them (see `avx512::scaling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScaleExponents {
    /// The lowest and highest biased exponent (1..=254).
    pub range: (u32, u32),
    /// Every scale a power of two (split rows, [`ScaleRule::PowerOfTwo`]).
    pub powers_of_two: bool,
}

impl Q8Activations {
    /// An empty buffer; the first quantization sizes it.
    pub fn new() -> Self {
        Self::default()
    }

    /// A buffer that holds `rows` tokens of `cols` without reallocating.
    pub fn with_capacity(rows: usize, cols: usize) -> Self {
        let groups = groups_for(cols);
        Self {
            rows: 0,
            cols: 0,
            groups: 0,
            quants: AlignedVec::with_capacity(rows * groups * GROUP_LEN),
            scale_lanes: AlignedVec::with_capacity(rows * groups * GROUP_LANES),
            sum_lanes: AlignedVec::with_capacity(rows * groups * GROUP_LANES),
            corrections: AlignedVec::with_capacity(rows * groups * GROUP_LANES),
            scale_exponents: OnceLock::new(),
            generation: 0,
        }
    }

    /// Tokens held.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per token.
    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(crate) fn row_quants(&self, row: usize) -> &[i8] {
        let stride = self.groups * GROUP_LEN;
        &self.quants[row * stride..(row + 1) * stride]
    }

    pub(crate) fn row_scale_lanes(&self, row: usize) -> &[f32] {
        let stride = self.groups * GROUP_LANES;
        &self.scale_lanes[row * stride..(row + 1) * stride]
    }

    pub(crate) fn row_sum_lanes(&self, row: usize) -> &[i32] {
        let stride = self.groups * GROUP_LANES;
        &self.sum_lanes[row * stride..(row + 1) * stride]
    }

    pub(crate) fn row_corrections(&self, row: usize) -> &[i32] {
        let stride = self.groups * GROUP_LANES;
        &self.corrections[row * stride..(row + 1) * stride]
    }

    /// Scale of block `block` of token `row`.
    pub(crate) fn block_scale(&self, row: usize, block: usize) -> f32 {
        let group = block / GROUP_BLOCKS;
        let j = block % GROUP_BLOCKS;
        self.row_scale_lanes(row)[group * GROUP_LANES + j * 4]
    }

    /// Which contents these rows hold: a number that changes with every write (a quantization,
    /// a gather) and that no other buffer's write in this process took, so a kernel that keeps
    /// something derived from the rows (the matrix unit's packed tiles) can tell whether it still
    /// fits. A clone shares it with its source, and their contents are the same until one of
    /// them is written. 0 for a buffer never written.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    fn resize(&mut self, rows: usize, cols: usize) {
        self.scale_exponents = OnceLock::new();
        self.generation = NEXT_GENERATION.fetch_add(1, Ordering::Relaxed);
        self.rows = rows;
        self.cols = cols;
        self.groups = groups_for(cols);
        // resize never allocates while the capacity suffices.
        self.quants.resize(rows * self.groups * GROUP_LEN, 0);
        self.scale_lanes
            .resize(rows * self.groups * GROUP_LANES, 0.0);
        self.sum_lanes.resize(rows * self.groups * GROUP_LANES, 0);
        self.corrections.resize(rows * self.groups * GROUP_LANES, 0);
    }

    /// The biased exponents of every real block scale, lowest and highest, and whether all are
    /// powers of two; `None` if one is 0, subnormal, infinite or NaN (or there are none).
    /// Padding blocks past the columns are skipped: the kernels' tiles give them scale 1 and
    /// sums 0. Scanned once per quantization.
    pub(crate) fn scale_exponents(&self) -> Option<ScaleExponents> {
        *self.scale_exponents.get_or_init(|| {
            let blocks = self.cols / BLOCK_LEN;
            let (mut low, mut high, mut mantissas) = (u32::MAX, 0, 0);
            for token in 0..self.rows {
                let lanes = self.row_scale_lanes(token);
                for block in 0..blocks {
                    let bits = lanes
                        [(block / GROUP_BLOCKS) * GROUP_LANES + 4 * (block % GROUP_BLOCKS)]
                        .to_bits();
                    // The sign bit lands above the exponent: a negative scale fails too.
                    let exponent = bits >> 23;
                    if exponent == 0 || exponent >= 255 {
                        return None;
                    }
                    low = low.min(exponent);
                    high = high.max(exponent);
                    mantissas |= bits & 0x007F_FFFF;
                }
            }
            (low <= high).then_some(ScaleExponents {
                range: (low, high),
                powers_of_two: mantissas == 0,
            })
        })
    }

    /// Copy whole quantized tokens from `source` (e.g. the tokens routed to one expert), without
    /// quantizing again.
    pub fn gather_rows(
        &mut self,
        source: &Q8Activations,
        rows: &[usize],
    ) -> Result<(), KernelError> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= source.rows) {
            return Err(KernelError::RowOutOfRange {
                what: "gathered activation row".to_string(),
                row: bad,
                rows: source.rows,
            });
        }
        self.resize(rows.len(), source.cols);
        let (qs, ls) = (self.groups * GROUP_LEN, self.groups * GROUP_LANES);
        for (dst, &src) in rows.iter().enumerate() {
            self.quants[dst * qs..(dst + 1) * qs].copy_from_slice(source.row_quants(src));
            self.scale_lanes[dst * ls..(dst + 1) * ls].copy_from_slice(source.row_scale_lanes(src));
            self.sum_lanes[dst * ls..(dst + 1) * ls].copy_from_slice(source.row_sum_lanes(src));
            self.corrections[dst * ls..(dst + 1) * ls].copy_from_slice(source.row_corrections(src));
        }
        Ok(())
    }

    /// The values the quantized token stands for (scale x int8), in natural element order.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                what: "activation row".to_string(),
                row,
                rows: self.rows,
            });
        }
        check_len("dequantized activation row", out.len(), self.cols)?;
        let quants = self.row_quants(row);
        for (k, value) in out.iter_mut().enumerate() {
            *value = quants[interleaved_position(k)] as f32 * self.block_scale(row, k / BLOCK_LEN);
        }
        Ok(())
    }
}

pub(crate) fn check_len(what: &str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got != expected {
        return Err(KernelError::Length {
            what: what.to_string(),
            expected,
            got,
        });
    }
    Ok(())
}

/// [`Kernels::quantize_activation_rows`]: checks the shape, then quantizes on `kernels`' path,
/// spreading a prefill chunk's rows over the current pool.
pub(super) fn quantize_activation_rows(
    kernels: Kernels,
    x: &[f32],
    cols: usize,
    rule: ScaleRule,
    out: &mut Q8Activations,
    parallel: bool,
) -> Result<(), KernelError> {
    check_block_cols("activation row", cols)?;
    if !x.len().is_multiple_of(cols) {
        return Err(KernelError::Length {
            what: format!("activations (a whole number of rows of {cols})"),
            expected: x.len().div_ceil(cols) * cols,
            got: x.len(),
        });
    }
    let rows = x.len() / cols;
    out.resize(rows, cols);
    let (quant_stride, lane_stride) = (out.groups * GROUP_LEN, out.groups * GROUP_LANES);
    let q = &mut *out;
    if rows < PARALLEL_QUANTIZE_ROWS || !parallel {
        kernels.quantize_rows(
            x,
            cols,
            rule,
            &mut q.quants,
            &mut q.scale_lanes,
            &mut q.sum_lanes,
            &mut q.corrections,
        );
        return Ok(());
    }
    // A prefill chunk's rows are independent: spread them over the pool (the caller is on it).
    let step = QUANTIZE_TASK_ROWS;
    x.par_chunks(step * cols)
        .zip(q.quants.par_chunks_mut(step * quant_stride))
        .zip(q.scale_lanes.par_chunks_mut(step * lane_stride))
        .zip(q.sum_lanes.par_chunks_mut(step * lane_stride))
        .zip(q.corrections.par_chunks_mut(step * lane_stride))
        .for_each(|((((x, quants), scales), sums), corrections)| {
            kernels.quantize_rows(x, cols, rule, quants, scales, sums, corrections)
        });
    Ok(())
}

/// Rows from which quantization runs on the pool, and rows per task there.
const PARALLEL_QUANTIZE_ROWS: usize = 16;
const QUANTIZE_TASK_ROWS: usize = 8;

/// The reference quantizer: the SIMD paths must reproduce its every output bit.
pub(super) fn quantize_rows_portable(
    x: &[f32],
    cols: usize,
    rule: ScaleRule,
    all_quants: &mut [i8],
    all_scales: &mut [f32],
    all_sums: &mut [i32],
    all_corrections: &mut [i32],
) {
    let rows = x.len() / cols;
    let groups = cols.div_ceil(GROUP_LEN);
    let (quant_stride, lane_stride) = (groups * GROUP_LEN, groups * GROUP_LANES);
    for row in 0..rows {
        let source = &x[row * cols..(row + 1) * cols];
        let quants = &mut all_quants[row * quant_stride..(row + 1) * quant_stride];
        let scales = &mut all_scales[row * lane_stride..(row + 1) * lane_stride];
        let sums = &mut all_sums[row * lane_stride..(row + 1) * lane_stride];
        let corrections = &mut all_corrections[row * lane_stride..(row + 1) * lane_stride];
        quants.fill(0);
        scales.fill(0.0);
        sums.fill(0);
        corrections.fill(0);
        for (block, values) in source.chunks_exact(BLOCK_LEN).enumerate() {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (scale, inverse) = block_scale(amax, rule);
            let group = block / GROUP_BLOCKS;
            let j = block % GROUP_BLOCKS;
            let base = group * GROUP_LEN + j * (BLOCK_LEN / 2);
            let mut sum = 0i32;
            for (pair, two) in values.chunks_exact(2).enumerate() {
                let even = (two[0] * inverse).round_even_fast().clamp(-127.0, 127.0) as i8;
                let odd = (two[1] * inverse).round_even_fast().clamp(-127.0, 127.0) as i8;
                quants[base + pair] = even;
                quants[base + GROUP_LEN / 2 + pair] = odd;
                sum += even as i32 + odd as i32;
            }
            let lanes = group * GROUP_LANES + j * 4;
            scales[lanes..lanes + 4].fill(scale);
            sums[lanes] = sum;
            corrections[lanes + CORRECTION_LANE_MXFP4] = -MXFP4_OFFSET * sum;
            corrections[lanes + CORRECTION_LANE_Q4] = -Q4_OFFSET * sum;
            corrections[lanes + CORRECTION_LANE_Q8] = -Q8_OFFSET * sum;
        }
    }
}

/// [`Kernels::split_rows`]' shape check.
pub(super) fn check_split_rows(x: &[f32], cols: usize, out: &[f32]) -> Result<(), KernelError> {
    check_block_cols("activation row", cols)?;
    if !x.len().is_multiple_of(cols) || out.len() < 2 * x.len() {
        return Err(KernelError::Length {
            what: format!("split rows (two rows of {cols} for each input row)"),
            expected: 2 * x.len().div_ceil(cols) * cols,
            got: out.len(),
        });
    }
    Ok(())
}

/// The reference `split_rows`: the SIMD paths give its bits (NaN payloads aside). The first row
/// is quantized with [`ScaleRule::PowerOfTwo`], so that is the rounding whose miss is kept.
pub(super) fn split_rows_portable(x: &[f32], cols: usize, out: &mut [f32]) {
    for (row, pair) in x.chunks_exact(cols).zip(out.chunks_exact_mut(2 * cols)) {
        let (exact, missed) = pair.split_at_mut(cols);
        exact.copy_from_slice(row);
        for (values, rest) in row
            .chunks_exact(BLOCK_LEN)
            .zip(missed.chunks_exact_mut(BLOCK_LEN))
        {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (scale, inverse) = block_scale(amax, ScaleRule::PowerOfTwo);
            for (r, &v) in rest.iter_mut().zip(values) {
                let q = (v * inverse).round_even_fast().clamp(-127.0, 127.0);
                *r = v - q * scale;
            }
        }
    }
}

/// Hand-written activation quantizers, bit for bit the portable loops.
///
/// Why they match, for every input including NaN and infinities:
/// * Block maxima: `f32::max` ignores a NaN argument; `max_ps(a, b)` returns `b` when either is
///   NaN, so folding each `|v|` in as `max_ps(|v|, acc)` from a zero start ignores NaN the same way.
///   The maxima are then combined in a tree, which is exact for non-NaN values in any order.
/// * Scale and inverse are the same IEEE divisions, masked to 0 where the maximum is not positive.
/// * A finite `p = v x inverse` is at most 127 plus two roundings in magnitude (`|v| <= amax`), so
///   `round_even_fast` never takes its `|x| >= 2^22` branch on a finite value and the branchless
///   `(p + 1.5 x 2^23) - 1.5 x 2^23` equals it everywhere, signed zeros included (the split rows
///   need those); for the int8 values `cvtps2dq` gives the same integers, rounding half to even in
///   the default rounding mode, which all Rust float code assumes.
/// * The rest is the clamp (infinities become +-127) and `as i8`, which turns NaN into 0: where
///   `p` is NaN (a NaN input, `inf x 0` when the maximum is infinite, `0 x inf` when it is so
///   small that `127 / amax` overflows) the SIMD code writes 0.
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{
        BLOCK_LEN, CORRECTION_LANE_MXFP4, CORRECTION_LANE_Q4, CORRECTION_LANE_Q8, GROUP_BLOCKS,
        GROUP_LANES, GROUP_LEN, MXFP4_OFFSET, Q4_OFFSET, Q8_OFFSET, ROUND_MAGIC,
    };

    /// A group's lanes of `-offset` per format: multiplied by the block sums they give
    /// `Q8Activations::corrections`.
    const CORRECTION_FACTORS: [i32; GROUP_LANES] = {
        let mut factors = [0; GROUP_LANES];
        let mut j = 0;
        while j < GROUP_BLOCKS {
            factors[4 * j + CORRECTION_LANE_MXFP4] = -MXFP4_OFFSET;
            factors[4 * j + CORRECTION_LANE_Q4] = -Q4_OFFSET;
            factors[4 * j + CORRECTION_LANE_Q8] = -Q8_OFFSET;
            j += 1;
        }
        factors
    };

    /// The int8 values are summed as unsigned bytes (`q ^ 0x80 = q + 128`), then this is taken off.
    const SUM_BIAS: i32 = 128 * BLOCK_LEN as i32;

    /// Rows, groups per row and blocks per row, after checking that the outputs hold whole groups
    /// for every row: the pointer arithmetic below relies on it.
    fn quantize_shape(
        x: &[f32],
        cols: usize,
        quants: &[i8],
        scales: &[f32],
        sums: &[i32],
        corrections: &[i32],
    ) -> (usize, usize, usize) {
        let rows = x.len() / cols;
        let blocks = cols / BLOCK_LEN;
        let groups = blocks.div_ceil(GROUP_BLOCKS);
        assert!(
            quants.len() >= rows * groups * GROUP_LEN
                && scales.len() >= rows * groups * GROUP_LANES
                && sums.len() >= rows * groups * GROUP_LANES
                && corrections.len() >= rows * groups * GROUP_LANES,
            "quantized activation buffers too small for {rows} rows of {cols}"
        );
        (rows, groups, blocks)
    }

    // ---------------------------------------------------------------------------------------------
    // AVX-512: one group (four blocks, eight vectors of 16) at a time.

    /// The eight vectors of a group starting at `src`, zeros past its `blocks` blocks.
    ///
    /// # Safety
    /// `src` points at `blocks * BLOCK_LEN` readable values, `1 <= blocks <= GROUP_BLOCKS`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load_group_512(src: *const f32, blocks: usize) -> [__m512; 8] {
        // SAFETY: the caller upholds this function's contract (`src` points at `blocks * BLOCK_LEN`
        // readable values, `1 <= blocks <= GROUP_BLOCKS`), which is what every pointer access and
        // target-feature call below relies on.
        unsafe {
            let mut v = [_mm512_setzero_ps(); 8];
            if blocks == GROUP_BLOCKS {
                for (i, v) in v.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(src.add(16 * i));
                }
            } else {
                for (i, v) in v.iter_mut().enumerate() {
                    // Masked-off lanes are not read, so the pointer may run past the row.
                    let mask: __mmask16 = if i < 2 * blocks { 0xFFFF } else { 0 };
                    *v = _mm512_maskz_loadu_ps(mask, src.wrapping_add(16 * i));
                }
            }
            v
        }
    }

    /// Block j's scale in lanes 4j..4j+3 and its inverse, each 0 where the block's largest
    /// magnitude is 0; powers of two with `POW2` (`ScaleRule::PowerOfTwo`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn scales_512<const POW2: bool>(v: &[__m512; 8]) -> (__m512, __m512) {
        let zero = _mm512_setzero_ps();
        let m: [__m512; 4] = std::array::from_fn(|j| {
            let first = _mm512_max_ps(_mm512_abs_ps(v[2 * j]), zero);
            _mm512_max_ps(_mm512_abs_ps(v[2 * j + 1]), first)
        });
        // Transpose-and-reduce: first pair 128-bit lanes across blocks, then finish within lanes.
        let p01 = _mm512_max_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(m[0], m[1]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(m[0], m[1]),
        );
        let p23 = _mm512_max_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(m[2], m[3]),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(m[2], m[3]),
        );
        let q = _mm512_max_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(p01, p23),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(p01, p23),
        );
        let q = _mm512_max_ps(q, _mm512_permute_ps::<0b10_11_00_01>(q));
        let amax = _mm512_max_ps(q, _mm512_permute_ps::<0b01_00_11_10>(q));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(amax, zero);
        let limit = _mm512_set1_ps(127.0);
        let tight = _mm512_maskz_div_ps(positive, amax, limit);
        if POW2 {
            // `power_of_two_at_least`, lane by lane (a zero lane stays zero).
            let scale = _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_add_epi32(_mm512_castps_si512(tight), _mm512_set1_epi32(0x007F_FFFF)),
                _mm512_set1_epi32(0xFF80_0000u32 as i32),
            ));
            (
                scale,
                _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0), scale),
            )
        } else {
            (tight, _mm512_maskz_div_ps(positive, limit, amax))
        }
    }

    /// Block j's lanes (4j..4j+3, all equal) broadcast to all sixteen.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn per_block_512(lanes: __m512) -> [__m512; 4] {
        [
            _mm512_shuffle_f32x4::<0x00>(lanes, lanes),
            _mm512_shuffle_f32x4::<0x55>(lanes, lanes),
            _mm512_shuffle_f32x4::<0xAA>(lanes, lanes),
            _mm512_shuffle_f32x4::<0xFF>(lanes, lanes),
        ]
    }

    /// `clamp(round_half_even(v x inverse), -127, 127)` as i32, NaN as 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn quantize_16(v: __m512, inverse: __m512) -> __m512i {
        let p = _mm512_mul_ps(v, inverse);
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(p, p);
        let clamped = _mm512_min_ps(
            _mm512_max_ps(p, _mm512_set1_ps(-127.0)),
            _mm512_set1_ps(127.0),
        );
        _mm512_maskz_cvtps_epi32(ordered, clamped)
    }

    /// Four vectors of i32 in -127..=127 as 64 bytes, in order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pack_bytes_512(q: [__m512i; 4]) -> __m512i {
        let bytes = _mm512_packs_epi16(
            _mm512_packs_epi32(q[0], q[1]),
            _mm512_packs_epi32(q[2], q[3]),
        );
        // The packs work within 128-bit lanes: dword 4k + m holds lane k of q[m].
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_epi32(order, bytes)
    }

    /// # Safety
    /// `src` as for [`load_group_512`]; `quants` points at `GROUP_LEN` writable bytes and
    /// `scales`, `sums`, `corrections` at `GROUP_LANES` writable lanes each.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn quantize_group_512<const POW2: bool>(
        src: *const f32,
        blocks: usize,
        quants: *mut i8,
        scales: *mut f32,
        sums: *mut i32,
        corrections: *mut i32,
    ) {
        // SAFETY: the caller upholds this function's contract (`src` as for [`load_group_512`];
        // `quants` points at `GROUP_LEN` writable bytes and `scales`, `sums`, `corrections` at
        // `GROUP_LANES` writable lanes each), which is what every pointer access and
        // target-feature call below relies on.
        unsafe {
            let v = load_group_512(src, blocks);
            let (scale, inverse) = scales_512::<POW2>(&v);
            let inverses = per_block_512(inverse);
            let evens_index =
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            let odds_index =
                _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            let evens = pack_bytes_512(std::array::from_fn(|j| {
                let e = _mm512_permutex2var_ps(v[2 * j], evens_index, v[2 * j + 1]);
                quantize_16(e, inverses[j])
            }));
            let odds = pack_bytes_512(std::array::from_fn(|j| {
                let o = _mm512_permutex2var_ps(v[2 * j], odds_index, v[2 * j + 1]);
                quantize_16(o, inverses[j])
            }));
            // Block j's 16 evens and 16 odds are 128-bit lane j of each: sum them as unsigned bytes.
            let flip = _mm512_set1_epi8(i8::MIN);
            let zero = _mm512_setzero_si512();
            let partial = _mm512_add_epi64(
                _mm512_sad_epu8(_mm512_xor_si512(evens, flip), zero),
                _mm512_sad_epu8(_mm512_xor_si512(odds, flip), zero),
            );
            let total = _mm512_add_epi64(partial, _mm512_shuffle_epi32::<0b01_00_11_10>(partial));
            // Lanes 4j and 4j + 2 now hold block j's sum (the others garbage).
            let sum = _mm512_sub_epi32(total, _mm512_set1_epi32(SUM_BIAS));
            let factors = _mm512_loadu_si512(CORRECTION_FACTORS.as_ptr().cast());
            _mm512_storeu_si512(quants.cast(), evens);
            _mm512_storeu_si512(quants.add(GROUP_LEN / 2).cast(), odds);
            _mm512_storeu_ps(scales, scale);
            _mm512_storeu_si512(sums.cast(), _mm512_maskz_mov_epi32(0x1111, sum));
            _mm512_storeu_si512(
                corrections.cast(),
                _mm512_mullo_epi32(_mm512_shuffle_epi32::<0>(sum), factors),
            );
        }
    }

    /// The AVX-512 quantizer: same contract and bits as `quantize_rows_portable`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(in crate::kernels) fn quantize_rows_avx512<const POW2: bool>(
        x: &[f32],
        cols: usize,
        quants: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
        corrections: &mut [i32],
    ) {
        let (rows, groups, blocks) = quantize_shape(x, cols, quants, scales, sums, corrections);
        for row in 0..rows {
            for group in 0..groups {
                let here = (blocks - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
                let at = row * groups + group;
                // SAFETY: the group's `here` blocks lie inside row `row` of `x`, and
                // `quantize_shape` checked that every output holds group `at`.
                unsafe {
                    quantize_group_512::<POW2>(
                        x.as_ptr().add(row * cols + group * GROUP_LEN),
                        here,
                        quants.as_mut_ptr().add(at * GROUP_LEN),
                        scales.as_mut_ptr().add(at * GROUP_LANES),
                        sums.as_mut_ptr().add(at * GROUP_LANES),
                        corrections.as_mut_ptr().add(at * GROUP_LANES),
                    )
                }
            }
        }
    }

    /// `v - clamp(round_half_even(v x inverse), -127, 127) x scale`, NaN where the portable code
    /// has NaN.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn missed_16(v: __m512, inverse: __m512, scale: __m512) -> __m512 {
        let magic = _mm512_set1_ps(ROUND_MAGIC);
        let rounded = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inverse), magic), magic);
        // Operand order keeps a NaN (max/min return their second operand if either is NaN).
        let q = _mm512_min_ps(
            _mm512_set1_ps(127.0),
            _mm512_max_ps(_mm512_set1_ps(-127.0), rounded),
        );
        _mm512_sub_ps(v, _mm512_mul_ps(q, scale))
    }

    /// The AVX-512 `split_rows`: same contract and bits as `split_rows_portable`.
    #[target_feature(enable = "avx512f")]
    pub(in crate::kernels) fn split_rows_avx512(x: &[f32], cols: usize, out: &mut [f32]) {
        let rows = x.len() / cols;
        let blocks = cols / BLOCK_LEN;
        assert!(out.len() >= 2 * rows * cols, "split rows output too small");
        for row in 0..rows {
            for group in 0..blocks.div_ceil(GROUP_BLOCKS) {
                let here = (blocks - group * GROUP_BLOCKS).min(GROUP_BLOCKS);
                let offset = row * cols + group * GROUP_LEN;
                // SAFETY: the group's `here` blocks lie inside row `row` of `x`, and inside rows
                // 2 row and 2 row + 1 of `out` at the same column (the assert above).
                unsafe {
                    let v = load_group_512(x.as_ptr().add(offset), here);
                    let (scale, inverse) = scales_512::<true>(&v);
                    let (scales, inverses) = (per_block_512(scale), per_block_512(inverse));
                    let exact = out.as_mut_ptr().add(offset + row * cols);
                    let missed = exact.add(cols);
                    for (i, &v) in v.iter().enumerate() {
                        let r = missed_16(v, inverses[i / 2], scales[i / 2]);
                        if i < 2 * here {
                            _mm512_storeu_ps(exact.add(16 * i), v);
                            _mm512_storeu_ps(missed.add(16 * i), r);
                        }
                    }
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------------------
    // AVX2: half a group (two blocks, eight vectors of 8) at a time.

    /// The eight vectors of two blocks starting at `src`, zeros past its `blocks` blocks.
    ///
    /// # Safety
    /// `src` points at `blocks * BLOCK_LEN` readable values, `blocks <= 2`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_pair_256(src: *const f32, blocks: usize) -> [__m256; 8] {
        // SAFETY: the caller upholds this function's contract (`src` points at `blocks * BLOCK_LEN`
        // readable values, `blocks <= 2`), which is what every pointer access and target-feature
        // call below relies on.
        unsafe {
            let mut v = [_mm256_setzero_ps(); 8];
            for (i, v) in v.iter_mut().enumerate() {
                if i < 4 * blocks {
                    *v = _mm256_loadu_ps(src.add(8 * i));
                }
            }
            v
        }
    }

    /// Block j (of two) scale in lanes 4j..4j+3 and its inverse, 0 where the block is all zeros.
    /// Powers of two with `POW2`, as [`scales_512`].
    #[inline]
    #[target_feature(enable = "avx2")]
    fn scales_256<const POW2: bool>(v: &[__m256; 8]) -> (__m256, __m256) {
        let zero = _mm256_setzero_ps();
        let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
        let m: [__m256; 2] = std::array::from_fn(|j| {
            v[4 * j..4 * j + 4].iter().fold(zero, |acc, &x| {
                _mm256_max_ps(_mm256_and_ps(x, magnitude), acc)
            })
        });
        let x = _mm256_max_ps(
            _mm256_permute2f128_ps::<0x20>(m[0], m[1]),
            _mm256_permute2f128_ps::<0x31>(m[0], m[1]),
        );
        let x = _mm256_max_ps(x, _mm256_permute_ps::<0b10_11_00_01>(x));
        let amax = _mm256_max_ps(x, _mm256_permute_ps::<0b01_00_11_10>(x));
        let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(amax, zero);
        let limit = _mm256_set1_ps(127.0);
        let tight = _mm256_and_ps(_mm256_div_ps(amax, limit), positive);
        if POW2 {
            let scale = _mm256_castsi256_ps(_mm256_and_si256(
                _mm256_add_epi32(_mm256_castps_si256(tight), _mm256_set1_epi32(0x007F_FFFF)),
                _mm256_set1_epi32(0xFF80_0000u32 as i32),
            ));
            (
                scale,
                _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), scale), positive),
            )
        } else {
            (tight, _mm256_and_ps(_mm256_div_ps(limit, amax), positive))
        }
    }

    /// Block j's lanes (4j..4j+3, all equal) broadcast to all eight.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn per_block_256(lanes: __m256) -> [__m256; 2] {
        [
            _mm256_permute2f128_ps::<0x00>(lanes, lanes),
            _mm256_permute2f128_ps::<0x11>(lanes, lanes),
        ]
    }

    /// `clamp(round_half_even(v x inverse), -127, 127)` as i32, NaN as 0.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn quantize_8(v: __m256, inverse: __m256) -> __m256i {
        let p = _mm256_mul_ps(v, inverse);
        let ordered = _mm256_cmp_ps::<_CMP_ORD_Q>(p, p);
        let clamped = _mm256_min_ps(
            _mm256_max_ps(p, _mm256_set1_ps(-127.0)),
            _mm256_set1_ps(127.0),
        );
        _mm256_cvtps_epi32(_mm256_and_ps(clamped, ordered))
    }

    /// # Safety
    /// `src` as for [`load_pair_256`]; `evens` and `odds` point at 32 writable bytes each,
    /// `scales`, `sums` and `corrections` at 8 writable lanes each.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize_pair_256<const POW2: bool>(
        src: *const f32,
        blocks: usize,
        evens: *mut i8,
        odds: *mut i8,
        scales: *mut f32,
        sums: *mut i32,
        corrections: *mut i32,
    ) {
        // SAFETY: the caller upholds this function's contract (`src` as for [`load_pair_256`];
        // `evens` and `odds` point at 32 writable bytes each, `scales`, `sums` and `corrections` at
        // 8 writable lanes each), which is what every pointer access and target-feature call below
        // relies on.
        unsafe {
            let v = load_pair_256(src, blocks);
            let (scale, inverse) = scales_256::<POW2>(&v);
            let inverses = per_block_256(inverse);
            // Each vector's evens to its low half, odds to its high half; after the in-lane packs,
            // block j's 16 evens fill the low 128 bits and its 16 odds the high 128 bits.
            let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
            let q: [__m256i; 8] = std::array::from_fn(|i| {
                quantize_8(_mm256_permutevar8x32_ps(v[i], split), inverses[i / 4])
            });
            let block: [__m256i; 2] = std::array::from_fn(|j| {
                _mm256_packs_epi16(
                    _mm256_packs_epi32(q[4 * j], q[4 * j + 1]),
                    _mm256_packs_epi32(q[4 * j + 2], q[4 * j + 3]),
                )
            });
            let even_bytes = _mm256_permute2x128_si256::<0x20>(block[0], block[1]);
            let odd_bytes = _mm256_permute2x128_si256::<0x31>(block[0], block[1]);
            let flip = _mm256_set1_epi8(i8::MIN);
            let zero = _mm256_setzero_si256();
            let partial = _mm256_add_epi64(
                _mm256_sad_epu8(_mm256_xor_si256(even_bytes, flip), zero),
                _mm256_sad_epu8(_mm256_xor_si256(odd_bytes, flip), zero),
            );
            let total = _mm256_add_epi64(partial, _mm256_shuffle_epi32::<0b01_00_11_10>(partial));
            // Lanes 4j and 4j + 2 now hold block j's sum (the others garbage).
            let sum = _mm256_sub_epi32(total, _mm256_set1_epi32(SUM_BIAS));
            let factors = _mm256_loadu_si256(CORRECTION_FACTORS.as_ptr().cast());
            _mm256_storeu_si256(evens.cast(), even_bytes);
            _mm256_storeu_si256(odds.cast(), odd_bytes);
            _mm256_storeu_ps(scales, scale);
            _mm256_storeu_si256(sums.cast(), _mm256_blend_epi32::<0x11>(zero, sum));
            _mm256_storeu_si256(
                corrections.cast(),
                _mm256_mullo_epi32(_mm256_shuffle_epi32::<0>(sum), factors),
            );
        }
    }

    /// The AVX2 quantizer: same contract and bits as `quantize_rows_portable`.
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) fn quantize_rows_avx2<const POW2: bool>(
        x: &[f32],
        cols: usize,
        quants: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
        corrections: &mut [i32],
    ) {
        let (rows, groups, blocks) = quantize_shape(x, cols, quants, scales, sums, corrections);
        for row in 0..rows {
            for group in 0..groups {
                let at = row * groups + group;
                for half in 0..2 {
                    let first = group * GROUP_BLOCKS + 2 * half;
                    let here = blocks.saturating_sub(first).min(2);
                    // SAFETY: the pair's `here` blocks lie inside row `row` of `x` (the pointer is
                    // not read when `here` is 0), and `quantize_shape` checked that every output
                    // holds group `at`, whose halves these are.
                    unsafe {
                        let quants = quants.as_mut_ptr().add(at * GROUP_LEN + 32 * half);
                        let lanes = at * GROUP_LANES + 8 * half;
                        quantize_pair_256::<POW2>(
                            x.as_ptr().wrapping_add(row * cols + first * BLOCK_LEN),
                            here,
                            quants,
                            quants.add(GROUP_LEN / 2),
                            scales.as_mut_ptr().add(lanes),
                            sums.as_mut_ptr().add(lanes),
                            corrections.as_mut_ptr().add(lanes),
                        )
                    }
                }
            }
        }
    }

    /// As [`missed_16`], eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn missed_8(v: __m256, inverse: __m256, scale: __m256) -> __m256 {
        let magic = _mm256_set1_ps(ROUND_MAGIC);
        let rounded = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, inverse), magic), magic);
        let q = _mm256_min_ps(
            _mm256_set1_ps(127.0),
            _mm256_max_ps(_mm256_set1_ps(-127.0), rounded),
        );
        _mm256_sub_ps(v, _mm256_mul_ps(q, scale))
    }

    /// The AVX2 `split_rows`: same contract and bits as `split_rows_portable`.
    #[target_feature(enable = "avx2")]
    pub(in crate::kernels) fn split_rows_avx2(x: &[f32], cols: usize, out: &mut [f32]) {
        let rows = x.len() / cols;
        let blocks = cols / BLOCK_LEN;
        assert!(out.len() >= 2 * rows * cols, "split rows output too small");
        for row in 0..rows {
            for first in (0..blocks).step_by(2) {
                let here = (blocks - first).min(2);
                let offset = row * cols + first * BLOCK_LEN;
                // SAFETY: the pair's `here` blocks lie inside row `row` of `x`, and inside rows
                // 2 row and 2 row + 1 of `out` at the same column (the assert above).
                unsafe {
                    let v = load_pair_256(x.as_ptr().add(offset), here);
                    let (scale, inverse) = scales_256::<true>(&v);
                    let (scales, inverses) = (per_block_256(scale), per_block_256(inverse));
                    let exact = out.as_mut_ptr().add(offset + row * cols);
                    let missed = exact.add(cols);
                    for (i, &v) in v.iter().enumerate() {
                        let r = missed_8(v, inverses[i / 4], scales[i / 4]);
                        if i < 4 * here {
                            _mm256_storeu_ps(exact.add(8 * i), v);
                            _mm256_storeu_ps(missed.add(8 * i), r);
                        }
                    }
                }
            }
        }
    }
}

/// An MXFP4 matrix `[rows, cols]` borrowed zero-copy from the checkpoint.
///
/// `blocks`: `rows x cols/32 x 16` bytes; element k of row r is in byte `r*(cols/2) + k/2`, low nibble
/// for even k. `scales`: `rows x cols/32` E8M0 bytes.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) blocks: &'a [u8],
    pub(super) scales: &'a [u8],
    pub(super) layout: Mxfp4Layout,
}

/// Rows per tile of the [`Mxfp4Layout::Tiles`] layout: one 512-bit vector holds a dword of each.
pub const MXFP4_TILE_ROWS: usize = 16;

/// Where a tile kernel writes tile `tile`'s lane 0 for token 0: `out` for row `first_row` of a
/// buffer whose first row is `rows_start`, before the buffer when the tile starts before the
/// rows (only lanes inside are ever written).
#[inline(always)]
pub(super) fn tile_out(out: &mut [f32], first_row: usize, rows_start: usize) -> *mut f32 {
    out.as_mut_ptr()
        .wrapping_add(first_row)
        .wrapping_sub(rows_start)
}

/// The rows of tile `tile` that `rows` covers, as lanes (0..[`MXFP4_TILE_ROWS`]).
#[inline(always)]
pub(super) fn tile_lanes(tile: usize, rows: &std::ops::Range<usize>) -> std::ops::Range<usize> {
    let first_row = tile * MXFP4_TILE_ROWS;
    rows.start.saturating_sub(first_row)..(rows.end - first_row).min(MXFP4_TILE_ROWS)
}

/// How an [`Mxfp4Matrix`]'s bytes are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mxfp4Layout {
    /// The checkpoint's order: row after row, each row's blocks in column order.
    Rows,
    /// Tiles of [`MXFP4_TILE_ROWS`] rows, each block's bytes transposed by dword: for tile τ,
    /// block b and dword s (bytes 4s..4s+4 of a row's 16-byte block), 64 bytes hold that dword of
    /// rows 16τ..16τ+16 in order; scales likewise, 16 bytes per (tile, block), one per row.
    ///
    /// Why: a product's integer sums need a block's eight dwords in one lane. In row order a
    /// vector holds one row's four blocks, so every 8 `vpdpbusd` of a token come with 4 float
    /// conversions, scales and FMAs (one per block per lane group) or a fold across lanes; here a
    /// vector is one dword of 16 rows, so a block of 16 rows and a token takes 8 `vpdpbusd` and
    /// one convert, scale and FMA, with no transpose at run time. Same bytes, reordered:
    /// [`tile_mxfp4`] does it once at load.
    Tiles,
}

impl<'a> Mxfp4Matrix<'a> {
    /// Check the byte counts against the shape.
    pub fn new(
        rows: usize,
        cols: usize,
        blocks: &'a [u8],
        scales: &'a [u8],
    ) -> Result<Self, KernelError> {
        check_block_cols("MXFP4 matrix", cols)?;
        check_len(
            "MXFP4 blocks (rows x cols/2 bytes)",
            blocks.len(),
            rows * cols / 2,
        )?;
        check_len(
            "MXFP4 scales (rows x cols/32 bytes)",
            scales.len(),
            rows * cols / BLOCK_LEN,
        )?;
        Ok(Self {
            rows,
            cols,
            blocks,
            scales,
            layout: Mxfp4Layout::Rows,
        })
    }

    /// A matrix whose bytes [`tile_mxfp4`] reordered into [`Mxfp4Layout::Tiles`]; `rows` a
    /// multiple of [`MXFP4_TILE_ROWS`].
    pub fn new_tiled(
        rows: usize,
        cols: usize,
        blocks: &'a [u8],
        scales: &'a [u8],
    ) -> Result<Self, KernelError> {
        check_tile_rows(rows)?;
        Ok(Self {
            layout: Mxfp4Layout::Tiles,
            ..Self::new(rows, cols, blocks, scales)?
        })
    }

    pub fn layout(&self) -> Mxfp4Layout {
        self.layout
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Nibble of element `k` of row `r`.
    #[inline]
    pub(crate) fn nibble(&self, row: usize, k: usize) -> u8 {
        let byte = self.blocks[match self.layout {
            Mxfp4Layout::Rows => row * (self.cols / 2) + k / 2,
            Mxfp4Layout::Tiles => tiled_byte(self.cols, row, k / 2),
        }];
        if k.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        }
    }

    #[inline]
    pub(crate) fn scale_byte(&self, row: usize, block: usize) -> u8 {
        let blocks_per_row = self.cols / BLOCK_LEN;
        self.scales[match self.layout {
            Mxfp4Layout::Rows => row * blocks_per_row + block,
            Mxfp4Layout::Tiles => tiled_scale(blocks_per_row, row, block),
        }]
    }

    /// Where tile `tile`'s bytes start: its 64-byte dword vectors, then its scale bytes.
    #[inline(always)]
    pub(crate) fn tile_offsets(&self, tile: usize) -> (usize, usize) {
        nibble_tile_offsets(self.cols, tile)
    }

    /// Row `row` as f32, exactly as the spec defines it (`FP4_E2M1[nibble] x e8m0_scale(s)`).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                what: "MXFP4 row".to_string(),
                row,
                rows: self.rows,
            });
        }
        check_len("dequantized MXFP4 row", out.len(), self.cols)?;
        for (k, value) in out.iter_mut().enumerate() {
            *value = FP4_E2M1[self.nibble(row, k) as usize]
                * e8m0_scale(self.scale_byte(row, k / BLOCK_LEN));
        }
        Ok(())
    }
}

fn check_tile_rows(rows: usize) -> Result<(), KernelError> {
    if !rows.is_multiple_of(MXFP4_TILE_ROWS) {
        return Err(KernelError::Length {
            what: format!("rows of a tiled matrix (a multiple of {MXFP4_TILE_ROWS})"),
            expected: rows.div_ceil(MXFP4_TILE_ROWS) * MXFP4_TILE_ROWS,
            got: rows,
        });
    }
    Ok(())
}

/// Index in [`Mxfp4Layout::Tiles`] order of byte `byte` (0..cols/2) of row `row`.
#[inline(always)]
fn tiled_byte(cols: usize, row: usize, byte: usize) -> usize {
    let blocks_per_row = cols / BLOCK_LEN;
    let (tile, r) = (row / MXFP4_TILE_ROWS, row % MXFP4_TILE_ROWS);
    let (block, in_block) = (byte / (BLOCK_LEN / 2), byte % (BLOCK_LEN / 2));
    let (dword, in_dword) = (in_block / 4, in_block % 4);
    ((tile * blocks_per_row + block) * 4 + dword) * (4 * MXFP4_TILE_ROWS) + r * 4 + in_dword
}

/// Index in [`Mxfp4Layout::Tiles`] order of the scale of `block` of `row`.
#[inline(always)]
fn tiled_scale(blocks_per_row: usize, row: usize, block: usize) -> usize {
    let (tile, r) = (row / MXFP4_TILE_ROWS, row % MXFP4_TILE_ROWS);
    (tile * blocks_per_row + block) * MXFP4_TILE_ROWS + r
}

/// Reorders an MXFP4 matrix of `rows x cols` from the checkpoint's row order (`blocks`,
/// `scales`) into [`Mxfp4Layout::Tiles`] (`tiled_blocks`, `tiled_scales`, the same sizes).
/// Matrices stacked back to back (a tensor of experts) can be reordered in one call when each
/// one's rows are a multiple of [`MXFP4_TILE_ROWS`]: tiles never cross a matrix.
pub fn tile_mxfp4(
    rows: usize,
    cols: usize,
    blocks: &[u8],
    scales: &[u8],
    tiled_blocks: &mut [u8],
    tiled_scales: &mut [u8],
) -> Result<(), KernelError> {
    check_tile_rows(rows)?;
    let source = Mxfp4Matrix::new(rows, cols, blocks, scales)?;
    check_len("tiled MXFP4 blocks", tiled_blocks.len(), blocks.len())?;
    check_len("tiled MXFP4 scales", tiled_scales.len(), scales.len())?;
    let (row_bytes, blocks_per_row) = (cols / 2, cols / BLOCK_LEN);
    for tile in 0..rows / MXFP4_TILE_ROWS {
        let first = tile * MXFP4_TILE_ROWS;
        let (bytes_at, scales_at) = nibble_tile_offsets(cols, tile);
        transpose_tile(
            |r| &source.blocks[(first + r) * row_bytes..(first + r + 1) * row_bytes],
            |r| &source.scales[(first + r) * blocks_per_row..(first + r + 1) * blocks_per_row],
            &mut tiled_blocks[bytes_at..bytes_at + MXFP4_TILE_ROWS * row_bytes],
            &mut tiled_scales[scales_at..scales_at + MXFP4_TILE_ROWS * blocks_per_row],
        );
    }
    Ok(())
}

/// Where tile `tile` of a tiled nibble matrix (MXFP4, Q4) of `cols` columns starts: its 64-byte
/// dword vectors and its scales (in elements).
#[inline(always)]
fn nibble_tile_offsets(cols: usize, tile: usize) -> (usize, usize) {
    let blocks_per_row = cols / BLOCK_LEN;
    (
        tile * blocks_per_row * MXFP4_TILE_ROWS * BLOCK_LEN / 2,
        tile * blocks_per_row * MXFP4_TILE_ROWS,
    )
}

/// One tile of a nibble matrix from its 16 rows in row order (`bytes(r)`: row r's packed
/// nibbles, `scales(r)`: its block scales): dword d of row r goes to vector d of the tile, lane
/// r, and scale b of row r to `scales_out[b * 16 + r]`.
fn transpose_tile<'a, S: Copy + 'a>(
    bytes: impl Fn(usize) -> &'a [u8],
    scales: impl Fn(usize) -> &'a [S],
    bytes_out: &mut [u8],
    scales_out: &mut [S],
) {
    for r in 0..MXFP4_TILE_ROWS {
        for (d, four) in bytes(r).chunks_exact(4).enumerate() {
            let to = d * 4 * MXFP4_TILE_ROWS + r * 4;
            bytes_out[to..to + 4].copy_from_slice(four);
        }
        for (b, &scale) in scales(r).iter().enumerate() {
            scales_out[b * MXFP4_TILE_ROWS + r] = scale;
        }
    }
}

fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Weights quantized to int8 blocks of 32 with an f16 scale per block (8.5 bits per weight).
///
/// Symmetric: `w ~ d x q`, `d = max|w| / 127`, q in -127..=127. Rows are stored group-interleaved like
/// [`Q8Activations`] and padded to whole groups (2880 columns: 2.2% more bytes) so no kernel has a
/// ragged tail.
#[derive(Clone, Debug)]
pub struct Q8Matrix {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) groups: usize,
    /// `rows x groups x 128`.
    pub(super) quants: AlignedVec<i8>,
    /// `rows x groups x 4`; padding blocks have scale 0.
    pub(super) scales: Vec<f16>,
    /// In the tile layout ([`Q8Matrix::to_tiles`]) instead of row order.
    pub(super) tiled: bool,
    /// [`Q8Matrix::scale_exponents`] of each band of 16 rows, found on first use.
    pub(super) scale_exponents: OnceLock<Vec<Option<(u32, u32)>>>,
}

/// Weights quantized to 4-bit blocks of 32 with an f16 scale per block (4.5 bits per weight).
///
/// Symmetric, like GGML's Q4_0: with m the block's value of largest magnitude, `d = m / -8` and
/// `q = round(w / d)` clamped to -8..=7, stored as the nibble `q + 8`. Nibbles follow the MXFP4 order
/// (16 bytes per block, low nibble = even element); rows are padded to whole groups.
#[derive(Clone, Debug)]
pub struct Q4Matrix {
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) groups: usize,
    /// Row order: `rows x groups x 64`. Tiled: `rows x cols / 2`, no padding blocks.
    pub(super) nibbles: AlignedVec<u8>,
    /// Row order: `rows x groups x 4`, padding blocks with scale 0. Tiled: `rows x cols / 32`.
    pub(super) scales: Vec<f16>,
    /// In the tile layout ([`Q4Matrix::to_tiles`]) instead of row order.
    pub(super) tiled: bool,
}

fn check_bf16_input(what: &str, rows: usize, cols: usize, len: usize) -> Result<(), KernelError> {
    check_block_cols(what, cols)?;
    check_len(&format!("{what} bf16 data (rows x cols)"), len, rows * cols)
}

impl Q8Matrix {
    /// A matrix from its stored form: `quants` group-interleaved int8 rows padded to whole groups
    /// (`rows x ceil(cols / 128) x 128`), `scales` one f16 per block of those rows. The lengths are
    /// checked against the shape, since the kernels read whole groups of every row.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        quants: &[i8],
        scales: Vec<f16>,
    ) -> Result<Self, KernelError> {
        check_block_cols("Q8 matrix", cols)?;
        let groups = groups_for(cols);
        check_len(
            "Q8 quants (rows x groups x 128)",
            quants.len(),
            rows * groups * GROUP_LEN,
        )?;
        check_len(
            "Q8 scales (rows x groups x 4)",
            scales.len(),
            rows * groups * GROUP_BLOCKS,
        )?;
        Ok(Self {
            rows,
            cols,
            groups,
            quants: AlignedVec::from_slice(quants),
            scales,
            tiled: false,
            scale_exponents: OnceLock::new(),
        })
    }

    /// A matrix from ggml's Q8_0 blocks as GGUF files store them, row-major: per 32 values an f16
    /// scale `d` (little-endian), then 32 int8 `q`; value `d x q`. That is this format's own
    /// block, so quants and scales are placed, never recomputed: the matrix holds the file's
    /// weights bit for bit. Rows are placed in parallel on the current rayon pool.
    pub fn from_ggml_q8_0(rows: usize, cols: usize, blocks: &[u8]) -> Result<Self, KernelError> {
        const GGML_BLOCK_BYTES: usize = 2 + BLOCK_LEN;
        check_block_cols("Q8 matrix", cols)?;
        let row_bytes = cols / BLOCK_LEN * GGML_BLOCK_BYTES;
        check_len(
            "Q8_0 blocks (rows x cols / 32 x 34 bytes)",
            blocks.len(),
            rows * row_bytes,
        )?;
        let groups = groups_for(cols);
        let mut quants = AlignedVec::filled(rows * groups * GROUP_LEN, 0i8);
        let mut scales = vec![f16::ZERO; rows * groups * GROUP_BLOCKS];
        quants
            .par_chunks_mut(groups * GROUP_LEN)
            .zip(scales.par_chunks_mut(groups * GROUP_BLOCKS))
            .zip(blocks.par_chunks(row_bytes))
            .for_each(|((row_quants, row_scales), source)| {
                for (block, bytes) in source.chunks_exact(GGML_BLOCK_BYTES).enumerate() {
                    row_scales[block] = f16::from_le_bytes([bytes[0], bytes[1]]);
                    for (e, &q) in bytes[2..].iter().enumerate() {
                        row_quants[interleaved_position(block * BLOCK_LEN + e)] = q as i8;
                    }
                }
            });
        quants.collapse_huge_pages();
        Ok(Self {
            rows,
            cols,
            groups,
            quants,
            scales,
            tiled: false,
            scale_exponents: OnceLock::new(),
        })
    }

    /// Quantize a row-major bf16 matrix (raw bits); rows are quantized in parallel on the rayon pool.
    pub fn from_bf16(rows: usize, cols: usize, data: &[u16]) -> Result<Self, KernelError> {
        check_bf16_input("Q8 matrix", rows, cols, data.len())?;
        let groups = groups_for(cols);
        let mut quants = AlignedVec::filled(rows * groups * GROUP_LEN, 0i8);
        let mut scales = vec![f16::ZERO; rows * groups * GROUP_BLOCKS];
        quants
            .par_chunks_mut(groups * GROUP_LEN)
            .zip(scales.par_chunks_mut(groups * GROUP_BLOCKS))
            .zip(data.par_chunks(cols))
            .for_each(|((row_quants, row_scales), source)| {
                for (block, values) in source.chunks_exact(BLOCK_LEN).enumerate() {
                    let amax = values
                        .iter()
                        .fold(0.0f32, |m, &v| m.max(bf16_to_f32(v).abs()));
                    let scale = f16::from_f32(amax / 127.0);
                    let stored = scale.to_f32();
                    let inverse = if stored > 0.0 { 1.0 / stored } else { 0.0 };
                    row_scales[block] = scale;
                    for (e, &v) in values.iter().enumerate() {
                        let q = (bf16_to_f32(v) * inverse)
                            .round_even_fast()
                            .clamp(-127.0, 127.0);
                        row_quants[interleaved_position(block * BLOCK_LEN + e)] = q as i8;
                    }
                }
            });
        quants.collapse_huge_pages();
        Ok(Self {
            rows,
            cols,
            groups,
            quants,
            scales,
            tiled: false,
            scale_exponents: OnceLock::new(),
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data (quants and scales).
    pub fn size_bytes(&self) -> usize {
        self.quants.len() + 2 * self.scales.len()
    }

    /// Row `row`'s int8 values in the group-interleaved order; row-order matrices only.
    pub(crate) fn row_quants(&self, row: usize) -> &[i8] {
        debug_assert!(!self.tiled, "row slices of a tiled Q8 matrix");
        let stride = self.groups * GROUP_LEN;
        &self.quants[row * stride..(row + 1) * stride]
    }

    /// Row `row`'s block scales; row-order matrices only.
    pub(crate) fn row_scales(&self, row: usize) -> &[f16] {
        debug_assert!(!self.tiled, "row slices of a tiled Q8 matrix");
        let stride = self.groups * GROUP_BLOCKS;
        &self.scales[row * stride..(row + 1) * stride]
    }

    /// Whether the matrix is in the tile layout.
    pub fn is_tiled(&self) -> bool {
        self.tiled
    }

    /// The int8 value at group-interleaved position `p` of row `row`, in either layout.
    #[inline]
    pub(crate) fn quant(&self, row: usize, p: usize) -> i8 {
        if self.tiled {
            let (group, in_group) = (p / GROUP_LEN, p % GROUP_LEN);
            let at = self.tile_vector(row / MXFP4_TILE_ROWS, group, in_group / 4)
                + (row % MXFP4_TILE_ROWS) * 4
                + in_group % 4;
            (self.quants[at] as u8 ^ 0x80) as i8
        } else {
            self.quants[row * self.groups * GROUP_LEN + p]
        }
    }

    /// The biased f32 exponents of the lowest and highest scale over every block of `rows`
    /// (padding blocks aside), `None` if one is zero, negative or not finite, or there are none:
    /// what the AVX-512 kernels check before they scale power-of-two activations by adding
    /// exponents. Kept per band of 16 rows (a tile), found once in parallel on the current
    /// pool, so an all-zero block turns the exponent add off for its own tile only.
    pub(crate) fn scale_exponents(&self, rows: Range<usize>) -> Option<(u32, u32)> {
        let bands = self.scale_exponents.get_or_init(|| {
            let blocks = self.cols / BLOCK_LEN;
            let row_range = |row: usize| {
                (0..blocks).try_fold((u32::MAX, 0), |(low, high), block| {
                    // The sign bit lands above the exponent: a negative scale fails too.
                    let exponent = self.scale(row, block).to_f32().to_bits() >> 23;
                    (exponent != 0 && exponent < 255)
                        .then(|| (low.min(exponent), high.max(exponent)))
                })
            };
            (0..self.rows.div_ceil(MXFP4_TILE_ROWS))
                .into_par_iter()
                .map(|band| {
                    let band_rows =
                        band * MXFP4_TILE_ROWS..((band + 1) * MXFP4_TILE_ROWS).min(self.rows);
                    band_rows
                        .map(row_range)
                        .try_fold((u32::MAX, 0), |(low, high), range| {
                            range.map(|(l, h)| (low.min(l), high.max(h)))
                        })
                })
                .collect()
        });
        let (start, end) = (rows.start.min(self.rows), rows.end.min(self.rows));
        if start >= end || self.cols < BLOCK_LEN {
            return None;
        }
        bands[start / MXFP4_TILE_ROWS..end.div_ceil(MXFP4_TILE_ROWS)]
            .iter()
            .try_fold((u32::MAX, 0), |(low, high), band| {
                band.map(|(l, h)| (low.min(l), high.max(h)))
            })
    }

    /// The scale of block `block` of row `row`, in either layout.
    #[inline]
    pub(crate) fn scale(&self, row: usize, block: usize) -> f16 {
        if self.tiled {
            self.scales[self.tile_scales(row / MXFP4_TILE_ROWS, block) + row % MXFP4_TILE_ROWS]
        } else {
            self.scales[row * self.groups * GROUP_BLOCKS + block]
        }
    }

    /// In the tile layout: where the 64-byte vector of dword `dword` (0..32) of `group` of tile
    /// `tile` starts.
    #[inline(always)]
    pub(crate) fn tile_vector(&self, tile: usize, group: usize, dword: usize) -> usize {
        ((tile * self.groups + group) * (GROUP_LEN / 4) + dword) * (4 * MXFP4_TILE_ROWS)
    }

    /// In the tile layout: where the 16 scales of block `block` of tile `tile` start.
    #[inline(always)]
    pub(crate) fn tile_scales(&self, tile: usize, block: usize) -> usize {
        (tile * self.groups * GROUP_BLOCKS + block) * MXFP4_TILE_ROWS
    }

    /// The same matrix in the tile layout, for kernels that prefer it
    /// ([`super::Kernels::prefers_tiled_q8`]): tiles of 16 rows in which each 64-byte vector is
    /// one dword (four int8 values of a block, in the group-interleaved order) of the 16 rows,
    /// stored plus 128 as the unsigned operand `vpdpbusd` takes, and 16 f16 scales per (tile,
    /// block). A block's sums for 16 rows then build up in one register per token, with no
    /// decode and no transpose: the reason [`Mxfp4Layout::Tiles`] exists, and more so here, where
    /// the row-order GEMM transposes two register files per tile. Needs rows in whole tiles.
    pub fn to_tiles(&self) -> Result<Q8Matrix, KernelError> {
        check_tile_rows(self.rows)?;
        if self.tiled {
            return Ok(self.clone());
        }
        let mut tiled = Q8Matrix {
            rows: self.rows,
            cols: self.cols,
            groups: self.groups,
            quants: AlignedVec::filled(self.quants.len(), 0i8),
            scales: vec![f16::ZERO; self.scales.len()],
            tiled: true,
            scale_exponents: OnceLock::new(),
        };
        let dwords = GROUP_LEN / 4;
        let tile_bytes = MXFP4_TILE_ROWS * self.groups * GROUP_LEN;
        let tile_scales = MXFP4_TILE_ROWS * self.groups * GROUP_BLOCKS;
        let (groups, blocks) = (self.groups, self.groups * GROUP_BLOCKS);
        tiled
            .quants
            .par_chunks_mut(tile_bytes)
            .zip(tiled.scales.par_chunks_mut(tile_scales))
            .enumerate()
            .for_each(|(tile, (quants, scales))| {
                for r in 0..MXFP4_TILE_ROWS {
                    let row = tile * MXFP4_TILE_ROWS + r;
                    let source =
                        &self.quants[row * groups * GROUP_LEN..(row + 1) * groups * GROUP_LEN];
                    for (d, four) in source.chunks_exact(4).enumerate() {
                        let (group, dword) = (d / dwords, d % dwords);
                        let to = (group * dwords + dword) * 4 * MXFP4_TILE_ROWS + r * 4;
                        for (i, &q) in four.iter().enumerate() {
                            quants[to + i] = (q as u8 ^ 0x80) as i8;
                        }
                    }
                    for b in 0..blocks {
                        scales[b * MXFP4_TILE_ROWS + r] = self.scales[row * blocks + b];
                    }
                }
            });
        tiled.quants.collapse_huge_pages();
        // Found now, at load, rather than by the first product that asks (a vocabulary-sized
        // matrix holds millions of scales).
        let _ = tiled.scale_exponents(0..tiled.rows);
        Ok(tiled)
    }

    /// Row `row` as f32 (scale x int8), natural element order.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                what: "Q8 row".to_string(),
                row,
                rows: self.rows,
            });
        }
        check_len("dequantized Q8 row", out.len(), self.cols)?;
        for (k, value) in out.iter_mut().enumerate() {
            *value = self.quant(row, interleaved_position(k)) as f32
                * self.scale(row, k / BLOCK_LEN).to_f32();
        }
        Ok(())
    }
}

impl Q4Matrix {
    /// A matrix from its stored form: `nibbles` rows padded to whole groups
    /// (`rows x ceil(cols / 128) x 64` bytes, nibble `q + 8`), `scales` one f16 per block of those
    /// rows. The lengths are checked against the shape, since the kernels read whole groups.
    pub fn from_parts(
        rows: usize,
        cols: usize,
        nibbles: &[u8],
        scales: Vec<f16>,
    ) -> Result<Self, KernelError> {
        check_block_cols("Q4 matrix", cols)?;
        let groups = groups_for(cols);
        check_len(
            "Q4 nibbles (rows x groups x 64)",
            nibbles.len(),
            rows * groups * GROUP_LEN / 2,
        )?;
        check_len(
            "Q4 scales (rows x groups x 4)",
            scales.len(),
            rows * groups * GROUP_BLOCKS,
        )?;
        Ok(Self {
            rows,
            cols,
            groups,
            nibbles: AlignedVec::from_slice(nibbles),
            scales,
            tiled: false,
        })
    }

    /// Quantize a row-major bf16 matrix (raw bits); rows are quantized in parallel on the rayon pool.
    pub fn from_bf16(rows: usize, cols: usize, data: &[u16]) -> Result<Self, KernelError> {
        check_bf16_input("Q4 matrix", rows, cols, data.len())?;
        let groups = groups_for(cols);
        let mut nibbles = AlignedVec::filled(rows * groups * GROUP_LEN / 2, 0u8);
        let mut scales = vec![f16::ZERO; rows * groups * GROUP_BLOCKS];
        nibbles
            .par_chunks_mut(groups * GROUP_LEN / 2)
            .zip(scales.par_chunks_mut(groups * GROUP_BLOCKS))
            .zip(data.par_chunks(cols))
            .for_each(|((row_nibbles, row_scales), source)| {
                // Padding blocks stay at nibble 8 (q = 0) so every stored nibble decodes to a real value.
                row_nibbles.fill(0x88);
                for (block, values) in source.chunks_exact(BLOCK_LEN).enumerate() {
                    let extreme = values.iter().map(|&v| bf16_to_f32(v)).fold(0.0f32, |m, v| {
                        if v.abs() > m.abs() {
                            v
                        } else {
                            m
                        }
                    });
                    let scale = f16::from_f32(extreme / -8.0);
                    let stored = scale.to_f32();
                    let inverse = if stored != 0.0 { 1.0 / stored } else { 0.0 };
                    row_scales[block] = scale;
                    let base = block * BLOCK_LEN / 2;
                    for (pair, two) in values.chunks_exact(2).enumerate() {
                        let quantize = |v: u16| {
                            ((bf16_to_f32(v) * inverse)
                                .round_even_fast()
                                .clamp(-8.0, 7.0) as i32
                                + Q4_OFFSET) as u8
                        };
                        row_nibbles[base + pair] = quantize(two[0]) | (quantize(two[1]) << 4);
                    }
                }
            });
        nibbles.collapse_huge_pages();
        Ok(Self {
            rows,
            cols,
            groups,
            nibbles,
            scales,
            tiled: false,
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of weight data (nibbles and scales).
    pub fn size_bytes(&self) -> usize {
        self.nibbles.len() + 2 * self.scales.len()
    }

    /// Row `row`'s nibbles, groups padded; row-order matrices only.
    pub(crate) fn row_nibbles(&self, row: usize) -> &[u8] {
        debug_assert!(!self.tiled, "row slices of a tiled Q4 matrix");
        let stride = self.groups * GROUP_LEN / 2;
        &self.nibbles[row * stride..(row + 1) * stride]
    }

    /// Row `row`'s block scales, groups padded; row-order matrices only.
    pub(crate) fn row_scales(&self, row: usize) -> &[f16] {
        debug_assert!(!self.tiled, "row slices of a tiled Q4 matrix");
        let stride = self.groups * GROUP_BLOCKS;
        &self.scales[row * stride..(row + 1) * stride]
    }

    /// Whether the matrix is in the tile layout.
    pub fn is_tiled(&self) -> bool {
        self.tiled
    }

    /// The scale of block `block` of row `row`, in either layout.
    #[inline]
    pub(crate) fn scale(&self, row: usize, block: usize) -> f16 {
        if self.tiled {
            self.scales[tiled_scale(self.cols / BLOCK_LEN, row, block)]
        } else {
            self.row_scales(row)[block]
        }
    }

    /// In the tile layout: where tile `tile`'s nibble vectors and its scales start.
    #[inline(always)]
    pub(crate) fn tile_offsets(&self, tile: usize) -> (usize, usize) {
        nibble_tile_offsets(self.cols, tile)
    }

    /// The same matrix in the tile layout of [`Mxfp4Layout::Tiles`] (the nibbles are in MXFP4's
    /// order already), with 16 f16 scales per (tile, block) and the padding blocks dropped, for
    /// kernels that prefer it ([`super::Kernels::prefers_tiled_q4`]): a block's sums for 16 rows
    /// build up in one register per token, where the row-order GEMM transposes register files
    /// per tile. Needs rows in whole tiles.
    pub fn to_tiles(&self) -> Result<Q4Matrix, KernelError> {
        check_tile_rows(self.rows)?;
        if self.tiled {
            return Ok(self.clone());
        }
        let blocks_per_row = self.cols / BLOCK_LEN;
        let (row_bytes, tile_bytes) = (self.cols / 2, MXFP4_TILE_ROWS * self.cols / 2);
        let mut tiled = Q4Matrix {
            rows: self.rows,
            cols: self.cols,
            groups: self.groups,
            nibbles: AlignedVec::filled(self.rows * row_bytes, 0u8),
            scales: vec![f16::ZERO; self.rows * blocks_per_row],
            tiled: true,
        };
        tiled
            .nibbles
            .par_chunks_mut(tile_bytes)
            .zip(
                tiled
                    .scales
                    .par_chunks_mut(MXFP4_TILE_ROWS * blocks_per_row),
            )
            .enumerate()
            .for_each(|(tile, (nibbles, scales))| {
                // The row order's padding blocks are left behind.
                let row = |r: usize| tile * MXFP4_TILE_ROWS + r;
                transpose_tile(
                    |r| &self.row_nibbles(row(r))[..row_bytes],
                    |r| &self.row_scales(row(r))[..blocks_per_row],
                    nibbles,
                    scales,
                );
            });
        tiled.nibbles.collapse_huge_pages();
        Ok(tiled)
    }

    /// Signed value (-8..=7) of element `k` of row `row`, in either layout.
    pub(crate) fn value(&self, row: usize, k: usize) -> i32 {
        let byte = if self.tiled {
            self.nibbles[tiled_byte(self.cols, row, k / 2)]
        } else {
            self.row_nibbles(row)[k / 2]
        };
        let nibble = if k.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        };
        nibble as i32 - Q4_OFFSET
    }

    /// Row `row` as f32 (scale x q), natural element order.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) -> Result<(), KernelError> {
        if row >= self.rows {
            return Err(KernelError::RowOutOfRange {
                what: "Q4 row".to_string(),
                row,
                rows: self.rows,
            });
        }
        check_len("dequantized Q4 row", out.len(), self.cols)?;
        for (k, value) in out.iter_mut().enumerate() {
            *value = self.value(row, k) as f32 * self.scale(row, k / BLOCK_LEN).to_f32();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KernelPath;

    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Column counts of every tail (1, 3, 1 and 2 blocks past whole groups, and whole groups) with
    /// the model's 2880.
    const RAGGED_COLS: [usize; 5] = [32, 96, 160, 2880, 4096];

    /// Rows of blocks that stress the quantizer: ordinary values over a wide range of scales,
    /// outliers, all-zero blocks (with negative zeros), subnormals, blocks so small that
    /// `127 / amax` overflows, values near `f32::MAX`, and exact rounding ties. With
    /// `non_finite`, some blocks also hold infinities and NaN.
    fn stress_values(rng: &mut ChaCha8Rng, n: usize, non_finite: bool) -> Vec<f32> {
        let mut x = Vec::with_capacity(n);
        while x.len() < n {
            let kinds = if non_finite { 9 } else { 8 };
            let scale = 10f32.powi(rng.gen_range(-6..=6));
            let block: Vec<f32> = match rng.gen_range(0..kinds) {
                0 | 1 => (0..BLOCK_LEN)
                    .map(|_| rng.gen_range(-1.0f32..1.0) * scale)
                    .collect(),
                2 => (0..BLOCK_LEN)
                    .map(|i| {
                        let v = rng.gen_range(-1.0f32..1.0) * scale;
                        if i == 5 {
                            v * 1e4
                        } else {
                            v
                        }
                    })
                    .collect(),
                3 => (0..BLOCK_LEN)
                    .map(|_| if rng.gen() { 0.0 } else { -0.0 })
                    .collect(),
                4 => (0..BLOCK_LEN)
                    .map(|_| match rng.gen_range(0..4) {
                        0 => 0.0,
                        1 => -0.0,
                        2 => f32::from_bits(rng.gen_range(1..0x0080_0000)) * rng_sign(rng),
                        _ => rng.gen_range(-1.0f32..1.0) * 1e-37,
                    })
                    .collect(),
                5 => (0..BLOCK_LEN)
                    .map(|_| rng.gen_range(-1.0f32..1.0) * f32::MAX)
                    .collect(),
                6 => {
                    // amax 127 makes the inverse exactly 1: the halves are exact ties.
                    let mut b: Vec<f32> = (0..BLOCK_LEN)
                        .map(|_| rng.gen_range(-127i32..127) as f32 + 0.5)
                        .collect();
                    b[rng.gen_range(0..BLOCK_LEN)] = 127.0 * rng_sign(rng);
                    b
                }
                7 => (0..BLOCK_LEN)
                    .map(|_| match rng.gen_range(0..3) {
                        0 => -0.0,
                        _ => rng.gen_range(-1.0f32..1.0) * scale,
                    })
                    .collect(),
                _ => (0..BLOCK_LEN)
                    .map(|_| match rng.gen_range(0..6) {
                        0 => f32::INFINITY,
                        1 => f32::NEG_INFINITY,
                        2 => f32::NAN,
                        3 => 0.0,
                        4 => 1e-38,
                        _ => rng.gen_range(-1.0f32..1.0) * scale,
                    })
                    .collect(),
            };
            x.extend(block);
        }
        x.truncate(n);
        x
    }

    fn rng_sign(rng: &mut ChaCha8Rng) -> f32 {
        if rng.gen() {
            1.0
        } else {
            -1.0
        }
    }

    fn simd_kernels() -> Vec<Kernels> {
        Kernels::all_supported()
            .into_iter()
            .filter(|k| k.path() != KernelPath::Scalar)
            .collect()
    }

    /// Quantizes `x` on `kernels` into buffers first filled with junk, so any lane a path leaves
    /// unwritten shows up.
    fn quantize_on(
        kernels: Option<Kernels>,
        x: &[f32],
        cols: usize,
        rule: ScaleRule,
    ) -> Q8Activations {
        let mut q = Q8Activations::new();
        q.resize(x.len() / cols, cols);
        q.quants.fill(0x55);
        q.scale_lanes.fill(f32::NAN);
        q.sum_lanes.fill(-7);
        q.corrections.fill(-7);
        let p = &mut q;
        let (quants, scales, sums, corrections) = (
            &mut p.quants[..],
            &mut p.scale_lanes[..],
            &mut p.sum_lanes[..],
            &mut p.corrections[..],
        );
        match kernels {
            Some(k) => k.quantize_rows(x, cols, rule, quants, scales, sums, corrections),
            None => quantize_rows_portable(x, cols, rule, quants, scales, sums, corrections),
        }
        q
    }

    fn assert_same_quantization(what: &str, got: &Q8Activations, expected: &Q8Activations) {
        for (i, (g, e)) in got.quants.iter().zip(&expected.quants[..]).enumerate() {
            assert_eq!(g, e, "{what}: quant {i}");
        }
        for (i, (g, e)) in got
            .scale_lanes
            .iter()
            .zip(&expected.scale_lanes[..])
            .enumerate()
        {
            assert_eq!(
                g.to_bits(),
                e.to_bits(),
                "{what}: scale lane {i}: {g} vs {e}"
            );
        }
        for (i, (g, e)) in got
            .sum_lanes
            .iter()
            .zip(&expected.sum_lanes[..])
            .enumerate()
        {
            assert_eq!(g, e, "{what}: sum lane {i}");
        }
        for (i, (g, e)) in got
            .corrections
            .iter()
            .zip(&expected.corrections[..])
            .enumerate()
        {
            assert_eq!(g, e, "{what}: correction lane {i}");
        }
        assert_eq!(got.quants.len(), expected.quants.len(), "{what}");
        assert_eq!(got.scale_lanes.len(), expected.scale_lanes.len(), "{what}");
    }

    #[test]
    fn simd_quantizers_give_the_portable_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        for non_finite in [false, true] {
            for cols in RAGGED_COLS {
                for rows in 1..=20 {
                    let x = stress_values(&mut rng, rows * cols, non_finite);
                    for rule in [ScaleRule::Tight, ScaleRule::PowerOfTwo] {
                        let expected = quantize_on(None, &x, cols, rule);
                        for k in simd_kernels() {
                            let got = quantize_on(Some(k), &x, cols, rule);
                            let what = format!(
                                "{} {rule:?} {rows}x{cols} non-finite {non_finite}",
                                k.path()
                            );
                            assert_same_quantization(&what, &got, &expected);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn simd_split_rows_give_the_portable_bits() {
        let mut rng = ChaCha8Rng::seed_from_u64(18);
        for non_finite in [false, true] {
            for cols in RAGGED_COLS {
                for rows in 1..=20 {
                    let x = stress_values(&mut rng, rows * cols, non_finite);
                    // One spare row checks that nothing is written past the split rows.
                    let mut expected = vec![-3.0f32; 2 * x.len() + cols];
                    split_rows_portable(&x, cols, &mut expected);
                    for k in simd_kernels() {
                        let mut got = vec![-3.0f32; 2 * x.len() + cols];
                        k.split_rows_unchecked(&x, cols, &mut got);
                        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                            // Rust leaves NaN payloads unspecified; NaN must stay NaN.
                            assert!(
                                g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()),
                                "{} {rows}x{cols} non-finite {non_finite}: element {i}: {g} vs {e}",
                                k.path()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantizers_map_non_finite_values_like_the_portable_casts() {
        // One block: +inf, -inf, NaN next to finite values. amax is infinite, so the inverse is 0:
        // finite values give 0, the infinities `inf x 0 = NaN`, which the cast turns into 0.
        let mut block = [1.0f32; BLOCK_LEN];
        (block[0], block[1], block[2]) = (f32::INFINITY, f32::NEG_INFINITY, f32::NAN);
        // A block whose maximum is so small that the inverse overflows: its zeros give
        // `0 x inf = NaN` -> 0, its nonzero values +-inf -> +-127.
        let mut tiny = [0.0f32; BLOCK_LEN];
        (tiny[3], tiny[4], tiny[5]) = (1e-38, -1e-39, -0.0);
        let x: Vec<f32> = block.iter().chain(&tiny).copied().collect();
        let expected = quantize_on(None, &x, x.len(), ScaleRule::Tight);
        assert!(expected.quants[..GROUP_LEN].iter().all(|&q| {
            // Block 0: all 0. Block 1: 127 and -127 for its two nonzero values.
            q == 0 || q == 127 || q == -127
        }));
        assert_eq!(expected.quants[GROUP_LEN / 2 + BLOCK_LEN / 2 + 1], 127);
        assert_eq!(expected.quants[BLOCK_LEN / 2 + 2], -127);
        assert_eq!(expected.scale_lanes[0], f32::INFINITY);
        for rule in [ScaleRule::Tight, ScaleRule::PowerOfTwo] {
            let expected = quantize_on(None, &x, x.len(), rule);
            for k in simd_kernels() {
                assert_same_quantization(
                    &format!("{} {rule:?}", k.path()),
                    &quantize_on(Some(k), &x, x.len(), rule),
                    &expected,
                );
            }
        }
    }

    /// A power-of-two scale is the least one at or above `max / 127`: the block's largest value
    /// lands in 64..=127 (at most one bit given up), and `scale x q` is exact.
    #[test]
    fn power_of_two_scales_give_up_at_most_one_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(19);
        let cols = 2880;
        for magnitude in [1e-30f32, 3e-3, 1.0, 127.0, 1e20] {
            let x: Vec<f32> = (0..4 * cols)
                .map(|_| (rng.gen::<f32>() - 0.5) * magnitude)
                .collect();
            let q = quantize_on(None, &x, cols, ScaleRule::PowerOfTwo);
            for (row, values) in x.chunks_exact(cols).enumerate() {
                for (block, values) in values.chunks_exact(BLOCK_LEN).enumerate() {
                    let scale = q.block_scale(row, block);
                    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    assert_eq!(scale.to_bits() & 0x007F_FFFF, 0, "{magnitude}: {scale}");
                    assert!(scale >= amax / 127.0 && scale < amax / 127.0 * 2.0);
                    let quants = q.row_quants(row);
                    let largest = (0..BLOCK_LEN)
                        .map(|k| quants[interleaved_position(block * BLOCK_LEN + k)].unsigned_abs())
                        .max()
                        .unwrap();
                    assert!((64..=127).contains(&largest), "{magnitude}: {largest}");
                }
            }
        }
    }

    /// A Q8 matrix's scale exponents are kept per tile of 16 rows: an all-zero block (scale 0)
    /// rules out the exponent add for its own tile only, in either layout.
    #[test]
    fn q8_scale_exponents_are_kept_per_tile() {
        let (rows, cols) = (48, 96);
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let mut values: Vec<f32> = (0..rows * cols).map(|_| rng.gen::<f32>() - 0.5).collect();
        values[20 * cols + 32..20 * cols + 64].fill(0.0);
        let bits: Vec<u16> = values.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let plain = Q8Matrix::from_bf16(rows, cols, &bits).unwrap();
        for w in [plain.clone(), plain.to_tiles().unwrap()] {
            let (low, high) = w.scale_exponents(0..16).expect("tile 0 has no zero scale");
            assert!(low <= high && low > 100 && high < 127, "{low} {high}");
            assert_eq!(
                w.scale_exponents(16..32),
                None,
                "tile 1 holds the zero block"
            );
            assert_eq!(w.scale_exponents(3..40), None);
            assert!(w.scale_exponents(32..48).is_some());
            assert_eq!(w.scale_exponents(0..16), w.scale_exponents(1..15));
            assert_eq!(w.scale_exponents(10..10), None);
        }
    }

    #[test]
    fn interleaved_position_is_a_permutation_of_each_group() {
        let mut seen = vec![false; 3 * GROUP_LEN];
        for k in 0..3 * GROUP_LEN {
            let p = interleaved_position(k);
            assert!(!seen[p], "position {p} hit twice");
            seen[p] = true;
            assert_eq!(p / GROUP_LEN, k / GROUP_LEN);
        }
        // Element 1 of block 2 (k = 65) is the first odd element of block 2: after 64 evens, 2 x 16 odds.
        assert_eq!(interleaved_position(65), 64 + 32);
    }

    #[test]
    fn e8m0_scales_follow_the_spec() {
        assert_eq!(e8m0_scale(127), 1.0);
        assert_eq!(e8m0_scale(128), 2.0);
        assert_eq!(e8m0_scale(120), 2f32.powi(-7));
        assert_eq!(e8m0_scale(0), 2f32.powi(-127));
        assert!(e8m0_scale(255).is_nan());
        assert_eq!(e8m0_kernel_scale(126), 0.5);
    }

    #[test]
    fn quantizing_into_a_large_enough_buffer_does_not_reallocate() {
        let mut x = Q8Activations::with_capacity(4, 2880);
        let pointers = (
            x.quants.as_ptr(),
            x.scale_lanes.as_ptr(),
            x.sum_lanes.as_ptr(),
        );
        let values: Vec<f32> = (0..4 * 2880).map(|i| (i % 97) as f32 - 48.0).collect();
        let k = crate::kernels::kernels();
        k.quantize_activation_rows(&values, 2880, &mut x).unwrap();
        k.quantize_activations(&values[..2880], &mut x).unwrap();
        assert_eq!(
            pointers,
            (
                x.quants.as_ptr(),
                x.scale_lanes.as_ptr(),
                x.sum_lanes.as_ptr()
            )
        );
        assert_eq!((x.rows(), x.cols()), (1, 2880));
    }

    #[test]
    fn block_sums_and_scales_land_in_their_lanes() {
        let mut x = Q8Activations::new();
        // Block j of the single group holds the constant j + 1: every value quantizes to 127.
        let values: Vec<f32> = (0..96).map(|k| (k / 32 + 1) as f32).collect();
        crate::kernels::kernels()
            .quantize_activations(&values, &mut x)
            .unwrap();
        for j in 0..3 {
            assert_eq!(x.sum_lanes[4 * j], 127 * 32);
            assert_eq!(
                &x.corrections[4 * j..4 * j + 4],
                &[-12 * 127 * 32, -8 * 127 * 32, -128 * 127 * 32, 0]
            );
            assert_eq!(&x.sum_lanes[4 * j + 1..4 * j + 4], &[0, 0, 0]);
            assert_eq!(x.scale_lanes[4 * j], (j + 1) as f32 / 127.0);
        }
        // The fourth block is padding.
        assert_eq!(x.sum_lanes[12], 0);
        assert_eq!(x.scale_lanes[12], 0.0);
    }

    /// Single-threaded ns per value of each path's quantizer and `split_rows`, best of several
    /// runs: `cargo test --release --lib quantizer_timings -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing harness; prints figures, asserts nothing"]
    fn quantizer_timings() {
        let cols = 2880;
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for rows in [1usize, 4, 512] {
            let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-4.0..4.0)).collect();
            let mut q = Q8Activations::with_capacity(rows, cols);
            q.resize(rows, cols);
            let mut split = vec![0.0f32; 2 * x.len()];
            let reps = (4_000_000 / x.len()).max(2);
            let best_ns = |run: &mut dyn FnMut()| {
                (0..15)
                    .map(|_| {
                        let start = std::time::Instant::now();
                        for _ in 0..reps {
                            run();
                        }
                        start.elapsed().as_secs_f64() * 1e9 / (reps * x.len()) as f64
                    })
                    .fold(f64::INFINITY, f64::min)
            };
            for k in Kernels::all_supported() {
                let quantize = best_ns(&mut || {
                    let p = &mut q;
                    k.quantize_rows(
                        &x,
                        cols,
                        ScaleRule::Tight,
                        &mut p.quants,
                        &mut p.scale_lanes,
                        &mut p.sum_lanes,
                        &mut p.corrections,
                    );
                    std::hint::black_box(&q.quants[..]);
                });
                let split = best_ns(&mut || {
                    k.split_rows_unchecked(&x, cols, &mut split);
                    std::hint::black_box(&split[..]);
                });
                println!(
                    "{rows:>3} x {cols} {:>6}: quantize {quantize:.3} ns/value, split_rows {split:.3} ns/value",
                    k.path().name()
                );
            }
        }
    }
}
