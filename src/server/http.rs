//! The HTTP endpoints (axum): chat completions (JSON or server-sent events), models, health and
//! metrics, every error as an OpenAI-style body.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::api::{parse_chat_request, parse_json, prepare_chat, ApiError, ChatJob};
use super::completions::{
    legacy_logprobs, legacy_logprobs_after, prepare_completion, CompletionRequest,
};
use super::metrics::Metrics;
use super::reply::ReplyDelta;
use super::reply::{logprob_json, LogprobEntry};
use super::responses::{continue_previous, prepare_responses, status_of, Outcome, ResponseBuilder};
use super::scheduler::{Event, Finish, Job, Scheduler, SubmitError, Usage};
use super::stored::ResponseStore;
use super::structured::OutputConstraint;
use crate::chat::Tokenizer;

/// What every handler shares.
pub struct AppState {
    pub scheduler: Scheduler,
    pub metrics: Arc<Metrics>,
    pub tokenizer: &'static Tokenizer,
    /// Tokens one sequence holds (prompt and reply).
    pub context: usize,
    pub model_id: String,
    pub api_key: Option<String>,
    pub started: u64,
    /// Positions the model was trained for and its vocabulary, for `/v1/models`.
    pub trained_context: usize,
    pub vocab: usize,
    /// Sequences decoded at once (`--parallel`).
    pub parallel: usize,
    /// Finished Responses API replies kept for `previous_response_id` and retrieval.
    pub responses: std::sync::Mutex<ResponseStore>,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        scheduler: Scheduler,
        tokenizer: &'static Tokenizer,
        context: usize,
        model_id: String,
        api_key: Option<String>,
    ) -> AppState {
        AppState {
            metrics: scheduler.metrics().clone(),
            scheduler,
            tokenizer,
            context,
            model_id,
            api_key,
            started: unix_seconds(),
            trained_context: 0,
            vocab: 0,
            parallel: 1,
            responses: std::sync::Mutex::new(ResponseStore::default()),
            next_id: AtomicU64::new(1),
        }
    }

    /// Adds what `/v1/models` reports about the model besides its id: the positions it was
    /// trained for, its vocabulary and the sequences decoded at once.
    pub fn with_model_facts(
        mut self,
        trained_context: usize,
        vocab: usize,
        parallel: usize,
    ) -> Self {
        self.trained_context = trained_context;
        self.vocab = vocab;
        self.parallel = parallel;
        self
    }
}

/// How far past the limit an oversized body is still read (and discarded) before the 413 is sent.
/// A client writes its whole body before it reads the reply; refusing at once would close the
/// socket under it, and it would see a broken pipe instead of the 413.
const OVERSIZED_BODY_DRAIN_BYTES: usize = 64 << 20;

