//! The fast forward pass: quantized SIMD kernels on the session's thread pool.
//!
//! Same steps as the exact path in `exact.rs` (which it is checked against), computed with the
//! `kernels` module: experts stay MXFP4 (in the tile layout where the kernels prefer it, see
//! `Weights::tile_experts`) and multiply int8-quantized activations; attention projections and the
//! unembedding are held in the weight format the settings choose (`convert.rs`); the KV cache is
//! f16 by default. Every multiplication splits its weight rows
//! into tasks on the pool; several matrices that read the same activations (q, k and v; the routed
//! experts of a token) run in one parallel region. A quantized product with split activations
//! (see [`ActivationFormat`]) writes two rows per token, folded into one afterwards.

mod attend;
mod experts;
mod jobs;
mod unembed;

use super::config::ModelConfig;
use super::convert::{DenseMatrix, FastLayer, FastWeights};
use super::kv::{KvElement, LayerKv, LayerKvOf};
use super::ops::{add_bias_rows, add_into, embed_tokens, rms_norm_rows, route_token};
use super::options::{ActivationFormat, Product};
use super::profile::{PassProfile, Phase};
use super::rope::{apply_rope_rows, RopeTable};
use super::session::{AllLogits, SequenceStep};
use super::team::parallel_for;
use super::team::Team;
use super::weights::{Layer, Weights};
use crate::kernels::{Kernels, Q8Activations};
use jobs::{Job, SharedOut, Work};

/// Tokens per prefill chunk in the fast path: enough that each of 32 experts sees dozens of
/// tokens, so a decoded weight tile is reused many times.
pub const PREFILL_CHUNK: usize = 512;

/// Rows per unembedding product when every row of a step is scored: the matrix (0.6 GB on the
/// 20b) is read once per block instead of once per row, and the block's logits (with split
/// activation rows, 2 x 16 x 201,088 floats: 26 MB) stay a small part of the scratch.
const SCORED_ROWS: usize = 16;

/// Activation buffers of the fast path for one chunk, sized once per session. Buffers a product
/// writes hold two rows per token (split activations) until they are folded.
pub struct Scratch {
    /// The residual stream.
    x: Vec<f32>,
    normed: Vec<f32>,
    normed_q: Q8Activations,
    cos: Vec<f32>,
    sin: Vec<f32>,
    /// q, k and v side by side: one parallel region writes all three.
    qkv: Vec<f32>,
    /// The attention heads' outputs, o_proj's input.
    attn: Vec<f32>,
    attn_q: Q8Activations,
    /// o_proj's output.
    proj: Vec<f32>,
    router: Vec<f32>,
    /// A batch's single-token steps as (step index, row), whose attention runs in one region.
    decoded: Vec<(usize, usize)>,
    /// Per expert, the (token, weight) pairs routed to it.
    routes: Vec<Vec<(usize, f32)>>,
    /// The rows of `expert_in_q` routed to one expert (prefill).
    route_rows: Vec<usize>,
    gathered: Q8Activations,
    /// The final-normed rows as one int8 row each, a two-stage unembedding's draft input.
    draft_in: Q8Activations,
    /// The experts whose products run together (see `experts.rs`), and each one's routed rows,
    /// sized for the most a grouped expert gets: a batch's routing changes every step, so
    /// buffers that grew on demand would allocate whenever an expert got more rows than before.
    group: Vec<usize>,
    group_in: Vec<Q8Activations>,
    /// The experts' input: one or two quantized rows per token (see [`ActivationFormat`]).
    expert_in_q: Q8Activations,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
    /// The down products' inputs: one per routed expert of a decoded token or per expert of a
    /// group, the first for an expert run alone.
    activated_q: Vec<Q8Activations>,
    expert_out: Vec<f32>,
    moe_out: Vec<f32>,
    /// The unembedding's output.
    logits: Vec<f32>,
    work: Work,
    /// The router's choices and a decode step's phase times, for the engine's live views.
    pub profile: PassProfile,
}

