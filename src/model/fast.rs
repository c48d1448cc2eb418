//! The fast forward pass: quantized SIMD kernels on a thread pool.
//!
//! Same steps as the exact path in `forward.rs` (which it is checked against), computed with the
//! `kernels` module: experts stay MXFP4 in the mapping and multiply int8-quantized activations;
//! attention projections and the unembedding are held in the weight format the settings choose;
//! the KV cache is f16 by default. Every multiplication splits its weight rows into tasks on the
//! rayon pool; several matrices that read the same activations (q, k and v; the routed experts of
//! a token) run in one parallel region.

use std::cell::RefCell;
use std::ops::Range;
use std::time::{Duration, Instant};

use half::f16;

use super::config::{LayerKind, ModelConfig, MXFP4_BLOCK};
use super::forward::{embed_tokens, rms_norm_rows, route_token};
use super::rope::apply_rope;
use super::team::{parallel_for, Team};
use super::weights::{Bf16Matrix, Layer, Mxfp4Experts, Weights};
use super::ModelError;
use crate::kernels::attention::{attend_group, AttentionScratch, GroupQuery, KvElem, KvHead};
use crate::kernels::{self, GemmScratch, Kernels, Mxfp4Matrix, Q4Matrix, Q8Activations, Q8Matrix};

/// How attention, embedding-free dense weights and the unembedding are held in the fast path.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
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
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    #[default]
    F16,
    F32,
}

crate::choice::impl_choice!(KvFormat { F16 => "f16", F32 => "f32" });

impl KvFormat {
    pub fn bytes_per_value(self) -> usize {
        match self {
            KvFormat::F16 => 2,
            KvFormat::F32 => 4,
        }
    }
}

/// How the inputs of quantized products (int8 blocks of 32) are made.
///
/// A plain int8 row loses about 1.5% of the logit range per position on the fixtures, enough to
/// flip near-tied top tokens. A split row adds a second int8 row holding what the first missed
/// (about 15 bits in all) at twice the integer work for that product; decode, bound by reading
/// weights, hardly notices, prefill does. Measured trade-offs are in README.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
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
}

impl ActivationFormat {
    pub fn split(self, product: Product) -> Split {
        match (self, product) {
            (ActivationFormat::Q8, _) => Split::Single,
            (ActivationFormat::Mixed, Product::ExpertGateUp) => Split::Single,
            (ActivationFormat::Mixed, _) | (ActivationFormat::Q8x2, _) => Split::Double,
        }
    }
}

/// A dense weight matrix in one of the [`WeightFormat`]s.
pub enum DenseMatrix {
    Bf16(Bf16Matrix),
    Q8(Q8Matrix),
    Q4(Q4Matrix),
}

impl DenseMatrix {
    fn convert(matrix: &Bf16Matrix, format: WeightFormat) -> Result<Self, ModelError> {
        // Quantized blocks need whole blocks of 32 inputs; other widths stay exact.
        if format == WeightFormat::Native || !matrix.cols().is_multiple_of(MXFP4_BLOCK) {
            return Ok(DenseMatrix::Bf16(matrix.clone()));
        }
        let quantized = match format {
            WeightFormat::Q8 => Q8Matrix::from_bf16(matrix.rows(), matrix.cols(), matrix.values())
                .map(DenseMatrix::Q8),
            _ => Q4Matrix::from_bf16(matrix.rows(), matrix.cols(), matrix.values())
                .map(DenseMatrix::Q4),
        };
        quantized.map_err(|e| ModelError::Quantize(e.to_string()))
    }

    pub fn rows(&self) -> usize {
        match self {
            DenseMatrix::Bf16(m) => m.rows(),
            DenseMatrix::Q8(m) => m.rows(),
            DenseMatrix::Q4(m) => m.rows(),
        }
    }

    /// Bytes a full pass over the matrix reads.
    pub fn byte_len(&self) -> usize {
        match self {
            DenseMatrix::Bf16(m) => m.byte_len(),
            DenseMatrix::Q8(m) => m.size_bytes(),
            DenseMatrix::Q4(m) => m.size_bytes(),
        }
    }

    /// Bytes held outside the checkpoint mapping.
    fn owned_bytes(&self) -> usize {
        match self {
            DenseMatrix::Bf16(_) => 0,
            other => other.byte_len(),
        }
    }

    fn needs_quantized_input(&self) -> bool {
        !matches!(self, DenseMatrix::Bf16(_))
    }
}

pub struct FastLayer {
    pub q: DenseMatrix,
    pub k: DenseMatrix,
    pub v: DenseMatrix,
    pub o: DenseMatrix,
}

/// The dense weights in the chosen format, built once at load (or again when the setting changes).
pub struct FastWeights {
    pub format: WeightFormat,
    pub layers: Vec<FastLayer>,
    pub lm_head: DenseMatrix,
    /// Time the conversion took.
    pub convert_time: Duration,
    /// Memory the converted weights take outside the mapping.
    pub owned_bytes: usize,
}