/// The router: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/tokenize`,
/// `/detokenize`, `/v1/models`, `/health`, `/metrics`, and with `web_ui` the chat page at `/`;
/// bodies larger than `max_body` bytes are refused with 413.
pub fn router(state: Arc<AppState>, max_body: usize, web_ui: bool) -> Router {
    let routes = if web_ui {
        Router::new()
            .route("/", get(super::webui::page))
            .route("/chat.js", get(super::webui::script))
    } else {
        Router::new()
    };
    routes
        .route(
            "/v1/chat/completions",
            post(move |state, headers, body| chat_completions(state, headers, body, max_body)),
        )
        .route(
            "/v1/completions",
            post(move |state, headers, body| completions(state, headers, body, max_body)),
        )
        .route(
            "/v1/responses",
            post(move |state, headers, body| responses(state, headers, body, max_body)),
        )
        .route(
            "/tokenize",
            post(
                move |State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body| async move {
                    json_reply(state, headers, body, max_body, |body, state| {
                        super::api::tokenize(body, state.tokenizer, state.context)
                    })
                    .await
                },
            ),
        )
        .route(
            "/detokenize",
            post(
                move |State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body| async move {
                    json_reply(state, headers, body, max_body, |body, state| {
                        super::api::detokenize(body, state.tokenizer)
                    })
                    .await
                },
            ),
        )
        .route(
            "/v1/responses/{id}",
            get(stored_response).delete(delete_response),
        )
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Bodies are limited by `read_body`, which drains before refusing.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// Which browser pages may call the API (CORS): pages served from this machine (`localhost`,
/// `127.0.0.1`, `[::1]`, any port, http or https) and the `extra` origins (`*`: every origin).
/// Other pages get no `Access-Control-Allow-Origin`, so a website the user happens to visit
/// cannot use the local model through the browser (ollama limits origins for the same reason);
/// clients outside a browser (curl, the openai package, editors) send no origin and are not
/// affected. Preflight requests are answered here; `Authorization` and `Content-Type` may be
/// sent.
pub fn cors(extra: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    let any = extra.iter().any(|origin| origin == "*");
    let extra: Vec<String> = extra
        .iter()
        .map(|o| o.trim_end_matches('/').to_owned())
        .collect();
    let allowed = AllowOrigin::predicate(move |origin: &HeaderValue, _| {
        let Ok(origin) = origin.to_str() else {
            return false;
        };
        any || is_local_origin(origin) || extra.iter().any(|o| o == origin)
    });
    CorsLayer::new()
        .allow_origin(allowed)
        .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
        .max_age(std::time::Duration::from_secs(3600))
}

/// `http(s)://localhost`, `127.0.0.1` or `[::1]`, with any port and nothing after.
fn is_local_origin(origin: &str) -> bool {
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    let host = match rest.strip_prefix("[::1]") {
        Some(port) => return port.is_empty() || is_port(port),
        None => rest.split_once(':').map_or(rest, |(host, _)| host),
    };
    let port = &rest[host.len()..];
    matches!(host, "localhost" | "127.0.0.1") && (port.is_empty() || is_port(port))
}

/// `:` and one to five digits.
fn is_port(text: &str) -> bool {
    text.strip_prefix(':').is_some_and(|digits| {
        (1..=5).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

fn reject(state: &AppState, error: ApiError) -> Response {
    Metrics::add(&state.metrics.requests_rejected, 1);
    error.into_response()
}

/// With an API key set, `Authorization: Bearer KEY` is required (the scheme's name in any case,
/// as RFC 6750 has it).
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            let (scheme, token) = value.trim().split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| token.trim_start())
        });
    if given.is_some_and(|given| same_key(given.as_bytes(), key.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or wrong API key: send `Authorization: Bearer KEY`".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        })
    }
}

/// Whether `given` is `key`, in a time that depends on their lengths only, not on where they first
/// differ (a server on a network must not tell a guesser how much of the key it got right).
fn same_key(given: &[u8], key: &[u8]) -> bool {
    let differences = given.iter().zip(key).fold(0u8, |acc, (a, b)| acc | (a ^ b));
    // `black_box` keeps the compiler from turning the fold into an early-exit comparison.
    std::hint::black_box(differences) == 0 && given.len() == key.len()
}

/// A bodiless request that carries the API key (when the server has one), as an extractor, so a
/// handler states the requirement in its signature and a request without the key never reaches
/// it. Handlers that take a body check after reading it instead (see `read_body`), so a client
/// still writing its body gets the 401 rather than a reset connection.
struct Authorized;

impl FromRequestParts<Arc<AppState>> for Authorized {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, Response> {
        authorize(state, &parts.headers)
            .map(|()| Authorized)
            .map_err(|error| reject(state, error))
    }
}

/// An endpoint answering one JSON object computed from the body alone (`/tokenize`,
/// `/detokenize`): the key, the body limit and the error replies as for the others.
async fn json_reply(
    state: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    max_body: usize,
    answer: impl FnOnce(&[u8], &AppState) -> Result<Value, ApiError> + Send + 'static,
) -> Response {
    let body = read_body(&headers, body, max_body).await;
    let shared = state.clone();
    let answered = off_the_workers(move || {
        authorize(&shared, &headers).and_then(|()| answer(&body?, &shared))
    })
    .await;
    match answered {
        Ok(value) => Json(value).into_response(),
        Err(error) => reject(&state, error),
    }
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(_: Authorized, State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"object": "list", "data": [model_json(&state)]})).into_response()
}

/// `GET /v1/models/{model}` (the openai package's `models.retrieve`): the model served, or 404.
async fn model(
    _: Authorized,
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id != state.model_id {
        let error = ApiError::invalid(
            format!(
                "the model {id:?} does not exist; this server serves {:?}",
                state.model_id
            ),
            Some("model"),
        )
        .with_status(StatusCode::NOT_FOUND)
        .with_code("model_not_found");
        return reject(&state, error);
    }
    Json(model_json(&state)).into_response()
}

/// `GET /v1/responses/{id}`: a kept response as it was answered, or 404.
async fn stored_response(
    _: Authorized,
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let found = state.store().response(&id).cloned();
    match found {
        Some(response) => Json(response).into_response(),
        None => reject(&state, response_not_found(&id)),
    }
}

/// `DELETE /v1/responses/{id}`: forgets a kept response.
async fn delete_response(
    _: Authorized,
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    let removed = state.store().remove(&id);
    match removed {
        true => Json(json!({"id": id, "object": "response", "deleted": true})).into_response(),
        false => reject(&state, response_not_found(&id)),
    }
}

fn response_not_found(id: &str) -> ApiError {
    ApiError::invalid(
        format!(
            "no response with id '{id}' is kept (stored in memory, the last {} at most)",
            super::stored::MAX_RESPONSES
        ),
        None,
    )
    .with_status(StatusCode::NOT_FOUND)
    .with_code("not_found")
}

impl AppState {
    /// The response store; a panic while it was held does not make it unusable (its bounds
    /// hold between operations).
    fn store(&self) -> std::sync::MutexGuard<'_, ResponseStore> {
        self.responses
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps a finished response (completed or incomplete) with the conversation it ended:
    /// `conversation` (its input) and its output items.
    fn keep_response(&self, mut conversation: Vec<Value>, response: &Value) {
        if !matches!(
            response["status"].as_str(),
            Some("completed" | "incomplete")
        ) {
            return;
        }
        if let Some(output) = response["output"].as_array() {
            conversation.extend(output.iter().cloned());
        }
        self.store().insert(response.clone(), conversation);
    }
}

