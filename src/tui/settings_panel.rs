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
    /// Config keys of the settings the engine does not control, and what the panel shows for
    /// them instead of a value.
    pub fixed: Vec<String>,
    pub fixed_shown_as: String,
}

impl SettingsPanel {
    pub fn new(current: Settings) -> SettingsPanel {
        let available = std::thread::available_parallelism().map_or(1, |count| count.get());
        SettingsPanel {
            max_threads: available.max(current.threads),
            current,
            engine: None,
            cursor: 0,
            fixed: Vec::new(),
            fixed_shown_as: String::new(),
        }
    }

    /// The engine decides the settings with these config keys: they show `shown_as` and stay.
    pub fn fix(&mut self, keys: Vec<String>, shown_as: String) {
        self.fixed = keys;
        self.fixed_shown_as = shown_as;
    }

    /// What the panel shows instead of `setting`'s value, when the engine decides it.
    pub fn fixed_value(&self, setting: &Setting) -> Option<&str> {
        self.fixed
            .iter()
            .any(|key| key == setting.key)
            .then_some(self.fixed_shown_as.as_str())
    }

    /// [`SettingsPanel::fixed_value`] by config key.
    pub fn fixed_key(&self, key: &str) -> Option<&str> {
        crate::settings::by_key(key).and_then(|setting| self.fixed_value(setting))
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
