//! What a model needs in memory against what the machine has, checked before loading.
//!
//! Mapped checkpoint weights are file-backed: when they exceed RAM the OS reads them from disk as
//! tokens touch them, slow but working, so that only warns. Memory the process must own (converted
//! weights, GGUF experts repacked to the kernels' layout, the KV cache at the chosen context) cannot
//! be paged back from a file; if it does not fit the load is refused with the numbers.

use std::path::Path;

use super::config::{ModelConfig, Preset, MXFP4_BLOCK};
use super::{
    gguf, resolve_model_path, ExpertLayout, KvFormat, LoadOptions, ModelError, Precision,
    WeightFormat,
};
use crate::kernels::{Kernels, GROUP_BLOCKS, GROUP_LEN, MXFP4_TILE_ROWS};

/// What to load, for [`check_before_load`].
#[derive(Debug, Clone, Copy)]
pub enum Planned<'a> {
    /// A `--model` value: checkpoint directory, GGUF file or `ollama:NAME:TAG`.
    Path(&'a Path),
    Synthetic(Preset),
}

/// Compares what loading `planned` with `opts` and a KV cache of `context` tokens needs with this
/// machine's memory, reading only the configuration. `Ok(Some(warning))` when the weights will be
/// paged from disk; an error when owned memory cannot fit. A model whose configuration cannot be
/// read passes: the load itself reports why.
pub fn check_before_load(
    planned: Planned<'_>,
    opts: &LoadOptions,
    context: usize,
) -> Result<Option<String>, ModelError> {
    check_before_load_sequences(planned, opts, 1, context)
}

/// [`check_before_load`] for `sequences` KV caches of `context` tokens each (a server's slots).
pub fn check_before_load_sequences(
    planned: Planned<'_>,
    opts: &LoadOptions,
    sequences: usize,
    context: usize,
) -> Result<Option<String>, ModelError> {
    let Some(memory) = SystemMemory::read() else {
        return Ok(None);
    };
    let (config, source) = match planned {
        Planned::Synthetic(preset) => (preset.config(), WeightSource::Synthetic),
        Planned::Path(spec) => {
            let path = resolve_model_path(spec)?;
            let read = if gguf::is_gguf(&path) {
                gguf::GgufFile::open(&path).and_then(|f| {
                    let config = f.config()?;
                    let held = GgufHeld::of(&f, &config);
                    Ok((config, WeightSource::Gguf(held)))
                })
            } else {
                ModelConfig::from_file(&path.join("config.json")).map(|c| (c, WeightSource::Mapped))
            };
            match read {
                Ok(found) => found,
                Err(_) => return Ok(None),
            }
        }
    };
    let context = context
        .min(config.max_position_embeddings)
        .saturating_mul(sequences);
    MemoryNeeds::estimate(
        &config,
        source,
        opts.precision,
        opts.weights,
        opts.kv,
        context,
    )
    .with_tiled_experts(&config, opts, Some(memory))
    .with_draft_unembedding(&config, opts)
    .check(memory)
}

/// Whether a fast-path load with `opts` reorders its experts into the tile layout, copying
/// `mapped_bytes` of them out of a file mapping (0 for experts the process owns, which are
/// reordered in place).
pub fn tiles_experts(opts: &LoadOptions, mapped_bytes: u64, memory: Option<SystemMemory>) -> bool {
    opts.precision == Precision::Fast
        && match opts.expert_layout {
            ExpertLayout::Rows => false,
            ExpertLayout::Tiles => true,
            ExpertLayout::Auto => {
                let path = opts.kernels.unwrap_or_else(crate::kernels::kernel_path);
                Kernels::new(path).is_ok_and(|k| k.prefers_tiled_mxfp4())
                    && tiled_copy_fits(mapped_bytes, memory)
            }
        }
}

/// Memory left beside a copy of mapped experts into the tile layout: converted matrices, a KV
/// cache at everyday contexts, the rest of the process and of the machine.
const TILED_COPY_HEADROOM: u64 = 4 << 30;

