//! The OpenAI chat-completions request as JSON, checked and turned into a harmony prompt, and the
//! OpenAI-style error body.

use axum::http::StatusCode;
use serde::Deserialize;

use super::structured::{structured_output, OutputConstraint, ResponseFormatField};
use crate::chat::tokenizer::special;
use crate::chat::{
    push_assistant_start, push_call_header, push_channel_header, render_turns, Channel,
    ChatMessage, FunctionTool, ReasoningEffort, RenderOptions, Role, SystemSettings, Tokenizer,
    Turn,
};
use crate::engine::SamplerSettings;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> ApiError {
        self.status = status;
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string, or a list of parts of which the text parts are read.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant message's calls of the request's functions.
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCallParam>>,
    /// A tool message's answer to this call.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// A tool message's function (when its call is not in the messages).
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant message's reasoning, as this server sends it back (either name): kept in the
    /// prompt while a tool-calling exchange is under way, as gpt-oss expects.
    #[serde(default)]
    pub reasoning_content: Option<String>,
    #[serde(default)]
    pub reasoning: Option<String>,
}

/// `tools[i]`: a function the model may call.
#[derive(Debug, Deserialize)]
pub struct ToolParam {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionParam,
}

#[derive(Debug, Deserialize)]
pub struct FunctionParam {
    pub name: String,
    #[serde(default)]
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    #[serde(default)]
    pub parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `messages[i].tool_calls[j]`.
#[derive(Debug, Deserialize)]
pub struct ToolCallParam {
    #[serde(default)]
    pub id: Option<String>,
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub function: CalledFunction,
}

#[derive(Debug, Deserialize)]
pub struct CalledFunction {
    pub name: String,
    /// The arguments as JSON text (OpenAI's form); an object is taken too.
    #[serde(default)]
    pub arguments: Option<serde_json::Value>,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name"}}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named(serde_json::Value),
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields of a chat-completions request this server reads; others are ignored, as OpenAI's
/// own clients send more than any server implements.
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub max_completion_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub tools: Option<Vec<ToolParam>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    /// Read and accepted: gpt-oss ends its turn at each call (`<|call|>`), so a reply holds at
    /// most one.
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Extensions llama-server and vLLM take: keep the k most likely tokens (0: all), and drop
    /// tokens less likely than this fraction of the most likely one.
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    /// Log-probabilities of the answer's tokens, and of the `top_logprobs` most likely tokens
    /// at each (at most [`MAX_TOP_LOGPROBS`]).
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u64>,
    /// Repetition penalties in [-2, 2] and a bias in [-100, 100] per token id (OpenAI's
    /// ranges); see [`LogitAdjustments`].
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Structured output: `json_object` or `json_schema`, enforced while sampling the final
    /// channel (see [`super::structured`]).
    #[serde(default)]
    pub response_format: Option<ResponseFormatField>,
    /// vLLM's extension: the last message, an assistant's, is left open on the final channel
    /// and the reply continues it (a prefilled answer); the reply holds only the new text.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
}

/// Most choices (`n`) one request may ask for: each is a sequence of its own, holding a slot.
pub const MAX_CHOICES: u64 = 16;

/// The request's `n`: how many replies to sample from the prompt (1 by default).
pub(super) fn choice_count(n: Option<u64>) -> Result<usize, ApiError> {
    match n.unwrap_or(1) {
        0 => Err(ApiError::invalid("`n` must be at least 1", Some("n"))),
        n if n > MAX_CHOICES => Err(ApiError::invalid(
            format!("`n` is {n}; at most {MAX_CHOICES} choices per request"),
            Some("n"),
        )),
        n => Ok(n as usize),
    }
}

/// A checked request: the prompt and how to sample it.
#[derive(Debug)]
pub struct ChatJob {
    pub prompt: Vec<u32>,
    pub sampler: SamplerSettings,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Replies to sample (`n`), each its own sequence sharing the prompt's prefill.
    pub choices: usize,
    /// The prompt defines functions: a message the model addresses to `functions.NAME` is a
    /// tool call, not content.
    pub tools: bool,
    /// The prompt's last tokens when `tool_choice` forces a call: the call's header, which the
    /// reply's parser reads before the first sampled token.
    pub forced: Vec<u32>,
    /// `Some(top)`: report each answer token's log-probability and the `top` likeliest.
    pub logprobs: Option<usize>,
    /// `Some(top)`: also each prompt token's (`/v1/completions` with `echo`), computed at every
    /// position of the prompt's prefill.
    pub prompt_logprobs: Option<usize>,
    /// `logit_bias` and repetition penalties applied before each sampling.
    pub adjustments: LogitAdjustments,
    /// How the sampled tokens become text.
    pub text: TextMode,
    /// The structured output the final answer is held to.
    pub constraint: Option<OutputConstraint>,
    /// The `strict` functions' argument constraints, by name.
    pub tool_constraints: Vec<(String, OutputConstraint)>,
    /// `tool_choice: "required"`: the reply from its first token, a defined function's name
    /// and its arguments (see [`OutputConstraint::required_call`]).
    pub call: Option<OutputConstraint>,
}

/// How a reply's tokens become text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextMode {
    /// Harmony messages: reasoning, content and tool calls (chat completions, responses).
    Harmony,
    /// Plain text (`/v1/completions`): every token's text in turn, special tokens left out when
    /// `skip_special_tokens`; `<|return|>`, `<|call|>` and `<|endoftext|>` end it, as gpt-oss's
    /// generation config says.
    Raw { skip_special_tokens: bool },
}

