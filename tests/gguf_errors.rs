//! Malformed GGUF files give clear errors naming what is wrong, never a panic or an allocation
//! sized by a lying count.

use std::path::{Path, PathBuf};

use ossterm::model::{LoadOptions, Model};

const F32: u32 = 0;
const Q8_0: u32 = 8;
const Q4_0: u32 = 2;
const BF16: u32 = 30;
const MXFP4: u32 = 39;

/// (values per block, bytes per block) of the types these tests write.
fn block(ty: u32) -> (usize, usize) {
    match ty {
        F32 => (1, 4),
        BF16 => (1, 2),
        Q8_0 => (32, 34),
        Q4_0 => (32, 18),
        MXFP4 => (32, 17),
        _ => (1, 1),
    }
}

enum Val {
    U32(u32),
    F32(f32),
    Str(String),
    Strings(Vec<String>),
    /// Raw bytes after the type id (for lies).
    Raw(u32, Vec<u8>),
}

struct Tensor {
    name: String,
    /// ggml order (innermost first).
    dims: Vec<u64>,
    ty: u32,
    /// Data offset to write instead of the computed one.
    offset: Option<u64>,
}

/// Writes GGUF files field by field, so every field can be made to lie.
struct Builder {
    version: u32,
    kvs: Vec<(String, Val)>,
    tensors: Vec<Tensor>,
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
    alignment: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Builder {
    /// A complete one-layer gpt-oss model (zero weights) that loads.
    fn valid() -> Builder {
        let (h, heads, kv_heads, d, e, i, vocab) = (32u64, 2u64, 1u64, 16u64, 2u64, 32u64, 64u64);
        let k = |s: &str| format!("gpt-oss.{s}");
        let mut b = Builder {
            version: 3,
            kvs: vec![
                ("general.architecture".into(), Val::Str("gpt-oss".into())),
                (k("context_length"), Val::U32(256)),
                (k("embedding_length"), Val::U32(h as u32)),
                (k("block_count"), Val::U32(1)),
                (k("attention.head_count"), Val::U32(heads as u32)),
                (k("attention.head_count_kv"), Val::U32(kv_heads as u32)),
                (k("attention.key_length"), Val::U32(d as u32)),
                (k("attention.value_length"), Val::U32(d as u32)),
                (k("attention.layer_norm_rms_epsilon"), Val::F32(1e-5)),
                (k("attention.sliding_window"), Val::U32(8)),
                (k("expert_count"), Val::U32(e as u32)),
                (k("expert_used_count"), Val::U32(1)),
                (k("expert_feed_forward_length"), Val::U32(i as u32)),
                (k("rope.freq_base"), Val::F32(150000.0)),
                (k("rope.scaling.type"), Val::Str("yarn".into())),
                (k("rope.scaling.factor"), Val::F32(4.0)),
                (k("rope.scaling.original_context_length"), Val::U32(64)),
                (
                    "tokenizer.ggml.tokens".into(),
                    Val::Strings((0..vocab).map(|t| format!("t{t}")).collect()),
                ),
            ],
            tensors: Vec::new(),
            tensor_count: None,
            kv_count: None,
            alignment: 32,
        };
        let (q, kv) = (heads * d, kv_heads * d);
        b.tensor("token_embd.weight", &[h, vocab], BF16);
        b.tensor("output.weight", &[h, vocab], BF16);
        b.tensor("output_norm.weight", &[h], F32);
        b.tensor("blk.0.attn_norm.weight", &[h], F32);
        b.tensor("blk.0.post_attention_norm.weight", &[h], F32);
        b.tensor("blk.0.attn_sinks.weight", &[heads], F32);
        for (name, rows, cols) in [
            ("attn_q", q, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, q),
            ("ffn_gate_inp", e, h),
        ] {
            b.tensor(&format!("blk.0.{name}.weight"), &[cols, rows], BF16);
            b.tensor(&format!("blk.0.{name}.bias"), &[rows], F32);
        }
        for (name, rows, cols) in [
            ("ffn_gate_exps", i, h),
            ("ffn_up_exps", i, h),
            ("ffn_down_exps", h, i),
        ] {
            b.tensor(&format!("blk.0.{name}.weight"), &[cols, rows, e], MXFP4);
            b.tensor(&format!("blk.0.{name}.bias"), &[rows, e], F32);
        }
        b
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32) {
        self.tensors.push(Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: None,
        });
    }

    fn set(&mut self, key: &str, val: Val) {
        self.kvs.retain(|(k, _)| k != key);
        self.kvs.push((key.into(), val));
    }

    fn remove(&mut self, key: &str) {
        self.kvs.retain(|(k, _)| k != key);
    }

    fn find(&mut self, name: &str) -> &mut Tensor {
        self.tensors.iter_mut().find(|t| t.name == name).unwrap()
    }

    fn bytes(&self) -> Vec<u8> {
        self.layout().0
    }

