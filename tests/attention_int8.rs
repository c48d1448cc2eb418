//! Attention on int8 dot products over an int8 cache (`Kernels::uses_int8_attention`, the
//! AVX-512 path): the SIMD kernel against its plain reference (`attend_block_q8_reference`) and
//! both against an f64 reference over the dequantized cache, over ragged blocks (depths off the
//! tile, causal ends inside a tile, windows whose edges split a quad of keys, blocks of 1-17
//! tokens); every token bit for bit the same alone as in its block; rows before a window (NaN
//! scales) never reach a result. The model-level accuracy (top-1 against the exact path with the
//! int8 cache) is tests/fast_path.rs's.
//!
//! Tolerances (of the largest |value| in the cache): the kernel within 5e-3 of its reference (the
//! kernel's softmax is online, the reference's two-pass, and its exponential a polynomial: a
//! probability byte can round the other way, which moves an output by up to 1/255 of the tile's
//! share; measured: 2.4e-7, no byte rounded differently); both within 3e-2 of the exact result
//! over the dequantized cache (queries carry up to 2^-8 relative error, probabilities 1/510 of
//! their tile's largest; measured: 1.1e-2). A kernel that paired the wrong keys or columns misses by far more.

use ossterm::kernels::attention::{
    attend_block_q8, attend_block_q8_reference, runs_int8, AttentionScratch, GroupQuery, Q8KvHead,
};
use ossterm::kernels::Kernels;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

mod support;
use support::attention::{ragged_cases, worst, Block, HEAD, KV_HEADS};

const KERNEL_TOLERANCE: f64 = 5e-3;
const EXACT_TOLERANCE: f64 = 3e-2;

/// The AVX-512 kernels with int8 attention, if this CPU runs them.
fn int8_kernels() -> Option<Kernels> {
    Kernels::all_supported()
        .into_iter()
        .find(|k| k.uses_int8_attention())
}

/// One head's rows of the block's cache as int8 rows with a scale each (`max |x| / 127`, as the
/// model's int8 cache stores them).
struct Q8Cache {
    keys: Vec<i8>,
    key_scales: Vec<f32>,
    values: Vec<i8>,
    value_scales: Vec<f32>,
}

fn quantize(cache: &[f32], d: usize) -> (Vec<i8>, Vec<f32>) {
    let (mut rows, mut scales) = (Vec::new(), Vec::new());
    for row in cache.chunks_exact(KV_HEADS * d) {
        let row = &row[HEAD * d..][..d];
        let largest = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let scale = largest / 127.0;
        scales.push(scale);
        rows.extend(row.iter().map(|x| {
            if scale == 0.0 {
                0
            } else {
                (x / scale).round() as i8
            }
        }));
    }
    (rows, scales)
}

impl Q8Cache {
    fn of(block: &Block) -> Self {
        let (keys, key_scales) = quantize(&block.keys, block.head_dim);
        let (values, value_scales) = quantize(&block.values, block.head_dim);
        Self {
            keys,
            key_scales,
            values,
            value_scales,
        }
    }

    fn head(&self) -> Q8KvHead<'_> {
        Q8KvHead {
            keys: &self.keys,
            key_scales: &self.key_scales,
            values: &self.values,
            value_scales: &self.value_scales,
        }
    }

    /// The block with its cache's head rows replaced by what this cache holds: the exact result
    /// the int8 arithmetic approximates.
    fn dequantized(&self, block: &Block) -> Block {
        let d = block.head_dim;
        let mut exact = block.clone();
        for (cache, rows, scales) in [
            (&mut exact.keys, &self.keys, &self.key_scales),
            (&mut exact.values, &self.values, &self.value_scales),
        ] {
            for (j, row) in cache.chunks_exact_mut(KV_HEADS * d).enumerate() {
                for (x, q) in row[HEAD * d..][..d].iter_mut().zip(&rows[j * d..][..d]) {
                    *x = *q as f32 * scales[j];
                }
            }
        }
        exact
    }
}

fn run_block(k: Kernels, block: &Block, cache: &Q8Cache) -> Vec<f32> {
    let mut scratch = AttentionScratch::new(block.tokens * block.group, block.head_dim);
    // Garbage in the output must not leak into the result.
    let mut out = vec![f32::NAN; block.tokens * block.group * block.head_dim];
    let visible = |t: usize| block.visible(t);
    attend_block_q8(
        k,
        &block.query(),
        &cache.head(),
        &visible,
        &mut out,
        &mut scratch,
    )
    .expect("valid shapes");
    out
}

/// Token by token, each a block of one.
fn run_tokens(k: Kernels, block: &Block, cache: &Q8Cache) -> Vec<f32> {
    let (g, d) = (block.group, block.head_dim);
    let mut scratch = AttentionScratch::new(g, d);
    let mut out = vec![0.0; block.tokens * g * d];
    for (t, out) in out.chunks_exact_mut(g * d).enumerate() {
        let one = GroupQuery {
            queries: &block.queries[t * block.token_stride..][..g * d],
            sinks: &block.sinks,
            head_dim: d,
            scale: block.scale(),
        };
        let query = ossterm::kernels::attention::BlockQuery {
            queries: one.queries,
            token_stride: g * d,
            tokens: 1,
            sinks: one.sinks,
            head_dim: d,
            scale: one.scale,
        };
        let seen = block.visible(t);
        let visible = |_: usize| seen.clone();
        attend_block_q8(k, &query, &cache.head(), &visible, out, &mut scratch).expect("valid");
    }
    out
}

