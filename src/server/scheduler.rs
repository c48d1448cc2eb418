//! Continuous batching on the CPU: one thread owns the model session and up to `parallel`
//! sequence slots, and every step runs ONE forward pass for all of them.
//!
//! A step's rows are the last sampled token of every decoding sequence plus, when a request is
//! being admitted, a chunk of its prompt (at most `prefill_chunk` tokens while others decode, so
//! running streams wait at most one such step: the stall is measured and reported in /metrics).
//! On a CPU decode reads every weight once per step whatever the batch, so n sequences decoded
//! together cost little more than one. A sequence that finishes, or whose client went away (its
//! event channel is closed), leaves the batch before the next step.
//!
//! KV memory: each slot preallocates room for `context` tokens, so the budget is
//! parallel x context, fixed at start and never fragmented. Paged blocks would let one long
//! request borrow another's room, but attention reads each KV head's rows as one contiguous
//! stream (the head-major layout the kernels are tuned for), which blocks would break; the
//! pages of a slot's allocation are only touched as far as its sequences reach. A request waits
//! in a bounded queue until a slot is free.
//!
//! Prefix reuse: a finished sequence stays in its slot. A new request takes the free slot whose
//! tokens share the longest prefix with its prompt, and if another slot (running or not) shares
//! a longer one (the same system and developer messages, an earlier turn of the same chat), the
//! keys and values of that prefix are copied over instead of computed again. A prompt scored at
//! every position (`echo` with `logprobs`) needs the scores of what it reuses: each slot keeps
//! those its last scored prompt computed, and such a prompt reuses only its own slot's scored
//! prefix.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tokio::sync::mpsc::UnboundedSender;

use super::api::{LogitAdjustments, TextMode};
use super::metrics::Metrics;
use super::reply::{token_logprobs, PromptLogprobs, ReplyDelta, ReplyText};
use super::structured::OutputConstraint;
use crate::chat::{HarmonyParser, ParseEvent, Tokenizer, Utf8Stream};
use crate::engine::generate::common_prefix_len;
use crate::engine::{Sampler, SamplerSettings};
use crate::model::{AllLogits, Sequence, SequenceStep, Session};

/// Fewest prefix tokens worth copying from another slot instead of prefilling them.
const MIN_PREFIX_COPY: usize = 16;

/// One completion request, rendered and checked.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampler: SamplerSettings,
    /// Most tokens to sample (already within the context).
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// Messages to `functions.NAME` are tool calls.
    pub tools: bool,
    /// The prompt's last tokens that open a forced call (see `ChatJob::forced`).
    pub forced: Vec<u32>,
    /// `Some(top)`: each answer token's log-probability and the `top` likeliest.
    pub logprobs: Option<usize>,
    /// `Some(top)`: every prompt token's log-probability given those before it and the `top`
    /// likeliest there, sent in the reply's first delta. Such a prompt reuses a cached prefix
    /// only with the scores a scored prompt left for it ([`CachedScores`]).
    pub prompt_logprobs: Option<usize>,
    /// Logit bias and repetition penalties, applied to the row before each sampling.
    pub adjustments: LogitAdjustments,
    /// Harmony messages, or plain text (`/v1/completions`).
    pub text: TextMode,
    /// The structured output the answer (a harmony reply's final message, or the whole plain
    /// text) is held to.
    pub constraint: Option<OutputConstraint>,
    /// The arguments of calls of these (`strict`) functions are held to their schemas.
    pub tool_constraints: Vec<(String, OutputConstraint)>,
    /// A reply that must call a function (`tool_choice: "required"`): held from its first token
    /// to a defined name and its arguments, ending in `<|call|>`.
    pub call: Option<OutputConstraint>,
    /// Which of the request's choices (`n`) this is: its events go out tagged with it.
    pub choice: usize,
    pub events: UnboundedSender<(usize, Event)>,
    pub received: Instant,
}

impl Job {
    /// Tells the request's handler, tagged with the choice (a handler that went away is not an
    /// error: the sequence is dropped at the next step).
    fn send(&self, event: Event) {
        let _ = self.events.send((self.choice, event));
    }
}

