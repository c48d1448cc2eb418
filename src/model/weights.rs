//! Typed per-layer views of the weights, checked against the configuration at load.

use std::sync::Arc;

use rayon::prelude::*;

use super::checkpoint::{AlignedBytes, ByteOwner, Checkpoint, Dtype, TensorBytes};
use super::config::{LayerKind, ModelConfig, MXFP4_BLOCK};
use super::ModelError;
use crate::kernels::{self, Mxfp4Layout, Mxfp4Matrix, Q8Matrix, MXFP4_TILE_ROWS};

/// Anything that hands out tensors by name with shape and dtype checks: a mapped checkpoint or
/// the synthetic generator.
pub trait TensorSource {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError>;

    /// The [rows, cols] matrix `name` as a ready [`Q8Matrix`], if the source stores it in that
    /// format's blocks (a GGUF's Q8_0 tensors): the fast path's Q8 weights then use it as it is
    /// instead of quantizing the bf16 view again.
    fn q8_matrix(
        &self,
        _name: &str,
        _rows: usize,
        _cols: usize,
    ) -> Result<Option<Q8Matrix>, ModelError> {
        Ok(None)
    }
}

impl TensorSource for Checkpoint {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        self.get(name, shape, dtypes)
    }
}

/// A row-major [rows, cols] matrix of bfloat16 values, usually straight out of the mapping. The
/// shape is fixed at construction, where it is checked against the bytes.
#[derive(Clone)]
pub struct Bf16Matrix {
    rows: usize,
    cols: usize,
    data: TensorBytes,
    /// The same matrix as the file stores it in Q8 blocks (GGUF Q8_0), of which `data` is the
    /// bf16 rounding; the fast path's Q8 format uses this one.
    native_q8: Option<Arc<Q8Matrix>>,
}

impl Bf16Matrix {
    /// The matrix `name` over `data`, which must hold exactly `rows x cols` bf16 values.
    pub fn new(
        name: &str,
        rows: usize,
        cols: usize,
        data: TensorBytes,
    ) -> Result<Self, ModelError> {
        check_bytes(name, data.len(), rows * cols * 2)?;
        // A shard may place a tensor at an odd offset; then (only then) copy it to aligned memory.
        let data = if data.as_u16().is_some() {
            data
        } else {
            let words: Vec<u16> = data
                .as_slice()
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect();
            let len = words.len() * 2;
            TensorBytes::new(Arc::new(AlignedWords(words)), 0..len)
        };
        Ok(Bf16Matrix {
            rows,
            cols,
            data,
            native_q8: None,
        })
    }

    /// The file's own Q8 form of this matrix, if it has one (see [`TensorSource::q8_matrix`]).
    pub fn native_q8(&self) -> Option<&Arc<Q8Matrix>> {
        self.native_q8.as_ref()
    }

