//! The model: checkpoint files, weights in memory, and the forward pass over a KV cache.

pub mod checkpoint;
pub mod config;
pub mod forward;
pub mod rope;
pub mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use config::{LayerKind, ModelConfig, Preset, RopeScaling};
pub use forward::{ForwardError, Session};
pub use weights::Weights;

use checkpoint::Checkpoint;
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
}

/// How the forward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 activations against exactly dequantized weights: the reference every faster path is
    /// checked against.
    #[default]
    Exact,
}

/// Options that shape a loaded model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub precision: Precision,
}

/// A loaded model: configuration, weights and the tables every session shares.
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub rope: RopeTable,
    pub precision: Precision,
    /// Where the weights came from, for display ("synthetic 20b (random weights)" or a path).
    pub source: String,
}

impl Model {
    /// Loads a Hugging Face gpt-oss checkpoint directory (config.json + safetensors shards).
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Model, ModelError> {
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
        Ok(Model::from_parts(
            config,
            weights,
            opts,
            dir.display().to_string(),
        ))
    }

    /// A model of `preset`'s shape with random weights, built in memory.
    pub fn synthetic(preset: Preset, seed: u64, opts: &LoadOptions) -> Model {
        let config = preset.config();
        let source = synthetic::SyntheticSource::new(config.clone(), seed);
        let weights = Weights::load(&config, &source)
            .expect("synthetic tensors are generated with the shapes the loader asks for");
        Model::from_parts(
            config,
            weights,
            opts,
            format!("synthetic {} (random weights)", preset.name()),
        )
    }

    fn from_parts(
        config: ModelConfig,
        weights: Weights,
        opts: &LoadOptions,
        source: String,
    ) -> Model {
        let rope = RopeTable::new(&config);
        Model {
            config,
            weights,
            rope,
            precision: opts.precision,
            source,
        }
    }

    pub fn new_session(self: &Arc<Self>, context_limit: usize) -> Session {
        Session::new(self.clone(), context_limit)
    }

    /// Bytes one decoded token reads from memory with `context` tokens in the cache: every dense
    /// weight, the routed experts, the lm_head, one embedding row and the visible KV cache.
    /// Decode is bound by this traffic, so bandwidth / this is the speed ceiling.
    pub fn decode_bytes_per_token(&self, context: usize) -> u64 {
        let c = &self.config;
        let w = &self.weights;
        let kv_bytes_per_position = 2 * c.kv_width() * forward::KV_BYTES_PER_VALUE;
        let mut total = (w.lm_head.byte_len() + w.embed.byte_len() / c.vocab_size) as u64;
        for layer in &w.layers {
            let a = &layer.attention;
            let dense = [&a.q, &a.k, &a.v, &a.o, &layer.router]
                .iter()
                .map(|l| l.weight.byte_len() + 4 * l.bias.len())
                .sum::<usize>();
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
