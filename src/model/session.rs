//! A session: one conversation's tokens and KV cache over a shared model, computed on the
//! session's own thread pool.
//!
//! A forward call splits its tokens into chunks and runs them on the pool the session holds
//! (`ThreadPool::install`, which costs nothing when the caller already runs on that pool, as a
//! generation loop does); a decoded token runs on a team of that pool's threads. What belongs to
//! the sequence (its ids and cache, [`Sequence`]) is kept apart from what one call needs (scratch
//! buffers, logits), so one call can serve several sequences: [`Session::forward_batch`] runs the
//! new tokens of many sequences (a server's streams) as the rows of one pass, each attending to
//! its own cache, so the weights are read once for all of them.

use std::sync::Arc;

use rayon::ThreadPool;

use super::exact;
use super::fast::{self, FastPass};
use super::kv::{KvShape, KvStore, RowSpan};
use super::options::{ActivationFormat, AttentionArithmetic, KvFormat, Precision};
use super::profile::{PassProfile, ProfileCounts, SharedProfile};
use super::snapshot::{KvSnapshot, SnapshotError};
use super::team::{with_team, Team};
use super::Model;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    #[error("the context holds {limit} tokens; {needed} were asked for")]
    ContextFull { limit: usize, needed: usize },
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("nothing to process: the token list is empty")]
    Empty,
    #[error("every row's logits were asked of step {step}, but the pass has {steps} steps")]
    NoSuchStep { step: usize, steps: usize },
    #[error("a batch holds at most {limit} tokens; {rows} were asked for")]
    BatchTooLarge { limit: usize, rows: usize },
    #[error("the sequence's cache holds {found} elements; this session computes with {expected}")]
    KvFormatMismatch {
        expected: &'static str,
        found: &'static str,
    },
}

/// One sequence's state: the ids its cache holds and the cache.
pub struct Sequence {
    tokens: Vec<u32>,
    pub(super) kv: KvStore,
}

/// One sequence's part of a batched forward call: the tokens to append to it.
pub struct SequenceStep<'a> {
    pub sequence: &'a mut Sequence,
    pub tokens: &'a [u32],
}

/// The logits of every row of one step of a pass (a prompt scored at each position: a server's
/// `echo` with `logprobs`, the logits tool), handed to `row` in the step's order. The pass
/// holds a block of rows at a time, never rows x vocabulary.
pub struct AllLogits<'a> {
    /// Which step of the pass.
    pub step: usize,
    pub row: &'a mut (dyn FnMut(&[f32]) + Send),
}

impl Sequence {
    /// Tokens in the cache: the position of the next token.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The ids the cache holds, for prefix reuse.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Rewinds the cache to its first `len` tokens (later positions are overwritten, so this is
    /// free).
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }

    /// Makes this sequence hold the first `len` tokens of `other` (at most what `other` holds and
    /// this cache has room for), copying their keys and values: a prefix computed once serves
    /// another sequence. Both caches must have the same element type; returns the tokens copied.
    pub fn copy_prefix_from(&mut self, other: &Sequence, len: usize) -> usize {
        let len = len.min(other.len()).min(self.context_limit());
        if self.kv.copy_prefix_from(&other.kv, len) {
            self.tokens.clear();
            self.tokens.extend_from_slice(&other.tokens[..len]);
            len
        } else {
            0
        }
    }

    fn new(model: &Model, context_limit: usize, kv: KvFormat) -> Sequence {
        Sequence {
            tokens: Vec::with_capacity(context_limit),
            kv: KvStore::new(kv, &model.config, context_limit),
        }
    }

    /// Tokens the cache has room for.
    pub fn context_limit(&self) -> usize {
        self.kv.positions()
    }
}

/// The buffers of the path the model computes with, reused by every call.
enum Scratch {
    Exact(Box<exact::Scratch>),
    Fast(Box<fast::Scratch>),
}

