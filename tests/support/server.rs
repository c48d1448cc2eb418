//! `ossterm serve` in process on a loopback port, on the synthetic tiny model (random weights),
//! and what a test asks it over HTTP.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use ossterm::model::{LoadOptions, Model, Precision, Preset};
use ossterm::server::scheduler::SchedulerOptions;
use ossterm::server::{start, RunningServer, ServeOptions};
use serde_json::Value;

/// The tiny synthetic model (seed 0) on `precision`'s path, loaded once per test binary.
pub fn tiny_model(precision: Precision) -> Arc<Model> {
    static FAST: OnceLock<Arc<Model>> = OnceLock::new();
    static EXACT: OnceLock<Arc<Model>> = OnceLock::new();
    let cell = match precision {
        Precision::Fast => &FAST,
        Precision::Exact => &EXACT,
    };
    cell.get_or_init(|| {
        let opts = LoadOptions {
            precision,
            ..LoadOptions::default()
        };
        Arc::new(Model::synthetic(Preset::Tiny, 0, &opts).expect("synthetic tiny"))
    })
    .clone()
}

/// Scheduler options with prefill chunks of 32 tokens.
pub fn scheduler(parallel: usize, context: usize, queue: usize) -> SchedulerOptions {
    SchedulerOptions {
        parallel,
        context,
        queue,
        prefill_chunk: 32,
    }
}

pub fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(60))
        .build()
}

/// The status and JSON body of a response, error statuses included.
pub fn read_json(result: Result<ureq::Response, ureq::Error>) -> (u16, Value) {
    let response = match result {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(error) => panic!("transport error: {error}"),
    };
    let status = response.status();
    let text = response.into_string().unwrap();
    let value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}"));
    (status, value)
}

/// A running server; [`Server::stop`] or [`Server::drain`] ends it.
pub struct Server {
    running: Option<RunningServer>,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// The key the server wants, sent with the metrics reads.
    api_key: Option<String>,
}

impl Server {
    /// Serves the tiny model on `precision`'s path with a pool of `threads`, under the model id
    /// "synthetic-tiny", without signal handling or drain grace.
    pub fn start(
        precision: Precision,
        threads: usize,
        scheduler: SchedulerOptions,
        api_key: Option<&str>,
        max_body_bytes: usize,
    ) -> Server {
        Self::start_with_page(precision, threads, scheduler, api_key, max_body_bytes, true)
    }

    /// As [`Server::start`], serving the chat page at `/` or not (`--no-webui`).
    pub fn start_with_page(
        precision: Precision,
        threads: usize,
        scheduler: SchedulerOptions,
        api_key: Option<&str>,
        max_body_bytes: usize,
        web_ui: bool,
    ) -> Server {
        let pool = ossterm::engine::build_pool(threads).unwrap();
        let session = tiny_model(precision).new_session(&pool, 1);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let options = ServeOptions {
            scheduler,
            api_key: api_key.map(str::to_owned),
            model_id: "synthetic-tiny".into(),
            max_body_bytes,
            handle_signals: false,
            drain_grace: Duration::ZERO,
            cors_origins: vec!["https://app.example.com".into()],
            web_ui,
        };
        let running = start(session, options, listener).unwrap();
        let base = format!("http://{}", running.addr);
        Server {
            running: Some(running),
            base,
            api_key: api_key.map(str::to_owned),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// POSTs `body` to the chat completions endpoint.
    pub fn post(&self, body: &str) -> (u16, Value) {
        let result = agent()
            .post(&self.url("/v1/chat/completions"))
            .set("Content-Type", "application/json")
            .send_string(body);
        read_json(result)
    }

    /// The value of the metric `name` on /metrics (read with the server's key, if it has one).
    pub fn metric(&self, name: &str) -> f64 {
        let mut request = agent().get(&self.url("/metrics"));
        if let Some(key) = &self.api_key {
            request = request.set("Authorization", &format!("Bearer {key}"));
        }
        let text = request.call().unwrap().into_string().unwrap();
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }

    /// Polls `name` until `accept` holds; fails after five seconds.
    pub fn wait_for_metric(&self, name: &str, accept: impl Fn(f64) -> bool) {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let value = self.metric(name);
            if accept(value) {
                return;
            }
            assert!(Instant::now() < until, "{name} stayed at {value}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn stop(mut self) {
        self.running.take().unwrap().stop().unwrap();
    }

    pub fn drain(mut self, grace: Duration) {
        self.running.take().unwrap().drain(grace).unwrap();
    }
}