/// The model object, with the context a request may use under the names clients read: vLLM's
/// `max_model_len`, and llama-server's `meta` (`n_ctx` per slot, `n_ctx_train` of the model).
fn model_json(state: &AppState) -> Value {
    json!({
        "id": state.model_id,
        "object": "model",
        "created": state.started,
        "owned_by": "ossterm",
        "max_model_len": state.context,
        "meta": {
            "n_ctx": state.context,
            "n_ctx_train": state.trained_context,
            "n_vocab": state.vocab,
            "n_parallel": state.parallel,
        },
    })
}

async fn metrics(_: Authorized, State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::invalid("no such endpoint; this server has POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /tokenize, POST /detokenize, GET /v1/models, GET /v1/models/{model}, GET /health, GET /metrics and (unless the server runs with --no-webui) the chat page at GET /", None)
        .with_status(StatusCode::NOT_FOUND)
        .with_code("not_found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::invalid("this endpoint does not take that method", None)
        .with_status(StatusCode::METHOD_NOT_ALLOWED)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
    max_body: usize,
) -> Response {
    let body = read_body(&headers, body, max_body).await;
    let shared = state.clone();
    match off_the_workers(move || start_chat(&shared, &headers, body)).await {
        Ok((accepted, events)) => {
            let reply = Reply {
                id: format!(
                    "chatcmpl-{:x}",
                    state.next_id.fetch_add(1, Ordering::Relaxed)
                ),
                created: unix_seconds(),
                model: state.model_id.clone(),
                include_usage: accepted.include_usage,
                logprobs: accepted.logprobs,
                choices: accepted.choices,
                per_prompt: accepted.per_prompt,
            };
            if accepted.stream {
                stream_reply(reply, events).into_response()
            } else {
                whole_reply(reply, events).await
            }
        }
        Err(error) => reject(&state, error),
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
    max_body: usize,
) -> Response {
    let body = read_body(&headers, body, max_body).await;
    let shared = state.clone();
    let started = off_the_workers(move || {
        let state = &shared;
        authorize(state, &headers)?;
        let request: CompletionRequest = parse_json(&body?)?;
        let jobs = prepare_completion(request, state.tokenizer, state.context)?;
        // One channel for every prompt's choices: prompt p's are p x n.. (p + 1) x n.
        let (sender, events) = mpsc::unbounded_channel();
        let mut echoes = Vec::with_capacity(jobs.len());
        let mut accepted: Option<Accepted> = None;
        for (job, echo) in jobs {
            let first = echoes.len() * job.choices;
            let this = submit_into(state, job, &sender, first)?;
            echoes.push(echo.unwrap_or_default());
            accepted.get_or_insert(this).choices = first + this.choices;
        }
        Metrics::add(&state.metrics.requests, 1);
        let accepted = accepted.ok_or_else(|| failure("a request without a prompt".into()))?;
        Ok((accepted, events, echoes))
    })
    .await;
    match started {
        Ok((accepted, events, echoes)) => {
            let reply = Reply {
                id: format!("cmpl-{:x}", state.next_id.fetch_add(1, Ordering::Relaxed)),
                created: unix_seconds(),
                model: state.model_id.clone(),
                include_usage: accepted.include_usage,
                logprobs: accepted.logprobs,
                choices: accepted.choices,
                per_prompt: accepted.per_prompt,
            };
            if accepted.stream {
                stream_completion(reply, events, echoes).into_response()
            } else {
                whole_completion(reply, events, echoes).await
            }
        }
        Err(error) => reject(&state, error),
    }
}

async fn responses(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
    max_body: usize,
) -> Response {
    let body = read_body(&headers, body, max_body).await;
    let shared = state.clone();
    let started = off_the_workers(move || {
        authorize(&shared, &headers)?;
        let kept = |id: &str| shared.store().conversation(id).map(<[Value]>::to_vec);
        let (request, conversation) = continue_previous(&body?, kept)?;
        let (job, echo) = prepare_responses(request, shared.tokenizer, shared.context)?;
        let (accepted, events) = submit(&shared, job)?;
        Ok((accepted, events, echo, conversation))
    })
    .await;
    match started {
        Ok((accepted, events, echo, conversation)) => {
            let id = format!("resp_{:x}", state.next_id.fetch_add(1, Ordering::Relaxed));
            let builder = ResponseBuilder::new(id, unix_seconds(), state.model_id.clone(), echo);
            let keep = conversation.map(|conversation| (state.clone(), conversation));
            if accepted.stream {
                stream_response(builder, events, keep).into_response()
            } else {
                whole_response(builder, events, keep).await
            }
        }
        Err(error) => reject(&state, error),
    }
}

/// The whole reply as one `response` object (status completed, or incomplete at the token
/// limit).
/// A response to keep once done: the server's state and the conversation it continues.
type Keep = Option<(Arc<AppState>, Vec<Value>)>;

async fn whole_response(mut builder: ResponseBuilder, mut events: Events, keep: Keep) -> Response {
    loop {
        // One choice: the Responses API has no `n`.
        match events.recv().await.map(|(_, event)| event) {
            Some(Event::Delta(delta)) => {
                builder.add_logprobs(&delta.logprobs);
                builder.push(&delta.reasoning, &delta.content, &delta.tool_calls)
            }
            Some(Event::Done(finish)) => {
                let status = status_of(finish.reason);
                let response = builder.response(status, Some(&finish.usage), None);
                if let Some((state, conversation)) = keep {
                    state.keep_response(conversation, &response);
                }
                return Json(response).into_response();
            }
            Some(Event::Failed(message)) => return failure(message).into_response(),
            None => return failure("the request was dropped".into()).into_response(),
        }
    }
}

/// The Responses API's semantic events (`event:` the type, `data:` the event object), ending
/// with `response.completed`, `response.incomplete` or `response.failed`. Hanging up cancels
/// the sequence, as for chat completions.
fn stream_response(
    mut builder: ResponseBuilder,
    mut events: Events,
    mut keep: Keep,
) -> impl IntoResponse {
    let (sender, receiver) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let sse = |(kind, value): (String, Value)| {
            Ok(SseEvent::default().event(kind).data(value.to_string()))
        };
        for event in builder.start() {
            if sender.send(sse(event)).await.is_err() {
                return;
            }
        }
        loop {
            let event = tokio::select! {
                _ = sender.closed() => return,
                event = events.recv() => event.map(|(_, event)| event),
            };
            let (out, last) = match event {
                Some(Event::Delta(delta)) => {
                    builder.add_logprobs(&delta.logprobs);
                    (
                        builder.delta(&delta.reasoning, &delta.content, &delta.tool_calls),
                        false,
                    )
                }
                Some(Event::Done(finish)) => {
                    let out = builder.finish(Outcome::Finished(finish.reason, &finish.usage));
                    // The last event carries the whole response.
                    if let (Some((state, conversation)), Some((_, last))) =
                        (keep.take(), out.last())
                    {
                        state.keep_response(conversation, &last["response"]);
                    }
                    (out, true)
                }
                Some(Event::Failed(message)) => (builder.finish(Outcome::Failed(&message)), true),
                None => (
                    builder.finish(Outcome::Failed("the request was dropped")),
                    true,
                ),
            };
            for event in out {
                if sender.send(sse(event)).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(receiver)).keep_alive(KeepAlive::default())
}

/// What the handler keeps of a request once the scheduler has it.
#[derive(Clone, Copy)]
struct Accepted {
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    /// Choices in all (prompts x `n`).
    choices: usize,
    /// Choices per prompt (`n`).
    per_prompt: usize,
}

/// The scheduler's events of one request, each tagged with its choice (`0..n`).
type Events = mpsc::UnboundedReceiver<(usize, Event)>;

/// The body, at most `max_body` bytes. A larger one is read to its end (up to
/// [`OVERSIZED_BODY_DRAIN_BYTES`] more) and refused with 413, so that the client gets the reply.
async fn read_body(headers: &HeaderMap, body: Body, max_body: usize) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::invalid(
            format!("the request body is too large (the limit is {max_body} bytes)"),
            None,
        )
        .with_status(StatusCode::PAYLOAD_TOO_LARGE)
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    let drain_limit = max_body.saturating_add(OVERSIZED_BODY_DRAIN_BYTES);
    if declared.is_some_and(|length| length > drain_limit as u64) {
        return Err(too_large());
    }
    let mut kept =
        Vec::with_capacity(declared.map_or(0, |length| length.min(max_body as u64) as usize));
    let mut seen = 0usize;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| {
            ApiError::invalid(format!("cannot read the request body: {error}"), None)
        })?;
        seen = seen.saturating_add(chunk.len());
        if seen <= max_body {
            kept.extend_from_slice(&chunk);
        } else if seen > drain_limit {
            break;
        }
    }
    if seen > max_body {
        return Err(too_large());
    }
    Ok(Bytes::from(kept))
}

