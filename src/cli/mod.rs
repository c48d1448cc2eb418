//! The command line: parses arguments and hands each command to the library.

/// A clap value parser for a choice enum (`impl_choice!`): accepts exactly its names and lists
/// them in `--help`.
macro_rules! choice_parser {
    ($ty:ty) => {
        clap::builder::TypedValueParser::map(
            clap::builder::PossibleValuesParser::new(<$ty>::ALL.iter().map(|value| value.name())),
            |name: String| {
                <$ty>::from_name(&name).expect("clap accepts only the names of the values")
            },
        )
    };
}

pub mod app;
mod batch_bench;
mod bench_cmd;
mod cache_cmd;
mod chat_cmds;
mod limits;
mod model_cmds;
pub mod output;
mod profile_bench;
mod resume_bench;
mod serve_cmd;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::model::memory::{check_before_load_sequences, Planned};
use crate::model::{
    ActivationFormat, AttentionArithmetic, ExpertLayout, KvFormat, LoadOptions, Model, Precision,
    Preset, Unembedding, WeightFormat,
};

#[derive(Parser, Debug)]
#[command(
    name = "ossterm",
    version,
    about = "Chat with gpt-oss-20b on your CPU, in your terminal"
)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Flags of the interactive app (no command).
    #[command(flatten)]
    pub app: app::AppArgs,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Measure prefill and decode speed, time to first token, memory and roofline efficiency.
    Bench(bench_cmd::BenchArgs),
    /// Show a checkpoint's configuration, tensors and parameter counts.
    Info(model_cmds::InfoArgs),
    /// Write the logits of every position of a token sequence (little-endian f32, [tokens x vocab]).
    Logits(model_cmds::LogitsArgs),
    /// Continue a token sequence; prints the generated ids on the last line.
    Generate(model_cmds::GenerateArgs),
    /// Write a checkpoint with random weights in the real layout (for speed tests without the download).
    Synth(model_cmds::SynthArgs),
    /// Answer one prompt (or continue a saved conversation), streaming the reply.
    Run(chat_cmds::RunArgs),
    /// Print the harmony generation prompt of a conversation file as ids (last line of stdout).
    Render(chat_cmds::RenderArgs),
    /// Encode text to o200k_harmony ids, or decode ids with --decode.
    Tokenize(chat_cmds::TokenizeArgs),
    /// Serve an OpenAI-compatible API (chat completions, models, health, metrics) with batching.
    Serve(serve_cmd::ServeArgs),
    /// List the KV snapshots on disk (chat, tokens, size, age), or `cache clear` to delete them.
    Cache(cache_cmd::CacheArgs),
}

/// Where the weights come from: a checkpoint directory or a synthetic preset.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Hugging Face gpt-oss checkpoint directory (config.json + *.safetensors), a GGUF file
    /// (llama.cpp / LM Studio / ollama) or an ollama model name: ollama:NAME:TAG.
    #[arg(long, value_name = "PATH", conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// Use random weights of this shape instead of a checkpoint.
    #[arg(long, value_name = "PRESET", value_parser = choice_parser!(Preset))]
    pub synthetic: Option<Preset>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub synthetic_seed: u64,
    /// Worker threads for the forward pass (default: one per physical core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Format of attention and unembedding weights (experts stay MXFP4).
    #[arg(long, value_name = "FORMAT", default_value = "q8", value_parser = choice_parser!(WeightFormat))]
    pub weights: WeightFormat,
    /// Element type of the KV cache.
    #[arg(long, value_name = "TYPE", default_value = "f16", value_parser = choice_parser!(KvFormat))]
    pub kv_cache: KvFormat,
    /// Int8 inputs of quantized products: q8 (one row, fastest), q8x2 (two rows, ~14 bits, every
    /// product) or mixed (two rows where one loses most: attention, unembedding, experts' down).
    #[arg(long, value_name = "FORMAT", default_value = "mixed", value_parser = choice_parser!(ActivationFormat))]
    pub activations: ActivationFormat,
    /// Attention arithmetic over the f16 KV cache: auto (bf16 on the AMX matrix unit on the amx
    /// path with AMX-BF16; elsewhere bf16 dot products where the CPU has AVX-512 BF16 and issues
    /// them as fast as f32 FMAs), f32, or bf16 (wherever the CPU has AVX-512 BF16). The q8 cache
    /// takes int8 dot products on the AVX-512 path unless f32. q8x2 activations keep f32.
    #[arg(long, value_name = "ARITHMETIC", default_value = "auto", value_parser = choice_parser!(AttentionArithmetic))]
    pub attention: AttentionArithmetic,
    /// Byte order of the MXFP4 experts in the fast path: tiles of 16 rows reordered at load
    /// (where the kernels have products for them and the copy fits in memory, with auto) or the
    /// file's rows.
    #[arg(long, value_name = "LAYOUT", default_value = "auto", value_parser = choice_parser!(ExpertLayout))]
    pub expert_layout: ExpertLayout,
    /// Logits of decoded tokens: two-stage (a q4 draft of every vocabulary row, then the 64
    /// best-scored rows again in the weight format; fewer bytes per token, a q4 copy of the
    /// unembedding in memory) or full (every row in the weight format).
    #[arg(long, value_name = "MODE", default_value = "two-stage", value_parser = choice_parser!(Unembedding))]
    pub unembedding: Unembedding,
}

impl ModelArgs {
    /// Loads the model the arguments name. `exact` selects the f32 reference path.
    pub fn load(&self, exact: bool) -> anyhow::Result<Arc<Model>> {
        self.load_for_context(exact, 0)
    }

