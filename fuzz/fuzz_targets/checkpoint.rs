//! A checkpoint directory held in memory (config.json, model.safetensors.index.json, shards), read
//! by the loader's own functions: `ModelConfig::from_json_str` (what `from_file` parses with),
//! `Checkpoint::from_memory` (the index and shard parsing of `Checkpoint::open`), `Weights::load`
//! (every tensor's name, dtype and shape against the config) and the RoPE table.
//!
//! The first input byte picks the form of the rest:
//! - even: a valid checkpoint of a small random shape is built, then damaged by a list of edits
//!   (tensors dropped, renamed, retyped, reshaped, moved between shards or given skewed offsets;
//!   header, index and config text replaced; files truncated or poked). With no edit it must load.
//! - odd: the files byte for byte: repeated `[name length u8][name][length u32 LE][bytes]`.
//!
//! Invariants: no panic, error messages render, heap under the bound, and a checkpoint built valid
//! loads and gives back the config it was built from.
#![no_main]

use std::collections::HashMap;
use std::path::Path;

use arbitrary::{Arbitrary, Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use ossterm::model::checkpoint::Checkpoint;
use ossterm::model::rope::RopeTable;
use ossterm::model::weights::Weights;
use ossterm::model::{LayerKind, ModelConfig, RopeScaling};
use ossterm_fuzz::LimitingAllocator;
use serde_json::{json, Map, Value};

/// Built checkpoints are under 200 KiB and raw inputs under the 1 MiB `-max_len`; the loader keeps
/// a copy of each shard and widens small tensors to f32.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(64);

const INDEX: &str = "model.safetensors.index.json";

/// A checkpoint directory: file name -> bytes.
type Files = HashMap<String, Vec<u8>>;

/// One tensor as the header will describe it.
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
    shard: usize,
    /// Added to the begin and end data offsets written in the header.
    skew: (i64, i64),
}

#[derive(Arbitrary, Debug)]
enum DtypeChoice {
    Bf16,
    F16,
    F32,
    U8,
    I8,
    F64,
    I64,
    Bool,
    F8E4m3,
    Other(String),
}

impl DtypeChoice {
    fn name(&self) -> String {
        match self {
            DtypeChoice::Bf16 => "BF16",
            DtypeChoice::F16 => "F16",
            DtypeChoice::F32 => "F32",
            DtypeChoice::U8 => "U8",
            DtypeChoice::I8 => "I8",
            DtypeChoice::F64 => "F64",
            DtypeChoice::I64 => "I64",
            DtypeChoice::Bool => "BOOL",
            DtypeChoice::F8E4m3 => "F8_E4M3",
            DtypeChoice::Other(name) => return name.clone(),
        }
        .into()
    }
}

/// JSON values for config keys, biased to the kinds validation has to tell apart.
#[derive(Arbitrary, Debug)]
enum FuzzJson {
    Null,
    Bool(bool),
    Small(u8),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    PowerOfTwo(u8),
    Text(String),
    List(Vec<String>),
}

impl FuzzJson {
    fn to_json(&self) -> Value {
        match self {
            FuzzJson::Null => Value::Null,
            FuzzJson::Bool(b) => json!(b),
            FuzzJson::Small(n) => json!(n),
            FuzzJson::Unsigned(n) => json!(n),
            FuzzJson::Signed(n) => json!(n),
            FuzzJson::Float(f) => {
                serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number)
            }
            FuzzJson::PowerOfTwo(shift) => json!(1u64 << (shift % 64)),
            FuzzJson::Text(text) => json!(text),
            FuzzJson::List(items) => json!(items),
        }
    }
}

/// Keys of config.json the loader reads (and a few it must ignore or refuse).
const CONFIG_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "intermediate_size",
    "swiglu_limit",
    "swiglu_alpha",
    "rms_norm_eps",
    "sliding_window",
    "layer_types",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "initial_context_length",
    "max_position_embeddings",
    "attention_bias",
    "tie_word_embeddings",
    "quantization_config",
];

const ROPE_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
    "truncate",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "rope_theta",
];

#[derive(Arbitrary, Debug)]
enum Edit {
    SetConfigKey(u8, FuzzJson),
    RemoveConfigKey(u8),
    SetRopeKey(u8, FuzzJson),
    ConfigText(String),
    DropTensor(u16),
    Dtype(u16, DtypeChoice),
    SetDim(u16, u8, u64),
    PushDim(u16, u64),
    PopDim(u16),
    Rename(u16, String),
    SkewOffsets(u16, i64, i64),
    MoveToShard(u16, u8),
    Duplicate(u16, u8),
    Metadata(Vec<(String, String)>),
    HeaderText(u8, String),
    HeaderLength(u8, u64),
    Truncate(u8, u32),
    Poke(u8, u32, u8),
    IndexEntry(String, String),
    IndexText(String),
    DropFile(u8),
}