impl FastWeights {
    /// Converts the attention projections and the unembedding to `format`. `progress` hears
    /// (matrices done, matrices in all). Quantizing reads the bf16 source once; its pages of the
    /// mapping are released afterwards so they do not count twice.
    pub fn build(
        weights: &Weights,
        format: WeightFormat,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<FastWeights, ModelError> {
        let started = Instant::now();
        let total = weights.layers.len() * 4 + 1;
        let mut done = 0;
        let mut step = |m: &Bf16Matrix| -> Result<DenseMatrix, ModelError> {
            let converted = DenseMatrix::convert(m, format)?;
            if converted.needs_quantized_input() {
                m.release_pages();
            }
            done += 1;
            progress(done, total);
            Ok(converted)
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for layer in &weights.layers {
            let a = &layer.attention;
            layers.push(FastLayer {
                q: step(&a.q.weight)?,
                k: step(&a.k.weight)?,
                v: step(&a.v.weight)?,
                o: step(&a.o.weight)?,
            });
        }
        let lm_head = step(&weights.lm_head)?;
        let owned_bytes = layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o])
            .map(|m| m.owned_bytes())
            .sum::<usize>()
            + lm_head.owned_bytes();
        Ok(FastWeights {
            format,
            layers,
            lm_head,
            convert_time: started.elapsed(),
            owned_bytes,
        })
    }
}

/// Tokens per prefill chunk in the fast path: enough that each of 32 experts sees dozens of
/// tokens, so a decoded weight tile is reused many times.
pub const FAST_PREFILL_CHUNK: usize = 512;

/// The KV cache of the fast path: keys of layer l at index 2l, values at 2l + 1, each
/// [kv_heads x positions x head_dim]: head-major, so attention streams each head's rows
/// contiguously (position-major rows put one head's 128 bytes every kv_width elements, which
/// the prefetchers followed poorly: decode at depth 4096 spent 17% of its time widening them).
pub enum KvStore {
    F16(Vec<Vec<f16>>),
    F32(Vec<Vec<f32>>),
}

impl KvStore {
    /// Keys and values of `layers` layers, `capacity_values` elements each; zeroed allocations
    /// are backed lazily by the OS, so unused context costs nothing.
    pub fn new(format: KvFormat, layers: usize, capacity_values: usize) -> KvStore {
        let tensors = 2 * layers;
        match format {
            KvFormat::F16 => KvStore::F16(
                (0..tensors)
                    .map(|_| vec![f16::ZERO; capacity_values])
                    .collect(),
            ),
            KvFormat::F32 => {
                KvStore::F32((0..tensors).map(|_| vec![0.0; capacity_values]).collect())
            }
        }
    }

    pub fn format(&self) -> KvFormat {
        match self {
            KvStore::F16(_) => KvFormat::F16,
            KvStore::F32(_) => KvFormat::F32,
        }
    }
}

/// An element type of the cache that rows of f32 can be stored into.
trait KvElement: Copy + Send + Sync {
    fn store(k: Kernels, src: &[f32], dst: &mut [Self]);
}

impl KvElement for f16 {
    fn store(k: Kernels, src: &[f32], dst: &mut [f16]) {
        k.f32_to_f16(src, dst)
            .expect("cache rows match the projection width");
    }
}

