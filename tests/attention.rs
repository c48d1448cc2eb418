//! The grouped-query attention kernel: every path against an f64 reference and the SIMD paths
//! against the scalar one, on random data with ragged tiles, windows that do not start at 0,
//! f16 and f32 caches and extreme sinks; shape errors; the polynomial exp.
//!
//! Tolerance (tests/support/attention.rs): 2e-6 of the largest |value| of the head's visible value
//! rows.

use half::f16;
use ossterm::bench::attention::{
    bench_attention_with, bench_block_attention, bench_block_attention_q8, AttentionBenchConfig,
};
use ossterm::kernels::attention::{
    attend_group, fast_exp, AttentionError, AttentionScratch, GroupQuery, KvElem, KvHead, TILE_KEYS,
};
use ossterm::kernels::{KernelPath, Kernels};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod support;
use support::attention::{assert_close, f32_attention_kernels, widen};

fn scalar() -> Kernels {
    Kernels::new(KernelPath::Scalar).expect("scalar always runs")
}

fn simd_paths() -> Vec<Kernels> {
    f32_attention_kernels()
        .into_iter()
        .filter(|k| k.path() != KernelPath::Scalar)
        .collect()
}

/// One random attention problem: a cache of `rows` positions with `kv_heads` heads.
struct Case {
    group: usize,
    head_dim: usize,
    kv_heads: usize,
    head: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
    sinks: Vec<f32>,
    positions: std::ops::Range<usize>,
}

impl Case {
    fn random(
        rng: &mut ChaCha8Rng,
        group: usize,
        head_dim: usize,
        first: usize,
        count: usize,
        sink: Option<f32>,
    ) -> Self {
        let kv_heads = 3;
        let rows = first + count + rng.gen_range(0..3);
        let row_stride = kv_heads * head_dim;
        let mut random = |n: usize, spread: f32| -> Vec<f32> {
            (0..n).map(|_| rng.gen_range(-spread..spread)).collect()
        };
        // Queries large enough that the softmax is far from uniform (logits spread over ~+-10).
        let queries = random(group * head_dim, 3.0);
        let keys = random(rows * row_stride, 1.5);
        let values = random(rows * row_stride, 2.0);
        let sinks = match sink {
            Some(s) => vec![s; group],
            None => random(group, 3.0),
        };
        Self {
            group,
            head_dim,
            kv_heads,
            head: 1,
            keys,
            values,
            queries,
            sinks,
            positions: first..first + count,
        }
    }