/// A small config of the gpt-oss family: every size the loader checks is drawn, so tensors stay
/// small while shapes vary.
fn small_config(u: &mut Unstructured<'_>) -> Result<ModelConfig> {
    let num_attention_heads = u.int_in_range(1..=4usize)?;
    let divisors: Vec<usize> = (1..=num_attention_heads)
        .filter(|d| num_attention_heads % d == 0)
        .collect();
    let num_key_value_heads = *u.choose(&divisors)?;
    let num_local_experts = u.int_in_range(1..=3usize)?;
    let num_hidden_layers = u.int_in_range(1..=2usize)?;
    let layer_kinds = (0..num_hidden_layers)
        .map(|_| {
            Ok(if u.arbitrary::<bool>()? {
                LayerKind::Sliding
            } else {
                LayerKind::Full
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let rope_scaling = if u.arbitrary::<bool>()? {
        RopeScaling::None
    } else {
        let factor = f64::from(u.int_in_range(1..=32u8)?);
        RopeScaling::Yarn {
            factor,
            beta_fast: f64::from(u.int_in_range(1..=64u8)?),
            beta_slow: 1.0,
            original_max_position_embeddings: 4096.0,
            truncate: u.arbitrary()?,
            attention_factor: if factor > 1.0 {
                0.1 * factor.ln() + 1.0
            } else {
                1.0
            },
        }
    };
    Ok(ModelConfig {
        vocab_size: u.int_in_range(1..=8)?,
        hidden_size: 32 * u.int_in_range(1..=2usize)?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim: 2 * u.int_in_range(1..=8usize)?,
        num_local_experts,
        num_experts_per_tok: u.int_in_range(1..=num_local_experts)?,
        intermediate_size: 32,
        sliding_window: u.int_in_range(1..=64)?,
        layer_kinds,
        rope_theta: f64::from(u.int_in_range(2..=200_000u32)?),
        rope_scaling,
        tie_word_embeddings: u.arbitrary()?,
        ..ModelConfig::tiny()
    })
}

/// Tensor data: valid values chosen by one input byte, written at memset speed (what the bytes are
/// matters less than their count; `Poke` edits put arbitrary bytes anywhere).
struct Filler(u8);

impl Filler {
    /// Finite bf16 values: one of 1, -0.5, 2^-10 and 3.
    fn bf16(&mut self, count: usize) -> Vec<u8> {
        let value: u16 = [0x3F80, 0xBF00, 0x3A80, 0x4040][usize::from(self.0 % 4)];
        value.to_le_bytes().repeat(count)
    }

    fn f32(&mut self, count: usize) -> Vec<u8> {
        (f32::from(self.0) / 256.0 - 0.5)
            .to_le_bytes()
            .repeat(count)
    }

    /// MXFP4 nibbles: every byte is valid.
    fn bytes(&mut self, count: usize) -> Vec<u8> {
        vec![self.0; count]
    }

    /// E8M0 scales near 2^0.
    fn scales(&mut self, count: usize) -> Vec<u8> {
        vec![120 + self.0 % 12; count]
    }
}

/// Every tensor `Weights::load` reads for `config`, with valid data.
fn tensors_for(
    config: &ModelConfig,
    filler: &mut Filler,
    small_f32: &mut impl FnMut() -> bool,
) -> Vec<Tensor> {
    let mut tensors = Vec::new();
    let mut push = |name: String, dtype: &str, shape: &[usize], data: Vec<u8>| {
        tensors.push(Tensor {
            name,
            dtype: dtype.into(),
            shape: shape.iter().map(|&d| d as u64).collect(),
            data,
            shard: 0,
            skew: (0, 0),
        })
    };
    let h = config.hidden_size;
    let mut matrices: Vec<(String, usize, usize)> =
        vec![("model.embed_tokens.weight".into(), config.vocab_size, h)];
    if !config.tie_word_embeddings {
        matrices.push(("lm_head.weight".into(), config.vocab_size, h));
    }
    let (q, kv) = (config.q_width(), config.kv_width());
    let e = config.num_local_experts;
    let i = config.intermediate_size;
    let mut vectors: Vec<(String, Vec<usize>)> = vec![("model.norm.weight".into(), vec![h])];
    let mut experts: Vec<(String, usize, usize)> = Vec::new();
    for l in 0..config.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        vectors.push((format!("{p}input_layernorm.weight"), vec![h]));
        vectors.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        vectors.push((
            format!("{p}self_attn.sinks"),
            vec![config.num_attention_heads],
        ));
        for (name, rows, cols) in [
            ("self_attn.q_proj", q, h),
            ("self_attn.k_proj", kv, h),
            ("self_attn.v_proj", kv, h),
            ("self_attn.o_proj", h, q),
            ("mlp.router", e, h),
        ] {
            matrices.push((format!("{p}{name}.weight"), rows, cols));
            vectors.push((format!("{p}{name}.bias"), vec![rows]));
        }
        experts.push((format!("{p}mlp.experts.gate_up_proj"), 2 * i, h));
        experts.push((format!("{p}mlp.experts.down_proj"), h, i));
    }
    for (name, rows, cols) in matrices {
        push(name, "BF16", &[rows, cols], filler.bf16(rows * cols));
    }
    for (name, rows, cols) in experts {
        let blocks = cols / 32;
        push(
            format!("{name}_blocks"),
            "U8",
            &[e, rows, blocks, 16],
            filler.bytes(e * rows * blocks * 16),
        );
        push(
            format!("{name}_scales"),
            "U8",
            &[e, rows, blocks],
            filler.scales(e * rows * blocks),
        );
        vectors.push((format!("{name}_bias"), vec![e, rows]));
    }
    for (name, shape) in vectors {
        let count = shape.iter().product();
        if small_f32() {
            push(name, "F32", &shape, filler.f32(count));
        } else {
            push(name, "BF16", &shape, filler.bf16(count));
        }
    }
    tensors
}

/// A safetensors file: 8-byte header length, header JSON, data in tensor order.
fn safetensors_file(
    tensors: &[&Tensor],
    metadata: Option<&Map<String, Value>>,
) -> (Vec<u8>, Vec<u8>) {
    let mut header = Map::new();
    if let Some(metadata) = metadata {
        header.insert("__metadata__".into(), Value::Object(metadata.clone()));
    }
    let mut data = Vec::new();
    for tensor in tensors {
        let begin = data.len() as i64;
        data.extend_from_slice(&tensor.data);
        let end = data.len() as i64;
        header.insert(
            tensor.name.clone(),
            json!({
                "dtype": tensor.dtype,
                "shape": tensor.shape,
                "data_offsets": [begin.wrapping_add(tensor.skew.0), end.wrapping_add(tensor.skew.1)],
            }),
        );
    }
    (Value::Object(header).to_string().into_bytes(), data)
}

fn assemble(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(data);
    file
}

/// Builds a valid checkpoint, applies the edits, and returns the files and, when nothing was
/// edited, the config the checkpoint must load as.
fn built(u: &mut Unstructured<'_>) -> Result<(Files, Option<ModelConfig>)> {
    let config = small_config(u)?;
    let mut filler = Filler(u.arbitrary()?);
    let f32_mask: u64 = u.arbitrary()?;
    let mut bit = 0;
    let mut tensors = tensors_for(&config, &mut filler, &mut || {
        bit = (bit + 1) % 64;
        f32_mask >> bit & 1 == 1
    });
    let num_shards = u.int_in_range(1..=3usize)?;
    for tensor in &mut tensors {
        tensor.shard = usize::from(u.arbitrary::<u8>()?) % num_shards;
    }
    let single_file = num_shards == 1 && u.arbitrary::<bool>()?;
    let edits: Vec<Edit> = u.arbitrary_iter()?.take(12).collect::<Result<_>>()?;

    let mut config_json = config.to_hf_json();
    let mut config_text: Option<String> = None;
    let mut metadata: Option<Map<String, Value>> =
        Some([("format".to_string(), json!("pt"))].into_iter().collect());
    let mut header_texts: HashMap<usize, String> = HashMap::new();
    let mut header_lengths: HashMap<usize, u64> = HashMap::new();
    let mut file_edits: Vec<&Edit> = Vec::new();
    let mut index_entries: Vec<(String, String)> = Vec::new();
    let mut index_text: Option<String> = None;
    let mut duplicates: Vec<Tensor> = Vec::new();
    let pick = |tensors: &[Tensor], index: u16| {
        (!tensors.is_empty()).then(|| usize::from(index) % tensors.len())
    };
    for edit in &edits {
        match edit {
            Edit::SetConfigKey(key, value) => {
                config_json[CONFIG_KEYS[usize::from(*key) % CONFIG_KEYS.len()]] = value.to_json();
            }
            Edit::RemoveConfigKey(key) => {
                if let Some(object) = config_json.as_object_mut() {
                    object.remove(CONFIG_KEYS[usize::from(*key) % CONFIG_KEYS.len()]);
                }
            }
            Edit::SetRopeKey(key, value) => {
                let key = ROPE_KEYS[usize::from(*key) % ROPE_KEYS.len()];
                if !config_json["rope_scaling"].is_object() {
                    config_json["rope_scaling"] = json!({"rope_type": "yarn"});
                }
                config_json["rope_scaling"][key] = value.to_json();
            }
            Edit::ConfigText(text) => config_text = Some(text.clone()),
            Edit::DropTensor(index) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors.remove(i);
                }
            }
            Edit::Dtype(index, dtype) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].dtype = dtype.name();
                }
            }
            Edit::SetDim(index, dim, value) => {
                if let Some(i) = pick(&tensors, *index) {
                    let shape = &mut tensors[i].shape;
                    if !shape.is_empty() {
                        let d = usize::from(*dim) % shape.len();
                        shape[d] = *value;
                    }
                }
            }
            Edit::PushDim(index, value) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].shape.push(*value);
                }
            }
            Edit::PopDim(index) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].shape.pop();
                }
            }
            Edit::Rename(index, name) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].name = name.clone();
                }
            }
            Edit::SkewOffsets(index, begin, end) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].skew = (*begin, *end);
                }
            }
            Edit::MoveToShard(index, shard) => {
                if let Some(i) = pick(&tensors, *index) {
                    tensors[i].shard = usize::from(*shard) % num_shards;
                }
            }
            Edit::Duplicate(index, shard) => {
                if let Some(i) = pick(&tensors, *index) {
                    let original = &tensors[i];
                    duplicates.push(Tensor {
                        name: original.name.clone(),
                        dtype: original.dtype.clone(),
                        shape: original.shape.clone(),
                        data: original.data.clone(),
                        shard: usize::from(*shard) % num_shards,
                        skew: (0, 0),
                    });
                }
            }
            Edit::Metadata(pairs) => {
                metadata = (!pairs.is_empty()).then(|| {
                    pairs
                        .iter()
                        .map(|(key, value)| (key.clone(), json!(value)))
                        .collect()
                });
            }
            Edit::HeaderText(shard, text) => {
                header_texts.insert(usize::from(*shard) % num_shards, text.clone());
            }
            Edit::HeaderLength(shard, length) => {
                header_lengths.insert(usize::from(*shard) % num_shards, *length);
            }
            Edit::IndexEntry(tensor, file) => index_entries.push((tensor.clone(), file.clone())),
            Edit::IndexText(text) => index_text = Some(text.clone()),
            Edit::Truncate(..) | Edit::Poke(..) | Edit::DropFile(..) => file_edits.push(edit),
        }
    }
    tensors.extend(duplicates);

    let shard_name = |shard: usize| {
        if single_file {
            "model.safetensors".to_string()
        } else {
            format!("model-{shard:05}-of-{:05}.safetensors", num_shards - 1)
        }
    };
    let mut files: HashMap<String, Vec<u8>> = HashMap::new();
    let mut shard_files: Vec<Vec<u8>> = Vec::new();
    for shard in 0..num_shards {
        let members: Vec<&Tensor> = tensors.iter().filter(|t| t.shard == shard).collect();
        let (header, data) = safetensors_file(&members, metadata.as_ref());
        let header = header_texts
            .get(&shard)
            .map_or(header, |text| text.clone().into_bytes());
        let mut file = assemble(&header, &data);
        if let Some(length) = header_lengths.get(&shard) {
            file[..8].copy_from_slice(&length.to_le_bytes());
        }
        shard_files.push(file);
    }
    for edit in file_edits {
        match edit {
            Edit::Truncate(shard, at) => {
                let file = &mut shard_files[usize::from(*shard) % num_shards];
                let at = *at as usize % (file.len() + 1);
                file.truncate(at);
            }
            Edit::Poke(shard, at, byte) => {
                let file = &mut shard_files[usize::from(*shard) % num_shards];
                if !file.is_empty() {
                    let at = *at as usize % file.len();
                    file[at] = *byte;
                }
            }
            _ => {}
        }
    }
    for (shard, file) in shard_files.into_iter().enumerate() {
        files.insert(shard_name(shard), file);
    }
    if !single_file {
        let mut weight_map: Map<String, Value> = tensors
            .iter()
            .map(|t| (t.name.clone(), json!(shard_name(t.shard))))
            .collect();
        for (tensor, file) in index_entries {
            weight_map.insert(tensor, json!(file));
        }
        let text = index_text.unwrap_or_else(|| {
            json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string()
        });
        files.insert(INDEX.into(), text.into_bytes());
    }
    files.insert(
        "config.json".into(),
        config_text
            .unwrap_or_else(|| serde_json::to_string_pretty(&config_json).unwrap_or_default())
            .into_bytes(),
    );
    for edit in &edits {
        if let Edit::DropFile(which) = edit {
            let mut names: Vec<String> = files.keys().cloned().collect();
            names.sort();
            let name = &names[usize::from(*which) % names.len()];
            files.remove(&name.clone());
            if files.is_empty() {
                break;
            }
        }
    }
    Ok((files, edits.is_empty().then_some(config)))
}

