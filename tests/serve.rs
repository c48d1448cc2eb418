//! `ossterm serve` in process on a loopback port: every endpoint, streaming, errors, batching,
//! prefix reuse, cancellation on disconnect, a full queue and shutdown. The synthetic tiny model
//! (random weights) answers; nothing leaves 127.0.0.1.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant};

use ossterm::model::Precision;
use ossterm::server::check_exposure;
use ossterm::server::scheduler::SchedulerOptions;
use serde_json::{json, Value};
use support::server::{agent, read_json, scheduler as options, Server};

/// The server most tests use: a pool of two threads and a body limit small enough that an
/// oversized body still fits the socket buffers, so the client reads the 413 instead of a reset
/// connection.
fn serve(precision: Precision, scheduler: SchedulerOptions, api_key: Option<&str>) -> Server {
    Server::start(precision, 2, scheduler, api_key, 256 << 10)
}

fn default_server() -> Server {
    serve(Precision::Fast, options(4, 4096, 8), None)
}

fn chat(messages: Value, extra: Value) -> String {
    let mut body = json!({"model": "synthetic-tiny", "messages": messages});
    for (key, value) in extra.as_object().unwrap() {
        body[key] = value.clone();
    }
    body.to_string()
}

/// The job `/v1/chat/completions` would run for `body`, rendered with `date` (None: no date line).
fn prepared(body: &str, context: usize, date: Option<&str>) -> ossterm::server::api::ChatJob {
    use ossterm::server::api::{parse_chat_request, prepare_chat_dated};
    let request = parse_chat_request(body.as_bytes()).unwrap();
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    prepare_chat_dated(request, tokenizer, context, date).unwrap()
}

fn user(text: &str) -> Value {
    json!([{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}])
}

/// The chunks of a streamed `/v1/completions` reply to `body`, parsed, until `[DONE]`.
fn completion_chunks(server: &Server, body: Value) -> Vec<Value> {
    let response = agent()
        .post(&server.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut chunks = Vec::new();
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            if data == "[DONE]" {
                break;
            }
            chunks.push(serde_json::from_str::<Value>(data).unwrap());
        }
    }
    chunks
}

/// The `data:` payloads of a streamed reply, until `[DONE]` (included).
fn stream(server: &Server, body: &str) -> Vec<String> {
    let response = agent()
        .post(&server.url("/v1/chat/completions"))
        .send_string(body)
        .unwrap();
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    let mut events = Vec::new();
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            events.push(data.to_owned());
            if data == "[DONE]" {
                break;
            }
        }
    }
    events
}

#[test]
fn health_models_metrics_and_unknown_paths() {
    let server = default_server();
    let health = read_json(agent().get(&server.url("/health")).call()).1;
    assert_eq!(health["status"], "ok");
    let models = read_json(agent().get(&server.url("/v1/models")).call()).1;
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "synthetic-tiny");
    // The context a request may use, as vLLM (`max_model_len`) and llama-server (`meta.n_ctx`)
    // report it.
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    assert_eq!(models["data"][0]["meta"]["n_ctx"], 4096);
    assert!(models["data"][0]["meta"]["n_ctx_train"].as_u64().unwrap() >= 4096);
    assert!(models["data"][0]["meta"]["n_vocab"].as_u64().unwrap() > 0);
    assert_eq!(models["data"][0]["meta"]["n_parallel"], 4);
    // One model by id, as `models.retrieve` asks; another id is a 404 naming it.
    let one = read_json(agent().get(&server.url("/v1/models/synthetic-tiny")).call()).1;
    assert_eq!(one, models["data"][0]);
    let (status, missing) = read_json(agent().get(&server.url("/v1/models/gpt-4")).call());
    assert_eq!(status, 404);
    assert_eq!(missing["error"]["code"], "model_not_found", "{missing}");
    let metrics = agent().get(&server.url("/metrics")).call().unwrap();
    assert!(metrics.content_type().starts_with("text/plain"));
    let text = metrics.into_string().unwrap();
    for name in [
        "ossterm_requests_total",
        "ossterm_tokens_generated_total",
        "ossterm_decode_tokens_per_second",
        "ossterm_prefill_tokens_per_second",
        "ossterm_queue_depth",
        "ossterm_active_sequences",
        "ossterm_kv_use_ratio",
        "ossterm_prefix_cache_hits_total",
    ] {
        assert!(
            text.contains(&format!("# TYPE {name} ")),
            "{name} missing:\n{text}"
        );
    }
    assert_eq!(server.metric("ossterm_kv_capacity_tokens"), 4.0 * 4096.0);
    let (status, body) = read_json(agent().get(&server.url("/v1/nothing")).call());
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "not_found");
    server.stop();
}

/// The chat page at the root, its script, their headers; served without the API key (the page
/// holds no data and asks for the key itself) while the API still wants it; `--no-webui` serves
/// neither.
#[test]
fn the_chat_page_is_served_at_the_root_unless_turned_off() {
    let server = serve(Precision::Fast, options(1, 512, 2), Some("sk-page"));
    let page = agent().get(&server.url("/")).call().unwrap();
    assert_eq!(page.content_type(), "text/html");
    let policy = page.header("content-security-policy").unwrap().to_owned();
    assert!(policy.contains("script-src 'self'"), "{policy}");
    assert!(policy.contains("connect-src 'self'"), "{policy}");
    assert_eq!(page.header("x-content-type-options"), Some("nosniff"));
    let html = page.into_string().unwrap();
    assert!(
        html.contains(r#"<script src="chat.js"></script>"#),
        "{html}"
    );
    for id in ["messages", "input", "send", "effort", "api-key", "new-chat"] {
        assert!(html.contains(&format!(r#"id="{id}""#)), "page lacks #{id}");
    }
    let script = agent().get(&server.url("/chat.js")).call().unwrap();
    assert_eq!(script.content_type(), "text/javascript");
    let js = script.into_string().unwrap();
    assert!(js.contains("v1/chat/completions"));
    // The page reads the model id and context from the API, which still wants the key.
    let (status, _) = read_json(agent().get(&server.url("/v1/models")).call());
    assert_eq!(status, 401);
    server.stop();

    let api_only =
        Server::start_with_page(Precision::Fast, 2, options(1, 512, 2), None, 1 << 20, false);
    for path in ["/", "/chat.js"] {
        let (status, body) = read_json(agent().get(&api_only.url(path)).call());
        assert_eq!(status, 404, "{path}");
        assert_eq!(body["error"]["code"], "not_found");
    }
    api_only.stop();
}

#[test]
fn a_chat_completion_has_the_openai_shape_and_is_repeatable_with_a_seed() {
    // The exact path: a reply must not depend on how much of the prompt came from the cache (the
    // fast path's int8 sums differ in the last bits between a prefill chunk and one token).
    let server = serve(Precision::Exact, options(4, 1024, 8), None);
    let body = chat(
        user("hello"),
        json!({"max_tokens": 80, "seed": 7, "temperature": 0.8}),
    );
    let (status, first) = server.post(&body);
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["object"], "chat.completion");
    assert_eq!(first["model"], "synthetic-tiny");
    let choice = &first["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let usage = &first["usage"];
    assert_eq!(usage["completion_tokens"], 80);
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 20, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + 80);
    let (_, second) = server.post(&body);
    assert_eq!(second["choices"][0]["message"], choice["message"]);
    // The same system message and prompt: the second request reuses all but the last token.
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, prompt - 1);
    assert!(server.metric("ossterm_prefix_cache_hits_total") >= 1.0);
    assert_eq!(server.metric("ossterm_tokens_generated_total"), 160.0);
    server.stop();
}

#[test]
fn streaming_sends_chunks_usage_and_done_with_the_same_text() {
    let server = serve(Precision::Exact, options(4, 1024, 8), None);
    let extra = json!({"max_tokens": 90, "seed": 3, "stream": true,
                       "stream_options": {"include_usage": true}});
    let events = stream(&server, &chat(user("stream please"), extra.clone()));
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 90);
    let mut content = String::new();
    for chunk in &chunks {
        if let Some(text) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(text);
        }
        let delta = &chunk["choices"][0]["delta"];
        assert_eq!(
            delta["reasoning_content"], delta["reasoning"],
            "both names carry reasoning"
        );
    }
    let mut whole = extra;
    whole["stream"] = json!(false);
    let (_, reply) = server.post(&chat(user("stream please"), whole));
    assert_eq!(reply["choices"][0]["message"]["content"], json!(content));
    server.stop();
}

