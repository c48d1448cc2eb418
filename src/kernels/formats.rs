//! Block formats: quantized activations, MXFP4 checkpoint views, and the Q8/Q4 formats we make at load.
//!
//! Every integer format groups its blocks of 32 in fours ("groups" of 128 elements) and stores each
//! group as the even elements of its four blocks, then the odd elements of its four blocks. That is
//! the order in which the checkpoint's MXFP4 nibbles come out of one 64-byte load (low nibbles are
//! the even elements), so no kernel needs an interleaving shuffle.

use half::f16;
use rayon::prelude::*;

use super::aligned::AlignedVec;
use super::KernelError;

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
}

impl ByteSpans for Mxfp4Matrix<'_> {
    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        let (row_bytes, row_scales) = (self.cols / 2, self.cols / BLOCK_LEN);
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
    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        let (row_bytes, row_scales) = (self.groups * GROUP_LEN / 2, self.groups * GROUP_BLOCKS * 2);
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
    fn byte_spans(&self, rows: std::ops::Range<usize>) -> [(*const u8, usize); 2] {
        let (row_bytes, row_scales) = (self.groups * GROUP_LEN, self.groups * GROUP_BLOCKS * 2);
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

impl RoundEvenFast for f32 {
    #[inline(always)]
    fn round_even_fast(self) -> f32 {
        const MAGIC: f32 = 12_582_912.0;
        if self.abs() < 4_194_304.0 {
            (self + MAGIC) - MAGIC
        } else {
            self
        }
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
    pub(crate) groups: usize,
    /// `rows x groups x 128` int8 values, group-interleaved (evens of 4 blocks, then odds).
    pub(crate) quants: AlignedVec<i8>,
    /// `rows x groups x 16`: lanes 4j..4j+3 hold the scale of block j of the group.
    pub(crate) scale_lanes: AlignedVec<f32>,
    /// `rows x groups x 16`: lane 4j holds the sum of block j's int8 values, the other lanes 0.
    /// The offset trick subtracts `offset x sum` from each block's unsigned-by-signed dot product.
    pub(crate) sum_lanes: AlignedVec<i32>,
    /// `rows x groups x 16`: each format's `-offset x block sum`, ready to start a block's integer
    /// sum: lane `4j + CORRECTION_LANE_*` holds block j's correction for that format, lane 4j + 3
    /// is 0. Only the total of a block's four lanes matters to the kernels, so the AVX-512 path
    /// loads this with one lane per block unmasked instead of multiplying `sum_lanes` each time.
    pub(crate) corrections: AlignedVec<i32>,
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

    fn resize(&mut self, rows: usize, cols: usize) {
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

/// Quantize one token (`x.len()` elements, a multiple of 32) into `out`, reusing its buffers.
pub fn quantize_activations(x: &[f32], out: &mut Q8Activations) -> Result<(), KernelError> {
    quantize_activation_rows(x, x.len(), out)
}

/// Quantize `x.len() / cols` tokens of `cols` elements each into `out`, reusing its buffers.
///
/// One implementation serves every kernel path, so all paths see identical int8 values: scale
/// `d = max|x| / 127`, `q = round_half_even(x * (127 / max|x|))`.
pub fn quantize_activation_rows(
    x: &[f32],
    cols: usize,
    out: &mut Q8Activations,
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
    if rows < PARALLEL_QUANTIZE_ROWS {
        quantize_rows_dispatch(
            x,
            cols,
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
            quantize_rows_dispatch(x, cols, quants, scales, sums, corrections)
        });
    Ok(())
}

/// Rows from which quantization runs on the pool, and rows per task there.
const PARALLEL_QUANTIZE_ROWS: usize = 16;
const QUANTIZE_TASK_ROWS: usize = 8;

/// Quantizes the rows of `x` into the given slices of a [`Q8Activations`] (whole rows each).
fn quantize_rows_dispatch(
    x: &[f32],
    cols: usize,
    quants: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
    corrections: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if super::kernel_path() == super::KernelPath::Avx512 {
        // SAFETY: the process-wide path is Avx512 only after its CPU features were detected.
        unsafe { quantize_rows_avx512(x, cols, quants, scales, sums, corrections) };
        return;
    }
    quantize_rows_portable(x, cols, quants, scales, sums, corrections);
}

/// The quantization loop, compiled twice: for baseline x86-64 and, through the wrapper below,
/// with AVX-512 enabled so the compiler vectorizes it. Same IEEE operations, so the same bits.
#[inline(always)]
fn quantize_rows_body(
    x: &[f32],
    cols: usize,
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
            let (scale, inverse) = if amax > 0.0 {
                (amax / 127.0, 127.0 / amax)
            } else {
                (0.0, 0.0)
            };
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

fn quantize_rows_portable(
    x: &[f32],
    cols: usize,
    quants: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
    corrections: &mut [i32],
) {
    quantize_rows_body(x, cols, quants, scales, sums, corrections)
}

/// # Safety
/// The CPU has AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_rows_avx512(
    x: &[f32],
    cols: usize,
    quants: &mut [i8],
    scales: &mut [f32],
    sums: &mut [i32],
    corrections: &mut [i32],
) {
    quantize_rows_body(x, cols, quants, scales, sums, corrections)
}

/// The f32 rows of a split quantization: each row of `x` followed by what its int8 quantization
/// misses (`x - scale * q`, rounded exactly as [`quantize_activation_rows`] rounds). Quantizing
/// `out` then gives each token two int8 rows whose products sum to about 15 bits of precision.
pub fn split_rows(x: &[f32], cols: usize, out: &mut [f32]) -> Result<(), KernelError> {
    check_block_cols("activation row", cols)?;
    if !x.len().is_multiple_of(cols) || out.len() < 2 * x.len() {
        return Err(KernelError::Length {
            what: format!("split rows (two rows of {cols} for each input row)"),
            expected: 2 * x.len().div_ceil(cols) * cols,
            got: out.len(),
        });
    }
    for (row, pair) in x.chunks_exact(cols).zip(out.chunks_exact_mut(2 * cols)) {
        let (exact, missed) = pair.split_at_mut(cols);
        exact.copy_from_slice(row);
        for (values, rest) in row
            .chunks_exact(BLOCK_LEN)
            .zip(missed.chunks_exact_mut(BLOCK_LEN))
        {
            let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let (scale, inverse) = if amax > 0.0 {
                (amax / 127.0, 127.0 / amax)
            } else {
                (0.0, 0.0)
            };
            for (r, &v) in rest.iter_mut().zip(values) {
                let q = (v * inverse).round_even_fast().clamp(-127.0, 127.0);
                *r = v - q * scale;
            }
        }
    }
    Ok(())
}

/// An MXFP4 matrix `[rows, cols]` borrowed zero-copy from the checkpoint.
///
/// `blocks`: `rows x cols/32 x 16` bytes; element k of row r is in byte `r*(cols/2) + k/2`, low nibble
/// for even k. `scales`: `rows x cols/32` E8M0 bytes.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Matrix<'a> {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) blocks: &'a [u8],
    pub(crate) scales: &'a [u8],
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
        })
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
        let byte = self.blocks[row * (self.cols / 2) + k / 2];
        if k.is_multiple_of(2) {
            byte & 0x0F
        } else {
            byte >> 4
        }
    }

    #[inline]
    pub(crate) fn scale_byte(&self, row: usize, block: usize) -> u8 {
        self.scales[row * (self.cols / BLOCK_LEN) + block]
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
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) groups: usize,
    /// `rows x groups x 128`.
    pub(crate) quants: AlignedVec<i8>,
    /// `rows x groups x 4`; padding blocks have scale 0.
    pub(crate) scales: Vec<f16>,
}

