//! Numeric kernels: quantized matrix-vector and matrix-matrix products, and the small f32/f16 helpers
//! attention needs, each with a scalar reference and AVX2 and AVX-512 paths.
//!
//! # Choosing a path
//! The path is chosen once per process: call [`init_kernel_path`] at start-up (it reads
//! `OSSTERM_KERNELS=scalar|avx2|avx2-vnni|avx512|amx|auto` and refuses a path this CPU lacks), then [`kernels`]
//! hands out a [`Kernels`] value whose methods run on that path. Tests and benchmarks build a
//! [`Kernels`] for any supported path with [`Kernels::new`] and compare them side by side.
//!
//! * `Avx512`: AVX-512 F/BW with VNNI (`vpdpbusd`), F16C and FMA; where AVX-512 VBMI is detected
//!   too, the MXFP4 GEMV decodes nibbles with `vpermb` ([`Kernels::without_vbmi`] turns it off).
//! * `Amx`: the AVX-512 path with its tiled MXFP4 and Q8 GEMMs of [`AMX_MIN_ROWS`] activation
//!   rows and more on the AMX matrix unit (`tdpbssd`, see the `amx` module), with the AVX-512
//!   GEMM's bits; where the CPU reports AMX-TILE, AMX-INT8 and AVX-512 VBMI and the OS grants the
//!   tile state, `auto` picks it. With
//!   AMX-BF16 too, attention over the f16 cache runs there in bf16
//!   ([`Kernels::uses_amx_attention`]).
//! * `Avx2Vnni`: the AVX2 path whose MXFP4 tile products and int8 probe sum with 256-bit
//!   `vpdpbusd`: AVX-VNNI (Intel's client cores from Alder Lake on, which lack AVX-512; Zen 5),
//!   or the EVEX form of AVX-512 VNNI/VL on CPUs that have that instead (so the path runs, and
//!   is tested, where AVX-512 is the default).
//! * `Avx2`: AVX2 (`vpmaddubsw` + `vpmaddwd`), F16C and FMA.
//! * `Scalar`: always available; the reference the others are tested against.
//!
//! AVX-512 BF16 (`vdpbf16ps`) serves only the fast path's attention over an f16 cache, where the
//! CPU issues it as fast as an f32 FMA ([`Kernels::uses_bf16_attention`]); the exact bf16 weight
//! products must not round their f32 activations to bf16.
//!
//! # Integer formats and the forward pass
//! ```text
//! k.quantize_activation_rows(x, cols, &mut acts)    once per token (batch), reused by every matrix
//! k.mxfp4_gemv(&expert, &acts, rows, &mut out)       one token; `rows` splits the work across threads
//! k.mxfp4_gemm(&expert, &acts, rows, &mut out, &mut scratch)   M tokens: out is [M x rows.len()]
//! k.q8_gemv / q8_gemm / q4_gemv / q4_gemm            same shape, for Q8Matrix / Q4Matrix
//! k.bf16_gemv / bf16_gemm                            exact f32 math on bf16 weights
//! k.dot / axpy / dot_f16 / axpy_f16 / f32_to_f16 / f16_to_f32   attention helpers
//! ```
//! Every function is single-threaded and allocation-free; the caller splits row ranges across its
//! thread pool. GEMM decodes a tile of weight rows once into [`GemmScratch`] and multiplies it
//! against all tokens, so its cost per token falls as M grows.
//!
//! # Weight formats
//! * MXFP4: the checkpoint's bytes, borrowed ([`Mxfp4Matrix`]).
//! * Q8: int8 blocks of 32, f16 scale, symmetric ([`Q8Matrix`], 8.5 bits per weight).
//! * Q4: 4-bit blocks of 32, f16 scale, symmetric like GGML Q4_0 ([`Q4Matrix`], 4.5 bits).
//!
//! Q8 and Q4 rows are padded to whole groups of 128 columns (2.2% for 2880 columns).
//!
//! # Numerics
//! Activations are int8 blocks of 32 with an f32 scale per block ([`Q8Activations`]). MXFP4 values
//! are doubled into integers (-12..=12) so block dot products are exact in int32; the E8M0 scale,
//! the activation scale and the final halving are applied in f32. The integer parts agree bit for bit
//! across paths; the f32 sums differ only in rounding order (about 1e-6 relative to the sum of
//! magnitudes).

mod aligned;
pub mod attention;
mod formats;
pub mod kv_widen;
mod scalar;
pub mod swiglu;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use half::f16;

pub use formats::{
    e8m0_scale, tile_mxfp4, Mxfp4Layout, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix, ScaleRule,
    BLOCK_LEN, FP4_E2M1, GROUP_BLOCKS, GROUP_LEN, MXFP4_TILE_ROWS,
};

pub(crate) use aligned::collapse_into_huge_pages;
pub(crate) use aligned::AlignedVec;
use formats::{check_len, GROUP_LANES};

/// Name of the environment variable that forces a kernel path.
pub const KERNELS_ENV: &str = "OSSTERM_KERNELS";

/// Most tokens a GEMV streams the weights for in one pass: a token and its split remainder in
/// decode, and the few tokens a prefill chunk routes to one expert in short prompts or follow-up
/// turns. Up to four, streaming the rows with every token's sums in registers beats decoding
/// and transposing a GEMM tile for so few tokens (MXFP4 on 2 threads: 209-247 against 174
/// GMAC/s at M = 3-4); more tokens go to the GEMM.
pub const MAX_GEMV_TOKENS: usize = 4;

/// Rows of weights a GEMM decodes at once; their int8 form (16 x 2944 bytes for 2880 columns) stays
/// in L1/L2 while every token is multiplied against it.
pub const GEMM_TILE_ROWS: usize = 16;