impl Scratch {
    fn profile(&mut self) -> &mut PassProfile {
        match self {
            Scratch::Exact(scratch) => &mut scratch.profile,
            Scratch::Fast(scratch) => &mut scratch.profile,
        }
    }
}

/// One conversation's state over a shared model: its sequence, the pool it computes on, scratch
/// space, the logits of the last processed token and the activation format the fast path
/// computes with.
pub struct Session {
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    sequence: Sequence,
    /// A property of the session, not of the shared model, so it can change while other holders
    /// (a weight conversion thread) read the model.
    activations: ActivationFormat,
    /// Likewise: the model's kernels carry the loader's choice, each session applies its own.
    attention: AttentionArithmetic,
    scratch: Scratch,
    logits: Vec<f32>,
    /// The logits of each step of the last batched call, [steps x vocab]; grows to the largest
    /// batch once.
    batch_logits: Vec<f32>,
    /// What the passes recorded (router choices, decode phase times), for the engine to report.
    profile: SharedProfile,
}

impl Session {
    /// A session with room for `context_limit` tokens (at least one) whose cache holds `kv`
    /// elements (the exact path always keeps f32), computing on `pool`.
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        context_limit: usize,
        kv: KvFormat,
    ) -> Session {
        let c = &model.config;
        let context_limit = context_limit.max(1);
        let (kv, scratch) = match model.fast {
            None => (
                KvFormat::F32,
                Scratch::Exact(Box::new(exact::Scratch::new(c))),
            ),
            Some(_) => (kv, Scratch::Fast(Box::new(fast::Scratch::new(c)))),
        };
        let session = Session {
            sequence: Sequence::new(&model, context_limit, kv),
            logits: vec![0.0; c.vocab_size],
            batch_logits: Vec::new(),
            profile: Arc::new(std::sync::Mutex::new(ProfileCounts::new(
                c.num_hidden_layers,
                c.num_local_experts,
            ))),
            activations: model.activations,
            attention: model.attention,
            scratch,
            pool,
            model,
        };
        session.prepare_pool_threads();
        session
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The pool this session computes on. A loop of many forward calls (a generation) runs
    /// inside `pool().install(..)`, so each call finds itself on the pool already instead of
    /// handing its work over from another thread.
    pub fn pool(&self) -> &Arc<ThreadPool> {
        &self.pool
    }

    /// Moves the session's computation to `pool` (a new thread count); the cache stays.
    pub fn set_pool(&mut self, pool: Arc<ThreadPool>) {
        self.pool = pool;
        self.prepare_pool_threads();
    }

    /// Sizes the fast path's per-thread scratch on every thread of the pool, so that a thread
    /// does not allocate it the first time it picks up such a task in a generation.
    fn prepare_pool_threads(&self) {
        if let Scratch::Fast(_) = self.scratch {
            let config = &self.model.config;
            self.pool
                .broadcast(|_| fast::prepare_thread_scratch(config));
        }
    }

    /// The figures the passes fold into after every call: the router's choices per layer and
    /// expert, and the phase times of decode steps. The holder drains them with
    /// [`ProfileCounts::take_into`].
    pub fn profile(&self) -> SharedProfile {
        Arc::clone(&self.profile)
    }

    /// Turns the timing of decode phases on or off (the router's choices are counted either way).
    pub fn set_profile_timing(&mut self, on: bool) {
        self.scratch.profile().set_timing(on);
    }

    /// Times prefill passes too, phase by phase, each counted as one step (`bench --profile`).
    pub fn set_profile_prefill_timing(&mut self, on: bool) {
        self.scratch.profile().set_prefill_timing(on);
    }

    /// Adds what the scratch recorded to the shared figures, unless their reader holds them just
    /// now (then the next call adds both).
    fn fold_profile(&mut self) {
        if let Ok(mut shared) = self.profile.try_lock() {
            self.scratch.profile().fold_into(&mut shared);
        }
    }

    /// Tokens in the KV cache.
    pub fn len(&self) -> usize {
        self.sequence.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequence.tokens.is_empty()
    }

    /// The ids the KV cache holds, for prefix reuse.
    pub fn tokens(&self) -> &[u32] {
        &self.sequence.tokens
    }

    pub fn context_limit(&self) -> usize {
        self.sequence.context_limit()
    }

    /// Rewinds the cache to its first `len` tokens. Later positions are simply overwritten, so
    /// this is free; the logits of the last token are stale until the next prefill or decode.
    pub fn truncate(&mut self, len: usize) {
        self.sequence.tokens.truncate(len);
    }

    /// How the fast path quantizes the inputs of its quantized products (the exact path keeps f32).
    pub fn activations(&self) -> ActivationFormat {
        self.activations
    }

    /// Switches the activation format. A change empties the cache: its keys and values were
    /// computed from inputs quantized the other way, so continuing from them would match neither
    /// format. The same format keeps the cache, which is still what that format computes.
    pub fn set_activations(&mut self, format: ActivationFormat) {
        if format != self.activations {
            self.activations = format;
            self.truncate(0);
        }
    }

    /// The arithmetic of the fast path's attention over an f16 cache.
    pub fn attention(&self) -> AttentionArithmetic {
        self.attention
    }

    /// Switches the attention arithmetic. As [`Session::set_activations`], a change empties the
    /// cache: later layers' keys and values depend on earlier layers' attention, so rows computed
    /// the other way would match neither arithmetic.
    pub fn set_attention(&mut self, attention: AttentionArithmetic) {
        if attention != self.attention {
            self.attention = attention;
            self.truncate(0);
        }
    }

    /// What this session's attention multiplies on.
    pub fn attention_products(&self) -> super::AttentionProducts {
        self.model
            .attention_products_with(self.attention, self.activations, self.kv_format())
    }

    /// Whether this session's attention runs on bf16 dot products.
    pub fn uses_bf16_attention(&self) -> bool {
        self.attention_products() == super::AttentionProducts::Bf16
    }

    /// The element type the KV cache holds.
    pub fn kv_format(&self) -> KvFormat {
        self.sequence.kv.format()
    }

    /// Identifies what computed this session's cache rows: the weights (the model's fingerprint),
    /// the path, the weight and activation formats, the kernels and whether the fast path's experts
    /// and Q8 matrices are tiled. A snapshot restores only into
    /// a session with the same value, so its rows are exactly what this session would compute.
    pub fn kv_fingerprint(&self) -> u64 {
        let model = &*self.model;
        let options = model.options();
        let path = match model.precision {
            Precision::Exact => "exact",
            Precision::Fast => model.kernels.path().name(),
        };
        // The kernels may sum tiled experts in another order than row-order ones. Row order adds
        // nothing, so snapshots written before tiles existed still restore.
        let tiled = model.precision == Precision::Fast
            && model.weights.layers.iter().any(|layer| {
                [&layer.gate_up, &layer.down]
                    .iter()
                    .any(|experts| experts.layout() == crate::kernels::Mxfp4Layout::Tiles)
            });
        // Likewise the Q8 matrices the conversion tiled (AVX-512, AVX2): one token's products
        // sum in another order than the row-order GEMV.
        let tiled_q8 = model.fast.as_ref().is_some_and(|fast| {
            matches!(&fast.lm_head, crate::model::convert::DenseMatrix::Q8(m) if m.is_tiled())
        });
        let layout = match (tiled, tiled_q8) {
            (true, true) => " tiled experts tiled q8",
            (true, false) => " tiled experts",
            (false, true) => " tiled q8",
            (false, false) => "",
        };
        // bf16 and int8 attention compute other rows than f32; f32 adds nothing, so snapshots
        // written before the choice existed (or on CPUs without it) still restore.
        let arithmetic = match self.attention_products().name() {
            Some(name) => format!(" {name} attention"),
            None => String::new(),
        };
        let identity = format!(
            "{:016x} {:?} {} {} {path}{layout}{arithmetic}",
            model.fingerprint,
            model.precision,
            options.weights.name(),
            self.activations.name(),
        );
        xxhash_rust::xxh3::xxh3_64(identity.as_bytes())
    }

    /// The state after every token the cache holds, with the last token's logits, restorable to
    /// any prefix.
    pub fn snapshot(&self) -> Result<KvSnapshot, SnapshotError> {
        self.snapshot_restorable_from(0)
    }

    /// [`Session::snapshot`] for restores of `floor` tokens or more only: the sliding-window
    /// layers keep just the rows such restores read (a query at position `floor` sees the last
    /// `sliding_window` of them), about half the snapshot of a long chat.
    pub fn snapshot_restorable_from(&self, floor: usize) -> Result<KvSnapshot, SnapshotError> {
        if self.is_empty() {
            return Err(SnapshotError::Empty);
        }
        let len = self.len();
        let rows = RowSpan::restorable_from(&self.model.config, floor.min(len));
        let tensors = self.sequence.kv.capture(len, &rows);
        KvSnapshot::new(
            self.kv_fingerprint(),
            self.sequence.kv.shape(),
            rows,
            self.sequence.tokens.clone(),
            self.logits.clone(),
            tensors,
        )
    }

    /// Replaces the cache with the first `len` tokens of `snapshot`. With all of them the logits
    /// are the snapshot's (the last token's); with fewer they are stale, as after
    /// [`Session::truncate`], until the next prefill or decode. Nothing changes on an error.
    pub fn restore(&mut self, snapshot: &KvSnapshot, len: usize) -> Result<(), SnapshotError> {
        let expected = self.kv_fingerprint();
        if snapshot.fingerprint != expected {
            return Err(SnapshotError::Fingerprint {
                expected,
                found: snapshot.fingerprint,
            });
        }
        if snapshot.format() != self.kv_format() {
            return Err(SnapshotError::Format {
                expected: self.kv_format(),
                found: snapshot.format(),
            });
        }
        let shape = KvShape::of(&self.model.config);
        if snapshot.shape != shape {
            return Err(SnapshotError::Shape {
                expected: shape,
                found: snapshot.shape,
            });
        }
        let expected_rows = RowSpan::all(&self.model.config);
        if (&snapshot.rows.sliding, snapshot.rows.window)
            != (&expected_rows.sliding, expected_rows.window)
        {
            return Err(SnapshotError::Layers {
                expected: expected_rows.window,
                found: snapshot.rows.window,
            });
        }
        let limit = self.context_limit();
        if len == 0 || len > snapshot.len() || len > limit {
            return Err(SnapshotError::Length {
                len,
                tokens: snapshot.len(),
                limit,
            });
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&token) = snapshot.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(SnapshotError::TokenOutOfRange { token, vocab });
        }
        if snapshot.logits.len() != vocab {
            return Err(SnapshotError::Logits {
                expected: vocab,
                found: snapshot.logits.len(),
            });
        }
        if len < snapshot.min_restore() {
            return Err(SnapshotError::Window {
                len,
                min: snapshot.min_restore(),
            });
        }
        self.sequence
            .kv
            .restore(&snapshot.tensors, &snapshot.rows, snapshot.len(), len);
        self.sequence.tokens.clear();
        self.sequence
            .tokens
            .extend_from_slice(&snapshot.tokens[..len]);
        if len == snapshot.len() {
            self.logits.copy_from_slice(&snapshot.logits);
        }
        Ok(())
    }

    /// Logits of the last processed token.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// Appends `tokens` to the context and returns the logits of the last one.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ForwardError> {
        self.check(tokens)?;
        self.run(tokens, None);
        Ok(&self.logits)
    }

    /// Like [`Session::prefill`], but appends the logits of every position to `all_logits`
    /// (row-major [tokens x vocab]).
    pub fn prefill_all_logits(
        &mut self,
        tokens: &[u32],
        all_logits: &mut Vec<f32>,
    ) -> Result<(), ForwardError> {
        self.check(tokens)?;
        self.run(tokens, Some(all_logits));
        Ok(())
    }

    /// Appends one token and returns its logits.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], ForwardError> {
        self.prefill(std::slice::from_ref(&token))
    }

    /// Tokens the forward pass processes at once; callers that report prefill progress or check
    /// for cancellation step by this much.
    pub fn chunk_len(&self) -> usize {
        match self.scratch {
            Scratch::Exact(_) => exact::PREFILL_CHUNK,
            Scratch::Fast(_) => fast::PREFILL_CHUNK,
        }
    }

    fn check(&self, tokens: &[u32]) -> Result<(), ForwardError> {
        check_step(&self.model, &self.sequence, tokens)
    }

    /// A sequence of its own (not the session's) with room for `context_limit` tokens and the
    /// session's cache format, for [`Session::forward_batch`].
    pub fn new_sequence(&self, context_limit: usize) -> Sequence {
        Sequence::new(&self.model, context_limit.max(1), self.kv_format())
    }

    /// Appends each step's tokens to its sequence in one forward pass: the steps' tokens are the
    /// rows of one batch (at most [`Session::chunk_len`] in all), each attending to its own
    /// sequence's cache, and the experts multiply the rows routed to them together whichever
    /// sequence they belong to. Afterwards [`Session::batch_logits`] holds each step's logits
    /// after its last token. Checks every step before computing anything.
    pub fn forward_batch(&mut self, steps: &mut [SequenceStep<'_>]) -> Result<(), ForwardError> {
        self.forward_batch_scoring(steps, None)
    }

    /// [`Session::forward_batch`], also handing every row's logits of the step `all` names to
    /// its callback (in the weight format's full unembedding), before the pass returns.
    pub fn forward_batch_scoring(
        &mut self,
        steps: &mut [SequenceStep<'_>],
        all: Option<AllLogits<'_>>,
    ) -> Result<(), ForwardError> {
        if let Some(all) = &all {
            if all.step >= steps.len() {
                return Err(ForwardError::NoSuchStep {
                    step: all.step,
                    steps: steps.len(),
                });
            }
        }
        let mut rows = 0;
        for step in steps.iter() {
            check_step(&self.model, step.sequence, step.tokens)?;
            if step.sequence.kv.format() != self.kv_format() {
                return Err(ForwardError::KvFormatMismatch {
                    expected: self.kv_format().name(),
                    found: step.sequence.kv.format().name(),
                });
            }
            rows += step.tokens.len();
        }
        if rows == 0 {
            return Err(ForwardError::Empty);
        }
        let limit = self.chunk_len();
        if rows > limit {
            return Err(ForwardError::BatchTooLarge { limit, rows });
        }
        let vocab = self.model.config.vocab_size;
        if self.batch_logits.len() < steps.len() * vocab {
            self.batch_logits.resize(steps.len() * vocab, 0.0);
        }
        let pool = Arc::clone(&self.pool);
        pool.install(|| {
            let Session {
                model,
                scratch,
                batch_logits,
                activations,
                attention,
                ..
            } = self;
            forward(
                model,
                &pool,
                (*activations, *attention),
                scratch,
                steps,
                rows,
                batch_logits,
                all,
            );
        });
        for step in steps.iter_mut() {
            step.sequence.tokens.extend_from_slice(step.tokens);
        }
        self.fold_profile();
        Ok(())
    }

    /// The logits after the last token of step `index` of the last [`Session::forward_batch`].
    pub fn batch_logits(&self, index: usize) -> &[f32] {
        let vocab = self.model.config.vocab_size;
        &self.batch_logits[index * vocab..(index + 1) * vocab]
    }

    /// [`Session::batch_logits`], to adjust before sampling (a server's logit bias and
    /// repetition penalties).
    pub fn batch_logits_mut(&mut self, index: usize) -> &mut [f32] {
        let vocab = self.model.config.vocab_size;
        &mut self.batch_logits[index * vocab..(index + 1) * vocab]
    }

    /// Runs `tokens` chunk by chunk on the session's pool.
    fn run(&mut self, tokens: &[u32], mut all_logits: Option<&mut Vec<f32>>) {
        let pool = Arc::clone(&self.pool);
        let chunk_len = self.chunk_len();
        pool.install(|| {
            for chunk in tokens.chunks(chunk_len) {
                let Session {
                    model,
                    sequence,
                    scratch,
                    logits,
                    activations,
                    attention,
                    ..
                } = self;
                let mut steps = [SequenceStep {
                    sequence,
                    tokens: chunk,
                }];
                let mut append = all_logits
                    .as_deref_mut()
                    .map(|out| move |row: &[f32]| out.extend_from_slice(row));
                let all = append.as_mut().map(|append| AllLogits {
                    step: 0,
                    row: append,
                });
                forward(
                    model,
                    &pool,
                    (*activations, *attention),
                    scratch,
                    &mut steps,
                    chunk.len(),
                    logits,
                    all,
                );
                sequence.tokens.extend_from_slice(chunk);
            }
        });
        self.fold_profile();
    }
}

/// Refuses a step that would not fit its sequence or names a token outside the vocabulary.
fn check_step(model: &Model, sequence: &Sequence, tokens: &[u32]) -> Result<(), ForwardError> {
    if tokens.is_empty() {
        return Err(ForwardError::Empty);
    }
    let needed = sequence.len() + tokens.len();
    let limit = sequence.context_limit();
    if needed > limit {
        return Err(ForwardError::ContextFull { limit, needed });
    }
    let vocab = model.config.vocab_size;
    if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ForwardError::TokenOutOfRange { token, vocab });
    }
    Ok(())
}

