//! Conversation files (`render --conversation`, `run --conversation`, the TUI's saved chats), as
//! bytes from disk through `Conversation::from_json`.
//! Invariants: no panic; a file that parses saves (`to_json`) to a file that parses to the same
//! conversation; it renders as a prompt, and rendering then parsing its history gives its messages
//! back.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use ossterm::chat::{render_for_completion, Conversation, RenderOptions};
use ossterm_fuzz::{check_harmony_round_trip, tokenizer, LimitingAllocator};

/// The tokenizer's tables plus a few copies of an input of at most 64 KiB.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(256);

// The tokenizer is built before fuzzing starts: its half second (more on a busy machine) must
// not count against the first input's timeout.
fuzz_target!(init: { tokenizer(); }, |data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("chat.json");
    let conversation = match Conversation::from_json(text, path) {
        Ok(conversation) => conversation,
        Err(error) => {
            assert!(error.to_string().contains("chat.json"));
            return;
        }
    };
    let saved = conversation.to_json();
    let reloaded = Conversation::from_json(&saved, path)
        .unwrap_or_else(|error| panic!("a saved conversation does not load: {error}\n{saved}"));
    assert_eq!(
        reloaded, conversation,
        "save then load changed the conversation"
    );
    let _ = render_for_completion(tokenizer(), &conversation, &RenderOptions::default());
    check_harmony_round_trip(&conversation);
});