    /// Attaches (or with `None` drops) the file's Q8 form; it must have this matrix's shape.
    pub fn set_native_q8(&mut self, q8: Option<Arc<Q8Matrix>>) -> Result<(), ModelError> {
        if let Some(m) = &q8 {
            if (m.rows(), m.cols()) != (self.rows, self.cols) {
                return Err(ModelError::WrongShape {
                    tensor: "native Q8 matrix".into(),
                    expected: vec![self.rows, self.cols],
                    found: vec![m.rows(), m.cols()],
                });
            }
        }
        self.native_q8 = q8;
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// All values as bf16 bit patterns.
    pub fn values(&self) -> &[u16] {
        self.data
            .as_u16()
            .expect("Bf16Matrix::new guarantees 2-byte alignment")
    }

    pub fn row(&self, r: usize) -> &[u16] {
        &self.values()[r * self.cols..(r + 1) * self.cols]
    }

    pub fn byte_len(&self) -> usize {
        self.data.len()
    }

    /// Releases the matrix's pages of the mapping (after it was converted to another format).
    pub fn release_pages(&self) {
        self.data.release_pages();
    }
}

struct AlignedWords(Vec<u16>);

impl ByteOwner for AlignedWords {
    fn bytes(&self) -> &[u8] {
        // SAFETY: any u16 slice is a valid byte slice of twice the length, same lifetime.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr().cast::<u8>(), self.0.len() * 2) }
    }
}

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// y = W x + b with W in bfloat16.
#[derive(Clone)]
pub struct Linear {
    pub weight: Bf16Matrix,
    pub bias: Vec<f32>,
}

/// The experts of one projection in native MXFP4: for expert e, a [rows, cols] matrix whose
/// 32-element input blocks are 16 bytes of FP4 codes plus one E8M0 scale byte.
#[derive(Clone)]
pub struct Mxfp4Experts {
    num_experts: usize,
    rows: usize,
    cols: usize,
    /// Expert after expert, each in `layout`.
    blocks: TensorBytes,
    scales: TensorBytes,
    layout: Mxfp4Layout,
    /// [num_experts, rows]
    bias: Vec<f32>,
}

impl Mxfp4Experts {
    /// The experts of projection `name` (the tensors' common prefix): `cols` a multiple of 32,
    /// `blocks` `num_experts x rows x cols / 2` bytes, `scales` one byte per block, `bias`
    /// `num_experts x rows` values.
    pub fn new(
        name: &str,
        shape: [usize; 3],
        blocks: TensorBytes,
        scales: TensorBytes,
        bias: Vec<f32>,
    ) -> Result<Self, ModelError> {
        let [num_experts, rows, cols] = shape;
        if !cols.is_multiple_of(MXFP4_BLOCK) {
            return Err(ModelError::WrongShape {
                tensor: format!("{name}_blocks"),
                expected: vec![num_experts, rows, cols.div_ceil(MXFP4_BLOCK), 16],
                found: vec![num_experts, rows, cols],
            });
        }
        check_bytes(
            &format!("{name}_blocks"),
            blocks.len(),
            num_experts * rows * cols / 2,
        )?;
        check_bytes(
            &format!("{name}_scales"),
            scales.len(),
            num_experts * rows * cols / MXFP4_BLOCK,
        )?;
        if bias.len() != num_experts * rows {
            return Err(ModelError::WrongShape {
                tensor: format!("{name}_bias"),
                expected: vec![num_experts, rows],
                found: vec![bias.len()],
            });
        }
        Ok(Mxfp4Experts {
            num_experts,
            rows,
            cols,
            blocks,
            scales,
            layout: Mxfp4Layout::Rows,
            bias,
        })
    }

    /// The order of the bytes [`Self::blocks`] and [`Self::scales`] return.
    pub fn layout(&self) -> Mxfp4Layout {
        self.layout
    }

    /// Expert `expert`'s matrix, in the tensor's layout.
    pub fn matrix(&self, expert: usize) -> Mxfp4Matrix<'_> {
        let (blocks, scales) = (self.blocks(expert), self.scales(expert));
        match self.layout {
            Mxfp4Layout::Rows => Mxfp4Matrix::new(self.rows, self.cols, blocks, scales),
            Mxfp4Layout::Tiles => Mxfp4Matrix::new_tiled(self.rows, self.cols, blocks, scales),
        }
        .expect("the shape was checked against the bytes when the tensor was built")
    }

    /// Whether [`Self::tile`] applies: the experts are in row order and their rows fill whole
    /// tiles (small test shapes may not; those stay in row order).
    pub fn can_tile(&self) -> bool {
        self.layout == Mxfp4Layout::Rows && self.rows.is_multiple_of(MXFP4_TILE_ROWS)
    }

    /// Whether the bytes are lent by a file mapping rather than owned by the process.
    pub fn is_mapped(&self) -> bool {
        self.blocks.is_mapped()
    }