/// Whether `bytes` of mapped experts may be copied into the tile layout, in memory the process
/// owns: only with [`TILED_COPY_HEADROOM`] to spare in `memory`'s available bytes (which count
/// the checkpoint's cached pages: the copy releases those). A model larger than that keeps its
/// experts in the mapping, paged from disk as tokens need them, rather than failing to load.
/// Unknown memory allows the copy.
pub fn tiled_copy_fits(bytes: u64, memory: Option<SystemMemory>) -> bool {
    bytes == 0 || memory.is_none_or(|m| bytes.saturating_add(TILED_COPY_HEADROOM) <= m.available)
}

/// Bytes of RAM: installed and available now (free plus reclaimable cache), from /proc/meminfo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SystemMemory {
    pub total: u64,
    pub available: u64,
}

impl SystemMemory {
    pub fn read() -> Option<SystemMemory> {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        Self::parse(&text)
    }

    pub fn parse(meminfo: &str) -> Option<SystemMemory> {
        let field = |name: &str| {
            meminfo.lines().find_map(|line| {
                let rest = line.strip_prefix(name)?.strip_prefix(':')?;
                let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
                Some(kib * 1024)
            })
        };
        Some(SystemMemory {
            total: field("MemTotal")?,
            available: field("MemAvailable")?,
        })
    }
}

/// Where a model's weights come from, for the memory estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightSource {
    /// Safetensors: every tensor stays in the mapping (the experts unless they are copied into
    /// tiles: [`MemoryNeeds::with_tiled_experts`]).
    Mapped,
    /// GGUF: what the loader copies out of this file (see [`GgufHeld`]).
    Gguf(GgufHeld),
    /// Generated in memory.
    Synthetic,
}

/// What loading a GGUF file holds in memory of its own, read from the tensor table (types and
/// shapes) as [`gguf::GgufSource`] serves the tensors: BF16 and F32 tensors are lent from the
/// mapping, everything else is a copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GgufHeld {
    /// Bytes of all tensors in the file.
    pub file_bytes: u64,
    /// MXFP4 experts repacked into the kernels' layout: as many bytes as the file's blocks.
    pub experts: u64,
    /// bf16 copies of dense matrices stored as F32, F16 or Q8_0 (embedding, attention, router,
    /// unembedding): the exact path and the embedding lookup read bf16.
    pub dense_copies: u64,
    /// Q8_0 attention and unembedding matrices placed in the fast path's Q8 layout at load (shared
    /// with `--weights q8`, kept with the other formats).
    pub native_q8: u64,
    /// Q8 bytes `--weights q8` adds for the converted matrices that have no Q8_0 form in the file.
    pub q8_to_convert: u64,
}

impl GgufHeld {
    /// What `file` (of configuration `config`) holds once loaded.
    pub fn of(file: &gguf::GgufFile, config: &ModelConfig) -> GgufHeld {
        let mut held = GgufHeld::default();
        for (name, tensor) in file.tensors() {
            held.file_bytes += tensor.byte_len() as u64;
            if tensor.type_id == gguf::GGML_MXFP4 {
                held.experts += tensor.byte_len() as u64;
                continue;
            }
            if tensor.dims.len() != 2 || name.ends_with("_exps.bias") {
                // Vectors and expert biases: counted for every source in `vector_bytes`.
                continue;
            }
            let (cols, rows) = (tensor.dims[0] as u64, tensor.dims[1] as u64);
            if tensor.type_id != gguf::GGML_BF16 {
                held.dense_copies += 2 * rows * cols;
            }
            let converted = name == "output.weight"
                || (name == "token_embd.weight" && config.tie_word_embeddings)
                || (name.starts_with("blk.")
                    && ["attn_q", "attn_k", "attn_v", "attn_output"]
                        .iter()
                        .any(|m| name.ends_with(&format!(".{m}.weight"))));
            if converted {
                if tensor.type_id == gguf::GGML_Q8_0 {
                    held.native_q8 += q8_bytes(rows, cols);
                } else {
                    held.q8_to_convert += q8_bytes(rows, cols);
                }
            }
        }
        held
    }