    fn row_stride(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// Rounds the cache to f16 (the f64 reference then reads the rounded values too).
    fn round_to_f16(&mut self) -> (Vec<f16>, Vec<f16>) {
        let round = |v: &mut Vec<f32>| -> Vec<f16> {
            let h: Vec<f16> = v.iter().map(|x| f16::from_f32(*x)).collect();
            *v = h.iter().map(|x| x.to_f32()).collect();
            h
        };
        (round(&mut self.keys), round(&mut self.values))
    }

    /// Straight from the formula, in f64.
    fn reference(&self) -> Vec<f64> {
        let (d, stride) = (self.head_dim, self.row_stride());
        let offset = self.head * d;
        let scale = self.scale() as f64;
        let mut out = vec![0.0f64; self.group * d];
        for g in 0..self.group {
            let q = &self.queries[g * d..(g + 1) * d];
            let logits: Vec<f64> = self
                .positions
                .clone()
                .map(|j| {
                    let key = &self.keys[j * stride + offset..j * stride + offset + d];
                    scale
                        * q.iter()
                            .zip(key)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                })
                .collect();
            let sink = self.sinks[g] as f64;
            let max = logits.iter().copied().fold(sink, f64::max);
            let denominator =
                (sink - max).exp() + logits.iter().map(|l| (l - max).exp()).sum::<f64>();
            for (l, j) in logits.iter().zip(self.positions.clone()) {
                let weight = (l - max).exp() / denominator;
                let value = &self.values[j * stride + offset..j * stride + offset + d];
                for (o, v) in out[g * d..(g + 1) * d].iter_mut().zip(value) {
                    *o += weight * *v as f64;
                }
            }
        }
        out
    }

    fn run<T: KvElem>(
        &self,
        k: Kernels,
        keys: &[T],
        values: &[T],
        scratch: &mut AttentionScratch,
    ) -> Vec<f32> {
        let query = GroupQuery {
            queries: &self.queries,
            sinks: &self.sinks,
            head_dim: self.head_dim,
            scale: self.scale(),
        };
        let kv = KvHead {
            keys,
            values,
            row_stride: self.row_stride(),
            offset: self.head * self.head_dim,
        };
        // Garbage in the output must not leak into the result.
        let mut out = vec![f32::NAN; self.group * self.head_dim];
        attend_group(k, &query, &kv, self.positions.clone(), &mut out, scratch)
            .expect("valid shapes");
        out
    }

    /// Largest |value| of this head's visible value rows, floor 1e-3.
    fn value_magnitude(&self) -> f64 {
        let (d, stride) = (self.head_dim, self.row_stride());
        self.positions
            .clone()
            .flat_map(|j| self.values[j * stride + self.head * d..][..d].iter())
            .fold(1e-3f64, |m, v| m.max(v.abs() as f64))
    }
}

/// Every path, f16 and f32 caches, against the f64 reference and (SIMD) against scalar.
fn check_case(mut case: Case, label: &str) {
    let mut scratch = AttentionScratch::new(case.group, case.head_dim);
    let magnitude = case.value_magnitude();
    let want = case.reference();
    let mut f32_results = Vec::new();
    for k in f32_attention_kernels() {
        let got = case.run(k, &case.keys, &case.values, &mut scratch);
        assert_close(
            &format!("{label} f32 cache, {}", k.path()),
            &got,
            &want,
            magnitude,
        );
        f32_results.push((k.path(), got));
    }
    let (scalar_path, scalar_out) = &f32_results[0];
    assert_eq!(*scalar_path, KernelPath::Scalar);
    for (path, out) in &f32_results[1..] {
        assert_close(
            &format!("{label} f32 cache, {path} vs scalar"),
            out,
            &widen(scalar_out),
            magnitude,
        );
    }

    let (keys, values) = case.round_to_f16();
    let magnitude = case.value_magnitude();
    let want = case.reference();
    let scalar_out = case.run(scalar(), &keys, &values, &mut scratch);
    assert_close(
        &format!("{label} f16 cache, scalar"),
        &scalar_out,
        &want,
        magnitude,
    );
    for k in simd_paths() {
        let got = case.run(k, &keys, &values, &mut scratch);
        assert_close(
            &format!("{label} f16 cache, {}", k.path()),
            &got,
            &want,
            magnitude,
        );
        assert_close(
            &format!("{label} f16 cache, {} vs scalar", k.path()),
            &got,
            &widen(&scalar_out),
            magnitude,
        );
    }
}

#[test]
fn all_paths_match_the_reference_on_ragged_windows() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let counts = [
        1, 2, 7, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 200, 300,
    ];
    for group in [1, 2, 8] {
        for head_dim in [16, 32, 64] {
            for (i, &count) in counts.iter().enumerate() {
                let first = [0, 3, 50, 129][i % 4];
                let case = Case::random(&mut rng, group, head_dim, first, count, None);
                check_case(
                    case,
                    &format!("G={group} D={head_dim} keys {first}..{}", first + count),
                );
            }
        }
    }
}

#[test]
fn head_dims_that_are_not_multiples_of_sixteen() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (group, head_dim, count) in [
        (3, 8, 70),
        (8, 24, 65),
        (5, 40, 19),
        (2, 2, 9),
        (4, 100, 130),
    ] {
        let case = Case::random(&mut rng, group, head_dim, 5, count, None);
        check_case(case, &format!("G={group} D={head_dim} {count} keys"));
    }
}

#[test]
fn large_and_very_negative_sinks() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    for sink in [5.0, 20.0, -30.0, -1e4] {
        for (group, head_dim, count) in [(8, 64, 1), (8, 64, 150), (2, 32, 70)] {
            let case = Case::random(&mut rng, group, head_dim, 9, count, Some(sink));
            check_case(
                case,
                &format!("sink {sink} G={group} D={head_dim} {count} keys"),
            );
        }
    }
}

