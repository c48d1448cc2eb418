//! What the attention kernel tests share: outputs compared with an f64 reference.
//!
//! Tolerance: relative to the largest |value| of the value rows a head sees (an output is a convex
//! combination of them, times at most 1). f32 arithmetic in a different order plus the <= 2 ulp
//! exp give errors up to about 4e-7 there (measured); we allow 2e-6.

use std::ops::Range;

use half::f16;
use ossterm::kernels::attention::{
    attend_block, attend_group, AttentionScratch, BlockQuery, GroupQuery, KvElem, KvHead,
};
use ossterm::kernels::Kernels;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

pub const TOLERANCE: f64 = 2e-6;

/// Every element of `got` within [`TOLERANCE`] x `magnitude` of `want`.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], magnitude: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let error = (*g as f64 - w).abs() / magnitude;
        assert!(
            error <= TOLERANCE,
            "{what}: element {i} is {g}, expected {w} (error {error:e} of the value magnitude)"
        );
    }
}

/// An f32 result as the f64 `want` of [`assert_close`].
pub fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

/// Every path this CPU runs, each with both attention arithmetics where it has bf16: what the
/// bit-for-bit tests hold (a kernel against itself: chunking, rows that must not be read).
pub fn every_attention_kernel() -> Vec<ossterm::kernels::Kernels> {
    let mut all = f32_attention_kernels();
    all.extend(bf16_attention_kernels());
    all
}

/// The paths this CPU runs with bf16 attention arithmetic: wherever it has AVX-512 BF16, whether
/// or not the start-up probe picks bf16 by default (`Kernels::with_bf16_attention`).
pub fn bf16_attention_kernels() -> Vec<ossterm::kernels::Kernels> {
    ossterm::kernels::Kernels::all_supported()
        .into_iter()
        .map(|k| k.with_bf16_attention())
        .filter(|k| k.uses_bf16_attention())
        .collect()
}

/// Every path this CPU runs, with f32 attention arithmetic: what the 2e-6 tolerance holds
/// (the bf16 dot products have their own tests and tolerances, tests/attention_bf16.rs).
pub fn f32_attention_kernels() -> Vec<ossterm::kernels::Kernels> {
    ossterm::kernels::Kernels::all_supported()
        .into_iter()
        .map(|k| k.without_bf16_attention())
        .collect()
}

/// A block of `tokens` tokens at positions `depth..depth + tokens` over a cache of those
/// positions, KV head 1 of 2, each token seeing the keys of `window` (all if `None`) up to its own.
#[derive(Clone)]
pub struct Block {
    pub group: usize,
    pub head_dim: usize,
    pub tokens: usize,
    pub depth: usize,
    pub window: Option<usize>,
    pub token_stride: usize,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
    pub queries: Vec<f32>,
    pub sinks: Vec<f32>,
}

pub const KV_HEADS: usize = 2;
pub const HEAD: usize = 1;

impl Block {
    pub fn random(
        rng: &mut ChaCha8Rng,
        (group, head_dim): (usize, usize),
        tokens: usize,
        depth: usize,
        window: Option<usize>,
    ) -> Self {
        let rows = depth + tokens;
        let row_stride = KV_HEADS * head_dim;
        // Query rows 3 elements further apart than a group, as a model's rows of all heads are.
        let token_stride = group * head_dim + 3;
        let mut random = |n: usize, spread: f32| -> Vec<f32> {
            (0..n).map(|_| rng.gen_range(-spread..spread)).collect()
        };
        // f16-exact keys and values, so one reference serves both caches.
        let mut exact = |n: usize, spread: f32| -> Vec<f32> {
            random(n, spread)
                .into_iter()
                .map(|x| f16::from_f32(x).to_f32())
                .collect()
        };
        let keys = exact(rows * row_stride, 1.5);
        let values = exact(rows * row_stride, 2.0);
        let mut random = |n: usize, spread: f32| -> Vec<f32> {
            (0..n).map(|_| rng.gen_range(-spread..spread)).collect()
        };
        Self {
            group,
            head_dim,
            tokens,
            depth,
            window,
            token_stride,
            keys,
            values,
            queries: random(tokens * token_stride, 3.0),
            sinks: random(group, 3.0),
        }
    }

