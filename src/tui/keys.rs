//! The key map: every binding, as data the help overlay and the README list.

/// (keys, what they do), in the order the help overlay shows them.
pub const KEY_BINDINGS: &[(&str, &str)] = &[
    ("Enter", "send the message (input focused)"),
    ("Alt-Enter / Shift-Enter", "new line in the message"),
    (
        "Up / Down (first/last line)",
        "previous / next sent message (history)",
    ),
    (
        "Esc",
        "stop generation; close an overlay; back to the input",
    ),
    ("Ctrl-R", "regenerate the last answer"),
    ("Ctrl-E", "edit and resend the last user message"),
    ("Ctrl-N", "new chat"),
    (
        "Ctrl-S",
        "save the chat now (it is also saved after every turn)",
    ),
    ("Ctrl-O", "open a saved chat (list: Up/Down, Enter, Esc)"),
    ("Ctrl-Y", "copy the last answer to the clipboard (OSC 52)"),
    (
        "Ctrl-T",
        "expand / collapse the reasoning of the selected or last answer",
    ),
    ("Ctrl-L", "repaint the whole screen"),
    ("Tab / Shift-Tab", "focus input -> conversation -> settings"),
    ("PageUp / PageDown, wheel", "scroll the conversation"),
    ("End (conversation)", "follow the stream again"),
    (
        "Up / Down (conversation)",
        "select a turn; Enter or Space expands its reasoning",
    ),
    ("Up / Down (settings)", "select a setting"),
    (
        "Left / Right (settings)",
        "change it; Enter edits text settings",
    ),
    (
        "F2",
        "engine view: expert routing map, decode time shares, roofline",
    ),
    ("F1 or ?", "this help (? when the input is empty)"),
    ("Ctrl-C / Ctrl-Q", "quit"),
];
