//! The generation loop of `ossterm run` (and of the allocation test): reuse the cached prefix,
//! prefill the rest of the prompt in chunks, then sample, parse and decode token by token,
//! reporting every event through a callback. Nothing is allocated per token. The app's engine
//! thread (`worker.rs`) still runs a loop of its own over the same steps.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::chat::{HarmonyParser, ParseEvent, StopToken, Tokenizer};
use crate::model::{ForwardError, Session};

use super::sampler::{Sampler, SamplerError};

/// Prompt tokens per prefill call for sessions that do not say how many they batch.
pub const PREFILL_STEP: usize = 256;

/// What the generation loop needs from a model: the KV-cached session of [`crate::model`]. A
/// trait so the loop can be tested without weights.
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
    /// `done` of `total` prompt tokens are in the cache (`total` counts reused ones too).
    PrefillProgress {
        done: usize,
        total: usize,
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

/// Generates a reply to `prompt` (a harmony prompt ending in `<|start|>assistant`).
///
/// The session keeps whatever it already holds that matches the start of the prompt; the rest is
/// prefilled. `cancel` is checked between prefill steps and between tokens; a cancelled run still
/// returns its result, with what was generated reported through `on_event` already.
pub fn generate<S: InferenceSession>(
    session: &mut S,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    sampler: &mut Sampler,
    limits: GenerateLimits,
    cancel: &AtomicBool,
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
    let mut result = GenerateResult {
        stop_reason: StopReason::Cancelled,
        prompt_tokens: prompt.len(),
        reused_tokens: 0,
        generated_tokens: 0,
        prefill_time: Duration::ZERO,
        time_to_first_token: Duration::ZERO,
        decode_time: Duration::ZERO,
    };

    // At least the last prompt token is processed again: its logits pick the first token.
    let reused = common_prefix_len(session.tokens(), prompt).min(prompt.len() - 1);
    session.truncate(reused);
    result.reused_tokens = reused;
    on_event(GenerateEvent::PrefillProgress {
        done: reused,
        total: prompt.len(),
    });

    let mut done = reused;
    let mut token = None;
    for step in prompt[reused..].chunks(session.prefill_chunk().max(1)) {
        if cancel.load(Ordering::Relaxed) {
            result.prefill_time = started.elapsed();
            return Ok(result);
        }
        let logits = session.prefill(step).map_err(forward_error)?;
        done += step.len();
        if done == prompt.len() {
            token = Some(sampler.sample(logits)?);
        }
        on_event(GenerateEvent::PrefillProgress {
            done,
            total: prompt.len(),
        });
    }
    result.prefill_time = started.elapsed();
    // The loop above always runs its last step: `reused < prompt.len()`.
    let Some(mut token) = token else {
        return Ok(result);
    };
    result.time_to_first_token = started.elapsed();
    let first_token_at = Instant::now();

    let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
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
        if cancel.load(Ordering::Relaxed) {
            break StopReason::Cancelled;
        }
        if session.tokens().len() >= context_limit {
            break StopReason::ContextFull;
        }
        let logits = session.decode(token).map_err(forward_error)?;
        token = sampler.sample(logits)?;
    };
    if stop_token.is_none() {
        parser.finish(&mut |event| on_event(GenerateEvent::Parsed(event)));
    }
    result.stop_reason = stop_reason;
    result.decode_time = first_token_at.elapsed();
    Ok(result)
}

/// Length of the longest common prefix of two id sequences.
pub fn common_prefix_len(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
