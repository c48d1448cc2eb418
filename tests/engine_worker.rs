//! Engine thread tests over a toy model whose logits depend on every token in its cache, so any
//! mistake in prefix reuse (a stale token left behind, a token missing) changes the output.

use ossterm::chat::{ParseEvent, StopToken};
use ossterm::engine::protocol::{
    ActivationFormat, AttentionArithmetic, Channel, ChatMessage, Command, Conversation, Event,
    GenerateRequest, KvCacheType, ReasoningEffort, RequestKind, Role, SamplingSettings, Settings,
    StopReason, SystemSettings, Unembedding, WeightFormat,
};
use ossterm::engine::worker::{ChatCodec, EngineError, EngineHandle, EngineParts, ModelBackend};
use ossterm::engine::{
    common_prefix_len, rewind_for_prompt, InferenceSession, ReplyParser, SamplerError,
    SamplerSettings, TokenSampler,
};
use std::convert::Infallible;
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const VOCAB: usize = 64;
/// Ids 0..=25 are the letters a..z; 26 is a space; 27 switches to the final channel; 28 stops.
const SPACE: u32 = 26;
const TO_FINAL: u32 = 27;
const STOP: u32 = 28;
const ROLE_USER: u32 = 40;
const ROLE_ASSISTANT: u32 = 41;
const ROLE_SYSTEM: u32 = 42;
const TOY_PREFILL_CHUNK: usize = 128;

/// Shared record of what the toy sessions were asked to do.
#[derive(Default)]
struct Journal {
    prefill_chunks: Vec<usize>,
    decodes: usize,
    /// Threads of the pool each prefill ran on (the session's).
    prefill_threads: Vec<usize>,
    /// KV cache type of every session made.
    sessions: Vec<KvCacheType>,
    /// Activation format of every session made and of every switch of one.
    session_activations: Vec<ActivationFormat>,
    /// Every switch of a session's attention arithmetic.
    session_attention: Vec<AttentionArithmetic>,
    /// Weight conversions started.
    requantizations: usize,
    /// Where each load ran: (on a pool's worker thread, that pool's threads).
    load_pools: Vec<(bool, usize)>,
}

/// (on a rayon worker thread, threads of the pool in force) for the calling code.
fn current_pool() -> (bool, usize) {
    (
        rayon::current_thread_index().is_some(),
        rayon::current_num_threads(),
    )
}

struct ToyModel {
    format: WeightFormat,
    unembedding: Unembedding,
    activations: ActivationFormat,
    attention: AttentionArithmetic,
    step_delay: Duration,
    journal: Arc<Mutex<Journal>>,
    /// When set, re-quantization reports 1 of 4 and then waits here until the test releases it.
    requantize_gate: Option<Arc<Barrier>>,
}

struct ToySession {
    /// The pool the session computes on, as a real session holds it.
    pool: Arc<rayon::ThreadPool>,
    activations: ActivationFormat,
    attention: AttentionArithmetic,
    /// The state before any token; it depends on the activation format and the attention
    /// arithmetic, so sessions of different ones give different logits, as the real forward pass
    /// does.
    start: u64,
    tokens: Vec<u32>,
    /// Rolling hash of the history after each token.
    states: Vec<u64>,
    logits: Vec<f32>,
    limit: usize,
    step_delay: Duration,
    journal: Arc<Mutex<Journal>>,
}

fn mix(state: u64, token: u32) -> u64 {
    (state ^ u64::from(token).wrapping_add(0x9e37_79b9_7f4a_7c15))
        .wrapping_mul(0xff51_afd7_ed55_8ccd)
        .rotate_left(29)
}

/// The default format and arithmetic keep the plain start, so replies of the other tests stay
/// what they were.
fn start_state(activations: ActivationFormat, attention: AttentionArithmetic) -> u64 {
    let start = match activations {
        ActivationFormat::Mixed => 0x1234_5678,
        other => mix(0x1234_5678, 1000 + other.name().len() as u32),
    };
    match attention {
        AttentionArithmetic::Auto => start,
        other => mix(start, 2000 + other.name().len() as u32),
    }
}

impl ToySession {
    fn append(&mut self, token: u32) {
        let previous = self.states.last().copied().unwrap_or(self.start);
        self.states.push(mix(previous, token));
        self.tokens.push(token);
    }

    fn compute_logits(&mut self) -> &[f32] {
        let state = *self.states.last().expect("logits need at least one token");
        for (index, logit) in self.logits.iter_mut().enumerate() {
            *logit = (mix(state, index as u32) >> 40) as f32 / (1u64 << 24) as f32;
        }
        &self.logits
    }
}

impl InferenceSession for ToySession {
    type Error = Infallible;

    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], Infallible> {
        std::thread::sleep(self.step_delay);
        let mut journal = self.journal.lock().unwrap();
        journal.prefill_chunks.push(tokens.len());
        journal
            .prefill_threads
            .push(self.pool.install(rayon::current_num_threads));
        drop(journal);
        for &token in tokens {
            self.append(token);
        }
        Ok(self.compute_logits())
    }

    fn decode(&mut self, token: u32) -> Result<&[f32], Infallible> {
        std::thread::sleep(self.step_delay);
        self.journal.lock().unwrap().decodes += 1;
        self.append(token);
        Ok(self.compute_logits())
    }

    fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        self.states.truncate(len);
    }

    fn context_limit(&self) -> usize {
        self.limit
    }

    fn prefill_chunk(&self) -> usize {
        TOY_PREFILL_CHUNK
    }

    fn activations(&self) -> ActivationFormat {
        self.activations
    }

    fn set_activations(&mut self, format: ActivationFormat) {
        if format != self.activations {
            self.journal
                .lock()
                .unwrap()
                .session_activations
                .push(format);
            self.activations = format;
            self.start = start_state(format, self.attention);
            self.truncate(0);
        }
    }

    fn attention(&self) -> AttentionArithmetic {
        self.attention
    }

    fn set_attention(&mut self, attention: AttentionArithmetic) {
        if attention != self.attention {
            self.journal
                .lock()
                .unwrap()
                .session_attention
                .push(attention);
            self.attention = attention;
            self.start = start_state(self.activations, attention);
            self.truncate(0);
        }
    }
}

/// A pool for toy sessions made outside the engine.
fn toy_pool() -> Arc<rayon::ThreadPool> {
    ossterm::engine::build_pool(1).unwrap()
}

impl ModelBackend for ToyModel {
    type Session = ToySession;

