//! Commands that speak harmony: `render`, `tokenize` and `run`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;

use super::output::{self, note};
use super::{limits, ModelArgs};
use crate::chat::{
    render_for_completion, Channel, ChatMessage, Conversation, HarmonyParser, ParseEvent,
    ReasoningEffort, RenderOptions, Tokenizer,
};
use crate::engine::kv_tiers::{conversation_label, KvTiers, TierConfig};
use crate::engine::resume_from_tiers;
use crate::engine::{
    generate, GenerateEvent, GenerateLimits, GenerateResult, Sampler, SamplerSettings, StopReason,
};

#[derive(Args, Debug)]
pub struct RenderArgs {
    /// Conversation file (JSON; see `chat::conversation`).
    #[arg(long, value_name = "FILE")]
    pub conversation: PathBuf,
    /// Keep the analysis of completed turns in the prompt.
    #[arg(long)]
    pub keep_reasoning: bool,
    /// Also print the prompt as text (special tokens spelled out) before the ids.
    #[arg(long)]
    pub show_text: bool,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text to encode, or comma-separated ids with --decode.
    pub text: String,
    /// Decode comma-separated ids back to text.
    #[arg(long)]
    pub decode: bool,
    /// Encode literal `<|...|>` strings as special tokens (message text never does).
    #[arg(long, conflicts_with = "decode")]
    pub special: bool,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Answer on an OpenAI-compatible server instead of a local model (--remote URL).
    #[command(flatten)]
    pub remote: Box<super::app::RemoteArgs>,
    /// The user's message; `-` reads it from stdin.
    #[arg(long, value_name = "TEXT", required_unless_present = "conversation")]
    pub prompt: Option<String>,
    /// Continue this saved conversation (the prompt, if any, is appended as a user message).
    #[arg(long, value_name = "FILE")]
    pub conversation: Option<PathBuf>,
    /// Model identity line of the system message (default: harmony's).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Developer instructions.
    #[arg(long, value_name = "TEXT")]
    pub developer: Option<String>,
    /// Reasoning effort.
    #[arg(long, value_name = "low|medium|high")]
    pub reasoning: Option<ReasoningEffort>,
    /// Current date line of the system message (YYYY-MM-DD).
    #[arg(long, value_name = "DATE")]
    pub date: Option<String>,
    /// Keep the analysis of completed turns in the prompt.
    #[arg(long)]
    pub keep_reasoning: bool,
    /// Print the reasoning (analysis channel) to stderr as it is generated.
    #[arg(long)]
    pub show_reasoning: bool,
    /// Print one JSON object with answer, reasoning, token counts and timings instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Most tokens to generate (default: until the model stops or the context is full).
    #[arg(long, value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Context size in tokens (prompt + reply).
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub context: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, value_name = "T", default_value_t = 1.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, value_name = "P", default_value_t = 0.0)]
    pub min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Directory of KV snapshots: with --conversation, the longest snapshot of the rendered
    /// prompt is restored instead of prefilled, and the state after the reply is saved (default:
    /// the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Disk budget of the snapshot directory in MiB (least recently used files go first).
    #[arg(long, value_name = "MB", default_value_t = crate::engine::kv_tiers::DEFAULT_DISK_MB)]
    pub max_disk_mb: u64,
    /// Neither read nor write KV snapshots.
    #[arg(long)]
    pub no_snapshots: bool,
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

pub fn render(args: RenderArgs) -> anyhow::Result<()> {
    let conversation = Conversation::load(&args.conversation)?;
    let tokenizer = Tokenizer::shared()?;
    let options = RenderOptions {
        keep_reasoning: args.keep_reasoning,
    };
    let ids = render_for_completion(tokenizer, &conversation, &options)?;
    let mut out = output::stdout();
    if args.show_text {
        writeln!(out, "{}", tokenizer.decode(&ids)?)?;
    }
    writeln!(out, "{}", join_ids(&ids))?;
    out.flush()?;
    Ok(())
}

pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let tokenizer = Tokenizer::shared()?;
    let mut out = output::stdout();
    if args.decode {
        let ids = crate::chat::tokenizer::parse_ids(&args.text)?;
        let text = tokenizer.decode(&ids)?;
        writeln!(out, "{text}")?;
    } else {
        let ids = if args.special {
            tokenizer.encode_with_special_tokens(&args.text)?
        } else {
            tokenizer.encode_text(&args.text)?
        };
        writeln!(out, "{}", join_ids(&ids))?;
    }
    out.flush()?;
    Ok(())
}

