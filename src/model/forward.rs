//! The forward pass: embedding, attention with sinks and sliding windows, mixture of experts,
//! final norm and unembedding, over a KV cache that grows with the conversation.
//!
//! One code path serves a single decoded token and a prefill chunk: every linear layer multiplies
//! all tokens of the chunk at once, so each weight block is decoded once per chunk, and the MoE
//! groups the chunk's tokens by expert. Buffers are sized when the session is created; a decoded
//! token allocates nothing.

use std::sync::Arc;

use rayon::prelude::*;

use super::config::{LayerKind, ModelConfig};
use super::fast::{ActivationFormat, FastPass, FastScratch, KvStore, FAST_PREFILL_CHUNK};
use super::rope::apply_rope;
use super::team::{with_team, Team};
use super::weights::{bf16_to_f32, e8m0_to_f32, Bf16Matrix, Layer, Linear, FP4_VALUES};
use super::Model;

/// Tokens per prefill chunk: large enough that a weight block is reused many times, small enough
/// that the chunk's activations stay in cache.
pub const PREFILL_CHUNK: usize = 64;

/// Bytes of one cached key or value element.
pub const KV_BYTES_PER_VALUE: usize = std::mem::size_of::<f32>();

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    #[error("the context holds {limit} tokens; {needed} were asked for")]
    ContextFull { limit: usize, needed: usize },
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("nothing to process: the token list is empty")]
    Empty,
}

/// Keys (after RoPE) and values of every processed position, per layer.
struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

/// Activation buffers for one chunk, reused for every chunk and every decoded token.
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    /// Output of a multiplication before it is transposed to token-major order.
    transposed: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    router: Vec<f32>,
    routes: Vec<Vec<(usize, f32)>>,
    expert_in: Vec<f32>,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
    expert_out: Vec<f32>,
    moe_out: Vec<f32>,
}

/// One conversation's state over a shared model: the KV cache, the ids it holds, scratch space,
/// the logits of the last processed token and the activation format the fast path computes with.
pub struct Session {
    model: Arc<Model>,
    context_limit: usize,
    tokens: Vec<u32>,
    /// A property of the session, not of the shared model, so it can change while other holders
    /// (a weight conversion thread) read the model.
    activations: ActivationFormat,
    state: State,
    logits: Vec<f32>,
}

/// The cache and buffers of the path the model computes with.
enum State {
    Exact {
        cache: KvCache,
        scratch: Box<Scratch>,
    },
    Fast {
        cache: KvStore,
        scratch: Box<FastScratch>,
    },
}

