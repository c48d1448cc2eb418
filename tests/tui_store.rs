//! Saved chats on disk: what the store accepts, and what a failed save leaves behind.

use ossterm::engine::protocol::{Channel, ChatMessage, Conversation};
use ossterm::tui::store::ChatStore;

fn conversation() -> Conversation {
    Conversation {
        messages: vec![
            ChatMessage::user("hello"),
            ChatMessage::assistant(Channel::Final, "hi"),
        ],
        ..Conversation::default()
    }
}

#[test]
fn a_chat_file_starting_with_a_byte_order_mark_opens() {
    let dir = tempfile::tempdir().unwrap();
    let store = ChatStore::new(dir.path().to_path_buf());
    let path = dir.path().join("chat-bom.json");
    let json = format!("\u{feff}{}", conversation().to_json());
    std::fs::write(&path, json).unwrap();
    assert_eq!(store.load(&path).unwrap(), conversation());
    let (chats, unreadable) = store.list().unwrap();
    assert_eq!((chats.len(), unreadable), (1, 0));
}

#[test]
fn a_save_writes_the_file_whole_and_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let store = ChatStore::new(dir.path().join("chats"));
    let path = dir.path().join("chats").join("chat-1.json");
    store.save(&path, &conversation()).unwrap();
    assert_eq!(store.load(&path).unwrap(), conversation());
    let names: Vec<_> = std::fs::read_dir(dir.path().join("chats"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, ["chat-1.json"]);
}

#[test]
fn a_failed_save_removes_its_temporary_file_and_keeps_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = ChatStore::new(dir.path().to_path_buf());
    // The rename cannot replace a directory that holds a file.
    let path = dir.path().join("chat-blocked.json");
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("keep"), "x").unwrap();
    let error = store.save(&path, &conversation()).unwrap_err();
    assert!(
        error.to_string().contains("chat-blocked.json"),
        "names the file: {error}"
    );
    assert!(
        !dir.path().join("chat-blocked.json.tmp").exists(),
        "the temporary file was left behind"
    );
    assert!(path.join("keep").exists());
}
