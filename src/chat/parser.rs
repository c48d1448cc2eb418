//! Streaming parser from generated token ids to harmony events: a message starts (role, channel),
//! text arrives, the message ends, generation stops.
//!
//! The parser starts right after the generation prompt `<|start|>assistant`, so the first header
//! already has its role. Header tokens never reach the text; malformed output is reported as
//! [`Malformation`] events and parsing goes on, so a confused model never crashes the caller.

use super::conversation::Channel;
use super::tokenizer::{special, Tokenizer, Utf8Stream};

/// Headers longer than this are not headers: the model lost the format.
const MAX_HEADER_TOKENS: usize = 64;
/// Room for the longest header text: 64 tokens of at most 128 bytes (o200k's longest token) each
/// plus spelled-out special tokens. Buffers get it up front so parsing never reallocates.
const HEADER_CAPACITY: usize = MAX_HEADER_TOKENS * 160;

/// Why the model stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopToken {
    /// `<|return|>`: the final answer is complete.
    Return,
    /// `<|call|>`: the message is a tool call that waits for the tool's answer.
    Call,
    /// `<|endoftext|>`: not part of harmony, but listed as an end token in the model's
    /// generation config; nothing sensible follows it.
    EndOfText,
}

/// Output that does not follow harmony.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformation {
    /// A message header without `<|channel|>`; its text is still reported, with channel `None`.
    MissingChannel,
    /// A channel other than analysis, commentary or final (named in the `MessageStart` event).
    UnknownChannel,
    /// A header that never reached `<|message|>` within a sane length; what came so far is taken as
    /// the header.
    HeaderTooLong,
    /// A special token where it means nothing (a reserved token, `<|message|>` inside text, ...);
    /// it is skipped.
    UnexpectedToken { id: u32 },
    /// Ordinary tokens between messages (after `<|end|>`, before `<|start|>`); skipped.
    TextOutsideMessage { id: u32 },
    /// `<|start|>` inside a message that was never ended; the message is closed first.
    MissingEnd,
    /// A token after a stop token; ignored.
    TokenAfterStop { id: u32 },
    /// Generation ended inside a header.
    Truncated,
}

impl std::fmt::Display for Malformation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Malformation::MissingChannel => write!(f, "message header has no channel"),
            Malformation::UnknownChannel => write!(f, "message header names an unknown channel"),
            Malformation::HeaderTooLong => {
                write!(f, "message header longer than {MAX_HEADER_TOKENS} tokens")
            }
            Malformation::UnexpectedToken { id } => write!(f, "unexpected special token {id}"),
            Malformation::TextOutsideMessage { id } => {
                write!(f, "token {id} outside any message (expected <|start|>)")
            }
            Malformation::MissingEnd => write!(f, "new message started before <|end|>"),
            Malformation::TokenAfterStop { id } => write!(f, "token {id} after the stop token"),
            Malformation::Truncated => write!(f, "output ended inside a message header"),
        }
    }
}

/// What the parser saw. Strings borrow from the parser and live until the next call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParseEvent<'a> {
    MessageStart {
        role: &'a str,
        /// `None` for a missing or unknown channel (see `channel_name`).
        channel: Option<Channel>,
        channel_name: &'a str,
        /// The ` to=...` recipient of a tool call, if any.
        recipient: Option<&'a str>,
    },
    /// Complete characters of message text (never half a UTF-8 character).
    Text {
        channel: Option<Channel>,
        text: &'a str,
    },
    /// `complete` is false when output stopped before the message's end token.
    MessageEnd {
        channel: Option<Channel>,
        complete: bool,
    },
    Stop(StopToken),
    Malformed(Malformation),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Between messages: only `<|start|>` (or a stop token) makes sense.
    ExpectStart,
    Header,
    Content,
    Stopped,
}

