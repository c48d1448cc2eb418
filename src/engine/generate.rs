//! The generation loop of the app's engine thread, `ossterm run` and the benchmark: reuse the
//! cached prefix, prefill the rest of the prompt in chunks, then sample, parse and decode token by
//! token, reporting every event through a callback. Nothing is allocated per token.

use std::time::{Duration, Instant};

use crate::chat::{HarmonyParser, ParseEvent, StopToken};
use crate::model::profile::SharedProfile;
use crate::model::{
    ActivationFormat, AttentionArithmetic, ForwardError, KvFormat, KvSnapshot, Session,
    SnapshotError,
};

use super::sampler::{Sampler, SamplerError, SamplerSettings};

/// Prompt tokens per prefill call for sessions that do not say how many they batch.
pub const PREFILL_STEP: usize = 256;

/// What the generation loop and the engine thread need from a model: the KV-cached session of
/// [`crate::model`]. A trait so both can be tested without weights.
pub trait InferenceSession {
    type Error: std::error::Error + Send + Sync + 'static;
    /// Appends tokens to the cache and returns the logits after the last one.
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], Self::Error>;
    /// Appends one token and returns the logits after it.
    fn decode(&mut self, token: u32) -> Result<&[f32], Self::Error>;
    /// The ids the cache holds.
    fn tokens(&self) -> &[u32];
    /// Rewinds the cache to its first `len` tokens.
    fn truncate(&mut self, len: usize);
    fn context_limit(&self) -> usize;
    /// Tokens the forward pass multiplies at once. Prefill steps by this much, so each step is
    /// one batched pass and Ctrl-C and progress are checked between them.
    fn prefill_chunk(&self) -> usize {
        PREFILL_STEP
    }
    /// How the inputs of quantized products are quantized.
    fn activations(&self) -> ActivationFormat;
    /// Switches the activation format; a change empties the cache, whose keys and values were
    /// computed the other way.
    fn set_activations(&mut self, format: ActivationFormat);
    /// The arithmetic of attention over an f16 cache.
    fn attention(&self) -> AttentionArithmetic;
    /// Switches the attention arithmetic; a change empties the cache, as for the activations.
    fn set_attention(&mut self, attention: AttentionArithmetic);
    /// What computed the cache rows and their element type, for KV snapshots; `None` for a
    /// session that cannot snapshot (then the engine keeps no tiers for it).
    fn kv_identity(&self) -> Option<(u64, KvFormat)> {
        None
    }
    /// The state after every cached token, restorable to `floor` tokens or more.
    fn snapshot_restorable_from(&self, floor: usize) -> Result<KvSnapshot, SnapshotError> {
        let _ = floor;
        Err(SnapshotError::Empty)
    }
    /// Replaces the cache with the first `len` tokens of `snapshot`.
    fn restore(&mut self, snapshot: &KvSnapshot, len: usize) -> Result<(), SnapshotError> {
        let _ = (snapshot, len);
        Err(SnapshotError::Empty)
    }
    /// What the passes record about themselves (router choices, decode phase times), for the
    /// engine view; `None` for a session that records nothing.
    fn profile(&self) -> Option<SharedProfile> {
        None
    }
    /// Experts per token of the model (top-k), for the routing view.
    fn experts_per_token(&self) -> usize {
        0
    }
    /// Bytes one decoded token reads from memory with `context` tokens in the cache, for the
    /// roofline.
    fn decode_bytes_per_token(&self, context: usize) -> Option<u64> {
        let _ = context;
        None
    }
}

