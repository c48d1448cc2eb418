//! The OpenAI Responses API (`POST /v1/responses`), the subset a chat client or an agent uses:
//! `input` as a string or a list of messages, function calls and their outputs, `instructions`,
//! `tools` (functions), `tool_choice`, `reasoning.effort`, `max_output_tokens`, `temperature`,
//! `top_p`, `stream` (and `seed`, as in chat completions). A request is turned into the
//! chat-completions form and checked by the same code ([`prepare_chat`]); the reply is a
//! `response` object whose output holds a reasoning item (the analysis channel), a message (the
//! final channel, or a preamble) and a function call when the model made one.

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{
    content_text, parse_json, prepare_chat, ApiError, CalledFunction, ChatCompletionRequest,
    ChatJob, Content, FunctionParam, Message, ToolCallParam, ToolChoice, ToolParam,
};

/// The text parts the Responses API's items carry.
const INPUT_TEXT_KINDS: &[&str] = &["input_text", "output_text", "text"];
use super::reply::{logprob_json, LogprobEntry, ToolCallDelta};
use super::scheduler::{FinishReason, Usage};
use super::structured::TextFormatField;
use crate::chat::Tokenizer;

/// `input`: one user message as a string, or a list of items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// An input item: a message, a function call the model made and its output, or a reasoning item
/// a client sends back from an earlier reply (kept before the call it led to, as gpt-oss
/// expects while a tool exchange runs; dropped elsewhere, as gpt-oss does not see earlier turns'
/// reasoning); other kinds are refused.
#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    /// `function_call` and `function_call_output`: the call's id.
    #[serde(default)]
    pub call_id: Option<String>,
    /// `function_call`: the function and its arguments (JSON text).
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub arguments: Option<Value>,
    /// `function_call_output`: what the function returned.
    #[serde(default)]
    pub output: Option<Content>,
}

/// `tools[i]`: a function (the Responses API's flat form of a chat-completions tool).
#[derive(Debug, Deserialize)]
pub struct ResponsesTool {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub parameters: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
pub struct ReasoningParam {
    #[serde(default)]
    pub effort: Option<String>,
}

/// The fields of a Responses request this server reads; others are ignored.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: Input,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub reasoning: Option<ReasoningParam>,
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Not in OpenAI's Responses API; taken as chat completions take it, for repeatable replies.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Resolved by [`continue_previous`] before the request is parsed here.
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// Keep the response for `previous_response_id` and retrieval (OpenAI's default: true).
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<ResponsesTool>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// `"message.output_text.logprobs"` asks for the answer tokens' log-probabilities (other
    /// values are accepted and add nothing).
    #[serde(default)]
    pub include: Option<Vec<String>>,
    /// The likeliest alternatives per answer token (0-20); more than 0 asks for log-probabilities
    /// too.
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    /// `text.format`: plain text, `json_object` or `json_schema` (structured output).
    #[serde(default)]
    pub text: Option<TextParam>,
}

/// The Responses API's `text` settings.
#[derive(Debug, Default, Deserialize)]
pub struct TextParam {
    #[serde(default)]
    pub format: Option<Value>,
}

/// The `include` value that asks for log-probabilities.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// Parses the body; a wrong type or a missing field is an error naming the field's path.
pub fn parse_responses_request(body: &[u8]) -> Result<ResponsesRequest, ApiError> {
    parse_json(body)
}

/// What a reply repeats from its request.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    pub instructions: Option<String>,
    pub effort: String,
    pub max_output_tokens: Option<u64>,
    pub temperature: f32,
    pub top_p: f32,
    /// The request's tools as the reply repeats them, and its tool choice.
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    /// `text.format` as the request gave it (`{"type": "text"}` by default).
    pub format: Value,
    /// Whether the response is kept.
    pub store: bool,
}