    pub fn visible(&self, t: usize) -> Range<usize> {
        let position = self.depth + t;
        let first = self.window.map_or(0, |w| (position + 1).saturating_sub(w));
        first..position + 1
    }

    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    pub fn query(&self) -> BlockQuery<'_> {
        BlockQuery {
            queries: &self.queries,
            token_stride: self.token_stride,
            tokens: self.tokens,
            sinks: &self.sinks,
            head_dim: self.head_dim,
            scale: self.scale(),
        }
    }

    pub fn kv<'a, T>(&self, keys: &'a [T], values: &'a [T]) -> KvHead<'a, T> {
        KvHead {
            keys,
            values,
            row_stride: KV_HEADS * self.head_dim,
            offset: HEAD * self.head_dim,
        }
    }

    pub fn run_block<T: KvElem>(&self, k: Kernels, keys: &[T], values: &[T]) -> Vec<f32> {
        let mut scratch = AttentionScratch::new(self.tokens * self.group, self.head_dim);
        // Garbage in the output must not leak into the result.
        let mut out = vec![f32::NAN; self.tokens * self.group * self.head_dim];
        let visible = |t: usize| self.visible(t);
        attend_block(
            k,
            &self.query(),
            &self.kv(keys, values),
            &visible,
            &mut out,
            &mut scratch,
        )
        .expect("valid shapes");
        out
    }

    /// Token by token through the one-token kernel.
    pub fn run_tokens<T: KvElem>(&self, k: Kernels, keys: &[T], values: &[T]) -> Vec<f32> {
        let (g, d) = (self.group, self.head_dim);
        let mut scratch = AttentionScratch::new(g, d);
        let mut out = vec![0.0; self.tokens * g * d];
        for (t, out) in out.chunks_exact_mut(g * d).enumerate() {
            let query = GroupQuery {
                queries: &self.queries[t * self.token_stride..][..g * d],
                sinks: &self.sinks,
                head_dim: d,
                scale: self.scale(),
            };
            let kv = self.kv(keys, values);
            attend_group(k, &query, &kv, self.visible(t), out, &mut scratch).expect("valid");
        }
        out
    }

    /// Straight from the formula, in f64, token by token.
    pub fn reference(&self) -> Vec<f64> {
        let (g, d) = (self.group, self.head_dim);
        let stride = KV_HEADS * d;
        let mut out = vec![0.0f64; self.tokens * g * d];
        for t in 0..self.tokens {
            for h in 0..g {
                let q = &self.queries[t * self.token_stride + h * d..][..d];
                let row = |cache: &[f32], j: usize| -> Vec<f64> {
                    cache[j * stride + HEAD * d..][..d]
                        .iter()
                        .map(|x| *x as f64)
                        .collect()
                };
                let logits: Vec<(usize, f64)> = self
                    .visible(t)
                    .map(|j| {
                        let dot: f64 = q
                            .iter()
                            .zip(row(&self.keys, j))
                            .map(|(a, b)| *a as f64 * b)
                            .sum();
                        (j, self.scale() as f64 * dot)
                    })
                    .collect();
                let sink = self.sinks[h] as f64;
                let max = logits.iter().fold(sink, |m, (_, l)| m.max(*l));
                let denominator =
                    (sink - max).exp() + logits.iter().map(|(_, l)| (l - max).exp()).sum::<f64>();
                let o = &mut out[(t * g + h) * d..][..d];
                for (j, l) in &logits {
                    let weight = (l - max).exp() / denominator;
                    for (o, v) in o.iter_mut().zip(row(&self.values, *j)) {
                        *o += weight * v;
                    }
                }
            }
        }
        out
    }

    pub fn magnitude(&self) -> f64 {
        self.values
            .iter()
            .fold(1e-3f64, |m, v| m.max(v.abs() as f64))
    }
}

/// The largest difference of `got` from `want` over `magnitude` (NaN counts as infinite).
pub fn worst(got: &[f32], want: &[f64], magnitude: f64) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            let error = (*g as f64 - w).abs() / magnitude;
            if error.is_nan() {
                f64::INFINITY
            } else {
                error
            }
        })
        .fold(0.0, f64::max)
}

/// (group, head_dim), tokens, depth, window.
pub type CaseShape = ((usize, usize), usize, usize, Option<usize>);

/// Ragged blocks for each (group, head_dim): depths off the tile, causal ends inside a tile,
/// windows whose edges split pairs and quads of keys, blocks of 1-17 tokens.
pub fn ragged_cases(shapes: &[(usize, usize)]) -> Vec<CaseShape> {
    let mut cases = Vec::new();
    for &shape in shapes {
        for (tokens, depth) in [
            (1, 0),
            (1, 1),
            (1, 62),
            (1, 63),
            (1, 64),
            (1, 130),
            (3, 61),
            (16, 0),
            (16, 48),
            (17, 100),
            (5, 300),
        ] {
            for window in [None, Some(7), Some(128)] {
                cases.push((shape, tokens, depth, window));
            }
        }
    }
    cases
}