impl Session {
    pub fn new(model: Arc<Model>, context_limit: usize, kv: super::KvFormat) -> Session {
        let c = &model.config;
        let context_limit = context_limit.max(1);
        let kv_format = kv;
        let kv = c.kv_width();
        if model.fast.is_some() {
            super::fast::prepare_thread_scratch(c);
            let state = State::Fast {
                cache: KvStore::new(kv_format, c.num_hidden_layers, context_limit * kv),
                scratch: Box::new(FastScratch::new(c)),
            };
            return Session {
                logits: vec![0.0; c.vocab_size],
                activations: model.activations,
                model,
                context_limit,
                tokens: Vec::with_capacity(context_limit),
                state,
            };
        }
        // Zeroed allocations are lazily backed by the OS: an unused context costs no memory.
        let cache = KvCache {
            keys: (0..c.num_hidden_layers)
                .map(|_| vec![0.0; context_limit * kv])
                .collect(),
            values: (0..c.num_hidden_layers)
                .map(|_| vec![0.0; context_limit * kv])
                .collect(),
        };
        let n = PREFILL_CHUNK;
        let widest = [
            2 * c.intermediate_size,
            c.q_width(),
            c.hidden_size,
            c.num_local_experts,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let scratch = Scratch {
            x: vec![0.0; n * c.hidden_size],
            normed: vec![0.0; n * c.hidden_size],
            q: vec![0.0; n * c.q_width()],
            k: vec![0.0; n * kv],
            v: vec![0.0; n * kv],
            attn: vec![0.0; n * c.q_width()],
            proj: vec![0.0; n * c.hidden_size],
            transposed: vec![0.0; n * widest],
            cos: vec![0.0; n * c.head_dim / 2],
            sin: vec![0.0; n * c.head_dim / 2],
            router: vec![0.0; n * c.num_local_experts],
            routes: (0..c.num_local_experts)
                .map(|_| Vec::with_capacity(n))
                .collect(),
            expert_in: vec![0.0; n * c.hidden_size],
            gate_up: vec![0.0; n * 2 * c.intermediate_size],
            activated: vec![0.0; n * c.intermediate_size],
            expert_out: vec![0.0; n * c.hidden_size],
            moe_out: vec![0.0; n * c.hidden_size],
        };
        Session {
            logits: vec![0.0; c.vocab_size],
            activations: model.activations,
            model,
            context_limit,
            tokens: Vec::with_capacity(context_limit),
            state: State::Exact {
                cache,
                scratch: Box::new(scratch),
            },
        }
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens in the KV cache.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The ids the KV cache holds, for prefix reuse.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn context_limit(&self) -> usize {
        self.context_limit
    }

    /// Rewinds the cache to its first `len` tokens. Later positions are simply overwritten, so
    /// this is free; the logits of the last token are stale until the next prefill or decode.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }

    /// How the fast path quantizes the inputs of its quantized products (the exact path keeps f32).
    pub fn activations(&self) -> ActivationFormat {
        self.activations
    }

    /// Switches the activation format. A change empties the cache: its keys and values were
    /// computed from inputs quantized the other way, so continuing from them would match neither
    /// format. The same format keeps the cache, which is still what that format computes.
    pub fn set_activations(&mut self, format: ActivationFormat) {
        if format != self.activations {
            self.activations = format;
            self.truncate(0);
        }
    }

    /// Logits of the last processed token.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Appends `tokens` to the context and returns the logits of the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ForwardError> {
        self.check(tokens)?;
        for chunk in tokens.chunks(self.chunk_len()) {
            self.forward_chunk(chunk, None);
        }
        Ok(&self.logits)
    }

    /// Like [`Session::prefill`], but appends the logits of every position to `all_logits`
    /// (row-major [tokens x vocab]).
    pub fn prefill_all_logits(
        &mut self,
        tokens: &[u32],
        all_logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        self.check(tokens)?;
        for chunk in tokens.chunks(self.chunk_len()) {
            self.forward_chunk(chunk, Some(all_logits));
        }
        Ok(())
    }

    /// Tokens the forward pass processes at once; callers that report prefill progress or check
    /// for cancellation step by this much.
    pub fn chunk_len(&self) -> usize {
        match self.state {
            State::Exact { .. } => PREFILL_CHUNK,
            State::Fast { .. } => FAST_PREFILL_CHUNK,
        }
    }

    /// Appends one token and returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], ForwardError> {
        self.prefill(std::slice::from_ref(&token))
    }

    fn check(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let needed = self.tokens.len() + tokens.len();
        if needed > self.context_limit {
            return Err(ForwardError::ContextFull {
                limit: self.context_limit,
                needed,
            });
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ForwardError::TokenOutOfRange { token, vocab });
        }
        Ok(())
    }

    fn forward_chunk(&mut self, tokens: &[u32], all_logits: Option<&mut Vec<f32>>) {
        let start = self.tokens.len();
        let model = self.model.clone();
        let activations = self.activations;
        match &mut self.state {
            State::Exact { cache, scratch } => exact_chunk(
                &model,
                tokens,
                start,
                scratch,
                cache,
                &mut self.logits,
                all_logits,
            ),
            State::Fast { cache, scratch } => {
                let logits = &mut self.logits;
                let run = |team: Option<&Team>| {
                    let pass = FastPass {
                        config: &model.config,
                        weights: &model.weights,
                        fast: model
                            .fast
                            .as_ref()
                            .expect("a fast session has fast weights"),
                        rope: &model.rope,
                        kernels: model.kernels,
                        activations,
                        team,
                    };
                    pass.forward_chunk(tokens, start, scratch, cache, logits, all_logits)
                };
                // A decode step is ~100 short parallel regions: the team keeps the pool awake
                // through it (about 4% faster decode, measured token by token in one process).
                // A prefill chunk's regions are long, and its activation quantization uses rayon.
                if tokens.len() == 1 {
                    with_team(run)
                } else {
                    run(None)
                }
            }
        }
        self.tokens.extend_from_slice(tokens);
    }
}