/// How sampled logits are adjusted: OpenAI's `logit_bias` (added to the listed tokens' logits)
/// and repetition penalties (`count x frequency + presence` subtracted from the logit of every
/// token the reply has already sampled `count > 0` times).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitAdjustments {
    pub bias: Vec<(u32, f32)>,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
}

impl LogitAdjustments {
    pub fn penalizes(&self) -> bool {
        self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }

    pub fn is_empty(&self) -> bool {
        self.bias.is_empty() && !self.penalizes()
    }
}

/// OpenAI's ranges: biases in [-100, 100], penalties in [-2, 2].
const MAX_BIAS: f32 = 100.0;
const MAX_PENALTY: f32 = 2.0;

/// The request's `logit_bias` and penalties, checked against OpenAI's ranges and the vocabulary.
pub(super) fn logit_adjustments(
    logit_bias: Option<&serde_json::Map<String, serde_json::Value>>,
    (frequency_penalty, presence_penalty): (Option<f32>, Option<f32>),
    vocab: usize,
) -> Result<LogitAdjustments, ApiError> {
    let mut bias = Vec::new();
    for (key, value) in logit_bias.into_iter().flatten() {
        let id = key.parse::<u32>().ok().filter(|&id| (id as usize) < vocab);
        let Some(id) = id else {
            return Err(ApiError::invalid(
                format!("`logit_bias` key {key:?} is not a token id below {vocab}"),
                Some("logit_bias"),
            ));
        };
        let amount = value
            .as_f64()
            .map(|v| v as f32)
            .filter(|v| v.abs() <= MAX_BIAS);
        let Some(amount) = amount else {
            return Err(ApiError::invalid(
                format!(
                    "`logit_bias` of token {id} is {value}; a bias is a number from -100 to 100"
                ),
                Some("logit_bias"),
            ));
        };
        bias.push((id, amount));
    }
    let penalty = |param: &str, value: Option<f32>| match value.unwrap_or(0.0) {
        v if v.abs() <= MAX_PENALTY => Ok(v),
        v => Err(ApiError::invalid(
            format!("`{param}` is {v}; it is a number from -2 to 2"),
            Some(param),
        )),
    };
    Ok(LogitAdjustments {
        bias,
        frequency_penalty: penalty("frequency_penalty", frequency_penalty)?,
        presence_penalty: penalty("presence_penalty", presence_penalty)?,
    })
}

