//! The choices that shape a loaded model and its sessions: how the forward pass computes, the
//! formats of weights, KV cache and activations. Plain data; the command line and the config file
//! parse them by the names `impl_choice!` gives them.

/// How the forward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 activations against exactly dequantized weights, portable code, f32 KV cache: the
    /// reference every faster path is checked against.
    Exact,
    /// SIMD kernels on int8-quantized activations, weights in the chosen [`WeightFormat`].
    #[default]
    Fast,
}

/// How attention, embedding-free dense weights and the unembedding are held in the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// bfloat16 as in the checkpoint, zero-copy (exact weights, f32 math).
    Native,
    /// int8 blocks of 32 with an f16 scale (8.5 bits per weight).
    #[default]
    Q8,
    /// 4-bit blocks of 32 with an f16 scale (4.5 bits per weight).
    Q4,
}

crate::choice::impl_choice!(WeightFormat { Native => "native", Q8 => "q8", Q4 => "q4" });

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    #[default]
    F16,
    F32,
    /// int8 with one f32 scale per head row: about half of f16's memory (fast path only).
    Q8,
}

crate::choice::impl_choice!(KvFormat { F16 => "f16", F32 => "f32", Q8 => "q8" });

impl KvFormat {
    /// Bytes of one head row of `head_dim` values (an int8 row carries its f32 scale).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvFormat::F16 => 2 * head_dim,
            KvFormat::F32 => 4 * head_dim,
            KvFormat::Q8 => head_dim + 4,
        }
    }
}

/// How the inputs of quantized products (int8 blocks of 32) are made.
///
/// A plain int8 row loses about 1.5% of the logit range per position on the fixtures, enough to
/// flip near-tied top tokens. A split row adds a second int8 row holding what the first missed
/// (about 14 bits in all, its scales powers of two) at twice the integer work for that product; decode, bound by reading
/// weights, hardly notices, prefill does. Measured trade-offs are in README.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActivationFormat {
    /// One int8 row for every product: fastest prefill.
    Q8,
    /// Split rows where int8 loses most: the experts' down input (the SwiGLU output, heavy-tailed),
    /// attention projections and the unembedding; one row for the experts' gate_up input
    /// (RMS-normed and smooth), the largest product.
    #[default]
    Mixed,
    /// Split rows for every product.
    Q8x2,
}

crate::choice::impl_choice!(ActivationFormat { Q8 => "q8", Mixed => "mixed", Q8x2 => "q8x2" });

impl ActivationFormat {
    /// The kernels attention runs on with these activations: `q8x2`, the precise setting, keeps
    /// f32 attention (its ~14-bit products would otherwise meet 8-bit attention); the others take
    /// bf16 dot products where the kernels do ([`crate::kernels::attention::runs_bf16`]).
    pub fn attention_kernels(self, kernels: crate::kernels::Kernels) -> crate::kernels::Kernels {
        match self {
            ActivationFormat::Q8x2 => kernels.without_bf16_attention(),
            ActivationFormat::Q8 | ActivationFormat::Mixed => kernels,
        }
    }

    pub fn split(self, product: Product) -> Split {
        match (self, product) {
            (ActivationFormat::Q8, _) => Split::Single,
            (ActivationFormat::Mixed, Product::ExpertGateUp) => Split::Single,
            (ActivationFormat::Mixed, _) | (ActivationFormat::Q8x2, _) => Split::Double,
        }
    }
}

/// Which product an activation row feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Product {
    /// Attention projections and the unembedding.
    Dense,
    ExpertGateUp,
    ExpertDown,
}

/// One int8 row per token, or two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Single,
    Double,
}

impl Split {
    /// Quantized rows per token.
    pub fn rows_per_token(self) -> usize {
        match self {
            Split::Single => 1,
            Split::Double => 2,
        }
    }

    /// How the rows' block scales are chosen: a single row keeps every bit (`max / 127`); a
    /// split row's second row takes back the bit power-of-two scales give up, and those let the
    /// AVX-512 products scale by adding exponents.
    pub fn scale_rule(self) -> crate::kernels::ScaleRule {
        match self {
            Split::Single => crate::kernels::ScaleRule::Tight,
            Split::Double => crate::kernels::ScaleRule::PowerOfTwo,
        }
    }
}

