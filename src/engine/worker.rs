//! The engine thread: owns the model, the KV cache (inside a session), the tokenizer side of the
//! chat format, the sampler and the thread pool, and turns [`Command`]s into [`Event`]s.
//!
//! Prefix reuse: the session remembers the ids its KV cache holds. A request keeps the longest
//! common prefix of those ids and the new prompt, drops the rest and prefills only the new tail,
//! so regenerate and edit-and-resend rewind to the edit point for free.
//!
//! A turn is [`generate`](super::generate::generate), the loop `ossterm run` uses too; the worker
//! adds what the app needs around it: the cancel mark, streaming events, live stats. It talks to
//! the model and the chat format through small traits so that it can be tested with a toy model
//! and so that the forward pass knows nothing about threads or UIs.

use crate::chat::{HarmonyParser, ParseEvent};
use crate::engine::generate::{
    generate, resume_from_tiers, GenerateError, GenerateEvent, GenerateLimits, GenerateResult,
    InferenceSession, ReplyParser, TokenSampler,
};
use crate::engine::kv_tiers::{self, conversation_label, KvTiers, TierConfig};
use crate::engine::protocol::{
    ActivationFormat, AttentionArithmetic, CacheHits, Channel, Command, Conversation, EngineInfo,
    Event, GenerateRequest, KvCacheType, ProfileSample, RequestId, Settings, StatsSample,
    Unembedding, WeightFormat,
};
use crate::model::profile::{ProfileCounts, SharedProfile};
use rayon::ThreadPool;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Boxed error of a model or chat component the worker drives.
pub type ComponentError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("model: {0}")]
    Model(ComponentError),
    #[error("chat format: {0}")]
    Chat(ComponentError),
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error("cannot build a thread pool of {threads} threads: {source}")]
    ThreadPool {
        threads: usize,
        source: rayon::ThreadPoolBuildError,
    },
    #[error("the engine thread has stopped")]
    Stopped,
}

/// The weight format and the unembedding a model is built with: what a re-quantization changes.
pub type WeightChoice = (WeightFormat, Unembedding);

/// The loaded weights: makes sessions and, for a weight-format change, a re-quantized copy.
pub trait ModelBackend: Send + Sync + 'static {
    type Session: InferenceSession + Send;

    /// A session computing on `pool`.
    fn new_session(
        model: &Arc<Self>,
        pool: &Arc<ThreadPool>,
        context_limit: usize,
        kv_cache: KvCacheType,
        activations: ActivationFormat,
    ) -> Result<Self::Session, EngineError>;

    /// Moves `session`'s computation to `pool` (a new thread count), keeping its cache.
    fn set_session_pool(session: &mut Self::Session, pool: &Arc<ThreadPool>);

    /// Builds the same model with attention/unembedding weights in `weights.0` and the
    /// unembedding `weights.1`. Runs on a background thread while this one keeps serving;
    /// `progress(done, total)` reports how far it got.
    fn requantized(
        &self,
        weights: WeightChoice,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, EngineError>
    where
        Self: Sized;

    fn weight_format(&self) -> WeightFormat;

    /// The unembedding the model was built with (as asked: a model that cannot hold a draft
    /// computes every row).
    fn unembedding(&self) -> Unembedding;

    /// What a re-quantization builds: the weight format and the unembedding.
    fn weight_choice(&self) -> WeightChoice {
        (self.weight_format(), self.unembedding())
    }

    /// The activation format the loader built the model with: the first session's.
    fn activations(&self) -> ActivationFormat;

    /// The attention arithmetic the loader built the model with: the first session's.
    fn attention(&self) -> AttentionArithmetic;

    /// The KV cache element type a session asked for `requested` really holds (a path that
    /// supports one type only answers that one, and the settings then show it).
    fn effective_kv_cache(&self, requested: KvCacheType) -> KvCacheType;

    /// The SIMD path the kernels picked ("avx512", "avx2" or "scalar"), with "+bf16" ("+int8")
    /// where a session of this attention arithmetic, activations and cache runs attention on
    /// bf16 (int8) dot products.
    fn kernel_path(
        &self,
        attention: AttentionArithmetic,
        activations: ActivationFormat,
        kv_cache: KvCacheType,
    ) -> String;
}

