//! AMX (Intel Advanced Matrix Extensions) tile products for prefill: `tdpbf16ps` multiplies a
//! 16 x 32 bf16 tile of activations by a 32 x 16 bf16 tile of weights into 16 x 16 f32 sums on
//! the core's matrix unit, with no vector instruction per multiply-add.
//!
//! # Why bf16 and not int8
//! Every integer format scales each block of 32 weights and each block of 32 activations on its
//! own. With `tdpbssd` (int8) a tile's sums would have to leave the matrix unit after every block
//! to be scaled in f32: a `tilestored`, 16 loads, converts, multiplies and FMAs per 16 x 16 x 32
//! products, which measured 410-435 GMAC/s a core at M = 128-256 (1.5-1.7x AVX-512). In bf16 the
//! scales go into the operands exactly and the sums stay in the tile over the whole row:
//! * an MXFP4 weight is `FP4 x 2^(s-127)`, two significant bits times a power of two: exact in
//!   bf16 (8 exponent bits, as f32);
//! * an int8 activation times a power-of-two block scale (split rows,
//!   [`ScaleRule::PowerOfTwo`](super::ScaleRule::PowerOfTwo)) has at most 8 significant bits:
//!   exact too. Their products are exact in the f32 sum, so the result is the integer path's up
//!   to the order of f32 additions.
//! * an activation with a `max / 127` scale ([`ScaleRule::Tight`](super::ScaleRule::Tight),
//!   single rows) is `q x scale` rounded to f32 and split into two bf16 terms (hi + lo, 16
//!   significant bits, 2^-17 of the value at most off, far below the int8 step); each weight
//!   tile meets both, so such products take two passes of the matrix unit.
//!
//! Weights whose value overflows f32 on its own (scale bytes 253 and up, never in a real
//! checkpoint) become infinite, where the integer paths multiply the two scales first.
//!
//! # Operands
//! * Weights (B tiles, 16 rows x 64 bytes: row p holds, for each of 16 weight rows, the bf16 pair
//!   of block elements 2p and 2p+1): a tiled MXFP4 matrix ([`Mxfp4Layout::Tiles`]) holds, per
//!   tile, block and dword `s`, byte j of each of 16 rows' dword = elements 8s+2j (low nibble)
//!   and 8s+2j+1 (high nibble): pair 4s+j. One `vpermb` per B row gathers those bytes, a table
//!   lookup (`vpermw`) gives the FP4 value in bf16 and a masked 16-bit add moves its exponent by
//!   the row's scale. A decoded tile (1 KiB a block) serves every token tile of a pass (64
//!   tokens), and is decoded by the vector units while the matrix unit multiplies the tiles
//!   before it.
//! * Activations (A tiles, 16 tokens x 32 bf16): [`Q8Activations`] keep a group's even elements
//!   before its odd ones; packed once per call in natural order, scaled.
//!
//! # Operating system
//! Linux hands out the 8 KiB of tile state only to a process that asks
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without it the first tile
//! instruction faults. [`availability`] asks once per process and reports a refusal, and the
//! `amx` path is offered only after it succeeded.

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use super::aligned::AlignedVec;
use super::formats::{
    e8m0_kernel_scale, tile_lanes, tile_out, Mxfp4Layout, Mxfp4Matrix, Q8Activations, BLOCK_LEN,
    FP4_E2M1, GROUP_BLOCKS, GROUP_LEN, MXFP4_TILE_ROWS,
};

