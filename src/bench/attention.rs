//! The attention benchmark: the tiled kernel against the per-key loop it replaced, on random data
//! of the gpt-oss-20b shape.

use std::fmt;
use std::time::Duration;

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::kernels::time_runs;
use crate::kernels::attention::{
    attend_block, attend_block_q8, attend_group, runs_int8, AttentionError, AttentionScratch,
    BlockQuery, GroupQuery, KvHead, Q8KvHead,
};
use crate::kernels::{KernelPath, Kernels};
use crate::model::kv::quantize_row_q8;

/// What [`bench_attention_with`] measures.
#[derive(Clone, Debug)]
pub struct AttentionBenchConfig {
    /// Key counts (context depths) to measure.
    pub depths: Vec<usize>,
    /// Query heads per KV head.
    pub group: usize,
    pub head_dim: usize,
    /// KV heads in a cache row; one measured call covers all of them, as a decoded token does.
    pub kv_heads: usize,
    /// Timed runs per measurement; the report gives the best and the median.
    pub repetitions: usize,
    /// Each timed run repeats the work until it lasts at least this long.
    pub min_run_time: Duration,
}

impl AttentionBenchConfig {
    /// gpt-oss-20b: 8 query heads per KV head, head_dim 64, 8 KV heads; a sliding window (128 keys)
    /// and a full layer at depth 4096.
    pub fn standard() -> Self {
        Self {
            depths: vec![128, 4096],
            group: 8,
            head_dim: 64,
            kv_heads: 8,
            repetitions: 5,
            min_run_time: Duration::from_millis(30),
        }
    }

    /// A shape small enough for tests.
    pub fn quick() -> Self {
        Self {
            depths: vec![5, 100],
            group: 8,
            head_dim: 64,
            kv_heads: 2,
            repetitions: 2,
            min_run_time: Duration::from_micros(200),
        }
    }
}

/// One context depth: nanoseconds per (query head, key), best and median of the runs.
#[derive(Clone, Debug)]
pub struct AttentionBenchRow {
    pub keys: usize,
    pub tiled_best_ns: f64,
    pub tiled_median_ns: f64,
    /// The per-key loop the forward pass used before this kernel: per key and head one
    /// `dot_f16`, a scalar online-softmax step and one `axpy_f16`.
    pub per_key_best_ns: f64,
    pub per_key_median_ns: f64,
}

/// All depths of one run (f16 cache, one thread).
#[derive(Clone, Debug)]
pub struct AttentionBenchReport {
    pub path: KernelPath,
    pub group: usize,
    pub head_dim: usize,
    pub rows: Vec<AttentionBenchRow>,
}

impl fmt::Display for AttentionBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "attention, kernel path {}, {} query heads per KV head, head_dim {}, f16 cache, one \
             thread; ns per (query head, key)",
            self.path, self.group, self.head_dim
        )?;
        writeln!(
            f,
            "{:>6} {:>11} {:>11} {:>13} {:>13} {:>8}",
            "keys", "tiled best", "tiled med", "per-key best", "per-key med", "speedup"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:>6} {:>11.2} {:>11.2} {:>13.2} {:>13.2} {:>7.1}x",
                r.keys,
                r.tiled_best_ns,
                r.tiled_median_ns,
                r.per_key_best_ns,
                r.per_key_median_ns,
                r.per_key_best_ns / r.tiled_best_ns
            )?;
        }
        Ok(())
    }
}

/// [`bench_attention_with`] on the standard gpt-oss-20b shape.
pub fn bench_attention(k: Kernels) -> Result<AttentionBenchReport, AttentionError> {
    bench_attention_with(k, &AttentionBenchConfig::standard())
}

