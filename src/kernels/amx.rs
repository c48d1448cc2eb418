//! AMX (Intel Advanced Matrix Extensions) tile products for prefill: `tdpbssd` multiplies a
//! 16 x 32 int8 tile of activations by a 32 x 16 int8 tile of weights into 16 x 16 int32 sums on
//! the core's matrix unit, which the vector units then scale, with no `vpdpbusd` per product.
//! It runs the tiled MXFP4 products (the experts) and the tiled Q8 ones (the attention
//! projections) of 16 rows and more. [`TileSession`] also holds the tile-register operations
//! (load, store, clear, `tdpbf16ps`) the bf16 attention of `attention/amx.rs` is built from.
//!
//! # Per-block scales, and the same bits as AVX-512
//! Every integer format scales each block of 32 weights and of 32 activations on its own, so a
//! tile's K is one block: each `tdpbssd` gives the exact int32 block sums of 16 tokens x 16 weight
//! rows, the integers every other path computes. They leave the unit (`tilestored`) and are added
//! into 16 f32 accumulators with one convert and one FMA by `weight scale x activation scale` per
//! 16 sums, block by block in column order, then times the format's factor (MXFP4's doubled
//! table: halved): the float steps
//! of the AVX-512 tile GEMM in the same order, so the results are its bits, and a row's bits do
//! not depend on which kernel (GEMV, AVX-512 or AMX GEMM) the number of rows sharing its product
//! chose. Four sum tiles rotate so the matrix unit works two blocks ahead of the float work, which
//! scales a block's sums one step after storing them (a load right behind a tile store waits for
//! it). Measured apart (one thread, M = 128, 2880 x 2880): the tile operations alone (loads,
//! product, store per block and token tile) 2.4 ms, the float work alone 2.2 ms, both 3.1 ms;
//! neither comes near its unit's peak, so the next step is fewer tile loads and stores per product
//! (two token tiles per weight tile) and fewer float operations per sum.
//!
//! A bf16 kernel (`tdpbf16ps`: MXFP4 weights and power-of-two-scaled activations are exact in
//! bf16, and the sums stay in the tile along the row) was built and measured too: 1.0-1.1x this
//! one's speed from 32 rows, slower below (its weight decode costs four times as much), and other
//! bits than the AVX-512 kernels, which would have made a prompt's results depend on the kernel
//! its rows' count picked (cold and warm turns, batched and alone). Not kept.
//!
//! # Operands
//! * Weights (B tiles, 8 rows x 64 bytes: row q holds bytes 4q..4q+4 of the block of each of the
//!   16 weight rows): the AVX-512 tile kernels' operands ([`TileSource::operands`]) already are
//!   such rows: per tile, block and dword `s` of a tiled MXFP4 matrix ([`Mxfp4Layout::Tiles`]) its
//!   low nibbles (elements 8s, 8s+2, 8s+4, 8s+6) decode straight into B row `s` and its high
//!   nibbles into row `4 + s`, and a tiled Q8 matrix stores both rows as they are. Those operands
//!   are unsigned (the format's offset added for `vpdpbusd`); less the offset they are the signed
//!   bytes `tdpbssd` takes, whose sums are the unsigned sums plus the activations' correction:
//!   the same integers. A decoded tile (512 bytes a block) serves every token tile of a pass.
//! * Activations (A tiles, 16 tokens x 32 bytes): [`Q8Activations`] keep a group's even elements
//!   before its odd ones, 16 bytes per block each; packed once per call as, per block, the 16 even
//!   then the 16 odd elements (the order the B rows above expect), 512 contiguous bytes a tile.
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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::aligned::AlignedVec;
use super::avx2::prefetch_share_capped;
use super::avx512::tiles::{Mxfp4Tiles, Q8Tiles, TileSource};
use super::avx512::{format_factor, FORMAT_MXFP4};
use super::formats::{
    tile_lanes, tile_out, Mxfp4Layout, Mxfp4Matrix, Q8Activations, Q8Matrix, BLOCK_LEN,
    GROUP_BLOCKS, GROUP_LEN, MXFP4_TILE_ROWS,
};

