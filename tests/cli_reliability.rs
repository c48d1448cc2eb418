//! The command line under faults and hostile input: a shard truncated while mapped, stdout
//! closed or full, sizes past every limit, too many threads, a full disk. Every case ends in a
//! message and a status, never a panic or a signal, and output made before a failure is kept.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ossterm::model::gguf_builder::{ggml, GgufBuilder, Shape};

fn ossterm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ossterm"))
}

fn run(args: &[&str]) -> Output {
    ossterm()
        .args(args)
        .output()
        .expect("the ossterm binary runs")
}

fn stderr_of(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The stderr of a command clap refused (exit status 2, no panic).
fn usage_error(what: &str, output: &Output) -> String {
    assert_no_panic(what, output);
    assert_eq!(
        output.status.code(),
        Some(2),
        "{what}: {}",
        stderr_of(output)
    );
    stderr_of(output)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn conversation() -> String {
    fixture("harmony/spec_two_turns.conversation.json")
        .display()
        .to_string()
}

/// The command failed with status 1 and a message containing `wanted`, without a panic.
fn assert_fails_with(what: &str, output: &Output, wanted: &str) {
    assert_no_panic(what, output);
    let stderr = stderr_of(output);
    assert_eq!(output.status.code(), Some(1), "{what}: {stderr}");
    assert!(
        stderr.contains(wanted),
        "{what}: wanted {wanted:?} in {stderr}"
    );
}

fn assert_no_panic(what: &str, output: &Output) {
    let stderr = stderr_of(output);
    assert!(!stderr.contains("panicked"), "{what}: {stderr}");
    assert!(
        output.status.code().is_some(),
        "{what}: killed by a signal: {:?}",
        output.status
    );
}

/// A tiny synthetic checkpoint written by `ossterm synth`, as a user would make one.
fn synth_tiny(parent: &Path) -> PathBuf {
    let dir = parent.join("tiny");
    let output = run(&["synth", "--preset", "tiny", "--out", dir.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    dir
}

fn wait_with_deadline(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}; stderr: {}",
                stderr_of(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Runs `generate` (with `extra` arguments) on `model` until it has printed its first id, lets
/// `damage` change the model's file under it, and returns the finished run and all it printed.
fn generate_while(model: &Path, extra: &[&str], damage: impl FnOnce()) -> (Output, String) {
    let mut child = ossterm()
        .args([
            "generate",
            "--greedy",
            "--tokens",
            "1,2,3",
            "--max-tokens",
            "100000",
        ])
        .args(extra)
        .arg("--model")
        .arg(model)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.contains(&b',') {
        assert_eq!(stdout.read(&mut byte).unwrap(), 1, "generate ended early");
        seen.push(byte[0]);
    }
    damage();
    stdout.read_to_end(&mut seen).unwrap();
    let output = wait_with_deadline(child, Duration::from_secs(120));
    (output, String::from_utf8(seen).unwrap())
}

/// The run ended with status 1 and an error naming `file` as changed on disk, and the ids it
/// printed before are kept, whole, on a finished line.
fn assert_stopped_by_change(what: &str, (output, printed): &(Output, String), file: &str) {
    assert_no_panic(what, output);
    let stderr = stderr_of(output);
    assert_eq!(output.status.code(), Some(1), "{what}: {stderr}");
    assert!(
        stderr.contains(&format!("{file} changed on disk while in use")),
        "{what}: {stderr}"
    );
    assert!(printed.ends_with('\n'), "{what}: {printed:?}");
    let ids: Vec<u32> = printed
        .trim_end()
        .split(',')
        .map(|id| id.parse().expect("only whole ids"))
        .collect();
    assert!(ids.len() >= 2, "{what}: {printed:?}");
    assert!(
        ids.len() < 100000,
        "{what}: the run went on after the change"
    );
}

/// Same length, other bytes in the middle, a later modification time: nothing faults, but the
/// weights changed.
fn overwrite_in_place(path: &Path) {
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let middle = file.metadata().unwrap().len() / 2;
    std::os::unix::fs::FileExt::write_all_at(&file, &[0x55; 4096], middle).unwrap();
    file.set_modified(std::time::SystemTime::now() + Duration::from_secs(5))
        .unwrap();
}

#[test]
fn a_shard_truncated_mid_run_is_an_error_naming_it_and_the_ids_so_far_are_kept() {
    let parent = tempfile::tempdir().unwrap();
    for exact in [false, true] {
        let dir = synth_tiny(parent.path());
        let shard = dir.join("model-00001-of-00001.safetensors");
        let extra: &[&str] = if exact { &["--exact"] } else { &[] };
        // Cut the shard to a tenth: the next forward pass reads pages no longer in the file.
        let run = generate_while(&dir, extra, || {
            let length = std::fs::metadata(&shard).unwrap().len();
            std::fs::OpenOptions::new()
                .write(true)
                .open(&shard)
                .unwrap()
                .set_len(length / 10)
                .unwrap();
        });
        assert_stopped_by_change(
            &format!("exact {exact}"),
            &run,
            "model-00001-of-00001.safetensors",
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_shard_overwritten_in_place_mid_run_is_an_error_naming_it() {
    let parent = tempfile::tempdir().unwrap();
    let dir = synth_tiny(parent.path());
    let shard = dir.join("model-00001-of-00001.safetensors");
    let run = generate_while(&dir, &[], || overwrite_in_place(&shard));
    assert_stopped_by_change("safetensors", &run, "model-00001-of-00001.safetensors");
}

#[test]
fn a_gguf_overwritten_in_place_mid_run_is_an_error_naming_it() {
    let parent = tempfile::tempdir().unwrap();
    let file = parent.path().join("tiny.gguf");
    // A context long enough that generate fills the stdout pipe and waits for this test.
    let shape = Shape {
        context: 131072,
        ..Shape::SMALL
    };
    std::fs::write(&file, GgufBuilder::model(shape, ggml::BF16).bytes()).unwrap();
    let run = generate_while(&file, &[], || overwrite_in_place(&file));
    assert_stopped_by_change("gguf", &run, "tiny.gguf");
}

#[test]
fn a_closed_stdout_ends_quietly_with_status_141() {
    let model = fixture("tiny_single");
    let model = model.to_str().unwrap();
    let conversation = conversation();
    let cases: Vec<Vec<&str>> = vec![
        vec!["render", "--conversation", &conversation, "--show-text"],
        vec!["tokenize", "hello world"],
        vec!["tokenize", "--decode", "24912,2375"],
        vec!["info", "--model", model],
        vec!["generate", "--greedy", "--tokens", "1,2", "--model", model],
    ];
    for args in cases {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let output = ossterm()
            .args(&args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_no_panic(&format!("{args:?}"), &output);
        assert_eq!(
            output.status.code(),
            Some(141),
            "{args:?}: {}",
            stderr_of(&output)
        );
        assert_eq!(
            stderr_of(&output)
                .lines()
                .filter(|l| l.starts_with("error"))
                .count(),
            0
        );
    }
}

#[test]
fn a_full_stdout_is_an_error_message() {
    let model = fixture("tiny_single");
    let model = model.to_str().unwrap();
    let conversation = conversation();
    let cases: Vec<Vec<&str>> = vec![
        vec!["render", "--conversation", &conversation],
        vec!["tokenize", "hello world"],
        vec!["info", "--model", model],
        vec!["generate", "--greedy", "--tokens", "1,2", "--model", model],
    ];
    for args in cases {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let output = ossterm()
            .args(&args)
            .stdout(full)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_fails_with(
            &format!("{args:?}"),
            &output,
            "cannot write to standard output: No space left on device",
        );
    }
}

#[test]
fn sizes_past_the_context_or_the_machine_are_refused_with_the_numbers() {
    let model = fixture("tiny_single");
    let model = model.to_str().unwrap();
    let generate = |max: &str| {
        run(&[
            "generate",
            "--greedy",
            "--tokens",
            "1,2,3",
            "--max-tokens",
            max,
            "--model",
            model,
        ])
    };
    let profile = |prompt_tokens: &str| {
        run(&[
            "bench",
            "--synthetic",
            "tiny",
            "--profile",
            "--prompt-tokens",
            prompt_tokens,
        ])
    };
    for (output, wanted) in [
        (
            generate("18446744073709551615"),
            "--max-tokens 18446744073709551615 add up to more than any context holds",
        ),
        (
            generate("1000000000000"),
            "need 1000000000003 positions, but the model's context holds",
        ),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--no-ttft",
                "--depth",
                "18446744073709551615",
            ]),
            "--depth 18446744073709551615",
        ),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--no-ttft",
                "--prompt-tokens",
                "4000000000",
            ]),
            "need 4000000129 positions",
        ),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--no-ttft",
                "--gen-tokens",
                "18446744073709551615",
            ]),
            "add up to more than any context holds",
        ),
        (
            profile("4000000000"),
            "the 32 tokens of the profile's decode prompt plus --prompt-tokens 4000000000 plus --gen-tokens 128 plus the 1 position for the first token need 4000000161 positions",
        ),
        (profile("0"), "--prompt-tokens must be at least 1"),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--profile",
                "--gen-tokens",
                "0",
            ]),
            "--gen-tokens must be at least 1",
        ),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--profile",
                "--depth",
                "200000",
            ]),
            "--depth 200000 plus --prompt-tokens 58",
        ),
        (
            run(&[
                "bench",
                "--synthetic",
                "tiny",
                "--repeat",
                "18446744073709551615",
            ]),
            "--repeat 18446744073709551615 is more than",
        ),
    ] {
        assert_fails_with(wanted, &output, wanted);
    }
    // A grace that no clock can add is refused by the argument parser (usage error: status 2).
    let output = run(&[
        "serve",
        "--synthetic",
        "tiny",
        "--drain-seconds",
        "18446744073709551615",
    ]);
    assert_no_panic("--drain-seconds", &output);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr_of(&output).contains("18446744073709551615 is not in 0..=86400"));
    // An origin that is not one (a path, no scheme) is refused by name before anything loads.
    for bad in ["app.example.com", "https://app.example.com/chat"] {
        let output = run(&["serve", "--synthetic", "tiny", "--cors-origin", bad]);
        assert_no_panic("--cors-origin", &output);
        assert_eq!(output.status.code(), Some(2));
        assert!(
            stderr_of(&output).contains("is not an origin"),
            "{}",
            stderr_of(&output)
        );
    }
    // More ids than the context (64 positions in this fixture) are refused before anything
    // is allocated; the logits themselves are streamed to the file a chunk at a time.
    let ids = vec!["1"; 100].join(",");
    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("logits.bin");
    let output = run(&[
        "logits",
        "--tokens",
        &ids,
        "--out",
        file.to_str().unwrap(),
        "--model",
        model,
    ]);
    assert_fails_with(
        "logits",
        &output,
        "the 100 token ids of --tokens need 100 positions, but the model's context holds 64",
    );
    assert!(!file.exists());
}

