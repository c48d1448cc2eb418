//! Commands that work on checkpoints and raw token ids: info, logits, generate, synth.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use super::output::{self, note, Out};
use super::{limits, ModelArgs};
use crate::model::checkpoint::{Checkpoint, ValueScan};
use crate::model::gguf;
use crate::model::memory::{GgufHeld, MemoryNeeds, SystemMemory, WeightSource};
use crate::model::{
    synthetic, KvFormat, LoadOptions, ModelConfig, Precision, Preset, RopeScaling, WeightFormat,
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
    /// Also read every value of every tensor and report each one holding NaN or infinity (or an
    /// MXFP4 scale of 0xFF, E8M0's NaN; in a GGUF also Q8_0 block scales). Reads the whole model.
    #[arg(long)]
    pub check: bool,
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
    let mut out = output::stdout();
    let (config, source, mut by_type) = match (&args.model, args.synthetic) {
        (Some(spec), _) => {
            let path = crate::model::resolve_model_path(spec)?;
            if gguf::is_gguf(&path) {
                let file = gguf::GgufFile::open(&path)?;
                if args.check {
                    let mut tensors: Vec<(&str, usize)> = file
                        .tensors()
                        .map(|(name, tensor)| (name, tensor.byte_len()))
                        .collect();
                    tensors.sort_unstable();
                    check_values(&mut out, &tensors, &|name| file.scan_values(name), &path)?;
                }
                let config = file.config()?;
                writeln!(
                    out,
                    "file:               {} (GGUF v{})",
                    path.display(),
                    file.version
                )?;
                let mut by_type: Vec<(String, u64, usize)> = Vec::new();
                for (_, tensor) in file.tensors() {
                    add_size(&mut by_type, tensor.type_name(), tensor.byte_len());
                }
                let held = GgufHeld::of(&file, &config);
                (config, WeightSource::Gguf(held), by_type)
            } else {
                if !path.is_dir() {
                    return Err(crate::model::ModelError::MissingDir(path).into());
                }
                let config = ModelConfig::from_file(&path.join("config.json"))?;
                let checkpoint = Checkpoint::open(&path)?;
                // The scan comes first: loading stops at the first bad tensor, the scan lists them all.
                if args.check {
                    let mut tensors: Vec<(&str, usize)> = checkpoint
                        .tensor_names()
                        .filter_map(|name| Some((name, checkpoint.info(name)?.byte_len())))
                        .collect();
                    tensors.sort_unstable();
                    let scan = |name: &str| checkpoint.scan_values(name);
                    check_values(&mut out, &tensors, &scan, &path)?;
                }
                // Build the typed views too, so `info` reports any tensor the engine would refuse.
                crate::model::Weights::load(&config, &checkpoint).with_context(|| {
                    format!("the checkpoint in {} is not usable", path.display())
                })?;
                writeln!(
                    out,
                    "shards:             {}",
                    checkpoint.shard_paths().count()
                )?;
                let mut by_type = Vec::new();
                for (dtype, bytes) in checkpoint.tensor_sizes() {
                    add_size(&mut by_type, dtype.name(), bytes);
                }
                (config, WeightSource::Mapped, by_type)
            }
        }
        (None, Some(preset)) => {
            writeln!(
                out,
                "preset:             {} (layout only, no weights)",
                preset.name()
            )?;
            (preset.config(), WeightSource::Mapped, Vec::new())
        }
        (None, None) => anyhow::bail!("name a model: --model PATH or --synthetic PRESET"),
    };
    print_config(&mut out, &config)?;
    if !by_type.is_empty() {
        by_type.sort();
        let tensors: usize = by_type.iter().map(|(_, _, n)| n).sum();
        let total_bytes: u64 = by_type.iter().map(|(_, b, _)| b).sum();
        writeln!(out, "tensors:            {tensors}")?;
        for (name, bytes, count) in &by_type {
            writeln!(
                out,
                "  {:<5} {:>5} tensors {:>16} bytes ({})",
                name,
                count,
                bytes,
                human_bytes(*bytes)
            )?;
        }
        writeln!(
            out,
            "tensor bytes:       {total_bytes} ({})",
            human_bytes(total_bytes)
        )?;
    }
    writeln!(
        out,
        "parameters:         {} total, {} active per token",
        billions(config.total_parameters()),
        billions(config.active_parameters())
    )?;
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
    )
    .with_tiled_experts(&config, &LoadOptions::default(), SystemMemory::read())
    .with_draft_unembedding(&config, &LoadOptions::default());
    let tiled = if needs.tiled > 0 {
        format!(
            ", MXFP4 experts reordered into tiles {}",
            human_bytes(needs.tiled)
        )
    } else {
        String::new()
    };
    writeln!(
        out,
        "memory:             weights {} ({}), held in memory {} (q8 attention/unembedding with \
         the unembedding's q4 draft, f32 vectors{tiled}{}), f16 KV cache at {context} tokens {}",
        human_bytes(needs.weights),
        match source {
            WeightSource::Gguf(_) => "as the file stores them",
            _ => "bf16 dense, MXFP4 experts",
        },
        human_bytes(needs.owned),
        match source {
            WeightSource::Gguf(held) => held.describe(),
            _ => String::new(),
        },
        human_bytes(needs.kv)
    )?;
    if let Some(machine) = SystemMemory::read() {
        let verdict = match needs.check(machine) {
            Ok(None) => "fits".to_string(),
            Ok(Some(warning)) => format!("loads, but {warning}"),
            Err(err) => err.to_string(),
        };
        writeln!(
            out,
            "this machine:       {} RAM, {} available: {verdict}",
            human_bytes(machine.total),
            human_bytes(machine.available)
        )?;
    }
    out.flush()?;
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