/// The streaming parser of one reply (harmony's, or a test's toy format).
pub trait ReplyParser {
    /// Reads one sampled token; a [`ParseEvent::Stop`] ends the reply.
    fn push(&mut self, token: u32, on_event: &mut dyn FnMut(ParseEvent<'_>));
    /// Ends a reply cut short (no stop token): flushes text, closes an open message.
    fn finish(&mut self, on_event: &mut dyn FnMut(ParseEvent<'_>));
}

impl ReplyParser for HarmonyParser<'_> {
    fn push(&mut self, token: u32, mut on_event: &mut dyn FnMut(ParseEvent<'_>)) {
        HarmonyParser::push(self, token, &mut on_event)
    }
    fn finish(&mut self, mut on_event: &mut dyn FnMut(ParseEvent<'_>)) {
        HarmonyParser::finish(self, &mut on_event)
    }
}

/// Picks the next token from logits.
pub trait TokenSampler {
    fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError>;
    /// New settings between generations; invalid ones are refused and the old ones kept.
    fn configure(&mut self, settings: SamplerSettings) -> Result<(), SamplerError>;
}

impl TokenSampler for Sampler {
    fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        Sampler::sample(self, logits)
    }
    fn configure(&mut self, settings: SamplerSettings) -> Result<(), SamplerError> {
        *self = Sampler::new(settings)?;
        Ok(())
    }
}

impl InferenceSession for Session {
    type Error = ForwardError;
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], ForwardError> {
        Session::prefill(self, tokens)
    }
    fn decode(&mut self, token: u32) -> Result<&[f32], ForwardError> {
        Session::decode(self, token)
    }
    fn tokens(&self) -> &[u32] {
        Session::tokens(self)
    }
    fn truncate(&mut self, len: usize) {
        Session::truncate(self, len)
    }
    fn context_limit(&self) -> usize {
        Session::context_limit(self)
    }
    fn prefill_chunk(&self) -> usize {
        Session::chunk_len(self)
    }
    fn activations(&self) -> ActivationFormat {
        Session::activations(self)
    }
    fn set_activations(&mut self, format: ActivationFormat) {
        Session::set_activations(self, format)
    }
    fn attention(&self) -> AttentionArithmetic {
        Session::attention(self)
    }
    fn set_attention(&mut self, attention: AttentionArithmetic) {
        Session::set_attention(self, attention)
    }
    fn kv_identity(&self) -> Option<(u64, KvFormat)> {
        Some((Session::kv_fingerprint(self), Session::kv_format(self)))
    }
    fn snapshot_restorable_from(&self, floor: usize) -> Result<KvSnapshot, SnapshotError> {
        Session::snapshot_restorable_from(self, floor)
    }
    fn restore(&mut self, snapshot: &KvSnapshot, len: usize) -> Result<(), SnapshotError> {
        Session::restore(self, snapshot, len)
    }
    fn profile(&self) -> Option<SharedProfile> {
        Some(Session::profile(self))
    }
    fn experts_per_token(&self) -> usize {
        self.model().config.num_experts_per_tok
    }
    fn decode_bytes_per_token(&self, context: usize) -> Option<u64> {
        Some(self.model().decode_bytes_per_token(context))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is {prompt_tokens} tokens but the context holds only {context_limit}; shorten the conversation or raise the context limit")]
    PromptTooLong {
        prompt_tokens: usize,
        context_limit: usize,
    },
    #[error("the prompt is empty: a harmony prompt ends in <|start|>assistant")]
    EmptyPrompt,
    #[error("sampling failed: {0}")]
    Sampler(#[from] SamplerError),
    #[error("the forward pass failed: {0}")]
    Forward(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the logits after {position} tokens are not finite ({value} at token id {token}): the weights hold NaN or infinity (check with `ossterm info --check`)")]
    NonFiniteLogits {
        position: usize,
        token: usize,
        value: f32,
    },
    /// A checkpoint shard changed on disk mid-generation; the last step read zeros from it, so
    /// its logits are discarded. Everything reported through the callback before is valid.
    #[error(transparent)]
    WeightsChanged(#[from] crate::fault::MappingChanged),
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// `<|return|>`: the final answer is complete.
    Return,
    /// `<|call|>`: the model called a tool.
    ToolCall,
    /// `<|endoftext|>`.
    EndOfText,
    /// The token budget ran out.
    MaxTokens,
    /// The KV cache is full.
    ContextFull,
    /// The cancel flag was set.
    Cancelled,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Return => "return",
            StopReason::ToolCall => "tool_call",
            StopReason::EndOfText => "end_of_text",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
            StopReason::Cancelled => "cancelled",
        }
    }
}

impl From<StopToken> for StopReason {
    fn from(stop: StopToken) -> StopReason {
        match stop {
            StopToken::Return => StopReason::Return,
            StopToken::Call => StopReason::ToolCall,
            StopToken::EndOfText => StopReason::EndOfText,
        }
    }
}

/// Reported while generating. Strings borrow from the parser until the callback returns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GenerateEvent<'a> {
    /// `done` of `total` prompt tokens are in the cache, `reused` of them from an earlier turn.
    /// Sent once the cache is rewound, then after every prefill step.
    PrefillProgress {
        done: usize,
        total: usize,
        reused: usize,
    },
    /// A token was sampled (before it is parsed).
    Token {
        id: u32,
    },
    Parsed(ParseEvent<'a>),
}

/// Counts and timings of one generation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateResult {
    pub stop_reason: StopReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV entries were already in the session (prefix reuse).
    pub reused_tokens: usize,
    /// Tokens sampled, including a final stop token.
    pub generated_tokens: usize,
    /// From the call to the end of prefill.
    pub prefill_time: Duration,
    /// From the call to the first sampled token.
    pub time_to_first_token: Duration,
    /// From the first sampled token to the last.
    pub decode_time: Duration,
}

impl GenerateResult {
    /// Prompt tokens actually processed per second of prefill.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens - self.reused_tokens, self.prefill_time)
    }

    /// Tokens per second after the first one.
    pub fn decode_tokens_per_second(&self) -> f64 {
        per_second(self.generated_tokens.saturating_sub(1), self.decode_time)
    }
}

fn per_second(count: usize, time: Duration) -> f64 {
    if count == 0 || time.is_zero() {
        0.0
    } else {
        count as f64 / time.as_secs_f64()
    }
}

/// Limits of one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GenerateLimits {
    /// Most tokens to sample; `None` runs until a stop token or the end of the context.
    pub max_tokens: Option<usize>,
}

fn forward_error<E: std::error::Error + Send + Sync + 'static>(error: E) -> GenerateError {
    GenerateError::Forward(Box::new(error))
}

/// Generates a reply to `prompt` (a prompt ending in `<|start|>assistant`), read by `parser`.
///
/// The session keeps whatever it already holds that matches the start of the prompt; the rest is
/// prefilled in steps of [`InferenceSession::prefill_chunk`]. `cancelled` is asked before every
/// prefill step and every decoded token, so a cancel takes effect within one of either; a cancelled
/// run still returns its result, with what was generated reported through `on_event` already.
/// Every stop rule is here: a stop token, `limits.max_tokens`, a full cache, a cancel.
pub fn generate<S: InferenceSession + ?Sized>(
    session: &mut S,
    parser: &mut impl ReplyParser,
    prompt: &[u32],
    sampler: &mut impl TokenSampler,
    limits: GenerateLimits,
    cancelled: impl Fn() -> bool,
    mut on_event: impl FnMut(GenerateEvent<'_>),
) -> Result<GenerateResult, GenerateError> {
    let started = Instant::now();
    let context_limit = session.context_limit();
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if prompt.len() > context_limit {
        return Err(GenerateError::PromptTooLong {
            prompt_tokens: prompt.len(),
            context_limit,
        });
    }
    // A shard rewritten since the last turn would give this one mixed weights: refuse up front.
    crate::fault::verify_files()?;
    let mut result = GenerateResult {
        stop_reason: StopReason::Cancelled,
        prompt_tokens: prompt.len(),
        reused_tokens: 0,
        generated_tokens: 0,
        prefill_time: Duration::ZERO,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
    };

    let reused = rewind_for_prompt(session, prompt);
    result.reused_tokens = reused;
    on_event(GenerateEvent::PrefillProgress {
        done: reused,
        total: prompt.len(),
        reused,
    });

    let mut done = reused;
    let mut token = None;
    for step in prompt[reused..].chunks(session.prefill_chunk().max(1)) {
        if cancelled() {
            result.prefill_time = started.elapsed();
            return Ok(result);
        }
        let logits = session.prefill(step).map_err(forward_error)?;
        crate::fault::check()?;
        done += step.len();
        if done == prompt.len() {
            check_logits(logits, done)?;
            token = Some(sampler.sample(logits)?);
        }
        on_event(GenerateEvent::PrefillProgress {
            done,
            total: prompt.len(),
            reused,
        });
    }
    result.prefill_time = started.elapsed();
    // The loop above always runs its last step: `reused < prompt.len()`.
    let Some(mut token) = token else {
        return Ok(result);
    };
    if limits.max_tokens == Some(0) {
        result.stop_reason = StopReason::MaxTokens;
        return Ok(result);
    }
    result.time_to_first_token = started.elapsed();
    let first_token_at = Instant::now();

    let mut stop_token = None;
    let stop_reason = loop {
        result.generated_tokens += 1;
        on_event(GenerateEvent::Token { id: token });
        parser.push(token, &mut |event| {
            if let ParseEvent::Stop(stop) = event {
                stop_token = Some(stop);
            }
            on_event(GenerateEvent::Parsed(event));
        });
        if let Some(stop) = stop_token {
            break StopReason::from(stop);
        }
        if limits
            .max_tokens
            .is_some_and(|max| result.generated_tokens >= max)
        {
            break StopReason::MaxTokens;
        }
        if cancelled() {
            break StopReason::Cancelled;
        }
        if session.tokens().len() >= context_limit {
            break StopReason::ContextFull;
        }
        let logits = session.decode(token).map_err(forward_error)?;
        crate::fault::check()?;
        check_logits(logits, prompt.len() + result.generated_tokens)?;
        token = sampler.sample(logits)?;
    };
    if stop_token.is_none() {
        parser.finish(&mut |event| on_event(GenerateEvent::Parsed(event)));
    }
    result.stop_reason = stop_reason;
    result.decode_time = first_token_at.elapsed();
    // Rewritten in place during this turn: what it streamed came partly from other weights.
    crate::fault::verify_files()?;
    Ok(result)
}

/// Refuses logits holding NaN or infinity: they come from broken weights, and sampling around
/// them would turn the damage into plausible-looking ids. `position` is the tokens processed.
pub fn check_logits(logits: &[f32], position: usize) -> Result<(), GenerateError> {
    // A branch-free OR over the whole row vectorizes; the slow search runs only on failure.
    if logits.iter().fold(false, |bad, v| bad | !v.is_finite()) {
        let token = logits.iter().position(|v| !v.is_finite()).unwrap_or(0);
        return Err(GenerateError::NonFiniteLogits {
            position,
            token,
            value: logits[token],
        });
    }
    Ok(())
}

/// Rewinds `session` to the longest prefix it shares with `prompt` and returns how many tokens
/// that keeps. At least one prompt token is always left to prefill: its logits pick the first
/// token, and the cache keeps no logits.
pub fn rewind_for_prompt<S: InferenceSession + ?Sized>(session: &mut S, prompt: &[u32]) -> usize {
    let reused = common_prefix_len(session.tokens(), prompt).min(prompt.len().saturating_sub(1));
    session.truncate(reused);
    reused
}

/// Length of the longest common prefix of two id sequences.
pub fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Restores into `session` the snapshot of `tiers` that covers the longest prefix of `prompt`,
/// when it covers more than the live cache already does. Returns what was resumed (tokens, tier,
/// time including the disk read). The caller then runs [`generate`], which keeps the restored
/// prefix and prefills only the rest.
pub fn resume_from_tiers<S: InferenceSession + ?Sized>(
    session: &mut S,
    tiers: &mut super::kv_tiers::KvTiers,
    prompt: &[u32],
) -> Option<Resumed> {
    let (fingerprint, format) = session.kv_identity()?;
    let started = Instant::now();
    let live = common_prefix_len(session.tokens(), prompt).min(prompt.len().saturating_sub(1));
    let found = tiers.best(fingerprint, format, prompt, live)?;
    match session.restore(&found.snapshot, found.matched) {
        Ok(()) => {
            tiers.record_hit();
            Some(Resumed {
                tokens: found.matched,
                tier: found.tier,
                took: started.elapsed(),
            })
        }
        // `best` matched the identity, so this is a shape or length problem: prefill instead.
        Err(_) => None,
    }
}

/// A prefix resumed from a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resumed {
    pub tokens: usize,
    pub tier: super::kv_tiers::Tier,
    pub took: Duration,
}

impl Resumed {
    /// "resumed 4,096 tokens from disk in 0.3 s"
    pub fn describe(&self) -> String {
        format!(
            "resumed {} tokens from {} in {:.1} s",
            group_thousands(self.tokens as u64),
            self.tier.name(),
            self.took.as_secs_f64()
        )
    }
}

/// 4096 -> "4,096".
pub fn group_thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_with_any_nan_or_infinity_are_an_error_naming_the_first() {
        let mut logits = vec![0.5f32; 1000];
        assert!(check_logits(&logits, 4).is_ok());
        logits[700] = f32::NEG_INFINITY;
        logits[900] = f32::NAN;
        let error = check_logits(&logits, 4).unwrap_err();
        assert!(matches!(
            error,
            GenerateError::NonFiniteLogits {
                position: 4,
                token: 700,
                ..
            }
        ));
        assert!(error.to_string().contains("not finite"), "{error}");
    }
}
