//! Attention on bf16 dot products (`Kernels::uses_bf16_attention`, AVX-512 BF16 where it pays):
//! the SIMD kernel against its plain reference (`attend_block_bf16_reference`) and both against
//! an f64 reference, over ragged blocks (depths off the tile, causal ends inside a tile, windows
//! whose edges split a pair of keys, blocks of 1-17 tokens); every token bit for bit the same
//! alone as in its block; value rows before the window never read; head dims the path does not
//! take run the f32 path exactly.
//!
//! Tolerances (of the largest |value| in the cache): the kernel within 3e-3 of its reference
//! (probabilities are rounded to bf16 against each tile's running maximum rather than the
//! final one; measured up to about 1e-3), both within 2e-2 of the exact result (bf16 keeps 8
//! bits: queries, keys, values and probabilities each carry up to 2^-9 relative error; measured
//! up to about 6e-3). A kernel that paired the wrong keys or columns misses by far more.

use std::ops::Range;

use half::f16;
use ossterm::kernels::attention::{
    attend_block, attend_block_bf16_reference, attend_group, AttentionScratch, BlockQuery,
    GroupQuery, KvHead,
};
use ossterm::kernels::Kernels;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const KERNEL_TOLERANCE: f64 = 3e-3;
const EXACT_TOLERANCE: f64 = 2e-2;
const KV_HEADS: usize = 2;
const HEAD: usize = 1;

/// The kernels with bf16 attention, if this CPU runs it.
fn bf16_kernels() -> Option<Kernels> {
    Kernels::all_supported()
        .into_iter()
        .find(|k| k.uses_bf16_attention())
}

struct Block {
    group: usize,
    head_dim: usize,
    tokens: usize,
    depth: usize,
    window: Option<usize>,
    token_stride: usize,
    keys: Vec<f16>,
    values: Vec<f16>,
    queries: Vec<f32>,
    sinks: Vec<f32>,
}