/// The conversation `run` continues: a saved one, or a fresh one from the flags.
fn conversation_for_run(args: &RunArgs) -> anyhow::Result<Conversation> {
    let mut conversation = match &args.conversation {
        Some(path) => Conversation::load(path)?,
        None => Conversation::default(),
    };
    if let Some(identity) = &args.system {
        conversation.system.identity = Some(identity.clone());
    }
    if let Some(reasoning) = args.reasoning {
        conversation.system.reasoning = Some(reasoning);
    }
    if let Some(date) = &args.date {
        conversation.system.date = Some(date.clone());
    }
    if let Some(developer) = &args.developer {
        conversation.developer = Some(developer.clone());
    }
    match args.prompt.as_deref() {
        Some("-") => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the prompt from stdin")?;
            conversation.messages.push(ChatMessage::user(text));
        }
        Some(text) => conversation.messages.push(ChatMessage::user(text)),
        None => {}
    }
    if conversation.messages.is_empty() {
        anyhow::bail!("nothing to answer: give --prompt TEXT (or - for stdin)");
    }
    Ok(conversation)
}

/// What `run` collects while streaming.
#[derive(Default)]
struct RunOutput {
    answer: String,
    reasoning: String,
    malformed: Vec<String>,
}

/// Appends `text` to `kept` and, when it is `shown`, writes it to `out` at once (flushed: the
/// user watches it come).
fn keep(kept: &mut String, text: &str, shown: bool, out: &mut impl Write) -> std::io::Result<()> {
    kept.push_str(text);
    if shown {
        out.write_all(text.as_bytes()).and_then(|()| out.flush())
    } else {
        Ok(())
    }
}

impl RunOutput {
    /// The run's result once it ended: a failed write of its stream first (nobody read the
    /// rest), then a failure of the run, `(message, error)`, after what the run generated
    /// before it, which is the user's. Streamed, that is on the screen already and only its line
    /// is ended; with `json`, it goes into the JSON object with the message beside it.
    fn settle<T>(
        &self,
        json: bool,
        write_error: Option<std::io::Error>,
        result: Result<T, (String, anyhow::Error)>,
    ) -> anyhow::Result<T> {
        if let Some(error) = write_error {
            return Err(error).context("cannot write the reply");
        }
        let (message, error) = match result {
            Ok(result) => return Ok(result),
            Err(failure) => failure,
        };
        let mut stdout = output::stdout();
        if json {
            let mut json = run_json(self, None);
            json["error"] = message.into();
            writeln!(stdout, "{json}")?;
        } else if !self.answer.is_empty() && !self.answer.ends_with('\n') {
            writeln!(stdout)?;
        }
        stdout.flush()?;
        Err(error)
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // Ctrl-C sets the flag and generation ends cleanly, printing what it has; a second Ctrl-C
    // exits at once. Installed first, so an early Ctrl-C during loading is not lost either.
    let cancel = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_conditional_shutdown(signal, 130, cancel.clone())
            .context("cannot install the Ctrl-C handler")?;
        signal_hook::flag::register(signal, cancel.clone())
            .context("cannot install the Ctrl-C handler")?;
    }
    let conversation = conversation_for_run(&args)?;
    if let Some(url) = args.remote.remote.clone() {
        return run_remote(&args, url, &conversation, &cancel);
    }
    let tokenizer = Tokenizer::shared()?;
    let prompt = render_for_completion(
        tokenizer,
        &conversation,
        &RenderOptions {
            keep_reasoning: args.keep_reasoning,
        },
    )?;
    let mut sampler = Sampler::new(SamplerSettings {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    })?;
    if prompt.len() > args.context {
        anyhow::bail!(
            "the prompt is {} tokens but the context holds only {}; raise --context or shorten the conversation",
            prompt.len(),
            args.context
        );
    }
    let model = args.model.load_for_context(false, args.context)?;
    let context = args.context.min(model.config.max_position_embeddings);
    limits::check_context(&model, context, &[("--context", context)])?;
    let pool = args.model.pool()?;
    let mut session = model.new_session(&pool, context);
    // A saved conversation is what a user reopens: resume it from its snapshot, save it after.
    let mut tiers = match (&args.conversation, args.no_snapshots) {
        (Some(_), false) => {
            let dir = args
                .cache_dir
                .clone()
                .or_else(crate::engine::kv_tiers::default_cache_dir);
            Some(KvTiers::new(TierConfig {
                ram_budget_bytes: 0,
                disk_dir: dir,
                disk_budget_bytes: args.max_disk_mb << 20,
            }))
        }
        _ => None,
    };
    if let Some(tiers) = &mut tiers {
        let resumed = pool.install(|| resume_from_tiers(&mut session, tiers, &prompt));
        for notice in tiers.take_notices() {
            eprintln!("[{notice}]");
        }
        if let Some(resumed) = resumed {
            eprintln!("[{}]", resumed.describe());
        }
    }

