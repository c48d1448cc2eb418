//! The remote engine (`--remote URL`) against the real `ossterm serve` in process on a loopback
//! port, and against a loopback listener written here that misbehaves (errors, a stream cut
//! short, silence past the timeout, raw harmony text). Also `ossterm run --remote` and the
//! settings panel's handling of the settings a server decides.

mod support;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ossterm::chat::{ChatMessage, Conversation};
use ossterm::engine::protocol::{
    Channel, Command, EngineInfo, Event, GenerateRequest, ReasoningEffort, RequestId, RequestKind,
    Settings, StopReason,
};
use ossterm::engine::worker::EngineHandle;
use ossterm::model::Precision;
use ossterm::remote::{spawn_remote_engine, RemoteConfig, RemoteTarget, SERVER_SETTINGS};
use serde_json::{json, Value};
use support::server::{scheduler, Server};

/// Generous bound on any one wait: the machine may be busy; a pass never comes near it.
const PATIENCE: Duration = Duration::from_secs(120);

/// Long enough a reply that the random model's text gets past its garbled first header (the
/// parser gives up on a header after 64 tokens and shows what follows).
const REPLY_TOKENS: usize = 100;

/// `ossterm serve` on the tiny synthetic model. A reply on the fast path depends (in the last
/// bits) on what the server had cached, so a comparison runs the same sequence of requests on
/// two fresh servers.
fn serve(api_key: Option<&str>) -> Server {
    Server::start(Precision::Fast, 1, scheduler(2, 4096, 8), api_key, 1 << 20)
}

fn settings(max_tokens: usize) -> Settings {
    let mut settings = Settings::default();
    settings.sampling.temperature = 0.0;
    settings.sampling.max_tokens = max_tokens;
    settings.reasoning_effort = ReasoningEffort::Low;
    settings
}

fn target(url: &str, api_key: Option<&str>, timeout: Duration) -> RemoteTarget {
    RemoteTarget {
        url: url.to_string(),
        api_key: api_key.map(str::to_owned),
        idle_timeout: timeout,
    }
}

fn engine(
    url: &str,
    model: Option<&str>,
    api_key: Option<&str>,
    timeout: Duration,
    settings: Settings,
) -> (EngineHandle, Receiver<Event>) {
    let (events, receiver) = mpsc::channel();
    let config = RemoteConfig {
        target: target(url, api_key, timeout),
        model: model.map(str::to_owned),
    };
    (spawn_remote_engine(config, settings, events), receiver)
}

fn next_event(events: &Receiver<Event>) -> Event {
    events
        .recv_timeout(PATIENCE)
        .expect("the remote engine went quiet")
}

/// Events until `Ready`, then the ones the start-up sends after it (fixed settings, gauges, a
/// notice), up to its last, the first stats sample.
fn wait_ready(events: &Receiver<Event>) -> (EngineInfo, Vec<Event>) {
    loop {
        match next_event(events) {
            Event::Ready(info) => {
                let mut after = Vec::new();
                loop {
                    let event = next_event(events);
                    let last = matches!(event, Event::Stats(_));
                    after.push(event);
                    if last {
                        return (info, after);
                    }
                }
            }
            Event::LoadProgress { .. } => {}
            other => panic!("before Ready: {other:?}"),
        }
    }
}

/// A one-message chat at low effort, as the app's snapshot carries its effort setting.
fn conversation(text: &str) -> Conversation {
    let mut chat = Conversation {
        messages: vec![ChatMessage::user(text)],
        ..Conversation::default()
    };
    chat.system.reasoning = Some(ReasoningEffort::Low);
    chat
}

/// What one turn produced.
#[derive(Debug, Default)]
struct Turn {
    reasoning: String,
    answer: String,
    done: Option<(StopReason, usize)>,
    error: Option<String>,
    gauges: Vec<(String, String)>,
    decode_rate: Option<f64>,
    notices: Vec<String>,
}