/// Most `top_logprobs` OpenAI accepts.
pub const MAX_TOP_LOGPROBS: u64 = 20;

/// `Some(top)` when the request asks for log-probabilities (`top` alternatives each).
fn logprobs_asked(request: &ChatCompletionRequest) -> Result<Option<usize>, ApiError> {
    let top = request.top_logprobs.unwrap_or(0);
    if top > MAX_TOP_LOGPROBS {
        return Err(ApiError::invalid(
            format!("`top_logprobs` is {top}; at most {MAX_TOP_LOGPROBS}"),
            Some("top_logprobs"),
        ));
    }
    match request.logprobs {
        Some(true) => Ok(Some(top as usize)),
        _ if top > 0 => Err(ApiError::invalid(
            "`top_logprobs` needs `logprobs`: true",
            Some("top_logprobs"),
        )),
        _ => Ok(None),
    }
}

/// Longest function name OpenAI accepts.
const MAX_FUNCTION_NAME: usize = 64;

/// OpenAI's rule for function names (`^[a-zA-Z0-9_-]{1,64}$`): the name becomes part of a
/// harmony header, where a space or a special token's text would change its meaning.
fn check_function_name(name: &str, param: &str) -> Result<(), ApiError> {
    let valid = !name.is_empty()
        && name.len() <= MAX_FUNCTION_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if valid {
        Ok(())
    } else {
        Err(ApiError::invalid(
            format!("{param} is {name:?}; a function name is 1 to {MAX_FUNCTION_NAME} letters, digits, '_' or '-'"),
            Some(param),
        ))
    }
}

/// What `tool_choice` asks of the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Forced {
    /// The model decides (`"auto"`, or `"none"` with the tools left out).
    Nothing,
    /// `"required"`: a call of some function.
    AnyCall,
    /// A call of this function.
    Call(String),
}

/// The function a named `tool_choice` names: `{"type": "function", "function": {"name"}}` (chat
/// completions) or `{"type": "function", "name"}` (the Responses API).
fn named_choice(value: &serde_json::Value) -> Option<&str> {
    if value.get("type").and_then(|t| t.as_str()) != Some("function") {
        return None;
    }
    value
        .get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| value.get("name"))
        .and_then(|n| n.as_str())
}

/// The schema of a function that takes no arguments: `{}`.
fn no_arguments() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false})
}

