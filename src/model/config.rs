//! `config.json` of a Hugging Face gpt-oss checkpoint, parsed and validated.
//!
//! Every value the forward pass depends on is read here once; anything the engine cannot honour is
//! refused with a message naming the key, so a wrong checkpoint fails at load instead of producing
//! plausible-looking garbage.

use serde_json::{Map, Value};
use std::path::Path;

use super::ops::MAX_EXPERTS_PER_TOKEN;
use super::ModelError;

/// Attention span of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Sees the last `sliding_window` positions, itself included.
    Sliding,
    /// Sees every earlier position.
    Full,
}

/// How RoPE frequencies are derived.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    None,
    /// YaRN with a static attention factor applied to cos and sin (spec section 3).
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        original_max_position_embeddings: f64,
        truncate: bool,
        attention_factor: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub intermediate_size: usize,
    pub swiglu_limit: f32,
    pub swiglu_alpha: f32,
    pub rms_norm_eps: f32,
    pub sliding_window: usize,
    pub layer_kinds: Vec<LayerKind>,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

/// Largest head width the attention kernel keeps on the stack.
pub const MAX_HEAD_DIM: usize = 256;
/// Expert weights are MXFP4: inputs come in blocks of 32.
pub const MXFP4_BLOCK: usize = 32;
/// Largest value any size in config.json may have: far above any model a CPU can hold, and low
/// enough that products of a few sizes cannot overflow (128-bit) arithmetic.
pub const MAX_SIZE: usize = 1 << 24;
/// Most parameters a config may describe (2^48): every element and byte count derived from the
/// sizes then fits a 64-bit integer with room to spare.
pub const MAX_PARAMETERS: u64 = 1 << 48;