fn send_turn(handle: &EngineHandle, id: RequestId, kind: RequestKind, chat: Conversation) {
    handle
        .send(Command::Generate(Box::new(GenerateRequest {
            id,
            kind,
            conversation: chat,
        })))
        .unwrap();
}

/// Collects request `id`'s events until it ends and the gauge rows that close every turn.
fn collect_turn(events: &Receiver<Event>, id: RequestId) -> Turn {
    let mut turn = Turn::default();
    let mut ended = false;
    loop {
        match next_event(events) {
            Event::Token {
                id: token_id,
                channel,
                text,
            } => {
                assert_eq!(token_id, id);
                match channel {
                    Channel::Analysis => turn.reasoning.push_str(&text),
                    _ => turn.answer.push_str(&text),
                }
            }
            Event::TurnDone {
                id: done_id,
                reason,
                generated_tokens,
                ..
            } => {
                assert_eq!(done_id, id);
                turn.done = Some((reason, generated_tokens));
                ended = true;
            }
            Event::Error {
                id: Some(error_id),
                message,
            } => {
                assert_eq!(error_id, id);
                turn.error = Some(message);
                ended = true;
            }
            Event::EngineGauges(rows) => {
                turn.gauges = rows;
                if ended {
                    return turn;
                }
            }
            Event::Stats(sample) => {
                turn.decode_rate = sample.decode_tokens_per_second.or(turn.decode_rate)
            }
            Event::Notice(text) => turn.notices.push(text),
            _ => {}
        }
    }
}

fn run_turn(handle: &EngineHandle, events: &Receiver<Event>, id: RequestId, text: &str) -> Turn {
    send_turn(handle, id, RequestKind::NewTurn, conversation(text));
    collect_turn(events, id)
}