/// `[name length u8][name][length u32 LE][bytes]`, repeated; a short tail is dropped.
fn raw_files(mut data: &[u8]) -> HashMap<String, Vec<u8>> {
    let mut files = HashMap::new();
    while let Some((&name_len, rest)) = data.split_first() {
        let name_len = usize::from(name_len);
        if rest.len() < name_len + 4 {
            break;
        }
        let name = String::from_utf8_lossy(&rest[..name_len]).into_owned();
        let len = u32::from_le_bytes(rest[name_len..name_len + 4].try_into().unwrap()) as usize;
        let body = &rest[name_len + 4..];
        let len = len.min(body.len());
        files.insert(name, body[..len].to_vec());
        data = &body[len..];
    }
    files
}

/// What validation promises about a config it accepts: the sizes the loader and the forward pass
/// multiply do not overflow, and every number the arithmetic uses is finite.
fn check_accepted(config: &ModelConfig) {
    let sizes = [
        config.num_attention_heads.checked_mul(config.head_dim),
        config.num_key_value_heads.checked_mul(config.head_dim),
        config.intermediate_size.checked_mul(2),
        config.vocab_size.checked_mul(config.hidden_size),
    ];
    assert!(
        sizes.iter().all(Option::is_some),
        "accepted sizes overflow: {config:?}"
    );
    assert!(
        config.swiglu_alpha.is_finite(),
        "accepted swiglu_alpha {}",
        config.swiglu_alpha
    );
    if let RopeScaling::Yarn {
        factor,
        beta_fast,
        beta_slow,
        original_max_position_embeddings,
        attention_factor,
        ..
    } = config.rope_scaling
    {
        for value in [
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
        ] {
            assert!(
                value.is_finite(),
                "accepted a non-finite YaRN parameter: {config:?}"
            );
        }
        // The RoPE table holds the attention factor as f32.
        assert!(
            (attention_factor as f32).is_finite(),
            "accepted attention factor {attention_factor}"
        );
    }
}