impl Scratch {
    pub fn new(c: &ModelConfig) -> Scratch {
        let n = PREFILL_CHUNK;
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
        Scratch {
            x: vec![0.0; n * h],
            normed: vec![0.0; n * h],
            normed_q: Q8Activations::with_capacity(2 * n, h),
            cos: vec![0.0; n * c.head_dim / 2],
            sin: vec![0.0; n * c.head_dim / 2],
            qkv: vec![0.0; 2 * n * (qw + 2 * kv)],
            attn: vec![0.0; n * qw],
            attn_q: Q8Activations::with_capacity(2 * n, qw),
            proj: vec![0.0; 2 * n * h],
            router: vec![0.0; n * e],
            decoded: Vec::with_capacity(n),
            routes: (0..e).map(|_| Vec::with_capacity(n)).collect(),
            route_rows: Vec::with_capacity(2 * n),
            gathered: Q8Activations::with_capacity(2 * n, h),
            draft_in: Q8Activations::with_capacity(n, h),
            group: Vec::with_capacity(experts::GROUP_SLOTS),
            group_in: (0..experts::GROUP_SLOTS)
                .map(|_| Q8Activations::with_capacity(2 * experts::GROUPED_TOKENS, h))
                .collect(),
            expert_in_q: Q8Activations::with_capacity(2 * n, h),
            gate_up: vec![0.0; expert_rows * 2 * i],
            activated: vec![0.0; n.max(top_k) * i],
            activated_q: (0..top_k.max(experts::GROUP_SLOTS))
                .map(|slot| {
                    if slot < top_k {
                        Q8Activations::with_capacity(2 * n, i)
                    } else {
                        Q8Activations::with_capacity(2 * experts::GROUPED_TOKENS, i)
                    }
                })
                .collect(),
            expert_out: vec![0.0; expert_rows * h],
            moe_out: vec![0.0; n * h],
            logits: vec![0.0; 2 * c.vocab_size],
            work: Work::new(blocked, n * h.max(i).max(qw)),
            profile: PassProfile::new(c.num_hidden_layers, e),
        }
    }
}

/// Sizes the calling thread's GEMM and attention scratch for `config`, so that no pool thread
/// allocates the first time it picks up such a task in the middle of a generation. Run on every
/// thread of a pool (`ThreadPool::broadcast`).
pub fn prepare_thread_scratch(config: &ModelConfig) {
    let widest = config
        .hidden_size
        .max(config.intermediate_size)
        .max(config.q_width());
    jobs::prepare_gemm_scratch(widest);
    // An expert slot of a group quantizes at most GROUPED_TOKENS tokens of its down input.
    jobs::prepare_split_staging(experts::GROUPED_TOKENS * config.intermediate_size);
    attend::prepare_attention_scratch(
        config.num_attention_heads / config.num_key_value_heads,
        config.head_dim,
    );
    unembed::prepare_candidate_scratch(crate::model::options::DRAFT_CANDIDATES, config.hidden_size);
}

/// What the fast forward pass reads for one call.
pub struct FastPass<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a Weights,
    pub fast: &'a FastWeights,
    pub rope: &'a RopeTable,
    pub kernels: Kernels,
    pub activations: ActivationFormat,
    /// Pool threads kept awake for this pass (decode), or `None` to use rayon.
    pub team: Option<&'a Team>,
}

/// The steps of a batch, shared by the tasks of one parallel region that each take a different
/// step.
struct SharedSteps<'s, 'a>(
    *mut SequenceStep<'a>,
    std::marker::PhantomData<&'s mut [SequenceStep<'a>]>,
);
// SAFETY: every task of the region takes a distinct step (see `FastPass::attention`), and a
// sequence's cache may be written from any thread (it is plain memory the session moves between
// threads already).
unsafe impl Send for SharedSteps<'_, '_> {}
unsafe impl Sync for SharedSteps<'_, '_> {}

impl<'s, 'a> SharedSteps<'s, 'a> {
    fn new(steps: &'s mut [SequenceStep<'a>]) -> Self {
        SharedSteps(steps.as_mut_ptr(), std::marker::PhantomData)
    }

    /// Step `index`.
    ///
    /// # Safety
    /// `index` is inside the slice and no other live reference to that step exists.
    #[allow(clippy::mut_from_ref)]
    unsafe fn get(&self, index: usize) -> &mut SequenceStep<'a> {
        // SAFETY: guaranteed by the caller.
        unsafe { &mut *self.0.add(index) }
    }
}

