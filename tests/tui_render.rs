//! The screen in known states, rendered with ratatui's TestBackend and checked as text; the state
//! is driven the way the app drives it: keys and engine events through `App::update`.

mod support;

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ossterm::engine::protocol::{
    ActivationFormat, CacheHits, Channel, Command, Event, RequestKind, Settings, StatsSample,
    StopReason, WeightFormat,
};
use ossterm::tui::store::ChatStore;
use ossterm::tui::{App, Effect, EngineStatus, Msg};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use support::{ctrl, draw_screen, key, loading_app, random_engine, screen};

/// `App::update` with the file work carried out as the loop does, and generation requests built
/// as the loop's engine thread builds them; returns the effects for the engine and the terminal.
fn step(app: &mut App, message: Msg, now: Instant) -> Vec<Effect> {
    let mut others = Vec::new();
    let mut messages = vec![message];
    while let Some(message) = messages.pop() {
        for effect in app.update(message, now) {
            match effect {
                Effect::Store(request) => {
                    messages.push(Msg::Stored(app.chat_file.store.clone().perform(request)))
                }
                Effect::Generate(job) => {
                    others.push(Effect::Engine(Command::Generate(Box::new(job.request()))))
                }
                other => others.push(other),
            }
        }
    }
    others
}

fn type_text(app: &mut App, text: &str, now: Instant) {
    for character in text.chars() {
        step(app, key(KeyCode::Char(character)), now);
    }
}

/// The app with the engine ready: a tiny model on random weights, the avx512 kernels.
fn ready_app(dir: &std::path::Path) -> App {
    ready_with(dir, Settings::default())
}

/// The app when the engine reports it is ready with `engine` settings.
fn ready_with(dir: &std::path::Path, engine: Settings) -> App {
    let settings = Settings {
        threads: 2,
        ..Settings::default()
    };
    let mut app = loading_app(settings, dir);
    let info = random_engine("synthetic tiny", "avx512", engine);
    step(&mut app, Msg::Engine(Event::Ready(info)), Instant::now());
    app
}

/// Types `text` and presses Enter: the effects of sending it.
fn send(app: &mut App, text: &str, now: Instant) -> Vec<Effect> {
    type_text(app, text, now);
    step(app, key(KeyCode::Enter), now)
}

/// The engine's end of turn `id`.
fn turn_done(id: u64, reason: StopReason, generated_tokens: usize) -> Msg {
    Msg::Engine(Event::TurnDone {
        id,
        reason,
        hits: CacheHits::default(),
        generated_tokens,
    })
}

fn sent_request(effects: &[Effect]) -> (u64, RequestKind, usize) {
    effects
        .iter()
        .find_map(|effect| match effect {
            Effect::Engine(Command::Generate(request)) => Some((
                request.id,
                request.kind,
                request.conversation.messages.len(),
            )),
            _ => None,
        })
        .expect("a generate command")
}

fn token(id: u64, channel: Channel, text: &str) -> Msg {
    Msg::Engine(Event::Token {
        id,
        channel,
        text: text.to_string(),
    })
}

fn stats(decode: f64) -> StatsSample {
    StatsSample {
        decode_tokens_per_second: Some(decode),
        prefill_tokens_per_second: Some(123.4),
        time_to_first_token: Some(Duration::from_millis(850)),
        process_memory_bytes: Some(3 << 30),
        turn_hits: CacheHits {
            reused: 90,
            prompt: 100,
        },
        session_hits: CacheHits {
            reused: 90,
            prompt: 180,
        },
        activations: ActivationFormat::Mixed,
        ..support::stats_sample()
    }
}

#[test]
fn loading_and_missing_model_screens() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = App::new(
        Settings::default(),
        ChatStore::new(dir.path().to_path_buf()),
        EngineStatus::Loading {
            stage: "reading weights".to_string(),
            done: 1,
            total: 4,
        },
    );
    let text = screen(&mut app, 100, 30);
    assert!(
        text.contains("Loading the model: reading weights"),
        "{text}"
    );
    assert!(text.contains("25%"), "{text}");

    app.engine = EngineStatus::ModelMissing {
        path: PathBuf::from("models/gpt-oss-20b"),
    };
    let text = screen(&mut app, 100, 30);
    assert!(
        text.contains("No model found at models/gpt-oss-20b"),
        "{text}"
    );
    assert!(text.contains("ossterm --synthetic tiny"), "{text}");
    assert!(text.contains("download openai/gpt-oss-20b"), "{text}");
}