/// The request's functions, checked (none when `tool_choice` is `"none"`), the call
/// `tool_choice` forces, if any, and the argument constraints of the `strict` ones.
#[allow(clippy::type_complexity)]
fn function_tools(
    tools: Option<Vec<ToolParam>>,
    choice: Option<ToolChoice>,
) -> Result<(Vec<FunctionTool>, Forced, Vec<(String, OutputConstraint)>), ApiError> {
    let tools = tools.unwrap_or_default();
    let forced = match &choice {
        None => Forced::Nothing,
        Some(ToolChoice::Mode(mode)) if mode == "auto" || mode == "none" => Forced::Nothing,
        Some(ToolChoice::Mode(mode)) if mode == "required" => Forced::AnyCall,
        Some(ToolChoice::Mode(mode)) => {
            return Err(ApiError::invalid(
                format!("`tool_choice` is {mode:?}; it takes \"none\", \"auto\", \"required\" or a function"),
                Some("tool_choice"),
            ))
        }
        Some(ToolChoice::Named(value)) => match named_choice(value) {
            Some(name) => Forced::Call(name.to_owned()),
            None => {
                return Err(ApiError::invalid(
                    "`tool_choice` is not a function choice: give {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    Some("tool_choice"),
                ))
            }
        },
    };
    let mut functions: Vec<FunctionTool> = Vec::with_capacity(tools.len());
    let mut strict = Vec::new();
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
        let function = tool.function;
        check_function_name(&function.name, &format!("{param}.function.name"))?;
        if functions.iter().any(|f| f.name == function.name) {
            return Err(ApiError::invalid(
                format!("{param}.function.name {:?} is defined twice", function.name),
                Some(&format!("{param}.function.name")),
            ));
        }
        if let Some(parameters) = &function.parameters {
            if !parameters.is_object() {
                return Err(ApiError::invalid(
                    format!("{param}.function.parameters must be a JSON schema object"),
                    Some(&format!("{param}.function.parameters")),
                ));
            }
        }
        // `strict`: the arguments are held to the parameters' schema while sampled.
        if function.strict == Some(true) {
            let schema = function.parameters.clone().unwrap_or_else(no_arguments);
            let constraint = OutputConstraint::compile(schema, true).map_err(|reason| {
                ApiError::invalid(
                    format!("{param}.function.parameters: {reason}"),
                    Some(&format!("{param}.function.parameters")),
                )
            })?;
            strict.push((function.name.clone(), constraint));
        }
        functions.push(FunctionTool {
            name: function.name,
            description: function.description.unwrap_or_default(),
            parameters: function.parameters,
        });
    }
    let none = matches!(&choice, Some(ToolChoice::Mode(mode)) if mode == "none");
    let known = match &forced {
        Forced::Nothing => true,
        Forced::AnyCall => !functions.is_empty(),
        Forced::Call(name) => functions.iter().any(|f| &f.name == name),
    };
    if !known {
        return Err(ApiError::invalid(
            match &forced {
                Forced::Call(name) => {
                    format!("`tool_choice` names {name:?}, which `tools` does not define")
                }
                _ => "`tool_choice` \"required\" needs `tools`".to_owned(),
            },
            Some("tool_choice"),
        ));
    }
    Ok(if none {
        (Vec::new(), Forced::Nothing, Vec::new())
    } else {
        (functions, forced, strict)
    })
}

/// A prompt entry with its text owned (the messages are consumed while they are checked).
enum Entry {
    Message(ChatMessage),
    Call { name: String, arguments: String },
    Result { name: String, output: String },
}

/// Most stop strings a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// Parses the body; a wrong type or a missing field is an error naming the field's path.
pub fn parse_chat_request(body: &[u8]) -> Result<ChatCompletionRequest, ApiError> {
    parse_json(body)
}

/// Parses a JSON request body into `T`; errors name the field's path.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let request: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid(format!("the request body is not valid JSON: {inner}"), None)
                .with_code("invalid_json")
        } else if path == "." {
            ApiError::invalid(format!("invalid request: {inner}"), None)
        } else {
            ApiError::invalid(format!("invalid value of `{path}`: {inner}"), Some(&path))
        }
    })?;
    deserializer.end().map_err(|error| {
        ApiError::invalid(format!("the request body is not valid JSON: {error}"), None)
            .with_code("invalid_json")
    })?;
    Ok(request)
}

/// Refuses a prompt (`what`, in the request's `param`) of `len` tokens that leaves no room for
/// a reply in `context`: 400 `context_length_exceeded`, as OpenAI and vLLM answer it.
pub fn check_fits(
    what: &str,
    len: usize,
    context: usize,
    param: &'static str,
) -> Result<(), ApiError> {
    if len < context {
        return Ok(());
    }
    Err(ApiError::invalid(
        format!(
            "{what} is {len} tokens, but the context holds {context} (prompt and reply); shorten it"
        ),
        Some(param),
    )
    .with_code("context_length_exceeded"))
}

/// Renders the messages as a harmony prompt and checks every sampling field. System and
/// developer messages become harmony's developer instructions (gpt-oss reserves the harmony
/// system message for identity, dates and reasoning effort), as the model card's chat template
/// does with a leading system message; the system message carries today's date (UTC), as it
/// does in the app, vLLM and llama-server.
pub fn prepare_chat(
    request: ChatCompletionRequest,
    tokenizer: &Tokenizer,
    context: usize,
) -> Result<ChatJob, ApiError> {
    let today = crate::tui::store::date_utc(std::time::SystemTime::now());
    prepare_chat_dated(request, tokenizer, context, Some(&today))
}