/// Tokens of an A tile and weight rows of a B tile.
const TILE: usize = 16;
/// Bytes of one decoded weight tile: 16 pair rows (K = 32) of 16 weight rows in bf16.
const B_TILE_BYTES: usize = TILE * 64;
/// Bytes of one tile of f32 sums: 16 tokens of 16 rows.
const C_TILE_BYTES: usize = TILE * 64;
/// bf16 elements of one block of activations: one A tile row.
const A_BLOCK: usize = BLOCK_LEN;
/// Bytes of one A tile (16 tokens' block), stored contiguously so a tile load streams 1 KiB.
const A_TILE_BYTES: usize = TILE * A_BLOCK * 2;
/// E8M0 scale bytes whose weights the bf16 exponent add decodes exactly: FP4 exponents run
/// from -1 (0.5) to 2 (6), so biased exponents `s - 128 .. s + 2` stay inside 1..=254. Blocks
/// with other scales (below 1e-37 or beyond 1e38, or 255, E8M0's NaN) take the scalar decode.
const EXACT_SCALES: std::ops::RangeInclusive<u8> = 2..=252;

/// bf16 bits of each FP4 E2M1 value (nibble order) at scale 1, twice: a `vpermw` table that
/// ignores index bit 4.
const FP4_BF16: [u16; 32] = {
    let mut table = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        // The values have at most two significant bits: their f32 upper halves are exact.
        table[i] = (FP4_E2M1[i % 16].to_bits() >> 16) as u16;
        i += 1;
    }
    table
};

/// `vpermb` indexes that gather byte j of each of a tile vector's 16 dwords into both bytes of
/// word lanes 2n and 2n+1 (B row 4s + j: the pair's low, then high nibble).
const PAIR_GATHER: [[u8; 64]; 4] = {
    let mut idx = [[0u8; 64]; 4];
    let mut j = 0;
    while j < 4 {
        let mut i = 0;
        while i < 64 {
            idx[j][i] = ((i / 4) * 4 + j) as u8;
            i += 1;
        }
        j += 1;
    }
    idx
};

/// Shifts that leave a word lane's nibble in its low four bits: lane 2n the low nibble, lane
/// 2n+1 the high nibble of the byte [`PAIR_GATHER`] put in both halves.
const NIBBLE_SHIFTS: [u16; 32] = {
    let mut shifts = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        shifts[i] = (i as u16 % 2) * 4;
        i += 1;
    }
    shifts
};

const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
/// The XSAVE feature number of the tile data (XTILEDATA).
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Whether AMX can run here: `Ok` once the CPU reports AMX-TILE and AMX-INT8, the operating
/// system enables the tile state (XCR0 bits 17 and 18) and has granted it to this process;
/// otherwise why not, for `bench` and the error of `OSSTERM_KERNELS=amx`. Asked once per process.
pub(crate) fn availability() -> Result<(), &'static str> {
    static GRANT: OnceLock<Result<(), &'static str>> = OnceLock::new();
    // The reason lives as long as the process: it is made once.
    *GRANT.get_or_init(|| request_tile_state().map_err(|reason| &*reason.leak()))
}

fn request_tile_state() -> Result<(), String> {
    let missing = missing_cpu_features();
    if !missing.is_empty() {
        return Err(format!("this CPU lacks {}", missing.join(", ")));
    }
    if !std::arch::is_x86_feature_detected!("avx512vbmi") {
        // Its weight decode gathers bytes with `vpermb`; every AMX CPU so far has it.
        return Err("this CPU lacks avx512vbmi, which the AMX weight decode uses".into());
    }
    if !os_enables_tiles() {
        return Err("the operating system does not enable the AMX tile state (XCR0)".into());
    }
    grant_tile_state()
}

/// AMX features this CPU lacks, from CPUID leaf 7 (EDX bit 24: AMX-TILE, bit 25: AMX-INT8).
pub(crate) fn missing_cpu_features() -> Vec<&'static str> {
    // Leaf 7 exists when leaf 0 reports it.
    let edx = if __cpuid(0).eax < 7 {
        0
    } else {
        __cpuid_count(7, 0).edx
    };
    let mut missing = Vec::new();
    if edx & (1 << 24) == 0 {
        missing.push("amx-tile");
    }
    if edx & (1 << 25) == 0 {
        missing.push("amx-int8");
    }
    missing
}