    fn new_session(
        model: &Arc<Self>,
        pool: &Arc<rayon::ThreadPool>,
        context_limit: usize,
        kv_cache: KvCacheType,
        activations: ActivationFormat,
    ) -> Result<ToySession, EngineError> {
        let mut journal = model.journal.lock().unwrap();
        journal.sessions.push(kv_cache);
        journal.session_activations.push(activations);
        Ok(ToySession {
            pool: Arc::clone(pool),
            activations,
            attention: AttentionArithmetic::Auto,
            start: start_state(activations, AttentionArithmetic::Auto),
            tokens: Vec::new(),
            states: Vec::new(),
            logits: vec![0.0; VOCAB],
            limit: context_limit,
            step_delay: model.step_delay,
            journal: Arc::clone(&model.journal),
        })
    }

    fn set_session_pool(session: &mut ToySession, pool: &Arc<rayon::ThreadPool>) {
        session.pool = Arc::clone(pool);
    }

    fn requantized(
        &self,
        (format, unembedding): (WeightFormat, Unembedding),
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<ToyModel, EngineError> {
        self.journal.lock().unwrap().requantizations += 1;
        for done in 0..=4 {
            std::thread::sleep(Duration::from_millis(5));
            progress(done, 4);
            if done == 1 {
                if let Some(gate) = &self.requantize_gate {
                    gate.wait();
                }
            }
        }
        Ok(ToyModel {
            format,
            unembedding,
            // Like the real model: the new weights keep the options of the old ones.
            activations: self.activations,
            attention: self.attention,
            step_delay: self.step_delay,
            journal: Arc::clone(&self.journal),
            requantize_gate: None,
        })
    }

    fn weight_format(&self) -> WeightFormat {
        self.format
    }

    fn unembedding(&self) -> Unembedding {
        self.unembedding
    }

    fn activations(&self) -> ActivationFormat {
        self.activations
    }

    fn attention(&self) -> AttentionArithmetic {
        self.attention
    }

    fn effective_kv_cache(&self, requested: KvCacheType) -> KvCacheType {
        requested
    }

    fn kernel_path(
        &self,
        attention: AttentionArithmetic,
        _: ActivationFormat,
        _: KvCacheType,
    ) -> String {
        // Names the arithmetic, as the real model's "+bf16" does.
        match attention {
            AttentionArithmetic::Bf16 => "scalar+bf16".to_string(),
            _ => "scalar".to_string(),
        }
    }
}

/// Renders a conversation as role markers and letters; analysis is dropped unless kept, like harmony.
struct ToyCodec;

fn encode_text(text: &str, out: &mut Vec<u32>) {
    for character in text.chars() {
        match character {
            'a'..='z' => out.push(character as u32 - 'a' as u32),
            _ => out.push(SPACE),
        }
    }
}

impl ChatCodec for ToyCodec {
    type Parser = ToyParser;

    fn render_prompt(
        &self,
        conversation: &Conversation,
        keep_reasoning: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let mut ids = vec![ROLE_SYSTEM];
        let effort = conversation
            .system
            .reasoning
            .map_or("", |effort| effort.name());
        encode_text(effort, &mut ids);
        for message in &conversation.messages {
            if message.channel == Some(Channel::Analysis) && !keep_reasoning {
                continue;
            }
            ids.push(if message.role == Role::User {
                ROLE_USER
            } else {
                ROLE_ASSISTANT
            });
            encode_text(&message.content, &mut ids);
        }
        ids.push(ROLE_ASSISTANT);
        Ok(ids)
    }

    fn parser(&self) -> ToyParser {
        ToyParser {
            channel: Channel::Analysis,
        }
    }
}

struct ToyParser {
    channel: Channel,
}

const LETTERS: &str = "abcdefghijklmnopqrstuvwxyz";

impl ReplyParser for ToyParser {
    fn push(&mut self, token: u32, on_event: &mut dyn FnMut(ParseEvent<'_>)) {
        let text = match token {
            0..=25 => &LETTERS[token as usize..token as usize + 1],
            SPACE => " ",
            TO_FINAL => {
                self.channel = Channel::Final;
                return;
            }
            STOP => return on_event(ParseEvent::Stop(StopToken::Return)),
            _ => return,
        };
        on_event(ParseEvent::Text {
            channel: Some(self.channel),
            text,
        });
    }

    // Every token is reported whole as it comes: nothing is left to flush.
    fn finish(&mut self, _on_event: &mut dyn FnMut(ParseEvent<'_>)) {}
}

/// Greedy, so runs are reproducible; records configurations.
struct GreedySampler {
    configured: Arc<Mutex<Vec<SamplerSettings>>>,
}

impl TokenSampler for GreedySampler {
    fn configure(&mut self, settings: SamplerSettings) -> Result<(), SamplerError> {
        self.configured.lock().unwrap().push(settings);
        Ok(())
    }

    fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        Ok(logits
            .iter()
            .enumerate()
            .max_by(|left, right| left.1.total_cmp(right.1))
            .map_or(0, |(index, _)| index as u32))
    }
}

struct Harness {
    engine: EngineHandle,
    events: Receiver<Event>,
    journal: Arc<Mutex<Journal>>,
    sampler_configs: Arc<Mutex<Vec<SamplerSettings>>>,
}

fn test_settings(max_tokens: usize) -> Settings {
    Settings {
        threads: 1,
        context_limit: 4096,
        sampling: SamplingSettings {
            max_tokens,
            temperature: 0.0,
            ..SamplingSettings::default()
        },
        ..Settings::default()
    }
}

fn start(settings: Settings, step_delay: Duration) -> Harness {
    start_gated(settings, step_delay, None)
}

fn start_gated(
    settings: Settings,
    step_delay: Duration,
    requantize_gate: Option<Arc<Barrier>>,
) -> Harness {
    let journal = Arc::new(Mutex::new(Journal::default()));
    let sampler_configs = Arc::new(Mutex::new(Vec::new()));
    let (event_sender, events) = mpsc::channel();
    let model_journal = Arc::clone(&journal);
    let configs = Arc::clone(&sampler_configs);
    let engine = EngineHandle::spawn(settings, event_sender, move |settings, progress| {
        progress("toy weights", 1, 1);
        model_journal
            .lock()
            .unwrap()
            .load_pools
            .push(current_pool());
        Ok(EngineParts {
            model: Arc::new(ToyModel {
                format: WeightFormat::Q8,
                unembedding: settings.unembedding,
                activations: settings.activations,
                attention: settings.attention,
                step_delay,
                journal: model_journal,
                requantize_gate,
            }),
            codec: ToyCodec,
            sampler: GreedySampler {
                configured: configs,
            },
            model_label: "toy".to_string(),
            random_weights: true,
            kv_tiers: Default::default(),
        })
    });
    Harness::ready(engine, events, journal, sampler_configs)
}

impl Harness {
    /// The harness of an engine just spawned, once the engine says it is ready.
    fn ready(
        engine: EngineHandle,
        events: Receiver<Event>,
        journal: Arc<Mutex<Journal>>,
        sampler_configs: Arc<Mutex<Vec<SamplerSettings>>>,
    ) -> Harness {
        let harness = Harness {
            engine,
            events,
            journal,
            sampler_configs,
        };
        harness.wait_for(|event| matches!(event, Event::Ready(_)));
        harness
    }

    /// Collects events until `stop` matches one (included); fails after 10 s.
    fn wait_for(&self, stop: impl Fn(&Event) -> bool) -> Vec<Event> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let event = self
                .events
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("timed out; saw {seen:?}"));
            let done = stop(&event);
            seen.push(event);
            if done {
                return seen;
            }
        }
    }

