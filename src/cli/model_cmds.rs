//! Commands that work on checkpoints and raw token ids: info, logits, generate, synth.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use super::ModelArgs;
use crate::model::checkpoint::{Checkpoint, Dtype};
use crate::model::{synthetic, ModelConfig, Preset, RopeScaling};

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Checkpoint directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
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
    let dir = &args.model;
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let checkpoint = Checkpoint::open(dir)?;
    // Build the typed views too, so `info` reports any tensor the engine would refuse.
    crate::model::Weights::load(&config, &checkpoint)
        .with_context(|| format!("the checkpoint in {} is not usable", dir.display()))?;
    print_config(&config);
    let mut by_dtype: Vec<(Dtype, u64, usize)> = Vec::new();
    for (dtype, bytes) in checkpoint.tensor_sizes() {
        match by_dtype.iter_mut().find(|(d, _, _)| *d == dtype) {
            Some(entry) => {
                entry.1 += bytes as u64;
                entry.2 += 1;
            }
            None => by_dtype.push((dtype, bytes as u64, 1)),
        }
    }
    by_dtype.sort_by_key(|(d, _, _)| d.name());
    let tensors: usize = by_dtype.iter().map(|(_, _, n)| n).sum();
    let total_bytes: u64 = by_dtype.iter().map(|(_, b, _)| b).sum();
    println!("shards:             {}", checkpoint.shard_paths().count());
    println!("tensors:            {tensors}");
    for (dtype, bytes, count) in &by_dtype {
        println!(
            "  {:<5} {:>5} tensors {:>16} bytes ({})",
            dtype.name(),
            count,
            bytes,
            human_bytes(*bytes)
        );
    }
    println!(
        "tensor bytes:       {total_bytes} ({})",
        human_bytes(total_bytes)
    );
    println!(
        "parameters:         {} total, {} active per token",
        billions(config.total_parameters()),
        billions(config.active_parameters())
    );
    Ok(())
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
