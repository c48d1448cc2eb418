//! The remote engine: an engine thread that answers the same [`Command`]s with the same
//! [`Event`]s as the local one, by asking an OpenAI-compatible server. The UI cannot tell the
//! two apart, except that this one reports the settings the server decides as fixed and adds
//! gauge rows of its own (server, network and server time).

use crate::engine::protocol::{
    CacheHits, Command, EngineInfo, Event, GenerateRequest, RequestId, Settings, StatsSample,
    StopReason,
};
use crate::engine::worker::{read_memory_usage, EngineHandle};
use crate::remote::client::{ChatOutcome, ClientTimings, Finish, RemoteTarget, ServerMetrics};
use crate::remote::session::{RemoteSession, SessionError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the panel shows for the settings the server decides.
pub const SHOWN_AS_SERVER: &str = "server";

/// Settings that do not apply to a remote engine: how the model runs (threads, formats, KV
/// cache, context) and how the harmony system message and history are rendered are the
/// server's business. Sampling, the token budget, reasoning effort and developer instructions
/// go with each request.
pub const SERVER_SETTINGS: [&str; 9] = [
    "engine.threads",
    "engine.weight_format",
    "engine.unembedding",
    "engine.kv_cache",
    "engine.activations",
    "engine.attention",
    "engine.context_limit",
    "chat.system_prompt",
    "chat.keep_reasoning_in_context",
];

/// How often a stats sample goes out while a reply streams.
const STATS_INTERVAL: Duration = Duration::from_millis(250);

/// The remote engine's configuration: the server, its key, the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteConfig {
    pub target: RemoteTarget,
    /// `None`: the server's first model.
    pub model: Option<String>,
}

/// Starts the remote engine thread. It checks the URL and lists the models (progress shows
/// meanwhile); a server that does not answer yet still gives a ready engine whose requests fail
/// with the reason until it does, so the user can retry without restarting.
pub fn spawn_remote_engine(
    config: RemoteConfig,
    settings: Settings,
    events: Sender<Event>,
) -> EngineHandle {
    EngineHandle::spawn_backend("ossterm-remote-engine", move |commands, cancel_mark| {
        let _ = events.send(Event::LoadProgress {
            stage: format!("connecting to {}", config.target.url),
            done: 0,
            total: 1,
        });
        match RemoteWorker::start(config, settings, events.clone(), cancel_mark) {
            Ok(worker) => worker.run(commands),
            Err(error) => {
                let _ = events.send(Event::Error {
                    id: None,
                    message: error.describe(),
                });
            }
        }
    })
}

/// The figures of the last turn, for stats and gauges.
#[derive(Clone, Debug, Default)]
struct TurnFigures {
    client: ClientTimings,
    outcome: Option<ChatOutcome>,
    hits: CacheHits,
    /// Tokens of the conversation as the server last counted them (prompt + reply).
    context_used: usize,
}

struct RemoteWorker {
    session: RemoteSession,
    settings: Settings,
    events: Sender<Event>,
    cancel_mark: Arc<AtomicU64>,
    session_hits: CacheHits,
    last: TurnFigures,
    metrics: Option<ServerMetrics>,
}

impl RemoteWorker {
    fn start(
        config: RemoteConfig,
        settings: Settings,
        events: Sender<Event>,
        cancel_mark: Arc<AtomicU64>,
    ) -> Result<RemoteWorker, SessionError> {
        let mut session = RemoteSession::new(config.target, config.model)?;
        let notice = match session.resolve_model() {
            Ok((_, notice)) => notice,
            Err(error) => Some(format!("Error: {}", error.describe())),
        };
        let mut worker = RemoteWorker {
            session,
            settings,
            events,
            cancel_mark,
            session_hits: CacheHits::default(),
            last: TurnFigures::default(),
            metrics: None,
        };
        worker.metrics = worker.session.server_metrics();
        let _ = worker.events.send(Event::Ready(EngineInfo {
            model_label: worker.label(),
            random_weights: false,
            kernel_path: SHOWN_AS_SERVER.to_string(),
            settings: worker.settings.clone(),
        }));
        let _ = worker.events.send(Event::SettingsFixed {
            keys: SERVER_SETTINGS.iter().map(|key| key.to_string()).collect(),
            shown_as: SHOWN_AS_SERVER.to_string(),
        });
        worker.send_gauges();
        if let Some(notice) = notice {
            let _ = worker.events.send(Event::Notice(notice));
        }
        // Last of the start-up events, so a reader knows the start-up is complete.
        worker.send_stats(None);
        Ok(worker)
    }

    fn label(&self) -> String {
        match self.session.model() {
            Some(model) => format!("{} at {}", model.id, self.session.url()),
            None => format!("{} (no model yet)", self.session.url()),
        }
    }

