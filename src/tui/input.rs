//! The message box: the text being written and the history of sent messages.

use crossterm::event::KeyEvent;
use tui_textarea::TextArea;

const PLACEHOLDER: &str = "Message (Enter sends, Alt-Enter new line, F1 help)";

/// A text editor with what the app wants of it: no cursor-line underline, the placeholder, and
/// lines of `text`.
pub fn editor(text: &str, placeholder: Option<&str>) -> TextArea<'static> {
    let mut editor = TextArea::new(text.split('\n').map(str::to_string).collect());
    if let Some(placeholder) = placeholder {
        editor.set_placeholder_text(placeholder);
    }
    editor.set_cursor_line_style(ratatui::style::Style::default());
    editor.move_cursor(tui_textarea::CursorMove::Bottom);
    editor.move_cursor(tui_textarea::CursorMove::End);
    editor
}

/// Hands `key` to `editor`.
pub fn edit(editor: &mut TextArea<'static>, key: KeyEvent) {
    editor.input(key);
}

/// Inserts pasted text into `editor`.
pub fn paste(editor: &mut TextArea<'static>, text: &str) {
    editor.insert_str(text);
}

/// The message box and its history.
pub struct InputBox {
    editor: TextArea<'static>,
    history: Vec<String>,
    history_cursor: Option<usize>,
}

impl Default for InputBox {
    fn default() -> Self {
        InputBox {
            editor: editor("", Some(PLACEHOLDER)),
            history: Vec::new(),
            history_cursor: None,
        }
    }
}

impl InputBox {
    pub fn editor(&self) -> &TextArea<'static> {
        &self.editor
    }

    pub fn lines(&self) -> &[String] {
        self.editor.lines()
    }

    pub fn text(&self) -> String {
        self.editor.lines().join("\n")
    }

    pub fn is_empty(&self) -> bool {
        self.editor.lines().iter().all(|line| line.is_empty())
    }

    /// (row, column) of the cursor.
    pub fn cursor(&self) -> (usize, usize) {
        self.editor.cursor()
    }

    pub fn key(&mut self, key: KeyEvent) {
        edit(&mut self.editor, key);
    }

    pub fn newline(&mut self) {
        self.editor.insert_newline();
    }

    pub fn paste(&mut self, text: &str) {
        paste(&mut self.editor, text);
    }

    /// Replaces the text, the cursor at its end.
    pub fn set_text(&mut self, text: &str) {
        self.editor = editor(text, Some(PLACEHOLDER));
    }

    /// Empties the box, keeping `sent` in the history.
    pub fn sent(&mut self, sent: String) {
        self.history.push(sent);
        self.history_cursor = None;
        self.editor = editor("", Some(PLACEHOLDER));
    }

    pub fn has_history(&self) -> bool {
        !self.history.is_empty()
    }

    pub fn browsing_history(&self) -> bool {
        self.history_cursor.is_some()
    }

    /// Shows the previous (`older`) or next sent message; past the newest, an empty box.
    pub fn recall(&mut self, older: bool) {
        if self.history.is_empty() {
            return;
        }
        let next = match (self.history_cursor, older) {
            (None, true) => Some(self.history.len() - 1),
            (None, false) => None,
            (Some(0), true) => Some(0),
            (Some(index), true) => Some(index - 1),
            (Some(index), false) if index + 1 < self.history.len() => Some(index + 1),
            (Some(_), false) => None,
        };
        self.history_cursor = next;
        let text = next.map_or(String::new(), |index| self.history[index].clone());
        self.editor = editor(&text, Some(PLACEHOLDER));
    }
}
