//! The settings panel's state: the settings as chosen, as the engine applied them, and the row
//! under the cursor. Its rows are [`SETTINGS`], in that order.

use crate::engine::protocol::Settings;
use crate::settings::{Setting, SETTINGS};

#[derive(Debug)]
pub struct SettingsPanel {
    /// The settings as the user chose them.
    pub current: Settings,
    /// The settings the engine reported as applied.
    pub engine: Option<Settings>,
    /// Index into [`SETTINGS`].
    pub cursor: usize,
    /// The panel's upper end for threads.
    pub max_threads: usize,
}

impl SettingsPanel {
    pub fn new(current: Settings) -> SettingsPanel {
        let available = std::thread::available_parallelism().map_or(1, |count| count.get());
        SettingsPanel {
            max_threads: available.max(current.threads),
            current,
            engine: None,
            cursor: 0,
        }
    }

    /// The setting under the cursor.
    pub fn selected(&self) -> &'static Setting {
        &SETTINGS[self.cursor]
    }

    /// Moves the cursor one row up (`up`) or down.
    pub fn move_cursor(&mut self, up: bool) {
        self.cursor = if up {
            self.cursor.saturating_sub(1)
        } else {
            (self.cursor + 1).min(SETTINGS.len() - 1)
        };
    }

    /// The current settings with the selected row stepped one notch.
    pub fn stepped(&self, up: bool) -> Settings {
        let mut next = self.current.clone();
        self.selected().step(&mut next, up, self.max_threads);
        next
    }
}
