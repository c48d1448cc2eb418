//! The KV cache: keys (after RoPE) and values of every processed position, per layer, and
//! snapshots of it that can be restored into another session.
//!
//! Each layer's keys and values are [kv_heads x positions x head_dim]: head-major, so attention
//! streams one head's rows contiguously (position-major rows put one head's 128 bytes every
//! kv_width elements, which the prefetchers followed poorly: deep-context decode spent a large
//! share of its time widening them).
//!
//! The int8 cache keeps one f32 scale per head_dim row (one head of one position): a row is
//! quantized when it is stored, symmetrically (`scale = max |x| / 127`), so a row never depends
//! on another and a restored row is the row the prefill wrote.

use std::ops::Range;

use half::f16;
use rayon::prelude::*;

use super::config::{LayerKind, ModelConfig};
use super::options::KvFormat;
use crate::kernels::attention::KvElem;
use crate::kernels::Kernels;

pub use crate::kernels::kv_widen::{widen_q8_rows, widen_q8_scalar};

// Tensors are viewed as their little-endian bytes (snapshot files, compression) without a
// per-element conversion.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "KV snapshots view tensors as little-endian bytes"
);

/// The keys and values of one sequence, in every layer, in f16, f32 or int8.
pub struct KvStore {
    layers: Layers,
    positions: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// Keys of layer l at index 2l, values at 2l + 1; each tensor [kv_heads x positions x head_dim]
/// (the int8 scales [kv_heads x positions]).
#[derive(Clone, Debug, PartialEq)]
pub enum Tensors {
    F16(Vec<Vec<f16>>),
    F32(Vec<Vec<f32>>),
    Q8 {
        rows: Vec<Vec<i8>>,
        scales: Vec<Vec<f32>>,
    },
}

type Layers = Tensors;

/// The dimensions every tensor of a cache or snapshot shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    pub fn of(config: &ModelConfig) -> KvShape {
        KvShape {
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
        }
    }

    /// Bytes of the keys and values of one position in `format` (scales included).
    pub fn bytes_per_position(self, format: KvFormat) -> usize {
        2 * self.layers * self.kv_heads * format.row_bytes(self.head_dim)
    }
}

/// Which positions a snapshot's tensors hold: every position in the full-attention layers; in
/// the sliding-window layers only those from `sliding_from` on. A query at position p of a
/// sliding layer reads the last `window` positions only, so a session restored to L tokens
/// never reads a row of those layers before L + 1 - window: a snapshot meant to be restored at
/// L or later needs nothing earlier, which halves the snapshots of long chats (every other
/// gpt-oss layer slides over 128 positions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowSpan {
    /// Per layer: whether it is a sliding-window layer.
    pub sliding: Vec<bool>,
    /// The sliding layers' window (0 without sliding layers).
    pub window: usize,
    /// First position the sliding layers' tensors hold.
    pub sliding_from: usize,
}

impl RowSpan {
    /// Every position of every layer of `config`.
    pub fn all(config: &ModelConfig) -> RowSpan {
        RowSpan::restorable_from(config, 0)
    }

    /// The positions a snapshot needs to be restored at any length from `floor` on.
    pub fn restorable_from(config: &ModelConfig, floor: usize) -> RowSpan {
        let sliding: Vec<bool> = config
            .layer_kinds
            .iter()
            .map(|k| *k == LayerKind::Sliding)
            .collect();
        let any = sliding.iter().any(|&s| s);
        let window = if any { config.sliding_window } else { 0 };
        RowSpan {
            sliding,
            window,
            // The rows a query at position `floor` sees (`ops::visible_keys`).
            sliding_from: if any {
                (floor + 1).saturating_sub(window)
            } else {
                0
            },
        }
    }

    /// The first position layer `layer`'s tensors hold.
    pub fn first(&self, layer: usize) -> usize {
        if self.sliding.get(layer).copied().unwrap_or(false) {
            self.sliding_from
        } else {
            0
        }
    }

    /// The shortest restore whose sliding layers find every row they will read.
    pub fn min_restore(&self) -> usize {
        if self.sliding_from == 0 {
            1
        } else {
            self.sliding_from + self.window - 1
        }
    }

