//! The app configuration: defaults, a TOML file, command-line overrides.
//!
//! Precedence, lowest first: built-in defaults, the file in the platform config directory (or the
//! file given with `--config`, which replaces it), then command-line flags. Every key of the file is
//! optional; a key the app does not know is an error that names it and its line, so a typo never
//! silently falls back to a default.

use crate::engine::protocol::Settings;
use crate::settings::{self, Value, SETTINGS};
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
    /// The 120b shape: about 62 GiB of random weights, refused where they cannot fit.
    #[serde(rename = "120b")]
    Gpt120b,
}

impl SyntheticChoice {
    pub fn from_name(text: &str) -> Option<SyntheticChoice> {
        match text {
            "auto" => Some(SyntheticChoice::Auto),
            "tiny" => Some(SyntheticChoice::Tiny),
            "20b" => Some(SyntheticChoice::Gpt20b),
            "120b" => Some(SyntheticChoice::Gpt120b),
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
            SyntheticChoice::Gpt120b => "120b",
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
    /// `[remote]`: a server to run the app on instead of the local model.
    pub remote: RemoteSection,
}

/// `remote.url`, `remote.api_key_env`, `remote.model`, `remote.timeout_secs`: with a URL the
/// app talks to an OpenAI-compatible server instead of loading a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteSection {
    /// `None`: run the model here.
    pub url: Option<String>,
    /// The environment variable holding the API key (the key itself never goes in the file).
    pub api_key_env: String,
    /// `None`: the server's first model.
    pub model: Option<String>,
    /// Longest silence of the server mid-request, in seconds.
    pub timeout_secs: u64,
}

impl Default for RemoteSection {
    fn default() -> Self {
        RemoteSection {
            url: None,
            api_key_env: crate::remote::DEFAULT_API_KEY_ENV.to_string(),
            model: None,
            timeout_secs: crate::remote::DEFAULT_IDLE_TIMEOUT.as_secs(),
        }
    }
}

impl RemoteSection {
    /// The remote engine's configuration when a URL is set: the key is `api_key` (from
    /// `--api-key`) or else the `api_key_env` variable's value.
    pub fn engine_config(&self, api_key: Option<String>) -> Option<crate::remote::RemoteConfig> {
        let url = self.url.clone()?;
        let api_key = api_key.or_else(|| {
            std::env::var(&self.api_key_env)
                .ok()
                .filter(|key| !key.is_empty())
        });
        Some(crate::remote::RemoteConfig {
            target: crate::remote::RemoteTarget {
                url,
                api_key,
                idle_timeout: std::time::Duration::from_secs(self.timeout_secs),
            },
            model: self.model.clone(),
        })
    }
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
            remote: RemoteSection::default(),
        }
    }
}

/// Command-line values that override the file; `None` (or no entry) leaves the file's (or the
/// default) value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConfigOverrides {
    pub model_dir: Option<PathBuf>,
    pub synthetic: Option<SyntheticChoice>,
    pub chats_dir: Option<PathBuf>,
    pub cache_dir: Option<PathBuf>,
    /// `--remote URL`, `--remote-model NAME`, `--remote-timeout SECS`.
    pub remote_url: Option<String>,
    pub remote_model: Option<String>,
    pub remote_timeout_secs: Option<u64>,
    /// Settings given as flags, by config key, as parsed from the flag's text.
    pub settings: Vec<(&'static str, Value)>,
}

impl ConfigOverrides {
    /// Adds the setting with config `key` (which must be one of [`SETTINGS`]).
    pub fn with(mut self, key: &'static str, value: Value) -> ConfigOverrides {
        self.settings.push((key, value));
        self
    }
}

