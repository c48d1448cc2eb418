//! The exact forward pass, the reference every faster path is checked against: f32 activations
//! against exactly decoded weights, portable code, an f32 KV cache.
//!
//! Embedding, then per layer attention with sinks and sliding windows and a mixture of experts,
//! each behind an RMS norm and added to the residual stream, then the final norm and the
//! unembedding (spec sections 3 and 4). One code path serves a decoded token and a prefill chunk:
//! every linear layer multiplies all tokens of the chunk at once, so each weight block is decoded
//! once per chunk, and the experts multiply the chunk's tokens routed to them together.

use rayon::prelude::*;

use super::config::ModelConfig;
use super::kv::{KvElement, LayerKv, LayerKvOf};
use super::ops::{
    add_bias_rows, add_into, add_weighted, attention_scale, embed_tokens, rms_norm_rows,
    route_token, swiglu, visible_keys,
};
use super::profile::{PassProfile, Phase};
use super::rope::apply_rope_rows;
use super::session::{AllLogits, SequenceStep};
use super::weights::{
    bf16_to_f32, e8m0_to_f32, Bf16Matrix, Layer, Linear, Mxfp4Experts, FP4_VALUES,
};
use super::Model;
use crate::kernels::{Mxfp4Layout, Mxfp4Matrix};

/// Tokens per prefill chunk: large enough that a weight block is reused many times, small enough
/// that the chunk's activations stay in cache.
pub const PREFILL_CHUNK: usize = 64;

/// Rows per unembedding product when every row of a step is scored (see [`AllLogits`]).
const SCORED_ROWS: usize = 16;

/// Activation buffers for one chunk, reused for every chunk and every decoded token.
pub struct Scratch {
    /// The residual stream.
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// The attention heads' outputs, o_proj's input.
    attn: Vec<f32>,
    /// o_proj's output.
    proj: Vec<f32>,
    /// Output of a multiplication before it is transposed to token-major order.
    transposed: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    router: Vec<f32>,
    /// Per expert, the (token, weight) pairs routed to it.
    routes: Vec<Vec<(usize, f32)>>,
    expert_in: Vec<f32>,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
    expert_out: Vec<f32>,
    moe_out: Vec<f32>,
    /// The router's choices and a decode step's phase times, for the engine's live views.
    pub profile: PassProfile,
}

impl Scratch {
    pub fn new(c: &ModelConfig) -> Scratch {
        let n = PREFILL_CHUNK;
        let (h, qw, kvw, e, i) = (
            c.hidden_size,
            c.q_width(),
            c.kv_width(),
            c.num_local_experts,
            c.intermediate_size,
        );
        let widest = [2 * i, qw, h, e].into_iter().max().unwrap_or(0);
        Scratch {
            x: vec![0.0; n * h],
            normed: vec![0.0; n * h],
            q: vec![0.0; n * qw],
            k: vec![0.0; n * kvw],
            v: vec![0.0; n * kvw],
            attn: vec![0.0; n * qw],
            proj: vec![0.0; n * h],
            transposed: vec![0.0; n * widest],
            cos: vec![0.0; n * c.head_dim / 2],
            sin: vec![0.0; n * c.head_dim / 2],
            router: vec![0.0; n * e],
            routes: (0..e).map(|_| Vec::with_capacity(n)).collect(),
            expert_in: vec![0.0; n * h],
            gate_up: vec![0.0; n * 2 * i],
            activated: vec![0.0; n * i],
            expert_out: vec![0.0; n * h],
            moe_out: vec![0.0; n * h],
            profile: PassProfile::new(c.num_hidden_layers, e),
        }
    }
}

