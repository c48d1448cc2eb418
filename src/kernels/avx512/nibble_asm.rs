//! The register-only tile product of [`super::tiles`] for the nibble formats, MXFP4 and Q4 (a
//! tile of 16 weight rows against up to [`super::tiles::DIRECT_TOKENS`] tokens, nibbles decoded
//! with `vpermb`; the formats differ in the table and in their scales, E8M0 bytes or f16) as one
//! loop of assembly, with the tokens' operands packed once per call (into the GEMM scratch) so
//! that every operand of a block sits at a constant offset from one pointer. It runs the calls
//! of 2-24 tokens; one token (decode), bound by memory, keeps the intrinsics loop, which decoded
//! as fast.
//!
//! # Why assembly
//! Short prompts and batched decode run the experts at a handful of tokens each, where this
//! product is bound by the core, not by memory (or, at 2-4 tokens, by both). Compiled from the intrinsics, a block of 8 tokens
//! (64 `vpdpbusd`, 8 `vpermb`, the float steps) took 23 ns on the Xeon with AMX (one thread, the
//! weights in L1 or L2 alike); the same instructions in a hand-ordered loop took 17.5 ns. The
//! compiler pulls the first and the last token's chains of eight `vpdpbusd` out of the round
//! robin, turns the exponent add (`vpaddd` with a broadcast operand) into a scalar add and a
//! register broadcast (two more operations per token and block, one of them on the port
//! `vpermb` needs), addresses every activation as base + index (two micro-operations each),
//! reloads the tokens' pointers from the stack and loops over its prefetches; the first two
//! and the last cost 4-5% each in the hand-written loop, the prefetch loop 17% at 4 tokens.
//! `bench --kernels` there, the two builds alternating twice (GMAC/s): one thread, one matrix,
//! M = 4 86-107 -> 119-124, M = 8 128-150 -> 169-171; two threads streaming 32 matrices, M = 6
//! 178-183 -> 217-262, M = 8 212-213 -> 247-278, M = 12 242-254 -> 314-350. In the model the
//! 58-token prefill's experts, which stream their weights at about the rate two cores read,
//! gained less: 657 / 663 -> 635 / 636 ms (`bench --synthetic 20b --profile`, alternating);
//! pp58 67.3 / 67.8 -> 72.7 / 71.4 tokens/s.
//!
//! # The same bits
//! The integer sums are exact in any order, and each token's float steps run block by block in
//! the order of [`super::accumulate`] (multiply: the scales' product by `vmulps`, convert, one
//! FMA; exponent add: the same with the product from an integer add; shifted sum: integer add
//! of the magic, subtract, add), so the results are the intrinsics kernel's bits.

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::super::formats::{
    Q8Activations, BLOCK_LEN, GROUP_BLOCKS, GROUP_LANES, GROUP_LEN, MXFP4_TILE_ROWS,
};
use super::{
    FORMAT_MXFP4, FORMAT_Q4, MXFP4_UNSIGNED_64, Q4_UNSIGNED_64, SCALE_EXPONENT_ADD, SCALE_MULTIPLY,
    SCALE_SHIFTED_SUM, SHIFTED_SUM_BIAS,
};

/// Calls of the loop in this process: its results are the intrinsics kernel's bits, so this is
/// how a test sees that a product ran here.
static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Counts one call (a product, not a tile: one relaxed add per product).
pub(super) fn count_call() {
    CALLS.fetch_add(1, Ordering::Relaxed);
}

pub(in crate::kernels) fn call_count() -> usize {
    CALLS.load(Ordering::Relaxed)
}

/// Packed u32 words per block and token: 4 even and 4 odd activation dwords, the block's
/// correction and the bits of its activation scale.
pub(super) const PACKED_WORDS: usize = 10;