/// Keys of the file that are not live settings: where the model and the chats are.
const MODEL_PATH_KEY: &str = "model.path";
const MODEL_SYNTHETIC_KEY: &str = "model.synthetic";
const CHATS_DIR_KEY: &str = "paths.chats_dir";
const CACHE_DIR_KEY: &str = "paths.cache_dir";
const MAX_DISK_KEY: &str = "cache.max_disk_mb";
const MAX_RAM_KEY: &str = "cache.max_ram_mb";
const REMOTE_URL_KEY: &str = "remote.url";
const REMOTE_API_KEY_ENV_KEY: &str = "remote.api_key_env";
const REMOTE_MODEL_KEY: &str = "remote.model";
const REMOTE_TIMEOUT_KEY: &str = "remote.timeout_secs";
const STARTUP_KEYS: [&str; 10] = [
    MODEL_PATH_KEY,
    MODEL_SYNTHETIC_KEY,
    CHATS_DIR_KEY,
    CACHE_DIR_KEY,
    MAX_DISK_KEY,
    MAX_RAM_KEY,
    REMOTE_URL_KEY,
    REMOTE_API_KEY_ENV_KEY,
    REMOTE_MODEL_KEY,
    REMOTE_TIMEOUT_KEY,
];
/// Longest remote timeout a key or flag accepts, in seconds (a day).
pub const MAX_REMOTE_TIMEOUT_SECS: u64 = 86_400;
/// Largest snapshot budget a key accepts, in MiB (1 PiB).
const MAX_BUDGET_MB: u64 = 1 << 30;

/// Every key the file may hold: the startup keys and each setting's.
fn known_keys() -> impl Iterator<Item = &'static str> {
    STARTUP_KEYS
        .into_iter()
        .chain(SETTINGS.iter().map(|setting| setting.key))
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
    // A UTF-8 byte order mark is not TOML, but editors write one.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let file: toml::Table = text
        .parse()
        .map_err(|error| describe_toml_error(&error, text, path))?;
    let mut config = AppConfig::default();
    let invalid = |key: &str, message: String| {
        let (section, name) = key.split_once('.').unwrap_or(("", key));
        let line = if name.is_empty() || section.is_empty() {
            locate_section(text, key).or_else(|| locate_key(text, "", key))
        } else {
            locate_key(text, section, name)
        };
        ConfigError::InvalidKey {
            path: path.to_path_buf(),
            line: line.unwrap_or(1),
            key: key.to_string(),
            message,
        }
    };
    let mut sections: Vec<&str> = known_keys()
        .filter_map(|key| key.split_once('.').map(|(section, _)| section))
        .collect();
    sections.sort_unstable();
    sections.dedup();

    for (section, item) in &file {
        if !sections.contains(&section.as_str()) {
            return Err(invalid(
                section,
                format!(
                    "unknown section `{section}`, expected one of {}",
                    sections.join(", ")
                ),
            ));
        }
        let Some(entries) = item.as_table() else {
            return Err(invalid(
                section,
                format!("expected a table ([{section}]), got {item}"),
            ));
        };
        for (name, value) in entries {
            let key = format!("{section}.{name}");
            let invalid = |message: String| invalid(&key, message);
            match key.as_str() {
                MAX_DISK_KEY | MAX_RAM_KEY => {
                    let budget = value
                        .as_integer()
                        .and_then(|v| u64::try_from(v).ok())
                        .filter(|v| *v <= MAX_BUDGET_MB);
                    let Some(budget) = budget else {
                        return Err(invalid(format!(
                            "expected 0..={MAX_BUDGET_MB} MiB, got {value}"
                        )));
                    };
                    if key == MAX_DISK_KEY {
                        config.cache.max_disk_mb = budget;
                    } else {
                        config.cache.max_ram_mb = budget;
                    }
                }
                MODEL_PATH_KEY | CHATS_DIR_KEY | CACHE_DIR_KEY => {
                    let Some(dir) = value.as_str() else {
                        return Err(invalid(format!("expected a directory path, got {value}")));
                    };
                    let dir = (!dir.is_empty()).then(|| PathBuf::from(dir));
                    if key == CHATS_DIR_KEY {
                        config.chats_dir = dir;
                    } else if key == CACHE_DIR_KEY {
                        config.cache.dir = dir;
                    } else if let Some(dir) = dir {
                        config.model = ModelSource::Checkpoint(dir);
                    }
                }
                REMOTE_URL_KEY | REMOTE_API_KEY_ENV_KEY | REMOTE_MODEL_KEY => {
                    let Some(text) = value.as_str() else {
                        return Err(invalid(format!("expected a string, got {value}")));
                    };
                    let text = text.trim();
                    if key == REMOTE_API_KEY_ENV_KEY {
                        if text.is_empty() || text.contains('=') {
                            return Err(invalid(format!(
                                "expected the name of an environment variable, got {value}"
                            )));
                        }
                        config.remote.api_key_env = text.to_string();
                    } else {
                        let text = (!text.is_empty()).then(|| text.to_string());
                        if key == REMOTE_URL_KEY {
                            config.remote.url = text;
                        } else {
                            config.remote.model = text;
                        }
                    }
                }
                REMOTE_TIMEOUT_KEY => {
                    let seconds = value
                        .as_integer()
                        .and_then(|v| u64::try_from(v).ok())
                        .filter(|v| (1..=MAX_REMOTE_TIMEOUT_SECS).contains(v));
                    let Some(seconds) = seconds else {
                        return Err(invalid(format!(
                            "expected 1..={MAX_REMOTE_TIMEOUT_SECS} seconds, got {value}"
                        )));
                    };
                    config.remote.timeout_secs = seconds;
                }
                MODEL_SYNTHETIC_KEY => {
                    let choice = value.as_str().and_then(SyntheticChoice::from_name);
                    let Some(choice) = choice else {
                        return Err(invalid(format!(
                            "expected auto, tiny, 20b or 120b, got {value}"
                        )));
                    };
                    // A checkpoint path wins over the synthetic choice.
                    if !matches!(config.model, ModelSource::Checkpoint(_)) {
                        config.model = ModelSource::Synthetic(choice);
                    }
                }
                _ => {
                    let Some(setting) = settings::by_key(&key) else {
                        let expected: Vec<String> = known_keys()
                            .filter_map(|known| known.strip_prefix(&format!("{section}.")))
                            .map(|known| format!("`{known}`"))
                            .collect();
                        return Err(invalid(format!(
                            "unknown field `{name}`, expected one of {}",
                            expected.join(", ")
                        )));
                    };
                    if let Some(value) = setting.parse_toml(value).map_err(invalid)? {
                        setting
                            .apply(&mut config.settings, value)
                            .map_err(invalid)?;
                    }
                }
            }
        }
    }
    Ok(config)
}

