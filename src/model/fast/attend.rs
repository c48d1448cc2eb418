//! Attention of a chunk's queries over one layer's cache, flash-style: one task per (KV head,
//! block of up to [`block_tokens`] consecutive tokens) walks the keys its tokens see once for all
//! their query heads, so at depth each cached row is read once per block, not once per token.
//! Tasks are ordered head by head, so a thread's working set is one head's keys and values.

use std::cell::RefCell;
use std::ops::Range;

use super::jobs::SharedOut;
use super::FastPass;
use crate::kernels::attention::{
    attend_block, attend_block_q8, runs_int8, AttentionError, AttentionScratch, BlockQuery, KvHead,
    Q8KvHead, TILE_KEYS,
};
use crate::kernels::Kernels;
use crate::model::config::ModelConfig;
use crate::model::kv::{widen_q8_rows, KvElement, LayerKv, LayerKvQ8};
use crate::model::ops::{attention_scale, visible_keys};
use crate::model::team::parallel_for;
use crate::model::weights::Layer;

/// Tokens per attention task in prefill. A block's rows (tokens x 8 heads) share every widened
/// tile of keys and values; 16 tokens cut the cache traffic at depth 16-fold while the block's
/// logits and accumulators (128 rows of 64 keys / 64 columns, 32 KiB each) stay in L2, and a
/// 512-token chunk still makes 256 tasks for the team to balance.
pub const BLOCK_TOKENS: usize = 16;

/// Tokens per task where the matrix unit runs attention ([`Kernels::uses_amx_attention`]): its
/// products cost little next to staging a tile of keys and values (converted to bf16, the values
/// transposed), which 32 tokens share twice as widely. An AMX microbenchmark (one KV head, depth
/// 4096, Xeon): 0.53 ns per (query head, key) with 16 tokens, 0.47 with 32, 0.44 with 64, whose
/// blocks waste more of a causal diagonal at depth 0.
pub const AMX_BLOCK_TOKENS: usize = 32;

/// Tokens per prefill attention task with these kernels.
pub fn block_tokens(k: Kernels) -> usize {
    if k.uses_amx_attention() {
        AMX_BLOCK_TOKENS
    } else {
        BLOCK_TOKENS
    }
}

/// Each pool thread's attention tiles and block output, with the (heads, head_dim) they were
/// sized for.
struct Tiles {
    shape: (usize, usize),
    scratch: AttentionScratch,
    out: Vec<f32>,
}

impl Tiles {
    /// Sized for the larger blocks of the matrix unit whatever the kernels: a session can switch
    /// its attention arithmetic live, and the forward pass never allocates.
    fn sized(&mut self, group: usize, head_dim: usize) -> &mut Self {
        if self.shape != (group, head_dim) {
            *self = Self {
                shape: (group, head_dim),
                scratch: AttentionScratch::new(AMX_BLOCK_TOKENS * group, head_dim),
                out: vec![0.0; AMX_BLOCK_TOKENS * group * head_dim],
            };
        }
        self
    }
}

thread_local! {
    static ATTENTION_SCRATCH: RefCell<Tiles> = RefCell::new(Tiles {
        shape: (0, 0),
        scratch: AttentionScratch::new(0, 0),
        out: Vec::new(),
    });
    /// Each pool thread's f32 copy of one int8 head's keys and values.
    static Q8_STAGING: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Sizes the calling thread's attention tiles for groups of `group` heads of `head_dim`.
pub fn prepare_attention_scratch(group: usize, head_dim: usize) {
    ATTENTION_SCRATCH.with(|tiles| {
        tiles.borrow_mut().sized(group, head_dim);
    });
}

/// The kernel call of one block: the block's queries, each token's visible cache rows, the
/// block's output rows and the thread's scratch.
type BlockKernel<'a> = dyn Fn(
        &BlockQuery<'_>,
        &dyn Fn(usize) -> Range<usize>,
        &mut [f32],
        &mut AttentionScratch,
    ) -> Result<(), AttentionError>
    + 'a;