/// The exact path over one chunk (see the module doc).
fn exact_chunk(
    model: &Model,
    tokens: &[u32],
    start: usize,
    s: &mut Scratch,
    cache: &mut KvCache,
    logits: &mut [f32],
    all_logits: Option<&mut Vec<f32>>,
) {
    {
        let c = &model.config;
        let weights = &model.weights;
        let n = tokens.len();
        let h = c.hidden_size;

        embed_tokens(weights, tokens, &mut s.x);
        model.rope.cos_sin_rows(start, n, &mut s.cos, &mut s.sin);

        for (l, layer) in weights.layers.iter().enumerate() {
            rms_norm_rows(
                &s.x[..n * h],
                &layer.input_norm,
                c.rms_norm_eps,
                &mut s.normed[..n * h],
            );
            self::attention(c, layer, l, start, n, s, cache);
            add_into(&mut s.x[..n * h], &s.proj[..n * h]);
            rms_norm_rows(
                &s.x[..n * h],
                &layer.post_attention_norm,
                c.rms_norm_eps,
                &mut s.normed[..n * h],
            );
            mixture_of_experts(c, layer, n, s);
            add_into(&mut s.x[..n * h], &s.moe_out[..n * h]);
        }

        // Only the rows whose logits are wanted go through the final norm and the unembedding.
        let (first_row, rows) = if all_logits.is_some() {
            (0, n)
        } else {
            (n - 1, 1)
        };
        rms_norm_rows(
            &s.x[first_row * h..(first_row + rows) * h],
            &weights.final_norm,
            c.rms_norm_eps,
            &mut s.normed[..rows * h],
        );
        let vocab = c.vocab_size;
        match all_logits {
            None => matmul(&weights.lm_head, &s.normed[..h], 1, logits),
            Some(out) => {
                let at = out.len();
                out.resize(at + rows * vocab, 0.0);
                let mut transposed = vec![0.0; rows * vocab];
                matmul(
                    &weights.lm_head,
                    &s.normed[..rows * h],
                    rows,
                    &mut transposed,
                );
                transpose(&transposed, vocab, rows, &mut out[at..]);
                logits.copy_from_slice(&out[out.len() - vocab..]);
            }
        }
    }
}

/// The embedding rows of `tokens`, widened to f32, into the first rows of `x`.
pub(crate) fn embed_tokens(weights: &super::Weights, tokens: &[u32], x: &mut [f32]) {
    let h = weights.embed.cols();
    for (row, &token) in x.chunks_exact_mut(h).zip(tokens) {
        for (out, &bits) in row.iter_mut().zip(weights.embed.row(token as usize)) {
            *out = bf16_to_f32(bits);
        }
    }
}