/// Tokens of an A tile and weight rows of a B tile.
const TILE: usize = 16;
/// Bytes of one A tile: 16 tokens' block of 32 int8 values.
const A_TILE_BYTES: usize = TILE * BLOCK_LEN;
/// Bytes of one decoded weight tile: 8 rows of 64 bytes (K = 32 for 16 weight rows).
const B_TILE_BYTES: usize = 8 * 64;
/// Bytes of one tile of int32 sums: 16 rows of 16 lanes.
const C_TILE_BYTES: usize = TILE * 64;
/// Sum tiles in rotation (tmm0..tmm3); the matrix unit runs [`LOOKAHEAD`] blocks ahead.
const SUM_TILES: usize = 4;
const LOOKAHEAD: usize = 2;
/// Token tiles multiplied in one pass over the weights: their packed activations (360 KiB at
/// 2880 columns) and the decoded weight tile stay in L2 while the tile is reused. With 4, a
/// 58-token prompt's attention projections (116 split rows) read their weights from memory
/// twice: 147-155 ms of attention against 129-136 ms with 8 (Xeon, `bench --profile`, two
/// alternations; a 512-token prefill the same within noise).
const PASS_TOKEN_TILES: usize = 8;

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
    // The GEMMs decode MXFP4 with `vpermb` (every CPU with AMX so far has AVX-512 VBMI).
    if !super::avx512::vbmi_detected() {
        missing.push("avx512-vbmi");
    }
    missing
}

/// Whether AMX runs here ([`availability`]) with AMX-BF16 too (CPUID leaf 7 EDX bit 22), and
/// AVX-512 BF16 and DQ for the vector work around the tiles: the bf16 tile products of attention
/// ([`crate::kernels::attention`]).
pub(crate) fn bf16_available() -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| {
        availability().is_ok()
            && __cpuid(0).eax >= 7
            && __cpuid_count(7, 0).edx & (1 << 22) != 0
            && std::arch::is_x86_feature_detected!("avx512bf16")
            && std::arch::is_x86_feature_detected!("avx512dq")
    })
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
pub(in crate::kernels) struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// Palette 1 with tile registers 0..8 of `rows` rows of `bytes_per_row` bytes.
    const fn palette1(bytes_per_row: [u16; 8], rows: [u8; 8]) -> Self {
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        let mut t = 0;
        while t < 8 {
            config.bytes_per_row[t] = bytes_per_row[t];
            config.rows[t] = rows[t];
            t += 1;
        }
        config
    }
}

/// The block products' tiles: tmm0..tmm3 int32 sums (16 x 64 bytes); tmm4, tmm5 activations
/// (16 tokens x 32 bytes); tmm6, tmm7 weights (8 x 64 bytes: 32 K values of 16 rows).
static BLOCK_CONFIG: TileConfig = TileConfig::palette1(
    [64, 64, 64, 64, 32, 32, 64, 64],
    [16, 16, 16, 16, 16, 16, 8, 8],
);

/// The peak probe's tiles, and the bf16 attention's: all eight 16 x 64 bytes (K = 64 int8 or
/// 32 bf16).
pub(in crate::kernels) static FULL_CONFIG: TileConfig = TileConfig::palette1([64; 8], [16; 8]);

/// The tile registers configured while alive; released on drop, so the thread carries no tile
/// state between calls (and the OS saves none for it).
pub(in crate::kernels) struct TileSession;

impl TileSession {
    /// # Safety
    /// [`availability`] returned `Ok`.
    pub(in crate::kernels) unsafe fn start(config: &'static TileConfig) -> Self {
        // SAFETY: the caller checked that the OS granted the tile state; the operand is a valid
        // 64-byte configuration.
        unsafe {
            asm!(
                "ldtilecfg [{}]",
                in(reg) config as *const TileConfig,
                options(nostack, readonly),
            );
        }
        TileSession
    }

    /// Clears the four sum tiles.
    fn zero_sums(&self) {
        for tmm in 0..SUM_TILES {
            self.zero(tmm);
        }
    }

