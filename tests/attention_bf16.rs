//! Attention on bf16 dot products (`Kernels::uses_bf16_attention`, AVX-512 BF16 where it pays):
//! the SIMD kernel against its plain reference (`attend_block_bf16_reference`) and both against
//! an f64 reference, over ragged blocks (depths off the tile, causal ends inside a tile, windows
//! whose edges split a pair of keys, blocks of 1-17 tokens); every token bit for bit the same
//! alone as in its block; head dims the path does not take run the f32 path exactly. Chunked
//! prefill and rows before the window (NaN, never read) are tests/attention_block.rs's, which
//! run on these kernels too.
//!
//! Tolerances (of the largest |value| in the cache): the kernel within 3e-3 of its reference
//! (probabilities are rounded to bf16 against each tile's running maximum rather than the
//! final one; measured up to about 1e-3), both within 2e-2 of the exact result (bf16 keeps 8
//! bits: queries, keys, values and probabilities each carry up to 2^-9 relative error; measured
//! up to about 6e-3). A kernel that paired the wrong keys or columns misses by far more.

use half::f16;
use ossterm::kernels::attention::attend_block_bf16_reference;
use ossterm::kernels::Kernels;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

mod support;
use support::attention::{ragged_cases, worst, Block};

const KERNEL_TOLERANCE: f64 = 3e-3;
const EXACT_TOLERANCE: f64 = 2e-2;

/// The kernels with bf16 attention, if this CPU has AVX-512 BF16 (whatever the probe chose):
/// `vdpbf16ps` on the AVX-512 path, and on the amx path the matrix unit's `tdpbf16ps` where
/// the CPU has AMX-BF16.
fn bf16_kernels() -> Vec<Kernels> {
    support::attention::bf16_attention_kernels()
}

fn name(k: Kernels) -> String {
    let unit = if k.uses_amx_attention() {
        "tdpbf16ps"
    } else {
        "vdpbf16ps"
    };
    format!("{:?} ({unit})", k.path())
}

/// A block's f16-exact cache as f16 (keys, values).
fn f16_cache(block: &Block) -> (Vec<f16>, Vec<f16>) {
    let halves = |v: &[f32]| v.iter().map(|x| f16::from_f32(*x)).collect();
    (halves(&block.keys), halves(&block.values))
}

fn bf16_reference(block: &Block, keys: &[f16], values: &[f16]) -> Vec<f32> {
    let mut out = vec![f32::NAN; block.tokens * block.group * block.head_dim];
    let visible = |t: usize| block.visible(t);
    let kv = block.kv(keys, values);
    attend_block_bf16_reference(&block.query(), &kv, &visible, &mut out).expect("valid");
    out
}

fn widen(v: &[f32]) -> Vec<f64> {
    v.iter().map(|x| *x as f64).collect()
}

#[test]
fn the_reference_stays_near_the_exact_result() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xbf16);
    let mut largest = 0.0f64;
    for (shape, tokens, depth, window) in ragged_cases(&[(8, 64), (3, 32), (2, 96)]) {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let (keys, values) = f16_cache(&block);
        let error = worst(
            &bf16_reference(&block, &keys, &values),
            &block.reference(),
            block.magnitude(),
        );
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
    let kernels = bf16_kernels();
    if kernels.is_empty() {
        println!("this CPU has no AVX-512 BF16: only the reference is checked");
    }
    for k in kernels {
        kernel_matches_its_reference(k);
    }
}

fn kernel_matches_its_reference(k: Kernels) {
    let mut rng = ChaCha8Rng::seed_from_u64(0x5eed);
    let (mut to_reference, mut to_exact) = (0.0f64, 0.0f64);
    for (shape, tokens, depth, window) in ragged_cases(&[(8, 64), (3, 32), (2, 96)]) {
        let block = Block::random(&mut rng, shape, tokens, depth, window);
        let label = format!(
            "{}: {shape:?} {tokens} tokens at {depth}, window {window:?}",
            name(k)
        );
        let (keys, values) = f16_cache(&block);
        let got = block.run_block(k, &keys, &values);
        let magnitude = block.magnitude();
        let error = worst(
            &got,
            &widen(&bf16_reference(&block, &keys, &values)),
            magnitude,
        );
        to_reference = to_reference.max(error);
        assert!(
            error <= KERNEL_TOLERANCE,
            "{label}: {error:e} from the reference"
        );
        let error = worst(&got, &block.reference(), magnitude);
        to_exact = to_exact.max(error);
        assert!(error <= EXACT_TOLERANCE, "{label}: {error:e} from exact");
        let alone = block.run_tokens(k, &keys, &values);
        assert_eq!(
            support::differing_bits(&got, &alone),
            0,
            "{label}: a token alone differs from the block"
        );
    }
    println!(
        "bf16 kernel {}: worst {to_reference:e} from its reference, {to_exact:e} from exact",
        name(k)
    );
}

/// On a CPU with AMX-BF16 the amx path's bf16 attention runs on the matrix unit, which sums in
/// another order than `vdpbf16ps`: outputs differ in their last bits, so the test above checked
/// two kernels, not one twice.
#[test]
fn the_matrix_unit_runs_where_the_cpu_has_it() {
    let kernels = bf16_kernels();
    let Some(amx) = kernels.iter().find(|k| k.uses_amx_attention()) else {
        println!("no AMX-BF16 here: the vdpbf16ps kernel alone is checked");
        return;
    };
    assert_eq!(amx.path(), ossterm::kernels::KernelPath::Amx);
    let vector = kernels
        .iter()
        .find(|k| !k.uses_amx_attention())
        .expect("a CPU with AMX-BF16 has AVX-512 BF16");
    let (differ, outputs) = differing_outputs(5, *amx, *vector);
    assert!(
        differ > outputs / 10,
        "only {differ} of {outputs} outputs differ"
    );
}

/// How many of a random block's outputs (and of how many) differ in their bits between
/// kernels `a` and `b` (8 heads of 64 dims, 16 tokens over 200 keys of an f16 cache).
fn differing_outputs(seed: u64, a: Kernels, b: Kernels) -> (usize, usize) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let block = Block::random(&mut rng, (8, 64), 16, 200, None);
    let (keys, values) = f16_cache(&block);
    let from_a = block.run_block(a, &keys, &values);
    let from_b = block.run_block(b, &keys, &values);
    (support::differing_bits(&from_a, &from_b), from_a.len())
}

#[test]
fn the_kernel_is_not_the_f32_path() {
    for k in bf16_kernels() {
        kernel_is_not_the_f32_path(k);
    }
}

fn kernel_is_not_the_f32_path(k: Kernels) {
    let (differ, outputs) = differing_outputs(3, k, k.without_bf16_attention());
    assert!(
        differ > outputs / 2,
        "only {differ} of {outputs} outputs differ"
    );
}

#[test]
fn head_dims_the_path_does_not_take_run_in_f32() {
    for k in bf16_kernels() {
        head_dims_run_in_f32(k);
    }
}

fn head_dims_run_in_f32(k: Kernels) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let block = Block::random(&mut rng, (4, 48), 5, 70, None);
    let (keys, values) = f16_cache(&block);
    let got = block.run_block(k, &keys, &values);
    let f32_path = block.run_block(k.without_bf16_attention(), &keys, &values);
    assert!(got
        .iter()
        .zip(&f32_path)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}
