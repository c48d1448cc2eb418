#!/usr/bin/env python3
"""Golden fixtures for ossterm: tiny random gpt-oss checkpoints plus transformers' outputs on them.

Each case is a directory holding a checkpoint in the exact Hugging Face `openai/gpt-oss-20b` layout
(`config.json`, BF16 non-expert tensors, MXFP4 expert tensors, one file or HF-named shards with
`model.safetensors.index.json`) and the outputs transformers computes on it in float32:

  logits.bin   little-endian f32 logits of every position of `golden.json["tokens"]`, row-major [T x vocab]
  golden.json  tokens, num_positions, vocab_size, logits_file, greedy {prompt, generated}, versions, seed, ...

Install:  pip install torch "transformers>=4.55" safetensors numpy
          (with transformers 4.x also `pip install accelerate`: its MXFP4 loader imports it)
Usage:    python3 tools/make_fixtures.py --out tests/fixtures            # every case in CASES
          python3 tools/make_fixtures.py --case tiny_single --seed 7 --out ../holdout

How the numbers are made exact: the MXFP4 codes and scale bytes are drawn first and dequantized exactly
(every FP4 value times a power of two is exact in f32), the BF16 tensors are drawn in f32 and rounded to
bf16, and the f32 model is given exactly those values. So the f32 transformers model computes on the
values stored in the files, and an f32 engine can match its logits to rounding noise.

A seed is rejected (and the next one tried) when an f32 engine could legitimately disagree with the golden
outputs: a greedy step whose top-1/top-2 logit gap is small, or a router whose k-th and (k+1)-th logits nearly
tie at some layer and position. The seed used is recorded in golden.json.

After writing, the directory is loaded back with `from_pretrained` (MXFP4 dequantized on CPU), and its
parameters and logits must equal the in-memory model's; an independent numpy dequantizer reads the files
and must reproduce the same expert matrices.

Works with transformers 4.55+ (config key `rope_scaling`) and 5.x (also `rope_parameters`); cases that write
the newer `rope_parameters` key need transformers 5, and the script says so instead of writing wrong goldens.
Checked: transformers 4.55.4 and 5.23.0 write byte-identical checkpoints and logits for the rope_scaling cases.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

FP4_E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
MXFP4_BLOCK = 32
E8M0_BIAS = 127
GREEDY_NEW_TOKENS = 20
# A greedy step is accepted only if top1 - top2 exceeds this fraction of the step's logit range (max - min).
GREEDY_RELATIVE_MARGIN = 2e-3
# Router top-k boundary: the k-th logit must beat the (k+1)-th by more than this (absolute).
ROUTER_MARGIN = 1e-4
MAX_SEED_ATTEMPTS = 200
# transformers runs in f32 (rope tables included); the numpy reference in f64.
REFERENCE_TOLERANCE = 1e-3
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@dataclass
class Case:
    """Shape and rope settings of one fixture; any valid combination works."""

    name: str
    description: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    vocab_size: int
    sliding_window: int
    rope_theta: float
    yarn_factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    truncate: bool
    max_position_embeddings: int
    # "rope_scaling" (legacy, as openai/gpt-oss-20b ships) or "rope_parameters" (transformers 5 naming)
    rope_key: str
    num_positions: int
    prompt_length: int
    # number of safetensors files; 1 writes `model.safetensors`, more write HF-named shards plus the index
    num_shards: int = 1
    # None: HF's default alternation (even layers sliding); otherwise the explicit list written to config.json
    layer_types: list[str] | None = None
    swiglu_limit: float = 7.0
    # Multiplies the std of the gate_up expert weights (1/sqrt(in) at 1.0) so the swiglu clamp is reached.
    gate_up_gain: float = 1.0
    seed: int = 0
    extra: dict = field(default_factory=dict)


CASES = {
    case.name: case
    for case in [
        Case(
            name="tiny_single",
            description="single model.safetensors; hidden = heads*head_dim = intermediate (like 20b); "
            "legacy rope_scaling key, yarn truncate false",
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            vocab_size=384,
            sliding_window=8,
            rope_theta=10000.0,
            yarn_factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            max_position_embeddings=64,
            rope_key="rope_scaling",
            num_positions=40,
            prompt_length=12,
            gate_up_gain=1.5,
            seed=1000,
        ),
        Case(
            name="tiny_sharded",
            description="3 HF-named shards + index, layers split mid-layer; q width 192 != hidden 96; "
            "rope_parameters key (transformers 5 naming), yarn truncate true",
            hidden_size=96,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=32,
            num_local_experts=8,
            num_experts_per_tok=4,
            intermediate_size=96,
            vocab_size=500,
            sliding_window=16,
            rope_theta=50000.0,
            yarn_factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=16.0,
            beta_slow=2.0,
            truncate=True,
            max_position_embeddings=256,
            rope_key="rope_parameters",
            num_positions=72,
            prompt_length=24,
            num_shards=3,
            gate_up_gain=1.5,
            seed=2000,
        ),
        Case(
            name="tiny_gqa8",
            description="8 query heads per KV head (like 20b), intermediate 96 != hidden 128, 6 experts top-3, "
            "explicit non-alternating layer_types, 20b rope numbers (theta 150000, factor 32) with a small "
            "original context, legacy rope_scaling key, 2 shards",
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=32,
            num_local_experts=6,
            num_experts_per_tok=3,
            intermediate_size=96,
            vocab_size=640,
            sliding_window=24,
            rope_theta=150000.0,
            yarn_factor=32.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            max_position_embeddings=1024,
            rope_key="rope_scaling",
            num_positions=96,
            prompt_length=30,
            num_shards=2,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            gate_up_gain=1.5,
            seed=3000,
        ),
        Case(
            name="small_wide",
            description="the widest case: head_dim 64 and 8 query heads per KV head as in 20b, hidden 256 "
            "(two 128-wide kernel groups per row), 8 experts top-4 like 20b, 3 layers; the "
            "fast path's accuracy is judged mostly here, where rounding errors average as in the real model",
            hidden_size=256,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=64,
            num_local_experts=8,
            num_experts_per_tok=4,
            intermediate_size=128,
            vocab_size=512,
            sliding_window=32,
            rope_theta=150000.0,
            yarn_factor=32.0,
            original_max_position_embeddings=64,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            max_position_embeddings=4096,
            rope_key="rope_scaling",
            num_positions=128,
            prompt_length=40,
            num_shards=2,
            gate_up_gain=1.5,
            seed=4000,
        ),
    ]
}


class FixtureError(Exception):
    pass


def transformers_major() -> int:
    return int(transformers.__version__.split(".")[0])


def validate_case(case: Case) -> None:
    problems = []
    if case.hidden_size % MXFP4_BLOCK or case.intermediate_size % MXFP4_BLOCK:
        problems.append(f"hidden_size and intermediate_size must be multiples of {MXFP4_BLOCK} (MXFP4 blocks)")
    if case.num_attention_heads % case.num_key_value_heads:
        problems.append("num_attention_heads must be a multiple of num_key_value_heads")
    if case.head_dim % 2:
        problems.append("head_dim must be even (half-split rope)")
    if not 0 < case.num_experts_per_tok < case.num_local_experts:
        problems.append("need 0 < num_experts_per_tok < num_local_experts (the router margin needs a (k+1)-th)")
    if case.prompt_length + GREEDY_NEW_TOKENS > case.max_position_embeddings:
        problems.append("prompt_length + 20 exceeds max_position_embeddings")
    if case.num_positions > case.max_position_embeddings:
        problems.append("num_positions exceeds max_position_embeddings")
    if case.rope_key not in ("rope_scaling", "rope_parameters"):
        problems.append("rope_key must be rope_scaling or rope_parameters")
    if case.layer_types is not None and len(case.layer_types) != case.num_hidden_layers:
        problems.append("layer_types must have num_hidden_layers entries")
    if problems:
        raise FixtureError(f"case {case.name}: " + "; ".join(problems))


def layer_types_of(case: Case) -> list[str]:
    if case.layer_types is not None:
        return list(case.layer_types)
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(case.num_hidden_layers)]


def hf_config_dict(case: Case) -> dict:
    """config.json with the keys and spelling of openai/gpt-oss-20b's (keys sorted, as HF writes them)."""
    rope = {
        "beta_fast": case.beta_fast,
        "beta_slow": case.beta_slow,
        "factor": case.yarn_factor,
        "original_max_position_embeddings": case.original_max_position_embeddings,
        "rope_type": "yarn",
        "truncate": case.truncate,
    }
    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        # No EOS/pad: the greedy goldens are pure argmax chains, nothing may stop or suppress a token.
        "eos_token_id": None,
        "experts_per_token": case.num_experts_per_tok,
        "head_dim": case.head_dim,
        "hidden_act": "silu",
        "hidden_size": case.hidden_size,
        "initial_context_length": case.original_max_position_embeddings,
        "initializer_range": 0.02,
        "intermediate_size": case.intermediate_size,
        "layer_types": layer_types_of(case),
        "max_position_embeddings": case.max_position_embeddings,
        "model_type": "gpt_oss",
        "num_attention_heads": case.num_attention_heads,
        "num_experts_per_tok": case.num_experts_per_tok,
        "num_hidden_layers": case.num_hidden_layers,
        "num_key_value_heads": case.num_key_value_heads,
        "num_local_experts": case.num_local_experts,
        "output_router_logits": False,
        "pad_token_id": None,
        "quantization_config": {"modules_to_not_convert": MODULES_TO_NOT_CONVERT, "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "router_aux_loss_coef": 0.9,
        "sliding_window": case.sliding_window,
        "swiglu_limit": case.swiglu_limit,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": case.vocab_size,
    }
    if case.rope_key == "rope_scaling":
        config["rope_scaling"] = rope
        config["rope_theta"] = case.rope_theta
    else:
        config["rope_parameters"] = dict(sorted({**rope, "rope_theta": case.rope_theta}.items()))
    return dict(sorted(config.items()))


