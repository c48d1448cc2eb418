//! The message box: the text being written, the history of sent messages, and what may enter the
//! box. The box never holds a control character other than its line breaks (a tab is shown as
//! spaces by the editor): whatever a terminal sends (CR or CRLF line breaks in a paste, escape
//! bytes typed one key at a time) is normalised on the way in, so nothing raw reaches the screen,
//! the model or the chat file.

use crossterm::event::{KeyCode, KeyEvent};
use tui_textarea::TextArea;

const PLACEHOLDER: &str = "Message (Enter sends, Alt-Enter new line, F1 help)";

/// `text` with CRLF and lone CR line breaks turned into LF, and every other control character
/// except tab dropped, as well as invisible format characters that would make the terminal and
/// the layout disagree (bidirectional overrides, zero-width characters).
pub fn normalize_pasted(text: &str) -> String {
    let mut normalized = String::with_capacity(text.len());
    let mut characters = text.chars().peekable();
    while let Some(character) = characters.next() {
        match character {
            '\r' => {
                characters.next_if_eq(&'\n');
                normalized.push('\n');
            }
            '\n' | '\t' => normalized.push(character),
            _ if character.is_control() => {}
            _ if crate::tui::markdown::is_invisible_format(character) => {}
            _ => normalized.push(character),
        }
    }
    normalized
}

/// A text editor with what the app wants of it: no cursor-line underline, the placeholder, and
/// lines of `text` (already normalised).
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

/// Hands `key` to `editor` unless it would put a control character into it: a control character
/// arriving as a typed character (a paste the terminal sends key by key) becomes a line break if
/// it is one, and is dropped otherwise.
pub fn edit(editor: &mut TextArea<'static>, key: KeyEvent) {
    match key.code {
        KeyCode::Char('\r' | '\n') => editor.insert_newline(),
        KeyCode::Char(character)
            if character.is_control() || crate::tui::markdown::is_invisible_format(character) => {}
        _ => {
            editor.input(key);
        }
    }
}

/// Inserts pasted text into `editor`, normalised.
pub fn paste(editor: &mut TextArea<'static>, text: &str) {
    editor.insert_str(normalize_pasted(text));
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

    /// Replaces the text (normalised), the cursor at its end.
    pub fn set_text(&mut self, text: &str) {
        self.editor = editor(&normalize_pasted(text), Some(PLACEHOLDER));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crossterm::event::KeyModifiers;

    #[test]
    fn pastes_lose_carriage_returns_and_control_characters() {
        assert_eq!(normalize_pasted("a\r\nb\rc\nd"), "a\nb\nc\nd");
        assert_eq!(normalize_pasted("\r\r\n"), "\n\n");
        assert_eq!(normalize_pasted("x\x1b[2Jy\u{7}\tz\u{202e}"), "x[2Jy\tz");
    }

    #[test]
    fn typed_control_characters_never_enter_the_box() {
        let mut input = InputBox::default();
        for character in ['a', '\r', 'b', '\u{1b}', '\u{8}', 'c'] {
            input.key(KeyEvent::new(KeyCode::Char(character), KeyModifiers::NONE));
        }
        assert_eq!(input.lines(), ["a", "bc"]);
        input.paste("1\r2\r\n3");
        assert_eq!(input.text(), "a\nbc1\n2\n3");
    }
}