/// `info --check`: every value of every tensor of the model at `path` ((name, bytes), in the order
/// given) through `scan`, one line per bad tensor on stdout, progress on stderr; an error when any
/// tensor is bad.
fn check_values(
    out: &mut Out,
    tensors: &[(&str, usize)],
    scan: &dyn Fn(&str) -> Result<ValueScan, crate::model::ModelError>,
    path: &Path,
) -> anyhow::Result<()> {
    let names: Vec<&str> = tensors.iter().map(|(name, _)| *name).collect();
    let total_bytes: u64 = tensors.iter().map(|(_, bytes)| *bytes as u64).sum();
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut done_bytes = 0u64;
    let mut bad = 0usize;
    let mut last_percent = None;
    for (index, name) in names.iter().enumerate() {
        let percent = (done_bytes * 100).checked_div(total_bytes).unwrap_or(100);
        if tty && last_percent != Some(percent) {
            let mut err = std::io::stderr().lock();
            let _ = write!(
                err,
                "\r\x1b[2Kchecking values: {percent}% (tensor {}/{})",
                index + 1,
                names.len()
            );
            let _ = err.flush();
            last_percent = Some(percent);
        }
        let report = scan(name)?;
        crate::fault::check()?;
        done_bytes += report.bytes as u64;
        if let Some(found) = report.bad {
            if tty {
                let _ = write!(std::io::stderr(), "\r\x1b[2K");
            }
            bad += 1;
            writeln!(out, "bad tensor {name}: {found}")?;
            out.flush()?;
        }
    }
    if tty {
        let _ = write!(std::io::stderr(), "\r\x1b[2K");
    }
    if bad > 0 {
        anyhow::bail!(
            "{bad} of {} tensors hold NaN, infinity or NaN scales: the model in {} is corrupt",
            names.len(),
            path.display()
        );
    }
    writeln!(
        out,
        "values:             all {} tensors finite ({})",
        names.len(),
        human_bytes(done_bytes)
    )?;
    out.flush()?;
    Ok(())
}

fn print_config(out: &mut Out, c: &ModelConfig) -> Result<(), output::OutputError> {
    writeln!(out, "vocab_size:         {}", c.vocab_size)?;
    writeln!(out, "hidden_size:        {}", c.hidden_size)?;
    writeln!(out, "layers:             {}", c.num_hidden_layers)?;
    writeln!(
        out,
        "attention:          {} query heads, {} KV heads, head_dim {}",
        c.num_attention_heads, c.num_key_value_heads, c.head_dim
    )?;
    let sliding = c
        .layer_kinds
        .iter()
        .filter(|k| **k == crate::model::LayerKind::Sliding)
        .count();
    writeln!(
        out,
        "layer types:        {} sliding (window {}), {} full",
        sliding,
        c.sliding_window,
        c.num_hidden_layers - sliding
    )?;
    writeln!(
        out,
        "experts:            {} per layer, {} per token, intermediate {}",
        c.num_local_experts, c.num_experts_per_tok, c.intermediate_size
    )?;
    match &c.rope_scaling {
        RopeScaling::None => writeln!(out, "rope:               theta {}", c.rope_theta)?,
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } => writeln!(
            out,
            "rope:               yarn, theta {}, factor {}, original context {}, attention factor {:.6}",
            c.rope_theta, factor, original_max_position_embeddings, attention_factor
        )?,
    }
    writeln!(
        out,
        "context:            {} positions",
        c.max_position_embeddings
    )
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
    let context = args.tokens.len();
    limits::check_context(&model, context, &[("token ids of --tokens", context)])?;
    let pool = args.model.pool()?;
    let written = write_logits(&model, &pool, &args.tokens, &args.out);
    if written.is_err() {
        // A partial file would pass for the logits of fewer tokens.
        let _ = std::fs::remove_file(&args.out);
    }
    written?;
    note!(
        "wrote {} x {} logits to {}",
        args.tokens.len(),
        model.config.vocab_size,
        args.out.display()
    );
    Ok(())
}