impl ModelConfig {
    /// Reads and validates `config.json` from a checkpoint directory.
    pub fn from_file(path: &Path) -> Result<Self, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_json_str(&text).map_err(|err| match err {
            ModelError::Config { key, message, .. } => ModelError::Config {
                file: path.display().to_string(),
                key,
                message,
            },
            other => other,
        })
    }

    pub fn from_json_str(text: &str) -> Result<Self, ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|e| config_err("", e.to_string()))?;
        let obj = value
            .as_object()
            .ok_or_else(|| config_err("", "the file is not a JSON object".into()))?;
        Self::from_json(obj)
    }

    fn from_json(obj: &Map<String, Value>) -> Result<Self, ModelError> {
        if let Some(model_type) = obj.get("model_type") {
            if model_type.as_str() != Some("gpt_oss") {
                return Err(config_err(
                    "model_type",
                    format!("expected \"gpt_oss\", found {model_type}"),
                ));
            }
        }
        let num_hidden_layers = req_usize(obj, "num_hidden_layers")?;
        // Checked before the default layer list of that length is built.
        if num_hidden_layers > MAX_SIZE {
            return Err(config_err(
                "num_hidden_layers",
                format!("must be at most {MAX_SIZE}, found {num_hidden_layers}"),
            ));
        }
        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_attention_heads = req_usize(obj, "num_attention_heads")?;
        let num_key_value_heads =
            opt_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim =
            opt_usize(obj, "head_dim")?.unwrap_or(hidden_size / num_attention_heads.max(1));
        let num_local_experts = match opt_usize(obj, "num_local_experts")? {
            Some(n) => n,
            None => req_usize(obj, "num_experts")?,
        };
        let num_experts_per_tok = match opt_usize(obj, "num_experts_per_tok")? {
            Some(n) => n,
            None => req_usize(obj, "experts_per_token")?,
        };
        let sliding_window = opt_usize(obj, "sliding_window")?.unwrap_or(0);
        let layer_kinds = match obj.get("layer_types") {
            None | Some(Value::Null) => (0..num_hidden_layers)
                .map(|i| if i % 2 == 0 { LayerKind::Sliding } else { LayerKind::Full })
                .collect(),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, item)| match item.as_str() {
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(config_err(
                        "layer_types",
                        format!(
                            "entry {i} is {item}; expected \"sliding_attention\" or \"full_attention\""
                        ),
                    )),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => {
                return Err(config_err(
                    "layer_types",
                    format!("expected a list of layer types, found {other}"),
                ))
            }
        };
        let (rope_theta, rope_scaling) = parse_rope(obj)?;
        let config = ModelConfig {
            vocab_size: req_usize(obj, "vocab_size")?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_local_experts,
            num_experts_per_tok,
            intermediate_size: req_usize(obj, "intermediate_size")?,
            swiglu_limit: opt_f64(obj, "swiglu_limit")?.unwrap_or(7.0) as f32,
            swiglu_alpha: opt_f64(obj, "swiglu_alpha")?.unwrap_or(1.702) as f32,
            rms_norm_eps: opt_f64(obj, "rms_norm_eps")?.unwrap_or(1e-5) as f32,
            sliding_window,
            layer_kinds,
            rope_theta,
            rope_scaling,
            max_position_embeddings: opt_usize(obj, "max_position_embeddings")?.unwrap_or(131072),
            tie_word_embeddings: opt_bool(obj, "tie_word_embeddings")?.unwrap_or(false),
        };
        if let Some(false) = opt_bool(obj, "attention_bias")? {
            return Err(config_err(
                "attention_bias",
                "gpt-oss has biases on q, k, v and o; false is not supported".into(),
            ));
        }
        if let Some(quant) = obj.get("quantization_config") {
            let method = quant.get("quant_method").and_then(Value::as_str);
            if method != Some("mxfp4") {
                return Err(config_err(
                    "quantization_config.quant_method",
                    format!(
                        "only \"mxfp4\" expert weights are supported, found {}",
                        quant.get("quant_method").unwrap_or(&Value::Null)
                    ),
                ));
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks the invariants the loader and the forward pass rely on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_local_experts", self.num_local_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("intermediate_size", self.intermediate_size),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(config_err(key, "must be greater than 0".into()));
            }
            if value > MAX_SIZE {
                return Err(config_err(
                    key,
                    format!("must be at most {MAX_SIZE}, found {value}"),
                ));
            }
        }
        let (total, _) = self.parameter_counts();
        if total > u128::from(MAX_PARAMETERS) {
            return Err(config_err(
                "num_hidden_layers",
                format!(
                    "the sizes describe {total} parameters, more than the {MAX_PARAMETERS} this \
                     loader can address"
                ),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(config_err(
                "num_key_value_heads",
                format!(
                    "{} query heads cannot be grouped over {} KV heads",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > MAX_HEAD_DIM {
            return Err(config_err(
                "head_dim",
                format!(
                    "must be even and at most {MAX_HEAD_DIM}, found {}",
                    self.head_dim
                ),
            ));
        }
        if self.num_experts_per_tok > MAX_EXPERTS_PER_TOKEN {
            return Err(config_err(
                "num_experts_per_tok",
                format!(
                    "{} routed experts per token; routing supports at most {MAX_EXPERTS_PER_TOKEN}",
                    self.num_experts_per_tok
                ),
            ));
        }
        if self.num_experts_per_tok > self.num_local_experts {
            return Err(config_err(
                "num_experts_per_tok",
                format!(
                    "{} routed experts per token but only {} experts",
                    self.num_experts_per_tok, self.num_local_experts
                ),
            ));
        }
        for (key, value) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
        ] {
            if !value.is_multiple_of(MXFP4_BLOCK) {
                return Err(config_err(
                    key,
                    format!("MXFP4 experts need a multiple of {MXFP4_BLOCK}, found {value}"),
                ));
            }
        }
        if self.layer_kinds.len() != self.num_hidden_layers {
            return Err(config_err(
                "layer_types",
                format!(
                    "{} entries for {} layers",
                    self.layer_kinds.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if self.layer_kinds.contains(&LayerKind::Sliding) && self.sliding_window == 0 {
            return Err(config_err(
                "sliding_window",
                "sliding layers need a window of at least 1".into(),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(config_err(
                "rms_norm_eps",
                "must be a positive number".into(),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(config_err("rope_theta", "must be a number above 1".into()));
        }
        if !self.swiglu_alpha.is_finite() {
            return Err(config_err(
                "swiglu_alpha",
                format!("must be a finite number, found {}", self.swiglu_alpha),
            ));
        }
        if !(self.swiglu_limit.is_finite() && self.swiglu_limit > 0.0) {
            return Err(config_err(
                "swiglu_limit",
                "must be a positive number".into(),
            ));
        }
        Ok(())
    }

    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Parameters stored in the checkpoint (each MXFP4 value counts as one).
    pub fn total_parameters(&self) -> u64 {
        u64::try_from(self.parameter_counts().0).unwrap_or(u64::MAX)
    }

    /// Parameters one token touches: routed experts only, one embedding matrix (as the model card counts).
    pub fn active_parameters(&self) -> u64 {
        u64::try_from(self.parameter_counts().1).unwrap_or(u64::MAX)
    }

    /// (total, active) parameters, in 128 bits: with every size at most [`MAX_SIZE`] no product
    /// here overflows, so validation can compare the count before anything multiplies in 64 bits.
    fn parameter_counts(&self) -> (u128, u128) {
        let h = self.hidden_size as u128;
        let q = self.num_attention_heads as u128 * self.head_dim as u128;
        let kv = self.num_key_value_heads as u128 * self.head_dim as u128;
        let e = self.num_local_experts as u128;
        let i = self.intermediate_size as u128;
        let layers = self.num_hidden_layers as u128;
        let attention =
            h * q + q + 2 * (h * kv + kv) + q * h + h + self.num_attention_heads as u128;
        let norms = 2 * h;
        let router = e * h + e;
        let per_layer_dense = attention + norms + router;
        let per_expert = h * 2 * i + 2 * i + i * h + h;
        let embeddings = self.vocab_size as u128 * h;
        let lm_head = if self.tie_word_embeddings {
            0
        } else {
            embeddings
        };
        let total = embeddings + lm_head + layers * (per_layer_dense + per_expert * e) + h;
        let active = embeddings
            + layers * (per_layer_dense + per_expert * self.num_experts_per_tok as u128)
            + h;
        (total, active)
    }
}

fn parse_rope(obj: &Map<String, Value>) -> Result<(f64, RopeScaling), ModelError> {
    // Newer transformers writes `rope_parameters` (theta inside); older files `rope_scaling` plus a
    // top-level `rope_theta`. Either may be null for plain RoPE.
    let (key, params) = match (obj.get("rope_parameters"), obj.get("rope_scaling")) {
        (Some(p), _) if !p.is_null() => ("rope_parameters", Some(p)),
        (_, Some(p)) if !p.is_null() => ("rope_scaling", Some(p)),
        _ => ("rope_scaling", None),
    };
    let params = match params {
        None => None,
        Some(Value::Object(map)) => Some(map),
        Some(other) => {
            return Err(config_err(
                key,
                format!("expected an object, found {other}"),
            ))
        }
    };
    let theta_in_params = match params {
        Some(map) => opt_f64(map, "rope_theta").map_err(|e| prefix_key(e, key))?,
        None => None,
    };
    let rope_theta = match (theta_in_params, opt_f64(obj, "rope_theta")?) {
        (Some(theta), _) | (None, Some(theta)) => theta,
        (None, None) => 150000.0,
    };
    let Some(map) = params else {
        return Ok((rope_theta, RopeScaling::None));
    };
    let rope_type = map
        .get("rope_type")
        .or_else(|| map.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let sub = |name: &str| format!("{key}.{name}");
    match rope_type {
        "default" => Ok((rope_theta, RopeScaling::None)),
        "yarn" => {
            let get = |name: &str| opt_f64(map, name).map_err(|e| prefix_key(e, key));
            let max_pos = opt_f64(obj, "max_position_embeddings")?.unwrap_or(131072.0);
            let original = match get("original_max_position_embeddings")? {
                Some(v) => v,
                None => opt_f64(obj, "initial_context_length")?.unwrap_or(max_pos),
            };
            let factor = get("factor")?.unwrap_or(max_pos / original);
            // transformers treats a zero/absent beta as its default (`or 32`, `or 1`).
            let beta_fast = get("beta_fast")?.filter(|v| *v != 0.0).unwrap_or(32.0);
            let beta_slow = get("beta_slow")?.filter(|v| *v != 0.0).unwrap_or(1.0);
            let truncate = match map.get("truncate") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(other) => {
                    return Err(config_err(
                        &sub("truncate"),
                        format!("expected true or false, found {other}"),
                    ))
                }
            };
            let mscale = get("mscale")?;
            let mscale_all_dim = get("mscale_all_dim")?;
            let yarn_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match get("attention_factor")? {
                Some(v) => v,
                None => match (mscale, mscale_all_dim) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        yarn_mscale(factor, m) / yarn_mscale(factor, all)
                    }
                    _ => yarn_mscale(factor, 1.0),
                },
            };
            if !(factor.is_finite() && factor > 0.0 && original > 0.0) {
                return Err(config_err(
                    &sub("factor"),
                    format!("must be positive, found {factor}"),
                ));
            }
            // The RoPE table holds it as f32.
            if !(attention_factor as f32).is_finite() {
                return Err(config_err(
                    &sub("attention_factor"),
                    format!("must be a finite number, found {attention_factor} (from mscale)"),
                ));
            }
            Ok((
                rope_theta,
                RopeScaling::Yarn {
                    factor,
                    beta_fast,
                    beta_slow,
                    original_max_position_embeddings: original,
                    truncate,
                    attention_factor,
                },
            ))
        }
        other => Err(config_err(
            &sub("rope_type"),
            format!("unsupported RoPE type \"{other}\"; gpt-oss uses \"yarn\""),
        )),
    }
}

fn config_err(key: &str, message: String) -> ModelError {
    ModelError::Config {
        file: "config.json".into(),
        key: key.into(),
        message,
    }
}

fn prefix_key(err: ModelError, prefix: &str) -> ModelError {
    match err {
        ModelError::Config { file, key, message } => ModelError::Config {
            file,
            key: format!("{prefix}.{key}"),
            message,
        },
        other => other,
    }
}

fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| config_err(key, format!("expected a non-negative integer, found {v}"))),
    }
}

fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    opt_usize(obj, key)?.ok_or_else(|| config_err(key, "missing".into()))
}

fn opt_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| config_err(key, format!("expected a number, found {v}"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(config_err(
            key,
            format!("expected true or false, found {v}"),
        )),
    }
}

/// The configurations `--synthetic` and `ossterm synth` can build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// The exact gpt-oss-20b shape (about 13 GB of weights).
    Gpt20b,
    /// The exact gpt-oss-120b shape (about 61 GiB of weights).
    Gpt120b,
    /// A few MB, with the full 201,088-token vocabulary so chat plumbing works end to end.
    Tiny,
}

impl Preset {
    pub fn config(self) -> ModelConfig {
        match self {
            Preset::Gpt20b => ModelConfig::gpt_oss_20b(),
            Preset::Gpt120b => ModelConfig::gpt_oss_120b(),
            Preset::Tiny => ModelConfig::tiny(),
        }
    }
}

crate::choice::impl_choice!(Preset { Gpt20b => "20b", Gpt120b => "120b", Tiny => "tiny" });

impl ModelConfig {
    /// gpt-oss-20b as published (spec section 1).
    pub fn gpt_oss_20b() -> Self {
        ModelConfig {
            vocab_size: 201088,
            hidden_size: 2880,
            num_hidden_layers: 24,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            head_dim: 64,
            num_local_experts: 32,
            num_experts_per_tok: 4,
            intermediate_size: 2880,
            swiglu_limit: 7.0,
            swiglu_alpha: 1.702,
            rms_norm_eps: 1e-5,
            sliding_window: 128,
            layer_kinds: (0..24)
                .map(|i| {
                    if i % 2 == 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect(),
            rope_theta: 150000.0,
            rope_scaling: RopeScaling::Yarn {
                factor: 32.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                original_max_position_embeddings: 4096.0,
                truncate: false,
                attention_factor: 0.1 * 32f64.ln() + 1.0,
            },
            max_position_embeddings: 131072,
            tie_word_embeddings: false,
        }
    }

    /// gpt-oss-120b as published: the 20b design with 36 layers and 128 experts (spec section 1).
    pub fn gpt_oss_120b() -> Self {
        ModelConfig {
            num_hidden_layers: 36,
            num_local_experts: 128,
            layer_kinds: (0..36)
                .map(|i| {
                    if i % 2 == 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect(),
            ..ModelConfig::gpt_oss_20b()
        }
    }

    /// A small model of the same family for tests and the low-memory demo.
    pub fn tiny() -> Self {
        ModelConfig {
            hidden_size: 128,
            num_hidden_layers: 4,
            num_attention_heads: 8,
            num_key_value_heads: 2,
            head_dim: 16,
            num_local_experts: 8,
            num_experts_per_tok: 2,
            intermediate_size: 128,
            sliding_window: 16,
            layer_kinds: (0..4)
                .map(|i| {
                    if i % 2 == 0 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect(),
            ..ModelConfig::gpt_oss_20b()
        }
    }

    /// `config.json` in the Hugging Face layout, as `ossterm synth` writes it.
    pub fn to_hf_json(&self) -> Value {
        let layer_types: Vec<&str> = self
            .layer_kinds
            .iter()
            .map(|k| match k {
                LayerKind::Sliding => "sliding_attention",
                LayerKind::Full => "full_attention",
            })
            .collect();
        let rope_scaling = match &self.rope_scaling {
            RopeScaling::None => Value::Null,
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            } => serde_json::json!({
                "rope_type": "yarn",
                "factor": factor,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "original_max_position_embeddings": *original_max_position_embeddings as u64,
                "truncate": truncate,
            }),
        };
        serde_json::json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "experts_per_token": self.num_experts_per_tok,
            "intermediate_size": self.intermediate_size,
            "swiglu_limit": self.swiglu_limit,
            "rms_norm_eps": self.rms_norm_eps,
            "sliding_window": self.sliding_window,
            "layer_types": layer_types,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "initial_context_length": 4096,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": true,
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": 200002,
            "pad_token_id": 199999,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head"
                ]
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_experts_per_token_than_routing_supports_are_refused() {
        let mut c = ModelConfig::tiny();
        c.num_local_experts = 64;
        c.num_experts_per_tok = MAX_EXPERTS_PER_TOKEN + 1;
        let message = c.validate().unwrap_err().to_string();
        assert!(message.contains("\"num_experts_per_tok\""), "{message}");
        assert!(message.contains("at most 32"), "{message}");
        c.num_experts_per_tok = MAX_EXPERTS_PER_TOKEN;
        c.validate().unwrap();
    }

    #[test]
    fn parameter_counts_match_the_model_card() {
        let c = ModelConfig::gpt_oss_20b();
        assert_eq!(c.total_parameters(), 20_914_757_184);
        let active = c.active_parameters() as f64 / 1e9;
        assert!((active - 3.61).abs() < 0.005, "active {active}");
    }

    /// tiny's config.json with `key` set to `value`, parsed.
    fn tiny_with(key: &str, value: Value) -> Result<ModelConfig, ModelError> {
        let mut json = ModelConfig::tiny().to_hf_json();
        json[key] = value;
        ModelConfig::from_json_str(&json.to_string())
    }

    // Found by fuzzing (fuzz target `checkpoint`): a vocabulary of 8e18 was accepted and
    // `vocab_size * hidden_size` overflowed where the parameter count is taken.
    #[test]
    fn sizes_past_the_limit_are_refused_by_name() {
        let error = tiny_with("vocab_size", serde_json::json!(8205201379295389049u64))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("vocab_size") && error.contains("at most"),
            "{error}"
        );
        let mut json = ModelConfig::tiny().to_hf_json();
        json["num_hidden_layers"] = serde_json::json!(MAX_SIZE);
        json["layer_types"] = Value::Null;
        json["num_local_experts"] = serde_json::json!(MAX_SIZE);
        let error = ModelConfig::from_json_str(&json.to_string())
            .unwrap_err()
            .to_string();
        assert!(error.contains("parameters"), "{error}");
    }

    // Found by fuzzing (fuzz target `checkpoint`, under its 64 MiB allocation bound): without
    // `layer_types`, a layer count of 4e12 made the loader allocate the default list of 4 TiB of
    // layer kinds before validation saw the count.
    #[test]
    fn a_huge_layer_count_is_refused_before_anything_is_allocated_for_it() {
        let mut json = ModelConfig::tiny().to_hf_json();
        json["num_hidden_layers"] = serde_json::json!(4_398_046_511_104u64);
        json["layer_types"] = Value::Null;
        let error = ModelConfig::from_json_str(&json.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("num_hidden_layers") && error.contains("at most"),
            "{error}"
        );
    }

    #[test]
    fn numbers_that_overflow_f32_or_yarn_are_refused() {
        let error = tiny_with("swiglu_alpha", serde_json::json!(1e300))
            .unwrap_err()
            .to_string();
        assert!(error.contains("swiglu_alpha"), "{error}");
        let mut json = ModelConfig::tiny().to_hf_json();
        json["rope_scaling"]["mscale"] = serde_json::json!(1e308);
        json["rope_scaling"]["mscale_all_dim"] = serde_json::json!(1e-308);
        let error = ModelConfig::from_json_str(&json.to_string())
            .unwrap_err()
            .to_string();
        assert!(error.contains("attention_factor"), "{error}");
    }

    #[test]
    fn parameter_counts_of_120b_match_the_model_card() {
        let c = ModelConfig::gpt_oss_120b();
        let total = c.total_parameters() as f64 / 1e9;
        let active = c.active_parameters() as f64 / 1e9;
        assert!((total - 116.83).abs() < 0.005, "total {total}");
        assert!((active - 5.13).abs() < 0.005, "active {active}");
    }

    #[test]
    fn hf_json_round_trips() {
        for c in [
            ModelConfig::gpt_oss_20b(),
            ModelConfig::gpt_oss_120b(),
            ModelConfig::tiny(),
        ] {
            let parsed = ModelConfig::from_json_str(&c.to_hf_json().to_string()).unwrap();
            assert_eq!(parsed, c);
        }
    }
}