/// Checks the request and renders it as a harmony prompt: `instructions` first as developer
/// instructions, then the input messages.
pub fn prepare_responses(
    request: ResponsesRequest,
    tokenizer: &Tokenizer,
    context: usize,
) -> Result<(ChatJob, Echo), ApiError> {
    if let Some(id) = &request.previous_response_id {
        // Not resolved by `continue_previous`: there is no store to look it up in.
        return Err(previous_not_found(id));
    }
    let (tools, echoed_tools) = chat_tools(request.tools.unwrap_or_default())?;
    let echoed_choice = match &request.tool_choice {
        None => json!("auto"),
        Some(ToolChoice::Mode(mode)) => json!(mode),
        Some(ToolChoice::Named(value)) => value.clone(),
    };
    let mut messages = Vec::new();
    // The input item each chat message came from, to name it in errors.
    let mut origins = Vec::new();
    if let Some(instructions) = &request.instructions {
        messages.push(Message {
            role: "developer".into(),
            content: Some(Content::Text(instructions.clone())),
            ..Message::default()
        });
        origins.push(None);
    }
    match request.input {
        Input::Text(text) => {
            messages.push(Message {
                role: "user".into(),
                content: Some(Content::Text(text)),
                ..Message::default()
            });
            origins.push(None);
        }
        Input::Items(items) => {
            // A reasoning item's text waits for what follows it: a function call keeps it.
            let mut reasoning: Option<String> = None;
            for (index, item) in items.into_iter().enumerate() {
                match item.kind.as_deref() {
                    Some("reasoning") => {
                        reasoning = Some(reasoning_text(item.content));
                        continue;
                    }
                    Some("function_call") => {
                        messages.push(call_message(item, index, reasoning.take())?);
                        origins.push(Some(index));
                        continue;
                    }
                    _ => reasoning = None,
                }
                if let Some(message) = input_message(item, index)? {
                    messages.push(message);
                    origins.push(Some(index));
                }
            }
        }
    }
    if messages.iter().all(|m| m.role == "developer") {
        return Err(ApiError::invalid(
            "`input` holds no message: give a string or at least one message",
            Some("input"),
        ));
    }
    let effort = request.reasoning.and_then(|r| r.effort);
    let format = request
        .text
        .and_then(|text| text.format)
        .unwrap_or_else(|| json!({"type": "text"}));
    let response_format =
        serde_json::from_value::<TextFormatField>(format.clone()).map_err(|error| {
            ApiError::invalid(format!("`text.format`: {error}"), Some("text.format"))
        })?;
    let chat = ChatCompletionRequest {
        model: request.model,
        messages,
        stream: request.stream,
        stream_options: None,
        max_tokens: None,
        max_completion_tokens: request.max_output_tokens,
        temperature: request.temperature,
        top_p: request.top_p,
        seed: request.seed,
        stop: None,
        reasoning_effort: effort.clone(),
        n: None,
        tools: Some(tools),
        tool_choice: request.tool_choice,
        parallel_tool_calls: None,
        top_k: None,
        min_p: None,
        logprobs: Some(
            request
                .include
                .iter()
                .flatten()
                .any(|item| item == INCLUDE_LOGPROBS)
                || request.top_logprobs.is_some_and(|top| top > 0),
        ),
        top_logprobs: request.top_logprobs,
        response_format: Some(response_format.into()),
        continue_final_message: None,
        frequency_penalty: None,
        presence_penalty: None,
        logit_bias: None,
    };
    let job = prepare_chat(chat, tokenizer, context)
        .map_err(|error| rename_param(input_param(error, &origins)))?;
    let echo = Echo {
        instructions: request.instructions,
        effort: effort.unwrap_or_else(|| "medium".into()),
        max_output_tokens: request.max_output_tokens,
        temperature: job.sampler.temperature,
        top_p: job.sampler.top_p,
        tools: echoed_tools,
        tool_choice: echoed_choice,
        format,
        store: request.store.unwrap_or(true),
    };
    Ok((job, echo))
}

/// The request in `body` with `previous_response_id` resolved by `conversation` (a kept
/// response's conversation, see [`super::stored::ResponseStore::conversation`]): those items
/// before the request's own input (`instructions` are not carried over, as in OpenAI's API).
/// Also the conversation this response continues, to keep with its output once it is done,
/// unless the request says `store: false`. The lookup is a closure so that the store is locked
/// only while the items are copied, not while the request is parsed.
pub fn continue_previous(
    body: &[u8],
    conversation: impl FnOnce(&str) -> Option<Vec<Value>>,
) -> Result<(ResponsesRequest, Option<Vec<Value>>), ApiError> {
    let mut value: Value = parse_json(body)?;
    let own = match value.get("input") {
        Some(Value::String(text)) => vec![json!({"role": "user", "content": text})],
        Some(Value::Array(items)) => items.clone(),
        // Wrong or missing: the typed parse names it.
        _ => return parse_responses_request(body).map(|request| (request, None)),
    };
    let items;
    if let Some(id) = value.get("previous_response_id").and_then(Value::as_str) {
        let mut kept = conversation(id).ok_or_else(|| previous_not_found(id))?;
        kept.extend(own);
        items = kept;
        value["input"] = Value::Array(items.clone());
        if let Some(fields) = value.as_object_mut() {
            fields.remove("previous_response_id");
        }
    } else {
        items = own;
    }
    let body = serde_json::to_vec(&value).map_err(|error| {
        ApiError::invalid(format!("the request could not be rebuilt: {error}"), None)
    })?;
    let request = parse_responses_request(&body)?;
    let keep = request.store.unwrap_or(true);
    Ok((request, keep.then_some(items)))
}

