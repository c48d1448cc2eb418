#!/usr/bin/env bash
# A real OpenAI client against `ossterm serve`: installs the `openai` Python package into a venv
# (target/openai-venv, reused), starts the server on a free loopback port with the synthetic tiny
# model, lists the models, streams a chat completion (reasoning and content deltas, usage) and
# asks for one without streaming, sends function tools and a tool-call exchange, streams a
# Responses API reply and function tools with a call's output as input items, then sends
# SIGTERM while a stream
# runs and checks that the stream finishes and the server exits cleanly.
# Skips (exit 0, with a message) when python3 or its venv module is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v python3 >/dev/null 2>&1; then
    echo "openai client check: python3 not installed, skipping"
    exit 0
fi
venv=target/openai-venv
if [ ! -x "$venv/bin/python" ]; then
    if ! python3 -m venv "$venv" >/dev/null 2>&1; then
        rm -rf "$venv"
        echo "openai client check: python3 cannot create a venv (python3-venv missing), skipping"
        exit 0
    fi
fi
"$venv/bin/python" -c "import openai" 2>/dev/null \
    || timeout 300 "$venv/bin/pip" install --quiet --disable-pip-version-check "openai>=1.40,<3"

cargo build --release --quiet
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log=$(mktemp)
target/release/ossterm serve --synthetic tiny --threads 2 --host 127.0.0.1 --port "$port" \
    --parallel 2 --context 2048 >"$log" 2>&1 &
server=$!
cleanup() { kill "$server" 2>/dev/null || true; rm -f "$log"; }
trap cleanup EXIT

timeout 120 "$venv/bin/python" - "$port" <<'PY'
import sys, time, urllib.request
import openai
from openai import OpenAI

base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(300):
    try:
        urllib.request.urlopen(base + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the server did not come up")

client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=60)
models = [m.id for m in client.models.list()]
assert client.models.retrieve(models[0]).id == models[0]
assert models == ["synthetic-tiny"], models

reasoning, content, finish, usage, chunks = "", "", None, None, 0
stream = client.chat.completions.create(
    model=models[0],
    messages=[{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "What is the capital of France?"}],
    max_tokens=120, seed=1, stream=True, stream_options={"include_usage": True},
    extra_body={"reasoning_effort": "low"},
)
for chunk in stream:
    chunks += 1
    if chunk.usage is not None:
        usage = chunk.usage
    if not chunk.choices:
        continue
    delta = chunk.choices[0].delta
    extra = delta.model_extra or {}
    piece = extra.get("reasoning_content")
    assert piece == extra.get("reasoning"), "both reasoning names carry the same text"
    reasoning += piece or ""
    content += delta.content or ""
    finish = chunk.choices[0].finish_reason or finish
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens > 0, usage
assert usage.prompt_tokens_details is not None
assert reasoning or content, "the reply carried no text"
print(f"openai client check: streamed {chunks} chunks, {len(reasoning)} chars of reasoning, "
      f"{len(content)} of content, finish {finish}, usage {usage.prompt_tokens}+{usage.completion_tokens} "
      f"(cached {usage.prompt_tokens_details.cached_tokens})")

reply = client.chat.completions.create(
    model=models[0], messages=[{"role": "user", "content": "hi"}], max_tokens=8)
assert reply.choices[0].finish_reason in ("stop", "length")
assert reply.usage.completion_tokens <= 8

scored = client.chat.completions.create(
    model=models[0], messages=[{"role": "system", "content": "Answer briefly."},
                               {"role": "user", "content": "What is the capital of France?"}],
    max_tokens=120, seed=1, reasoning_effort="low", logprobs=True, top_logprobs=2)
entries = scored.choices[0].logprobs.content
assert entries and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries), scored
rebuilt = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
assert rebuilt == scored.choices[0].message.content, (rebuilt, scored.choices[0].message.content)
print(f"openai client check: logprobs for {len(entries)} answer tokens")

# Function calling as an agent sends it: tools, then the exchange after a call (the assistant's
# tool_calls with content None, the tool's answer). Random weights make up their reply, so this
# checks what the client sends is taken and what comes back parses, not that the model calls.
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
asked = [{"role": "user", "content": "Weather in Oslo?"}]
reply = client.chat.completions.create(model=models[0], messages=asked, tools=tools,
                                       tool_choice="auto", max_tokens=16, seed=3)
assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls"), reply.choices[0].finish_reason
answered = asked + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'}]
calls, pieces = 0, 0
for chunk in client.chat.completions.create(model=models[0], messages=answered, tools=tools,
                                            max_tokens=16, seed=3, stream=True):
    pieces += 1
    if chunk.choices and chunk.choices[0].delta.tool_calls:
        calls += 1