    /// Clears sum tile `tmm` (0..4).
    #[inline(always)]
    pub(in crate::kernels) fn zero(&self, tmm: usize) {
        // SAFETY: the session configured the tiles; a register-only instruction.
        unsafe {
            match tmm {
                0 => asm!("tilezero tmm0", options(nostack, nomem)),
                1 => asm!("tilezero tmm1", options(nostack, nomem)),
                2 => asm!("tilezero tmm2", options(nostack, nomem)),
                _ => asm!("tilezero tmm3", options(nostack, nomem)),
            }
        }
    }

    /// Loads operand tile `tmm` (4..8) from `at`, its rows `stride` bytes apart.
    ///
    /// # Safety
    /// As many rows as the session's configuration gives the register, of its bytes per row,
    /// are readable from `at`, `stride` apart.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn load(&self, tmm: usize, at: *const u8, stride: usize) {
        macro_rules! load {
            ($t:literal) => {
                asm!(
                    concat!("tileloadd ", $t, ", [{at} + {stride} * 1]"),
                    at = in(reg) at,
                    stride = in(reg) stride,
                    options(nostack, readonly),
                )
            };
        }
        // SAFETY: the caller upholds the contract.
        unsafe {
            match tmm {
                4 => load!("tmm4"),
                5 => load!("tmm5"),
                6 => load!("tmm6"),
                _ => load!("tmm7"),
            }
        }
    }

    /// Stores sum tile `tmm` (0..4) to `at`, its rows `stride` bytes apart.
    ///
    /// # Safety
    /// As for [`TileSession::load`], writable.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn store(&self, tmm: usize, at: *mut u8, stride: usize) {
        macro_rules! store {
            ($t:literal) => {
                asm!(
                    concat!("tilestored [{at} + {stride} * 1], ", $t),
                    at = in(reg) at,
                    stride = in(reg) stride,
                    options(nostack),
                )
            };
        }
        // SAFETY: the caller upholds the contract.
        unsafe {
            match tmm {
                0 => store!("tmm0"),
                1 => store!("tmm1"),
                2 => store!("tmm2"),
                _ => store!("tmm3"),
            }
        }
    }

    /// `tmm{c} += tmm{a} . tmm{b}` in bf16 pairs summed in f32 (`tdpbf16ps`, AMX-BF16); c in
    /// 0..4, a in 4..6, b in 6..8. The caller checked [`bf16_available`] before starting the
    /// session (a register-only instruction otherwise safe on configured tiles).
    #[inline(always)]
    pub(in crate::kernels) fn dot_bf16(&self, c: usize, a: usize, b: usize) {
        macro_rules! dot {
            ($c:literal, $a:literal, $b:literal) => {
                asm!(
                    concat!("tdpbf16ps ", $c, ", ", $a, ", ", $b),
                    options(nostack, nomem)
                )
            };
        }
        // SAFETY: the session configured the tiles; register-only.
        unsafe {
            match (c, a, b) {
                (0, 4, 6) => dot!("tmm0", "tmm4", "tmm6"),
                (0, 4, 7) => dot!("tmm0", "tmm4", "tmm7"),
                (0, 5, 6) => dot!("tmm0", "tmm5", "tmm6"),
                (0, 5, 7) => dot!("tmm0", "tmm5", "tmm7"),
                (1, 4, 6) => dot!("tmm1", "tmm4", "tmm6"),
                (1, 4, 7) => dot!("tmm1", "tmm4", "tmm7"),
                (1, 5, 6) => dot!("tmm1", "tmm5", "tmm6"),
                (1, 5, 7) => dot!("tmm1", "tmm5", "tmm7"),
                (2, 4, 6) => dot!("tmm2", "tmm4", "tmm6"),
                (2, 4, 7) => dot!("tmm2", "tmm4", "tmm7"),
                (2, 5, 6) => dot!("tmm2", "tmm5", "tmm6"),
                (2, 5, 7) => dot!("tmm2", "tmm5", "tmm7"),
                (3, 4, 6) => dot!("tmm3", "tmm4", "tmm6"),
                (3, 4, 7) => dot!("tmm3", "tmm4", "tmm7"),
                (3, 5, 6) => dot!("tmm3", "tmm5", "tmm6"),
                (3, 5, 7) => dot!("tmm3", "tmm5", "tmm7"),
                _ => unreachable!("sum tiles 0..4, operands 4..6 and 6..8"),
            }
        }
    }

    /// Loads the activations of a block (`a`, 16 rows of 32 bytes) and its decoded weights (`b`)
    /// into the operand registers of sum tile `slot` (mod 4) and multiplies them into it from
    /// zero.
    ///
    /// # Safety
    /// `a` has [`A_TILE_BYTES`] and `b` [`B_TILE_BYTES`] readable bytes; [`BLOCK_CONFIG`] is
    /// loaded.
    #[inline(always)]
    unsafe fn issue(&self, slot: usize, a: *const u8, b: *const u8) {
        macro_rules! product {
            ($c:literal, $a:literal, $b:literal) => {
                asm!(
                    concat!("tileloadd ", $a, ", [{a} + {a_row} * 1]"),
                    concat!("tileloadd ", $b, ", [{b} + {b_row} * 1]"),
                    concat!("tilezero ", $c),
                    concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
                    a = in(reg) a,
                    a_row = in(reg) BLOCK_LEN,
                    b = in(reg) b,
                    b_row = in(reg) 64usize,
                    options(nostack, readonly),
                )
            };
        }
        // SAFETY: see the function's contract.
        unsafe {
            match slot % SUM_TILES {
                0 => product!("tmm0", "tmm4", "tmm6"),
                1 => product!("tmm1", "tmm5", "tmm7"),
                2 => product!("tmm2", "tmm4", "tmm6"),
                _ => product!("tmm3", "tmm5", "tmm7"),
            }
        }
    }

    /// Stores sum tile `slot` (mod 4) to `c` (16 rows of 64 bytes).
    ///
    /// # Safety
    /// `c` has [`C_TILE_BYTES`] writable bytes.
    #[inline(always)]
    unsafe fn store_sums(&self, slot: usize, c: *mut u8) {
        // SAFETY: the caller upholds the contract.
        unsafe { self.store(slot % SUM_TILES, c, 64) }
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        // SAFETY: a session exists only after `start` configured the tiles.
        unsafe { asm!("tilerelease", options(nostack, nomem)) }
    }
}

