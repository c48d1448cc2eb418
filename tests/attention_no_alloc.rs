//! `attend_group` and `attend_block` allocate nothing once their scratch exists, on every path
//! and for both cache element types: a counting global allocator watches the calls.
//!
//! Both run on the calling thread, so only that thread's allocations are counted.

use half::f16;
use ossterm::kernels::attention::{
    attend_block, attend_group, AttentionScratch, BlockQuery, GroupQuery, KvHead,
};
use ossterm::kernels::Kernels;

mod counting_alloc;
use counting_alloc::thread_allocations;

#[test]
fn attention_does_not_allocate() {
    let (group, d, kv_heads, rows) = (8, 64, 2, 300);
    let stride = kv_heads * d;
    let cache32: Vec<f32> = (0..rows * stride)
        .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
        .collect();
    let cache16: Vec<f16> = cache32.iter().map(|x| f16::from_f32(*x)).collect();
    let queries: Vec<f32> = (0..group * d)
        .map(|i| ((i % 13) as f32 - 6.0) / 4.0)
        .collect();
    let sinks = vec![0.5f32; group];
    let query = GroupQuery {
        queries: &queries,
        sinks: &sinks,
        head_dim: d,
        scale: 0.125,
    };
    let mut out = vec![0.0f32; group * d];
    let mut scratch = AttentionScratch::new(group, d);
    // A block of four tokens, each with the same queries.
    let tokens = 4;
    let block_queries: Vec<f32> = queries.repeat(tokens);
    let block = BlockQuery {
        queries: &block_queries,
        token_stride: group * d,
        tokens,
        sinks: &sinks,
        head_dim: d,
        scale: 0.125,
    };
    let mut block_out = vec![0.0f32; tokens * group * d];
    let mut block_scratch = AttentionScratch::new(tokens * group, d);
    // Every path, and on AVX-512 both attention arithmetics (bf16 where the CPU has it).
    let paths: Vec<Kernels> = Kernels::all_supported()
        .into_iter()
        .flat_map(|k| [k.with_bf16_attention(), k.without_bf16_attention()])
        .collect();

    let before = thread_allocations();
    for &k in &paths {
        for positions in [0..1, 10..139, 0..rows] {
            let kv16 = KvHead {
                keys: &cache16[..],
                values: &cache16[..],
                row_stride: stride,
                offset: d,
            };
            attend_group(k, &query, &kv16, positions.clone(), &mut out, &mut scratch)
                .expect("f16 attention");
            let kv32 = KvHead {
                keys: &cache32[..],
                values: &cache32[..],
                row_stride: stride,
                offset: d,
            };
            attend_group(k, &query, &kv32, positions.clone(), &mut out, &mut scratch)
                .expect("f32 attention");
            // Token t sees one more key than token t - 1, as in prefill.
            let visible = |t: usize| positions.start..(positions.end + t).min(rows);
            attend_block(
                k,
                &block,
                &kv16,
                &visible,
                &mut block_out,
                &mut block_scratch,
            )
            .expect("f16 block");
            attend_block(
                k,
                &block,
                &kv32,
                &visible,
                &mut block_out,
                &mut block_scratch,
            )
            .expect("f32 block");
        }
    }
    let allocations = thread_allocations() - before;
    assert_eq!(allocations, 0, "attention allocated {allocations} times");
    assert!(out.iter().chain(&block_out).all(|o| o.is_finite()));
}