    /// Positions per head of each tensor (keys and values of every layer) of a snapshot of `len`
    /// positions.
    pub fn tensor_positions(&self, len: usize) -> impl Iterator<Item = usize> + '_ {
        (0..2 * self.sliding.len()).map(move |t| len.saturating_sub(self.first(t / 2)))
    }
}

/// A zeroed vector, mapped lazily by the OS (`vec![f16::ZERO; n]` would write every element).
fn zeroed_f16(len: usize) -> Vec<f16> {
    let mut bits = std::mem::ManuallyDrop::new(vec![0u16; len]);
    // SAFETY: f16 is a transparent u16 (same size, alignment and bit validity); the allocation
    // changes owner without being freed.
    unsafe { Vec::from_raw_parts(bits.as_mut_ptr().cast::<f16>(), bits.len(), bits.capacity()) }
}

/// The bytes of a slice of plain numbers.
fn bytes_of<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: only instantiated with i8, f16 and f32: no padding, every byte initialized.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// The bytes of a slice of plain numbers, writable.
fn bytes_of_mut<T: Copy>(values: &mut [T]) -> &mut [u8] {
    // SAFETY: only instantiated with i8, f16 and f32, for which every bit pattern is valid.
    unsafe {
        std::slice::from_raw_parts_mut(
            values.as_mut_ptr().cast::<u8>(),
            std::mem::size_of_val(values),
        )
    }
}

/// Where positions sit in a tensor: `rows` positions per head, the first being `first`.
#[derive(Clone, Copy)]
struct Placement {
    rows: usize,
    first: usize,
}

/// Whether to spread a copy over threads: only on a pool's thread (the session's, where restores
/// and captures run), so a caller outside any pool never wakes rayon's global one.
fn in_a_pool() -> bool {
    rayon::current_thread_index().is_some()
}

/// Copies positions `range` of every head from `src` to `dst` (tensors of `width` values per
/// position and head). Tensors are copied in parallel: a restore is a hundred megabytes or more
/// of memcpy and first-touch page faults, which one core does not saturate.
fn copy_positions<T: Copy + Send + Sync>(
    src: &[Vec<T>],
    dst: &mut [Vec<T>],
    heads: usize,
    width: usize,
    plan: &(dyn Fn(usize) -> (Placement, Placement, Range<usize>) + Sync),
) {
    let copy = |t: usize, s: &Vec<T>, d: &mut Vec<T>| {
        let (from, to, range) = plan(t);
        let n = range.len() * width;
        for head in 0..heads {
            let at = (head * from.rows + range.start - from.first) * width;
            let into = (head * to.rows + range.start - to.first) * width;
            d[into..into + n].copy_from_slice(&s[at..at + n]);
        }
    };
    if in_a_pool() {
        src.par_iter()
            .zip(dst.par_iter_mut())
            .enumerate()
            .for_each(|(t, (s, d))| copy(t, s, d));
    } else {
        src.iter()
            .zip(dst.iter_mut())
            .enumerate()
            .for_each(|(t, (s, d))| copy(t, s, d));
    }
}

/// Gathers positions `range(t)` of every head of `src` (placed by `from(t)`) into new compact
/// tensors (`range.len()` positions per head).
fn gather_positions<T: Copy + Send + Sync>(
    src: &[Vec<T>],
    heads: usize,
    width: usize,
    from: &(dyn Fn(usize) -> Placement + Sync),
    range: &(dyn Fn(usize) -> Range<usize> + Sync),
) -> Vec<Vec<T>> {
    let gather = |(t, s): (usize, &Vec<T>)| {
        let (from, range) = (from(t), range(t));
        let n = range.len() * width;
        let mut out = Vec::with_capacity(heads * n);
        for head in 0..heads {
            let at = (head * from.rows + range.start - from.first) * width;
            out.extend_from_slice(&s[at..at + n]);
        }
        out
    };
    if in_a_pool() {
        src.par_iter().enumerate().map(gather).collect()
    } else {
        src.iter().enumerate().map(gather).collect()
    }
}

impl Tensors {
    /// `count` tensors of `values` elements (and `values / head_dim` scales) each, zeroed.
    /// Zeroed allocations are backed lazily by the OS, so unused context costs no memory.
    fn zeroed(format: KvFormat, count: usize, values: usize, head_dim: usize) -> Tensors {
        Tensors::zeroed_each(format, (0..count).map(|_| values / head_dim), head_dim)
    }

