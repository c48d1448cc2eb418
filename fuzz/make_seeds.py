#!/usr/bin/env python3
"""Writes the committed seed corpora of the fuzz targets (fuzz/seeds/TARGET/) from the test fixtures
and hand-made cases, next to the `found-*` inputs that once crashed a target. Deterministic:
rerunning gives the same files. Run from the repository root:

    python3 fuzz/make_seeds.py
"""

import hashlib
import json
import random
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SEEDS = ROOT / "fuzz" / "seeds"


def write(target, cases):
    folder = SEEDS / target
    folder.mkdir(parents=True, exist_ok=True)
    # `found-*` files are inputs that once crashed a target (kept as regression seeds).
    for old in folder.iterdir():
        if not old.name.startswith("found-"):
            old.unlink()
    for name, data in cases:
        if isinstance(data, str):
            data = data.encode()
        (folder / name).write_bytes(data)


def app_config():
    cases = [("config.example.toml", (ROOT / "config.example.toml").read_text())]
    hand = {
        "empty": "",
        "engine": "[engine]\nthreads = 4\nweight_format = \"q8\"\nkv_cache = \"f16\"\ncontext_limit = 4096\n",
        "sampling": "[sampling]\ntemperature = 0.7\ntop_p = 0.9\ntop_k = 40\nmin_p = 0.05\nmax_tokens = 512\nseed = 7\n",
        "chat": "[chat]\nreasoning_effort = \"high\"\nkeep_reasoning_in_context = true\n"
        "system_prompt = '''multi\nline'''\ndeveloper_instructions = \"\\u00e9\\t\"\n",
        "model": "[model]\npath = \"models/gpt-oss-20b\"\nsynthetic = \"tiny\"\n[paths]\nchats_dir = \"chats\"\n",
        "unknown_key": "[engine]\nthreds = 4\n",
        "bad_value": "[sampling]\ntemperature = -1.5\n",
        "bad_type": "[engine]\nthreads = \"four\"\n",
        "dotted": "engine.threads = 2\nsampling = { top_k = 3 }\n",
        "duplicate": "[engine]\nthreads = 1\n[engine]\nthreads = 2\n",
        "arrays": "[[engine]]\nthreads = 1\n",
        "unterminated": "[chat]\nsystem_prompt = \"abc\n",
        "huge_int": "[engine]\ncontext_limit = 99999999999999999999\n",
        "crlf": "[engine]\r\nthreads = 3\r\n",
    }
    cases += sorted(hand.items())
    write("app_config", cases)


def conversation_file():
    cases = sorted(
        (path.name, path.read_bytes())
        for path in (FIXTURES / "harmony").glob("*.conversation.json")
    )
    hand = {
        "empty_object": "{}",
        "bom": "\ufeff{\"messages\": []}",
        "extras": json.dumps(
            {
                "system": {"identity": None, "theme": {"dark": True}},
                "title": "t",
                "messages": [
                    {"role": "user", "content": "hi", "sent_at": 1.5e300},
                    {"role": "assistant", "channel": "commentary", "content": "<|call|>", "n": -0},
                ],
            }
        ),
        "bad_role": "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}",
        "wrong_types": "{\"system\": [], \"messages\": {}}",
        "duplicate_key": "{\"messages\": [], \"messages\": []}",
        "escapes": "{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud83d\\ude00 \\u0000 \\r\\n\"}]}",
        "deep": "[" * 200 + "]" * 200,
        "numbers": "{\"x\": [1e-400, 18446744073709551616, -9223372036854775809, 0.1]}",
    }
    cases += sorted(hand.items())
    write("conversation_file", cases)


def arbitrary_bytes(count, seed):
    rng = random.Random(seed)
    return [(f"random_{i}", bytes(rng.randrange(256) for _ in range(rng.randrange(16, 512))))
            for i in range(count)]


def ids_as_bytes(ids):
    return b"".join(struct.pack("<I", i)[:3] for i in ids)