/// Errors of the kernel layer: bad shapes handed to a kernel, or a kernel path this CPU cannot run.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(
        "unknown kernel path {value:?} in {KERNELS_ENV}: expected scalar, avx2, avx2-vnni, avx512, amx or auto"
    )]
    UnknownPath { value: String },
    #[error("{KERNELS_ENV} is not valid UTF-8")]
    NotUnicode,
    #[error("kernel path {path} needs CPU features this machine lacks: {missing}")]
    UnsupportedPath { path: KernelPath, missing: String },
    #[error("kernel path already selected as {selected}; cannot switch to {requested}")]
    AlreadySelected {
        selected: KernelPath,
        requested: KernelPath,
    },
    #[error("{what}: {cols} columns, expected a positive multiple of 32")]
    BadColumns { what: String, cols: usize },
    #[error("{what}: length {got}, expected {expected}")]
    Length {
        what: String,
        expected: usize,
        got: usize,
    },
    #[error("{what}: row {row} out of range, there are {rows} rows")]
    RowOutOfRange {
        what: String,
        row: usize,
        rows: usize,
    },
    #[error("{what}: row range {start}..{end} is not inside 0..{rows}")]
    RowRange {
        what: String,
        start: usize,
        end: usize,
        rows: usize,
    },
    #[error("{what}: activations have {got} columns, the weights have {expected}")]
    ColumnMismatch {
        what: String,
        expected: usize,
        got: usize,
    },
    #[error("{what}: GEMV takes 1 to {MAX_GEMV_TOKENS} tokens, got {tokens}")]
    TooManyGemvTokens { what: String, tokens: usize },
    #[error("kernel benchmark could not start its thread pool: {0}")]
    ThreadPool(String),
    #[error("GEMM scratch was sized for {have} columns, the matrix has {needed}")]
    ScratchTooSmall { have: usize, needed: usize },
}

/// Which implementation the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelPath {
    Scalar,
    Avx2,
    Avx2Vnni,
    Avx512,
    /// The AVX-512 path with its prefill GEMMs on the AMX matrix unit (`tdpbssd`), and attention
    /// over the f16 cache there too where the CPU has AMX-BF16 (`tdpbf16ps`).
    Amx,
}

impl KernelPath {
    /// Slowest to fastest: detection picks the last one the CPU supports.
    pub const ALL: [KernelPath; 5] = [
        KernelPath::Scalar,
        KernelPath::Avx2,
        KernelPath::Avx2Vnni,
        KernelPath::Avx512,
        KernelPath::Amx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Scalar => "scalar",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx2Vnni => "avx2-vnni",
            KernelPath::Avx512 => "avx512",
            KernelPath::Amx => "amx",
        }
    }

    /// CPU features this path needs that the running CPU lacks (empty: the path can run).
    pub fn missing_features(self) -> Vec<&'static str> {
        match self {
            KernelPath::Scalar => Vec::new(),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => avx2::missing_features(),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2Vnni => {
                let mut missing = avx2::missing_features();
                if avx2::vnni_encoding().is_none() {
                    missing.push("avxvnni (or avx512vnni with avx512vl)");
                }
                missing
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => avx512::missing_features(),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Amx => {
                let mut missing = avx512::missing_features();
                if missing.is_empty() {
                    if let Err(reason) = amx::availability() {
                        missing.push(reason);
                    }
                }
                missing
            }
            #[cfg(not(target_arch = "x86_64"))]
            KernelPath::Avx2 | KernelPath::Avx2Vnni | KernelPath::Avx512 | KernelPath::Amx => {
                vec!["x86-64"]
            }
        }
    }

    pub fn is_supported(self) -> bool {
        self.missing_features().is_empty()
    }

    /// Whether this path runs the AVX-512 kernels (`Amx` adds the matrix unit for GEMMs and
    /// bf16 attention).
    pub fn is_avx512(self) -> bool {
        matches!(self, KernelPath::Avx512 | KernelPath::Amx)
    }

    /// Why the AMX path cannot run here (`None`: it can): the CPU, the operating system or the
    /// kernel's refusal of the tile state.
    pub fn amx_unavailable_reason() -> Option<String> {
        let missing = KernelPath::Amx.missing_features();
        (!missing.is_empty()).then(|| missing.join(", "))
    }

    /// Why a CPU that reports AMX runs without it (the OS or kernel refused the tile state, or
    /// a feature its path needs is missing), `None` where AMX runs or the CPU has none: what
    /// `bench` and the kernels gauge show beside the path that runs instead.
    pub fn amx_refusal() -> Option<String> {
        #[cfg(target_arch = "x86_64")]
        if amx::missing_cpu_features().is_empty() {
            return KernelPath::amx_unavailable_reason();
        }
        None
    }

    /// This path's name, followed by why AMX is not used where the CPU has it and this path is
    /// the AVX-512 one instead (e.g. "avx512 (AMX refused: ...)"): what `bench` reports.
    pub fn describe(self) -> String {
        match self.refused_amx() {
            Some(reason) => format!("{} (AMX refused: {reason})", self.name()),
            None => self.name().to_string(),
        }
    }

    /// [`KernelPath::describe`] short enough for the app's kernels gauge ("avx512 (no AMX)");
    /// the reason is in `bench`.
    pub fn gauge_name(self) -> &'static str {
        match self.refused_amx() {
            Some(_) => "avx512 (no AMX)",
            None => self.name(),
        }
    }

    /// [`KernelPath::amx_refusal`] where it concerns this path: the AVX-512 path running on a
    /// CPU whose AMX was refused (what [`KernelPath::describe`] and `bench --kernels` show).
    pub fn refused_amx(self) -> Option<String> {
        (self == KernelPath::Avx512)
            .then(KernelPath::amx_refusal)
            .flatten()
    }
}