/// Each pool thread's operand buffers, grown to the largest call and then reused.
#[derive(Default)]
struct Scratch {
    /// Packed activations (`padded tokens x K` bytes, tile after tile), one decoded weight tile
    /// (`blocks x 512`) and the sum tiles in rotation, each part on a 64-byte boundary.
    bytes: AlignedVec<u8>,
    /// Activation block scales, per token tile and block the 16 tokens' (0 past the tokens).
    scales: AlignedVec<f32>,
    /// The [`Q8Activations::generation`] of the rows packed in `bytes` and `scales` (0: none).
    /// A dense product's rows are cut into about four tasks a thread (`model::fast::jobs`),
    /// each a call here with the same activations: packed once a thread instead of once a
    /// task, a 512-token prefill's attention projections pack 2 x 1,024 split rows where they
    /// packed 8 x (Xeon with AMX: packing was 5.4-5.8% of a prefill's samples).
    packed: u64,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Packs the tokens of `x` as A tiles: per token tile and block 16 rows of 32 bytes (the
/// block's 16 even then 16 odd elements; rows past the tokens zero), and each block's scale
/// into `scales[tile][block][row]` (0 past the tokens).
fn pack_activations(
    x: &Q8Activations,
    blocks: usize,
    padded: usize,
    a: &mut [u8],
    scales: &mut [f32],
) {
    let tile_bytes = blocks * A_TILE_BYTES;
    if x.rows() < padded {
        let last = padded / TILE - 1;
        a[last * tile_bytes..(last + 1) * tile_bytes].fill(0);
        scales[last * blocks * TILE..(last + 1) * blocks * TILE].fill(0.0);
    }
    for token in 0..x.rows() {
        let (tile, lane) = (token / TILE, token % TILE);
        let quants = x.row_quants(token);
        for block in 0..blocks {
            let (group, j) = (block / GROUP_BLOCKS, block % GROUP_BLOCKS);
            let evens = group * GROUP_LEN + j * (BLOCK_LEN / 2);
            let odds = evens + GROUP_LEN / 2;
            let at = tile * tile_bytes + block * A_TILE_BYTES + lane * BLOCK_LEN;
            let (even_dst, odd_dst) = a[at..at + BLOCK_LEN].split_at_mut(BLOCK_LEN / 2);
            for (d, &q) in even_dst
                .iter_mut()
                .zip(&quants[evens..evens + BLOCK_LEN / 2])
            {
                *d = q as u8;
            }
            for (d, &q) in odd_dst.iter_mut().zip(&quants[odds..odds + BLOCK_LEN / 2]) {
                *d = q as u8;
            }
            scales[(tile * blocks + block) * TILE + lane] = x.block_scale(token, block);
        }
    }
}

/// Writes block `block` of the tile whose operand bytes start at `vectors` (from
/// [`TileSource::tile_base`]) as a B tile of signed int8 at `dst`: the AVX-512 kernels' unsigned
/// operands of dword `s` less the format's offset ([`TileSource::signed_operands`]), their even
/// half as row `s` and odd half as row `4 + s` (the order the packed activations hold them). The
/// signed sums are the unsigned sums plus the activations' correction: the same integers.
///
/// # Safety
/// AVX-512 F/BW available; `vectors` is a tile of a `W` matrix and `block` below its blocks per
/// row; `dst` has [`B_TILE_BYTES`] writable bytes, 64-byte aligned.
#[inline(always)]
unsafe fn decode_block<W: TileSource>(vectors: *const u8, block: usize, dst: *mut u8) {
    // SAFETY: `operands` reads inside the tile for a block of the row and s < 4 (its contract,
    // upheld by the caller's); every store writes 64 bytes inside `dst`.
    unsafe {
        for s in 0..4 {
            let (evens, odds) = W::signed_operands(vectors, block, s);
            _mm512_store_si512(dst.add(s * 64).cast(), evens);
            _mm512_store_si512(dst.add((4 + s) * 64).cast(), odds);
        }
    }
}

/// Blocks a [`tile_product`] that decodes its weight tile writes ahead of the block it issues
/// to the matrix unit: a tile load right behind the vector stores of its bytes waits for them to
/// reach the cache, as a vector load behind a tile store does.
const DECODE_AHEAD: usize = 2;

/// Most bytes of the next MXFP4 weight tile a block of [`tile_product`] asks for (two lines; a
/// tile's lone token tile's share is four a block, a pass of two or more token tiles' two or
/// less). Q8 tiles (twice the bytes) keep their whole share: not measured capped.
/// As in the AVX-512 assembly loop (`avx512::tiles::HALF_PREFETCH_TOKENS`), the loop is bound by
/// the core, and each line in flight holds one of its few L1 miss buffers: capped, the hardware
/// prefetchers fetch the rest. Xeon with AMX, two threads, 460 tiled 2880 x 2880 MXFP4 matrices
/// (2 GB, past the L3) on huge pages, ms a matrix, alternating four times: 12 tokens 0.314 /
/// 0.319 / 0.319 / 0.307 -> 0.302 / 0.291 / 0.290 / 0.291, 16 tokens 0.324 / 0.325 / 0.320 /
/// 0.325 -> 0.296 / 0.318 / 0.314 / 0.307.
const PREFETCH_BYTES_PER_BLOCK: usize = 128;

/// The 16 x 16 products of one token tile (`a`: its `blocks` A tiles) and a weight tile in `b`
/// whose scales start at `scales` (from [`TileSource::tile_base`]): per block, int32 sums x
/// (weight scale x activation scale) added in f32, block by block, with `act_scales` the token
/// tile's `[block][token]` scales; prefetches share `part` of `parts` of `prefetch` into L2.
/// With `decode` (the tile's operand bytes) the weight tile is decoded into `b` as the blocks
/// go, [`DECODE_AHEAD`] blocks ahead of the matrix unit, so the vector work of the decode runs
/// while the matrix unit multiplies; without, `b` holds it decoded. Decoded whole before the
/// products, the decode and the products took turns: one 2880 x 2880 MXFP4 matrix, 16 tokens,
/// took 0.82 / 0.69 ms on one thread and 0.41 / 0.34 on two, against 0.59 / 0.58 and 0.28 / 0.30
/// decoded as it goes (Q8 one thread 0.80 / 0.84 -> 0.66 / 0.67 ms); a 58-token prefill 1146 /
/// 1171 / 1159 -> 1102 / 1012 / 1110 ms (Xeon with AMX, `bench --kernels` and `bench --profile`,
/// alternating).
///
/// # Safety
/// `session` holds [`BLOCK_CONFIG`]; the AVX-512 path's features available; `a` holds `blocks` A
/// tiles, `b` room for `blocks` B tiles (64-byte aligned; decoded unless `decode` is given, whose
/// tile has `blocks` blocks a row), `sums` [`SUM_TILES`] sum tiles (64-byte aligned) and
/// `act_scales` `blocks x 16` floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_product<W: TileSource, const ROWS: usize>(
    session: &TileSession,
    scales: *const u8,
    a: *const u8,
    b: *mut u8,
    decode: Option<*const u8>,
    sums: *mut u8,
    act_scales: *const f32,
    blocks: usize,
    prefetch: &[(*const u8, usize); 2],
    (part, parts): (usize, usize),
) -> [__m512; TILE] {
    let mut acc = [_mm512_setzero_ps(); TILE];
    // The AVX-512 tile GEMM's float steps, in its order: convert, scale product, FMA.
    let scale_block = |block: usize, acc: &mut [__m512; TILE]| {
        let c = sums.wrapping_add((block % SUM_TILES) * C_TILE_BYTES);
        // SAFETY: `c` is a stored sum tile and `block < blocks` (the contract's sizes).
        unsafe {
            let w_scales = W::scales(scales, block);
            let a_scales = act_scales.add(block * TILE);
            for (row, acc) in acc.iter_mut().enumerate().take(ROWS) {
                let sum = _mm512_cvtepi32_ps(_mm512_load_si512(c.add(row * 64).cast()));
                let scale = _mm512_mul_ps(w_scales, _mm512_set1_ps(*a_scales.add(row)));
                *acc = _mm512_fmadd_ps(sum, scale, *acc);
            }
        }
    };
    // SAFETY: block offsets stay below `blocks` (the contract's sizes).
    unsafe {
        let decode_ahead = |block: usize| {
            if let Some(vectors) = decode {
                if block < blocks {
                    decode_block::<W>(vectors, block, b.add(block * B_TILE_BYTES));
                }
            }
        };
        for block in 0..LOOKAHEAD + DECODE_AHEAD {
            decode_ahead(block);
        }
        for ahead in 0..LOOKAHEAD.min(blocks) {
            session.issue(
                ahead,
                a.add(ahead * A_TILE_BYTES),
                b.add(ahead * B_TILE_BYTES),
            );
        }
        for block in 0..blocks {
            prefetch_share_capped::<true>(
                prefetch,
                part * blocks + block,
                parts * blocks,
                if W::FORMAT == FORMAT_MXFP4 {
                    PREFETCH_BYTES_PER_BLOCK
                } else {
                    usize::MAX
                },
            );
            decode_ahead(block + LOOKAHEAD + DECODE_AHEAD);
            let next = block + LOOKAHEAD;
            if next < blocks {
                session.issue(next, a.add(next * A_TILE_BYTES), b.add(next * B_TILE_BYTES));
            }
            session.store_sums(block, sums.add((block % SUM_TILES) * C_TILE_BYTES));
            // The block stored one step before: its stores have left for the cache while this
            // one's were issued (a load right behind a tile store waits for it).
            if block > 0 {
                scale_block(block - 1, &mut acc);
            }
        }
        scale_block(blocks - 1, &mut acc);
    }
    acc
}

/// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for a tiled MXFP4 `w`, on the matrix
/// unit: the bits of the AVX-512 tile GEMM.
///
/// # Safety
/// [`availability`] returned `Ok`, the CPU has every feature of the AVX-512 path (as every CPU
/// of the `amx` path), `w` is tiled, and the shapes were checked as for every GEMM (`x.cols() ==
/// w.cols`, rows inside `w`, `out` is tokens x rows).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn mxfp4_gemm(
    w: &Mxfp4Matrix,
    x: &Q8Activations,
    rows: Range<usize>,
    out: &mut [f32],
) {
    debug_assert_eq!(w.layout, Mxfp4Layout::Tiles);
    // SAFETY: the caller's contract is `gemm`'s.
    unsafe { gemm(&Mxfp4Tiles::<true>(w), x, rows, out) }
}