impl KvElement for f32 {
    fn store(_: Kernels, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

/// Activation buffers of the fast path, sized once per session.
pub struct FastScratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    normed_q: Q8Activations,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    attn_q: Q8Activations,
    proj: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    router: Vec<f32>,
    routes: Vec<Vec<(usize, f32)>>,
    route_rows: Vec<usize>,
    gathered: Q8Activations,
    /// The experts' input: one or two quantized rows per token (see [`ActivationFormat`]).
    expert_in_q: Q8Activations,
    /// The f32 rows of a split quantization.
    split_staging: Vec<f32>,
    /// The unembedding's output rows before folding split activations.
    logits_split: Vec<f32>,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
    activated_q: Vec<Q8Activations>,
    expert_out: Vec<f32>,
    moe_out: Vec<f32>,
    /// Kernel outputs in task blocks ([tokens x task rows] per task) before reordering.
    blocked: Vec<f32>,
    tasks: Vec<RowTask>,
}

impl FastScratch {
    pub fn new(c: &ModelConfig) -> FastScratch {
        let n = FAST_PREFILL_CHUNK;
        let (h, qw, kv, e, i) = (
            c.hidden_size,
            c.q_width(),
            c.kv_width(),
            c.num_local_experts,
            c.intermediate_size,
        );
        let top_k = c.num_experts_per_tok;
        // Expert products hold up to two quantized rows per token, for a chunk's tokens in prefill
        // or a token's routed experts in decode.
        let expert_rows = 2 * n.max(top_k);
        let blocked = [
            2 * n * (qw + 2 * kv),
            2 * n * h,
            n * e,
            2 * c.vocab_size,
            expert_rows * 2 * i,
            expert_rows * h,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        FastScratch {
            x: vec![0.0; n * h],
            normed: vec![0.0; n * h],
            normed_q: Q8Activations::with_capacity(2 * n, h),
            q: vec![0.0; n * qw],
            k: vec![0.0; n * kv],
            v: vec![0.0; n * kv],
            attn: vec![0.0; n * qw],
            attn_q: Q8Activations::with_capacity(2 * n, qw),
            proj: vec![0.0; n * h],
            cos: vec![0.0; n * c.head_dim / 2],
            sin: vec![0.0; n * c.head_dim / 2],
            router: vec![0.0; n * e],
            routes: (0..e).map(|_| Vec::with_capacity(n)).collect(),
            route_rows: Vec::with_capacity(2 * n),
            gathered: Q8Activations::with_capacity(2 * n, h),
            expert_in_q: Q8Activations::with_capacity(2 * n, h),
            split_staging: vec![0.0; 2 * n * h.max(i).max(qw)],
            logits_split: vec![0.0; 2 * c.vocab_size],
            gate_up: vec![0.0; (expert_rows * 2 * i).max(2 * n * (qw + 2 * kv))],
            activated: vec![0.0; n.max(top_k) * i],
            activated_q: (0..top_k.max(1))
                .map(|_| Q8Activations::with_capacity(2 * n, i))
                .collect(),
            expert_out: vec![0.0; expert_rows * h],
            moe_out: vec![0.0; n * h],
            blocked: vec![0.0; blocked],
            tasks: Vec::with_capacity(1024),
        }
    }
}

/// The weights one multiplication job reads.
#[derive(Clone, Copy)]
enum JobWeights<'a> {
    Dense(&'a DenseMatrix),
    Expert(Mxfp4Matrix<'a>),
    /// Exact bf16 rows (the router): f32 activations.
    Bf16(&'a Bf16Matrix),
}

impl JobWeights<'_> {
    fn rows(&self) -> usize {
        match self {
            JobWeights::Dense(m) => m.rows(),
            JobWeights::Expert(m) => m.rows(),
            JobWeights::Bf16(m) => m.rows(),
        }
    }

    fn cols(&self) -> usize {
        match self {
            JobWeights::Dense(DenseMatrix::Bf16(m)) => m.cols(),
            JobWeights::Dense(DenseMatrix::Q8(m)) => m.cols(),
            JobWeights::Dense(DenseMatrix::Q4(m)) => m.cols(),
            JobWeights::Expert(m) => m.cols(),
            JobWeights::Bf16(m) => m.cols(),
        }
    }
}

/// Multiply-accumulates below which a job set runs on the calling thread: waking the pool costs
/// more than the work (the router's 32 x 2880 for one token, say).
const INLINE_WORK: usize = 1 << 18;

/// One matrix times a batch of activations, written token-major into `out` ([n x rows]).
#[derive(Clone, Copy)]
struct Job<'a> {
    weights: JobWeights<'a>,
    quantized: Option<&'a Q8Activations>,
    plain: &'a [f32],
    tokens: usize,
    /// Offset of this job's output in the caller's buffer.
    out_offset: usize,
}

#[derive(Clone, Copy, Debug)]
struct RowTask {
    job: usize,
    rows: (usize, usize),
    /// Where the task's [tokens x rows] block goes in the blocked buffer.
    block_offset: usize,
}

thread_local! {
    /// Each pool thread's attention tiles, with the (heads, head_dim) they were sized for.
    static ATTENTION_SCRATCH: RefCell<((usize, usize), AttentionScratch)> =
        RefCell::new(((0, 0), AttentionScratch::new(0, 0)));
    /// Each pool thread's GEMM tile, with the widest row it was sized for; grown on first use.
    static GEMM_SCRATCH: RefCell<(usize, GemmScratch)> = RefCell::new((0, GemmScratch::new(0)));
}

/// Sizes every thread's GEMM and attention scratch for `config` now, on the current rayon pool
/// (the global one outside any pool), so that no thread allocates the first time it happens to
/// pick up such a task in the middle of a generation.
pub fn prepare_thread_scratch(config: &ModelConfig) {
    let widest = config
        .hidden_size
        .max(config.intermediate_size)
        .max(config.q_width());
    let group = config.num_attention_heads / config.num_key_value_heads;
    let head_dim = config.head_dim;
    rayon::broadcast(|_| {
        GEMM_SCRATCH.with(|scratch| {
            let mut guard = scratch.borrow_mut();
            if guard.0 < widest {
                *guard = (widest, GemmScratch::new(widest));
            }
        });
        ATTENTION_SCRATCH.with(|scratch| {
            let mut guard = scratch.borrow_mut();
            if guard.0 != (group, head_dim) {
                *guard = ((group, head_dim), AttentionScratch::new(group, head_dim));
            }
        });
    });
}

/// A raw pointer that may cross to pool threads; every task writes a disjoint range through it.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the tasks of one parallel region (`run_jobs`' row tasks, `attend`'s (KV head, token)
// tasks) cover disjoint ranges of the buffer, and the buffer outlives the region (it is borrowed
// mutably for its whole duration).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The `len` floats at `offset`.
    ///
    /// # Safety
    /// The range is inside the buffer and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, offset: usize, len: usize) -> &mut [f32] {
        // SAFETY: guaranteed by the caller, see above.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// Rows per task: a multiple of the GEMM tile, about four tasks per thread for balance.
fn task_rows(total_rows: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let target = total_rows.div_ceil(threads * 4).max(1);
    target.div_ceil(kernels::GEMM_TILE_ROWS) * kernels::GEMM_TILE_ROWS
}

/// Runs `jobs` in one parallel region and leaves each job's token-major output in `out` at its
/// `out_offset`.
fn run_jobs(
    k: Kernels,
    team: Option<&Team>,
    jobs: &[Job<'_>],
    tasks: &mut Vec<RowTask>,
    blocked: &mut [f32],
    out: &mut [f32],
) {
    tasks.clear();
    let total_rows: usize = jobs.iter().map(|j| j.weights.rows()).sum();
    let work: usize = jobs
        .iter()
        .map(|j| j.weights.rows() * j.weights.cols() * j.tokens)
        .sum();
    let inline = work < INLINE_WORK;
    let per_task = if inline {
        usize::MAX
    } else {
        task_rows(total_rows)
    };
    let mut block_offset = 0;
    for (index, job) in jobs.iter().enumerate() {
        let rows = job.weights.rows();
        let mut start = 0;
        while start < rows {
            let end = start.saturating_add(per_task).min(rows);
            tasks.push(RowTask {
                job: index,
                rows: (start, end),
                block_offset,
            });
            block_offset += (end - start) * job.tokens;
            start = end;
        }
    }
    assert!(
        block_offset <= blocked.len(),
        "scratch sized for the widest job set"
    );
    let shared = SharedOut(blocked.as_mut_ptr());
    let run = |task: &RowTask| {
        let job = &jobs[task.job];
        let len = (task.rows.1 - task.rows.0) * job.tokens;
        // SAFETY: see `SharedOut`: this task's block [block_offset, block_offset + len) is its own.
        let block = unsafe { shared.slice(task.block_offset, len) };
        run_task(k, job, task.rows.0..task.rows.1, block);
    };
    if inline {
        tasks.iter().for_each(run);
    } else {
        parallel_for(team, tasks.len(), &|i| run(&tasks[i]));
    }
    // Reorder the [tokens x task rows] blocks into each job's [tokens x rows] output.
    for task in tasks.iter() {
        let job = &jobs[task.job];
        let rows = job.weights.rows();
        let width = task.rows.1 - task.rows.0;
        for t in 0..job.tokens {
            let src = &blocked[task.block_offset + t * width..task.block_offset + (t + 1) * width];
            let dst = job.out_offset + t * rows + task.rows.0;
            out[dst..dst + width].copy_from_slice(src);
        }
    }
}

fn run_task(k: Kernels, job: &Job<'_>, rows: Range<usize>, out: &mut [f32]) {
    // A token and its split remainder (decode), or the few tokens an expert gets in a short
    // prefill, stream the weights once through the GEMV.
    let one = job.tokens <= kernels::MAX_GEMV_TOKENS;
    let result = match (job.weights, job.quantized) {
        (JobWeights::Bf16(m), _) => k.bf16_gemm(m.values(), m.cols(), job.plain, rows, out),
        (JobWeights::Dense(DenseMatrix::Bf16(m)), _) => {
            k.bf16_gemm(m.values(), m.cols(), job.plain, rows, out)
        }
        (JobWeights::Dense(DenseMatrix::Q8(m)), Some(x)) if one => k.q8_gemv(m, x, rows, out),
        (JobWeights::Expert(m), Some(x)) if one => k.mxfp4_gemv(&m, x, rows, out),
        (JobWeights::Dense(DenseMatrix::Q4(m)), Some(x)) if one => k.q4_gemv(m, x, rows, out),
        (weights, Some(x)) => GEMM_SCRATCH.with(|scratch| {
            let mut guard = scratch.borrow_mut();
            if guard.0 < x.cols() {
                *guard = (x.cols(), GemmScratch::new(x.cols()));
            }
            let scratch = &mut guard.1;
            match weights {
                JobWeights::Dense(DenseMatrix::Q8(m)) => k.q8_gemm(m, x, rows, out, scratch),
                JobWeights::Dense(DenseMatrix::Q4(m)) => k.q4_gemm(m, x, rows, out, scratch),
                JobWeights::Expert(m) => k.mxfp4_gemm(&m, x, rows, out, scratch),
                _ => unreachable!("bf16 weights take the plain path above"),
            }
        }),
        (_, None) => unreachable!("quantized weights are always given quantized activations"),
    };
    // Shapes are fixed by the model config and checked at load; a mismatch is a bug, not input.
    if let Err(err) = result {
        panic!("kernel shape mismatch: {err}");
    }
}

fn expert_matrix(experts: &Mxfp4Experts, expert: usize) -> Mxfp4Matrix<'_> {
    Mxfp4Matrix::new(
        experts.rows(),
        experts.cols(),
        experts.blocks(expert),
        experts.scales(expert),
    )
    .expect("expert tensor shapes are checked at load")
}

/// State the fast forward pass threads through one chunk.
pub struct FastPass<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a Weights,
    pub fast: &'a FastWeights,
    pub rope: &'a super::rope::RopeTable,
    pub kernels: Kernels,
    pub activations: ActivationFormat,
    /// Pool threads kept awake for this pass (decode), or `None` to use rayon.
    pub team: Option<&'a Team>,
}

impl FastPass<'_> {
    /// How the inputs of `product` are quantized under the activation setting.
    fn split(&self, product: Product) -> Split {
        self.activations.split(product)
    }