def effective_rope(config) -> dict:
    """The rope settings transformers will actually use, whichever key it keeps them under.

    transformers 4.x keeps unknown config.json keys as plain attributes, so a `rope_parameters` dict shows up
    on a 4.x config while its model silently uses `rope_scaling` (the 20b defaults): ask by version.
    """
    if transformers_major() >= 5:
        params = dict(config.rope_parameters or {})
        theta = params.get("rope_theta")
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
        theta = getattr(config, "rope_theta", None)
    return {
        "rope_type": params.get("rope_type", params.get("type")),
        "rope_theta": theta,
        "factor": params.get("factor"),
        "original_max_position_embeddings": params.get("original_max_position_embeddings"),
        "beta_fast": params.get("beta_fast"),
        "beta_slow": params.get("beta_slow"),
        "truncate": params.get("truncate", True),
    }


def check_rotary_tables(case: Case, model: GptOssForCausalLM, config_json: dict) -> str:
    """The model's own inv_freq and concentration must be the ones spec section 3 derives from config.json."""
    rotary = model.model.rotary_emb
    want_inv_freq = yarn_inv_freq(config_json)
    got_inv_freq = rotary.inv_freq.double().numpy()
    relative = float(np.max(np.abs(got_inv_freq - want_inv_freq) / want_inv_freq))
    concentration_error = abs(float(rotary.attention_scaling) - yarn_concentration(config_json))
    if relative > 1e-6 or concentration_error > 1e-6:
        raise FixtureError(
            f"case {case.name}: transformers {transformers.__version__} built rope tables that do not follow "
            f"config.json (inv_freq relative error {relative:.1e}, concentration error {concentration_error:.1e})"
        )
    return f"model rope tables = config.json yarn: inv_freq rel err {relative:.1e}, concentration {yarn_concentration(config_json):.6f}"


