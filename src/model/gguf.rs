//! GGUF files as llama.cpp's converter writes gpt-oss (`convert_hf_to_gguf.py`, `GptOssModel`):
//! the file ggml-org publishes, unsloth's files and the blob `ollama pull gpt-oss:20b` stores.
//!
//! The file is memory-mapped and parsed with every count, length and offset checked against the
//! bytes that remain before it is used, so a truncated or lying file is refused with a message and
//! never sizes an allocation. [`GgufSource`] then serves the tensors under the Hugging Face names
//! [`Weights::load`](super::Weights::load) asks for:
//!
//! - F32/BF16 tensors are lent straight from the mapping; F16 and Q8_0 are widened to f32 (exactly)
//!   for vectors and rounded to bf16 for matrices, the one dense format the exact path reads. Q8_0
//!   matrices also come as they are, block for block, for the fast path's Q8 format
//!   ([`TensorSource::q8_matrix`]), so with the default settings they are never quantized again.
//! - MXFP4 experts are repacked once into the Hugging Face layout the expert kernels read: GGUF keeps
//!   each 32-value block as 17 bytes (E8M0 scale, then 16 bytes whose low nibbles hold values 0..15 and
//!   high nibbles 16..31), Hugging Face keeps scales apart and packs neighbours (value 2j low, 2j+1
//!   high). The converter also split HF's gate_up (gate rows even, up rows odd) into `ffn_gate_exps` and
//!   `ffn_up_exps` (or, with its `--fuse-gate-up-exps`, into one `ffn_gate_up_exps` holding each
//!   expert's gate rows then its up rows); the repack interleaves them again. The scale bytes and FP4
//!   codes are copied, never rounded, so the experts are bit for bit the checkpoint's.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::checkpoint::{
    scan_units, AlignedBytes, ByteOwner, Dtype, TensorBytes, ValueScan, WatchedMap,
};
use super::config::{LayerKind, ModelConfig, RopeScaling, MXFP4_BLOCK};
use super::weights::TensorSource;
use super::ModelError;
use crate::kernels::Q8Matrix;

/// The architecture name llama.cpp gives gpt-oss (`general.architecture`, prefix of its keys).
pub const ARCH: &str = "gpt-oss";

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: usize = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: usize = 4;

/// Value types of metadata entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of a fixed-size value; strings take at least their 8-byte length.
    fn min_size(self) -> usize {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            // Element type (4) and count (8).
            Array => 12,
        }
    }

    fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// One metadata value. Arrays are kept as a byte range of the mapping and decoded when asked for,
/// so the 201,088 token strings of a real file cost nothing until the vocabulary check reads them.
#[derive(Debug, Clone)]
enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    String(Range<usize>),
    Array {
        elem: ValueType,
        count: usize,
        bytes: Range<usize>,
    },
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Bool(_) => "a boolean",
            Value::String(_) => "a string",
            Value::Array { .. } => "an array",
        }
    }
}

/// ggml tensor element types: (name, values per block, bytes per block). Only the ones this loader
/// reads are converted; the others are known so their byte sizes can be checked against the file.
fn ggml_type(id: u32) -> Option<(&'static str, usize, usize)> {
    Some(match id {
        0 => ("F32", 1, 4),
        1 => ("F16", 1, 2),
        2 => ("Q4_0", 32, 18),
        3 => ("Q4_1", 32, 20),
        6 => ("Q5_0", 32, 22),
        7 => ("Q5_1", 32, 24),
        8 => ("Q8_0", 32, 34),
        9 => ("Q8_1", 32, 36),
        10 => ("Q2_K", 256, 84),
        11 => ("Q3_K", 256, 110),
        12 => ("Q4_K", 256, 144),
        13 => ("Q5_K", 256, 176),
        14 => ("Q6_K", 256, 210),
        15 => ("Q8_K", 256, 292),
        16 => ("IQ2_XXS", 256, 66),
        17 => ("IQ2_XS", 256, 74),
        18 => ("IQ3_XXS", 256, 98),
        19 => ("IQ1_S", 256, 50),
        20 => ("IQ4_NL", 32, 18),
        21 => ("IQ3_S", 256, 110),
        22 => ("IQ2_S", 256, 82),
        23 => ("IQ4_XS", 256, 136),
        24 => ("I8", 1, 1),
        25 => ("I16", 1, 2),
        26 => ("I32", 1, 4),
        27 => ("I64", 1, 8),
        28 => ("F64", 1, 8),
        29 => ("IQ1_M", 256, 56),
        30 => ("BF16", 1, 2),
        34 => ("TQ1_0", 256, 54),
        35 => ("TQ2_0", 256, 66),
        39 => ("MXFP4", 32, 17),
        _ => return None,
    })
}

pub(crate) const GGML_F32: u32 = 0;
pub(crate) const GGML_F16: u32 = 1;
pub(crate) const GGML_Q8_0: u32 = 8;
pub(crate) const GGML_BF16: u32 = 30;
pub(crate) const GGML_MXFP4: u32 = 39;
/// Bytes of a Q8_0 block: f16 scale, then 32 int8 values.
const Q8_0_BLOCK_BYTES: usize = 34;
/// Bytes of a GGUF MXFP4 block: E8M0 scale, then 16 bytes of FP4 codes.
const MXFP4_BLOCK_BYTES: usize = 17;

/// One tensor's entry in the file.
#[derive(Debug, Clone)]
pub struct GgufTensor {
    /// ggml dimensions, innermost first (the reverse of the Hugging Face shape).
    pub dims: Vec<usize>,
    pub type_id: u32,
    range: Range<usize>,
}

