//! `ossterm cache`: lists the KV snapshots on disk (chat, tokens, size, age) or empties the cache.

use std::path::PathBuf;
use std::time::SystemTime;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::config::{self, ConfigOverrides};
use crate::engine::generate::group_thousands;
use crate::engine::kv_tiers::{clear_dir, list_dir};

#[derive(Args, Debug)]
pub struct CacheArgs {
    #[command(subcommand)]
    pub action: Option<CacheAction>,
    /// Directory of KV snapshots (default: paths.cache_dir, else the platform cache directory).
    #[arg(long, value_name = "DIR", global = true)]
    pub cache_dir: Option<PathBuf>,
    /// Config file to read paths.cache_dir from (default: the platform config file).
    #[arg(long, value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum CacheAction {
    /// List the snapshots (the default).
    List,
    /// Delete every snapshot.
    Clear,
}

pub fn cache(args: CacheArgs) -> anyhow::Result<()> {
    let overrides = ConfigOverrides {
        cache_dir: args.cache_dir.clone(),
        ..ConfigOverrides::default()
    };
    let config = config::load(args.config.as_deref(), &overrides)?;
    let dir = config
        .cache
        .resolved_dir()
        .context("no platform cache directory; set paths.cache_dir or --cache-dir")?;
    match args.action.unwrap_or(CacheAction::List) {
        CacheAction::Clear => {
            let (count, bytes) =
                clear_dir(&dir).with_context(|| format!("cannot empty {}", dir.display()))?;
            println!(
                "deleted {count} snapshot files ({}) from {}",
                size(bytes),
                dir.display()
            );
        }
        CacheAction::List => {
            let (entries, bad) = list_dir(&dir);
            println!("KV snapshots in {}", dir.display());
            if entries.is_empty() {
                println!("(none)");
            } else {
                println!(
                    "{:<48}  {:>8}  {:>5}  {:>10}  {:>8}  file",
                    "chat", "tokens", "kv", "size", "age"
                );
            }
            let now = SystemTime::now();
            for entry in &entries {
                let age = now
                    .duration_since(entry.last_used)
                    .unwrap_or_default()
                    .as_secs();
                let label = if entry.header.label.is_empty() {
                    "(untitled)"
                } else {
                    &entry.header.label
                };
                println!(
                    "{:<48}  {:>8}  {:>5}  {:>10}  {:>8}  {}",
                    label,
                    group_thousands(entry.header.tokens.len() as u64),
                    entry.header.format.name(),
                    size(entry.size),
                    age_text(age),
                    entry
                        .path
                        .file_name()
                        .map(|n| n.to_string_lossy())
                        .unwrap_or_default()
                );
            }
            let total: u64 = entries.iter().map(|e| e.size).sum();
            println!(
                "{} snapshots, {} (budget cache.max_disk_mb = {} MiB)",
                entries.len(),
                size(total),
                config.cache.max_disk_mb
            );
            for error in bad {
                eprintln!("unreadable: {error}");
            }
        }
    }
    Ok(())
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn age_text(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s if s < 172_800 => format!("{} h", s / 3600),
        s => format!("{} d", s / 86_400),
    }
}