/// A request's own CPU work before it queues (parsing, rendering the prompt, tokenizing,
/// compiling a schema into a grammar: milliseconds, up to a few hundred for a 4 MiB body) on
/// tokio's blocking threads: on the two async workers it would hold up the streams of running
/// replies and `/health` meanwhile. A panic there is answered as a 500, not propagated.
async fn off_the_workers<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|_| {
        Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "preparing the request failed (a bug: please report it)".into(),
            kind: "server_error",
            param: None,
            code: None,
        })
    })
}

fn start_chat(
    state: &AppState,
    headers: &HeaderMap,
    body: Result<Bytes, ApiError>,
) -> Result<(Accepted, Events), ApiError> {
    authorize(state, headers)?;
    let body = body?;
    let request = parse_chat_request(&body)?;
    let job = prepare_chat(request, state.tokenizer, state.context)?;
    submit(state, job)
}

/// Hands a checked job to the scheduler, one sequence per choice (`n`); the receiver hears
/// their events. Choices of a seeded request take seeds `seed`, `seed + 1`, ... (repeatable, and
/// not all the same reply); the scheduler has the later ones copy the first one's prefill.
fn submit(state: &AppState, job: ChatJob) -> Result<(Accepted, Events), ApiError> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let accepted = submit_into(state, job, &sender, 0)?;
    Metrics::add(&state.metrics.requests, 1);
    Ok((accepted, receiver))
}

