//! Weight conversion for the fast path: the attention projections and the unembedding in the
//! chosen [`WeightFormat`], built once at load (and again when the setting changes). Experts stay
//! MXFP4, in the mapping or reordered into tiles at load (`Weights::tile_experts`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::MXFP4_BLOCK;
use super::options::WeightFormat;
use super::weights::{Bf16Matrix, Weights};
use super::ModelError;
use crate::kernels::{Q4Matrix, Q8Matrix, MXFP4_TILE_ROWS};

/// A dense weight matrix in one of the [`WeightFormat`]s.
pub enum DenseMatrix {
    Bf16(Bf16Matrix),
    /// Shared with the [`Bf16Matrix`] it came from when the file stored it as Q8 (GGUF Q8_0).
    Q8(Arc<Q8Matrix>),
    Q4(Q4Matrix),
}

impl DenseMatrix {
    /// `tile_q8`: reorder Q8 matrices the conversion makes into the tile layout
    /// ([`Q8Matrix::to_tiles`]) where their rows fill whole tiles. A file's own Q8 blocks stay
    /// in row order: they are shared with the bf16 matrix they came from, so a tiled copy
    /// would hold them twice.
    fn convert(
        matrix: &Bf16Matrix,
        format: WeightFormat,
        tile_q8: bool,
    ) -> Result<Self, ModelError> {
        // Quantized blocks need whole blocks of 32 inputs; other widths stay exact.
        if format == WeightFormat::Native || !matrix.cols().is_multiple_of(MXFP4_BLOCK) {
            return Ok(DenseMatrix::Bf16(matrix.clone()));
        }
        // The file's own Q8 blocks: quantizing their bf16 rounding again would only add error.
        if let (WeightFormat::Q8, Some(native)) = (format, matrix.native_q8()) {
            return Ok(DenseMatrix::Q8(native.clone()));
        }
        let quantized = match format {
            WeightFormat::Q8 => Q8Matrix::from_bf16(matrix.rows(), matrix.cols(), matrix.values())
                .and_then(|m| {
                    if tile_q8 && m.rows().is_multiple_of(MXFP4_TILE_ROWS) {
                        m.to_tiles()
                    } else {
                        Ok(m)
                    }
                })
                .map(|m| DenseMatrix::Q8(Arc::new(m))),
            _ => Q4Matrix::from_bf16(matrix.rows(), matrix.cols(), matrix.values())
                .map(DenseMatrix::Q4),
        };
        quantized.map_err(|e| ModelError::Quantize(e.to_string()))
    }

    pub fn rows(&self) -> usize {
        match self {
            DenseMatrix::Bf16(m) => m.rows(),
            DenseMatrix::Q8(m) => m.rows(),
            DenseMatrix::Q4(m) => m.rows(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            DenseMatrix::Bf16(m) => m.cols(),
            DenseMatrix::Q8(m) => m.cols(),
            DenseMatrix::Q4(m) => m.cols(),
        }
    }

    /// Bytes a full pass over the matrix reads.
    pub fn byte_len(&self) -> usize {
        match self {
            DenseMatrix::Bf16(m) => m.byte_len(),
            DenseMatrix::Q8(m) => m.size_bytes(),
            DenseMatrix::Q4(m) => m.size_bytes(),
        }
    }

    /// Bytes held outside the checkpoint mapping.
    fn owned_bytes(&self) -> usize {
        match self {
            DenseMatrix::Bf16(_) => 0,
            other => other.byte_len(),
        }
    }

    /// Whether products with this matrix take int8 activations (bf16 ones take f32).
    pub fn needs_quantized_input(&self) -> bool {
        !matches!(self, DenseMatrix::Bf16(_))
    }
}

/// One layer's attention projections in the chosen format.
pub struct FastLayer {
    pub q: DenseMatrix,
    pub k: DenseMatrix,
    pub v: DenseMatrix,
    pub o: DenseMatrix,
}

/// The dense weights in the chosen format, built once at load (or again when the setting changes).
pub struct FastWeights {
    pub format: WeightFormat,
    pub layers: Vec<FastLayer>,
    pub lm_head: DenseMatrix,
    /// Time the conversion took.
    pub convert_time: Duration,
    /// Time reordering the experts into tiles took before the conversion (zero when they were
    /// not), and the bytes reordered.
    pub tile_time: Duration,
    pub tiled_bytes: usize,
    /// Where the tiled experts are.
    pub tile_source: super::tile_cache::TileSource,
    /// Why the tile cache was not used, when it was meant to be (the tiles were copied instead).
    pub tile_cache_note: Option<String>,
    /// Memory the converted weights take outside the mapping.
    pub owned_bytes: usize,
}

impl FastWeights {
    /// How many matrices [`FastWeights::build`] converts (its progress total).
    pub fn matrix_count(weights: &Weights) -> usize {
        weights.layers.len() * 4 + 1
    }

    /// Converts the attention projections and the unembedding to `format` on the current rayon
    /// pool (callers install the session's: the engine, the CLI), Q8 in tiles if `tile_q8`. `progress` hears
    /// (matrices done, matrices in all). Quantizing reads the bf16 source once; its pages of the
    /// mapping are released afterwards so they do not count twice.
    pub fn build(
        weights: &Weights,
        format: WeightFormat,
        tile_q8: bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<FastWeights, ModelError> {
        let started = Instant::now();
        let total = Self::matrix_count(weights);
        let mut done = 0;
        let mut step = |m: &Bf16Matrix| -> Result<DenseMatrix, ModelError> {
            let converted = DenseMatrix::convert(m, format, tile_q8)?;
            if converted.needs_quantized_input() {
                m.release_pages();
            }
            done += 1;
            progress(done, total);
            Ok(converted)
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for layer in &weights.layers {
            let a = &layer.attention;
            layers.push(FastLayer {
                q: step(&a.q.weight)?,
                k: step(&a.k.weight)?,
                v: step(&a.v.weight)?,
                o: step(&a.o.weight)?,
            });
        }
        let lm_head = step(&weights.lm_head)?;
        let owned_bytes = layers
            .iter()
            .flat_map(|l| [&l.q, &l.k, &l.v, &l.o])
            .map(|m| m.owned_bytes())
            .sum::<usize>()
            + lm_head.owned_bytes();
        Ok(FastWeights {
            format,
            layers,
            lm_head,
            convert_time: started.elapsed(),
            tile_time: Duration::ZERO,
            tiled_bytes: 0,
            tile_source: super::tile_cache::TileSource::None,
            tile_cache_note: None,
            owned_bytes,
        })
    }
}