#[test]
fn streaming_then_collapsed_reasoning_then_expanded() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let start = Instant::now();
    let effects = send(&mut app, "What is 2 + 2?", start);
    let (id, kind, messages) = sent_request(&effects);
    assert_eq!((kind, messages), (RequestKind::NewTurn, 1));

    step(
        &mut app,
        Msg::Engine(Event::PrefillProgress {
            id,
            done: 40,
            total: 80,
            reused: 0,
        }),
        start,
    );
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("Reading the prompt… 40/80 tokens"), "{text}");

    step(&mut app, token(id, Channel::Analysis, "Simple "), start);
    step(
        &mut app,
        token(id, Channel::Analysis, "arithmetic."),
        start + Duration::from_millis(100),
    );
    step(&mut app, Msg::Engine(Event::Stats(stats(11.5))), start);
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("Thinking… (2 tokens)"), "{text}");
    assert!(text.contains("Simple arithmetic."), "{text}");
    assert!(text.contains("11.5 tok/s"), "{text}");
    assert!(text.contains("turn 90% · chat 50%"), "{text}");
    assert!(text.contains("avx512"), "{text}");
    assert!(text.contains("RANDOM WEIGHTS"), "{text}");

    let answer_at = start + Duration::from_millis(1500);
    step(
        &mut app,
        token(id, Channel::Final, "**4**, as `2+2` shows.\n- a list item"),
        answer_at,
    );
    step(&mut app, turn_done(id, StopReason::Finished, 9), answer_at);
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("▸ Thought (2 tokens, 1.5 s)"), "{text}");
    assert!(
        !text.contains("Simple arithmetic."),
        "reasoning should be collapsed:\n{text}"
    );
    assert!(text.contains("4, as 2+2 shows."), "{text}");
    assert!(text.contains("• a list item"), "{text}");
    assert!(!text.contains("<|"), "no harmony markup on screen:\n{text}");

    step(&mut app, ctrl('t'), answer_at);
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("▾ Thought (2 tokens, 1.5 s)"), "{text}");
    assert!(text.contains("Simple arithmetic."), "{text}");
}

#[test]
fn settings_panel_and_help_overlay() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    step(&mut app, key(KeyCode::Tab), now);
    step(&mut app, key(KeyCode::Tab), now);
    let text = screen(&mut app, 110, 40);
    for label in [
        "threads",
        "weight format",
        "KV cache",
        "reasoning effort",
        "temperature",
        "top-p",
        "top-k",
        "min-p",
        "max tokens",
        "seed",
        "keep reasoning",
        "activations",
        "system prompt",
        "developer instr.",
    ] {
        assert!(text.contains(label), "missing {label}:\n{text}");
    }
    // Down to weight format, step it: the engine is told, and the panel shows the new value.
    step(&mut app, key(KeyCode::Down), now);
    let effects = step(&mut app, key(KeyCode::Right), now);
    let applied = effects.iter().find_map(|effect| match effect {
        Effect::Engine(Command::ApplySettings(settings)) => Some(settings.weight_format),
        _ => None,
    });
    assert_eq!(applied, Some(WeightFormat::Q4));
    let text = screen(&mut app, 110, 40);
    assert!(text.contains("›weight format     q4"), "{text}");

    step(&mut app, key(KeyCode::F(1)), now);
    let text = screen(&mut app, 110, 40);
    assert!(text.contains("Keys (any key closes)"), "{text}");
    for keys in [
        "Ctrl-R",
        "Ctrl-E",
        "Ctrl-N",
        "Ctrl-S",
        "Ctrl-O",
        "Ctrl-Y",
        "Esc",
        "Ctrl-C / Ctrl-Q",
    ] {
        assert!(text.contains(keys), "help lacks {keys}:\n{text}");
    }
    step(&mut app, key(KeyCode::Char('x')), now);
    assert!(app.overlay.is_none());
}

