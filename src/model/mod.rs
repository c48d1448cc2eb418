//! The model: checkpoint files, weights in memory, and the forward pass over a KV cache.

pub mod checkpoint;
pub mod config;
pub mod convert;
pub mod exact;
pub mod fast;
pub mod gguf;
#[doc(hidden)]
pub mod gguf_builder;
pub mod kv;
pub mod memory;
pub mod ollama;
pub mod ops;
pub mod options;
pub mod profile;
pub mod rope;
pub mod session;
pub mod snapshot;
pub mod synthetic;
pub mod team;
pub mod tile_cache;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::ThreadPool;

pub use config::{LayerKind, ModelConfig, Preset, RopeScaling};
pub use convert::FastWeights;
pub use options::{
    ActivationFormat, AttentionArithmetic, ExpertLayout, KvFormat, LoadOptions, Precision,
    TileCache, Unembedding, WeightFormat,
};

/// What attention's products run on in a session (see [`Model::attention_products_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionProducts {
    F32,
    /// bf16 dot products over the f16 cache (AVX-512 BF16).
    Bf16,
    /// int8 dot products over the int8 cache (AVX-512 VNNI).
    Int8,
}

impl AttentionProducts {
    /// `bf16` or `int8`; nothing for f32, the reference arithmetic.
    pub fn name(self) -> Option<&'static str> {
        match self {
            AttentionProducts::F32 => None,
            AttentionProducts::Bf16 => Some("bf16"),
            AttentionProducts::Int8 => Some("int8"),
        }
    }
}
pub use session::{AllLogits, ForwardError, Sequence, SequenceStep, Session};
pub use snapshot::{KvSnapshot, SnapshotError};
pub use weights::Weights;

use checkpoint::Checkpoint;
use convert::BuildChoices;
use rope::RopeTable;

