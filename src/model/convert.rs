//! Weight conversion for the fast path: the attention projections and the unembedding in the
//! chosen [`WeightFormat`], built once at load (and again when the setting changes). Experts stay
//! MXFP4, in the mapping or reordered into tiles at load (`Weights::tile_experts`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::config::MXFP4_BLOCK;
use super::options::{Unembedding, WeightFormat, DRAFT_CANDIDATES};
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
    /// `tiles`: reorder the Q8 and Q4 matrices the conversion makes into their tile layouts
    /// ([`Q8Matrix::to_tiles`], [`Q4Matrix::to_tiles`]) where their rows fill whole tiles. A
    /// file's own Q8 blocks stay in row order: they are shared with the bf16 matrix they came
    /// from, so a tiled copy would hold them twice.
    fn convert(
        matrix: &Bf16Matrix,
        format: WeightFormat,
        tiles: TileChoices,
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
                    if tiles.q8 && m.rows().is_multiple_of(MXFP4_TILE_ROWS) {
                        m.to_tiles()
                    } else {
                        Ok(m)
                    }
                })
                .map(|m| DenseMatrix::Q8(Arc::new(m))),
            _ => q4_matrix(matrix, tiles.q4).map(DenseMatrix::Q4),
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

    /// Bytes computing one row alone reads: a tiled Q8 matrix's kernels compute whole tiles.
    pub fn row_read_bytes(&self) -> usize {
        let rows = match self {
            DenseMatrix::Q8(m) if m.is_tiled() => MXFP4_TILE_ROWS,
            _ => 1,
        };
        self.byte_len() / self.rows().max(1) * rows
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

/// The q4 copy of the unembedding a two-stage unembedding scores every row with (see
/// [`Unembedding::TwoStage`]).
pub struct DraftUnembedding {
    /// Always [`DenseMatrix::Q4`].
    pub matrix: DenseMatrix,
    /// Rows per decoded token recomputed with the session's `lm_head`.
    pub candidates: usize,
}

impl DraftUnembedding {
    /// Whether a fast-path unembedding in `format`, `cols` wide, gets a draft: a q4 copy only
    /// lightens one held in a wider format, and q4 needs whole blocks of 32 inputs.
    pub fn applies(unembedding: Unembedding, format: WeightFormat, cols: usize) -> bool {
        unembedding == Unembedding::TwoStage
            && format != WeightFormat::Q4
            && cols.is_multiple_of(MXFP4_BLOCK)
    }
}

/// `matrix` quantized to Q4, in the tile layout when `tile` says so and its rows fill whole
/// tiles (the row-order copy is dropped at once).
fn q4_matrix(matrix: &Bf16Matrix, tile: bool) -> Result<Q4Matrix, crate::kernels::KernelError> {
    let m = Q4Matrix::from_bf16(matrix.rows(), matrix.cols(), matrix.values())?;
    if tile && m.rows().is_multiple_of(MXFP4_TILE_ROWS) {
        m.to_tiles()
    } else {
        Ok(m)
    }
}

/// Which quantized matrices [`FastWeights::build`] reorders into tiles: those the kernels have
/// tile products for ([`crate::kernels::Kernels::prefers_tiled_q8`] and `_q4`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TileChoices {
    pub q8: bool,
    pub q4: bool,
}

impl TileChoices {
    /// What these kernels prefer.
    pub fn for_kernels(kernels: &crate::kernels::Kernels) -> Self {
        Self {
            q8: kernels.prefers_tiled_q8(),
            q4: kernels.prefers_tiled_q4(),
        }
    }
}

/// What [`FastWeights::build`] makes besides the format.
#[derive(Debug, Clone, Copy)]
pub struct BuildChoices {
    /// Reorder quantized matrices into tiles (see [`DenseMatrix::convert`]).
    pub tiles: TileChoices,
    pub unembedding: Unembedding,
    /// Candidates per row of a two-stage unembedding (`None`: [`DRAFT_CANDIDATES`]).
    pub draft_candidates: Option<usize>,
}

/// The dense weights in the chosen format, built once at load (or again when the setting changes).
pub struct FastWeights {
    pub format: WeightFormat,
    pub layers: Vec<FastLayer>,
    pub lm_head: DenseMatrix,
    /// Present for a two-stage unembedding.
    pub draft: Option<DraftUnembedding>,
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
    pub fn matrix_count(
        weights: &Weights,
        format: WeightFormat,
        unembedding: Unembedding,
    ) -> usize {
        let draft = DraftUnembedding::applies(unembedding, format, weights.lm_head.cols());
        weights.layers.len() * 4 + 1 + usize::from(draft)
    }

    /// Converts the attention projections and the unembedding to `format` on the current rayon
    /// pool (callers install the session's: the engine, the CLI), with the draft a two-stage
    /// unembedding reads. `progress` hears (matrices done, matrices in all). Quantizing reads the
    /// bf16 source once; its pages of the mapping are released afterwards so they do not count
    /// twice.
    pub fn build(
        weights: &Weights,
        format: WeightFormat,
        choices: BuildChoices,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<FastWeights, ModelError> {
        let started = Instant::now();
        let total = Self::matrix_count(weights, format, choices.unembedding);
        let tiles = choices.tiles;
        let mut done = 0;
        // Before the unembedding's own conversion, which releases the pages of its source.
        let draft =
            if DraftUnembedding::applies(choices.unembedding, format, weights.lm_head.cols()) {
                let matrix = q4_matrix(&weights.lm_head, tiles.q4)
                    .map(DenseMatrix::Q4)
                    .map_err(|e| ModelError::Quantize(e.to_string()))?;
                done += 1;
                progress(done, total);
                Some(DraftUnembedding {
                    matrix,
                    candidates: choices
                        .draft_candidates
                        .unwrap_or(DRAFT_CANDIDATES)
                        .clamp(1, weights.lm_head.rows()),
                })
            } else {
                None
            };
        let mut step = |m: &Bf16Matrix| -> Result<DenseMatrix, ModelError> {
            let converted = DenseMatrix::convert(m, format, tiles)?;
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
            + lm_head.owned_bytes()
            + draft.as_ref().map_or(0, |d| d.matrix.owned_bytes());
        Ok(FastWeights {
            format,
            layers,
            lm_head,
            draft,
            convert_time: started.elapsed(),
            tile_time: Duration::ZERO,
            tiled_bytes: 0,
            tile_source: super::tile_cache::TileSource::None,
            tile_cache_note: None,
            owned_bytes,
        })
    }
}
