//! What the fuzz targets share: the allocation limit every target runs under, and the harmony
//! round trip the conversation targets check.
//!
//! Each target declares `#[global_allocator] static ALLOC: LimitingAllocator = ...` with its
//! bound; a target that needs more live heap than that aborts, which libFuzzer records as a crash
//! with the input that caused it. libFuzzer's own bookkeeping uses malloc directly and is not
//! counted, so the bound is what the parser under test (plus the tokenizer tables) holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

use ossterm::chat::tokenizer::special;
use ossterm::chat::{
    render_history, Channel, Conversation, HarmonyParser, ParseEvent, RenderOptions, Tokenizer,
};

pub const MIB: usize = 1024 * 1024;

/// Live heap bytes of the process (Rust allocations only).
static LIVE: AtomicUsize = AtomicUsize::new(0);
/// Allocations (and reallocations) made so far, for the paths that promise to make none.
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

/// The system allocator with a ceiling on live heap bytes: crossing it aborts the process.
pub struct LimitingAllocator {
    limit_bytes: usize,
}

impl LimitingAllocator {
    pub const fn with_limit_mib(mib: usize) -> Self {
        LimitingAllocator {
            limit_bytes: mib * MIB,
        }
    }

    fn grow(&self, bytes: usize) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        let live = LIVE
            .fetch_add(bytes, Ordering::Relaxed)
            .saturating_add(bytes);
        if live > self.limit_bytes {
            report_and_abort(bytes, live, self.limit_bytes);
        }
    }
}

/// Says what happened without allocating (the allocator is the caller), then aborts.
#[cold]
fn report_and_abort(request: usize, live: usize, limit: usize) -> ! {
    let mut buffer = [0u8; 160];
    let mut cursor = std::io::Cursor::new(&mut buffer[..]);
    let _ = writeln!(
        cursor,
        "fuzz allocation limit: a request of {request} bytes makes {live} live heap bytes, \
         over the bound of {limit}"
    );
    let written = cursor.position() as usize;
    let _ = std::io::stderr().write_all(&buffer[..written]);
    std::process::abort();
}

// SAFETY: every call goes to the system allocator unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for LimitingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.grow(layout.size());
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.grow(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            self.grow(new_size - layout.size());
        } else {
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocations made by the process so far.
pub fn allocations() -> usize {
    ALLOCATIONS.load(Ordering::Relaxed)
}

/// The tokenizer every target shares (built once per process).
pub fn tokenizer() -> &'static Tokenizer {
    Tokenizer::shared().expect("the o200k_harmony tokenizer is embedded in the binary")
}

/// One message as harmony carries it.
#[derive(Debug, PartialEq, Eq)]
pub struct HarmonyMessage {
    pub role: String,
    pub channel: Option<Channel>,
    pub content: String,
}

/// Renders `conversation` as history (reasoning kept, so every message is in it) and parses the
/// ids back with the streaming parser the engine uses; panics when the messages that come back
/// are not the ones that went in. Returns false when the tokenizer refused the text (the app
/// reports that as an error, nothing to compare).
pub fn check_harmony_round_trip(conversation: &Conversation) -> bool {
    let tokenizer = tokenizer();
    let options = RenderOptions {
        keep_reasoning: true,
    };
    let Ok(ids) = render_history(tokenizer, conversation, &options) else {
        return false;
    };
    let mut expected = vec![HarmonyMessage {
        role: "system".into(),
        channel: None,
        content: ossterm::chat::harmony::system_text(&conversation.system),
    }];
    if let Some(instructions) = &conversation.developer {
        expected.push(HarmonyMessage {
            role: "developer".into(),
            channel: None,
            content: ossterm::chat::harmony::developer_text(instructions),
        });
    }
    expected.extend(conversation.messages.iter().map(|message| HarmonyMessage {
        role: message.role.as_str().into(),
        channel: message.channel,
        content: message.content.clone(),
    }));

    // The parser starts after `<|start|>{role}`, as it does after a generation prompt.
    let role_ids = tokenizer
        .encode_text("system")
        .expect("plain ASCII encodes");
    assert_eq!(ids[0], special::START);
    assert_eq!(&ids[1..1 + role_ids.len()], &role_ids[..]);
    let mut parser = HarmonyParser::after_prompt(tokenizer, "system");
    let mut parsed: Vec<HarmonyMessage> = Vec::new();
    let mut open = false;
    let mut on_event = |event: ParseEvent<'_>| match event {
        ParseEvent::MessageStart { role, channel, .. } => {
            assert!(!open, "a message started inside another");
            open = true;
            parsed.push(HarmonyMessage {
                role: role.into(),
                channel,
                content: String::new(),
            });
        }
        ParseEvent::Text { text, .. } => {
            assert!(open, "text outside a message");
            parsed.last_mut().expect("open message").content += text;
        }
        ParseEvent::MessageEnd { complete, .. } => {
            assert!(open && complete, "a rendered message ended early");
            open = false;
        }
        ParseEvent::Malformed(ossterm::chat::Malformation::MissingChannel) => {}
        other => panic!("rendered history parsed as {other:?}"),
    };
    for &id in &ids[1 + role_ids.len()..] {
        parser.push(id, &mut on_event);
    }
    parser.finish(&mut on_event);
    assert!(!open, "the last message never ended");
    assert_eq!(
        parsed, expected,
        "render then parse changed the conversation"
    );
    true
}