/// Harmony stream parser; reuses its buffers, so steady-state parsing allocates nothing.
#[derive(Debug)]
pub struct HarmonyParser<'t> {
    tokenizer: &'t Tokenizer,
    state: State,
    /// Header text with special tokens spelled out (`<|channel|>`); set when the header began with
    /// `<|start|>` and still holds the role then.
    header: String,
    header_tokens: usize,
    header_has_start: bool,
    role: String,
    channel: Option<Channel>,
    channel_name: String,
    recipient: String,
    text: Utf8Stream,
    reported_outside_message: bool,
}

impl<'t> HarmonyParser<'t> {
    /// A parser for the tokens that follow a generation prompt ending in `<|start|>{role}`.
    pub fn after_prompt(tokenizer: &'t Tokenizer, role: &str) -> HarmonyParser<'t> {
        let mut parser = HarmonyParser {
            tokenizer,
            state: State::Header,
            header: String::with_capacity(HEADER_CAPACITY),
            header_tokens: 0,
            header_has_start: false,
            role: String::with_capacity(HEADER_CAPACITY),
            channel: None,
            channel_name: String::with_capacity(HEADER_CAPACITY),
            recipient: String::with_capacity(HEADER_CAPACITY),
            text: Utf8Stream::default(),
            reported_outside_message: false,
        };
        parser.role.push_str(role);
        parser
    }

    /// Starts over after a new generation prompt `<|start|>{role}`.
    pub fn reset(&mut self, role: &str) {
        self.begin_header(false);
        self.role.clear();
        self.role.push_str(role);
        self.reported_outside_message = false;
    }

    /// Whether a stop token was seen.
    pub fn is_stopped(&self) -> bool {
        self.state == State::Stopped
    }

    fn begin_header(&mut self, after_start_token: bool) {
        self.state = State::Header;
        self.header.clear();
        self.header_tokens = 0;
        self.header_has_start = after_start_token;
        self.channel = None;
        self.channel_name.clear();
        self.recipient.clear();
        self.text.reset();
    }

    /// Feeds one generated token; events go to `on_event`.
    pub fn push(&mut self, id: u32, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        match self.state {
            State::Stopped => on_event(ParseEvent::Malformed(Malformation::TokenAfterStop { id })),
            State::ExpectStart => self.push_between_messages(id, on_event),
            State::Header => self.push_header(id, on_event),
            State::Content => self.push_content(id, on_event),
        }
    }

    /// Ends the stream (generation stopped for a reason other than a stop token): flushes text
    /// and closes an open message.
    pub fn finish(&mut self, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        match self.state {
            State::Content => self.end_message(false, on_event),
            State::Header if self.header_tokens > 0 => {
                on_event(ParseEvent::Malformed(Malformation::Truncated))
            }
            _ => {}
        }
        self.state = State::Stopped;
    }

    fn stop(&mut self, stop: StopToken, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        self.state = State::Stopped;
        on_event(ParseEvent::Stop(stop));
    }

    fn stop_token(id: u32) -> Option<StopToken> {
        match id {
            special::RETURN => Some(StopToken::Return),
            special::CALL => Some(StopToken::Call),
            special::END_OF_TEXT => Some(StopToken::EndOfText),
            _ => None,
        }
    }

    fn push_between_messages(&mut self, id: u32, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        if id == special::START {
            self.reported_outside_message = false;
            self.begin_header(true);
        } else if let Some(stop) = Self::stop_token(id) {
            self.stop(stop, on_event);
        } else if Tokenizer::is_special(id) {
            on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
        } else if !self.reported_outside_message {
            self.reported_outside_message = true;
            on_event(ParseEvent::Malformed(Malformation::TextOutsideMessage {
                id,
            }));
        }
    }

    fn push_header(&mut self, id: u32, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        match id {
            special::MESSAGE => self.open_message(on_event),
            special::START => {
                // A header that starts over: keep only the new one.
                on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
                self.begin_header(true);
            }
            special::END => {
                on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
                self.state = State::ExpectStart;
            }
            _ => {
                if let Some(stop) = Self::stop_token(id) {
                    on_event(ParseEvent::Malformed(Malformation::Truncated));
                    self.stop(stop, on_event);
                    return;
                }
                match self.tokenizer.token_bytes(id) {
                    Ok(bytes) => {
                        // Lossy, like String::from_utf8_lossy, but without a temporary String.
                        for chunk in bytes.utf8_chunks() {
                            self.header.push_str(chunk.valid());
                            if !chunk.invalid().is_empty() {
                                self.header.push(char::REPLACEMENT_CHARACTER);
                            }
                        }
                    }
                    Err(_) => {
                        on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
                        return;
                    }
                }
                self.header_tokens += 1;
                if self.header_tokens >= MAX_HEADER_TOKENS {
                    on_event(ParseEvent::Malformed(Malformation::HeaderTooLong));
                    self.open_message(on_event);
                }
            }
        }
    }

    /// Parses `[role][ to=recipient]<|channel|>channel[ to=recipient][ content-type]`.
    fn open_message(&mut self, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        let channel_marker = "<|channel|>";
        let (before_channel, after_channel) = match self.header.find(channel_marker) {
            Some(at) => (
                &self.header[..at],
                Some(&self.header[at + channel_marker.len()..]),
            ),
            None => (self.header.as_str(), None),
        };
        let mut words = before_channel.split_whitespace();
        if self.header_has_start {
            self.role.clear();
            if let Some(role) = words.next() {
                self.role.push_str(role);
            }
        }
        let mut channel_words = after_channel.map(|rest| rest.split_whitespace());
        if let Some(name) = channel_words.as_mut().and_then(|words| words.next()) {
            self.channel_name.push_str(name);
        }
        let recipient = words
            .chain(channel_words.into_iter().flatten())
            .find_map(|word| word.strip_prefix("to="))
            // `to=functions.f<|constrain|>json`: the model may write the content type without a
            // space (harmony's own docs show both).
            .map(|recipient| recipient.split("<|").next().unwrap_or_default())
            .filter(|recipient| !recipient.is_empty());
        if let Some(recipient) = recipient {
            self.recipient.push_str(recipient);
        }
        self.channel = Channel::from_name(&self.channel_name);
        if after_channel.is_none() {
            on_event(ParseEvent::Malformed(Malformation::MissingChannel));
        } else if self.channel.is_none() {
            on_event(ParseEvent::Malformed(Malformation::UnknownChannel));
        }
        on_event(ParseEvent::MessageStart {
            role: &self.role,
            channel: self.channel,
            channel_name: &self.channel_name,
            recipient: (!self.recipient.is_empty()).then_some(self.recipient.as_str()),
        });
        self.text.reset();
        self.state = State::Content;
    }

    fn push_content(&mut self, id: u32, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        match id {
            special::END => {
                self.end_message(true, on_event);
                self.state = State::ExpectStart;
            }
            special::START => {
                on_event(ParseEvent::Malformed(Malformation::MissingEnd));
                self.end_message(false, on_event);
                self.begin_header(true);
            }
            _ => {
                if let Some(stop) = Self::stop_token(id) {
                    self.end_message(true, on_event);
                    self.stop(stop, on_event);
                } else if Tokenizer::is_special(id) {
                    on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
                } else if let Ok(bytes) = self.tokenizer.token_bytes(id) {
                    let text = self.text.push(bytes);
                    if !text.is_empty() {
                        on_event(ParseEvent::Text {
                            channel: self.channel,
                            text,
                        });
                    }
                } else {
                    on_event(ParseEvent::Malformed(Malformation::UnexpectedToken { id }));
                }
            }
        }
    }

    fn end_message(&mut self, complete: bool, on_event: &mut impl FnMut(ParseEvent<'_>)) {
        let tail = self.text.finish();
        if !tail.is_empty() {
            on_event(ParseEvent::Text {
                channel: self.channel,
                text: tail,
            });
        }
        on_event(ParseEvent::MessageEnd {
            channel: self.channel,
            complete,
        });
    }
}