def check_config_read_back(case: Case, config) -> list[str]:
    """transformers must read config.json the way it was written; otherwise the goldens would be wrong."""
    want = {
        "rope_type": "yarn",
        "rope_theta": case.rope_theta,
        "factor": case.yarn_factor,
        "original_max_position_embeddings": case.original_max_position_embeddings,
        "beta_fast": case.beta_fast,
        "beta_slow": case.beta_slow,
        "truncate": case.truncate,
    }
    got = effective_rope(config)
    for key, value in want.items():
        if got[key] != value:
            hint = ""
            if case.rope_key == "rope_parameters" and transformers_major() < 5:
                hint = " (the rope_parameters key needs transformers >= 5)"
            raise FixtureError(
                f"case {case.name}: transformers {transformers.__version__} read rope {key}={got[key]!r} "
                f"from config.json, expected {value!r}{hint}"
            )
    scalar_keys = {
        "sliding_window": case.sliding_window,
        "head_dim": case.head_dim,
        "num_local_experts": case.num_local_experts,
        "num_experts_per_tok": case.num_experts_per_tok,
        "layer_types": layer_types_of(case),
        "tie_word_embeddings": False,
        "swiglu_limit": case.swiglu_limit,
    }
    for key, value in scalar_keys.items():
        if getattr(config, key) != value:
            raise FixtureError(f"case {case.name}: config.{key} read back as {getattr(config, key)!r}, expected {value!r}")
    return [f"config read back: rope {got}, sliding_window {config.sliding_window}, layer_types {config.layer_types}"]


def build_model(config) -> GptOssForCausalLM:
    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        # transformers 5 may dispatch experts to grouped_mm; the eager loop is the reference.
        config._experts_implementation = "eager"
    torch.manual_seed(0)  # only initializes values that are all overwritten below
    model = GptOssForCausalLM(config).to(torch.float32)
    model.eval()
    limit = model.model.layers[0].mlp.experts.limit
    if limit != config.swiglu_limit:
        raise FixtureError(
            f"transformers {transformers.__version__} uses swiglu limit {limit}, config.json says "
            f"{config.swiglu_limit} (transformers 4.x hard-codes 7.0)"
        )
    return model


# ---------------------------------------------------------------------------------------------------------------
# Random weights


def round_to_bf16(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)