impl Block {
    fn random(
        rng: &mut ChaCha8Rng,
        (group, head_dim): (usize, usize),
        tokens: usize,
        depth: usize,
        window: Option<usize>,
    ) -> Self {
        let rows = depth + tokens;
        let row_stride = KV_HEADS * head_dim;
        let token_stride = group * head_dim + 3;
        let mut cache = |n: usize, spread: f32| -> Vec<f16> {
            (0..n)
                .map(|_| f16::from_f32(rng.gen_range(-spread..spread)))
                .collect()
        };
        let keys = cache(rows * row_stride, 1.5);
        let values = cache(rows * row_stride, 2.0);
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

    fn visible(&self, t: usize) -> Range<usize> {
        let position = self.depth + t;
        let first = self.window.map_or(0, |w| (position + 1).saturating_sub(w));
        first..position + 1
    }

    fn query(&self) -> BlockQuery<'_> {
        BlockQuery {
            queries: &self.queries,
            token_stride: self.token_stride,
            tokens: self.tokens,
            sinks: &self.sinks,
            head_dim: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    fn kv<'a>(&self, keys: &'a [f16], values: &'a [f16]) -> KvHead<'a, f16> {
        KvHead {
            keys,
            values,
            row_stride: KV_HEADS * self.head_dim,
            offset: HEAD * self.head_dim,
        }
    }

    fn outputs(&self) -> usize {
        self.tokens * self.group * self.head_dim
    }

    fn run_block(&self, k: Kernels, values: &[f16]) -> Vec<f32> {
        let mut scratch = AttentionScratch::new(self.tokens * self.group, self.head_dim);
        let mut out = vec![f32::NAN; self.outputs()];
        let visible = |t: usize| self.visible(t);
        let kv = self.kv(&self.keys, values);
        attend_block(k, &self.query(), &kv, &visible, &mut out, &mut scratch).expect("valid");
        out
    }

    fn run_tokens(&self, k: Kernels) -> Vec<f32> {
        let (g, d) = (self.group, self.head_dim);
        let mut scratch = AttentionScratch::new(g, d);
        let mut out = vec![0.0; self.outputs()];
        for (t, out) in out.chunks_exact_mut(g * d).enumerate() {
            let query = GroupQuery {
                queries: &self.queries[t * self.token_stride..][..g * d],
                sinks: &self.sinks,
                head_dim: d,
                scale: self.query().scale,
            };
            let kv = self.kv(&self.keys, &self.values);
            attend_group(k, &query, &kv, self.visible(t), out, &mut scratch).expect("valid");
        }
        out
    }

    fn bf16_reference(&self) -> Vec<f32> {
        let mut out = vec![f32::NAN; self.outputs()];
        let visible = |t: usize| self.visible(t);
        let kv = self.kv(&self.keys, &self.values);
        attend_block_bf16_reference(&self.query(), &kv, &visible, &mut out).expect("valid");
        out
    }

    /// Straight from the formula, in f64.
    fn exact(&self) -> Vec<f64> {
        let (g, d) = (self.group, self.head_dim);
        let stride = KV_HEADS * d;
        let row = |cache: &[f16], j: usize| -> Vec<f64> {
            cache[j * stride + HEAD * d..][..d]
                .iter()
                .map(|x| x.to_f64())
                .collect()
        };
        let mut out = vec![0.0f64; self.outputs()];
        for t in 0..self.tokens {
            for h in 0..g {
                let q = &self.queries[t * self.token_stride + h * d..][..d];
                let logits: Vec<(usize, f64)> = self
                    .visible(t)
                    .map(|j| {
                        let dot: f64 = q
                            .iter()
                            .zip(row(&self.keys, j))
                            .map(|(a, b)| *a as f64 * b)
                            .sum();
                        (j, dot / (d as f64).sqrt())
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

    fn magnitude(&self) -> f64 {
        self.values
            .iter()
            .fold(1e-3f64, |m, v| m.max(v.to_f64().abs()))
    }
}

/// The largest difference over `magnitude`.
fn worst(got: &[f32], want: &[f64], magnitude: f64) -> f64 {
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

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

/// (group, head_dim), tokens, depth, window.
type CaseShape = ((usize, usize), usize, usize, Option<usize>);

fn cases() -> Vec<CaseShape> {
    let mut cases = Vec::new();
    for shape in [(8, 64), (3, 32), (2, 96)] {
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

#[test]
fn the_reference_stays_near_the_exact_result() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xbf16);
    let mut largest = 0.0f64;
    for (shape, tokens, depth, window) in cases() {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let error = worst(&block.bf16_reference(), &block.exact(), block.magnitude());
        largest = largest.max(error);
        assert!(
            error <= EXACT_TOLERANCE,
            "{shape:?} {tokens} tokens at {depth}, window {window:?}: {error:e}"
        );
    }
    println!("bf16 reference against exact: worst {largest:e}");
}

#[test]
fn the_kernel_matches_its_reference_and_is_the_same_alone_as_in_a_block() {
    let Some(k) = bf16_kernels() else {
        println!("this CPU runs no bf16 attention (no AVX-512 BF16, or vdpbf16ps does not pay)");
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let (mut to_reference, mut to_exact) = (0.0f64, 0.0f64);
    for (shape, tokens, depth, window) in cases() {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let label = format!("{shape:?} {tokens} tokens at {depth}, window {window:?}");
        let got = block.run_block(k, &block.values);
        let magnitude = block.magnitude();
        let error = worst(&got, &widen(&block.bf16_reference()), magnitude);
        to_reference = to_reference.max(error);
        assert!(
            error <= KERNEL_TOLERANCE,
            "{label}: {error:e} from the reference"
        );
        let error = worst(&got, &block.exact(), magnitude);
        to_exact = to_exact.max(error);
        assert!(error <= EXACT_TOLERANCE, "{label}: {error:e} from exact");
        let alone = block.run_tokens(k);
        let same = got
            .iter()
            .zip(&alone)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{label}: a token alone differs from the block");
    }
    println!("bf16 kernel: worst {to_reference:e} from its reference, {to_exact:e} from exact");
}

#[test]
fn the_kernel_is_not_the_f32_path() {
    let Some(k) = bf16_kernels() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let block = Block::random(&mut rng, (8, 64), 16, 200, None);
    let bf16 = block.run_block(k, &block.values);
    let f32_path = block.run_block(k.without_bf16_attention(), &block.values);
    let differ = bf16
        .iter()
        .zip(&f32_path)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert!(
        differ > bf16.len() / 2,
        "only {differ} of {} outputs differ",
        bf16.len()
    );
}

#[test]
fn value_rows_before_the_window_are_never_read() {
    let Some(k) = bf16_kernels() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    // Windows starting at odd and even rows, so the first pair of keys is split or whole.
    for window in [7, 8, 33, 64] {
        let block = Block::random(&mut rng, (8, 64), 4, 150, Some(window));
        let first = block.visible(0).start;
        let mut values = block.values.clone();
        let stride = KV_HEADS * block.head_dim;
        for v in &mut values[..first * stride] {
            *v = f16::NAN;
        }
        let poisoned = block.run_block(k, &values);
        let clean = block.run_block(k, &block.values);
        assert!(
            poisoned
                .iter()
                .zip(&clean)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "window {window}: rows before the window changed the result"
        );
    }
}

#[test]
fn head_dims_the_path_does_not_take_run_in_f32() {
    let Some(k) = bf16_kernels() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let block = Block::random(&mut rng, (4, 48), 5, 70, None);
    let got = block.run_block(k, &block.values);
    let f32_path = block.run_block(k.without_bf16_attention(), &block.values);
    assert!(got
        .iter()
        .zip(&f32_path)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}