/// [`submit`] onto an existing channel, the choices numbered from `first` (a completions
/// request's later prompts).
fn submit_into(
    state: &AppState,
    job: ChatJob,
    sender: &mpsc::UnboundedSender<(usize, Event)>,
    first: usize,
) -> Result<Accepted, ApiError> {
    let accepted = Accepted {
        stream: job.stream,
        include_usage: job.include_usage,
        logprobs: job.logprobs.is_some(),
        choices: job.choices,
        per_prompt: job.choices,
    };
    let received = Instant::now();
    for choice in 0..job.choices {
        let mut sampler = job.sampler;
        sampler.seed = sampler.seed.map(|seed| seed.wrapping_add(choice as u64));
        let tool_constraints = job
            .tool_constraints
            .iter()
            .map(|(name, constraint)| (name.clone(), constraint.fork()))
            .collect();
        // A failed submit drops the receiver: choices already queued are cancelled with it.
        state
            .scheduler
            .submit(Job {
                prompt: job.prompt.clone(),
                sampler,
                max_tokens: job.max_tokens,
                stop: job.stop.clone(),
                tools: job.tools,
                forced: job.forced.clone(),
                logprobs: job.logprobs,
                prompt_logprobs: job.prompt_logprobs,
                adjustments: job.adjustments.clone(),
                text: job.text,
                constraint: job.constraint.as_ref().map(OutputConstraint::fork),
                tool_constraints,
                call: job.call.as_ref().map(OutputConstraint::fork),
                choice: first + choice,
                events: sender.clone(),
                received,
            })
            .map_err(|error| {
                let code = match error {
                    SubmitError::QueueFull(_) => "queue_full",
                    SubmitError::ShuttingDown => "shutting_down",
                };
                ApiError {
                    status: StatusCode::SERVICE_UNAVAILABLE,
                    message: error.to_string(),
                    kind: "server_error",
                    param: None,
                    code: Some(code),
                }
            })?;
    }
    Ok(accepted)
}

/// Every choice's deltas and finish, in choice order, once all have finished; the first
/// failure ends the request.
async fn gather(
    mut events: Events,
    choices: usize,
) -> Result<Vec<(Vec<ReplyDelta>, Finish)>, ApiError> {
    let mut deltas: Vec<Vec<ReplyDelta>> = (0..choices).map(|_| Vec::new()).collect();
    let mut finishes: Vec<Option<Finish>> = vec![None; choices];
    let mut open = choices;
    while open > 0 {
        match events.recv().await {
            Some((choice, Event::Delta(delta))) => {
                if let Some(list) = deltas.get_mut(choice) {
                    list.push(delta);
                }
            }
            Some((choice, Event::Done(finish))) => {
                if let Some(slot @ None) = finishes.get_mut(choice) {
                    *slot = Some(finish);
                    open -= 1;
                }
            }
            Some((_, Event::Failed(message))) => return Err(failure(message)),
            None => return Err(failure("the request was dropped".into())),
        }
    }
    Ok(deltas
        .into_iter()
        .zip(finishes.into_iter().flatten())
        .collect())
}

/// The usage of a request's choices together (`per_prompt` of each prompt, in order): each
/// prompt (and what of it came from a cache) once, as its first choice counted it, the
/// completions summed.
fn total_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>, per_prompt: usize) -> Usage {
    let mut total = Usage::default();
    for (index, usage) in usages.into_iter().enumerate() {
        if index % per_prompt.max(1) == 0 {
            total.prompt_tokens += usage.prompt_tokens;
            total.cached_tokens += usage.cached_tokens;
        }
        total.completion_tokens += usage.completion_tokens;
        total.reasoning_tokens += usage.reasoning_tokens;
    }
    total
}

/// The fields every chunk or response of one request repeats.
struct Reply {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// The request asked for log-probabilities.
    logprobs: bool,
    /// Choices in all, and per prompt (`n`; a completions request may have several prompts).
    choices: usize,
    per_prompt: usize,
}

impl Reply {
    fn chunk(&self, choice: usize, delta: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": choice, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
        })
    }

    /// A choice's `logprobs`: `{"content": [...]}` when asked for, else null.
    fn logprobs_json(&self, entries: &[LogprobEntry]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let content: Vec<Value> = entries.iter().map(logprob_json).collect();
        json!({"content": content})
    }
}

/// llama-server's `timings` object: prompt (queue and prefill, until the first token) and
/// predicted (first to last token) times, which load tools read to measure TTFT and decode speed.
fn timings_json(finish: &Finish) -> Value {
    let usage = &finish.usage;
    let prompt_ms = finish.time_to_first_token.as_secs_f64() * 1e3;
    let predicted_ms = finish.decode_time.as_secs_f64() * 1e3;
    let decoded = usage.completion_tokens.saturating_sub(1);
    json!({
        "prompt_n": usage.prompt_tokens - usage.cached_tokens,
        "cache_n": usage.cached_tokens,
        "prompt_ms": prompt_ms,
        "predicted_n": usage.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_second": if predicted_ms > 0.0 { decoded as f64 * 1e3 / predicted_ms } else { 0.0 },
    })
}

fn usage_json(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    })
}

fn failure(message: String) -> ApiError {
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message,
        kind: "server_error",
        param: None,
        code: None,
    }
}