/// Harmony rendering and parsing (implemented over `chat`).
pub trait ChatCodec: Send + 'static {
    type Parser: ReplyParser;

    /// Renders `conversation` followed by `<|start|>assistant`. Reasoning (analysis messages) of
    /// completed turns is dropped unless `keep_reasoning`.
    fn render_prompt(
        &self,
        conversation: &Conversation,
        keep_reasoning: bool,
    ) -> Result<Vec<u32>, EngineError>;

    fn parser(&self) -> Self::Parser;
}

/// What the load closure hands to the engine thread.
pub struct EngineParts<M, C, S> {
    pub model: Arc<M>,
    pub codec: C,
    pub sampler: S,
    pub model_label: String,
    pub random_weights: bool,
    /// Budgets and directory of the KV snapshot tiers.
    pub kv_tiers: TierConfig,
}

/// How often a stats sample goes out while the engine works.
const STATS_INTERVAL: Duration = Duration::from_millis(250);

/// How long the idle loop waits for a command before it looks for a finished re-quantization.
const IDLE_POLL: Duration = Duration::from_millis(50);

/// The UI's side of the engine thread.
pub struct EngineHandle {
    commands: Sender<Command>,
    /// Every request with an id at or below this mark is cancelled. A mark rather than a flag so a
    /// cancel that races with the start of a request can never be lost or hit a later one.
    cancel_mark: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl EngineHandle {
    /// Starts the engine thread. `load` runs on it (so the UI shows progress while weights load)
    /// and reports `(stage, done, total)`.
    pub fn spawn<M, C, S, L>(settings: Settings, events: Sender<Event>, load: L) -> EngineHandle
    where
        M: ModelBackend,
        C: ChatCodec,
        S: TokenSampler + Send + 'static,
        L: FnOnce(
                &Settings,
                &mut dyn FnMut(&str, u64, u64),
            ) -> Result<EngineParts<M, C, S>, EngineError>
            + Send
            + 'static,
    {
        let (commands, command_receiver) = mpsc::channel();
        let cancel_mark = Arc::new(AtomicU64::new(0));
        let worker_mark = Arc::clone(&cancel_mark);
        let thread = std::thread::Builder::new()
            .name("ossterm-engine".to_string())
            .spawn(move || {
                let mut report = |stage: &str, done: u64, total: u64| {
                    let _ = events.send(Event::LoadProgress {
                        stage: stage.to_string(),
                        done,
                        total,
                    });
                };
                let fail = |error: EngineError| {
                    let _ = events.send(Event::Error {
                        id: None,
                        message: error.to_string(),
                    });
                };
                // The session's pool exists first: loading and converting the weights run on it
                // rather than on rayon's global pool, so no second set of threads competes.
                let pool = match build_pool(settings.threads) {
                    Ok(pool) => pool,
                    Err(error) => return fail(error),
                };
                let parts = match pool.install(|| load(&settings, &mut report)) {
                    Ok(parts) => parts,
                    Err(error) => return fail(error),
                };
                match Worker::new(parts, settings, pool, events.clone(), worker_mark) {
                    Ok(worker) => worker.run(command_receiver),
                    Err(error) => {
                        let _ = events.send(Event::Error {
                            id: None,
                            message: error.to_string(),
                        });
                    }
                }
            })
            .ok();
        EngineHandle {
            commands,
            cancel_mark,
            thread,
        }
    }

    /// Starts an engine thread that runs `serve` instead of the local model worker: another
    /// backend behind the same protocol (the remote engine). `serve` gets the commands and the
    /// cancel mark, which [`EngineHandle::send`] raises for a `Cancel` before the command arrives.
    pub fn spawn_backend<F>(name: &str, serve: F) -> EngineHandle
    where
        F: FnOnce(Receiver<Command>, Arc<AtomicU64>) + Send + 'static,
    {
        let (commands, command_receiver) = mpsc::channel();
        let cancel_mark = Arc::new(AtomicU64::new(0));
        let worker_mark = Arc::clone(&cancel_mark);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || serve(command_receiver, worker_mark))
            .ok();
        EngineHandle {
            commands,
            cancel_mark,
            thread,
        }
    }

    pub fn send(&self, command: Command) -> Result<(), EngineError> {
        if let Command::Cancel(id) = command {
            self.cancel_mark.fetch_max(id, Ordering::SeqCst);
        }
        self.commands
            .send(command)
            .map_err(|_| EngineError::Stopped)
    }

    /// Stops request `id` within one token or one prefill chunk.
    pub fn cancel(&self, id: RequestId) {
        let _ = self.send(Command::Cancel(id));
    }