/// Whether the OS saves the tile configuration and data (XCR0 bits 17 and 18).
fn os_enables_tiles() -> bool {
    // SAFETY: CPUID leaf 1 exists on every x86-64 CPU; XGETBV runs only where CPUID says the OS
    // enabled it (OSXSAVE, ECX bit 27).
    unsafe {
        if __cpuid(1).ecx & (1 << 27) == 0 {
            return false;
        }
        let (low, _high): (u32, u32);
        asm!("xgetbv", in("ecx") 0u32, out("eax") low, out("edx") _high, options(nomem, nostack));
        low & (0b11 << 17) == 0b11 << 17
    }
}

#[cfg(target_os = "linux")]
fn grant_tile_state() -> Result<(), String> {
    // SAFETY: arch_prctl with these codes takes a feature number (request) or a pointer to a
    // u64 it fills (query); both are plain system calls with no memory effects beyond `granted`.
    unsafe {
        if libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) != 0
        {
            return Err(format!(
                "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: {})",
                std::io::Error::last_os_error()
            ));
        }
        let mut granted: u64 = 0;
        let rc = libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut granted as *mut u64,
        );
        if rc != 0 || granted & (1 << XFEATURE_XTILEDATA) == 0 {
            return Err("the kernel did not grant the AMX tile state".into());
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn grant_tile_state() -> Result<(), String> {
    Err("AMX tile state is requested only on Linux".into())
}

/// The LDTILECFG operand: palette 1, then bytes per row and rows of each tile register.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// tmm0..tmm3: f32 sums of up to 2 x 2 (token tile, weight tile) pairs, tmm(2i + j); tmm4,
/// tmm5: activations of token tiles 0 and 1; tmm6, tmm7: weights of weight tiles 0 and 1.
/// Every one 16 rows of 64 bytes.
static BLOCK_CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tile registers configured for the block products while alive; released on drop, so the
/// thread carries no tile state between calls (and the OS saves none for it).
struct TileSession;

impl TileSession {
    /// # Safety
    /// [`availability`] returned `Ok`.
    unsafe fn start() -> Self {
        // SAFETY: the caller checked that the OS granted the tile state; the operand is a valid
        // 64-byte configuration.
        unsafe {
            asm!(
                "ldtilecfg [{}]",
                in(reg) &BLOCK_CONFIG as *const TileConfig,
                options(nostack, readonly),
            );
        }
        TileSession
    }

    /// Clears the four sum tiles.
    fn zero_sums(&self) {
        // SAFETY: the session configured the tiles.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            )
        }
    }

    /// Stores sum tile `slot` (0..4) to `c`.
    ///
    /// # Safety
    /// `c` has [`C_TILE_BYTES`] writable bytes.
    unsafe fn store_sums(&self, slot: usize, c: *mut u8) {
        macro_rules! store {
            ($c:literal) => {
                asm!(
                    concat!("tilestored [{c} + {row} * 1], ", $c),
                    c = in(reg) c,
                    row = in(reg) 64usize,
                    options(nostack),
                )
            };
        }
        // SAFETY: the session configured the tiles; `c` is the caller's contract.
        unsafe {
            match slot {
                0 => store!("tmm0"),
                1 => store!("tmm1"),
                2 => store!("tmm2"),
                _ => store!("tmm3"),
            }
        }
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        // SAFETY: a session exists only after `start` configured the tiles.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }
}

/// The products of one weight-tile group (`TN` tiles of 16 rows at `b[j]`, a block every
/// [`B_TILE_BYTES`]) and one token-tile group (`TM` tiles at `a[i]`, a block every
/// [`A_TILE_BYTES`]; with two parts, the second part `part_bytes` further) over `blocks` blocks,
/// into sum tile tmm(2i + j). A block's weight tiles are loaded once for both parts. After each
/// block `between(block)` runs: vector work (the next weight tiles' decode) that the core
/// issues while the matrix unit multiplies.
///
/// # Safety
/// A [`TileSession`] is alive; the first `TM` of `a` (and their second parts) and `TN` of `b`
/// point at `blocks` tiles.
#[inline(always)]
unsafe fn run_blocks<const TM: usize, const TN: usize>(
    _session: &TileSession,
    a: [*const u8; 2],
    (parts, part_bytes): (usize, usize),
    b: [*const u8; 2],
    blocks: usize,
    mut between: impl FnMut(usize),
) {
    let row = 64usize;
    // SAFETY: every load reads a tile inside the ranges of the contract.
    unsafe {
        for block in 0..blocks {
            let b0 = b[0].add(block * B_TILE_BYTES);
            let b1 = b[1].wrapping_add(block * B_TILE_BYTES);
            if TN == 1 {
                asm!(
                    "tileloadd tmm6, [{b0} + {row} * 1]",
                    b0 = in(reg) b0, row = in(reg) row, options(nostack, readonly),
                );
            } else {
                asm!(
                    "tileloadd tmm6, [{b0} + {row} * 1]",
                    "tileloadd tmm7, [{b1} + {row} * 1]",
                    b0 = in(reg) b0, b1 = in(reg) b1, row = in(reg) row,
                    options(nostack, readonly),
                );
            }
            for part in 0..parts {
                let at = part * part_bytes + block * A_TILE_BYTES;
                let (a0, a1) = (a[0].add(at), a[1].wrapping_add(at));
                match (TM, TN) {
                    (1, 1) => asm!(
                        "tileloadd tmm4, [{a0} + {row} * 1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        a0 = in(reg) a0, row = in(reg) row, options(nostack, readonly),
                    ),
                    (1, _) => asm!(
                        "tileloadd tmm4, [{a0} + {row} * 1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        a0 = in(reg) a0, row = in(reg) row, options(nostack, readonly),
                    ),
                    (_, 1) => asm!(
                        "tileloadd tmm4, [{a0} + {row} * 1]",
                        "tileloadd tmm5, [{a1} + {row} * 1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        a0 = in(reg) a0, a1 = in(reg) a1, row = in(reg) row,
                        options(nostack, readonly),
                    ),
                    _ => asm!(
                        "tileloadd tmm4, [{a0} + {row} * 1]",
                        "tileloadd tmm5, [{a1} + {row} * 1]",
                        "tdpbf16ps tmm0, tmm4, tmm6",
                        "tdpbf16ps tmm1, tmm4, tmm7",
                        "tdpbf16ps tmm2, tmm5, tmm6",
                        "tdpbf16ps tmm3, tmm5, tmm7",
                        a0 = in(reg) a0, a1 = in(reg) a1, row = in(reg) row,
                        options(nostack, readonly),
                    ),
                }
            }
            between(block);
        }
    }
}

/// Each pool thread's operand buffers, grown to the largest call and then reused.
#[derive(Default)]
struct Scratch {
    /// Packed activations: per part (1 or 2), `padded tokens x K` bf16.
    activations: AlignedVec<u16>,
    /// Decoded weight tiles (two tiles of `blocks` B tiles) and the sum tiles' f32 on the way
    /// out.
    bytes: AlignedVec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// The upper half of an f32 rounded to nearest, ties to even (finite values; overflow rounds to
/// infinity), in the low 16 bits of each lane.
#[inline(always)]
unsafe fn round_to_bf16(bits: __m512i) -> __m512i {
    // SAFETY: plain AVX-512 F arithmetic, available in every caller.
    unsafe {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        _mm512_srli_epi32::<16>(rounded)
    }
}

/// Packs the tokens of `x` as A tile rows: `padded` rows of `K` bf16 in natural element order,
/// each block times its scale; with `parts == 2` the f32 value's bf16 rounding goes to the
/// first part and what that missed, rounded, to the second. Rows past the tokens are zero.
///
/// # Safety
/// AVX-512 F/BW available; `a` holds `parts x padded x K` elements, `K = blocks x 32` the
/// activations' columns.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_activations(
    x: &Q8Activations,
    blocks: usize,
    padded: usize,
    parts: usize,
    a: &mut [u16],
) {
    let k = blocks * BLOCK_LEN;
    let part_len = padded * k;
    debug_assert!(a.len() >= parts * part_len);
    // The last token tile's rows past the tokens stay zero.
    if x.rows() < padded {
        let last = (padded / TILE - 1) * blocks * TILE * A_BLOCK;
        for part in 0..parts {
            a[part * part_len + last..(part + 1) * part_len].fill(0);
        }
    }
    // SAFETY: every 16-byte load lies inside a token's quantized row (a block's evens and odds),
    // every 64-byte store inside `a` (sizes above); the features are the caller's contract.
    unsafe {
        let upper = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for token in 0..x.rows() {
            let quants = x.row_quants(token).as_ptr();
            let row = a
                .as_mut_ptr()
                .add((token / TILE) * blocks * TILE * A_BLOCK + (token % TILE) * A_BLOCK);
            for block in 0..blocks {
                let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
                let evens = group * GROUP_LEN + j * (BLOCK_LEN / 2);
                let scale = _mm512_set1_ps(x.block_scale(token, block));
                let widen = |at: usize| {
                    let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(quants.add(at).cast()));
                    _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale)
                };
                let (even, odd) = (widen(evens), widen(evens + GROUP_LEN / 2));
                // Lane i: element 2i in the low word, 2i + 1 in the high word.
                let join = |even: __m512i, odd: __m512i| {
                    _mm512_or_si512(even, _mm512_slli_epi32::<16>(odd))
                };
                let at = row.add(block * TILE * A_BLOCK);
                if parts == 1 {
                    // Power-of-two scales: the products are exact in bf16 (upper halves).
                    let pair = _mm512_or_si512(
                        _mm512_srli_epi32::<16>(_mm512_castps_si512(even)),
                        _mm512_and_si512(_mm512_castps_si512(odd), upper),
                    );
                    _mm512_storeu_si512(at.cast(), pair);
                } else {
                    let split = |v: __m512| {
                        let high = round_to_bf16(_mm512_castps_si512(v));
                        let rest =
                            _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(high)));
                        (high, round_to_bf16(_mm512_castps_si512(rest)))
                    };
                    let ((even_high, even_low), (odd_high, odd_low)) = (split(even), split(odd));
                    _mm512_storeu_si512(at.cast(), join(even_high, odd_high));
                    _mm512_storeu_si512(at.add(part_len).cast(), join(even_low, odd_low));
                }
            }
        }
    }
}

