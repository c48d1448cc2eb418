//! The flash-style block kernel (`attend_block`): every path, f16 and f32 caches, against an f64
//! reference per token, against the one-token kernel (`attend_group`) on the scalar path, and bit
//! for bit against `attend_group` on its own path, over ragged blocks: depths that are not
//! multiples of the tile, causal ends inside a tile, sliding windows whose edges cross tiles and
//! windows narrower than the block (tiles nobody sees), head dims that need padding, and query
//! rows further apart than a group. Then a sequence prefilled in different chunks (bit for bit),
//! NaN rows before the window that must not be read (both also on the bf16 dot products, where
//! the CPU runs them), and the shape errors.
//!
//! Tolerance (tests/support/attention.rs): 2e-6 of the largest |value| in the cache.

use half::f16;
use ossterm::kernels::attention::{
    attend_block, AttentionError, AttentionScratch, BlockQuery, KvElem, TILE_KEYS,
};
use ossterm::kernels::{KernelPath, Kernels};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

mod support;
use support::attention::{
    assert_close, every_attention_kernel, f32_attention_kernels, widen, Block, KV_HEADS,
};

fn check(block: &Block, label: &str) {
    let want = block.reference();
    let magnitude = block.magnitude();
    let scalar = Kernels::new(KernelPath::Scalar).expect("scalar always runs");
    let per_token = block.run_tokens(scalar, &block.keys, &block.values);
    let halves: Vec<f16> = block.keys.iter().map(|x| f16::from_f32(*x)).collect();
    let value_halves: Vec<f16> = block.values.iter().map(|x| f16::from_f32(*x)).collect();
    for k in f32_attention_kernels() {
        let path = k.path();
        let f32_out = block.run_block(k, &block.keys, &block.values);
        assert_close(&format!("{label} f32 {path}"), &f32_out, &want, magnitude);
        assert_close(
            &format!("{label} f32 {path} vs per-token scalar"),
            &f32_out,
            &widen(&per_token),
            magnitude,
        );
        let f16_out = block.run_block(k, &halves, &value_halves);
        assert_close(&format!("{label} f16 {path}"), &f16_out, &want, magnitude);
        for (cache, out, tokens) in [
            (
                "f32",
                &f32_out,
                block.run_tokens(k, &block.keys, &block.values),
            ),
            ("f16", &f16_out, block.run_tokens(k, &halves, &value_halves)),
        ] {
            let what = format!("{label} {cache} {path} vs attend_group on the same path");
            assert_same_bits(&what, out, &tokens, "attend_group");
        }
    }
}

#[test]
fn blocks_match_the_reference_at_ragged_depths_and_windows() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    let depths = [0, 1, 5, TILE_KEYS - 1, TILE_KEYS, TILE_KEYS + 3, 200, 333];
    for (i, &depth) in depths.iter().enumerate() {
        for tokens in [1, 2, 7, 16, 17] {
            for window in [None, Some(1), Some(5), Some(40), Some(128)] {
                let shape = [(8, 64), (2, 32), (3, 24)][(i + tokens) % 3];
                let block = Block::random(&mut rng, shape, tokens, depth, window);
                check(
                    &block,
                    &format!("{shape:?} depth {depth} tokens {tokens} window {window:?}"),
                );
            }
        }
    }
}

#[test]
fn block_shape_errors_are_reported() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    let block = Block::random(&mut rng, (2, 16), 3, 10, None);
    let k = Kernels::new(KernelPath::Scalar).expect("scalar always runs");
    let kv = block.kv(&block.keys, &block.values);
    let mut scratch = AttentionScratch::new(6, 16);
    let mut out = vec![0.0; 3 * 2 * 16];
    let fine = |t: usize| block.visible(t);

    let backwards = |t: usize| 0..12 - t;
    let e = attend_block(k, &block.query(), &kv, &backwards, &mut out, &mut scratch).unwrap_err();
    assert!(
        matches!(e, AttentionError::VisibleNotMonotone { token: 1 }),
        "{e}"
    );

    let past = |t: usize| 0..block.depth + 4 + t;
    let e = attend_block(k, &block.query(), &kv, &past, &mut out, &mut scratch).unwrap_err();
    assert!(matches!(e, AttentionError::CacheTooShort { .. }), "{e}");

    let mut short = block.query();
    // The last token's row ends 3 elements (the stride's padding) before the buffer does.
    short.queries = &block.queries[..block.queries.len() - 4];
    let e = attend_block(k, &short, &kv, &fine, &mut out, &mut scratch).unwrap_err();
    assert!(matches!(e, AttentionError::BlockQueries { .. }), "{e}");

    let mut narrow = block.query();
    narrow.token_stride = 31;
    let e = attend_block(k, &narrow, &kv, &fine, &mut out, &mut scratch).unwrap_err();
    assert!(matches!(e, AttentionError::BlockQueries { .. }), "{e}");

    let e = attend_block(k, &block.query(), &kv, &fine, &mut out[1..], &mut scratch).unwrap_err();
    assert!(matches!(e, AttentionError::OutputLength { .. }), "{e}");

    let mut small = AttentionScratch::new(5, 16);
    let e = attend_block(k, &block.query(), &kv, &fine, &mut out, &mut small).unwrap_err();
    assert!(matches!(e, AttentionError::ScratchTooSmall { .. }), "{e}");

    let mut none = block.query();
    none.tokens = 0;
    attend_block(k, &none, &kv, &fine, &mut [], &mut scratch).expect("an empty block is fine");
}