    let stream = !args.json;
    let mut output = RunOutput::default();
    let mut write_error = None;
    // The loop runs on the session's pool, as the app's generation does, so it takes stdout there.
    let result = pool.install(|| {
        let mut stdout = std::io::stdout().lock();
        let mut stderr = std::io::stderr();
        generate(
            &mut session,
            &mut HarmonyParser::after_prompt(tokenizer, "assistant"),
            &prompt,
            &mut sampler,
            GenerateLimits {
                max_tokens: args.max_tokens,
            },
            || cancel.load(Ordering::Relaxed),
            |event| {
                let GenerateEvent::Parsed(event) = event else {
                    return;
                };
                let written = match event {
                    ParseEvent::Text { channel, text } => match channel {
                        Some(Channel::Analysis | Channel::Commentary) => {
                            let shown = stream && args.show_reasoning;
                            keep(&mut output.reasoning, text, shown, &mut stderr)
                        }
                        // Text without a known channel is shown: the user asked for an answer.
                        Some(Channel::Final) | None => {
                            keep(&mut output.answer, text, stream, &mut stdout)
                        }
                    },
                    ParseEvent::MessageEnd {
                        channel: Some(Channel::Analysis | Channel::Commentary),
                        ..
                    } if stream && args.show_reasoning => stderr.write_all(b"\n"),
                    ParseEvent::Malformed(malformation) => {
                        output.malformed.push(malformation.to_string());
                        Ok(())
                    }
                    _ => Ok(()),
                };
                if let Err(error) = written {
                    write_error.get_or_insert(error);
                    // Nobody reads the rest: stop generating it.
                    cancel.store(true, Ordering::Relaxed);
                }
            },
        )
    });
    if let (Some(tiers), Ok(_)) = (&mut tiers, &result) {
        // A failed forward pass may leave the cache half-written: only a finished run is kept.
        // Restorable from the last message on: continuing, regenerating or editing it.
        let mut earlier = conversation.clone();
        earlier.messages.pop();
        let options = RenderOptions {
            keep_reasoning: args.keep_reasoning,
        };
        let floor = render_for_completion(tokenizer, &earlier, &options)
            .map(|ids| crate::engine::kv_tiers::resume_floor(session.tokens(), &ids))
            .unwrap_or(0);
        if let Ok(snapshot) = pool.install(|| session.snapshot_restorable_from(floor)) {
            tiers.store(snapshot, &conversation_label(&conversation));
            tiers.flush();
        }
        for notice in tiers.take_notices() {
            eprintln!("[{notice}]");
        }
    }
    let result = output.settle(
        args.json,
        write_error,
        result.map_err(|error| (error.to_string(), error.into())),
    )?;
    let mut stdout = output::stdout();
    if args.json {
        let json = run_json(&output, Some(&result));
        writeln!(stdout, "{json}")?;
    } else {
        if !output.answer.ends_with('\n') {
            writeln!(stdout)?;
        }
        report_run(&output, &result);
    }
    stdout.flush()?;
    Ok(())
}

/// The JSON object of `run --json`; without a result (the run failed) only the text so far.
fn run_json(output: &RunOutput, result: Option<&GenerateResult>) -> serde_json::Value {
    let mut json = serde_json::json!({
        "answer": output.answer,
        "reasoning": output.reasoning,
        "malformed": output.malformed,
    });
    if let Some(result) = result {
        json["prompt_tokens"] = result.prompt_tokens.into();
        json["generated_tokens"] = result.generated_tokens.into();
        json["stop_reason"] = result.stop_reason.as_str().into();
        json["ttft_ms"] = (result.time_to_first_token.as_secs_f64() * 1e3).into();
        json["prefill_tps"] = result.prefill_tokens_per_second().into();
        json["decode_tps"] = result.decode_tokens_per_second().into();
        json["reused_tokens"] = result.reused_tokens.into();
    }
    json
}

/// One stderr line on how the run ended, so stdout holds only the answer.
fn report_run(output: &RunOutput, result: &GenerateResult) {
    let why = match result.stop_reason {
        StopReason::Return => "answer complete",
        StopReason::ToolCall => "the model called a tool (tools are not supported)",
        StopReason::EndOfText => "end of text",
        StopReason::MaxTokens => "--max-tokens reached",
        StopReason::ContextFull => "the context is full (raise --context)",
        StopReason::Cancelled => "cancelled",
    };
    note!(
        "[{why}: {} prompt tokens, {} generated; first token after {:.0} ms, prefill {:.1} tokens/s, decode {:.1} tokens/s]",
        result.prompt_tokens,
        result.generated_tokens,
        result.time_to_first_token.as_secs_f64() * 1e3,
        result.prefill_tokens_per_second(),
        result.decode_tokens_per_second(),
    );
    if !output.malformed.is_empty() {
        note!(
            "[the output did not follow harmony {} times; first: {}]",
            output.malformed.len(),
            output.malformed[0]
        );
    }
}

