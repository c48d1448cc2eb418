//! `ossterm tokenize --decode IDS`: the id list parser and the decoder behind it.
//! Invariants: no panic, and text that decoding produced encodes back (as plain text) to ids that
//! decode to the same text.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ossterm::chat::tokenizer::parse_ids;
use ossterm_fuzz::{tokenizer, LimitingAllocator};

/// The tokenizer's tables (about 60 MiB with tiktoken's maps) plus text of at most 128 bytes per
/// id of the input.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(256);

// The tokenizer is built before fuzzing starts: its half second (more on a busy machine) must
// not count against the first input's timeout.
fuzz_target!(init: { tokenizer(); }, |data: &[u8]| {
    // A command-line argument is a String: clap refuses arguments that are not UTF-8.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let tokenizer = tokenizer();
    let Ok(ids) = parse_ids(text) else {
        return;
    };
    let Ok(decoded) = tokenizer.decode(&ids) else {
        return;
    };
    if let Ok(again) = tokenizer.encode_text(&decoded) {
        assert_eq!(
            tokenizer
                .decode(&again)
                .expect("encoded ids are in the vocabulary"),
            decoded
        );
    }
});