    /// What the held bytes are, for `info`'s memory line.
    pub fn describe(&self) -> String {
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        let mut parts = vec![format!("repacked GGUF experts {}", gib(self.experts))];
        if self.dense_copies > 0 {
            parts.push(format!(
                "bf16 copies of F32/F16/Q8_0 matrices {}",
                gib(self.dense_copies)
            ));
        }
        if self.native_q8 > 0 {
            parts.push(format!(
                "Q8_0 matrices in the kernels' layout {}",
                gib(self.native_q8)
            ));
        }
        format!(", {}", parts.join(", "))
    }

    /// A file as llama.cpp's converter writes `config` by default (BF16 dense, F32 vectors, MXFP4
    /// experts), for when there is no file to read.
    pub fn converter_default(config: &ModelConfig) -> GgufHeld {
        GgufHeld {
            file_bytes: config.checkpoint_bytes(),
            experts: config.expert_bytes(),
            dense_copies: 0,
            native_q8: 0,
            q8_to_convert: config
                .converted_shapes()
                .map(|(rows, cols)| q8_bytes(rows, cols))
                .sum(),
        }
    }
}

/// Bytes of a [`crate::kernels::Q8Matrix`] of this shape (groups of 128 int8 values with four f16
/// scales, rows padded to whole groups); 0 when the columns are not whole blocks of 32, which the
/// fast path leaves in bf16.
fn q8_bytes(rows: u64, cols: u64) -> u64 {
    if !cols.is_multiple_of(32) {
        return 0;
    }
    rows * cols.div_ceil(GROUP_LEN as u64) * (GROUP_LEN + 2 * GROUP_BLOCKS) as u64
}

/// Bytes of a [`crate::kernels::Q4Matrix`] of this shape (as [`q8_bytes`], packed nibbles).
fn q4_bytes(rows: u64, cols: u64) -> u64 {
    if !cols.is_multiple_of(32) {
        return 0;
    }
    rows * cols.div_ceil(GROUP_LEN as u64) * (GROUP_LEN / 2 + 2 * GROUP_BLOCKS) as u64
}

/// A model's memory needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeeds {
    /// All weights as stored (bf16 dense, MXFP4 experts).
    pub weights: u64,
    /// Of those or in addition, bytes the process must own (not backed by a file).
    pub owned: u64,
    /// Of `owned`, the fast path's converted attention and unembedding matrices.
    pub converted: u64,
    /// Of `owned`, mapped experts the fast path copies into the kernels' tile layout (see
    /// [`MemoryNeeds::with_tiled_experts`]).
    pub tiled: u64,
    /// The KV cache when the context is full.
    pub kv: u64,
    pub context: usize,
    pub source: WeightSource,
}

impl ModelConfig {
    /// Bytes of the expert weights (MXFP4 blocks and scales, biases as bf16).
    pub fn expert_bytes(&self) -> u64 {
        let (h, i, e) = (
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.num_local_experts as u64,
        );
        let values = e * (h * 2 * i + i * h);
        let mxfp4 = values / 2 + values / MXFP4_BLOCK as u64;
        let biases = 2 * e * (2 * i + h);
        self.num_hidden_layers as u64 * (mxfp4 + biases)
    }

    /// Bytes of the MXFP4 expert tensors whose rows fill whole tiles of the kernels' tile layout
    /// (every tensor of the published shapes).
    pub fn tileable_expert_bytes(&self) -> u64 {
        let (h, i, e) = (
            self.hidden_size as u64,
            self.intermediate_size as u64,
            self.num_local_experts as u64,
        );
        let tensor = |rows: u64, cols: u64| {
            let values = e * rows * cols;
            if rows.is_multiple_of(MXFP4_TILE_ROWS as u64) {
                values / 2 + values / MXFP4_BLOCK as u64
            } else {
                0
            }
        };
        self.num_hidden_layers as u64 * (tensor(2 * i, h) + tensor(h, i))
    }

    /// Bytes of a Hugging Face checkpoint of this shape: dense parameters in bf16, experts MXFP4.
    pub fn checkpoint_bytes(&self) -> u64 {
        let expert_params = self.num_hidden_layers as u64
            * self.num_local_experts as u64
            * (self.hidden_size as u64 * 2 * self.intermediate_size as u64
                + 2 * self.intermediate_size as u64
                + self.intermediate_size as u64 * self.hidden_size as u64
                + self.hidden_size as u64);
        2 * (self.total_parameters() - expert_params) + self.expert_bytes()
    }