/// Time [`attend_group`] against the per-key loop on random data (an f16 cache of the deepest
/// depth, all KV heads of one token per run), after checking that both give the same result.
pub fn bench_attention_with(
    k: Kernels,
    config: &AttentionBenchConfig,
) -> Result<AttentionBenchReport, AttentionError> {
    let (group, d, kv_heads) = (config.group, config.head_dim, config.kv_heads.max(1));
    let row_stride = kv_heads * d;
    let depth = config.depths.iter().copied().max().unwrap_or(1).max(1);
    let mut rng = ChaCha8Rng::seed_from_u64(0xa77e);
    let keys = random_f16(&mut rng, depth * row_stride);
    let values = random_f16(&mut rng, depth * row_stride);
    let queries = random(&mut rng, kv_heads * group * d, 1.0);
    let sinks = random(&mut rng, kv_heads * group, 2.0);
    let scale = 1.0 / (d as f32).sqrt();
    let mut scratch = AttentionScratch::new(group, d);
    let mut tiled_out = vec![0.0f32; kv_heads * group * d];
    let mut per_key_out = vec![0.0f32; kv_heads * group * d];
    let mut per_key_state = vec![(0.0f32, 0.0f32); group];

    let mut rows = Vec::with_capacity(config.depths.len());
    for &keys_visible in &config.depths {
        let positions = depth - keys_visible.min(depth)..depth;
        let mut tiled = || -> Result<(), AttentionError> {
            for h in 0..kv_heads {
                let query = GroupQuery {
                    queries: &queries[h * group * d..(h + 1) * group * d],
                    sinks: &sinks[h * group..(h + 1) * group],
                    head_dim: d,
                    scale,
                };
                let kv = KvHead {
                    keys: &keys,
                    values: &values,
                    row_stride,
                    offset: h * d,
                };
                let out = &mut tiled_out[h * group * d..(h + 1) * group * d];
                attend_group(k, &query, &kv, positions.clone(), out, &mut scratch)?;
            }
            Ok(())
        };
        tiled()?;
        let (tiled_best, tiled_median) =
            time_runs(config.repetitions, config.min_run_time, &mut tiled)?;

        let mut per_key = || -> Result<(), AttentionError> {
            for h in 0..kv_heads {
                let q = &queries[h * group * d..(h + 1) * group * d];
                let out = &mut per_key_out[h * group * d..(h + 1) * group * d];
                out.fill(0.0);
                for (g, state) in per_key_state.iter_mut().enumerate() {
                    *state = (sinks[h * group + g], 0.0);
                }
                for j in positions.clone() {
                    let at = j * row_stride + h * d;
                    let (key, value) = (&keys[at..at + d], &values[at..at + d]);
                    for (g, (max, sum)) in per_key_state.iter_mut().enumerate() {
                        let logit = k.dot_f16(&q[g * d..(g + 1) * d], key)? * scale;
                        let acc = &mut out[g * d..(g + 1) * d];
                        if logit > *max {
                            let rescale = (*max - logit).exp();
                            *sum *= rescale;
                            acc.iter_mut().for_each(|o| *o *= rescale);
                            *max = logit;
                        }
                        let weight = (logit - *max).exp();
                        *sum += weight;
                        k.axpy_f16(weight, value, acc)?;
                    }
                }
                for (g, (max, sum)) in per_key_state.iter().enumerate() {
                    let denominator = sum + (sinks[h * group + g] - max).exp();
                    out[g * d..(g + 1) * d]
                        .iter_mut()
                        .for_each(|o| *o /= denominator);
                }
            }
            Ok(())
        };
        per_key()?;
        let (per_key_best, per_key_median) =
            time_runs(config.repetitions, config.min_run_time, &mut per_key)?;

        // The f32 kernel agrees with the f32 loop element by element; bf16 dot products keep 8
        // bits, so theirs is measured against the values' magnitude (1 here), with the bound
        // tests/attention_bf16.rs holds them to.
        let (floor, bound) = if k.uses_bf16_attention() {
            (1.0, 2e-2)
        } else {
            (1e-3, 1e-3)
        };
        let difference = tiled_out
            .iter()
            .zip(&per_key_out)
            .map(|(a, b)| (a - b).abs() / b.abs().max(floor))
            .fold(0.0f32, f32::max);
        if difference.is_nan() || difference > bound {
            return Err(AttentionError::BenchMismatch {
                keys: keys_visible,
                difference,
            });
        }
        let per_pair = 1e9 / (kv_heads * group * positions.len().max(1)) as f64;
        rows.push(AttentionBenchRow {
            keys: positions.len(),
            tiled_best_ns: tiled_best * per_pair,
            tiled_median_ns: tiled_median * per_pair,
            per_key_best_ns: per_key_best * per_pair,
            per_key_median_ns: per_key_median * per_pair,
        });
    }
    Ok(AttentionBenchReport {
        path: k.path(),
        group,
        head_dim: d,
        rows,
    })
}