/// The loader's path from files to weights, as `Model::load` takes it; errors as their messages.
fn load(files: &HashMap<String, Vec<u8>>) -> std::result::Result<(ModelConfig, Weights), String> {
    let dir = Path::new("model");
    let config = match files.get("config.json") {
        Some(bytes) => std::str::from_utf8(bytes)
            .map_err(|error| error.to_string())
            .and_then(|text| ModelConfig::from_json_str(text).map_err(|error| error.to_string())),
        None => Err("no config.json".into()),
    };
    let checkpoint = Checkpoint::from_memory(dir, files).map_err(|error| error.to_string());
    if let Ok(config) = &config {
        check_accepted(config);
    }
    let (config, checkpoint) = (config?, checkpoint?);
    let weights = Weights::load(&config, &checkpoint).map_err(|error| error.to_string())?;
    let _ = RopeTable::new(&config);
    Ok((config, weights))
}

fuzz_target!(|data: &[u8]| {
    let Some((&form, rest)) = data.split_first() else {
        return;
    };
    if form % 2 == 1 {
        let _ = load(&raw_files(rest));
        return;
    }
    let Ok((files, pristine)) = built(&mut Unstructured::new(rest)) else {
        return;
    };
    let loaded = load(&files);
    if let Some(config) = pristine {
        let (loaded_config, _) =
            loaded.unwrap_or_else(|error| panic!("a valid checkpoint failed to load: {error}"));
        assert_eq!(loaded_config, config, "config.json did not load as written");
    }
});