#[test]
fn error_cancel_regenerate_edit_and_saved_chats() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "hello", now));
    step(&mut app, token(id, Channel::Final, "partial answer"), now);

    // Esc cancels: the engine is told, and the partial answer stays with a marker.
    let effects = step(&mut app, key(KeyCode::Esc), now);
    assert!(effects.contains(&Effect::Engine(Command::Cancel(id))));
    step(&mut app, turn_done(id, StopReason::Cancelled, 2), now);
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("partial answer"), "{text}");
    assert!(text.contains("[stopped]"), "{text}");

    // The chat file was written as turns went by, atomically, in the conversation JSON shape.
    let saved = app.chat_file.path.clone().expect("autosaved");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!(json["messages"][0]["content"], "hello");
    assert_eq!(json["messages"][1]["channel"], "final");
    assert!(json["system"]["identity"].is_string());

    // Ctrl-R regenerates: a request for the same user message, the old reply gone.
    let (regen_id, kind, messages) = sent_request(&step(&mut app, ctrl('r'), now));
    assert_eq!((kind, messages), (RequestKind::Regenerate, 1));
    step(
        &mut app,
        Msg::Engine(Event::Error {
            id: Some(regen_id),
            message: "forward pass failed".to_string(),
        }),
        now,
    );
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("[error: forward pass failed]"), "{text}");
    assert!(!text.contains("partial answer"), "{text}");

    // Ctrl-E puts the last user message back in the input; Enter resends it as an edit.
    step(&mut app, ctrl('e'), now);
    assert_eq!(app.input.lines(), ["hello"]);
    let (edit_id, kind, _) = sent_request(&send(&mut app, " again", now));
    assert_eq!(kind, RequestKind::EditAndResend);
    step(&mut app, token(edit_id, Channel::Final, "fine"), now);
    step(&mut app, turn_done(edit_id, StopReason::Finished, 1), now);
    assert_eq!(
        step(&mut app, ctrl('y'), now),
        vec![Effect::Copy("fine".to_string())]
    );

    // New chat, then open the saved one from the list.
    step(&mut app, ctrl('n'), now);
    assert!(app.transcript.turns().is_empty());
    step(&mut app, ctrl('o'), now);
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("Open a saved chat"), "{text}");
    assert!(text.contains("hello again"), "{text}");
    step(&mut app, key(KeyCode::Enter), now);
    assert_eq!(app.transcript.turns().len(), 1);
    assert_eq!(app.transcript.turns()[0].user, "hello again");
    assert_eq!(
        app.transcript.turns()[0].reply.as_ref().unwrap().answer,
        "fine"
    );
}

#[test]
fn scrolling_up_stops_following_and_end_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "count", now));
    for number in 0..60 {
        step(
            &mut app,
            token(id, Channel::Final, &format!("line {number}\n")),
            now,
        );
    }
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("line 59"), "follows the stream:\n{text}");
    step(&mut app, key(KeyCode::PageUp), now);
    let text = screen(&mut app, 100, 30);
    assert!(!text.contains("line 59"), "{text}");
    assert!(text.contains("scrolled"), "{text}");
    step(&mut app, token(id, Channel::Final, "line 60\n"), now);
    let text = screen(&mut app, 100, 30);
    assert!(
        !text.contains("line 60"),
        "stays where the user scrolled:\n{text}"
    );
    step(&mut app, key(KeyCode::PageDown), now);
    step(&mut app, key(KeyCode::PageDown), now);
    let text = screen(&mut app, 100, 30);
    assert!(
        text.contains("line 60"),
        "back at the bottom follows again:\n{text}"
    );
}

#[test]
fn history_recalls_sent_messages() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "first", now));
    step(&mut app, turn_done(id, StopReason::Finished, 0), now);
    step(&mut app, key(KeyCode::Up), now);
    assert_eq!(app.input.lines(), ["first"]);
    step(&mut app, key(KeyCode::Down), now);
    assert_eq!(app.input.lines(), [""]);
    // Alt-Enter adds a line instead of sending.
    type_text(&mut app, "a", now);
    let effects = step(
        &mut app,
        Msg::Key(KeyEvent::new(KeyCode::Enter, KeyModifiers::ALT)),
        now,
    );
    assert!(effects.is_empty());
    assert_eq!(app.input.lines().len(), 2);
}

#[test]
fn gauges_show_kernels_formats_and_a_running_conversion() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    step(&mut app, Msg::Engine(Event::Stats(stats(12.5))), now);
    let text = screen(&mut app, 110, 40);
    for row in [
        "kernels     avx512",
        "weights     q8",
        "activations mixed",
        "KV format   f16",
        "threads     2",
    ] {
        assert!(text.contains(row), "missing {row}:\n{text}");
    }
    // Weight format q8 -> q4: the gauge shows the serving format, the target and the progress.
    step(&mut app, key(KeyCode::Tab), now);
    step(&mut app, key(KeyCode::Tab), now);
    step(&mut app, key(KeyCode::Down), now);
    step(&mut app, key(KeyCode::Right), now);
    step(
        &mut app,
        Msg::Engine(Event::SettingsProgress {
            what: "re-quantizing weights to q4".to_string(),
            done: 8,
            total: 16,
        }),
        now,
    );
    let text = screen(&mut app, 110, 40);
    assert!(text.contains("weights     q8 → q4 50%"), "{text}");
}

