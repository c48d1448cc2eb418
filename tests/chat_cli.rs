//! `ossterm render`, `tokenize` and `run` as a user calls them.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn ossterm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(args)
        .output()
        .expect("the ossterm binary runs")
}

fn stdout_of(output: &Output) -> String {
    assert!(
        output.status.success(),
        "ossterm failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout.clone()).unwrap()
}

fn ids_on_last_line(stdout: &str) -> Vec<u32> {
    let last = stdout.lines().last().expect("some output");
    last.split(',').map(|id| id.parse().unwrap()).collect()
}

#[test]
fn render_prints_openai_harmony_ids_on_the_last_line() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harmony");
    for name in [
        "spec_two_turns",
        "three_turns_with_reasoning",
        "user_types_special_tokens",
    ] {
        let conversation = dir.join(format!("{name}.conversation.json"));
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.expected.json"))).unwrap(),
        )
        .unwrap();
        let conversation = conversation.to_str().unwrap();
        for (flags, key) in [
            (&[][..], "ids"),
            (&["--keep-reasoning"][..], "ids_keep_reasoning"),
        ] {
            let mut args = vec!["render", "--conversation", conversation];
            args.extend_from_slice(flags);
            let ids = ids_on_last_line(&stdout_of(&ossterm(&args)));
            let want: Vec<u32> = serde_json::from_value(expected[key].clone()).unwrap();
            assert_eq!(ids, want, "{name} {key}");
        }
    }
}

#[test]
fn tokenize_round_trips_and_bad_input_is_an_error() {
    let ids = stdout_of(&ossterm(&["tokenize", "Grüße <|end|>"]));
    let ids = ids.trim();
    assert!(!ids.split(',').any(|id| id == "200007"), "{ids}");
    let text = stdout_of(&ossterm(&["tokenize", "--decode", ids]));
    assert_eq!(text, "Grüße <|end|>\n");
    let special = stdout_of(&ossterm(&["tokenize", "--special", "<|end|>"]));
    assert_eq!(special.trim(), "200007");
    let bad = ossterm(&["tokenize", "--decode", "12,999999"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("999999"));
}

fn run_json(args: &[&str], stdin: Option<&str>) -> serde_json::Value {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(["run", "--synthetic", "tiny", "--json"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    } else {
        drop(child.stdin.take());
    }
    let output = child.wait_with_output().unwrap();
    serde_json::from_str(stdout_of(&output).trim()).expect("one JSON object")
}

#[test]
fn run_synthetic_tiny_reports_json_and_reads_stdin() {
    let result = run_json(
        &["--prompt", "hi", "--max-tokens", "80", "--seed", "1"],
        None,
    );
    for key in [
        "answer",
        "reasoning",
        "prompt_tokens",
        "generated_tokens",
        "stop_reason",
        "ttft_ms",
        "prefill_tps",
        "decode_tps",
    ] {
        assert!(result.get(key).is_some(), "{key} missing from {result}");
    }
    // The default system message plus `hi`: 57 ids, as the harmony fixture says.
    assert_eq!(result["prompt_tokens"], 57);
    let generated = result["generated_tokens"].as_u64().unwrap();
    assert!((1..=80).contains(&generated), "{result}");
    if generated == 80 {
        assert_eq!(result["stop_reason"], "max_tokens");
    }
    // Same seed, same output.
    assert_eq!(
        run_json(
            &["--prompt", "hi", "--max-tokens", "80", "--seed", "1"],
            None
        )["answer"],
        result["answer"]
    );

    let piped = run_json(
        &["--prompt", "-", "--max-tokens", "3", "--reasoning", "low"],
        Some("hi"),
    );
    assert_eq!(piped["prompt_tokens"], 57);
    assert_eq!(piped["generated_tokens"], 3);
}

#[test]
fn run_errors_name_the_numbers_and_files() {
    let too_long = ossterm(&[
        "run",
        "--synthetic",
        "tiny",
        "--prompt",
        "hi",
        "--context",
        "20",
    ]);
    assert!(!too_long.status.success());
    let message = String::from_utf8_lossy(&too_long.stderr);
    assert!(
        message.contains("57 tokens") && message.contains("only 20"),
        "{message}"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.json");
    std::fs::write(&path, r#"{"messages": [{"role": "user"}]}"#).unwrap();
    let broken = ossterm(&["render", "--conversation", path.to_str().unwrap()]);
    assert!(!broken.status.success());
    let message = String::from_utf8_lossy(&broken.stderr);
    assert!(
        message.contains("broken.json") && message.contains("content"),
        "{message}"
    );
}

#[test]
fn run_continues_a_saved_conversation() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harmony");
    let conversation = dir.join("spec_two_turns.conversation.json");
    let cache = tempfile::tempdir().unwrap();
    let args = [
        "--conversation",
        conversation.to_str().unwrap(),
        "--max-tokens",
        "2",
        "--temperature",
        "0",
        "--cache-dir",
        cache.path().to_str().unwrap(),
    ];
    let first = run_json(&args, None);
    assert_eq!(first["prompt_tokens"], 103);
    assert_eq!(first["reused_tokens"], 0);
    // The second run resumes the saved conversation from the snapshot the first one wrote.
    let second = run_json(&args, None);
    assert_eq!(second["reused_tokens"], 102);
    assert_eq!(second["answer"], first["answer"]);
    assert_eq!(second["reasoning"], first["reasoning"]);
}

#[test]
fn ctrl_c_stops_cleanly_with_what_was_generated() {
    let child = Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args([
            "run",
            "--synthetic",
            "tiny",
            "--json",
            "--prompt",
            "hi",
            "--seed",
            "5",
            "--context",
            "100000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let output = child.wait_with_output().unwrap();
    let result: serde_json::Value = serde_json::from_str(stdout_of(&output).trim()).unwrap();
    assert_eq!(result["stop_reason"], "cancelled", "{result}");
}