impl GgufTensor {
    pub fn type_name(&self) -> &'static str {
        ggml_type(self.type_id).map(|t| t.0).unwrap_or("unknown")
    }

    pub fn byte_len(&self) -> usize {
        self.range.len()
    }

    /// The shape in Hugging Face order (outermost first).
    fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// A mapped, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Arc<dyn ByteOwner>,
    pub version: u32,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, GgufTensor>,
    pub alignment: usize,
    /// Bytes before the tensor data: header, metadata and tensor table.
    header_len: usize,
}

/// Walks the mapped bytes; every read checks the remaining length first.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<Range<usize>, String> {
        if n > self.remaining() {
            return Err(format!(
                "the file ends inside {}: {n} bytes needed at offset {}, {} left (truncated file?)",
                what(),
                self.pos,
                self.remaining()
            ));
        }
        let start = self.pos;
        self.pos += n;
        Ok(start..self.pos)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], String> {
        let range = self.take(N, what)?;
        Ok(self.bytes[range].try_into().expect("range has N bytes"))
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length-prefixed string's byte range; the length is checked against the remaining bytes.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<Range<usize>, String> {
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            return Err(format!(
                "{} claims {len} bytes at offset {}, but only {} remain",
                what(),
                self.pos,
                self.remaining()
            ));
        }
        self.take(len as usize, what)
    }

    fn utf8(&mut self, what: &dyn Fn() -> String) -> Result<&'a str, String> {
        let range = self.string(what)?;
        std::str::from_utf8(&self.bytes[range]).map_err(|_| format!("{} is not UTF-8", what()))
    }

    /// A count of items of at least `min_size` bytes each, refused if the rest of the file could
    /// not hold that many.
    fn count(&mut self, min_size: usize, what: &dyn Fn() -> String) -> Result<usize, String> {
        let count = self.u64(what)?;
        let fits = (self.remaining() / min_size.max(1)) as u64;
        if count > fits {
            return Err(format!(
                "{} is {count}, but the {} bytes left hold at most {fits}",
                what(),
                self.remaining()
            ));
        }
        Ok(count as usize)
    }

    fn value(&mut self, vtype: ValueType, key: &str, in_array: bool) -> Result<Value, String> {
        let what = || format!("the value of {key}");
        Ok(match vtype {
            ValueType::U8 => Value::Int(self.array::<1>(&what)?[0] as i128),
            ValueType::I8 => Value::Int(self.array::<1>(&what)?[0] as i8 as i128),
            ValueType::U16 => Value::Int(u16::from_le_bytes(self.array(&what)?) as i128),
            ValueType::I16 => Value::Int(i16::from_le_bytes(self.array(&what)?) as i128),
            ValueType::U32 => Value::Int(self.u32(&what)? as i128),
            ValueType::I32 => Value::Int(i32::from_le_bytes(self.array(&what)?) as i128),
            ValueType::U64 => Value::Int(self.u64(&what)? as i128),
            ValueType::I64 => Value::Int(i64::from_le_bytes(self.array(&what)?) as i128),
            ValueType::F32 => Value::Float(f32::from_le_bytes(self.array(&what)?) as f64),
            ValueType::F64 => Value::Float(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => match self.array::<1>(&what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                other => return Err(format!("{key} is a boolean stored as {other}, not 0 or 1")),
            },
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                if in_array {
                    return Err(format!("{key} nests an array in an array"));
                }
                let elem_id = self.u32(&|| format!("the element type of {key}"))?;
                let elem = ValueType::from_id(elem_id)
                    .ok_or_else(|| format!("{key} is an array of unknown value type {elem_id}"))?;
                if elem == ValueType::Array {
                    return Err(format!("{key} nests an array in an array"));
                }
                let count = self.count(elem.min_size(), &|| {
                    format!("the element count of {key} ({} array)", elem.name())
                })?;
                let start = self.pos;
                match elem {
                    ValueType::String => {
                        for i in 0..count {
                            self.string(&|| format!("string {i} of {key}"))?;
                        }
                    }
                    fixed => {
                        // `count` already fits the remaining bytes at this element size.
                        self.take(count * fixed.min_size(), &what)?;
                    }
                }
                Value::Array {
                    elem,
                    count,
                    bytes: start..self.pos,
                }
            }
        })
    }
}