/// Requests that arrive together with a long shared prefix: the later ones wait for the first
/// one's prefill and copy its keys and values, so the prefix is computed once; the replies are
/// what each gets alone (exact path, greedy).
#[test]
fn requests_sharing_a_prefix_prefill_it_once() {
    let system = "You answer in the style of a ship's log, with dates. ".repeat(40);
    let bodies: Vec<String> = (0..3)
        .map(|i| {
            chat(
                json!([{"role": "system", "content": system},
                       {"role": "user", "content": format!("entry {i}")}]),
                json!({"max_tokens": 8, "temperature": 0}),
            )
        })
        .collect();
    let server = serve(Precision::Exact, options(4, 2048, 8), None);
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| scope.spawn(|| server.post(body).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let prompt = together[0]["usage"]["prompt_tokens"].as_u64().unwrap();
    let mut cached: Vec<u64> = together
        .iter()
        .map(|r| {
            r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    cached.sort_unstable();
    assert!(prompt > 400, "{prompt}");
    // The first computes everything; the others copy all but the last few tokens.
    assert_eq!(cached[0], 0, "{together:?}");
    assert!(
        cached[1] + 24 >= prompt && cached[2] + 24 >= prompt,
        "{cached:?} of {prompt}"
    );
    for (body, t) in bodies.iter().zip(&together) {
        let (_, a) = server.post(body);
        assert_eq!(a["choices"][0]["message"], t["choices"][0]["message"]);
    }
    server.stop();
}

#[test]
fn concurrent_requests_get_the_replies_they_get_alone() {
    // The exact path computes a batch exactly as each sequence alone, so greedy replies match.
    let server = serve(Precision::Exact, options(4, 1024, 8), None);
    let bodies: Vec<String> = (0..4)
        .map(|i| {
            chat(
                user(&format!("question number {i}")),
                json!({"max_tokens": 70 + 3 * i, "temperature": 0}),
            )
        })
        .collect();
    let alone: Vec<Value> = bodies.iter().map(|body| server.post(body).1).collect();
    let together: Vec<Value> = std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| scope.spawn(|| server.post(body).1))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(a["choices"][0]["message"], t["choices"][0]["message"]);
        assert_eq!(
            a["usage"]["completion_tokens"],
            t["usage"]["completion_tokens"]
        );
    }
    server.stop();
}

#[test]
fn bad_requests_get_openai_errors_naming_the_problem() {
    let server = serve(Precision::Fast, options(2, 256, 8), None);
    let cases: [(&str, u16, &str); 9] = [
        ("{\"messages\": [", 400, "not valid JSON"),
        (r#"{"messages": "hi"}"#, 400, "messages"),
        (r#"{"messages": []}"#, 400, "empty"),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
            400,
            "temperature",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "temperature": -1}"#,
            400,
            "temperature",
        ),
        (
            r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
            400,
            "tool",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}"#,
            400,
            "extreme",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
            400,
            "max_tokens",
        ),
        (
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            400,
            "image_url",
        ),
    ];
    for (body, want_status, needle) in cases {
        let (status, reply) = server.post(body);
        assert_eq!(status, want_status, "{body}: {reply}");
        let error = &reply["error"];
        assert_eq!(error["type"], "invalid_request_error", "{reply}");
        assert!(
            error["message"].as_str().unwrap().contains(needle),
            "{body}: {reply}"
        );
        assert!(
            error.get("param").is_some() && error.get("code").is_some(),
            "{reply}"
        );
    }
    let long = "many words ".repeat(200);
    let (status, reply) = server.post(&chat(user(&long), json!({})));
    assert_eq!(status, 400);
    assert_eq!(reply["error"]["code"], "context_length_exceeded");
    assert_eq!(reply["error"]["param"], "messages");
    let huge = format!(
        r#"{{"messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "a".repeat(300 << 10)
    );
    let (status, reply) = server.post(&huge);
    assert_eq!(status, 413, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("too large"),
        "{reply}"
    );
    // A declared length far past the limit is refused from the headers alone.
    let mut raw = std::net::TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    write!(
        raw,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{{",
        1u64 << 40
    )
    .unwrap();
    let mut head = [0u8; 12];
    raw.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 413");
    assert!(server.metric("ossterm_requests_rejected_total") >= 11.0);
    // Still serving after all that.
    let (status, _) = server.post(&chat(user("fine"), json!({"max_tokens": 2})));
    assert_eq!(status, 200);
    server.stop();
}

#[test]
fn an_api_key_is_required_when_set_and_exposure_without_one_is_refused() {
    let server = serve(Precision::Fast, options(1, 512, 4), Some("sekrit"));
    let body = chat(user("hi"), json!({"max_tokens": 2}));
    let (status, reply) = server.post(&body);
    assert_eq!(status, 401);
    assert_eq!(reply["error"]["code"], "invalid_api_key");
    let ok = agent()
        .post(&server.url("/v1/chat/completions"))
        .set("Authorization", "Bearer sekrit")
        .send_string(&body);
    assert_eq!(read_json(ok).0, 200);
    // The scheme's name in any case (RFC 6750); a key that differs anywhere, is cut short or runs
    // on, or comes under another scheme, is refused.
    let with = |value: &str| {
        read_json(
            agent()
                .post(&server.url("/v1/chat/completions"))
                .set("Authorization", value)
                .send_string(&body),
        )
        .0
    };
    assert_eq!(with("bearer sekrit"), 200);
    // A header that is not text (HTTP allows bytes past ASCII) is a wrong key, not a panic.
    let mut raw = std::net::TcpStream::connect(server.base.trim_start_matches("http://")).unwrap();
    raw.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekr\xffit\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut reply = Vec::new();
    raw.read_to_end(&mut reply).unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 401"), "{reply}");
    assert!(reply.contains("invalid_api_key"), "{reply}");
    for wrong in [
        "Bearer sekri",
        "Bearer sekritt",
        "Bearer Sekrit",
        "Basic sekrit",
        "sekrit",
        "Bearer",
    ] {
        assert_eq!(with(wrong), 401, "{wrong}");
    }
    // Every endpoint but the health check and the chat page: kept responses can be neither read
    // nor deleted without the key.
    let stored = server.url("/v1/responses/resp_1");
    for (name, reply) in [
        ("get response", agent().get(&stored).call()),
        ("delete response", agent().delete(&stored).call()),
        ("models", agent().get(&server.url("/v1/models")).call()),
        (
            "model",
            agent().get(&server.url("/v1/models/synthetic-tiny")).call(),
        ),
        ("metrics", agent().get(&server.url("/metrics")).call()),
    ] {
        let (status, body) = read_json(reply);
        assert_eq!(status, 401, "{name}: {body}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{name}");
    }
    let (status, _) = read_json(
        agent()
            .get(&server.url("/v1/models/synthetic-tiny"))
            .set("Authorization", "Bearer sekrit")
            .call(),
    );
    assert_eq!(status, 200);
    assert_eq!(
        agent().get(&server.url("/health")).call().unwrap().status(),
        200
    );
    server.stop();
    let error = check_exposure("0.0.0.0", None).unwrap_err().to_string();
    assert!(error.contains("API key"), "{error}");
    assert!(check_exposure("0.0.0.0", Some("k")).is_ok());
    assert!(check_exposure("127.0.0.1", None).is_ok());
    assert!(check_exposure("::1", None).is_ok());
}

#[test]
fn a_client_that_disconnects_frees_its_sequence_and_a_full_queue_answers_503() {
    let server = serve(Precision::Fast, options(1, 4096, 1), None);
    let long = chat(user("go on"), json!({"max_tokens": 4000, "stream": true}));
    let response = agent()
        .post(&server.url("/v1/chat/completions"))
        .send_string(&long)
        .unwrap();
    let mut lines = BufReader::new(response.into_reader()).lines();
    let _first = lines.next().unwrap().unwrap();
    server.wait_for_metric("ossterm_active_sequences", |v| v == 1.0);
    std::thread::scope(|scope| {
        // One request waits for the only slot; the next finds the queue full.
        let waiting = scope.spawn(|| server.post(&chat(user("after"), json!({"max_tokens": 3}))));
        server.wait_for_metric("ossterm_queue_depth", |v| v == 1.0);
        let (status, reply) = server.post(&chat(user("too many"), json!({"max_tokens": 3})));
        assert_eq!(status, 503, "{reply}");
        assert_eq!(reply["error"]["code"], "queue_full");
        // Hanging up frees the slot for the waiting request.
        drop(lines);
        let (status, reply) = waiting.join().unwrap();
        assert_eq!(status, 200, "{reply}");
    });
    server.wait_for_metric("ossterm_active_sequences", |v| v == 0.0);
    assert!(server.metric("ossterm_tokens_generated_total") < 4000.0);
    server.stop();
}

#[test]
fn stopping_the_server_ends_running_streams() {
    let (server, reader) = serve_a_long_stream();
    let started = Instant::now();
    server.stop();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_ended_by_shutdown(&reader.join().unwrap());
}

/// A stream's `data:` payloads end with an error saying the server shuts down, then `[DONE]`.
fn assert_ended_by_shutdown(events: &[String]) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{error}"
    );
}

/// A server streaming a long reply (4,000 tokens at most) on another thread, its first tokens
/// generated; the thread returns the stream's `data:` payloads.
fn serve_a_long_stream() -> (Server, std::thread::JoinHandle<Vec<String>>) {
    let server = serve(Precision::Fast, options(2, 4096, 4), None);
    let reader = stream_in_background(
        &server,
        chat(user("long"), json!({"max_tokens": 4000, "stream": true})),
    );
    server.wait_for_metric("ossterm_tokens_generated_total", |v| v > 0.0);
    (server, reader)
}

/// The `data:` payloads of a streamed chat started on another thread.
fn stream_in_background(server: &Server, body: String) -> std::thread::JoinHandle<Vec<String>> {
    let url = server.url("/v1/chat/completions");
    std::thread::spawn(move || {
        let response = agent().post(&url).send_string(&body).unwrap();
        BufReader::new(response.into_reader())
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| line.strip_prefix("data: ").map(str::to_owned))
            .collect()
    })
}

