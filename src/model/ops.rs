//! The small steps both forward passes take the same way: embedding lookup, RMS norm, residual
//! add, routing, the clamped SwiGLU and the attention window (spec sections 3 and 4).

use std::ops::Range;

use super::config::{LayerKind, ModelConfig};
use super::weights::{bf16_to_f32, Weights};

/// Routed experts per token that routing supports (the config refuses more).
pub const MAX_EXPERTS_PER_TOKEN: usize = 32;

/// The embedding rows of `tokens`, widened to f32, into the first rows of `x`.
pub fn embed_tokens(weights: &Weights, tokens: &[u32], x: &mut [f32]) {
    let h = weights.embed.cols();
    for (row, &token) in x.chunks_exact_mut(h).zip(tokens) {
        for (out, &bits) in row.iter_mut().zip(weights.embed.row(token as usize)) {
            *out = bf16_to_f32(bits);
        }
    }
}

/// RMS norm of each `weight.len()`-wide row of `x` into `out`.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_square = sum_of_squares(row) / width as f64;
        let inv = 1.0 / ((mean_square as f32) + eps).sqrt();
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// The squares of `row` summed in f64, in eight interleaved partial sums. Each square is exact
/// in f64 and the sum's rounding (about 1e-13 of it) stays far below the f32 it becomes; one
/// chain of dependent adds made a norm cost ~3 us a row, serial work while other threads wait
/// (~1% of a short prompt's prefill).
fn sum_of_squares(row: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut chunks = row.chunks_exact(lanes.len());
    for chunk in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += (v as f64) * (v as f64);
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum();
    lanes.iter().sum::<f64>() + tail
}

/// `acc += x`, element by element.
pub fn add_into(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
}

/// Adds `bias` to every `bias.len()`-wide row of `rows`.
pub fn add_bias_rows(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_exact_mut(bias.len()) {
        add_into(row, bias);
    }
}

/// `acc += weight * y`: one expert's output added into a token's mixture.
pub fn add_weighted(acc: &mut [f32], weight: f32, y: &[f32]) {
    acc.iter_mut().zip(y).for_each(|(a, &y)| *a += weight * y);
}

/// Calls `assign(expert, weight)` for the `top_k` largest router logits, weights being the
/// softmax over those k logits only (top-k first, softmax second). `top_k` is at most
/// [`MAX_EXPERTS_PER_TOKEN`] and the number of logits (the config guarantees both).
pub fn route_token(logits: &[f32], top_k: usize, mut assign: impl FnMut(usize, f32)) {
    assert!(
        (1..=MAX_EXPERTS_PER_TOKEN.min(logits.len())).contains(&top_k),
        "the config bounds experts per token"
    );
    let mut chosen = [(0usize, f32::NEG_INFINITY); MAX_EXPERTS_PER_TOKEN];
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

/// The clamped SwiGLU of one token (spec section 3): `gate_up` holds gate and up interleaved
/// (gate at even indices), biases already added; the gate is clamped from above, the up value on
/// both sides, and the up path carries a +1.
pub fn swiglu(config: &ModelConfig, gate_up: &[f32], out: &mut [f32]) {
    let (limit, alpha) = (config.swiglu_limit, config.swiglu_alpha);
    for (o, pair) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
        let gate = pair[0].min(limit);
        let up = pair[1].clamp(-limit, limit);
        let glu = gate / (1.0 + (-alpha * gate).exp());
        *o = glu * (up + 1.0);
    }
}

/// The cached positions a query at `position` attends to: the last `sliding_window` positions
/// up to and including its own in a sliding layer, all of them in a full one.
pub fn visible_keys(config: &ModelConfig, kind: LayerKind, position: usize) -> Range<usize> {
    let first = match kind {
        LayerKind::Sliding => (position + 1).saturating_sub(config.sliding_window),
        LayerKind::Full => 0,
    };
    first..position + 1
}

/// The attention logit scale, 1 / sqrt(head_dim).
pub fn attention_scale(config: &ModelConfig) -> f32 {
    1.0 / (config.head_dim as f32).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_sum_of_squares_matches_one_chain() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 64.0
        };
        for len in (0..40).chain([2879, 2880, 2881]) {
            let row: Vec<f32> = (0..len).map(|_| next()).collect();
            let chain: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
            let got = sum_of_squares(&row);
            assert!(
                (got - chain).abs() <= chain * 1e-13,
                "len {len}: {got} vs {chain}"
            );
            assert_eq!(got as f32, chain as f32, "len {len}");
        }
    }

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
    fn swiglu_clamps_gate_and_up() {
        let config = ModelConfig::tiny();
        let limit = config.swiglu_limit;
        let mut out = [0.0f32; 2];
        // A huge gate is clamped to the limit, a huge negative up to -limit.
        swiglu(&config, &[1e6, -1e6, 0.0, 3.0], &mut out);
        let gate = limit;
        let want = gate / (1.0 + (-config.swiglu_alpha * gate).exp()) * (-limit + 1.0);
        assert!((out[0] - want).abs() <= want.abs() * 1e-6, "{out:?}");
        assert_eq!(out[1], 0.0);
    }

    #[test]
    fn the_window_ends_at_the_query() {
        let mut config = ModelConfig::tiny();
        config.sliding_window = 4;
        assert_eq!(visible_keys(&config, LayerKind::Sliding, 2), 0..3);
        assert_eq!(visible_keys(&config, LayerKind::Sliding, 9), 6..10);
        assert_eq!(visible_keys(&config, LayerKind::Full, 9), 0..10);
    }
}