/// Packs tokens `tokens` of `x` for [`tile_tokens`] into `to`: per block of `blocks`, the
/// tokens' even activation dwords (dword `s` of token `t` at word `s x T + t`, `T` the token
/// count), then their odd dwords alike, their corrections (lane `correction_lane` of the
/// block's lanes) and the bits of their activation scales: [`PACKED_WORDS`] x `T` words a block.
pub(super) fn pack(
    x: &Q8Activations,
    correction_lane: usize,
    tokens: Range<usize>,
    blocks: usize,
    to: &mut [u32],
) {
    let count = tokens.len();
    let (quant_stride, lane_stride) = (x.groups * GROUP_LEN, x.groups * GROUP_LANES);
    for (t, token) in tokens.enumerate() {
        let quants = &x.quants[token * quant_stride..][..quant_stride];
        // SAFETY: i8 and u8 have the same size and alignment, and every bit pattern is both.
        let quants: &[u8] =
            unsafe { std::slice::from_raw_parts(quants.as_ptr().cast(), quants.len()) };
        let corrections = &x.corrections[token * lane_stride..][..lane_stride];
        let scales = &x.scale_lanes[token * lane_stride..][..lane_stride];
        let dword = |at: usize| {
            u32::from_le_bytes([quants[at], quants[at + 1], quants[at + 2], quants[at + 3]])
        };
        for (block, words) in to
            .chunks_exact_mut(PACKED_WORDS * count)
            .take(blocks)
            .enumerate()
        {
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let evens = group * GROUP_LEN + 16 * j;
            for s in 0..4 {
                words[s * count + t] = dword(evens + 4 * s);
                words[(4 + s) * count + t] = dword(evens + 4 * s + GROUP_LEN / 2);
            }
            let lane = group * GROUP_LANES + 4 * j;
            words[8 * count + t] = corrections[lane + correction_lane] as u32;
            words[9 * count + t] = scales[lane].to_bits();
        }
    }
}

/// Where a tile's product asks for part of the next tile's bytes: `lines` (at most 4) cache
/// lines from `first`, then from `first + step`, and so on, one step per block.
#[derive(Clone, Copy)]
pub(super) struct LinePrefetch {
    pub(super) first: *const u8,
    pub(super) step: usize,
    pub(super) lines: usize,
}