    /// Reorders the bytes into [`Mxfp4Layout::Tiles`] ([`Self::can_tile`] must hold), expert by
    /// expert on the current rayon pool. Aligned heap bytes nothing else shares (generated or
    /// repacked at load) are reordered in place; others are copied into 64-byte aligned memory of
    /// the tensor's own, and a mapping's pages of the row-order bytes are released: nothing
    /// reads them any more, and they would otherwise stay resident beside the copy.
    pub fn tile(&mut self) -> Result<(), ModelError> {
        assert!(self.can_tile(), "tiling experts that cannot be tiled");
        let (rows, cols) = (self.rows, self.cols);
        // `max(1)`: chunks of a tensor without bytes must still have a size.
        let per_expert = (rows * cols / 2).max(1);
        let per_expert_scales = (rows * cols / MXFP4_BLOCK).max(1);
        if let (Some(blocks), Some(scales)) = (
            self.blocks.unique_aligned_mut(),
            self.scales.unique_aligned_mut(),
        ) {
            blocks
                .par_chunks_mut(per_expert)
                .zip(scales.par_chunks_mut(per_expert_scales))
                .try_for_each(|(blocks, scales)| tile_in_place(rows, cols, blocks, scales))?;
        } else {
            let mut blocks = AlignedBytes::zeroed(self.blocks.len());
            let mut scales = AlignedBytes::zeroed(self.scales.len());
            self.tile_into(blocks.as_mut_slice(), scales.as_mut_slice())?;
            blocks.collapse_huge_pages();
            scales.collapse_huge_pages();
            self.blocks.release_pages();
            self.scales.release_pages();
            self.blocks = TensorBytes::from_aligned(blocks);
            self.scales = TensorBytes::from_aligned(scales);
        }
        self.layout = Mxfp4Layout::Tiles;
        Ok(())
    }

    /// Writes the bytes reordered into [`Mxfp4Layout::Tiles`] to `blocks` and `scales` (of the
    /// tensor's sizes), expert by expert on the current rayon pool, leaving `self` as it is
    /// ([`Self::can_tile`] must hold).
    pub fn tile_into(&self, blocks: &mut [u8], scales: &mut [u8]) -> Result<(), ModelError> {
        assert!(self.can_tile(), "tiling experts that cannot be tiled");
        check_bytes("tiled MXFP4 blocks", blocks.len(), self.blocks.len())?;
        check_bytes("tiled MXFP4 scales", scales.len(), self.scales.len())?;
        let (rows, cols) = (self.rows, self.cols);
        // `max(1)`: chunks of a tensor without bytes must still have a size.
        let per_expert = (rows * cols / 2).max(1);
        let per_expert_scales = (rows * cols / MXFP4_BLOCK).max(1);
        blocks
            .par_chunks_mut(per_expert)
            .zip(scales.par_chunks_mut(per_expert_scales))
            .enumerate()
            .try_for_each(|(expert, (tiled_blocks, tiled_scales))| {
                kernels::tile_mxfp4(
                    rows,
                    cols,
                    self.blocks(expert),
                    self.scales(expert),
                    tiled_blocks,
                    tiled_scales,
                )
            })?;
        Ok(())
    }

    /// Points the experts at bytes already in [`Mxfp4Layout::Tiles`] (what [`Self::tile_into`]
    /// wrote, e.g. into a cache file), releasing a mapping's pages of the row-order bytes.
    pub fn use_tiled(
        &mut self,
        blocks: TensorBytes,
        scales: TensorBytes,
    ) -> Result<(), ModelError> {
        assert!(self.can_tile(), "tiling experts that cannot be tiled");
        check_bytes("tiled MXFP4 blocks", blocks.len(), self.blocks.len())?;
        check_bytes("tiled MXFP4 scales", scales.len(), self.scales.len())?;
        self.blocks.release_pages();
        self.scales.release_pages();
        self.blocks = blocks;
        self.scales = scales;
        self.layout = Mxfp4Layout::Tiles;
        Ok(())
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Output rows of each expert's matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns of each expert's matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Every expert's FP4 codes, expert after expert: the bulk of a gpt-oss checkpoint's bytes.
    pub fn all_blocks(&self) -> &[u8] {
        self.blocks.as_slice()
    }

    /// Expert `expert`'s FP4 codes, in the tensor's [`Self::layout`].
    pub fn blocks(&self, expert: usize) -> &[u8] {
        let per_expert = self.rows * self.cols / 2;
        &self.blocks.as_slice()[expert * per_expert..(expert + 1) * per_expert]
    }

    /// Expert `expert`'s scale bytes, in the tensor's [`Self::layout`].
    pub fn scales(&self, expert: usize) -> &[u8] {
        let per_expert = self.rows * self.cols / MXFP4_BLOCK;
        &self.scales.as_slice()[expert * per_expert..(expert + 1) * per_expert]
    }

    pub fn bias(&self, expert: usize) -> &[f32] {
        &self.bias[expert * self.rows..(expert + 1) * self.rows]
    }

    pub fn byte_len(&self) -> usize {
        self.blocks.len() + self.scales.len()
    }
}

#[derive(Clone)]
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// One extra softmax logit per query head, with no value vector.
    pub sinks: Vec<f32>,
}