    /// The file and the length of its header (everything before the tensor data).
    fn layout(&self) -> (Vec<u8>, usize) {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend(
            self.tensor_count
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        out.extend(self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (key, val) in &self.kvs {
            string(&mut out, key);
            match val {
                Val::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Val::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Val::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Val::Strings(items) => {
                    out.extend(9u32.to_le_bytes());
                    out.extend(8u32.to_le_bytes());
                    out.extend((items.len() as u64).to_le_bytes());
                    for s in items {
                        string(&mut out, s);
                    }
                }
                Val::Raw(ty, raw) => {
                    out.extend(ty.to_le_bytes());
                    out.extend(raw);
                }
            }
        }
        let mut offset = 0u64;
        let mut data_len = 0u64;
        for t in &self.tensors {
            string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
            let (per, bytes) = block(t.ty);
            let size = t.dims.iter().product::<u64>() / per as u64 * bytes as u64;
            data_len = data_len.max(offset + size);
            offset = (offset + size).div_ceil(self.alignment) * self.alignment;
        }
        while !(out.len() as u64).is_multiple_of(self.alignment) {
            out.push(0);
        }
        let header_len = out.len();
        out.resize(out.len() + data_len as usize, 0);
        (out, header_len)
    }

    fn write(&self, dir: &Path) -> PathBuf {
        let path = dir.join("model.gguf");
        std::fs::write(&path, self.bytes()).unwrap();
        path
    }
}

fn load(path: &Path) -> Result<Model, String> {
    Model::load(path, &LoadOptions::default()).map_err(|e| e.to_string())
}

fn load_err(path: &Path) -> String {
    match load(path) {
        Ok(_) => panic!("{} loaded, but it is broken", path.display()),
        Err(message) => message,
    }
}

/// Writes `b` and loads it, expecting an error containing every one of `needles`.
fn refused(b: &Builder, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let path = b.write(dir.path());
    let message = match load(&path) {
        Ok(_) => panic!("the broken file loaded (expected {needles:?})"),
        Err(message) => message,
    };
    for needle in needles {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    assert!(
        message.contains("model.gguf") || message.contains("tensor"),
        "{message}"
    );
}

#[test]
fn the_valid_builder_file_loads() {
    let dir = tempfile::tempdir().unwrap();
    let model = load(&Builder::valid().write(dir.path())).unwrap();
    assert_eq!(model.config.num_local_experts, 2);
    assert_eq!(model.config.vocab_size, 64);
}

#[test]
fn not_gguf_and_bad_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, b"PK\x03\x04 a zip file, not a model").unwrap();
    assert!(load_err(&path).contains("not a GGUF file"));
    let mut b = Builder::valid();
    b.version = 1;
    refused(&b, &["version 1"]);
    b.version = 3u32.swap_bytes();
    refused(&b, &["big-endian"]);
    b.version = 7;
    refused(&b, &["unknown GGUF version 7"]);
}

#[test]
fn every_truncation_is_refused() {
    let (bytes, header_end) = Builder::valid().layout();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    // Every cut inside the header, and a few inside the data.
    let cuts = (0..header_end).chain((header_end..bytes.len()).step_by(97));
    for cut in cuts {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let message = load_err(&path);
        assert!(
            message.contains("truncated")
                || message.contains("ends inside")
                || message.contains("remain")
                || message.contains("hold at most")
                || message.contains("not a GGUF"),
            "cut at {cut}: {message}"
        );
    }
}

#[test]
fn lying_counts_are_refused_before_allocating() {
    let mut b = Builder::valid();
    b.tensor_count = Some(u64::MAX);
    refused(&b, &["tensor count", "hold at most"]);
    let mut b = Builder::valid();
    b.kv_count = Some(1 << 40);
    refused(&b, &["metadata entry count", "hold at most"]);
    let mut b = Builder::valid();
    b.kv_count = Some(b.kvs.len() as u64 + 1);
    refused(&b, &["remain"]);
}

#[test]
fn huge_strings_and_arrays_are_refused() {
    let mut b = Builder::valid();
    let mut raw = u64::MAX.to_le_bytes().to_vec();
    raw.extend(b"short");
    b.set("general.name", Val::Raw(8, raw));
    refused(&b, &["general.name", "claims 18446744073709551615 bytes"]);
    let mut b = Builder::valid();
    let mut raw = 8u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 60).to_le_bytes());
    b.set("tokenizer.ggml.merges", Val::Raw(9, raw));
    refused(
        &b,
        &["element count of tokenizer.ggml.merges", "hold at most"],
    );
    let mut b = Builder::valid();
    let mut raw = 9u32.to_le_bytes().to_vec();
    raw.extend(1u64.to_le_bytes());
    b.set("nested", Val::Raw(9, raw));
    refused(&b, &["nested", "array in an array"]);
}

