//! The harmony streaming parser (`chat::parser`) fed any sequence of token ids, as a confused model
//! could generate them: every id of the vocabulary (special ones included) and ids past its end.
//! Input: 3 bytes per id, little-endian, taken modulo a range 64 ids wider than the vocabulary;
//! 0xFFFFFF starts a new generation (`reset`), as the engine does between turns.
//! Invariants: no panic; events nest (text only inside a message, one end per start, nothing but
//! `TokenAfterStop` after a stop); pushing tokens allocates nothing, as the module promises.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ossterm::chat::tokenizer::VOCAB_SIZE;
use ossterm::chat::{HarmonyParser, Malformation, ParseEvent};
use ossterm_fuzz::{allocations, tokenizer, LimitingAllocator};

/// The tokenizer's tables and the parser's fixed buffers.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(256);

const RESET: u32 = 0xFF_FFFF;

#[derive(Default)]
struct Checker {
    open: bool,
    stopped: bool,
    starts: usize,
}

impl Checker {
    fn see(&mut self, event: ParseEvent<'_>) {
        if self.stopped {
            assert!(
                matches!(
                    event,
                    ParseEvent::Malformed(Malformation::TokenAfterStop { .. })
                ),
                "{event:?} after the stop"
            );
            return;
        }
        match event {
            ParseEvent::MessageStart { .. } => {
                assert!(!self.open, "a message started inside another");
                self.open = true;
                self.starts += 1;
            }
            ParseEvent::Text { text, .. } => {
                assert!(self.open, "text outside a message");
                assert!(!text.is_empty(), "empty text event");
            }
            ParseEvent::MessageEnd { .. } => {
                assert!(self.open, "a message ended that never started");
                self.open = false;
            }
            ParseEvent::Stop(_) => {
                assert!(!self.open, "stopped inside a message");
                self.stopped = true;
            }
            ParseEvent::Malformed(_) => {}
        }
    }
}

// The tokenizer is built before fuzzing starts: its half second (more on a busy machine) must
// not count against the first input's timeout.
fuzz_target!(init: { tokenizer(); }, |data: &[u8]| {
    let tokenizer = tokenizer();
    let mut parser = HarmonyParser::after_prompt(tokenizer, "assistant");
    let mut checker = Checker::default();
    let before = allocations();
    for chunk in data.chunks_exact(3) {
        let value = u32::from(chunk[0]) | u32::from(chunk[1]) << 8 | u32::from(chunk[2]) << 16;
        if value == RESET {
            parser.finish(&mut |event| checker.see(event));
            parser.reset("assistant");
            checker = Checker::default();
            continue;
        }
        let id = value % (VOCAB_SIZE as u32 + 64);
        parser.push(id, &mut |event| checker.see(event));
        assert_eq!(parser.is_stopped(), checker.stopped);
    }
    parser.finish(&mut |event| checker.see(event));
    assert!(!checker.open, "finish left a message open");
    assert_eq!(allocations(), before, "parsing allocated");
});
