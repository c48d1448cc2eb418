#!/usr/bin/env python3
"""Render chat-completions requests with function tools through openai-harmony, as a server for
gpt-oss does (vLLM's conversion of OpenAI messages into harmony messages), and write the golden
prompts to tests/fixtures/harmony/function_tools.json.

Each case is {"name", "date", "request": the OpenAI request body, "ids": the generation prompt,
"text": the same decoded, for reading}. tests/serve.rs renders every request with ossterm's
server code and compares id for id.

The conversion (what `ossterm serve` does too):
  - system and developer messages: joined by a blank line into harmony's developer instructions;
  - `tools` (unless tool_choice is "none"): the developer message's `functions` namespace;
  - user: a user message; assistant: its `reasoning_content` as an analysis message, then its
    content on the final channel, or, beside `tool_calls`, as a commentary preamble followed by
    one message per call (channel commentary, recipient functions.NAME, content type json, ending
    in <|call|>);
  - tool: a message from functions.NAME (the name of the call its tool_call_id answers) to the
    assistant on the commentary channel.

Requirements: `pip install openai-harmony==0.0.8`; the vocabulary as for make_harmony_fixtures.py
(--encodings-dir or TIKTOKEN_ENCODINGS_BASE).
"""

import json
from pathlib import Path

from make_harmony_fixtures import harmony_arguments

WEATHER_TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["location"],
        },
    }},
    {"type": "function", "function": {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {
            "type": "object",
            "properties": {
                "locations": {
                    "type": "array",
                    "items": {"type": "string"},
                    "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]',
                },
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["locations"],
        },
    }},
]

SEARCH_TOOL = {"type": "function", "function": {
    "name": "search_files",
    "description": "Searches the project.\nReturns matching lines.",
    "parameters": {
        "type": "object",
        "description": "What to look for.",
        "properties": {
            "query": {"type": "string", "title": "Query", "description": "Text or a regular expression.",
                      "examples": ["fn main", "TODO"]},
            "limit": {"type": "integer", "default": 20},
            "case": {"type": ["string", "null"]},
            "paths": {"type": "array"},
            "scope": {
                "description": "Where to search.",
                "oneOf": [
                    {"type": "string", "enum": ["all", "tests"], "description": "Where to search."},
                    {"type": "object", "properties": {"dir": {"type": "string"}}, "required": ["dir"],
                     "description": "One folder."},
                ],
            },
            "options": {
                "type": "object",
                "properties": {"hidden": {"type": "boolean", "nullable": True}, "depth": {"type": "number"}},
            },
            "anything": {},
        },
        "required": ["query"],
    },
}}


def cases():
    weather_call = {"role": "assistant", "reasoning_content": "Need to use function get_current_weather.",
                    "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                        "name": "get_current_weather", "arguments": '{"location":"San Francisco"}'}}]}
    weather_answer = {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'}
    return [
        {"name": "docs_weather_tools", "date": "2025-06-28", "request": {
            "messages": [{"role": "system", "content": "Use a friendly tone."},
                         {"role": "user", "content": "What is the weather like in SF?"}],
            "tools": WEATHER_TOOLS, "reasoning_effort": "high"}},
        {"name": "tool_answer_keeps_the_reasoning", "date": "2025-06-28", "request": {
            "messages": [{"role": "system", "content": "Use a friendly tone."},
                         {"role": "user", "content": "What is the weather like in SF?"},
                         weather_call, weather_answer],
            "tools": WEATHER_TOOLS, "tool_choice": "auto"}},
        {"name": "after_the_answer_the_reasoning_drops", "date": "2025-06-28", "request": {
            "messages": [{"role": "user", "content": "What is the weather like in SF?"},
                         weather_call, weather_answer,
                         {"role": "assistant", "content": "Sunny, 20 degrees."},
                         {"role": "user", "content": "Thanks! And tomorrow?"}],
            "tools": WEATHER_TOOLS}},
        {"name": "schema_features_and_a_preamble", "date": None, "request": {
            "messages": [{"role": "developer", "content": "You help with code."},
                         {"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Find the main function."},
                         {"role": "assistant", "content": "Searching now.", "tool_calls": [
                             {"id": "c", "type": "function",
                              "function": {"name": "search_files", "arguments": '{"query": "fn main"}'}}]},
                         {"role": "tool", "tool_call_id": "c", "content": "src/main.rs:1: fn main() {"}],
            "tools": [SEARCH_TOOL], "reasoning_effort": "low"}},
        {"name": "tool_choice_none_defines_no_functions", "date": "2025-06-28", "request": {
            "messages": [{"role": "user", "content": "Hi"}], "tools": WEATHER_TOOLS, "tool_choice": "none"}},
    ]


def text_of(content):
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part.get("type") == "text")


def harmony_prompt(case, harmony, encoding):
    request = case["request"]
    system = harmony.SystemContent.new().with_reasoning_effort(
        harmony.ReasoningEffort(request.get("reasoning_effort", "medium").capitalize()))
    if case["date"] is not None:
        system = system.with_conversation_start_date(case["date"])
    messages = [harmony.Message.from_role_and_content(harmony.Role.SYSTEM, system)]
    instructions = [text_of(m["content"]) for m in request["messages"]
                    if m["role"] in ("system", "developer") and text_of(m["content"]).strip()]
    tools = [] if request.get("tool_choice") == "none" else request.get("tools", [])
    if instructions or tools:
        developer = harmony.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([
                harmony.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                            parameters=t["function"].get("parameters"))
                for t in tools])
        messages.append(harmony.Message.from_role_and_content(harmony.Role.DEVELOPER, developer))
    names = {}
    for message in request["messages"]:
        role, text = message["role"], text_of(message.get("content"))
        if role == "user":
            messages.append(harmony.Message.from_role_and_content(harmony.Role.USER, text))
        elif role == "assistant":
            if message.get("reasoning_content"):
                messages.append(harmony.Message.from_role_and_content(
                    harmony.Role.ASSISTANT, message["reasoning_content"]).with_channel("analysis"))
            calls = message.get("tool_calls") or []
            if not calls:
                messages.append(harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, text)
                                .with_channel("final"))
                continue
            if text:
                messages.append(harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, text)
                                .with_channel("commentary"))
            for call in calls:
                name = call["function"]["name"]
                names[call["id"]] = name
                messages.append(harmony.Message.from_role_and_content(harmony.Role.ASSISTANT,
                                                                      call["function"]["arguments"])
                                .with_channel("commentary").with_recipient(f"functions.{name}")
                                .with_content_type("json"))
        elif role == "tool":
            name = names[message["tool_call_id"]]
            messages.append(harmony.Message.from_author_and_content(
                harmony.Author.new(harmony.Role.TOOL, f"functions.{name}"), text)
                .with_recipient("assistant").with_channel("commentary"))
    conversation = harmony.Conversation.from_messages(messages)
    return encoding.render_conversation_for_completion(conversation, harmony.Role.ASSISTANT)


def main():
    harmony, encoding, path = harmony_arguments(
        __doc__, Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "harmony" / "function_tools.json")
    out = []
    for case in cases():
        ids = harmony_prompt(case, harmony, encoding)
        out.append({**case, "ids": ids, "text": encoding.decode(ids)})
        print(f"{case['name']}: {len(ids)} ids")
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