impl fmt::Display for KernelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parse an `OSSTERM_KERNELS` value: `Some(path)` to force a path, `None` for `auto` or empty.
pub fn parse_kernel_path(value: &str) -> Result<Option<KernelPath>, KernelError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(None),
        "scalar" => Ok(Some(KernelPath::Scalar)),
        "avx2" => Ok(Some(KernelPath::Avx2)),
        "avx2-vnni" | "avx2vnni" => Ok(Some(KernelPath::Avx2Vnni)),
        "avx512" | "avx-512" => Ok(Some(KernelPath::Avx512)),
        "amx" => Ok(Some(KernelPath::Amx)),
        _ => Err(KernelError::UnknownPath {
            value: value.to_string(),
        }),
    }
}

/// The fastest path this CPU supports.
pub fn best_supported_path() -> KernelPath {
    KernelPath::ALL
        .into_iter()
        .rev()
        .find(|p| p.is_supported())
        .unwrap_or(KernelPath::Scalar)
}

/// The path for a requested `OSSTERM_KERNELS` value (`None`: variable unset), refusing paths the CPU
/// lacks. Pure apart from CPU detection, so tests can call it without touching the environment.
pub fn select_kernel_path(requested: Option<&str>) -> Result<KernelPath, KernelError> {
    match requested.map(parse_kernel_path).transpose()?.flatten() {
        None => Ok(best_supported_path()),
        Some(path) => Kernels::new(path).map(|k| k.path),
    }
}

fn requested_from_env() -> Result<Option<String>, KernelError> {
    match std::env::var(KERNELS_ENV) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(KernelError::NotUnicode),
    }
}

static SELECTED: OnceLock<KernelPath> = OnceLock::new();

/// Select the process-wide path from `OSSTERM_KERNELS` (or detection). Call once at start-up so a
/// bad value is reported; later calls return the same path.
pub fn init_kernel_path() -> Result<KernelPath, KernelError> {
    let requested = requested_from_env()?;
    let chosen = select_kernel_path(requested.as_deref())?;
    let selected = *SELECTED.get_or_init(|| chosen);
    if selected != chosen {
        return Err(KernelError::AlreadySelected {
            selected,
            requested: chosen,
        });
    }
    Ok(selected)
}

/// The process-wide path. If [`init_kernel_path`] was not called, the environment is read now and a
/// value the CPU cannot honour falls back to detection (it can never select an unsupported path).
pub fn kernel_path() -> KernelPath {
    *SELECTED.get_or_init(|| {
        requested_from_env()
            .and_then(|r| select_kernel_path(r.as_deref()))
            .unwrap_or_else(|_| best_supported_path())
    })
}

/// Kernels on the process-wide path.
pub fn kernels() -> Kernels {
    Kernels::on_path(kernel_path())
}

/// Accumulator chains of the int8 peak probe ([`Kernels::int8_mac_probe`]): one `vpdpbusd`
/// each per round on AVX-512, enough independent chains to cover its latency.
pub(crate) const PROBE_GROUPS: usize = 16;
/// Multiply-accumulates per chain and round: one 512-bit `vpdpbusd` (16 lanes x 4 products).
pub(crate) const PROBE_GROUP_MACS: usize = 64;
/// Multiply-accumulates of one probe round, on every path.
pub const PROBE_ROUND_MACS: usize = PROBE_GROUPS * PROBE_GROUP_MACS;

/// The operands of chain `g` of the probe: every product of the chain is `u x s`. Small enough
/// that the AVX2 path's 16-bit pair sums cannot saturate.
#[inline(always)]
pub(crate) fn probe_operands(g: usize) -> (u8, i8) {
    (1 + (g % 3) as u8, (g % 5) as i8 - 2)
}

/// Decoded tiles the GEMM scratch holds: the AVX-512 GEMM multiplies two at once (32 rows), so
/// each activation load feeds two products.
pub(crate) const GEMM_TILE_SLOTS: usize = 2;

/// Scratch space for the GEMMs: [`GEMM_TILE_SLOTS`] decoded tiles of [`GEMM_TILE_ROWS`] weight rows.
#[derive(Clone, Debug)]
// Only the SIMD paths decode tiles; the scalar reference leaves the scratch untouched.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct GemmScratch {
    cols: usize,
    /// Unsigned int8 weights, group-interleaved like the activations, `GEMM_TILE_ROWS x groups x 128`.
    tile: AlignedVec<u8>,
    /// Weight block scales as lanes, `GEMM_TILE_ROWS x groups x 16` at most, in the layout of the
    /// path that decoded the tile (AVX-512: one vector per quad of rows, AVX2: per row).
    tile_scales: AlignedVec<f32>,
    /// The tokens of a call the AVX-512 MXFP4 and Q4 loop in assembly runs, packed per block
    /// (`avx512/nibble_asm.rs`): room for the most tokens such a call has.
    packed_tokens: Vec<u32>,
}

/// The size of the batches `tokens` tokens split into when a pass takes at most `most`: as even
/// as the count of passes allows (13 tokens at most 12 a pass: 7 and 6, not 12 and 1).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn even_batch(tokens: usize, most: usize) -> usize {
    tokens.div_ceil(tokens.div_ceil(most))
}

/// Words of [`GemmScratch::packed_tokens`] for rows of `cols` columns.
fn packed_token_words(cols: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::assembly_packed_words(cols)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = cols;
        0
    }
}

impl GemmScratch {
    /// Scratch for matrices of up to `max_cols` columns.
    pub fn new(max_cols: usize) -> Self {
        let groups = max_cols.div_ceil(GROUP_LEN);
        Self {
            cols: max_cols,
            tile: AlignedVec::filled(GEMM_TILE_SLOTS * GEMM_TILE_ROWS * groups * GROUP_LEN, 0),
            tile_scales: AlignedVec::filled(
                GEMM_TILE_SLOTS * GEMM_TILE_ROWS * groups * GROUP_LANES,
                0.0,
            ),
            packed_tokens: vec![0; packed_token_words(max_cols)],
        }
    }