    /// Runs `tokens` at positions `start..`, leaving the last token's logits in `logits` (or every
    /// token's, appended to `all_logits`).
    pub fn forward_chunk(
        &self,
        tokens: &[u32],
        start: usize,
        s: &mut FastScratch,
        cache: &mut KvStore,
        logits: &mut [f32],
        all_logits: Option<&mut Vec<f32>>,
    ) {
        let c = self.config;
        let n = tokens.len();
        let h = c.hidden_size;
        embed_tokens(self.weights, tokens, &mut s.x);
        self.rope.cos_sin_rows(start, n, &mut s.cos, &mut s.sin);
        for (l, (layer, fast)) in self
            .weights
            .layers
            .iter()
            .zip(&self.fast.layers)
            .enumerate()
        {
            rms_norm_rows(
                &s.x[..n * h],
                &layer.input_norm,
                c.rms_norm_eps,
                &mut s.normed[..n * h],
            );
            self.attention(layer, fast, l, start, n, s, cache);
            add_into(&mut s.x[..n * h], &s.proj[..n * h]);
            rms_norm_rows(
                &s.x[..n * h],
                &layer.post_attention_norm,
                c.rms_norm_eps,
                &mut s.normed[..n * h],
            );
            self.mixture_of_experts(layer, n, s);
            add_into(&mut s.x[..n * h], &s.moe_out[..n * h]);
        }
        let (first_row, rows) = if all_logits.is_some() {
            (0, n)
        } else {
            (n - 1, 1)
        };
        rms_norm_rows(
            &s.x[first_row * h..(first_row + rows) * h],
            &self.weights.final_norm,
            c.rms_norm_eps,
            &mut s.normed[..rows * h],
        );
        match all_logits {
            None => {
                self.dense(&self.fast.lm_head, 1, s, logits);
            }
            Some(out) => {
                // The logits tool's path: row by row, so the scratch never holds n x vocab.
                for r in 0..rows {
                    s.normed.copy_within(r * h..(r + 1) * h, 0);
                    self.dense(&self.fast.lm_head, 1, s, logits);
                    out.extend_from_slice(logits);
                }
            }
        }
    }