/// The error for a `previous_response_id` the store does not have, as OpenAI words it.
fn previous_not_found(id: &str) -> ApiError {
    ApiError::invalid(
        format!(
            "previous response with id '{id}' not found (this server keeps the last {} responses in memory, until it stops)",
            super::stored::MAX_RESPONSES
        ),
        Some("previous_response_id"),
    )
    .with_code("previous_response_not_found")
}

/// An error about chat message `k` (`messages[k].tool_call_id`, `messages[k].tool_calls[0].
/// function.name`) names the input item it came from in the Responses API's words.
fn input_param(mut error: ApiError, origins: &[Option<usize>]) -> ApiError {
    let Some(param) = error.param.clone() else {
        return error;
    };
    let Some(rest) = param.strip_prefix("messages[") else {
        return error;
    };
    let Some((number, field)) = rest.split_once(']') else {
        return error;
    };
    let Some(Some(index)) = number.parse::<usize>().ok().and_then(|k| origins.get(k)) else {
        return error;
    };
    let mapped = match field {
        ".tool_call_id" => ".call_id",
        ".tool_calls[0].function.name" | ".name" => ".name",
        other => other,
    };
    let renamed = format!("input[{index}]{mapped}");
    error.message = error
        .message
        .replace(&format!("messages[{number}]{field}"), &renamed)
        .replace(&format!("messages[{number}]"), &format!("input[{index}]"));
    error.param = Some(renamed);
    error
}

/// The request's function tools in the chat-completions form (checked there), and as the reply
/// repeats them. Other kinds (web search, file search, MCP...) are refused.
fn chat_tools(tools: Vec<ResponsesTool>) -> Result<(Vec<ToolParam>, Vec<Value>), ApiError> {
    let mut chat = Vec::with_capacity(tools.len());
    let mut echoed = Vec::with_capacity(tools.len());
    for (index, tool) in tools.into_iter().enumerate() {
        let param = format!("tools[{index}]");
        if tool.kind != "function" {
            return Err(ApiError::invalid(
                format!(
                    "{param}.type is {:?}; this server takes \"function\" tools",
                    tool.kind
                ),
                Some(&format!("{param}.type")),
            ));
        }
        let Some(name) = tool.name else {
            return Err(ApiError::invalid(
                format!("{param} has no `name`"),
                Some(&format!("{param}.name")),
            ));
        };
        echoed.push(
            json!({"type": "function", "name": name, "description": tool.description,
                           "parameters": tool.parameters, "strict": tool.strict.unwrap_or(false)}),
        );
        chat.push(ToolParam {
            kind: tool.kind,
            function: FunctionParam {
                name,
                description: tool.description,
                parameters: tool.parameters,
                strict: tool.strict,
            },
        });
    }
    Ok((chat, echoed))
}

/// A `function_call` item: the assistant's call, with the reasoning item before it (if any).
fn call_message(
    item: InputItem,
    index: usize,
    reasoning: Option<String>,
) -> Result<Message, ApiError> {
    let param = format!("input[{index}]");
    let Some(name) = item.name else {
        return Err(ApiError::invalid(
            format!("{param} is a function call without a `name`"),
            Some(&format!("{param}.name")),
        ));
    };
    Ok(Message {
        role: "assistant".into(),
        reasoning_content: reasoning,
        tool_calls: Some(vec![ToolCallParam {
            id: item.call_id,
            kind: Some("function".into()),
            function: CalledFunction {
                name,
                arguments: item.arguments,
            },
        }]),
        ..Message::default()
    })
}

/// The text of a reasoning item's `reasoning_text` parts (a summary-only item has none).
fn reasoning_text(content: Option<Content>) -> String {
    match content {
        None => String::new(),
        Some(Content::Text(text)) => text,
        Some(Content::Parts(parts)) => parts
            .into_iter()
            .filter(|part| part.kind == "reasoning_text" || part.kind == "text")
            .filter_map(|part| part.text)
            .collect(),
    }
}

