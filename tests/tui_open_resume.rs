//! Ctrl-O: opening a saved chat hands it to the engine at once, so the engine restores its KV
//! snapshot while the user reads and types, not when the next message is sent.

mod support;

use ossterm::engine::protocol::{Channel, ChatMessage, Conversation, Event, Settings};
use ossterm::tui::store::StoreOutcome;
use ossterm::tui::{Effect, Msg};
use std::time::Instant;
use support::{random_engine, ready_app, screen};

#[test]
fn opening_a_chat_asks_the_engine_to_resume_it() {
    let dir = std::env::temp_dir();
    let mut app = ready_app(
        Settings::default(),
        &dir,
        random_engine("synthetic tiny", "avx2", Settings::default()),
    );
    let opened = Conversation {
        messages: vec![
            ChatMessage::user("what is the tide?"),
            ChatMessage::assistant(Channel::Final, "the sea rising and falling"),
        ],
        ..Conversation::default()
    };
    let effects = app.update(
        Msg::Stored(StoreOutcome::Opened {
            path: dir.join("resume-test.json"),
            result: Ok(Box::new(opened.clone())),
        }),
        Instant::now(),
    );
    let resumes: Vec<Conversation> = effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Resume(chat) => Some(chat.conversation()),
            _ => None,
        })
        .collect();
    assert_eq!(resumes.len(), 1, "{effects:?}");
    assert_eq!(resumes[0].messages, opened.messages);
    // After any settings the chat brings: the engine renders it with them.
    let resume_at = effects
        .iter()
        .position(|e| matches!(e, Effect::Resume(_)))
        .unwrap();
    assert!(!effects[resume_at..]
        .iter()
        .any(|e| matches!(e, Effect::Engine(_))));
}

/// What the engine says after resuming shows on the status line, and the gauges show the tiers'
/// use and the resumed turns.
#[test]
fn the_resume_notice_and_the_tiers_show_on_screen() {
    use ossterm::engine::kv_tiers::TierUsage;
    use ossterm::engine::protocol::{CacheHits, StatsSample};
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(
        Settings::default(),
        dir.path(),
        random_engine("synthetic tiny", "avx2", Settings::default()),
    );
    let now = Instant::now();
    // The engine's words for a disk resume (`Resumed::describe`, first letter raised).
    let resumed = ossterm::engine::Resumed {
        tokens: 4096,
        tier: ossterm::engine::kv_tiers::Tier::Disk,
        took: std::time::Duration::from_millis(310),
    };
    let mut notice = resumed.describe();
    notice[..1].make_ascii_uppercase();
    assert_eq!(notice, "Resumed 4,096 tokens from disk in 0.3 s");
    app.update(Msg::Engine(Event::Notice(notice.clone())), now);
    let sample = StatsSample {
        decode_tokens_per_second: None,
        prefill_tokens_per_second: None,
        time_to_first_token: None,
        process_memory_bytes: None,
        machine_memory_bytes: None,
        kv_tokens_used: 4096,
        kv_tokens_capacity: 8192,
        kv_cache: ossterm::engine::protocol::KvCacheType::F16,
        context_used: 4096,
        context_limit: 8192,
        turn_hits: CacheHits::default(),
        session_hits: CacheHits {
            reused: 4096,
            prompt: 4200,
        },
        threads: 2,
        kernel_path: "avx2".to_string(),
        weight_format: Default::default(),
        unembedding: Default::default(),
        activations: Default::default(),
        kv_tiers: TierUsage {
            ram_bytes: 3 << 29,
            ram_snapshots: 2,
            disk_bytes: 5 << 29,
            disk_snapshots: 7,
            snapshot_hits: 3,
        },
    };
    app.update(Msg::Engine(Event::Stats(sample)), now);
    let text = screen(&mut app, 120, 40);
    assert!(text.contains(&notice), "no resume notice:\n{text}");
    assert!(
        text.contains("KV tiers    RAM 1.5G · disk 2.5G "),
        "no tiers gauge:\n{text}"
    );
    // The restored tokens count as cache hits.
    assert!(
        text.contains("cache hit   turn - · chat 98% "),
        "no cache hits:\n{text}"
    );
}
