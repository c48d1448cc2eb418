#!/usr/bin/env python3
"""Write gpt-oss GGUF files from Hugging Face checkpoints, laid out as llama.cpp's converter
(convert_hf_to_gguf.py, class GptOssModel) writes them.

    python3 tools/make_gguf.py --fixtures            # tests/fixtures/gguf/*.gguf from the golden cases
    python3 tools/make_gguf.py --checkpoint DIR --out FILE.gguf [--dense bf16|q8_0]

The script installs its dependencies (the `gguf` package from PyPI, numpy) into a venv of its own
($OSSTERM_GGUF_VENV, default ~/.cache/ossterm-gguf-venv) and re-runs itself there.

Layout (the converter's, checked against its source): tensor names token_embd, output_norm, output,
blk.N.{attn_norm, post_attention_norm, attn_q, attn_k, attn_v, attn_output, attn_sinks, ffn_gate_inp,
ffn_gate_exps, ffn_up_exps, ffn_down_exps}; HF's interleaved gate_up rows (gate even, up odd) split into
ffn_gate_exps / ffn_up_exps; MXFP4 experts as 17-byte blocks (E8M0 scale, then 16 bytes whose low nibbles
are values 0..15 and high nibbles values 16..31); 1-D tensors and biases F32; metadata gpt-oss.*.
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


def plan(ck, dense):
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
            if half is not None:
                shape[-1] //= 2
            return tuple(shape), np.float32, 4 * int(np.prod(shape)), None

        def make():
            dtype, data = ck.get(hf)
            data = to_f32(dtype, np.asarray(data))
            if half is not None:
                data = data[..., half::2]
            return np.ascontiguousarray(data)
        return info, make

    def experts(prefix, half=None):
        def info():
            e, rows, nb, _ = shape_of(prefix + "_blocks")
            if half is not None:
                rows //= 2
            return (e, rows, nb * 17), np.uint8, e * rows * nb * 17, MXFP4

        def make():
            _, blocks = ck.get(prefix + "_blocks")
            _, scales = ck.get(prefix + "_scales")
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
        out += [
            (b + "ffn_gate_inp.weight", *matrix(p + "mlp.router.weight")),
            (b + "ffn_gate_inp.bias", *f32(p + "mlp.router.bias")),
            (b + "ffn_gate_exps.weight", *experts(p + "mlp.experts.gate_up_proj", 0)),
            (b + "ffn_up_exps.weight", *experts(p + "mlp.experts.gate_up_proj", 1)),
            (b + "ffn_down_exps.weight", *experts(p + "mlp.experts.down_proj")),
            (b + "ffn_gate_exps.bias", *f32(p + "mlp.experts.gate_up_proj_bias", 0)),
            (b + "ffn_up_exps.bias", *f32(p + "mlp.experts.gate_up_proj_bias", 1)),
            (b + "ffn_down_exps.bias", *f32(p + "mlp.experts.down_proj_bias")),
        ]
    out.append(("output_norm.weight", *f32("model.norm.weight")))
    if not c.get("tie_word_embeddings", False):
        out.append(("output.weight", *matrix("lm_head.weight")))
    return out


def rope(c):
    scaling = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = scaling.get("rope_theta", c.get("rope_theta", 150000.0))
    return theta, scaling


def write(ck, out_path, dense, tokens):
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
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)

    items = plan(ck, dense)
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


def vocabulary(size):
    """Placeholder strings, with o200k_harmony's special tokens at their ids where they fit."""
    specials = {
        199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
        200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>",
        200008: "<|message|>", 200012: "<|call|>",
    }
    return [specials.get(i, f"<|reserved_{i}|>" if i >= 200000 else f"t{i}") for i in range(size)]


FIXTURES = [
    # (case directory, output name, dense format)
    ("tiny_single", "tiny_single.gguf", "bf16"),
    ("tiny_gqa8", "tiny_gqa8.gguf", "bf16"),
    ("tiny_single", "tiny_single_q8_0.gguf", "q8_0"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", action="store_true", help="write tests/fixtures/gguf/*.gguf")
    ap.add_argument("--checkpoint", help="HF checkpoint directory")
    ap.add_argument("--out", help="output .gguf")
    ap.add_argument("--dense", choices=["bf16", "q8_0"], default="bf16", help="type of the dense matrices")
    a = ap.parse_args()
    if a.fixtures:
        out_dir = os.path.join(ROOT, "tests", "fixtures", "gguf")
        os.makedirs(out_dir, exist_ok=True)
        for case, name, dense in FIXTURES:
            ck = Checkpoint(os.path.join(ROOT, "tests", "fixtures", case))
            path = os.path.join(out_dir, name)
            write(ck, path, dense, vocabulary(ck.config["vocab_size"]))
            print(f"{path}: {os.path.getsize(path)} bytes")
    elif a.checkpoint and a.out:
        ck = Checkpoint(a.checkpoint)
        write(ck, a.out, a.dense, vocabulary(ck.config["vocab_size"]))
        print(f"{a.out}: {os.path.getsize(a.out)} bytes")
    else:
        ap.error("give --fixtures, or --checkpoint DIR --out FILE")


if __name__ == "__main__":
    main()
