//! The HTTP side of the remote engine: `GET /v1/models`, a streamed `POST /v1/chat/completions`
//! read as server-sent events, and an ossterm server's `/metrics`. reqwest (rustls for https)
//! speaks HTTP and eventsource-stream splits the event stream; this module only maps the OpenAI
//! shapes onto what the engine needs and turns every failure into a [`RemoteError`] that carries
//! the server's own message.

use crate::engine::protocol::ReasoningEffort;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use thiserror::Error;

/// Environment variable the API key is read from when neither `--api-key` nor the config names
/// another.
pub const DEFAULT_API_KEY_ENV: &str = "OSSTERM_API_KEY";

/// How long a connection may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Default longest silence of a server mid-request (no header, no event) before the request is
/// given up. Generous: a busy server may queue a request, and a CPU server prefills a long chat
/// for minutes before the first token.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a streaming request looks at its cancel check while it waits for the server.
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// Longest server message quoted in an error.
const MAX_MESSAGE_CHARS: usize = 300;

#[derive(Debug, Error)]
pub enum RemoteError {
    #[error("invalid server URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error("cannot reach {url}: {reason}")]
    Connect { url: String, reason: String },
    #[error("{url} answered HTTP {status}: {message}")]
    Status {
        url: String,
        status: u16,
        message: String,
        /// `Retry-After` of a 429 or 503, in seconds.
        retry_after: Option<u64>,
    },
    #[error("{url} sent nothing for {seconds} s (timeout)")]
    Timeout { url: String, seconds: u64 },
    #[error("the stream from {url} stopped mid-way: {reason}")]
    Interrupted { url: String, reason: String },
    #[error("{url} sent an error in the stream: {message}")]
    StreamError { url: String, message: String },
    #[error("{url} sent a reply that is not the OpenAI shape: {reason}")]
    Malformed { url: String, reason: String },
    #[error("{url} lists no models; name one with --remote-model")]
    NoModels { url: String },
}

/// Where the server is and how to talk to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteTarget {
    /// The base URL as given (`http://host:8000` or `http://host:8000/v1`).
    pub url: String,
    pub api_key: Option<String>,
    pub idle_timeout: Duration,
}

/// One model of `GET /v1/models`, with the context length where the server says it (vLLM's
/// `max_model_len`, llama-server's `meta.n_ctx_train`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteModel {
    pub id: String,
    pub context_length: Option<usize>,
}

/// What a chat request asks for, beyond the messages.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatParams {
    pub model: String,
    pub reasoning_effort: ReasoningEffort,
    pub temperature: f32,
    pub top_p: f32,
    /// 0: off (not sent).
    pub top_k: usize,
    /// 0: off (not sent).
    pub min_p: f32,
    /// `None`: the server's default (often the rest of its context).
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
}

/// One OpenAI chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiMessage {
    pub role: &'static str,
    pub content: String,
}

/// A piece of streamed text as the server labelled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaKind {
    /// `reasoning_content` or `reasoning`.
    Reasoning,
    /// `content`.
    Content,
}

/// Token counts of `usage` (and the cached part of the prompt where the server reports it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

/// llama-server's (and ossterm serve's) `timings`: the server's own prompt and decode time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServerTimings {
    pub prompt_tokens: u64,
    pub prompt_ms: f64,
    pub predicted_tokens: u64,
    pub predicted_ms: f64,
}

/// Why the server ended a reply (`finish_reason`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    /// Anything else the server names (`tool_calls`, `content_filter`).
    Other(String),
    /// The stream ended with `[DONE]` without naming a reason.
    Unstated,
    /// The cancel check answered yes; the connection was closed.
    Cancelled,
}

/// How a streamed request went, measured by the client plus what the server reported.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOutcome {
    pub finish: Finish,
    pub usage: Option<Usage>,
    pub timings: Option<ServerTimings>,
    pub client: ClientTimings,
}

/// What the client saw of a request's time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClientTimings {
    /// Sent until the response header arrived.
    pub headers: Option<Duration>,
    /// Sent until the first text arrived.
    pub first_text: Option<Duration>,
    /// Sent until the last text arrived.
    pub last_text: Option<Duration>,
    /// Events that carried text (servers send one per token or per step).
    pub text_events: u64,
    /// Sent until the last event (the finish or usage chunk) arrived.
    pub last_event: Option<Duration>,
}