# A named tool_choice opens that call in the prompt: even random weights reply with it.
forced = client.chat.completions.create(
    model=models[0], messages=asked, tools=tools, max_tokens=8, seed=3,
    tool_choice={"type": "function", "function": {"name": "get_weather"}})
call = forced.choices[0].message.tool_calls[0]
assert call.function.name == "get_weather" and call.id.startswith("call_"), forced
print(f"openai client check: tools taken (a reply finishing {reply.choices[0].finish_reason}; {calls} call deltas; "
      f"after a tool answer {pieces} chunks); a named tool_choice replied with a {call.function.name} call")

# The Responses API: streamed semantic events, the reasoning item and the message.
kinds, reasoning, text, final = [], "", "", None
# (`client.responses.stream` would read only `response.completed`, not the `response.incomplete`
# a reply cut at max_output_tokens ends with, so the raw events are read.)
for event in client.responses.create(
    model=models[0], instructions="Answer briefly.", input="What is the capital of France?",
    reasoning={"effort": "low"}, max_output_tokens=120, stream=True, extra_body={"seed": 1},
):
    kinds.append(event.type)
    if event.type == "response.reasoning_text.delta":
        reasoning += event.delta
    elif event.type == "response.output_text.delta":
        text += event.delta
    elif event.type in ("response.completed", "response.incomplete"):
        final = event.response
assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
assert final.status in ("completed", "incomplete"), final.status
assert final.output_text == text, (final.output_text, text)
items = {item.type: item for item in final.output}
if reasoning:
    assert items["reasoning"].content[0].text == reasoning
assert final.usage.output_tokens > 0 and final.usage.input_tokens_details is not None
whole = client.responses.create(model=models[0], input=[{"role": "user", "content": "hi"}],
                                max_output_tokens=8)
assert whole.status in ("completed", "incomplete") and whole.usage.output_tokens <= 8
print(f"openai client check: responses streamed {len(kinds)} events, {len(reasoning)} chars of "
      f"reasoning, {len(text)} of output text, status {final.status}")

# A kept response continued by id, retrieved and deleted, as the openai package does it
# (instructions and reasoning effort are not carried over: the same ones are sent again).
follow = client.responses.create(model=models[0], instructions="Answer briefly.", input="And Germany?",
                                 reasoning={"effort": "low"}, previous_response_id=final.id,
                                 max_output_tokens=8)
assert follow.usage.input_tokens > final.usage.input_tokens, (follow.usage, final.usage)
# The same prompt as the whole conversation sent as input.
conversation = [{"role": "user", "content": "What is the capital of France?"}]
conversation += [item.model_dump(exclude_none=True) for item in final.output]
conversation.append({"role": "user", "content": "And Germany?"})
explicit = client.responses.create(model=models[0], instructions="Answer briefly.", input=conversation,
                                   reasoning={"effort": "low"}, max_output_tokens=8, store=False)
assert explicit.usage.input_tokens == follow.usage.input_tokens, (explicit.usage, follow.usage)
assert not explicit.store
assert client.responses.retrieve(follow.id).id == follow.id
client.responses.delete(final.id)
try:
    client.responses.retrieve(final.id)
    raise AssertionError("a deleted response was retrieved")
except openai.NotFoundError:
    pass
print(f"openai client check: previous_response_id reused {follow.usage.input_tokens_details.cached_tokens} "
      f"cached tokens of {follow.usage.input_tokens}; retrieve and delete")

