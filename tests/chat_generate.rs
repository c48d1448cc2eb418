//! The generation loop over a scripted session (exact control of the output) and over the
//! synthetic tiny model (the real forward pass).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ossterm::chat::{
    render_for_completion, Channel, ChatMessage, Conversation, HarmonyParser, ParseEvent,
    RenderOptions, Tokenizer,
};
use ossterm::engine::{
    generate, GenerateError, GenerateEvent, GenerateLimits, GenerateResult, InferenceSession,
    Sampler, SamplerSettings, StopReason,
};
use ossterm::model::{ActivationFormat, AttentionArithmetic, LoadOptions, Model, Preset};

/// A session whose logits make greedy sampling emit `script` after the prompt.
struct ScriptedSession {
    prompt_len: usize,
    script: Vec<u32>,
    tokens: Vec<u32>,
    limit: usize,
    logits: Vec<f32>,
    prefilled: Vec<usize>,
    activations: ActivationFormat,
    attention: AttentionArithmetic,
}

impl ScriptedSession {
    fn new(prompt_len: usize, script: Vec<u32>, limit: usize) -> Self {
        ScriptedSession {
            prompt_len,
            script,
            tokens: Vec::new(),
            limit,
            logits: vec![0.0; 201_088],
            prefilled: Vec::new(),
            activations: ActivationFormat::default(),
            attention: AttentionArithmetic::default(),
        }
    }

    fn next_logits(&mut self) -> &[f32] {
        self.logits.fill(0.0);
        let step = self.tokens.len() - self.prompt_len;
        // Past the script the model babbles token 100 ("E").
        let next = self.script.get(step).copied().unwrap_or(100);
        self.logits[next as usize] = 10.0;
        &self.logits
    }
}

impl InferenceSession for ScriptedSession {
    type Error = Infallible;
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], Infallible> {
        assert!(
            self.tokens.len() + tokens.len() <= self.limit,
            "prefill past the context"
        );
        self.prefilled.push(tokens.len());
        self.tokens.extend_from_slice(tokens);
        Ok(self.next_logits())
    }
    fn decode(&mut self, token: u32) -> Result<&[f32], Infallible> {
        assert!(self.tokens.len() < self.limit, "decode past the context");
        self.tokens.push(token);
        Ok(self.next_logits())
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }
    fn context_limit(&self) -> usize {
        self.limit
    }
    fn activations(&self) -> ActivationFormat {
        self.activations
    }
    fn set_activations(&mut self, format: ActivationFormat) {
        if format != self.activations {
            self.activations = format;
            self.tokens.clear();
        }
    }
    fn attention(&self) -> AttentionArithmetic {
        self.attention
    }
    fn set_attention(&mut self, attention: AttentionArithmetic) {
        if attention != self.attention {
            self.attention = attention;
            self.tokens.clear();
        }
    }
}

fn tokenizer() -> &'static Tokenizer {
    Tokenizer::shared().unwrap()
}

fn prompt() -> Vec<u32> {
    let conversation = Conversation {
        messages: vec![ChatMessage::user("What is 2 + 2?")],
        ..Conversation::default()
    };
    render_for_completion(tokenizer(), &conversation, &RenderOptions::default()).unwrap()
}

/// Runs greedy generation and collects (reasoning, answer, result).
fn run(
    session: &mut impl InferenceSession,
    prompt: &[u32],
    max_tokens: Option<usize>,
    cancel_after: Option<usize>,
) -> Result<(String, String, GenerateResult), GenerateError> {
    let mut sampler = Sampler::new(SamplerSettings::greedy()).unwrap();
    let cancel = AtomicBool::new(false);
    let (mut reasoning, mut answer, mut sampled) = (String::new(), String::new(), 0);
    let result = generate(
        session,
        &mut HarmonyParser::after_prompt(tokenizer(), "assistant"),
        prompt,
        &mut sampler,
        GenerateLimits { max_tokens },
        || cancel.load(Ordering::Relaxed),
        |event| match event {
            GenerateEvent::Token { .. } => {
                sampled += 1;
                if cancel_after == Some(sampled) {
                    cancel.store(true, Ordering::Relaxed);
                }
            }
            GenerateEvent::Parsed(ParseEvent::Text { channel, text }) => match channel {
                Some(Channel::Analysis) => reasoning.push_str(text),
                _ => answer.push_str(text),
            },
            _ => {}
        },
    )?;
    Ok((reasoning, answer, result))
}

fn script(completion: &str) -> Vec<u32> {
    tokenizer().encode_with_special_tokens(completion).unwrap()
}

const COMPLETION: &str = "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4<|return|>";

#[test]
fn streams_reasoning_and_answer_and_stops_at_return() {
    let prompt = prompt();
    let script = script(COMPLETION);
    let mut session = ScriptedSession::new(prompt.len(), script.clone(), 4096);
    let (reasoning, answer, result) = run(&mut session, &prompt, None, None).unwrap();
    assert_eq!(reasoning, "Simple arithmetic.");
    assert_eq!(answer, "2 + 2 = 4");
    assert_eq!(result.stop_reason, StopReason::Return);
    assert_eq!(result.prompt_tokens, prompt.len());
    assert_eq!(result.generated_tokens, script.len());
    // The stop token is sampled but never decoded into the cache.
    assert_eq!(session.tokens.len(), prompt.len() + script.len() - 1);
}

