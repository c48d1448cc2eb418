//! A GGUF file held in memory, read by the loader's own functions: `GgufFile::from_bytes` (the
//! header, metadata and tensor-table parsing of `GgufFile::open`), `GgufFile::config` (the
//! `gpt-oss.*` keys through the config validation, and the vocabulary check) and `Weights::load`
//! through `GgufSource` (names, types and shapes; expert repacking; F16/Q8_0 widening).
//!
//! The first input byte picks the form of the rest:
//! - even: a valid one-layer gpt-oss GGUF of a small random shape is built, then damaged by a list
//!   of edits (metadata values replaced or dropped, tensors retyped, reshaped, renamed, dropped or
//!   given other offsets, counts and the version replaced, the file truncated or poked). With no
//!   edit it must load and give back the shape it was built with.
//! - odd: the file byte for byte.
//!
//! Invariants: no panic, error messages render, heap under the bound.
#![no_main]

use std::path::Path;

use arbitrary::{Arbitrary, Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use ossterm::model::gguf::{GgufFile, GgufSource};
use ossterm::model::weights::Weights;
use ossterm_fuzz::LimitingAllocator;

/// Built files are under 100 KiB and raw inputs under the 1 MiB `-max_len`; the loader keeps a
/// repacked copy of the experts and widens small tensors to f32.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(64);

const F32: u32 = 0;
const F16: u32 = 1;
const Q8_0: u32 = 8;
const BF16: u32 = 30;
const MXFP4: u32 = 39;

/// (values per block, bytes per block) of the types the builder writes.
fn block(ty: u32) -> (u64, u64) {
    match ty {
        F32 => (1, 4),
        F16 | BF16 => (1, 2),
        Q8_0 => (32, 34),
        MXFP4 => (32, 17),
        _ => (1, 1),
    }
}

enum Val {
    U32(u32),
    F32(f32),
    Str(String),
    Strings(Vec<String>),
    Raw(u32, Vec<u8>),
}

struct Tensor {
    name: String,
    dims: Vec<u64>,
    ty: u32,
    offset: Option<u64>,
}

#[derive(Arbitrary, Debug)]
enum Edit {
    SetU32(u8, u32),
    SetFloat(u8, f32),
    SetText(u8, String),
    RawValue(u8, u32, Vec<u8>),
    DropKey(u8),
    Retype(u8, u32),
    SetDim(u8, u8, u64),
    PushDim(u8, u64),
    Rename(u8, String),
    DropTensor(u8),
    Offset(u8, u64),
    TensorCount(u64),
    KvCount(u64),
    Version(u32),
    Truncate(u32),
    Poke(u32, u8),
}

const KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "gpt-oss.context_length",
    "gpt-oss.embedding_length",
    "gpt-oss.block_count",
    "gpt-oss.attention.head_count",
    "gpt-oss.attention.head_count_kv",
    "gpt-oss.attention.key_length",
    "gpt-oss.attention.value_length",
    "gpt-oss.attention.layer_norm_rms_epsilon",
    "gpt-oss.attention.sliding_window",
    "gpt-oss.attention.sliding_window_pattern",
    "gpt-oss.expert_count",
    "gpt-oss.expert_used_count",
    "gpt-oss.expert_feed_forward_length",
    "gpt-oss.rope.freq_base",
    "gpt-oss.rope.scaling.type",
    "gpt-oss.rope.scaling.factor",
    "gpt-oss.rope.scaling.original_context_length",
    "tokenizer.ggml.tokens",
];

struct Built {
    version: u32,
    kvs: Vec<(String, Val)>,
    tensors: Vec<Tensor>,
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// (hidden, heads, kv heads, head_dim, experts, used, intermediate, vocab)
type Shape = (u64, u64, u64, u64, u64, u64, u64, u64);

fn valid(u: &mut Unstructured<'_>) -> Result<(Built, Shape)> {
    let heads = u.int_in_range(1..=4u64)?;
    let kv_heads = *u.choose(
        &(1..=heads)
            .filter(|d| heads.is_multiple_of(*d))
            .collect::<Vec<_>>(),
    )?;
    let d = 2 * u.int_in_range(1..=8u64)?;
    let e = u.int_in_range(1..=3u64)?;
    let used = u.int_in_range(1..=e)?;
    let (h, i, vocab) = (
        32 * u.int_in_range(1..=2u64)?,
        32u64,
        u.int_in_range(1..=8u64)?,
    );
    let dense = *u.choose(&[BF16, F32, F16, Q8_0])?;
    let k = |s: &str| format!("gpt-oss.{s}");
    let mut b = Built {
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
            (k("expert_used_count"), Val::U32(used as u32)),
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
    };
    let mut tensor = |name: &str, dims: &[u64], ty: u32| {
        b.tensors.push(Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: None,
        })
    };
    let (q, kv) = (heads * d, kv_heads * d);
    tensor("token_embd.weight", &[h, vocab], dense);
    tensor("output.weight", &[h, vocab], dense);
    tensor("output_norm.weight", &[h], F32);
    tensor("blk.0.attn_norm.weight", &[h], F32);
    tensor("blk.0.post_attention_norm.weight", &[h], F32);
    tensor("blk.0.attn_sinks.weight", &[heads], F32);
    for (name, rows, cols) in [
        ("attn_q", q, h),
        ("attn_k", kv, h),
        ("attn_v", kv, h),
        ("attn_output", h, q),
        ("ffn_gate_inp", e, h),
    ] {
        // Q8_0 rows need whole blocks of 32.
        let ty = if dense == Q8_0 && !cols.is_multiple_of(32) {
            BF16
        } else {
            dense
        };
        tensor(&format!("blk.0.{name}.weight"), &[cols, rows], ty);
        tensor(&format!("blk.0.{name}.bias"), &[rows], F32);
    }
    for (name, rows, cols) in [
        ("ffn_gate_exps", i, h),
        ("ffn_up_exps", i, h),
        ("ffn_down_exps", h, i),
    ] {
        tensor(&format!("blk.0.{name}.weight"), &[cols, rows, e], MXFP4);
        tensor(&format!("blk.0.{name}.bias"), &[rows, e], F32);
    }
    Ok((b, (h, heads, kv_heads, d, e, used, i, vocab)))
}