/// Most rows a pass runs on a team: every decode step of a server's batch (one row per
/// sequence, up to 64 sequences), and a few joining prompt rows. Inside a team, the activation
/// quantization of 16 or more rows (which goes parallel on rayon) runs on the leader alone, as
/// the team's threads spin rather than steal: for a few dozen rows that is microseconds, while
/// rayon's sleeping threads would cost a wake-up per region of the ~100 a step has. A prefill
/// chunk's regions are long and its quantization is not: those go to rayon.
pub const TEAM_ROWS: usize = 96;

/// One pass over `rows` tokens of `steps`, on a thread of `pool`.
#[allow(clippy::too_many_arguments)]
fn forward(
    model: &Model,
    pool: &ThreadPool,
    (activations, attention): (ActivationFormat, AttentionArithmetic),
    scratch: &mut Scratch,
    steps: &mut [SequenceStep<'_>],
    rows: usize,
    logits: &mut [f32],
    all_logits: Option<AllLogits<'_>>,
) {
    match scratch {
        Scratch::Exact(scratch) => exact::forward(model, steps, scratch, logits, all_logits),
        Scratch::Fast(scratch) => {
            let run = |team: Option<&Team>| {
                let pass = FastPass {
                    config: &model.config,
                    weights: &model.weights,
                    fast: model
                        .fast
                        .as_ref()
                        .expect("a fast session has fast weights"),
                    rope: &model.rope,
                    kernels: attention.apply(model.kernels),
                    activations,
                    team,
                };
                pass.forward(steps, scratch, logits, all_logits)
            };
            // A decode step is ~100 short parallel regions: the team keeps the pool awake
            // through it, also for a server's batch of sequences (see TEAM_ROWS).
            if rows <= TEAM_ROWS {
                with_team(pool, run)
            } else {
                run(None)
            }
        }
    }
}
