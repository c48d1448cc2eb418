//! Random weights of any gpt-oss shape, in memory or written to disk as a real checkpoint.
//!
//! Both paths generate every tensor from (seed, tensor name) alone, so `--synthetic 20b` and a
//! directory written by `ossterm synth --preset 20b` with the same seed hold the same weights.
//! Values are scaled so activations stay in a sane range through all layers: the point is a
//! faithful performance demo (same shapes, same formats, same routing work), not meaningful text.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::checkpoint::{AlignedBytes, Dtype, TensorBytes};
use super::config::{ModelConfig, MXFP4_BLOCK};
use super::weights::TensorSource;
use super::ModelError;

#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Norm weights: 1 +- 0.1.
    Norm,
    /// Biases: small, non-zero.
    Bias,
    /// Attention sinks: around a unit.
    Sink,
    /// A dense matrix with `cols` inputs: variance 1/cols keeps each projection's output scale.
    Dense { cols: usize },
    /// Token embeddings: unit scale (the first norm rescales anyway).
    Embedding,
    /// MXFP4 codes: uniform random nibbles.
    Fp4Codes,
    /// E8M0 scales chosen so dequantized weights have variance about 1/cols.
    Fp4Scales { cols: usize },
}

#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    fill: Fill,
}

impl TensorSpec {
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Every tensor of a gpt-oss checkpoint of this config, in checkpoint order (globals around the
/// layers, each layer's tensors together).
pub fn tensor_specs(config: &ModelConfig) -> Vec<TensorSpec> {
    let spec = |name: String, shape: Vec<usize>, dtype: Dtype, fill: Fill| TensorSpec {
        name,
        shape,
        dtype,
        fill,
    };
    let h = config.hidden_size;
    let (q, kv) = (config.q_width(), config.kv_width());
    let (e, i) = (config.num_local_experts, config.intermediate_size);
    let mut specs = vec![spec(
        "model.embed_tokens.weight".into(),
        vec![config.vocab_size, h],
        Dtype::Bf16,
        Fill::Embedding,
    )];
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        specs.push(spec(
            format!("{p}input_layernorm.weight"),
            vec![h],
            Dtype::Bf16,
            Fill::Norm,
        ));
        for (name, rows, cols) in [
            ("q_proj", q, h),
            ("k_proj", kv, h),
            ("v_proj", kv, h),
            ("o_proj", h, q),
        ] {
            specs.push(spec(
                format!("{p}self_attn.{name}.weight"),
                vec![rows, cols],
                Dtype::Bf16,
                Fill::Dense { cols },
            ));
            specs.push(spec(
                format!("{p}self_attn.{name}.bias"),
                vec![rows],
                Dtype::Bf16,
                Fill::Bias,
            ));
        }
        specs.push(spec(
            format!("{p}self_attn.sinks"),
            vec![config.num_attention_heads],
            Dtype::Bf16,
            Fill::Sink,
        ));
        specs.push(spec(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            Dtype::Bf16,
            Fill::Norm,
        ));
        specs.push(spec(
            format!("{p}mlp.router.weight"),
            vec![e, h],
            Dtype::Bf16,
            Fill::Dense { cols: h },
        ));
        specs.push(spec(
            format!("{p}mlp.router.bias"),
            vec![e],
            Dtype::Bf16,
            Fill::Bias,
        ));
        for (name, rows, cols) in [("gate_up_proj", 2 * i, h), ("down_proj", h, i)] {
            let nblocks = cols / MXFP4_BLOCK;
            let base = format!("{p}mlp.experts.{name}");
            specs.push(spec(
                format!("{base}_blocks"),
                vec![e, rows, nblocks, 16],
                Dtype::U8,
                Fill::Fp4Codes,
            ));
            specs.push(spec(
                format!("{base}_scales"),
                vec![e, rows, nblocks],
                Dtype::U8,
                Fill::Fp4Scales { cols },
            ));
            specs.push(spec(
                format!("{base}_bias"),
                vec![e, rows],
                Dtype::Bf16,
                Fill::Bias,
            ));
        }
    }
    specs.push(spec(
        "model.norm.weight".into(),
        vec![h],
        Dtype::Bf16,
        Fill::Norm,
    ));
    if !config.tie_word_embeddings {
        specs.push(spec(
            "lm_head.weight".into(),
            vec![config.vocab_size, h],
            Dtype::Bf16,
            Fill::Dense { cols: h },
        ));
    }
    specs
}

/// Generates tensors on request; implements [`TensorSource`] for in-memory synthetic models.
pub struct SyntheticSource {
    seed: u64,
    specs: HashMap<String, TensorSpec>,
}

impl SyntheticSource {
    pub fn new(config: ModelConfig, seed: u64) -> Self {
        let specs = tensor_specs(&config)
            .into_iter()
            .map(|s| (s.name.clone(), s))
            .collect();
        SyntheticSource { seed, specs }
    }
}

impl TensorSource for SyntheticSource {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        let spec = self
            .specs
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                tensor: name.into(),
                dir: "<synthetic>".into(),
            })?;
        if spec.shape != shape || !dtypes.contains(&spec.dtype) {
            return Err(ModelError::WrongShape {
                tensor: name.into(),
                expected: shape.to_vec(),
                found: spec.shape.clone(),
            });
        }
        // Aligned heap bytes: the fast path can reorder the experts in place (see
        // `Mxfp4Experts::tile`).
        let mut bytes = AlignedBytes::zeroed(spec.byte_len());
        generate_into(spec, self.seed, bytes.as_mut_slice());
        bytes.collapse_huge_pages();
        Ok((spec.dtype, TensorBytes::from_aligned(bytes)))
    }
}