/// As [`mxfp4_gemm`] for a tiled Q8 `w`: the bits of the AVX-512 Q8 tile GEMM.
///
/// # Safety
/// As [`mxfp4_gemm`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn q8_gemm(w: &Q8Matrix, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    debug_assert!(w.tiled);
    // SAFETY: the caller's contract is `gemm`'s.
    unsafe { gemm(&Q8Tiles(w), x, rows, out) }
}

/// GEMMs the matrix unit has run in this process (one relaxed add a call, not per block): how
/// tests see that the `amx` path took it, since its results are the AVX-512 path's bits.
static GEMMS: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn gemm_count() -> usize {
    GEMMS.load(Ordering::Relaxed)
}

/// The matrix unit's GEMM of a tiled `w`: per pass of up to [`PASS_TOKEN_TILES`] token tiles,
/// each weight tile decoded once into B tiles (as the pass's first token tile is multiplied)
/// and multiplied by every token tile of the pass.
///
/// # Safety
/// As [`mxfp4_gemm`]. It carries the features itself (not only its callers), so that the
/// scratch closure below is compiled with them: without, its intrinsics were calls and the
/// GEMM ran at a quarter of its speed. They are the AVX-512 path's whole set, not only what
/// this file's intrinsics need, so that the MXFP4 operand decode (`split_nibbles`, compiled
/// with that set) inlines: with F/BW/F16C alone it was a call per 64 weight bytes, and a call of
/// 16 tokens ran 7-8% slower (one thread, weights in L2).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn gemm<W: TileSource>(w: &W, x: &Q8Activations, rows: Range<usize>, out: &mut [f32]) {
    let tokens = x.rows();
    if rows.is_empty() || tokens == 0 {
        return;
    }
    GEMMS.fetch_add(1, Ordering::Relaxed);
    let blocks = w.cols() / BLOCK_LEN;
    let padded = tokens.div_ceil(TILE) * TILE;
    let token_tiles = padded / TILE;
    let width = rows.len();
    let a_len = padded * blocks * BLOCK_LEN;
    let b_len = blocks * B_TILE_BYTES;
    let c_len = SUM_TILES * C_TILE_BYTES;
    SCRATCH.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let scratch = &mut *scratch;
        if scratch.bytes.len() < a_len + b_len + c_len {
            scratch.bytes.resize(a_len + b_len + c_len, 0);
            scratch.packed = 0;
        }
        if scratch.scales.len() < padded * blocks {
            scratch.scales.resize(padded * blocks, 0.0);
            scratch.packed = 0;
        }
        // The packing depends on `x` alone (its columns give `blocks`, its rows `padded`).
        let generation = x.generation();
        let packed = generation != 0 && scratch.packed == generation;
        // Every part starts on a 64-byte boundary: the lengths before it are multiples of 512.
        let (a, rest) = scratch.bytes.split_at_mut(a_len);
        let (b, rest) = rest.split_at_mut(b_len);
        let sums = rest[..c_len].as_mut_ptr();
        let act_scales = &mut scratch.scales[..padded * blocks];
        if !packed {
            pack_activations(x, blocks, padded, a, act_scales);
            scratch.packed = generation;
        }
        // SAFETY: the caller guarantees the tile state and the features; every pointer below
        // stays inside the scratch parts sized above, the matrix's tiles, or (for the masked
        // stores) the lanes of `out` that `rows` covers.
        unsafe {
            let session = TileSession::start(&BLOCK_CONFIG);
            let factor = _mm512_set1_ps(format_factor(W::FORMAT));
            let weight_tiles = rows.start / MXFP4_TILE_ROWS..rows.end.div_ceil(MXFP4_TILE_ROWS);
            for pass in (0..token_tiles).step_by(PASS_TOKEN_TILES) {
                let pass_end = (pass + PASS_TOKEN_TILES).min(token_tiles);
                for tile in weight_tiles.clone() {
                    let (vectors, scales) = w.tile_base(tile);
                    // The next tile (past `rows` up to the matrix's end, so the next task's
                    // first tile is not a cold miss either) comes into L2 while this one's
                    // token tiles are multiplied: the decode above would otherwise wait for
                    // memory at every tile.
                    let next = ((tile + 1) * MXFP4_TILE_ROWS).min(w.rows());
                    let spans = w.spans(next..(next + MXFP4_TILE_ROWS).min(w.rows()));
                    let lanes = tile_lanes(tile, &rows);
                    let mask =
                        (((1u32 << lanes.end) - 1) & !((1u32 << lanes.start) - 1)) as __mmask16;
                    let first = tile_out(out, tile * MXFP4_TILE_ROWS, rows.start);
                    for token_tile in pass..pass_end {
                        let base = token_tile * TILE;
                        macro_rules! product {
                            ($rows:literal) => {
                                tile_product::<W, $rows>(
                                    &session,
                                    scales,
                                    a.as_ptr().add(token_tile * blocks * A_TILE_BYTES),
                                    b.as_mut_ptr(),
                                    (token_tile == pass).then_some(vectors),
                                    sums,
                                    act_scales.as_ptr().add(token_tile * blocks * TILE),
                                    blocks,
                                    &spans,
                                    (token_tile - pass, pass_end - pass),
                                )
                            };
                        }
                        // A short last token tile scales only its tokens' rows (in steps of
                        // four): its other sums are zero products nobody reads.
                        let acc = match (tokens - base).min(TILE) {
                            1..=4 => product!(4),
                            5..=8 => product!(8),
                            9..=12 => product!(12),
                            _ => product!(16),
                        };
                        for (row, acc) in acc.iter().enumerate().take(tokens - base) {
                            _mm512_mask_storeu_ps(
                                first.wrapping_add((base + row) * width),
                                mask,
                                _mm512_mul_ps(*acc, factor),
                            );
                        }
                    }
                }
            }
        }
    })
}

