//! Ctrl-O: opening a saved chat hands it to the engine at once, so the engine restores its KV
//! snapshot while the user reads and types, not when the next message is sent.

use ossterm::engine::protocol::{Channel, ChatMessage, Conversation, EngineInfo, Event, Settings};
use ossterm::tui::store::{ChatStore, StoreOutcome};
use ossterm::tui::{App, Effect, EngineStatus, Msg};
use std::time::Instant;

#[test]
fn opening_a_chat_asks_the_engine_to_resume_it() {
    let dir = std::env::temp_dir();
    let mut app = App::new(
        Settings::default(),
        ChatStore::new(dir.clone()),
        EngineStatus::Loading {
            stage: "weights".to_string(),
            done: 0,
            total: 1,
        },
    );
    let info = EngineInfo {
        model_label: "synthetic tiny".to_string(),
        random_weights: true,
        kernel_path: "avx2".to_string(),
        settings: Settings::default(),
    };
    app.update(Msg::Engine(Event::Ready(info)), Instant::now());
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
