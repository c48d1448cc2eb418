//! `POST /v1/completions`, the legacy text-completion API that editors' completion plugins,
//! llama-server and vLLM clients still use: a raw prompt (text, where harmony's special tokens
//! are read as such, or token ids) continued as plain text, with no harmony rendering or parsing.

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{
    check_fits, choice_count, logit_adjustments, sampler_settings, stop_strings, ApiError, ChatJob,
    StopField, StreamOptions, TextMode, MAX_CHOICES, MAX_TOP_LOGPROBS,
};
use super::reply::{LogprobEntry, PromptLogprobs};
use super::structured::{structured_output, OutputConstraint, ResponseFormatField};
use crate::chat::Tokenizer;

/// OpenAI's default reply length on this endpoint (vLLM's too).
pub const DEFAULT_MAX_TOKENS: u64 = 16;

/// `prompt`: a string, token ids, or a list of either holding one prompt (a request is one
/// completion here).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The fields of a completions request this server reads; others are ignored.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: PromptField,
    /// Fill-in-the-middle text after the completion: refused (gpt-oss has no such tokens).
    #[serde(default)]
    pub suffix: Option<String>,
    #[serde(default)]
    pub max_tokens: Option<u64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    #[serde(default)]
    pub top_k: Option<u64>,
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<StopField>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u64>,
    #[serde(default)]
    pub best_of: Option<u64>,
    /// The prompt's text before the completion's.
    #[serde(default)]
    pub echo: Option<bool>,
    /// Log-probabilities of each completion token and of the `logprobs` likeliest tokens.
    #[serde(default)]
    pub logprobs: Option<u64>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    /// vLLM's extension: leave special tokens out of the text (the default) or write them.
    #[serde(default)]
    pub skip_special_tokens: Option<bool>,
    /// vLLM's extension: the whole completion held to JSON (`json_object`) or a schema
    /// (`json_schema`), from its first token (the prompt is the caller's: nothing describes the
    /// format to the model).
    #[serde(default)]
    pub response_format: Option<ResponseFormatField>,
}