#[test]
fn bench_batch_sizes_and_steps_out_of_range_are_refused() {
    for (sizes, wanted) in [
        ("0", "--batch sizes must be 1 to"),
        ("1,100000", "--batch sizes must be 1 to"),
    ] {
        let output = run(&["bench", "--synthetic", "tiny", "--batch", sizes]);
        assert_fails_with("--batch", &output, wanted);
    }
    for (args, wanted) in [
        (&["--batch", "99999999999999999999999"][..], "invalid value"),
        (
            &["--batch", "1", "--batch-steps", "0"][..],
            "0 is not in 1..=1000",
        ),
        (
            &["--batch", "1", "--batch-steps", "18446744073709551615"][..],
            "18446744073709551615 is not in 1..=1000",
        ),
    ] {
        let mut all = vec!["bench", "--synthetic", "tiny"];
        all.extend_from_slice(args);
        let output = run(&all);
        assert_no_panic("bench --batch", &output);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(
            stderr_of(&output).contains(wanted),
            "{args:?}: {}",
            stderr_of(&output)
        );
    }
}

#[test]
fn a_huge_context_is_checked_against_the_machines_memory() {
    // The tiny model's context is 131072 positions of 4 KB each in f32: fits. A config with a
    // context of 2^40 positions would need petabytes, which no machine has.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("tiny_single")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let config_path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["max_position_embeddings"] = (1u64 << 40).into();
    std::fs::write(&config_path, config.to_string()).unwrap();
    let output = run(&[
        "generate",
        "--greedy",
        "--tokens",
        "1",
        "--max-tokens",
        "1000000000000",
        "--model",
        dir.path().to_str().unwrap(),
    ]);
    assert_fails_with("huge context", &output, "but this machine has");
    assert_fails_with(
        "huge context",
        &output,
        "KV cache of 1000000000001 positions",
    );
}