/// The chat checks name chat-completions fields; a Responses client knows these names.
fn rename_param(mut error: ApiError) -> ApiError {
    if let Some(param) = error.param.clone() {
        // tools[i].function.name -> tools[i].name; messages[i] -> input[i] (instructions, when
        // given, are message 0, so indices past it are shifted by the caller's count).
        if let Some(rest) = param.strip_prefix("tools[") {
            let flat = format!("tools[{}", rest.replacen("].function.", "].", 1));
            error.message = error.message.replace(&param, &flat);
            error.param = Some(flat);
            return error;
        }
    }
    let renamed = match error.param.as_deref() {
        Some("max_completion_tokens") => Some("max_output_tokens"),
        Some("reasoning_effort") => Some("reasoning.effort"),
        Some("messages") => Some("input"),
        Some("response_format") => Some("text.format"),
        _ => None,
    };
    if let Some(param) = renamed {
        let old = error.param.take().unwrap_or_default();
        error.message = error
            .message
            .replace(&format!("`{old}`"), &format!("`{param}`"));
        error.param = Some(param.into());
    }
    error
}

fn input_message(item: InputItem, index: usize) -> Result<Option<Message>, ApiError> {
    let param = format!("input[{index}]");
    match item.kind.as_deref() {
        None | Some("message") => {}
        Some("function_call_output") => {
            let Some(call_id) = item.call_id else {
                return Err(ApiError::invalid(
                    format!("{param} is a function call output without a `call_id`"),
                    Some(&format!("{param}.call_id")),
                ));
            };
            return Ok(Some(Message {
                role: "tool".into(),
                tool_call_id: Some(call_id),
                content: Some(Content::Text(content_text(
                    item.output,
                    &param,
                    INPUT_TEXT_KINDS,
                )?)),
                ..Message::default()
            }));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                format!("{param} is a {other:?} item; this server takes messages"),
                Some(&format!("{param}.type")),
            ))
        }
    }
    let Some(role) = item.role else {
        return Err(ApiError::invalid(
            format!("{param} has no `role`"),
            Some(&format!("{param}.role")),
        ));
    };
    let text = content_text(item.content, &param, INPUT_TEXT_KINDS)?;
    if !matches!(role.as_str(), "user" | "assistant" | "system" | "developer") {
        return Err(ApiError::invalid(
            format!("{param}.role is {role:?}; this server takes system, developer, user and assistant messages"),
            Some(&format!("{param}.role")),
        ));
    }
    Ok(Some(Message {
        role,
        content: Some(Content::Text(text)),
        ..Message::default()
    }))
}

/// The state of a response as it is built: ids, text so far and which output items are open.
/// Streaming and the whole reply both go through it, so their objects agree.
pub struct ResponseBuilder {
    pub id: String,
    pub created_at: u64,
    pub model: String,
    pub echo: Echo,
    reasoning: String,
    content: String,
    /// Output items opened so far: reasoning, then the message, each at most once, then the
    /// function calls.
    reasoning_open: bool,
    message_open: bool,
    calls: Vec<CallItem>,
    sequence: u64,
    /// The answer tokens' log-probabilities (when asked for): all of them, and those not yet
    /// sent with an `output_text.delta`.
    logprobs: Vec<Value>,
    pending_logprobs: Vec<Value>,
}

/// A function call among the output items.
struct CallItem {
    id: String,
    call_id: String,
    name: String,
    arguments: String,
    open: bool,
}