/// What a request's handler hears.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New text and tool-call pieces since the last delta.
    Delta(ReplyDelta),
    Done(Finish),
    /// The request could not be completed (the server is stopping, the forward pass failed).
    Failed(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The model called a function and waits for its answer (`<|call|>`).
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub usage: Usage,
    /// From the request's arrival to its first sampled token (queueing and prefill included).
    pub time_to_first_token: Duration,
    /// From the first sampled token to the last.
    pub decode_time: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubmitError {
    #[error("the server is busy: {0} requests are already waiting; retry later")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// Sizes of the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct SchedulerOptions {
    /// Sequences in flight at once (slots).
    pub parallel: usize,
    /// Tokens each slot holds (prompt and reply).
    pub context: usize,
    /// Requests that may wait for a slot; more are refused.
    pub queue: usize,
    /// Prompt tokens prefilled per step while other sequences decode.
    pub prefill_chunk: usize,
}

enum Command {
    /// Boxed: a job is a few hundred bytes (its sampler settings and constraints).
    Submit(Box<Job>),
    /// Finish what was accepted, cancelling whatever still runs at the deadline.
    Drain(Instant),
}

/// The HTTP side's handle on the scheduler thread.
pub struct Scheduler {
    commands: Sender<Command>,
    metrics: Arc<Metrics>,
    queue_limit: usize,
    shutting_down: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts the scheduler thread, which owns `session` (its model and pool).
    pub fn start(session: Session, options: SchedulerOptions, metrics: Arc<Metrics>) -> Scheduler {
        let (commands, receiver) = mpsc::channel();
        let shutting_down = Arc::new(AtomicBool::new(false));
        let options = SchedulerOptions {
            parallel: options.parallel.max(1),
            context: options.context.max(2),
            prefill_chunk: options.prefill_chunk.max(1),
            ..options
        };
        // Published before the thread starts, so the first /metrics already shows the budget.
        let bytes_per_token = crate::model::kv::KvShape::of(&session.model().config)
            .bytes_per_position(session.kv_format());
        let capacity = options.parallel.saturating_mul(options.context);
        metrics
            .kv_capacity_tokens
            .store(capacity, Ordering::Relaxed);
        metrics.kv_capacity_bytes.store(
            capacity.saturating_mul(bytes_per_token) as u64,
            Ordering::Relaxed,
        );
        let thread = {
            let metrics = metrics.clone();
            std::thread::Builder::new()
                .name("ossterm-scheduler".into())
                .spawn(move || Worker::new(session, options, metrics).run(receiver))
                .expect("the OS can start a thread")
        };
        Scheduler {
            commands,
            metrics,
            queue_limit: options.queue,
            shutting_down,
            thread: Mutex::new(Some(thread)),
        }
    }

    /// Queues a job; refused when the queue is full or the server stops.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        let waiting = &self.metrics.queue_depth;
        let depth = waiting.fetch_add(1, Ordering::AcqRel);
        if depth >= self.queue_limit {
            waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::QueueFull(depth));
        }
        self.commands
            .send(Command::Submit(Box::new(job)))
            .map_err(|_| {
                waiting.fetch_sub(1, Ordering::AcqRel);
                SubmitError::ShuttingDown
            })
    }

    /// Refuses new requests from now on; the thread finishes the running and waiting ones and
    /// stops, cancelling (their clients get an error event) those still running after `grace`.
    /// Returns at once; a later call with a shorter grace brings the deadline forward.
    pub fn drain(&self, grace: Duration) {
        self.shutting_down.store(true, Ordering::Release);
        // A grace past what an Instant can hold means "no deadline" in practice: a day.
        let now = Instant::now();
        let deadline = now
            .checked_add(grace)
            .unwrap_or_else(|| now + Duration::from_secs(86_400));
        let _ = self.commands.send(Command::Drain(deadline));
    }

    /// Cancels every running and waiting request (their clients get an error event) and waits
    /// for the thread to stop.
    pub fn shutdown(&self) {
        self.drain(Duration::ZERO);
        let thread = self.thread.lock().map(|mut t| t.take()).unwrap_or(None);
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request being served in a slot.
struct Active {
    job: Job,
    /// Prompt tokens in the slot's cache.
    prefilled: usize,
    reused: usize,
    /// The sampled token to feed in the next step.
    next: Option<u32>,
    generated: usize,
    sampler: Sampler,
    parser: HarmonyParser<'static>,
    /// A plain-text reply (`/v1/completions`) decodes token bytes itself instead of parsing
    /// harmony; `None` for a harmony reply.
    raw: Option<RawText>,
    reply: ReplyText,
    first_token_at: Option<Instant>,
    /// How often each token was sampled so far (kept only under a repetition penalty).
    sampled_counts: std::collections::HashMap<u32, u32>,
    /// A structured output's mask was applied to this step's row: the sampled token advances
    /// it.
    constrained: bool,
    /// The prompt's log-probabilities so far, when the job asked for them; sent with the
    /// reply's first delta.
    prompt_logprobs: Option<PromptLogprobs>,
}

impl Active {
    /// The structured output the next sampled token is held to, if any, and the token that ends
    /// it: a required call's (`<|call|>`) from the first token; the answer's (`<|return|>`) in a
    /// plain-text reply or a final message; a strict function's (`<|call|>`) in its call's
    /// arguments.
    fn next_constraint(&mut self) -> Option<(&mut OutputConstraint, u32)> {
        use crate::chat::tokenizer::special::{CALL, RETURN};
        if let Some(call) = self.job.call.as_mut() {
            return Some((call, CALL));
        }
        if self.raw.is_some() || self.reply.in_final_answer() {
            return self.job.constraint.as_mut().map(|c| (c, RETURN));
        }
        let name = self.reply.in_call_arguments()?;
        self.job
            .tool_constraints
            .iter_mut()
            .find(|(function, _)| function == name)
            .map(|(_, c)| (c, CALL))
    }
}

/// The decoding state of a plain-text reply.
struct RawText {
    bytes: Utf8Stream,
    skip_special_tokens: bool,
}

struct Slot {
    sequence: Sequence,
    active: Option<Active>,
    /// What a scored prompt left of the cached tokens' log-probabilities, for the next scored
    /// prompt sharing the prefix (an evaluation harness sends each question's context once per
    /// answer).
    scores: CachedScores,
}

/// Entry `i` scores token `i + 1` of what the slot last scored given the tokens before it, each
/// with `top` alternatives; a prompt sharing tokens `0..=i + 1` with the cache may take it.
#[derive(Default)]
struct CachedScores {
    entries: Vec<super::reply::LogprobEntry>,
    top: usize,
}

impl CachedScores {
    /// The sequence keeps its first `len` tokens and goes on with others: the entries of tokens
    /// past them go.
    fn truncate(&mut self, len: usize) {
        self.entries.truncate(len.saturating_sub(1));
    }

    /// How much of `prompt` a scoring job can take from this slot: `common` tokens of it are
    /// cached, but an entry is only reusable for a token the prompt shares too, and the entries
    /// must hold at least `top` alternatives.
    fn reusable(&self, common: usize, top: usize) -> usize {
        if top > self.top {
            return 0;
        }
        common.saturating_sub(1).min(self.entries.len())
    }
}

struct Worker {
    session: Session,
    slots: Vec<Slot>,
    waiting: VecDeque<Job>,
    options: SchedulerOptions,
    metrics: Arc<Metrics>,
    tokenizer: Option<&'static Tokenizer>,
    /// Recent time of a step of pure decode per row, to measure the prefill stall against.
    decode_step_seconds: f64,
}

/// Which slot a step row belongs to, and whether its logits pick a token.
#[derive(Clone, Copy)]
struct Planned {
    slot: usize,
    tokens: usize,
    samples: bool,
}

impl Worker {
    fn new(session: Session, options: SchedulerOptions, metrics: Arc<Metrics>) -> Worker {
        let slots: Vec<Slot> = (0..options.parallel)
            .map(|_| Slot {
                sequence: session.new_sequence(options.context),
                active: None,
                scores: CachedScores::default(),
            })
            .collect();
        Worker {
            session,
            slots,
            waiting: VecDeque::new(),
            options,
            metrics,
            tokenizer: Tokenizer::shared().ok(),
            decode_step_seconds: 0.0,
        }
    }

    fn run(mut self, commands: Receiver<Command>) {
        let mut deadline: Option<Instant> = None;
        loop {
            let busy = !self.waiting.is_empty() || self.slots.iter().any(|s| s.active.is_some());
            if deadline.is_some() && !busy {
                break;
            }
            // Idle: block for the next command; busy: take what arrived and go on stepping.
            let first = if busy {
                commands.try_recv().ok()
            } else {
                match commands.recv_timeout(Duration::from_secs(1)) {
                    Ok(command) => Some(command),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            };
            for command in first.into_iter().chain(commands.try_iter()) {
                match command {
                    Command::Submit(job) => self.waiting.push_back(*job),
                    Command::Drain(until) => {
                        deadline = Some(deadline.map_or(until, |d| d.min(until)));
                    }
                }
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                self.cancel_all("the server is shutting down");
                break;
            }
            self.drop_gone_clients();
            self.admit();
            self.publish_gauges();
            if self.slots.iter().any(|s| s.active.is_some()) {
                self.step();
                self.publish_gauges();
            }
        }
        self.publish_gauges();
    }

    fn publish_gauges(&self) {
        let m = &self.metrics;
        let active = self.slots.iter().filter(|s| s.active.is_some());
        m.active_sequences
            .store(active.clone().count(), Ordering::Relaxed);
        let used = active.map(|s| s.sequence.len()).sum();
        m.kv_used_tokens.store(used, Ordering::Relaxed);
    }

    fn cancel_all(&mut self, why: &str) {
        for job in self.waiting.drain(..) {
            self.metrics.queue_depth.fetch_sub(1, Ordering::AcqRel);
            job.send(Event::Failed(why.into()));
        }
        for slot in &mut self.slots {
            if let Some(active) = slot.active.take() {
                active.job.send(Event::Failed(why.into()));
            }
        }
    }

    /// Requests whose client disconnected leave the queue and the batch now, freeing their slot.
    fn drop_gone_clients(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|job| !job.events.is_closed());
        let gone = before - self.waiting.len();
        self.metrics.queue_depth.fetch_sub(gone, Ordering::AcqRel);
        for slot in &mut self.slots {
            if slot
                .active
                .as_ref()
                .is_some_and(|a| a.job.events.is_closed())
            {
                slot.active = None;
            }
        }
    }

    /// Moves waiting jobs into free slots, reusing the longest cached prefix.
    fn admit(&mut self) {
        while !self.waiting.is_empty() {
            let Some(tokenizer) = self.tokenizer else {
                self.cancel_all("the o200k_harmony tokenizer could not be built");
                return;
            };
            let free = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.active.is_none());
            let head = &self.waiting[0];
            let Some((slot, own)) = free
                .map(|(i, s)| (i, reusable(s, head)))
                .max_by_key(|&(i, len)| (len, std::cmp::Reverse(i)))
            else {
                return;
            };
            if self.wait_for_shared_prefill() {
                return;
            }
            let Some(job) = self.waiting.pop_front() else {
                return;
            };
            self.metrics.queue_depth.fetch_sub(1, Ordering::AcqRel);
            // At least one prompt token is computed: its logits pick the first token. A scored
            // prompt reuses only what its slot has scores for.
            let limit = job.prompt.len() - 1;
            let mut reused = own.min(limit);
            let best_other = self
                .slots
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != slot && job.prompt_logprobs.is_none())
                .map(|(i, s)| {
                    (
                        i,
                        common_prefix_len(s.sequence.tokens(), &job.prompt).min(limit),
                    )
                })
                .max_by_key(|&(_, len)| len);
            if let Some((source, len)) = best_other {
                if len >= reused + MIN_PREFIX_COPY {
                    let (to, from) = two_slots(&mut self.slots, slot, source);
                    reused = to.sequence.copy_prefix_from(&from.sequence, len);
                    // Another slot's tokens: this slot's scores describe what it held before.
                    to.scores = CachedScores::default();
                }
            }
            let target = &mut self.slots[slot];
            target.sequence.truncate(reused);
            match job.prompt_logprobs {
                // The entry of token `reused` too: the prompt shares that token (see
                // `CachedScores::reusable`), and its row is not computed again.
                Some(_) => target.scores.entries.truncate(reused),
                None => target.scores.truncate(reused),
            }
            let m = &self.metrics;
            Metrics::add(&m.prompt_tokens, job.prompt.len() as u64);
            Metrics::add(&m.cached_prompt_tokens, reused as u64);
            if reused > 0 {
                Metrics::add(&m.prefix_cache_hits, 1);
            }
            let sampler = match Sampler::new(job.sampler) {
                Ok(sampler) => sampler,
                Err(error) => {
                    job.send(Event::Failed(error.to_string()));
                    continue;
                }
            };
            let mut reply = ReplyText::new(job.stop.clone()).with_tools(job.tools);
            let raw = match job.text {
                TextMode::Harmony => None,
                TextMode::Raw {
                    skip_special_tokens,
                } => {
                    reply = reply.plain_text();
                    Some(RawText {
                        bytes: Utf8Stream::default(),
                        skip_special_tokens,
                    })
                }
            };
            let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
            // A forced call's header is prompt, but the reply's parser must have read it.
            for &token in &job.forced {
                parser.push(token, &mut |event| reply.on_event(event));
            }
            let cached = &self.slots[slot].scores.entries;
            let prompt_logprobs = job.prompt_logprobs.map(|top| {
                let mut rest = Vec::with_capacity(job.prompt.len() - 1);
                rest.extend(cached[..reused].iter().map(|entry| {
                    let mut entry = entry.clone();
                    entry.top.truncate(top);
                    entry
                }));
                PromptLogprobs {
                    first: tokenizer
                        .token_bytes(job.prompt[0])
                        .map(|bytes| String::from_utf8_lossy(bytes).into_owned())
                        .unwrap_or_default(),
                    rest,
                }
            });
            self.slots[slot].active = Some(Active {
                job,
                prefilled: reused,
                reused,
                next: None,
                generated: 0,
                sampler,
                parser,
                raw,
                reply,
                first_token_at: None,
                sampled_counts: std::collections::HashMap::new(),
                constrained: false,
                prompt_logprobs,
            });
        }
    }

    /// Whether the first waiting prompt should wait for another slot's prefill: when a slot is
    /// still prefilling a prompt that shares at least [`MIN_PREFIX_COPY`] more tokens with it than
    /// any cache holds now, that prefix is copied once it is done instead of being prefilled
    /// twice, each at half the step's prefill budget (requests that arrive together with the
    /// same system prompt, the `n` choices of one request). The prefilling slot goes on, so the
    /// wait ends; only the queue's head waits, keeping arrival order.
    fn wait_for_shared_prefill(&self) -> bool {
        let head = &self.waiting[0];
        let prompt = &head.prompt;
        let limit = prompt.len() - 1;
        // A scored prompt takes only the scored prefix of the free slot it is given, so it
        // waits for a scored prefill with enough alternatives, which leaves its scores there.
        let cached = match head.prompt_logprobs {
            Some(_) => self
                .slots
                .iter()
                .filter(|s| s.active.is_none())
                .map(|s| reusable(s, head))
                .max(),
            None => self
                .slots
                .iter()
                .map(|s| common_prefix_len(s.sequence.tokens(), prompt).min(limit))
                .max(),
        }
        .unwrap_or(0);
        self.slots
            .iter()
            .filter_map(|s| s.active.as_ref())
            .filter(|active| active.next.is_none() && active.generated == 0)
            .filter(|active| match head.prompt_logprobs {
                Some(top) => active.job.prompt_logprobs.is_some_and(|t| t >= top),
                None => true,
            })
            .any(|active| {
                common_prefix_len(&active.job.prompt, prompt).min(limit) >= cached + MIN_PREFIX_COPY
            })
    }

    /// One forward pass over every active slot, then sampling and streaming.
    fn step(&mut self) {
        let decoding = self
            .slots
            .iter()
            .filter(|s| s.active.as_ref().is_some_and(|a| a.next.is_some()))
            .count();
        let chunk = self.session.chunk_len();
        // With nothing decoding nobody waits: prefill takes whole chunks.
        let mut prefill_budget = if decoding > 0 {
            self.options
                .prefill_chunk
                .min(chunk.saturating_sub(decoding))
        } else {
            chunk
        };
        let mut plan = Vec::with_capacity(self.slots.len());
        let mut steps = Vec::with_capacity(self.slots.len());
        let mut prefill_rows = 0;
        // One prompt a pass is scored at every position (each scored row costs a read of the
        // unembedding per block of rows); another waits for the next step.
        let mut scored: Option<(usize, PromptScorer<'_>)> = None;
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let Slot {
                sequence, active, ..
            } = slot;
            let Some(active) = active.as_mut() else {
                continue;
            };
            let scores = active.next.is_none() && active.prompt_logprobs.is_some();
            if scores && scored.is_some() {
                continue;
            }
            let tokens: &[u32] = match &active.next {
                Some(token) => std::slice::from_ref(token),
                None => {
                    if prefill_budget == 0 {
                        continue;
                    }
                    let end = (active.prefilled + prefill_budget).min(active.job.prompt.len());
                    let rows = &active.job.prompt[active.prefilled..end];
                    prefill_budget -= rows.len();
                    prefill_rows += rows.len();
                    rows
                }
            };
            let samples =
                active.next.is_some() || active.prefilled + tokens.len() == active.job.prompt.len();
            if let (true, Some(out), Some(top), Some(tokenizer)) = (
                scores,
                active.prompt_logprobs.as_mut(),
                active.job.prompt_logprobs,
                self.tokenizer,
            ) {
                let scorer = PromptScorer {
                    out,
                    prompt: &active.job.prompt,
                    position: active.prefilled,
                    top,
                    tokenizer,
                };
                scored = Some((steps.len(), scorer));
            }
            plan.push(Planned {
                slot: index,
                tokens: tokens.len(),
                samples,
            });
            steps.push(SequenceStep { sequence, tokens });
        }
        if steps.is_empty() {
            return;
        }
        let started = Instant::now();
        let result = match scored.as_mut() {
            Some((step, scorer)) => {
                let mut row = |logits: &[f32]| scorer.score(logits);
                let all = AllLogits {
                    step: *step,
                    row: &mut row,
                };
                self.session.forward_batch_scoring(&mut steps, Some(all))
            }
            None => self.session.forward_batch(&mut steps),
        };
        drop(steps);
        let seconds = started.elapsed().as_secs_f64();
        if let Err(error) = result {
            for planned in &plan {
                if let Some(active) = self.slots[planned.slot].active.take() {
                    active
                        .job
                        .send(Event::Failed(format!("the forward pass failed: {error}")));
                }
            }
            return;
        }
        self.record_step(seconds, decoding, prefill_rows);

        // Bias and penalties touch a few logits of a row, a structured output's mask forbids
        // what cannot continue it (after the bias, which must not bring a forbidden token
        // back): done here, before the parallel sampling reads the rows.
        for (row, planned) in plan.iter().enumerate().filter(|(_, p)| p.samples) {
            let slot = &mut self.slots[planned.slot];
            let Some(active) = slot.active.as_mut() else {
                continue;
            };
            let adjust = &active.job.adjustments;
            if !adjust.is_empty() {
                adjust_logits(
                    self.session.batch_logits_mut(row),
                    adjust,
                    &active.sampled_counts,
                );
            }
            let masked = active
                .next_constraint()
                .map(|(constraint, end)| constraint.mask(self.session.batch_logits_mut(row), end));
            active.constrained = masked.is_some();
            if let Some(Err(error)) = masked {
                active.job.send(Event::Failed(error));
                slot.active = None;
            }
        }

        // Sampling is a few passes over the vocabulary per sequence: the rows are sampled in
        // parallel on the session's pool.
        let mut samples = {
            let Worker { session, slots, .. } = self;
            let mut samplers: Vec<(usize, &mut Sampler)> = Vec::with_capacity(plan.len());
            // `plan` lists slots in ascending order, as they were visited.
            let mut rows = plan
                .iter()
                .enumerate()
                .filter(|(_, p)| p.samples)
                .peekable();
            for (index, slot) in slots.iter_mut().enumerate() {
                if let Some(&(row, planned)) = rows.peek() {
                    if planned.slot == index {
                        rows.next();
                        if let Some(active) = slot.active.as_mut() {
                            samplers.push((row, &mut active.sampler));
                        }
                    }
                }
            }
            let session = &*session;
            let mut samples: Vec<Option<Result<u32, String>>> =
                (0..plan.len()).map(|_| None).collect();
            let drawn: Vec<_> = session.pool().install(|| {
                samplers
                    .par_iter_mut()
                    .map(|(row, sampler)| (*row, sampler.sample(session.batch_logits(*row))))
                    .collect()
            });
            for (row, result) in drawn {
                samples[row] = Some(result.map_err(|error| error.to_string()));
            }
            samples
        };
        for (row, planned) in plan.iter().enumerate() {
            let slot = &mut self.slots[planned.slot];
            let Some(active) = slot.active.as_mut() else {
                continue;
            };
            if active.next.is_none() {
                active.prefilled += planned.tokens;
            }
            let Some(sampled) = samples[row].take() else {
                continue;
            };
            let prompt_scores = active.prompt_logprobs.take();
            if let (Some(scores), Some(top)) = (&prompt_scores, active.job.prompt_logprobs) {
                slot.scores = CachedScores {
                    entries: scores.rest.clone(),
                    top,
                };
            }
            if active.job.max_tokens == 0 {
                // Scoring only (`echo` with `max_tokens` 0): the prompt is the whole answer.
                let delta = ReplyDelta {
                    prompt: prompt_scores,
                    ..ReplyDelta::default()
                };
                if !delta.is_empty() {
                    active.job.send(Event::Delta(delta));
                }
                let now = Instant::now();
                active.job.send(Event::Done(Finish {
                    reason: FinishReason::Length,
                    usage: Usage {
                        prompt_tokens: active.job.prompt.len(),
                        cached_tokens: active.reused,
                        ..Usage::default()
                    },
                    time_to_first_token: now.duration_since(active.job.received),
                    decode_time: Duration::ZERO,
                }));
                slot.active = None;
                continue;
            }
            let token = match sampled {
                Ok(token) => token,
                Err(error) => {
                    active.job.send(Event::Failed(error));
                    slot.active = None;
                    continue;
                }
            };
            if active.generated == 0 {
                active.first_token_at = Some(Instant::now());
                let m = &self.metrics;
                let ttft = active.job.received.elapsed().as_secs_f64();
                m.time_to_first_token_seconds_sum
                    .set(m.time_to_first_token_seconds_sum.get() + ttft);
                Metrics::add(&m.time_to_first_token_count, 1);
            }
            Metrics::add(&self.metrics.generated_tokens, 1);
            // Read before the token goes through the parser: whether it lands in the answer.
            if let (Some(top), Some(tokenizer)) = (active.job.logprobs, self.tokenizer) {
                if !Tokenizer::is_special(token) && active.reply.in_answer() {
                    let logits = self.session.batch_logits(row);
                    active
                        .reply
                        .push_logprob(token_logprobs(logits, token, top, tokenizer));
                }
            }
            if active.job.adjustments.penalizes() {
                *active.sampled_counts.entry(token).or_insert(0) += 1;
            }
            // The reply has not moved since the mask: the same constraint takes the token.
            let advanced = match active.constrained {
                true => active
                    .next_constraint()
                    .map(|(c, end)| c.advance(token, end)),
                false => None,
            };
            if let Some(Err(error)) = advanced {
                active.job.send(Event::Failed(error));
                slot.active = None;
                continue;
            }
            let finish = match self.tokenizer {
                Some(tokenizer) => take_token(
                    active,
                    token,
                    (slot.sequence.len(), self.options.context),
                    tokenizer,
                ),
                // Admission needs the tokenizer: no request is active without one.
                None => Some(FinishReason::Stop),
            };
            let mut delta = active.reply.take();
            delta.prompt = prompt_scores;
            if !delta.is_empty() {
                active.job.send(Event::Delta(delta));
            }
            if let Some(reason) = finish {
                let usage = Usage {
                    prompt_tokens: active.job.prompt.len(),
                    cached_tokens: active.reused,
                    completion_tokens: active.generated,
                    reasoning_tokens: active.reply.reasoning_tokens,
                };
                let first = active.first_token_at.unwrap_or_else(Instant::now);
                active.job.send(Event::Done(Finish {
                    reason,
                    usage,
                    time_to_first_token: first.duration_since(active.job.received),
                    decode_time: first.elapsed(),
                }));
                slot.active = None;
            }
        }
    }

    /// Updates throughput and stall figures from a step of `seconds` with `decoding` decode
    /// rows and `prefill_rows` prompt rows.
    fn record_step(&mut self, seconds: f64, decoding: usize, prefill_rows: usize) {
        let m = &self.metrics;
        Metrics::add(&m.prefilled_tokens, prefill_rows as u64);
        if seconds <= 0.0 {
            return;
        }
        let smooth = |gauge: &super::metrics::Gauge, value: f64| {
            let old = gauge.get();
            gauge.set(if old == 0.0 {
                value
            } else {
                0.8 * old + 0.2 * value
            });
        };
        if prefill_rows == 0 {
            smooth(&m.decode_tokens_per_second, decoding as f64 / seconds);
            self.decode_step_seconds = seconds;
        } else {
            smooth(&m.prefill_tokens_per_second, prefill_rows as f64 / seconds);
            if decoding > 0 {
                let stall = (seconds - self.decode_step_seconds).max(0.0);
                m.prefill_stall_seconds.set(stall);
                m.prefill_stall_max_seconds.raise(stall);
            }
        }
    }
}