/// The same question asked directly, not streamed: (reasoning, content, completion tokens).
fn direct_reply(server: &Server, text: &str, max_tokens: usize) -> (String, String, u64) {
    let body = json!({
        "model": "synthetic-tiny",
        "messages": [{"role": "user", "content": text}],
        "reasoning_effort": "low",
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": max_tokens,
    });
    let response = ureq::post(&format!("{}/v1/chat/completions", server.base))
        .send_string(&body.to_string())
        .unwrap();
    let value: Value = serde_json::from_str(&response.into_string().unwrap()).unwrap();
    let message = &value["choices"][0]["message"];
    (
        message["reasoning_content"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        message["content"].as_str().unwrap_or("").to_string(),
        value["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn the_app_engine_streams_what_the_server_answers_and_regenerates_it() {
    let server = serve(None);
    let reference = serve(None);
    let (handle, events) = engine(
        &server.base,
        None,
        None,
        Duration::from_secs(60),
        settings(REPLY_TOKENS),
    );
    let (info, after) = wait_ready(&events);
    assert!(info.model_label.contains("synthetic-tiny"), "{info:?}");
    assert!(info.model_label.contains(&server.base), "{info:?}");
    assert!(after.iter().any(|event| matches!(
        event,
        Event::SettingsFixed { keys, shown_as }
            if shown_as == "server" && keys.iter().any(|key| key == "engine.threads")
    )));
    let gauges = after.iter().find_map(|event| match event {
        Event::EngineGauges(rows) => Some(rows.clone()),
        _ => None,
    });
    let gauges = gauges.expect("gauge rows after Ready");
    assert!(gauges.contains(&("server".to_string(), server.base.clone())));
    // An ossterm server has /metrics: its load is shown.
    assert!(gauges.iter().any(|(label, _)| label == "server load"));

    let first = run_turn(&handle, &events, 1, "Hello there");
    assert_eq!(first.error, None);
    let (reason, generated) = first.done.unwrap();
    let (reasoning, answer, completion_tokens) =
        direct_reply(&reference, "Hello there", REPLY_TOKENS);
    assert!(
        !(reasoning.is_empty() && answer.is_empty()),
        "the reference reply is empty"
    );
    assert_eq!(first.reasoning, reasoning);
    assert_eq!(first.answer, answer);
    assert_eq!(generated as u64, completion_tokens);
    assert!(matches!(
        reason,
        StopReason::MaxTokens | StopReason::Finished
    ));
    let labels: Vec<&str> = first
        .gauges
        .iter()
        .map(|(label, _)| label.as_str())
        .collect();
    for label in ["network", "server time", "usage", "server load"] {
        assert!(labels.contains(&label), "{label} missing from {labels:?}");
    }

    // Regenerate: the same conversation again (the reference server is asked the same).
    send_turn(
        &handle,
        2,
        RequestKind::Regenerate,
        conversation("Hello there"),
    );
    let again = collect_turn(&events, 2);
    assert_eq!(again.error, None);
    let (reasoning, answer, _) = direct_reply(&reference, "Hello there", REPLY_TOKENS);
    assert_eq!((again.reasoning, again.answer), (reasoning, answer));

    // Edit and resend: a different last message is a different request.
    send_turn(
        &handle,
        3,
        RequestKind::EditAndResend,
        conversation("Something else"),
    );
    let edited = collect_turn(&events, 3);
    assert_eq!(edited.error, None);
    let (edited_reasoning, edited_answer, _) =
        direct_reply(&reference, "Something else", REPLY_TOKENS);
    assert_eq!(
        (edited.reasoning, edited.answer),
        (edited_reasoning, edited_answer)
    );
    handle.shutdown();
    server.stop();
    reference.stop();
}

#[test]
fn stop_closes_the_stream_and_the_server_cancels() {
    let server = serve(None);
    let (handle, events) = engine(
        &server.base,
        None,
        None,
        Duration::from_secs(60),
        settings(3000),
    );
    wait_ready(&events);
    send_turn(&handle, 1, RequestKind::NewTurn, conversation("Go on"));
    // Once text streams, stop it.
    loop {
        if let Event::Token { .. } = next_event(&events) {
            break;
        }
    }
    handle.cancel(1);
    let turn = collect_turn(&events, 1);
    let (reason, _) = turn.done.expect("the stopped turn ends");
    assert_eq!(reason, StopReason::Cancelled);
    // The server saw the connection close and freed the sequence long before 3000 tokens.
    let until = Instant::now() + PATIENCE;
    while server.metric("ossterm_active_sequences") > 0.0 {
        assert!(Instant::now() < until, "the server kept generating");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(server.metric("ossterm_tokens_generated_total") < 3000.0);
    // The engine serves the next request as usual.
    let next = run_turn(&handle, &events, 2, "Again");
    assert_eq!(next.error, None);
    assert!(next.done.is_some());
    handle.shutdown();
    server.stop();
}

#[test]
fn an_api_key_is_sent_and_a_wrong_one_is_reported_with_the_servers_message() {
    let server = serve(Some("sesame"));
    let (handle, events) = engine(
        &server.base,
        None,
        Some("wrong"),
        Duration::from_secs(60),
        settings(8),
    );
    let (info, after) = wait_ready(&events);
    // Without the model list the engine is still ready; the notice says why.
    assert!(info.model_label.contains("no model yet"), "{info:?}");
    let notice = after.iter().find_map(|event| match event {
        Event::Notice(text) => Some(text.clone()),
        _ => None,
    });
    let notice = notice.expect("a notice about the model list");
    assert!(notice.contains("401"), "{notice}");
    let turn = run_turn(&handle, &events, 1, "Hi");
    let error = turn.error.expect("a 401 error");
    assert!(
        error.contains("HTTP 401") && error.contains("missing or wrong API key"),
        "{error}"
    );
    assert!(error.contains("--api-key"), "{error}");
    handle.shutdown();

    let (handle, events) = engine(
        &server.base,
        None,
        Some("sesame"),
        Duration::from_secs(60),
        settings(8),
    );
    let (info, _) = wait_ready(&events);
    assert!(info.model_label.contains("synthetic-tiny"), "{info:?}");
    let turn = run_turn(&handle, &events, 1, "Hi");
    assert_eq!(turn.error, None);
    assert!(turn.done.is_some());
    handle.shutdown();
    server.stop();
}

/// What the misbehaving listener does with one chat request.
#[derive(Clone, Debug)]
enum Behavior {
    /// A status with this JSON body and extra headers.
    Status(u16, &'static str, Vec<(&'static str, &'static str)>),
    /// These `data:` payloads; `[DONE]` after them unless `cut` (then the connection just closes).
    Stream { events: Vec<Value>, cut: bool },
    /// Reads the request and says nothing for this long.
    Silence(Duration),
}

/// A loopback HTTP/1.1 listener that answers `/v1/models` with one model and each chat request
/// with the next queued behavior (a short good stream when none is left), recording requests.
struct Misbehaving {
    url: String,
    requests: Arc<Mutex<Vec<(String, Value)>>>,
}

fn delta(kind: &str, text: &str) -> Value {
    json!({"object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {kind: text}, "finish_reason": null}]})
}

fn finish(reason: &str) -> Value {
    json!({"object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "finish_reason": reason}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3}})
}

fn good_stream() -> Behavior {
    Behavior::Stream {
        events: vec![
            delta("reasoning_content", "Think."),
            delta("content", "Fine"),
            delta("content", " answer."),
            finish("stop"),
        ],
        cut: false,
    }
}

impl Misbehaving {
    fn start(behaviors: Vec<Behavior>) -> Misbehaving {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let behaviors = Arc::new(Mutex::new(VecDeque::from(behaviors)));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (queue, seen) = (behaviors, Arc::clone(&requests));
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (queue, seen) = (Arc::clone(&queue), Arc::clone(&seen));
                std::thread::spawn(move || serve_one(stream, &queue, &seen));
            }
        });
        Misbehaving { url, requests }
    }

    fn chat_requests(&self) -> Vec<(String, Value)> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|(head, _)| head.starts_with("POST"))
            .cloned()
            .collect()
    }
}

fn serve_one(
    stream: TcpStream,
    behaviors: &Mutex<VecDeque<Behavior>>,
    requests: &Mutex<Vec<(String, Value)>>,
) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        if line == "\r\n" {
            break;
        }
        head.push_str(&line);
    }
    let length = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    requests.lock().unwrap().push((head.clone(), body));
    let mut out = stream;
    if head.starts_with("GET") && head.contains("/v1/models") {
        let list = json!({"object": "list", "data": [{"id": "fake-model"}]}).to_string();
        let _ = write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{list}",
            list.len()
        );
        return;
    }
    if head.starts_with("GET") {
        let _ = write!(
            out,
            "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        return;
    }
    let behavior = behaviors
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or_else(good_stream);
    match behavior {
        Behavior::Status(status, body, headers) => {
            let mut text = format!(
                "HTTP/1.1 {status} Whatever\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for (name, value) in headers {
                text.push_str(&format!("{name}: {value}\r\n"));
            }
            text.push_str("\r\n");
            text.push_str(body);
            let _ = out.write_all(text.as_bytes());
        }
        Behavior::Stream { events, cut } => {
            let _ = out.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n",
            );
            for event in events {
                let _ = write!(out, "data: {event}\n\n");
                let _ = out.flush();
            }
            if !cut {
                let _ = out.write_all(b"data: [DONE]\n\n");
            }
        }
        Behavior::Silence(duration) => std::thread::sleep(duration),
    }
    let _ = out.shutdown(std::net::Shutdown::Both);
}

/// Runs a turn against `server` with `behavior` first, then checks that a retry works.
fn error_then_retry(behavior: Behavior, timeout: Duration) -> (Turn, Turn) {
    let server = Misbehaving::start(vec![behavior]);
    let (handle, events) = engine(&server.url, None, None, timeout, settings(16));
    let (info, _) = wait_ready(&events);
    assert!(info.model_label.contains("fake-model"), "{info:?}");
    let failed = run_turn(&handle, &events, 1, "Hi");
    let retried = run_turn(&handle, &events, 2, "Hi");
    assert_eq!(retried.error, None, "the retry failed");
    assert_eq!(retried.reasoning, "Think.");
    assert_eq!(retried.answer, "Fine answer.");
    assert_eq!(retried.done, Some((StopReason::Finished, 3)));
    handle.shutdown();
    (failed, retried)
}

#[test]
fn a_server_error_shows_its_message_and_a_retry_works() {
    let (failed, _) = error_then_retry(
        Behavior::Status(
            500,
            r#"{"error":{"message":"the GPU fell over","type":"server_error"}}"#,
            Vec::new(),
        ),
        Duration::from_secs(60),
    );
    let error = failed.error.expect("an error");
    assert!(error.contains("HTTP 500"), "{error}");
    assert!(error.contains("the GPU fell over"), "{error}");
    assert!(error.contains("Ctrl-R retries"), "{error}");
}

#[test]
fn rate_limits_and_missing_models_say_what_to_do() {
    let (failed, _) = error_then_retry(
        Behavior::Status(
            429,
            r#"{"error":{"message":"slow down"}}"#,
            vec![("Retry-After", "7")],
        ),
        Duration::from_secs(60),
    );
    let error = failed.error.expect("an error");
    assert!(
        error.contains("HTTP 429") && error.contains("slow down"),
        "{error}"
    );
    assert!(error.contains("retry after 7 s"), "{error}");

    let (failed, _) = error_then_retry(
        Behavior::Status(
            404,
            r#"{"object":"error","message":"The model `fake-model` does not exist.","code":404}"#,
            Vec::new(),
        ),
        Duration::from_secs(60),
    );
    let error = failed.error.expect("an error");
    assert!(error.contains("does not exist"), "{error}");
    assert!(error.contains("--remote-model"), "{error}");
}

#[test]
fn a_stream_cut_mid_way_keeps_the_text_and_reports_it() {
    let (failed, _) = error_then_retry(
        Behavior::Stream {
            events: vec![delta("reasoning", "Half a"), delta("content", "thought")],
            cut: true,
        },
        Duration::from_secs(60),
    );
    assert_eq!(failed.reasoning, "Half a");
    assert_eq!(failed.answer, "thought");
    let error = failed.error.expect("an error");
    assert!(error.contains("stopped mid-way"), "{error}");
    assert_eq!(failed.done, None);
}

#[test]
fn a_silent_server_times_out() {
    let started = Instant::now();
    let (failed, _) = error_then_retry(
        Behavior::Silence(Duration::from_secs(4)),
        Duration::from_secs(1),
    );
    let error = failed.error.expect("an error");
    assert!(error.contains("timeout"), "{error}");
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[test]
fn a_refused_connection_leaves_a_ready_engine_that_works_once_the_server_is_up() {
    // A port nobody listens on: bound, then closed.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let (handle, events) = engine(&url, None, None, Duration::from_secs(60), settings(8));
    let (_, after) = wait_ready(&events);
    assert!(after.iter().any(|event| matches!(
        event,
        Event::Notice(text) if text.contains("cannot reach") && text.contains("refused")
    )));
    let turn = run_turn(&handle, &events, 1, "Hi");
    let error = turn.error.expect("an error");
    assert!(
        error.contains("cannot reach") && error.contains("Ctrl-R retries"),
        "{error}"
    );
    handle.shutdown();
}

#[test]
fn requests_carry_the_settings_the_key_and_the_developer_text() {
    let server = Misbehaving::start(Vec::new());
    let mut chosen = settings(77);
    chosen.sampling.temperature = 0.7;
    chosen.sampling.top_p = 0.9;
    chosen.sampling.top_k = 20;
    chosen.sampling.seed = Some(5);
    chosen.reasoning_effort = ReasoningEffort::High;
    let (handle, events) = engine(
        &server.url,
        Some("fake-model"),
        Some("k-123"),
        Duration::from_secs(60),
        chosen.clone(),
    );
    wait_ready(&events);
    // The conversation names the effort (the app's chat carries the setting); without it the
    // setting goes.
    let mut chat = conversation("Hi");
    chat.developer = Some("Answer in French.".to_string());
    chat.system.reasoning = None;
    send_turn(&handle, 1, RequestKind::NewTurn, chat);
    assert_eq!(collect_turn(&events, 1).error, None);

    // A changed min-p goes with the next request; the thread count stays the server's.
    let mut changed = chosen.clone();
    changed.reasoning_effort = ReasoningEffort::Low;
    changed.sampling.min_p = 0.1;
    changed.threads = chosen.threads + 1;
    handle
        .send(Command::ApplySettings(Box::new(changed)))
        .unwrap();
    let applied = loop {
        if let Event::SettingsApplied(applied) = next_event(&events) {
            break applied;
        }
    };
    assert_eq!(applied.threads, chosen.threads);
    assert_eq!(applied.reasoning_effort, ReasoningEffort::Low);
    let mut chat = conversation("Again");
    chat.system.reasoning = Some(ReasoningEffort::Low);
    send_turn(&handle, 2, RequestKind::NewTurn, chat);
    assert_eq!(collect_turn(&events, 2).error, None);
    handle.shutdown();

    let requests = server.chat_requests();
    assert_eq!(requests.len(), 2);
    let (head, body) = &requests[0];
    assert!(
        head.to_lowercase().contains("authorization: bearer k-123"),
        "{head}"
    );
    assert_eq!(body["model"], "fake-model");
    assert_eq!(body["stream"], true);
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["max_tokens"], 77);
    assert_eq!(body["top_k"], 20);
    assert_eq!(body["seed"], 5);
    assert!((body["temperature"].as_f64().unwrap() - 0.7).abs() < 1e-6);
    assert!(body.get("min_p").is_none());
    assert_eq!(
        body["messages"],
        json!([{"role": "system", "content": "Answer in French."},
               {"role": "user", "content": "Hi"}])
    );
    let (_, second) = &requests[1];
    assert_eq!(second["reasoning_effort"], "low");
    assert!((second["min_p"].as_f64().unwrap() - 0.1).abs() < 1e-6);
}

#[test]
fn raw_harmony_from_the_server_is_parsed_into_channels() {
    let raw = "<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>";
    let mut events = Vec::new();
    // Split where a marker is cut in two, as a server streaming token by token may do.
    for piece in [&raw[..5], &raw[5..40], &raw[40..90], &raw[90..]] {
        events.push(delta("content", piece));
    }
    events.push(finish("stop"));
    let server = Misbehaving::start(vec![Behavior::Stream { events, cut: false }]);
    let (handle, receiver) = engine(
        &server.url,
        None,
        None,
        Duration::from_secs(60),
        settings(16),
    );
    wait_ready(&receiver);
    let turn = run_turn(&handle, &receiver, 1, "Hi");
    assert_eq!(turn.error, None);
    assert_eq!(turn.reasoning, "User says hi.");
    assert_eq!(turn.answer, "Hello!");
    handle.shutdown();
}

#[test]
fn several_models_are_listed_in_a_notice_and_the_first_is_used() {
    // A one-off listener whose model list has two entries.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let list = json!({"data": [{"id": "gpt-oss-120b"}, {"id": "gpt-oss-20b"}]}).to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{list}",
                list.len()
            );
        }
    });
    let (handle, events) = engine(&url, None, None, Duration::from_secs(60), settings(8));
    let (info, after) = wait_ready(&events);
    assert!(info.model_label.starts_with("gpt-oss-120b"), "{info:?}");
    assert!(after.iter().any(|event| matches!(
        event,
        Event::Notice(text) if text.contains("2 models") && text.contains("gpt-oss-20b")
    )));
    handle.shutdown();
}

