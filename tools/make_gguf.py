#!/usr/bin/env python3
"""Write gpt-oss GGUF files from Hugging Face checkpoints, laid out as llama.cpp's converter
(convert_hf_to_gguf.py, class GptOssModel) writes them.

    python3 tools/make_gguf.py --fixtures            # tests/fixtures/gguf/*.gguf from the golden cases
    python3 tools/make_gguf.py --checkpoint DIR --out FILE.gguf [--dense bf16|q8_0] [--fuse-gate-up]

The script installs its dependencies (the `gguf` package from PyPI, numpy) into a venv of its own
($OSSTERM_GGUF_VENV, default ~/.cache/ossterm-gguf-venv) and re-runs itself there.

Layout (the converter's, checked against its source): tensor names token_embd, output_norm, output,
blk.N.{attn_norm, post_attention_norm, attn_q, attn_k, attn_v, attn_output, attn_sinks, ffn_gate_inp,
ffn_gate_exps, ffn_up_exps, ffn_down_exps}; HF's interleaved gate_up rows (gate even, up odd) split into
ffn_gate_exps / ffn_up_exps, or with --fuse-gate-up one ffn_gate_up_exps (each expert's gate rows, then
its up rows: the converter's --fuse-gate-up-exps); MXFP4 experts as 17-byte blocks (E8M0 scale, then 16
bytes whose low nibbles are values 0..15 and high nibbles values 16..31); 1-D tensors and biases F32;
metadata gpt-oss.*. The vocabulary is o200k_harmony as a byte-level BPE vocabulary (tokens, token types,
merges, pre-tokenizer "gpt-4o", special ids), read from the o200k_base.tiktoken that the tiktoken-rs crate
embeds, so llama.cpp-family programs load the files; a fixture's small vocabulary is o200k's first ids.
Tensors are streamed to the file one at a time, so a 13 GB checkpoint converts in little memory.
"""

import argparse
import json
import os
import struct
import subprocess
import sys