    /// (rows, columns) of the matrices the fast path converts: every layer's attention
    /// projections, and the unembedding.
    fn converted_shapes(&self) -> impl Iterator<Item = (u64, u64)> {
        let (h, q, kv) = (
            self.hidden_size as u64,
            self.q_width() as u64,
            self.kv_width() as u64,
        );
        (0..self.num_hidden_layers)
            .flat_map(move |_| [(q, h), (kv, h), (kv, h), (h, q)])
            .chain([(self.vocab_size as u64, h)])
    }

    /// Bytes of the f32 vectors every load holds of its own (norms, biases, sinks, expert biases),
    /// whatever the file stores them as.
    pub fn vector_bytes(&self) -> u64 {
        let (h, q, kv, e, i) = (
            self.hidden_size as u64,
            self.q_width() as u64,
            self.kv_width() as u64,
            self.num_local_experts as u64,
            self.intermediate_size as u64,
        );
        let per_layer =
            2 * h + (q + 2 * kv + h) + self.num_attention_heads as u64 + e + e * (2 * i + h);
        4 * (self.num_hidden_layers as u64 * per_layer + h)
    }
}

impl MemoryNeeds {
    pub fn estimate(
        config: &ModelConfig,
        source: WeightSource,
        precision: Precision,
        weights: WeightFormat,
        kv: KvFormat,
        context: usize,
    ) -> MemoryNeeds {
        let (total, loaded, q8_converted) = match source {
            WeightSource::Mapped => (config.checkpoint_bytes(), 0, None),
            WeightSource::Gguf(held) => (
                held.file_bytes,
                held.experts + held.dense_copies + held.native_q8,
                Some(held.q8_to_convert),
            ),
            WeightSource::Synthetic => (config.checkpoint_bytes(), config.checkpoint_bytes(), None),
        };
        // The fast path's conversion of attention and unembedding; converted pages of the mapping
        // are released. A GGUF's Q8_0 matrices are already held in that form (in `loaded`).
        let converted = match (precision, weights) {
            (Precision::Exact, _) | (_, WeightFormat::Native) => 0,
            (_, WeightFormat::Q8) => q8_converted.unwrap_or_else(|| {
                config
                    .converted_shapes()
                    .map(|(rows, cols)| q8_bytes(rows, cols))
                    .sum()
            }),
            (_, WeightFormat::Q4) => config
                .converted_shapes()
                .map(|(rows, cols)| q4_bytes(rows, cols))
                .sum(),
        };
        let loaded = loaded + config.vector_bytes();
        let kv_format = match precision {
            Precision::Exact => KvFormat::F32,
            Precision::Fast => kv,
        };
        // Keys and values of every layer: one row per KV head and position.
        let row_bytes = kv_format.row_bytes(config.head_dim) as u64;
        MemoryNeeds {
            weights: total,
            owned: loaded + converted,
            converted,
            tiled: 0,
            source,
            // Saturating: a server's slots times their context can be any size the flags give.
            kv: (2
                * config.num_hidden_layers as u64
                * config.num_key_value_heads as u64
                * row_bytes)
                .saturating_mul(context as u64),
            context,
        }
    }

    /// These needs with the copy of mapped experts into the tile layout that a load with `opts`
    /// makes (see [`tiles_experts`]); experts generated or repacked from a GGUF are reordered
    /// in place, and the pages of the mapped ones are released, so only a mapped source grows.
    pub fn with_tiled_experts(
        mut self,
        config: &ModelConfig,
        opts: &LoadOptions,
        memory: Option<SystemMemory>,
    ) -> MemoryNeeds {
        if self.source != WeightSource::Mapped {
            return self;
        }
        let bytes = config.tileable_expert_bytes();
        if tiles_experts(opts, bytes, memory) {
            self.tiled = bytes;
            self.owned += bytes;
        }
        self
    }