    /// Asks the engine to stop and waits for it (a running turn is cancelled first).
    pub fn shutdown(mut self) {
        self.stop_thread();
    }

    fn stop_thread(&mut self) {
        self.cancel_mark.store(u64::MAX, Ordering::SeqCst);
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// Timings of the turn in progress, for stats samples.
#[derive(Default)]
struct TurnTimings {
    prefill_tokens: usize,
    prefill_time: Duration,
    decoded_tokens: usize,
    decode_time: Duration,
    time_to_first_token: Option<Duration>,
    hits: CacheHits,
    context_used: usize,
}

impl TurnTimings {
    /// `done` prompt tokens are in the cache, `elapsed` since the turn started.
    fn prefilled(&mut self, done: usize, reused: usize, elapsed: Duration) {
        self.prefill_tokens = done - reused;
        self.prefill_time = elapsed;
        self.context_used = done;
    }

    /// A token was sampled, `elapsed` since the turn started. Every token after the first one
    /// follows a decode step, which put the token before it into the cache.
    fn sampled(&mut self, elapsed: Duration) {
        match self.time_to_first_token {
            None => self.time_to_first_token = Some(elapsed),
            Some(first) => {
                self.decoded_tokens += 1;
                self.decode_time = elapsed - first;
                self.context_used += 1;
            }
        }
    }

    /// Writes this turn's figures and the memory in use into `sample`.
    fn fill(&self, sample: &mut StatsSample) {
        let rate = |tokens: usize, time: Duration| {
            (tokens > 0 && time > Duration::ZERO).then(|| tokens as f64 / time.as_secs_f64())
        };
        let memory = read_memory_usage();
        sample.decode_tokens_per_second = rate(self.decoded_tokens, self.decode_time);
        sample.prefill_tokens_per_second = rate(self.prefill_tokens, self.prefill_time);
        sample.time_to_first_token = self.time_to_first_token;
        sample.process_memory_bytes = memory.process_bytes;
        sample.machine_memory_bytes = memory.machine_bytes;
        sample.context_used = self.context_used.max(sample.kv_tokens_used);
        sample.turn_hits = self.hits;
    }
}

/// Bytes the bandwidth probe of [`Command::MeasureBandwidth`] streams: far beyond any cache, yet
/// small beside the model.
const BANDWIDTH_PROBE_BYTES: usize = 256 << 20;

/// Turns what the passes recorded into [`ProfileSample`]s: drains the session's shared counts,
/// keeps the turn's routing for its distinct-expert counts and times the decode steps as the
/// engine sees them go by. Its buffers are sized once per turn.
#[derive(Default)]
struct ProfileReporter {
    shared: Option<SharedProfile>,
    taken: ProfileCounts,
    turn_routing: Vec<u32>,
    experts_per_token: usize,
    /// Bytes per decoded token at the prompt's length, and what each further token adds.
    bytes_at_prompt: Option<u64>,
    bytes_per_position: u64,
    prompt_len: usize,
    last_token: Option<Instant>,
    wall_steps: u64,
    decode_wall: Duration,
}

impl ProfileReporter {
    /// Starts a turn whose prompt is `prompt_len` tokens.
    fn start_turn<T: InferenceSession>(&mut self, session: &T, prompt_len: usize) {
        self.shared = session.profile();
        if let Some(shared) = &self.shared {
            // What earlier turns left (and settings changes in between) is not this turn's.
            if let Ok(mut counts) = shared.lock() {
                counts.take_into(&mut self.taken);
            }
        }
        self.turn_routing.clear();
        self.turn_routing.resize(self.taken.routing.len(), 0);
        self.experts_per_token = session.experts_per_token();
        self.prompt_len = prompt_len;
        self.bytes_at_prompt = session.decode_bytes_per_token(prompt_len);
        // Linear in the context while no sliding window fills up: exact enough for a gauge.
        self.bytes_per_position = session
            .decode_bytes_per_token(prompt_len + 1)
            .zip(self.bytes_at_prompt)
            .map_or(0, |(next, at)| next.saturating_sub(at));
        self.last_token = None;
        self.wall_steps = 0;
        self.decode_wall = Duration::ZERO;
    }

    /// A token was sampled; every one after the turn's first ends a decode step.
    fn token(&mut self, now: Instant) {
        if let Some(previous) = self.last_token {
            self.wall_steps += 1;
            self.decode_wall += now.saturating_duration_since(previous);
        }
        self.last_token = Some(now);
    }

    /// What happened since the previous sample, with `context` tokens in the cache.
    fn sample(&mut self, context: usize) -> Option<ProfileSample> {
        let shared = self.shared.as_ref()?;
        shared.lock().ok()?.take_into(&mut self.taken);
        let taken = &self.taken;
        if self.turn_routing.len() != taken.routing.len() {
            self.turn_routing.clear();
            self.turn_routing.resize(taken.routing.len(), 0);
        }
        for (turn, &recent) in self.turn_routing.iter_mut().zip(&taken.routing) {
            *turn += recent;
        }
        let experts = taken.experts.max(1);
        let turn_distinct = self
            .turn_routing
            .chunks(experts)
            .map(|layer| layer.iter().filter(|&&count| count > 0).count() as u16)
            .collect();
        let extra = context.saturating_sub(self.prompt_len) as u64;
        let sample = ProfileSample {
            layers: taken.layers,
            experts: taken.experts,
            experts_per_token: self.experts_per_token,
            routing: taken.routing.clone(),
            routed_tokens: taken.tokens,
            turn_distinct,
            decode_steps: taken.steps,
            phase_nanos: taken.nanos,
            wall_steps: self.wall_steps,
            decode_wall: self.decode_wall,
            bytes_per_token: self
                .bytes_at_prompt
                .map(|bytes| bytes + extra * self.bytes_per_position),
        };
        self.wall_steps = 0;
        self.decode_wall = Duration::ZERO;
        Some(sample)
    }
}

/// The engine thread's state. Generic over the model and chat pieces; see [`EngineHandle::spawn`].
pub struct Worker<M: ModelBackend, C, S> {
    model: Arc<M>,
    session: M::Session,
    codec: C,
    sampler: S,
    settings: Settings,
    /// The pool the session computes on.
    pool: Arc<ThreadPool>,
    events: Sender<Event>,
    cancel_mark: Arc<AtomicU64>,
    session_hits: CacheHits,
    timings: TurnTimings,
    last_stats: Instant,
    /// A re-quantized model being built in the background, with the format it will have.
    pending_model: Option<(WeightChoice, Receiver<Result<M, EngineError>>)>,
    /// Snapshots of earlier prefixes, in RAM and on disk.
    tiers: KvTiers,
    profile: ProfileReporter,
}

impl<M: ModelBackend, C: ChatCodec, S: TokenSampler + Send> Worker<M, C, S> {
    /// The worker over `parts`, computing on `pool` (built for `settings.threads`).
    pub fn new(
        parts: EngineParts<M, C, S>,
        settings: Settings,
        pool: Arc<ThreadPool>,
        events: Sender<Event>,
        cancel_mark: Arc<AtomicU64>,
    ) -> Result<Self, EngineError> {
        let EngineParts {
            model,
            codec,
            sampler,
            model_label,
            random_weights,
            kv_tiers,
        } = parts;
        let mut session = M::new_session(
            &model,
            &pool,
            settings.context_limit,
            settings.kv_cache,
            model.activations(),
        )?;
        session.set_attention(model.attention());
        let mut effective = settings;
        // The loader chose the formats; what it built is what the settings show from now on.
        effective.weight_format = model.weight_format();
        effective.unembedding = model.unembedding();
        effective.activations = model.activations();
        effective.attention = model.attention();
        effective.kv_cache = model.effective_kv_cache(effective.kv_cache);
        let _ = events.send(Event::Ready(EngineInfo {
            model_label,
            random_weights,
            kernel_path: model.kernel_path(
                effective.attention,
                effective.activations,
                effective.kv_cache,
            ),
            settings: effective.clone(),
        }));
        let mut worker = Worker {
            model,
            session,
            codec,
            sampler,
            settings: effective,
            pool,
            events,
            cancel_mark,
            session_hits: CacheHits::default(),
            timings: TurnTimings::default(),
            last_stats: Instant::now(),
            pending_model: None,
            tiers: KvTiers::new(kv_tiers),
            profile: ProfileReporter::default(),
        };
        worker.send_notices();
        worker.send_stats();
        Ok(worker)
    }

    /// Serves commands until `Shutdown` or until the UI hangs up.
    pub fn run(mut self, commands: Receiver<Command>) {
        loop {
            match commands.recv_timeout(IDLE_POLL) {
                Ok(Command::Generate(request)) => {
                    self.install_requantized_model();
                    self.run_turn(*request);
                }
                // A cancel with nothing running has already raised the mark; queued requests check it.
                Ok(Command::Cancel(_)) => {}
                Ok(Command::ApplySettings(settings)) => {
                    self.apply_settings(*settings);
                    self.report_settings();
                }
                Ok(Command::MeasureBandwidth) => {
                    let threads = self.pool.current_num_threads();
                    let gigabytes_per_second = crate::bench::probe::read_bandwidth_gbps_over(
                        BANDWIDTH_PROBE_BYTES,
                        threads,
                    );
                    let _ = self.events.send(Event::Bandwidth {
                        gigabytes_per_second,
                        threads,
                    });
                }
                Ok(Command::Resume(conversation)) => {
                    self.install_requantized_model();
                    self.resume(&conversation);
                }
                Err(RecvTimeoutError::Timeout) => self.install_requantized_model(),
                Ok(Command::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn run_turn(&mut self, request: GenerateRequest) {
        let id = request.id;
        self.timings = TurnTimings::default();
        // The whole turn runs on the session's pool, so each forward call finds itself there
        // instead of handing its work over from this thread.
        let pool = Arc::clone(&self.pool);
        self.tiers.set_busy(true);
        let outcome = pool.install(|| self.generate(&request));
        self.tiers.set_busy(false);
        match outcome {
            Ok(result) => {
                self.send_stats();
                self.send_profile();
                let _ = self.events.send(Event::TurnDone {
                    id,
                    reason: result.stop_reason.into(),
                    hits: self.timings.hits,
                    generated_tokens: result.generated_tokens,
                });
                // After TurnDone, so the copy never delays the reply; the disk write runs on the
                // tiers' own thread.
                let floor = self.resume_floor(&request.conversation);
                let session = &mut self.session;
                // On the pool: the copy spreads over its threads.
                if let Ok(snapshot) = pool.install(move || session.snapshot_restorable_from(floor))
                {
                    self.tiers
                        .store(snapshot, &conversation_label(&request.conversation));
                }
                self.send_notices();
                self.send_stats();
            }
            Err(error) => {
                // A failed forward pass may leave the cache half-written: forget it.
                self.session.truncate(0);
                self.send_stats();
                let _ = self.events.send(Event::Error {
                    id: Some(id),
                    message: error.to_string(),
                });
            }
        }
    }

    /// Restores the longest snapshot of an opened chat into the live cache (unless the cache
    /// already holds more of it), telling the UI what was resumed.
    fn resume(&mut self, conversation: &Conversation) {
        match self
            .codec
            .render_prompt(conversation, self.settings.keep_reasoning_in_context)
        {
            Ok(prompt) => {
                let pool = Arc::clone(&self.pool);
                let (session, tiers) = (&mut self.session, &mut self.tiers);
                if let Some(resumed) = pool.install(|| resume_from_tiers(session, tiers, &prompt)) {
                    let mut message = resumed.describe();
                    message[..1].make_ascii_uppercase();
                    let _ = self.events.send(Event::Notice(message));
                }
            }
            Err(error) => {
                let _ = self.events.send(Event::Notice(format!(
                    "cannot resume the opened chat: {error}"
                )));
            }
        }
        self.send_notices();
        self.send_stats();
    }

    /// Where the snapshot of `conversation`'s turn must be restorable from
    /// ([`crate::engine::kv_tiers::resume_floor`]).
    fn resume_floor(&self, conversation: &Conversation) -> usize {
        let mut earlier = conversation.clone();
        earlier.messages.pop();
        self.codec
            .render_prompt(&earlier, self.settings.keep_reasoning_in_context)
            .map(|ids| kv_tiers::resume_floor(self.session.tokens(), &ids))
            .unwrap_or(0)
    }

    /// Runs one turn through the generation loop, streaming its text, prefill progress and
    /// (every [`STATS_INTERVAL`]) stats samples to the UI.
    fn generate(&mut self, request: &GenerateRequest) -> Result<GenerateResult, EngineError> {
        let id = request.id;
        let started = Instant::now();
        let prompt = self.codec.render_prompt(
            &request.conversation,
            self.settings.keep_reasoning_in_context,
        )?;
        if let Some(resumed) = resume_from_tiers(&mut self.session, &mut self.tiers, &prompt) {
            let mut message = resumed.describe();
            message[..1].make_ascii_uppercase();
            let _ = self.events.send(Event::Notice(message));
        }
        self.send_notices();
        self.profile.start_turn(&self.session, prompt.len());
        let mut parser = self.codec.parser();
        // What stays fixed through the turn; the callback refreshes the rest.
        let mut sample = self.stats_sample();
        let limits = GenerateLimits {
            max_tokens: Some(self.settings.sampling.max_tokens),
        };
        let cancel_mark = &self.cancel_mark;
        let (events, timings) = (&self.events, &mut self.timings);
        let (session_hits, last_stats) = (&mut self.session_hits, &mut self.last_stats);
        let profile = &mut self.profile;
        let result = generate(
            &mut self.session,
            &mut parser,
            &prompt,
            &mut self.sampler,
            limits,
            || cancel_mark.load(Ordering::SeqCst) >= id,
            |event| {
                match event {
                    GenerateEvent::PrefillProgress {
                        done,
                        total,
                        reused,
                    } => {
                        // The first report comes right after the rewind, before any prefill step.
                        if done == reused {
                            timings.hits = CacheHits {
                                reused: reused as u64,
                                prompt: total as u64,
                            };
                            session_hits.add(timings.hits);
                        }
                        timings.prefilled(done, reused, started.elapsed());
                        let _ = events.send(Event::PrefillProgress {
                            id,
                            done: done - reused,
                            total: total - reused,
                            reused,
                        });
                    }
                    GenerateEvent::Token { .. } => {
                        let now = Instant::now();
                        timings.sampled(now - started);
                        profile.token(now);
                    }
                    GenerateEvent::Parsed(ParseEvent::Text { channel, text }) => {
                        // Text outside a known channel is shown as answer text.
                        let channel = channel.unwrap_or(Channel::Final);
                        let text = text.to_string();
                        let _ = events.send(Event::Token { id, channel, text });
                    }
                    GenerateEvent::Parsed(_) => {}
                }
                if last_stats.elapsed() >= STATS_INTERVAL {
                    *last_stats = Instant::now();
                    sample.kv_tokens_used = timings.context_used;
                    sample.session_hits = *session_hits;
                    timings.fill(&mut sample);
                    let _ = events.send(Event::Stats(sample.clone()));
                    if let Some(profile) = profile.sample(timings.context_used) {
                        let _ = events.send(Event::Profile(Box::new(profile)));
                    }
                }
            },
        )?;
        Ok(result)
    }

    fn apply_settings(&mut self, next: Settings) {
        let previous = self.settings.clone();
        let mut failure = None;
        if next.threads != previous.threads {
            match build_pool(next.threads) {
                Ok(pool) => {
                    M::set_session_pool(&mut self.session, &pool);
                    self.pool = pool;
                }
                Err(error) => failure = Some(error),
            }
        }
        if next.context_limit != previous.context_limit || next.kv_cache != previous.kv_cache {
            match M::new_session(
                &self.model,
                &self.pool,
                next.context_limit,
                next.kv_cache,
                next.activations,
            ) {
                Ok(session) => self.session = session,
                Err(error) => failure = Some(error),
            }
        }
        // The weights do not depend on the activation format or the attention arithmetic, so
        // the session switches at once, even while a conversion thread reads the model; the new
        // weights get the choices in force.
        self.session.set_activations(next.activations);
        self.session.set_attention(next.attention);
        if next.sampling != previous.sampling {
            // Values were validated with the config; an invalid set keeps the previous sampler.
            if let Err(error) = self.sampler.configure(next.sampling.sampler()) {
                let message = format!("sampling settings refused: {error}");
                let _ = self.events.send(Event::Error { id: None, message });
            }
        }
        let wants = (next.weight_format, next.unembedding);
        let pending = self.pending_model.as_ref().map(|(choice, _)| *choice);
        if wants == self.model.weight_choice() {
            // Back to the serving weights: a conversion still running is no longer wanted (its
            // thread finishes and its result is dropped with the receiver).
            self.pending_model = None;
        } else if pending != Some(wants) {
            self.start_requantization(wants);
        }
        let mut applied = next;
        if let Some(error) = failure {
            let _ = self.events.send(Event::Error {
                id: None,
                message: error.to_string(),
            });
            applied.threads = previous.threads;
            applied.context_limit = self.session.context_limit();
            applied.kv_cache = previous.kv_cache;
        }
        applied.kv_cache = self.model.effective_kv_cache(applied.kv_cache);
        self.settings = applied;
    }

    /// Tells the UI the settings in force. The formats shown are the serving ones: a new weight
    /// format shows once its weights are installed.
    fn report_settings(&mut self) {
        self.settings.weight_format = self.model.weight_format();
        self.settings.unembedding = self.model.unembedding();
        self.settings.activations = self.session.activations();
        self.settings.attention = self.session.attention();
        let _ = self
            .events
            .send(Event::SettingsApplied(Box::new(self.settings.clone())));
        self.send_stats();
    }

    fn start_requantization(&mut self, choice: WeightChoice) {
        let (format, unembedding) = choice;
        let (sender, receiver) = mpsc::channel();
        let model = Arc::clone(&self.model);
        let events = self.events.clone();
        // Its own thread, and not the session's pool: the old weights keep serving meanwhile, and
        // a conversion installed on the session's pool would hold its workers, so a turn would
        // wait behind it (with one thread, for all of it).
        let spawned = std::thread::Builder::new()
            .name("ossterm-requantize".to_string())
            .spawn(move || {
                let what = if format == model.weight_format() {
                    format!("rebuilding weights for a {unembedding} unembedding")
                } else {
                    format!("re-quantizing weights to {format}")
                };
                let mut progress = |done: u64, total: u64| {
                    let _ = events.send(Event::SettingsProgress {
                        what: what.clone(),
                        done,
                        total,
                    });
                };
                let _ = sender.send(model.requantized(choice, &mut progress));
            });
        match spawned {
            Ok(_) => self.pending_model = Some((choice, receiver)),
            Err(error) => {
                let message = format!("cannot start re-quantization to {format}: {error}");
                let _ = self.events.send(Event::Error { id: None, message });
            }
        }
    }

    /// Swaps in a finished re-quantized model (between turns only: the caller never runs mid-turn).
    fn install_requantized_model(&mut self) {
        let Some(((format, _), receiver)) = &self.pending_model else {
            return;
        };
        let format = *format;
        let result = match receiver.try_recv() {
            Ok(result) => result,
            Err(mpsc::TryRecvError::Empty) => return,
            Err(mpsc::TryRecvError::Disconnected) => Err(EngineError::Model(
                format!("the re-quantization thread for {format} ended without a result").into(),
            )),
        };
        self.pending_model = None;
        let installed = result.and_then(|model| {
            let model = Arc::new(model);
            let mut session = M::new_session(
                &model,
                &self.pool,
                self.settings.context_limit,
                self.settings.kv_cache,
                self.session.activations(),
            )?;
            session.set_attention(self.session.attention());
            Ok((model, session))
        });
        match installed {
            Ok((model, session)) => {
                self.model = model;
                self.session = session;
                self.report_settings();
            }
            Err(error) => {
                let _ = self.events.send(Event::Error {
                    id: None,
                    message: error.to_string(),
                });
            }
        }
    }

    /// The passes' figures since the last sample (the turn's last ones after it ended).
    fn send_profile(&mut self) {
        if let Some(profile) = self.profile.sample(self.session.tokens().len()) {
            let _ = self.events.send(Event::Profile(Box::new(profile)));
        }
    }

    /// Passes the tiers' notices (skipped snapshot files, failed writes) to the status line.
    fn send_notices(&mut self) {
        for message in self.tiers.take_notices() {
            let _ = self.events.send(Event::Notice(message));
        }
    }

    fn send_stats(&mut self) {
        self.tiers.poll();
        self.last_stats = Instant::now();
        let _ = self.events.send(Event::Stats(self.stats_sample()));
    }

    /// The current numbers (also what a stats event carries).
    pub fn stats_sample(&self) -> StatsSample {
        let mut sample = StatsSample {
            decode_tokens_per_second: None,
            prefill_tokens_per_second: None,
            time_to_first_token: None,
            process_memory_bytes: None,
            machine_memory_bytes: None,
            kv_tokens_used: self.session.tokens().len(),
            kv_tokens_capacity: self.session.context_limit(),
            kv_cache: self.settings.kv_cache,
            context_used: 0,
            context_limit: self.settings.context_limit,
            turn_hits: CacheHits::default(),
            session_hits: self.session_hits,
            threads: self.pool.current_num_threads(),
            kernel_path: self.model.kernel_path(
                self.session.attention(),
                self.session.activations(),
                self.settings.kv_cache,
            ),
            weight_format: self.model.weight_format(),
            unembedding: self.model.unembedding(),
            activations: self.session.activations(),
            kv_tiers: self.tiers.usage(),
        };
        self.timings.fill(&mut sample);
        sample
    }
}

fn build_pool(threads: usize) -> Result<Arc<ThreadPool>, EngineError> {
    super::build_pool(threads).map_err(|source| EngineError::ThreadPool { threads, source })
}

/// Resident memory of this process and total memory of the machine, where the OS tells.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub process_bytes: Option<u64>,
    pub machine_bytes: Option<u64>,
    /// Memory the kernel could hand out now without swapping (`MemAvailable`).
    pub available_bytes: Option<u64>,
}

/// Reads `/proc` on Linux; other systems report nothing rather than a guess.
pub fn read_memory_usage() -> MemoryUsage {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    MemoryUsage {
        process_bytes: kib_field_bytes(&status, "VmRSS:"),
        machine_bytes: kib_field_bytes(&meminfo, "MemTotal:"),
        available_bytes: kib_field_bytes(&meminfo, "MemAvailable:"),
    }
}

/// A `Name:   1234 kB` field of a `/proc` text, in bytes.
pub fn kib_field_bytes(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024)
}

/// Memory available now, if known.
pub fn available_memory_bytes() -> Option<u64> {
    read_memory_usage().available_bytes
}

impl ModelBackend for crate::model::Model {
    type Session = crate::model::Session;

    fn new_session(
        model: &Arc<Self>,
        pool: &Arc<ThreadPool>,
        context_limit: usize,
        kv_cache: KvCacheType,
        activations: ActivationFormat,
    ) -> Result<Self::Session, EngineError> {
        let mut session = model.new_session_with_kv(pool, context_limit, kv_cache);
        session.set_activations(activations);
        Ok(session)
    }

    fn set_session_pool(session: &mut Self::Session, pool: &Arc<ThreadPool>) {
        session.set_pool(Arc::clone(pool));
    }

    fn requantized(
        &self,
        (format, unembedding): WeightChoice,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self, EngineError> {
        let options = crate::model::LoadOptions {
            weights: format,
            unembedding,
            ..self.options()
        };
        self.reconfigured(&options, &mut |done, total| {
            progress(done as u64, total as u64)
        })
        .map_err(|error| EngineError::Model(Box::new(error)))
    }

    fn weight_format(&self) -> WeightFormat {
        self.options().weights
    }

    fn unembedding(&self) -> Unembedding {
        self.unembedding
    }

    fn activations(&self) -> ActivationFormat {
        self.activations
    }

    fn attention(&self) -> AttentionArithmetic {
        crate::model::Model::attention(self)
    }

    fn effective_kv_cache(&self, requested: KvCacheType) -> KvCacheType {
        // The exact reference path always keeps an f32 cache.
        match self.precision {
            crate::model::Precision::Exact => KvCacheType::F32,
            crate::model::Precision::Fast => requested,
        }
    }

    fn kernel_path(
        &self,
        attention: AttentionArithmetic,
        activations: ActivationFormat,
        kv_cache: KvCacheType,
    ) -> String {
        if self.precision == crate::model::Precision::Exact {
            return "portable".to_string();
        }
        let path = self.kernels.path().gauge_name();
        match self
            .attention_products_with(attention, activations, kv_cache)
            .name()
        {
            Some(products) => format!("{path}+{products}"),
            None => path.to_string(),
        }
    }
}

/// Harmony over the o200k_harmony tokenizer (`chat` module).
pub struct HarmonyCodec {
    tokenizer: &'static crate::chat::Tokenizer,
}

impl HarmonyCodec {
    pub fn new() -> Result<HarmonyCodec, EngineError> {
        let tokenizer =
            crate::chat::Tokenizer::shared().map_err(|error| EngineError::Chat(Box::new(error)))?;
        Ok(HarmonyCodec { tokenizer })
    }
}

impl ChatCodec for HarmonyCodec {
    type Parser = HarmonyParser<'static>;

    fn render_prompt(
        &self,
        conversation: &Conversation,
        keep_reasoning: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let options = crate::chat::RenderOptions { keep_reasoning };
        crate::chat::render_for_completion(self.tokenizer, conversation, &options)
            .map_err(|error| EngineError::Chat(Box::new(error)))
    }

    fn parser(&self) -> HarmonyParser<'static> {
        HarmonyParser::after_prompt(self.tokenizer, "assistant")
    }
}