/// The jobs of a completions request, one per prompt (`prompt` may list several, as vLLM takes
/// it), each with that prompt's text when `echo` asks for it.
pub fn prepare_completion(
    request: CompletionRequest,
    tokenizer: &Tokenizer,
    context: usize,
) -> Result<Vec<(ChatJob, Option<String>)>, ApiError> {
    let choices = choice_count(request.n)?;
    if request.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(
            "only `best_of` = 1 is supported",
            Some("best_of"),
        ));
    }
    if request.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid(
            "`suffix` is not supported: gpt-oss has no fill-in-the-middle tokens",
            Some("suffix"),
        ));
    }
    let encode = |text: &str| {
        tokenizer.encode_with_special_tokens(text).map_err(|error| {
            ApiError::invalid(format!("cannot encode the prompt: {error}"), Some("prompt"))
        })
    };
    let prompts: Vec<Vec<u32>> = match request.prompt {
        PromptField::Text(text) => vec![encode(&text)?],
        PromptField::Texts(texts) => texts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
        PromptField::Tokens(ids) => vec![ids],
        PromptField::TokenLists(lists) => lists,
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid(
            "`prompt` is an empty list: give at least one prompt",
            Some("prompt"),
        ));
    }
    if (prompts.len() * choices) as u64 > MAX_CHOICES {
        return Err(ApiError::invalid(
            format!(
                "{} prompts x `n` {choices} make {} completions; at most {MAX_CHOICES} per request",
                prompts.len(),
                prompts.len() * choices
            ),
            Some("prompt"),
        ));
    }
    let vocab = tokenizer.vocab_size();
    let logprobs = match request.logprobs {
        Some(top) if top > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                format!("`logprobs` is {top}; at most {MAX_TOP_LOGPROBS}"),
                Some("logprobs"),
            ))
        }
        top => top.map(|top| top as usize),
    };
    let echo = request.echo.unwrap_or(false);
    // The echoed prompt's tokens get theirs too, as OpenAI's legacy API and vLLM report them:
    // what evaluation harnesses score a continuation with.
    let prompt_logprobs = logprobs.filter(|_| echo);
    let skip_special_tokens = request.skip_special_tokens.unwrap_or(true);
    let sampler = sampler_settings(
        (request.temperature, request.top_p),
        (request.top_k, request.min_p),
        request.seed,
    )?;
    let adjustments = logit_adjustments(
        request.logit_bias.as_ref(),
        (request.frequency_penalty, request.presence_penalty),
        vocab,
    )?;
    let stop = stop_strings(request.stop)?;
    let constraint = structured_output(request.response_format, "response_format")?
        .map(|structured| structured.constraint);
    let several = prompts.len() > 1;
    let mut jobs = Vec::with_capacity(prompts.len());
    for (index, prompt) in prompts.into_iter().enumerate() {
        // With several prompts an error names the one it is about.
        let which = if several {
            format!("`prompt[{index}]`")
        } else {
            "`prompt`".to_owned()
        };
        if prompt.is_empty() {
            return Err(ApiError::invalid(
                format!("{which} is empty: give at least one token of text"),
                Some("prompt"),
            ));
        }
        if let Some(id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("{which} holds token {id}; token ids are below {vocab}"),
                Some("prompt"),
            ));
        }
        check_fits(&which, prompt.len(), context, "prompt")?;
        let room = context - prompt.len();
        let max_tokens = match request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS) {
            // Only the echoed prompt (and its log-probabilities): scoring a text, as OpenAI's
            // legacy API and vLLM allow.
            0 if echo => 0,
            0 => {
                return Err(ApiError::invalid(
                    "`max_tokens` must be at least 1 (0 only with `echo`)",
                    Some("max_tokens"),
                ))
            }
            max => max.min(room as u64) as usize,
        };
        let echoed = echo.then(|| prompt_text(tokenizer, &prompt, skip_special_tokens));
        let job = ChatJob {
            sampler,
            adjustments: adjustments.clone(),
            stop: stop.clone(),
            prompt,
            max_tokens,
            stream: request.stream.unwrap_or(false),
            include_usage: request
                .stream_options
                .as_ref()
                .is_some_and(|options| options.include_usage),
            choices,
            tools: false,
            forced: Vec::new(),
            logprobs,
            prompt_logprobs,
            text: TextMode::Raw {
                skip_special_tokens,
            },
            constraint: constraint.as_ref().map(OutputConstraint::fork),
            tool_constraints: Vec::new(),
            call: None,
        };
        jobs.push((job, echoed));
    }
    Ok(jobs)
}

