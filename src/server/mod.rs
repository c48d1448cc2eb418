//! `ossterm serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of a scheduler that
//! decodes many sequences in one forward pass (continuous batching on the CPU).
//!
//! The HTTP side ([`http`]) parses and checks requests ([`api`]), renders them as harmony prompts
//! and hands them to the scheduler thread ([`scheduler`]), which owns the model session; replies
//! come back as events and go out as JSON or server-sent events.

pub mod api;
pub mod completions;
pub mod http;
pub mod metrics;
pub mod reply;
pub mod responses;
pub mod scheduler;
pub mod stored;
pub mod structured;
pub mod webui;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::chat::{Tokenizer, TokenizerError};
use crate::model::Session;
use metrics::Metrics;
use scheduler::{Scheduler, SchedulerOptions};

/// Largest request body accepted (413 beyond).
pub const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("refusing to listen on {host} without an API key: anyone who can reach that address could use the model. Set --api-key KEY or OSSTERM_API_KEY, or listen on 127.0.0.1")]
    ExposedWithoutKey { host: String },
    #[error("{0}")]
    Tokenizer(#[from] TokenizerError),
    #[error("cannot serve on {addr}: {source}")]
    Io {
        addr: String,
        source: std::io::Error,
    },
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub scheduler: SchedulerOptions,
    pub api_key: Option<String>,
    /// The id `/v1/models` lists and replies carry.
    pub model_id: String,
    /// Largest request body accepted (413 beyond); [`MAX_BODY_BYTES`] by default.
    pub max_body_bytes: usize,
    /// Stop on SIGTERM and Ctrl-C (the command does; tests stop the server themselves).
    pub handle_signals: bool,
    /// How long a signal lets running requests finish before they are cancelled.
    pub drain_grace: Duration,
    /// Origins whose browser pages may call the API besides local ones (`*`: any); see
    /// [`http::cors`].
    pub cors_origins: Vec<String>,
    /// Serve the chat page at `/` (see [`webui`]).
    pub web_ui: bool,
}

/// Refuses a non-loopback address without an API key.
pub fn check_exposure(host: &str, api_key: Option<&str>) -> Result<(), ServeError> {
    let loopback = match host.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host == "localhost",
    };
    if loopback || api_key.is_some_and(|key| !key.is_empty()) {
        Ok(())
    } else {
        Err(ServeError::ExposedWithoutKey {
            host: host.to_owned(),
        })
    }
}

/// A server running on its own threads (the HTTP runtime and the scheduler).
pub struct RunningServer {
    pub addr: SocketAddr,
    /// Carries the grace time running requests get.
    stop: Option<tokio::sync::oneshot::Sender<Duration>>,
    thread: Option<JoinHandle<Result<(), ServeError>>>,
}

impl RunningServer {
    /// Cancels in-flight requests, closes connections and waits for the threads.
    pub fn stop(self) -> Result<(), ServeError> {
        self.drain(Duration::ZERO)
    }

    /// Stops accepting connections and requests, lets running and queued requests finish for up
    /// to `grace` (then cancels them) and waits for the threads.
    pub fn drain(mut self, grace: Duration) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(grace);
        }
        self.wait_inner()
    }

    /// Runs until a signal stops the server (with `handle_signals`).
    pub fn wait(mut self) -> Result<(), ServeError> {
        self.wait_inner()
    }

    fn wait_inner(&mut self) -> Result<(), ServeError> {
        match self.thread.take() {
            Some(thread) => thread.join().unwrap_or(Ok(())),
            None => Ok(()),
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Duration::ZERO);
        }
        let _ = self.wait_inner();
    }
}

/// Serves `session`'s model on `listener` until stopped.
pub fn start(
    session: Session,
    options: ServeOptions,
    listener: std::net::TcpListener,
) -> Result<RunningServer, ServeError> {
    let addr = listener.local_addr().map_err(|source| ServeError::Io {
        addr: "the listener".into(),
        source,
    })?;
    let io_error = move |source| ServeError::Io {
        addr: addr.to_string(),
        source,
    };
    listener.set_nonblocking(true).map_err(io_error)?;
    let tokenizer = Tokenizer::shared()?;
    // The structured-output parser's vocabulary tables, built while the server starts rather
    // than during the first request that asks for a format.
    let _ = std::thread::Builder::new()
        .name("ossterm-grammar".into())
        .spawn(structured::prepare);
    let metrics = Arc::new(Metrics::default());
    let config = &session.model().config;
    let (trained_context, vocab) = (config.max_position_embeddings, config.vocab_size);
    let scheduler = Scheduler::start(session, options.scheduler, metrics);
    let state = Arc::new(
        http::AppState::new(
            scheduler,
            tokenizer,
            options.scheduler.context,
            options.model_id.clone(),
            options.api_key.clone(),
        )
        .with_model_facts(trained_context, vocab, options.scheduler.parallel.max(1)),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<Duration>();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Requests are prepared on blocking threads (see `http::off_the_workers`): a few at
        // once keep two cores busy, and a flood of large bodies cannot start hundreds.
        .max_blocking_threads(4)
        .thread_name("ossterm-http")
        .enable_all()
        .build()
        .map_err(io_error)?;
    let handle_signals = options.handle_signals;
    let signal_grace = options.drain_grace;
    let max_body = options.max_body_bytes;
    let cors_origins = options.cors_origins.clone();
    let web_ui = options.web_ui;
    let thread = std::thread::Builder::new()
        .name("ossterm-serve".into())
        .spawn(move || {
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(io_error)?;
                let app = http::router(state.clone(), max_body, web_ui).layer(http::cors(&cors_origins));
                let shutdown_state = state.clone();
                let shutdown = async move {
                    let grace = wait_for_stop(stopped, handle_signals, signal_grace).await;
                    // New requests get 503 from now on; once this future resolves the listener
                    // closes, and the server waits for the open connections, whose streams end
                    // as the scheduler finishes or, after the grace time, cancels them.
                    shutdown_state.scheduler.drain(grace);
                    if handle_signals && !grace.is_zero() {
                        eprintln!(
                            "ossterm serve: finishing running requests (up to {} s; again to cancel them)",
                            grace.as_secs()
                        );
                        let state = shutdown_state.clone();
                        tokio::spawn(async move {
                            signal().await;
                            state.scheduler.drain(Duration::ZERO);
                        });
                    }
                };
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown)
                    .await
                    .map_err(io_error)?;
                state.scheduler.shutdown();
                Ok(())
            })
        })
        .map_err(io_error)?;
    Ok(RunningServer {
        addr,
        stop: Some(stop),
        thread: Some(thread),
    })
}

/// Resolves with the grace time of the stop message, or `signal_grace` on SIGTERM / Ctrl-C when
/// `signals`.
async fn wait_for_stop(
    stopped: tokio::sync::oneshot::Receiver<Duration>,
    signals: bool,
    signal_grace: Duration,
) -> Duration {
    if !signals {
        return stopped.await.unwrap_or(Duration::ZERO);
    }
    tokio::select! {
        grace = stopped => grace.unwrap_or(Duration::ZERO),
        _ = signal() => signal_grace,
    }
}

/// Resolves on SIGTERM or Ctrl-C.
async fn signal() {
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
