//! `attend_group` allocates nothing once its scratch exists, on every path and for both cache
//! element types: a counting global allocator watches the calls.
//!
//! `attend_group` runs on the calling thread, so only that thread's allocations are counted.

use half::f16;
use ossterm::kernels::attention::{attend_group, AttentionScratch, GroupQuery, KvHead};
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
    let paths = Kernels::all_supported();

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
            attend_group(k, &query, &kv32, positions, &mut out, &mut scratch)
                .expect("f32 attention");
        }
    }
    let allocations = thread_allocations() - before;
    assert_eq!(allocations, 0, "attend_group allocated {allocations} times");
    assert!(out.iter().all(|o| o.is_finite()));
}