/// Streams the logits to `path` one prefill chunk at a time, so memory stays at one chunk's rows
/// however many tokens there are.
fn write_logits(
    model: &std::sync::Arc<crate::model::Model>,
    pool: &std::sync::Arc<rayon::ThreadPool>,
    tokens: &[u32],
    path: &Path,
) -> anyhow::Result<()> {
    let write_error = |source| anyhow::anyhow!("cannot write {}: {source}", path.display());
    let file = std::fs::File::create(path).map_err(write_error)?;
    let mut file = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut session = model.new_session(pool, tokens.len());
    let vocab = model.config.vocab_size;
    let chunk = session.chunk_len().max(1);
    let mut rows = Vec::new();
    let mut bytes = Vec::new();
    for (chunk_index, part) in tokens.chunks(chunk).enumerate() {
        rows.clear();
        pool.install(|| session.prefill_all_logits(part, &mut rows))?;
        crate::fault::check()?;
        for (row, logits) in rows.chunks(vocab).enumerate() {
            crate::engine::check_logits(logits, chunk_index * chunk + row + 1)?;
        }
        bytes.clear();
        for value in &rows {
            bytes.extend_from_slice(&value.to_le_bytes());
        }
        file.write_all(&bytes).map_err(write_error)?;
    }
    file.flush().map_err(write_error)?;
    crate::fault::verify_files()?;
    Ok(())
}

pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    if !args.greedy {
        anyhow::bail!(
            "`generate` decodes greedily; pass --greedy (use `ossterm run` for sampling)"
        );
    }
    let model = args.model.load(args.exact)?;
    let parts = [
        ("prompt tokens", args.tokens.len()),
        ("--max-tokens", args.max_tokens),
    ];
    let context = limits::positions(&parts)?;
    limits::check_context(&model, context, &parts)?;
    let pool = args.model.pool()?;
    let mut session = model.new_session(&pool, context);
    let mut sampler = crate::engine::Sampler::new(crate::engine::SamplerSettings::greedy())?;
    // Each id is written and flushed as soon as it is chosen: whatever stops the run (an error,
    // a signal, a closed pipe), the ids made so far are already out.
    // The loop runs on the session's pool, as the app's generation does.
    let (generated, timings) = pool.install(|| {
        let mut out = output::stdout();
        let mut generated = 0usize;
        let timings = (|| -> anyhow::Result<_> {
            let started = Instant::now();
            crate::fault::verify_files()?;
            let mut logits = session.prefill(&args.tokens)?;
            crate::fault::check()?;
            crate::engine::check_logits(logits, args.tokens.len())?;
            let prefill_time = started.elapsed();
            let decode_start = Instant::now();
            while generated < args.max_tokens {
                let next = sampler.sample(logits)?;
                let separator = if generated == 0 { "" } else { "," };
                write!(out, "{separator}{next}")?;
                out.flush()?;
                generated += 1;
                if args.stop.contains(&next) || generated == args.max_tokens {
                    break;
                }
                logits = session.decode(next)?;
                // A stat per shard (microseconds) also catches a shard rewritten in place.
                crate::fault::verify_files()?;
                crate::engine::check_logits(logits, args.tokens.len() + generated)?;
            }
            crate::fault::verify_files()?;
            Ok((prefill_time, decode_start.elapsed()))
        })();
        // End the line of ids, also when the run failed after printing some.
        let ended = if timings.is_ok() || generated > 0 {
            writeln!(out).and_then(|()| out.flush())
        } else {
            Ok(())
        };
        match (timings, ended) {
            (Err(error), _) => (generated, Err(error)),
            (Ok(_), Err(error)) => (generated, Err(error.into())),
            (Ok(timings), Ok(())) => (generated, Ok(timings)),
        }
    });
    let (prefill_time, decode_time) = timings?;
    note!(
        "prefill {} tokens in {:.2} s, generated {} tokens in {:.2} s",
        args.tokens.len(),
        prefill_time.as_secs_f64(),
        generated,
        decode_time.as_secs_f64()
    );
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
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\rwriting shard {done}/{total}");
            let _ = err.flush();
        },
    );
    note!("");
    let written = written?;
    let mut out = output::stdout();
    writeln!(
        out,
        "wrote {} tensors in {} shards ({}) to {} in {:.1} s",
        written.tensors,
        written.shards,
        human_bytes(written.bytes),
        args.out.display(),
        started.elapsed().as_secs_f64()
    )?;
    out.flush()?;
    Ok(())
}
