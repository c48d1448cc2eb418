//! The app configuration: defaults, a TOML file, command-line overrides.
//!
//! Precedence, lowest first: built-in defaults, the file in the platform config directory (or the
//! file given with `--config`, which replaces it), then command-line flags. Every key of the file is
//! optional; a key the app does not know is an error that names it and its line, so a typo never
//! silently falls back to a default.

use crate::engine::protocol::{
    ActivationFormat, KvCacheType, ReasoningEffort, SamplingSettings, Settings, WeightFormat,
};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// File name of the config inside the platform config directory.
pub const CONFIG_FILE_NAME: &str = "config.toml";

/// Available memory needed before the no-model default picks the synthetic 20b demo over the tiny
/// one. The demo holds 12.8 GiB of random weights, 1.2 GiB of q8 copies of the attention and
/// unembedding matrices and a 0.4 GiB KV cache (8192 tokens, f16): about 14.5 GiB, plus headroom so
/// the rest of the system is not pushed into swap.
pub const SYNTHETIC_20B_MIN_MEMORY_BYTES: u64 = 16 * 1024 * 1024 * 1024;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}, line {line}: key `{key}`: {message}")]
    InvalidKey {
        path: PathBuf,
        line: usize,
        key: String,
        message: String,
    },
    #[error("config file {path}, line {line}: {message}")]
    Syntax {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("invalid value for {flag}: {message}")]
    InvalidFlag { flag: String, message: String },
}

/// Which random-weight model to run when no checkpoint is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub enum SyntheticChoice {
    /// The 20b shape when the machine has the memory available for it, the tiny one otherwise.
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "tiny")]
    Tiny,
    #[serde(rename = "20b")]
    Gpt20b,
}

impl SyntheticChoice {
    pub fn from_name(text: &str) -> Option<SyntheticChoice> {
        match text {
            "auto" => Some(SyntheticChoice::Auto),
            "tiny" => Some(SyntheticChoice::Tiny),
            "20b" => Some(SyntheticChoice::Gpt20b),
            _ => None,
        }
    }

    /// Settles `Auto` against the memory available now (`None` when unknown: take the safe tiny
    /// model).
    pub fn resolve(self, available_memory_bytes: Option<u64>) -> SyntheticChoice {
        match self {
            SyntheticChoice::Auto => match available_memory_bytes {
                Some(bytes) if bytes >= SYNTHETIC_20B_MIN_MEMORY_BYTES => SyntheticChoice::Gpt20b,
                _ => SyntheticChoice::Tiny,
            },
            settled => settled,
        }
    }
}

impl fmt::Display for SyntheticChoice {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            SyntheticChoice::Auto => "auto",
            SyntheticChoice::Tiny => "tiny",
            SyntheticChoice::Gpt20b => "20b",
        })
    }
}

/// Where the model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    Checkpoint(PathBuf),
    Synthetic(SyntheticChoice),
}

/// The resolved configuration the app runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct AppConfig {
    pub model: ModelSource,
    pub settings: Settings,
    /// Directory of saved chats; `None` means the platform data directory.
    pub chats_dir: Option<PathBuf>,
    /// The file the values came from, if any (shown in the help overlay).
    pub loaded_from: Option<PathBuf>,
    /// Where and how much the KV snapshot tiers keep.
    pub cache: CacheConfig,
}

/// The KV snapshot tiers' settings: `paths.cache_dir`, `cache.max_disk_mb`, `cache.max_ram_mb`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// `None` means the platform cache directory.
    pub dir: Option<PathBuf>,
    /// 0 keeps snapshots in RAM only.
    pub max_disk_mb: u64,
    /// 0 keeps no snapshots in RAM (disk snapshots are still read).
    pub max_ram_mb: u64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            dir: None,
            max_disk_mb: crate::engine::kv_tiers::DEFAULT_DISK_MB,
            max_ram_mb: crate::engine::kv_tiers::DEFAULT_RAM_MB,
        }
    }
}

impl CacheConfig {
    /// The snapshot directory: the configured one or the platform cache directory.
    pub fn resolved_dir(&self) -> Option<PathBuf> {
        self.dir
            .clone()
            .or_else(crate::engine::kv_tiers::default_cache_dir)
    }

