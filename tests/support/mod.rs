//! What the test files share: for the TUI, an app as `main` builds it, keys, and the screen drawn
//! on a ratatui TestBackend the way the loop draws it; `server` for the HTTP tests, `attention`
//! for the kernel's, `fixtures` for the golden fixtures. Included with `mod support;`.
// Each test binary uses its own part of this module.
#![allow(dead_code)]

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ossterm::engine::protocol::{
    CacheHits, EngineInfo, Event, KvCacheType, Settings, StatsSample, WeightFormat,
};
use ossterm::tui::store::ChatStore;
use ossterm::tui::view::{conversation_viewport, draw};
use ossterm::tui::{App, EngineStatus, Msg};
use ratatui::backend::TestBackend;
use ratatui::layout::Rect;
use ratatui::Terminal;
use std::path::Path;
use std::time::{Duration, Instant};

pub mod attention;
pub mod fixtures;
pub mod server;

/// How many of `a`'s values differ from `b`'s in their bits (`a` and `b` of one length): the
/// tests that hold two ways of computing to the same arithmetic count these.
pub fn differing_bits(a: &[f32], b: &[f32]) -> usize {
    assert_eq!(a.len(), b.len(), "compared outputs of different lengths");
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
}

/// The app as it starts: chats saved in `dir`, the engine still loading its weights.
pub fn loading_app(settings: Settings, dir: &Path) -> App {
    App::new(
        settings,
        ChatStore::new(dir.to_path_buf()),
        EngineStatus::Loading {
            stage: "weights".to_string(),
            done: 0,
            total: 1,
        },
    )
}

/// What an engine on random weights says when it is ready.
pub fn random_engine(model_label: &str, kernel_path: &str, settings: Settings) -> EngineInfo {
    EngineInfo {
        model_label: model_label.to_string(),
        random_weights: true,
        kernel_path: kernel_path.to_string(),
        settings,
    }
}

/// [`loading_app`] after the engine reported `info`.
pub fn ready_app(settings: Settings, dir: &Path, info: EngineInfo) -> App {
    let mut app = loading_app(settings, dir);
    app.update(Msg::Engine(Event::Ready(info)), Instant::now());
    app
}

pub fn key(code: KeyCode) -> Msg {
    Msg::Key(KeyEvent::new(code, KeyModifiers::NONE))
}

pub fn ctrl(character: char) -> Msg {
    Msg::Key(KeyEvent::new(
        KeyCode::Char(character),
        KeyModifiers::CONTROL,
    ))
}

/// Draws `app` as the loop does: the layout message first, then the frame.
pub fn draw_screen(app: &mut App, width: u16, height: u16) -> Terminal<TestBackend> {
    let mut terminal = Terminal::new(TestBackend::new(width, height)).unwrap();
    let (pane_width, pane_height) = conversation_viewport(Rect::new(0, 0, width, height), app);
    app.update(
        Msg::Layout {
            width: pane_width,
            height: pane_height,
        },
        Instant::now(),
    );
    terminal.draw(|frame| draw(frame, app)).unwrap();
    terminal
}

/// Every cell's symbol, row by row, each row ending in a line feed.
pub fn cell_text(terminal: &Terminal<TestBackend>) -> String {
    let buffer = terminal.backend().buffer();
    let mut text = String::new();
    for y in 0..buffer.area.height {
        for x in 0..buffer.area.width {
            text.push_str(buffer[(x, y)].symbol());
        }
        text.push('\n');
    }
    text
}

/// [`draw_screen`] as text.
pub fn screen(app: &mut App, width: u16, height: u16) -> String {
    cell_text(&draw_screen(app, width, height))
}

/// A stats sample of a 20b decoding at 7.9 tokens/s on two threads with the avx512 kernels, 300
/// of 8,192 tokens used, no cache hits.
pub fn stats_sample() -> StatsSample {
    StatsSample {
        decode_tokens_per_second: Some(7.9),
        prefill_tokens_per_second: Some(61.0),
        time_to_first_token: Some(Duration::from_millis(900)),
        process_memory_bytes: Some(13 << 30),
        machine_memory_bytes: Some(24 << 30),
        kv_tokens_used: 300,
        kv_tokens_capacity: 8192,
        kv_cache: KvCacheType::F16,
        context_used: 300,
        context_limit: 8192,
        turn_hits: CacheHits::default(),
        session_hits: CacheHits::default(),
        threads: 2,
        kernel_path: "avx512".to_string(),
        weight_format: WeightFormat::Q8,
        unembedding: ossterm::engine::protocol::Unembedding::TwoStage,
        activations: Default::default(),
        kv_tiers: Default::default(),
    }
}
