//! The app's panic hook and terminal restore. In a file of its own because a panic hook is global
//! to the test process.

use ossterm::cli::app::{install_panic_hook, write_terminal_restore};
use std::sync::{Arc, Mutex};

#[test]
fn panic_hook_restores_the_terminal_before_the_message_and_only_for_the_ui_thread() {
    let log: Arc<Mutex<Vec<&str>>> = Arc::default();
    let message_log = Arc::clone(&log);
    // Stands in for the default hook, which prints the message.
    std::panic::set_hook(Box::new(move |_| {
        message_log.lock().unwrap().push("message")
    }));
    let restore_log = Arc::clone(&log);
    let notes = install_panic_hook(move || restore_log.lock().unwrap().push("restore"));

    let outcome = std::panic::catch_unwind(|| panic!("the UI failed"));
    assert!(outcome.is_err());
    assert_eq!(*log.lock().unwrap(), ["restore", "message"]);

    // The engine thread panicking must leave the running UI's terminal alone and keep the
    // message for later.
    let engine = std::thread::Builder::new()
        .name("ossterm-engine".to_string())
        .spawn(|| panic!("the forward pass failed"))
        .unwrap();
    assert!(engine.join().is_err());
    let _ = std::panic::take_hook();
    assert_eq!(*log.lock().unwrap(), ["restore", "message"]);
    let notes = notes.lock().unwrap();
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].contains("ossterm-engine panicked")
            && notes[0].contains("the forward pass failed"),
        "{notes:?}"
    );
}

#[test]
fn restore_leaves_the_alternate_screen_shows_the_cursor_and_stops_mouse_and_paste_reports() {
    let mut written = Vec::new();
    write_terminal_restore(&mut written).unwrap();
    let text = String::from_utf8(written).unwrap();
    for (sequence, meaning) in [
        ("\x1b[?1049l", "leave the alternate screen"),
        ("\x1b[?25h", "show the cursor"),
        ("\x1b[?1000l", "stop mouse reports"),
        ("\x1b[?2004l", "stop bracketed paste"),
    ] {
        assert!(text.contains(sequence), "does not {meaning}: {text:?}");
    }
    // The main screen must come back before the cursor is shown on it.
    assert!(text.find("\x1b[?1049l") < text.find("\x1b[?25h"));
}