    /// What the engine's tiers run with.
    pub fn tiers(&self) -> crate::engine::kv_tiers::TierConfig {
        crate::engine::kv_tiers::TierConfig {
            ram_budget_bytes: self.max_ram_mb << 20,
            disk_dir: (self.max_disk_mb > 0)
                .then(|| self.resolved_dir())
                .flatten(),
            disk_budget_bytes: self.max_disk_mb << 20,
        }
    }
}

impl Default for AppConfig {
    fn default() -> Self {
        AppConfig {
            model: ModelSource::Synthetic(SyntheticChoice::Auto),
            settings: Settings::default(),
            chats_dir: None,
            loaded_from: None,
            cache: CacheConfig::default(),
        }
    }
}

/// Command-line values that override the file; `None` leaves the file's (or default) value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigOverrides {
    pub model_dir: Option<PathBuf>,
    pub synthetic: Option<SyntheticChoice>,
    pub threads: Option<usize>,
    pub weight_format: Option<WeightFormat>,
    pub activations: Option<ActivationFormat>,
    pub kv_cache: Option<KvCacheType>,
    pub context_limit: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    pub reasoning_effort: Option<ReasoningEffort>,
    pub chats_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    model: ModelSection,
    #[serde(default)]
    engine: EngineSection,
    #[serde(default)]
    sampling: SamplingSection,
    #[serde(default)]
    chat: ChatSection,
    #[serde(default)]
    paths: PathsSection,
    #[serde(default)]
    cache: CacheSection,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheSection {
    max_disk_mb: Option<u64>,
    max_ram_mb: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    path: Option<PathBuf>,
    synthetic: Option<SyntheticChoice>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineSection {
    threads: Option<usize>,
    weight_format: Option<WeightFormat>,
    activations: Option<ActivationFormat>,
    kv_cache: Option<KvCacheType>,
    context_limit: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SamplingSection {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    max_tokens: Option<usize>,
    seed: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatSection {
    reasoning_effort: Option<ReasoningEffort>,
    keep_reasoning_in_context: Option<bool>,
    system_prompt: Option<String>,
    developer_instructions: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathsSection {
    chats_dir: Option<PathBuf>,
    cache_dir: Option<PathBuf>,
}

/// The platform directories of the app (`~/.config/ossterm`, `~/.local/share/ossterm` on Linux).
pub fn project_dirs() -> Option<directories::ProjectDirs> {
    directories::ProjectDirs::from("", "", "ossterm")
}

/// The config file the app reads when `--config` is not given.
pub fn default_config_path() -> Option<PathBuf> {
    project_dirs().map(|dirs| dirs.config_dir().join(CONFIG_FILE_NAME))
}

/// Where saved chats go when the config does not say.
pub fn default_chats_dir() -> Option<PathBuf> {
    project_dirs().map(|dirs| dirs.data_dir().join("chats"))
}

/// Loads the configuration: `explicit_path` (from `--config`) must exist; without it the platform
/// file is read if present. Then `overrides` apply, and the result is validated.
pub fn load(
    explicit_path: Option<&Path>,
    overrides: &ConfigOverrides,
) -> Result<AppConfig, ConfigError> {
    let mut config = match explicit_path {
        Some(path) => load_file(path)?,
        None => match default_config_path() {
            Some(path) if path.is_file() => load_file(&path)?,
            _ => AppConfig::default(),
        },
    };
    apply_overrides(&mut config, overrides)?;
    Ok(config)
}

/// Reads and validates one config file on top of the defaults.
pub fn load_file(path: &Path) -> Result<AppConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut config = parse(&text, path)?;
    config.loaded_from = Some(path.to_path_buf());
    Ok(config)
}

/// Parses config text; `path` only labels errors.
pub fn parse(text: &str, path: &Path) -> Result<AppConfig, ConfigError> {
    let file: FileConfig =
        toml::from_str(text).map_err(|error| describe_toml_error(&error, text, path))?;
    let mut config = AppConfig::default();
    let invalid = |section: &str, key: &str, message: String| ConfigError::InvalidKey {
        path: path.to_path_buf(),
        line: locate_key(text, section, key).unwrap_or(1),
        key: format!("{section}.{key}"),
        message,
    };

    if let Some(dir) = file.model.path.filter(|dir| !dir.as_os_str().is_empty()) {
        config.model = ModelSource::Checkpoint(dir);
    } else if let Some(choice) = file.model.synthetic {
        config.model = ModelSource::Synthetic(choice);
    }

    let settings = &mut config.settings;
    if let Some(threads) = file.engine.threads {
        // 0 keeps the default: every available core.
        if threads > 0 {
            settings.threads = threads;
        }
    }
    set(&mut settings.weight_format, file.engine.weight_format);
    set(&mut settings.activations, file.engine.activations);
    set(&mut settings.kv_cache, file.engine.kv_cache);
    set(&mut settings.context_limit, file.engine.context_limit);
    let sampling = &mut settings.sampling;
    set(&mut sampling.temperature, file.sampling.temperature);
    set(&mut sampling.top_p, file.sampling.top_p);
    set(&mut sampling.top_k, file.sampling.top_k);
    set(&mut sampling.min_p, file.sampling.min_p);
    set(&mut sampling.max_tokens, file.sampling.max_tokens);
    if file.sampling.seed.is_some() {
        sampling.seed = file.sampling.seed;
    }
    set(&mut settings.reasoning_effort, file.chat.reasoning_effort);
    set(
        &mut settings.keep_reasoning_in_context,
        file.chat.keep_reasoning_in_context,
    );
    set(&mut settings.system_prompt, file.chat.system_prompt);
    set(
        &mut settings.developer_instructions,
        file.chat.developer_instructions,
    );
    config.chats_dir = file
        .paths
        .chats_dir
        .filter(|dir| !dir.as_os_str().is_empty());
    config.cache.dir = file
        .paths
        .cache_dir
        .filter(|dir| !dir.as_os_str().is_empty());
    set(&mut config.cache.max_disk_mb, file.cache.max_disk_mb);
    set(&mut config.cache.max_ram_mb, file.cache.max_ram_mb);
    for (key, value) in [
        ("max_disk_mb", config.cache.max_disk_mb),
        ("max_ram_mb", config.cache.max_ram_mb),
    ] {
        if value > 1 << 30 {
            return Err(invalid(
                "cache",
                key,
                format!("expected 0..=1073741824 MiB, got {value}"),
            ));
        }
    }

    if let Err((key, message)) = validate_settings(&config.settings) {
        let (section, key) = key.split_once('.').unwrap_or(("", key));
        return Err(invalid(section, key, message));
    }
    Ok(config)
}

fn set<T>(target: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *target = value;
    }
}

/// Checks value ranges; on failure returns the dotted config key and what was expected.
pub fn validate_settings(settings: &Settings) -> Result<(), (&'static str, String)> {
    let sampling: &SamplingSettings = &settings.sampling;
    if settings.threads == 0 || settings.threads > 1024 {
        return Err((
            "engine.threads",
            format!(
                "expected 1..=1024 (0 = all cores), got {}",
                settings.threads
            ),
        ));
    }
    if settings.context_limit < 256 || settings.context_limit > 131_072 {
        return Err((
            "engine.context_limit",
            format!(
                "expected 256..=131072 tokens, got {}",
                settings.context_limit
            ),
        ));
    }
    if !(sampling.temperature.is_finite() && (0.0..=10.0).contains(&sampling.temperature)) {
        return Err((
            "sampling.temperature",
            format!(
                "expected 0.0..=10.0 (0 = greedy), got {}",
                sampling.temperature
            ),
        ));
    }
    if !(sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
        return Err((
            "sampling.top_p",
            format!("expected a value in (0, 1], got {}", sampling.top_p),
        ));
    }
    if !(0.0..1.0).contains(&sampling.min_p) {
        return Err((
            "sampling.min_p",
            format!("expected a value in [0, 1), got {}", sampling.min_p),
        ));
    }
    if sampling.max_tokens == 0 {
        return Err(("sampling.max_tokens", "expected at least 1".to_string()));
    }
    Ok(())
}

fn apply_overrides(config: &mut AppConfig, overrides: &ConfigOverrides) -> Result<(), ConfigError> {
    if let Some(dir) = &overrides.model_dir {
        config.model = ModelSource::Checkpoint(dir.clone());
    } else if let Some(choice) = overrides.synthetic {
        config.model = ModelSource::Synthetic(choice);
    }
    let settings = &mut config.settings;
    if let Some(threads) = overrides.threads.filter(|threads| *threads > 0) {
        settings.threads = threads;
    }
    set(&mut settings.weight_format, overrides.weight_format);
    set(&mut settings.activations, overrides.activations);
    set(&mut settings.kv_cache, overrides.kv_cache);
    set(&mut settings.context_limit, overrides.context_limit);
    set(&mut settings.sampling.temperature, overrides.temperature);
    set(&mut settings.sampling.top_p, overrides.top_p);
    set(&mut settings.sampling.top_k, overrides.top_k);
    set(&mut settings.sampling.min_p, overrides.min_p);
    set(&mut settings.sampling.max_tokens, overrides.max_tokens);
    if overrides.seed.is_some() {
        settings.sampling.seed = overrides.seed;
    }
    set(&mut settings.reasoning_effort, overrides.reasoning_effort);
    if overrides.chats_dir.is_some() {
        config.chats_dir.clone_from(&overrides.chats_dir);
    }
    if overrides.cache_dir.is_some() {
        config.cache.dir.clone_from(&overrides.cache_dir);
    }
    validate_settings(settings).map_err(|(key, message)| ConfigError::InvalidFlag {
        flag: format!(
            "--{}",
            key.rsplit('.').next().unwrap_or(key).replace('_', "-")
        ),
        message,
    })
}

/// 1-based line of byte `offset` in `text`.
fn line_of_offset(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The table header (`[section]`) in force at 1-based `line`, or "" at top level.
fn section_at_line(text: &str, line: usize) -> String {
    text.lines()
        .take(line)
        .filter_map(table_header)
        .last()
        .unwrap_or_default()
}

fn table_header(line: &str) -> Option<String> {
    let trimmed = line.trim();
    let inner = trimmed.strip_prefix('[')?.split(']').next()?;
    Some(inner.trim_matches(['[', ' ']).trim().to_string())
}

/// 1-based line where `key` is assigned inside `[section]`.
fn locate_key(text: &str, section: &str, key: &str) -> Option<usize> {
    let mut current = String::new();
    for (index, line) in text.lines().enumerate() {
        if let Some(header) = table_header(line) {
            current = header;
            continue;
        }
        let Some((name, _)) = line.split_once('=') else {
            continue;
        };
        if current == section && name.trim().trim_matches('"') == key {
            return Some(index + 1);
        }
    }
    None
}

/// Turns a toml/serde error into one that names the line and, where the span points at a key or
/// value, the dotted key.
fn describe_toml_error(error: &toml::de::Error, text: &str, path: &Path) -> ConfigError {
    let message = error.message().trim().to_string();
    let Some(span) = error.span() else {
        return ConfigError::Syntax {
            path: path.to_path_buf(),
            line: 1,
            message,
        };
    };
    let line = line_of_offset(text, span.start);
    let source_line = text.lines().nth(line - 1).unwrap_or("");
    let key = if let Some(header) = table_header(source_line) {
        Some(header)
    } else {
        source_line.split_once('=').map(|(name, _)| {
            let section = section_at_line(text, line);
            let name = name.trim().trim_matches('"');
            if section.is_empty() {
                name.to_string()
            } else {
                format!("{section}.{name}")
            }
        })
    };
    match key {
        Some(key) if !key.is_empty() => ConfigError::InvalidKey {
            path: path.to_path_buf(),
            line,
            key,
            message,
        },
        _ => ConfigError::Syntax {
            path: path.to_path_buf(),
            line,
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_str(text: &str) -> Result<AppConfig, ConfigError> {
        parse(text, Path::new("test.toml"))
    }

    #[test]
    fn empty_file_gives_defaults() {
        let config = parse_str("").expect("empty config parses");
        assert_eq!(config.settings, Settings::default());
        assert_eq!(config.model, ModelSource::Synthetic(SyntheticChoice::Auto));
    }

    #[test]
    fn unknown_key_is_named_with_its_line() {
        let error = parse_str("[sampling]\ntemperature = 0.7\ntop_q = 0.5\n").unwrap_err();
        match error {
            ConfigError::InvalidKey {
                line, key, message, ..
            } => {
                assert_eq!(line, 3);
                assert_eq!(key, "sampling.top_q");
                assert!(message.contains("unknown field"), "{message}");
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn unknown_section_is_named() {
        let error = parse_str("[engine]\nthreads = 2\n\n[colours]\nx = 1\n").unwrap_err();
        let text = error.to_string();
        assert!(text.contains("colours"), "{text}");
    }

    #[test]
    fn wrong_type_names_key_and_line() {
        let error = parse_str("[engine]\n\nweight_format = \"q5\"\n").unwrap_err();
        match error {
            ConfigError::InvalidKey {
                line, key, message, ..
            } => {
                assert_eq!((line, key.as_str()), (3, "engine.weight_format"));
                assert!(message.contains("q5"), "{message}");
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn activations_parse_and_a_bad_one_names_key_and_line() {
        let config = parse_str("[engine]\nactivations = \"q8x2\"\n").unwrap();
        assert_eq!(config.settings.activations, ActivationFormat::Q8x2);
        let config = parse_str("[engine]\nactivations = \"q8\"\n").unwrap();
        assert_eq!(config.settings.activations, ActivationFormat::Q8);

        let error = parse_str("[engine]\nthreads = 2\nactivations = \"q4\"\n").unwrap_err();
        match error {
            ConfigError::InvalidKey {
                line, key, message, ..
            } => {
                assert_eq!((line, key.as_str()), (3, "engine.activations"));
                assert!(message.contains("q4"), "{message}");
                assert!(
                    message.contains("q8x2"),
                    "names the accepted values: {message}"
                );
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
        let error = parse_str("[engine]\n\nactivations = 8\n").unwrap_err();
        match error {
            ConfigError::InvalidKey { line, key, .. } => {
                assert_eq!((line, key.as_str()), (3, "engine.activations"))
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn activations_flag_beats_the_file_and_the_file_beats_the_default() {
        let mut config = parse_str("[engine]\nactivations = \"q8\"\n").unwrap();
        apply_overrides(&mut config, &ConfigOverrides::default()).unwrap();
        assert_eq!(config.settings.activations, ActivationFormat::Q8);
        let overrides = ConfigOverrides {
            activations: Some(ActivationFormat::Q8x2),
            ..Default::default()
        };
        apply_overrides(&mut config, &overrides).unwrap();
        assert_eq!(config.settings.activations, ActivationFormat::Q8x2);
        assert_eq!(
            AppConfig::default().settings.activations,
            ActivationFormat::Mixed
        );
    }

    #[test]
    fn out_of_range_value_names_key_and_line() {
        let error = parse_str("[sampling]\nseed = 3\ntop_p = 1.5\n").unwrap_err();
        match error {
            ConfigError::InvalidKey { line, key, .. } => {
                assert_eq!((line, key.as_str()), (3, "sampling.top_p"))
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn overrides_beat_the_file() {
        let mut config = parse_str("[sampling]\ntemperature = 0.5\ntop_k = 40\n").unwrap();
        let overrides = ConfigOverrides {
            temperature: Some(0.0),
            ..Default::default()
        };
        apply_overrides(&mut config, &overrides).unwrap();
        assert_eq!(config.settings.sampling.temperature, 0.0);
        assert_eq!(config.settings.sampling.top_k, 40);
    }

    #[test]
    fn bad_override_names_the_flag() {
        let mut config = AppConfig::default();
        let overrides = ConfigOverrides {
            top_p: Some(0.0),
            ..Default::default()
        };
        let error = apply_overrides(&mut config, &overrides).unwrap_err();
        assert!(error.to_string().contains("--top-p"), "{error}");
    }

    #[test]
    fn example_file_documents_the_defaults() {
        let config =
            parse_str(include_str!("../config.example.toml")).expect("config.example.toml parses");
        assert_eq!(config.settings, Settings::default());
        assert_eq!(config.model, ModelSource::Synthetic(SyntheticChoice::Auto));
        assert_eq!(config.chats_dir, None);
    }

    #[test]
    fn synthetic_auto_follows_memory() {
        assert_eq!(
            SyntheticChoice::Auto.resolve(Some(24 << 30)),
            SyntheticChoice::Gpt20b
        );
        assert_eq!(
            SyntheticChoice::Auto.resolve(Some(8 << 30)),
            SyntheticChoice::Tiny
        );
        assert_eq!(SyntheticChoice::Auto.resolve(None), SyntheticChoice::Tiny);
        assert_eq!(
            SyntheticChoice::Tiny.resolve(Some(64 << 30)),
            SyntheticChoice::Tiny
        );
    }
}