VENV = os.environ.get(
    "OSSTERM_GGUF_VENV", os.path.join(os.path.expanduser("~"), ".cache", "ossterm-gguf-venv")
)
REQUIREMENTS = ["gguf==0.19.0", "numpy"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ensure_venv():
    if os.path.realpath(sys.prefix) == os.path.realpath(VENV):
        return
    python = os.path.join(VENV, "bin", "python")
    if not os.path.exists(python):
        subprocess.check_call([sys.executable, "-m", "venv", VENV])
        subprocess.check_call([python, "-m", "pip", "install", "-q", *REQUIREMENTS])
    os.execv(python, [python, os.path.abspath(__file__), *sys.argv[1:]])


ensure_venv()

import numpy as np  # noqa: E402
import gguf  # noqa: E402

ARCH = "gpt-oss"


class Checkpoint:
    """safetensors shards read with numpy memmaps (numpy has no bfloat16: BF16 comes back as uint16)."""

    DTYPES = {"BF16": np.uint16, "F32": np.float32, "F16": np.float16, "U8": np.uint8}

    def __init__(self, directory):
        self.dir = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            files = sorted(set(json.load(open(index))["weight_map"].values()))
        else:
            files = ["model.safetensors"]
        self.tensors = {}
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                start, end = info["data_offsets"]
                self.tensors[tensor] = (path, 8 + length + start, end - start, info["dtype"], info["shape"])
        self.config = json.load(open(os.path.join(directory, "config.json")))

    def get(self, name):
        path, offset, nbytes, dtype, shape = self.tensors[name]
        count = nbytes // np.dtype(self.DTYPES[dtype]).itemsize
        data = np.memmap(path, dtype=self.DTYPES[dtype], mode="r", offset=offset, shape=(count,))
        return dtype, data.reshape(shape)


def to_f32(dtype, data):
    if dtype == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def mxfp4_to_ggml(blocks, scales):
    """HF blocks [E, R, NB, 16] (byte j: value 2j low, 2j+1 high) + scales [E, R, NB] -> ggml
    [E, R, NB * 17] (scale byte, then byte i: value i low, i + 16 high)."""
    values = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    values[..., 0::2] = blocks & 0x0F
    values[..., 1::2] = blocks >> 4
    codes = values[..., :16] | (values[..., 16:] << 4)
    packed = np.concatenate([scales[..., None], codes], axis=-1)
    return np.ascontiguousarray(packed.reshape(packed.shape[0], packed.shape[1], -1))


def plan(ck, dense, fuse=False):
    """(gguf name, shape maker, data maker) for every tensor, in the converter's order. The shape
    maker reads only the safetensors header, so the file's header can be written before any data."""
    c = ck.config
    layers = c["num_hidden_layers"]
    out = []
    Q8_0, BF16, MXFP4 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.BF16,
                         gguf.GGMLQuantizationType.MXFP4)

    def shape_of(hf):
        return list(ck.tensors[hf][4])

    def matrix(hf):
        def info():
            rows, cols = shape_of(hf)
            if dense == "q8_0":
                return (rows, cols // 32 * 34), np.uint8, rows * cols // 32 * 34, Q8_0
            return (rows, cols * 2), np.uint8, rows * cols * 2, BF16

        def make():
            dtype, data = ck.get(hf)
            if dense == "q8_0":
                return gguf.quants.quantize(to_f32(dtype, data), Q8_0)
            assert dtype == "BF16", f"{hf} is {dtype}"
            return np.ascontiguousarray(data).view(np.uint8).reshape(data.shape[0], -1)
        return info, make

    def f32(hf, half=None):
        def info():
            shape = shape_of(hf)
            if half in (0, 1):
                shape[-1] //= 2
            return tuple(shape), np.float32, 4 * int(np.prod(shape)), None

        def make():
            dtype, data = ck.get(hf)
            data = to_f32(dtype, np.asarray(data))
            if half == "fused":
                data = np.concatenate([data[..., 0::2], data[..., 1::2]], axis=-1)
            elif half is not None:
                data = data[..., half::2]
            return np.ascontiguousarray(data)
        return info, make

    def experts(prefix, half=None):
        """half 0/1: the gate/up rows of HF's interleaved gate_up; "fused": gate rows then up rows
        of each expert in one tensor (the converter's --fuse-gate-up-exps)."""
        def info():
            e, rows, nb, _ = shape_of(prefix + "_blocks")
            if half in (0, 1):
                rows //= 2
            return (e, rows, nb * 17), np.uint8, e * rows * nb * 17, MXFP4

        def make():
            _, blocks = ck.get(prefix + "_blocks")
            _, scales = ck.get(prefix + "_scales")
            if half == "fused":
                gate = mxfp4_to_ggml(np.asarray(blocks[:, 0::2]), np.asarray(scales[:, 0::2]))
                up = mxfp4_to_ggml(np.asarray(blocks[:, 1::2]), np.asarray(scales[:, 1::2]))
                return np.ascontiguousarray(np.concatenate([gate, up], axis=1))
            if half is not None:
                blocks, scales = blocks[:, half::2], scales[:, half::2]
            return mxfp4_to_ggml(np.asarray(blocks), np.asarray(scales))
        return info, make

    out.append(("token_embd.weight", *matrix("model.embed_tokens.weight")))
    for l in range(layers):
        p = f"model.layers.{l}."
        b = f"blk.{l}."
        out += [
            (b + "attn_norm.weight", *f32(p + "input_layernorm.weight")),
            (b + "post_attention_norm.weight", *f32(p + "post_attention_layernorm.weight")),
            (b + "attn_sinks.weight", *f32(p + "self_attn.sinks")),
        ]
        for hf, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
            out += [
                (b + g + ".weight", *matrix(p + f"self_attn.{hf}.weight")),
                (b + g + ".bias", *f32(p + f"self_attn.{hf}.bias")),
            ]
        gate_up = p + "mlp.experts.gate_up_proj"
        out += [
            (b + "ffn_gate_inp.weight", *matrix(p + "mlp.router.weight")),
            (b + "ffn_gate_inp.bias", *f32(p + "mlp.router.bias")),
        ]
        if fuse:
            out.append((b + "ffn_gate_up_exps.weight", *experts(gate_up, "fused")))
        else:
            out += [
                (b + "ffn_gate_exps.weight", *experts(gate_up, 0)),
                (b + "ffn_up_exps.weight", *experts(gate_up, 1)),
            ]
        out.append((b + "ffn_down_exps.weight", *experts(p + "mlp.experts.down_proj")))
        if fuse:
            out.append((b + "ffn_gate_up_exps.bias", *f32(gate_up + "_bias", "fused")))
        else:
            out += [
                (b + "ffn_gate_exps.bias", *f32(gate_up + "_bias", 0)),
                (b + "ffn_up_exps.bias", *f32(gate_up + "_bias", 1)),
            ]
        out.append((b + "ffn_down_exps.bias", *f32(p + "mlp.experts.down_proj_bias")))
    out.append(("output_norm.weight", *f32("model.norm.weight")))
    if not c.get("tie_word_embeddings", False):
        out.append(("output.weight", *matrix("lm_head.weight")))
    return out


def rope(c):
    scaling = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = scaling.get("rope_theta", c.get("rope_theta", 150000.0))
    return theta, scaling


def write(ck, out_path, dense, vocab, fuse=False):
    c = ck.config
    w = gguf.GGUFWriter(out_path, ARCH)
    w.add_name(os.path.basename(os.path.normpath(ck.dir)))
    w.add_context_length(c.get("max_position_embeddings", 131072))
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    theta, scaling = rope(c)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-5))
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c.get("num_experts_per_tok", c.get("experts_per_token")))
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        if scaling.get("truncate", True) is not False:
            sys.exit(f"{ck.dir}: YaRN truncate=true has no GGUF key; llama.cpp and ossterm read gpt-oss as false")
        if (scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)) != (32.0, 1.0):
            w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    kinds = c.get("layer_types")
    default = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c["num_hidden_layers"])]
    if kinds is not None and kinds != default:
        # Not written by the converter (llama.cpp fixes gpt-oss at even layers sliding); the key is
        # llama.cpp's own per-layer form, needed for a fixture with another pattern.
        w.add_sliding_window_pattern([k == "sliding_attention" for k in kinds])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if dense == "q8_0" else gguf.LlamaFileType.MOSTLY_BF16)
    tokens, types, merges = vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")  # the converter's name for o200k's pre-tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if len(tokens) == O200K_SIZE:
        # As the converter takes them from gpt-oss's tokenizer_config.json.
        w.add_bos_token_id(199998)
        w.add_eos_token_id(200002)
        w.add_pad_token_id(199999)
        w.add_chat_template(CHAT_TEMPLATE)

    items = plan(ck, dense, fuse)
    # Shapes and sizes first (the header holds them), then the data, one tensor at a time.
    for name, info, _ in items:
        shape, dtype, nbytes, qtype = info()
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, info, make in items:
        data = make()
        assert data.nbytes == info()[2], name
        w.write_tensor_data(data)
        del data
    w.close()


