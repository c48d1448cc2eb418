//! A session: one conversation's tokens and KV cache over a shared model, computed on the
//! session's own thread pool.
//!
//! A forward call splits its tokens into chunks and runs them on the pool the session holds
//! (`ThreadPool::install`, which costs nothing when the caller already runs on that pool, as a
//! generation loop does); a decoded token runs on a team of that pool's threads. What belongs to
//! the sequence (its ids and cache, [`Sequence`]) is kept apart from what one call needs (scratch
//! buffers, logits), so a call can later serve several sequences.

use std::sync::Arc;

use rayon::ThreadPool;

use super::exact;
use super::fast::{self, FastPass};
use super::kv::{KvShape, KvStore};
use super::options::{ActivationFormat, KvFormat, Precision};
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
}

/// One sequence's state: the ids its cache holds and the cache.
pub struct Sequence {
    tokens: Vec<u32>,
    kv: KvStore,
}

impl Sequence {
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
    scratch: Scratch,
    logits: Vec<f32>,
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
            activations: model.activations,
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

    /// The element type the KV cache holds.
    pub fn kv_format(&self) -> KvFormat {
        self.sequence.kv.format()
    }

    /// Identifies what computed this session's cache rows: the weights (the model's fingerprint),
    /// the path, the weight and activation formats and the kernels. A snapshot restores only into
    /// a session with the same value, so its rows are exactly what this session would compute.
    pub fn kv_fingerprint(&self) -> u64 {
        let model = &*self.model;
        let options = model.options();
        let path = match model.precision {
            Precision::Exact => "exact",
            Precision::Fast => model.kernels.path().name(),
        };
        let identity = format!(
            "{:016x} {:?} {} {} {path}",
            model.fingerprint,
            model.precision,
            options.weights.name(),
            self.activations.name(),
        );
        xxhash_rust::xxh3::xxh3_64(identity.as_bytes())
    }

    /// The state after every token the cache holds, with the last token's logits.
    pub fn snapshot(&self) -> Result<KvSnapshot, SnapshotError> {
        if self.is_empty() {
            return Err(SnapshotError::Empty);
        }
        let len = self.len();
        KvSnapshot::new(
            self.kv_fingerprint(),
            self.sequence.kv.shape(),
            self.sequence.tokens.clone(),
            self.logits.clone(),
            self.sequence.kv.capture(len),
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
        self.sequence
            .kv
            .restore(&snapshot.tensors, snapshot.len(), len);
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
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let needed = self.len() + tokens.len();
        let limit = self.context_limit();
        if needed > limit {
            return Err(ForwardError::ContextFull { limit, needed });
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ForwardError::TokenOutOfRange { token, vocab });
        }
        Ok(())
    }

    /// Runs `tokens` chunk by chunk on the session's pool; a single token of the fast path
    /// (decode) on a team of its threads: a decode step is ~100 short parallel regions, and the
    /// team keeps the pool awake through them. A prefill chunk's regions are long, and its
    /// activation quantization uses rayon, as does the exact path.
    fn run(&mut self, tokens: &[u32], mut all_logits: Option<&mut Vec<f32>>) {
        let pool = Arc::clone(&self.pool);
        if let ([_], Scratch::Fast(_)) = (tokens, &self.scratch) {
            with_team(&pool, |team| self.forward_chunk(tokens, all_logits, team));
        } else {
            let chunk_len = self.chunk_len();
            pool.install(|| {
                for chunk in tokens.chunks(chunk_len) {
                    self.forward_chunk(chunk, all_logits.as_deref_mut(), None);
                }
            });
        }
    }

    /// One chunk of the sequence, on a thread of the pool.
    fn forward_chunk(
        &mut self,
        tokens: &[u32],
        all_logits: Option<&mut Vec<f32>>,
        team: Option<&Team>,
    ) {
        let model = &*self.model;
        let sequence = &mut self.sequence;
        let start = sequence.tokens.len();
        let logits = &mut self.logits;
        match &mut self.scratch {
            Scratch::Exact(scratch) => exact::forward_chunk(
                model,
                tokens,
                start,
                &mut sequence.kv,
                scratch,
                logits,
                all_logits,
            ),
            Scratch::Fast(scratch) => {
                let pass = FastPass {
                    config: &model.config,
                    weights: &model.weights,
                    fast: model
                        .fast
                        .as_ref()
                        .expect("a fast session has fast weights"),
                    rope: &model.rope,
                    kernels: model.kernels,
                    activations: self.activations,
                    team,
                };
                pass.forward_chunk(tokens, start, &mut sequence.kv, scratch, logits, all_logits)
            }
        }
        sequence.tokens.extend_from_slice(tokens);
    }
}