fn apply_overrides(config: &mut AppConfig, overrides: &ConfigOverrides) -> Result<(), ConfigError> {
    if let Some(dir) = &overrides.model_dir {
        config.model = ModelSource::Checkpoint(dir.clone());
    } else if let Some(choice) = overrides.synthetic {
        config.model = ModelSource::Synthetic(choice);
    }
    for (key, value) in &overrides.settings {
        let setting = settings::by_key(key).ok_or_else(|| ConfigError::InvalidFlag {
            flag: (*key).to_string(),
            message: "not a setting".to_string(),
        })?;
        let flag = setting.flag.unwrap_or(setting.key);
        setting
            .apply(&mut config.settings, value.clone())
            .map_err(|message| ConfigError::InvalidFlag {
                flag: format!("--{flag}"),
                message,
            })?;
    }
    if overrides.chats_dir.is_some() {
        config.chats_dir.clone_from(&overrides.chats_dir);
    }
    if overrides.cache_dir.is_some() {
        config.cache.dir.clone_from(&overrides.cache_dir);
    }
    if let Some(url) = &overrides.remote_url {
        let url = url.trim();
        config.remote.url = (!url.is_empty()).then(|| url.to_string());
    } else if overrides.model_dir.is_some() || overrides.synthetic.is_some() {
        // A model named on the command line is run here, whatever server the file names.
        config.remote.url = None;
    }
    if let Some(model) = &overrides.remote_model {
        config.remote.model = Some(model.clone());
    }
    if let Some(seconds) = overrides.remote_timeout_secs {
        if !(1..=MAX_REMOTE_TIMEOUT_SECS).contains(&seconds) {
            return Err(ConfigError::InvalidFlag {
                flag: "--remote-timeout".to_string(),
                message: format!("expected 1..={MAX_REMOTE_TIMEOUT_SECS} seconds, got {seconds}"),
            });
        }
        config.remote.timeout_secs = seconds;
    }
    Ok(())
}

