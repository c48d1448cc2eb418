//! The terminal UI: state and update ([`state`]), drawing ([`view`]), and the pieces they use.
//! The terminal itself (raw mode, the event loop) lives in `cli::app`, so everything here can be
//! driven by tests through ratatui's `TestBackend`.

pub mod chat_file;
pub mod clipboard;
pub mod demo;
pub mod engine_view;
pub mod gauges;
pub mod input;
pub mod insight;
pub mod keys;
pub mod markdown;
pub mod settings_panel;
pub mod state;
pub mod store;
pub mod transcript;
pub mod view;

pub use state::{App, Effect, EngineStatus, Focus, Msg};
