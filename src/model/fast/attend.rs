//! Attention of a chunk's queries over one layer's cache: one task per (KV head, token) walks the
//! visible keys once for all query heads of its group, so each cached row is read once. Tasks are
//! ordered head by head, so a thread's working set is one head's keys and values.

use std::cell::RefCell;

use super::jobs::SharedOut;
use super::FastPass;
use crate::kernels::attention::{attend_group, AttentionScratch, GroupQuery, KvHead};
use crate::model::kv::{KvElement, LayerKv};
use crate::model::ops::{attention_scale, visible_keys};
use crate::model::team::parallel_for;
use crate::model::weights::Layer;

thread_local! {
    /// Each pool thread's attention tiles, with the (heads, head_dim) they were sized for.
    static ATTENTION_SCRATCH: RefCell<((usize, usize), AttentionScratch)> =
        RefCell::new(((0, 0), AttentionScratch::new(0, 0)));
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
