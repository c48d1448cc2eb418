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
use ossterm::model::gguf_builder::ggml::{BF16, F16, F32, Q8_0};
use ossterm::model::gguf_builder::{GgufBuilder, Shape, Val};
use ossterm::model::weights::Weights;
use ossterm_fuzz::LimitingAllocator;

/// Built files are under 100 KiB and raw inputs under the 1 MiB `-max_len`; the loader keeps a
/// repacked copy of the experts and widens small tensors to f32.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(64);

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

/// A valid one-layer model of a random small shape, its dense matrices in a random type.
fn valid(u: &mut Unstructured<'_>) -> Result<(GgufBuilder, Shape)> {
    let heads = u.int_in_range(1..=4u64)?;
    let kv_heads = *u.choose(
        &(1..=heads)
            .filter(|d| heads.is_multiple_of(*d))
            .collect::<Vec<_>>(),
    )?;
    let experts = u.int_in_range(1..=3u64)?;
    let shape = Shape {
        hidden: 32 * u.int_in_range(1..=2u64)?,
        heads,
        kv_heads,
        head_dim: 2 * u.int_in_range(1..=8u64)?,
        experts,
        experts_used: u.int_in_range(1..=experts)?,
        intermediate: 32,
        vocab: u.int_in_range(1..=8u64)?,
        context: 256,
    };
    let dense = *u.choose(&[BF16, F32, F16, Q8_0])?;
    let mut b = GgufBuilder::model(shape, dense);
    // Gate and up experts as two tensors (the converter's default) or one fused tensor.
    if u.arbitrary()? {
        b.fuse_gate_up();
    }
    // Finite values for every type written (0x3C3C is 1.06 as f16, 0.0115 as bf16; 0x3C a sane
    // E8M0 scale).
    b.fill = *u.choose(&[0x00u8, 0x3C])?;
    // Built files stay under 100 KiB whatever shape an edit claims.
    b.max_tensor_bytes = 1 << 20;
    Ok((b, shape))
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
    let edits: Vec<Edit> = u.arbitrary_iter()?.take(8).collect::<Result<_>>()?;
    let key = |i: u8| KEYS[usize::from(i) % KEYS.len()].to_string();
    let mut file_edits = Vec::new();
    for edit in &edits {
        let n = b.tensors.len().max(1);
        match edit {
            Edit::SetU32(k, v) => b.set(&key(*k), Val::U32(*v)),
            Edit::SetFloat(k, v) => b.set(&key(*k), Val::F32(*v)),
            Edit::SetText(k, v) => b.set(&key(*k), Val::Str(v.clone())),
            Edit::RawValue(k, ty, raw) => b.set(&key(*k), Val::Raw(*ty, raw.clone())),
            Edit::DropKey(k) => b.remove(&key(*k)),
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
    let mut bytes = b.bytes();
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
    if let Some(shape) = pristine {
        let config = loaded.unwrap_or_else(|error| panic!("a valid GGUF failed to load: {error}"));
        let got = [
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            config.vocab_size,
        ];
        let want = [
            shape.hidden,
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.experts,
            shape.experts_used,
            shape.intermediate,
            shape.vocab,
        ]
        .map(|n| n as usize);
        assert_eq!(got, want, "the GGUF did not load as written");
    }
});
