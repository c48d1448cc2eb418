//! Writes gpt-oss GGUF files field by field, so every field can be made to lie: the malformed-GGUF
//! tests and the GGUF fuzz target build their files with it. Not part of the loader.

/// ggml tensor type ids the builder writes.
pub mod ggml {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q4_0: u32 = 2;
    pub const Q8_0: u32 = 8;
    pub const BF16: u32 = 30;
    pub const MXFP4: u32 = 39;
}

/// (values per block, bytes per block) of the types the builder writes; 1 byte for others.
fn block(ty: u32) -> (u64, u64) {
    match ty {
        ggml::F32 => (1, 4),
        ggml::F16 | ggml::BF16 => (1, 2),
        ggml::Q8_0 => (32, 34),
        ggml::Q4_0 => (32, 18),
        ggml::MXFP4 => (32, 17),
        _ => (1, 1),
    }
}

/// A metadata value.
pub enum Val {
    U32(u32),
    F32(f32),
    Str(String),
    Strings(Vec<String>),
    /// Raw bytes after the type id (for lies).
    Raw(u32, Vec<u8>),
}

pub struct Tensor {
    pub name: String,
    /// ggml order (innermost first).
    pub dims: Vec<u64>,
    pub ty: u32,
    /// Data offset to write instead of the computed one.
    pub offset: Option<u64>,
}

/// A one-layer model's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub experts: u64,
    pub experts_used: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub context: u32,
}

impl Shape {
    /// Two heads sharing one KV head, two experts, 64 tokens, 256 positions.
    pub const SMALL: Shape = Shape {
        hidden: 32,
        heads: 2,
        kv_heads: 1,
        head_dim: 16,
        experts: 2,
        experts_used: 1,
        intermediate: 32,
        vocab: 64,
        context: 256,
    };
}