/// Self-attention of `n` new tokens at positions `start..start + n`; leaves o_proj's output in
/// `s.proj`.
fn attention(
    c: &ModelConfig,
    layer: &Layer,
    l: usize,
    start: usize,
    n: usize,
    s: &mut Scratch,
    cache: &mut KvCache,
) {
    let h = c.hidden_size;
    let (qw, kvw, hd) = (c.q_width(), c.kv_width(), c.head_dim);
    let a = &layer.attention;
    let normed = &s.normed[..n * h];
    linear(&a.q, normed, n, &mut s.q[..n * qw], &mut s.transposed);
    linear(&a.k, normed, n, &mut s.k[..n * kvw], &mut s.transposed);
    linear(&a.v, normed, n, &mut s.v[..n * kvw], &mut s.transposed);
    let half = hd / 2;
    for i in 0..n {
        let (cos, sin) = (
            &s.cos[i * half..(i + 1) * half],
            &s.sin[i * half..(i + 1) * half],
        );
        apply_rope(&mut s.q[i * qw..(i + 1) * qw], hd, cos, sin);
        apply_rope(&mut s.k[i * kvw..(i + 1) * kvw], hd, cos, sin);
    }
    let keys = &mut cache.keys[l];
    let values = &mut cache.values[l];
    keys[start * kvw..(start + n) * kvw].copy_from_slice(&s.k[..n * kvw]);
    values[start * kvw..(start + n) * kvw].copy_from_slice(&s.v[..n * kvw]);
    let (keys, values) = (&*keys, &*values);

    let heads = c.num_attention_heads;
    let group = heads / c.num_key_value_heads;
    let window = match layer.kind {
        LayerKind::Sliding => c.sliding_window,
        LayerKind::Full => usize::MAX,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let q = &s.q[..n * qw];
    s.attn[..n * qw]
        .par_chunks_mut(hd)
        .enumerate()
        .with_min_len(4)
        .for_each(|(index, out)| {
            let (i, head) = (index / heads, index % heads);
            let position = start + i;
            let first_key = (position + 1).saturating_sub(window);
            let kv_offset = (head / group) * hd;
            let query = &q[i * qw + head * hd..i * qw + (head + 1) * hd];
            attend_one_head(
                query,
                (first_key..=position).map(|j| {
                    let at = j * kvw + kv_offset;
                    (&keys[at..at + hd], &values[at..at + hd])
                }),
                layer.attention.sinks[head],
                scale,
                out,
            );
        });
    linear(
        &a.o,
        &s.attn[..n * qw],
        n,
        &mut s.proj[..n * h],
        &mut s.transposed,
    );
}

/// Softmax attention of one query over `keys_values` with a sink logit in the denominator, in
/// online form: the running max starts at the sink, and the sink's share is added at the end.
fn attend_one_head<'a>(
    query: &[f32],
    keys_values: impl Iterator<Item = (&'a [f32], &'a [f32])>,
    sink: f32,
    scale: f32,
    out: &mut [f32],
) {
    out.fill(0.0);
    let mut max = sink;
    let mut sum = 0.0f32;
    for (key, value) in keys_values {
        let logit = dot(query, key) * scale;
        if logit > max {
            let rescale = (max - logit).exp();
            sum *= rescale;
            out.iter_mut().for_each(|o| *o *= rescale);
            max = logit;
        }
        let weight = (logit - max).exp();
        sum += weight;
        out.iter_mut()
            .zip(value)
            .for_each(|(o, v)| *o += weight * v);
    }
    let denominator = sum + (sink - max).exp();
    out.iter_mut().for_each(|o| *o /= denominator);
}

/// Routes each token to its top-k experts and leaves the weighted sum of their outputs in
/// `s.moe_out`.
fn mixture_of_experts(c: &ModelConfig, layer: &Layer, n: usize, s: &mut Scratch) {
    let h = c.hidden_size;
    let experts = c.num_local_experts;
    let top_k = c.num_experts_per_tok;
    let inter = c.intermediate_size;
    linear(
        &layer.router,
        &s.normed[..n * h],
        n,
        &mut s.router[..n * experts],
        &mut s.transposed,
    );

    s.routes.iter_mut().for_each(Vec::clear);
    for i in 0..n {
        route_token(
            &s.router[i * experts..(i + 1) * experts],
            top_k,
            |expert, weight| {
                s.routes[expert].push((i, weight));
            },
        );
    }

    s.moe_out[..n * h].fill(0.0);
    let (limit, alpha) = (c.swiglu_limit, c.swiglu_alpha);
    for expert in 0..experts {
        let routed = s.routes[expert].len();
        if routed == 0 {
            continue;
        }
        for (slot, &(i, _)) in s.routes[expert].iter().enumerate() {
            s.expert_in[slot * h..(slot + 1) * h].copy_from_slice(&s.normed[i * h..(i + 1) * h]);
        }
        let gate_up = ExpertMatrix::new(&layer.gate_up, expert);
        // Outputs stay transposed ([rows x tokens]): the activation reads them in that order.
        matmul(
            &gate_up,
            &s.expert_in[..routed * h],
            routed,
            &mut s.gate_up[..routed * 2 * inter],
        );
        let bias = layer.gate_up.bias(expert);
        for slot in 0..routed {
            for j in 0..inter {
                let gate = s.gate_up[2 * j * routed + slot] + bias[2 * j];
                let up = s.gate_up[(2 * j + 1) * routed + slot] + bias[2 * j + 1];
                let gate = gate.min(limit);
                let up = up.clamp(-limit, limit);
                let glu = gate / (1.0 + (-alpha * gate).exp());
                s.activated[slot * inter + j] = glu * (up + 1.0);
            }
        }
        let down = ExpertMatrix::new(&layer.down, expert);
        matmul(
            &down,
            &s.activated[..routed * inter],
            routed,
            &mut s.expert_out[..routed * h],
        );
        let bias = layer.down.bias(expert);
        for (slot, &(i, weight)) in s.routes[expert].iter().enumerate() {
            let out = &mut s.moe_out[i * h..(i + 1) * h];
            for (r, o) in out.iter_mut().enumerate() {
                *o += weight * (s.expert_out[r * routed + slot] + bias[r]);
            }
        }
    }
}