#[test]
fn run_with_max_tokens_zero_generates_nothing() {
    let output = run(&[
        "run",
        "--synthetic",
        "tiny",
        "--prompt",
        "hi",
        "--max-tokens",
        "0",
        "--json",
        "--seed",
        "1",
    ]);
    let stderr = stderr_of(&output);
    assert!(output.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["generated_tokens"], 0, "{json}");
    assert_eq!(json["answer"], "", "{json}");
    assert_eq!(json["stop_reason"], "max_tokens", "{json}");
}

#[test]
fn more_threads_than_the_os_allows_are_capped_not_a_panic() {
    let model = fixture("tiny_single");
    for command in [
        vec![
            "generate",
            "--greedy",
            "--tokens",
            "1,2",
            "--max-tokens",
            "2",
        ],
        vec!["logits", "--tokens", "1,2", "--out", "/dev/null"],
    ] {
        let child = ossterm()
            .args(&command)
            .args(["--threads", "1000000", "--model"])
            .arg(&model)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = wait_with_deadline(child, Duration::from_secs(60));
        assert_no_panic("--threads 1000000", &output);
        let stderr = stderr_of(&output);
        assert!(output.status.success(), "{command:?}: {stderr}");
        assert!(
            stderr.contains("--threads 1000000 is more than the"),
            "{stderr}"
        );
    }
}