def draw_mxfp4(rng: np.random.Generator, experts: int, rows: int, cols: int, gain: float):
    """Codes and scale bytes of an [experts, rows, cols] matrix (cols = input dim) with std ~ gain/sqrt(cols)."""
    codes = rng.integers(0, 16, size=(experts, rows, cols), dtype=np.uint8)
    fp4_rms = math.sqrt(float(np.mean(FP4_E2M1_VALUES.astype(np.float64) ** 2)))
    base_exponent = round(math.log2(gain / math.sqrt(cols) / fp4_rms))
    # Per-block exponents vary so a reader that ignores or misplaces scales is caught.
    exponents = base_exponent + rng.integers(-1, 2, size=(experts, rows, cols // MXFP4_BLOCK))
    scales = (exponents + E8M0_BIAS).astype(np.uint8)
    return codes, scales


def pack_mxfp4(codes: np.ndarray) -> np.ndarray:
    """[E, R, K] nibble codes -> [E, R, K/32, 16] bytes: even element in the low nibble, odd in the high."""
    experts, rows, cols = codes.shape
    pairs = codes.reshape(experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def dequantize_mxfp4_numpy(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Independent of transformers: [E, R, G, 16] bytes + [E, R, G] scales -> [E, R, G*32] f32 ([out, in])."""
    low = FP4_E2M1_VALUES[blocks & 0x0F]
    high = FP4_E2M1_VALUES[blocks >> 4]
    values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], MXFP4_BLOCK)
    factors = np.ldexp(np.float32(1.0), scales.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    values = values * factors[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def bf16_tensor_std(name: str, shape: tuple[int, ...], case: Case) -> tuple[float, float]:
    """(mean, std) of the random draw for a non-expert parameter, by its HF name."""
    fan_in = shape[-1] if len(shape) > 1 else None
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0, 0.2
    if name.endswith("self_attn.sinks"):
        return 0.0, 1.5
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name.endswith("mlp.router.weight"):
        return 0.0, 2.0 / math.sqrt(fan_in)
    if name.endswith("mlp.router.bias"):
        return 0.0, 0.5
    if name.endswith("experts.gate_up_proj_bias"):
        return 0.0, 0.5
    if name.endswith("experts.down_proj_bias"):
        return 0.0, 0.2
    if name.endswith(".bias"):
        return 0.0, 0.2
    if name.endswith(".weight"):
        return 0.0, 1.0 / math.sqrt(fan_in)
    raise FixtureError(f"no random rule for parameter {name} of shape {shape}")


def draw_weights(model: GptOssForCausalLM, case: Case, rng: np.random.Generator):
    """Draws every parameter (shapes read from the model), sets the f32 model to the exact stored values.

    Returns the checkpoint tensors by HF name, in the model's parameter order.
    """
    tensors: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, param in params.items():
        shape = tuple(param.shape)
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            # In memory HF keeps [E, in, out] for x @ W; the checkpoint packs [E, out, in] along `in`.
            experts, fan_in, fan_out = shape
            gain = case.gate_up_gain if name.endswith("gate_up_proj") else 1.0
            codes, scales = draw_mxfp4(rng, experts, fan_out, fan_in, gain)
            blocks = pack_mxfp4(codes)
            dense = dequantize_mxfp4_numpy(blocks, scales)  # [E, out, in]
            with torch.no_grad():
                param.copy_(torch.from_numpy(np.ascontiguousarray(dense.transpose(0, 2, 1))))
            tensors[name + "_blocks"] = torch.from_numpy(blocks)
            tensors[name + "_scales"] = torch.from_numpy(scales)
        else:
            mean, std = bf16_tensor_std(name, shape, case)
            values = round_to_bf16(rng.normal(mean, std, size=shape))
            with torch.no_grad():
                param.copy_(values.to(torch.float32))
            tensors[name] = values
    return tensors


# ---------------------------------------------------------------------------------------------------------------
# Goldens and the checks that reject a seed


class RouterRecorder:
    """Records each layer's router input so router logits are recomputed the same way in every version."""

    def __init__(self, model: GptOssForCausalLM):
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for index, layer in enumerate(model.model.layers):
            self.handles.append(layer.mlp.router.register_forward_hook(self._hook(index)))
        self.routers = [layer.mlp.router for layer in model.model.layers]
        self.experts = [layer.mlp.experts for layer in model.model.layers]

    def _hook(self, index):
        def hook(module, args, output):
            self.inputs.setdefault(index, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).clone())

        return hook

    def clear(self):
        self.inputs = {}

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def router_logits(self, layer: int) -> torch.Tensor:
        router = self.routers[layer]
        hidden = torch.cat(self.inputs[layer], dim=0)
        return torch.nn.functional.linear(hidden, router.weight, router.bias)


def router_report(recorder: RouterRecorder, top_k: int, limit: float) -> dict:
    """Smallest top-k boundary gap over layers and positions, expert usage, and swiglu clamp hits."""
    smallest_gap = math.inf
    usage = []
    clamp_gate_hits = clamp_up_hits = routed_units = 0
    for layer in range(len(recorder.routers)):
        logits = recorder.router_logits(layer)
        ordered = torch.sort(logits, dim=-1, descending=True).values
        smallest_gap = min(smallest_gap, float((ordered[:, top_k - 1] - ordered[:, top_k]).min()))
        chosen = torch.topk(logits, top_k, dim=-1).indices
        usage.append(torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).tolist())
        hidden = torch.cat(recorder.inputs[layer], dim=0)
        experts = recorder.experts[layer]
        for expert in range(logits.shape[-1]):
            rows = (chosen == expert).any(dim=-1)
            if not rows.any():
                continue
            gate_up = hidden[rows] @ experts.gate_up_proj[expert] + experts.gate_up_proj_bias[expert]
            clamp_gate_hits += int((gate_up[:, ::2] > limit).sum())
            clamp_up_hits += int((gate_up[:, 1::2].abs() > limit).sum())
            routed_units += gate_up[:, ::2].numel()
    return {
        "smallest_router_gap": smallest_gap,
        "expert_usage_per_layer": usage,
        "clamp_gate_hits": clamp_gate_hits,
        "clamp_up_hits": clamp_up_hits,
        "routed_units": routed_units,
    }


def sink_mass(model: GptOssForCausalLM, tokens: torch.Tensor) -> tuple[float, float, float]:
    """Min/mean/max attention probability taken by the sinks (1 - sum of the returned key weights)."""
    with torch.no_grad():
        out = model(tokens, output_attentions=True, use_cache=False)
    masses = torch.stack([1.0 - attn.sum(dim=-1) for attn in out.attentions])
    return float(masses.min()), float(masses.mean()), float(masses.max())


def greedy_generate(model: GptOssForCausalLM, prompt: torch.Tensor) -> list[int]:
    with torch.no_grad():
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            use_cache=True,
            max_new_tokens=GREEDY_NEW_TOKENS,
            min_new_tokens=GREEDY_NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return generated[0, prompt.shape[1] :].tolist()


@dataclass
class Attempt:
    seed: int
    tensors: dict
    model: GptOssForCausalLM
    tokens: list
    logits: np.ndarray
    prompt: list
    generated: list
    notes: list


def try_seed(case: Case, config, seed: int) -> tuple[Attempt | None, str]:
    rng = np.random.Generator(np.random.PCG64(seed))
    model = build_model(config)
    tensors = draw_weights(model, case, rng)
    tokens = rng.integers(0, case.vocab_size, size=case.num_positions).tolist()
    prompt = rng.integers(0, case.vocab_size, size=case.prompt_length).tolist()
    notes = []

    recorder = RouterRecorder(model)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
    report = router_report(recorder, case.num_experts_per_tok, case.swiglu_limit)
    if report["smallest_router_gap"] <= ROUTER_MARGIN:
        recorder.remove()
        return None, f"router near-tie on the logits sequence (gap {report['smallest_router_gap']:.2e})"
    if not torch.isfinite(logits).all():
        recorder.remove()
        return None, "non-finite logits"
    notes.append(
        f"logits sequence: T={len(tokens)}, max|logit| {float(logits.abs().max()):.3f}, "
        f"logit std {float(logits.std()):.3f}, smallest router top-{case.num_experts_per_tok} gap "
        f"{report['smallest_router_gap']:.3e}"
    )
    notes.append(f"expert usage per layer (token-slots): {report['expert_usage_per_layer']}")
    notes.append(
        f"swiglu clamp (limit {case.swiglu_limit}) hits among {report['routed_units']} routed gate units: "
        f"gate>limit {report['clamp_gate_hits']}, |up|>limit {report['clamp_up_hits']}"
    )
    if min(min(layer) for layer in report["expert_usage_per_layer"]) == 0:
        recorder.remove()
        return None, "an expert is never routed to in some layer"

    recorder.clear()
    generated = greedy_generate(model, torch.tensor([prompt]))
    recorder.clear()
    # Teacher-forced pass over prompt + generated: every greedy step must be the plain argmax with a margin,
    # which also proves no logits processor (EOS, min length) changed a choice.
    sequence = prompt + generated
    with torch.no_grad():
        forced = model(torch.tensor([sequence]), use_cache=False).logits[0]
    gen_report = router_report(recorder, case.num_experts_per_tok, case.swiglu_limit)
    recorder.remove()
    smallest_relative_gap = math.inf
    for step in range(GREEDY_NEW_TOKENS):
        row = forced[len(prompt) - 1 + step]
        top2 = torch.topk(row, 2)
        if int(top2.indices[0]) != generated[step]:
            return None, f"greedy step {step}: generate() chose {generated[step]}, argmax is {int(top2.indices[0])}"
        relative_gap = float(top2.values[0] - top2.values[1]) / float(row.max() - row.min())
        smallest_relative_gap = min(smallest_relative_gap, relative_gap)
    if smallest_relative_gap <= GREEDY_RELATIVE_MARGIN:
        return None, f"greedy near-tie (top1-top2 = {smallest_relative_gap:.2e} of the logit range)"
    if gen_report["smallest_router_gap"] <= ROUTER_MARGIN:
        return None, f"router near-tie on the greedy sequence (gap {gen_report['smallest_router_gap']:.2e})"
    notes.append(
        f"greedy: prompt {len(prompt)} + {GREEDY_NEW_TOKENS} tokens, every step = argmax of a full forward, "
        f"smallest top1-top2 gap {smallest_relative_gap:.3e} of the logit range (> {GREEDY_RELATIVE_MARGIN}), "
        f"smallest router gap {gen_report['smallest_router_gap']:.3e} (> {ROUTER_MARGIN})"
    )
    low, mean, high = sink_mass(model, torch.tensor([tokens]))
    notes.append(f"sink probability mass per (layer, head, query): min {low:.3f} mean {mean:.3f} max {high:.3f}")
    return Attempt(seed, tensors, model, tokens, logits.numpy().astype("<f4"), prompt, generated, notes), ""


def sensitivity_notes(case: Case, config, attempt: Attempt) -> list[str]:
    """How far the goldens move if a feature were implemented wrong, so the fixture can catch it."""
    state = attempt.model.state_dict()
    tokens = torch.tensor([attempt.tokens])
    base = torch.from_numpy(attempt.logits)
    notes = []

    def variant_logits(variant_config, edit_state=None):
        model = build_model(variant_config)
        variant_state = dict(state) if edit_state is None else edit_state(dict(state))
        model.load_state_dict(variant_state)
        with torch.no_grad():
            return model(tokens, use_cache=False).logits[0]

    def report(label, logits):
        notes.append(f"if {label}: max|d logit| {float((logits - base).abs().max()):.3f}")

    no_window = copy.deepcopy(config)
    no_window.layer_types = ["full_attention"] * case.num_hidden_layers
    report("the sliding window were ignored", variant_logits(no_window))

    def zero_sinks(s):
        return {k: (torch.zeros_like(v) if k.endswith("sinks") else v) for k, v in s.items()}

    report("sinks were left out", variant_logits(config, zero_sinks))

    flipped = copy.deepcopy(config)
    for holder in ("rope_parameters", "rope_scaling"):
        params = getattr(flipped, holder, None)
        if isinstance(params, dict) and params:
            params["truncate"] = not case.truncate
    report(f"yarn truncate were {not case.truncate}", variant_logits(flipped))

    def halves_instead_of_interleave(s):
        edited = dict(s)
        for key, value in s.items():
            if key.endswith("gate_up_proj") or key.endswith("gate_up_proj_bias"):
                width = value.shape[-1]
                order = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
                inverse = torch.argsort(order)
                edited[key] = value[..., inverse]
        return edited

    report("gate/up were split in halves", variant_logits(config, halves_instead_of_interleave))
    return notes


# ---------------------------------------------------------------------------------------------------------------
# Writing and proving the layout


def checkpoint_order(tensors: dict) -> list[str]:
    return sorted(tensors)


def shard_assignment(names: list[str], tensors: dict, num_shards: int) -> list[list[str]]:
    """Contiguous byte-balanced groups of the sorted names, so shards cut through layers."""
    sizes = [tensors[name].numel() * tensors[name].element_size() for name in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(num_shards)]
    running = 0
    for name, size in zip(names, sizes):
        index = min(num_shards - 1, int(running * num_shards / total))
        groups[index].append(name)
        running += size
    if any(not group for group in groups):
        raise FixtureError(f"cannot fill {num_shards} shards with {len(names)} tensors")
    return groups


def write_checkpoint(directory: Path, case: Case, tensors: dict) -> list[str]:
    names = checkpoint_order(tensors)
    metadata = {"format": "pt"}
    if case.num_shards == 1:
        safetensors.torch.save_file({n: tensors[n].contiguous() for n in names}, directory / "model.safetensors", metadata)
        return ["model.safetensors"]
    groups = shard_assignment(names, tensors, case.num_shards)
    # HF's converter numbers shards from 0 and writes the count minus one: 3 files are -of-00002.
    files = [f"model-{i:05d}-of-{case.num_shards - 1:05d}.safetensors" for i in range(case.num_shards)]
    weight_map = {}
    for file, group in zip(files, groups):
        safetensors.torch.save_file({n: tensors[n].contiguous() for n in group}, directory / file, metadata)
        for name in group:
            weight_map[name] = file
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def shard_notes(directory: Path, files: list[str]) -> list[str]:
    if len(files) == 1:
        return []
    layers_per_file = []
    for file in files:
        with safetensors.safe_open(directory / file, "pt") as handle:
            layers_per_file.append(
                sorted({int(k.split(".")[2]) for k in handle.keys() if k.startswith("model.layers.")})
            )
    split = sorted({layer for a, b in zip(layers_per_file, layers_per_file[1:]) for layer in set(a) & set(b)})
    if not split:
        raise FixtureError(f"{directory}: no layer is split across shards")
    return [f"shards hold layers {layers_per_file}; layers split across two files: {split}"]


def load_back(directory: Path) -> GptOssForCausalLM:
    from transformers import Mxfp4Config

    dtype_key = "dtype" if tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    kwargs = {dtype_key: torch.float32, "attn_implementation": "eager"}
    if transformers_major() >= 5:
        kwargs["experts_implementation"] = "eager"
    try:
        model = GptOssForCausalLM.from_pretrained(
            directory, quantization_config=Mxfp4Config(dequantize=True), **kwargs
        )
    except ImportError as error:
        raise FixtureError(
            f"transformers {transformers.__version__} cannot load {directory} with MXFP4 dequantization: {error} "
            "(transformers 4.x needs `pip install accelerate` for this)"
        ) from error
    # transformers 4.55 dequantizes MXFP4 to bf16 whatever dtype is asked for; FP4 value x 2^k is exact in
    # bf16 and f32, so widening loses nothing and lets the f32 forward run.
    model = model.to(torch.float32)
    model.eval()
    return model


def prove_layout(directory: Path, case: Case, attempt: Attempt, files: list[str]) -> list[str]:
    notes = []
    loaded = load_back(directory)
    check_config_read_back(case, loaded.config)
    mine = dict(attempt.model.named_parameters())
    theirs = dict(loaded.named_parameters())
    if set(mine) != set(theirs):
        raise FixtureError(f"{directory}: reloaded parameter names differ: {sorted(set(mine) ^ set(theirs))}")
    worst = max(float((mine[n].float() - theirs[n].float()).abs().max()) for n in mine)
    if worst != 0.0:
        raise FixtureError(f"{directory}: from_pretrained parameters differ from the in-memory model by {worst}")
    with torch.no_grad():
        reloaded_logits = loaded(torch.tensor([attempt.tokens]), use_cache=False).logits[0]
    diff = float((reloaded_logits - torch.from_numpy(attempt.logits)).abs().max())
    if diff > 1e-5:
        raise FixtureError(f"{directory}: from_pretrained logits differ from the goldens by {diff}")
    notes.append(
        f"from_pretrained(Mxfp4Config(dequantize=True), f32, eager): all {len(mine)} parameters identical, "
        f"max|d logit| {diff:.1e}"
    )

    # Independent reader: raw safetensors + numpy dequantizer, nothing from transformers.
    weight_files = {}
    for file in files:
        with safetensors.safe_open(directory / file, "np") as handle:
            for key in handle.keys():
                weight_files[key] = file
    checked = 0
    for name, param in mine.items():
        if name.endswith("gate_up_proj") or name.endswith("down_proj"):
            with safetensors.safe_open(directory / weight_files[name + "_blocks"], "np") as handle:
                blocks = handle.get_tensor(name + "_blocks")
            with safetensors.safe_open(directory / weight_files[name + "_scales"], "np") as handle:
                scales = handle.get_tensor(name + "_scales")
            dense = dequantize_mxfp4_numpy(blocks, scales).transpose(0, 2, 1)
            if not np.array_equal(dense, param.detach().numpy()):
                raise FixtureError(f"{directory}: numpy dequantization of {name} differs from the model")
            checked += 1
    notes.append(f"numpy MXFP4 dequantizer on the files reproduces all {checked} expert matrices exactly")

    reference = reference_forward(directory, attempt.tokens)
    reference_diff = float(np.abs(reference - attempt.logits.astype(np.float64)).max())
    if reference_diff > REFERENCE_TOLERANCE:
        raise FixtureError(
            f"{directory}: the numpy f64 reference forward differs from transformers by {reference_diff:.2e} "
            f"(tolerance {REFERENCE_TOLERANCE})"
        )
    notes.append(f"numpy f64 reference forward from the files (spec section 3) vs transformers f32: max|d logit| {reference_diff:.2e}")
    return notes


# ---------------------------------------------------------------------------------------------------------------
# Independent float64 numpy forward, reading only config.json and the safetensors files (spec section 3)

SWIGLU_ALPHA = 1.702


def read_checkpoint(directory: Path) -> dict[str, np.ndarray]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.exists():
        files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for file in files:
        # "pt" only because numpy has no bfloat16; the values are widened before any arithmetic.
        with safetensors.safe_open(directory / file, "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                tensors[key] = tensor.numpy() if tensor.dtype == torch.uint8 else tensor.double().numpy()
    return tensors


def yarn_rope_settings(config: dict) -> tuple[dict, float]:
    rope = config.get("rope_parameters") or config["rope_scaling"]
    return rope, rope.get("rope_theta", config.get("rope_theta"))


def yarn_inv_freq(config: dict) -> np.ndarray:
    rope, theta = yarn_rope_settings(config)
    dim = config["head_dim"]
    factor = rope["factor"]
    original = rope["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope["beta_fast"]), correction_dim(rope["beta_slow"])
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    index = np.arange(dim // 2, dtype=np.float64)
    base_freq = theta ** (2 * index / dim)
    ramp = np.clip((index - low) / (high - low), 0.0, 1.0)
    return (1 - ramp) / base_freq + ramp / (factor * base_freq)


def yarn_concentration(config: dict) -> float:
    factor = yarn_rope_settings(config)[0]["factor"]
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_tables(config: dict, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position, both multiplied by the concentration (spec section 3)."""
    angles = np.arange(positions, dtype=np.float64)[:, None] * yarn_inv_freq(config)[None, :]
    concentration = yarn_concentration(config)
    return np.cos(angles) * concentration, np.sin(angles) * concentration


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rotate_half_split(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def reference_forward(directory: Path, tokens: list[int]) -> np.ndarray:
    config = json.loads((directory / "config.json").read_text())
    w = read_checkpoint(directory)
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    top_k, limit, eps = config["num_experts_per_tok"], config["swiglu_limit"], config["rms_norm_eps"]
    count = len(tokens)
    cos, sin = yarn_tables(config, count)
    x = w["model.embed_tokens.weight"][tokens]
    query_pos = np.arange(count)[:, None]
    key_pos = np.arange(count)[None, :]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (t @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).reshape(count, heads, dim)
        k = (t @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).reshape(count, kv_heads, dim)
        v = (t @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).reshape(count, kv_heads, dim)
        q = rotate_half_split(q, cos[:, None, :], sin[:, None, :])
        k = rotate_half_split(k, cos[:, None, :], sin[:, None, :])
        allowed = key_pos <= query_pos
        if config["layer_types"][layer] == "sliding_attention":
            allowed &= query_pos - key_pos < config["sliding_window"]
        attended = np.empty((count, heads, dim))
        for head in range(heads):
            group = head // (heads // kv_heads)
            scores = np.where(allowed, q[:, head] @ k[:, group].T / math.sqrt(dim), -np.inf)
            sink = w[p + "self_attn.sinks"][head]
            peak = np.maximum(scores.max(axis=-1, keepdims=True), sink)
            weights = np.exp(scores - peak)
            weights /= weights.sum(axis=-1, keepdims=True) + np.exp(sink - peak)
            attended[:, head] = weights @ v[:, group]
        x = x + attended.reshape(count, -1) @ w[p + "self_attn.o_proj.weight"].T + w[p + "self_attn.o_proj.bias"]

        t = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        router = t @ w[p + "mlp.router.weight"].T + w[p + "mlp.router.bias"]
        gate_up = dequantize_mxfp4_numpy(w[p + "mlp.experts.gate_up_proj_blocks"], w[p + "mlp.experts.gate_up_proj_scales"])
        down = dequantize_mxfp4_numpy(w[p + "mlp.experts.down_proj_blocks"], w[p + "mlp.experts.down_proj_scales"])
        moe = np.zeros_like(x)
        for position in range(count):
            chosen = np.argsort(-router[position], kind="stable")[:top_k]
            chosen_logits = router[position, chosen]
            routing = np.exp(chosen_logits - chosen_logits.max())
            routing /= routing.sum()
            for expert, weight in zip(chosen, routing):
                h = gate_up[expert].astype(np.float64) @ t[position] + w[p + "mlp.experts.gate_up_proj_bias"][expert]
                gate = np.minimum(h[0::2], limit)
                up = np.clip(h[1::2], -limit, limit)
                activated = gate / (1 + np.exp(-SWIGLU_ALPHA * gate)) * (up + 1)
                y = down[expert].astype(np.float64) @ activated + w[p + "mlp.experts.down_proj_bias"][expert]
                moe[position] += weight * y
        x = x + moe
    x = rms_norm(x, w["model.norm.weight"], eps)
    return x @ w["lm_head.weight"].T


def dump_json_compact_int_lists(value: dict) -> str:
    """Indented JSON with each list of token ids kept on one line."""
    text = json.dumps(value, indent=2)
    return re.sub(r"\[[\d,\s]+\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def versions() -> dict:
    return {"transformers_version": transformers.__version__, "torch_version": torch.__version__}


def make_case(case: Case, out_root: Path, seed: int | None) -> dict:
    validate_case(case)
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # one thread: the same reduction order, hence the same bytes, on every run
    target = out_root / case.name
    out_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{case.name}.", dir=out_root))
    staging.chmod(0o755)
    try:
        (staging / "config.json").write_text(json.dumps(hf_config_dict(case), indent=2) + "\n")
        config = GptOssConfig.from_pretrained(staging)
        notes = check_config_read_back(case, config)
        notes.append(check_rotary_tables(case, build_model(config), hf_config_dict(case)))
        first_seed = case.seed if seed is None else seed
        attempt = None
        for candidate in range(first_seed, first_seed + MAX_SEED_ATTEMPTS):
            attempt, reason = try_seed(case, config, candidate)
            if attempt is not None:
                break
            print(f"  [{case.name}] seed {candidate} rejected: {reason}")
        if attempt is None:
            raise FixtureError(f"case {case.name}: no seed in {MAX_SEED_ATTEMPTS} tries passed the margin checks")
        notes += attempt.notes
        notes += sensitivity_notes(case, config, attempt)
        files = write_checkpoint(staging, case, attempt.tensors)
        notes += shard_notes(staging, files)
        notes += prove_layout(staging, case, attempt, files)

        (staging / "logits.bin").write_bytes(attempt.logits.tobytes())
        golden = {
            "case": case.name,
            "description": case.description,
            "tokens": attempt.tokens,
            "num_positions": len(attempt.tokens),
            "vocab_size": case.vocab_size,
            "logits_file": "logits.bin",
            "max_abs_logit": round(float(np.abs(attempt.logits).max()), 4),
            "greedy": {"prompt": attempt.prompt, "generated": attempt.generated},
            "checks": {
                "greedy_min_top1_top2_gap_fraction_of_range": GREEDY_RELATIVE_MARGIN,
                "router_min_topk_gap": ROUTER_MARGIN,
            },
            **versions(),
            "seed": attempt.seed,
        }
        (staging / "golden.json").write_text(dump_json_compact_int_lists(golden))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"[{case.name}] seed {attempt.seed} -> {target}")
    for note in notes:
        print(f"  {note}")
    return golden


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory that receives one sub-directory per case")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="case to make (repeatable); default all")
    parser.add_argument("--seed", type=int, help="first seed to try (default: the case's own)")
    args = parser.parse_args(argv)
    names = args.case or list(CASES)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    try:
        for name in names:
            make_case(CASES[name], args.out, args.seed)
    except FixtureError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