/// Turns each scored row of a prompt chunk into the log-probability of the prompt token that
/// follows it: the row at prompt position `p` predicts token `p + 1`; the prompt's last row
/// predicts the reply, which is sampled from it as usual.
struct PromptScorer<'a> {
    out: &'a mut PromptLogprobs,
    prompt: &'a [u32],
    /// The prompt position of the next row.
    position: usize,
    top: usize,
    tokenizer: &'static Tokenizer,
}

impl PromptScorer<'_> {
    fn score(&mut self, logits: &[f32]) {
        if let Some(&next) = self.prompt.get(self.position + 1) {
            self.out
                .rest
                .push(token_logprobs(logits, next, self.top, self.tokenizer));
        }
        self.position += 1;
    }
}

/// Feeds a sampled token to the request's parser and applies the stop rules: a harmony stop token
/// or a stop string ends it (`stop`), the token budget or a full context (`length`). Otherwise
/// the token is fed in the next step. `cached` is what the slot's cache holds now.
fn take_token(
    active: &mut Active,
    token: u32,
    (cached, context): (usize, usize),
    tokenizer: &Tokenizer,
) -> Option<FinishReason> {
    active.generated += 1;
    active.reply.count_token();
    let mut stopped = false;
    let reply = &mut active.reply;
    match &mut active.raw {
        Some(raw) => {
            use crate::chat::tokenizer::special::{CALL, END_OF_TEXT, RETURN};
            if matches!(token, RETURN | CALL | END_OF_TEXT) {
                stopped = true;
            } else if !(raw.skip_special_tokens && Tokenizer::is_special(token)) {
                if let Ok(bytes) = tokenizer.token_bytes(token) {
                    reply.push_plain(raw.bytes.push(bytes));
                }
            }
        }
        None => active.parser.push(token, &mut |event| {
            if let ParseEvent::Stop(_) = event {
                stopped = true;
            }
            reply.on_event(event);
        }),
    }
    let reason = if stopped && reply.made_calls() {
        Some(FinishReason::ToolCalls)
    } else if stopped || reply.stopped() {
        Some(FinishReason::Stop)
    } else if active.generated >= active.job.max_tokens || cached + 1 > context {
        Some(FinishReason::Length)
    } else {
        None
    };
    match reason {
        Some(_) => {
            match &mut active.raw {
                Some(raw) => reply.push_plain(raw.bytes.finish()),
                None if !stopped => active.parser.finish(&mut |event| reply.on_event(event)),
                None => {}
            }
            reply.finish();
            active.next = None;
        }
        None => active.next = Some(token),
    }
    reason
}