/// A prefill block at depth: `tokens` consecutive tokens whose causal ranges end at `depth + 1 ..
/// depth + tokens`, each (query head, key) pair once, token by token ([`attend_group`], how
/// prefill ran before blocks) against [`attend_block`]; f16 cache, one KV head, one thread.
#[derive(Clone, Debug)]
pub struct BlockBenchRow {
    pub tokens: usize,
    pub depth: usize,
    /// Nanoseconds per (query head, key), best of the runs: on a shared machine the best run is
    /// the one least disturbed by other processes.
    pub per_token_ns: f64,
    pub block_ns: f64,
}

impl fmt::Display for BlockBenchRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "block of {:>3} tokens at depth {:>5}: {:>6.3} ns per (query head, key) token by token, \
             {:>6.3} as a block ({:.2}x)",
            self.tokens,
            self.depth,
            self.per_token_ns,
            self.block_ns,
            self.per_token_ns / self.block_ns
        )
    }
}

/// Times one [`BlockBenchRow`] (G = `config.group`, head_dim `config.head_dim`), after checking
/// that both ways give the same bits.
pub fn bench_block_attention(
    k: Kernels,
    config: &AttentionBenchConfig,
    tokens: usize,
    depth: usize,
) -> Result<BlockBenchRow, AttentionError> {
    let (group, d) = (config.group, config.head_dim);
    let tokens = tokens.max(1);
    let rows = depth + tokens;
    let mut rng = ChaCha8Rng::seed_from_u64(0xb10c);
    let keys = random_f16(&mut rng, rows * d);
    let values = random_f16(&mut rng, rows * d);
    let (queries, sinks) = random_block(&mut rng, tokens, group, d);
    let block = block_query(&queries, &sinks, tokens, d);
    let kv = KvHead {
        keys: &keys,
        values: &values,
        row_stride: d,
        offset: 0,
    };
    let visible = |t: usize| 0..depth + t + 1;
    time_block_and_tokens(
        config,
        (tokens, depth),
        |out, scratch| attend_block(k, &block, &kv, &visible, out, scratch),
        |t, out, scratch| {
            let query = GroupQuery {
                queries: &queries[t * group * d..(t + 1) * group * d],
                sinks: &sinks,
                head_dim: d,
                scale: block.scale,
            };
            attend_group(k, &query, &kv, visible(t), out, scratch)
        },
    )
}

/// The random queries (`tokens` x `group` rows of `d`) and sinks the block rows time.
fn random_block(
    rng: &mut ChaCha8Rng,
    tokens: usize,
    group: usize,
    d: usize,
) -> (Vec<f32>, Vec<f32>) {
    (
        random(rng, tokens * group * d, 1.0),
        random(rng, group, 2.0),
    )
}

/// `queries` (tokens x heads rows of `d`) with `sinks` as one block, scaled by 1/sqrt(d).
fn block_query<'a>(
    queries: &'a [f32],
    sinks: &'a [f32],
    tokens: usize,
    d: usize,
) -> BlockQuery<'a> {
    BlockQuery {
        queries,
        token_stride: sinks.len() * d,
        tokens,
        sinks,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
    }
}

/// Times `as_block` (the whole block into the output) and `token` (token t alone into its
/// rows), each on its own scratch, after a first run of each; a token's result does not depend
/// on the block it is in (the kernels' tiles sit at fixed rows), so the two outputs must agree
/// to the bit ([`block_row`]).
fn time_block_and_tokens(
    config: &AttentionBenchConfig,
    (tokens, depth): (usize, usize),
    mut as_block: impl FnMut(&mut [f32], &mut AttentionScratch) -> Result<(), AttentionError>,
    mut token: impl FnMut(usize, &mut [f32], &mut AttentionScratch) -> Result<(), AttentionError>,
) -> Result<BlockBenchRow, AttentionError> {
    let (group, d) = (config.group, config.head_dim);
    let mut block_scratch = AttentionScratch::new(tokens * group, d);
    let mut token_scratch = AttentionScratch::new(group, d);
    let mut block_out = vec![0.0f32; tokens * group * d];
    let mut token_out = vec![0.0f32; tokens * group * d];
    let mut whole = || as_block(&mut block_out, &mut block_scratch);
    whole()?;
    let (block_best, _) = time_runs(config.repetitions, config.min_run_time, &mut whole)?;
    let mut by_token = || -> Result<(), AttentionError> {
        for (t, out) in token_out.chunks_exact_mut(group * d).enumerate() {
            token(t, out, &mut token_scratch)?;
        }
        Ok(())
    };
    by_token()?;
    let (token_best, _) = time_runs(config.repetitions, config.min_run_time, &mut by_token)?;
    block_row(
        (tokens, depth, group),
        (block_best, token_best),
        &block_out,
        &token_out,
    )
}