pub struct GgufBuilder {
    pub version: u32,
    pub kvs: Vec<(String, Val)>,
    pub tensors: Vec<Tensor>,
    /// Counts to write instead of the true ones.
    pub tensor_count: Option<u64>,
    pub kv_count: Option<u64>,
    pub alignment: u64,
    /// The byte every tensor's data is filled with.
    pub fill: u8,
    /// Data bytes written at most per tensor (a fuzzed shape can claim exabytes).
    pub max_tensor_bytes: u64,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl GgufBuilder {
    /// A complete one-layer gpt-oss model of `shape` that loads: dense matrices in `dense` (those
    /// whose rows are not whole blocks of 32 stay BF16 when `dense` is Q8_0), experts MXFP4,
    /// vectors F32; data all zero until [`GgufBuilder::fill`] says otherwise.
    pub fn model(shape: Shape, dense: u32) -> GgufBuilder {
        let Shape {
            hidden: h,
            heads,
            kv_heads,
            head_dim: d,
            experts: e,
            experts_used,
            intermediate: i,
            vocab,
            context,
        } = shape;
        let k = |s: &str| format!("gpt-oss.{s}");
        let mut b = GgufBuilder {
            version: 3,
            kvs: vec![
                ("general.architecture".into(), Val::Str("gpt-oss".into())),
                (k("context_length"), Val::U32(context)),
                (k("embedding_length"), Val::U32(h as u32)),
                (k("block_count"), Val::U32(1)),
                (k("attention.head_count"), Val::U32(heads as u32)),
                (k("attention.head_count_kv"), Val::U32(kv_heads as u32)),
                (k("attention.key_length"), Val::U32(d as u32)),
                (k("attention.value_length"), Val::U32(d as u32)),
                (k("attention.layer_norm_rms_epsilon"), Val::F32(1e-5)),
                (k("attention.sliding_window"), Val::U32(8)),
                (k("expert_count"), Val::U32(e as u32)),
                (k("expert_used_count"), Val::U32(experts_used as u32)),
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
            fill: 0,
            max_tensor_bytes: u64::MAX,
        };
        let (q, kv) = (heads * d, kv_heads * d);
        let matrix = |cols: u64| {
            if dense == ggml::Q8_0 && !cols.is_multiple_of(32) {
                ggml::BF16
            } else {
                dense
            }
        };
        b.tensor("token_embd.weight", &[h, vocab], matrix(h));
        b.tensor("output.weight", &[h, vocab], matrix(h));
        b.tensor("output_norm.weight", &[h], ggml::F32);
        b.tensor("blk.0.attn_norm.weight", &[h], ggml::F32);
        b.tensor("blk.0.post_attention_norm.weight", &[h], ggml::F32);
        b.tensor("blk.0.attn_sinks.weight", &[heads], ggml::F32);
        for (name, rows, cols) in [
            ("attn_q", q, h),
            ("attn_k", kv, h),
            ("attn_v", kv, h),
            ("attn_output", h, q),
            ("ffn_gate_inp", e, h),
        ] {
            b.tensor(&format!("blk.0.{name}.weight"), &[cols, rows], matrix(cols));
            b.tensor(&format!("blk.0.{name}.bias"), &[rows], ggml::F32);
        }
        for (name, rows, cols) in [
            ("ffn_gate_exps", i, h),
            ("ffn_up_exps", i, h),
            ("ffn_down_exps", h, i),
        ] {
            b.tensor(
                &format!("blk.0.{name}.weight"),
                &[cols, rows, e],
                ggml::MXFP4,
            );
            b.tensor(&format!("blk.0.{name}.bias"), &[rows, e], ggml::F32);
        }
        b
    }

    /// Replaces each layer's `ffn_gate_exps` and `ffn_up_exps` (weights and biases) by one
    /// `ffn_gate_up_exps` holding both (gate rows, then up rows, per expert), as llama.cpp's
    /// converter writes them with `--fuse-gate-up-exps`.
    pub fn fuse_gate_up(&mut self) {
        let mut fused = Vec::new();
        for t in &self.tensors {
            if let Some(prefix) = t.name.strip_suffix("ffn_gate_exps.weight") {
                let mut dims = t.dims.clone();
                dims[1] *= 2;
                fused.push((format!("{prefix}ffn_gate_up_exps.weight"), dims, t.ty));
            } else if let Some(prefix) = t.name.strip_suffix("ffn_gate_exps.bias") {
                let mut dims = t.dims.clone();
                dims[0] *= 2;
                fused.push((format!("{prefix}ffn_gate_up_exps.bias"), dims, t.ty));
            }
        }
        self.tensors
            .retain(|t| !t.name.contains("ffn_gate_exps") && !t.name.contains("ffn_up_exps"));
        for (name, dims, ty) in fused {
            self.tensor(&name, &dims, ty);
        }
    }

    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32) {
        self.tensors.push(Tensor {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
            offset: None,
        });
    }

    /// Sets `key` (moved to the end of the metadata).
    pub fn set(&mut self, key: &str, val: Val) {
        self.remove(key);
        self.kvs.push((key.into(), val));
    }

    pub fn remove(&mut self, key: &str) {
        self.kvs.retain(|(k, _)| k != key);
    }

    /// The tensor `name`; panics if there is none (a mistake in the caller).
    pub fn find(&mut self, name: &str) -> &mut Tensor {
        self.tensors
            .iter_mut()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("the builder has no tensor {name}"))
    }

    /// Each tensor's computed data offset and byte size, and the length of the data section.
    fn placements(&self) -> (Vec<(u64, u64)>, u64) {
        let alignment = self.alignment.max(1);
        let (mut offset, mut data_len) = (0u64, 0u64);
        let mut placements = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let (per, bytes) = block(t.ty);
            let size = t
                .dims
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d))
                .map_or(0, |n| (n / per).saturating_mul(bytes))
                .min(self.max_tensor_bytes);
            placements.push((offset, size));
            data_len = data_len.max(offset + size);
            offset = (offset + size).div_ceil(alignment) * alignment;
        }
        (placements, data_len)
    }

    /// Where tensor `name`'s data starts in [`GgufBuilder::bytes`] (at its computed offset).
    pub fn data_start(&self, name: &str) -> Option<usize> {
        let index = self.tensors.iter().position(|t| t.name == name)?;
        let header_len = self.layout().1;
        Some(header_len + self.placements().0[index].0 as usize)
    }

    pub fn bytes(&self) -> Vec<u8> {
        self.layout().0
    }

    /// The file and the length of its header (everything before the tensor data).
    pub fn layout(&self) -> (Vec<u8>, usize) {
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
        let alignment = self.alignment.max(1);
        let (placements, data_len) = self.placements();
        for (t, &(offset, _)) in self.tensors.iter().zip(&placements) {
            string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.to_le_bytes());
            out.extend(t.offset.unwrap_or(offset).to_le_bytes());
        }
        while !(out.len() as u64).is_multiple_of(alignment) {
            out.push(0);
        }
        let header_len = out.len();
        out.resize(out.len() + data_len as usize, self.fill);
        (out, header_len)
    }
}