/// Focuses the settings panel and moves the cursor to `label`'s row.
fn select_setting(app: &mut App, label: &str, now: Instant) {
    step(app, key(KeyCode::Tab), now);
    step(app, key(KeyCode::Tab), now);
    let row = ossterm::settings::SETTINGS
        .iter()
        .position(|setting| setting.label == label)
        .expect("a settings row");
    for _ in 0..row {
        step(app, key(KeyCode::Down), now);
    }
}

#[test]
fn activations_setting_is_sent_to_the_engine_and_the_gauge_follows_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    step(&mut app, Msg::Engine(Event::Stats(stats(12.5))), now);
    let (id, _, _) = sent_request(&send(&mut app, "hello", now));
    step(&mut app, turn_done(id, StopReason::Finished, 1), now);
    select_setting(&mut app, "activations", now);
    let text = screen(&mut app, 110, 40);
    assert!(text.contains("›activations       mixed"), "{text}");

    // Right steps mixed -> q8x2: the engine gets the whole settings with the new format.
    let effects = step(&mut app, key(KeyCode::Right), now);
    let applied: Vec<&Settings> = effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Engine(Command::ApplySettings(settings)) => Some(settings.as_ref()),
            _ => None,
        })
        .collect();
    assert_eq!(applied.len(), 1, "{effects:?}");
    assert_eq!(applied[0].activations, ActivationFormat::Q8x2);
    assert_eq!(
        applied[0].weight_format,
        WeightFormat::Q8,
        "nothing else moves"
    );
    let text = screen(&mut app, 140, 40);
    assert!(text.contains("›activations       q8x2"), "{text}");
    assert!(
        text.contains(
            "Activations q8x2 needs a new cache: the next turn re-prefills the whole conversation"
        ),
        "{text}"
    );
    // Until the engine reports the switch, the gauge shows the serving format and the target.
    assert!(text.contains("activations mixed → q8x2"), "{text}");

    let switched = Box::new(applied[0].clone());
    step(&mut app, Msg::Engine(Event::SettingsApplied(switched)), now);
    let mut sample = stats(12.5);
    sample.activations = ActivationFormat::Q8x2;
    step(&mut app, Msg::Engine(Event::Stats(sample)), now);
    let text = screen(&mut app, 140, 40);
    assert!(text.contains("activations q8x2 "), "{text}");
    assert!(!text.contains("→ q8x2"), "{text}");
    assert_eq!(
        app.settings
            .engine
            .as_ref()
            .map(|settings| settings.activations),
        Some(ActivationFormat::Q8x2)
    );
}

#[test]
fn ready_shows_the_activation_format_the_engine_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Settings {
        activations: ActivationFormat::Q8,
        ..Settings::default()
    };
    let app = ready_with(dir.path(), engine);
    assert_eq!(app.settings.current.activations, ActivationFormat::Q8);
}

#[test]
fn changing_reasoning_effort_warns_about_the_re_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "hello", now));
    step(&mut app, token(id, Channel::Final, "hi"), now);
    step(&mut app, turn_done(id, StopReason::Finished, 1), now);
    step(&mut app, key(KeyCode::Tab), now);
    step(&mut app, key(KeyCode::Tab), now);
    for _ in 0..4 {
        step(&mut app, key(KeyCode::Down), now);
    }
    let text = screen(&mut app, 110, 40);
    assert!(text.contains("changing it re-prefills the chat"), "{text}");
    let effects = step(&mut app, key(KeyCode::Right), now);
    let applied = effects.iter().find_map(|effect| match effect {
        Effect::Engine(Command::ApplySettings(settings)) => Some(settings.reasoning_effort),
        _ => None,
    });
    assert_eq!(applied.map(|effort| effort.name()), Some("high"));
    let text = screen(&mut app, 140, 40);
    assert!(
        text.contains("Reasoning effort high changes the system message: the next turn re-prefills the whole conversation"),
        "{text}"
    );
    // The next request carries the new effort in its system message.
    step(&mut app, key(KeyCode::Tab), now);
    let effects = send(&mut app, "again", now);
    let effort = effects.iter().find_map(|effect| match effect {
        Effect::Engine(Command::Generate(request)) => request.conversation.system.reasoning,
        _ => None,
    });
    assert_eq!(effort.map(|effort| effort.name()), Some("high"));
}