/// [`prepare_chat`] with the system message's date given (`None`: no date line).
pub fn prepare_chat_dated(
    request: ChatCompletionRequest,
    tokenizer: &Tokenizer,
    context: usize,
    date: Option<&str>,
) -> Result<ChatJob, ApiError> {
    if request.messages.is_empty() {
        return Err(ApiError::invalid(
            "`messages` is empty: give at least one message",
            Some("messages"),
        ));
    }
    let choices = choice_count(request.n)?;
    let logprobs = logprobs_asked(&request)?;
    let structured = structured_output(request.response_format, "response_format")?;
    let adjustments = logit_adjustments(
        request.logit_bias.as_ref(),
        (request.frequency_penalty, request.presence_penalty),
        tokenizer.vocab_size(),
    )?;
    let reasoning = match request.reasoning_effort.as_deref() {
        None => ReasoningEffort::Medium,
        Some(text) => text
            .parse()
            .map_err(|message: String| ApiError::invalid(message, Some("reasoning_effort")))?,
    };
    let (tools, forced, strict_tools) = function_tools(request.tools, request.tool_choice)?;
    // `required`: the reply is held to a defined function's name and its arguments.
    let call = match forced {
        Forced::AnyCall => {
            let functions: Vec<(&str, Option<serde_json::Value>)> = tools
                .iter()
                .map(|f| {
                    let strict = strict_tools.iter().any(|(name, _)| *name == f.name);
                    let schema = strict.then(|| f.parameters.clone().unwrap_or_else(no_arguments));
                    (f.name.as_str(), schema)
                })
                .collect();
            let constraint = OutputConstraint::required_call(&functions)
                .map_err(|reason| ApiError::invalid(reason, Some("tools")))?;
            Some(constraint)
        }
        _ => None,
    };
    let mut developer: Vec<String> = Vec::new();
    let mut entries = Vec::new();
    // The function each call id named, for the tool messages that answer them.
    let mut called: Vec<(String, String)> = Vec::new();
    for (index, message) in request.messages.into_iter().enumerate() {
        let param = format!("messages[{index}]");
        let text = content_text(message.content, &param, &["text"])?;
        match message.role.as_str() {
            // Several are joined in order, wherever they stand; an empty one adds nothing (the
            // chat template renders no developer message for an empty system message).
            "system" | "developer" => {
                if !text.trim().is_empty() {
                    developer.push(text)
                }
            }
            "user" => entries.push(Entry::Message(ChatMessage::user(text))),
            "assistant" => {
                let reasoning = message.reasoning_content.or(message.reasoning);
                if let Some(reasoning) = reasoning.filter(|r| !r.is_empty()) {
                    entries.push(Entry::Message(ChatMessage::assistant(
                        Channel::Analysis,
                        reasoning,
                    )));
                }
                let calls = message.tool_calls.unwrap_or_default();
                if calls.is_empty() {
                    entries.push(Entry::Message(ChatMessage::assistant(Channel::Final, text)));
                    continue;
                }
                // Text beside calls is a preamble: harmony's commentary to the user.
                if !text.is_empty() {
                    entries.push(Entry::Message(ChatMessage::assistant(
                        Channel::Commentary,
                        text,
                    )));
                }
                for (j, call) in calls.into_iter().enumerate() {
                    let call_param = format!("{param}.tool_calls[{j}]");
                    if call.kind.as_deref().is_some_and(|kind| kind != "function") {
                        return Err(ApiError::invalid(
                            format!("{call_param}.type is {:?}; calls are of \"function\"", call.kind.unwrap_or_default()),
                            Some(&format!("{call_param}.type")),
                        ));
                    }
                    let name = call.function.name;
                    check_function_name(&name, &format!("{call_param}.function.name"))?;
                    let arguments = match call.function.arguments {
                        None | Some(serde_json::Value::Null) => "{}".to_owned(),
                        Some(serde_json::Value::String(text)) => text,
                        Some(value) => value.to_string(),
                    };
                    if let Some(id) = call.id {
                        called.push((id, name.clone()));
                    }
                    entries.push(Entry::Call { name, arguments });
                }
            }
            "tool" => {
                let by_id = message.tool_call_id.as_ref().and_then(|id| {
                    called
                        .iter()
                        .rev()
                        .find(|(known, _)| known == id)
                        .map(|(_, name)| name.clone())
                });
                let Some(name) = by_id.or(message.name) else {
                    return Err(ApiError::invalid(
                        format!("{param} answers no call: its `tool_call_id` names no earlier assistant tool call and it has no `name`"),
                        Some(&format!("{param}.tool_call_id")),
                    ));
                };
                check_function_name(&name, &format!("{param}.name"))?;
                entries.push(Entry::Result { name, output: text });
            }
            other => {
                return Err(ApiError::invalid(
                    format!("{param}.role is {other:?}; this server takes system, developer, user, assistant and tool messages"),
                    Some(&format!("{param}.role")),
                ))
            }
        }
    }
    let open_answer = if request.continue_final_message.unwrap_or(false) {
        if forced != Forced::Nothing {
            return Err(ApiError::invalid(
                "`continue_final_message` continues an answer, while `tool_choice` asks for a call: give one of them",
                Some("continue_final_message"),
            ));
        }
        match entries.pop() {
            Some(Entry::Message(message))
                if message.role == Role::Assistant && message.channel == Some(Channel::Final) =>
            {
                Some(message.content)
            }
            _ => {
                return Err(ApiError::invalid(
                    "`continue_final_message` needs the last message to be an assistant's answer (no tool calls) to continue",
                    Some("continue_final_message"),
                ))
            }
        }
    } else {
        None
    };
    let system = SystemSettings {
        reasoning: Some(reasoning),
        date: date.map(str::to_owned),
        ..SystemSettings::default()
    };
    let instructions = (!developer.is_empty()).then(|| developer.join("\n\n"));
    let turns: Vec<Turn<'_>> = entries
        .iter()
        .map(|entry| match entry {
            Entry::Message(message) => Turn::Message(message),
            Entry::Call { name, arguments } => Turn::ToolCall { name, arguments },
            Entry::Result { name, output } => Turn::ToolResult { name, output },
        })
        .collect();
    let encode_error = |error: crate::chat::TokenizerError| {
        ApiError::invalid(
            format!("cannot encode the messages: {error}"),
            Some("messages"),
        )
    };
    let mut prompt = render_turns(
        tokenizer,
        &system,
        instructions.as_deref(),
        &tools,
        structured.as_ref().and_then(|s| s.section.as_ref()),
        &turns,
        &RenderOptions::default(),
    )
    .map_err(encode_error)?;
    push_assistant_start(tokenizer, &mut prompt).map_err(encode_error)?;
    // A forced call's header ends the prompt; the reply's parser reads it first.
    let prompt_len = prompt.len();
    let function = match &forced {
        Forced::Nothing => None,
        Forced::AnyCall => Some(None),
        Forced::Call(name) => Some(Some(name.as_str())),
    };
    if let Some(function) = function {
        push_call_header(tokenizer, function, &mut prompt).map_err(encode_error)?;
    }
    if open_answer.is_some() {
        push_channel_header(tokenizer, Channel::Final, &mut prompt).map_err(encode_error)?;
    }
    let forced = prompt[prompt_len..].to_vec();
    let mut structured = structured;
    if let Some(answer) = &open_answer {
        // The answer so far is prompt: the reply's parser does not read it (the reply is the
        // new text), but a structured output must have.
        let answer_start = prompt.len();
        tokenizer
            .encode_text_into(answer, &mut prompt)
            .map_err(encode_error)?;
        if let Some(structured) = structured.as_mut() {
            for &token in &prompt[answer_start..] {
                structured.constraint.advance(token, special::RETURN).map_err(|error| {
                    ApiError::invalid(
                        format!("the assistant message to continue does not fit `response_format`: {error}"),
                        Some("response_format"),
                    )
                })?;
            }
        }
    }
    check_fits("the prompt", prompt.len(), context, "messages")?;

    let (max_param, max) = match (request.max_completion_tokens, request.max_tokens) {
        (Some(max), _) => ("max_completion_tokens", Some(max)),
        (None, max) => ("max_tokens", max),
    };
    let room = context - prompt.len();
    let max_tokens = match max {
        Some(0) => {
            return Err(ApiError::invalid(
                format!("`{max_param}` must be at least 1"),
                Some(max_param),
            ))
        }
        Some(max) => (max.min(room as u64)) as usize,
        None => room,
    };
    let sampler = sampler_settings(
        (request.temperature, request.top_p),
        (request.top_k, request.min_p),
        request.seed,
    )?;
    let stop = stop_strings(request.stop)?;
    Ok(ChatJob {
        prompt,
        sampler,
        max_tokens,
        stop,
        stream: request.stream.unwrap_or(false),
        include_usage: request.stream_options.unwrap_or_default().include_usage,
        choices,
        tools: !tools.is_empty(),
        forced,
        logprobs,
        prompt_logprobs: None,
        adjustments,
        text: TextMode::Harmony,
        constraint: structured.map(|s| s.constraint),
        tool_constraints: strict_tools,
        call,
    })
}

