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

use half::f16;

use super::config::ModelConfig;
use super::options::KvFormat;
use crate::kernels::attention::KvElem;
use crate::kernels::{KernelPath, Kernels};

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

impl Tensors {
    /// `count` tensors of `values` elements (and `values / head_dim` scales) each, zeroed.
    /// Zeroed allocations are backed lazily by the OS, so unused context costs no memory.
    fn zeroed(format: KvFormat, count: usize, values: usize, head_dim: usize) -> Tensors {
        match format {
            KvFormat::F16 => Tensors::F16((0..count).map(|_| vec![f16::ZERO; values]).collect()),
            KvFormat::F32 => Tensors::F32((0..count).map(|_| vec![0.0; values]).collect()),
            KvFormat::Q8 => Tensors::Q8 {
                rows: (0..count).map(|_| vec![0; values]).collect(),
                scales: (0..count).map(|_| vec![0.0; values / head_dim]).collect(),
            },
        }
    }

    pub fn format(&self) -> KvFormat {
        match self {
            Tensors::F16(_) => KvFormat::F16,
            Tensors::F32(_) => KvFormat::F32,
            Tensors::Q8 { .. } => KvFormat::Q8,
        }
    }

    /// Copies rows `0..len` of every head from `src` (tensors of `src_positions` positions per
    /// head) into `dst` (of `dst_positions`). Both hold the same format.
    fn copy_rows(
        src: &Tensors,
        src_positions: usize,
        dst: &mut Tensors,
        dst_positions: usize,
        len: usize,
        shape: KvShape,
    ) {
        fn rows<T: Copy>(
            src: &[Vec<T>],
            from: usize,
            dst: &mut [Vec<T>],
            to: usize,
            len: usize,
            heads: usize,
            width: usize,
        ) {
            for (s, d) in src.iter().zip(dst.iter_mut()) {
                for head in 0..heads {
                    let (at, into) = (head * from * width, head * to * width);
                    d[into..into + len * width].copy_from_slice(&s[at..at + len * width]);
                }
            }
        }
        let (heads, hd) = (shape.kv_heads, shape.head_dim);
        let (from, to) = (src_positions, dst_positions);
        match (src, dst) {
            (Tensors::F16(s), Tensors::F16(d)) => rows(s, from, d, to, len, heads, hd),
            (Tensors::F32(s), Tensors::F32(d)) => rows(s, from, d, to, len, heads, hd),
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
                rows(s, from, d, to, len, heads, hd);
                rows(ss, from, ds, to, len, heads, 1);
            }
            _ => unreachable!("callers compare the formats first"),
        }
    }

    /// Little-endian bytes of every tensor in order (int8 rows, then their scales, per tensor).
    pub fn write_bytes(&self, out: &mut Vec<u8>) {
        match self {
            Tensors::F16(tensors) => {
                for t in tensors {
                    out.reserve(2 * t.len());
                    t.iter()
                        .for_each(|v| out.extend_from_slice(&v.to_bits().to_le_bytes()));
                }
            }
            Tensors::F32(tensors) => {
                for t in tensors {
                    out.reserve(4 * t.len());
                    t.iter()
                        .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
                }
            }
            Tensors::Q8 { rows, scales } => {
                for (r, s) in rows.iter().zip(scales) {
                    out.extend(r.iter().map(|&v| v as u8));
                    s.iter()
                        .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
                }
            }
        }
    }

    /// Bytes [`Tensors::write_bytes`] writes for `positions` positions of `shape` in `format`.
    pub fn byte_len(format: KvFormat, shape: KvShape, positions: usize) -> usize {
        shape.bytes_per_position(format) * positions
    }

    /// Reads what [`Tensors::write_bytes`] wrote for `positions` positions; `None` if `bytes`
    /// is not exactly that long.
    pub fn read_bytes(
        format: KvFormat,
        shape: KvShape,
        positions: usize,
        bytes: &[u8],
    ) -> Option<Tensors> {
        if bytes.len() != Tensors::byte_len(format, shape, positions) {
            return None;
        }
        let count = 2 * shape.layers;
        let values = shape.kv_heads * positions * shape.head_dim;
        let scales = shape.kv_heads * positions;
        Some(match format {
            KvFormat::F16 => Tensors::F16(
                bytes
                    .chunks_exact(2 * values.max(1))
                    .take(count)
                    .map(|t| {
                        t.chunks_exact(2)
                            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                            .collect()
                    })
                    .collect(),
            ),
            KvFormat::F32 => Tensors::F32(
                bytes
                    .chunks_exact(4 * values.max(1))
                    .take(count)
                    .map(|t| {
                        t.chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect()
                    })
                    .collect(),
            ),
            KvFormat::Q8 => {
                let per_tensor = values + 4 * scales;
                let (mut rows, mut all_scales) = (Vec::new(), Vec::new());
                for t in bytes.chunks_exact(per_tensor.max(1)).take(count) {
                    let (r, s) = t.split_at(values);
                    rows.push(r.iter().map(|&b| b as i8).collect());
                    all_scales.push(
                        s.chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect(),
                    );
                }
                Tensors::Q8 {
                    rows,
                    scales: all_scales,
                }
            }
        })
        .filter(|t| t.tensor_count() == count)
    }

    fn tensor_count(&self) -> usize {
        match self {
            Tensors::F16(t) => t.len(),
            Tensors::F32(t) => t.len(),
            Tensors::Q8 { rows, .. } => rows.len(),
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

    /// Copies of the rows of positions `0..len` (compact: `len` positions per head).
    pub fn capture(&self, len: usize) -> Tensors {
        let shape = self.shape();
        let values = len * self.kv_heads * self.head_dim;
        let mut out = Tensors::zeroed(self.format(), 2 * shape.layers, values, self.head_dim);
        Tensors::copy_rows(&self.layers, self.positions, &mut out, len, len, shape);
        out
    }

    /// Overwrites positions `0..len` with the first `len` rows of `tensors`, which hold
    /// `positions` positions per head in this cache's format and shape (checked by the caller).
    pub fn restore(&mut self, tensors: &Tensors, positions: usize, len: usize) {
        let shape = self.shape();
        Tensors::copy_rows(
            tensors,
            positions,
            &mut self.layers,
            self.positions,
            len,
            shape,
        );
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
        Tensors::copy_rows(
            &other.layers,
            other.positions,
            &mut self.layers,
            self.positions,
            len,
            shape,
        );
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

/// Widens `count` int8 rows of `head_dim` (`rows`, with one scale each in `scales`) to f32 rows
/// of `head_dim` in `dst`: `dst = q * scale`. Every path gives the same bits (one exact int to
/// float conversion and one rounded product per element).
pub fn widen_q8_rows(
    path: KernelPath,
    rows: &[i8],
    scales: &[f32],
    head_dim: usize,
    dst: &mut [f32],
) {
    let count = scales.len();
    let (rows, dst) = (&rows[..count * head_dim], &mut dst[..count * head_dim]);
    match path {
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 if std::arch::is_x86_feature_detected!("avx512f") => {
            // SAFETY: the feature was just detected.
            unsafe { widen_q8_avx512(rows, scales, head_dim, dst) }
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Avx512 | KernelPath::Avx2 if std::arch::is_x86_feature_detected!("avx2") => {
            // SAFETY: the feature was just detected.
            unsafe { widen_q8_avx2(rows, scales, head_dim, dst) }
        }
        _ => widen_q8_scalar(rows, scales, head_dim, dst),
    }
}

/// The reference of [`widen_q8_rows`].
pub fn widen_q8_scalar(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    for ((row, &scale), out) in rows
        .chunks_exact(head_dim)
        .zip(scales)
        .zip(dst.chunks_exact_mut(head_dim))
    {
        for (o, &q) in out.iter_mut().zip(row) {
            *o = q as f32 * scale;
        }
    }
}

// The SIMD versions are the scalar loop compiled for wider registers: the loop is a plain
// convert-and-multiply the compiler vectorizes fully, and no reassociation is involved, so the
// results are the scalar bits.

/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn widen_q8_avx2(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    widen_q8_scalar(rows, scales, head_dim, dst)
}

/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_q8_avx512(rows: &[i8], scales: &[f32], head_dim: usize, dst: &mut [f32]) {
    widen_q8_scalar(rows, scales, head_dim, dst)
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
    fn every_widen_path_matches_the_scalar_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for head_dim in [1, 7, 16, 33, 64, 100] {
            for count in [0, 1, 3, 17] {
                let rows: Vec<i8> = (0..count * head_dim).map(|_| rng.gen()).collect();
                let scales: Vec<f32> = (0..count).map(|_| rng.gen_range(1e-4..2.0)).collect();
                let mut want = vec![0.0; count * head_dim];
                widen_q8_scalar(&rows, &scales, head_dim, &mut want);
                for path in KernelPath::ALL {
                    let mut got = vec![f32::NAN; count * head_dim];
                    widen_q8_rows(path, &rows, &scales, head_dim, &mut got);
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{path:?} head_dim {head_dim} count {count}");
                }
            }
        }
    }

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