    /// Zeroed tensors of `positions` positions per head each (`kv_heads` folded in by the caller
    /// through `positions`), of `head_dim` values per position.
    fn zeroed_each(
        format: KvFormat,
        positions: impl Iterator<Item = usize>,
        head_dim: usize,
    ) -> Tensors {
        let positions: Vec<usize> = positions.collect();
        match format {
            KvFormat::F16 => {
                Tensors::F16(positions.iter().map(|p| zeroed_f16(p * head_dim)).collect())
            }
            KvFormat::F32 => {
                Tensors::F32(positions.iter().map(|p| vec![0.0; p * head_dim]).collect())
            }
            KvFormat::Q8 => Tensors::Q8 {
                rows: positions.iter().map(|p| vec![0; p * head_dim]).collect(),
                scales: positions.iter().map(|p| vec![0.0; *p]).collect(),
            },
        }
    }

    /// Zeroed tensors for a snapshot of `len` positions of `shape` holding `span`, to be filled
    /// through [`Tensors::byte_views_mut`].
    pub fn for_snapshot(format: KvFormat, shape: KvShape, span: &RowSpan, len: usize) -> Tensors {
        Tensors::zeroed_each(
            format,
            span.tensor_positions(len).map(|p| p * shape.kv_heads),
            shape.head_dim,
        )
    }

    pub fn format(&self) -> KvFormat {
        match self {
            Tensors::F16(_) => KvFormat::F16,
            Tensors::F32(_) => KvFormat::F32,
            Tensors::Q8 { .. } => KvFormat::Q8,
        }
    }

    /// The bytes of every tensor in file order (int8 rows, then their scales, per tensor).
    pub fn byte_views(&self) -> Vec<&[u8]> {
        match self {
            Tensors::F16(t) => t.iter().map(|t| bytes_of(t)).collect(),
            Tensors::F32(t) => t.iter().map(|t| bytes_of(t)).collect(),
            Tensors::Q8 { rows, scales } => rows
                .iter()
                .zip(scales)
                .flat_map(|(r, s)| [bytes_of(r), bytes_of(s)])
                .collect(),
        }
    }

    /// [`Tensors::byte_views`], writable: a reader fills a snapshot's tensors in place.
    pub fn byte_views_mut(&mut self) -> Vec<&mut [u8]> {
        match self {
            Tensors::F16(t) => t.iter_mut().map(|t| bytes_of_mut(t)).collect(),
            Tensors::F32(t) => t.iter_mut().map(|t| bytes_of_mut(t)).collect(),
            Tensors::Q8 { rows, scales } => rows
                .iter_mut()
                .zip(scales.iter_mut())
                .flat_map(|(r, s)| [bytes_of_mut(r), bytes_of_mut(s)])
                .collect(),
        }
    }

    /// Bytes of the tensors (scales included).
    pub fn total_bytes(&self) -> usize {
        self.byte_views().iter().map(|b| b.len()).sum()
    }

    /// Bytes of a snapshot's tensors: `len` positions of `shape` in `format`, holding `span`.
    pub fn byte_len(format: KvFormat, shape: KvShape, span: &RowSpan, len: usize) -> usize {
        let per_position = shape.kv_heads * format.row_bytes(shape.head_dim);
        span.tensor_positions(len).map(|p| p * per_position).sum()
    }

    fn tensor_count(&self) -> usize {
        match self {
            Tensors::F16(t) => t.len(),
            Tensors::F32(t) => t.len(),
            Tensors::Q8 { rows, .. } => rows.len(),
        }
    }

    /// Positions per head of each tensor, for `head_dim`.
    pub fn positions_each(&self, shape: KvShape) -> Vec<usize> {
        let per_position = shape.kv_heads * shape.head_dim;
        match self {
            Tensors::F16(t) => t.iter().map(|t| t.len() / per_position.max(1)).collect(),
            Tensors::F32(t) => t.iter().map(|t| t.len() / per_position.max(1)).collect(),
            Tensors::Q8 { rows, .. } => {
                rows.iter().map(|t| t.len() / per_position.max(1)).collect()
            }
        }
    }