/// The MXFP4 weight decode into B tiles (see the module's doc), its constants loaded once.
struct Decoder {
    table: __m512i,
    shifts: __m512i,
    gather: [__m512i; 4],
    code: __m512i,
}

impl Decoder {
    /// # Safety
    /// AVX-512 F/BW available.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn new() -> Self {
        // SAFETY: the loads read the constant tables whole; AVX-512 F is the caller's contract.
        unsafe {
            Decoder {
                table: _mm512_loadu_si512(FP4_BF16.as_ptr().cast()),
                shifts: _mm512_loadu_si512(NIBBLE_SHIFTS.as_ptr().cast()),
                gather: std::array::from_fn(|j| _mm512_loadu_si512(PAIR_GATHER[j].as_ptr().cast())),
                code: _mm512_set1_epi16(7),
            }
        }
    }

    /// Decodes block `block` of tile `tile` of a tiled MXFP4 `w` into one B tile at `dst`: each
    /// weight `FP4 x 2^(s-127)` exactly.
    ///
    /// # Safety
    /// AVX-512 F/BW/VBMI available; `tile` is a tile of `w` (tiled layout) and `block` a block
    /// of its rows; `dst` has [`B_TILE_BYTES`] writable bytes, 64-byte aligned.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn block(&self, w: &Mxfp4Matrix, tile: usize, block: usize, dst: *mut u8) {
        let (bytes_at, scales_at) = w.tile_offsets(tile);
        let at = bytes_at + block * 4 * 64;
        let vectors = &w.blocks[at..at + 4 * 64];
        let scales = &w.scales[scales_at + block * TILE..scales_at + (block + 1) * TILE];
        if !scales.iter().all(|s| EXACT_SCALES.contains(s)) {
            // SAFETY: `dst` is the caller's contract.
            unsafe { decode_block_scalar(w, tile, block, dst.cast()) };
            return;
        }
        // SAFETY: the loads read inside `vectors` and `scales`, the stores inside `dst` (the
        // caller's contract); the features are the caller's contract.
        unsafe {
            // Word lanes 2n and 2n+1: (s_n - 127) << 7, the exponent move of row n.
            let s = _mm_loadu_si128(scales.as_ptr().cast());
            let doubled = _mm256_set_m128i(_mm_unpackhi_epi8(s, s), _mm_unpacklo_epi8(s, s));
            let shift = _mm512_slli_epi16::<7>(_mm512_sub_epi16(
                _mm512_cvtepu8_epi16(doubled),
                _mm512_set1_epi16(127),
            ));
            for dword in 0..4 {
                let v = _mm512_loadu_si512(vectors.as_ptr().add(dword * 64).cast());
                for (j, gather) in self.gather.iter().enumerate() {
                    // Junk above the nibble is ignored: `vpermw` reads five index bits and the
                    // table repeats after 16, and the zero test reads three.
                    let index = _mm512_srlv_epi16(_mm512_permutexvar_epi8(*gather, v), self.shifts);
                    let nonzero = _mm512_test_epi16_mask(index, self.code);
                    // Zeros stay zero: only nonzero values have an exponent to move.
                    let value = _mm512_maskz_add_epi16(
                        nonzero,
                        _mm512_permutexvar_epi16(index, self.table),
                        shift,
                    );
                    _mm512_store_si512(dst.add((dword * 4 + j) * 64).cast(), value);
                }
            }
        }
    }
}