impl Built {
    fn bytes(&self, fill: u8) -> Vec<u8> {
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
        let (mut offset, mut data_len) = (0u64, 0u64);
        for t in &self.tensors {
            string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
            let (per, bytes) = block(t.ty);
            let size = t
                .dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .map_or(0, |n| (n / per).saturating_mul(bytes))
                .min(1 << 20);
            data_len = data_len.max(offset + size);
            offset = (offset + size).div_ceil(32) * 32;
        }
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        // Finite values for every type written (0x3C3C is 1.06 as f16, 0.0115 as bf16; 0x3C a sane E8M0 scale).
        out.resize(out.len() + data_len as usize, fill);
        out
    }
}

fn load(bytes: Vec<u8>) -> std::result::Result<ossterm::model::ModelConfig, String> {
    let file = GgufFile::from_bytes(Path::new("model.gguf"), bytes).map_err(|e| e.to_string())?;
    let config = file.config().map_err(|e| e.to_string())?;
    let source = GgufSource::new(file);
    Weights::load(&config, &source).map_err(|e| e.to_string())?;
    Ok(config)
}

fn built(u: &mut Unstructured<'_>) -> Result<(Vec<u8>, Option<Shape>)> {
    let (mut b, shape) = valid(u)?;
    let fill = *u.choose(&[0x00u8, 0x3C])?;
    let edits: Vec<Edit> = u.arbitrary_iter()?.take(8).collect::<Result<_>>()?;
    let key = |i: u8| KEYS[usize::from(i) % KEYS.len()].to_string();
    let mut file_edits = Vec::new();
    for edit in &edits {
        let n = b.tensors.len().max(1);
        match edit {
            Edit::SetU32(k, v) => set(&mut b, key(*k), Val::U32(*v)),
            Edit::SetFloat(k, v) => set(&mut b, key(*k), Val::F32(*v)),
            Edit::SetText(k, v) => set(&mut b, key(*k), Val::Str(v.clone())),
            Edit::RawValue(k, ty, raw) => set(&mut b, key(*k), Val::Raw(*ty, raw.clone())),
            Edit::DropKey(k) => {
                let k = key(*k);
                b.kvs.retain(|(name, _)| *name != k);
            }
            Edit::Retype(t, ty) => {
                if let Some(t) = b.tensors.get_mut(usize::from(*t) % n) {
                    t.ty = *ty % 48;
                }
            }
            Edit::SetDim(t, d, v) => {
                if let Some(t) = b.tensors.get_mut(usize::from(*t) % n) {
                    let len = t.dims.len();
                    t.dims[usize::from(*d) % len] = *v;
                }
            }
            Edit::PushDim(t, v) => {
                if let Some(t) = b.tensors.get_mut(usize::from(*t) % n) {
                    t.dims.push(*v);
                }
            }
            Edit::Rename(t, name) => {
                if let Some(t) = b.tensors.get_mut(usize::from(*t) % n) {
                    t.name = name.clone();
                }
            }
            Edit::DropTensor(t) => {
                if !b.tensors.is_empty() {
                    b.tensors.remove(usize::from(*t) % n);
                }
            }
            Edit::Offset(t, o) => {
                if let Some(t) = b.tensors.get_mut(usize::from(*t) % n) {
                    t.offset = Some(*o);
                }
            }
            Edit::TensorCount(c) => b.tensor_count = Some(*c),
            Edit::KvCount(c) => b.kv_count = Some(*c),
            Edit::Version(v) => b.version = *v,
            Edit::Truncate(..) | Edit::Poke(..) => file_edits.push(edit),
        }
    }
    let mut bytes = b.bytes(fill);
    for edit in file_edits {
        match edit {
            Edit::Truncate(at) => bytes.truncate(*at as usize % (bytes.len() + 1)),
            Edit::Poke(at, byte) if !bytes.is_empty() => {
                let at = *at as usize % bytes.len();
                bytes[at] = *byte;
            }
            _ => {}
        }
    }
    Ok((bytes, edits.is_empty().then_some(shape)))
}

fn set(b: &mut Built, key: String, val: Val) {
    b.kvs.retain(|(name, _)| *name != key);
    b.kvs.push((key, val));
}

fuzz_target!(|data: &[u8]| {
    let Some((&form, rest)) = data.split_first() else {
        return;
    };
    if form % 2 == 1 {
        let _ = load(rest.to_vec());
        return;
    }
    let Ok((bytes, pristine)) = built(&mut Unstructured::new(rest)) else {
        return;
    };
    let loaded = load(bytes);
    if let Some((h, heads, kv_heads, d, e, used, i, vocab)) = pristine {
        let config = loaded.unwrap_or_else(|error| panic!("a valid GGUF failed to load: {error}"));
        let got = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            config.vocab_size,
        );
        let want = (h, heads, kv_heads, d, e, used, i, vocab);
        let want = (
            want.0 as usize,
            want.1 as usize,
            want.2 as usize,
            want.3 as usize,
            want.4 as usize,
            want.5 as usize,
            want.6 as usize,
            want.7 as usize,
        );
        assert_eq!(got, want, "the GGUF did not load as written");
    }
});