#[test]
fn the_settings_panel_shows_server_settings_and_does_not_change_them() {
    use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    use ossterm::tui::{App, EngineStatus, Msg};
    let dir = tempfile::tempdir().unwrap();
    let settings = Settings::default();
    let mut app = App::new(
        settings.clone(),
        ossterm::tui::store::ChatStore::new(dir.path().to_path_buf()),
        EngineStatus::Ready,
    );
    let now = Instant::now();
    app.update(
        Msg::Engine(Event::SettingsFixed {
            keys: SERVER_SETTINGS.iter().map(|key| key.to_string()).collect(),
            shown_as: "server".to_string(),
        }),
        now,
    );
    let key = |code| Msg::Key(KeyEvent::new(code, KeyModifiers::NONE));
    // Tab twice: input, conversation, settings. The first row is threads.
    app.update(key(KeyCode::Tab), now);
    app.update(key(KeyCode::Tab), now);
    let effects = app.update(key(KeyCode::Right), now);
    assert!(effects.is_empty(), "{effects:?}");
    assert_eq!(app.settings.current, settings);
    let notice = app.notice.clone().unwrap_or_default();
    assert!(notice.contains("set by the server"), "{notice}");
    // Reasoning effort (row 5) still changes and goes to the engine.
    for _ in 0..4 {
        app.update(key(KeyCode::Down), now);
    }
    let effects = app.update(key(KeyCode::Right), now);
    assert_eq!(effects.len(), 1, "{effects:?}");
    assert_ne!(
        app.settings.current.reasoning_effort,
        settings.reasoning_effort
    );
}