    /// Sends a new turn without waiting for it.
    fn start_turn(&self, id: u64, conversation: Conversation) {
        let request = GenerateRequest {
            id,
            kind: RequestKind::NewTurn,
            conversation,
        };
        self.engine
            .send(Command::Generate(Box::new(request)))
            .unwrap();
    }

    /// Runs a new turn: its events, through its end.
    fn generate(&self, id: u64, conversation: Conversation) -> Vec<Event> {
        self.start_turn(id, conversation);
        self.wait_for(|event| matches!(event, Event::TurnDone { id: done, .. } | Event::Error { id: Some(done), .. } if *done == id))
    }
}

fn conversation(messages: &[(Role, Option<Channel>, &str)]) -> Conversation {
    Conversation {
        system: SystemSettings {
            identity: Some("toy".to_string()),
            reasoning: Some(ReasoningEffort::Low),
            ..SystemSettings::default()
        },
        developer: None,
        messages: messages
            .iter()
            .map(|(role, channel, content)| match (role, channel) {
                (Role::Assistant, Some(channel)) => ChatMessage::assistant(*channel, *content),
                (Role::Assistant, None) => ChatMessage {
                    channel: None,
                    ..ChatMessage::assistant(Channel::Final, *content)
                },
                (Role::User, _) => ChatMessage::user(*content),
            })
            .collect(),
        ..Conversation::default()
    }
}