#[test]
fn error_causes_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny_single").join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    for args in [
        vec!["info", "--model"],
        vec!["generate", "--greedy", "--tokens", "1", "--model"],
    ] {
        let output = ossterm().args(&args).arg(dir.path()).output().unwrap();
        let stderr = stderr_of(&output);
        assert_eq!(output.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("config.json"), "{stderr}");
        let causes = stderr.matches("No such file or directory").count()
            + stderr.matches("not found").count();
        assert_eq!(causes, 1, "{args:?}: {stderr}");
    }
    let output = run(&[
        "render",
        "--conversation",
        fixture("README.md").to_str().unwrap(),
    ]);
    let stderr = stderr_of(&output);
    assert_eq!(
        stderr.matches("expected value at line 1").count(),
        1,
        "{stderr}"
    );
}

/// `synth` into a file system that runs out of room (RLIMIT_FSIZE through `ulimit -f`, with
/// SIGXFSZ ignored so the write fails instead of killing the process) leaves no checkpoint and
/// no staging files behind, and says what failed in plain words.
#[test]
fn synth_on_a_full_disk_leaves_nothing_and_says_why() {
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("ckpt");
    let script = format!(
        "trap '' XFSZ; ulimit -f 20000; exec '{}' synth --preset tiny --out '{}'",
        env!("CARGO_BIN_EXE_ossterm"),
        out.display()
    );
    let output = Command::new("sh").args(["-c", &script]).output().unwrap();
    assert_no_panic("synth", &output);
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot write"), "{stderr}");
    assert!(stderr.contains("File too large"), "{stderr}");
    assert!(!stderr.contains("IoError("), "Debug-formatted: {stderr}");
    let left: Vec<_> = std::fs::read_dir(parent.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // And an ordinary run still writes the checkpoint where asked.
    let output = run(&["synth", "--preset", "tiny", "--out", out.to_str().unwrap()]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    assert!(out.join("model.safetensors.index.json").is_file());
    assert!(out.join("config.json").is_file());
}

#[test]
fn bench_profile_splits_a_short_prompts_prefill_by_phase() {
    // By default the shortest standard prompt's length on a fresh cache; `--prompt-tokens` names
    // another, `--depth` the context before it (and before the decode runs).
    for (extra, tokens, depth) in [
        (None, 58, None),
        (Some("20"), 20, None),
        (Some("20"), 20, Some("100")),
    ] {
        check_prefill_profile(extra, tokens, depth);
    }
}

fn check_prefill_profile(prompt_tokens: Option<&str>, tokens: usize, depth: Option<&str>) {
    let mut args = vec![
        "bench",
        "--synthetic",
        "tiny",
        "--threads",
        "2",
        "--profile",
        "--gen-tokens",
        "4",
        "--repeat",
        "5",
    ];
    if let Some(count) = prompt_tokens {
        args.extend(["--prompt-tokens", count]);
    }
    if let Some(depth) = depth {
        args.extend(["--depth", depth]);
    }
    let output = run(&args);
    assert_no_panic("bench --profile", &output);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let (decode_context, after) = match depth {
        None => ("32".to_string(), "on a fresh cache".to_string()),
        Some(depth) => (
            depth.to_string(),
            format!("after {depth} tokens of context"),
        ),
    };
    assert!(
        stdout.contains(&format!(
            "decode 4 tokens after {decode_context} of context x 5 rounds"
        )),
        "{stdout}"
    );
    let wanted = format!("prefill of a {tokens}-token prompt {after}, 5 rounds");
    let mut lines = stdout.lines().skip_while(|line| !line.starts_with(&wanted));
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("no prefill profile in\n{stdout}"));
    let mean: f64 = header
        .split("mean ")
        .nth(1)
        .and_then(|rest| rest.split(" ms").next())
        .and_then(|number| number.trim().parse().ok())
        .unwrap_or_else(|| panic!("no mean in {header:?}"));
    let phases: Vec<(String, f64)> = lines
        .take(5)
        .map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next().unwrap_or_default().to_string();
            let ms = words
                .next()
                .and_then(|w| w.parse().ok())
                .unwrap_or(f64::NAN);
            (name, ms)
        })
        .collect();
    let names: Vec<&str> = phases.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "attention",
            "experts",
            "unembedding",
            "quantization",
            "rest"
        ],
        "{stdout}"
    );
    let inside: f64 = phases.iter().map(|(_, ms)| ms).sum();
    // The phases are timed inside each prefill; printed to 0.01 ms, they cannot exceed the mean
    // prefill by more than the rounding, and the products must have taken some time.
    assert!(mean > 0.0, "{stdout}");
    assert!(
        inside <= mean + 0.3,
        "{inside} ms of phases in a {mean} ms prefill\n{stdout}"
    );
    assert!(phases[0].1 + phases[1].1 > 0.0, "{stdout}");
}

