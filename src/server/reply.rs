//! From the harmony parser's events to what an OpenAI client reads: the analysis channel becomes
//! reasoning text, a message addressed to `functions.NAME` (when the request defined functions)
//! becomes a tool call, every other channel (final, a commentary preamble, or text whose header
//! the model garbled) becomes content, and the request's stop strings cut the content.

use rand::Rng;

use crate::chat::{Channel, ParseEvent};

/// A piece of a tool call as OpenAI streams one: the first piece of a call carries its id and
/// function name, every piece some of the arguments' text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    /// The call's position in the reply (0 for the first).
    pub index: usize,
    /// `Some((id, name))` on a call's first piece.
    pub opens: Option<(String, String)>,
    pub arguments: String,
}

/// A token's log-probability as OpenAI reports it: its text, its bytes (a token may hold part of
/// a UTF-8 character) and the log-probability under the model's distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// An answer token's log-probability and the likeliest tokens at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobEntry {
    pub sampled: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

/// The prompt's tokens scored by the model, as `echo` with `logprobs` reports them
/// (`/v1/completions`): the first by its text alone (nothing before it predicts it), each later
/// one with its log-probability given the tokens before it and the likeliest tokens there.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PromptLogprobs {
    pub first: String,
    pub rest: Vec<LogprobEntry>,
}

/// What a reply produced since it was last taken.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplyDelta {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
    /// One entry per answer token (when the request asked for them).
    pub logprobs: Vec<LogprobEntry>,
    /// In the first delta of a request that asked for the prompt's log-probabilities.
    pub prompt: Option<PromptLogprobs>,
}

impl ReplyDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty()
            && self.content.is_empty()
            && self.tool_calls.is_empty()
            && self.logprobs.is_empty()
            && self.prompt.is_none()
    }
}

/// The text of one reply not yet sent to the client, and whether a stop string ended it.
#[derive(Debug, Default)]
pub struct ReplyText {
    channel: Option<Channel>,
    /// Reasoning and content produced since the last [`ReplyText::take`].
    pub reasoning: String,
    pub content: String,
    stops: StopMatcher,
    stopped: bool,
    /// Sampled tokens that fell inside an analysis message.
    pub reasoning_tokens: usize,
    /// Whether the request defined functions (else a recipient's message stays content).
    tools: bool,
    /// The open message is a tool call.
    in_call: bool,
    /// The function the open call names.
    call_name: String,
    /// Calls opened so far.
    calls: usize,
    tool_calls: Vec<ToolCallDelta>,
    /// A message's text is being read (between its `<|message|>` and its end).
    in_message: bool,
    logprobs: Vec<LogprobEntry>,
}

impl ReplyText {
    pub fn new(stops: Vec<String>) -> ReplyText {
        ReplyText {
            stops: StopMatcher::new(stops),
            ..ReplyText::default()
        }
    }

    /// A plain-text reply (`/v1/completions`): every token's text is content, fed by
    /// [`ReplyText::push_plain`].
    pub fn plain_text(mut self) -> ReplyText {
        self.in_message = true;
        self
    }

    /// Text of a plain-text reply, cut by the stop strings.
    pub fn push_plain(&mut self, text: &str) {
        if !self.stopped && !text.is_empty() {
            self.stopped = self.stops.push(text, &mut self.content);
        }
    }

    /// Messages to `functions.NAME` become tool calls.
    pub fn with_tools(mut self, tools: bool) -> ReplyText {
        self.tools = tools;
        self
    }

    /// Whether the reply called a function.
    pub fn made_calls(&self) -> bool {
        self.calls > 0
    }

    /// Whether the next text token belongs to the answer (`content`): inside a message that is
    /// neither reasoning nor a tool call, and before a stop string.
    pub fn in_answer(&self) -> bool {
        self.in_message && !self.in_call && self.channel != Some(Channel::Analysis) && !self.stopped
    }

    /// Whether the next token belongs to the final channel's message: what a structured output
    /// holds to its format (reasoning, preambles and tool calls stay free).
    pub fn in_final_answer(&self) -> bool {
        self.in_answer() && self.channel == Some(Channel::Final)
    }

    /// The function whose arguments the next token belongs to: inside a tool call's message.
    pub fn in_call_arguments(&self) -> Option<&str> {
        (self.in_message && self.in_call && !self.stopped).then_some(self.call_name.as_str())
    }

    /// Records an answer token's log-probabilities, sent with the next delta.
    pub fn push_logprob(&mut self, entry: LogprobEntry) {
        self.logprobs.push(entry);
    }

    /// Whether a stop string was found: the reply is over.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Counts one sampled token towards the channel it was sampled in.
    pub fn count_token(&mut self) {
        if self.channel == Some(Channel::Analysis) {
            self.reasoning_tokens += 1;
        }
    }