/// The row of a block of `tokens` at `depth` (G = `group`) timed as a block and token by token,
/// after checking that both ways gave the same bits.
fn block_row(
    (tokens, depth, group): (usize, usize, usize),
    (block_best, token_best): (f64, f64),
    block_out: &[f32],
    token_out: &[f32],
) -> Result<BlockBenchRow, AttentionError> {
    let pairs = || block_out.iter().zip(token_out);
    if pairs().any(|(a, b)| a.to_bits() != b.to_bits()) {
        let difference = pairs()
            .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
            .fold(0.0f32, f32::max);
        return Err(AttentionError::BenchMismatch {
            keys: depth,
            difference,
        });
    }
    let keys_seen = tokens * (depth + 1) + tokens * (tokens - 1) / 2;
    let per_pair = 1e9 / (group * keys_seen) as f64;
    Ok(BlockBenchRow {
        tokens,
        depth,
        per_token_ns: token_best * per_pair,
        block_ns: block_best * per_pair,
    })
}

/// [`bench_block_attention`] over an int8 cache with int8 dot products ([`attend_block_q8`]):
/// the same random data, its rows quantized as the int8 cache stores them. `None` where these
/// kernels do not run int8 attention ([`runs_int8`]).
pub fn bench_block_attention_q8(
    k: Kernels,
    config: &AttentionBenchConfig,
    tokens: usize,
    depth: usize,
) -> Result<Option<BlockBenchRow>, AttentionError> {
    let (group, d) = (config.group, config.head_dim);
    if !runs_int8(k, d) {
        return Ok(None);
    }
    let tokens = tokens.max(1);
    let rows = depth + tokens;
    let mut rng = ChaCha8Rng::seed_from_u64(0xb10c);
    let quantized = |rng: &mut ChaCha8Rng| {
        let mut bytes = vec![0i8; rows * d];
        let scales: Vec<f32> = bytes
            .chunks_exact_mut(d)
            .map(|row| quantize_row_q8(&random(rng, d, 1.0), row))
            .collect();
        (bytes, scales)
    };
    let (keys, key_scales) = quantized(&mut rng);
    let (values, value_scales) = quantized(&mut rng);
    let (queries, sinks) = random_block(&mut rng, tokens, group, d);
    let block = block_query(&queries, &sinks, tokens, d);
    let kv = Q8KvHead {
        keys: &keys,
        key_scales: &key_scales,
        values: &values,
        value_scales: &value_scales,
    };
    let visible = |t: usize| 0..depth + t + 1;
    time_block_and_tokens(
        config,
        (tokens, depth),
        |out, scratch| attend_block_q8(k, &block, &kv, &visible, out, scratch),
        |t, out, scratch| {
            let one = BlockQuery {
                queries: &queries[t * group * d..(t + 1) * group * d],
                tokens: 1,
                ..block
            };
            let seen = visible(t);
            attend_block_q8(k, &one, &kv, &|_| seen.clone(), out, scratch)
        },
    )
    .map(Some)
}

/// `n` values uniform in (-spread, spread).
fn random(rng: &mut ChaCha8Rng, n: usize, spread: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-spread..spread)).collect()
}

/// `n` cache elements uniform in (-1, 1), rounded to f16.
fn random_f16(rng: &mut ChaCha8Rng, n: usize) -> Vec<f16> {
    random(rng, n, 1.0).into_iter().map(f16::from_f32).collect()
}