/// Calls `assign(expert, weight)` for the `top_k` largest router logits, weights being the
/// softmax over those k logits only (top-k first, softmax second).
pub fn route_token(logits: &[f32], top_k: usize, mut assign: impl FnMut(usize, f32)) {
    const MAX_TOP_K: usize = 32;
    let top_k = top_k.min(MAX_TOP_K).min(logits.len());
    let mut chosen = [(0usize, f32::NEG_INFINITY); MAX_TOP_K];
    for (expert, &logit) in logits.iter().enumerate() {
        // Insertion into a short sorted list; ties keep the lower index first, as torch.topk does.
        if logit > chosen[top_k - 1].1 {
            let mut at = top_k - 1;
            while at > 0 && logit > chosen[at - 1].1 {
                chosen[at] = chosen[at - 1];
                at -= 1;
            }
            chosen[at] = (expert, logit);
        }
    }
    let max = chosen[0].1;
    let total: f32 = chosen[..top_k].iter().map(|&(_, l)| (l - max).exp()).sum();
    for &(expert, logit) in &chosen[..top_k] {
        assign(expert, (logit - max).exp() / total);
    }
}

/// A weight matrix that can decode any run of a row to f32, exactly.
trait DecodeRows: Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// Decodes row `r`, columns `start..start + out.len()`; `start` is a multiple of 32.
    fn decode(&self, r: usize, start: usize, out: &mut [f32]);
}

impl DecodeRows for Bf16Matrix {
    fn rows(&self) -> usize {
        self.rows()
    }

    fn cols(&self) -> usize {
        self.cols()
    }

    fn decode(&self, r: usize, start: usize, out: &mut [f32]) {
        let row = &self.row(r)[start..start + out.len()];
        for (o, &bits) in out.iter_mut().zip(row) {
            *o = bf16_to_f32(bits);
        }
    }
}

/// One expert's [rows, cols] matrix inside an MXFP4 expert tensor.
struct ExpertMatrix<'a> {
    rows: usize,
    cols: usize,
    blocks: &'a [u8],
    scales: &'a [u8],
}

impl<'a> ExpertMatrix<'a> {
    fn new(experts: &'a super::weights::Mxfp4Experts, expert: usize) -> Self {
        ExpertMatrix {
            rows: experts.rows(),
            cols: experts.cols(),
            blocks: experts.blocks(expert),
            scales: experts.scales(expert),
        }
    }
}

impl DecodeRows for ExpertMatrix<'_> {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn decode(&self, r: usize, start: usize, out: &mut [f32]) {
        let bytes =
            &self.blocks[(r * self.cols + start) / 2..(r * self.cols + start + out.len()) / 2];
        let scales = &self.scales[(r * self.cols + start) / 32..];
        for (block, (values, codes)) in out.chunks_mut(32).zip(bytes.chunks(16)).enumerate() {
            let scale = e8m0_to_f32(scales[block]);
            for (pair, &byte) in values.chunks_exact_mut(2).zip(codes) {
                pair[0] = FP4_VALUES[(byte & 0x0F) as usize] * scale;
                pair[1] = FP4_VALUES[(byte >> 4) as usize] * scale;
            }
        }
    }
}