    pub fn on_event(&mut self, event: ParseEvent<'_>) {
        match event {
            ParseEvent::MessageStart {
                channel, recipient, ..
            } => {
                self.channel = channel;
                self.in_message = true;
                let function = recipient
                    .and_then(|r| r.strip_prefix("functions."))
                    .filter(|name| self.tools && !name.is_empty());
                self.in_call = function.is_some();
                if let Some(name) = function {
                    self.call_name.clear();
                    self.call_name.push_str(name);
                    self.tool_calls.push(ToolCallDelta {
                        index: self.calls,
                        opens: Some((new_call_id(), name.to_owned())),
                        arguments: String::new(),
                    });
                    self.calls += 1;
                }
            }
            ParseEvent::Text { text, .. } if self.in_call && !self.stopped => {
                let index = self.calls - 1;
                match self.tool_calls.last_mut() {
                    Some(pending) if pending.index == index => pending.arguments.push_str(text),
                    _ => self.tool_calls.push(ToolCallDelta {
                        index,
                        opens: None,
                        arguments: text.to_owned(),
                    }),
                }
            }
            ParseEvent::MessageEnd { .. } => self.in_message = false,
            ParseEvent::Text { channel, text } if !self.stopped => {
                if channel == Some(Channel::Analysis) {
                    self.reasoning.push_str(text);
                } else {
                    self.stopped = self.stops.push(text, &mut self.content);
                }
            }
            _ => {}
        }
    }

    /// The reply ended: content held back in case it began a stop string is released.
    pub fn finish(&mut self) {
        if !self.stopped {
            self.stops.flush(&mut self.content);
        }
    }

    /// Takes what was produced since the last take.
    pub fn take(&mut self) -> ReplyDelta {
        ReplyDelta {
            reasoning: std::mem::take(&mut self.reasoning),
            content: std::mem::take(&mut self.content),
            tool_calls: std::mem::take(&mut self.tool_calls),
            logprobs: std::mem::take(&mut self.logprobs),
            prompt: None,
        }
    }
}

/// An entry as OpenAI's chat completions and Responses API write it: the token's text,
/// log-probability and bytes, with the likeliest alternatives in `top_logprobs`.
pub fn logprob_json(entry: &LogprobEntry) -> serde_json::Value {
    let one = |t: &TokenLogprob| serde_json::json!({"token": t.token, "logprob": t.logprob, "bytes": t.bytes});
    let mut value = one(&entry.sampled);
    value["top_logprobs"] = entry.top.iter().map(one).collect();
    value
}

/// The log-probability OpenAI reports for a token the model cannot produce (JSON has no -inf).
const LOGPROB_FLOOR: f32 = -9999.0;

/// `token`'s log-probability under the softmax of `logits` (temperature 1: the model's own
/// distribution, whatever the request samples with) and the `top` likeliest tokens', most
/// likely first. One pass for the normalizer, one keeping the best `top` in a small sorted list.
pub fn token_logprobs(
    logits: &[f32],
    token: u32,
    top: usize,
    tokenizer: &crate::chat::Tokenizer,
) -> LogprobEntry {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let normalizer = f64::from(max) + sum.ln();
    let logprob = |logit: f32| -> f32 {
        if logit.is_finite() && normalizer.is_finite() {
            ((f64::from(logit) - normalizer) as f32).max(LOGPROB_FLOOR)
        } else {
            LOGPROB_FLOOR
        }
    };
    let describe = |id: u32, logit: f32| {
        let bytes = tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        TokenLogprob {
            token: String::from_utf8_lossy(&bytes).into_owned(),
            bytes,
            logprob: logprob(logit),
        }
    };
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (id, &logit) in logits.iter().enumerate() {
            if !logit.is_finite() || (best.len() == top && logit <= best[top - 1].0) {
                continue;
            }
            let at = best.partition_point(|&(kept, _)| kept >= logit);
            best.insert(at, (logit, id as u32));
            best.truncate(top);
        }
    }
    let sampled = logits
        .get(token as usize)
        .copied()
        .unwrap_or(f32::NEG_INFINITY);
    LogprobEntry {
        sampled: describe(token, sampled),
        top: best
            .into_iter()
            .map(|(logit, id)| describe(id, logit))
            .collect(),
    }
}

/// An id for a call, unique enough for a client to match its answer (`call_` and 24 letters and
/// digits, as OpenAI's look).
fn new_call_id() -> String {
    let mut rng = rand::thread_rng();
    let tail: String = (0..24)
        .map(|_| rng.sample(rand::distributions::Alphanumeric) as char)
        .collect();
    format!("call_{tail}")
}