/// The whole reply as one `chat.completion` object. If the client goes away, this future is
/// dropped with the receiver, which cancels the sequences.
async fn whole_reply(reply: Reply, events: Events) -> Response {
    whole(
        &reply,
        events,
        "chat.completion",
        |index, deltas, finish| chat_choice(&reply, index, deltas, finish),
    )
    .await
}

/// A whole reply of every choice as one `object`: `choice` makes each from its deltas and
/// finish; usage counts them together, timings are the first one's.
async fn whole(
    reply: &Reply,
    events: Events,
    object: &str,
    mut choice: impl FnMut(usize, Vec<ReplyDelta>, &Finish) -> Value,
) -> Response {
    let choices = match gather(events, reply.choices).await {
        Ok(choices) => choices,
        Err(error) => return error.into_response(),
    };
    let usage = total_usage(
        choices.iter().map(|(_, finish)| &finish.usage),
        reply.per_prompt,
    );
    let timings = timings_json(&choices[0].1);
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(index, (deltas, finish))| choice(index, deltas, &finish))
        .collect();
    Json(json!({
        "id": reply.id,
        "object": object,
        "created": reply.created,
        "model": reply.model,
        "choices": choices,
        "usage": usage_json(&usage),
        "timings": timings,
    }))
    .into_response()
}

/// One choice of a whole chat reply: its message (reasoning, content, tool calls), log-
/// probabilities and finish reason.
fn chat_choice(reply: &Reply, index: usize, deltas: Vec<ReplyDelta>, finish: &Finish) -> Value {
    let (mut reasoning, mut content) = (String::new(), String::new());
    // (id, name, arguments) of each call, in order.
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut logprobs = Vec::new();
    for delta in deltas {
        reasoning.push_str(&delta.reasoning);
        content.push_str(&delta.content);
        logprobs.extend(delta.logprobs);
        for piece in delta.tool_calls {
            if let Some((id, name)) = piece.opens {
                calls.push((id, name, String::new()));
            }
            if let Some(call) = calls.get_mut(piece.index) {
                call.2.push_str(&piece.arguments);
            }
        }
    }
    let mut message = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = calls
            .iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            })
            .collect();
    }
    if !reasoning.is_empty() {
        message["reasoning_content"] = json!(reasoning);
        message["reasoning"] = json!(reasoning);
    }
    json!({"index": index, "message": message,
           "logprobs": reply.logprobs_json(&logprobs),
           "finish_reason": finish.reason.as_str()})
}

/// The whole completion as one `text_completion` object, a choice per `n` (the echoed prompt
/// first in each when asked).
async fn whole_completion(reply: Reply, events: Events, echoes: Vec<String>) -> Response {
    let per_prompt = reply.per_prompt.max(1);
    let choice = |index: usize, deltas: Vec<ReplyDelta>, finish: &Finish| {
        let echo = echoes.get(index / per_prompt).map_or("", String::as_str);
        let mut text = echo.to_owned();
        let (mut logprobs, mut prompt) = (Vec::new(), None);
        for delta in deltas {
            text.push_str(&delta.content);
            logprobs.extend(delta.logprobs);
            prompt = prompt.or(delta.prompt);
        }
        let logprobs = match reply.logprobs {
            true => legacy_logprobs_after(prompt.as_ref(), &logprobs, echo.len()).0,
            false => Value::Null,
        };
        json!({"text": text, "index": index, "logprobs": logprobs,
               "finish_reason": finish.reason.as_str()})
    };
    whole(&reply, events, "text_completion", choice).await
}

/// A completion as server-sent events: the echoed prompt first (when asked, in each choice), a
/// chunk per step's new text, a chunk with each choice's finish reason, the usage chunk when
/// asked for, then `data: [DONE]`.
fn stream_completion(reply: Reply, events: Events, echoes: Vec<String>) -> impl IntoResponse {
    let chunk =
        move |reply: &Reply, index: usize, text: &str, logprobs: Value, finish: Option<&str>| {
            json!({
                "id": reply.id,
                "object": "text_completion",
                "created": reply.created,
                "model": reply.model,
                "choices": [{"text": text, "index": index, "logprobs": logprobs,
                             "finish_reason": finish}],
            })
        };
    let per_prompt = reply.per_prompt.max(1);
    let echo_of = |index: usize| echoes.get(index / per_prompt).map_or("", String::as_str);
    let mut offsets: Vec<usize> = (0..reply.choices).map(|i| echo_of(i).len()).collect();
    // With log-probabilities the echoed prompt waits for its own (they come with the first
    // delta, after the prefill); without, it goes out at once.
    let first = (0..reply.choices)
        .filter(|&index| !reply.logprobs && !echo_of(index).is_empty())
        .map(|index| chunk(&reply, index, echo_of(index), Value::Null, None))
        .collect();
    let usage = UsageChunk::of(&reply, "text_completion");
    sse_events(first, events, usage, move |index, event, out| match event {
        Event::Delta(piece) => {
            if let Some(prompt) = &piece.prompt {
                let logprobs = legacy_logprobs_after(Some(prompt), &[], 0).0;
                let echo = echoes.get(index / per_prompt).map_or("", String::as_str);
                out.push(chunk(&reply, index, echo, logprobs, None));
            }
            let logprobs = match (
                reply.logprobs && !piece.logprobs.is_empty(),
                offsets.get_mut(index),
            ) {
                (true, Some(offset)) => {
                    let (value, end) = legacy_logprobs(&piece.logprobs, *offset);
                    *offset = end;
                    value
                }
                _ => Value::Null,
            };
            if !piece.content.is_empty() || !logprobs.is_null() {
                out.push(chunk(&reply, index, &piece.content, logprobs, None));
            }
        }
        Event::Done(finish) => {
            let mut done = chunk(&reply, index, "", Value::Null, Some(finish.reason.as_str()));
            done["timings"] = timings_json(&finish);
            out.push(done);
        }
        Event::Failed(message) => out.push(failure(message).body()),
    })
}