    /// Copies positions per tensor between two tensor sets of one format (`plan` as in
    /// [`copy_positions`]).
    fn copy_from(
        &mut self,
        src: &Tensors,
        shape: KvShape,
        plan: &(dyn Fn(usize) -> (Placement, Placement, Range<usize>) + Sync),
    ) {
        let (heads, hd) = (shape.kv_heads, shape.head_dim);
        match (src, self) {
            (Tensors::F16(s), Tensors::F16(d)) => copy_positions(s, d, heads, hd, plan),
            (Tensors::F32(s), Tensors::F32(d)) => copy_positions(s, d, heads, hd, plan),
            (
                Tensors::Q8 {
                    rows: s,
                    scales: ss,
                },
                Tensors::Q8 {
                    rows: d,
                    scales: ds,
                },
            ) => {
                copy_positions(s, d, heads, hd, plan);
                copy_positions(ss, ds, heads, 1, plan);
            }
            _ => unreachable!("callers compare the formats first"),
        }
    }
}

impl KvStore {
    /// Room for `positions` positions of `config`'s shape.
    pub fn new(format: KvFormat, config: &ModelConfig, positions: usize) -> KvStore {
        let shape = KvShape::of(config);
        let values = positions * config.kv_width();
        KvStore {
            layers: Tensors::zeroed(format, 2 * shape.layers, values, shape.head_dim),
            positions,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
        }
    }

    pub fn format(&self) -> KvFormat {
        self.layers.format()
    }

    /// Positions the cache has room for.
    pub fn positions(&self) -> usize {
        self.positions
    }

    pub fn shape(&self) -> KvShape {
        KvShape {
            layers: self.layers.tensor_count() / 2,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }

    fn placement(&self) -> Placement {
        Placement {
            rows: self.positions,
            first: 0,
        }
    }

    /// Copies of the rows of positions `0..len` that `span` keeps (compact: each tensor holds
    /// its kept positions only).
    pub fn capture(&self, len: usize, span: &RowSpan) -> Tensors {
        let shape = self.shape();
        let (heads, hd, cache) = (self.kv_heads, self.head_dim, self.placement());
        let from = |_| cache;
        let range = |t: usize| span.first(t / 2).min(len)..len;
        match &self.layers {
            Tensors::F16(t) => Tensors::F16(gather_positions(t, heads, hd, &from, &range)),
            Tensors::F32(t) => Tensors::F32(gather_positions(t, heads, hd, &from, &range)),
            Tensors::Q8 { rows, scales } => Tensors::Q8 {
                rows: gather_positions(rows, heads, hd, &from, &range),
                scales: gather_positions(scales, shape.kv_heads, 1, &from, &range),
            },
        }
    }

    /// Makes positions `0..len` those of a snapshot of `tensors` (holding `span` of `positions`
    /// positions, in this cache's format and shape, `len` at least `span.min_restore()`: checked
    /// by the caller). Only the rows a continuation reads are copied: in a sliding layer those
    /// a query at position `len` sees.
    pub fn restore(&mut self, tensors: &Tensors, span: &RowSpan, positions: usize, len: usize) {
        let (shape, cache) = (self.shape(), self.placement());
        let plan = |t: usize| {
            let first = span.first(t / 2);
            let snapshot = Placement {
                rows: positions - first,
                first,
            };
            let start = if span.sliding[t / 2] {
                first.max((len + 1).saturating_sub(span.window))
            } else {
                0
            };
            (snapshot, cache, start..len)
        };
        self.layers.copy_from(tensors, shape, &plan);
    }

    /// Copies the keys and values of positions `0..len` from `other` (same format and shape; `len`
    /// within both): a prefix computed for one sequence serves another. Returns false, copying
    /// nothing, when the two do not match.
    pub fn copy_prefix_from(&mut self, other: &KvStore, len: usize) -> bool {
        let shape = self.shape();
        if self.format() != other.format()
            || (shape.layers, shape.kv_heads, shape.head_dim)
                != (other.shape().layers, other.kv_heads, other.head_dim)
            || len > self.positions.min(other.positions)
        {
            return false;
        }
        let (from, to) = (other.placement(), self.placement());
        self.layers
            .copy_from(&other.layers, shape, &|_| (from, to, 0..len));
        true
    }

    /// Layer `l`'s keys and values, in the element type the cache holds.
    pub fn layer(&mut self, l: usize) -> LayerKvOf<'_> {
        let (positions, kv_heads, head_dim) = (self.positions, self.kv_heads, self.head_dim);
        match &mut self.layers {
            Tensors::F16(tensors) => LayerKvOf::F16(LayerKv::new(
                &mut tensors[2 * l..2 * l + 2],
                positions,
                kv_heads,
                head_dim,
            )),
            Tensors::F32(tensors) => LayerKvOf::F32(LayerKv::new(
                &mut tensors[2 * l..2 * l + 2],
                positions,
                kv_heads,
                head_dim,
            )),
            Tensors::Q8 { rows, scales } => {
                let (keys, values) = rows[2 * l..2 * l + 2].split_at_mut(1);
                let (key_scales, value_scales) = scales[2 * l..2 * l + 2].split_at_mut(1);
                LayerKvOf::Q8(LayerKvQ8 {
                    keys: &mut keys[0],
                    values: &mut values[0],
                    key_scales: &mut key_scales[0],
                    value_scales: &mut value_scales[0],
                    positions,
                    kv_heads,
                    head_dim,
                })
            }
        }
    }
}