#[test]
fn a_sink_that_dominates_leaves_almost_nothing() {
    // Logits stay within about +-30 here, so a sink of 60 takes all but ~e^-30 of the weight.
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let case = Case::random(&mut rng, 8, 64, 0, 100, Some(60.0));
    let mut scratch = AttentionScratch::new(8, 64);
    for k in f32_attention_kernels() {
        let out = case.run(k, &case.keys, &case.values, &mut scratch);
        assert!(
            out.iter().all(|o| o.abs() < 1e-9),
            "{}: the sink should take the weight",
            k.path()
        );
    }
}

#[test]
fn empty_window_gives_zeros() {
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let case = Case::random(&mut rng, 8, 64, 4, 0, None);
    let mut scratch = AttentionScratch::new(8, 64);
    for k in f32_attention_kernels() {
        let out = case.run(k, &case.keys, &case.values, &mut scratch);
        assert!(out.iter().all(|o| *o == 0.0), "{}", k.path());
    }
}

#[test]
fn a_dominant_key_in_a_late_tile_rescales_earlier_tiles() {
    // One key far above the rest, in the third tile: the earlier tiles' accumulators must be
    // rescaled by exp(old max - new max), and the result is almost exactly that key's value.
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let mut case = Case::random(&mut rng, 2, 32, 0, 3 * TILE_KEYS, Some(-5.0));
    let (d, stride) = (case.head_dim, case.row_stride());
    let hot = 2 * TILE_KEYS + 5;
    let at = hot * stride + case.head * d;
    for i in 0..d {
        case.keys[at + i] = case.queries[i].signum() * 4.0;
    }
    check_case(case, "dominant late key");
}

#[test]
fn scratch_is_reused_across_shapes() {
    // A scratch sized for the largest shape, used by smaller ones in turn: stale tile contents
    // from a wider head_dim must not leak into a narrower one.
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    let mut scratch = AttentionScratch::new(8, 64);
    for (group, head_dim) in [(8, 64), (2, 24), (8, 64), (1, 16), (4, 40)] {
        let case = Case::random(&mut rng, group, head_dim, 1, 90, None);
        let want = case.reference();
        for k in f32_attention_kernels() {
            let got = case.run(k, &case.keys, &case.values, &mut scratch);
            assert_close(
                &format!("reused scratch G={group} D={head_dim} {}", k.path()),
                &got,
                &want,
                case.value_magnitude(),
            );
        }
    }
}

#[test]
fn bad_shapes_are_errors() {
    let (group, d, stride) = (2, 16, 32);
    let queries = vec![0.5f32; group * d];
    let sinks = vec![0.0f32; group];
    let cache = vec![0.25f32; 10 * stride];
    let mut out = vec![0.0f32; group * d];
    let mut scratch = AttentionScratch::new(group, d);
    let query = GroupQuery {
        queries: &queries,
        sinks: &sinks,
        head_dim: d,
        scale: 0.25,
    };
    let kv = KvHead {
        keys: &cache[..],
        values: &cache[..],
        row_stride: stride,
        offset: d,
    };
    for path in f32_attention_kernels() {
        let e = attend_group(path, &query, &kv, 0..11, &mut out, &mut scratch).unwrap_err();
        assert!(
            matches!(
                e,
                AttentionError::CacheTooShort {
                    operand: "key",
                    last: 10,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("key cache"), "{e}");
        let short_values = KvHead {
            values: &cache[..9 * stride],
            ..kv
        };
        let e =
            attend_group(path, &query, &short_values, 0..10, &mut out, &mut scratch).unwrap_err();
        assert!(
            matches!(
                e,
                AttentionError::CacheTooShort {
                    operand: "value",
                    ..
                }
            ),
            "{e}"
        );
        let outside = KvHead { offset: 17, ..kv };
        let e = attend_group(path, &query, &outside, 0..3, &mut out, &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::HeadOutsideRow { .. }), "{e}");
        let e = attend_group(path, &query, &kv, 0..3, &mut out[1..], &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::OutputLength { .. }), "{e}");
        let one_sink = GroupQuery {
            sinks: &sinks[..1],
            ..query
        };
        let e = attend_group(path, &one_sink, &kv, 0..3, &mut out, &mut scratch).unwrap_err();
        assert!(
            matches!(
                e,
                AttentionError::SinkCount {
                    expected: 2,
                    got: 1
                }
            ),
            "{e}"
        );
        let ragged = GroupQuery {
            queries: &queries[..d + 3],
            ..query
        };
        let e = attend_group(path, &ragged, &kv, 0..3, &mut out, &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::QueryLength { .. }), "{e}");
        let (start, end) = (5, 3);
        let e = attend_group(path, &query, &kv, start..end, &mut out, &mut scratch).unwrap_err();
        assert!(matches!(e, AttentionError::Positions { .. }), "{e}");
    }
    for k in f32_attention_kernels() {
        let mut small = AttentionScratch::new(1, d);
        let e = attend_group(k, &query, &kv, 0..3, &mut out, &mut small).unwrap_err();
        assert!(matches!(e, AttentionError::ScratchTooSmall { .. }), "{e}");
    }
}