    fn run(mut self, commands: Receiver<Command>) {
        for command in commands {
            match command {
                Command::Generate(request) => self.run_turn(*request),
                // The mark is already raised; a turn running then has seen it.
                Command::Cancel(_) => {}
                Command::ApplySettings(next) => self.apply_settings(*next),
                // The server keeps its own KV cache; a reopened chat has nothing to restore here.
                Command::Resume(_) => {}
                // The weights are read on the server: this machine's bandwidth is no ceiling of
                // that decode, so the answer says there is none (0 GB/s).
                Command::MeasureBandwidth => {
                    let _ = self.events.send(Event::Bandwidth {
                        gigabytes_per_second: 0.0,
                        threads: 0,
                    });
                }
                Command::Shutdown => return,
            }
        }
    }

    fn cancelled(&self, id: RequestId) -> bool {
        self.cancel_mark.load(Ordering::SeqCst) >= id
    }

    fn run_turn(&mut self, request: GenerateRequest) {
        let id = request.id;
        if self.cancelled(id) {
            self.turn_done(id, StopReason::Cancelled, CacheHits::default(), 0);
            self.send_gauges();
            return;
        }
        let had_model = self.session.model().is_some();
        let started = Instant::now();
        let events = self.events.clone();
        let mut texts = 0u64;
        let mut first_text: Option<Duration> = None;
        let mut last_stats = Instant::now();
        let mut streaming = self.stats_sample(None);
        let cancel_mark = Arc::clone(&self.cancel_mark);
        let result = self.session.reply(
            &request.conversation,
            &self.settings.sampling,
            self.settings.reasoning_effort,
            &|| cancel_mark.load(Ordering::SeqCst) >= id,
            &mut |channel, text| {
                let at = started.elapsed();
                let first = *first_text.get_or_insert(at);
                texts += 1;
                let _ = events.send(Event::Token {
                    id,
                    channel,
                    text: text.to_string(),
                });
                if last_stats.elapsed() >= STATS_INTERVAL {
                    last_stats = Instant::now();
                    let span = at.saturating_sub(first).as_secs_f64();
                    streaming.time_to_first_token = Some(first);
                    streaming.decode_tokens_per_second =
                        (texts > 1 && span > 0.0).then(|| (texts - 1) as f64 / span);
                    let _ = events.send(Event::Stats(streaming.clone()));
                }
            },
        );
        if !had_model && self.session.model().is_some() {
            // The model became known with this request: the title says which it is now.
            self.announce_model();
        }
        match result {
            Ok(reply) => {
                let outcome = reply.outcome;
                let reason = match outcome.finish {
                    Finish::Cancelled => StopReason::Cancelled,
                    Finish::Length => StopReason::MaxTokens,
                    Finish::Stop | Finish::Other(_) | Finish::Unstated => StopReason::Finished,
                };
                let hits = outcome
                    .usage
                    .map_or(CacheHits::default(), |usage| CacheHits {
                        reused: usage.cached_tokens,
                        prompt: usage.prompt_tokens,
                    });
                self.session_hits.add(hits);
                let generated = outcome.usage.map_or(texts, |usage| usage.completion_tokens);
                self.last = TurnFigures {
                    client: outcome.client,
                    hits,
                    context_used: outcome.usage.map_or(self.last.context_used, |usage| {
                        (usage.prompt_tokens + usage.completion_tokens) as usize
                    }),
                    outcome: Some(outcome),
                };
                self.send_stats(Some(&self.last.clone()));
                self.turn_done(id, reason, hits, generated as usize);
                if reason != StopReason::Cancelled {
                    self.metrics = self.session.server_metrics();
                }
                if let Some(first) = reply.malformed.first() {
                    let _ = self.events.send(Event::Notice(format!(
                        "The server's harmony text did not parse {} times; first: {first}",
                        reply.malformed.len()
                    )));
                }
                // A turn's events end with the gauge rows, whatever its outcome.
                self.send_gauges();
            }
            Err(error) => {
                self.send_stats(None);
                let retry = if error.is_transient() {
                    " (Ctrl-R retries)"
                } else {
                    ""
                };
                let _ = self.events.send(Event::Error {
                    id: Some(id),
                    message: format!("{}{retry}", error.describe()),
                });
                self.send_gauges();
            }
        }
    }

    fn turn_done(&self, id: RequestId, reason: StopReason, hits: CacheHits, generated: usize) {
        let _ = self.events.send(Event::TurnDone {
            id,
            reason,
            hits,
            generated_tokens: generated,
        });
    }

    /// Sends `Ready` again with the model now known (the UI keeps the chat and the settings).
    fn announce_model(&self) {
        let _ = self.events.send(Event::Ready(EngineInfo {
            model_label: self.label(),
            random_weights: false,
            kernel_path: SHOWN_AS_SERVER.to_string(),
            settings: self.settings.clone(),
        }));
        self.send_gauges();
    }