/// One tile (16 rows: `vectors` and `scales` from [`super::tiles::TileSource::tile_base`] of a
/// tiled MXFP4 matrix, `blocks` blocks a row) against `T` tokens packed by [`pack`] at
/// `packed`, scaled as `SCALING` ([`SCALE_MULTIPLY`], [`SCALE_EXPONENT_ADD`] or
/// [`SCALE_SHIFTED_SUM`]) says; the
/// 16 f32 sums of each token (before the format's factor) go to `acc`.
///
/// # Safety
/// The tile's `blocks` blocks of vectors (256 bytes each) and scales (16 bytes each) and the
/// packed words of `T` tokens for `blocks` blocks are readable; `1 <= T <= 12`; `blocks > 0`;
/// the CPU has AVX-512 F, BW, VNNI and VBMI; unless `SCALING` multiplies, every product of a
/// weight and an activation scale is a normal float (what [`super::scaling`] checks before it
/// picks the other scalings).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi")]
pub(super) unsafe fn tile_tokens<const T: usize, const SCALING: u8, const FORMAT: u8>(
    vectors: *const u8,
    scales: *const u8,
    packed: *const u32,
    blocks: usize,
    prefetch: LinePrefetch,
    acc: &mut [__m512; T],
) {
    const {
        assert!(T >= 1 && T <= 12, "sums and accumulators fill zmm0..zmm23");
        // The `.if` lines below name the scalings by these values.
        assert!(SCALE_MULTIPLY == 0 && SCALE_EXPONENT_ADD == 1 && SCALE_SHIFTED_SUM == 2);
        assert!(
            SCALING == SCALE_MULTIPLY
                || SCALING == SCALE_EXPONENT_ADD
                || SCALING == SCALE_SHIFTED_SUM
        );
        assert!(FORMAT == FORMAT_MXFP4 || FORMAT == FORMAT_Q4);
    }
    let bias = if SCALING == SCALE_SHIFTED_SUM {
        SHIFTED_SUM_BIAS
    } else {
        127 << 23
    };
    debug_assert!(blocks > 0 && BLOCK_LEN == 32);
    let table = if FORMAT == FORMAT_Q4 {
        Q4_UNSIGNED_64.as_ptr()
    } else {
        MXFP4_UNSIGNED_64.as_ptr()
    };
    // SAFETY: the caller upholds the contract: every address below lies in the tile's vectors
    // and scales, the packed words or `acc` (prefetches never fault); the registers written are
    // declared clobbered.
    unsafe {
        asm!(
            // zmm0..zmm11: a block's integer sums per token; zmm12..zmm23: the tokens' f32
            // accumulators; zmm24, zmm25: the decoded even and odd operands; zmm26: the nibble
            // table; zmm27: the block's weight scales (their bits less the bias where the
            // scaling adds exponents or shifts sums); zmm28: a token's scale.
            ".macro ossterm_fold t, acc",
            ".if \\t < {T}",
            ".if {SCALING} == 0",
            "vmulps zmm28, zmm27, dword ptr [{packed} + 36 * {T} + 4 * \\t]{{1to16}}",
            "vcvtdq2ps zmm\\t, zmm\\t",
            "vfmadd231ps zmm\\acc, zmm\\t, zmm28",
            ".else",
            "vpaddd zmm28, zmm27, dword ptr [{packed} + 36 * {T} + 4 * \\t]{{1to16}}",
            ".if {SCALING} == 1",
            "vcvtdq2ps zmm\\t, zmm\\t",
            "vfmadd231ps zmm\\acc, zmm\\t, zmm28",
            ".else",
            "vpaddd zmm\\t, zmm\\t, zmm28",
            "vsubps zmm\\t, zmm\\t, zmm28",
            "vaddps zmm\\acc, zmm\\acc, zmm\\t",
            ".endif",
            ".endif",
            ".endif",
            ".endm",
            "vmovdqu64 zmm26, [{table}]",
            "vpbroadcastd zmm29, {bias:e}",
            ".irp a, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23",
            ".if \\a - 12 < {T}",
            "vpxord zmm\\a, zmm\\a, zmm\\a",
            ".endif",
            ".endr",
            "2:",
            "cmp {lines}, 1",
            "jb 3f",
            "prefetcht1 [{pf}]",
            "cmp {lines}, 2",
            "jb 3f",
            "prefetcht1 [{pf} + 64]",
            "cmp {lines}, 3",
            "jb 3f",
            "prefetcht1 [{pf} + 128]",
            "cmp {lines}, 4",
            "jb 3f",
            "prefetcht1 [{pf} + 192]",
            "3:",
            "add {pf}, {step}",
            ".irp t, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11",
            ".if \\t < {T}",
            "vpbroadcastd zmm\\t, dword ptr [{packed} + 32 * {T} + 4 * \\t]",
            ".endif",
            ".endr",
            ".irp s, 0, 1, 2, 3",
            "vmovdqu64 zmm24, [{vectors} + 64 * \\s]",
            "vpsrlw zmm25, zmm24, 4",
            "vpermb zmm24, zmm24, zmm26",
            "vpermb zmm25, zmm25, zmm26",
            ".irp t, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11",
            ".if \\t < {T}",
            "vpdpbusd zmm\\t, zmm24, dword ptr [{packed} + 4 * (\\s * {T} + \\t)]{{1to16}}",
            "vpdpbusd zmm\\t, zmm25, dword ptr [{packed} + 16 * {T} + 4 * (\\s * {T} + \\t)]{{1to16}}",
            ".endif",
            ".endr",
            ".endr",
            ".if {F16}",
            "vcvtph2ps zmm27, ymmword ptr [{scales}]",
            ".else",
            "vpmovzxbd zmm27, xmmword ptr [{scales}]",
            "vpslld zmm27, zmm27, 23",
            ".endif",
            ".if {SCALING} != 0",
            "vpsubd zmm27, zmm27, zmm29",
            ".endif",
            "ossterm_fold 0, 12",
            "ossterm_fold 1, 13",
            "ossterm_fold 2, 14",
            "ossterm_fold 3, 15",
            "ossterm_fold 4, 16",
            "ossterm_fold 5, 17",
            "ossterm_fold 6, 18",
            "ossterm_fold 7, 19",
            "ossterm_fold 8, 20",
            "ossterm_fold 9, 21",
            "ossterm_fold 10, 22",
            "ossterm_fold 11, 23",
            "add {vectors}, 256",
            "add {scales}, {SCALE_BYTES}",
            "add {packed}, 40 * {T}",
            "dec {blocks}",
            "jnz 2b",
            ".irp a, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23",
            ".if \\a - 12 < {T}",
            "vmovups [{acc} + 64 * (\\a - 12)], zmm\\a",
            ".endif",
            ".endr",
            ".purgem ossterm_fold",
            T = const T,
            SCALING = const SCALING,
            // Q4's scales are 16 f16 a block, MXFP4's 16 E8M0 bytes.
            F16 = const (FORMAT == FORMAT_Q4) as usize,
            SCALE_BYTES = const MXFP4_TILE_ROWS * (1 + (FORMAT == FORMAT_Q4) as usize),
            table = in(reg) table,
            bias = in(reg) bias,
            acc = in(reg) acc.as_mut_ptr(),
            vectors = inout(reg) vectors => _,
            scales = inout(reg) scales => _,
            packed = inout(reg) packed => _,
            blocks = inout(reg) blocks => _,
            pf = inout(reg) prefetch.first => _,
            step = in(reg) prefetch.step,
            lines = in(reg) prefetch.lines,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
            out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
            out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
            out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
            out("zmm28") _, out("zmm29") _,
            options(nostack),
        );
    }
}