#[test]
fn fast_exp_is_within_two_ulp_where_it_matters() {
    let mut x = -87.0f32;
    let mut worst = 0.0f64;
    while x <= 0.0 {
        let exact = (x as f64).exp();
        let got = fast_exp(x) as f64;
        let ulp = (exact as f32).to_bits();
        let ulp = f32::from_bits(ulp + 1) as f64 - f32::from_bits(ulp) as f64;
        worst = worst.max((got - exact).abs() / ulp);
        x += 0.000_37;
    }
    assert!(worst <= 2.0, "fast_exp is off by {worst} ulp");
    assert_eq!(fast_exp(0.0), 1.0);
    assert_eq!(fast_exp(-87.5), 0.0);
    assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
    assert_eq!(fast_exp(f32::NAN), 0.0);
}

#[test]
fn benchmark_agrees_with_the_per_key_loop() {
    for k in f32_attention_kernels() {
        let report = bench_attention_with(k, &AttentionBenchConfig::quick())
            .unwrap_or_else(|e| panic!("{}: {e}", k.path()));
        assert_eq!(report.rows.len(), 2);
        let row = bench_block_attention(k, &AttentionBenchConfig::quick(), 5, 70)
            .unwrap_or_else(|e| panic!("{}: {e}", k.path()));
        assert!(row.block_ns > 0.0 && row.per_token_ns > 0.0, "{row}");
        // The int8 kernel's benchmark checks its block against its tokens too.
        let with_int8 = Kernels::new(k.path()).expect("supported");
        let row = bench_block_attention_q8(with_int8, &AttentionBenchConfig::quick(), 5, 70)
            .unwrap_or_else(|e| panic!("{}: {e}", k.path()));
        assert_eq!(row.is_some(), with_int8.uses_int8_attention());
        for row in &report.rows {
            assert!(
                row.tiled_best_ns.is_finite() && row.tiled_best_ns > 0.0,
                "{report}"
            );
            assert!(
                row.per_key_best_ns.is_finite() && row.per_key_best_ns > 0.0,
                "{report}"
            );
        }
    }
}

/// The standard measurement (G=8, D=64, 128 and 4096 keys); run with
/// `cargo test --release --test attention -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: a few seconds, prints its report"]
fn benchmark_report() {
    let kernels = Kernels::all_supported().into_iter().flat_map(|k| {
        let bf16 = k.with_bf16_attention();
        if bf16.uses_bf16_attention() {
            vec![k.without_bf16_attention(), bf16]
        } else {
            vec![k.without_bf16_attention()]
        }
    });
    for k in kernels {
        let arithmetic = match (k.uses_bf16_attention(), k.uses_amx_attention()) {
            (true, true) => "bf16 tile products (AMX)",
            (true, false) => "bf16 dot products",
            _ => "f32",
        };
        println!("attention arithmetic: {arithmetic}");
        let report = ossterm::bench::attention::bench_attention(k).expect("benchmark");
        println!("{report}");
        let config = AttentionBenchConfig {
            repetitions: 15,
            ..AttentionBenchConfig::standard()
        };
        for (tokens, depth) in [(1, 4096), (16, 128), (16, 4096), (32, 4096)] {
            let row = bench_block_attention(k, &config, tokens, depth).expect("benchmark");
            println!("{row}");
        }
    }
    for k in Kernels::all_supported() {
        let config = AttentionBenchConfig {
            repetitions: 15,
            ..AttentionBenchConfig::standard()
        };
        for (tokens, depth) in [(1, 4096), (16, 128), (16, 4096), (32, 4096)] {
            if let Some(row) = bench_block_attention_q8(k, &config, tokens, depth).expect("bench") {
                println!("int8 cache, int8 dot products ({}): {row}", k.path());
            }
        }
    }
}