#[test]
fn engine_thread_ending_mid_turn_fails_the_reply_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "hello", now));
    step(&mut app, token(id, Channel::Final, "half an ans"), now);
    step(
        &mut app,
        Msg::EngineStopped("ossterm-engine panicked: index out of bounds".to_string()),
        now,
    );
    assert!(!app.is_generating());
    let text = screen(&mut app, 120, 30);
    assert!(text.contains("half an ans"), "{text}");
    assert!(
        text.contains("[error: the engine stopped: ossterm-engine panicked: index out of bounds]"),
        "{text}"
    );
    assert!(text.contains("restart ossterm"), "{text}");
    // What was received is in the chat file.
    let saved = std::fs::read_to_string(app.chat_file.path.clone().unwrap()).unwrap();
    assert!(saved.contains("half an ans"), "{saved}");
}

#[test]
fn control_characters_from_the_model_never_reach_the_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "hi", now));
    // The prompt is read but no text has come yet (a header, or a random model).
    step(
        &mut app,
        Msg::Engine(Event::PrefillProgress {
            id,
            done: 40,
            total: 40,
            reused: 0,
        }),
        now,
    );
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("Generating… · Esc stops"), "{text}");
    step(
        &mut app,
        token(
            id,
            Channel::Final,
            "a\x1b[2Jb\rc\u{8}d\u{202e}e\u{200b}f\tg\u{9b}h",
        ),
        now,
    );
    let terminal = draw_screen(&mut app, 100, 30);
    for cell in terminal.backend().buffer().content() {
        assert!(
            !cell.symbol().chars().any(|character| character.is_control()
                || ('\u{202a}'..='\u{202e}').contains(&character)),
            "a control or bidi character reached a cell: {:?}",
            cell.symbol()
        );
    }
    let text = screen(&mut app, 100, 30);
    assert!(text.contains("a␛[2Jb␍c␈def    g\u{fffd}h"), "{text}");
}

#[test]
fn a_finished_reply_and_ctrl_l_repaint_the_whole_screen() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    let (id, _, _) = sent_request(&send(&mut app, "hi", now));
    let done = turn_done(id, StopReason::Finished, 3);
    assert_eq!(step(&mut app, done.clone(), now), vec![Effect::Redraw]);
    // A late duplicate of an old request changes nothing.
    assert!(step(&mut app, done, now).is_empty());
    assert_eq!(step(&mut app, ctrl('l'), now), vec![Effect::Redraw]);
}

/// Every cell of the screen is free of control characters.
fn assert_no_control_cells(app: &mut App, width: u16, height: u16) {
    let terminal = draw_screen(app, width, height);
    for cell in terminal.backend().buffer().content() {
        assert!(
            !cell.symbol().chars().any(char::is_control),
            "a control character reached a cell: {:?}",
            cell.symbol()
        );
    }
}

#[test]
fn a_paste_with_carriage_returns_is_sent_and_saved_with_line_feeds() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    // What tmux, xterm and VTE send for a three-line paste, CRLF from Windows Terminal.
    step(
        &mut app,
        Msg::Paste("first line\rsecond line\r\nthird\x1b[31m".to_string()),
        now,
    );
    assert_eq!(
        app.input.lines(),
        ["first line", "second line", "third[31m"]
    );
    assert_no_control_cells(&mut app, 100, 30);
    let text = screen(&mut app, 100, 30);
    let border_rows = text
        .lines()
        .filter(|row| row.contains("│first line"))
        .count();
    assert_eq!(border_rows, 1, "the box keeps its left border:\n{text}");

    // A paste the terminal sends key by key: CR as a typed character.
    for character in ['\r', 'x', '\u{7}', 'y'] {
        step(&mut app, key(KeyCode::Char(character)), now);
    }
    let effects = step(&mut app, key(KeyCode::Enter), now);
    let sent = effects
        .iter()
        .find_map(|effect| match effect {
            Effect::Engine(Command::Generate(request)) => {
                Some(request.conversation.messages[0].content.clone())
            }
            _ => None,
        })
        .expect("a generate command");
    assert_eq!(sent, "first line\nsecond line\nthird[31m\nxy");
    let saved = std::fs::read_to_string(app.chat_file.path.clone().unwrap()).unwrap();
    assert!(
        !saved.contains("\\r") && saved.contains("first line\\nsecond line"),
        "{saved}"
    );
    assert_no_control_cells(&mut app, 100, 30);
}

#[test]
fn the_settings_editor_takes_pastes_without_carriage_returns() {
    let dir = tempfile::tempdir().unwrap();
    let mut app = ready_app(dir.path());
    let now = Instant::now();
    select_setting(&mut app, "developer instr.", now);
    step(&mut app, key(KeyCode::Enter), now);
    step(&mut app, Msg::Paste("be\rbrief".to_string()), now);
    assert_no_control_cells(&mut app, 110, 40);
    step(&mut app, key(KeyCode::Enter), now);
    assert_eq!(app.settings.current.developer_instructions, "be\nbrief");
}