/// Prefills positions `0..len` in chunks of `splits` (which sum to `len`) the way the model does:
/// each chunk in blocks of [`MODEL_BLOCK`] tokens counted from the chunk's start, every block one
/// `attend_block` call over the whole cache. Returns every position's G x head_dim outputs.
fn prefill_in_chunks<T: KvElem>(
    k: Kernels,
    block: &Block,
    (keys, values): (&[T], &[T]),
    splits: &[usize],
) -> Vec<f32> {
    let (g, d) = (block.group, block.head_dim);
    let len = block.tokens;
    assert_eq!(
        splits.iter().sum::<usize>(),
        len,
        "splits cover the sequence"
    );
    let mut scratch = AttentionScratch::new(MODEL_BLOCK * g, d);
    let mut out = vec![f32::NAN; len * g * d];
    let kv = block.kv(keys, values);
    let mut chunk_start = 0;
    for &chunk in splits {
        let mut first = chunk_start;
        while first < chunk_start + chunk {
            let tokens = MODEL_BLOCK.min(chunk_start + chunk - first);
            let query = BlockQuery {
                queries: &block.queries[first * block.token_stride..],
                tokens,
                ..block.query()
            };
            let visible = |t: usize| block.visible(first + t);
            let result = &mut out[first * g * d..(first + tokens) * g * d];
            attend_block(k, &query, &kv, &visible, result, &mut scratch).expect("valid shapes");
            first += tokens;
        }
        chunk_start += chunk;
    }
    out
}

const WHOLE: &str = "the whole sequence as one chunk";

/// Tokens per `attend_block` call in the model's prefill (src/model/fast/attend.rs).
const MODEL_BLOCK: usize = 16;

fn assert_same_bits(what: &str, got: &[f32], want: &[f32], wanted_from: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i} is {g:e}, {wanted_from} gave {w:e}"
        );
    }
}

/// A prompt's attention must not depend on how it was chunked: a cache reused from an earlier
/// turn plus the rest of the prompt has to give what a cold prefill of the whole prompt gives, bit
/// for bit, and so must a decoded token (a chunk of one, or `attend_group`).
#[test]
fn chunking_never_changes_a_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let len = 301;
    let splits: [&[usize]; 5] = [
        &[37, 200, 64],
        &[1, 16, 17, 63, 65, 139],
        &[128, 128, 45],
        &[5, 290, 1, 1, 1, 1, 1, 1],
        &[300, 1],
    ];
    for (shape, window) in [((8, 64), None), ((8, 64), Some(128)), ((3, 24), Some(40))] {
        // Positions 0..len: depth 0, one token per position.
        let block = Block::random(&mut rng, shape, len, 0, window);
        let halves: Vec<f16> = block.keys.iter().map(|x| f16::from_f32(*x)).collect();
        let value_halves: Vec<f16> = block.values.iter().map(|x| f16::from_f32(*x)).collect();
        for k in every_attention_kernel() {
            let bf16 = if k.uses_bf16_attention() { " bf16" } else { "" };
            let label = format!("{shape:?} window {window:?} {}{bf16}", k.path());
            let f32_cache = (&block.keys[..], &block.values[..]);
            let f16_cache = (&halves[..], &value_halves[..]);
            let whole = prefill_in_chunks(k, &block, f32_cache, &[len]);
            let whole_f16 = prefill_in_chunks(k, &block, f16_cache, &[len]);
            for splits in splits {
                let what = format!("{label} f32 chunks {splits:?}");
                let chunked = prefill_in_chunks(k, &block, f32_cache, splits);
                assert_same_bits(&what, &chunked, &whole, WHOLE);
                let what = format!("{label} f16 chunks {splits:?}");
                let chunked = prefill_in_chunks(k, &block, f16_cache, splits);
                assert_same_bits(&what, &chunked, &whole_f16, WHOLE);
            }
            let decoded = block.run_tokens(k, f16_cache.0, f16_cache.1);
            assert_same_bits(
                &format!("{label} f16 attend_group"),
                &decoded,
                &whole_f16,
                WHOLE,
            );
        }
    }
}

/// Rows before a block's first visible key share a tile with rows it sees (tiles sit at fixed
/// rows) but must not reach the result: a window-trimmed snapshot restores only the last window,
/// so such rows may hold anything, here NaN.
#[test]
fn rows_before_the_window_are_never_read() {
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    for (depth, tokens, window) in [(200, 7, 40), (300, 16, 128), (70, 1, 5)] {
        let block = Block::random(&mut rng, (8, 64), tokens, depth, Some(window));
        let first = block.visible(0).start;
        assert!(
            !first.is_multiple_of(TILE_KEYS),
            "the window starts inside a tile"
        );
        let mut poisoned = (block.keys.clone(), block.values.clone());
        let row_stride = KV_HEADS * block.head_dim;
        poisoned.0[..first * row_stride].fill(f32::NAN);
        poisoned.1[..first * row_stride].fill(f32::NAN);
        let halves = |v: &[f32]| -> Vec<f16> { v.iter().map(|x| f16::from_f32(*x)).collect() };
        for k in every_attention_kernel() {
            let bf16 = if k.uses_bf16_attention() { " bf16" } else { "" };
            let label = format!(
                "depth {depth} tokens {tokens} window {window} {}{bf16}",
                k.path()
            );
            let clean = block.run_block(k, &block.keys, &block.values);
            let got = block.run_block(k, &poisoned.0, &poisoned.1);
            assert_same_bits(&format!("{label} f32"), &got, &clean, "finite rows");
            let clean = block.run_block(k, &halves(&block.keys), &halves(&block.values));
            let got = block.run_block(k, &halves(&poisoned.0), &halves(&poisoned.1));
            assert_same_bits(&format!("{label} f16"), &got, &clean, "finite rows");
        }
    }
}