/// `kernel` as a [`BlockKernel`] (names the closure's argument types once for its callers).
fn block_kernel<F>(kernel: F) -> F
where
    F: Fn(
        &BlockQuery<'_>,
        &dyn Fn(usize) -> Range<usize>,
        &mut [f32],
        &mut AttentionScratch,
    ) -> Result<(), AttentionError>,
{
    kernel
}

/// One block's attention: tokens `block` of the chunk (at positions `start + i`), KV head
/// `kv_head`'s query group, by `kernel` over a cache whose row 0 is position `first`, into
/// `out`.
#[allow(clippy::too_many_arguments)]
fn attend_tokens(
    c: &ModelConfig,
    layer: &Layer,
    (start, first): (usize, usize),
    block: Range<usize>,
    kv_head: usize,
    q: &[f32],
    kernel: &BlockKernel<'_>,
    out: SharedOut,
) {
    let (qw, hd) = (c.q_width(), c.head_dim);
    let group = c.num_attention_heads / c.num_key_value_heads;
    let heads = kv_head * group..(kv_head + 1) * group;
    let query = BlockQuery {
        queries: &q[block.start * qw + heads.start * hd..],
        token_stride: qw,
        tokens: block.len(),
        sinks: &layer.attention.sinks[heads.clone()],
        head_dim: hd,
        scale: attention_scale(c),
    };
    let visible = |t: usize| {
        let seen = visible_keys(c, layer.kind, start + block.start + t);
        seen.start - first..seen.end - first
    };
    ATTENTION_SCRATCH.with(|tiles| {
        let mut tiles = tiles.borrow_mut();
        let tiles = tiles.sized(group, hd);
        let result = &mut tiles.out[..block.len() * group * hd];
        kernel(&query, &visible, result, &mut tiles.scratch)
            .expect("attention shapes follow the model config");
        for (i, row) in block.clone().zip(result.chunks_exact(group * hd)) {
            // SAFETY: (block, KV head) owns the group's query heads of its tokens in `out`, ranges
            // no other task touches; the buffer outlives the parallel loop.
            unsafe { out.slice(i * qw + heads.start * hd, group * hd) }.copy_from_slice(row);
        }
    });
}

impl FastPass<'_> {
    /// Writes the attention output of the `n` queries in `q` (tokens at positions `start..`, each
    /// q_width wide, already rotated) into `out`, over `cache`, which already holds their keys
    /// and values.
    pub(super) fn attend<T: KvElement>(
        &self,
        layer: &Layer,
        start: usize,
        n: usize,
        q: &[f32],
        cache: &LayerKv<'_, T>,
        out: &mut [f32],
    ) {
        let c = self.config;
        let hd = c.head_dim;
        assert!(out.len() >= n * c.q_width(), "scratch sized for the chunk");
        let shared = SharedOut(out.as_mut_ptr());
        let k = self.activations.attention_kernels(self.kernels);
        let block_tokens = block_tokens(k);
        let blocks = n.div_ceil(block_tokens);
        parallel_for(self.team, blocks * c.num_key_value_heads, &|index| {
            let (kv_head, b) = (index / blocks, index % blocks);
            let block = b * block_tokens..((b + 1) * block_tokens).min(n);
            let (keys, values) = cache.head(kv_head);
            let head = KvHead {
                keys,
                values,
                row_stride: hd,
                offset: 0,
            };
            let kernel = block_kernel(|query, visible, out, scratch| {
                attend_block(k, query, &head, visible, out, scratch)
            });
            attend_tokens(c, layer, (start, 0), block, kv_head, q, &kernel, shared);
        });
    }
}