/// How a response ended.
pub enum Outcome<'a> {
    Finished(FinishReason, &'a Usage),
    Failed(&'a str),
}

impl ResponseBuilder {
    pub fn new(id: String, created_at: u64, model: String, echo: Echo) -> ResponseBuilder {
        ResponseBuilder {
            id,
            created_at,
            model,
            echo,
            reasoning: String::new(),
            content: String::new(),
            reasoning_open: false,
            message_open: false,
            calls: Vec::new(),
            sequence: 0,
            logprobs: Vec::new(),
            pending_logprobs: Vec::new(),
        }
    }

    /// Index of call `k` among the output items: after the reasoning and the message, if any.
    fn call_index(&self, k: usize) -> usize {
        self.message_index() + usize::from(!self.content.is_empty()) + k
    }

    /// A new function-call item (its id from the call's, `fc_` for `call_`); its index.
    fn add_call(&mut self, call_id: &str, name: &str, open: bool) -> usize {
        self.calls.push(CallItem {
            id: format!("fc_{}", call_id.trim_start_matches("call_")),
            call_id: call_id.to_owned(),
            name: name.to_owned(),
            arguments: String::new(),
            open,
        });
        self.calls.len() - 1
    }

    fn call_item(&self, k: usize, status: &str) -> Value {
        let call = &self.calls[k];
        let arguments = if status == "in_progress" {
            ""
        } else {
            &call.arguments
        };
        json!({"id": call.id, "type": "function_call", "status": status, "call_id": call.call_id,
               "name": call.name, "arguments": arguments})
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.id.trim_start_matches("resp_"))
    }

    fn message_id(&self) -> String {
        format!("msg_{}", self.id.trim_start_matches("resp_"))
    }

    fn event(&mut self, kind: &str, mut fields: Value) -> (String, Value) {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        (kind.to_owned(), fields)
    }

    fn reasoning_item(&self, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "reasoning_text", "text": self.reasoning}])
        };
        json!({"id": self.reasoning_id(), "type": "reasoning", "status": status,
               "summary": [], "content": content})
    }

    fn message_item(&self, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([{"type": "output_text", "text": self.content, "annotations": [],
                    "logprobs": self.logprobs}])
        };
        json!({"id": self.message_id(), "type": "message", "role": "assistant",
               "status": status, "content": content})
    }

    /// Index of the message among the output items.
    fn message_index(&self) -> usize {
        usize::from(!self.reasoning.is_empty())
    }

    /// The `response` object: `status` is in_progress, completed, incomplete or failed.
    pub fn response(&self, status: &str, usage: Option<&Usage>, error: Option<&str>) -> Value {
        let mut output = Vec::new();
        if status != "in_progress" {
            let item_status = if status == "completed" {
                "completed"
            } else {
                "incomplete"
            };
            if !self.reasoning.is_empty() {
                output.push(self.reasoning_item(item_status));
            }
            let answered = status == "completed" && self.calls.is_empty();
            if !self.content.is_empty() || answered {
                output.push(self.message_item(item_status));
            }
            for k in 0..self.calls.len() {
                output.push(self.call_item(k, item_status));
            }
        }
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error.map(|message| json!({"code": "server_error", "message": message})),
            "incomplete_details": (status == "incomplete")
                .then(|| json!({"reason": "max_output_tokens"})),
            "instructions": self.echo.instructions,
            "max_output_tokens": self.echo.max_output_tokens,
            "temperature": self.echo.temperature,
            "top_p": self.echo.top_p,
            "reasoning": {"effort": self.echo.effort, "summary": null},
            "parallel_tool_calls": false,
            "tool_choice": self.echo.tool_choice,
            "tools": self.echo.tools,
            "text": {"format": self.echo.format},
            "store": self.echo.store,
            "metadata": {},
            "usage": usage.map(usage_json),
        })
    }

    /// The events that open the stream.
    pub fn start(&mut self) -> Vec<(String, Value)> {
        let created = self.response("in_progress", None, None);
        vec![
            self.event("response.created", json!({"response": created})),
            self.event("response.in_progress", json!({"response": created})),
        ]
    }

    /// The events for new reasoning and answer text and function-call pieces (opening the output
    /// items they belong to).
    pub fn delta(
        &mut self,
        reasoning: &str,
        content: &str,
        calls: &[ToolCallDelta],
    ) -> Vec<(String, Value)> {
        let mut events = self.text_delta(reasoning, content);
        for piece in calls {
            if let Some((call_id, name)) = &piece.opens {
                events.extend(self.close_reasoning("completed"));
                events.extend(self.close_message("completed"));
                events.extend(self.close_calls("completed"));
                let k = self.add_call(call_id, name, true);
                let (index, item) = (self.call_index(k), self.call_item(k, "in_progress"));
                events.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
            }
            let Some(k) = self.calls.len().checked_sub(1) else {
                continue;
            };
            if piece.arguments.is_empty() {
                continue;
            }
            self.calls[k].arguments.push_str(&piece.arguments);
            let (id, index) = (self.calls[k].id.clone(), self.call_index(k));
            events.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": piece.arguments}),
            ));
        }
        events
    }

    fn close_calls(&mut self, status: &str) -> Vec<(String, Value)> {
        let mut events = Vec::new();
        for k in 0..self.calls.len() {
            if !self.calls[k].open {
                continue;
            }
            self.calls[k].open = false;
            let (id, index) = (self.calls[k].id.clone(), self.call_index(k));
            let arguments = self.calls[k].arguments.clone();
            let item = self.call_item(k, status);
            events.push(self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "arguments": arguments}),
            ));
            events.push(self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ));
        }
        events
    }

    fn text_delta(&mut self, reasoning: &str, content: &str) -> Vec<(String, Value)> {
        let mut events = Vec::new();
        if !reasoning.is_empty() && !self.message_open {
            if !self.reasoning_open {
                self.reasoning_open = true;
                let item = self.reasoning_item("in_progress");
                events.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": 0, "item": item}),
                ));
                let id = self.reasoning_id();
                events.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": 0, "content_index": 0,
                           "part": {"type": "reasoning_text", "text": ""}}),
                ));
            }
            self.reasoning.push_str(reasoning);
            let id = self.reasoning_id();
            events.push(self.event(
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "delta": reasoning}),
            ));
        }
        if !content.is_empty() {
            events.extend(self.close_reasoning("completed"));
            if !self.message_open {
                self.message_open = true;
                let index = self.message_index();
                let item = self.message_item("in_progress");
                events.push(self.event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                ));
                let id = self.message_id();
                events.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
                ));
            }
            self.content.push_str(content);
            let (id, index) = (self.message_id(), self.message_index());
            let logprobs = std::mem::take(&mut self.pending_logprobs);
            events.push(self.event(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "delta": content, "logprobs": logprobs}),
            ));
        }
        events
    }

    fn close_reasoning(&mut self, status: &str) -> Vec<(String, Value)> {
        if !self.reasoning_open {
            return Vec::new();
        }
        self.reasoning_open = false;
        let id = self.reasoning_id();
        let text = self.reasoning.clone();
        let item = self.reasoning_item(status);
        vec![
            self.event(
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "text": text}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": text}}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ),
        ]
    }

    fn close_message(&mut self, status: &str) -> Vec<(String, Value)> {
        if !self.message_open {
            return Vec::new();
        }
        self.message_open = false;
        let (id, index) = (self.message_id(), self.message_index());
        let text = self.content.clone();
        let item = self.message_item(status);
        let logprobs = Value::from(self.logprobs.clone());
        vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "text": text, "logprobs": logprobs}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": text, "annotations": [],
                                "logprobs": logprobs}}),
            ),
            self.event(
                "response.output_item.done",
                json!({"output_index": index, "item": item}),
            ),
        ]
    }

    /// The events that close the open items and end the stream (`response.completed`,
    /// `response.incomplete` or `response.failed`; the Responses API sends no `[DONE]`).
    pub fn finish(&mut self, outcome: Outcome<'_>) -> Vec<(String, Value)> {
        let (status, usage, error) = match outcome {
            Outcome::Finished(FinishReason::Stop | FinishReason::ToolCalls, usage) => {
                ("completed", Some(usage), None)
            }
            Outcome::Finished(FinishReason::Length, usage) => ("incomplete", Some(usage), None),
            Outcome::Failed(message) => ("failed", None, Some(message)),
        };
        let item_status = if status == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        let mut events = self.close_reasoning(item_status);
        events.extend(self.close_message(item_status));
        events.extend(self.close_calls(item_status));
        let response = self.response(status, usage, error);
        events.push(self.event(&format!("response.{status}"), json!({"response": response})));
        events
    }

    /// Answer tokens' log-probabilities, sent with the next answer text (and in the message).
    pub fn add_logprobs(&mut self, entries: &[LogprobEntry]) {
        for entry in entries {
            let value = logprob_json(entry);
            self.logprobs.push(value.clone());
            self.pending_logprobs.push(value);
        }
    }

    /// Records text and calls without producing events (the whole, non-streamed reply).
    pub fn push(&mut self, reasoning: &str, content: &str, calls: &[ToolCallDelta]) {
        self.reasoning.push_str(reasoning);
        self.content.push_str(content);
        for piece in calls {
            if let Some((call_id, name)) = &piece.opens {
                self.add_call(call_id, name, false);
            }
            if let Some(call) = self.calls.last_mut() {
                call.arguments.push_str(&piece.arguments);
            }
        }
    }
}