    /// These needs with the q4 draft of the unembedding a load with `opts` builds (see
    /// [`crate::model::Unembedding::TwoStage`]).
    pub fn with_draft_unembedding(
        mut self,
        config: &ModelConfig,
        opts: &LoadOptions,
    ) -> MemoryNeeds {
        let h = config.hidden_size;
        if opts.precision == Precision::Fast
            && crate::model::convert::DraftUnembedding::applies(opts.unembedding, opts.weights, h)
        {
            let bytes = q4_bytes(config.vocab_size as u64, h as u64);
            self.converted += bytes;
            self.owned += bytes;
        }
        self
    }

    /// What would lower the owned memory, for the refusal message.
    fn advice(&self) -> String {
        let mut ways = Vec::new();
        if self.kv > 0 {
            ways.push("lower the context (--context / engine.context_limit)".to_string());
        }
        match self.source {
            WeightSource::Synthetic => ways.push(
                "pick a smaller synthetic preset: random weights are generated in memory".into(),
            ),
            WeightSource::Gguf(_) => ways.push(
                "use the Hugging Face safetensors checkpoint, which stays mapped (a GGUF's \
                 experts are repacked into memory)"
                    .into(),
            ),
            WeightSource::Mapped => {}
        }
        if self.tiled > 0 {
            ways.push("--expert-layout rows keeps the experts in the mapping".into());
        }
        if self.converted > 0 && self.source != WeightSource::Synthetic {
            ways.push("--weights native keeps attention and unembedding in the mapping".into());
        }
        ways.join("; or ")
    }