def harmony_parser():
    cases = []
    for path in sorted((FIXTURES / "harmony").glob("*.expected.json")):
        ids = json.loads(path.read_text())["ids"]
        cases.append((path.name.replace(".expected.json", ".ids"), ids_as_bytes(ids)))
    # What a model generates after `<|start|>assistant`: analysis, then the final answer.
    generated = [200005, 35644, 200008, 13225, 2375, 200007, 200006, 173781, 200005, 17196, 200008,
                 12194, 1354, 200002]
    cases.append(("analysis_then_final", ids_as_bytes(generated)))
    cases.append(("reset_between_turns", ids_as_bytes(generated) + b"\xff\xff\xff"
                  + ids_as_bytes(generated[6:])))
    cases.append(("long_header", ids_as_bytes([13225] * 70 + [200008, 2375, 200007])))
    cases.append(("split_utf8", ids_as_bytes([200005, 17196, 200008] + list(range(128, 200)))))
    write("harmony_parser", cases)


def tokenize_decode():
    cases = [("hello", "200006,1428"), ("spaces", " 1 , 2,3 "), ("empty", ""), ("comma", ","),
             ("max_u32", "4294967295"), ("past_vocab", "201088"), ("negative", "-1"),
             ("special", "199998,200012,201087"), ("plus", "+5"), ("split_char", "9468,9468,9468")]
    for path in sorted((FIXTURES / "harmony").glob("*.expected.json"))[:4]:
        ids = json.loads(path.read_text())["ids"]
        cases.append((path.name.replace(".expected.json", ".ids"), ",".join(map(str, ids))))
    write("tokenize_decode", cases)


def raw_container(files):
    out = b""
    for name, data in files:
        name = name.encode()
        out += bytes([len(name)]) + name + struct.pack("<I", len(data)) + data
    return b"\x01" + out