#[test]
fn bench_flags_a_mode_would_ignore_are_refused() {
    // Each mode measures something of its own: a flag it never reads is an error naming both,
    // not a figure silently measured without it.
    for (mode, ignored) in [
        (&["--kernels"][..], &["--prompt-tokens", "64"][..]),
        (&["--kernels"], &["--depth", "4096"]),
        (&["--kernels"], &["--gen-tokens", "8"]),
        (&["--kernels"], &["--threads", "1"]),
        (&["--kernels"], &["--synthetic", "tiny"]),
        (&["--kernels"], &["--activations", "q8"]),
        (&["--kernels"], &["--profile"]),
        (&["--resume"], &["--prompt-tokens", "64"]),
        (&["--resume"], &["--gen-tokens", "8"]),
        (&["--resume"], &["--json"]),
        (&["--batch", "1,2"], &["--prompt-tokens", "64"]),
        (&["--batch", "1,2"], &["--depth", "4096"]),
        (&["--batch", "1,2"], &["--no-ttft"]),
        (&["--batch", "1,2"], &["--resume"]),
        (&["--profile"], &["--json"]),
        (&["--profile"], &["--batch", "1"]),
        (&["--synthetic", "tiny"], &["--batch-steps", "2"]),
    ] {
        let mut args = vec!["bench"];
        args.extend_from_slice(mode);
        args.extend_from_slice(ignored);
        if !args.contains(&"--synthetic") && !args.contains(&"--kernels") {
            args.extend(["--synthetic", "tiny"]);
        }
        let what = args.join(" ");
        let stderr = usage_error(&what, &run(&args));
        assert!(
            stderr.contains(ignored[0])
                && (stderr.contains("cannot be used with") || stderr.contains("required")),
            "{what}: {stderr}"
        );
    }
}