/// [`Decoder::block`] for a block whose scales the exponent add cannot take: each weight
/// through f32 (`FP4 x e8m0_kernel_scale(s)`, as the reference scales it) rounded to bf16.
///
/// # Safety
/// `dst` has [`B_TILE_BYTES`] writable bytes, 2-byte aligned.
unsafe fn decode_block_scalar(w: &Mxfp4Matrix, tile: usize, block: usize, dst: *mut u16) {
    for pair in 0..TILE {
        for n in 0..TILE {
            let row = tile * MXFP4_TILE_ROWS + n;
            let scale = e8m0_kernel_scale(w.scale_byte(row, block));
            for half in 0..2 {
                let k = block * BLOCK_LEN + 2 * pair + half;
                let value = FP4_E2M1[w.nibble(row, k) as usize] * scale;
                // SAFETY: pair * 32 + n * 2 + half < 512 elements = B_TILE_BYTES bytes.
                unsafe {
                    *dst.add(pair * 2 * TILE + n * 2 + half) = half::bf16::from_f32(value).to_bits()
                };
            }
        }
    }
}

/// Token tiles multiplied in one pass over the weights: their activations (1.4 MiB at two
/// parts of 2880 columns) and the decoded weight pairs stay in L2; a longer batch takes several
/// passes, each decoding the weights again (mostly hidden behind the products).
const CHUNK_TOKEN_TILES: usize = 4;

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled MXFP4 `w`, on the matrix
/// unit. Weight tiles go in pairs: while the matrix unit multiplies one pair with every token
/// tile, the vector units decode the next pair into the other half of a double buffer.
///
/// # Safety
/// [`availability`] returned `Ok` (which needs AVX-512 F/BW/VBMI), `w` is tiled, and the shapes
/// were checked as for every GEMM (`x.cols() == w.cols`, rows inside `w`, `out` is tokens x
/// rows).
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(crate) unsafe fn mxfp4_gemm(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    debug_assert_eq!(w.layout, Mxfp4Layout::Tiles);
    let tokens = x.rows();
    if rows.is_empty() || tokens == 0 {
        return;
    }
    let blocks = w.cols / BLOCK_LEN;
    let k = blocks * BLOCK_LEN;
    let padded = tokens.div_ceil(TILE) * TILE;
    let token_tiles = padded / TILE;
    // Power-of-two block scales make every activation exact in one bf16; others take two.
    let parts = if x.scale_exponents().is_some_and(|e| e.powers_of_two) {
        1
    } else {
        2
    };
    let width = rows.len();
    let weight_tiles = rows.start / MXFP4_TILE_ROWS..rows.end.div_ceil(MXFP4_TILE_ROWS);
    // A pair of weight tiles' decoded blocks, twice (the pair multiplied, the next decoded).
    let pair_bytes = 2 * blocks * B_TILE_BYTES;
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let scratch = &mut *scratch;
        if scratch.activations.len() < parts * padded * k {
            scratch.activations.resize(parts * padded * k, 0);
        }
        if scratch.bytes.len() < 2 * pair_bytes + 4 * C_TILE_BYTES {
            scratch.bytes.resize(2 * pair_bytes + 4 * C_TILE_BYTES, 0);
        }
        let (decoded, sums) = scratch.bytes.split_at_mut(2 * pair_bytes);
        let decoded = decoded.as_mut_ptr();
        let sums = sums.as_mut_ptr();
        let a = &mut scratch.activations[..];
        // SAFETY: the caller guarantees the tile state and the features; every pointer below
        // stays inside the scratch parts sized above (each a multiple of 64 bytes long, so
        // every part and tile starts on a 64-byte boundary), the matrix's tiles, or (for the
        // masked stores) the lanes of `out` that `rows` covers.
        unsafe {
            pack_activations(x, blocks, padded, parts, a);
            let a = a.as_ptr().cast::<u8>();
            let part_bytes = padded * k * 2;
            let decoder = Decoder::new();
            // Where tile `j` of a pair in buffer half `half` keeps its decoded blocks.
            let slot =
                |half: usize, j: usize| decoded.add(half * pair_bytes + j * blocks * B_TILE_BYTES);
            let pair_len = |first: usize| (weight_tiles.end - first).min(2);
            let session = TileSession::start();
            for chunk in (0..token_tiles).step_by(CHUNK_TOKEN_TILES) {
                let chunk_end = (chunk + CHUNK_TOKEN_TILES).min(token_tiles);
                for j in 0..pair_len(weight_tiles.start) {
                    for block in 0..blocks {
                        decoder.block(
                            w,
                            weight_tiles.start + j,
                            block,
                            slot(0, j).add(block * B_TILE_BYTES),
                        );
                    }
                }
                let mut tile = weight_tiles.start;
                let mut half = 0;
                while tile < weight_tiles.end {
                    let tn = pair_len(tile);
                    let next = tile + tn;
                    let next_tn = if next < weight_tiles.end {
                        pair_len(next)
                    } else {
                        0
                    };
                    let b = [slot(half, 0).cast_const(), slot(half, 1).cast_const()];
                    let mut token_tile = chunk;
                    while token_tile < chunk_end {
                        let tm = (chunk_end - token_tile).min(2);
                        session.zero_sums();
                        let first = a.add(token_tile * blocks * A_TILE_BYTES);
                        let a = [first, first.wrapping_add(blocks * A_TILE_BYTES)];
                        // The first token tiles' products cover the next pair's decode.
                        let decode_next = token_tile == chunk;
                        let between = |block: usize| {
                            if decode_next {
                                for j in 0..next_tn {
                                    let dst = slot(1 - half, j).add(block * B_TILE_BYTES);
                                    decoder.block(w, next + j, block, dst);
                                }
                            }
                        };
                        let run = (parts, part_bytes);
                        match (tm, tn) {
                            (1, 1) => run_blocks::<1, 1>(&session, a, run, b, blocks, between),
                            (1, _) => run_blocks::<1, 2>(&session, a, run, b, blocks, between),
                            (_, 1) => run_blocks::<2, 1>(&session, a, run, b, blocks, between),
                            _ => run_blocks::<2, 2>(&session, a, run, b, blocks, between),
                        }
                        for i in 0..tm {
                            for j in 0..tn {
                                let c = sums.add((2 * i + j) * C_TILE_BYTES);
                                session.store_sums(2 * i + j, c);
                                let lanes = tile_lanes(tile + j, &rows);
                                let mask = (((1u32 << lanes.end) - 1)
                                    & !((1u32 << lanes.start) - 1))
                                    as __mmask16;
                                let first = tile_out(out, (tile + j) * MXFP4_TILE_ROWS, rows.start);
                                let base = (token_tile + i) * TILE;
                                for r in 0..TILE.min(tokens.saturating_sub(base)) {
                                    let v = _mm512_load_ps(c.add(r * 64).cast());
                                    _mm512_mask_storeu_ps(
                                        first.wrapping_add((base + r) * width),
                                        mask,
                                        v,
                                    );
                                }
                            }
                        }
                        token_tile += tm;
                    }
                    tile = next;
                    half = 1 - half;
                }
            }
        }
    })
}