/// How the fast path orders the experts' MXFP4 bytes (see [`crate::kernels::Mxfp4Layout`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// Tiles where the kernels have fast products for them and, for experts in a mapped file, the
    /// copy fits in memory (see [`super::memory::tiled_copy_fits`]); the file's row order
    /// otherwise.
    #[default]
    Auto,
    /// The file's row order: mapped experts stay in the mapping.
    Rows,
    /// Tiles of 16 rows on any kernel path, memory permitting or not.
    Tiles,
}

crate::choice::impl_choice!(ExpertLayout { Auto => "auto", Rows => "rows", Tiles => "tiles" });

/// The arithmetic of attention over an f16 KV cache in the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionArithmetic {
    /// bf16 dot products where the CPU has AVX-512 BF16 and a probe at start finds them issuing
    /// about as fast as f32 FMAs (twice the multiply-adds); f32 otherwise.
    #[default]
    Auto,
    /// f32 products everywhere: the reference arithmetic, and what to compare against.
    F32,
    /// bf16 dot products wherever the CPU has AVX-512 BF16, whatever the probe finds.
    Bf16,
}

crate::choice::impl_choice!(AttentionArithmetic { Auto => "auto", F32 => "f32", Bf16 => "bf16" });

impl AttentionArithmetic {
    /// `kernels` with this choice applied to their attention arithmetic, whatever choice they
    /// carried before.
    pub fn apply(self, kernels: crate::kernels::Kernels) -> crate::kernels::Kernels {
        match self {
            AttentionArithmetic::Auto => kernels.with_probed_attention(),
            AttentionArithmetic::F32 => kernels.without_bf16_attention(),
            AttentionArithmetic::Bf16 => kernels.with_bf16_attention(),
        }
    }
}

/// Where the fast path keeps experts of a mapped checkpoint once reordered into tiles (see
/// [`super::tile_cache`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TileCache {
    /// `OSSTERM_TILE_CACHE` if set (`off`, or a directory), else `tiles` in the platform cache
    /// directory; either only for experts of [`super::tile_cache::MIN_CACHED_BYTES`] or more,
    /// whose copy takes seconds.
    #[default]
    Auto,
    /// This directory, whatever the size.
    Dir(std::path::PathBuf),
    /// No file: the tiles are copied into memory the process owns.
    Off,
}

/// How the fast path computes a decoded token's logits.
///
/// The unembedding is the largest dense matrix (201,088 x 2,880 on gpt-oss: a quarter of the bytes
/// a decoded token reads in q8). Sampling only ever picks among the best-scored tokens, so a 4-bit
/// pass over every row can find them and the session's own format recompute just those.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unembedding {
    /// Every row in the session's weight format.
    Full,
    /// A q4 draft of every row on one int8 activation row, then the [`DRAFT_CANDIDATES`] best
    /// rows of each token again in the session's format; the other logits keep the draft's
    /// values. The draft is an extra copy of the matrix in memory (4.5 bits per weight). Prefill
    /// that asks for every position's logits (scoring) always computes them in full.
    #[default]
    TwoStage,
}

crate::choice::impl_choice!(Unembedding { Full => "full", TwoStage => "two-stage" });

/// Tokens per decoded row whose logits a two-stage unembedding recomputes in the session's
/// format: far more than top-k or top-p sampling keeps on a real model's vocabulary, and cheap
/// (64 rows of 2,880 against 201,088).
pub const DRAFT_CANDIDATES: usize = 64;

/// Options that shape a loaded model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub precision: Precision,
    /// Format of attention and unembedding weights in the fast path.
    pub weights: WeightFormat,
    /// KV cache element type in the fast path.
    pub kv: KvFormat,
    /// How expert inputs are quantized in the fast path.
    pub activations: ActivationFormat,
    /// Kernel path to use instead of the process-wide one (tests compare paths this way).
    pub kernels: Option<crate::kernels::KernelPath>,
    /// Attention arithmetic over an f16 cache in the fast path (`q8x2` activations keep f32
    /// whatever this says).
    pub attention: AttentionArithmetic,
    /// Byte order of the experts in the fast path. Experts reordered once stay so in a model
    /// [`super::Model::reconfigured`] from it, whatever this says (every path reads both orders).
    pub expert_layout: ExpertLayout,
    /// Where tiles of a mapped checkpoint's experts are kept.
    pub tile_cache: TileCache,
    /// How decoded tokens' logits are computed in the fast path.
    pub unembedding: Unembedding,
    /// Candidates per row of a two-stage unembedding; `None` for [`DRAFT_CANDIDATES`] (tests
    /// ask for fewer, to reach the draft's values on tiny vocabularies).
    pub draft_candidates: Option<usize>,
}