#[test]
fn a_bad_choice_for_a_model_flag_names_the_values_on_every_command() {
    for command in ["run", "bench", "logits", "generate", "serve"] {
        for (flag, bad, values) in [
            ("--unembedding", "two_stage", "full, two-stage"),
            ("--activations", "q16", "q8, mixed, q8x2"),
            ("--weights", "q2", "native, q8, q4"),
            ("--kv-cache", "bf16", "f16, f32, q8"),
            ("--attention", "fp16", "auto, f32, bf16"),
        ] {
            let what = format!("{command} {flag} {bad}");
            let stderr = usage_error(&what, &run(&[command, flag, bad]));
            assert!(
                stderr.contains(&format!("invalid value '{bad}'")) && stderr.contains(values),
                "{what}: {stderr}"
            );
        }
    }
}

/// `--attention` reaches the model: the settings line of `bench` names bf16 attention exactly
/// where the choice, the CPU and the activations allow it (`q8x2` keeps f32 whatever is asked).
#[test]
fn the_attention_flag_picks_the_arithmetic_bench_names() {
    use ossterm::kernels::{kernel_path, Kernels};
    let model = fixture("small_wide");
    let settings = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--model",
            model.to_str().unwrap(),
            "--threads",
            "2",
            "--prompt-tokens",
            "8",
            "--gen-tokens",
            "2",
            "--repeat",
            "1",
            "--no-ttft",
        ];
        args.extend_from_slice(extra);
        let output = run(&args);
        assert_no_panic(&format!("bench {extra:?}"), &output);
        assert!(output.status.success(), "{}", stderr_of(&output));
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        stdout
            .lines()
            .find(|line| line.starts_with("settings"))
            .unwrap_or_else(|| panic!("no settings line in\n{stdout}"))
            .to_string()
    };
    let kernels = Kernels::new(kernel_path()).expect("the process-wide path is supported");
    // The vector kernel's words, or the matrix unit's on the amx path with AMX-BF16.
    let bf16 = if kernels.with_bf16_attention().uses_amx_attention() {
        "attention on bf16 tile products (AMX)"
    } else {
        "attention on bf16 dot products"
    };
    for (extra, expected) in [
        (&["--attention", "f32"][..], false),
        (
            &["--attention", "bf16"][..],
            kernels.with_bf16_attention().uses_bf16_attention(),
        ),
        (&["--attention", "auto"][..], kernels.uses_bf16_attention()),
        (&["--attention", "bf16", "--activations", "q8x2"][..], false),
        (&["--attention", "bf16", "--kv-cache", "f32"][..], false),
    ] {
        let line = settings(extra);
        assert_eq!(line.contains(bf16), expected, "{extra:?}: {line}");
    }
}

/// `OSSTERM_KERNELS`: a misspelt path is refused with the values it takes; a path this CPU
/// cannot run is refused naming the missing features; the new `avx2-vnni` runs where it can.
#[test]
fn kernel_paths_from_the_environment_are_checked_before_anything_runs() {
    let run_on = |path: &str| {
        ossterm()
            .env("OSSTERM_KERNELS", path)
            .args(["run", "--synthetic", "tiny", "--prompt", "hi"])
            .args(["--max-tokens", "1", "--json", "--seed", "1"])
            .output()
            .expect("the ossterm binary runs")
    };
    assert_fails_with(
        "misspelt",
        &run_on("avx2-vnnx"),
        "expected scalar, avx2, avx2-vnni, avx512, amx or auto",
    );
    for path in ossterm::kernels::KernelPath::ALL {
        let output = run_on(path.name());
        if path.is_supported() {
            assert!(output.status.success(), "{path}: {}", stderr_of(&output));
        } else {
            assert_fails_with(
                path.name(),
                &output,
                "needs CPU features this machine lacks",
            );
        }
    }
}