fn reference(block: &Block, cache: &Q8Cache) -> Vec<f32> {
    let mut out = vec![f32::NAN; block.tokens * block.group * block.head_dim];
    let visible = |t: usize| block.visible(t);
    attend_block_q8_reference(&block.query(), &cache.head(), &visible, &mut out).expect("valid");
    out
}

#[test]
fn the_reference_stays_near_the_exact_result() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x1a8);
    let mut largest = 0.0f64;
    for (shape, tokens, depth, window) in ragged_cases(&[(8, 64), (3, 128)]) {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let cache = Q8Cache::of(&block);
        let exact = cache.dequantized(&block);
        let error = worst(
            &reference(&block, &cache),
            &exact.reference(),
            block.magnitude(),
        );
        largest = largest.max(error);
        assert!(
            error <= EXACT_TOLERANCE,
            "{shape:?} {tokens} tokens at {depth}, window {window:?}: {error:e}"
        );
    }
    println!("int8 reference against exact: worst {largest:e}");
}

#[test]
fn the_kernel_matches_its_reference_and_is_the_same_alone_as_in_a_block() {
    let Some(k) = int8_kernels() else {
        println!("this CPU has no AVX-512 VNNI: only the reference is checked");
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed8);
    let (mut to_reference, mut to_exact) = (0.0f64, 0.0f64);
    for (shape, tokens, depth, window) in ragged_cases(&[(8, 64), (3, 128)]) {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let label = format!("{shape:?} {tokens} tokens at {depth}, window {window:?}");
        let cache = Q8Cache::of(&block);
        let got = run_block(k, &block, &cache);
        let magnitude = block.magnitude();
        let want: Vec<f64> = reference(&block, &cache)
            .iter()
            .map(|x| *x as f64)
            .collect();
        let error = worst(&got, &want, magnitude);
        to_reference = to_reference.max(error);
        assert!(
            error <= KERNEL_TOLERANCE,
            "{label}: {error:e} from the reference"
        );
        let error = worst(&got, &cache.dequantized(&block).reference(), magnitude);
        to_exact = to_exact.max(error);
        assert!(error <= EXACT_TOLERANCE, "{label}: {error:e} from exact");
        let alone = run_tokens(k, &block, &cache);
        assert_eq!(
            support::differing_bits(&got, &alone),
            0,
            "{label}: a token alone differs from the block"
        );
    }
    println!("int8 kernel: worst {to_reference:e} from its reference, {to_exact:e} from exact");
}

/// Key and value rows before a window (and before the block's first visible key) share tiles
/// and quads with visible ones; with NaN scales they must still not reach any result.
#[test]
fn rows_before_the_window_never_reach_a_result() {
    let Some(k) = int8_kernels() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for (tokens, depth, window) in [(16, 200, 7), (5, 130, 70), (1, 301, 128)] {
        let block = Block::random(&mut rng, (8, 64), tokens, depth, Some(window));
        let clean = Q8Cache::of(&block);
        let mut poisoned = Q8Cache::of(&block);
        let first_seen = block.visible(0).start;
        for j in 0..first_seen {
            poisoned.key_scales[j] = f32::NAN;
            poisoned.value_scales[j] = f32::NAN;
            poisoned.keys[j * 64..][..64].fill(127);
            poisoned.values[j * 64..][..64].fill(-128);
        }
        assert_eq!(
            support::differing_bits(
                &run_block(k, &block, &clean),
                &run_block(k, &block, &poisoned)
            ),
            0,
            "{tokens} tokens at {depth}, window {window}"
        );
    }
}

#[test]
fn the_path_runs_only_where_it_is_taken() {
    for k in Kernels::all_supported() {
        assert_eq!(
            runs_int8(k, 64),
            k.uses_int8_attention(),
            "{}",
            k.path().name()
        );
        assert!(!runs_int8(k, 48), "head_dim 48 is not whole vectors");
        assert!(!runs_int8(k.without_bf16_attention(), 64), "f32 arithmetic");
    }
    let Some(k) = int8_kernels() else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let block = Block::random(&mut rng, (4, 48), 3, 20, None);
    let cache = Q8Cache::of(&block);
    let mut out = vec![0.0; 3 * 4 * 48];
    let mut scratch = AttentionScratch::new(12, 48);
    let visible = |t: usize| block.visible(t);
    let error = attend_block_q8(
        k,
        &block.query(),
        &cache.head(),
        &visible,
        &mut out,
        &mut scratch,
    )
    .expect_err("head_dim 48 is refused");
    assert!(error.to_string().contains("multiple of 64"), "{error}");
    // A cache shorter than the visible rows is an error, not a read past its end.
    let block = Block::random(&mut rng, (8, 64), 2, 100, None);
    let mut cache = Q8Cache::of(&block);
    cache.value_scales.truncate(50);
    let mut out = vec![0.0; 2 * 8 * 64];
    let mut scratch = AttentionScratch::new(16, 64);
    let visible = |t: usize| block.visible(t);
    let error = attend_block_q8(
        k,
        &block.query(),
        &cache.head(),
        &visible,
        &mut out,
        &mut scratch,
    )
    .expect_err("short scales are refused");
    assert!(error.to_string().contains("value scale"), "{error}");
}