/// The prompt's tokens as the completion would write them.
fn prompt_text(tokenizer: &Tokenizer, prompt: &[u32], skip_special_tokens: bool) -> String {
    let mut bytes = Vec::new();
    for &id in prompt {
        if skip_special_tokens && Tokenizer::is_special(id) {
            continue;
        }
        if let Ok(token) = tokenizer.token_bytes(id) {
            bytes.extend_from_slice(token);
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The legacy `logprobs` object of a choice: per token its text, log-probability, the likeliest
/// alternatives (text to log-probability) and its offset in the choice's text, which begins
/// `offset` bytes into the completion. Returns the object and the offset after these tokens.
pub fn legacy_logprobs(entries: &[LogprobEntry], offset: usize) -> (Value, usize) {
    legacy_logprobs_after(None, entries, offset)
}

/// [`legacy_logprobs`] after the echoed prompt's tokens (`echo` with `logprobs`), which start
/// at offset 0: the first with null log-probability and alternatives, as nothing predicts it.
pub fn legacy_logprobs_after(
    prompt: Option<&PromptLogprobs>,
    entries: &[LogprobEntry],
    mut offset: usize,
) -> (Value, usize) {
    let (mut tokens, mut token_logprobs, mut top, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if let Some(prompt) = prompt {
        tokens.push(json!(prompt.first));
        token_logprobs.push(Value::Null);
        top.push(Value::Null);
        offsets.push(json!(0));
        let mut at = prompt.first.len();
        for entry in &prompt.rest {
            push_legacy(
                entry,
                at,
                (&mut tokens, &mut token_logprobs, &mut top, &mut offsets),
            );
            at += entry.sampled.token.len();
        }
    }
    for entry in entries {
        push_legacy(
            entry,
            offset,
            (&mut tokens, &mut token_logprobs, &mut top, &mut offsets),
        );
        offset += entry.sampled.token.len();
    }
    let value = json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    });
    (value, offset)
}

/// The legacy lists' items for one token at `offset`.
fn push_legacy(
    entry: &LogprobEntry,
    offset: usize,
    (tokens, token_logprobs, top, offsets): (
        &mut Vec<Value>,
        &mut Vec<Value>,
        &mut Vec<Value>,
        &mut Vec<Value>,
    ),
) {
    tokens.push(json!(entry.sampled.token));
    token_logprobs.push(json!(entry.sampled.logprob));
    let alternatives: serde_json::Map<String, Value> = entry
        .top
        .iter()
        .map(|t| (t.token.clone(), json!(t.logprob)))
        .collect();
    top.push(Value::Object(alternatives));
    offsets.push(json!(offset));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The job of a one-prompt request.
    fn prepare(body: &str) -> Result<(ChatJob, Option<String>), ApiError> {
        let mut jobs = prepare_all(body)?;
        assert_eq!(jobs.len(), 1, "{body}");
        Ok(jobs.remove(0))
    }

    fn prepare_all(body: &str) -> Result<Vec<(ChatJob, Option<String>)>, ApiError> {
        let request: CompletionRequest = super::super::api::parse_json(body.as_bytes())?;
        prepare_completion(request, Tokenizer::shared().unwrap(), 64)
    }

    #[test]
    fn several_prompts_are_one_job_each() {
        let jobs =
            prepare_all(r#"{"prompt": ["Hello", "Hi there"], "n": 2, "echo": true}"#).unwrap();
        let tokenizer = Tokenizer::shared().unwrap();
        let texts: Vec<String> = jobs
            .iter()
            .map(|(job, _)| tokenizer.decode(&job.prompt).unwrap())
            .collect();
        assert_eq!(texts, ["Hello", "Hi there"]);
        assert!(jobs.iter().all(|(job, _)| job.choices == 2));
        assert_eq!(jobs[1].1.as_deref(), Some("Hi there"));
        let ids = prepare_all(r#"{"prompt": [[1, 2], [3]]}"#).unwrap();
        assert_eq!(ids[1].0.prompt, vec![3]);
        // A bad prompt is named by its index; too many completions in all are refused.
        let error = prepare_all(r#"{"prompt": ["a", ""]}"#).unwrap_err();
        assert!(error.message.contains("prompt[1]"), "{}", error.message);
        let error = prepare_all(r#"{"prompt": ["a", "b", "c"], "n": 6}"#).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("prompt"));
        assert!(prepare_all(r#"{"prompt": []}"#).is_err());
    }

    #[test]
    fn a_text_prompt_keeps_harmony_tokens_and_takes_sixteen_tokens_by_default() {
        let (job, echo) = prepare(r#"{"prompt": "<|start|>user<|message|>hi"}"#).unwrap();
        let tokenizer = Tokenizer::shared().unwrap();
        assert_eq!(job.prompt[0], crate::chat::tokenizer::special::START);
        assert_eq!(
            tokenizer.decode(&job.prompt).unwrap(),
            "<|start|>user<|message|>hi"
        );
        assert_eq!(job.max_tokens, 16);
        assert_eq!(
            job.text,
            TextMode::Raw {
                skip_special_tokens: true
            }
        );
        assert!(echo.is_none() && !job.stream && job.forced.is_empty());
    }

    #[test]
    fn token_prompts_lists_of_one_and_echo() {
        let ids = Tokenizer::shared().unwrap().encode_text("Hello,").unwrap();
        let body = format!(
            r#"{{"prompt": [{ids:?}], "echo": true, "max_tokens": 1000, "skip_special_tokens": false}}"#
        );
        let (job, echo) = prepare(&body).unwrap();
        assert_eq!(job.prompt, ids);
        assert_eq!(echo.as_deref(), Some("Hello,"));
        // Capped by the context (64) less the prompt.
        assert_eq!(job.max_tokens, 64 - ids.len());
        let (job, _) = prepare(r#"{"prompt": ["Hello"], "stop": "x", "logprobs": 2}"#).unwrap();
        assert_eq!(job.stop, vec!["x".to_string()]);
        assert_eq!(job.logprobs, Some(2));
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_name() {
        for (body, param) in [
            (r#"{"prompt": "a", "n": 17}"#, "n"),
            (r#"{"prompt": "a", "best_of": 3}"#, "best_of"),
            (r#"{"prompt": "a", "suffix": "b"}"#, "suffix"),
            (r#"{"prompt": []}"#, "prompt"),
            (r#"{"prompt": ""}"#, "prompt"),
            (r#"{"prompt": [300000]}"#, "prompt"),
            (r#"{"prompt": "a", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "a", "logprobs": 21}"#, "logprobs"),
            (r#"{"prompt": "a", "temperature": -1}"#, "temperature"),
            (r#"{"prompt": "a", "stop": ["1","2","3","4","5"]}"#, "stop"),
            (r#"{"prompt": "a", "logit_bias": {"x": 1}}"#, "logit_bias"),
            (r#"{"prompt": 5}"#, "prompt"),
        ] {
            let error = prepare(body).expect_err(body);
            assert_eq!(error.param.as_deref(), Some(param), "{body}: {error:?}");
        }
        let long = format!(r#"{{"prompt": "{}"}}"#, "word ".repeat(100));
        let error = prepare(&long).expect_err("too long");
        assert_eq!(error.code, Some("context_length_exceeded"));
        assert!(prepare(r#"{"max_tokens": 3}"#).is_err(), "no prompt");
    }

    #[test]
    fn echo_with_logprobs_scores_the_prompt_and_may_generate_nothing() {
        let (job, echo) =
            prepare(r#"{"prompt": "Hello there", "echo": true, "logprobs": 2}"#).unwrap();
        assert_eq!((job.logprobs, job.prompt_logprobs), (Some(2), Some(2)));
        assert_eq!(echo.as_deref(), Some("Hello there"));
        let (job, _) = prepare(r#"{"prompt": "Hi", "logprobs": 2}"#).unwrap();
        assert_eq!(
            job.prompt_logprobs, None,
            "without echo only the reply is scored"
        );
        let (job, _) = prepare(r#"{"prompt": "Hi", "echo": true, "max_tokens": 0}"#).unwrap();
        assert_eq!((job.max_tokens, job.prompt_logprobs), (0, None));
    }

    fn token(text: &str, logprob: f32) -> super::super::reply::TokenLogprob {
        super::super::reply::TokenLogprob {
            token: text.into(),
            bytes: text.as_bytes().to_vec(),
            logprob,
        }
    }

    #[test]
    fn legacy_logprobs_put_the_echoed_prompt_first() {
        let prompt = PromptLogprobs {
            first: "Hé".into(),
            rest: vec![LogprobEntry {
                sampled: token(" you", -2.0),
                top: vec![token(" me", -0.5)],
            }],
        };
        let reply = [LogprobEntry {
            sampled: token("!", -0.25),
            top: vec![],
        }];
        let (value, end) = legacy_logprobs_after(Some(&prompt), &reply, 7);
        assert_eq!(value["tokens"], json!(["Hé", " you", "!"]));
        assert_eq!(value["token_logprobs"], json!([null, -2.0, -0.25]));
        assert_eq!(value["top_logprobs"], json!([null, {" me": -0.5}, {}]));
        assert_eq!(value["text_offset"], json!([0, 3, 7]));
        assert_eq!(end, 8);
    }

    #[test]
    fn legacy_logprobs_count_offsets_in_bytes() {
        let entries = vec![
            LogprobEntry {
                sampled: token("Hé", -0.5),
                top: vec![token("Hé", -0.5), token("A", -1.0)],
            },
            LogprobEntry {
                sampled: token("!", -0.25),
                top: vec![],
            },
        ];
        let (value, end) = legacy_logprobs(&entries, 10);
        assert_eq!(end, 14);
        assert_eq!(value["tokens"], json!(["Hé", "!"]));
        assert_eq!(value["token_logprobs"], json!([-0.5, -0.25]));
        assert_eq!(value["top_logprobs"][0]["A"], json!(-1.0));
        assert_eq!(value["text_offset"], json!([10, 13]));
    }
}