    fn check(&self, cols: usize) -> Result<(), KernelError> {
        if cols > self.cols {
            return Err(KernelError::ScratchTooSmall {
                have: self.cols,
                needed: cols,
            });
        }
        Ok(())
    }
}

/// Like `check_len` for a kernel's output, building the message only on failure: this runs on
/// every call of the hot path, which must not allocate.
fn check_output_len(what: &str, got: usize, expected: usize) -> Result<(), KernelError> {
    if got != expected {
        return Err(KernelError::Length {
            what: format!("{what} output (tokens x rows)"),
            expected,
            got,
        });
    }
    Ok(())
}

fn check_rows(what: &str, rows: &Range<usize>, total: usize) -> Result<(), KernelError> {
    if rows.start > rows.end || rows.end > total {
        return Err(KernelError::RowRange {
            what: what.to_string(),
            start: rows.start,
            end: rows.end,
            rows: total,
        });
    }
    Ok(())
}

fn check_quantized(
    what: &str,
    weight_rows: usize,
    weight_cols: usize,
    x: &Q8Activations,
    rows: &Range<usize>,
    out: &[f32],
    one_token: bool,
) -> Result<(), KernelError> {
    check_rows(what, rows, weight_rows)?;
    if x.cols() != weight_cols {
        return Err(KernelError::ColumnMismatch {
            what: what.to_string(),
            expected: weight_cols,
            got: x.cols(),
        });
    }
    if one_token && !(1..=MAX_GEMV_TOKENS).contains(&x.rows()) {
        return Err(KernelError::TooManyGemvTokens {
            what: what.to_string(),
            tokens: x.rows(),
        });
    }
    check_output_len(what, out.len(), x.rows() * rows.len())
}

fn check_bf16(
    what: &str,
    w: &[u16],
    cols: usize,
    x: &[f32],
    rows: &Range<usize>,
    out: &[f32],
) -> Result<usize, KernelError> {
    if cols == 0 || !w.len().is_multiple_of(cols) {
        return Err(KernelError::Length {
            what: format!("{what} weights (a whole number of rows of {cols})"),
            expected: w.len().div_ceil(cols.max(1)) * cols,
            got: w.len(),
        });
    }
    check_rows(what, rows, w.len() / cols)?;
    if !x.len().is_multiple_of(cols) {
        return Err(KernelError::Length {
            what: format!("{what} activations (a whole number of rows of {cols})"),
            expected: x.len().div_ceil(cols) * cols,
            got: x.len(),
        });
    }
    let tokens = x.len() / cols;
    check_output_len(what, out.len(), tokens * rows.len())?;
    Ok(tokens)
}

/// Runs an operation on the path held by `$kernels`: the one place that maps a path to its code.
/// Every operation dispatches exactly once, through this macro: the products and the activation
/// quantizers in [`Kernels`]' methods, attention and its tile widening in [`attention`].
///
/// Each SIMD arm is sound because a [`Kernels`] value holding that path is only built (in
/// [`Kernels::new`]) after every CPU feature the path's `#[target_feature]` functions enable was
/// detected at run time; the caller has checked the shapes the arm's function documents.
macro_rules! dispatch {
    ($kernels:expr, avx512: $avx512:expr, avx2: $avx2:expr, scalar: $scalar:expr $(,)?) => {
        match $kernels.path() {
            // SAFETY: see the macro's doc: Avx512 and Amx (AVX-512 plus the matrix unit, which
            // only the GEMMs choosing by `Kernels::path` run) are only held after detecting their
            // features.
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::KernelPath::Avx512 | $crate::kernels::KernelPath::Amx => unsafe {
                $avx512
            },
            // SAFETY: see the macro's doc: Avx2 and Avx2Vnni (AVX2 plus a 256-bit `vpdpbusd`,
            // which only the code choosing by `Kernels::avx2_dot` runs) are only held after
            // detecting their features.
            #[cfg(target_arch = "x86_64")]
            $crate::kernels::KernelPath::Avx2 | $crate::kernels::KernelPath::Avx2Vnni => unsafe {
                $avx2
            },
            _ => $scalar,
        }
    };
    ($kernels:expr, $name:ident ( $($arg:expr),* )) => {
        dispatch!(
            $kernels,
            avx512: avx512::$name($($arg),*),
            avx2: avx2::$name($($arg),*),
            scalar: scalar::$name($($arg),*),
        )
    };
}
pub(crate) use dispatch;

/// The kernels of one path. Cheap to copy; hold one in the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    path: KernelPath,
    /// The AVX-512 MXFP4 GEMV decodes nibbles with `vpermb` (AVX-512 VBMI, detected at run time).
    vbmi: bool,
    /// Attention over an f16 cache takes bf16 dot products (AVX-512 BF16, where a probe at start
    /// finds `vdpbf16ps` issuing about as fast as an f32 FMA: twice the multiply-adds; see
    /// [`attention::runs_bf16`]).
    bf16_attention: bool,
    /// Attention over an int8 cache takes int8 dot products (`vpdpbusd` on the AVX-512 path; see
    /// [`attention::runs_int8`]) instead of widening the cache to f32.
    int8_attention: bool,
    /// How the AVX2 paths' MXFP4 tile products sum int8 products (only `Avx2Vnni` differs).
    avx2_dot: Avx2Dot,
}

/// How the AVX2 paths sum int8 products: per 64 products two `vpmaddubsw`, their int16 sum,
/// `vpmaddwd` and `vpaddd`, or two `vpdpbusd` (the same integer sums: no int16 lane of the
/// first saturates on the operands they take).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Avx2Dot {
    Maddubs,
    /// `vpdpbusd` as AVX-VNNI (VEX encoded).
    VnniVex,
    /// `vpdpbusd` as AVX-512 VNNI with VL (EVEX encoded).
    VnniEvex,
}