# o200k_harmony's special tokens (ids 199998..201087); every other id at or above 199998 is
# <|reserved_ID|>, as in tiktoken-rs and Hugging Face's tokenizer.json for gpt-oss.
SPECIALS = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
    200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
    200008: "<|message|>", 200012: "<|call|>",
}
FIRST_SPECIAL = 199998
O200K_SIZE = 201088
# A minimal harmony template (ours): enough for llama.cpp's server to render chats for gpt-oss
# (it recognises the family by "<|start|>" and "<|channel|>"); the real file carries OpenAI's.
CHAT_TEMPLATE = (
    "{#- harmony: <|start|>role<|channel|>channel<|message|>text<|end|> -#}"
    "{%- for m in messages -%}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def byte_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character (what tokenizer.json and
    llama.cpp's BPE vocabularies spell tokens in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def o200k_ranks(path=None):
    """o200k_base's mergeable ranks (bytes -> rank) from the .tiktoken file tiktoken-rs embeds: the
    crate is a dependency of ossterm, so `cargo metadata` finds it offline."""
    import base64
    if path is None:
        cmd = ["cargo", "metadata", "--format-version", "1", "--manifest-path", os.path.join(ROOT, "Cargo.toml")]
        try:  # offline first: a built checkout has the crate already
            meta = json.loads(subprocess.check_output(cmd + ["--offline"], stderr=subprocess.DEVNULL))
        except subprocess.CalledProcessError:
            meta = json.loads(subprocess.check_output(cmd))
        crates = [p for p in meta["packages"] if p["name"] == "tiktoken-rs"]
        if not crates:
            sys.exit("tiktoken-rs is not among ossterm's dependencies; give --o200k FILE")
        path = os.path.join(os.path.dirname(crates[0]["manifest_path"]), "assets", "o200k_base.tiktoken")
    ranks = {}
    with open(path) as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def vocabulary(size, ranks):
    """(tokens, token types, merges) of o200k_harmony cut to `size` ids, as llama.cpp's converter
    writes a byte-level BPE vocabulary: tokens spelled in GPT-2's alphabet, type 1 (normal) for
    mergeable ranks and 3 (control) for specials, merges "a b" ordered by the rank of their result.
    The merges are derived from the ranks as transformers' tiktoken converter derives them (every
    split of a token into two tokens of lower rank). A fixture's small vocabulary is o200k's first
    `size` ranks, so it is a real (if short) BPE vocabulary llama.cpp can load."""
    alphabet = byte_to_unicode()
    spell = lambda b: "".join(alphabet[x] for x in b)
    by_rank = sorted((r, b) for b, r in ranks.items() if r < min(size, FIRST_SPECIAL))
    assert [r for r, _ in by_rank] == list(range(len(by_rank))), "o200k ranks are not dense"
    tokens = [spell(b) for _, b in by_rank]
    types = [1] * len(tokens)
    for i in range(len(tokens), size):
        tokens.append(SPECIALS.get(i, f"<|reserved_{i}|>"))
        types.append(3)
    kept = {b: r for r, b in by_rank}
    merges = []
    for rank, token in by_rank:
        if len(token) == 1:
            continue
        splits = [(token[:i], token[i:]) for i in range(1, len(token))
                  if token[:i] in kept and token[i:] in kept]
        splits.sort(key=lambda lr: (kept[lr[0]], kept[lr[1]]))
        merges += [f"{spell(l)} {spell(r)}" for l, r in splits]
    return tokens, types, merges


FIXTURES = [
    # (case directory, output name, dense format, gate and up experts fused)
    ("tiny_single", "tiny_single.gguf", "bf16", False),
    ("tiny_gqa8", "tiny_gqa8.gguf", "bf16", False),
    ("tiny_single", "tiny_single_q8_0.gguf", "q8_0", False),
    ("tiny_single", "tiny_single_fused.gguf", "bf16", True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", action="store_true", help="write tests/fixtures/gguf/*.gguf")
    ap.add_argument("--checkpoint", help="HF checkpoint directory")
    ap.add_argument("--out", help="output .gguf")
    ap.add_argument("--dense", choices=["bf16", "q8_0"], default="bf16", help="type of the dense matrices")
    ap.add_argument("--fuse-gate-up", action="store_true",
                    help="gate and up experts in one ffn_gate_up_exps tensor (the converter's --fuse-gate-up-exps)")
    ap.add_argument("--o200k", help="o200k_base.tiktoken (default: the one tiktoken-rs embeds)")
    a = ap.parse_args()
    ranks = o200k_ranks(a.o200k) if (a.fixtures or (a.checkpoint and a.out)) else None
    if a.fixtures:
        out_dir = os.path.join(ROOT, "tests", "fixtures", "gguf")
        os.makedirs(out_dir, exist_ok=True)
        for case, name, dense, fuse in FIXTURES:
            ck = Checkpoint(os.path.join(ROOT, "tests", "fixtures", case))
            path = os.path.join(out_dir, name)
            write(ck, path, dense, vocabulary(ck.config["vocab_size"], ranks), fuse)
            print(f"{path}: {os.path.getsize(path)} bytes")
    elif a.checkpoint and a.out:
        ck = Checkpoint(a.checkpoint)
        write(ck, a.out, a.dense, vocabulary(ck.config["vocab_size"], ranks), a.fuse_gate_up)
        print(f"{a.out}: {os.path.getsize(a.out)} bytes")
    else:
        ap.error("give --fixtures, or --checkpoint DIR --out FILE")


if __name__ == "__main__":
    main()
