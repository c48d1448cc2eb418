//! `ossterm --demo`: a scripted session that runs on its own. It types a few prompts, then moves
//! the forward pass from one thread to two and the weights from q8 to q4 and back while the
//! gauges and the engine view show what changes, and starts over until a key is pressed.
//!
//! The script only decides what to do next; [`crate::tui::App`] carries it out through the same
//! paths as keys (sending a message, changing a setting), so the demo shows the real app.

use crate::engine::protocol::{Settings, WeightFormat};
use std::time::{Duration, Instant};

/// Characters typed per tick of the demo clock: fast enough not to bore, slow enough to read.
pub const TYPED_PER_TICK: usize = 3;

/// How often the loop ticks the demo.
pub const TICK: Duration = Duration::from_millis(60);

/// Longest wait for a turn or a weight conversion before the script moves on anyway (a stuck
/// step must not freeze a demo left running).
const STEP_TIMEOUT: Duration = Duration::from_secs(600);

/// The replies' token budget: enough for the decode gauges to settle, short enough for a loop to
/// take a few minutes on the 20b. Random (synthetic) weights never write a harmony header, so the
/// parser shows their text only after its 64-token header limit: 96 leaves a visible reply.
pub const DEMO_MAX_TOKENS: usize = 96;

/// One step of the script.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    /// A line for the status bar, saying what the next steps show.
    Say(&'static str),
    /// Type this message into the input box and send it.
    Ask(&'static str),
    /// Wait until no reply is being generated.
    AwaitReply,
    /// Change the thread count.
    Threads(usize),
    /// Change the weight format and wait until the engine serves it.
    Weights(WeightFormat),
    /// Wait so the audience can read the screen.
    Pause(Duration),
    /// Start a new chat (the loop's end).
    NewChat,
}

/// The script, played in order and then from the start again.
pub const SCRIPT: &[Step] = &[
    Step::Threads(1),
    Step::Say("Demo: one thread, q8 weights"),
    Step::Ask(
        "Explain in two sentences why decoding a language model is bound by memory bandwidth.",
    ),
    Step::AwaitReply,
    Step::Ask("Which experts did you just use?"),
    Step::AwaitReply,
    Step::Say("Demo: two threads: watch decode speed and the roofline bar"),
    Step::Threads(2),
    Step::Ask("Write a haiku about a CPU cache."),
    Step::AwaitReply,
    Step::Say("Demo: converting attention and unembedding weights to q4"),
    Step::Weights(WeightFormat::Q4),
    Step::Ask("Now say the same thing with q4 weights: fewer bytes per token."),
    Step::AwaitReply,
    Step::Say("Demo: back to q8 weights"),
    Step::Weights(WeightFormat::Q8),
    Step::Ask("And once more with q8."),
    Step::AwaitReply,
    Step::Pause(Duration::from_secs(3)),
    Step::NewChat,
];

/// What the app should do on this tick.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Nothing yet.
    Wait,
    Say(&'static str),
    /// Put these characters into the input box.
    Type(String),
    /// Send the input box.
    Send,
    /// Apply these settings.
    Apply(Settings),
    NewChat,
}

/// What the script needs to know of the app on a tick.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub ready: bool,
    pub generating: bool,
    /// The weight format the engine serves now.
    pub serving_weights: Option<WeightFormat>,
    pub settings: &'a Settings,
}

#[derive(Debug, Clone)]
pub struct Demo {
    step: usize,
    /// Characters of the current message typed so far.
    typed: usize,
    /// When the current step started (for pauses and timeouts).
    since: Instant,
    /// Loops completed.
    pub loops: u64,
}

impl Demo {
    pub fn new(now: Instant) -> Demo {
        Demo {
            step: 0,
            typed: 0,
            since: now,
            loops: 0,
        }
    }

    /// The step being played.
    pub fn current(&self) -> Step {
        SCRIPT[self.step]
    }

    fn advance(&mut self, now: Instant) {
        self.step += 1;
        self.typed = 0;
        self.since = now;
        if self.step == SCRIPT.len() {
            self.step = 0;
            self.loops += 1;
        }
    }

    /// The next action: at most one per tick, so every change gets drawn.
    pub fn tick(&mut self, view: View<'_>, now: Instant) -> Action {
        if !view.ready {
            return Action::Wait;
        }
        let waited = now.saturating_duration_since(self.since);
        match self.current() {
            Step::Say(text) => {
                self.advance(now);
                Action::Say(text)
            }
            Step::Ask(message) => {
                if view.generating {
                    return Action::Wait;
                }
                let characters = message.chars().count();
                if self.typed < characters {
                    let next: String = message
                        .chars()
                        .skip(self.typed)
                        .take(TYPED_PER_TICK)
                        .collect();
                    self.typed += next.chars().count();
                    return Action::Type(next);
                }
                self.advance(now);
                Action::Send
            }
            Step::AwaitReply => {
                if !view.generating || waited >= STEP_TIMEOUT {
                    self.advance(now);
                }
                Action::Wait
            }
            Step::Threads(threads) => {
                self.advance(now);
                let mut next = view.settings.clone();
                next.threads = threads;
                next.sampling.max_tokens = DEMO_MAX_TOKENS;
                Action::Apply(next)
            }
            Step::Weights(format) => {
                if view.settings.weight_format != format {
                    let mut next = view.settings.clone();
                    next.weight_format = format;
                    return Action::Apply(next);
                }
                if view.serving_weights == Some(format) || waited >= STEP_TIMEOUT {
                    self.advance(now);
                }
                Action::Wait
            }
            Step::Pause(length) => {
                if waited >= length {
                    self.advance(now);
                }
                Action::Wait
            }
            Step::NewChat => {
                self.advance(now);
                Action::NewChat
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plays_the_script_in_order_and_loops() {
        let start = Instant::now();
        let mut demo = Demo::new(start);
        let mut settings = Settings {
            threads: 4,
            ..Settings::default()
        };
        let mut serving = WeightFormat::Q8;
        let mut generating = false;
        let mut sent = 0;
        let mut applied_threads = Vec::new();
        let mut formats = Vec::new();
        let mut now = start;
        while demo.loops == 0 {
            now += Duration::from_secs(1);
            let view = View {
                ready: true,
                generating,
                serving_weights: Some(serving),
                settings: &settings,
            };
            match demo.tick(view, now) {
                Action::Send => {
                    sent += 1;
                    generating = true;
                }
                Action::Wait => {
                    // The engine finishes a reply and a conversion by the next tick.
                    generating = false;
                    serving = settings.weight_format;
                }
                Action::Apply(next) => {
                    if next.threads != settings.threads {
                        applied_threads.push(next.threads);
                    }
                    if next.weight_format != settings.weight_format {
                        formats.push(next.weight_format);
                    }
                    settings = next;
                }
                Action::Say(_) | Action::Type(_) | Action::NewChat => {}
            }
            assert!(now < start + Duration::from_secs(3600), "the script stalls");
        }
        assert_eq!(sent, 5);
        assert_eq!(applied_threads, vec![1, 2]);
        assert_eq!(formats, vec![WeightFormat::Q4, WeightFormat::Q8]);
        assert_eq!(settings.sampling.max_tokens, DEMO_MAX_TOKENS);
    }

    #[test]
    fn waits_for_the_engine() {
        let now = Instant::now();
        let mut demo = Demo::new(now);
        let settings = Settings::default();
        let view = View {
            ready: false,
            generating: false,
            serving_weights: None,
            settings: &settings,
        };
        assert_eq!(demo.tick(view, now), Action::Wait);
        assert_eq!(demo.current(), SCRIPT[0]);
    }
}