/// Columns decoded per step: two MXFP4 blocks, a few cache lines of bf16.
const DECODE_STEP: usize = 64;

/// `out_t[r * n + i] = sum_k W[r][k] * x[i][k]` for `n` token rows of `x` (token-major); the
/// output is row-major over weight rows, i.e. transposed. Each weight run is decoded once and
/// applied to all `n` tokens.
fn matmul(w: &impl DecodeRows, x: &[f32], n: usize, out_t: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    debug_assert_eq!(x.len(), n * cols);
    debug_assert_eq!(out_t.len(), n * rows);
    let rows_per_task = (rows / (rayon::current_num_threads() * 16)).max(1);
    out_t
        .par_chunks_mut(n * rows_per_task)
        .enumerate()
        .for_each(|(task, outs)| {
            let mut decoded = [0.0f32; DECODE_STEP];
            for (local, out) in outs.chunks_mut(n).enumerate() {
                let r = task * rows_per_task + local;
                out.fill(0.0);
                let mut start = 0;
                while start < cols {
                    let len = DECODE_STEP.min(cols - start);
                    w.decode(r, start, &mut decoded[..len]);
                    for (i, o) in out.iter_mut().enumerate() {
                        *o += dot(
                            &decoded[..len],
                            &x[i * cols + start..i * cols + start + len],
                        );
                    }
                    start += len;
                }
            }
        });
}

/// `out = x W^T + b` for `n` token rows, token-major.
fn linear(layer: &Linear, x: &[f32], n: usize, out: &mut [f32], transposed: &mut [f32]) {
    let rows = layer.weight.rows();
    if n == 1 {
        matmul(&layer.weight, x, 1, out);
    } else {
        matmul(&layer.weight, x, n, &mut transposed[..n * rows]);
        transpose(&transposed[..n * rows], rows, n, out);
    }
    for row in out.chunks_exact_mut(rows) {
        add_into(row, &layer.bias);
    }
}

/// `out[i * rows + r] = t[r * n + i]`.
fn transpose(t: &[f32], rows: usize, n: usize, out: &mut [f32]) {
    for (r, column) in t.chunks_exact(n).enumerate() {
        for (i, &v) in column.iter().enumerate() {
            out[i * rows + r] = v;
        }
    }
}

pub(crate) fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_square = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / width as f64;
        let inv = 1.0 / ((mean_square as f32) + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

fn add_into(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// Dot product with eight partial sums, which the compiler turns into vector code.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for lane in 0..8 {
            partial[lane] += a[c * 8 + lane] * b[c * 8 + lane];
        }
    }
    let mut sum: f32 = partial.iter().sum();
    for k in chunks * 8..a.len() {
        sum += a[k] * b[k];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_top_k_then_softmax() {
        let logits = [0.5, 3.0, -1.0, 2.0, 2.5];
        let mut got = Vec::new();
        route_token(&logits, 2, |e, w| got.push((e, w)));
        assert_eq!(got[0].0, 1);
        assert_eq!(got[1].0, 4);
        let expected = 1.0 / (1.0 + (-0.5f32).exp());
        assert!((got[0].1 - expected).abs() < 1e-6);
        assert!((got[0].1 + got[1].1 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn sink_takes_its_share_of_the_softmax() {
        let key = [1.0f32, 0.0];
        let value = [2.0f32, -4.0];
        let mut out = [0.0f32; 2];
        // One key with logit 1 against a sink of 1: half the probability goes to the sink.
        attend_one_head(
            &[1.0, 0.0],
            std::iter::once((&key[..], &value[..])),
            1.0,
            1.0,
            &mut out,
        );
        assert!(
            (out[0] - 1.0).abs() < 1e-6 && (out[1] + 2.0).abs() < 1e-6,
            "{out:?}"
        );
    }
}