fn streamed_text(events: &[Event]) -> String {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Token { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn turn_done(events: &[Event]) -> (StopReason, u64, u64) {
    events
        .iter()
        .find_map(|event| match event {
            Event::TurnDone { reason, hits, .. } => Some((*reason, hits.reused, hits.prompt)),
            _ => None,
        })
        .expect("turn done")
}

/// A toy model outside any engine, and a session of 100 tokens on it.
fn toy_model() -> Arc<ToyModel> {
    Arc::new(ToyModel {
        format: WeightFormat::Q8,
        unembedding: Unembedding::TwoStage,
        activations: ActivationFormat::Mixed,
        attention: AttentionArithmetic::Auto,
        step_delay: Duration::ZERO,
        journal: Default::default(),
        requantize_gate: None,
    })
}

fn toy_session(model: &Arc<ToyModel>) -> ToySession {
    let format = ActivationFormat::Mixed;
    ToyModel::new_session(model, &toy_pool(), 100, KvCacheType::F16, format).unwrap()
}

#[test]
fn common_prefix_and_rewind_keep_one_token_to_prefill() {
    assert_eq!(common_prefix_len(&[1, 2, 3], &[1, 2, 4, 5]), 2);
    assert_eq!(common_prefix_len(&[], &[1]), 0);
    let model = toy_model();
    let mut session = toy_session(&model);
    session.prefill(&[5, 6, 7, 8]).unwrap();
    assert_eq!(rewind_for_prompt(&mut session, &[5, 6, 9]), 2);
    assert_eq!(session.tokens(), &[5, 6]);
    session.prefill(&[9]).unwrap();
    // Identical prompt: one token is re-run to get its logits.
    assert_eq!(rewind_for_prompt(&mut session, &[5, 6, 9]), 2);
}

#[test]
fn reused_prefix_gives_the_same_logits_as_a_cold_prefill() {
    let model = toy_model();
    let first: Vec<u32> = (0..40).map(|index| index % 26).collect();
    let mut second = first[..30].to_vec();
    second.extend([3, 1, 4, 1, 5, 9, 2, 6]);

    let mut warm = toy_session(&model);
    warm.prefill(&first).unwrap();
    warm.decode(7).unwrap();
    let reused = rewind_for_prompt(&mut warm, &second);
    assert_eq!(reused, 30);
    let warm_logits = warm.prefill(&second[reused..]).unwrap().to_vec();

    let mut cold = toy_session(&model);
    let cold_logits = cold.prefill(&second).unwrap().to_vec();
    assert_eq!(warm_logits, cold_logits);
}

#[test]
fn second_turn_prefills_only_the_new_tail_and_matches_a_cold_engine() {
    let harness = start(test_settings(12), Duration::ZERO);
    let turn_one = conversation(&[(Role::User, None, "hello there")]);
    let first = harness.generate(1, turn_one);
    let first_answer = streamed_text(&first);
    assert!(!first_answer.is_empty());
    let (_, reused, prompt) = turn_done(&first);
    assert_eq!(reused, 0);

    let turn_two = conversation(&[
        (Role::User, None, "hello there"),
        (Role::Assistant, Some(Channel::Final), &first_answer),
        (Role::User, None, "and again"),
    ]);
    harness.journal.lock().unwrap().prefill_chunks.clear();
    let second = harness.generate(2, turn_two.clone());
    let (_, reused_two, prompt_two) = turn_done(&second);
    // Everything through the first `assistant` marker is shared with turn one's prompt.
    assert!(
        reused_two >= prompt,
        "reused {reused_two} of {prompt_two}, turn one prompt {prompt}"
    );
    let prefilled: usize = harness.journal.lock().unwrap().prefill_chunks.iter().sum();
    assert_eq!(prefilled as u64, prompt_two - reused_two);

    let cold = start(test_settings(12), Duration::ZERO);
    let cold_events = cold.generate(1, turn_two);
    assert_eq!(streamed_text(&second), streamed_text(&cold_events));
    assert_eq!(turn_done(&cold_events).1, 0);
}

#[test]
fn regenerate_rewinds_to_the_edit_point() {
    let harness = start(test_settings(10), Duration::ZERO);
    let turn = conversation(&[(Role::User, None, "abc")]);
    let original = streamed_text(&harness.generate(1, turn.clone()));
    let regenerated = harness.generate(2, turn.clone());
    // Same prompt, greedy sampling: same answer, and all but the last prompt token came from the cache.
    assert_eq!(streamed_text(&regenerated), original);
    let (_, reused, prompt) = turn_done(&regenerated);
    assert_eq!(reused, prompt - 1);

    // Edit-and-resend: a different last user message rewinds to where it differs.
    let edited = conversation(&[(Role::User, None, "abd")]);
    let events = harness.generate(3, edited.clone());
    let (_, reused, _) = turn_done(&events);
    let cold = start(test_settings(10), Duration::ZERO);
    assert_eq!(
        streamed_text(&events),
        streamed_text(&cold.generate(1, edited))
    );
    assert!(reused > 0);
}

#[test]
fn cancel_stops_within_one_token() {
    let harness = start(test_settings(100_000), Duration::from_millis(3));
    harness.start_turn(1, conversation(&[(Role::User, None, "go")]));
    harness.wait_for(|event| matches!(event, Event::Token { .. }));
    let decodes_at_cancel = harness.journal.lock().unwrap().decodes;
    harness.engine.cancel(1);
    let events = harness.wait_for(|event| matches!(event, Event::TurnDone { .. }));
    let (reason, _, _) = turn_done(&events);
    assert_eq!(reason, StopReason::Cancelled);
    let decodes_after = harness.journal.lock().unwrap().decodes;
    assert!(
        decodes_after - decodes_at_cancel <= 2,
        "decoded {} tokens after cancel",
        decodes_after - decodes_at_cancel
    );
    // The engine serves the next request normally.
    let next = harness.generate(2, conversation(&[(Role::User, None, "go")]));
    let (reason, _, _) = turn_done(&next);
    assert!(
        matches!(reason, StopReason::MaxTokens | StopReason::Finished),
        "the next turn ended with {reason:?}"
    );
    assert!(
        !streamed_text(&next).is_empty(),
        "the next turn streamed no text"
    );
}

#[test]
fn a_full_cache_stops_the_turn_and_the_stats_count_what_it_holds() {
    let mut settings = test_settings(50);
    // The prompt is 8 tokens: system marker, "low", user marker, "hi", assistant marker.
    settings.context_limit = 11;
    let harness = start(settings, Duration::ZERO);
    let events = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    let (reason, reused, prompt) = turn_done(&events);
    assert_eq!((reason, reused, prompt), (StopReason::ContextFull, 0, 8));
    // The prompt's logits give one token, each of the three decodes that fill the cache another.
    let generated = events.iter().find_map(|event| match event {
        Event::TurnDone {
            generated_tokens, ..
        } => Some(*generated_tokens),
        _ => None,
    });
    assert_eq!(generated, Some(4));
    let stats = last_stats(&events);
    assert_eq!(
        (
            stats.kv_tokens_used,
            stats.context_used,
            stats.kv_tokens_capacity
        ),
        (11, 11, 11)
    );
    assert!(stats.time_to_first_token.is_some());
    assert!(stats.prefill_tokens_per_second.is_some());
    assert_eq!(stats.turn_hits.prompt, 8);
}

#[test]
fn cancel_before_start_skips_the_request() {
    let harness = start(test_settings(50), Duration::from_millis(2));
    harness.engine.cancel(1);
    let events = harness.generate(1, conversation(&[(Role::User, None, "go")]));
    assert_eq!(turn_done(&events).0, StopReason::Cancelled);
    assert!(streamed_text(&events).is_empty());
}

#[test]
fn cancel_between_prefill_chunks() {
    let harness = start(test_settings(50), Duration::from_millis(20));
    let long = "abcdefghij ".repeat(100);
    harness.start_turn(1, conversation(&[(Role::User, None, &long)]));
    harness.wait_for(|event| matches!(event, Event::PrefillProgress { .. }));
    harness.engine.cancel(1);
    let events = harness.wait_for(|event| matches!(event, Event::TurnDone { .. }));
    assert_eq!(turn_done(&events).0, StopReason::Cancelled);
    let chunks = harness.journal.lock().unwrap().prefill_chunks.len();
    assert!(
        chunks < 1100usize.div_ceil(TOY_PREFILL_CHUNK),
        "prefilled {chunks} chunks"
    );
}

#[test]
fn settings_apply_between_turns() {
    let harness = start(test_settings(8), Duration::ZERO);
    let mut settings = test_settings(8);
    settings.threads = 2;
    settings.sampling.top_k = 7;
    let events = harness.apply(&settings, |_| true);
    let applied = last_applied(&events);
    assert_eq!(applied.threads, 2);
    let events = harness.wait_for(|event| matches!(event, Event::Stats(_)));
    match events.last() {
        Some(Event::Stats(stats)) => assert_eq!(stats.threads, 2),
        other => panic!("expected stats, got {other:?}"),
    }
    assert_eq!(
        harness
            .sampler_configs
            .lock()
            .unwrap()
            .last()
            .unwrap()
            .top_k,
        7
    );

    // A new weight format re-quantizes in the background with progress, then swaps in.
    settings.weight_format = WeightFormat::Q4;
    let events = harness.apply(&settings, |applied| {
        applied.weight_format == WeightFormat::Q4
    });
    assert!(conversion_finished(&events), "{events:?}");
    let after = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(last_stats(&after).weight_format, WeightFormat::Q4);
}

#[test]
fn prompt_longer_than_the_context_is_an_error_not_a_panic() {
    let mut settings = test_settings(8);
    settings.context_limit = 256;
    let harness = start(settings, Duration::ZERO);
    let events = harness.generate(1, conversation(&[(Role::User, None, &"word ".repeat(100))]));
    let message = events.iter().find_map(|event| match event {
        Event::Error { message, .. } => Some(message.clone()),
        _ => None,
    });
    let message = message.expect("error event");
    assert!(message.contains("holds only 256"), "{message}");
}

#[test]
fn reasoning_kept_in_context_changes_the_prompt() {
    let mut settings = test_settings(6);
    settings.keep_reasoning_in_context = true;
    let harness = start(settings, Duration::ZERO);
    let with_reasoning = conversation(&[
        (Role::User, None, "a"),
        (Role::Assistant, Some(Channel::Analysis), "think"),
        (Role::Assistant, Some(Channel::Final), "b"),
        (Role::User, None, "c"),
    ]);
    let events = harness.generate(1, with_reasoning);
    let (_, _, prompt) = turn_done(&events);
    // system marker + "low" + (user a) + (assistant think) + (assistant b) + (user c) + assistant marker
    assert_eq!(prompt, 1 + 3 + 2 + 6 + 2 + 2 + 1);
}

#[test]
fn real_model_reuse_gives_the_same_logits_as_a_cold_prefill() {
    use ossterm::model::{LoadOptions, Model, Preset};
    let model = Arc::new(Model::synthetic(Preset::Tiny, 7, &LoadOptions::default()).unwrap());
    let vocab = model.config.vocab_size as u32;
    let first: Vec<u32> = (0..50).map(|index| (index * 7919 + 13) % vocab).collect();
    let mut second = first[..35].to_vec();
    second.extend((0..9).map(|index| (index * 104_729 + 5) % vocab));

    let pool = ossterm::engine::build_pool(2).unwrap();
    let new_session = || {
        let format = ActivationFormat::Mixed;
        <Model as ModelBackend>::new_session(&model, &pool, 256, KvCacheType::F32, format).unwrap()
    };
    let mut warm = new_session();
    InferenceSession::prefill(&mut warm, &first).unwrap();
    InferenceSession::decode(&mut warm, 3).unwrap();
    let reused = rewind_for_prompt(&mut warm, &second);
    assert_eq!(reused, 35);
    let warm_logits = InferenceSession::prefill(&mut warm, &second[reused..])
        .unwrap()
        .to_vec();

    let mut cold = new_session();
    let cold_logits = InferenceSession::prefill(&mut cold, &second)
        .unwrap()
        .to_vec();
    let worst = warm_logits
        .iter()
        .zip(&cold_logits)
        .map(|(warm, cold)| (warm - cold).abs())
        .fold(0.0f32, f32::max);
    // Chunking differs (the warm run prefills 9 tokens, the cold one 44), so summation order may
    // differ in the last bits; anything beyond rounding noise means stale cache entries.
    let scale = cold_logits.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(
        worst < 1e-4 * scale,
        "largest logit difference {worst} (largest logit {scale})"
    );
}

fn last_stats(events: &[Event]) -> ossterm::engine::protocol::StatsSample {
    events
        .iter()
        .rev()
        .find_map(|event| match event {
            Event::Stats(stats) => Some(stats.clone()),
            _ => None,
        })
        .expect("a stats sample")
}

/// The settings of the last event, which must be `SettingsApplied`.
fn last_applied(events: &[Event]) -> &Settings {
    match events.last() {
        Some(Event::SettingsApplied(applied)) => applied,
        other => panic!("expected settings applied, got {other:?}"),
    }
}

/// A weight conversion reported its last step.
fn conversion_finished(events: &[Event]) -> bool {
    events.iter().any(|event| {
        matches!(
            event,
            Event::SettingsProgress {
                done: 4,
                total: 4,
                ..
            }
        )
    })
}

impl Harness {
    /// Sends new settings and waits until the engine reports settings that satisfy `applied`.
    fn apply(&self, settings: &Settings, applied: impl Fn(&Settings) -> bool) -> Vec<Event> {
        self.engine
            .send(Command::ApplySettings(Box::new(settings.clone())))
            .unwrap();
        self.wait_for(|event| matches!(event, Event::SettingsApplied(done) if applied(done)))
    }
}

#[test]
fn weight_format_change_requantizes_while_the_old_weights_keep_serving() {
    let gate = Arc::new(Barrier::new(2));
    let harness = start_gated(test_settings(6), Duration::ZERO, Some(Arc::clone(&gate)));
    let mut settings = test_settings(6);
    settings.weight_format = WeightFormat::Q4;
    // Applied at once, but still showing the serving format while the conversion runs.
    let events = harness.apply(&settings, |_| true);
    let applied = last_applied(&events);
    assert_eq!(applied.weight_format, WeightFormat::Q8);
    harness.wait_for(|event| {
        matches!(
            event,
            Event::SettingsProgress {
                done: 1,
                total: 4,
                ..
            }
        )
    });

    // The conversion is held at 1 of 4: a turn now runs on the old weights.
    let during = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    assert_ne!(turn_done(&during).0, StopReason::Cancelled);
    assert_eq!(last_stats(&during).weight_format, WeightFormat::Q8);

    gate.wait();
    let events = harness.wait_for(|event| {
        matches!(event, Event::SettingsApplied(applied) if applied.weight_format == WeightFormat::Q4)
    });
    assert!(conversion_finished(&events), "{events:?}");
    let after = harness.generate(2, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(last_stats(&after).weight_format, WeightFormat::Q4);
    // New weights mean a new KV cache: the same prompt is prefilled from the start.
    assert_eq!(turn_done(&after).1, 0);
}

#[test]
fn unembedding_change_rebuilds_the_weights_while_the_old_ones_keep_serving() {
    let gate = Arc::new(Barrier::new(2));
    let harness = start_gated(test_settings(6), Duration::ZERO, Some(Arc::clone(&gate)));
    let mut settings = test_settings(6);
    assert_eq!(settings.unembedding, Unembedding::TwoStage);
    settings.unembedding = Unembedding::Full;
    let events = harness.apply(&settings, |_| true);
    assert_eq!(last_applied(&events).unembedding, Unembedding::TwoStage);
    let progress =
        harness.wait_for(|event| matches!(event, Event::SettingsProgress { done: 1, .. }));
    assert!(
        progress.iter().any(|event| matches!(
            event,
            Event::SettingsProgress { what, .. } if what.contains("full unembedding")
        )),
        "{progress:?}"
    );
    let during = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(last_stats(&during).unembedding, Unembedding::TwoStage);

    gate.wait();
    harness.wait_for(|event| {
        matches!(event, Event::SettingsApplied(applied) if applied.unembedding == Unembedding::Full)
    });
    let after = harness.generate(2, conversation(&[(Role::User, None, "hi")]));
    let stats = last_stats(&after);
    assert_eq!(
        (stats.weight_format, stats.unembedding),
        (WeightFormat::Q8, Unembedding::Full)
    );
    // Asking again for what now serves starts nothing.
    harness.apply(&settings, |_| true);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(harness.journal.lock().unwrap().requantizations, 1);
}

/// An engine (at most 4 tokens a turn) converting its weights to q4, the conversion held at 1 of
/// 4 until the test waits at the returned barrier; and the settings that asked for it.
fn start_held_conversion() -> (Harness, Arc<Barrier>, Settings) {
    let gate = Arc::new(Barrier::new(2));
    let harness = start_gated(test_settings(4), Duration::ZERO, Some(Arc::clone(&gate)));
    let mut settings = test_settings(4);
    settings.weight_format = WeightFormat::Q4;
    harness.apply(&settings, |_| true);
    harness.wait_for(|event| matches!(event, Event::SettingsProgress { done: 1, .. }));
    (harness, gate, settings)
}

#[test]
fn switching_back_to_the_serving_format_drops_the_conversion() {
    let (harness, gate, mut settings) = start_held_conversion();
    settings.weight_format = WeightFormat::Q8;
    harness.apply(&settings, |applied| {
        applied.weight_format == WeightFormat::Q8
    });
    gate.wait();
    // Give the finished conversion time to be (wrongly) installed by the idle loop.
    std::thread::sleep(Duration::from_millis(200));
    let after = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(last_stats(&after).weight_format, WeightFormat::Q8);
    assert!(!after.iter().any(|event| matches!(
        event,
        Event::SettingsApplied(applied) if applied.weight_format == WeightFormat::Q4
    )));
}

#[test]
fn thread_count_change_rebuilds_the_pool_the_forward_pass_runs_on() {
    let harness = start(test_settings(4), Duration::ZERO);
    harness.generate(1, conversation(&[(Role::User, None, "one")]));
    assert_eq!(
        harness.journal.lock().unwrap().prefill_threads.last(),
        Some(&1)
    );
    let mut settings = test_settings(4);
    settings.threads = 3;
    harness.apply(&settings, |applied| applied.threads == 3);
    let events = harness.generate(2, conversation(&[(Role::User, None, "two")]));
    assert_eq!(
        harness.journal.lock().unwrap().prefill_threads.last(),
        Some(&3)
    );
    assert_eq!(last_stats(&events).threads, 3);
}

#[test]
fn loading_runs_on_the_sessions_pool() {
    let mut settings = test_settings(4);
    settings.threads = 3;
    let harness = start(settings, Duration::ZERO);
    harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    let journal = harness.journal.lock().unwrap();
    // Three threads, not rayon's global pool (one per CPU, and not entered from these threads).
    assert_eq!(journal.load_pools, [(true, 3)]);
    assert_eq!(journal.prefill_threads.last(), Some(&3));
}

#[test]
fn kv_cache_change_makes_a_new_cache_and_re_prefills() {
    let harness = start(test_settings(4), Duration::ZERO);
    let turn = conversation(&[(Role::User, None, "same prompt")]);
    harness.generate(1, turn.clone());
    let (_, reused, prompt) = turn_done(&harness.generate(2, turn.clone()));
    assert_eq!(reused, prompt - 1, "warm cache before the change");

    let mut settings = test_settings(4);
    settings.kv_cache = KvCacheType::F32;
    harness.apply(&settings, |applied| applied.kv_cache == KvCacheType::F32);
    assert_eq!(
        harness.journal.lock().unwrap().sessions.last(),
        Some(&KvCacheType::F32)
    );
    let events = harness.generate(3, turn);
    assert_eq!(turn_done(&events).1, 0, "a new cache reuses nothing");
    assert_eq!(last_stats(&events).kv_cache, KvCacheType::F32);
}

fn with_activations(mut settings: Settings, activations: ActivationFormat) -> Settings {
    settings.activations = activations;
    settings
}

fn conversion_progress(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|event| matches!(event, Event::SettingsProgress { .. }))
        .count()
}

#[test]
fn attention_change_switches_the_session_with_a_new_cache() {
    let harness = start(test_settings(6), Duration::ZERO);
    let turn = conversation(&[(Role::User, None, "same prompt")]);
    let before = harness.generate(1, turn.clone());
    assert_eq!(last_stats(&before).kernel_path, "scalar");
    let (_, reused, prompt) = turn_done(&harness.generate(2, turn.clone()));
    assert_eq!(reused, prompt - 1, "warm cache before the change");

    let mut settings = test_settings(6);
    settings.attention = AttentionArithmetic::Bf16;
    let events = harness.apply(&settings, |applied| {
        applied.attention == AttentionArithmetic::Bf16
    });
    assert_eq!(conversion_progress(&events), 0, "no weights are rebuilt");
    {
        let journal = harness.journal.lock().unwrap();
        assert_eq!(journal.requantizations, 0);
        assert_eq!(journal.session_attention, [AttentionArithmetic::Bf16]);
    }
    let after = harness.generate(3, turn.clone());
    assert_eq!(last_stats(&after).kernel_path, "scalar+bf16");
    assert_eq!(turn_done(&after).1, 0, "the old cache holds other numbers");
    // What a fresh engine loaded with that arithmetic says, and not what the other said.
    let cold = start(settings, Duration::ZERO);
    assert_eq!(
        streamed_text(&after),
        streamed_text(&cold.generate(1, turn.clone()))
    );
    assert_ne!(streamed_text(&after), streamed_text(&before));
    let (_, reused, prompt) = turn_done(&harness.generate(4, turn));
    assert_eq!(reused, prompt - 1, "the new cache is reused");
}

#[test]
fn activation_change_switches_the_session_with_a_new_cache() {
    let harness = start(test_settings(6), Duration::ZERO);
    let turn = conversation(&[(Role::User, None, "same prompt")]);
    let before = harness.generate(1, turn.clone());
    assert_eq!(last_stats(&before).activations, ActivationFormat::Mixed);
    let (_, reused, prompt) = turn_done(&harness.generate(2, turn.clone()));
    assert_eq!(reused, prompt - 1, "warm cache before the change");

    let settings = with_activations(test_settings(6), ActivationFormat::Q8);
    let events = harness.apply(&settings, |applied| {
        applied.activations == ActivationFormat::Q8
    });
    // One report, already with the new format: the switch needs no background work.
    let reports: Vec<&Event> = events
        .iter()
        .filter(|event| matches!(event, Event::SettingsApplied(_)))
        .collect();
    assert_eq!(reports.len(), 1, "{events:?}");
    assert_eq!(conversion_progress(&events), 0);
    {
        let journal = harness.journal.lock().unwrap();
        assert_eq!(journal.requantizations, 0, "the weights are kept");
        assert_eq!(
            journal.session_activations.last(),
            Some(&ActivationFormat::Q8)
        );
    }

    let after = harness.generate(3, turn.clone());
    assert_eq!(last_stats(&after).activations, ActivationFormat::Q8);
    assert_eq!(turn_done(&after).1, 0, "the old cache holds other numbers");
    // What a fresh engine on the new format says, and not what the old format said.
    let cold = start(settings, Duration::ZERO);
    assert_eq!(
        streamed_text(&after),
        streamed_text(&cold.generate(1, turn.clone()))
    );
    assert_ne!(streamed_text(&after), streamed_text(&before));
    let (_, reused, prompt) = turn_done(&harness.generate(4, turn));
    assert_eq!(reused, prompt - 1, "the new cache is reused");
}

#[test]
fn activation_change_during_a_conversion_switches_at_once_and_carries_into_the_new_weights() {
    let gate = Arc::new(Barrier::new(2));
    let harness = start_gated(test_settings(4), Duration::ZERO, Some(Arc::clone(&gate)));
    let turn = conversation(&[(Role::User, None, "hi")]);
    harness.generate(1, turn.clone());
    let mut settings = test_settings(4);
    settings.weight_format = WeightFormat::Q4;
    harness.apply(&settings, |_| true);
    harness.wait_for(|event| matches!(event, Event::SettingsProgress { done: 1, .. }));

    // The conversion is held at 1 of 4 and still reads the serving model; the switch is the
    // session's, so it does not wait for it.
    settings.activations = ActivationFormat::Q8x2;
    let events = harness.apply(&settings, |_| true);
    let applied = last_applied(&events);
    assert_eq!(
        (applied.weight_format, applied.activations),
        (WeightFormat::Q8, ActivationFormat::Q8x2)
    );
    let during = harness.generate(2, turn.clone());
    assert_eq!(last_stats(&during).activations, ActivationFormat::Q8x2);
    assert_eq!(turn_done(&during).1, 0, "the old cache holds other numbers");
    let cold = start(
        with_activations(test_settings(4), ActivationFormat::Q8x2),
        Duration::ZERO,
    );
    assert_eq!(
        streamed_text(&during),
        streamed_text(&cold.generate(1, turn.clone()))
    );

    gate.wait();
    harness.wait_for(|event| {
        matches!(event, Event::SettingsApplied(applied)
            if applied.weight_format == WeightFormat::Q4
                && applied.activations == ActivationFormat::Q8x2)
    });
    let after = harness.generate(3, turn);
    let stats = last_stats(&after);
    assert_eq!(
        (stats.weight_format, stats.activations),
        (WeightFormat::Q4, ActivationFormat::Q8x2)
    );
    let journal = harness.journal.lock().unwrap();
    assert_eq!(journal.requantizations, 1);
    // First session, its switch, and the new weights' session made in the format in force.
    assert_eq!(
        journal.session_activations,
        [
            ActivationFormat::Mixed,
            ActivationFormat::Q8x2,
            ActivationFormat::Q8x2
        ]
    );
}

#[test]
fn activation_change_with_an_abandoned_conversion_applies_at_once() {
    let (harness, gate, mut settings) = start_held_conversion();
    // Back to q8 (the conversion is dropped but its thread still runs) and to q8 activations.
    settings.weight_format = WeightFormat::Q8;
    settings.activations = ActivationFormat::Q8;
    let events = harness.apply(&settings, |_| true);
    let applied = last_applied(&events);
    assert_eq!(
        (applied.weight_format, applied.activations),
        (WeightFormat::Q8, ActivationFormat::Q8)
    );
    let during = harness.generate(1, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(last_stats(&during).activations, ActivationFormat::Q8);
    gate.wait();
    std::thread::sleep(Duration::from_millis(200));
    let after = harness.generate(2, conversation(&[(Role::User, None, "hi")]));
    assert_eq!(
        (
            last_stats(&after).weight_format,
            last_stats(&after).activations
        ),
        (WeightFormat::Q8, ActivationFormat::Q8)
    );
}

#[test]
fn real_model_session_switch_computes_like_a_model_built_that_way() {
    use ossterm::model::{LoadOptions, Model, Preset};
    let build = |activations| {
        let options = LoadOptions {
            activations,
            ..LoadOptions::default()
        };
        Arc::new(Model::synthetic(Preset::Tiny, 5, &options).unwrap())
    };
    let mixed_model = build(ActivationFormat::Mixed);
    let vocab = mixed_model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..40).map(|index| (index * 7919 + 11) % vocab).collect();
    let pool = ossterm::engine::build_pool(2).unwrap();
    let new_session = |model: &Arc<Model>, activations| {
        <Model as ModelBackend>::new_session(model, &pool, 128, KvCacheType::F16, activations)
            .unwrap()
    };

    // Through the worker's traits: made as mixed, switched to q8 with a warm cache.
    let mut session = new_session(&mixed_model, ActivationFormat::Mixed);
    let mixed = InferenceSession::prefill(&mut session, &prompt)
        .unwrap()
        .to_vec();
    InferenceSession::set_activations(&mut session, ActivationFormat::Q8);
    assert_eq!(
        InferenceSession::activations(&session),
        ActivationFormat::Q8
    );
    assert!(session.tokens().is_empty(), "the switch empties the cache");
    let switched = InferenceSession::prefill(&mut session, &prompt)
        .unwrap()
        .to_vec();

    let q8_model = build(ActivationFormat::Q8);
    let mut direct = new_session(&q8_model, ActivationFormat::Q8);
    let direct = InferenceSession::prefill(&mut direct, &prompt).unwrap();
    // Same weights, kernels and chunking: bit for bit what a model built with q8 computes.
    assert_eq!(switched, direct);
    assert_ne!(switched, mixed, "the format reaches the forward pass");
    // A session asked for q8 over the mixed model is the same session.
    let mut asked = new_session(&mixed_model, ActivationFormat::Q8);
    assert_eq!(
        InferenceSession::prefill(&mut asked, &prompt).unwrap(),
        direct
    );
}

#[test]
fn reasoning_effort_change_re_prefills_from_the_system_message() {
    let harness = start(test_settings(4), Duration::ZERO);
    let low = conversation(&[(Role::User, None, "a question")]);
    harness.generate(1, low.clone());
    let mut high = low;
    high.system.reasoning = Some(ReasoningEffort::High);
    let mut settings = test_settings(4);
    settings.reasoning_effort = ReasoningEffort::High;
    assert!(test_settings(4).invalidates_prompt_prefix(&settings));
    harness.apply(&settings, |applied| {
        applied.reasoning_effort == ReasoningEffort::High
    });
    let (_, reused, prompt) = turn_done(&harness.generate(2, high));
    // Only the system marker before the effort word is shared: the whole chat is prefilled again.
    assert_eq!(reused, 1, "reused {reused} of {prompt}");
}

/// The real fast forward pass (synthetic tiny model) behind the engine, with the toy chat format.
fn start_real(settings: Settings) -> Harness {
    start_real_with_tiers(settings, Default::default())
}

fn start_real_with_tiers(
    settings: Settings,
    kv_tiers: ossterm::engine::kv_tiers::TierConfig,
) -> Harness {
    use ossterm::model::{LoadOptions, Model, Precision, Preset};
    let journal = Arc::new(Mutex::new(Journal::default()));
    let sampler_configs = Arc::new(Mutex::new(Vec::new()));
    let (event_sender, events) = mpsc::channel();
    let configs = Arc::clone(&sampler_configs);
    let engine = EngineHandle::spawn(settings, event_sender, move |settings, progress| {
        progress("tiny weights", 0, 1);
        let options = LoadOptions {
            precision: Precision::Fast,
            weights: settings.weight_format,
            kv: settings.kv_cache,
            activations: settings.activations,
            ..LoadOptions::default()
        };
        let model = Model::synthetic(Preset::Tiny, 3, &options)
            .map_err(|error| EngineError::Model(Box::new(error)))?;
        Ok(EngineParts {
            model: Arc::new(model),
            codec: ToyCodec,
            sampler: GreedySampler {
                configured: configs,
            },
            model_label: "synthetic tiny".to_string(),
            random_weights: true,
            kv_tiers,
        })
    });
    Harness::ready(engine, events, journal, sampler_configs)
}

fn notices(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Notice(message) => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn switching_chats_and_back_resumes_from_snapshots_with_the_same_reply() {
    let dir = std::env::temp_dir().join(format!("ossterm-engine-tiers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tiers = ossterm::engine::kv_tiers::TierConfig {
        disk_dir: Some(dir.clone()),
        ..Default::default()
    };
    let harness = start_real_with_tiers(test_settings(6), tiers.clone());
    let chat_a = conversation(&[(Role::User, None, "tell me about the sea")]);
    let chat_b = conversation(&[(Role::User, None, "and now the mountains")]);
    let first_a = harness.generate(1, chat_a.clone());
    harness.generate(2, chat_b.clone());
    // Back to A: its prefix comes from the RAM snapshot, the reply is the one a cold run gives.
    let again_a = harness.generate(3, chat_a.clone());
    let (_, reused, prompt) = turn_done(&again_a);
    assert_eq!(reused, prompt - 1);
    assert!(
        notices(&again_a)
            .iter()
            .any(|n| n.starts_with("Resumed") && n.contains("RAM")),
        "{:?}",
        notices(&again_a)
    );
    assert_eq!(streamed_text(&again_a), streamed_text(&first_a));
    let stats = last_stats(&again_a);
    assert_eq!(stats.kv_tiers.snapshot_hits, 1);
    assert!(stats.kv_tiers.ram_snapshots >= 2);
    drop(harness);

    // A new engine (an app restart) resumes chat B from disk.
    let harness = start_real_with_tiers(test_settings(6), tiers);
    let again_b = harness.generate(1, chat_b.clone());
    let (_, reused, prompt) = turn_done(&again_b);
    assert_eq!(reused, prompt - 1);
    assert!(
        notices(&again_b).iter().any(|n| n.contains("from disk")),
        "{:?}",
        notices(&again_b)
    );
    drop(harness);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn real_model_applies_every_engine_setting_live() {
    let expected_kernels = ossterm::kernels::kernel_path().name().to_string();
    let harness = start_real(test_settings(6));
    let turn = conversation(&[(Role::User, None, "hello there")]);
    let first = harness.generate(1, turn.clone());
    let stats = last_stats(&first);
    assert_eq!(stats.kernel_path, expected_kernels);
    assert_eq!(
        (stats.weight_format, stats.kv_cache, stats.threads),
        (WeightFormat::Q8, KvCacheType::F16, 1)
    );
    assert_eq!(stats.activations, ActivationFormat::Mixed);
    assert!(stats.decode_tokens_per_second.is_some());

    // Weight format: a background conversion reports every matrix, then the new weights serve.
    let mut settings = test_settings(6);
    settings.weight_format = WeightFormat::Q4;
    let events = harness.apply(&settings, |applied| {
        applied.weight_format == WeightFormat::Q4
    });
    let progress: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|event| match event {
            Event::SettingsProgress { done, total, .. } => Some((*done, *total)),
            _ => None,
        })
        .collect();
    let total = progress.last().expect("conversion progress").1;
    // q, k, v and o of each of the 4 layers, then the unembedding.
    assert_eq!(total, 4 * 4 + 1);
    assert_eq!(progress.last(), Some(&(total, total)));
    let after = harness.generate(2, turn.clone());
    assert_eq!(last_stats(&after).weight_format, WeightFormat::Q4);
    assert_eq!(turn_done(&after).1, 0, "new weights, new cache");

    // KV cache type: a new cache of the new type; the next turn re-prefills, the one after reuses.
    settings.kv_cache = KvCacheType::F32;
    harness.apply(&settings, |applied| applied.kv_cache == KvCacheType::F32);
    let cold = harness.generate(3, turn.clone());
    assert_eq!(turn_done(&cold).1, 0);
    assert_eq!(last_stats(&cold).kv_cache, KvCacheType::F32);
    let (_, reused, prompt) = turn_done(&harness.generate(4, turn.clone()));
    assert_eq!(reused, prompt - 1);

    // Activations: switched in place (no conversion), a new cache, the same reply a fresh engine
    // built with them gives.
    settings.activations = ActivationFormat::Q8x2;
    let events = harness.apply(&settings, |applied| {
        applied.activations == ActivationFormat::Q8x2
    });
    assert_eq!(conversion_progress(&events), 0);
    let switched = harness.generate(5, turn.clone());
    assert_eq!(last_stats(&switched).activations, ActivationFormat::Q8x2);
    assert_eq!(turn_done(&switched).1, 0, "new activations, new cache");
    let cold = start_real(settings.clone());
    assert_eq!(
        streamed_text(&switched),
        streamed_text(&cold.generate(1, turn.clone()))
    );

    // Threads: a new pool, and the gauges say so.
    settings.threads = 2;
    harness.apply(&settings, |applied| applied.threads == 2);
    let events = harness.generate(6, turn);
    assert_eq!(last_stats(&events).threads, 2);
    assert!(!events
        .iter()
        .any(|event| matches!(event, Event::Error { .. })));
}

/// Ctrl-O: the engine restores an opened chat's snapshot as soon as the chat is opened (with the
/// "Resumed" notice), and the next turn finds the chat in the live cache.
#[test]
fn opening_a_chat_resumes_its_snapshot_before_the_next_turn() {
    let harness = start_real_with_tiers(
        test_settings(6),
        ossterm::engine::kv_tiers::TierConfig::default(),
    );
    let chat_a = conversation(&[(Role::User, None, "tell me about the sea")]);
    let first_a = harness.generate(1, chat_a.clone());
    let (_, _, prompt_a) = turn_done(&first_a);
    harness.generate(
        2,
        conversation(&[(Role::User, None, "and now the mountains")]),
    );

    // Chat A as its file holds it: the question and the reply.
    let reply = streamed_text(&first_a);
    let mut opened = conversation(&[
        (Role::User, None, "tell me about the sea"),
        (Role::Assistant, Some(Channel::Final), &reply),
    ]);
    harness
        .engine
        .send(Command::Resume(Box::new(opened.clone())))
        .unwrap();
    let events =
        harness.wait_for(|event| matches!(event, Event::Notice(n) if n.starts_with("Resumed")));
    let notice = notices(&events).pop().unwrap();
    assert!(notice.contains("from RAM"), "{notice}");
    let resumed: u64 = notice
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.replace(',', "").parse().ok())
        .expect("a token count");
    assert!(
        resumed >= prompt_a,
        "{notice}, the chat's prompt was {prompt_a}"
    );

    // The next message: the live cache already holds the chat, nothing more to resume.
    opened
        .messages
        .push(conversation(&[(Role::User, None, "and the fish?")]).messages[0].clone());
    let next = harness.generate(3, opened);
    let (_, reused, _) = turn_done(&next);
    assert!(reused >= resumed, "reused {reused}, resumed {resumed}");
    assert!(
        !notices(&next).iter().any(|n| n.starts_with("Resumed")),
        "{:?}",
        notices(&next)
    );
}
