//! Turns a server's streamed deltas into channel text. A server that parses harmony sends the
//! analysis as `reasoning_content`/`reasoning` and the answer as `content`; one that does not
//! (llama-server without a reasoning parser, a raw completions proxy) sends the model's harmony
//! text as `content`, special tokens spelled out. Such a reply starts with `<|channel|>` (the
//! prompt ended with `<|start|>assistant`), and is re-tokenized and read by ossterm's own harmony
//! parser.

use crate::chat::{Channel, HarmonyParser, ParseEvent, Tokenizer};
use crate::remote::client::DeltaKind;

/// The longest special-token spelling (`<|startoftext|>`), so a marker split across events is
/// held back whole and nothing longer ever is.
const LONGEST_MARKER: usize = 16;

/// Markers that open a harmony reply.
const HARMONY_OPENINGS: [&str; 3] = ["<|channel|>", "<|start|>", "<|message|>"];

enum Mode {
    /// No content yet, or too little to tell.
    Undecided,
    Plain,
    Harmony(Box<HarmonyParser<'static>>),
}

/// One reply's decoder.
pub struct ReplyDecoder {
    mode: Mode,
    /// Content not yet passed on: the start of a reply while undecided, or in harmony mode a
    /// tail that may be the beginning of a marker.
    pending: String,
    tokenizer: Option<&'static Tokenizer>,
    /// Harmony mode read a special token outside any message, or similar; said once at the end.
    pub malformed: Vec<String>,
}

impl ReplyDecoder {
    /// `tokenizer` is needed only for harmony text; without one such text passes as plain.
    pub fn new(tokenizer: Option<&'static Tokenizer>) -> ReplyDecoder {
        ReplyDecoder {
            mode: Mode::Undecided,
            pending: String::new(),
            tokenizer,
            malformed: Vec::new(),
        }
    }

    /// Whether the reply turned out to be unparsed harmony.
    pub fn is_harmony(&self) -> bool {
        matches!(self.mode, Mode::Harmony(_))
    }

    /// Feeds one delta; text for the transcript goes to `emit`.
    pub fn push(&mut self, kind: DeltaKind, text: &str, emit: &mut impl FnMut(Channel, &str)) {
        match kind {
            DeltaKind::Reasoning => emit(Channel::Analysis, text),
            DeltaKind::Content => {
                self.pending.push_str(text);
                self.drain(false, emit);
            }
        }
    }

    /// The stream ended: passes on what was held back and closes an open harmony message.
    pub fn finish(&mut self, emit: &mut impl FnMut(Channel, &str)) {
        self.drain(true, emit);
        if let Mode::Harmony(parser) = &mut self.mode {
            let malformed = &mut self.malformed;
            parser.finish(&mut |event| forward(event, malformed, emit));
        }
    }