#[test]
fn draining_refuses_new_requests_and_lets_running_ones_finish() {
    let server = serve(Precision::Fast, options(2, 4096, 4), None);
    let reader = stream_in_background(
        &server,
        chat(
            user("long"),
            json!({"max_tokens": 300, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    server.wait_for_metric("ossterm_tokens_generated_total", |v| v > 0.0);
    let url = server.url("/v1/chat/completions");
    let probe = chat(user("late"), json!({"max_tokens": 2}));
    std::thread::scope(|scope| {
        let draining = scope.spawn(|| server.drain(Duration::from_secs(120)));
        // Once the drain has begun, a new request is refused: 503 while the listener is still
        // open, a refused connection after. Requests sent just before are served like the rest.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match agent().post(&url).send_string(&probe) {
                Err(ureq::Error::Status(status, response)) => {
                    assert_eq!(status, 503);
                    let body: Value =
                        serde_json::from_str(&response.into_string().unwrap()).unwrap();
                    assert_eq!(body["error"]["code"], "shutting_down", "{body}");
                    break;
                }
                Err(ureq::Error::Transport(_)) => break,
                Ok(_) => assert!(Instant::now() < until, "still accepting requests"),
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        draining.join().unwrap();
    });
    let events = reader.join().unwrap();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "a drained stream got an error: {events:?}"
    );
    let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    let finish = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_owned));
    assert!(
        matches!(finish.as_deref(), Some("length" | "stop")),
        "{events:?}"
    );
    if finish.as_deref() == Some("length") {
        assert_eq!(usage["usage"]["completion_tokens"], 300, "{usage}");
    }
}

#[test]
fn draining_cancels_what_still_runs_after_the_grace_time() {
    let (server, reader) = serve_a_long_stream();
    let started = Instant::now();
    server.drain(Duration::from_millis(50));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_ended_by_shutdown(&reader.join().unwrap());
}

#[test]
fn the_responses_api_answers_whole_and_streamed_with_the_same_text() {
    let server = serve(Precision::Exact, options(4, 1024, 8), None);
    let url = server.url("/v1/responses");
    let body = json!({"model": "synthetic-tiny", "instructions": "You answer briefly.",
                      "input": [{"role": "user", "content": [{"type": "input_text", "text": "stream please"}]}],
                      "reasoning": {"effort": "low"}, "max_output_tokens": 90, "seed": 3});
    let (status, whole) = read_json(agent().post(&url).send_string(&body.to_string()));
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "response");
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"));
    assert!(matches!(
        whole["status"].as_str(),
        Some("completed" | "incomplete")
    ));
    assert_eq!(whole["reasoning"]["effort"], "low");
    assert_eq!(whole["instructions"], "You answer briefly.");
    let usage = &whole["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    let text_of = |response: &Value, kind: &str| -> String {
        response["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|item| item["type"] == kind)
            .flat_map(|item| item["content"].as_array().unwrap().clone())
            .map(|part| part["text"].as_str().unwrap().to_owned())
            .collect()
    };

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response = agent()
        .post(&url)
        .send_string(&streamed.to_string())
        .unwrap();
    assert_eq!(response.header("content-type"), Some("text/event-stream"));
    let mut kinds = Vec::new();
    let mut events = Vec::new();
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(kind) = line.strip_prefix("event: ") {
            kinds.push(kind.to_owned());
        } else if let Some(data) = line.strip_prefix("data: ") {
            events.push(serde_json::from_str::<Value>(data).unwrap());
        }
    }
    assert_eq!(kinds.len(), events.len());
    for (index, (kind, event)) in kinds.iter().zip(&events).enumerate() {
        assert_eq!(event["type"], kind.as_str());
        assert_eq!(event["sequence_number"], index as u64);
    }
    assert_eq!(kinds[..2], ["response.created", "response.in_progress"]);
    let last = &events.last().unwrap()["response"];
    assert_eq!(
        kinds.last().unwrap(),
        &format!("response.{}", last["status"].as_str().unwrap())
    );
    let deltas = |kind: &str| -> String {
        events
            .iter()
            .filter(|e| e["type"] == kind)
            .map(|e| e["delta"].as_str().unwrap().to_owned())
            .collect()
    };
    // Seeded: the streamed reply is the whole one, and the deltas add up to the final items.
    assert_eq!(last["output"], whole["output"].clone().tap_ids(last));
    assert_eq!(
        deltas("response.reasoning_text.delta"),
        text_of(last, "reasoning")
    );
    assert_eq!(
        deltas("response.output_text.delta"),
        text_of(last, "message")
    );
    assert!(!(text_of(last, "reasoning") + &text_of(last, "message")).is_empty());

    // Errors name the Responses fields.
    let (status, error) = read_json(
        agent()
            .post(&url)
            .send_string(r#"{"input": "hi", "max_output_tokens": 0}"#),
    );
    assert_eq!(status, 400);
    assert_eq!(error["error"]["param"], "max_output_tokens", "{error}");
    server.stop();
}

/// The same output items with the ids of `other` (each response numbers its own items).
trait TapIds {
    fn tap_ids(self, other: &Value) -> Value;
}

impl TapIds for Value {
    fn tap_ids(mut self, other: &Value) -> Value {
        if let (Some(items), Some(theirs)) = (self.as_array_mut(), other["output"].as_array()) {
            for (item, their) in items.iter_mut().zip(theirs) {
                item["id"] = their["id"].clone();
            }
        }
        self
    }
}

#[test]
fn slots_that_cannot_fit_in_memory_are_refused_before_loading() {
    let serve = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
            .args([
                "serve",
                "--synthetic",
                "tiny",
                "--threads",
                "1",
                "--port",
                "0",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    let out = serve(&["--parallel", "1000000000", "--context", "4096"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("not enough memory") && stderr.contains("KV cache"),
        "{stderr}"
    );
    let out = serve(&["--parallel", "1", "--context", "100000000"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--context 100000000"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn an_unbounded_grace_drains_an_idle_server_without_overflow() {
    // Duration::MAX does not fit in an Instant; the drain must still stop an idle server.
    let server = serve(Precision::Fast, options(1, 256, 2), None);
    let started = Instant::now();
    server.drain(Duration::MAX);
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// The spec's two-turn harmony example (section 5, rendered by openai-harmony 0.0.8): a system
/// message from the client becomes the developer instructions, token for token.
#[test]
fn a_system_message_renders_as_harmony_developer_instructions() {
    let body = json!({
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        "reasoning_effort": "low",
    });
    let render = |body: &Value| prepared(&body.to_string(), 4096, Some("2025-08-05")).prompt;
    let want: Vec<u32> =
        "200006 17360 200008 3575 553 17554 162016 11 261 4410 6439 2359 22203 656 \
        7788 17527 558 87447 100594 25 220 1323 19 12 3218 198 6576 3521 25 220 1323 20 12 3062 12 \
        2922 279 30377 289 25 4465 279 2 13888 18403 25 8450 11 49159 11 1721 13 21030 2804 413 \
        7360 395 1753 3176 13 200007 200006 77944 200008 2 68406 279 17045 51088 13 200007 200006 \
        1428 200008 4827 382 220 17 659 220 17 30 200007 200006 173781 200005 17196 200008 19 \
        200007 200006 1428 200008 3436 220 18 659 220 18 30 200007 200006 173781"
            .split_whitespace()
            .map(|id| id.parse().unwrap())
            .collect();
    assert_eq!(render(&body), want);
    // A developer message is the same; an empty system message adds no developer message.
    let mut developer = body.clone();
    developer["messages"][0]["role"] = json!("developer");
    assert_eq!(render(&developer), want);
    let mut empty = body.clone();
    empty["messages"][0]["content"] = json!("");
    let without: Vec<u32> = want[..61].iter().chain(&want[71..]).copied().collect();
    assert_eq!(render(&empty), without);
}

/// Requests with function tools, tool calls and tool answers, rendered as openai-harmony 0.0.8
/// renders the harmony messages vLLM makes of them (tools/make_harmony_tool_fixtures.py): the
/// `functions` namespace from JSON schemas, the system message's line for function calls, calls
/// ending in `<|call|>`, answers from `functions.NAME`, reasoning kept until a final answer.
#[test]
fn function_tools_and_calls_render_as_openai_harmony_renders_them() {
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/harmony/function_tools.json"
    );
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(cases.len(), 5);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let job = prepared(&case["request"].to_string(), 8192, case["date"].as_str());
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        if job.prompt != want {
            panic!(
                "{name}: ossterm renders\n{}\nopenai-harmony\n{}",
                tokenizer.decode(&job.prompt).unwrap(),
                case["text"].as_str().unwrap()
            );
        }
        let defines = case["request"]["tool_choice"] != "none";
        assert_eq!(job.tools, defines, "{name}");
    }
}

/// Tools the server cannot honour, or a tool exchange that does not hold together: a 400 naming
/// the field, never a silently ignored request.
#[test]
fn bad_function_tools_and_tool_messages_get_errors_naming_the_field() {
    let server = serve(Precision::Fast, options(2, 1024, 8), None);
    let ask = json!([{"role": "user", "content": "weather?"}]);
    let weather = json!({"type": "function", "function": {"name": "get_weather"}});
    let cases = [
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            ask.clone(),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "get weather"}}]}),
            ask.clone(),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [weather, weather]}),
            ask.clone(),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            ask.clone(),
            "tools[0].function.parameters",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true,
                "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2,
                    "maximum": 1}}, "required": ["n"]}}}]}),
            ask.clone(),
            "tools[0].function.parameters",
        ),
        (
            json!({"tool_choice": "required"}),
            ask.clone(),
            "tool_choice",
        ),
        (
            json!({"tools": [weather], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            ask.clone(),
            "tool_choice",
        ),
        (
            json!({"tools": [weather], "tool_choice": {"type": "function"}}),
            ask.clone(),
            "tool_choice",
        ),
        (
            json!({"tools": [weather], "tool_choice": "sometimes"}),
            ask.clone(),
            "tool_choice",
        ),
        (
            json!({"tools": [weather]}),
            json!([{"role": "user", "content": "weather?"},
                   {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]),
            "messages[1].tool_call_id",
        ),
        (
            json!({"tools": [weather]}),
            json!([{"role": "user", "content": "weather?"},
                   {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                    "function": {"name": "get<|end|>", "arguments": "{}"}}]}]),
            "messages[1].tool_calls[0].function.name",
        ),
    ];
    for (extra, messages, param) in cases {
        let body = chat(messages, extra);
        let (status, reply) = server.post(&body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
        assert_eq!(reply["error"]["param"], param, "{body}: {reply}");
    }
    // The same exchange held together is served; so is a tool message naming its function.
    for answer in [
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 3}"}),
        json!({"role": "tool", "name": "get_weather", "content": "{\"temperature\": 3}"}),
    ] {
        let messages = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "reasoning_content": "need it",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            answer,
        ]);
        let (status, reply) = server.post(&chat(
            messages,
            json!({"tools": [weather], "max_tokens": 3}),
        ));
        assert_eq!(status, 200, "{reply}");
        let reason = reply["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(
            ["stop", "length", "tool_calls"].contains(&reason),
            "{reply}"
        );
    }
    server.stop();
}

