//! Commands that work on checkpoints and raw token ids: info, logits, generate, synth.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use super::ModelArgs;
use crate::model::checkpoint::Checkpoint;
use crate::model::gguf;
use crate::model::memory::{MemoryNeeds, SystemMemory, WeightSource};
use crate::model::{
    synthetic, KvFormat, ModelConfig, Precision, Preset, RopeScaling, WeightFormat,
};

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Checkpoint directory, GGUF file or ollama:NAME:TAG.
    #[arg(long, value_name = "PATH", required_unless_present = "synthetic")]
    pub model: Option<PathBuf>,
    /// Describe a preset's layout instead (nothing is built).
    #[arg(long, value_name = "PRESET", conflicts_with = "model", value_parser = choice_parser!(Preset))]
    pub synthetic: Option<Preset>,
    /// Context for the KV cache estimate (default: the model's longest).
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<usize>,
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(long, value_name = "IDS", value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Output file: little-endian f32, row-major [tokens x vocab].
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Compute with f32 activations and exactly dequantized weights (the reference path).
    #[arg(long)]
    pub exact: bool,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated prompt token ids.
    #[arg(long, value_name = "IDS", value_delimiter = ',', required = true)]
    pub tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub max_tokens: usize,
    /// Pick the most likely token each step (the only decoding this command offers; see `run`).
    #[arg(long)]
    pub greedy: bool,
    /// Compute with f32 activations and exactly dequantized weights (the reference path).
    #[arg(long)]
    pub exact: bool,
    /// Stop at any of these ids (comma-separated); none by default.
    #[arg(long, value_name = "IDS", value_delimiter = ',')]
    pub stop: Vec<u32>,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Shape of the checkpoint.
    #[arg(long, value_name = "PRESET", value_parser = choice_parser!(Preset))]
    pub preset: Preset,
    /// Output directory (created if needed).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Random seed (the same seed gives the same weights as `--synthetic PRESET --synthetic-seed N`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Layers per safetensors shard.
    #[arg(long, default_value_t = 4)]
    pub layers_per_shard: usize,
}

pub fn info(args: InfoArgs) -> anyhow::Result<()> {
    let (config, source, by_type) = match (&args.model, args.synthetic) {
        (Some(spec), _) => {
            let path = crate::model::resolve_model_path(spec)?;
            if gguf::is_gguf(&path) {
                let file = gguf::GgufFile::open(&path)?;
                let config = file.config()?;
                println!(
                    "file:               {} (GGUF v{})",
                    path.display(),
                    file.version
                );
                let mut by_type: Vec<(String, u64, usize)> = Vec::new();
                for (_, tensor) in file.tensors() {
                    add_size(&mut by_type, tensor.type_name(), tensor.byte_len());
                }
                (config, WeightSource::Gguf, by_type)
            } else {
                let config = ModelConfig::from_file(&path.join("config.json"))?;
                let checkpoint = Checkpoint::open(&path)?;
                // Build the typed views too, so `info` reports any tensor the engine would refuse.
                crate::model::Weights::load(&config, &checkpoint).with_context(|| {
                    format!("the checkpoint in {} is not usable", path.display())
                })?;
                println!("shards:             {}", checkpoint.shard_paths().count());
                let mut by_type = Vec::new();
                for (dtype, bytes) in checkpoint.tensor_sizes() {
                    add_size(&mut by_type, dtype.name(), bytes);
                }
                (config, WeightSource::Mapped, by_type)
            }
        }
        (None, Some(preset)) => {
            println!(
                "preset:             {} (layout only, no weights)",
                preset.name()
            );
            (preset.config(), WeightSource::Mapped, Vec::new())
        }
        (None, None) => anyhow::bail!("name a model: --model PATH or --synthetic PRESET"),
    };
    print_config(&config);
    if !by_type.is_empty() {
        let mut by_type = by_type;
        by_type.sort();
        let tensors: usize = by_type.iter().map(|(_, _, n)| n).sum();
        let total_bytes: u64 = by_type.iter().map(|(_, b, _)| b).sum();
        println!("tensors:            {tensors}");
        for (name, bytes, count) in &by_type {
            println!(
                "  {:<5} {:>5} tensors {:>16} bytes ({})",
                name,
                count,
                bytes,
                human_bytes(*bytes)
            );
        }
        println!(
            "tensor bytes:       {total_bytes} ({})",
            human_bytes(total_bytes)
        );
    }
    println!(
        "parameters:         {} total, {} active per token",
        billions(config.total_parameters()),
        billions(config.active_parameters())
    );
    let context = args
        .context
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings);
    let needs = MemoryNeeds::estimate(
        &config,
        source,
        Precision::Fast,
        WeightFormat::Q8,
        KvFormat::F16,
        context,
    );
    println!(
        "memory:             weights {} (bf16 dense, MXFP4 experts), held in memory {} (q8 \
         attention/unembedding{}), f16 KV cache at {context} tokens {}",
        human_bytes(needs.weights),
        human_bytes(needs.owned),
        if source == WeightSource::Gguf {
            ", repacked GGUF experts"
        } else {
            ""
        },
        human_bytes(needs.kv)
    );
    if let Some(machine) = SystemMemory::read() {
        let verdict = match needs.check(machine) {
            Ok(None) => "fits".to_string(),
            Ok(Some(warning)) => format!("loads, but {warning}"),
            Err(err) => err.to_string(),
        };
        println!(
            "this machine:       {} RAM, {} available: {verdict}",
            human_bytes(machine.total),
            human_bytes(machine.available)
        );
    }
    Ok(())
}