    /// `out = W normed` for the first `n` rows of `s.normed` (quantizing them when `w` needs it).
    fn dense(&self, w: &DenseMatrix, n: usize, s: &mut FastScratch, out: &mut [f32]) {
        let h = self.config.hidden_size;
        if !w.needs_quantized_input() {
            let job = dense_job(w, None, &s.normed[..n * h], n, 0);
            run_jobs(
                self.kernels,
                self.team,
                &[job],
                &mut s.tasks,
                &mut s.blocked,
                out,
            );
            return;
        }
        let per_token = self.split(Product::Dense).rows_per_token();
        quantize_rows(
            self.kernels,
            &s.normed[..n * h],
            h,
            self.split(Product::Dense),
            &mut s.normed_q,
            &mut s.split_staging,
        );
        let rows = w.rows();
        let staged = &mut s.logits_split[..per_token * n * rows];
        let job = dense_job(w, Some(&s.normed_q), &[], per_token * n, 0);
        run_jobs(
            self.kernels,
            self.team,
            &[job],
            &mut s.tasks,
            &mut s.blocked,
            staged,
        );
        fold_rows(staged, n, per_token, rows);
        out[..n * rows].copy_from_slice(&staged[..n * rows]);
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: &Layer,
        fast: &FastLayer,
        l: usize,
        start: usize,
        n: usize,
        s: &mut FastScratch,
        cache: &mut KvStore,
    ) {
        let c = self.config;
        let (h, qw, kvw, hd) = (c.hidden_size, c.q_width(), c.kv_width(), c.head_dim);
        let a = &layer.attention;
        let needs_q8 = [&fast.q, &fast.k, &fast.v]
            .iter()
            .any(|m| m.needs_quantized_input());
        if needs_q8 {
            quantize_rows(
                self.kernels,
                &s.normed[..n * h],
                h,
                self.split(Product::Dense),
                &mut s.normed_q,
                &mut s.split_staging,
            );
        }
        // q, k and v read the same activations: one parallel region, outputs side by side
        // ([rows x qw] then [rows x kvw] twice, rows = tokens x quantized rows per token).
        let per = |m: &DenseMatrix| {
            if m.needs_quantized_input() {
                self.split(Product::Dense).rows_per_token()
            } else {
                1
            }
        };
        let (pq, pk, pv) = (per(&fast.q), per(&fast.k), per(&fast.v));
        let (at_k, at_v) = (pq * n * qw, pq * n * qw + pk * n * kvw);
        let qkv_out = &mut s.gate_up[..at_v + pv * n * kvw];
        {
            let quantized = needs_q8.then_some(&s.normed_q);
            let plain = &s.normed[..n * h];
            let jobs = [
                dense_job(&fast.q, quantized, plain, pq * n, 0),
                dense_job(&fast.k, quantized, plain, pk * n, at_k),
                dense_job(&fast.v, quantized, plain, pv * n, at_v),
            ];
            run_jobs(
                self.kernels,
                self.team,
                &jobs,
                &mut s.tasks,
                &mut s.blocked,
                qkv_out,
            );
        }
        fold_rows(&mut qkv_out[..at_k], n, pq, qw);
        fold_rows(&mut qkv_out[at_k..at_v], n, pk, kvw);
        fold_rows(&mut qkv_out[at_v..], n, pv, kvw);
        s.q[..n * qw].copy_from_slice(&qkv_out[..n * qw]);
        s.k[..n * kvw].copy_from_slice(&qkv_out[at_k..at_k + n * kvw]);
        s.v[..n * kvw].copy_from_slice(&qkv_out[at_v..at_v + n * kvw]);
        for i in 0..n {
            add_into(&mut s.q[i * qw..(i + 1) * qw], &a.q.bias);
            add_into(&mut s.k[i * kvw..(i + 1) * kvw], &a.k.bias);
            add_into(&mut s.v[i * kvw..(i + 1) * kvw], &a.v.bias);
        }
        let half = hd / 2;
        for i in 0..n {
            let (cos, sin) = (
                &s.cos[i * half..(i + 1) * half],
                &s.sin[i * half..(i + 1) * half],
            );
            apply_rope(&mut s.q[i * qw..(i + 1) * qw], hd, cos, sin);
            apply_rope(&mut s.k[i * kvw..(i + 1) * kvw], hd, cos, sin);
        }
        match cache {
            KvStore::F16(layers) => self.attend(layer, start, n, s, &mut layers[2 * l..2 * l + 2]),
            KvStore::F32(layers) => self.attend(layer, start, n, s, &mut layers[2 * l..2 * l + 2]),
        }
        let po = per(&fast.o);
        if fast.o.needs_quantized_input() {
            quantize_rows(
                self.kernels,
                &s.attn[..n * qw],
                qw,
                self.split(Product::Dense),
                &mut s.attn_q,
                &mut s.split_staging,
            );
        }
        let job = dense_job(&fast.o, Some(&s.attn_q), &s.attn[..n * qw], po * n, 0);
        let staged = &mut s.expert_out[..po * n * h];
        run_jobs(
            self.kernels,
            self.team,
            &[job],
            &mut s.tasks,
            &mut s.blocked,
            staged,
        );
        fold_rows(staged, n, po, h);
        let o_out = &mut s.proj[..n * h];
        o_out.copy_from_slice(&staged[..n * h]);
        for i in 0..n {
            add_into(&mut o_out[i * h..(i + 1) * h], &a.o.bias);
        }
    }