/// OpenAI's logit bias and repetition penalties on one row: `bias` added to the listed tokens,
/// `count x frequency + presence` subtracted from every token sampled `count > 0` times so far.
fn adjust_logits(
    logits: &mut [f32],
    adjust: &LogitAdjustments,
    sampled_counts: &std::collections::HashMap<u32, u32>,
) {
    for &(id, bias) in &adjust.bias {
        if let Some(logit) = logits.get_mut(id as usize) {
            *logit += bias;
        }
    }
    for (&id, &count) in sampled_counts {
        if let Some(logit) = logits.get_mut(id as usize) {
            *logit -= count as f32 * adjust.frequency_penalty + adjust.presence_penalty;
        }
    }
}

/// How many of `job`'s prompt tokens `slot` holds for it: the common prefix, or for a scored
/// prompt the part of it the slot has scores for ([`CachedScores::reusable`]).
fn reusable(slot: &Slot, job: &Job) -> usize {
    let common = common_prefix_len(slot.sequence.tokens(), &job.prompt);
    match job.prompt_logprobs {
        Some(top) => slot.scores.reusable(common, top),
        None => common,
    }
}

/// Mutable `slots[to]` and shared `slots[from]` (different indices).
fn two_slots(slots: &mut [Slot], to: usize, from: usize) -> (&mut Slot, &Slot) {
    if to < from {
        let (left, right) = slots.split_at_mut(from);
        (&mut left[to], &right[0])
    } else {
        let (left, right) = slots.split_at_mut(to);
        (&mut right[0], &left[from])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_have_openai_names() {
        assert_eq!(FinishReason::Stop.as_str(), "stop");
        assert_eq!(FinishReason::Length.as_str(), "length");
        assert_eq!(FinishReason::ToolCalls.as_str(), "tool_calls");
    }

    #[test]
    fn bias_and_penalties_move_exactly_the_logits_openai_says() {
        let mut logits = vec![1.0f32; 8];
        let adjust = LogitAdjustments {
            bias: vec![(2, 5.0), (3, -100.0), (99, 1.0)],
            frequency_penalty: 0.5,
            presence_penalty: 1.5,
        };
        let counts = std::collections::HashMap::from([(2u32, 3u32), (5, 1)]);
        adjust_logits(&mut logits, &adjust, &counts);
        // Token 2: +5 bias, -(3 x 0.5 + 1.5); token 5: -(0.5 + 1.5); an id past the row: ignored.
        assert_eq!(logits, [1.0, 1.0, 3.0, -99.0, 1.0, -1.0, 1.0, 1.0]);
    }
}