/// 1-based line of byte `offset` in `text`. Counted over bytes: an offset inside a multibyte
/// character (the parser's spans are not promised to fall on a boundary) must not panic.
fn line_of_offset(text: &str, offset: usize) -> usize {
    let before = &text.as_bytes()[..offset.min(text.len())];
    before.iter().filter(|&&b| b == b'\n').count() + 1
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

/// 1-based line of the `[section]` header.
fn locate_section(text: &str, section: &str) -> Option<usize> {
    text.lines()
        .position(|line| table_header(line).as_deref() == Some(section))
        .map(|index| index + 1)
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
    use crate::engine::protocol::{ActivationFormat, WeightFormat};

    fn parse_str(text: &str) -> Result<AppConfig, ConfigError> {
        parse(text, Path::new("test.toml"))
    }

    #[test]
    fn offsets_inside_multibyte_characters_give_their_line() {
        let text = "# \u{e9}t\u{e9}\nname = \"\u{1f600}\"\n";
        // Byte 3 is the second byte of the first e-acute, byte 17 inside the emoji.
        assert!(!text.is_char_boundary(3) && !text.is_char_boundary(17));
        assert_eq!(line_of_offset(text, 3), 1);
        assert_eq!(line_of_offset(text, 17), 2);
        assert_eq!(line_of_offset(text, text.len() + 5), 3);
        // And a real error in multibyte text still names its line.
        let err = parse_str("# \u{e9}t\u{e9} \u{1f600}\n[ui]\ntheme = \u{e9}\n").unwrap_err();
        assert!(err.to_string().contains("line 3"), "{err}");
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
    fn a_key_outside_any_section_is_named_with_its_line() {
        match parse_str("# settings\n\nthreads = 2\n").unwrap_err() {
            ConfigError::InvalidKey { line, key, .. } => {
                assert_eq!((line, key.as_str()), (3, "threads"))
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
    fn unembedding_parses_and_a_bad_one_names_key_line_and_values() {
        use crate::engine::protocol::Unembedding;
        let config = parse_str("[engine]\nunembedding = \"full\"\n").unwrap();
        assert_eq!(config.settings.unembedding, Unembedding::Full);
        assert_eq!(
            AppConfig::default().settings.unembedding,
            Unembedding::TwoStage
        );
        let error = parse_str("[engine]\n\nunembedding = \"two_stage\"\n").unwrap_err();
        match error {
            ConfigError::InvalidKey {
                line, key, message, ..
            } => {
                assert_eq!((line, key.as_str()), (3, "engine.unembedding"));
                assert!(message.contains("two_stage"), "{message}");
                assert!(message.contains("two-stage"), "names the values: {message}");
            }
            other => panic!("expected InvalidKey, got {other:?}"),
        }
    }

    #[test]
    fn attention_parses_and_a_bad_one_names_key_line_and_values() {
        for name in ["auto", "f32", "bf16"] {
            let config = parse_str(&format!("[engine]\nattention = \"{name}\"\n")).unwrap();
            assert_eq!(config.settings.attention.name(), name);
        }
        for bad in ["\"fp16\"", "16"] {
            let error =
                parse_str(&format!("[engine]\nthreads = 2\nattention = {bad}\n")).unwrap_err();
            match error {
                ConfigError::InvalidKey {
                    line, key, message, ..
                } => {
                    assert_eq!((line, key.as_str()), (3, "engine.attention"));
                    assert!(
                        message.contains("auto, f32, bf16"),
                        "names the values: {message}"
                    );
                }
                other => panic!("expected InvalidKey, got {other:?}"),
            }
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
        let overrides =
            ConfigOverrides::default().with("engine.activations", Value::Choice("q8x2"));
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
        let overrides = ConfigOverrides::default().with("sampling.temperature", Value::Real(0.0));
        apply_overrides(&mut config, &overrides).unwrap();
        assert_eq!(config.settings.sampling.temperature, 0.0);
        assert_eq!(config.settings.sampling.top_k, 40);
    }

    #[test]
    fn bad_override_names_the_flag() {
        let mut config = AppConfig::default();
        let overrides = ConfigOverrides::default().with("sampling.top_p", Value::Real(0.0));
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
    fn example_file_lists_every_setting_and_startup_key() {
        let example = include_str!("../config.example.toml");
        for key in known_keys() {
            let (section, name) = key.split_once('.').unwrap();
            let commented = example.contains(&format!("# {name} = "));
            assert!(
                locate_key(example, section, name).is_some() || commented,
                "config.example.toml lacks {key}"
            );
        }
    }

    #[test]
    fn every_setting_value_round_trips_through_the_file() {
        let mut text = String::new();
        let mut changed = Settings::default();
        for setting in SETTINGS {
            setting.step(&mut changed, true, 8);
        }
        changed.system_prompt = "be \"terse\"".to_string();
        for setting in SETTINGS {
            let (section, name) = setting.key.split_once('.').unwrap();
            let value = match (setting.get)(&changed) {
                Value::Count(count) => count.to_string(),
                Value::Real(real) => format!("{real:?}"),
                Value::Choice(name) => format!("{name:?}"),
                Value::Switch(on) => on.to_string(),
                Value::Text(text) => format!("{text:?}"),
                Value::Seed(seed) => seed.unwrap().to_string(),
            };
            text.push_str(&format!("[{section}]\n{name} = {value}\n"));
        }
        // Sections repeat above; TOML wants each once, so merge them.
        let mut merged: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        let mut current = "";
        for line in text.lines() {
            match line.strip_prefix('[') {
                Some(header) => current = header.trim_end_matches(']'),
                None => merged.entry(current).or_default().push(line),
            }
        }
        let file: String = merged
            .iter()
            .map(|(section, lines)| format!("[{section}]\n{}\n", lines.join("\n")))
            .collect();
        let config = parse_str(&file).unwrap_or_else(|error| panic!("{error}\n{file}"));
        assert_eq!(config.settings, changed, "{file}");
    }

    #[test]
    fn a_byte_order_mark_is_accepted() {
        let config = parse_str("\u{feff}[engine]\nweight_format = \"q4\"\n").unwrap();
        assert_eq!(config.settings.weight_format, WeightFormat::Q4);
    }

    #[test]
    fn remote_keys_parse_and_flags_beat_them() {
        let config = parse_str(
            "[remote]\nurl = \"http://gpu:8000\"\napi_key_env = \"TEAM_KEY\"\nmodel = \"openai/gpt-oss-120b\"\ntimeout_secs = 60\n",
        )
        .unwrap();
        assert_eq!(config.remote.url.as_deref(), Some("http://gpu:8000"));
        assert_eq!(config.remote.api_key_env, "TEAM_KEY");
        assert_eq!(config.remote.model.as_deref(), Some("openai/gpt-oss-120b"));
        assert_eq!(config.remote.timeout_secs, 60);
        let mut overridden = config.clone();
        let overrides = ConfigOverrides {
            remote_url: Some("https://other/v1".to_string()),
            remote_model: Some("m".to_string()),
            ..ConfigOverrides::default()
        };
        apply_overrides(&mut overridden, &overrides).unwrap();
        assert_eq!(overridden.remote.url.as_deref(), Some("https://other/v1"));
        assert_eq!(overridden.remote.model.as_deref(), Some("m"));
        let engine = overridden
            .remote
            .engine_config(Some("k".to_string()))
            .unwrap();
        assert_eq!(engine.target.api_key.as_deref(), Some("k"));
        assert_eq!(engine.target.idle_timeout.as_secs(), 60);
        assert!(AppConfig::default().remote.engine_config(None).is_none());
        // A model or an empty URL on the command line runs here.
        for overrides in [
            ConfigOverrides {
                synthetic: Some(SyntheticChoice::Tiny),
                ..ConfigOverrides::default()
            },
            ConfigOverrides {
                remote_url: Some(String::new()),
                ..ConfigOverrides::default()
            },
        ] {
            let mut local = config.clone();
            apply_overrides(&mut local, &overrides).unwrap();
            assert_eq!(local.remote.url, None, "{overrides:?}");
        }
    }

    #[test]
    fn bad_remote_keys_name_key_and_line() {
        for (text, key) in [
            ("[remote]\nurl = 5\n", "remote.url"),
            ("[remote]\ntimeout_secs = 0\n", "remote.timeout_secs"),
            ("[remote]\napi_key_env = \"\"\n", "remote.api_key_env"),
            ("[remote]\nkey = \"secret\"\n", "remote.key"),
        ] {
            let error = parse_str(text).unwrap_err().to_string();
            assert!(
                error.contains(key) && error.contains("line 2"),
                "{text}: {error}"
            );
        }
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