#[derive(Clone)]
pub struct Layer {
    pub kind: LayerKind,
    pub input_norm: Vec<f32>,
    pub attention: Attention,
    pub post_attention_norm: Vec<f32>,
    pub router: Linear,
    /// Rows alternate gate (even) and up (odd) units.
    pub gate_up: Mxfp4Experts,
    pub down: Mxfp4Experts,
}

#[derive(Clone)]
pub struct Weights {
    pub embed: Bf16Matrix,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    pub lm_head: Bf16Matrix,
}

const SMALL: &[Dtype] = &[Dtype::Bf16, Dtype::F32];

impl Weights {
    pub fn load(config: &ModelConfig, source: &impl TensorSource) -> Result<Self, ModelError> {
        let h = config.hidden_size;
        let (vocab, embed_name) = (config.vocab_size, "model.embed_tokens.weight");
        let (embed, lm_head) = if config.tie_word_embeddings {
            let embed = converted_matrix(source, embed_name, vocab, h)?;
            (embed.clone(), embed)
        } else {
            (
                matrix(source, embed_name, vocab, h)?,
                converted_matrix(source, "lm_head.weight", vocab, h)?,
            )
        };
        let layers = (0..config.num_hidden_layers)
            .map(|l| load_layer(config, source, l))
            .collect::<Result<Vec<_>, _>>()?;
        // Every dense matrix is checked for NaN and infinity: the fast path quantizes them to
        // int8, which would turn a NaN into a plausible weight. Memory-speed, in parallel.
        let mut dense: Vec<(String, &Bf16Matrix)> =
            vec![("model.embed_tokens.weight".into(), &embed)];
        if !config.tie_word_embeddings {
            dense.push(("lm_head.weight".into(), &lm_head));
        }
        for (l, layer) in layers.iter().enumerate() {
            let a = &layer.attention;
            for (name, linear) in [
                ("q_proj", &a.q),
                ("k_proj", &a.k),
                ("v_proj", &a.v),
                ("o_proj", &a.o),
            ] {
                dense.push((
                    format!("model.layers.{l}.self_attn.{name}.weight"),
                    &linear.weight,
                ));
            }
        }
        dense
            .par_iter()
            .try_for_each(|(name, matrix)| finite_bf16(name, matrix.values()))?;
        let final_norm = vector(source, "model.norm.weight", h)?;
        // Reading the tensors above may have hit a shard cut short on disk: it read as zeros.
        crate::fault::check()?;
        Ok(Weights {
            embed,
            layers,
            final_norm,
            lm_head,
        })
    }
}

impl Weights {
    /// The expert tensors [`Weights::tile_experts`] reorders.
    fn tileable_experts(&self) -> impl Iterator<Item = &Mxfp4Experts> {
        self.layers
            .iter()
            .flat_map(|layer| [&layer.gate_up, &layer.down])
            .filter(|experts| experts.can_tile())
    }

    /// The expert tensors [`Weights::tile_experts`] reorders, each named by its layer and
    /// projection (`layers.3.down`), for the tile cache.
    pub fn tileable_experts_named(&mut self) -> Vec<(String, &mut Mxfp4Experts)> {
        self.layers
            .iter_mut()
            .enumerate()
            .flat_map(|(l, layer)| {
                [
                    (format!("layers.{l}.gate_up"), &mut layer.gate_up),
                    (format!("layers.{l}.down"), &mut layer.down),
                ]
            })
            .filter(|(_, experts)| experts.can_tile())
            .collect()
    }

    /// How many expert tensors [`Weights::tile_experts`] reorders.
    pub fn tileable_expert_tensors(&self) -> usize {
        self.tileable_experts().count()
    }

    /// Bytes of those tensors that are lent by a file mapping: reordering copies them into memory
    /// the process owns (the mapping's pages are released, so they are not resident twice).
    pub fn tileable_mapped_bytes(&self) -> u64 {
        self.tileable_experts()
            .filter(|experts| experts.is_mapped())
            .map(|experts| experts.byte_len() as u64)
            .sum()
    }