/// The sampling fields (temperature, top_p; top_k, min_p; seed), checked. Past the vocabulary
/// k keeps every token, as 0 does.
pub(super) fn sampler_settings(
    (temperature, top_p): (Option<f32>, Option<f32>),
    (top_k, min_p): (Option<u64>, Option<f32>),
    seed: Option<u64>,
) -> Result<SamplerSettings, ApiError> {
    let sampler = SamplerSettings {
        temperature: temperature.unwrap_or(1.0),
        top_p: top_p.unwrap_or(1.0),
        top_k: top_k.map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        min_p: min_p.unwrap_or(0.0),
        seed,
    };
    if let Err(error) = sampler.validate() {
        let param = match error {
            crate::engine::SamplerError::TopP(_) => "top_p",
            crate::engine::SamplerError::MinP(_) => "min_p",
            _ => "temperature",
        };
        return Err(ApiError::invalid(error.to_string(), Some(param)));
    }
    Ok(sampler)
}

/// `stop` as a list, checked against OpenAI's limit.
pub(super) fn stop_strings(stop: Option<StopField>) -> Result<Vec<String>, ApiError> {
    let stop = match stop {
        None => Vec::new(),
        Some(StopField::One(stop)) => vec![stop],
        Some(StopField::Many(stops)) => stops,
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            format!(
                "`stop` has {} strings; at most {MAX_STOPS} are allowed",
                stop.len()
            ),
            Some("stop"),
        ));
    }
    Ok(stop)
}