impl ClientTimings {
    /// Text events per second after the first one: the decode rate as the client sees it.
    pub fn decode_rate(&self) -> Option<f64> {
        let (first, last) = (self.first_text?, self.last_text?);
        let span = last.saturating_sub(first).as_secs_f64();
        (self.text_events > 1 && span > 0.0).then(|| (self.text_events - 1) as f64 / span)
    }
}

/// The client of one server: a connection pool and the normalized endpoint URLs.
pub struct RemoteClient {
    http: reqwest::Client,
    target: RemoteTarget,
    /// `…/v1`, without a trailing slash.
    api_base: String,
    /// The server root, for `/metrics`.
    root: String,
}

impl RemoteClient {
    /// Checks the URL (http or https, with a host) and builds the client; nothing is sent yet.
    pub fn new(target: RemoteTarget) -> Result<RemoteClient, RemoteError> {
        let invalid = |reason: &str| RemoteError::InvalidUrl {
            url: target.url.clone(),
            reason: reason.to_string(),
        };
        let parsed = reqwest::Url::parse(target.url.trim()).map_err(|error| {
            invalid(&format!(
                "{error} (expected e.g. http://localhost:8000 or https://host/v1)"
            ))
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(invalid("expected an http:// or https:// URL"));
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(invalid("the URL names no host"));
        }
        let path = parsed.path().trim_end_matches('/');
        let (root_path, api_path) = match path.strip_suffix("/v1") {
            Some(root) => (root.to_string(), path.to_string()),
            None => (path.to_string(), format!("{path}/v1")),
        };
        let origin = parsed.origin().ascii_serialization();
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("ossterm/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|error| RemoteError::Client(error.to_string()))?;
        Ok(RemoteClient {
            http,
            api_base: format!("{origin}{api_path}"),
            root: format!("{origin}{root_path}"),
            target,
        })
    }

    /// The URL as the user gave it, for titles and messages.
    pub fn url(&self) -> &str {
        &self.target.url
    }

    fn request(&self, builder: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.target.api_key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }

    /// `GET /v1/models`.
    pub async fn list_models(&self) -> Result<Vec<RemoteModel>, RemoteError> {
        let url = format!("{}/models", self.api_base);
        let response = self.send(self.request(self.http.get(&url)), &url).await?;
        let body = self.read_body(response, &url).await?;
        parse_models(&body).map_err(|reason| RemoteError::Malformed { url, reason })
    }

    /// An ossterm server's `/metrics` (Prometheus text): `Ok(None)` when the server answers
    /// without them (any other server: 404), `Err(())` when it does not answer (in time).
    pub async fn ossterm_metrics(&self) -> Result<Option<ServerMetrics>, ()> {
        let url = format!("{}/metrics", self.root);
        let request = self
            .request(self.http.get(&url))
            .timeout(Duration::from_secs(2));
        let response = request.send().await.map_err(|_| ())?;
        if !response.status().is_success() {
            return Ok(None);
        }
        let text = response.text().await.map_err(|_| ())?;
        Ok(ServerMetrics::parse(&text))
    }

    /// Streams one chat completion: every piece of text goes to `on_delta` as it arrives.
    /// `cancelled` is asked between events and while waiting; a yes drops the connection, which
    /// is how an OpenAI server learns to stop.
    pub async fn chat(
        &self,
        messages: &[ApiMessage],
        params: &ChatParams,
        cancelled: &dyn Fn() -> bool,
        on_delta: &mut dyn FnMut(DeltaKind, &str),
    ) -> Result<ChatOutcome, RemoteError> {
        let url = format!("{}/chat/completions", self.api_base);
        let body = chat_body(messages, params);
        let started = Instant::now();
        let mut client = ClientTimings::default();
        let request = self
            .request(self.http.post(&url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body.to_string());
        let response = match self
            .until_cancelled(self.send(request, &url), cancelled)
            .await
        {
            Some(response) => response??,
            None => return Ok(cancelled_outcome(client)),
        };
        client.headers = Some(started.elapsed());
        let mut events = response.bytes_stream().eventsource();
        let mut finish = None;
        let mut usage = None;
        let mut timings = None;
        loop {
            let Some(next) = self.until_cancelled(events.next(), cancelled).await else {
                return Ok(ChatOutcome {
                    finish: Finish::Cancelled,
                    usage,
                    timings,
                    client,
                });
            };
            let event = match next? {
                Some(Ok(event)) => event,
                Some(Err(error)) => {
                    return Err(RemoteError::Interrupted {
                        url,
                        reason: error_chain(&error),
                    })
                }
                None if finish.is_some() => break,
                None => {
                    return Err(RemoteError::Interrupted {
                        url,
                        reason: "the connection closed before the reply finished".to_string(),
                    })
                }
            };
            let data = event.data.trim();
            client.last_event = Some(started.elapsed());
            if data == "[DONE]" {
                break;
            }
            if data.is_empty() {
                continue;
            }
            let chunk: Value =
                serde_json::from_str(data).map_err(|error| RemoteError::Malformed {
                    url: url.clone(),
                    reason: format!("an event is not JSON ({error}): {}", clip(data)),
                })?;
            if let Some(message) = error_message(&chunk) {
                return Err(RemoteError::StreamError { url, message });
            }
            let parsed = parse_chunk(&chunk);
            for (kind, text) in &parsed.deltas {
                if text.is_empty() {
                    continue;
                }
                let at = started.elapsed();
                client.first_text.get_or_insert(at);
                client.last_text = Some(at);
                client.text_events += 1;
                on_delta(*kind, text);
            }
            if let Some(reason) = parsed.finish {
                finish = Some(reason);
            }
            usage = parsed.usage.or(usage);
            timings = parsed.timings.or(timings);
        }
        Ok(ChatOutcome {
            finish: finish.unwrap_or(Finish::Unstated),
            usage,
            timings,
            client,
        })
    }

    /// Runs `work` until it ends (`Some`), the cancel check says yes or the idle timeout passes
    /// (`None` for a cancel; the timeout is an error inside `Some`).
    async fn until_cancelled<T>(
        &self,
        work: impl std::future::Future<Output = T>,
        cancelled: &dyn Fn() -> bool,
    ) -> Option<Result<T, RemoteError>> {
        let deadline = tokio::time::sleep(self.target.idle_timeout);
        tokio::pin!(work, deadline);
        let mut poll = tokio::time::interval(CANCEL_POLL);
        loop {
            tokio::select! {
                output = &mut work => return Some(Ok(output)),
                () = &mut deadline => {
                    return Some(Err(RemoteError::Timeout {
                        url: self.target.url.clone(),
                        seconds: self.target.idle_timeout.as_secs(),
                    }))
                }
                _ = poll.tick() => {
                    if cancelled() {
                        return None;
                    }
                }
            }
        }
    }

    /// Sends `request`; a status of 400 or more becomes [`RemoteError::Status`] with the server's
    /// message.
    async fn send(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Response, RemoteError> {
        let response = request.send().await.map_err(|error| RemoteError::Connect {
            url: url.to_string(),
            reason: root_cause(&error),
        })?;
        let status = response.status();
        if status.is_client_error() || status.is_server_error() {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.trim().parse().ok());
            let body = response.text().await.unwrap_or_default();
            let message = error_body_message(&body).unwrap_or_else(|| {
                status
                    .canonical_reason()
                    .unwrap_or("no message")
                    .to_string()
            });
            return Err(RemoteError::Status {
                url: url.to_string(),
                status: status.as_u16(),
                message,
                retry_after,
            });
        }
        Ok(response)
    }

    async fn read_body(
        &self,
        response: reqwest::Response,
        url: &str,
    ) -> Result<String, RemoteError> {
        let read = tokio::time::timeout(self.target.idle_timeout, response.text()).await;
        match read {
            Ok(Ok(body)) => Ok(body),
            Ok(Err(error)) => Err(RemoteError::Interrupted {
                url: url.to_string(),
                reason: error_chain(&error),
            }),
            Err(_) => Err(RemoteError::Timeout {
                url: url.to_string(),
                seconds: self.target.idle_timeout.as_secs(),
            }),
        }
    }
}

fn cancelled_outcome(client: ClientTimings) -> ChatOutcome {
    ChatOutcome {
        finish: Finish::Cancelled,
        usage: None,
        timings: None,
        client,
    }
}

impl RemoteError {
    /// A short hint for the status line after the error itself.
    pub fn hint(&self) -> Option<String> {
        match self {
            RemoteError::Status {
                status: 401 | 403, ..
            } => Some("check --api-key or the key's environment variable".to_string()),
            RemoteError::Status {
                status: 404,
                message,
                ..
            } if message.to_lowercase().contains("model") => {
                Some("check --remote-model (the server lists its models at /v1/models)".to_string())
            }
            RemoteError::Status {
                status: 429 | 503,
                retry_after: Some(seconds),
                ..
            } => Some(format!("the server asks to retry after {seconds} s")),
            RemoteError::Status { status: 429, .. } => {
                Some("the server is busy: retry later".to_string())
            }
            _ => None,
        }
    }

    /// Whether the same request may succeed later (the server down or busy, the network).
    pub fn is_transient(&self) -> bool {
        match self {
            RemoteError::Connect { .. }
            | RemoteError::Timeout { .. }
            | RemoteError::Interrupted { .. }
            | RemoteError::StreamError { .. } => true,
            RemoteError::Status { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }

    /// The error with its hint, as the status line shows it.
    pub fn describe(&self) -> String {
        match self.hint() {
            Some(hint) => format!("{self}; {hint}"),
            None => self.to_string(),
        }
    }
}

/// The request body: the messages, streaming with usage, reasoning effort and every sampling
/// setting (the filters that are off are left out, as some servers refuse fields they lack).
pub fn chat_body(messages: &[ApiMessage], params: &ChatParams) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|message| json!({"role": message.role, "content": message.content}))
        .collect();
    let mut body = json!({
        "model": params.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
        "reasoning_effort": params.reasoning_effort.name(),
        "temperature": params.temperature,
        "top_p": params.top_p,
    });
    if let Some(max_tokens) = params.max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    if params.top_k > 0 {
        body["top_k"] = json!(params.top_k);
    }
    if params.min_p > 0.0 {
        body["min_p"] = json!(params.min_p);
    }
    if let Some(seed) = params.seed {
        body["seed"] = json!(seed);
    }
    body
}

/// What one streamed chunk carries.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedChunk {
    pub deltas: Vec<(DeltaKind, String)>,
    pub finish: Option<Finish>,
    pub usage: Option<Usage>,
    pub timings: Option<ServerTimings>,
}

/// Reads a `chat.completion.chunk`: the first choice's delta (reasoning under either name, then
/// content), its finish reason, and `usage`/`timings` wherever the server put them.
pub fn parse_chunk(chunk: &Value) -> ParsedChunk {
    let mut parsed = ParsedChunk::default();
    let choice = chunk["choices"].get(0);
    if let Some(choice) = choice {
        let delta = &choice["delta"];
        // A server sends one of the two names, or (like ossterm serve) both with the same text.
        let reasoning = delta["reasoning_content"]
            .as_str()
            .or_else(|| delta["reasoning"].as_str());
        if let Some(text) = reasoning {
            parsed.deltas.push((DeltaKind::Reasoning, text.to_string()));
        }
        if let Some(text) = delta["content"].as_str() {
            parsed.deltas.push((DeltaKind::Content, text.to_string()));
        }
        parsed.finish = choice["finish_reason"].as_str().map(|reason| match reason {
            "stop" => Finish::Stop,
            "length" => Finish::Length,
            other => Finish::Other(other.to_string()),
        });
    }
    let usage = &chunk["usage"];
    if usage.is_object() {
        let count = |value: &Value| value.as_u64().unwrap_or(0);
        parsed.usage = Some(Usage {
            prompt_tokens: count(&usage["prompt_tokens"]),
            completion_tokens: count(&usage["completion_tokens"]),
            cached_tokens: count(&usage["prompt_tokens_details"]["cached_tokens"]),
        });
    }
    let timings = &chunk["timings"];
    if timings.is_object() {
        let number = |value: &Value| value.as_f64().unwrap_or(0.0);
        parsed.timings = Some(ServerTimings {
            prompt_tokens: timings["prompt_n"].as_u64().unwrap_or(0),
            prompt_ms: number(&timings["prompt_ms"]),
            predicted_tokens: timings["predicted_n"].as_u64().unwrap_or(0),
            predicted_ms: number(&timings["predicted_ms"]),
        });
    }
    parsed
}

/// The `data` of `GET /v1/models`.
pub fn parse_models(body: &str) -> Result<Vec<RemoteModel>, String> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        max_model_len: Option<usize>,
        #[serde(default)]
        meta: Option<Meta>,
    }
    #[derive(Deserialize)]
    struct Meta {
        #[serde(default)]
        n_ctx_train: Option<usize>,
    }
    let list: List = serde_json::from_str(body).map_err(|error| {
        format!(
            "GET /v1/models is not a model list ({error}): {}",
            clip(body)
        )
    })?;
    Ok(list
        .data
        .into_iter()
        .map(|entry| RemoteModel {
            context_length: entry
                .max_model_len
                .or(entry.meta.and_then(|meta| meta.n_ctx_train)),
            id: entry.id,
        })
        .collect())
}