impl Kernels {
    /// Kernels on `path`, refused with a clear error if this CPU lacks a feature it needs.
    pub fn new(path: KernelPath) -> Result<Self, KernelError> {
        let missing = path.missing_features();
        if !missing.is_empty() {
            return Err(KernelError::UnsupportedPath {
                path,
                missing: missing.join(", "),
            });
        }
        Ok(Self::on_path(path))
    }

    /// Kernels on a path this CPU supports, with the optional features it has.
    fn on_path(path: KernelPath) -> Self {
        #[cfg(target_arch = "x86_64")]
        let (vbmi, bf16_attention, avx2_dot) = (
            path.is_avx512() && avx512::vbmi_detected(),
            // The matrix unit's bf16 tiles pay wherever they run, whatever `vdpbf16ps` costs.
            (path == KernelPath::Amx && amx::bf16_available())
                || (path.is_avx512() && avx512::bf16_dot_pays()),
            match path {
                KernelPath::Avx2Vnni => avx2::vnni_encoding().unwrap_or(Avx2Dot::Maddubs),
                _ => Avx2Dot::Maddubs,
            },
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (vbmi, bf16_attention, avx2_dot) = (false, false, Avx2Dot::Maddubs);
        Self {
            path,
            vbmi,
            bf16_attention,
            int8_attention: path.is_avx512(),
            avx2_dot,
        }
    }

    /// The same kernels with f32 attention arithmetic over every cache (no bf16 or int8 dot
    /// products): what a CPU without AVX-512 BF16 runs over an f16 cache, and
    /// what `q8x2` activations keep (tests compare the two; the attention benchmark,
    /// `cargo test --release --test attention -- --ignored --nocapture`, times both).
    pub fn without_bf16_attention(self) -> Self {
        Self {
            bf16_attention: false,
            int8_attention: false,
            ..self
        }
    }

    /// The same kernels with bf16 attention wherever the CPU has AVX-512 BF16 (on the AVX-512
    /// path), whatever the start-up probe found: to measure or test it on a CPU the probe turns
    /// it down on. Elsewhere unchanged.
    pub fn with_bf16_attention(self) -> Self {
        #[cfg(target_arch = "x86_64")]
        let bf16 = (self.path == KernelPath::Amx && amx::bf16_available())
            || (self.path.is_avx512() && avx512::bf16_detected());
        #[cfg(not(target_arch = "x86_64"))]
        let bf16 = false;
        Self {
            bf16_attention: bf16,
            int8_attention: self.path.is_avx512(),
            ..self
        }
    }

    /// The same kernels with the attention arithmetic the start-up probe chooses (what
    /// [`Kernels::new`] gives): undoes [`Kernels::with_bf16_attention`] and
    /// [`Kernels::without_bf16_attention`].
    pub fn with_probed_attention(self) -> Self {
        Self {
            bf16_attention: Self::on_path(self.path).bf16_attention,
            int8_attention: Self::on_path(self.path).int8_attention,
            ..self
        }
    }

    /// Whether attention over an f16 cache runs on bf16 dot products (see
    /// [`attention::attend_block_bf16_reference`] for what it computes).
    pub fn uses_bf16_attention(&self) -> bool {
        self.bf16_attention
    }

    /// Whether that bf16 attention runs its tile products on the AMX matrix unit (`tdpbf16ps`,
    /// the `amx` path where the CPU has AMX-BF16) rather than on `vdpbf16ps`: the same
    /// arithmetic, summed in another order.
    pub fn uses_amx_attention(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.bf16_attention && self.path == KernelPath::Amx && amx::bf16_available();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// Whether attention over an int8 cache runs on int8 dot products (see
    /// [`attention::attend_block_q8_reference`] for what it computes).
    pub fn uses_int8_attention(&self) -> bool {
        self.int8_attention
    }

    /// The same kernels without the optional AVX-512 VBMI decode of the MXFP4 GEMV: what a CPU
    /// with AVX-512 VNNI but no VBMI runs (tests compare the two; the benchmark can time both).
    pub fn without_vbmi(self) -> Self {
        Self {
            vbmi: false,
            ..self
        }
    }

    /// Whether MXFP4 weights should be reordered into [`Mxfp4Layout::Tiles`] for these kernels:
    /// the AVX-512 and AVX2 products have kernels for it that beat the row order. The scalar
    /// path takes tiled matrices too (correct but slow), so the model tiles only when this says
    /// so.
    pub fn prefers_tiled_mxfp4(&self) -> bool {
        matches!(
            self.path,
            KernelPath::Avx512 | KernelPath::Amx | KernelPath::Avx2 | KernelPath::Avx2Vnni
        )
    }

    /// Whether Q8 matrices should be reordered into the tile layout ([`Q8Matrix::to_tiles`]) for
    /// these kernels: the AVX-512 and both AVX2 paths have kernels for it (plain AVX2 makes the
    /// tiles' unsigned bytes signed again, as `vpmaddubsw` would saturate on them); the scalar
    /// path reads it the reference's way.
    pub fn prefers_tiled_q8(&self) -> bool {
        matches!(
            self.path,
            KernelPath::Avx512 | KernelPath::Amx | KernelPath::Avx2 | KernelPath::Avx2Vnni
        )
    }

    /// Whether Q4 matrices should be reordered into the tile layout ([`Q4Matrix::to_tiles`]):
    /// the AVX-512 and both AVX2 paths have kernels for it (the tiles' `q + 8` nibbles suit
    /// `vpmaddubsw` as MXFP4's do); the scalar path reads it the reference's way.
    pub fn prefers_tiled_q4(&self) -> bool {
        matches!(
            self.path,
            KernelPath::Avx512 | KernelPath::Amx | KernelPath::Avx2 | KernelPath::Avx2Vnni
        )
    }

    /// Whether the MXFP4 GEMV decodes with `vpermb` (AVX-512 VBMI).
    pub fn uses_vbmi(&self) -> bool {
        self.vbmi
    }

    /// Kernels for every path this CPU supports, slowest (scalar) first.
    pub fn all_supported() -> Vec<Kernels> {
        KernelPath::ALL
            .into_iter()
            .filter_map(|p| Kernels::new(p).ok())
            .collect()
    }

    pub fn path(&self) -> KernelPath {
        self.path
    }

    /// Quantize `x.len() / cols` tokens of `cols` elements each (a multiple of 32) into `out`,
    /// reusing its buffers; from 16 tokens on, the rows are spread over the current pool.
    ///
    /// Scale `d = max|x| / 127`, `q = round_half_even(x * (127 / max|x|))`; every path writes the
    /// same bits (decode and prefill results, and the paths' products, are compared closely).
    pub fn quantize_activation_rows(
        &self,
        x: &[f32],
        cols: usize,
        out: &mut Q8Activations,
    ) -> Result<(), KernelError> {
        self.quantize_activation_rows_with(x, cols, ScaleRule::Tight, true, out)
    }

    /// [`Kernels::quantize_activation_rows`] with the block scales chosen by `rule` (split rows
    /// take [`ScaleRule::PowerOfTwo`]); `parallel: false` keeps the work on the calling thread,
    /// for callers that are already one task of a parallel region (the bits are the same either
    /// way).
    pub fn quantize_activation_rows_with(
        &self,
        x: &[f32],
        cols: usize,
        rule: ScaleRule,
        parallel: bool,
        out: &mut Q8Activations,
    ) -> Result<(), KernelError> {
        formats::quantize_activation_rows(*self, x, cols, rule, out, parallel)
    }

    /// Quantize one token (`x.len()` elements, a multiple of 32) into `out`, reusing its buffers.
    pub fn quantize_activations(
        &self,
        x: &[f32],
        out: &mut Q8Activations,
    ) -> Result<(), KernelError> {
        self.quantize_activation_rows(x, x.len(), out)
    }

    /// Quantizes whole rows of `x` into the matching slices of a [`Q8Activations`]; every path
    /// gives the bits of `formats::quantize_rows_portable`. The SIMD paths assert that every
    /// buffer holds whole groups for every row.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quantize_rows(
        &self,
        x: &[f32],
        cols: usize,
        rule: ScaleRule,
        quants: &mut [i8],
        scales: &mut [f32],
        sums: &mut [i32],
        corrections: &mut [i32],
    ) {
        let pow2 = rule == ScaleRule::PowerOfTwo;
        dispatch!(
            self,
            avx512: if pow2 {
                formats::x86::quantize_rows_avx512::<true>(x, cols, quants, scales, sums, corrections)
            } else {
                formats::x86::quantize_rows_avx512::<false>(x, cols, quants, scales, sums, corrections)
            },
            avx2: if pow2 {
                formats::x86::quantize_rows_avx2::<true>(x, cols, quants, scales, sums, corrections)
            } else {
                formats::x86::quantize_rows_avx2::<false>(x, cols, quants, scales, sums, corrections)
            },
            scalar: formats::quantize_rows_portable(x, cols, rule, quants, scales, sums, corrections),
        )
    }

    /// The f32 rows of a split quantization: each row of `x` followed by what its int8
    /// quantization misses (`x - scale * q`, rounded exactly as
    /// [`Kernels::quantize_activation_rows_with`] rounds with [`ScaleRule::PowerOfTwo`]).
    /// Quantizing `out` with that rule then gives each token two int8 rows whose products sum to
    /// about 14 bits of precision.
    pub fn split_rows(&self, x: &[f32], cols: usize, out: &mut [f32]) -> Result<(), KernelError> {
        formats::check_split_rows(x, cols, out)?;
        self.split_rows_unchecked(x, cols, out);
        Ok(())
    }

    /// [`Kernels::split_rows`] after its check; every path gives the bits of
    /// `formats::split_rows_portable` (NaN payloads aside).
    pub(crate) fn split_rows_unchecked(&self, x: &[f32], cols: usize, out: &mut [f32]) {
        dispatch!(
            self,
            avx512: formats::x86::split_rows_avx512(x, cols, out),
            avx2: formats::x86::split_rows_avx2(x, cols, out),
            scalar: formats::split_rows_portable(x, cols, out),
        )
    }

    /// `rounds` rounds of [`PROBE_ROUND_MACS`] int8 multiply-accumulates each, in the
    /// instructions the path's GEMMs use (AVX-512: `vpdpbusd` on 16 independent chains; AVX2:
    /// `vpmaddubsw`, `vpmaddwd`, `vpaddd`; AVX2 with VNNI: 256-bit `vpdpbusd`), with no memory
    /// traffic: the arithmetic peak the GEMMs
    /// are measured against. Returns the sum of all products, the same on every path. Keep
    /// `rounds` below 2^24 so no 32-bit lane overflows.
    pub fn int8_mac_probe(&self, rounds: usize) -> i64 {
        dispatch!(
            self,
            avx512: avx512::int8_mac_probe(rounds),
            avx2: avx2::int8_mac_probe(rounds, self.avx2_dot),
            scalar: scalar::int8_mac_probe(rounds),
        )
    }

    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for the one or two tokens in `x`,
    /// streaming the weights once (a GEMM for so few tokens would spend its time decoding tiles).
    pub fn mxfp4_gemv(
        &self,
        w: &Mxfp4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_quantized("MXFP4 GEMV", w.rows, w.cols, x, &rows, out, true)?;
        dispatch!(
            self,
            avx512: avx512::mxfp4_gemv(w, x, rows, out, self.vbmi),
            avx2: if w.layout == Mxfp4Layout::Tiles {
                avx2::tiles::mxfp4_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::mxfp4_gemv(w, x, rows, out)
            },
            scalar: scalar::mxfp4_gemv(w, x, rows, out),
        );
        Ok(())
    }

    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for every token t of `x`.
    pub fn mxfp4_gemm(
        &self,
        w: &Mxfp4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError> {
        check_quantized("MXFP4 GEMM", w.rows, w.cols, x, &rows, out, false)?;
        scratch.check(w.cols)?;
        dispatch!(
            self,
            avx512: if self.path == KernelPath::Amx
                && w.layout == Mxfp4Layout::Tiles
                && x.rows() >= AMX_MIN_ROWS
            {
                // The Amx path is only held after `amx::availability` granted the tile state;
                // both kernels give the same bits, so the row count only picks the faster.
                amx::mxfp4_gemm(w, x, rows, out)
            } else {
                avx512::mxfp4_gemm(w, x, rows, out, scratch, self.vbmi)
            },
            avx2: if w.layout == Mxfp4Layout::Tiles {
                avx2::tiles::mxfp4_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::mxfp4_gemm(w, x, rows, out, scratch)
            },
            scalar: scalar::mxfp4_gemm(w, x, rows, out, scratch),
        );
        Ok(())
    }

    /// Whether a product of `tokens` tokens with a nibble matrix (MXFP4, Q4), in the tile
    /// layout or not (`tiled`), is fastest through the GEMV entry: one token always; up to
    /// [`MAX_GEMV_TOKENS`] unless the GEMM runs it on the assembly loop
    /// ([`Kernels::nibble_assembly`]), which packs the tokens into the scratch the GEMV has not
    /// got. The choice of [`Kernels::mxfp4_product`] and [`Kernels::q4_product`].
    fn nibble_gemv_fits(&self, tiled: bool, tokens: usize) -> bool {
        tokens == 1 || (tokens <= MAX_GEMV_TOKENS && !(tiled && self.nibble_assembly()))
    }

    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` through the kernel that is fastest
    /// for `x.rows()` tokens: the GEMV up to [`MAX_GEMV_TOKENS`], the GEMM beyond; from two
    /// tokens the GEMM where it runs tiles through the assembly loop (AVX-512 VBMI).
    pub fn mxfp4_product(
        &self,
        w: &Mxfp4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError> {
        if self.nibble_gemv_fits(w.layout == Mxfp4Layout::Tiles, x.rows()) {
            self.mxfp4_gemv(w, x, rows, out)
        } else {
            self.mxfp4_gemm(w, x, rows, out, scratch)
        }
    }

    /// Like [`Kernels::mxfp4_gemv`] for a [`Q8Matrix`].
    pub fn q8_gemv(
        &self,
        w: &Q8Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_quantized("Q8 GEMV", w.rows, w.cols, x, &rows, out, true)?;
        dispatch!(
            self,
            avx512: avx512::q8_gemv(w, x, rows, out),
            avx2: if w.tiled {
                avx2::tiles::q8_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::q8_gemv(w, x, rows, out)
            },
            scalar: scalar::q8_gemv(w, x, rows, out),
        );
        Ok(())
    }

    /// Like [`Kernels::mxfp4_gemm`] for a [`Q8Matrix`].
    pub fn q8_gemm(
        &self,
        w: &Q8Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError> {
        check_quantized("Q8 GEMM", w.rows, w.cols, x, &rows, out, false)?;
        scratch.check(w.cols)?;
        dispatch!(
            self,
            avx512: if self.path == KernelPath::Amx && w.tiled && x.rows() >= AMX_MIN_ROWS {
                // As in `mxfp4_gemm`: the tile state was granted, the bits are the same.
                amx::q8_gemm(w, x, rows, out)
            } else {
                avx512::q8_gemm(w, x, rows, out, scratch)
            },
            avx2: if w.tiled {
                avx2::tiles::q8_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::q8_gemm(w, x, rows, out, scratch)
            },
            scalar: scalar::q8_gemm(w, x, rows, out, scratch),
        );
        Ok(())
    }

    /// Like [`Kernels::mxfp4_gemv`] for a [`Q4Matrix`].
    pub fn q4_gemv(
        &self,
        w: &Q4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_quantized("Q4 GEMV", w.rows, w.cols, x, &rows, out, true)?;
        dispatch!(
            self,
            avx512: avx512::q4_gemv(w, x, rows, out, self.vbmi),
            avx2: if w.tiled {
                avx2::tiles::q4_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::q4_gemv(w, x, rows, out)
            },
            scalar: scalar::q4_gemv(w, x, rows, out),
        );
        Ok(())
    }

    /// Whether the GEMM entries run tiled MXFP4 and Q4 products of 2-24 tokens on the AVX-512
    /// assembly loop here (it decodes nibbles with VBMI's `vpermb`), which packs the tokens into
    /// the GEMM's scratch: callers with 2-4 tokens for such a matrix should call the GEMM, not
    /// the GEMV (which keeps the intrinsics loop, as one token should).
    pub fn nibble_assembly(&self) -> bool {
        self.vbmi && matches!(self.path, KernelPath::Avx512 | KernelPath::Amx)
    }

    /// Like [`Kernels::mxfp4_product`] for a [`Q4Matrix`].
    pub fn q4_product(
        &self,
        w: &Q4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError> {
        if self.nibble_gemv_fits(w.tiled, x.rows()) {
            self.q4_gemv(w, x, rows, out)
        } else {
            self.q4_gemm(w, x, rows, out, scratch)
        }
    }

    /// Like [`Kernels::mxfp4_gemm`] for a [`Q4Matrix`].
    pub fn q4_gemm(
        &self,
        w: &Q4Matrix,
        x: &Q8Activations,
        rows: Range<usize>,
        out: &mut [f32],
        scratch: &mut GemmScratch,
    ) -> Result<(), KernelError> {
        check_quantized("Q4 GEMM", w.rows, w.cols, x, &rows, out, false)?;
        scratch.check(w.cols)?;
        dispatch!(
            self,
            avx512: avx512::q4_gemm(w, x, rows, out, scratch, self.vbmi),
            avx2: if w.tiled {
                avx2::tiles::q4_product(w, x, rows, out, self.avx2_dot)
            } else {
                avx2::q4_gemm(w, x, rows, out, scratch)
            },
            scalar: scalar::q4_gemm(w, x, rows, out, scratch),
        );
        Ok(())
    }

    /// `out[i] = W[rows.start + i] . x` with `w` row-major bf16 bits of `cols` columns, in f32 with FMA.
    pub fn bf16_gemv(
        &self,
        w: &[u16],
        cols: usize,
        x: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("BF16 GEMV activations", x.len(), cols)?;
        self.bf16_gemm(w, cols, x, rows, out)
    }

    /// `out[t * rows.len() + i] = W[rows.start + i] . x[t]` for the `x.len() / cols` tokens of `x`.
    pub fn bf16_gemm(
        &self,
        w: &[u16],
        cols: usize,
        x: &[f32],
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_bf16("BF16 GEMM", w, cols, x, &rows, out)?;
        dispatch!(self, bf16_gemm(w, cols, x, rows, out));
        Ok(())
    }

    /// `a . b` in f32.
    pub fn dot(&self, a: &[f32], b: &[f32]) -> Result<f32, KernelError> {
        check_len("dot operand b", b.len(), a.len())?;
        Ok(dispatch!(self, dot(a, b)))
    }

    /// `y += alpha * x`.
    pub fn axpy(&self, alpha: f32, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        check_len("axpy output y", y.len(), x.len())?;
        dispatch!(self, axpy(alpha, x, y));
        Ok(())
    }

    /// `a . b` with `b` an f16 row (a key of an f16 KV cache), in f32.
    pub fn dot_f16(&self, a: &[f32], b: &[f16]) -> Result<f32, KernelError> {
        check_len("f16 dot operand b", b.len(), a.len())?;
        Ok(dispatch!(self, dot_f16(a, b)))
    }

    /// `y += alpha * x` with `x` an f16 row (a value of an f16 KV cache).
    pub fn axpy_f16(&self, alpha: f32, x: &[f16], y: &mut [f32]) -> Result<(), KernelError> {
        check_len("f16 axpy output y", y.len(), x.len())?;
        dispatch!(self, axpy_f16(alpha, x, y));
        Ok(())
    }

    /// Round an f32 row to f16 (nearest, ties to even).
    pub fn f32_to_f16(&self, src: &[f32], dst: &mut [f16]) -> Result<(), KernelError> {
        check_len("f16 destination row", dst.len(), src.len())?;
        dispatch!(self, f32_to_f16(src, dst));
        Ok(())
    }

    /// Widen an f16 row to f32 (exact).
    pub fn f16_to_f32(&self, src: &[f16], dst: &mut [f32]) -> Result<(), KernelError> {
        check_len("f32 destination row", dst.len(), src.len())?;
        dispatch!(self, f16_to_f32(src, dst));
        Ok(())
    }
}

impl Kernels {
    /// `rounds` rounds of [`TILE_PROBE_ROUND_MACS`] multiply-adds on the AMX matrix unit (four
    /// independent `tdpbssd`, operands in the tile registers): its int8 peak, beside which
    /// `bench --kernels` prints the AMX GEMM. `None` off the `amx` path.
    pub fn tile_mac_probe(&self, rounds: usize) -> Option<i32> {
        #[cfg(target_arch = "x86_64")]
        if self.path == KernelPath::Amx {
            // SAFETY: the Amx path is only held after `amx::availability` granted the tile state.
            return Some(unsafe { amx::tile_probe(rounds) });
        }
        let _ = rounds;
        None
    }
}

/// Fewest activation rows of a tiled MXFP4 or Q8 GEMM that the `amx` path runs on the matrix
/// unit (fewer take the AVX-512 kernel; the bits are the same).
///
/// It is where the matrix unit beats the AVX-512 tile GEMM: below, one token tile's decode, sums
/// and scaling cost more than the `vpdpbusd` they replace. `bench --kernels`, Xeon with AMX, one 2880 x 2880 matrix, two threads, AVX-512
/// against the matrix unit (decoding as it multiplies), twice each: MXFP4 at M = 8 0.27 / 0.30
/// against 0.29 / 0.32 ms, M = 10 0.30 / 0.34 against 0.31 / 0.33, M = 12 0.35 / 0.40 against
/// 0.30 / 0.34, M = 14 0.41 / 0.42 against 0.33 / 0.35; Q8 at M = 12 0.41 / 0.40 against 0.38 /
/// 0.38, M = 14 0.44 / 0.44 against 0.39 / 0.39.
pub const AMX_MIN_ROWS: usize = 12;

/// MXFP4 and Q4 products the AVX-512 loop in assembly (`avx512/nibble_asm.rs`: 2-24 tokens,
/// `vpermb`) has run in this process (0 elsewhere): its results are the intrinsics kernel's bits, so this
/// is how a test sees that it ran.
pub fn nibble_assembly_count() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::assembly_call_count()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// GEMMs the AMX matrix unit has run in this process (0 without AMX): its results are the
/// AVX-512 path's bits, so this is how a test sees that the `amx` path used it.
pub fn amx_gemm_count() -> usize {
    #[cfg(target_arch = "x86_64")]
    {
        amx::gemm_count()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// Multiply-adds of one round of [`Kernels::tile_mac_probe`]: four 16 x 16 x 64 products.
#[cfg(target_arch = "x86_64")]
pub const TILE_PROBE_ROUND_MACS: usize = amx::TILE_PROBE_ROUND_MACS;
#[cfg(not(target_arch = "x86_64"))]
pub const TILE_PROBE_ROUND_MACS: usize = 4 * 16 * 16 * 64;