# Function tools in the Responses API, as the Agents SDK sends them: the flat tool form, then a
# call and its output as input items; the reply must parse with the tools echoed.
flat_tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}, "strict": False}]
items = [{"role": "user", "content": "Weather in Oslo?"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 3}'}]
answer = client.responses.create(model=models[0], input=items, tools=flat_tools, max_output_tokens=16,
                                 extra_body={"seed": 3})
named = client.responses.create(model=models[0], input="Weather in Oslo?", tools=flat_tools,
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=8)
assert [item.type for item in named.output][-1] == "function_call", named.output
assert named.output[-1].name == "get_weather", named.output
assert answer.status in ("completed", "incomplete"), answer.status
assert [t.name for t in answer.tools] == ["get_weather"], answer.tools
kinds = [event.type for event in client.responses.create(
    model=models[0], input=items, tools=flat_tools, max_output_tokens=16, stream=True)]
assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
print(f"openai client check: responses with function tools and a call's output: {answer.status}, "
      f"{len(kinds)} streamed events")

# The legacy completions API: a raw prompt continued as text, whole and streamed alike (greedy),
# with the legacy logprobs object.
whole = client.completions.create(model=models[0], prompt="Once upon a time", max_tokens=12,
                                  temperature=0, logprobs=2)
choice = whole.choices[0]
assert choice.finish_reason in ("stop", "length") and whole.usage.prompt_tokens == 4, whole
assert "".join(choice.logprobs.tokens) == choice.text, choice.logprobs
pieces = [c.choices[0].text for c in client.completions.create(
    model=models[0], prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if c.choices]
assert "".join(pieces) == choice.text, (pieces, choice.text)
print(f"openai client check: completions gave {whole.usage.completion_tokens} tokens "
      f"({len(choice.text)} chars), streamed in {len(pieces)} chunks")

# A log-likelihood as lm-evaluation-harness asks for it: the prompt echoed and scored at every
# position (token_logprobs[0] is null), then one greedy token; the sum over a continuation.
context, continuation = "The capital of France is", " Paris"
scored = client.completions.create(model=models[0], prompt=context + continuation, max_tokens=1,
                                   temperature=0, logprobs=1, echo=True)
lp = scored.choices[0].logprobs
ctxlen = scored.usage.prompt_tokens - 1
assert lp.token_logprobs[0] is None and len(lp.tokens) == scored.usage.prompt_tokens + 1, lp
assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
loglikelihood = sum(lp.token_logprobs[ctxlen:-1])
greedy = all(t == max(top.values()) for t, top in
             zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]))
print(f"openai client check: echo + logprobs scored {len(lp.tokens) - 1} prompt tokens; "
      f"log-likelihood of the continuation {loglikelihood:.2f}, greedy {greedy}")

# Structured outputs: a schema every random reply can finish, held in completions (vLLM's
# response_format) and in a chat's final channel (continuing a prefilled answer).
import json
verdict = {"name": "verdict", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["answer", "sure"],
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}}}}
done = client.completions.create(model=models[0], prompt="Verdict:", max_tokens=60, seed=2,
                                 extra_body={"response_format": {"type": "json_schema", "json_schema": verdict}})
value = json.loads(done.choices[0].text)
assert done.choices[0].finish_reason == "stop" and value["answer"] in ("yes", "no"), done
answer = client.chat.completions.create(
    model=models[0], max_tokens=60, seed=3,
    messages=[{"role": "user", "content": "Is it?"}, {"role": "assistant", "content": '{"answer":"'}],
    response_format={"type": "json_schema", "json_schema": verdict},
    extra_body={"continue_final_message": True})
value = json.loads('{"answer":"' + answer.choices[0].message.content)
assert isinstance(value["sure"], bool), answer
# A strict function (as the Agents SDK sends them) forced by tool_choice: conforming arguments.
strict = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"enum": ["Oslo", "Lima"]}}}}}]
called = client.chat.completions.create(
    model=models[0], messages=asked, tools=strict, max_tokens=60, seed=4,
    tool_choice={"type": "function", "function": {"name": "get_weather"}})
arguments = json.loads(called.choices[0].message.tool_calls[0].function.arguments)
assert called.choices[0].finish_reason == "tool_calls" and arguments["city"] in ("Oslo", "Lima"), called
print(f"openai client check: structured outputs {done.choices[0].text} and {value}; "
      f"strict call arguments {arguments}")
two = client.completions.create(model=models[0], prompt="Rivers:", n=2, max_tokens=6, seed=5)
assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 12, two
print(f"openai client check: n=2 gave choices {[c.text for c in two.choices]}")
PY

# Draining: SIGTERM while a stream runs lets it finish (a chat completion that ends normally),
# refuses new connections, and the server exits with status 0.
timeout 120 "$venv/bin/python" - "$port" "$server" <<'PY'
import os, signal, sys, threading
from openai import OpenAI

client = OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused", timeout=60)
stream = client.chat.completions.create(
    model="synthetic-tiny", messages=[{"role": "user", "content": "go on"}],
    max_tokens=400, stream=True)
finish, pieces = None, 0
for chunk in stream:
    if pieces == 0:
        os.kill(int(sys.argv[2]), signal.SIGTERM)
    pieces += 1
    if chunk.choices:
        finish = chunk.choices[0].finish_reason or finish
assert finish in ("stop", "length"), f"the drained stream ended without a finish reason ({pieces} chunks)"
print(f"openai client check: a stream running at SIGTERM finished ({pieces} chunks, {finish})")
PY

kill -TERM "$server" 2>/dev/null || true
status=0
wait "$server" || status=$?
if [ "$status" -ne 0 ]; then
    cat "$log"
    echo "openai client check: the server exited with status $status after SIGTERM"
    exit 1
fi
echo "openai client check: passed (server drained and stopped cleanly on SIGTERM)"