fn usage_json(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.prompt_tokens - usage.cached_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    })
}

/// The status a finish reason gives a whole response.
pub fn status_of(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop | FinishReason::ToolCalls => "completed",
        FinishReason::Length => "incomplete",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prepare(body: &str) -> Result<(ChatJob, Echo), ApiError> {
        let request = parse_responses_request(body.as_bytes())?;
        prepare_responses(request, Tokenizer::shared().unwrap(), 4096)
    }

    #[test]
    fn a_string_and_the_same_message_list_give_the_same_prompt() {
        let (text, echo) = prepare(r#"{"input": "hi", "instructions": "be brief"}"#).unwrap();
        let (items, _) = prepare(
            r#"{"instructions": "be brief", "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(text.prompt, items.prompt);
        assert_eq!(echo.instructions.as_deref(), Some("be brief"));
        assert_eq!(echo.effort, "medium");
    }

    #[test]
    fn a_previous_response_goes_first_and_bad_store_fields_are_named() {
        let kept = vec![json!({"role": "user", "content": "a"})];
        let lookup = |id: &str| (id == "resp_1").then(|| kept.clone());
        let body = br#"{"input": "b", "previous_response_id": "resp_1"}"#;
        let (request, conversation) = continue_previous(body, lookup).unwrap();
        let conversation = conversation.expect("kept by default");
        assert_eq!(conversation[0], kept[0]);
        assert_eq!(conversation[1], json!({"role": "user", "content": "b"}));
        assert!(request.previous_response_id.is_none());
        assert!(matches!(request.input, Input::Items(ref items) if items.len() == 2));
        let (_, conversation) =
            continue_previous(br#"{"input": "b", "store": false}"#, lookup).unwrap();
        assert!(conversation.is_none(), "store: false keeps nothing");
        for (body, param, code) in [
            (
                &br#"{"input": "b", "previous_response_id": "resp_9"}"#[..],
                "previous_response_id",
                Some("previous_response_not_found"),
            ),
            (
                br#"{"input": "b", "previous_response_id": 5}"#,
                "previous_response_id",
                None,
            ),
            (br#"{"input": "b", "store": "yes"}"#, "store", None),
            (
                br#"{"input": 5, "previous_response_id": "resp_1"}"#,
                "input",
                None,
            ),
        ] {
            let error = continue_previous(body, lookup).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{error:?}");
            if code.is_some() {
                assert_eq!(error.code, code);
            }
        }
    }

    #[test]
    fn effort_and_limits_are_read_and_errors_name_responses_fields() {
        let (job, echo) = prepare(
            r#"{"input": "hi", "reasoning": {"effort": "low"}, "max_output_tokens": 7, "stream": true}"#,
        )
        .unwrap();
        assert_eq!(
            (job.max_tokens, job.stream, echo.effort.as_str()),
            (7, true, "low")
        );
        let cases = [
            (
                r#"{"input": "hi", "max_output_tokens": 0}"#,
                "max_output_tokens",
            ),
            (
                r#"{"input": "hi", "reasoning": {"effort": "huge"}}"#,
                "reasoning.effort",
            ),
            (r#"{"input": []}"#, "input"),
            (
                r#"{"input": "hi", "previous_response_id": "resp_1"}"#,
                "previous_response_id",
            ),
            (
                r#"{"input": "hi", "tools": [{"type": "web_search"}]}"#,
                "tools[0].type",
            ),
            (
                r#"{"input": "hi", "tools": [{"type": "function", "name": "a b"}]}"#,
                "tools[0].name",
            ),
            (
                r#"{"input": "hi", "tools": [{"type": "function"}]}"#,
                "tools[0].name",
            ),
            (
                r#"{"input": [{"type": "function_call_output"}]}"#,
                "input[0].call_id",
            ),
            (
                r#"{"input": [{"role": "user", "content": "a"},
                    {"type": "function_call_output", "call_id": "c9", "output": "x"}]}"#,
                "input[1].call_id",
            ),
            (
                r#"{"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}"#,
                "input[0].name",
            ),
            (
                r#"{"input": [{"type": "web_search_call"}]}"#,
                "input[0].type",
            ),
            (
                r#"{"input": [{"role": "tool", "content": "x"}]}"#,
                "input[0].role",
            ),
            (r#"{"input": 5}"#, "input"),
        ];
        for (body, param) in cases {
            let error = prepare(body).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{body}: {error:?}");
        }
    }

    /// Reasoning items before a message (not a call) are dropped, as before calls existed.
    #[test]
    fn earlier_reasoning_items_are_dropped() {
        let (with, _) = prepare(
            r#"{"input": [{"role": "user", "content": "a"},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
                {"role": "user", "content": "c"}]}"#,
        )
        .unwrap();
        let (without, _) = prepare(
            r#"{"input": [{"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}"#,
        )
        .unwrap();
        assert_eq!(with.prompt, without.prompt);
    }

    fn echo() -> Echo {
        Echo {
            instructions: None,
            effort: "low".into(),
            max_output_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            tools: Vec::new(),
            tool_choice: json!("auto"),
            format: json!({"type": "text"}),
            store: true,
        }
    }

    /// The same exchange in the Responses API's items and in chat-completions messages renders
    /// the same prompt: reasoning before a call kept, the call, its output.
    #[test]
    fn function_call_items_render_as_the_chat_exchange_does() {
        let (responses, echo) = prepare(
            r#"{"instructions": "Be brief.", "input": [
                {"role": "user", "content": "weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "need it"}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call_output", "call_id": "call_1", "output": "3 C"}],
                "tools": [{"type": "function", "name": "get_weather", "description": "Weather.",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}"#,
        )
        .unwrap();
        let chat = super::super::api::parse_chat_request(
            br#"{"messages": [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "reasoning_content": "need it", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}"#,
        )
        .unwrap();
        let chat = prepare_chat(chat, Tokenizer::shared().unwrap(), 4096).unwrap();
        assert_eq!(responses.prompt, chat.prompt);
        assert!(responses.tools);
        assert_eq!(echo.tools[0]["name"], "get_weather");
        assert_eq!(echo.tool_choice, "auto");
    }

    fn opening(call_id: &str, arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index: 0,
            opens: Some((call_id.into(), "get_weather".into())),
            arguments: arguments.into(),
        }
    }

    fn more(arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index: 0,
            opens: None,
            arguments: arguments.into(),
        }
    }

    #[test]
    fn a_call_streams_as_a_function_call_item_after_the_reasoning() {
        let mut builder = ResponseBuilder::new("resp_1".into(), 0, "m".into(), echo());
        let mut events = builder.start();
        events.extend(builder.delta("need weather", "", &[]));
        events.extend(builder.delta("", "", &[opening("call_x", "{\"city\":")]));
        events.extend(builder.delta("", "", &[more("\"Oslo\"}")]));
        let usage = Usage::default();
        events.extend(builder.finish(Outcome::Finished(FinishReason::ToolCalls, &usage)));
        let kinds: Vec<&str> = events.iter().map(|(kind, _)| kind.as_str()).collect();
        assert_eq!(
            kinds[4..],
            [
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let added = &events[8].1;
        assert_eq!(added["output_index"], 1);
        assert_eq!(added["item"]["type"], "function_call");
        assert_eq!(added["item"]["call_id"], "call_x");
        assert_eq!(added["item"]["name"], "get_weather");
        assert_eq!(events[11].1["arguments"], "{\"city\":\"Oslo\"}");
        let done = &events.last().unwrap().1["response"];
        assert_eq!(done["status"], "completed");
        let output = done["output"].as_array().unwrap();
        assert_eq!(output.len(), 2, "{done}");
        assert_eq!(output[1]["type"], "function_call");
        assert_eq!(output[1]["id"], added["item"]["id"]);
        assert_eq!(output[1]["arguments"], "{\"city\":\"Oslo\"}");
        for (index, (_, value)) in events.iter().enumerate() {
            assert_eq!(value["sequence_number"], index as u64);
        }

        // The whole reply: the same items.
        let mut whole = ResponseBuilder::new("resp_1".into(), 0, "m".into(), echo());
        whole.push("need weather", "", &[opening("call_x", "{\"city\":")]);
        whole.push("", "", &[more("\"Oslo\"}")]);
        let response = whole.response("completed", Some(&usage), None);
        assert_eq!(response["output"], done["output"]);
    }

    #[test]
    fn streamed_events_are_numbered_and_close_every_item_they_open() {
        let echo = echo();
        let mut builder = ResponseBuilder::new("resp_1".into(), 0, "m".into(), echo);
        let mut events = builder.start();
        events.extend(builder.delta("think", "", &[]));
        events.extend(builder.delta(" more", "An", &[]));
        events.extend(builder.delta("", "swer", &[]));
        let usage = Usage {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 5,
            reasoning_tokens: 2,
        };
        events.extend(builder.finish(Outcome::Finished(FinishReason::Stop, &usage)));
        let kinds: Vec<&str> = events.iter().map(|(kind, _)| kind.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (index, (kind, value)) in events.iter().enumerate() {
            assert_eq!(value["sequence_number"], index as u64);
            assert_eq!(value["type"], kind.as_str());
        }
        let done = &events.last().unwrap().1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], "think more");
        assert_eq!(done["output"][1]["content"][0]["text"], "Answer");
        assert_eq!(done["output"][1]["id"], events[9].1["item"]["id"]);
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 4);
        assert_eq!(done["usage"]["total_tokens"], 15);
    }
}