#[test]
fn max_tokens_context_end_and_cancel_stop_with_their_reason() {
    let prompt = prompt();
    let script = script(COMPLETION);
    let mut session = ScriptedSession::new(prompt.len(), script.clone(), 4096);
    let (_, _, result) = run(&mut session, &prompt, Some(5), None).unwrap();
    assert_eq!(
        (result.stop_reason, result.generated_tokens),
        (StopReason::MaxTokens, 5)
    );

    let mut session = ScriptedSession::new(prompt.len(), script.clone(), prompt.len() + 3);
    let (reasoning, _, result) = run(&mut session, &prompt, None, None).unwrap();
    assert_eq!(
        (result.stop_reason, result.generated_tokens),
        (StopReason::ContextFull, 4)
    );
    assert_eq!(reasoning, "Simple");

    let mut session = ScriptedSession::new(prompt.len(), script, 4096);
    let (reasoning, _, result) = run(&mut session, &prompt, None, Some(6)).unwrap();
    assert_eq!(
        (result.stop_reason, result.generated_tokens),
        (StopReason::Cancelled, 6)
    );
    assert_eq!(reasoning, "Simple arithmetic.");
}

#[test]
fn prompt_longer_than_the_context_is_an_error_with_the_numbers() {
    let prompt = prompt();
    let mut session = ScriptedSession::new(prompt.len(), Vec::new(), 10);
    let error = run(&mut session, &prompt, None, None)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&format!("{} tokens", prompt.len())),
        "{error}"
    );
    assert!(error.contains("only 10"), "{error}");
}

#[test]
fn a_following_turn_reuses_the_cached_prefix() {
    let prompt = prompt();
    let mut session = ScriptedSession::new(prompt.len(), script(COMPLETION), 4096);
    run(&mut session, &prompt, None, None).unwrap();
    let cached = session.tokens.len();
    // Next turn: the same prompt plus more (what the re-rendered conversation starts with).
    let mut next_prompt = prompt.clone();
    next_prompt.extend(script("<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>user<|message|>Thanks<|end|><|start|>assistant"));
    session.prompt_len = next_prompt.len();
    session.prefilled.clear();
    let (_, _, result) = run(&mut session, &next_prompt, Some(1), None).unwrap();
    // The analysis message and the next <|start|> match the cache; the roles differ after that.
    let shared = prompt.len() + 8;
    assert!(shared < cached);
    assert_eq!(result.reused_tokens, shared);
    assert_eq!(session.prefilled, [next_prompt.len() - shared]);
    // The very same prompt again: only its last token is processed.
    session.prefilled.clear();
    session.truncate(next_prompt.len());
    let (_, _, result) = run(&mut session, &next_prompt, Some(1), None).unwrap();
    assert_eq!(result.reused_tokens, next_prompt.len() - 1);
    assert_eq!(session.prefilled, [1]);
}

#[test]
fn synthetic_tiny_model_generates_and_reuses_its_cache_exactly() {
    let model = Arc::new(Model::synthetic(Preset::Tiny, 0, &LoadOptions::default()).unwrap());
    let pool = ossterm::engine::build_pool(2).unwrap();
    let prompt = prompt();
    let cold = |max_tokens| {
        let mut session = model.new_session(&pool, 512);
        let mut sampler = Sampler::new(SamplerSettings {
            seed: Some(3),
            ..SamplerSettings::default()
        })
        .unwrap();
        let mut ids = Vec::new();
        let result = generate(
            &mut session,
            &mut HarmonyParser::after_prompt(tokenizer(), "assistant"),
            &prompt,
            &mut sampler,
            GenerateLimits {
                max_tokens: Some(max_tokens),
            },
            || false,
            |event| {
                if let GenerateEvent::Token { id } = event {
                    ids.push(id);
                }
            },
        )
        .unwrap();
        (ids, result, session)
    };
    let (ids, result, mut session) = cold(12);
    assert_eq!(ids.len(), result.generated_tokens);
    assert!(result.generated_tokens >= 1 && result.generated_tokens <= 12);
    assert!(ids.iter().all(|&id| (id as usize) < 201_088));
    // Same seed, same model: the same tokens, even when the cache already holds the prompt.
    let (again, _, _) = cold(12);
    assert_eq!(ids, again);
    let mut sampler = Sampler::new(SamplerSettings {
        seed: Some(3),
        ..SamplerSettings::default()
    })
    .unwrap();
    let mut warm_ids = Vec::new();
    let warm = generate(
        &mut session,
        &mut HarmonyParser::after_prompt(tokenizer(), "assistant"),
        &prompt,
        &mut sampler,
        GenerateLimits {
            max_tokens: Some(12),
        },
        || false,
        |event| {
            if let GenerateEvent::Token { id } = event {
                warm_ids.push(id);
            }
        },
    )
    .unwrap();
    assert_eq!(warm.reused_tokens, prompt.len() - 1);
    assert_eq!(warm_ids, ids);
}