impl GgufFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        // Watched like a safetensors shard: a file truncated while mapped becomes an error naming
        // it instead of a SIGBUS, one overwritten in place is noticed between generations.
        Self::parse(path, Arc::new(WatchedMap::open(path)?))
    }

    /// Parses a GGUF held in memory; `path` only names it in errors (tests and fuzzing use this).
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, ModelError> {
        Self::parse(path, Arc::new(bytes))
    }

    fn parse(path: &Path, map: Arc<dyn ByteOwner>) -> Result<Self, ModelError> {
        let bad = |message: String| ModelError::BadGguf {
            path: path.to_owned(),
            message,
        };
        let bytes: &[u8] = map.bytes();
        let mut c = Cursor { bytes, pos: 0 };
        let magic = c.array::<4>(&|| "the magic number".into()).map_err(bad)?;
        if &magic != MAGIC {
            return Err(bad(format!(
                "not a GGUF file: it starts with {magic:02x?}, a GGUF file with \"GGUF\""
            )));
        }
        let version = c.u32(&|| "the version".into()).map_err(bad)?;
        match version {
            2 | 3 => {}
            1 => return Err(bad(
                "GGUF version 1 (32-bit counts) is not supported; convert the model again with \
                     a current llama.cpp"
                    .into(),
            )),
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(bad(
                    "a big-endian GGUF file; x86-64 reads little-endian files".into(),
                ))
            }
            v => {
                return Err(bad(format!(
                    "unknown GGUF version {v} (2 and 3 are supported)"
                )))
            }
        }
        // Smallest tensor info: empty name (8), dimension count (4), type (4), offset (8).
        let tensor_count = c.count(24, &|| "the tensor count".into()).map_err(bad)?;
        // Smallest entry: empty key (8), value type (4), one byte.
        let kv_count = c
            .count(13, &|| "the metadata entry count".into())
            .map_err(bad)?;

        let mut metadata = HashMap::new();
        for i in 0..kv_count {
            let key = c
                .utf8(&|| format!("the key of metadata entry {i}"))
                .map_err(bad)?
                .to_owned();
            let type_id = c.u32(&|| format!("the value type of {key}")).map_err(bad)?;
            let vtype = ValueType::from_id(type_id)
                .ok_or_else(|| bad(format!("{key} has unknown value type {type_id}")))?;
            let value = c.value(vtype, &key, false).map_err(bad)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(bad(format!("metadata key {key} appears twice")));
            }
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::Int(a)) if *a > 0 && (*a as u128).is_power_of_two() && *a <= 1 << 30 => {
                *a as usize
            }
            Some(other) => {
                return Err(bad(format!(
                    "general.alignment must be a power of two, found {}",
                    describe(bytes, other)
                )))
            }
        };

        let mut infos = Vec::with_capacity(tensor_count);
        for i in 0..tensor_count {
            let name = c
                .utf8(&|| format!("the name of tensor {i}"))
                .map_err(bad)?
                .to_owned();
            let n_dims = c
                .u32(&|| format!("the dimension count of {name}"))
                .map_err(bad)? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad(format!(
                    "tensor {name} has {n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}"
                )));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for d in 0..n_dims {
                let dim = c.u64(&|| format!("dimension {d} of {name}")).map_err(bad)?;
                if dim == 0 || dim > i64::MAX as u64 {
                    return Err(bad(format!("tensor {name} has dimension {d} = {dim}")));
                }
                dims.push(dim as usize);
            }
            let type_id = c.u32(&|| format!("the type of {name}")).map_err(bad)?;
            let offset = c
                .u64(&|| format!("the data offset of {name}"))
                .map_err(bad)?;
            infos.push((name, dims, type_id, offset));
        }
        let data_start = c.pos.div_ceil(alignment).saturating_mul(alignment);

        let mut tensors = HashMap::with_capacity(infos.len());
        for (name, dims, type_id, offset) in infos {
            let Some((type_name, block, block_bytes)) = ggml_type(type_id) else {
                return Err(bad(format!(
                    "tensor {name} has unknown ggml type {type_id} (a newer llama.cpp format?)"
                )));
            };
            if !dims[0].is_multiple_of(block) {
                return Err(bad(format!(
                    "tensor {name}: {type_name} stores rows in blocks of {block} values, but a row \
                     has {}",
                    dims[0]
                )));
            }
            let elements = dims
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| {
                    bad(format!(
                        "tensor {name}: {dims:?} overflows the element count"
                    ))
                })?;
            let size = (elements / block)
                .checked_mul(block_bytes)
                .ok_or_else(|| bad(format!("tensor {name}: {dims:?} overflows the byte count")))?;
            if !offset.is_multiple_of(alignment as u64) {
                return Err(bad(format!(
                    "tensor {name} starts at data offset {offset}, not a multiple of the file's \
                     alignment {alignment}"
                )));
            }
            let start = (offset as u128) + data_start as u128;
            let end = start + size as u128;
            if end > bytes.len() as u128 {
                return Err(bad(format!(
                    "tensor {name} ({type_name} {dims:?}, {size} bytes at data offset {offset}) \
                     ends at byte {end}, past the end of the {}-byte file (truncated file?)",
                    bytes.len()
                )));
            }
            let tensor = GgufTensor {
                dims,
                type_id,
                range: start as usize..end as usize,
            };
            if tensors.insert(name.clone(), tensor).is_some() {
                return Err(bad(format!("tensor {name} appears twice")));
            }
        }
        let mut ranges: Vec<(&str, &Range<usize>)> = tensors
            .iter()
            .map(|(n, t)| (n.as_str(), &t.range))
            .collect();
        ranges.sort_by_key(|(_, r)| (r.start, r.end));
        for pair in ranges.windows(2) {
            if pair[1].1.start < pair[0].1.end {
                return Err(bad(format!(
                    "tensors {} and {} overlap in the file",
                    pair[0].0, pair[1].0
                )));
            }
        }
        let header_len = data_start.min(bytes.len());
        Ok(GgufFile {
            path: path.to_owned(),
            map,
            version,
            metadata,
            tensors,
            alignment,
            header_len,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A hash of everything before the tensor data (metadata, names, types, shapes, offsets) and
    /// of the file's length: two files with the same fingerprint lay out the same tensors, as
    /// [`Checkpoint::fingerprint`](super::checkpoint::Checkpoint::fingerprint) promises for
    /// shards. Weight bytes are not read.
    pub fn fingerprint(&self) -> u64 {
        let bytes = self.map.bytes();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&bytes[..self.header_len]);
        hasher.update(&(bytes.len() as u64).to_le_bytes());
        hasher.digest()
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.tensors.get(name)
    }

    pub fn tensors(&self) -> impl Iterator<Item = (&str, &GgufTensor)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// Reads every value of tensor `name` (its GGUF name) and counts those that are not numbers:
    /// NaN or infinity in F32, F16 and BF16 tensors and in the f16 scales of Q8_0 blocks (each
    /// bad scale counts once, at its block's first element), and the NaN scale byte 0xFF of MXFP4
    /// blocks. Other types are not read by the loader and are not scanned.
    pub fn scan_values(&self, name: &str) -> Result<ValueScan, ModelError> {
        let tensor = self.get_or_missing(name)?;
        let bytes = self.bytes(tensor);
        let f16_bad: fn(&[u8]) -> bool = |e| u16::from_le_bytes([e[0], e[1]]) & 0x7c00 == 0x7c00;
        Ok(match tensor.type_id {
            GGML_F32 => scan_units(bytes, 4, 1, false, |e| {
                !f32::from_le_bytes([e[0], e[1], e[2], e[3]]).is_finite()
            }),
            GGML_F16 => scan_units(bytes, 2, 1, false, f16_bad),
            GGML_BF16 => scan_units(bytes, 2, 1, false, |e| {
                u16::from_le_bytes([e[0], e[1]]) & 0x7f80 == 0x7f80
            }),
            GGML_Q8_0 => scan_units(bytes, Q8_0_BLOCK_BYTES, 32, false, f16_bad),
            GGML_MXFP4 => scan_units(bytes, MXFP4_BLOCK_BYTES, 32, true, |b| b[0] == 0xff),
            _ => ValueScan {
                bytes: bytes.len(),
                bad: None,
            },
        })
    }

    fn get_or_missing(&self, name: &str) -> Result<&GgufTensor, ModelError> {
        self.tensor(name).ok_or_else(|| self.missing_tensor(name))
    }

    /// The tensor's bytes as the file stores them.
    pub fn bytes(&self, tensor: &GgufTensor) -> &[u8] {
        &self.map.bytes()[tensor.range.clone()]
    }

    fn view(&self, tensor: &GgufTensor) -> TensorBytes {
        TensorBytes::new(self.map.clone(), tensor.range.clone())
    }

    fn err(&self, message: String) -> ModelError {
        ModelError::BadGguf {
            path: self.path.clone(),
            message,
        }
    }

    fn key_err(&self, key: &str, message: String) -> ModelError {
        ModelError::Config {
            file: self.path.display().to_string(),
            key: key.into(),
            message,
        }
    }

    /// The string value of `key`, if present.
    pub fn string(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(range)) => std::str::from_utf8(&self.map.bytes()[range.clone()])
                .map(Some)
                .map_err(|_| self.key_err(key, "is not UTF-8".into())),
            Some(other) => {
                Err(self.key_err(key, format!("expected a string, found {}", other.kind())))
            }
        }
    }

    fn uint(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Int(v)) if *v >= 0 && *v <= usize::MAX as i128 => Ok(Some(*v as usize)),
            Some(other) => Err(self.key_err(
                key,
                format!(
                    "expected a non-negative integer, found {}",
                    describe(self.map.bytes(), other)
                ),
            )),
        }
    }

    fn required_uint(&self, key: &str) -> Result<usize, ModelError> {
        self.uint(key)?
            .ok_or_else(|| self.key_err(key, "missing; llama.cpp's converter writes it".into()))
    }

    fn float(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Float(v)) => Ok(Some(*v)),
            Some(Value::Int(v)) => Ok(Some(*v as f64)),
            Some(other) => {
                Err(self.key_err(key, format!("expected a number, found {}", other.kind())))
            }
        }
    }

    /// The strings of an array value, borrowed from the mapping.
    pub fn string_array(&self, key: &str) -> Result<Option<Vec<&str>>, ModelError> {
        let Some(value) = self.metadata.get(key) else {
            return Ok(None);
        };
        let Value::Array {
            elem: ValueType::String,
            count,
            bytes,
        } = value
        else {
            return Err(self.key_err(
                key,
                format!("expected an array of strings, found {}", value.kind()),
            ));
        };
        let mut c = Cursor {
            bytes: &self.map.bytes()[..bytes.end],
            pos: bytes.start,
        };
        // The parse walked these strings already; `count` is bounded by the file size.
        let mut out = Vec::with_capacity(*count);
        for i in 0..*count {
            let s = c
                .utf8(&|| format!("string {i} of {key}"))
                .map_err(|m| self.key_err(key, m))?;
            out.push(s);
        }
        Ok(Some(out))
    }

    /// Per-layer flags of an array of booleans or integers (non-zero = true).
    fn flag_array(&self, key: &str) -> Result<Option<Vec<bool>>, ModelError> {
        let Some(value) = self.metadata.get(key) else {
            return Ok(None);
        };
        match value {
            Value::Array { elem, count, bytes } if *elem != ValueType::String => {
                let size = elem.min_size();
                let raw = &self.map.bytes()[bytes.clone()];
                Ok(Some(
                    (0..*count)
                        .map(|i| raw[i * size..(i + 1) * size].iter().any(|b| *b != 0))
                        .collect(),
                ))
            }
            other => Err(self.key_err(
                key,
                format!("expected an array of flags, found {}", other.kind()),
            )),
        }
    }

    /// The model configuration from the `gpt-oss.*` keys, checked by [`ModelConfig::validate`].
    pub fn config(&self) -> Result<ModelConfig, ModelError> {
        let arch_key = "general.architecture";
        match self.string(arch_key)? {
            Some(ARCH) => {}
            Some(other) => {
                return Err(self.key_err(
                    arch_key,
                    format!(
                    "the file holds a \"{other}\" model; ossterm runs \"{ARCH}\" (gpt-oss) only"
                ),
                ))
            }
            None => return Err(self.key_err(arch_key, "missing".into())),
        }
        let k = |name: &str| format!("{ARCH}.{name}");
        let embed = self
            .tensor("token_embd.weight")
            .ok_or_else(|| self.missing_tensor("token_embd.weight"))?;
        if embed.dims.len() != 2 {
            return Err(ModelError::WrongShape {
                tensor: "token_embd.weight".into(),
                expected: vec![0, 0],
                found: embed.shape(),
            });
        }
        let hidden_size = self.required_uint(&k("embedding_length"))?;
        let num_hidden_layers = self.required_uint(&k("block_count"))?;
        // Every layer has tensors of its own: a count the tensor table cannot back is a lie, and
        // refusing it here keeps it from sizing the per-layer lists below.
        if num_hidden_layers > self.tensors.len() {
            return Err(self.key_err(
                &k("block_count"),
                format!(
                    "{num_hidden_layers} layers, but the file has only {} tensors",
                    self.tensors.len()
                ),
            ));
        }
        let num_attention_heads = self.required_uint(&k("attention.head_count"))?;
        let num_key_value_heads = self
            .uint(&k("attention.head_count_kv"))?
            .unwrap_or(num_attention_heads);
        let head_dim = match self.uint(&k("attention.key_length"))? {
            Some(d) => d,
            None => hidden_size / num_attention_heads.max(1),
        };
        if let Some(v) = self.uint(&k("attention.value_length"))? {
            if v != head_dim {
                return Err(self.key_err(
                    &k("attention.value_length"),
                    format!(
                        "{v} differs from the key length {head_dim}; gpt-oss uses one head width"
                    ),
                ));
            }
        }
        let intermediate_size = match self.uint(&k("expert_feed_forward_length"))? {
            Some(n) => n,
            None => self.required_uint(&k("feed_forward_length"))?,
        };
        let sliding_window = self.required_uint(&k("attention.sliding_window"))?;
        let pattern_key = k("attention.sliding_window_pattern");
        // llama.cpp gives gpt-oss sliding attention on even layers (pattern 2) unless told otherwise.
        let layer_kinds: Vec<LayerKind> =
            match (self.flag_array(&pattern_key), self.uint(&pattern_key)) {
                (Ok(Some(flags)), _) => flags
                    .iter()
                    .map(|&s| {
                        if s {
                            LayerKind::Sliding
                        } else {
                            LayerKind::Full
                        }
                    })
                    .collect(),
                (_, Ok(Some(n))) if n > 0 => (0..num_hidden_layers)
                    .map(|l| {
                        if l % n < n - 1 {
                            LayerKind::Sliding
                        } else {
                            LayerKind::Full
                        }
                    })
                    .collect(),
                (Ok(None), _) => (0..num_hidden_layers)
                    .map(|l| {
                        if l % 2 == 0 {
                            LayerKind::Sliding
                        } else {
                            LayerKind::Full
                        }
                    })
                    .collect(),
                _ => {
                    return Err(self.key_err(
                        &pattern_key,
                        "expected a positive period or one flag per layer".into(),
                    ))
                }
            };
        let rope_theta = self.float(&k("rope.freq_base"))?.unwrap_or(150000.0);
        let max_position_embeddings = self.required_uint(&k("context_length"))?;
        let rope_scaling = match self.string(&k("rope.scaling.type"))? {
            None | Some("none") => RopeScaling::None,
            Some("yarn") => {
                let factor = self.float(&k("rope.scaling.factor"))?.ok_or_else(|| {
                    self.key_err(&k("rope.scaling.factor"), "missing for YaRN".into())
                })?;
                let original =
                    self.required_uint(&k("rope.scaling.original_context_length"))? as f64;
                if !(factor.is_finite() && factor > 0.0 && original > 0.0) {
                    return Err(self.key_err(
                        &k("rope.scaling.factor"),
                        format!("must be positive, found {factor}"),
                    ));
                }
                let yarn_mscale = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * factor.ln() + 1.0
                };
                RopeScaling::Yarn {
                    factor,
                    beta_fast: self
                        .float(&k("rope.scaling.yarn_beta_fast"))?
                        .filter(|v| *v != 0.0)
                        .unwrap_or(32.0),
                    beta_slow: self
                        .float(&k("rope.scaling.yarn_beta_slow"))?
                        .filter(|v| *v != 0.0)
                        .unwrap_or(1.0),
                    original_max_position_embeddings: original,
                    // GGUF has no key for it; gpt-oss's published config says false.
                    truncate: false,
                    attention_factor: yarn_mscale,
                }
            }
            Some(other) => {
                return Err(self.key_err(
                    &k("rope.scaling.type"),
                    format!("unsupported RoPE scaling \"{other}\"; gpt-oss uses \"yarn\""),
                ))
            }
        };
        let config = ModelConfig {
            vocab_size: embed.dims[1],
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_local_experts: self.required_uint(&k("expert_count"))?,
            num_experts_per_tok: self.required_uint(&k("expert_used_count"))?,
            intermediate_size,
            // llama.cpp fixes the clamped SwiGLU of gpt-oss at these values; GGUF has no keys for them.
            swiglu_limit: 7.0,
            swiglu_alpha: 1.702,
            rms_norm_eps: self
                .float(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5) as f32,
            sliding_window,
            layer_kinds,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: self.tensor("output.weight").is_none(),
        };
        config.validate().map_err(|e| match e {
            ModelError::Config { key, message, .. } => self.key_err(&gguf_key(&key), message),
            other => other,
        })?;
        self.check_vocabulary(config.vocab_size)?;
        Ok(config)
    }

    fn missing_tensor(&self, name: &str) -> ModelError {
        ModelError::MissingTensor {
            tensor: name.into(),
            dir: self.path.clone(),
        }
    }

    /// Refuses a vocabulary other than o200k_harmony: the chat format's special tokens must sit at
    /// their ids, or the prompt the app renders would mean something else to the model.
    pub fn check_vocabulary(&self, vocab_size: usize) -> Result<(), ModelError> {
        let key = "tokenizer.ggml.tokens";
        let tokens = self
            .string_array(key)?
            .ok_or_else(|| self.key_err(key, "missing: the file has no vocabulary".into()))?;
        if tokens.len() != vocab_size {
            return Err(self.key_err(
                key,
                format!(
                    "{} tokens, but token_embd.weight has {vocab_size} rows",
                    tokens.len()
                ),
            ));
        }
        for (id, expected) in HARMONY_SPECIALS {
            if let Some(found) = tokens.get(*id as usize) {
                if found != expected {
                    return Err(self.key_err(
                        key,
                        format!(
                            "token {id} is {found:?}, but o200k_harmony has {expected:?} there: this \
                             file's tokenizer is not gpt-oss's"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Special tokens of o200k_harmony the chat format depends on (spec section 5).
pub const HARMONY_SPECIALS: &[(u32, &str)] = &[
    (199998, "<|startoftext|>"),
    (199999, "<|endoftext|>"),
    (200002, "<|return|>"),
    (200003, "<|constrain|>"),
    (200005, "<|channel|>"),
    (200006, "<|start|>"),
    (200007, "<|end|>"),
    (200008, "<|message|>"),
    (200012, "<|call|>"),
];

/// The GGUF key behind a config.json field name, for errors of the shared validation.
fn gguf_key(field: &str) -> String {
    let name = match field {
        "vocab_size" => return "token_embd.weight (rows)".into(),
        "hidden_size" => "embedding_length",
        "num_hidden_layers" => "block_count",
        "num_attention_heads" => "attention.head_count",
        "num_key_value_heads" => "attention.head_count_kv",
        "head_dim" => "attention.key_length",
        "num_local_experts" => "expert_count",
        "num_experts_per_tok" => "expert_used_count",
        "intermediate_size" => "expert_feed_forward_length",
        "sliding_window" => "attention.sliding_window",
        "layer_types" => "attention.sliding_window_pattern",
        "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
        "rope_theta" => "rope.freq_base",
        other => other,
    };
    format!("{ARCH}.{name}")
}

fn describe(map: &[u8], value: &Value) -> String {
    match value {
        Value::Int(v) => v.to_string(),
        Value::Float(v) => v.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::String(r) => format!("{:?}", String::from_utf8_lossy(&map[r.clone()])),
        Value::Array { elem, count, .. } => format!("an array of {count} {}", elem.name()),
    }
}

/// The GGUF name of a Hugging Face tensor name, and what it takes to serve it.
enum Mapped {
    /// The same tensor under another name.
    Plain(String),
    /// MXFP4 experts: `parts` are the GGUF tensors (gate and up are interleaved row by row).
    ExpertBlocks { parts: Vec<String>, scales: bool },
    /// Expert biases, interleaved like their weights.
    ExpertBias(Vec<String>),
}

fn map_name(hf: &str) -> Option<Mapped> {
    let plain = |s: &str| Some(Mapped::Plain(s.to_owned()));
    match hf {
        "model.embed_tokens.weight" => return plain("token_embd.weight"),
        "lm_head.weight" => return plain("output.weight"),
        "model.norm.weight" => return plain("output_norm.weight"),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let blk = |s: &str| format!("blk.{layer}.{s}");
    let gate_up = || vec![blk("ffn_gate_exps"), blk("ffn_up_exps")];
    Some(match rest {
        "input_layernorm.weight" => Mapped::Plain(blk("attn_norm.weight")),
        "post_attention_layernorm.weight" => Mapped::Plain(blk("post_attention_norm.weight")),
        "self_attn.sinks" => Mapped::Plain(blk("attn_sinks.weight")),
        "mlp.experts.gate_up_proj_blocks" | "mlp.experts.gate_up_proj_scales" => {
            Mapped::ExpertBlocks {
                parts: gate_up(),
                scales: rest.ends_with("_scales"),
            }
        }
        "mlp.experts.down_proj_blocks" | "mlp.experts.down_proj_scales" => Mapped::ExpertBlocks {
            parts: vec![blk("ffn_down_exps")],
            scales: rest.ends_with("_scales"),
        },
        "mlp.experts.gate_up_proj_bias" => Mapped::ExpertBias(gate_up()),
        "mlp.experts.down_proj_bias" => Mapped::ExpertBias(vec![blk("ffn_down_exps")]),
        _ => {
            let (module, kind) = rest.rsplit_once('.')?;
            let gguf = match module {
                "self_attn.q_proj" => "attn_q",
                "self_attn.k_proj" => "attn_k",
                "self_attn.v_proj" => "attn_v",
                "self_attn.o_proj" => "attn_output",
                "mlp.router" => "ffn_gate_inp",
                _ => return None,
            };
            Mapped::Plain(blk(&format!("{gguf}.{kind}")))
        }
    })
}

/// One part of an expert projection: (GGUF tensor name, tensor, first row within an expert).
type ExpertPart<'a> = (String, &'a GgufTensor, usize);

/// A [`GgufFile`] serving tensors under Hugging Face names, converted as the module doc says.
pub struct GgufSource {
    pub file: GgufFile,
    /// The other half of an expert repack (scales after blocks were asked for, or the reverse).
    pending: Mutex<HashMap<String, TensorBytes>>,
}

impl GgufSource {
    pub fn new(file: GgufFile) -> Self {
        GgufSource {
            file,
            pending: Mutex::new(HashMap::new()),
        }
    }

    fn get(&self, name: &str) -> Result<&GgufTensor, ModelError> {
        self.file
            .tensor(name)
            .ok_or_else(|| self.file.missing_tensor(name))
    }

    fn check_shape(
        &self,
        name: &str,
        tensor: &GgufTensor,
        shape: &[usize],
    ) -> Result<(), ModelError> {
        if tensor.shape() != shape {
            return Err(ModelError::WrongShape {
                tensor: name.into(),
                expected: shape.to_vec(),
                found: tensor.shape(),
            });
        }
        Ok(())
    }

    fn wrong_type(name: &str, tensor: &GgufTensor, expected: &str) -> ModelError {
        ModelError::WrongDtype {
            tensor: name.into(),
            expected: expected.into(),
            found: tensor.type_name().into(),
        }
    }

    /// A dense tensor in one of `dtypes` (BF16 for matrices; BF16 or F32 for vectors).
    fn dense(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        let tensor = self.get(name)?;
        self.check_shape(name, tensor, shape)?;
        let wants_f32 = dtypes.contains(&Dtype::F32);
        let bytes = self.file.bytes(tensor);
        let widened: Vec<f32> = match tensor.type_id {
            GGML_BF16 if dtypes.contains(&Dtype::Bf16) => {
                return Ok((Dtype::Bf16, self.file.view(tensor)))
            }
            GGML_F32 if wants_f32 => return Ok((Dtype::F32, self.file.view(tensor))),
            GGML_F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            GGML_F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            GGML_Q8_0 => dequantize_q8_0(bytes),
            GGML_BF16 => bytes
                .chunks_exact(2)
                .map(|b| super::weights::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
            _ => return Err(Self::wrong_type(name, tensor, "F32, F16, BF16 or Q8_0")),
        };
        if wants_f32 {
            let bytes = widened.iter().flat_map(|v| v.to_le_bytes()).collect();
            return Ok((Dtype::F32, TensorBytes::from_vec(bytes)));
        }
        // The forward pass reads dense matrices as bf16: round to nearest even.
        let bytes = widened
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        Ok((Dtype::Bf16, TensorBytes::from_vec(bytes)))
    }

    /// Where the rows of `parts` are: each part as its own tensor (`ffn_gate_exps`, `ffn_up_exps`,
    /// the converter's default), or gate and up as the two halves of one `ffn_gate_up_exps`
    /// tensor (each expert's gate rows, then its up rows: the converter's `--fuse-gate-up-exps`,
    /// which llama.cpp and ik_llama.cpp also read). Returns one (tensor name, tensor, first row
    /// within an expert) per part, and whether the parts share one fused tensor.
    fn expert_parts(
        &self,
        parts: &[String],
        suffix: &str,
    ) -> Result<(Vec<ExpertPart<'_>>, bool), ModelError> {
        if let [gate, _] = parts {
            if let Some(fused) = gate.strip_suffix("ffn_gate_exps") {
                let name = format!("{fused}ffn_gate_up_exps.{suffix}");
                let separate = format!("{gate}.{suffix}");
                if self.file.tensor(&separate).is_none() {
                    if let Some(tensor) = self.file.tensor(&name) {
                        let rows = if suffix == "bias" {
                            tensor.dims[0]
                        } else {
                            tensor.dims.get(1).copied().unwrap_or(0)
                        };
                        if !rows.is_multiple_of(2) {
                            return Err(self.file.err(format!(
                                "{name} has {rows} rows per expert; gate and up need an even count"
                            )));
                        }
                        return Ok((
                            vec![(name.clone(), tensor, 0), (name, tensor, rows / 2)],
                            true,
                        ));
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(parts.len());
        for part in parts {
            let name = format!("{part}.{suffix}");
            let tensor = self.get(&name)?;
            out.push((name, tensor, 0));
        }
        Ok((out, false))
    }

    /// Expert weights in the Hugging Face layout: returns (blocks [E, rows, cols/32, 16],
    /// scales [E, rows, cols/32]) for `parts` interleaved row by row.
    fn repack_experts(
        &self,
        parts: &[String],
        shape: &[usize],
    ) -> Result<(AlignedBytes, AlignedBytes), ModelError> {
        // shape is HF's blocks shape [E, rows, nblocks, 16] with rows = parts x part rows.
        let (experts, rows, nblocks) = (shape[0], shape[1], shape[2]);
        let part_rows = rows / parts.len();
        let cols = nblocks * MXFP4_BLOCK;
        let (sources, fused) = self.expert_parts(parts, "weight")?;
        // Rows per expert in each source tensor: its own part's, or (fused) all of them.
        let expected_rows = if fused { rows } else { part_rows };
        for (name, tensor, _) in &sources {
            if tensor.type_id != GGML_MXFP4 {
                return Err(Self::wrong_type(name, tensor, "MXFP4"));
            }
            self.check_shape(name, tensor, &[experts, expected_rows, cols])?;
        }
        let row_blocks = nblocks * 16;
        // Aligned heap bytes: the fast path can reorder them into tiles in place.
        let mut blocks = AlignedBytes::zeroed(experts * rows * row_blocks);
        let mut scales = AlignedBytes::zeroed(experts * rows * nblocks);
        let src: Vec<(&[u8], usize)> = sources
            .iter()
            .map(|(_, t, first)| (self.file.bytes(t), *first))
            .collect();
        let src_row = nblocks * MXFP4_BLOCK_BYTES;
        blocks
            .as_mut_slice()
            .par_chunks_mut(row_blocks)
            .zip(scales.as_mut_slice().par_chunks_mut(nblocks))
            .enumerate()
            .for_each(|(global_row, (dst_blocks, dst_scales))| {
                let (expert, row) = (global_row / rows, global_row % rows);
                // Interleaved parts: HF row r is row r / parts of part r % parts.
                let (bytes, first) = src[row % src.len()];
                let part_row = expert * expected_rows + first + row / src.len();
                let row_src = &bytes[part_row * src_row..(part_row + 1) * src_row];
                for (b, block) in row_src.chunks_exact(MXFP4_BLOCK_BYTES).enumerate() {
                    dst_scales[b] = block[0];
                    let codes = &block[1..];
                    let out = &mut dst_blocks[b * 16..(b + 1) * 16];
                    // GGUF: byte i holds value i (low) and i + 16 (high). HF: byte j holds 2j (low)
                    // and 2j + 1 (high): values 0..15 come from low nibbles, 16..31 from high ones.
                    for j in 0..8 {
                        let (even, odd) = (codes[2 * j], codes[2 * j + 1]);
                        out[j] = (even & 0x0F) | (odd << 4);
                        out[j + 8] = (even >> 4) | (odd & 0xF0);
                    }
                }
            });
        blocks.collapse_huge_pages();
        scales.collapse_huge_pages();
        // The copy is what the kernels read: let the OS drop the file's pages from this process.
        for (_, tensor, _) in sources {
            self.file.view(tensor).release_pages();
        }
        Ok((blocks, scales))
    }

    fn experts(
        &self,
        hf: &str,
        parts: &[String],
        scales: bool,
        shape: &[usize],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        if let Some(ready) = self
            .pending
            .lock()
            .expect("no panics under this lock")
            .remove(hf)
        {
            return Ok((Dtype::U8, ready));
        }
        let blocks_shape: Vec<usize> = if scales {
            vec![shape[0], shape[1], shape[2], 16]
        } else {
            shape.to_vec()
        };
        if blocks_shape.len() != 4
            || blocks_shape[3] != 16
            || !blocks_shape[1].is_multiple_of(parts.len())
        {
            return Err(self.file.err(format!(
                "{hf} cannot be served as MXFP4 experts of shape {shape:?}"
            )));
        }
        let (blocks, scale_bytes) = self.repack_experts(parts, &blocks_shape)?;
        let (wanted, other, other_name) = if scales {
            (scale_bytes, blocks, hf.replace("_scales", "_blocks"))
        } else {
            (blocks, scale_bytes, hf.replace("_blocks", "_scales"))
        };
        self.pending
            .lock()
            .expect("no panics under this lock")
            .insert(other_name, TensorBytes::from_aligned(other));
        Ok((Dtype::U8, TensorBytes::from_aligned(wanted)))
    }

    fn expert_bias(
        &self,
        parts: &[String],
        shape: &[usize],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        let (experts, rows) = (shape[0], shape[1]);
        if !rows.is_multiple_of(parts.len()) {
            return Err(self.file.err(format!(
                "expert bias rows {rows} do not split over {} parts",
                parts.len()
            )));
        }
        let part_rows = rows / parts.len();
        let (found, fused) = self.expert_parts(parts, "bias")?;
        let expected_rows = if fused { rows } else { part_rows };
        let mut sources = Vec::with_capacity(found.len());
        for (name, _, first) in found {
            let (_, bytes) = self.dense(&name, &[experts, expected_rows], &[Dtype::F32])?;
            sources.push((bytes, first));
        }
        let mut out = Vec::with_capacity(experts * rows * 4);
        for e in 0..experts {
            for r in 0..rows {
                let (part, first) = &sources[r % parts.len()];
                let at = (e * expected_rows + first + r / parts.len()) * 4;
                out.extend_from_slice(&part.as_slice()[at..at + 4]);
            }
        }
        Ok((Dtype::F32, TensorBytes::from_vec(out)))
    }
}

impl TensorSource for GgufSource {
    fn tensor(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        match map_name(name) {
            Some(Mapped::Plain(gguf)) => self.dense(&gguf, shape, dtypes),
            Some(Mapped::ExpertBlocks { parts, scales }) => {
                self.experts(name, &parts, scales, shape)
            }
            Some(Mapped::ExpertBias(parts)) => self.expert_bias(&parts, shape),
            None => Err(ModelError::MissingTensor {
                tensor: name.into(),
                dir: self.file.path.clone(),
            }),
        }
    }

    fn q8_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Q8Matrix>, ModelError> {
        let Some(Mapped::Plain(gguf)) = map_name(name) else {
            return Ok(None);
        };
        let tensor = self.get(&gguf)?;
        if tensor.type_id != GGML_Q8_0 {
            return Ok(None);
        }
        self.check_shape(&gguf, tensor, &[rows, cols])?;
        Q8Matrix::from_ggml_q8_0(rows, cols, self.file.bytes(tensor))
            .map(Some)
            .map_err(|e| self.file.err(format!("{gguf}: {e}")))
    }
}

/// Q8_0 blocks (f16 scale, 32 int8) as f32; every product of an f16 and an int8 is exact in f32.
fn dequantize_q8_0(bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / Q8_0_BLOCK_BYTES * 32);
    for block in bytes.chunks_exact(Q8_0_BLOCK_BYTES) {
        let scale = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        out.extend(block[2..].iter().map(|&q| q as i8 as f32 * scale));
    }
    out
}

/// Whether `path` names a GGUF file: by extension, or by its first four bytes.
pub fn is_gguf(path: &Path) -> bool {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_map_to_the_converters_names() {
        let plain = |hf: &str| match map_name(hf) {
            Some(Mapped::Plain(g)) => g,
            _ => panic!("{hf} is not a plain tensor"),
        };
        assert_eq!(plain("model.embed_tokens.weight"), "token_embd.weight");
        assert_eq!(plain("lm_head.weight"), "output.weight");
        assert_eq!(
            plain("model.layers.3.self_attn.o_proj.bias"),
            "blk.3.attn_output.bias"
        );
        assert_eq!(
            plain("model.layers.0.self_attn.sinks"),
            "blk.0.attn_sinks.weight"
        );
        assert_eq!(
            plain("model.layers.11.mlp.router.weight"),
            "blk.11.ffn_gate_inp.weight"
        );
        assert_eq!(
            plain("model.layers.2.post_attention_layernorm.weight"),
            "blk.2.post_attention_norm.weight"
        );
        assert!(matches!(
            map_name("model.layers.1.mlp.experts.gate_up_proj_scales"),
            Some(Mapped::ExpertBlocks { parts, scales: true }) if parts == ["blk.1.ffn_gate_exps", "blk.1.ffn_up_exps"]
        ));
        assert!(map_name("model.layers.x.mlp.router.weight").is_none());
    }

    #[test]
    fn q8_0_blocks_dequantize_exactly() {
        let mut block = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        block.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let values = dequantize_q8_0(&block);
        assert_eq!(values.len(), 32);
        assert_eq!(values[0], -8.0);
        assert_eq!(values[31], 7.5);
    }
}