/// Runs the new tokens of every step (at most [`PREFILL_CHUNK`] in all) as the rows of one pass,
/// each step's tokens at its sequence's next positions over its own cache. Leaves the logits of
/// each step's last token in `logits` ([steps x vocab]) and hands every row's logits of the step
/// `all_logits` names to its callback (a single step's `logits` are then its last row's). The
/// caller appends the tokens to the sequences.
pub fn forward(
    model: &Model,
    steps: &mut [SequenceStep<'_>],
    s: &mut Scratch,
    logits: &mut [f32],
    all_logits: Option<AllLogits<'_>>,
) {
    let c = &model.config;
    let weights = &model.weights;
    let h = c.hidden_size;
    let half = c.head_dim / 2;
    let eps = c.rms_norm_eps;

    let rows: usize = steps.iter().map(|step| step.tokens.len()).sum();
    s.profile.begin(rows, steps.len(), Phase::Rest);
    let mut n = 0;
    for step in steps.iter() {
        let len = step.tokens.len();
        embed_tokens(weights, step.tokens, &mut s.x[n * h..(n + len) * h]);
        model.rope.cos_sin_rows(
            step.sequence.len(),
            len,
            &mut s.cos[n * half..],
            &mut s.sin[n * half..],
        );
        n += len;
    }
    assert!(n <= PREFILL_CHUNK, "callers split work into chunks");
    for (l, layer) in weights.layers.iter().enumerate() {
        rms_norm_rows(
            &s.x[..n * h],
            &layer.input_norm,
            eps,
            &mut s.normed[..n * h],
        );
        s.profile.enter(Phase::Attention);
        attention(model, layer, l, steps, n, s);
        s.profile.enter(Phase::Rest);
        add_into(&mut s.x[..n * h], &s.proj[..n * h]);
        rms_norm_rows(
            &s.x[..n * h],
            &layer.post_attention_norm,
            eps,
            &mut s.normed[..n * h],
        );
        s.profile.enter(Phase::Experts);
        mixture_of_experts(c, layer, l, n, s);
        s.profile.enter(Phase::Rest);
        add_into(&mut s.x[..n * h], &s.moe_out[..n * h]);
    }
    s.profile.enter(Phase::Unembedding);

    let vocab = c.vocab_size;
    if let Some(all) = all_logits {
        let first: usize = steps[..all.step].iter().map(|step| step.tokens.len()).sum();
        let count = steps[all.step].tokens.len();
        let rows = &s.x[first * h..(first + count) * h];
        // The reference path's own buffers, a block of rows at a time: [vocab x rows] of the
        // whole step would not fit the scratch.
        let block = SCORED_ROWS.min(count);
        let (mut normed, mut transposed) = (vec![0.0; block * h], vec![0.0; block * vocab]);
        let mut block_logits = vec![0.0; block * vocab];
        for part in rows.chunks(SCORED_ROWS * h) {
            let n = part.len() / h;
            rms_norm_rows(part, &weights.final_norm, eps, &mut normed[..n * h]);
            matmul(
                &weights.lm_head,
                &normed[..n * h],
                n,
                &mut transposed[..n * vocab],
            );
            transpose(
                &transposed[..n * vocab],
                vocab,
                n,
                &mut block_logits[..n * vocab],
            );
            for row in block_logits[..n * vocab].chunks_exact(vocab) {
                (all.row)(row);
            }
            if steps.len() == 1 {
                logits[..vocab].copy_from_slice(&block_logits[(n - 1) * vocab..n * vocab]);
            }
        }
        if steps.len() == 1 {
            s.profile.end();
            return;
        }
    }
    // Only each step's last row goes through the final norm and the unembedding.
    let mut last = 0;
    for (r, step) in steps.iter().enumerate() {
        last += step.tokens.len();
        rms_norm_rows(
            &s.x[(last - 1) * h..last * h],
            &weights.final_norm,
            eps,
            &mut s.normed[..h],
        );
        matmul(
            &weights.lm_head,
            &s.normed[..h],
            1,
            &mut logits[r * vocab..(r + 1) * vocab],
        );
    }
    s.profile.end();
}

/// Self-attention of the `n` rows of `steps`, each step's rows over its own cache of layer `l`;
/// leaves o_proj's output in `s.proj`.
fn attention(
    model: &Model,
    layer: &Layer,
    l: usize,
    steps: &mut [SequenceStep<'_>],
    n: usize,
    s: &mut Scratch,
) {
    let c = &model.config;
    let (h, qw, kvw, hd) = (c.hidden_size, c.q_width(), c.kv_width(), c.head_dim);
    let a = &layer.attention;
    let normed = &s.normed[..n * h];
    let (q, k, v) = (&mut s.q[..n * qw], &mut s.k[..n * kvw], &mut s.v[..n * kvw]);

    linear(&a.q, normed, n, q, &mut s.transposed);
    linear(&a.k, normed, n, k, &mut s.transposed);
    linear(&a.v, normed, n, v, &mut s.transposed);
    apply_rope_rows(q, qw, hd, &s.cos, &s.sin);
    apply_rope_rows(k, kvw, hd, &s.cos, &s.sin);
    let mut row = 0;
    for step in steps.iter_mut() {
        let len = step.tokens.len();
        let start = step.sequence.len();
        let rows = (
            &q[row * qw..(row + len) * qw],
            &k[row * kvw..(row + len) * kvw],
            &v[row * kvw..(row + len) * kvw],
        );
        let out = &mut s.attn[row * qw..(row + len) * qw];
        match step.sequence.kv.layer(l) {
            LayerKvOf::F16(cache) => attend_rows(model, layer, start, rows, cache, out),
            LayerKvOf::F32(cache) => attend_rows(model, layer, start, rows, cache, out),
            LayerKvOf::Q8(_) => unreachable!("an exact session keeps an f32 cache (Session::new)"),
        }
        row += len;
    }

    linear(
        &a.o,
        &s.attn[..n * qw],
        n,
        &mut s.proj[..n * h],
        &mut s.transposed,
    );
}

/// Stores one sequence's new keys and values at positions `start..`, then attends with its
/// queries.
fn attend_rows<T: KvElement>(
    model: &Model,
    layer: &Layer,
    start: usize,
    (q, k, v): (&[f32], &[f32], &[f32]),
    mut cache: LayerKv<'_, T>,
    out: &mut [f32],
) {
    let c = &model.config;
    let (qw, kvw, hd) = (c.q_width(), c.kv_width(), c.head_dim);
    for (i, (key, value)) in k.chunks_exact(kvw).zip(v.chunks_exact(kvw)).enumerate() {
        cache.store(model.kernels, start + i, key, value);
    }
    let heads = c.num_attention_heads;
    let group = heads / c.num_key_value_heads;
    let scale = attention_scale(c);
    let cache = &cache;
    out.par_chunks_mut(hd)
        .enumerate()
        .with_min_len(4)
        .for_each(|(index, out)| {
            let (i, head) = (index / heads, index % heads);
            let (keys, values) = cache.head(head / group);
            let query = &q[i * qw + head * hd..i * qw + (head + 1) * hd];
            let visible = visible_keys(c, layer.kind, start + i).map(|j| {
                let row = j * hd..(j + 1) * hd;
                (&keys[row.clone()], &values[row])
            });
            attend_one_head(query, visible, layer.attention.sinks[head], scale, out);
        });
}

/// Softmax attention of one query over `keys_values` with a sink logit in the denominator, in
/// online form: the running max starts at the sink, and the sink's share is added at the end.
fn attend_one_head<'a, T: KvElement + 'a>(
    query: &[f32],
    keys_values: impl Iterator<Item = (&'a [T], &'a [T])>,
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
            .for_each(|(o, v)| *o += weight * v.to_f32());
    }
    let denominator = sum + (sink - max).exp();
    out.iter_mut().for_each(|o| *o /= denominator);
}

/// Routes each token to its top-k experts and leaves the weighted sum of their outputs in
/// `s.moe_out`.
fn mixture_of_experts(c: &ModelConfig, layer: &Layer, l: usize, n: usize, s: &mut Scratch) {
    let (h, e, inter) = (c.hidden_size, c.num_local_experts, c.intermediate_size);
    linear(
        &layer.router,
        &s.normed[..n * h],
        n,
        &mut s.router[..n * e],
        &mut s.transposed,
    );
    s.routes.iter_mut().for_each(Vec::clear);
    for i in 0..n {
        route_token(
            &s.router[i * e..(i + 1) * e],
            c.num_experts_per_tok,
            |expert, weight| s.routes[expert].push((i, weight)),
        );
    }
    let routes = &s.routes;
    s.profile.routed(l, |expert| routes[expert].len());

    s.moe_out[..n * h].fill(0.0);
    for expert in 0..e {
        let routes = &s.routes[expert];
        let m = routes.len();
        if m == 0 {
            continue;
        }
        for (slot, &(i, _)) in routes.iter().enumerate() {
            s.expert_in[slot * h..(slot + 1) * h].copy_from_slice(&s.normed[i * h..(i + 1) * h]);
        }
        let gate_up = &mut s.gate_up[..m * 2 * inter];
        expert_linear(
            &layer.gate_up,
            expert,
            &s.expert_in[..m * h],
            m,
            gate_up,
            &mut s.transposed,
        );
        let activated = &mut s.activated[..m * inter];
        for (pair, out) in gate_up
            .chunks_exact(2 * inter)
            .zip(activated.chunks_exact_mut(inter))
        {
            swiglu(c, pair, out);
        }
        let expert_out = &mut s.expert_out[..m * h];
        expert_linear(
            &layer.down,
            expert,
            activated,
            m,
            expert_out,
            &mut s.transposed,
        );
        for (y, &(i, weight)) in expert_out.chunks_exact(h).zip(routes) {
            add_weighted(&mut s.moe_out[i * h..(i + 1) * h], weight, y);
        }
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

/// One expert's [rows, cols] matrix inside an MXFP4 expert tensor, in either layout: a model
/// built for the fast path may have reordered its experts into tiles, and an exact model
/// reconfigured from it shares them.
struct ExpertMatrix<'a> {
    rows: usize,
    cols: usize,
    blocks: &'a [u8],
    scales: &'a [u8],
    matrix: Mxfp4Matrix<'a>,
}

impl<'a> ExpertMatrix<'a> {
    fn new(experts: &'a Mxfp4Experts, expert: usize) -> Self {
        ExpertMatrix {
            rows: experts.rows(),
            cols: experts.cols(),
            blocks: experts.blocks(expert),
            scales: experts.scales(expert),
            matrix: experts.matrix(expert),
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
        if self.matrix.layout() == Mxfp4Layout::Tiles {
            // Element by element through the layout's index: the same values, only slower.
            for (k, value) in (start..).zip(out.iter_mut()) {
                let scale = e8m0_to_f32(self.matrix.scale_byte(r, k / 32));
                *value = FP4_VALUES[self.matrix.nibble(r, k) as usize] * scale;
            }
            return;
        }
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
    multiply(&layer.weight, x, n, out, transposed);
    add_bias_rows(out, &layer.bias);
}

/// [`linear`] for one expert of an MXFP4 expert tensor.
fn expert_linear(
    experts: &Mxfp4Experts,
    expert: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    transposed: &mut [f32],
) {
    multiply(&ExpertMatrix::new(experts, expert), x, n, out, transposed);
    add_bias_rows(out, experts.bias(expert));
}

/// `out = x W^T` for `n` token rows, token-major.
fn multiply(w: &impl DecodeRows, x: &[f32], n: usize, out: &mut [f32], transposed: &mut [f32]) {
    let rows = w.rows();
    if n == 1 {
        matmul(w, x, 1, out);
    } else {
        matmul(w, x, n, &mut transposed[..n * rows]);
        transpose(&transposed[..n * rows], rows, n, out);
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

/// Dot product with eight partial sums, which the compiler turns into vector code; `b`'s elements
/// are widened to f32 on the way (cached keys may be f16).
#[inline]
fn dot<T: KvElement>(a: &[f32], b: &[T]) -> f32 {
    let mut partial = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for lane in 0..8 {
            partial[lane] += a[c * 8 + lane] * b[c * 8 + lane].to_f32();
        }
    }
    let mut sum: f32 = partial.iter().sum();
    for k in chunks * 8..a.len() {
        sum += a[k] * b[k].to_f32();
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

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
