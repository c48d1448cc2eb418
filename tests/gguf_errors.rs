//! Malformed GGUF files give clear errors naming what is wrong, never a panic or an allocation
//! sized by a lying count.

use std::path::{Path, PathBuf};

use ossterm::model::gguf_builder::ggml::{BF16, Q4_0, Q8_0};
use ossterm::model::gguf_builder::{GgufBuilder, Shape, Val};
use ossterm::model::{LoadOptions, Model};

/// A complete one-layer model (zero weights) that loads.
fn valid() -> GgufBuilder {
    GgufBuilder::model(Shape::SMALL, BF16)
}

fn write(b: &GgufBuilder, dir: &Path) -> PathBuf {
    let path = dir.join("model.gguf");
    std::fs::write(&path, b.bytes()).unwrap();
    path
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
fn refused(b: &GgufBuilder, needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(b, dir.path());
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
    let model = load(&write(&valid(), dir.path())).unwrap();
    assert_eq!(model.config.num_local_experts, 2);
    assert_eq!(model.config.vocab_size, 64);
}

#[test]
fn not_gguf_and_bad_versions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, b"PK\x03\x04 a zip file, not a model").unwrap();
    assert!(load_err(&path).contains("not a GGUF file"));
    let mut b = valid();
    b.version = 1;
    refused(&b, &["version 1"]);
    b.version = 3u32.swap_bytes();
    refused(&b, &["big-endian"]);
    b.version = 7;
    refused(&b, &["unknown GGUF version 7"]);
}

#[test]
fn every_truncation_is_refused() {
    let (bytes, header_end) = valid().layout();
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
    let mut b = valid();
    b.tensor_count = Some(u64::MAX);
    refused(&b, &["tensor count", "hold at most"]);
    let mut b = valid();
    b.kv_count = Some(1 << 40);
    refused(&b, &["metadata entry count", "hold at most"]);
    let mut b = valid();
    b.kv_count = Some(b.kvs.len() as u64 + 1);
    refused(&b, &["remain"]);
}

#[test]
fn huge_strings_and_arrays_are_refused() {
    let mut b = valid();
    let mut raw = u64::MAX.to_le_bytes().to_vec();
    raw.extend(b"short");
    b.set("general.name", Val::Raw(8, raw));
    refused(&b, &["general.name", "claims 18446744073709551615 bytes"]);
    let mut b = valid();
    let mut raw = 8u32.to_le_bytes().to_vec();
    raw.extend((1u64 << 60).to_le_bytes());
    b.set("tokenizer.ggml.merges", Val::Raw(9, raw));
    refused(
        &b,
        &["element count of tokenizer.ggml.merges", "hold at most"],
    );
    let mut b = valid();
    let mut raw = 9u32.to_le_bytes().to_vec();
    raw.extend(1u64.to_le_bytes());
    b.set("nested", Val::Raw(9, raw));
    refused(&b, &["nested", "array in an array"]);
}

#[test]
fn unknown_types_are_refused() {
    let mut b = valid();
    b.set("general.something", Val::Raw(13, vec![0; 8]));
    refused(&b, &["general.something", "unknown value type 13"]);
    let mut b = valid();
    b.find("blk.0.attn_q.weight").ty = 77;
    refused(&b, &["blk.0.attn_q.weight", "unknown ggml type 77"]);
    // A known type this loader does not read is named where it is used.
    let mut b = valid();
    b.find("output.weight").ty = Q4_0;
    refused(&b, &["output.weight", "Q4_0"]);
    let mut b = valid();
    b.find("blk.0.ffn_up_exps.weight").ty = Q8_0;
    refused(&b, &["blk.0.ffn_up_exps.weight", "MXFP4", "Q8_0"]);
}

#[test]
fn lying_offsets_and_misaligned_data_are_refused() {
    let mut b = valid();
    b.find("blk.0.ffn_down_exps.weight").offset = Some(1 << 40);
    refused(&b, &["blk.0.ffn_down_exps.weight", "past the end"]);
    let mut b = valid();
    b.find("blk.0.attn_k.weight").offset = Some(u64::MAX - 31);
    refused(&b, &["blk.0.attn_k.weight"]);
    let mut b = valid();
    b.find("blk.0.attn_v.weight").offset = Some(8);
    refused(
        &b,
        &[
            "blk.0.attn_v.weight",
            "not a multiple of the file's alignment 32",
        ],
    );
    let mut b = valid();
    b.find("output.weight").offset = Some(0);
    refused(&b, &["overlap"]);
    let mut b = valid();
    b.set("general.alignment", Val::U32(24));
    refused(&b, &["general.alignment", "power of two"]);
    let mut b = valid();
    b.find("blk.0.attn_q.weight").dims = vec![32, 0];
    refused(&b, &["blk.0.attn_q.weight", "dimension 1 = 0"]);
    let mut b = valid();
    b.find("blk.0.attn_q.weight").dims = vec![1, 1, 1, 1, 1];
    refused(&b, &["blk.0.attn_q.weight", "5 dimensions"]);
    let mut b = valid();
    b.find("blk.0.attn_q.weight").dims = vec![u64::MAX / 2, 4];
    refused(&b, &["blk.0.attn_q.weight"]);
    let mut b = valid();
    b.find("blk.0.ffn_gate_exps.weight").dims = vec![31, 32, 2];
    refused(&b, &["blk.0.ffn_gate_exps.weight", "blocks of 32"]);
}