/// The text of `content`: the string, or its parts of the `text_kinds` joined; any other part
/// is refused, named by its path under `param`.
pub(super) fn content_text(
    content: Option<Content>,
    param: &str,
    text_kinds: &[&str],
) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (index, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    (kind, Some(piece)) if text_kinds.contains(&kind) => text.push_str(&piece),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!("{param}.content[{index}] is a {kind:?} part; only text parts are supported"),
                            Some(&format!("{param}.content[{index}]")),
                        ))
                    }
                }
            }
            Ok(text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let error = parse_chat_request(br#"{"messages": [{"role": 5}]}"#).unwrap_err();
        assert_eq!(
            error.param.as_deref(),
            Some("messages[0].role"),
            "{error:?}"
        );
        let error = parse_chat_request(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("temperature"), "{error:?}");
        let error = parse_chat_request(b"{\"messages\": [").unwrap_err();
        assert_eq!(error.code, Some("invalid_json"));
        let error = parse_chat_request(b"{}").unwrap_err();
        assert!(error.message.contains("messages"), "{error:?}");
    }

    #[test]
    fn parsing_arbitrary_bytes_never_panics() {
        // A small deterministic fuzz: prefixes, byte flips and splices of a valid request.
        let valid = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":null,"reasoning_content":"r","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"ok"}],"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{"a":{"type":"string","enum":["x"],"default":"x"},"b":{"oneOf":[{"type":"number"},{"type":"array","items":{"type":"integer"}}]}},"required":["a"]}}}],"tool_choice":"auto","stream":true,"stop":["a","b"],"max_tokens":3,"temperature":0.5}"#;
        let tokenizer = Tokenizer::shared().unwrap();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..4000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut body = valid.to_vec();
            match round % 3 {
                0 => body.truncate(state as usize % valid.len()),
                1 => {
                    let at = state as usize % body.len();
                    body[at] = (state >> 32) as u8;
                }
                _ => {
                    let at = state as usize % body.len();
                    let from = (state >> 20) as usize % body.len();
                    let piece = body[from..].to_vec();
                    body.splice(at..at, piece);
                }
            }
            if let Ok(request) = parse_chat_request(&body) {
                let _ = prepare_chat(request, tokenizer, 64);
            }
        }
    }
}