/// Multiply-adds of one tile probe round: four products of 16 x 16 x K, K = 32 (bf16) or 64
/// (int8).
pub(crate) const fn tile_probe_round_macs(int8: bool) -> usize {
    4 * TILE * TILE * if int8 { 64 } else { 32 }
}

/// `rounds` rounds of four independent tile products (`tdpbssd` if `int8`, else `tdpbf16ps`)
/// on operands that stay in the tile registers: the matrix unit's peak, which the GEMM is
/// measured against. Returns the first sum, so the work cannot be dropped.
///
/// # Safety
/// [`availability`] returned `Ok`.
pub(crate) unsafe fn tile_probe(rounds: usize, int8: bool) -> f32 {
    let ones = AlignedVec::<u16>::filled(TILE * 32, if int8 { 0x0101 } else { 0x3F80 });
    let mut sums = AlignedVec::<f32>::filled(TILE * TILE, 0.0);
    // SAFETY: the caller checked the tile state; the loads read the 1 KiB of `ones`, the store
    // writes the 1 KiB of `sums`.
    unsafe {
        let session = TileSession::start();
        session.zero_sums();
        asm!(
            "tileloadd tmm4, [{p} + {row} * 1]",
            "tileloadd tmm5, [{p} + {row} * 1]",
            "tileloadd tmm6, [{p} + {row} * 1]",
            "tileloadd tmm7, [{p} + {row} * 1]",
            p = in(reg) ones.as_ptr(),
            row = in(reg) 64usize,
            options(nostack, readonly),
        );
        for _ in 0..rounds {
            if int8 {
                asm!(
                    "tdpbssd tmm0, tmm4, tmm6",
                    "tdpbssd tmm1, tmm4, tmm7",
                    "tdpbssd tmm2, tmm5, tmm6",
                    "tdpbssd tmm3, tmm5, tmm7",
                    options(nostack, nomem),
                );
            } else {
                asm!(
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    options(nostack, nomem),
                );
            }
        }
        session.store_sums(0, sums.as_mut_ptr().cast());
    }
    sums[0]
}