/// What the server cannot honour is refused by name (a schema without one or that nothing
/// satisfies, an answer to continue that is not there, penalties and biases
/// out of OpenAI's ranges or naming no token, more than 20 `top_logprobs` or `top_logprobs`
/// without `logprobs`) while their neutral values pass; llama-server's and vLLM's `top_k` and
/// `min_p` are honoured: `top_k` 1 samples greedily, as temperature 0 does.
#[test]
fn unserved_fields_are_refused_and_top_k_and_min_p_are_honoured() {
    let server = serve(Precision::Fast, options(2, 1024, 8), None);
    for (extra, param) in [
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "strict": true, "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}),
            "response_format",
        ),
        (
            json!({"continue_final_message": true}),
            "continue_final_message",
        ),
        (json!({"frequency_penalty": 2.5}), "frequency_penalty"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"logit_bias": {"1000": 101}}), "logit_bias"),
        (json!({"logit_bias": {"a": 1}}), "logit_bias"),
        (json!({"logit_bias": {"201088": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": "up"}}), "logit_bias"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"n": 0}), "n"),
        (json!({"n": 17}), "n"),
        (json!({"top_k": -1}), "top_k"),
    ] {
        let body = chat(user("hi"), extra);
        let (status, reply) = server.post(&body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{body}: {reply}");
    }
    let neutral = json!({"logprobs": false, "top_logprobs": 0, "response_format": {"type": "text"},
                         "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                         "max_tokens": 2});
    let (status, reply) = server.post(&chat(user("hi"), neutral));
    assert_eq!(status, 200, "{reply}");
    server.stop();
    // The exact path: a reply must not depend on how much of the prompt came from the cache.
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let text = |extra: Value| {
        let (status, reply) = server.post(&chat(user("Count to five."), extra));
        assert_eq!(status, 200, "{reply}");
        let message = &reply["choices"][0]["message"];
        format!("{}|{}", message["reasoning_content"], message["content"])
    };
    let greedy = text(json!({"temperature": 0, "max_tokens": 80}));
    let sampled = [7, 8].map(|seed| text(json!({"seed": seed, "max_tokens": 80})));
    assert!(
        greedy.len() > 20 && sampled[0] != sampled[1],
        "{greedy} {sampled:?}"
    );
    assert_eq!(
        text(json!({"top_k": 1, "seed": 7, "max_tokens": 80})),
        greedy
    );
    assert_eq!(
        text(json!({"top_k": 1, "seed": 8, "min_p": 0.5, "max_tokens": 80})),
        greedy
    );
    server.stop();
}

/// `tool_choice` naming a function opens that call in the prompt (`<|channel|>commentary
/// to=functions.NAME <|constrain|>json<|message|>`), so whatever the model samples is the call's
/// arguments: with random weights too, the reply is a call of that function, whole and streamed.
/// `"required"` stops the header after `to=functions.` for the model to name one.
#[test]
fn a_named_tool_choice_makes_the_reply_a_call_of_that_function() {
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let prompt_of = |choice: Value| {
        let body = chat(
            user("weather?"),
            json!({"tools": [weather], "tool_choice": choice}),
        );
        prepared(&body, 4096, None)
    };
    let auto = prompt_of(json!("auto"));
    let forced = prompt_of(named.clone());
    assert!(auto.forced.is_empty());
    assert_eq!(forced.prompt[..auto.prompt.len()], auto.prompt[..]);
    let tail = tokenizer
        .decode(&forced.prompt[auto.prompt.len()..])
        .unwrap();
    assert_eq!(
        tail,
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    );
    assert_eq!(forced.forced, forced.prompt[auto.prompt.len()..]);
    let any = prompt_of(json!("required"));
    let tail = tokenizer.decode(&any.prompt[auto.prompt.len()..]).unwrap();
    assert_eq!(tail, "<|channel|>commentary to=functions.");

    // The exact path: the streamed request reuses the first one's cache, and the fast path's
    // int8 sums differ in the last bits between a prefill chunk and one token.
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let body = chat(
        user("weather?"),
        json!({"tools": [weather], "tool_choice": named, "max_tokens": 6, "seed": 1}),
    );
    let (status, reply) = server.post(&body);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null, "{reply}");
    let calls = message["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{reply}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(
        calls[0]["id"].as_str().unwrap().starts_with("call_"),
        "{reply}"
    );
    // Random weights write no `<|call|>`: the budget ends the call.
    assert!(["length", "tool_calls"].contains(&choice["finish_reason"].as_str().unwrap()));
    let arguments = calls[0]["function"]["arguments"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut streamed = body.clone();
    streamed.pop();
    streamed.push_str(r#","stream":true}"#);
    let events = stream(&server, &streamed);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let pieces: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(
        pieces[0][0]["function"]["name"], "get_weather",
        "{events:?}"
    );
    assert!(
        pieces[1..].iter().all(|p| p[0].get("id").is_none()),
        "{events:?}"
    );
    let joined: String = pieces
        .iter()
        .map(|p| p[0]["function"]["arguments"].as_str().unwrap())
        .collect();
    // The same seed and prompt, whole or streamed: the same arguments.
    assert_eq!(joined, arguments);
    server.stop();
}

/// `logprobs`: one entry per answer token, whose bytes rebuild the answer; `top_logprobs`
/// alternatives in falling order; greedy sampling picks the first of them; streamed chunks carry
/// the same entries as the whole reply.
#[test]
fn log_probabilities_cover_the_answer_tokens() {
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let body = chat(
        user("Count to five."),
        json!({"temperature": 0, "max_tokens": 80, "logprobs": true, "top_logprobs": 3}),
    );
    let (status, reply) = server.post(&body);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    let content = choice["message"]["content"].as_str().unwrap();
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    assert!(!content.is_empty() && !entries.is_empty(), "{reply}");
    let mut bytes = Vec::new();
    for entry in entries {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{entry}");
        let values: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            values.windows(2).all(|w| w[0] >= w[1]) && values[0] <= 0.0,
            "{entry}"
        );
        assert_eq!(
            entry["logprob"], top[0]["logprob"],
            "greedy takes the likeliest: {entry}"
        );
        bytes.extend(
            entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(String::from_utf8_lossy(&bytes), content);

    let mut streamed = body.clone();
    streamed.pop();
    streamed.push_str(r#","stream":true}"#);
    let events = stream(&server, &streamed);
    let pieces: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|data| serde_json::from_str::<Value>(data).unwrap())
        .filter_map(|chunk| {
            chunk["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(&pieces, entries);
    // Without the flag, null as before.
    let (_, plain) = server.post(&chat(user("hi"), json!({"max_tokens": 3})));
    assert_eq!(plain["choices"][0]["logprobs"], Value::Null);
    server.stop();
}

/// `logit_bias` and the repetition penalties, seen through a forced call (every sampled token is
/// the call's argument text): +100 on one token makes every pick that token; with two tokens
/// boosted alike, a frequency penalty stops either from running away.
#[test]
fn logit_bias_and_penalties_steer_what_is_sampled() {
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let id = |text: &str| {
        let ids = tokenizer.encode_text(text).unwrap();
        assert_eq!(ids.len(), 1, "{text}");
        ids[0].to_string()
    };
    let (x, y) = (id("x"), id("y"));
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let arguments = |extra: Value| {
        let mut fields = json!({
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "temperature": 0, "max_tokens": 12,
        });
        for (key, value) in extra.as_object().unwrap() {
            fields[key] = value.clone();
        }
        let (status, reply) = server.post(&chat(user("go"), fields));
        assert_eq!(status, 200, "{reply}");
        reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        arguments(json!({"logit_bias": {x.clone(): 100}})),
        "x".repeat(12)
    );
    let both = json!({x.clone(): 100, y.clone(): 100});
    let free = arguments(json!({"logit_bias": both}));
    let penalized = arguments(json!({"logit_bias": both, "frequency_penalty": 2}));
    assert!(free.chars().all(|c| c == 'x' || c == 'y'), "{free}");
    let counts = |text: &str| (text.matches('x').count(), text.matches('y').count());
    let (fx, fy) = counts(&penalized);
    assert_eq!(fx + fy, 12, "{penalized}");
    // Each repeat costs 2, so the gap between the two stays within what the model's own
    // preference pays for: on the tiny model the free run leans 8 to 4 (yxxyxyxxxyxx), the
    // penalized one evens out.
    let gap = |(a, b): (usize, usize)| a.abs_diff(b);
    assert!(gap((fx, fy)) < gap(counts(&free)), "{free} -> {penalized}");
    assert!(fx >= 3 && fy >= 3, "{free} -> {penalized}");
    server.stop();
}

/// `/tokenize` and `/detokenize` in llama-server's and vLLM's forms: text ids as the tokenizer
/// gives them, a chat's count equal to what the same request is charged as prompt tokens, ids
/// back to text, and errors for ambiguous or unknown input.
#[test]
fn tokenize_and_detokenize_agree_with_the_tokenizer_and_the_chat_prompt() {
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let server = default_server();
    let post = |path: &str, body: Value| {
        read_json(
            agent()
                .post(&server.url(path))
                .send_string(&body.to_string()),
        )
    };
    let text = "Hello, world <|end|> ünïcode";
    let want = tokenizer.encode_text(text).unwrap();
    for key in ["content", "prompt"] {
        let (status, reply) = post("/tokenize", json!({key: text}));
        assert_eq!(status, 200, "{reply}");
        let ids: Vec<u32> = serde_json::from_value(reply["tokens"].clone()).unwrap();
        assert_eq!(ids, want);
        assert_eq!(reply["count"], want.len());
        assert_eq!(reply["max_model_len"], 4096);
    }
    let (_, pieces) = post(
        "/tokenize",
        json!({"content": "Hello", "with_pieces": true}),
    );
    assert_eq!(pieces["tokens"][0]["id"], want[0]);
    assert_eq!(pieces["tokens"][0]["piece"], "Hello");
    let (status, back) = post("/detokenize", json!({"tokens": want}));
    assert_eq!(status, 200, "{back}");
    assert_eq!(
        (back["content"].as_str(), back["prompt"].as_str()),
        (Some(text), Some(text))
    );

    // A chat: the count is the prompt the completion is charged for.
    let messages = user("What is 2 + 2?");
    let (_, counted) = post(
        "/tokenize",
        json!({"messages": messages, "reasoning_effort": "low"}),
    );
    let (status, reply) = server.post(&chat(
        messages,
        json!({"reasoning_effort": "low", "max_tokens": 1}),
    ));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(
        counted["count"], reply["usage"]["prompt_tokens"],
        "{counted}"
    );

    for (path, body) in [
        ("/tokenize", json!({"content": "a", "prompt": "b"})),
        ("/tokenize", json!({})),
        ("/tokenize", json!({"content": 5})),
        ("/detokenize", json!({"tokens": [999_999_999]})),
        ("/detokenize", json!({"tokens": "abc"})),
    ] {
        let (status, reply) = post(path, body.clone());
        assert_eq!(status, 400, "{path} {body}: {reply}");
        assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
    }
    server.stop();
}

/// `/v1/completions`: the prompt is continued as plain text (no harmony rendering or parsing),
/// the same text whole and streamed, 16 tokens by default, `echo`, stop strings, the legacy
/// `logprobs` object, and errors naming the field.
#[test]
fn text_completions_continue_the_raw_prompt_whole_and_streamed() {
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let post = |body: Value| {
        read_json(
            agent()
                .post(&server.url("/v1/completions"))
                .send_string(&body.to_string()),
        )
    };
    let (status, reply) = post(
        json!({"model": "synthetic-tiny", "prompt": "Once upon a time",
                                      "temperature": 0}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "text_completion");
    assert!(reply["id"].as_str().unwrap().starts_with("cmpl-"));
    let choice = &reply["choices"][0];
    let text = choice["text"].as_str().unwrap().to_owned();
    let usage = &reply["usage"];
    // Random weights seldom sample an end token in 16 tokens; either way the count says why.
    let completion = usage["completion_tokens"].as_u64().unwrap();
    match choice["finish_reason"].as_str().unwrap() {
        "length" => assert_eq!(completion, 16, "{reply}"),
        "stop" => assert!(completion < 16, "{reply}"),
        other => panic!("finish reason {other}"),
    }
    // The prompt is the text's own tokens: no harmony system message around it.
    assert_eq!(usage["prompt_tokens"], 4, "{usage}");

    // Streamed: the same text in pieces, a finish chunk, the usage chunk, [DONE].
    let chunks = completion_chunks(
        &server,
        json!({"prompt": "Once upon a time", "temperature": 0, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = &chunks[chunks.len() - 1];
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], completion);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        choice["finish_reason"]
    );

    // echo puts the prompt first; a stop string cuts the text before it.
    let (_, echoed) = post(json!({"prompt": "Once upon a time", "temperature": 0, "echo": true}));
    assert_eq!(
        echoed["choices"][0]["text"].as_str().unwrap(),
        format!("Once upon a time{text}")
    );
    if let Some(cut) = text.char_indices().nth(3).map(|(at, _)| at) {
        let stop = &text[cut..];
        let (_, stopped) = post(json!({"prompt": "Once upon a time", "temperature": 0,
                                        "stop": stop}));
        let kept = stopped["choices"][0]["text"].as_str().unwrap();
        assert!(
            text.starts_with(kept) && kept.len() <= cut,
            "{kept:?} of {text:?}"
        );
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    }

    // Legacy log-probabilities: a token per completion token, offsets into the text.
    let (_, scored) = post(json!({"prompt": "Once upon a time", "temperature": 0,
                                  "logprobs": 2, "max_tokens": 5}));
    let logprobs = &scored["choices"][0]["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    assert!(!tokens.is_empty() && tokens.len() <= 5, "{scored}");
    assert_eq!(
        logprobs["token_logprobs"].as_array().unwrap().len(),
        tokens.len()
    );
    assert_eq!(logprobs["text_offset"][0], 0);
    for top in logprobs["top_logprobs"].as_array().unwrap() {
        // Two alternatives, keyed by text (two tokens of the same text would share a key).
        let alternatives = top.as_object().unwrap().len();
        assert!((1..=2).contains(&alternatives), "{top}");
    }
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, scored["choices"][0]["text"].as_str().unwrap());

    // Token-id prompts; errors name the field.
    let (status, by_ids) = post(json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 200, "{by_ids}");
    assert_eq!(by_ids["usage"]["prompt_tokens"], 3);
    for (body, param) in [
        (json!({"prompt": "a", "n": 0}), "n"),
        (json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (json!({"prompt": []}), "prompt"),
        (json!({"max_tokens": 2}), "prompt"),
    ] {
        let (status, error) = post(body.clone());
        assert_eq!(status, 400, "{body}: {error}");
        assert!(
            error["error"]["param"] == json!(param)
                || error["error"]["message"].as_str().unwrap().contains(param),
            "{body}: {error}"
        );
    }
    server.stop();
}

/// The Responses API's log-probabilities: `include: ["message.output_text.logprobs"]` fills the
/// output_text part's `logprobs` (one entry per answer token, their text the answer's), and the
/// stream's `output_text.delta` events carry the same entries in pieces.
#[test]
fn responses_report_log_probabilities_when_included() {
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let url = server.url("/v1/responses");
    let body = json!({"input": "Count to five.", "temperature": 0, "max_output_tokens": 80,
                      "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let (status, whole) = read_json(agent().post(&url).send_string(&body.to_string()));
    assert_eq!(status, 200, "{whole}");
    let part = whole["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "message")
        .map(|item| item["content"][0].clone())
        .expect("an answer message");
    let entries = part["logprobs"].as_array().unwrap().clone();
    assert!(!entries.is_empty(), "{whole}");
    let mut bytes = Vec::new();
    for entry in &entries {
        assert_eq!(
            entry["top_logprobs"].as_array().unwrap().len(),
            2,
            "{entry}"
        );
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        bytes.extend(
            entry["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        part["text"].as_str().unwrap()
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response = agent()
        .post(&url)
        .send_string(&streamed.to_string())
        .unwrap();
    let mut pieces = Vec::new();
    let mut done = None;
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        if let Some(data) = line.strip_prefix("data: ") {
            let event: Value = serde_json::from_str(data).unwrap();
            match event["type"].as_str().unwrap() {
                "response.output_text.delta" => {
                    pieces.extend(event["logprobs"].as_array().unwrap().clone())
                }
                "response.output_text.done" => done = Some(event["logprobs"].clone()),
                _ => {}
            }
        }
    }
    assert_eq!(pieces, entries);
    assert_eq!(done, Some(Value::from(entries)));
    // Bad values are refused by name.
    for (bad, param) in [
        (json!({"input": "hi", "top_logprobs": 21}), "top_logprobs"),
        (
            json!({"input": "hi", "include": "message.output_text.logprobs"}),
            "include",
        ),
    ] {
        let (status, error) = read_json(agent().post(&url).send_string(&bad.to_string()));
        assert_eq!(status, 400, "{bad}: {error}");
        assert_eq!(error["error"]["param"], json!(param), "{bad}: {error}");
    }
    // Without `include`, empty lists as before.
    let (_, plain) = read_json(
        agent()
            .post(&url)
            .send_string(&json!({"input": "hi", "max_output_tokens": 40}).to_string()),
    );
    for item in plain["output"].as_array().unwrap() {
        if item["type"] == "message" {
            assert_eq!(item["content"][0]["logprobs"], json!([]));
        }
    }
    server.stop();
}

/// A schema the structured-output tests hold replies to: every field bounded, so a reply of random
/// weights ends (the mask leaves `<|return|>` alone once the object is whole).
fn answer_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
            "checked": {"type": "boolean"}
        },
        "required": ["answer", "confidence", "checked"],
        "additionalProperties": false
    })
}

fn assert_fits_answer_schema(text: &str) {
    let value: Value =
        serde_json::from_str(text).unwrap_or_else(|error| panic!("{text:?}: {error}"));
    let object = value.as_object().unwrap();
    assert_eq!(object.len(), 3, "{text}");
    assert!(
        ["yes", "no", "maybe"].contains(&value["answer"].as_str().unwrap()),
        "{text}"
    );
    assert!(value["confidence"].as_u64().unwrap() <= 100, "{text}");
    assert!(value["checked"].is_boolean(), "{text}");
}

/// Structured outputs: random weights held to a schema write a conforming document and stop
/// (whole and streamed alike, sampled or greedy) in `/v1/completions` (vLLM's `response_format`,
/// from the first token) and in chat completions, where the final channel is constrained: an
/// answer prefilled with `continue_final_message` starts there, and the prefix must fit the
/// schema. The developer message describes the format as harmony's cookbook says.
#[test]
fn structured_outputs_hold_replies_to_the_schema() {
    let server = serve(Precision::Fast, options(2, 1024, 8), None);
    let format = json!({"type": "json_schema",
                        "json_schema": {"name": "verdict", "schema": answer_schema(), "strict": true}});
    let post = |path: &str, body: Value| {
        read_json(
            agent()
                .post(&server.url(path))
                .send_string(&body.to_string()),
        )
    };
    for (seed, temperature) in [(1, 1.0), (2, 1.0), (3, 0.0)] {
        let (status, reply) = post(
            "/v1/completions",
            json!({"prompt": "The verdict as JSON:", "max_tokens": 200, "seed": seed,
                   "temperature": temperature, "response_format": format}),
        );
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
        assert_fits_answer_schema(reply["choices"][0]["text"].as_str().unwrap());
    }

    // Chat: the prefilled answer `{"answer":"` is prompt, the reply continues it (compact, as
    // the format's documents are written).
    let messages = json!([
        {"role": "system", "content": "Answer as JSON."},
        {"role": "user", "content": "Is water wet?"},
        {"role": "assistant", "content": "{\"answer\":\""}
    ]);
    for stream_reply in [false, true] {
        let body = chat(
            messages.clone(),
            json!({"response_format": format, "continue_final_message": true, "seed": 4,
                   "max_tokens": 200, "stream": stream_reply}),
        );
        let content = if stream_reply {
            let events = stream(&server, &body);
            let mut content = String::new();
            let mut finish = Value::Null;
            for event in &events[..events.len() - 1] {
                let chunk: Value = serde_json::from_str(event).unwrap();
                let choice = &chunk["choices"][0];
                if let Some(piece) = choice["delta"]["content"].as_str() {
                    content.push_str(piece);
                }
                if !choice["finish_reason"].is_null() {
                    finish = choice["finish_reason"].clone();
                }
            }
            assert_eq!(finish, "stop", "{events:?}");
            content
        } else {
            let (status, reply) = server.post(&body);
            assert_eq!(status, 200, "{reply}");
            assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
            reply["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        assert_fits_answer_schema(&format!("{{\"answer\":\"{content}"));
    }

    // A prefix the schema cannot continue is refused, naming the format.
    let mut bad = messages.clone();
    bad[2]["content"] = json!("{\"verdict\"");
    let (status, reply) = server.post(&chat(
        bad,
        json!({"response_format": format, "continue_final_message": true}),
    ));
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "response_format", "{reply}");

    // JSON mode: an object, or (cut by max_tokens) the start of one.
    let (status, reply) = post(
        "/v1/completions",
        json!({"prompt": "JSON:", "max_tokens": 24, "seed": 5,
               "response_format": {"type": "json_object"}}),
    );
    assert_eq!(status, 200, "{reply}");
    let text = reply["choices"][0]["text"].as_str().unwrap();
    match reply["choices"][0]["finish_reason"].as_str().unwrap() {
        "stop" => assert!(serde_json::from_str::<Value>(text).unwrap().is_object()),
        _ => assert!(text.starts_with('{'), "{text:?}"),
    }

    // Without a prefill the request is served too: the reply reasons freely first (the gate
    // is `ReplyText::in_final_answer`, tested on the parser's events in src/server/reply.rs).
    let (status, reply) = server.post(&chat(
        user("Is water wet?"),
        json!({"response_format": format, "max_tokens": 12, "seed": 6}),
    ));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");

    // The Responses API takes it as `text.format` (the schema's fields inline) and echoes it.
    let text_format = json!({"type": "json_schema", "name": "verdict", "schema": answer_schema()});
    let (status, reply) = post(
        "/v1/responses",
        json!({"input": "Is water wet?", "max_output_tokens": 8, "text": {"format": text_format}}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["text"]["format"], text_format, "{reply}");
    let (status, reply) = post(
        "/v1/responses",
        json!({"input": "Is water wet?", "text": {"format": {"type": "json_schema", "name": "v"}}}),
    );
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["param"], "text.format", "{reply}");
    server.stop();
}

/// The developer message ends in harmony's `# Response Formats` section (after the instructions
/// and tools), and a prefilled answer leaves the prompt open on the final channel.
#[test]
fn a_response_format_renders_in_the_developer_message() {
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let body = json!({
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Is water wet?"},
            {"role": "assistant", "content": "{\"answer\":"},
        ],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "verdict", "description": "A yes or no.",
            "schema": {"type": "object", "properties": {"answer": {"type": "string"}}}}},
        "continue_final_message": true,
    });
    let job = prepared(&body.to_string(), 4096, None);
    let text = tokenizer.decode(&job.prompt).unwrap();
    let developer = "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Response Formats\n\n\
        ## verdict\n\n// A yes or no.\n{\"type\":\"object\",\"properties\":{\"answer\":{\"type\":\"string\"}}}<|end|>";
    assert!(text.contains(developer), "{text}");
    assert!(
        text.ends_with(
            "<|start|>user<|message|>Is water wet?<|end|><|start|>assistant<|channel|>final<|message|>{\"answer\":"
        ),
        "{text}"
    );
    assert_eq!(
        tokenizer.decode(&job.forced).unwrap(),
        "<|channel|>final<|message|>"
    );
}

/// `strict` function tools: a call's arguments are held to the parameters' schema and end in
/// `<|call|>`, so random weights forced into a call (a named `tool_choice`) write conforming
/// arguments and the reply finishes with `tool_calls`, in chat completions and in the Responses
/// API (its flat tools). `tool_choice: "required"` holds the name to the defined functions.
#[test]
fn strict_tools_get_arguments_that_fit_their_schema() {
    let server = serve(Precision::Fast, options(2, 1024, 8), None);
    let parameters = json!({"type": "object", "additionalProperties": false,
        "required": ["city", "days"],
        "properties": {"city": {"enum": ["Oslo", "Lima"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}});
    let check = |arguments: &str| {
        let value: Value =
            serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments:?}: {e}"));
        assert!(
            ["Oslo", "Lima"].contains(&value["city"].as_str().unwrap()),
            "{arguments}"
        );
        assert!(
            (1..=7).contains(&value["days"].as_u64().unwrap()),
            "{arguments}"
        );
        assert_eq!(value.as_object().unwrap().len(), 2, "{arguments}");
    };
    let tool = json!({"type": "function", "function": {"name": "forecast", "strict": true,
        "description": "The forecast.", "parameters": parameters}});
    for seed in [1, 2] {
        let (status, reply) = server.post(&chat(
            user("Weather?"),
            json!({"tools": [tool], "max_tokens": 100, "seed": seed,
                   "tool_choice": {"type": "function", "function": {"name": "forecast"}}}),
        ));
        assert_eq!(status, 200, "{reply}");
        let choice = &reply["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
        let call = &choice["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "forecast");
        check(call["arguments"].as_str().unwrap());
    }
    // `required`: the model names the function, held to the defined names, and the strict
    // one's arguments to its schema (a function without `strict` gets any JSON object).
    let other = json!({"type": "function", "function": {"name": "get_time", "strict": true,
        "parameters": {"type": "object", "required": ["zone"], "additionalProperties": false,
                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}});
    let mut named = std::collections::BTreeSet::new();
    for seed in 1..=6 {
        let (status, reply) = server.post(&chat(
            user("Weather?"),
            json!({"tools": [tool, other], "tool_choice": "required", "max_tokens": 100,
                   "seed": seed}),
        ));
        assert_eq!(status, 200, "{reply}");
        let choice = &reply["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
        let call = &choice["message"]["tool_calls"][0]["function"];
        let arguments = call["arguments"].as_str().unwrap();
        match call["name"].as_str().unwrap() {
            "forecast" => check(arguments),
            "get_time" => assert!(
                arguments == r#"{"zone":"UTC"}"# || arguments == r#"{"zone":"CET"}"#,
                "{arguments}"
            ),
            name => panic!("called {name:?}: {reply}"),
        }
        named.insert(call["name"].as_str().unwrap().to_owned());
    }
    assert_eq!(named.len(), 2, "{named:?}");
    let flat = json!({"type": "function", "name": "forecast", "strict": true,
                      "parameters": parameters});
    let (status, reply) = read_json(
        agent().post(&server.url("/v1/responses")).send_string(
            &json!({"input": "Weather?", "tools": [flat], "max_output_tokens": 100,
                    "tool_choice": {"type": "function", "name": "forecast"}})
            .to_string(),
        ),
    );
    assert_eq!(status, 200, "{reply}");
    let call = reply["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["type"] == "function_call")
        .unwrap_or_else(|| panic!("{reply}"));
    check(call["arguments"].as_str().unwrap());
    server.stop();
}

/// `n` choices: one sequence each (the later ones copy the first one's prefill), seeds `seed`,
/// `seed + 1`, ..., so each choice is the reply a request with that seed gets alone; streamed,
/// every chunk names its choice and the stream ends after the last one finishes; usage counts
/// the prompt once and every choice's tokens. Completions take `n` the same way.
#[test]
fn n_choices_are_the_replies_of_consecutive_seeds() {
    let server = serve(Precision::Exact, options(4, 1024, 8), None);
    // A prefilled (empty) answer: random weights then write content, not an unheaded mumble.
    let body = |extra: Value| {
        let mut base = json!({"max_tokens": 12, "seed": 40, "continue_final_message": true});
        for (key, value) in extra.as_object().unwrap() {
            base[key] = value.clone();
        }
        let messages = json!([{"role": "user", "content": "Name three rivers."},
                              {"role": "assistant", "content": ""}]);
        chat(messages, base)
    };
    let (status, reply) = server.post(&body(json!({"n": 3})));
    assert_eq!(status, 200, "{reply}");
    let choices = reply["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{reply}");
    let mut completion = 0;
    for (index, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], index);
        let (_, alone) = server.post(&body(json!({"seed": 40 + index})));
        assert_eq!(
            choice["message"], alone["choices"][0]["message"],
            "choice {index}"
        );
        completion += alone["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_ne!(choices[0]["message"], choices[1]["message"], "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], completion, "{reply}");
    let prompt = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(reply["usage"]["total_tokens"], prompt + completion);

    // Streamed: the same messages, rebuilt per choice index.
    let events = stream(
        &server,
        &body(json!({"n": 3, "stream": true, "stream_options": {"include_usage": true}})),
    );
    assert_eq!(events.last().unwrap(), "[DONE]");
    let mut content = vec![String::new(); 3];
    let mut finishes = 0;
    let mut usage = Value::Null;
    for event in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(event).unwrap();
        if chunk["choices"] == json!([]) {
            usage = chunk["usage"].clone();
            continue;
        }
        let choice = &chunk["choices"][0];
        let index = choice["index"].as_u64().unwrap() as usize;
        if let Some(text) = choice["delta"]["content"].as_str() {
            content[index].push_str(text);
        }
        if !choice["finish_reason"].is_null() {
            finishes += 1;
        }
    }
    assert_eq!(finishes, 3, "{events:?}");
    assert_eq!(usage["completion_tokens"], completion, "{usage}");
    for (index, text) in content.iter().enumerate() {
        assert!(!text.is_empty());
        assert_eq!(
            text, &choices[index]["message"]["content"],
            "choice {index}"
        );
    }

    // Completions: two choices, each the seed's text alone.
    let post = |body: Value| {
        read_json(
            agent()
                .post(&server.url("/v1/completions"))
                .send_string(&body.to_string()),
        )
    };
    let (status, two) = post(json!({"prompt": "Rivers:", "n": 2, "seed": 9, "max_tokens": 6}));
    assert_eq!(status, 200, "{two}");
    for index in 0..2 {
        let (_, alone) = post(json!({"prompt": "Rivers:", "seed": 9 + index, "max_tokens": 6}));
        assert_eq!(two["choices"][index]["index"], index);
        assert_eq!(two["choices"][index]["text"], alone["choices"][0]["text"]);
    }
    // Several prompts (as vLLM takes them): prompt p's choices are p x n.. (p + 1) x n, each
    // what that prompt and seed give alone; usage counts every prompt once.
    let prompts = ["Rivers:", "Mountains of the north:"];
    let (status, four) = post(
        json!({"prompt": prompts, "n": 2, "seed": 9, "max_tokens": 6,
                                      "echo": true}),
    );
    assert_eq!(status, 200, "{four}");
    let mut prompt_tokens = 0;
    for (p, prompt) in prompts.iter().enumerate() {
        for c in 0..2 {
            let (_, alone) = post(json!({"prompt": prompt, "seed": 9 + c, "max_tokens": 6,
                                         "echo": true}));
            let choice = &four["choices"][p * 2 + c];
            assert_eq!(choice["index"], p * 2 + c);
            assert_eq!(
                choice["text"], alone["choices"][0]["text"],
                "prompt {p} choice {c}"
            );
            assert!(choice["text"].as_str().unwrap().starts_with(prompt));
            if c == 0 {
                prompt_tokens += alone["usage"]["prompt_tokens"].as_u64().unwrap();
            }
        }
    }
    assert_eq!(four["usage"]["prompt_tokens"], prompt_tokens, "{four}");
    server.stop();
}

/// CORS: browser pages on this machine and the configured origins (the test server allows
/// `https://app.example.com`) may call the API, preflight included; other sites get no
/// `Access-Control-Allow-Origin`, so a page the user visits cannot drive the local model.
#[test]
fn browser_pages_of_this_machine_and_configured_origins_may_call_the_api() {
    let server = default_server();
    let allowed = |origin: &str| {
        let preflight = agent()
            .request("OPTIONS", &server.url("/v1/chat/completions"))
            .set("Origin", origin)
            .set("Access-Control-Request-Method", "POST")
            .set(
                "Access-Control-Request-Headers",
                "authorization, content-type",
            )
            .call()
            .unwrap();
        let allow = preflight
            .header("access-control-allow-origin")
            .map(str::to_owned);
        let get = agent()
            .get(&server.url("/v1/models"))
            .set("Origin", origin)
            .call()
            .unwrap();
        assert_eq!(get.status(), 200);
        assert_eq!(
            get.header("access-control-allow-origin").map(str::to_owned),
            allow,
            "{origin}"
        );
        if allow.is_some() {
            let methods = preflight.header("access-control-allow-methods").unwrap();
            assert!(methods.contains("POST"), "{methods}");
            let headers = preflight.header("access-control-allow-headers").unwrap();
            assert!(headers.contains("authorization"), "{headers}");
        }
        allow
    };
    for origin in [
        "http://localhost:3000",
        "http://127.0.0.1:5173",
        "https://app.example.com",
    ] {
        assert_eq!(allowed(origin).as_deref(), Some(origin));
    }
    for origin in [
        "https://evil.example",
        "http://localhost.evil.example",
        "null",
    ] {
        assert_eq!(allowed(origin), None, "{origin}");
    }
    server.stop();
}

/// What `echo` with `logprobs` should report for `ids`: each token's log-probability after the
/// ones before it, from the same model's logits at every position (`prefill_all_logits`), and
/// the likeliest token's.
fn expected_prompt_logprobs(precision: Precision, ids: &[u32]) -> Vec<(f64, f64)> {
    let pool = ossterm::engine::build_pool(2).unwrap();
    let mut session = support::server::tiny_model(precision).new_session(&pool, 1024);
    let mut all = Vec::new();
    session.prefill_all_logits(ids, &mut all).unwrap();
    let vocab = all.len() / ids.len();
    all.chunks_exact(vocab)
        .zip(&ids[1..])
        .map(|(row, &next)| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&l| f64::from(l - max).exp()).sum();
            let normalizer = f64::from(max) + sum.ln();
            let logprob = |logit: f32| f64::from(logit) - normalizer;
            (logprob(row[next as usize]), logprob(max))
        })
        .collect()
}

/// `choice`'s prompt scores are the fast path's own for `prompt` (within 1e-3).
fn assert_prompt_scored(choice: &Value, prompt: &[u32]) {
    let got = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    for (p, &(logprob, _)) in expected_prompt_logprobs(Precision::Fast, prompt)
        .iter()
        .enumerate()
    {
        let value = got[p + 1].as_f64().unwrap();
        assert!(
            (value - logprob).abs() < 1e-3,
            "position {}: {value} against {logprob}",
            p + 1
        );
    }
}

#[test]
fn echoed_prompts_are_scored_at_every_position_as_evaluation_harnesses_ask() {
    let server = serve(Precision::Fast, options(2, 1024, 8), None);
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let text = "The quick brown fox jumps over the lazy dog, and the model scores every word";
    let ids = tokenizer.encode_text(text).unwrap();
    let n = ids.len();
    let expected = expected_prompt_logprobs(Precision::Fast, &ids);
    let post = |body: Value| {
        read_json(
            agent()
                .post(&server.url("/v1/completions"))
                .send_string(&body.to_string()),
        )
    };
    // What lm-evaluation-harness sends for a log-likelihood: token ids, one generated token.
    let body = json!({"model": "synthetic-tiny", "prompt": ids, "echo": true, "logprobs": 1,
                      "max_tokens": 1, "temperature": 0});
    let (status, reply) = post(body.clone());
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    assert!(
        choice["text"].as_str().unwrap().starts_with(text),
        "{choice}"
    );
    let logprobs = &choice["logprobs"];
    let tokens = logprobs["tokens"].as_array().unwrap();
    let scores = logprobs["token_logprobs"].as_array().unwrap();
    let tops = logprobs["top_logprobs"].as_array().unwrap();
    let offsets = logprobs["text_offset"].as_array().unwrap();
    assert_eq!(
        tokens.len(),
        n + 1,
        "the prompt's tokens and the generated one: {logprobs}"
    );
    assert_eq!(
        (scores.len(), tops.len(), offsets.len()),
        (n + 1, n + 1, n + 1)
    );
    assert!(
        scores[0].is_null() && tops[0].is_null(),
        "nothing predicts the first token"
    );
    let joined: String = tokens[..n].iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text);
    assert!(offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()));
    for (p, &(logprob, best)) in expected.iter().enumerate() {
        let got = scores[p + 1].as_f64().unwrap();
        assert!(
            (got - logprob).abs() < 1e-3,
            "position {}: {got} against {logprob}",
            p + 1
        );
        let top: Vec<f64> = tops[p + 1]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 1, "{}", tops[p + 1]);
        assert!(
            (top[0] - best).abs() < 1e-3,
            "position {}: {top:?} against {best}",
            p + 1
        );
    }
    // Asked again, the scores of the cached prompt are reused with it: all but the last row.
    let (_, again) = post(body);
    assert_eq!(
        again["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()[..n],
        scores[..n]
    );
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        n - 1,
        "{again}"
    );
    // Another answer to the same question (as a multiple-choice benchmark asks): the shared
    // context comes from the cache, scores included; the rest is computed.
    let other = tokenizer
        .encode_text("The quick brown fox jumps over the lazy dog, and the model guesses a word")
        .unwrap();
    let shared = ids.iter().zip(&other).take_while(|(a, b)| a == b).count();
    assert!(shared > 4 && shared < n, "{shared} of {n}");
    let (_, answer) = post(
        json!({"prompt": other, "echo": true, "logprobs": 1, "max_tokens": 1,
                                  "temperature": 0}),
    );
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        shared - 1,
        "{answer}"
    );
    assert_prompt_scored(&answer["choices"][0], &other);
    // More alternatives than the cache kept: computed again.
    let (_, wider) = post(json!({"prompt": other, "echo": true, "logprobs": 3, "max_tokens": 1}));
    assert_eq!(
        wider["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{wider}"
    );
    assert_eq!(
        wider["choices"][0]["logprobs"]["top_logprobs"][2]
            .as_object()
            .unwrap()
            .len(),
        3
    );

    // Scoring alone (`max_tokens` 0): the prompt is the whole answer.
    let (status, scored) = post(json!({"prompt": text, "echo": true, "logprobs": 3,
                                       "max_tokens": 0}));
    assert_eq!(status, 200, "{scored}");
    let choice = &scored["choices"][0];
    assert_eq!(choice["text"], text);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(scored["usage"]["completion_tokens"], 0);
    assert_eq!(choice["logprobs"]["tokens"].as_array().unwrap().len(), n);
    assert_eq!(
        choice["logprobs"]["top_logprobs"][1]
            .as_object()
            .unwrap()
            .len(),
        3
    );
    let (status, refused) = post(json!({"prompt": text, "max_tokens": 0}));
    assert_eq!(status, 400, "{refused}");

    // Streamed: the echoed prompt comes with its log-probabilities in one chunk, then the
    // reply's tokens with theirs.
    let chunks = completion_chunks(
        &server,
        json!({"prompt": ids, "echo": true, "logprobs": 1, "max_tokens": 3,
               "temperature": 0, "stream": true}),
    );
    let echoed = &chunks[0]["choices"][0];
    assert_eq!(echoed["text"], text, "{echoed}");
    let streamed = echoed["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(streamed.len(), n);
    assert_eq!(streamed[..], scores[..n]);
    let later: usize = chunks[1..]
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array())
        .map(Vec::len)
        .sum();
    assert!((1..=3).contains(&later), "the reply's tokens: {chunks:?}");
    server.stop();
}

#[test]
fn prompts_scored_beside_running_streams_and_each_other_get_the_same_scores() {
    let server = serve(Precision::Fast, options(3, 1024, 8), None);
    let reader = stream_in_background(
        &server,
        chat(user("long"), json!({"max_tokens": 400, "stream": true})),
    );
    server.wait_for_metric("ossterm_tokens_generated_total", |v| v > 0.0);
    // Longer than a prefill chunk (32 here) while a stream decodes: scored in several steps,
    // each a batch with the stream's row, two requests taking turns.
    let text = "It was the best of times, it was the worst of times, it was the age of wisdom, \
                it was the age of foolishness, it was the epoch of belief, it was the epoch of \
                incredulity, it was the season of Light, it was the season of Darkness, it was the \
                spring of hope, it was the winter of despair";
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let ids = tokenizer.encode_text(text).unwrap();
    assert!(ids.len() > 64, "{} tokens", ids.len());
    let expected = expected_prompt_logprobs(Precision::Fast, &ids);
    let url = server.url("/v1/completions");
    let scorers: Vec<_> = (0..2)
        .map(|_| {
            let (url, ids) = (url.clone(), ids.clone());
            std::thread::spawn(move || {
                let body = json!({"prompt": ids, "echo": true, "logprobs": 1, "max_tokens": 0});
                read_json(agent().post(&url).send_string(&body.to_string()))
            })
        })
        .collect();
    let mut cached = 0;
    for scorer in scorers {
        let (status, reply) = scorer.join().unwrap();
        assert_eq!(status, 200, "{reply}");
        cached += reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let scores = reply["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .clone();
        assert_eq!(scores.len(), ids.len());
        let worst = expected
            .iter()
            .zip(&scores[1..])
            .map(|(&(logprob, _), got)| (got.as_f64().unwrap() - logprob).abs())
            .fold(0.0, f64::max);
        assert!(worst < 2e-3, "worst difference {worst}");
    }
    // The later of the two waited for the first one's scored prefill and took all of it but
    // the last row from its slot.
    assert_eq!(cached, ids.len() as u64 - 1);
    server.stop();
    reader.join().unwrap();
}

#[test]
fn the_answers_of_a_batched_question_share_its_scored_context() {
    let server = serve(Precision::Fast, options(4, 1024, 8), None);
    let tokenizer = ossterm::chat::Tokenizer::shared().unwrap();
    let context = "Question: which of these is the capital of France, the city on the Seine that \
                   hosts the Louvre and the Eiffel Tower? Answer:";
    let answers = [" Paris", " Berlin", " Madrid", " Rome"];
    let prompts: Vec<Vec<u32>> = answers
        .iter()
        .map(|a| tokenizer.encode_text(&format!("{context}{a}")).unwrap())
        .collect();
    let shared = prompts[0]
        .iter()
        .zip(&prompts[1])
        .take_while(|(a, b)| a == b)
        .count();
    assert!(shared > 20, "{shared}");
    // One request, four prompts, as a harness batches a question's answers: the first is
    // computed, each later one waits for the one before and takes the context's scores.
    let body = json!({"prompt": prompts, "echo": true, "logprobs": 1, "max_tokens": 1,
                      "temperature": 0});
    let (status, reply) = read_json(
        agent()
            .post(&server.url("/v1/completions"))
            .send_string(&body.to_string()),
    );
    assert_eq!(status, 200, "{reply}");
    let cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, 3 * (shared as u64 - 1), "{}", reply["usage"]);
    for (choice, prompt) in reply["choices"].as_array().unwrap().iter().zip(&prompts) {
        assert_prompt_scored(choice, prompt);
    }
    server.stop();
}

#[test]
fn responses_are_kept_continued_by_previous_response_id_retrieved_and_deleted() {
    let server = serve(Precision::Exact, options(2, 1024, 8), None);
    let url = server.url("/v1/responses");
    let post = |body: Value| read_json(agent().post(&url).send_string(&body.to_string()));
    let get = |id: &str| {
        read_json(
            agent()
                .get(&server.url(&format!("/v1/responses/{id}")))
                .call(),
        )
    };
    let ask = |input: Value, extra: Value| {
        let mut body = json!({"model": "synthetic-tiny", "input": input, "max_output_tokens": 24,
                              "seed": 5, "temperature": 0, "reasoning": {"effort": "low"}});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body
    };
    let (status, first) = post(ask(json!("Hello there"), json!({})));
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["store"], true, "kept by default, as in OpenAI's API");
    let id = first["id"].as_str().unwrap().to_owned();
    assert_eq!(
        get(&id),
        (200, first.clone()),
        "retrieved as it was answered"
    );

    // The next turn names the first: its conversation (input and output items) comes first.
    let (status, second) = post(ask(
        json!("And again?"),
        json!({"previous_response_id": id}),
    ));
    assert_eq!(status, 200, "{second}");
    let input_tokens = |r: &Value| r["usage"]["input_tokens"].as_u64().unwrap();
    assert!(input_tokens(&second) > input_tokens(&first));
    // The first turn's prompt is the second's prefix: its cache is reused.
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= input_tokens(&first) - 1,
        "{cached} of {}",
        input_tokens(&first)
    );
    // Sending the whole conversation as input is the same request.
    let mut items = vec![json!({"role": "user", "content": "Hello there"})];
    items.extend(first["output"].as_array().unwrap().iter().cloned());
    items.push(json!({"role": "user", "content": "And again?"}));
    let (_, explicit) = post(ask(Value::Array(items), json!({"store": false})));
    assert_eq!(input_tokens(&explicit), input_tokens(&second));
    assert_eq!(explicit["output"], second["output"]);
    assert_eq!(explicit["store"], false);
    assert_eq!(get(explicit["id"].as_str().unwrap()).0, 404, "not kept");

    // Streamed, continuing the second: the response.completed event's response is kept.
    let mut streamed = ask(
        json!("Once more"),
        json!({"previous_response_id": second["id"]}),
    );
    streamed["stream"] = json!(true);
    let reply = agent()
        .post(&url)
        .send_string(&streamed.to_string())
        .unwrap();
    let last = BufReader::new(reply.into_reader())
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| line.strip_prefix("data: ").map(str::to_owned))
        .last()
        .unwrap();
    let last: Value = serde_json::from_str(&last).unwrap();
    let third = &last["response"];
    assert!(input_tokens(third) > input_tokens(&second), "{last}");
    assert_eq!(get(third["id"].as_str().unwrap()), (200, third.clone()));

    // Deleted: gone, and no longer a conversation to continue.
    let deleted = read_json(
        agent()
            .delete(&server.url(&format!("/v1/responses/{id}")))
            .call(),
    );
    assert_eq!(deleted.0, 200);
    assert_eq!(
        deleted.1,
        json!({"id": id, "object": "response", "deleted": true})
    );
    assert_eq!(get(&id).0, 404);
    let (status, refused) = post(ask(json!("hi"), json!({"previous_response_id": id})));
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["code"], "previous_response_not_found");
    assert_eq!(refused["error"]["param"], "previous_response_id");
    let again = read_json(
        agent()
            .delete(&server.url(&format!("/v1/responses/{id}")))
            .call(),
    );
    assert_eq!(again.0, 404);
    server.stop();
}