def shard_head(path, keep_data):
    """The shard's header and the first `keep_data` bytes of its data."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[: 8 + length + keep_data]


def checkpoint():
    cases = []
    for case in ["tiny_single", "tiny_sharded", "tiny_gqa8", "small_wide"]:
        folder = FIXTURES / case
        files = [("config.json", (folder / "config.json").read_bytes())]
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files.append((index.name, index.read_bytes()))
        for shard in sorted(folder.glob("*.safetensors")):
            files.append((shard.name, shard_head(shard, 64)))
        cases.append((f"raw_{case}", raw_container(files)))
    # A complete single-file checkpoint small enough for a seed: one tensor.
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "model.norm.weight": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}})
    shard = struct.pack("<Q", len(header)) + header.encode() + bytes(range(8))
    cases.append(("raw_one_tensor", raw_container([("config.json", (FIXTURES / "tiny_single" / "config.json").read_bytes()),
                                                    ("model.safetensors", shard)])))
    # Built form (even first byte): the bytes drive the shape and the edits.
    cases.append(("built_minimal", b"\x00"))
    cases += [(name.replace("random", "built"), b"\x00" + data) for name, data in arbitrary_bytes(8, 10)]
    write("checkpoint", cases)


def gguf():
    gguf_dir = FIXTURES / "gguf"
    # Raw form (odd first byte): a whole small GGUF written by tools/make_gguf.py, and the head of
    # another (header, metadata and tensor table, data cut off).
    cases = [
        ("raw_tiny_single_q8_0", b"\x01" + (gguf_dir / "tiny_single_q8_0.gguf").read_bytes()),
        ("raw_tiny_single_head", b"\x01" + (gguf_dir / "tiny_single.gguf").read_bytes()[:16384]),
    ]
    # Built form (even first byte): the bytes drive the shape and the edits.
    cases.append(("built_minimal", b"\x00"))
    cases += [(name.replace("random", "built"), b"\x00" + data) for name, data in arbitrary_bytes(8, 10)]
    write("gguf", cases)


def server_request():
    # First byte: bit 0 picks the endpoint (0 chat completions, 1 responses; with bit 3 set,
    # 0 tokenize, 1 detokenize; bit 4 set: completions), bits 1-2 the context (16, 96, 512, 4096
    # tokens); the rest is the body.
    chat = {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
        "stream": True, "stream_options": {"include_usage": True}, "stop": ["a", "b"],
        "max_tokens": 30, "temperature": 0.5, "top_p": 0.9, "seed": 3, "reasoning_effort": "low",
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "logit_bias": {"100": 5, "200005": -100}}
    small = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5}
    tools = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "need it", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"t\": 3}"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather.\nNow.",
            "parameters": {"type": "object", "description": "Where.", "properties": {
                "city": {"type": "string", "title": "City", "examples": ["Oslo"]},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                "days": {"type": ["integer", "null"]},
                "at": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"lat": {"type": "number"}}}]}},
                "required": ["city"]}}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "logprobs": True, "top_logprobs": 2}
    text = {"model": "m", "input": "hi", "instructions": "Be brief.",
            "reasoning": {"effort": "high"}, "max_output_tokens": 40, "stream": True,
            "temperature": 0.7}
    items = {"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "developer", "content": "c"}], "seed": 1}
    completion = {"model": "m", "prompt": "<|start|>user<|message|>hi<|end|><|start|>assistant",
                  "max_tokens": 20, "stream": True, "stop": "x", "logprobs": 2, "temperature": 0.2,
                  "logit_bias": {"5": 1}}
    schema = {"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}},
        "required": ["answer"], "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}}}
    structured = {"messages": [{"role": "user", "content": "ok?"},
                               {"role": "assistant", "content": "{\"answer\":"}],
                  "continue_final_message": True, "max_tokens": 50,
                  "response_format": {"type": "json_schema", "json_schema": {
                      "name": "verdict", "description": "Yes or no.", "strict": True, "schema": schema}}}
    structured_text = {"input": "ok?", "text": {"format": {"type": "json_schema", "name": "v", "schema": schema}}}
    structured_completion = {"prompt": "JSON:", "response_format": {"type": "json_object"}}
    cases = [(name, bytes([selector]) + json.dumps(body).encode())
             for name, selector, body in [("chat_full.json", 6, chat),
                                          ("chat_small_context.json", 2, small),
                                          ("chat_tools.json", 6, tools),
                                          ("tokenize_chat.json", 8, {"messages": chat["messages"], "with_pieces": True}),
                                          ("tokenize_text.json", 14, {"content": "hi <|end|> there"}),
                                          ("detokenize.json", 9, {"tokens": [200006, 17360, 1428]}),
                                          ("responses_text.json", 7, text),
                                          ("responses_items.json", 7, items),
                                          ("completion_text.json", 22, completion),
                                          ("chat_structured.json", 6, structured),
                                          ("responses_structured.json", 7, structured_text),
                                          ("responses_previous.json", 7, {"input": "and then?", "previous_response_id": "resp_1", "store": False}),
                                          ("completion_structured.json", 22, structured_completion),
                                          ("completion_prompts.json", 22, {"prompt": ["a", "<|start|>b"], "n": 2, "echo": True, "seed": 4}),
                                          ("completion_tokens.json", 18, {"prompt": [[200006, 17360, 200008, 1428]], "max_tokens": 8, "echo": True, "skip_special_tokens": False}),
                                          ("completion_scored.json", 22, {"prompt": [976, 9290, 328, 10128], "echo": True, "logprobs": 1, "max_tokens": 0})]]
    write("server_request", cases)


def main():
    app_config()
    conversation_file()
    write("conversation_roundtrip", arbitrary_bytes(8, 20))
    harmony_parser()
    tokenize_decode()
    checkpoint()
    gguf()
    server_request()
    total = sum(1 for _ in SEEDS.rglob("*") if _.is_file())
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SEEDS.rglob("*")) if p.is_file()))
    print(f"{total} seed files, sha256 {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