/// Everything that can go wrong turning files into a model. Each variant names the file, key or
/// tensor at fault and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model directory {0} does not exist")]
    MissingDir(PathBuf),
    #[error(
        "{0} holds no weights: expected model.safetensors.index.json or model.safetensors \
         (download with: huggingface-cli download openai/gpt-oss-20b --local-dir DIR)"
    )]
    NoWeights(PathBuf),
    #[error("{index} names shard {shard}, which does not exist")]
    MissingShard { index: PathBuf, shard: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    BadIndex { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    BadShard { path: PathBuf, message: String },
    #[error("{file}: key \"{key}\": {message}")]
    Config {
        file: String,
        key: String,
        message: String,
    },
    #[error("tensor {tensor} is missing from the checkpoint in {dir}")]
    MissingTensor { tensor: String, dir: PathBuf },
    #[error("tensor {tensor} has dtype {found}; expected {expected}")]
    WrongDtype {
        tensor: String,
        expected: String,
        found: String,
    },
    #[error("tensor {tensor} holds {found} bytes; its shape needs {expected}")]
    TensorBytes {
        tensor: String,
        expected: usize,
        found: usize,
    },
    #[error("tensor {tensor} has shape {found:?}; expected {expected:?}")]
    WrongShape {
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {message}")]
    Serialize { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    BadGguf { path: PathBuf, message: String },
    #[error("{name}: {message}")]
    Ollama { name: String, message: String },
    #[error("{0}")]
    Memory(String),
    #[error("cannot convert the weights: {0}")]
    Quantize(String),
    #[error("{0}")]
    Kernels(#[from] crate::kernels::KernelError),
    #[error(transparent)]
    Changed(#[from] crate::fault::MappingChanged),
    #[error("tensor {tensor} holds {value} at element {index}: the checkpoint is corrupt (scan it all with `ossterm info --check`)")]
    NonFinite {
        tensor: String,
        index: usize,
        value: f32,
    },
    #[error("tensor {tensor} holds the MXFP4 scale byte 0xFF (E8M0's NaN) at element {index}: the checkpoint is corrupt (scan it all with `ossterm info --check`)")]
    NanScale { tensor: String, index: usize },
}

/// What a model load is busy with, for progress reports (`done` and `total` in the stage's unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadStage {
    /// Mapping the checkpoint and checking its tensors (one step).
    Mapping,
    /// Generating synthetic weights (bytes).
    Generating,
    /// Converting weights to the chosen format (matrices).
    Converting,
}

/// Receives (stage, done, total).
pub type LoadProgress<'a> = dyn FnMut(LoadStage, u64, u64) + 'a;

/// The file or directory a `--model` value names: `ollama:NAME:TAG` becomes the GGUF blob in
/// ollama's store; any other value is a path, returned as is.
pub fn resolve_model_path(spec: &Path) -> Result<PathBuf, ModelError> {
    match spec.to_str() {
        Some(s) if s.starts_with(ollama::PREFIX) && !spec.exists() => {
            let models = ollama::models_dir().ok_or_else(|| ModelError::Ollama {
                name: s.to_owned(),
                message: "neither OLLAMA_MODELS nor HOME is set".into(),
            })?;
            ollama::resolve(s, &models)
        }
        _ => Ok(spec.to_owned()),
    }
}

/// Whether `spec` names something [`Model::load`] can try: a checkpoint directory with its
/// config.json, a GGUF file, or an `ollama:` name (whose resolution reports its own errors).
pub fn looks_loadable(spec: &Path) -> bool {
    let ollama_name = spec
        .to_str()
        .is_some_and(|s| s.starts_with(ollama::PREFIX) && !spec.exists());
    ollama_name || (spec.is_file() && gguf::is_gguf(spec)) || spec.join("config.json").is_file()
}

/// A loaded model: configuration, weights and the tables every session shares.
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub rope: RopeTable,
    pub precision: Precision,
    /// The fast path's converted weights (`None` in exact mode).
    pub fast: Option<FastWeights>,
    pub kv_format: KvFormat,
    /// The activation format new sessions start with; each session can switch its own.
    pub activations: ActivationFormat,
    pub kernels: crate::kernels::Kernels,
    /// The attention arithmetic asked for (already applied to `kernels`).
    attention: AttentionArithmetic,
    /// The expert layout asked for; [`Mxfp4Experts::layout`](weights::Mxfp4Experts::layout)
    /// tells what each tensor got.
    pub expert_layout: ExpertLayout,
    /// Where tiles of mapped experts are kept, as asked for.
    pub tile_cache: TileCache,
    /// The unembedding asked for; `fast.draft` tells whether it got a draft (a q4 weight format
    /// has none: it is the draft's format).
    pub unembedding: Unembedding,
    /// Names this checkpoint's file in the tile cache (`None`: not a mapped checkpoint).
    pub tile_key: Option<tile_cache::CacheKey>,
    /// Where the weights came from, for display ("synthetic 20b (random weights)" or a path).
    pub source: String,
    /// Identifies the weights: a hash of config.json and the tensor headers, or of the synthetic
    /// preset and seed. KV snapshots carry it (with the formats) so one never meets other weights.
    pub fingerprint: u64,
}

impl Model {
    /// Loads a Hugging Face gpt-oss checkpoint directory (config.json + safetensors shards), a GGUF
    /// file, or an `ollama:NAME:TAG` model (see [`resolve_model_path`]).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Model, ModelError> {
        Model::load_with_progress(dir, opts, &mut |_, _, _| {})
    }

    /// [`Model::load`], reporting progress.
    pub fn load_with_progress(
        dir: &Path,
        opts: &LoadOptions,
        progress: &mut LoadProgress<'_>,
    ) -> Result<Model, ModelError> {
        progress(LoadStage::Mapping, 0, 1);
        let resolved = resolve_model_path(dir)?;
        if gguf::is_gguf(&resolved) {
            let source = gguf::GgufSource::new(gguf::GgufFile::open(&resolved)?);
            let config = source.file.config()?;
            let weights = Weights::load(&config, &source)?;
            let name = if resolved == dir {
                dir.display().to_string()
            } else {
                format!("{} ({})", dir.display(), resolved.display())
            };
            let identity = (name, source.file.fingerprint());
            return Model::from_parts(config, weights, opts, identity, None, &mut |done, total| {
                progress(LoadStage::Converting, done as u64, total as u64)
            });
        }
        if !dir.is_dir() {
            return Err(ModelError::MissingDir(dir.to_owned()));
        }
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(ModelError::Io {
                path: config_path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
            });
        }
        let config = ModelConfig::from_file(&config_path)?;
        let checkpoint = Checkpoint::open(dir)?;
        let weights = Weights::load(&config, &checkpoint)?;
        let config_bytes = std::fs::read(&config_path).map_err(|source| ModelError::Io {
            path: config_path.clone(),
            source,
        })?;
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&config_bytes);
        hasher.update(&checkpoint.fingerprint().to_le_bytes());
        let fingerprint = hasher.digest();
        let tile_key =
            tile_cache::CacheKey::of_checkpoint(dir, fingerprint, checkpoint.shard_paths());
        Model::from_parts(
            config,
            weights,
            opts,
            (dir.display().to_string(), fingerprint),
            tile_key,
            &mut |done, total| progress(LoadStage::Converting, done as u64, total as u64),
        )
    }

    /// A model of `preset`'s shape with random weights, built in memory.
    pub fn synthetic(preset: Preset, seed: u64, opts: &LoadOptions) -> Result<Model, ModelError> {
        Model::synthetic_with_progress(preset, seed, opts, &mut |_, _, _| {})
    }

    /// [`Model::synthetic`], reporting progress (generating the 20b shape takes a while).
    pub fn synthetic_with_progress(
        preset: Preset,
        seed: u64,
        opts: &LoadOptions,
        progress: &mut LoadProgress<'_>,
    ) -> Result<Model, ModelError> {
        let config = preset.config();
        let source = synthetic::SyntheticSource::new(config.clone(), seed);
        let weights = {
            let mut generated = |done, total| progress(LoadStage::Generating, done, total);
            let reporting = synthetic::Reporting::new(&source, &mut generated);
            Weights::load(&config, &reporting)?
        };
        let fingerprint = xxhash_rust::xxh3::xxh3_64(
            format!("synthetic {} seed {seed}: {config:?}", preset.name()).as_bytes(),
        );
        Model::from_parts(
            config,
            weights,
            opts,
            (
                format!("synthetic {} (random weights)", preset.name()),
                fingerprint,
            ),
            None,
            &mut |done, total| progress(LoadStage::Converting, done as u64, total as u64),
        )
    }

    fn from_parts(
        config: ModelConfig,
        mut weights: Weights,
        opts: &LoadOptions,
        (source, fingerprint): (String, u64),
        tile_key: Option<tile_cache::CacheKey>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let rope = RopeTable::new(&config);
        let path = opts.kernels.unwrap_or_else(crate::kernels::kernel_path);
        let kernels = opts.attention.apply(crate::kernels::Kernels::new(path)?);
        let fast = match opts.precision {
            Precision::Exact => None,
            Precision::Fast => {
                let tile = memory::tiles_experts(
                    opts,
                    weights.tileable_mapped_bytes(),
                    memory::SystemMemory::read(),
                );
                // Reordering and converting report as one stage: tensors, then matrices.
                let tensors = if tile {
                    weights.tileable_expert_tensors()
                } else {
                    0
                };
                let total =
                    tensors + FastWeights::matrix_count(&weights, opts.weights, opts.unembedding);
                let started = std::time::Instant::now();
                let (mut tile_source, mut tile_cache_note) = (tile_cache::TileSource::None, None);
                let tiled_bytes = if tile {
                    let mapped = weights.tileable_mapped_bytes();
                    let cache = tile_key.filter(|_| mapped > 0).and_then(|key| {
                        tile_cache::cache_dir(&opts.tile_cache, mapped).map(|dir| (dir, key))
                    });
                    let mut done = 0;
                    let cached = cache.map(|(dir, key)| {
                        tile_cache::tile_through_cache(&mut weights, &dir, key, &mut || {
                            done += 1;
                            progress(done, total);
                        })
                    });
                    match cached {
                        Some(Ok((bytes, source))) => {
                            tile_source = source;
                            bytes
                        }
                        other => {
                            // The cache is an optimization: whatever went wrong with it, the
                            // tiles are copied as without one.
                            tile_cache_note = other.and_then(Result::err);
                            tile_source = if mapped > 0 {
                                tile_cache::TileSource::Copied
                            } else {
                                tile_cache::TileSource::InPlace
                            };
                            let mut done = 0;
                            weights.tile_experts(&mut || {
                                done += 1;
                                progress(done, total);
                            })?
                        }
                    }
                } else {
                    0
                };
                let tile_time = started.elapsed();
                let choices = BuildChoices {
                    tiles: convert::TileChoices::for_kernels(&kernels),
                    unembedding: opts.unembedding,
                    draft_candidates: opts.draft_candidates,
                };
                let fast = FastWeights::build(&weights, opts.weights, choices, &mut |done, _| {
                    progress(tensors + done, total)
                })?;
                Some(FastWeights {
                    tile_time,
                    tiled_bytes,
                    tile_source,
                    tile_cache_note,
                    ..fast
                })
            }
        };
        Ok(Model {
            config,
            weights,
            rope,
            precision: opts.precision,
            fast,
            kv_format: match opts.precision {
                Precision::Exact => KvFormat::F32,
                Precision::Fast => opts.kv,
            },
            activations: opts.activations,
            kernels,
            attention: opts.attention,
            expert_layout: opts.expert_layout,
            tile_cache: opts.tile_cache.clone(),
            unembedding: opts.unembedding,
            tile_key,
            source,
            fingerprint,
        })
    }

    /// The same checkpoint with other options: the mapping is shared, only converted weights are
    /// built anew (`progress` hears matrices done / in all). The old model keeps serving meanwhile.
    pub fn reconfigured(
        &self,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model, ModelError> {
        let (config, weights) = (self.config.clone(), self.weights.clone());
        let identity = (self.source.clone(), self.fingerprint);
        Model::from_parts(config, weights, opts, identity, self.tile_key, progress)
    }

    /// The options this model was built with.
    pub fn options(&self) -> LoadOptions {
        LoadOptions {
            precision: self.precision,
            weights: self
                .fast
                .as_ref()
                .map(|f| f.format)
                .unwrap_or(WeightFormat::Native),
            kv: self.kv_format,
            activations: self.activations,
            kernels: Some(self.kernels.path()),
            attention: self.attention,
            expert_layout: self.expert_layout,
            tile_cache: self.tile_cache.clone(),
            unembedding: self.unembedding,
            draft_candidates: self
                .fast
                .as_ref()
                .and_then(|f| f.draft.as_ref())
                .map(|d| d.candidates),
        }
    }

    /// What new sessions' attention multiplies on: bf16 dot products over the default f16 cache
    /// where the kernels choose them for this CPU, int8 ones over the int8 cache on the AVX-512
    /// path, f32 otherwise (always with `q8x2` activations, the precise setting).
    pub fn attention_products(&self) -> AttentionProducts {
        self.attention_products_with(self.attention, self.activations, self.kv_format)
    }

    /// Whether new sessions' bf16 attention runs its products on the AMX matrix unit
    /// ([`crate::kernels::Kernels::uses_amx_attention`]).
    pub fn attention_on_matrix_unit(&self) -> bool {
        self.attention_products() == AttentionProducts::Bf16
            && self
                .activations
                .attention_kernels(self.attention.apply(self.kernels))
                .uses_amx_attention()
    }

    /// The attention arithmetic the model was loaded with: new sessions' (a session may change
    /// its own, [`Session::set_attention`]).
    pub fn attention(&self) -> AttentionArithmetic {
        self.attention
    }

    /// What a session with this attention arithmetic, activations and cache multiplies on in
    /// attention: the one place that decides (labels, descriptions and snapshot identities ask
    /// here).
    pub fn attention_products_with(
        &self,
        attention: AttentionArithmetic,
        activations: ActivationFormat,
        kv: KvFormat,
    ) -> AttentionProducts {
        let kernels = activations.attention_kernels(attention.apply(self.kernels));
        let head_dim = self.config.head_dim;
        match kv {
            _ if self.fast.is_none() => AttentionProducts::F32,
            KvFormat::F16 if crate::kernels::attention::runs_bf16(kernels, head_dim) => {
                AttentionProducts::Bf16
            }
            KvFormat::Q8 if crate::kernels::attention::runs_int8(kernels, head_dim) => {
                AttentionProducts::Int8
            }
            _ => AttentionProducts::F32,
        }
    }

    /// A short description of the weight formats, for the UI and the benchmark.
    pub fn weights_description(&self) -> String {
        match &self.fast {
            None => "bf16 (exact)".into(),
            Some(fast) => {
                let draft = match &fast.draft {
                    Some(draft) => format!(
                        ", unembedding two-stage (q4 draft, {} candidates)",
                        draft.candidates
                    ),
                    None => String::new(),
                };
                let attention = match self.attention_products().name() {
                    Some(name) if self.attention_on_matrix_unit() => {
                        format!(", attention on {name} tile products (AMX)")
                    }
                    Some(name) => format!(", attention on {name} dot products"),
                    None => String::new(),
                };
                format!(
                    "experts mxfp4 x {} activations, rest {}{draft}{attention}",
                    self.activations.name(),
                    fast.format.name(),
                )
            }
        }
    }

    /// A session with room for `context_limit` tokens and the model's KV format, computing on
    /// `pool`.
    pub fn new_session(self: &Arc<Self>, pool: &Arc<ThreadPool>, context_limit: usize) -> Session {
        Session::new(self.clone(), pool.clone(), context_limit, self.kv_format)
    }

    /// A session whose KV cache holds `kv` elements (the exact path always keeps f32).
    pub fn new_session_with_kv(
        self: &Arc<Self>,
        pool: &Arc<ThreadPool>,
        context_limit: usize,
        kv: KvFormat,
    ) -> Session {
        Session::new(self.clone(), pool.clone(), context_limit, kv)
    }

    /// The experts' FP4 codes, layer by layer (gate_up, then down): most of the memory decode
    /// streams, on the pages it streams them from (what `bench`'s bandwidth probe reads).
    pub fn expert_bytes(&self) -> impl Iterator<Item = &[u8]> {
        self.weights
            .layers
            .iter()
            .flat_map(|layer| [layer.gate_up.all_blocks(), layer.down.all_blocks()])
    }

    /// Bytes one decoded token reads from memory with `context` tokens in the cache: every dense
    /// weight, the routed experts, the lm_head, one embedding row and the visible KV cache.
    /// Decode is bound by this traffic, so bandwidth / this is the speed ceiling.
    pub fn decode_bytes_per_token(&self, context: usize) -> u64 {
        let c = &self.config;
        let w = &self.weights;
        let kv_bytes_per_position =
            2 * c.num_key_value_heads * self.kv_format.row_bytes(c.head_dim);
        let lm_head = match &self.fast {
            Some(FastWeights {
                draft: Some(draft),
                lm_head,
                ..
            }) => draft.matrix.byte_len() + draft.candidates * lm_head.row_read_bytes(),
            Some(fast) => fast.lm_head.byte_len(),
            None => w.lm_head.byte_len(),
        };
        let mut total = (lm_head + w.embed.byte_len() / c.vocab_size) as u64;
        for (l, layer) in w.layers.iter().enumerate() {
            let a = &layer.attention;
            let biases = [&a.q, &a.k, &a.v, &a.o, &layer.router]
                .iter()
                .map(|l| 4 * l.bias.len())
                .sum::<usize>();
            let projections = match &self.fast {
                Some(fast) => {
                    let f = &fast.layers[l];
                    [&f.q, &f.k, &f.v, &f.o]
                        .iter()
                        .map(|m| m.byte_len())
                        .sum::<usize>()
                }
                None => [&a.q, &a.k, &a.v, &a.o]
                    .iter()
                    .map(|l| l.weight.byte_len())
                    .sum(),
            };
            let dense = biases + projections + layer.router.weight.byte_len();
            let per_expert =
                (layer.gate_up.byte_len() + layer.down.byte_len()) / c.num_local_experts;
            let visible = match layer.kind {
                LayerKind::Sliding => context.min(c.sliding_window),
                LayerKind::Full => context,
            };
            total += (dense + per_expert * c.num_experts_per_tok + visible * kv_bytes_per_position)
                as u64;
        }
        total
    }
}