/// The usage chunk that ends a stream whose request asked for it (`stream_options.include_usage`):
/// `{id, object, created, model, choices: [], usage}`, the choices' usage together.
struct UsageChunk {
    /// The chunk without `usage`; `None` when the request did not ask for it.
    template: Option<Value>,
    choices: usize,
    per_prompt: usize,
}

impl UsageChunk {
    fn of(reply: &Reply, object: &str) -> UsageChunk {
        UsageChunk {
            template: reply.include_usage.then(|| {
                json!({"id": reply.id, "object": object, "created": reply.created,
                       "model": reply.model, "choices": []})
            }),
            choices: reply.choices,
            per_prompt: reply.per_prompt,
        }
    }
}

/// Server-sent events of one request: `first`, then what `render` makes of each scheduler event
/// (told the choice it belongs to), until the last choice's `Done`, a `Failed` or the scheduler
/// dropping the request; after the last `Done` the usage chunk when asked for; then
/// `data: [DONE]`. A task forwards them and stops as soon as the client's stream is dropped,
/// which closes the scheduler's channel and so cancels the sequences before their next step.
fn sse_events(
    first: Vec<Value>,
    mut events: Events,
    usage: UsageChunk,
    mut render: impl FnMut(usize, Event, &mut Vec<Value>) + Send + 'static,
) -> impl IntoResponse {
    let (sender, receiver) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let data = |value: &Value| Ok(SseEvent::default().data(value.to_string()));
        for value in &first {
            if sender.send(data(value)).await.is_err() {
                return;
            }
        }
        let mut out = Vec::new();
        let mut open = usage.choices;
        let mut usages = vec![Usage::default(); usage.choices];
        loop {
            let event = tokio::select! {
                _ = sender.closed() => return,
                event = events.recv() => event,
            };
            let (last, finished) = match &event {
                Some((_, Event::Delta(_))) => (false, false),
                Some((choice, Event::Done(finish))) => {
                    if let Some(slot) = usages.get_mut(*choice) {
                        *slot = finish.usage;
                    }
                    open = open.saturating_sub(1);
                    (open == 0, open == 0)
                }
                Some((_, Event::Failed(_))) | None => (true, false),
            };
            if let Some((choice, event)) = event {
                render(choice, event, &mut out);
            }
            if let (true, Some(template)) = (finished, &usage.template) {
                let mut chunk = template.clone();
                chunk["usage"] = usage_json(&total_usage(&usages, usage.per_prompt));
                out.push(chunk);
            }
            let mut items: Vec<_> = out.drain(..).map(|value| data(&value)).collect();
            if last {
                items.push(Ok(SseEvent::default().data("[DONE]")));
            }
            for item in items {
                if sender.send(item).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(receiver)).keep_alive(KeepAlive::default())
}

/// A chunk's `tool_calls` delta: a call's first piece carries its id, type and name, as
/// OpenAI's streams do.
fn tool_call_deltas(pieces: Vec<super::reply::ToolCallDelta>) -> Value {
    pieces
        .into_iter()
        .map(|piece| match piece.opens {
            Some((id, name)) => json!({"index": piece.index, "id": id, "type": "function",
                                       "function": {"name": name, "arguments": piece.arguments}}),
            None => json!({"index": piece.index, "function": {"arguments": piece.arguments}}),
        })
        .collect()
}

/// Server-sent events: a first chunk with the role, a chunk per step's new text (reasoning as
/// both `reasoning_content` and `reasoning`, the answer as `content`), a chunk with the finish
/// reason, the usage chunk when asked for, then `data: [DONE]` ([`sse_events`]: a client that
/// goes away cancels the sequence).
fn stream_reply(reply: Reply, events: Events) -> impl IntoResponse {
    let first = (0..reply.choices)
        .map(|index| reply.chunk(index, json!({"role": "assistant", "content": ""}), None))
        .collect();
    let usage = UsageChunk::of(&reply, "chat.completion.chunk");
    sse_events(first, events, usage, move |index, event, out| match event {
        Event::Delta(piece) => {
            let mut delta = json!({});
            if !piece.reasoning.is_empty() {
                delta["reasoning_content"] = json!(piece.reasoning);
                delta["reasoning"] = json!(piece.reasoning);
            }
            if !piece.content.is_empty() {
                delta["content"] = json!(piece.content);
            }
            if !piece.tool_calls.is_empty() {
                delta["tool_calls"] = tool_call_deltas(piece.tool_calls);
            }
            let mut chunk = reply.chunk(index, delta, None);
            if !piece.logprobs.is_empty() {
                chunk["choices"][0]["logprobs"] = reply.logprobs_json(&piece.logprobs);
            }
            out.push(chunk);
        }
        Event::Done(finish) => {
            let mut chunk = reply.chunk(index, json!({}), Some(finish.reason.as_str()));
            chunk["timings"] = timings_json(&finish);
            out.push(chunk);
        }
        Event::Failed(message) => out.push(failure(message).body()),
    })
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::super::reply::{ReplyDelta, ToolCallDelta};
    use super::super::scheduler::{FinishReason, Usage};
    use super::*;
    use std::time::Duration;

    #[test]
    fn keys_match_only_whole_and_exact() {
        assert!(same_key(b"sk-123", b"sk-123"));
        for given in [&b"sk-12"[..], b"sk-1234", b"sk-124", b"SK-123", b""] {
            assert!(!same_key(given, b"sk-123"), "{given:?}");
        }
    }

    /// The events of a reply that reasons, then calls `get_weather` in two pieces.
    fn tool_call_events() -> Events {
        let (sender, receiver) = mpsc::unbounded_channel();
        let piece = |reasoning: &str, calls: Vec<ToolCallDelta>| {
            Event::Delta(ReplyDelta {
                reasoning: reasoning.into(),
                content: String::new(),
                tool_calls: calls,
                logprobs: Vec::new(),
                prompt: None,
            })
        };
        let events = [
            piece("need weather", Vec::new()),
            piece(
                "",
                vec![ToolCallDelta {
                    index: 0,
                    opens: Some(("call_abc".into(), "get_weather".into())),
                    arguments: "{\"city\":".into(),
                }],
            ),
            piece(
                "",
                vec![ToolCallDelta {
                    index: 0,
                    opens: None,
                    arguments: "\"Oslo\"}".into(),
                }],
            ),
            Event::Done(Finish {
                reason: FinishReason::ToolCalls,
                usage: Usage::default(),
                time_to_first_token: Duration::ZERO,
                decode_time: Duration::ZERO,
            }),
        ];
        for event in events {
            sender.send((0, event)).unwrap();
        }
        receiver
    }

    fn reply() -> Reply {
        Reply {
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            include_usage: false,
            logprobs: false,
            choices: 1,
            per_prompt: 1,
        }
    }

    async fn body_text(response: Response) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn request_work_off_the_workers_answers_its_result_and_a_panic_as_a_500() {
        let rt = runtime();
        let answer = rt.block_on(off_the_workers(|| {
            Ok(std::thread::current().name().map(str::to_owned))
        }));
        // Not the runtime's own thread: tokio's blocking pool.
        assert_ne!(
            answer.unwrap(),
            std::thread::current().name().map(str::to_owned)
        );
        let refused = rt.block_on(off_the_workers(|| -> Result<(), ApiError> {
            Err(ApiError::invalid("bad", None))
        }));
        assert_eq!(refused.unwrap_err().status, StatusCode::BAD_REQUEST);
        let panicked = rt.block_on(off_the_workers(|| -> Result<(), ApiError> {
            panic!("a bug while preparing")
        }));
        assert_eq!(
            panicked.unwrap_err().status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn local_origins_are_pages_of_this_machine() {
        for origin in [
            "http://localhost",
            "http://localhost:3000",
            "https://127.0.0.1:8443",
            "http://[::1]:5173",
        ] {
            assert!(is_local_origin(origin), "{origin}");
        }
        for origin in [
            "http://localhost.evil.com",
            "http://127.0.0.1.evil.com:80",
            "https://example.com",
            "http://localhost:3000/x",
            "http://localhost:",
            "http://localhost:123456",
            "null",
            "file://",
            "http://[::1]x",
        ] {
            assert!(!is_local_origin(origin), "{origin}");
        }
    }

    #[test]
    fn a_whole_reply_carries_the_call_with_null_content() {
        let body = runtime()
            .block_on(async { body_text(whole_reply(reply(), tool_call_events()).await).await });
        let value: Value = serde_json::from_str(&body).unwrap();
        let choice = &value["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
        let message = &choice["message"];
        assert_eq!(message["content"], Value::Null, "{body}");
        assert_eq!(message["reasoning_content"], "need weather");
        assert_eq!(
            message["tool_calls"],
            json!([{"id": "call_abc", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}])
        );
    }

    #[test]
    fn a_stream_opens_the_call_once_then_sends_its_arguments() {
        let body = runtime().block_on(async {
            body_text(stream_reply(reply(), tool_call_events()).into_response()).await
        });
        let chunks: Vec<Value> = body
            .lines()
            .filter_map(|line| line.strip_prefix("data: "))
            .filter(|data| *data != "[DONE]")
            .map(|data| serde_json::from_str(data).unwrap())
            .collect();
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|chunk| chunk["choices"][0]["delta"].get("tool_calls"))
            .collect();
        assert_eq!(
            calls,
            [
                &json!([{"index": 0, "id": "call_abc", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\":"}}]),
                &json!([{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]),
            ],
            "{body}"
        );
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{body}");
        assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    }
}