/// One layer's cache in its element type.
pub enum LayerKvOf<'a> {
    F16(LayerKv<'a, f16>),
    F32(LayerKv<'a, f32>),
    Q8(LayerKvQ8<'a>),
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

/// One layer's int8 keys and values with a scale per head row.
pub struct LayerKvQ8<'a> {
    keys: &'a mut [i8],
    values: &'a mut [i8],
    key_scales: &'a mut [f32],
    value_scales: &'a mut [f32],
    positions: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// One KV head of an int8 layer: [positions x head_dim] rows and one scale per row.
#[derive(Clone, Copy)]
pub struct Q8Head<'a> {
    pub keys: &'a [i8],
    pub key_scales: &'a [f32],
    pub values: &'a [i8],
    pub value_scales: &'a [f32],
}

impl LayerKvQ8<'_> {
    /// Positions the layer has room for.
    pub fn positions(&self) -> usize {
        self.positions
    }

    /// Quantizes and stores the keys and values of `position` (each a kv_width row).
    pub fn store(&mut self, position: usize, keys: &[f32], values: &[f32]) {
        let hd = self.head_dim;
        for head in 0..self.kv_heads {
            let (src, row) = (head * hd, head * self.positions + position);
            self.key_scales[row] = quantize_row_q8(
                &keys[src..src + hd],
                &mut self.keys[row * hd..(row + 1) * hd],
            );
            self.value_scales[row] = quantize_row_q8(
                &values[src..src + hd],
                &mut self.values[row * hd..(row + 1) * hd],
            );
        }
    }

    pub fn head(&self, kv_head: usize) -> Q8Head<'_> {
        let rows = kv_head * self.positions..(kv_head + 1) * self.positions;
        let values = rows.start * self.head_dim..rows.end * self.head_dim;
        Q8Head {
            keys: &self.keys[values.clone()],
            key_scales: &self.key_scales[rows.clone()],
            values: &self.values[values],
            value_scales: &self.value_scales[rows],
        }
    }
}

/// Symmetric int8 quantization of one row: returns the scale (`max |x| / 127`, 0 for a zero row)
/// with `dst[i] = round(src[i] / scale)`.
pub fn quantize_row_q8(src: &[f32], dst: &mut [i8]) -> f32 {
    let max = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if max == 0.0 || !max.is_finite() {
        dst.fill(0);
        return if max.is_finite() { 0.0 } else { f32::NAN };
    }
    let scale = max / 127.0;
    let inverse = 1.0 / scale;
    for (d, s) in dst.iter_mut().zip(src) {
        *d = (s * inverse).round().clamp(-127.0, 127.0) as i8;
    }
    scale
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn q8_rows_round_trip_within_half_a_step() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let src: Vec<f32> = (0..64).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let mut q = vec![0i8; 64];
        let scale = quantize_row_q8(&src, &mut q);
        let mut back = vec![0.0; 64];
        widen_q8_scalar(&q, &[scale], 64, &mut back);
        for (a, b) in src.iter().zip(&back) {
            assert!((a - b).abs() <= scale * 0.5 + 1e-6, "{a} vs {b}");
        }
        assert_eq!(quantize_row_q8(&[0.0; 4], &mut q[..4]), 0.0);
    }
}