/// Multiply-adds of one tile probe round: four `tdpbssd` of 16 x 16 x 64.
pub(crate) const TILE_PROBE_ROUND_MACS: usize = 4 * TILE * TILE * 64;

/// `rounds` rounds of four independent `tdpbssd` on operands that stay in the tile registers:
/// the matrix unit's int8 peak, which the GEMM is measured against. Returns the first sum, so
/// the work cannot be dropped.
///
/// # Safety
/// [`availability`] returned `Ok`.
pub(crate) unsafe fn tile_probe(rounds: usize) -> i32 {
    let ones = AlignedVec::<u8>::filled(TILE * 64, 1);
    let mut sums = AlignedVec::<i32>::filled(TILE * TILE, 0);
    // SAFETY: the caller checked the tile state; the loads read the 1 KiB of `ones`, the store
    // writes the 1 KiB of `sums`.
    unsafe {
        let session = TileSession::start(&FULL_CONFIG);
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
            asm!(
                "tdpbssd tmm0, tmm4, tmm6",
                "tdpbssd tmm1, tmm4, tmm7",
                "tdpbssd tmm2, tmm5, tmm6",
                "tdpbssd tmm3, tmm5, tmm7",
                options(nostack, nomem),
            );
        }
        session.store_sums(0, sums.as_mut_ptr().cast());
    }
    sums[0]
}
