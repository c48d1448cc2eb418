//! The file the current chat is saved to, and what it holds beyond the turns.

use crate::tui::store::{date_utc, ChatStore};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

/// Harmony's default knowledge cutoff line.
pub const KNOWLEDGE_CUTOFF: &str = crate::chat::conversation::DEFAULT_KNOWLEDGE_CUTOFF;

/// How often the chat file is rewritten while a reply streams.
pub const STREAM_SAVE_INTERVAL: Duration = Duration::from_secs(2);

/// The parts of a chat file the app shows no setting for, kept so a loaded chat is written back
/// with them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatFileExtras {
    pub knowledge_cutoff: Option<String>,
    pub system: serde_json::Map<String, serde_json::Value>,
    pub conversation: serde_json::Map<String, serde_json::Value>,
}

impl Default for ChatFileExtras {
    fn default() -> Self {
        ChatFileExtras {
            knowledge_cutoff: Some(KNOWLEDGE_CUTOFF.to_string()),
            system: serde_json::Map::new(),
            conversation: serde_json::Map::new(),
        }
    }
}

#[derive(Debug)]
pub struct ChatFile {
    pub store: ChatStore,
    /// `None` until the chat is first saved.
    pub path: Option<PathBuf>,
    /// The date in this chat's system message; fixed so the prompt prefix (and its cache) stays
    /// valid. `None` (a loaded chat without one) leaves the line out, as harmony does.
    pub date: Option<String>,
    /// What a loaded chat file holds beyond the settings the app edits (its knowledge cutoff,
    /// fields of other tools), written back unchanged.
    pub extras: ChatFileExtras,
    pub last_stream_save: Option<Instant>,
}

impl ChatFile {
    pub fn new(store: ChatStore) -> ChatFile {
        ChatFile {
            store,
            path: None,
            date: Some(date_utc(SystemTime::now())),
            extras: ChatFileExtras::default(),
            last_stream_save: None,
        }
    }

    /// A fresh chat: no file yet, today's date, harmony's defaults.
    pub fn reset(&mut self) {
        *self = ChatFile::new(self.store.clone());
    }

    /// The file to write, naming a new one the first time.
    pub fn path_for_saving(&mut self) -> PathBuf {
        self.path
            .get_or_insert_with(|| self.store.new_chat_path(SystemTime::now()))
            .clone()
    }
}