/// Finds the first of the request's stop strings in streamed text, holding back the tail that
/// could still become one so no part of a stop string is ever sent.
#[derive(Debug, Default)]
struct StopMatcher {
    stops: Vec<String>,
    held: String,
    longest: usize,
}

impl StopMatcher {
    fn new(mut stops: Vec<String>) -> StopMatcher {
        stops.retain(|stop| !stop.is_empty());
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        StopMatcher {
            stops,
            held: String::new(),
            longest,
        }
    }

    /// Adds `text`; appends what is safe to send to `out`. True when a stop string was found
    /// (the text before it is sent, the rest dropped).
    fn push(&mut self, text: &str, out: &mut String) -> bool {
        if self.stops.is_empty() {
            out.push_str(text);
            return false;
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first {
            out.push_str(&self.held[..at]);
            self.held.clear();
            return true;
        }
        // Keep the last longest - 1 bytes (a stop string may be completed by the next text).
        let mut keep_from = self.held.len().saturating_sub(self.longest - 1);
        while !self.held.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        out.push_str(&self.held[..keep_from]);
        self.held.drain(..keep_from);
        false
    }

    fn flush(&mut self, out: &mut String) {
        out.push_str(&self.held);
        self.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(channel: Option<Channel>, text: &str) -> ParseEvent<'_> {
        ParseEvent::Text { channel, text }
    }

    /// A structured output holds the final channel's message only: not the reasoning before it,
    /// not a preamble, not a tool call's arguments.
    #[test]
    fn only_the_final_message_is_the_structured_answer() {
        use crate::chat::tokenizer::special::{CHANNEL, END, MESSAGE, START};
        use crate::chat::{HarmonyParser, Tokenizer};
        let tokenizer = Tokenizer::shared().unwrap();
        let mut reply = ReplyText::new(Vec::new()).with_tools(true);
        let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
        let mut gate_after = |pieces: &[&str]| {
            for piece in pieces {
                let ids = match *piece {
                    "<|channel|>" => vec![CHANNEL],
                    "<|message|>" => vec![MESSAGE],
                    "<|end|>" => vec![END],
                    "<|start|>" => vec![START],
                    text => tokenizer.encode_text(text).unwrap(),
                };
                for id in ids {
                    parser.push(id, &mut |event| reply.on_event(event));
                }
            }
            reply.in_final_answer()
        };
        assert!(!gate_after(&["<|channel|>", "analysis", "<|message|>"]));
        assert!(!gate_after(&[
            "Think.",
            "<|end|>",
            "<|start|>",
            "assistant"
        ]));
        assert!(!gate_after(&[
            "<|channel|>",
            "commentary",
            "<|message|>",
            "Soon.",
            "<|end|>"
        ]));
        assert!(!gate_after(&[
            "<|start|>",
            "assistant",
            "<|channel|>",
            "commentary to=functions.f"
        ]));
        assert!(!gate_after(&[
            "<|message|>",
            "{}",
            "<|end|>",
            "<|start|>",
            "assistant"
        ]));
        assert!(gate_after(&["<|channel|>", "final", "<|message|>"]));
        assert!(gate_after(&["{\"a\":"]));
        // The header a model may write for JSON: `<|channel|>final <|constrain|>json<|message|>`.
        let mut reply = ReplyText::new(Vec::new());
        let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
        let mut ids = vec![CHANNEL];
        ids.extend(tokenizer.encode_text("final ").unwrap());
        ids.push(crate::chat::tokenizer::special::CONSTRAIN);
        ids.extend(tokenizer.encode_text("json").unwrap());
        ids.push(MESSAGE);
        for id in ids {
            parser.push(id, &mut |event| reply.on_event(event));
        }
        assert!(reply.in_final_answer());
    }

    #[test]
    fn analysis_is_reasoning_and_the_rest_content() {
        let mut reply = ReplyText::new(Vec::new());
        reply.on_event(text(Some(Channel::Analysis), "think"));
        reply.on_event(text(Some(Channel::Final), "answer"));
        reply.on_event(text(None, "!"));
        let delta = reply.take();
        assert_eq!(
            (delta.reasoning, delta.content),
            ("think".into(), "answer!".into())
        );
        assert!(reply.take().is_empty());
    }

    fn start<'a>(channel: Channel, recipient: Option<&'a str>) -> ParseEvent<'a> {
        ParseEvent::MessageStart {
            role: "assistant",
            channel: Some(channel),
            channel_name: channel.as_str(),
            recipient,
        }
    }

    #[test]
    fn a_message_to_a_function_is_a_tool_call_when_the_request_defined_functions() {
        let mut reply = ReplyText::new(vec!["}".into()]).with_tools(true);
        reply.on_event(start(Channel::Analysis, None));
        reply.on_event(text(Some(Channel::Analysis), "need weather"));
        reply.on_event(start(Channel::Commentary, Some("functions.get_weather")));
        reply.on_event(text(Some(Channel::Commentary), "{\"city\":"));
        let first = reply.take();
        assert_eq!(first.reasoning, "need weather");
        assert_eq!(first.content, "");
        let [call] = &first.tool_calls[..] else {
            panic!("{first:?}")
        };
        let (id, name) = call.opens.clone().unwrap();
        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
        assert_eq!((call.index, name.as_str()), (0, "get_weather"));
        assert_eq!(call.arguments, "{\"city\":");
        // Later pieces carry only arguments; a stop string does not cut them.
        reply.on_event(text(Some(Channel::Commentary), "\"Oslo\"}"));
        let second = reply.take();
        assert_eq!(
            second.tool_calls,
            [ToolCallDelta {
                index: 0,
                opens: None,
                arguments: "\"Oslo\"}".into()
            }]
        );
        assert!(!reply.stopped());
        assert!(reply.made_calls());
    }

    #[test]
    fn log_probabilities_are_normalized_and_the_top_tokens_ordered() {
        let tokenizer = crate::chat::Tokenizer::shared().unwrap();
        let mut logits = vec![0.0f32; 1000];
        logits[7] = 3.0;
        logits[9] = 2.0;
        logits[11] = f32::NEG_INFINITY;
        logits[12] = f32::NAN;
        let entry = token_logprobs(&logits, 9, 3, tokenizer);
        let normalizer = (3f64.exp() + 2f64.exp() + 996.0).ln();
        assert!((f64::from(entry.sampled.logprob) - (2.0 - normalizer)).abs() < 1e-5);
        assert_eq!(entry.sampled.bytes, tokenizer.token_bytes(9).unwrap());
        let order: Vec<f32> = entry.top.iter().map(|t| t.logprob).collect();
        assert_eq!(entry.top.len(), 3);
        assert!(order[0] > order[1] && order[1] > order[2], "{order:?}");
        assert_eq!(entry.top[0].bytes, tokenizer.token_bytes(7).unwrap());
        // Probabilities over the whole vocabulary add up to one.
        let total: f64 = (0..1000u32)
            .map(|id| f64::from(token_logprobs(&logits, id, 0, tokenizer).sampled.logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
        assert_eq!(
            token_logprobs(&logits, 11, 0, tokenizer).sampled.logprob,
            -9999.0
        );
        assert_eq!(
            token_logprobs(&logits, 5000, 0, tokenizer).sampled.logprob,
            -9999.0
        );
    }

    #[test]
    fn only_answer_text_is_an_answer_token() {
        let mut reply = ReplyText::new(Vec::new()).with_tools(true);
        assert!(!reply.in_answer());
        reply.on_event(start(Channel::Analysis, None));
        assert!(!reply.in_answer());
        reply.on_event(ParseEvent::MessageEnd {
            channel: Some(Channel::Analysis),
            complete: true,
        });
        reply.on_event(start(Channel::Final, None));
        assert!(reply.in_answer());
        reply.on_event(ParseEvent::MessageEnd {
            channel: Some(Channel::Final),
            complete: true,
        });
        assert!(!reply.in_answer());
        reply.on_event(start(Channel::Commentary, Some("functions.f")));
        assert!(!reply.in_answer());
    }

    #[test]
    fn without_functions_or_to_another_recipient_the_text_stays_content() {
        for (tools, recipient) in [(false, "functions.get_weather"), (true, "browser.search")] {
            let mut reply = ReplyText::new(Vec::new()).with_tools(tools);
            reply.on_event(start(Channel::Commentary, Some(recipient)));
            reply.on_event(text(Some(Channel::Commentary), "{}"));
            let delta = reply.take();
            assert_eq!(delta.content, "{}", "{recipient}");
            assert!(delta.tool_calls.is_empty());
            assert!(!reply.made_calls());
        }
    }

    #[test]
    fn stop_strings_cut_the_content_even_across_pieces() {
        let mut reply = ReplyText::new(vec!["END".into(), String::new()]);
        for piece in ["one E", "N", "D two"] {
            reply.on_event(text(Some(Channel::Final), piece));
        }
        assert!(reply.stopped());
        reply.finish();
        assert_eq!(reply.take().content, "one ");

        let mut reply = ReplyText::new(vec!["xyz".into()]);
        reply.on_event(text(Some(Channel::Final), "héllo x"));
        // The last two bytes may start the stop string: held back until the reply ends.
        assert_eq!(reply.take().content, "héllo");
        reply.finish();
        assert_eq!(reply.take().content, " x");
        assert!(!reply.stopped());
    }
}
