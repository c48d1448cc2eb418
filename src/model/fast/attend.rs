//! Attention of a chunk's queries over one layer's cache: one task per (KV head, token) walks the
//! visible keys once for all query heads of its group, so each cached row is read once. Tasks are
//! ordered head by head, so a thread's working set is one head's keys and values.

use std::cell::RefCell;

use super::jobs::SharedOut;
use super::FastPass;
use crate::kernels::attention::{attend_group, AttentionScratch, GroupQuery, KvHead};
use crate::model::kv::{widen_q8_rows, KvElement, LayerKv, LayerKvQ8};
use crate::model::ops::{attention_scale, visible_keys};
use crate::model::team::parallel_for;
use crate::model::weights::Layer;

thread_local! {
    /// Each pool thread's attention tiles, with the (heads, head_dim) they were sized for.
    static ATTENTION_SCRATCH: RefCell<((usize, usize), AttentionScratch)> =
        RefCell::new(((0, 0), AttentionScratch::new(0, 0)));
    /// Each pool thread's f32 copy of one int8 head's keys and values.
    static Q8_STAGING: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Sizes the calling thread's attention tiles for groups of `group` heads of `head_dim`.
pub fn prepare_attention_scratch(group: usize, head_dim: usize) {
    ATTENTION_SCRATCH.with(|scratch| {
        let mut guard = scratch.borrow_mut();
        if guard.0 != (group, head_dim) {
            *guard = ((group, head_dim), AttentionScratch::new(group, head_dim));
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
        let (qw, hd) = (c.q_width(), c.head_dim);
        let kv_heads = c.num_key_value_heads;
        let group = c.num_attention_heads / kv_heads;
        let scale = attention_scale(c);
        let sinks = &layer.attention.sinks;
        assert!(out.len() >= n * qw, "scratch sized for the chunk");
        let shared = SharedOut(out.as_mut_ptr());
        parallel_for(self.team, n * kv_heads, &|index| {
            let (kv_head, i) = (index / n, index % n);
            let heads = kv_head * group..(kv_head + 1) * group;
            let query = GroupQuery {
                queries: &q[i * qw + heads.start * hd..i * qw + heads.end * hd],
                sinks: &sinks[heads.clone()],
                head_dim: hd,
                scale,
            };
            let (keys, values) = cache.head(kv_head);
            let head = KvHead {
                keys,
                values,
                row_stride: hd,
                offset: 0,
            };
            // SAFETY: (token i, KV head) owns the group's query heads of token i in `out`, a
            // range no other task touches; the buffer outlives the parallel loop.
            let out = unsafe { shared.slice(i * qw + heads.start * hd, group * hd) };
            ATTENTION_SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                if scratch.0 != (group, hd) {
                    *scratch = ((group, hd), AttentionScratch::new(group, hd));
                }
                let visible = visible_keys(c, layer.kind, start + i);
                attend_group(self.kernels, &query, &head, visible, out, &mut scratch.1)
                    .expect("attention shapes follow the model config");
            });
        });
    }
}

/// [`FastPass::attend`] over an int8 cache. The kernel reads f16 or f32 rows, so each task widens the rows
/// its KV head's queries can see (once for the whole chunk) into f32 staging, then attends over
/// that in place. One task per KV head: the widening is shared by the chunk's tokens.
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
        let (qw, hd) = (c.q_width(), c.head_dim);
        let kv_heads = c.num_key_value_heads;
        let group = c.num_attention_heads / kv_heads;
        let scale = attention_scale(c);
        let sinks = &layer.attention.sinks;
        assert!(out.len() >= n * qw, "scratch sized for the chunk");
        let first = visible_keys(c, layer.kind, start).start;
        let rows = first..start + n;
        let room = cache.positions() * hd;
        let shared = SharedOut(out.as_mut_ptr());
        parallel_for(self.team, kv_heads, &|kv_head| {
            let heads = kv_head * group..(kv_head + 1) * group;
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
                ATTENTION_SCRATCH.with(|scratch| {
                    let mut scratch = scratch.borrow_mut();
                    if scratch.0 != (group, hd) {
                        *scratch = ((group, hd), AttentionScratch::new(group, hd));
                    }
                    for i in 0..n {
                        let query = GroupQuery {
                            queries: &q[i * qw + heads.start * hd..i * qw + heads.end * hd],
                            sinks: &sinks[heads.clone()],
                            head_dim: hd,
                            scale,
                        };
                        // SAFETY: (token i, KV head) owns the group's query heads of token i in
                        // `out`, a range no other task touches; the buffer outlives the loop.
                        let out = unsafe { shared.slice(i * qw + heads.start * hd, group * hd) };
                        let visible = visible_keys(c, layer.kind, start + i);
                        let visible = visible.start - first..visible.end - first;
                        attend_group(k, &query, &staged, visible, out, &mut scratch.1)
                            .expect("attention shapes follow the model config");
                    }
                });
            });
        });
    }
}