/// Wraps a [`SyntheticSource`] and reports (bytes generated, bytes in all) after each tensor.
pub struct Reporting<'a> {
    inner: &'a SyntheticSource,
    done: std::cell::Cell<u64>,
    total: u64,
    progress: std::cell::RefCell<&'a mut dyn FnMut(u64, u64)>,
}

impl<'a> Reporting<'a> {
    pub fn new(inner: &'a SyntheticSource, progress: &'a mut dyn FnMut(u64, u64)) -> Self {
        let total = inner.specs.values().map(|s| s.byte_len() as u64).sum();
        Reporting {
            inner,
            done: std::cell::Cell::new(0),
            total,
            progress: std::cell::RefCell::new(progress),
        }
    }
}

impl TensorSource for Reporting<'_> {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        let tensor = self.inner.tensor(name, shape, dtypes)?;
        self.done.set(self.done.get() + tensor.1.len() as u64);
        (self.progress.borrow_mut())(self.done.get(), self.total);
        Ok(tensor)
    }
}

/// Bytes generated per independently seeded piece, so generation runs on every core.
const PIECE: usize = 1 << 20;

fn generate(spec: &TensorSpec, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; spec.byte_len()];
    generate_into(spec, seed, &mut bytes);
    bytes
}

/// Fills `bytes` (the tensor's size) with `spec`'s values for `seed`.
fn generate_into(spec: &TensorSpec, seed: u64, bytes: &mut [u8]) {
    let name_seed = fnv1a(spec.name.as_bytes()) ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    bytes
        .par_chunks_mut(PIECE)
        .enumerate()
        .for_each(|(piece, out)| {
            let mut rng =
                SplitMix64(name_seed ^ (piece as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            fill_piece(spec.fill, out, &mut rng);
        });
}

fn fill_piece(fill: Fill, out: &mut [u8], rng: &mut SplitMix64) {
    let bf16 = |out: &mut [u8], rng: &mut SplitMix64, f: &dyn Fn(f32) -> f32| {
        for pair in out.chunks_exact_mut(2) {
            let value = f(rng.uniform());
            // Round to nearest even bfloat16.
            let bits = value.to_bits();
            let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
            pair.copy_from_slice(&(rounded as u16).to_le_bytes());
        }
    };
    match fill {
        Fill::Norm => bf16(out, rng, &|u| 1.0 + 0.1 * u),
        Fill::Bias => bf16(out, rng, &|u| 0.05 * u),
        Fill::Sink => bf16(out, rng, &|u| u),
        Fill::Embedding => bf16(out, rng, &|u| 1.7 * u),
        Fill::Dense { cols } => {
            let a = (3.0 / cols as f32).sqrt();
            bf16(out, rng, &|u| a * u)
        }
        Fill::Fp4Codes => {
            for chunk in out.chunks_mut(8) {
                let word = rng.next().to_le_bytes();
                chunk.copy_from_slice(&word[..chunk.len()]);
            }
        }
        Fill::Fp4Scales { cols } => {
            // Uniform FP4 codes have an RMS of about 2.93; aim the product at 1/sqrt(cols).
            let target = (1.0 / (cols as f64).sqrt() / 2.93).log2();
            let base = (127.0 + target).round() as i64;
            for byte in out.iter_mut() {
                *byte = (base - (rng.next() & 1) as i64).clamp(1, 254) as u8;
            }
        }
    }
}

/// A tiny, fast, fixed-definition generator: synthetic weights must be identical across crate
/// versions and runs, which `rand`'s `SmallRng` does not promise.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

struct GeneratedView<'a> {
    spec: &'a TensorSpec,
    seed: u64,
}

impl safetensors::View for GeneratedView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.spec.dtype {
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::U8 => safetensors::Dtype::U8,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.spec.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(generate(self.spec, self.seed))
    }

    fn data_len(&self) -> usize {
        self.spec.byte_len()
    }
}