/// `POST /tokenize`, in the forms llama-server and vLLM take: text as `content` or `prompt`
/// (tokenized as plain text: special tokens' names stay text), or a chat request's `messages`
/// (its whole harmony prompt, as `/v1/chat/completions` would render it, to count what a request
/// costs); `with_pieces` (llama-server) pairs each id with its text.
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<serde_json::Value>,
    #[serde(default)]
    pub with_pieces: bool,
}

/// `POST /detokenize`: token ids back to text.
#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// The `/tokenize` reply: `tokens` (ids, or `{id, piece}` with pieces), `count` and the context
/// a request may use (`max_model_len`, as vLLM names it).
pub fn tokenize(
    body: &[u8],
    tokenizer: &Tokenizer,
    context: usize,
) -> Result<serde_json::Value, ApiError> {
    let request: TokenizeRequest = parse_json(body)?;
    let ids = match (&request.content, &request.prompt, &request.messages) {
        (Some(text), None, None) | (None, Some(text), None) => tokenizer.encode_text(text),
        (None, None, Some(_)) => {
            // The whole body is a chat request: tools and reasoning effort shape the prompt too.
            // Rendered whatever its length: counting is how a client learns it is too long.
            let chat = parse_chat_request(body)?;
            return prepare_chat(chat, tokenizer, usize::MAX)
                .map(|job| tokens_json(&job.prompt, request.with_pieces, tokenizer, context));
        }
        _ => {
            return Err(ApiError::invalid(
                "give exactly one of `content`, `prompt` (text) or `messages` (a chat)",
                None,
            ))
        }
    }
    .map_err(|error| ApiError::invalid(format!("cannot tokenize: {error}"), None))?;
    Ok(tokens_json(&ids, request.with_pieces, tokenizer, context))
}

fn tokens_json(
    ids: &[u32],
    with_pieces: bool,
    tokenizer: &Tokenizer,
    context: usize,
) -> serde_json::Value {
    let tokens: Vec<serde_json::Value> = if with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                serde_json::json!({"id": id, "piece": String::from_utf8_lossy(bytes)})
            })
            .collect()
    } else {
        ids.iter().map(|&id| serde_json::json!(id)).collect()
    };
    serde_json::json!({"tokens": tokens, "count": ids.len(), "max_model_len": context})
}

/// The `/detokenize` reply: the text as `content` (llama-server) and `prompt` (vLLM); special
/// tokens come back as their names.
pub fn detokenize(body: &[u8], tokenizer: &Tokenizer) -> Result<serde_json::Value, ApiError> {
    let request: DetokenizeRequest = parse_json(body)?;
    let text = tokenizer.decode(&request.tokens).map_err(|error| {
        ApiError::invalid(format!("cannot detokenize: {error}"), Some("tokens"))
    })?;
    Ok(serde_json::json!({"content": text, "prompt": text}))
}
