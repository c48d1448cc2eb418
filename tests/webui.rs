//! The chat page's script (src/server/webui/chat.js) under Node's test runner
//! (tests/webui/chat.test.js), against a real server: an in-process `ossterm serve` on the tiny
//! model, with an API key as a server exposed on a network would have. Skipped, saying so, on a
//! machine without Node.js.

mod support;

use std::process::Command;

use ossterm::model::Precision;
use support::server::{scheduler, Server};

const KEY: &str = "sk-webui-test";

fn node_available() -> bool {
    Command::new("node")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
}

#[test]
fn the_page_script_streams_refuses_and_stops_against_the_server() {
    if !node_available() {
        eprintln!("node not installed: skipping the chat page's script tests");
        return;
    }
    let server = Server::start(
        Precision::Fast,
        2,
        scheduler(2, 8192, 4),
        Some(KEY),
        1 << 20,
    );
    let out = Command::new("node")
        .args(["--test", "tests/webui/chat.test.js"])
        .env("OSSTERM_TEST_SERVER", format!("{}/", server.base))
        .env("OSSTERM_TEST_API_KEY", KEY)
        .output()
        .expect("node runs");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "node --test failed:\n{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every test ran, those against the server too: none was skipped.
    assert!(report.contains("# fail 0"), "{report}");
    assert!(report.contains("# skipped 0"), "{report}");
    assert!(!report.contains("# pass 0"), "{report}");
    // The stopped reply (asked for 4,000 tokens) left the batch when its client went away.
    server.wait_for_metric("ossterm_active_sequences", |active| active == 0.0);
    assert!(server.metric("ossterm_tokens_generated_total") < 1000.0);
    server.stop();
}