fn add_size(by_type: &mut Vec<(String, u64, usize)>, name: &str, bytes: usize) {
    match by_type.iter_mut().find(|(n, _, _)| n == name) {
        Some(entry) => {
            entry.1 += bytes as u64;
            entry.2 += 1;
        }
        None => by_type.push((name.to_string(), bytes as u64, 1)),
    }
}

fn print_config(c: &ModelConfig) {
    println!("vocab_size:         {}", c.vocab_size);
    println!("hidden_size:        {}", c.hidden_size);
    println!("layers:             {}", c.num_hidden_layers);
    println!(
        "attention:          {} query heads, {} KV heads, head_dim {}",
        c.num_attention_heads, c.num_key_value_heads, c.head_dim
    );
    let sliding = c
        .layer_kinds
        .iter()
        .filter(|k| **k == crate::model::LayerKind::Sliding)
        .count();
    println!(
        "layer types:        {} sliding (window {}), {} full",
        sliding,
        c.sliding_window,
        c.num_hidden_layers - sliding
    );
    println!(
        "experts:            {} per layer, {} per token, intermediate {}",
        c.num_local_experts, c.num_experts_per_tok, c.intermediate_size
    );
    match &c.rope_scaling {
        RopeScaling::None => println!("rope:               theta {}", c.rope_theta),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } => println!(
            "rope:               yarn, theta {}, factor {}, original context {}, attention factor {:.6}",
            c.rope_theta, factor, original_max_position_embeddings, attention_factor
        ),
    }
    println!(
        "context:            {} positions",
        c.max_position_embeddings
    );
}

fn billions(n: u64) -> String {
    format!("{:.2}B ({n})", n as f64 / 1e9)
}

pub fn human_bytes(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

pub fn logits(args: LogitsArgs) -> anyhow::Result<()> {
    let model = args.model.load(args.exact)?;
    let mut session = model.new_session(&args.model.pool()?, args.tokens.len());
    let mut all = Vec::with_capacity(args.tokens.len() * model.config.vocab_size);
    session.prefill_all_logits(&args.tokens, &mut all)?;
    let mut bytes = Vec::with_capacity(all.len() * 4);
    for value in &all {
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    std::fs::write(&args.out, bytes)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    eprintln!(
        "wrote {} x {} logits to {}",
        args.tokens.len(),
        model.config.vocab_size,
        args.out.display()
    );
    Ok(())
}

pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    if !args.greedy {
        anyhow::bail!(
            "`generate` decodes greedily; pass --greedy (use `ossterm run` for sampling)"
        );
    }
    let model = args.model.load(args.exact)?;
    let pool = args.model.pool()?;
    let mut session = model.new_session(&pool, args.tokens.len() + args.max_tokens);
    let mut generated = Vec::with_capacity(args.max_tokens);
    // The loop runs on the session's pool, as the app's generation does.
    let (prefill_time, decode_time) = pool.install(|| -> anyhow::Result<_> {
        let started = Instant::now();
        let mut logits = session.prefill(&args.tokens)?;
        let prefill_time = started.elapsed();
        let decode_start = Instant::now();
        while generated.len() < args.max_tokens {
            let next = crate::engine::sampler::argmax(logits).unwrap_or(0);
            generated.push(next);
            if args.stop.contains(&next) || generated.len() == args.max_tokens {
                break;
            }
            logits = session.decode(next)?;
        }
        Ok((prefill_time, decode_start.elapsed()))
    })?;
    eprintln!(
        "prefill {} tokens in {:.2} s, generated {} tokens in {:.2} s",
        args.tokens.len(),
        prefill_time.as_secs_f64(),
        generated.len(),
        decode_time.as_secs_f64()
    );
    let line: Vec<String> = generated.iter().map(u32::to_string).collect();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", line.join(","))?;
    Ok(())
}

pub fn synth(args: SynthArgs) -> anyhow::Result<()> {
    let config = args.preset.config();
    let started = Instant::now();
    let written = synthetic::write_checkpoint(
        &config,
        args.seed,
        &args.out,
        args.layers_per_shard,
        |done, total| {
            eprint!("\rwriting shard {done}/{total}");
            let _ = std::io::stderr().flush();
        },
    )?;
    eprintln!();
    println!(
        "wrote {} tensors in {} shards ({}) to {} in {:.1} s",
        written.tensors,
        written.shards,
        human_bytes(written.bytes),
        args.out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