    /// Takes the settings that go with requests; the server's stay as they were.
    fn apply_settings(&mut self, next: Settings) {
        let kept = &self.settings;
        let applied = Settings {
            threads: kept.threads,
            weight_format: kept.weight_format,
            unembedding: kept.unembedding,
            activations: kept.activations,
            kv_cache: kept.kv_cache,
            context_limit: kept.context_limit,
            system_prompt: kept.system_prompt.clone(),
            keep_reasoning_in_context: kept.keep_reasoning_in_context,
            ..next
        };
        self.settings = applied;
        let _ = self
            .events
            .send(Event::SettingsApplied(Box::new(self.settings.clone())));
    }

    fn context_capacity(&self) -> usize {
        self.session
            .model()
            .and_then(|model| model.context_length)
            .unwrap_or(self.settings.context_limit)
    }

    /// A stats sample: the client's own measurements, plus the server's prefill rate when its
    /// timings came.
    fn stats_sample(&self, turn: Option<&TurnFigures>) -> StatsSample {
        let memory = read_memory_usage();
        let timings = turn
            .and_then(|turn| turn.outcome.as_ref())
            .and_then(|outcome| outcome.timings);
        let prefill = timings.and_then(|timings| {
            (timings.prompt_tokens > 0 && timings.prompt_ms > 0.0)
                .then(|| timings.prompt_tokens as f64 * 1e3 / timings.prompt_ms)
        });
        let capacity = self.context_capacity();
        StatsSample {
            decode_tokens_per_second: turn.and_then(|turn| turn.client.decode_rate()),
            prefill_tokens_per_second: prefill,
            time_to_first_token: turn.and_then(|turn| turn.client.first_text),
            process_memory_bytes: memory.process_bytes,
            machine_memory_bytes: memory.machine_bytes,
            kv_tokens_used: self.last.context_used,
            kv_tokens_capacity: capacity,
            kv_cache: self.settings.kv_cache,
            context_used: self.last.context_used,
            context_limit: capacity,
            turn_hits: turn.map_or(CacheHits::default(), |turn| turn.hits),
            session_hits: self.session_hits,
            threads: 0,
            kernel_path: SHOWN_AS_SERVER.to_string(),
            weight_format: self.settings.weight_format,
            unembedding: self.settings.unembedding,
            activations: self.settings.activations,
            kv_tiers: Default::default(),
        }
    }

    fn send_stats(&self, turn: Option<&TurnFigures>) {
        let _ = self.events.send(Event::Stats(self.stats_sample(turn)));
    }

    fn send_gauges(&self) {
        let _ = self.events.send(Event::EngineGauges(gauge_rows(
            self.session.url(),
            self.session.model().map(|model| model.id.as_str()),
            self.last.outcome.as_ref(),
            self.metrics,
        )));
    }
}

fn milliseconds(duration: Duration) -> String {
    format!("{:.0} ms", duration.as_secs_f64() * 1e3)
}

/// The remote engine's own gauge rows: where it talks to, how the last reply's time split
/// between the network and the server (when the server reported its timings), the server's
/// token counts, and an ossterm server's load.
pub fn gauge_rows(
    url: &str,
    model: Option<&str>,
    last: Option<&ChatOutcome>,
    metrics: Option<ServerMetrics>,
) -> Vec<(String, String)> {
    let mut rows = vec![
        ("server".to_string(), url.to_string()),
        ("model".to_string(), model.unwrap_or("-").to_string()),
    ];
    if let Some(outcome) = last {
        let client = outcome.client;
        // The server's own prompt and decode time against the whole request as the client saw
        // it: the rest is the network (and the server's HTTP layer).
        let network = match (client.last_event, outcome.timings) {
            (Some(total), Some(timings)) => {
                let server_ms = (timings.prompt_ms + timings.predicted_ms).max(0.0);
                let server = Duration::from_secs_f64(server_ms / 1e3);
                format!(
                    "{} of {}",
                    milliseconds(total.saturating_sub(server)),
                    milliseconds(total)
                )
            }
            _ => client.headers.map_or("-".to_string(), |headers| {
                format!("reply header after {}", milliseconds(headers))
            }),
        };
        rows.push(("network".to_string(), network));
        if let Some(timings) = outcome.timings {
            rows.push((
                "server time".to_string(),
                format!(
                    "prompt {:.0} ms · decode {:.0} ms",
                    timings.prompt_ms, timings.predicted_ms
                ),
            ));
        }
        if let Some(usage) = outcome.usage {
            rows.push((
                "usage".to_string(),
                format!(
                    "{} prompt ({} cached) · {} reply",
                    usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
                ),
            ));
        }
    }
    if let Some(metrics) = metrics {
        rows.push((
            "server load".to_string(),
            format!(
                "{:.1} tok/s · {:.0} queued · {:.0} active · KV {:.0}%",
                metrics.decode_tokens_per_second,
                metrics.queue_depth,
                metrics.active_sequences,
                metrics.kv_use_ratio * 100.0
            ),
        ));
    }
    rows
}