    fn drain(&mut self, at_end: bool, emit: &mut impl FnMut(Channel, &str)) {
        if let Mode::Undecided = self.mode {
            let start = self.pending.trim_start();
            let harmony = HARMONY_OPENINGS
                .iter()
                .any(|marker| start.starts_with(marker));
            let could_be = HARMONY_OPENINGS
                .iter()
                .any(|marker| marker.starts_with(start));
            self.mode = match (harmony, self.tokenizer) {
                (true, Some(tokenizer)) => Mode::Harmony(Box::new(HarmonyParser::after_prompt(
                    tokenizer,
                    "assistant",
                ))),
                _ if could_be && !at_end => return,
                _ => Mode::Plain,
            };
        }
        match &mut self.mode {
            Mode::Undecided => {}
            Mode::Plain => {
                if !self.pending.is_empty() {
                    emit(Channel::Final, &self.pending);
                    self.pending.clear();
                }
            }
            Mode::Harmony(parser) => {
                let Some(tokenizer) = self.tokenizer else {
                    return;
                };
                // Hold back a tail that may be half of a marker; text tokens need no such care,
                // as the parser puts bytes back together whatever the split.
                let keep_from = if at_end {
                    self.pending.len()
                } else {
                    match self.pending.rfind('<') {
                        Some(open) if could_begin_marker(&self.pending[open..]) => open,
                        _ => self.pending.len(),
                    }
                };
                let ready: String = self.pending.drain(..keep_from).collect();
                if ready.is_empty() {
                    return;
                }
                let malformed = &mut self.malformed;
                match tokenizer.encode_with_special_tokens(&ready) {
                    Ok(ids) => {
                        for id in ids {
                            parser.push(id, &mut |event| forward(event, malformed, emit));
                        }
                    }
                    // Text the tokenizer cannot encode is still the model's: show it as is.
                    Err(error) => {
                        malformed.push(error.to_string());
                        emit(Channel::Final, &ready);
                    }
                }
            }
        }
    }
}

/// Whether `tail` (from a `<` on) may be the start of a special token still arriving.
fn could_begin_marker(tail: &str) -> bool {
    tail.len() < LONGEST_MARKER && (tail == "<" || tail.starts_with("<|")) && !tail.contains("|>")
}

fn forward(
    event: ParseEvent<'_>,
    malformed: &mut Vec<String>,
    emit: &mut impl FnMut(Channel, &str),
) {
    match event {
        // Text outside a known channel is shown as answer text, as the local engine does.
        ParseEvent::Text { channel, text } => emit(channel.unwrap_or(Channel::Final), text),
        ParseEvent::Malformed(malformation) => malformed.push(malformation.to_string()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(pieces: &[(DeltaKind, &str)]) -> (Vec<(Channel, String)>, bool) {
        let tokenizer = Tokenizer::shared().unwrap();
        let mut decoder = ReplyDecoder::new(Some(tokenizer));
        let mut out: Vec<(Channel, String)> = Vec::new();
        let mut emit = |channel: Channel, text: &str| match out.last_mut() {
            Some((last, joined)) if *last == channel => joined.push_str(text),
            _ => out.push((channel, text.to_string())),
        };
        for (kind, text) in pieces {
            decoder.push(*kind, text, &mut emit);
        }
        decoder.finish(&mut emit);
        (out, decoder.is_harmony())
    }

    #[test]
    fn parsed_replies_pass_through() {
        let (out, harmony) = decode(&[
            (DeltaKind::Reasoning, "think"),
            (DeltaKind::Content, "Hel"),
            (DeltaKind::Content, "lo <|not a marker"),
        ]);
        assert!(!harmony);
        assert_eq!(
            out,
            vec![
                (Channel::Analysis, "think".to_string()),
                (Channel::Final, "Hello <|not a marker".to_string())
            ]
        );
    }

    #[test]
    fn raw_harmony_is_parsed_even_with_markers_split_across_events() {
        let text = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi there!<|return|>";
        for split in [1, 2, 3, 5, 7, 13] {
            let pieces: Vec<String> = text
                .chars()
                .collect::<Vec<_>>()
                .chunks(split)
                .map(|chunk| chunk.iter().collect())
                .collect();
            let deltas: Vec<(DeltaKind, &str)> = pieces
                .iter()
                .map(|piece| (DeltaKind::Content, piece.as_str()))
                .collect();
            let (out, harmony) = decode(&deltas);
            assert!(harmony, "split {split}");
            assert_eq!(
                out,
                vec![
                    (Channel::Analysis, "The user greets.".to_string()),
                    (Channel::Final, "Hi there!".to_string())
                ],
                "split {split}"
            );
        }
    }

    #[test]
    fn a_short_plain_reply_that_looks_like_a_marker_start_is_kept() {
        let (out, harmony) = decode(&[(DeltaKind::Content, "<|")]);
        assert!(!harmony);
        assert_eq!(out, vec![(Channel::Final, "<|".to_string())]);
    }
}