/// Weights quantized to 4-bit blocks of 32 with an f16 scale per block (4.5 bits per weight).
///
/// Symmetric, like GGML's Q4_0: with m the block's value of largest magnitude, `d = m / -8` and
/// `q = round(w / d)` clamped to -8..=7, stored as the nibble `q + 8`. Nibbles follow the MXFP4 order
/// (16 bytes per block, low nibble = even element); rows are padded to whole groups.
#[derive(Clone, Debug)]
pub struct Q4Matrix {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) groups: usize,
    /// `rows x groups x 64`.
    pub(crate) nibbles: AlignedVec<u8>,
    /// `rows x groups x 4`; padding blocks have scale 0.
    pub(crate) scales: Vec<f16>,
}

fn check_bf16_input(what: &str, rows: usize, cols: usize, len: usize) -> Result<(), KernelError> {
    check_block_cols(what, cols)?;
    check_len(&format!("{what} bf16 data (rows x cols)"), len, rows * cols)
}

impl Q8Matrix {
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
        Ok(Self {
            rows,
            cols,
            groups,
            quants,
            scales,
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

    pub(crate) fn row_quants(&self, row: usize) -> &[i8] {
        let stride = self.groups * GROUP_LEN;
        &self.quants[row * stride..(row + 1) * stride]
    }

    pub(crate) fn row_scales(&self, row: usize) -> &[f16] {
        let stride = self.groups * GROUP_BLOCKS;
        &self.scales[row * stride..(row + 1) * stride]
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
        let (quants, scales) = (self.row_quants(row), self.row_scales(row));
        for (k, value) in out.iter_mut().enumerate() {
            *value = quants[interleaved_position(k)] as f32 * scales[k / BLOCK_LEN].to_f32();
        }
        Ok(())
    }
}

impl Q4Matrix {
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
        Ok(Self {
            rows,
            cols,
            groups,
            nibbles,
            scales,
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

    pub(crate) fn row_nibbles(&self, row: usize) -> &[u8] {
        let stride = self.groups * GROUP_LEN / 2;
        &self.nibbles[row * stride..(row + 1) * stride]
    }

    pub(crate) fn row_scales(&self, row: usize) -> &[f16] {
        let stride = self.groups * GROUP_BLOCKS;
        &self.scales[row * stride..(row + 1) * stride]
    }

    /// Signed value (-8..=7) of element `k` of row `row`.
    pub(crate) fn value(&self, row: usize, k: usize) -> i32 {
        let byte = self.row_nibbles(row)[k / 2];
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
        let scales = self.row_scales(row);
        for (k, value) in out.iter_mut().enumerate() {
            *value = self.value(row, k) as f32 * scales[k / BLOCK_LEN].to_f32();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorized_quantization_gives_the_same_bits() {
        #[cfg(target_arch = "x86_64")]
        if super::super::KernelPath::Avx512.is_supported() {
            let mut state = 7u64;
            for cols in [32usize, 160, 2880] {
                let rows = 5;
                let x: Vec<f32> = (0..rows * cols)
                    .map(|i| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        // Some exact ties at .5 steps, some zero blocks, mostly random values.
                        match i % 97 {
                            0 => 0.0,
                            1 => 63.5,
                            _ => ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 8.0,
                        }
                    })
                    .collect();
                let (mut portable, mut simd) = (Q8Activations::new(), Q8Activations::new());
                portable.resize(rows, cols);
                simd.resize(rows, cols);
                let p = &mut portable;
                quantize_rows_portable(
                    &x,
                    cols,
                    &mut p.quants,
                    &mut p.scale_lanes,
                    &mut p.sum_lanes,
                    &mut p.corrections,
                );
                let v = &mut simd;
                // SAFETY: AVX-512 support was checked above.
                unsafe {
                    quantize_rows_avx512(
                        &x,
                        cols,
                        &mut v.quants,
                        &mut v.scale_lanes,
                        &mut v.sum_lanes,
                        &mut v.corrections,
                    )
                };
                assert_eq!(&portable.quants[..], &simd.quants[..], "cols {cols}");
                assert_eq!(&portable.scale_lanes[..], &simd.scale_lanes[..]);
                assert_eq!(&portable.sum_lanes[..], &simd.sum_lanes[..]);
                assert_eq!(&portable.corrections[..], &simd.corrections[..]);
            }
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
        quantize_activation_rows(&values, 2880, &mut x).unwrap();
        quantize_activations(&values[..2880], &mut x).unwrap();
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
        quantize_activations(&values, &mut x).unwrap();
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
}