/// The message of an error object: OpenAI's `{"error": {"message": …}}`, `{"error": "…"}`, or
/// vLLM's and others' top-level `{"message": …}` / `{"detail": …}`.
pub fn error_message(value: &Value) -> Option<String> {
    let error = &value["error"];
    let text = error["message"]
        .as_str()
        .or_else(|| error.as_str())
        .or_else(|| {
            (value["object"].as_str() == Some("error"))
                .then(|| value["message"].as_str())
                .flatten()
        })?;
    Some(clip(text))
}

/// The message of an error response body: its JSON error, else the text itself.
pub fn error_body_message(body: &str) -> Option<String> {
    let trimmed = body.trim();
    if trimmed.is_empty() {
        return None;
    }
    match serde_json::from_str::<Value>(trimmed) {
        Ok(value) => error_message(&value)
            .or_else(|| value["message"].as_str().map(clip))
            .or_else(|| value["detail"].as_str().map(clip))
            .or_else(|| Some(clip(trimmed))),
        Err(_) => Some(clip(trimmed)),
    }
}

fn clip(text: &str) -> String {
    let mut clipped: String = text.chars().take(MAX_MESSAGE_CHARS).collect();
    if clipped.len() < text.len() {
        clipped.push('…');
    }
    clipped
}

/// The innermost cause of an error ("Connection refused (os error 111)"): reqwest's outer
/// layers only repeat the URL.
fn root_cause(error: &dyn std::error::Error) -> String {
    let mut cause = error;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

/// An error with its sources ("error sending request: … connection refused").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The gauges of an ossterm server's `/metrics` the app shows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServerMetrics {
    pub decode_tokens_per_second: f64,
    pub queue_depth: f64,
    pub active_sequences: f64,
    pub kv_use_ratio: f64,
}