    /// Reorders every expert tensor that [`Mxfp4Experts::can_tile`] into
    /// [`Mxfp4Layout::Tiles`], one tensor at a time (each in parallel on the current rayon pool),
    /// so the row-order bytes of a tensor are dropped or released before the next is copied:
    /// memory peaks one tensor above the model. `progress` hears each tensor done. Returns the
    /// bytes reordered.
    pub fn tile_experts(&mut self, progress: &mut dyn FnMut()) -> Result<usize, ModelError> {
        let mut bytes = 0;
        for layer in &mut self.layers {
            for experts in [&mut layer.gate_up, &mut layer.down] {
                if experts.can_tile() {
                    experts.tile()?;
                    bytes += experts.byte_len();
                    progress();
                }
            }
        }
        Ok(bytes)
    }
}

/// Reorders one [rows, cols] matrix into [`Mxfp4Layout::Tiles`] in place. In that layout a tile
/// takes the bytes its 16 rows take in row order, so each tile is rebuilt from a copy of its own
/// rows alone: no second buffer the size of the matrix.
fn tile_in_place(
    rows: usize,
    cols: usize,
    blocks: &mut [u8],
    scales: &mut [u8],
) -> Result<(), ModelError> {
    let tile_bytes = MXFP4_TILE_ROWS * cols / 2;
    let tile_scales = MXFP4_TILE_ROWS * cols / MXFP4_BLOCK;
    debug_assert_eq!(
        Mxfp4Matrix::new_tiled(rows, cols, blocks, scales)?.tile_offsets(1),
        (tile_bytes, tile_scales),
        "a tile's bytes are where its rows were"
    );
    let mut rows_of_tile = vec![0u8; tile_bytes + tile_scales];
    let (row_blocks, row_scales) = rows_of_tile.split_at_mut(tile_bytes);
    for (tile_blocks, tile_scale_bytes) in blocks
        .chunks_exact_mut(tile_bytes)
        .zip(scales.chunks_exact_mut(tile_scales))
    {
        row_blocks.copy_from_slice(tile_blocks);
        row_scales.copy_from_slice(tile_scale_bytes);
        kernels::tile_mxfp4(
            MXFP4_TILE_ROWS,
            cols,
            row_blocks,
            row_scales,
            tile_blocks,
            tile_scale_bytes,
        )?;
    }
    Ok(())
}

fn load_layer(
    config: &ModelConfig,
    source: &impl TensorSource,
    l: usize,
) -> Result<Layer, ModelError> {
    let h = config.hidden_size;
    let p = format!("model.layers.{l}.");
    let linear = |name: &str, rows: usize, cols: usize| -> Result<Linear, ModelError> {
        let weight = format!("{p}{name}.weight");
        // The router stays bf16 on every path; the attention projections are converted.
        let weight = if name == "mlp.router" {
            matrix(source, &weight, rows, cols)?
        } else {
            converted_matrix(source, &weight, rows, cols)?
        };
        Ok(Linear {
            weight,
            bias: vector(source, &format!("{p}{name}.bias"), rows)?,
        })
    };
    let (q, kv) = (config.q_width(), config.kv_width());
    let e = config.num_local_experts;
    let i = config.intermediate_size;
    Ok(Layer {
        kind: config.layer_kinds[l],
        input_norm: vector(source, &format!("{p}input_layernorm.weight"), h)?,
        attention: Attention {
            q: linear("self_attn.q_proj", q, h)?,
            k: linear("self_attn.k_proj", kv, h)?,
            v: linear("self_attn.v_proj", kv, h)?,
            o: linear("self_attn.o_proj", h, q)?,
            sinks: vector(
                source,
                &format!("{p}self_attn.sinks"),
                config.num_attention_heads,
            )?,
        },
        post_attention_norm: vector(source, &format!("{p}post_attention_layernorm.weight"), h)?,
        router: {
            let router = linear("mlp.router", e, h)?;
            // The router is small and picks the experts: a NaN there silently routes every token
            // to the same few experts in the fast path, so it is checked at load.
            finite_bf16(&format!("{p}mlp.router.weight"), router.weight.values())?;
            router
        },
        gate_up: experts(source, &format!("{p}mlp.experts.gate_up_proj"), e, 2 * i, h)?,
        down: experts(source, &format!("{p}mlp.experts.down_proj"), e, h, i)?,
    })
}