/// Summary of a checkpoint written by [`write_checkpoint`].
pub struct WrittenCheckpoint {
    pub shards: usize,
    pub tensors: usize,
    pub bytes: u64,
}

/// Writes a checkpoint directory in the Hugging Face layout: config.json, shards of about
/// `layers_per_shard` layers each, and model.safetensors.index.json. Each tensor is generated
/// just before it is written, so memory stays at one tensor.
///
/// The files are written to a hidden directory beside `dir` and moved into place only when all
/// of them are complete, so a full disk or an interrupted run leaves no half checkpoint at `dir`;
/// on error the staging directory is removed.
pub fn write_checkpoint(
    config: &ModelConfig,
    seed: u64,
    dir: &Path,
    layers_per_shard: usize,
    progress: impl FnMut(usize, usize),
) -> Result<WrittenCheckpoint, ModelError> {
    let staging = staging_dir(dir);
    let create = std::fs::create_dir_all(&staging).map_err(|source| ModelError::Write {
        path: staging.clone(),
        source,
    });
    let written = create
        .and_then(|()| write_files(config, seed, &staging, layers_per_shard, progress))
        .and_then(|(written, files)| {
            move_into_place(&staging, dir, &files)?;
            Ok(written)
        });
    let _ = std::fs::remove_dir_all(&staging);
    written
}

/// `.NAME.partial-PID` beside `dir`.
fn staging_dir(dir: &Path) -> std::path::PathBuf {
    let name = dir
        .file_name()
        .map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy().into_owned());
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    parent.join(format!(".{name}.partial-{}", std::process::id()))
}

/// Moves the finished `files` from `staging` to `dir`: the whole directory at once when `dir`
/// does not exist yet, else file by file with the index last (it is what makes a checkpoint).
fn move_into_place(staging: &Path, dir: &Path, files: &[String]) -> Result<(), ModelError> {
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to).map_err(|source| ModelError::Write {
            path: to.to_owned(),
            source,
        })
    };
    if !dir.exists() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|source| ModelError::Write {
                path: parent.to_owned(),
                source,
            })?;
        }
        return rename(staging, dir);
    }
    if !dir.is_dir() {
        return Err(ModelError::Write {
            path: dir.to_owned(),
            source: std::io::Error::new(std::io::ErrorKind::AlreadyExists, "not a directory"),
        });
    }
    for file in files {
        rename(&staging.join(file), &dir.join(file))?;
    }
    Ok(())
}

/// Writes every file into `dir` (which exists) and returns the summary and the file names,
/// index last.
fn write_files(
    config: &ModelConfig,
    seed: u64,
    dir: &Path,
    layers_per_shard: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<(WrittenCheckpoint, Vec<String>), ModelError> {
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| ModelError::Write { path, source }
    };
    let config_path = dir.join("config.json");
    let config_text =
        serde_json::to_string_pretty(&config.to_hf_json()).expect("JSON values serialize");
    std::fs::write(&config_path, config_text).map_err(io_err(&config_path))?;
    let mut files = vec!["config.json".to_string()];

    let specs = tensor_specs(config);
    let layers_per_shard = layers_per_shard.max(1);
    let shard_of = |spec: &TensorSpec| -> usize {
        match spec.name.strip_prefix("model.layers.") {
            Some(rest) => {
                let layer: usize = rest
                    .split('.')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0);
                layer / layers_per_shard
            }
            None if spec.name == "model.embed_tokens.weight" => 0,
            None => (config.num_hidden_layers.max(1) - 1) / layers_per_shard,
        }
    };
    let num_shards = specs.iter().map(shard_of).max().unwrap_or(0) + 1;
    let file_name = |s: usize| format!("model-{:05}-of-{:05}.safetensors", s + 1, num_shards);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for shard in 0..num_shards {
        let members: Vec<&TensorSpec> = specs.iter().filter(|s| shard_of(s) == shard).collect();
        let path = dir.join(file_name(shard));
        let views = members
            .iter()
            .map(|spec| (spec.name.clone(), GeneratedView { spec, seed }));
        safetensors::serialize_to_file(views, &None, &path).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => ModelError::Write {
                path: path.clone(),
                source,
            },
            other => ModelError::Serialize {
                path: path.clone(),
                message: format!("{other:?}"),
            },
        })?;
        files.push(file_name(shard));
        for spec in &members {
            weight_map.insert(spec.name.clone(), file_name(shard).into());
            total += spec.byte_len() as u64;
        }
        progress(shard + 1, num_shards);
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(
        &index_path,
        serde_json::to_string_pretty(&index).expect("JSON values serialize"),
    )
    .map_err(io_err(&index_path))?;
    files.push("model.safetensors.index.json".into());
    let written = WrittenCheckpoint {
        shards: num_shards,
        tensors: specs.len(),
        bytes: total,
    };
    Ok((written, files))
}