impl ServerMetrics {
    /// Reads the `ossterm_*` samples of Prometheus text; `None` when none is there (a server
    /// that is not ossterm).
    pub fn parse(text: &str) -> Option<ServerMetrics> {
        let mut metrics = ServerMetrics::default();
        let mut found = false;
        for line in text.lines().filter(|line| !line.starts_with('#')) {
            let mut fields = line.split_whitespace();
            let (Some(name), Some(value)) = (fields.next(), fields.next()) else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let slot = match name {
                "ossterm_decode_tokens_per_second" => &mut metrics.decode_tokens_per_second,
                "ossterm_queue_depth" => &mut metrics.queue_depth,
                "ossterm_active_sequences" => &mut metrics.active_sequences,
                "ossterm_kv_use_ratio" => &mut metrics.kv_use_ratio,
                _ => continue,
            };
            *slot = value;
            found = true;
        }
        found.then_some(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(url: &str) -> Result<RemoteClient, RemoteError> {
        RemoteClient::new(RemoteTarget {
            url: url.to_string(),
            api_key: None,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        })
    }

    #[test]
    fn base_urls_with_and_without_v1_reach_the_same_endpoints() {
        for url in [
            "http://host:8000",
            "http://host:8000/",
            "http://host:8000/v1/",
        ] {
            let client = client(url).unwrap();
            assert_eq!(client.api_base, "http://host:8000/v1", "{url}");
            assert_eq!(client.root, "http://host:8000", "{url}");
        }
        let prefixed = client("https://example.com/llm/v1").unwrap();
        assert_eq!(prefixed.api_base, "https://example.com/llm/v1");
        assert_eq!(prefixed.root, "https://example.com/llm");
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        for (url, expected) in [
            ("localhost:8000", "http"),
            ("ftp://host", "http:// or https://"),
            ("not a url", "expected e.g."),
        ] {
            let error = client(url).err().expect(url).to_string();
            assert!(error.contains(expected), "{url}: {error}");
        }
    }

    #[test]
    fn chunks_give_reasoning_under_either_name_then_content() {
        let both = json!({"choices": [{"delta": {"reasoning_content": "a", "reasoning": "a"}}]});
        assert_eq!(
            parse_chunk(&both).deltas,
            vec![(DeltaKind::Reasoning, "a".to_string())]
        );
        let vllm = json!({"choices": [{"delta": {"reasoning": "b"}, "finish_reason": null}]});
        assert_eq!(
            parse_chunk(&vllm).deltas,
            vec![(DeltaKind::Reasoning, "b".to_string())]
        );
        let content = json!({"choices": [{"delta": {"content": "c"}, "finish_reason": "length"}]});
        let parsed = parse_chunk(&content);
        assert_eq!(parsed.deltas, vec![(DeltaKind::Content, "c".to_string())]);
        assert_eq!(parsed.finish, Some(Finish::Length));
        let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 3}},
            "timings": {"prompt_n": 6, "prompt_ms": 12.5, "predicted_n": 4, "predicted_ms": 30.0}});
        let parsed = parse_chunk(&usage);
        assert_eq!(
            parsed.usage,
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 4,
                cached_tokens: 3
            })
        );
        assert_eq!(parsed.timings.unwrap().predicted_ms, 30.0);
    }

    #[test]
    fn error_messages_are_found_in_every_common_shape() {
        assert_eq!(
            error_body_message(r#"{"error":{"message":"bad key","type":"x"}}"#).as_deref(),
            Some("bad key")
        );
        assert_eq!(
            error_body_message(
                r#"{"object":"error","message":"The model `x` does not exist.","code":404}"#
            )
            .as_deref(),
            Some("The model `x` does not exist.")
        );
        assert_eq!(
            error_body_message(r#"{"error":"overloaded"}"#).as_deref(),
            Some("overloaded")
        );
        assert_eq!(
            error_body_message("upstream down").as_deref(),
            Some("upstream down")
        );
        assert_eq!(error_body_message("  "), None);
    }

    #[test]
    fn models_read_ids_and_context_lengths() {
        let models = parse_models(
            r#"{"object":"list","data":[{"id":"openai/gpt-oss-20b","max_model_len":131072},
            {"id":"gguf","meta":{"n_ctx_train":4096}},{"id":"plain"}]}"#,
        )
        .unwrap();
        assert_eq!(models[0].context_length, Some(131_072));
        assert_eq!(models[1].context_length, Some(4096));
        assert_eq!(models[2].context_length, None);
        assert!(parse_models("[]").is_err());
    }

    #[test]
    fn the_body_sends_effort_and_sampling_and_leaves_off_filters() {
        let mut params = ChatParams {
            model: "m".to_string(),
            reasoning_effort: ReasoningEffort::High,
            temperature: 0.5,
            top_p: 0.9,
            top_k: 0,
            min_p: 0.0,
            max_tokens: Some(64),
            seed: None,
        };
        let messages = [ApiMessage {
            role: "user",
            content: "hi".to_string(),
        }];
        let body = chat_body(&messages, &params);
        assert_eq!(body["reasoning_effort"], "high");
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["stream"], true);
        assert!(body.get("top_k").is_none() && body.get("min_p").is_none());
        assert!(body.get("seed").is_none());
        params.top_k = 40;
        params.min_p = 0.05;
        params.seed = Some(7);
        let body = chat_body(&messages, &params);
        assert_eq!(body["top_k"], 40);
        assert_eq!(body["seed"], 7);
        assert!(body["min_p"].as_f64().unwrap() > 0.04);
    }

    #[test]
    fn ossterm_metrics_are_read_and_other_text_is_not() {
        let text = "# TYPE ossterm_queue_depth gauge\nossterm_queue_depth 2\nossterm_decode_tokens_per_second 31.5\nossterm_kv_use_ratio 0.25\n";
        let metrics = ServerMetrics::parse(text).unwrap();
        assert_eq!(metrics.queue_depth, 2.0);
        assert_eq!(metrics.decode_tokens_per_second, 31.5);
        assert_eq!(metrics.kv_use_ratio, 0.25);
        assert_eq!(ServerMetrics::parse("vllm:num_requests_running 1\n"), None);
    }
}