fn matrix(
    source: &impl TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Bf16Matrix, ModelError> {
    let (_, bytes) = source.tensor(name, &[rows, cols], &[Dtype::Bf16])?;
    Bf16Matrix::new(name, rows, cols, bytes)
}

/// A matrix the fast path converts to its weight format (attention projections, unembedding),
/// with the source's own Q8 form of it where there is one.
fn converted_matrix(
    source: &impl TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Bf16Matrix, ModelError> {
    let mut converted = matrix(source, name, rows, cols)?;
    converted.set_native_q8(source.q8_matrix(name, rows, cols)?.map(Arc::new))?;
    Ok(converted)
}

/// A small tensor (norm, bias, sinks) widened to f32, checked to hold only finite values.
fn vector(source: &impl TensorSource, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    vector_of_shape(source, name, &[len])
}

fn finite(name: &str, values: &[f32]) -> Result<(), ModelError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(ModelError::NonFinite {
            tensor: name.into(),
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

fn finite_bf16(name: &str, values: &[u16]) -> Result<(), ModelError> {
    let not_finite = |v: &u16| v & 0x7f80 == 0x7f80;
    // A branch-free OR per piece vectorizes; pieces go to the pool (the embedding is 1 GB).
    let any_bad = values
        .par_chunks(1 << 16)
        .any(|piece| piece.iter().fold(false, |bad, v| bad | not_finite(v)));
    if !any_bad {
        return Ok(());
    }
    match values.iter().position(not_finite) {
        Some(index) => Err(ModelError::NonFinite {
            tensor: name.into(),
            index,
            value: bf16_to_f32(values[index]),
        }),
        None => Ok(()),
    }
}

fn vector_of_shape(
    source: &impl TensorSource,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, ModelError> {
    let (dtype, bytes) = source.tensor(name, shape, SMALL)?;
    let values = widen(dtype, bytes.as_slice());
    finite(name, &values)?;
    Ok(values)
}

fn widen(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        _ => bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
    }
}

fn experts(
    source: &impl TensorSource,
    prefix: &str,
    num_experts: usize,
    rows: usize,
    cols: usize,
) -> Result<Mxfp4Experts, ModelError> {
    let nblocks = cols / MXFP4_BLOCK;
    let (_, blocks) = source.tensor(
        &format!("{prefix}_blocks"),
        &[num_experts, rows, nblocks, 16],
        &[Dtype::U8],
    )?;
    let (_, scales) = source.tensor(
        &format!("{prefix}_scales"),
        &[num_experts, rows, nblocks],
        &[Dtype::U8],
    )?;
    // 0xFF is E8M0's NaN: every weight of its block would be NaN. The scales are 1/17 of the
    // experts' bytes and `contains` runs at memory speed, so all of them are checked.
    if scales.as_slice().contains(&0xff) {
        let index = scales
            .as_slice()
            .iter()
            .position(|&s| s == 0xff)
            .unwrap_or(0);
        return Err(ModelError::NanScale {
            tensor: format!("{prefix}_scales"),
            index,
        });
    }
    let bias_name = format!("{prefix}_bias");
    let bias = vector_of_shape(source, &bias_name, &[num_experts, rows])?;
    Mxfp4Experts::new(prefix, [num_experts, rows, cols], blocks, scales, bias)
}

/// The bytes of tensor `name` against what its shape needs.
fn check_bytes(name: &str, found: usize, expected: usize) -> Result<(), ModelError> {
    if found != expected {
        return Err(ModelError::TensorBytes {
            tensor: name.to_string(),
            expected,
            found,
        });
    }
    Ok(())
}

/// FP4 E2M1 values by nibble (bit 3 is the sign).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// 2^(s - 127) for an E8M0 scale byte, exactly.
#[inline]
pub fn e8m0_to_f32(scale: u8) -> f32 {
    if scale == 0 {
        // 2^-127 is subnormal in f32: build it from its bits.
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((scale as u32) << 23)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Little-endian bytes of `values`, placed at byte `offset` of a fresh buffer.
    fn bytes_at(offset: usize, values: &[u16]) -> TensorBytes {
        let mut bytes = vec![0xEEu8; offset];
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        bytes.push(0xEE);
        let end = bytes.len() - 1;
        TensorBytes::new(Arc::new(bytes), offset..end)
    }

    #[test]
    fn a_matrix_at_an_odd_offset_is_copied_to_aligned_memory_value_for_value() {
        let (rows, cols) = (3, 5);
        // Distinct, byte-asymmetric values, so a swapped or shifted byte shows.
        let values: Vec<u16> = (0..rows * cols)
            .map(|i| 0x3F80 + 0x0101 * i as u16)
            .collect();
        let odd = bytes_at(1, &values);
        assert!(odd.as_u16().is_none(), "the test needs a misaligned view");
        let matrix = Bf16Matrix::new("odd", rows, cols, odd).unwrap();
        assert_eq!(matrix.values(), &values[..]);
        assert_eq!(matrix.row(2), &values[10..15]);
        assert_eq!((matrix.rows(), matrix.cols()), (rows, cols));
        assert_eq!(matrix.byte_len(), rows * cols * 2);
        assert_eq!(bf16_to_f32(matrix.row(0)[0]), 1.0);
    }

    #[test]
    fn an_aligned_matrix_is_borrowed_not_copied() {
        let values: Vec<u16> = (0..8).collect();
        let even = bytes_at(2, &values);
        let start = even.as_slice().as_ptr();
        let matrix = Bf16Matrix::new("even", 2, 4, even).unwrap();
        assert_eq!(matrix.values().as_ptr().cast::<u8>(), start);
        assert_eq!(matrix.values(), &values[..]);
    }

    #[test]
    fn shapes_that_do_not_match_the_bytes_are_refused() {
        let Err(err) = Bf16Matrix::new("short", 2, 4, bytes_at(0, &[0; 7])) else {
            panic!("a short matrix was accepted")
        };
        assert!(err.to_string().contains("short"), "{err}");
        let blocks = TensorBytes::from_vec(vec![0; 2 * 3 * 64 / 2]);
        let scales = TensorBytes::from_vec(vec![127; 2 * 3 * 2]);
        assert!(Mxfp4Experts::new(
            "e",
            [2, 3, 64],
            blocks.clone(),
            scales.clone(),
            vec![0.0; 6]
        )
        .is_ok());
        assert!(Mxfp4Experts::new(
            "e",
            [2, 3, 64],
            blocks.clone(),
            scales.clone(),
            vec![0.0; 5]
        )
        .is_err());
        assert!(Mxfp4Experts::new("e", [2, 4, 64], blocks.clone(), scales, vec![0.0; 8]).is_err());
        let Err(err) = Mxfp4Experts::new(
            "e",
            [2, 3, 48],
            blocks,
            TensorBytes::from_vec(vec![]),
            vec![0.0; 6],
        ) else {
            panic!("columns that are not whole blocks were accepted")
        };
        assert!(err.to_string().contains("e_blocks"), "{err}");
    }

    /// Experts of shape [experts, rows, cols] with bytes that differ everywhere.
    fn experts_of(shape: [usize; 3]) -> Mxfp4Experts {
        let [e, rows, cols] = shape;
        let blocks = (0..e * rows * cols / 2).map(|i| (i * 7 + i / 251) as u8);
        let scales = (0..e * rows * cols / 32).map(|i| 100 + (i % 50) as u8);
        Mxfp4Experts::new(
            "e",
            shape,
            TensorBytes::from_vec(blocks.collect()),
            TensorBytes::from_vec(scales.collect()),
            (0..e * rows).map(|i| i as f32).collect(),
        )
        .unwrap()
    }

    /// `experts` with its bytes in aligned heap memory of their own, as generated weights are.
    fn owned_aligned(experts: &Mxfp4Experts) -> Mxfp4Experts {
        let aligned = |bytes: &TensorBytes| {
            let mut copy = AlignedBytes::zeroed(bytes.len());
            copy.as_mut_slice().copy_from_slice(bytes.as_slice());
            TensorBytes::from_aligned(copy)
        };
        Mxfp4Experts {
            blocks: aligned(&experts.blocks),
            scales: aligned(&experts.scales),
            bias: experts.bias.clone(),
            ..*experts
        }
    }

    #[test]
    fn tiled_experts_hold_the_same_values_in_aligned_memory() {
        let rows = experts_of([3, 32, 96]);
        assert!(rows.can_tile() && !rows.is_mapped());
        // A plain Vec is copied; aligned bytes of their own are reordered where they are.
        let mut copied = rows.clone();
        copied.tile().unwrap();
        let mut in_place = owned_aligned(&rows);
        let start = in_place.blocks.as_slice().as_ptr();
        in_place.tile().unwrap();
        assert_eq!(in_place.blocks.as_slice().as_ptr(), start);
        assert_eq!(in_place.blocks.as_slice(), copied.blocks.as_slice());
        assert_eq!(in_place.scales.as_slice(), copied.scales.as_slice());
        // Shared bytes are copied, not written under the other reader.
        let mut shared = owned_aligned(&rows);
        let other = shared.clone();
        shared.tile().unwrap();
        assert_eq!(other.blocks.as_slice(), rows.blocks.as_slice());
        assert_eq!(shared.blocks.as_slice(), copied.blocks.as_slice());

        let tiled = copied;
        assert_eq!(tiled.layout(), Mxfp4Layout::Tiles);
        assert!(!tiled.can_tile(), "tiles are not tiled again");
        assert_eq!(tiled.blocks.as_slice().as_ptr() as usize % 64, 0);
        assert_eq!(tiled.scales.as_slice().as_ptr() as usize % 64, 0);
        assert_eq!(tiled.byte_len(), rows.byte_len());
        let (mut want, mut got) = (vec![0.0; 96], vec![0.0; 96]);
        for e in 0..3 {
            assert_eq!(tiled.bias(e), rows.bias(e));
            assert_ne!(tiled.blocks(e), rows.blocks(e), "the bytes were reordered");
            for r in 0..32 {
                rows.matrix(e).dequantize_row(r, &mut want).unwrap();
                tiled.matrix(e).dequantize_row(r, &mut got).unwrap();
                assert_eq!(want, got, "expert {e} row {r}");
            }
        }
    }

    #[test]
    fn experts_whose_rows_are_not_whole_tiles_stay_in_row_order() {
        let mut weights = Weights {
            embed: Bf16Matrix::new("m", 1, 1, bytes_at(0, &[0])).unwrap(),
            layers: Vec::new(),
            final_norm: Vec::new(),
            lm_head: Bf16Matrix::new("m", 1, 1, bytes_at(0, &[0])).unwrap(),
        };
        assert!(!experts_of([2, 24, 64]).can_tile());
        let attention = || Linear {
            weight: Bf16Matrix::new("m", 1, 1, bytes_at(0, &[0])).unwrap(),
            bias: Vec::new(),
        };
        weights.layers.push(Layer {
            kind: LayerKind::Full,
            input_norm: Vec::new(),
            attention: Attention {
                q: attention(),
                k: attention(),
                v: attention(),
                o: attention(),
                sinks: Vec::new(),
            },
            post_attention_norm: Vec::new(),
            router: attention(),
            gate_up: experts_of([2, 48, 64]),
            down: experts_of([2, 24, 64]),
        });
        assert_eq!(weights.tileable_expert_tensors(), 1);
        assert_eq!(weights.tileable_mapped_bytes(), 0);
        let mut done = 0;
        let bytes = weights.tile_experts(&mut || done += 1).unwrap();
        assert_eq!(bytes, experts_of([2, 48, 64]).byte_len());
        assert_eq!(done, 1);
        let layer = &weights.layers[0];
        assert_eq!(layer.gate_up.layout(), Mxfp4Layout::Tiles);
        assert_eq!(layer.down.layout(), Mxfp4Layout::Rows);
        assert_eq!(layer.down.blocks(1), experts_of([2, 24, 64]).blocks(1));
    }

    #[test]
    fn e8m0_scales_are_powers_of_two() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(128), 2.0);
        assert_eq!(e8m0_to_f32(120), 2f32.powi(-7));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
    }
}