    /// [`ModelArgs::load`], first checking that the weights and a KV cache of `context` tokens
    /// fit this machine's memory (a warning on stderr when the weights will be paged from disk).
    pub fn load_for_context(&self, exact: bool, context: usize) -> anyhow::Result<Arc<Model>> {
        self.load_for_sequences(exact, 1, context)
    }

    /// [`ModelArgs::load_for_context`] for `sequences` KV caches of `context` tokens (a server's
    /// slots).
    pub fn load_for_sequences(
        &self,
        exact: bool,
        sequences: usize,
        context: usize,
    ) -> anyhow::Result<Arc<Model>> {
        init_threads(self.threads)?;
        crate::kernels::init_kernel_path()?;
        let opts = LoadOptions {
            precision: if exact {
                Precision::Exact
            } else {
                Precision::Fast
            },
            weights: self.weights,
            kv: self.kv_cache,
            activations: self.activations,
            attention: self.attention,
            expert_layout: self.expert_layout,
            unembedding: self.unembedding,
            ..LoadOptions::default()
        };
        let planned = match (&self.model, self.synthetic) {
            (Some(path), _) => Some(Planned::Path(path)),
            (None, Some(preset)) => Some(Planned::Synthetic(preset)),
            (None, None) => None,
        };
        if let Some(planned) = planned {
            if let Some(warning) = check_before_load_sequences(planned, &opts, sequences, context)?
            {
                eprintln!("warning: {warning}");
            }
        }
        // Loading and converting run on the pool the forward pass will use.
        let pool = self.pool()?;
        let model = pool.install(|| -> anyhow::Result<Model> {
            Ok(match (&self.model, self.synthetic) {
                (Some(dir), _) => Model::load(dir, &opts)
                    .with_context(|| format!("cannot load the model {}", dir.display()))?,
                (None, Some(preset)) => Model::synthetic(preset, self.synthetic_seed, &opts)?,
                (None, None) => anyhow::bail!(
                    "name a model: --model DIR|FILE.gguf|ollama:NAME:TAG or --synthetic 20b|120b|tiny"
                ),
            })
        })?;
        // Converting the weights reads the mapping; a shard cut short meanwhile read zeros.
        crate::fault::check()?;
        Ok(Arc::new(model))
    }

    /// The pool the forward pass computes on: `--threads` workers, built as the app builds its
    /// own, once per process (the model loads on it before the first session takes it).
    pub fn pool(&self) -> anyhow::Result<Arc<rayon::ThreadPool>> {
        static POOL: std::sync::OnceLock<Arc<rayon::ThreadPool>> = std::sync::OnceLock::new();
        if let Some(pool) = POOL.get() {
            return Ok(Arc::clone(pool));
        }
        let count = thread_count(self.threads)?;
        let pool = crate::engine::build_pool(count)
            .with_context(|| format!("cannot build a thread pool of {count} threads"))?;
        Ok(Arc::clone(POOL.get_or_init(|| pool)))
    }
}

/// `--threads`, or one per physical core. More than the logical CPUs are capped to that count,
/// as the app's setting is: they would only contend, and tens of thousands exhaust the OS.
fn thread_count(threads: Option<usize>) -> anyhow::Result<usize> {
    static NOTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let asked = threads.unwrap_or_else(crate::engine::default_threads);
    if asked == 0 {
        anyhow::bail!("--threads must be at least 1");
    }
    let available = std::thread::available_parallelism().map_or(1, |count| count.get());
    let count = asked.min(available);
    if count < asked && !NOTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        output::note!("--threads {asked} is more than the {available} logical CPUs; using {count}");
    }
    Ok(count)
}

/// Sizes the global rayon pool, which loading and weight conversion use, once; later calls are
/// fine. A pool the OS refuses is an error (rayon would panic at its first use).
pub fn init_threads(threads: Option<usize>) -> anyhow::Result<()> {
    static POOL_THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let count = thread_count(threads)?;
    if POOL_THREADS.get().is_some() {
        return Ok(());
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(count)
        .build_global()
        .map_err(|error| {
            anyhow::anyhow!("cannot start a pool of {count} worker threads: {error}")
        })?;
    let _ = POOL_THREADS.set(count);
    Ok(())
}

/// Large allocations (weight matrices, caches) get their own mappings, returned to the system
/// when freed. glibc otherwise raises its mmap threshold to the size of each such block freed
/// (up to 32 MiB), so after a weight-format or unembedding change the next matrices of that size
/// come from the heap, and the ones they replace stay resident once freed.
fn return_large_buffers_to_the_system() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; it is called before any other thread
    // exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

pub fn main() -> ExitCode {
    return_large_buffers_to_the_system();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Bench(args)) => bench_cmd::bench(args),
        Some(Command::Info(args)) => model_cmds::info(args),
        Some(Command::Logits(args)) => model_cmds::logits(args),
        Some(Command::Generate(args)) => model_cmds::generate(args),
        Some(Command::Synth(args)) => model_cmds::synth(args),
        Some(Command::Run(args)) => chat_cmds::run(args),
        Some(Command::Render(args)) => chat_cmds::render(args),
        Some(Command::Tokenize(args)) => chat_cmds::tokenize(args),
        Some(Command::Serve(args)) => serve_cmd::serve(args),
        Some(Command::Cache(args)) => cache_cmd::cache(args),
        None => app::run(cli.app),
    };
    output::exit_code(result)
}