    /// Stores the chunk's keys and values, then attends: one task per (KV head, token) walks the
    /// visible keys once for all query heads of its group, so each cached row is read once.
    /// Tasks are ordered head by head, so a thread's working set is one head's keys and values.
    fn attend<T: KvElement + KvElem>(
        &self,
        layer: &Layer,
        start: usize,
        n: usize,
        s: &mut FastScratch,
        kv: &mut [Vec<T>],
    ) {
        let c = self.config;
        let (qw, kvw, hd) = (c.q_width(), c.kv_width(), c.head_dim);
        let kv_heads = c.num_key_value_heads;
        let k = self.kernels;
        let (keys, values) = kv.split_at_mut(1);
        let (keys, values) = (&mut keys[0], &mut values[0]);
        let capacity = keys.len() / kvw;
        for i in 0..n {
            for h in 0..kv_heads {
                let src = i * kvw + h * hd;
                let dst = (h * capacity + start + i) * hd;
                T::store(k, &s.k[src..src + hd], &mut keys[dst..dst + hd]);
                T::store(k, &s.v[src..src + hd], &mut values[dst..dst + hd]);
            }
        }
        let (keys, values) = (&*keys, &*values);
        let group = c.num_attention_heads / kv_heads;
        let window = match layer.kind {
            LayerKind::Sliding => c.sliding_window,
            LayerKind::Full => usize::MAX,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        let sinks = &layer.attention.sinks;
        let q = &s.q[..n * qw];
        let out = SharedOut(s.attn.as_mut_ptr());
        assert!(s.attn.len() >= n * qw, "scratch sized for the chunk");
        parallel_for(self.team, n * kv_heads, &|index| {
            let (kv_head, i) = (index / n, index % n);
            let position = start + i;
            let first_key = (position + 1).saturating_sub(window);
            let heads = kv_head * group..(kv_head + 1) * group;
            let query = GroupQuery {
                queries: &q[i * qw + heads.start * hd..i * qw + heads.end * hd],
                sinks: &sinks[heads.clone()],
                head_dim: hd,
                scale,
            };
            let span = kv_head * capacity * hd..(kv_head + 1) * capacity * hd;
            let head = KvHead {
                keys: &keys[span.clone()],
                values: &values[span],
                row_stride: hd,
                offset: 0,
            };
            // SAFETY: (token i, KV head) owns the group's query heads of token i in `s.attn`,
            // a range no other task touches; the buffer outlives the parallel loop.
            let out = unsafe { out.slice(i * qw + heads.start * hd, group * hd) };
            ATTENTION_SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                if scratch.0 != (group, hd) {
                    *scratch = ((group, hd), AttentionScratch::new(group, hd));
                }
                attend_group(
                    k,
                    &query,
                    &head,
                    first_key..position + 1,
                    out,
                    &mut scratch.1,
                )
                .expect("attention shapes follow the model config");
            });
        });
    }

    fn mixture_of_experts(&self, layer: &Layer, n: usize, s: &mut FastScratch) {
        let c = self.config;
        let (h, e, top_k) = (c.hidden_size, c.num_local_experts, c.num_experts_per_tok);
        // The router stays exact: top-k choices are sensitive to small errors.
        let job = Job {
            weights: JobWeights::Bf16(&layer.router.weight),
            quantized: None,
            plain: &s.normed[..n * h],
            tokens: n,
            out_offset: 0,
        };
        run_jobs(
            self.kernels,
            self.team,
            &[job],
            &mut s.tasks,
            &mut s.blocked,
            &mut s.router[..n * e],
        );
        for i in 0..n {
            add_into(&mut s.router[i * e..(i + 1) * e], &layer.router.bias);
        }
        s.routes.iter_mut().for_each(Vec::clear);
        for i in 0..n {
            route_token(&s.router[i * e..(i + 1) * e], top_k, |expert, weight| {
                s.routes[expert].push((i, weight))
            });
        }
        quantize_rows(
            self.kernels,
            &s.normed[..n * h],
            h,
            self.split(Product::ExpertGateUp),
            &mut s.expert_in_q,
            &mut s.split_staging,
        );
        s.moe_out[..n * h].fill(0.0);
        if n == 1 {
            self.decode_experts(layer, s);
        } else {
            for expert in 0..e {
                if !s.routes[expert].is_empty() {
                    self.prefill_expert(layer, expert, s);
                }
            }
        }
    }

    /// One token: the gate_up products of all its experts in one region, then all down products.
    fn decode_experts(&self, layer: &Layer, s: &mut FastScratch) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let mut chosen = [(0usize, 0.0f32); MAX_TOP_K];
        let mut count = 0;
        for (expert, routes) in s.routes.iter().enumerate() {
            if let Some(&(_, weight)) = routes.first() {
                chosen[count] = (expert, weight);
                count += 1;
            }
        }
        let chosen = &chosen[..count];
        let per_token = self.split(Product::ExpertGateUp).rows_per_token();
        let per_down = self.split(Product::ExpertDown).rows_per_token();
        // A fixed array (slots past `count` repeat the first expert and are never run): no
        // allocation per token.
        let expert_in = &s.expert_in_q;
        let jobs: [Job<'_>; MAX_TOP_K] = std::array::from_fn(|slot| {
            let (expert, _) = chosen[if slot < count { slot } else { 0 }];
            Job {
                weights: JobWeights::Expert(expert_matrix(&layer.gate_up, expert)),
                quantized: Some(expert_in),
                plain: &[],
                tokens: per_token,
                out_offset: slot * per_token * 2 * inter,
            }
        });
        run_jobs(
            self.kernels,
            self.team,
            &jobs[..count],
            &mut s.tasks,
            &mut s.blocked,
            &mut s.gate_up[..count * per_token * 2 * inter],
        );
        // Each slot's rows fold into one: slot k ends up at row k.
        fold_rows(&mut s.gate_up, count, per_token, 2 * inter);
        for (slot, &(expert, _)) in chosen.iter().enumerate() {
            let gate_up = &s.gate_up[slot * 2 * inter..(slot + 1) * 2 * inter];
            let activated = &mut s.activated[slot * inter..(slot + 1) * inter];
            swiglu(c, gate_up, layer.gate_up.bias(expert), activated);
            quantize_rows(
                self.kernels,
                activated,
                inter,
                self.split(Product::ExpertDown),
                &mut s.activated_q[slot],
                &mut s.split_staging,
            );
        }
        let activated_q = &s.activated_q;
        let jobs: [Job<'_>; MAX_TOP_K] = std::array::from_fn(|slot| {
            let slot = if slot < count { slot } else { 0 };
            Job {
                weights: JobWeights::Expert(expert_matrix(&layer.down, chosen[slot].0)),
                quantized: Some(&activated_q[slot]),
                plain: &[],
                tokens: per_down,
                out_offset: slot * per_down * h,
            }
        });
        run_jobs(
            self.kernels,
            self.team,
            &jobs[..count],
            &mut s.tasks,
            &mut s.blocked,
            &mut s.expert_out[..count * per_down * h],
        );
        fold_rows(&mut s.expert_out, count, per_down, h);
        for (slot, &(expert, weight)) in chosen.iter().enumerate() {
            let bias = layer.down.bias(expert);
            let out = &s.expert_out[slot * h..(slot + 1) * h];
            for ((acc, &y), &b) in s.moe_out[..h].iter_mut().zip(out).zip(bias) {
                *acc += weight * (y + b);
            }
        }
    }

    /// The tokens of a chunk routed to `expert`, multiplied together so each weight tile is decoded
    /// once for all of them.
    fn prefill_expert(&self, layer: &Layer, expert: usize, s: &mut FastScratch) {
        let c = self.config;
        let (h, inter) = (c.hidden_size, c.intermediate_size);
        let per_token = self.split(Product::ExpertGateUp).rows_per_token();
        let per_down = self.split(Product::ExpertDown).rows_per_token();
        let m = s.routes[expert].len();
        s.route_rows.clear();
        for &(i, _) in &s.routes[expert] {
            s.route_rows.extend(per_token * i..per_token * (i + 1));
        }
        s.gathered
            .gather_rows(&s.expert_in_q, &s.route_rows)
            .expect("routed rows are chunk rows");
        let job = Job {
            weights: JobWeights::Expert(expert_matrix(&layer.gate_up, expert)),
            quantized: Some(&s.gathered),
            plain: &[],
            tokens: per_token * m,
            out_offset: 0,
        };
        run_jobs(
            self.kernels,
            self.team,
            &[job],
            &mut s.tasks,
            &mut s.blocked,
            &mut s.gate_up[..per_token * m * 2 * inter],
        );
        fold_rows(&mut s.gate_up, m, per_token, 2 * inter);
        let bias = layer.gate_up.bias(expert);
        for t in 0..m {
            swiglu(
                c,
                &s.gate_up[t * 2 * inter..(t + 1) * 2 * inter],
                bias,
                &mut s.activated[t * inter..(t + 1) * inter],
            );
        }
        quantize_rows(
            self.kernels,
            &s.activated[..m * inter],
            inter,
            self.split(Product::ExpertDown),
            &mut s.activated_q[0],
            &mut s.split_staging,
        );
        let job = Job {
            weights: JobWeights::Expert(expert_matrix(&layer.down, expert)),
            quantized: Some(&s.activated_q[0]),
            plain: &[],
            tokens: per_down * m,
            out_offset: 0,
        };
        run_jobs(
            self.kernels,
            self.team,
            &[job],
            &mut s.tasks,
            &mut s.blocked,
            &mut s.expert_out[..per_down * m * h],
        );
        fold_rows(&mut s.expert_out, m, per_down, h);
        let bias = layer.down.bias(expert);
        for (t, &(i, weight)) in s.routes[expert].iter().enumerate() {
            let out = &s.expert_out[t * h..(t + 1) * h];
            for ((acc, &y), &b) in s.moe_out[i * h..(i + 1) * h].iter_mut().zip(out).zip(bias) {
                *acc += weight * (y + b);
            }
        }
    }
}