#[test]
fn fused_gate_up_experts_load_and_lying_ones_are_refused() {
    let mut b = valid();
    b.fuse_gate_up();
    let dir = tempfile::tempdir().unwrap();
    let model = load(&write(&b, dir.path())).unwrap();
    assert_eq!(model.config.intermediate_size, 32);
    // Rows that are not gate and up of the configured width.
    let mut b = valid();
    b.fuse_gate_up();
    b.find("blk.0.ffn_gate_up_exps.weight").dims = vec![32, 48, 2];
    refused(&b, &["blk.0.ffn_gate_up_exps.weight", "shape"]);
    let mut b = valid();
    b.fuse_gate_up();
    b.find("blk.0.ffn_gate_up_exps.weight").dims = vec![32, 33, 2];
    refused(&b, &["blk.0.ffn_gate_up_exps.weight", "even"]);
    let mut b = valid();
    b.fuse_gate_up();
    b.find("blk.0.ffn_gate_up_exps.weight").ty = BF16;
    refused(&b, &["blk.0.ffn_gate_up_exps.weight", "MXFP4"]);
    let mut b = valid();
    b.fuse_gate_up();
    b.find("blk.0.ffn_gate_up_exps.bias").dims = vec![32, 2];
    refused(&b, &["blk.0.ffn_gate_up_exps.bias", "shape"]);
    // Neither form present: the separate tensors are the ones named missing.
    let mut b = valid();
    b.tensors.retain(|t| !t.name.contains("ffn_gate_exps"));
    refused(&b, &["blk.0.ffn_gate_exps.weight", "missing"]);
}

#[test]
fn wrong_model_and_missing_keys_are_named() {
    let mut b = valid();
    b.set("general.architecture", Val::Str("llama".into()));
    refused(&b, &["general.architecture", "\"llama\"", "gpt-oss"]);
    let mut b = valid();
    b.remove("gpt-oss.block_count");
    refused(&b, &["gpt-oss.block_count", "missing"]);
    let mut b = valid();
    b.set("gpt-oss.block_count", Val::U32(u32::MAX));
    refused(&b, &["gpt-oss.block_count", "4294967295 layers"]);
    let mut b = valid();
    b.set("gpt-oss.rope.scaling.type", Val::Str("linear".into()));
    refused(&b, &["gpt-oss.rope.scaling.type", "linear"]);
    let mut b = valid();
    b.set("gpt-oss.attention.head_count_kv", Val::U32(3));
    refused(
        &b,
        &["gpt-oss.attention.head_count_kv", "cannot be grouped"],
    );
    let mut b = valid();
    b.set("gpt-oss.embedding_length", Val::Str("32".into()));
    refused(&b, &["gpt-oss.embedding_length", "integer"]);
    let mut b = valid();
    b.tensors.retain(|t| t.name != "blk.0.attn_sinks.weight");
    refused(&b, &["blk.0.attn_sinks.weight", "missing"]);
    let mut b = valid();
    b.find("blk.0.attn_q.weight").dims = vec![32, 16];
    refused(&b, &["blk.0.attn_q.weight", "shape"]);
}

#[test]
fn a_vocabulary_other_than_o200k_harmony_is_refused() {
    let mut b = valid();
    b.remove("tokenizer.ggml.tokens");
    refused(&b, &["tokenizer.ggml.tokens", "missing"]);
    let mut b = valid();
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
    let mut b = valid();
    b.set("tokenizer.ggml.tokens", Val::Strings(names(true)));
    b.find("token_embd.weight").dims = vec![32, vocab];
    b.find("output.weight").dims = vec![32, vocab];
    refused(
        &b,
        &["token 200006", "<|im_start|>", "<|start|>", "not gpt-oss"],
    );
    b.set("tokenizer.ggml.tokens", Val::Strings(names(false)));
    let dir = tempfile::tempdir().unwrap();
    let config = ossterm::model::gguf::GgufFile::open(&write(&b, dir.path()))
        .unwrap()
        .config()
        .unwrap();
    assert_eq!(config.vocab_size, vocab as usize);
}