/// How the model runs is the server's business: every `engine.*` setting is fixed on a remote
/// engine, so a new one cannot be forgotten there (the attention arithmetic once was).
#[test]
fn every_engine_setting_is_the_servers_on_a_remote_engine() {
    for setting in ossterm::settings::SETTINGS {
        if setting.key.starts_with("engine.") {
            assert!(
                SERVER_SETTINGS.contains(&setting.key),
                "{} is not in SERVER_SETTINGS",
                setting.key
            );
        }
    }
}

#[test]
fn run_remote_answers_one_prompt_as_json_and_reports_a_refused_connection() {
    let server = serve(None);
    let reference = serve(None);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(["run", "--remote", &server.base, "--prompt", "Hello there"])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            &REPLY_TOKENS.to_string(),
        ])
        .args(["--reasoning", "low", "--json"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let json: Value = serde_json::from_slice(&output.stdout).unwrap();
    let (reasoning, answer, completion_tokens) =
        direct_reply(&reference, "Hello there", REPLY_TOKENS);
    assert!(!(reasoning.is_empty() && answer.is_empty()));
    assert_eq!(json["reasoning"], reasoning);
    assert_eq!(json["answer"], answer);
    assert_eq!(json["generated_tokens"], completion_tokens);
    assert_eq!(json["model"], "synthetic-tiny");
    server.stop();
    reference.stop();

    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(["run", "--remote", &format!("http://127.0.0.1:{port}")])
        .args(["--prompt", "Hi"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot reach") && stderr.contains("refused"),
        "{stderr}"
    );
}

#[test]
fn https_urls_go_through_tls() {
    // A listener that answers in plain HTTP: the TLS handshake must fail, and say so.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let url = format!("https://127.0.0.1:{port}");
    let mut session =
        ossterm::remote::RemoteSession::new(target(&url, None, Duration::from_secs(30)), None)
            .unwrap();
    let error = session.resolve_model().expect_err("a TLS error");
    let text = error.to_string().to_lowercase();
    assert!(text.contains("cannot reach"), "{text}");
    assert!(
        ["tls", "corrupt", "invalidcontenttype", "handshake"]
            .iter()
            .any(|word| text.contains(word)),
        "{text}"
    );
}