/// [`FastPass::attend`] over an int8 cache. Where the kernels take int8 attention
/// ([`runs_int8`]) the cache is read as stored, in blocks of tokens as over an f16 cache.
/// Otherwise the kernel reads f16 or f32 rows, so each task widens the rows its KV head's queries
/// can see (once for the whole chunk) into f32 staging, then attends over that in place, in
/// blocks of tokens. One task per KV head: the widening is shared by the chunk's tokens.
impl FastPass<'_> {
    pub(super) fn attend_q8(
        &self,
        layer: &Layer,
        start: usize,
        n: usize,
        q: &[f32],
        cache: &LayerKvQ8<'_>,
        out: &mut [f32],
    ) {
        let (k, c) = (self.kernels, self.config);
        let hd = c.head_dim;
        assert!(out.len() >= n * c.q_width(), "scratch sized for the chunk");
        let attention = self.activations.attention_kernels(k);
        if runs_int8(attention, hd) {
            return self.attend_q8_in_place(attention, layer, start, n, q, cache, out);
        }
        // Staged from a row the kernel's tiles start at, so the tiles of the staged rows are those
        // of the whole cache and a token's result does not depend on where its chunk began.
        let seen = visible_keys(c, layer.kind, start).start;
        let first = seen - seen % TILE_KEYS;
        let rows = first..start + n;
        let room = cache.positions() * hd;
        let shared = SharedOut(out.as_mut_ptr());
        parallel_for(self.team, c.num_key_value_heads, &|kv_head| {
            let head = cache.head(kv_head);
            Q8_STAGING.with(|staging| {
                let (keys, values) = &mut *staging.borrow_mut();
                // Sized once for the whole cache (zeroed pages are mapped lazily), so decoding never
                // grows it token by token.
                if keys.len() < room {
                    *keys = vec![0.0; room];
                    *values = vec![0.0; room];
                }
                let span = rows.start * hd..rows.end * hd;
                let (keys, values) = (&mut keys[..rows.len() * hd], &mut values[..rows.len() * hd]);
                widen_q8_rows(
                    k,
                    &head.keys[span.clone()],
                    &head.key_scales[rows.clone()],
                    hd,
                    keys,
                );
                widen_q8_rows(
                    k,
                    &head.values[span],
                    &head.value_scales[rows.clone()],
                    hd,
                    values,
                );
                let staged = KvHead {
                    keys,
                    values,
                    row_stride: hd,
                    offset: 0,
                };
                // The chunk's tokens in blocks over the staged rows, as in FastPass::attend.
                let mut block = 0;
                while block < n {
                    let tokens = block..(block + BLOCK_TOKENS).min(n);
                    block = tokens.end;
                    let kernel = block_kernel(|query, visible, out, scratch| {
                        attend_block(k, query, &staged, visible, out, scratch)
                    });
                    attend_tokens(
                        c,
                        layer,
                        (start, first),
                        tokens,
                        kv_head,
                        q,
                        &kernel,
                        shared,
                    );
                }
            });
        });
    }
}

impl FastPass<'_> {
    /// [`FastPass::attend_q8`] on int8 dot products: one task per (KV head, block of up to
    /// [`BLOCK_TOKENS`] tokens), as [`FastPass::attend`] over an f16 cache.
    #[allow(clippy::too_many_arguments)]
    fn attend_q8_in_place(
        &self,
        k: Kernels,
        layer: &Layer,
        start: usize,
        n: usize,
        q: &[f32],
        cache: &LayerKvQ8<'_>,
        out: &mut [f32],
    ) {
        let c = self.config;
        let shared = SharedOut(out.as_mut_ptr());
        let blocks = n.div_ceil(BLOCK_TOKENS);
        parallel_for(self.team, blocks * c.num_key_value_heads, &|index| {
            let (kv_head, b) = (index / blocks, index % blocks);
            let block = b * BLOCK_TOKENS..((b + 1) * BLOCK_TOKENS).min(n);
            let head = cache.head(kv_head);
            let kv = Q8KvHead {
                keys: head.keys,
                key_scales: head.key_scales,
                values: head.values,
                value_scales: head.value_scales,
            };
            let kernel = block_kernel(|query, visible, out, scratch| {
                attend_block_q8(k, query, &kv, visible, out, scratch)
            });
            attend_tokens(c, layer, (start, 0), block, kv_head, q, &kernel, shared);
        });
    }
}
