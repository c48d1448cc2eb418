//! The KV cache: keys (after RoPE) and values of every processed position, per layer.
//!
//! Each layer's keys and values are [kv_heads x positions x head_dim]: head-major, so attention
//! streams one head's rows contiguously (position-major rows put one head's 128 bytes every
//! kv_width elements, which the prefetchers followed poorly: deep-context decode spent a large
//! share of its time widening them).

use half::f16;

use super::config::ModelConfig;
use super::options::KvFormat;
use crate::kernels::attention::KvElem;
use crate::kernels::Kernels;

/// The keys and values of one sequence, in every layer, in f16 or f32.
pub struct KvStore {
    layers: Layers,
    positions: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Keys of layer l at index 2l, values at 2l + 1.
enum Layers {
    F16(Vec<Vec<f16>>),
    F32(Vec<Vec<f32>>),
}

impl KvStore {
    /// Room for `positions` positions of `config`'s shape. Zeroed allocations are backed lazily
    /// by the OS, so unused context costs no memory.
    pub fn new(format: KvFormat, config: &ModelConfig, positions: usize) -> KvStore {
        let tensors = 2 * config.num_hidden_layers;
        let values = positions * config.kv_width();
        let layers = match format {
            KvFormat::F16 => Layers::F16((0..tensors).map(|_| vec![f16::ZERO; values]).collect()),
            KvFormat::F32 => Layers::F32((0..tensors).map(|_| vec![0.0; values]).collect()),
        };
        KvStore {
            layers,
            positions,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }

    pub fn format(&self) -> KvFormat {
        match self.layers {
            Layers::F16(_) => KvFormat::F16,
            Layers::F32(_) => KvFormat::F32,
        }
    }

    /// Positions the cache has room for.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Copies the keys and values of positions `0..len` from `other` (same shape and element
    /// type; `len` within both). Returns false, copying nothing, when the two do not match.
    pub fn copy_prefix_from(&mut self, other: &KvStore, len: usize) -> bool {
        if (self.kv_heads, self.head_dim) != (other.kv_heads, other.head_dim)
            || len > self.positions.min(other.positions)
        {
            return false;
        }
        let (hd, heads) = (self.head_dim, self.kv_heads);
        let (to_stride, from_stride) = (self.positions * hd, other.positions * hd);
        fn copy<T: Copy>(
            to: &mut [Vec<T>],
            from: &[Vec<T>],
            heads: usize,
            strides: (usize, usize),
            span: usize,
        ) {
            for (to, from) in to.iter_mut().zip(from) {
                for head in 0..heads {
                    let (t, f) = (head * strides.0, head * strides.1);
                    to[t..t + span].copy_from_slice(&from[f..f + span]);
                }
            }
        }
        let strides = (to_stride, from_stride);
        match (&mut self.layers, &other.layers) {
            (Layers::F16(to), Layers::F16(from)) if to.len() == from.len() => {
                copy(to, from, heads, strides, len * hd)
            }
            (Layers::F32(to), Layers::F32(from)) if to.len() == from.len() => {
                copy(to, from, heads, strides, len * hd)
            }
            _ => return false,
        }
        true
    }

    /// Layer `l`'s keys and values, in the element type the cache holds.
    pub fn layer(&mut self, l: usize) -> LayerKvOf<'_> {
        let (positions, kv_heads, head_dim) = (self.positions, self.kv_heads, self.head_dim);
        match &mut self.layers {
            Layers::F16(tensors) => LayerKvOf::F16(LayerKv::new(
                &mut tensors[2 * l..2 * l + 2],
                positions,
                kv_heads,
                head_dim,
            )),
            Layers::F32(tensors) => LayerKvOf::F32(LayerKv::new(
                &mut tensors[2 * l..2 * l + 2],
                positions,
                kv_heads,
                head_dim,
            )),
        }
    }
}

/// One layer's cache in its element type.
pub enum LayerKvOf<'a> {
    F16(LayerKv<'a, f16>),
    F32(LayerKv<'a, f32>),
}

/// One layer's keys and values.
pub struct LayerKv<'a, T> {
    keys: &'a mut [T],
    values: &'a mut [T],
    positions: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl<'a, T: KvElement> LayerKv<'a, T> {
    fn new(tensors: &'a mut [Vec<T>], positions: usize, kv_heads: usize, head_dim: usize) -> Self {
        let (keys, values) = tensors.split_at_mut(1);
        LayerKv {
            keys: &mut keys[0],
            values: &mut values[0],
            positions,
            kv_heads,
            head_dim,
        }
    }

    /// Stores the keys and values of `position` (each a kv_width row: all KV heads).
    pub fn store(&mut self, k: Kernels, position: usize, keys: &[f32], values: &[f32]) {
        let hd = self.head_dim;
        for head in 0..self.kv_heads {
            let (src, dst) = (head * hd, (head * self.positions + position) * hd);
            T::store(k, &keys[src..src + hd], &mut self.keys[dst..dst + hd]);
            T::store(k, &values[src..src + hd], &mut self.values[dst..dst + hd]);
        }
    }

    /// The keys and values of KV head `kv_head`, [positions x head_dim] each.
    pub fn head(&self, kv_head: usize) -> (&[T], &[T]) {
        let span = kv_head * self.positions * self.head_dim
            ..(kv_head + 1) * self.positions * self.head_dim;
        (&self.keys[span.clone()], &self.values[span])
    }
}

/// An element type of the cache: rows of f32 are stored into it and read back widened.
pub trait KvElement: KvElem + Copy + Send + Sync {
    fn store(k: Kernels, src: &[f32], dst: &mut [Self]);
    fn to_f32(self) -> f32;
}

impl KvElement for f16 {
    fn store(k: Kernels, src: &[f32], dst: &mut [f16]) {
        k.f32_to_f16(src, dst)
            .expect("cache rows match the projection width");
    }

    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl KvElement for f32 {
    fn store(_: Kernels, src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn to_f32(self) -> f32 {
        self
    }
}