/// `run --remote URL`: the same conversation and output, answered by a server.
fn run_remote(
    args: &RunArgs,
    url: String,
    conversation: &Conversation,
    cancel: &AtomicBool,
) -> anyhow::Result<()> {
    use crate::remote::client::Finish;
    let section = crate::config::RemoteSection {
        url: Some(url),
        model: args.remote.remote_model.clone(),
        timeout_secs: args
            .remote
            .remote_timeout
            .unwrap_or(crate::remote::DEFAULT_IDLE_TIMEOUT.as_secs()),
        ..crate::config::RemoteSection::default()
    };
    let Some(config) = section.engine_config(args.remote.api_key.clone()) else {
        anyhow::bail!("--remote needs a URL");
    };
    let mut session = crate::remote::RemoteSession::new(config.target, config.model.clone())
        .map_err(|error| anyhow::anyhow!(error.describe()))?;
    if config.model.is_none() {
        let (_, notice) = session
            .resolve_model()
            .map_err(|error| anyhow::anyhow!(error.describe()))?;
        if let Some(notice) = notice {
            note!("[{notice}]");
        }
    }
    let sampling = crate::engine::protocol::SamplingSettings {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        max_tokens: args.max_tokens.unwrap_or(0),
        seed: args.seed,
    };
    let stream = !args.json;
    let mut output = RunOutput::default();
    let mut write_error = None;
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    let effort = args.reasoning.unwrap_or(ReasoningEffort::Medium);
    let mut reasoning_open = false;
    let result = session.reply(
        conversation,
        &sampling,
        effort,
        &|| cancel.load(Ordering::Relaxed),
        &mut |channel, text| {
            let written = match channel {
                Channel::Analysis | Channel::Commentary => {
                    reasoning_open = true;
                    keep(
                        &mut output.reasoning,
                        text,
                        stream && args.show_reasoning,
                        &mut stderr,
                    )
                }
                Channel::Final => {
                    let ended_reasoning = std::mem::take(&mut reasoning_open);
                    if ended_reasoning && stream && args.show_reasoning {
                        let _ = stderr.write_all(b"\n");
                    }
                    keep(&mut output.answer, text, stream, &mut stdout)
                }
            };
            if let Err(error) = written {
                write_error.get_or_insert(error);
                cancel.store(true, Ordering::Relaxed);
            }
        },
    );
    drop(stdout);
    let reply = output.settle(
        args.json,
        write_error,
        result.map_err(|error| (error.describe(), anyhow::anyhow!(error.describe()))),
    )?;
    let mut stdout = output::stdout();
    output.malformed = reply.malformed;
    let outcome = &reply.outcome;
    let (why, stop_reason) = match &outcome.finish {
        Finish::Stop | Finish::Unstated => ("answer complete", "return"),
        Finish::Length => ("--max-tokens reached", "max_tokens"),
        Finish::Other(_) => ("the server ended the reply", "other"),
        Finish::Cancelled => ("cancelled", "cancelled"),
    };
    let usage = outcome.usage.unwrap_or_default();
    let ttft = outcome.client.first_text.unwrap_or_default();
    let decode = outcome.client.decode_rate().unwrap_or(0.0);
    if args.json {
        let mut json = run_json(&output, None);
        json["prompt_tokens"] = usage.prompt_tokens.into();
        json["generated_tokens"] = usage.completion_tokens.into();
        json["reused_tokens"] = usage.cached_tokens.into();
        json["stop_reason"] = stop_reason.into();
        json["ttft_ms"] = (ttft.as_secs_f64() * 1e3).into();
        json["decode_tps"] = decode.into();
        json["model"] = session.model().map(|model| model.id.clone()).into();
        json["server"] = session.url().into();
        writeln!(stdout, "{json}")?;
    } else {
        if !output.answer.ends_with('\n') {
            writeln!(stdout)?;
        }
        let model = session.model().map_or("?", |model| model.id.as_str());
        note!(
            "[{why}: {model} at {}: {} prompt tokens ({} cached), {} generated; first token after {:.0} ms, decode {:.1} tokens/s as received]",
            session.url(),
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            ttft.as_secs_f64() * 1e3,
            decode,
        );
        if let Some(first) = output.malformed.first() {
            note!(
                "[the server's harmony text did not parse {} times; first: {first}]",
                output.malformed.len()
            );
        }
    }
    stdout.flush()?;
    Ok(())
}