#[test]
fn unknown_types_are_refused() {
    let mut b = Builder::valid();
    b.set("general.something", Val::Raw(13, vec![0; 8]));
    refused(&b, &["general.something", "unknown value type 13"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_q.weight").ty = 77;
    refused(&b, &["blk.0.attn_q.weight", "unknown ggml type 77"]);
    // A known type this loader does not read is named where it is used.
    let mut b = Builder::valid();
    b.find("output.weight").ty = Q4_0;
    refused(&b, &["output.weight", "Q4_0"]);
    let mut b = Builder::valid();
    b.find("blk.0.ffn_up_exps.weight").ty = Q8_0;
    refused(&b, &["blk.0.ffn_up_exps.weight", "MXFP4", "Q8_0"]);
}

#[test]
fn lying_offsets_and_misaligned_data_are_refused() {
    let mut b = Builder::valid();
    b.find("blk.0.ffn_down_exps.weight").offset = Some(1 << 40);
    refused(&b, &["blk.0.ffn_down_exps.weight", "past the end"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_k.weight").offset = Some(u64::MAX - 31);
    refused(&b, &["blk.0.attn_k.weight"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_v.weight").offset = Some(8);
    refused(
        &b,
        &[
            "blk.0.attn_v.weight",
            "not a multiple of the file's alignment 32",
        ],
    );
    let mut b = Builder::valid();
    b.find("output.weight").offset = Some(0);
    refused(&b, &["overlap"]);
    let mut b = Builder::valid();
    b.set("general.alignment", Val::U32(24));
    refused(&b, &["general.alignment", "power of two"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_q.weight").dims = vec![32, 0];
    refused(&b, &["blk.0.attn_q.weight", "dimension 1 = 0"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_q.weight").dims = vec![1, 1, 1, 1, 1];
    refused(&b, &["blk.0.attn_q.weight", "5 dimensions"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_q.weight").dims = vec![u64::MAX / 2, 4];
    refused(&b, &["blk.0.attn_q.weight"]);
    let mut b = Builder::valid();
    b.find("blk.0.ffn_gate_exps.weight").dims = vec![31, 32, 2];
    refused(&b, &["blk.0.ffn_gate_exps.weight", "blocks of 32"]);
}

#[test]
fn wrong_model_and_missing_keys_are_named() {
    let mut b = Builder::valid();
    b.set("general.architecture", Val::Str("llama".into()));
    refused(&b, &["general.architecture", "\"llama\"", "gpt-oss"]);
    let mut b = Builder::valid();
    b.remove("gpt-oss.block_count");
    refused(&b, &["gpt-oss.block_count", "missing"]);
    let mut b = Builder::valid();
    b.set("gpt-oss.block_count", Val::U32(u32::MAX));
    refused(&b, &["gpt-oss.block_count", "4294967295 layers"]);
    let mut b = Builder::valid();
    b.set("gpt-oss.rope.scaling.type", Val::Str("linear".into()));
    refused(&b, &["gpt-oss.rope.scaling.type", "linear"]);
    let mut b = Builder::valid();
    b.set("gpt-oss.attention.head_count_kv", Val::U32(3));
    refused(
        &b,
        &["gpt-oss.attention.head_count_kv", "cannot be grouped"],
    );
    let mut b = Builder::valid();
    b.set("gpt-oss.embedding_length", Val::Str("32".into()));
    refused(&b, &["gpt-oss.embedding_length", "integer"]);
    let mut b = Builder::valid();
    b.tensors.retain(|t| t.name != "blk.0.attn_sinks.weight");
    refused(&b, &["blk.0.attn_sinks.weight", "missing"]);
    let mut b = Builder::valid();
    b.find("blk.0.attn_q.weight").dims = vec![32, 16];
    refused(&b, &["blk.0.attn_q.weight", "shape"]);
}

#[test]
fn a_vocabulary_other_than_o200k_harmony_is_refused() {
    let mut b = Builder::valid();
    b.remove("tokenizer.ggml.tokens");
    refused(&b, &["tokenizer.ggml.tokens", "missing"]);
    let mut b = Builder::valid();
    b.set(
        "tokenizer.ggml.tokens",
        Val::Strings((0..63).map(|t| t.to_string()).collect()),
    );
    refused(&b, &["63 tokens", "64 rows"]);

    // A full-size vocabulary with another tokenizer's token where <|start|> belongs.
    let vocab = 200013u64;
    let names = |bad: bool| -> Vec<String> {
        (0..vocab)
            .map(|t| match t {
                199998 => "<|startoftext|>".into(),
                199999 => "<|endoftext|>".into(),
                200002 => "<|return|>".into(),
                200003 => "<|constrain|>".into(),
                200005 => "<|channel|>".into(),
                200006 if bad => "<|im_start|>".into(),
                200006 => "<|start|>".into(),
                200007 => "<|end|>".into(),
                200008 => "<|message|>".into(),
                200012 => "<|call|>".into(),
                _ => format!("t{t}"),
            })
            .collect()
    };
    let mut b = Builder::valid();
    b.set("tokenizer.ggml.tokens", Val::Strings(names(true)));
    b.find("token_embd.weight").dims = vec![32, vocab];
    b.find("output.weight").dims = vec![32, vocab];
    refused(
        &b,
        &["token 200006", "<|im_start|>", "<|start|>", "not gpt-oss"],
    );
    b.set("tokenizer.ggml.tokens", Val::Strings(names(false)));
    let dir = tempfile::tempdir().unwrap();
    let config = ossterm::model::gguf::GgufFile::open(&b.write(dir.path()))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(config.vocab_size, vocab as usize);
}
