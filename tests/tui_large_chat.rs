//! A saved chat of 90,000 messages costs no more per key than one of ten: only what is visible is
//! wrapped and drawn. Costs are compared with each other, not with a clock budget, so a loaded
//! machine slows both alike.

mod support;

use crossterm::event::KeyCode;
use ossterm::engine::protocol::{
    CacheHits, Channel, ChatMessage, Conversation, Event, Settings, StopReason,
};
use ossterm::tui::store::StoreOutcome;
use ossterm::tui::view::{conversation_viewport, draw};
use ossterm::tui::{App, Msg};
use ratatui::backend::TestBackend;
use ratatui::layout::Rect;
use ratatui::Terminal;
use std::time::{Duration, Instant};
use support::{key, random_engine, ready_app};

fn chat(messages: usize) -> Conversation {
    let answer =
        "Here is **an answer** with `code`, a list:\n- one item that is long enough to wrap \
                  around the pane at least once when the pane is narrow\n- two\n\n```rust\nfn \
                  main() {}\n```\nand a closing paragraph of ordinary words to wrap. "
            .repeat(2);
    let messages = (0..messages)
        .map(|index| {
            if index % 2 == 0 {
                ChatMessage::user(format!("question {index}: what about this and that? ").repeat(3))
            } else {
                ChatMessage::assistant(Channel::Final, format!("{index} {answer}"))
            }
        })
        .collect();
    Conversation {
        messages,
        ..Conversation::default()
    }
}

fn app_with(conversation: Conversation) -> App {
    let dir = std::env::temp_dir();
    let mut app = ready_app(
        Settings::default(),
        &dir,
        random_engine("synthetic tiny", "avx2", Settings::default()),
    );
    app.update(
        Msg::Stored(StoreOutcome::Opened {
            path: dir.join("large-chat-test.json"),
            result: Ok(Box::new(conversation)),
        }),
        Instant::now(),
    );
    app
}

/// One key as the loop handles it: update, the layout message, the frame.
fn key_to_frame(app: &mut App, terminal: &mut Terminal<TestBackend>, code: KeyCode) {
    let now = Instant::now();
    app.update(key(code), now);
    let size = terminal.size().unwrap();
    let (width, height) = conversation_viewport(Rect::new(0, 0, size.width, size.height), app);
    app.update(Msg::Layout { width, height }, now);
    terminal.draw(|frame| draw(frame, app)).unwrap();
}

/// Every cell's symbol, in one line.
fn shown(terminal: &Terminal<TestBackend>) -> String {
    let cells = terminal.backend().buffer().content();
    cells.iter().map(|cell| cell.symbol()).collect()
}

/// The fastest of a few rounds of typing, scrolling and resizing, per key.
fn cost_per_key(app: &mut App) -> Duration {
    let mut terminal = Terminal::new(TestBackend::new(130, 40)).unwrap();
    // The first frame wraps what is visible; the keys after it measure the steady state.
    key_to_frame(app, &mut terminal, KeyCode::Char('a'));
    let keys = [
        KeyCode::Char('x'),
        KeyCode::Char('y'),
        KeyCode::PageUp,
        KeyCode::PageUp,
        KeyCode::Backspace,
        KeyCode::PageDown,
        KeyCode::PageDown,
        KeyCode::PageDown,
    ];
    (0..7)
        .map(|round| {
            // A width change every other round: the cache is wrapped again, for what shows.
            let width = if round % 2 == 0 { 130 } else { 100 };
            terminal.backend_mut().resize(width, 40);
            let start = Instant::now();
            for code in keys {
                key_to_frame(app, &mut terminal, code);
            }
            start.elapsed() / keys.len() as u32
        })
        .min()
        .unwrap()
}

/// The fastest of a few rounds of sending a message and receiving the end of its reply (each
/// saves the chat, and the message asks for a request holding the whole conversation).
fn cost_of_a_turn(app: &mut App) -> Duration {
    let mut terminal = Terminal::new(TestBackend::new(130, 40)).unwrap();
    (0..5)
        .map(|_| {
            let start = Instant::now();
            key_to_frame(app, &mut terminal, KeyCode::Char('q'));
            key_to_frame(app, &mut terminal, KeyCode::Enter);
            let id = app.active_request().expect("the message was sent");
            let done = Event::TurnDone {
                id,
                reason: StopReason::Finished,
                hits: CacheHits::default(),
                generated_tokens: 1,
            };
            app.update(Msg::Engine(done), Instant::now());
            key_to_frame(app, &mut terminal, KeyCode::Char('z'));
            start.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn sending_in_a_long_chat_shares_the_chat_instead_of_copying_it() {
    let mut large = app_with(chat(90_000));
    let turn = cost_of_a_turn(&mut large);
    // What the update used to do twice per message, and once per save: build the conversation.
    let copy = (0..3)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(large.conversation());
            start.elapsed()
        })
        .min()
        .unwrap();
    // Sharing costs a pointer per turn (three times: the request and two saves); copying costs
    // every byte of the chat.
    assert!(
        turn * 5 <= copy,
        "a turn took {turn:?} on the UI thread, a copy of the chat {copy:?}"
    );
    eprintln!("a turn in the 90,000-message chat: {turn:?}; one copy of the chat: {copy:?}");
}

#[test]
fn a_key_costs_the_same_in_a_chat_of_ninety_thousand_messages() {
    let mut small = app_with(chat(10));
    let large_chat = chat(90_000);
    let bytes = large_chat.to_json().len();
    assert!(bytes > 30 << 20, "the large chat is only {bytes} bytes");
    let mut large = app_with(large_chat);
    assert_eq!(large.transcript.len(), 45_000);

    let small_cost = cost_per_key(&mut small);
    let large_cost = cost_per_key(&mut large);
    // Before the transcript drew only what shows, the large chat took seconds per key: thousands
    // of times the small one's cost. A factor of 4 leaves room for cache effects of the larger
    // heap; 100 µs keeps the comparison above timer noise on a fast machine.
    let bound = small_cost.max(Duration::from_micros(100)) * 4;
    assert!(
        large_cost <= bound,
        "a key in the 90,000-message chat took {large_cost:?}, in the 10-message chat \
         {small_cost:?}"
    );
    // Scrolled to the top and back, the view still shows the right lines.
    let mut terminal = Terminal::new(TestBackend::new(130, 40)).unwrap();
    large.update(key(KeyCode::Tab), Instant::now());
    key_to_frame(&mut large, &mut terminal, KeyCode::Home);
    let top = shown(&terminal);
    assert!(top.contains("question 0:"), "{top}");
    key_to_frame(&mut large, &mut terminal, KeyCode::End);
    let bottom = shown(&terminal);
    assert!(bottom.contains("89999 Here is"), "{bottom}");
    eprintln!("per key: 10 messages {small_cost:?}, 90,000 messages {large_cost:?}");
}