impl FastPass<'_> {
    /// Runs the new tokens of every step (at most [`PREFILL_CHUNK`] in all) as the rows of one
    /// pass, each step's tokens at its sequence's next positions over its own cache. Leaves the
    /// logits of each step's last token in `logits` ([steps x vocab]) and hands every row's logits of
    /// the step `all_logits` names to its callback (a single step's `logits` are then its last
    /// row's full logits). The caller appends the tokens to the sequences.
    pub fn forward(
        &self,
        steps: &mut [SequenceStep<'_>],
        s: &mut Scratch,
        logits: &mut [f32],
        all_logits: Option<AllLogits<'_>>,
    ) {
        let c = self.config;
        let h = c.hidden_size;
        let half = c.head_dim / 2;
        let eps = c.rms_norm_eps;
        let rows: usize = steps.iter().map(|step| step.tokens.len()).sum();
        s.profile.begin(rows, steps.len(), Phase::Rest);
        let mut n = 0;
        for step in steps.iter() {
            let len = step.tokens.len();
            embed_tokens(self.weights, step.tokens, &mut s.x[n * h..(n + len) * h]);
            self.rope.cos_sin_rows(
                step.sequence.len(),
                len,
                &mut s.cos[n * half..],
                &mut s.sin[n * half..],
            );
            n += len;
        }
        assert!(n <= PREFILL_CHUNK, "callers split work into chunks");
        // Without every row's logits, the last layer needs every row's keys and values (for the
        // cache) but the rest of its work only for each step's last row: after its attention
        // those rows move to the front and the pass goes on with one row per step, as llama.cpp
        // does. A 58-token prompt skips 57 rows of o_proj, experts and norms in one layer of 24.
        let last_rows_only = all_logits.is_none() && n > steps.len();
        let last_layer = self.weights.layers.len() - 1;
        let layers = self.weights.layers.iter().zip(&self.fast.layers);
        for (l, (layer, fast)) in layers.enumerate() {
            rms_norm_rows(
                &s.x[..n * h],
                &layer.input_norm,
                eps,
                &mut s.normed[..n * h],
            );
            s.profile.enter(Phase::Attention);
            let only_last = last_rows_only && l == last_layer;
            self.attention(layer, fast, l, steps, n, only_last, s);
            s.profile.enter(Phase::Rest);
            if only_last {
                let mut end = 0;
                for (r, step) in steps.iter().enumerate() {
                    end += step.tokens.len();
                    s.x.copy_within((end - 1) * h..end * h, r * h);
                }
                n = steps.len();
            }
            add_into(&mut s.x[..n * h], &s.proj[..n * h]);
            rms_norm_rows(
                &s.x[..n * h],
                &layer.post_attention_norm,
                eps,
                &mut s.normed[..n * h],
            );
            s.profile.enter(Phase::Experts);
            self.mixture_of_experts(layer, l, n, s);
            s.profile.enter(Phase::Rest);
            add_into(&mut s.x[..n * h], &s.moe_out[..n * h]);
        }
        s.profile.enter(Phase::Unembedding);

        let vocab = c.vocab_size;
        let lm_head = &self.fast.lm_head;
        if let Some(all) = all_logits {
            self.score_every_row(steps, all, s);
            if steps.len() == 1 {
                // A single step's last row is the last block's: its full logits are the pass's.
                let last = (steps[0].tokens.len() - 1) % SCORED_ROWS;
                logits[..vocab].copy_from_slice(&s.logits[last * vocab..(last + 1) * vocab]);
                s.profile.end();
                return;
            }
        }
        // Only each step's last row goes through the final norm and the unembedding, all rows in
        // one product, so the unembedding matrix is read once for the whole batch.
        let rows = steps.len();
        let mut last = 0;
        for (r, step) in steps.iter().enumerate() {
            // After a last layer of one row per step, step r's last row is row r.
            last = if n == rows {
                r + 1
            } else {
                last + step.tokens.len()
            };
            rms_norm_rows(
                &s.x[(last - 1) * h..last * h],
                &self.weights.final_norm,
                eps,
                &mut s.normed[r * h..(r + 1) * h],
            );
        }
        if let Some(draft) = &self.fast.draft {
            self.two_stage_unembedding(draft, rows, s);
            logits[..rows * vocab].copy_from_slice(&s.logits[..rows * vocab]);
            s.profile.end();
            return;
        }
        let per_token = self.rows_per_token(lm_head);
        if s.logits.len() < per_token * rows * vocab {
            s.logits.resize(per_token * rows * vocab, 0.0);
        }
        s.work.reserve_blocked(per_token * rows * vocab);
        let x = &s.normed[..rows * h];
        self.project(
            lm_head,
            x,
            rows,
            &mut s.normed_q,
            &mut s.work,
            &mut s.logits,
            &mut s.profile,
        );
        logits[..rows * vocab].copy_from_slice(&s.logits[..rows * vocab]);
        s.profile.end();
    }

    /// Every row of step `all.step` through the final norm and the full unembedding, a block
    /// of [`SCORED_ROWS`] rows per product (one read of the matrix per block, where a row at a
    /// time read it per row), each row's logits handed to the callback in order.
    fn score_every_row(&self, steps: &[SequenceStep<'_>], all: AllLogits<'_>, s: &mut Scratch) {
        let c = self.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let first: usize = steps[..all.step].iter().map(|step| step.tokens.len()).sum();
        let count = steps[all.step].tokens.len();
        let lm_head = &self.fast.lm_head;
        let per_token = self.rows_per_token(lm_head);
        let block = SCORED_ROWS.min(count);
        if s.logits.len() < per_token * block * vocab {
            s.logits.resize(per_token * block * vocab, 0.0);
        }
        s.work.reserve_blocked(per_token * block * vocab);
        let mut done = 0;
        while done < count {
            let rows = (count - done).min(SCORED_ROWS);
            let at = (first + done) * h;
            rms_norm_rows(
                &s.x[at..at + rows * h],
                &self.weights.final_norm,
                c.rms_norm_eps,
                &mut s.normed[..rows * h],
            );
            self.project(
                lm_head,
                &s.normed[..rows * h],
                rows,
                &mut s.normed_q,
                &mut s.work,
                &mut s.logits,
                &mut s.profile,
            );
            for row in s.logits[..rows * vocab].chunks_exact(vocab) {
                (all.row)(row);
            }
            done += rows;
        }
    }

    /// Self-attention of the `n` rows of `steps`, each step's rows over its own cache of layer
    /// `l`; leaves o_proj's output in `s.proj`. With `only_last`, every row's keys and values
    /// still go to the caches, but only each step's last row attends: step r's output is row r.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        layer: &Layer,
        fast: &FastLayer,
        l: usize,
        steps: &mut [SequenceStep<'_>],
        n: usize,
        only_last: bool,
        s: &mut Scratch,
    ) {
        let c = self.config;
        let (h, qw, kvw, hd) = (c.hidden_size, c.q_width(), c.kv_width(), c.head_dim);
        let a = &layer.attention;
        let normed = &s.normed[..n * h];

        let (q, k, v) = self.project_qkv(
            fast,
            normed,
            n,
            &mut s.normed_q,
            &mut s.work,
            &mut s.qkv,
            &mut s.profile,
        );
        add_bias_rows(q, &a.q.bias);
        add_bias_rows(k, &a.k.bias);
        add_bias_rows(v, &a.v.bias);
        apply_rope_rows(q, qw, hd, &s.cos, &s.sin);
        apply_rope_rows(k, kvw, hd, &s.cos, &s.sin);
        let (q, k, v) = (&*q, &*k, &*v);
        // Decoded rows (one token of a sequence) attend in one parallel region for all of a
        // batch's sequences, a task per sequence: a step of 16 sequences would otherwise run 16
        // regions per layer of a few microseconds' work each, and each region's barrier costs
        // about as much as its work. Steps of several tokens (a prompt chunk joining the batch)
        // have work enough for a region of their own, split by KV head and token.
        let single = steps.iter().filter(|step| step.tokens.len() == 1).count();
        let fused = self.team.is_some() && single > 1;
        let mut row = 0;
        s.decoded.clear();
        for (index, step) in steps.iter_mut().enumerate() {
            let len = step.tokens.len();
            if fused && len == 1 {
                s.decoded.push((index, row));
            } else if only_last {
                let attn = &mut s.attn[index * qw..(index + 1) * qw];
                self.sequence_attention(layer, l, step, row, (q, k, v), true, attn);
            } else {
                let attn = &mut s.attn[row * qw..(row + len) * qw];
                self.sequence_attention(layer, l, step, row, (q, k, v), false, attn);
            }
            row += len;
        }
        if fused {
            // A task's own pass has no team: its attention runs on the thread that took it.
            let alone = FastPass {
                team: None,
                ..*self
            };
            let shared_steps = SharedSteps::new(steps);
            let shared_attn = SharedOut(s.attn.as_mut_ptr());
            let decoded = &s.decoded;
            parallel_for(self.team, decoded.len(), &|task| {
                let (index, row) = decoded[task];
                // Step r's one row is its last, written to row r when only last rows go on.
                let out_row = if only_last { index } else { row };
                // SAFETY: each task takes a different step (the indices in `decoded` are
                // distinct) and the output row of that step's token, which no other task
                // touches; `steps` and `s.attn` outlive the region.
                let (step, attn) =
                    unsafe { (shared_steps.get(index), shared_attn.slice(out_row * qw, qw)) };
                alone.sequence_attention(layer, l, step, row, (q, k, v), false, attn);
            });
        }
        let n = if only_last { steps.len() } else { n };
        let attn = &s.attn[..n * qw];
        let (xq, work, out) = (&mut s.attn_q, &mut s.work, &mut s.proj);
        self.project(&fast.o, attn, n, xq, work, out, &mut s.profile);
        add_bias_rows(&mut s.proj[..n * h], &a.o.bias);
    }

    /// Stores the keys and values of `step`'s tokens (rows `row..` of `q`, `k`, `v`) in its
    /// sequence's cache of layer `l` and writes their attention into `attn`: every token's, or
    /// with `only_last` the last token's alone (its bits are the same either way: a query's
    /// attention does not depend on the other queries of its block).
    #[allow(clippy::too_many_arguments)]
    fn sequence_attention(
        &self,
        layer: &Layer,
        l: usize,
        step: &mut SequenceStep<'_>,
        row: usize,
        (q, k, v): (&[f32], &[f32], &[f32]),
        only_last: bool,
        attn: &mut [f32],
    ) {
        let (qw, kvw) = (self.config.q_width(), self.config.kv_width());
        let len = step.tokens.len();
        let start = step.sequence.len();
        let (k, v) = (
            &k[row * kvw..(row + len) * kvw],
            &v[row * kvw..(row + len) * kvw],
        );
        // The attending queries: all of the step's, or its last.
        let first = if only_last { len - 1 } else { 0 };
        let q = &q[(row + first) * qw..(row + len) * qw];
        let queries = (start + first, len - first);
        match step.sequence.kv.layer(l) {
            LayerKvOf::F16(cache) => {
                self.store_and_attend(layer, start, queries, (q, k, v), cache, attn)
            }
            LayerKvOf::F32(cache) => {
                self.store_and_attend(layer, start, queries, (q, k, v), cache, attn)
            }
            LayerKvOf::Q8(mut cache) => {
                for (i, (key, value)) in k.chunks_exact(kvw).zip(v.chunks_exact(kvw)).enumerate() {
                    cache.store(start + i, key, value);
                }
                self.attend_q8(layer, queries.0, queries.1, q, &cache, attn);
            }
        }
    }

    /// Stores the chunk's keys and values from position `start`, then attends with the
    /// `count` queries `q` from position `first`.
    fn store_and_attend<T: KvElement>(
        &self,
        layer: &Layer,
        start: usize,
        (first, count): (usize, usize),
        (q, k, v): (&[f32], &[f32], &[f32]),
        mut cache: LayerKv<'_, T>,
        out: &mut [f32],
    ) {
        let kvw = self.config.kv_width();
        for (i, (key, value)) in k.chunks_exact(kvw).zip(v.chunks_exact(kvw)).enumerate() {
            cache.store(self.kernels, start + i, key, value);
        }
        self.attend(layer, first, count, q, &cache, out);
    }

    /// The router's choices for each token, then the routed experts' outputs, weighted, summed
    /// into `s.moe_out`.
    fn mixture_of_experts(&self, layer: &Layer, l: usize, n: usize, s: &mut Scratch) {
        let c = self.config;
        let (h, e, top_k) = (c.hidden_size, c.num_local_experts, c.num_experts_per_tok);
        // The router stays exact: top-k choices are sensitive to small errors.
        let job = Job::bf16(&layer.router.weight, &s.normed[..n * h], n);
        s.work
            .run(self.kernels, self.team, &[job], &mut s.router[..n * e]);
        add_bias_rows(&mut s.router[..n * e], &layer.router.bias);
        s.routes.iter_mut().for_each(Vec::clear);
        for i in 0..n {
            route_token(&s.router[i * e..(i + 1) * e], top_k, |expert, weight| {
                s.routes[expert].push((i, weight))
            });
        }
        let routes = &s.routes;
        s.profile.routed(l, |expert| routes[expert].len());

        let split = self.activations.split(Product::ExpertGateUp);
        let outer = s.profile.enter(Phase::Quantization);
        s.work.quantize(
            self.kernels,
            &s.normed[..n * h],
            h,
            split,
            &mut s.expert_in_q,
        );
        s.profile.enter(outer);
        s.moe_out[..n * h].fill(0.0);
        if n == 1 {
            self.decode_experts(layer, s);
        } else {
            self.batch_experts(layer, s);
        }
    }

    /// Quantized rows per token of `w`'s input: two for split activations, one for a quantized
    /// matrix otherwise, one for bf16 (f32 input).
    fn rows_per_token(&self, w: &DenseMatrix) -> usize {
        if w.needs_quantized_input() {
            self.activations.split(Product::Dense).rows_per_token()
        } else {
            1
        }
    }

    /// q, k and v of the `n` token rows of `x`, in one parallel region; returns them token-major
    /// ([n x q_width], [n x kv_width] twice), without bias.
    #[allow(clippy::too_many_arguments)]
    fn project_qkv<'o>(
        &self,
        fast: &FastLayer,
        x: &[f32],
        n: usize,
        xq: &mut Q8Activations,
        work: &mut Work,
        qkv: &'o mut [f32],
        profile: &mut PassProfile,
    ) -> (&'o mut [f32], &'o mut [f32], &'o mut [f32]) {
        let c = self.config;
        let (h, qw, kvw) = (c.hidden_size, c.q_width(), c.kv_width());
        let matrices = [&fast.q, &fast.k, &fast.v];
        if matrices.iter().any(|m| m.needs_quantized_input()) {
            let outer = profile.enter(Phase::Quantization);
            work.quantize(
                self.kernels,
                x,
                h,
                self.activations.split(Product::Dense),
                xq,
            );
            profile.enter(outer);
        }
        let (pq, pk, pv) = (
            self.rows_per_token(&fast.q),
            self.rows_per_token(&fast.k),
            self.rows_per_token(&fast.v),
        );
        let at_k = n * qw;
        let at_v = at_k + n * kvw;
        let end = at_v + n * kvw;
        let jobs = [
            Job::dense(&fast.q, xq, x, pq * n, 0).folded(pq),
            Job::dense(&fast.k, xq, x, pk * n, at_k).folded(pk),
            Job::dense(&fast.v, xq, x, pv * n, at_v).folded(pv),
        ];
        work.run(self.kernels, self.team, &jobs, &mut qkv[..end]);
        let (q, rest) = qkv[..end].split_at_mut(at_k);
        let (k, v) = rest.split_at_mut(at_v - at_k);
        (q, k, v)
    }

    /// `out[..n * rows] = W x` for the `n` token rows of `x` (quantized into `xq` first when `w`
    /// takes int8 input), a token's split rows summed.
    #[allow(clippy::too_many_arguments)]
    fn project(
        &self,
        w: &DenseMatrix,
        x: &[f32],
        n: usize,
        xq: &mut Q8Activations,
        work: &mut Work,
        out: &mut [f32],
        profile: &mut PassProfile,
    ) {
        if w.needs_quantized_input() {
            let outer = profile.enter(Phase::Quantization);
            work.quantize(
                self.kernels,
                x,
                w.cols(),
                self.activations.split(Product::Dense),
                xq,
            );
            profile.enter(outer);
        }
        let (per_token, rows) = (self.rows_per_token(w), w.rows());
        let job = Job::dense(w, xq, x, per_token * n, 0).folded(per_token);
        work.run(self.kernels, self.team, &[job], &mut out[..n * rows]);
    }
}
