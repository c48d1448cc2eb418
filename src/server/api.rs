//! The OpenAI chat-completions request as JSON, checked and turned into a harmony prompt, and the
//! OpenAI-style error body.

use axum::http::StatusCode;
use serde::Deserialize;

use crate::chat::{
    render_for_completion, Channel, ChatMessage, Conversation, ReasoningEffort, RenderOptions,
    SystemSettings, Tokenizer,
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

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
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
    if request.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only `n` = 1 is supported", Some("n")));
    }
    let reasoning = match request.reasoning_effort.as_deref() {
        None => ReasoningEffort::Medium,
        Some(text) => text
            .parse()
            .map_err(|message: String| ApiError::invalid(message, Some("reasoning_effort")))?,
    };
    let mut developer: Vec<String> = Vec::new();
    let mut messages = Vec::new();
    for (index, message) in request.messages.into_iter().enumerate() {
        let param = format!("messages[{index}]");
        let text = content_text(message.content, &param)?;
        match message.role.as_str() {
            // Several are joined in order, wherever they stand; an empty one adds nothing (the
            // chat template renders no developer message for an empty system message).
            "system" | "developer" => {
                if !text.trim().is_empty() {
                    developer.push(text)
                }
            }
            "user" => messages.push(ChatMessage::user(text)),
            "assistant" => messages.push(ChatMessage::assistant(Channel::Final, text)),
            other => {
                return Err(ApiError::invalid(
                    format!("{param}.role is {other:?}; this server takes system, developer, user and assistant messages"),
                    Some(&format!("{param}.role")),
                ))
            }
        }
    }
    let conversation = Conversation {
        system: SystemSettings {
            reasoning: Some(reasoning),
            date: date.map(str::to_owned),
            ..SystemSettings::default()
        },
        developer: (!developer.is_empty()).then(|| developer.join("\n\n")),
        messages,
        extra: serde_json::Map::new(),
    };
    let prompt = render_for_completion(tokenizer, &conversation, &RenderOptions::default())
        .map_err(|error| {
            ApiError::invalid(
                format!("cannot encode the messages: {error}"),
                Some("messages"),
            )
        })?;
    if prompt.len() >= context {
        return Err(ApiError::invalid(
            format!(
                "the prompt is {} tokens, but the context holds {context} (prompt and reply); shorten the messages",
                prompt.len()
            ),
            Some("messages"),
        )
        .with_code("context_length_exceeded"));
    }

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
    let sampler = SamplerSettings {
        temperature: request.temperature.unwrap_or(1.0),
        top_p: request.top_p.unwrap_or(1.0),
        seed: request.seed,
        ..SamplerSettings::default()
    };
    if let Err(error) = sampler.validate() {
        let param = match error {
            crate::engine::SamplerError::TopP(_) => "top_p",
            _ => "temperature",
        };
        return Err(ApiError::invalid(error.to_string(), Some(param)));
    }
    let stop = match request.stop {
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
    Ok(ChatJob {
        prompt,
        sampler,
        max_tokens,
        stop,
        stream: request.stream.unwrap_or(false),
        include_usage: request.stream_options.unwrap_or_default().include_usage,
    })
}

fn content_text(content: Option<Content>, param: &str) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(text)) => Ok(text),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (index, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(piece)) => text.push_str(&piece),
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
        let valid = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true,"stop":["a","b"],"max_tokens":3,"temperature":0.5}"#;
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