/// A job for a dense matrix; `quantized` is used only if the matrix's format needs it.
fn dense_job<'j>(
    w: &'j DenseMatrix,
    quantized: Option<&'j Q8Activations>,
    plain: &'j [f32],
    tokens: usize,
    out_offset: usize,
) -> Job<'j> {
    Job {
        weights: JobWeights::Dense(w),
        quantized: if w.needs_quantized_input() {
            quantized
        } else {
            None
        },
        plain,
        tokens,
        out_offset,
    }
}

const MAX_TOP_K: usize = 32;

/// Quantizes the token rows of `x` (`cols` wide) for a quantized matrix: one int8 row per token, or
/// for [`Split::Double`] two, the second quantizing what the first missed.
fn quantize_rows(
    k: Kernels,
    x: &[f32],
    cols: usize,
    split: Split,
    out: &mut Q8Activations,
    staging: &mut [f32],
) {
    let widths = "quantized inputs are a multiple of 32 wide";
    match split {
        Split::Single => k.quantize_activation_rows(x, cols, out).expect(widths),
        Split::Double => {
            let staged = &mut staging[..2 * x.len()];
            k.split_rows(x, cols, staged).expect(widths);
            k.quantize_activation_rows(staged, cols, out).expect(widths);
        }
    }
}

/// Sums each token's `per_token` consecutive output rows (`width` wide) into one, in place: row t
/// of the result is rows per_token x t .. per_token x (t + 1) of the input.
fn fold_rows(out: &mut [f32], tokens: usize, per_token: usize, width: usize) {
    if per_token == 1 {
        return;
    }
    for t in 0..tokens {
        for k in 0..width {
            let mut sum = 0.0;
            for part in 0..per_token {
                sum += out[(per_token * t + part) * width + k];
            }
            out[t * width + k] = sum;
        }
    }
}

/// The clamped SwiGLU of one token: gate rows are even, up rows odd (spec section 3).
fn swiglu(c: &ModelConfig, gate_up: &[f32], bias: &[f32], out: &mut [f32]) {
    let (limit, alpha) = (c.swiglu_limit, c.swiglu_alpha);
    for (j, o) in out.iter_mut().enumerate() {
        let gate = (gate_up[2 * j] + bias[2 * j]).min(limit);
        let up = (gate_up[2 * j + 1] + bias[2 * j + 1]).clamp(-limit, limit);
        let glu = gate / (1.0 + (-alpha * gate).exp());
        *o = glu * (up + 1.0);
    }
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}
