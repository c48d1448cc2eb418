//! From the harmony parser's events to what an OpenAI client reads: the analysis channel becomes
//! reasoning text, every other channel (final, a commentary preamble, or text whose header the
//! model garbled) becomes content, and the request's stop strings cut the content.

use crate::chat::{Channel, ParseEvent};

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
}

impl ReplyText {
    pub fn new(stops: Vec<String>) -> ReplyText {
        ReplyText {
            stops: StopMatcher::new(stops),
            ..ReplyText::default()
        }
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
            ParseEvent::MessageStart { channel, .. } => self.channel = channel,
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

    /// Takes the pending (reasoning, content).
    pub fn take(&mut self) -> (String, String) {
        (
            std::mem::take(&mut self.reasoning),
            std::mem::take(&mut self.content),
        )
    }
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

    #[test]
    fn analysis_is_reasoning_and_the_rest_content() {
        let mut reply = ReplyText::new(Vec::new());
        reply.on_event(text(Some(Channel::Analysis), "think"));
        reply.on_event(text(Some(Channel::Final), "answer"));
        reply.on_event(text(None, "!"));
        assert_eq!(reply.take(), ("think".into(), "answer!".into()));
        assert_eq!(reply.take(), (String::new(), String::new()));
    }

    #[test]
    fn stop_strings_cut_the_content_even_across_pieces() {
        let mut reply = ReplyText::new(vec!["END".into(), String::new()]);
        for piece in ["one E", "N", "D two"] {
            reply.on_event(text(Some(Channel::Final), piece));
        }
        assert!(reply.stopped());
        reply.finish();
        assert_eq!(reply.take().1, "one ");

        let mut reply = ReplyText::new(vec!["xyz".into()]);
        reply.on_event(text(Some(Channel::Final), "héllo x"));
        // The last two bytes may start the stop string: held back until the reply ends.
        assert_eq!(reply.take().1, "héllo");
        reply.finish();
        assert_eq!(reply.take().1, " x");
        assert!(!reply.stopped());
    }
}