    /// Refuses what cannot fit in `memory`; returns a warning when the mapped weights do not fit
    /// beside it (they will be read from disk as needed).
    pub fn check(&self, memory: SystemMemory) -> Result<Option<String>, ModelError> {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let anonymous = self.owned.saturating_add(self.kv);
        if anonymous > memory.available {
            let kv = if self.context > 0 {
                format!(
                    "the KV cache for {} tokens needs {:.1} GiB and ",
                    self.context,
                    gib(self.kv)
                )
            } else {
                String::new()
            };
            return Err(ModelError::Memory(format!(
                "not enough memory: {kv}weights held in memory ({}) need {:.1} GiB, {:.1} GiB in \
                 all, but {:.1} GiB of {:.1} GiB are available: {}",
                match self.source {
                    WeightSource::Synthetic => "generated",
                    WeightSource::Gguf(_) => "repacked experts, converted matrices",
                    WeightSource::Mapped if self.tiled > 0 => {
                        "experts reordered into tiles, converted matrices"
                    }
                    WeightSource::Mapped => "converted matrices",
                },
                gib(self.owned),
                gib(anonymous),
                gib(memory.available),
                gib(memory.total),
                self.advice()
            )));
        }
        let mapped = self.weights.saturating_sub(self.owned.min(self.weights));
        if mapped + anonymous > memory.total {
            return Ok(Some(format!(
                "the weights ({:.1} GiB) and KV cache ({:.1} GiB) exceed this machine's {:.1} GiB of \
                 RAM: loading from the mapping anyway; the OS will read weights from disk as tokens \
                 need them, so generation will be slow",
                gib(self.weights),
                gib(self.kv),
                gib(memory.total)
            )));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn meminfo_parses() {
        let m = SystemMemory::parse(
            "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n",
        )
        .unwrap();
        assert_eq!(m.total, 24_000_000 * 1024);
        assert_eq!(m.available, 20_000_000 * 1024);
        assert!(SystemMemory::parse("MemTotal: 5 kB\n").is_none());
    }

    #[test]
    fn checkpoint_bytes_match_the_published_sizes() {
        // openai/gpt-oss-20b's safetensors hold 13,761,300,984 bytes of tensors (12.8 GiB).
        let b20 = ModelConfig::gpt_oss_20b().checkpoint_bytes() as f64 / GIB as f64;
        assert!((b20 - 12.8).abs() < 0.1, "20b {b20} GiB");
        let b120 = ModelConfig::gpt_oss_120b().checkpoint_bytes() as f64 / GIB as f64;
        assert!((b120 - 60.8).abs() < 0.5, "120b {b120} GiB");
    }

    #[test]
    fn mapped_experts_reordered_into_tiles_are_owned_memory_when_they_fit() {
        let c = ModelConfig::gpt_oss_20b();
        // 24 layers x 32 experts x (5760 + 2880) rows x 2880 columns, 4.25 bits each.
        let tiles = c.tileable_expert_bytes() as f64 / GIB as f64;
        assert!((tiles - 9.46).abs() < 0.01, "{tiles} GiB");
        let machine = SystemMemory {
            total: 24 * GIB,
            available: 20 * GIB,
        };
        let needs = |source| {
            MemoryNeeds::estimate(
                &c,
                source,
                Precision::Fast,
                WeightFormat::Q8,
                KvFormat::F16,
                4096,
            )
        };
        let opts = |expert_layout| LoadOptions {
            expert_layout,
            ..LoadOptions::default()
        };
        let rows = needs(WeightSource::Mapped);
        let tiled = rows.with_tiled_experts(&c, &opts(ExpertLayout::Tiles), Some(machine));
        assert_eq!(tiled.tiled, c.tileable_expert_bytes());
        assert_eq!(tiled.owned, rows.owned + tiled.tiled);
        assert_eq!(tiled.check(machine).unwrap(), None);
        let small = SystemMemory {
            total: 16 * GIB,
            available: 10 * GIB,
        };
        let err = tiled.check(small).unwrap_err().to_string();
        assert!(
            err.contains("experts reordered into tiles") && err.contains("--expert-layout rows"),
            "{err}"
        );
        let kept = rows.with_tiled_experts(&c, &opts(ExpertLayout::Rows), Some(machine));
        assert_eq!(kept, rows);
        // Generated experts are reordered where they are.
        let synthetic = needs(WeightSource::Synthetic);
        let opts_tiles = opts(ExpertLayout::Tiles);
        assert_eq!(
            synthetic.with_tiled_experts(&c, &opts_tiles, Some(machine)),
            synthetic
        );
        // A copy that leaves no headroom is not made: the experts stay mapped.
        let exact = LoadOptions {
            precision: Precision::Exact,
            ..opts_tiles
        };
        assert_eq!(rows.with_tiled_experts(&c, &exact, Some(machine)), rows);
        assert!(tiled_copy_fits(c.tileable_expert_bytes(), Some(machine)));
        let b120 = ModelConfig::gpt_oss_120b().tileable_expert_bytes();
        assert!(!tiled_copy_fits(b120, Some(machine)));
        assert!(tiled_copy_fits(b120, None) && tiled_copy_fits(0, Some(machine)));
    }

    #[test]
    fn kv_that_cannot_fit_is_refused_and_big_weights_warn() {
        let c = ModelConfig::gpt_oss_120b();
        let machine = SystemMemory {
            total: 24 * GIB,
            available: 20 * GIB,
        };
        let needs = |context| {
            MemoryNeeds::estimate(
                &c,
                WeightSource::Mapped,
                Precision::Fast,
                WeightFormat::Native,
                KvFormat::F16,
                context,
            )
        };
        // 120b: 36 layers x 2 x 512 values x 2 bytes = 72 KiB per token.
        assert_eq!(needs(1).kv, 36 * 2 * 512 * 2);
        let warning = needs(4096)
            .check(machine)
            .unwrap()
            .expect("60 GiB of weights on 24 GiB warns");
        assert!(warning.contains("exceed"), "{warning}");
        let small_machine = SystemMemory {
            total: 16 * GIB,
            available: 8 * GIB,
        };
        let err = needs(131072).check(small_machine).unwrap_err().to_string();
        assert!(
            err.contains("131072 tokens needs 9.0 GiB") && err.contains("--context"),
            "{err}"
        );
        let small = MemoryNeeds::estimate(
            &ModelConfig::tiny(),
            WeightSource::Mapped,
            Precision::Fast,
            WeightFormat::Q8,
            KvFormat::F16,
            4096,
        );
        assert_eq!(small.check(machine).unwrap(), None);
        // A GGUF 120b's repacked experts must be owned: refused on 24 GiB, with the way out named.
        let gguf = MemoryNeeds::estimate(
            &c,
            WeightSource::Gguf(GgufHeld::converter_default(&c)),
            Precision::Fast,
            WeightFormat::Q8,
            KvFormat::F16,
            4096,
        );
        let err = gguf.check(machine).unwrap_err().to_string();
        assert!(err.contains("safetensors"), "{err}");
    }
}
