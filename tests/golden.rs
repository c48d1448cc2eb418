//! The forward pass against Hugging Face transformers: golden logits and greedy continuations
//! made by `tools/make_fixtures.py` on small random checkpoints in the real MXFP4 layout.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use ossterm::model::{LoadOptions, Model, Precision};

struct Golden {
    dir: PathBuf,
    tokens: Vec<u32>,
    vocab: usize,
    logits: Vec<f32>,
    prompt: Vec<u32>,
    generated: Vec<u32>,
}

/// The pool sessions compute on, built as the app builds its own.
fn pool() -> Arc<rayon::ThreadPool> {
    ossterm::engine::build_pool(2).expect("a pool of two threads")
}

fn fixture_dirs() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("tests/fixtures exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").is_file())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 2,
        "expected at least two golden fixtures in {}",
        root.display()
    );
    dirs
}

fn ids(value: &serde_json::Value) -> Vec<u32> {
    value
        .as_array()
        .expect("a list of ids")
        .iter()
        .map(|v| v.as_u64().expect("an id") as u32)
        .collect()
}

fn read_golden(dir: &Path) -> Golden {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let tokens = ids(&json["tokens"]);
    let vocab = json["vocab_size"].as_u64().unwrap() as usize;
    let bytes = std::fs::read(dir.join(json["logits_file"].as_str().unwrap())).unwrap();
    let logits: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(logits.len(), tokens.len() * vocab);
    Golden {
        dir: dir.to_owned(),
        tokens,
        vocab,
        logits,
        prompt: ids(&json["greedy"]["prompt"]),
        generated: ids(&json["greedy"]["generated"]),
    }
}

fn load(dir: &Path) -> Arc<Model> {
    let opts = LoadOptions {
        precision: Precision::Exact,
        ..LoadOptions::default()
    };
    Arc::new(Model::load(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display())))
}

/// How far the exact path may be from transformers, relative to the largest golden logit: about
/// 3e-6 is observed (f32 summation order), so a real mistake in any step shows far above this.
const RELATIVE_TOLERANCE: f32 = 2e-5;

fn max_abs(values: &[f32]) -> f32 {
    values.iter().fold(0.0, |m, v| m.max(v.abs()))
}

fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (at, err) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold(
            (0, 0.0f32),
            |best, (i, e)| if e > best.1 { (i, e) } else { best },
        );
    assert!(
        err <= tolerance,
        "{what}: max error {err} at {at} exceeds {tolerance}"
    );
}

fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn exact_logits_match_transformers() {
    for dir in fixture_dirs() {
        let golden = read_golden(&dir);
        let model = load(&dir);
        assert_eq!(model.config.vocab_size, golden.vocab);
        let mut session = model.new_session(&pool(), golden.tokens.len());
        let mut logits = Vec::new();
        session
            .prefill_all_logits(&golden.tokens, &mut logits)
            .unwrap();
        let tolerance = RELATIVE_TOLERANCE * max_abs(&golden.logits);
        let worst = logits
            .iter()
            .zip(&golden.logits)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!(
            "{}: max error {:.2e} of the largest logit",
            dir.display(),
            worst / max_abs(&golden.logits)
        );
        assert_close(
            &logits,
            &golden.logits,
            tolerance,
            &dir.display().to_string(),
        );
    }
}

#[test]
fn greedy_continuation_matches_transformers() {
    for dir in fixture_dirs() {
        let golden = read_golden(&dir);
        let model = load(&dir);
        let mut session = model.new_session(&pool(), golden.prompt.len() + golden.generated.len());
        let mut next = argmax(session.prefill(&golden.prompt).unwrap());
        let mut generated = vec![next];
        while generated.len() < golden.generated.len() {
            next = argmax(session.decode(next).unwrap());
            generated.push(next);
        }
        assert_eq!(generated, golden.generated, "{}", dir.display());
    }
}

#[test]
fn one_token_decode_equals_batch_prefill() {
    for dir in fixture_dirs() {
        let golden = read_golden(&dir);
        let model = load(&dir);
        let mut batch = model.new_session(&pool(), golden.tokens.len());
        let mut batch_logits = Vec::new();
        batch
            .prefill_all_logits(&golden.tokens, &mut batch_logits)
            .unwrap();

        let mut stepwise = model.new_session(&pool(), golden.tokens.len());
        let vocab = golden.vocab;
        for (i, &token) in golden.tokens.iter().enumerate() {
            let logits = stepwise.decode(token).unwrap();
            let want = &batch_logits[i * vocab..(i + 1) * vocab];
            assert_close(
                logits,
                want,
                1e-5 * max_abs(want).max(1.0),
                &format!("{} position {i}", dir.display()),
            );
        }
    }
}

#[test]
fn prefill_in_uneven_pieces_equals_one_prefill() {
    let dir = &fixture_dirs()[0];
    let golden = read_golden(dir);
    let model = load(dir);
    let mut whole = model.new_session(&pool(), golden.tokens.len());
    let want = whole.prefill(&golden.tokens).unwrap().to_vec();
    let mut pieces = model.new_session(&pool(), golden.tokens.len());
    let (a, rest) = golden.tokens.split_at(3);
    let (b, c) = rest.split_at(rest.len() / 2);
    pieces.prefill(a).unwrap();
    pieces.prefill(b).unwrap();
    let got = pieces.prefill(c).unwrap();
    assert_close(got, &want, 1e-5 * max_abs(&want), "pieces");
}

fn ossterm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ossterm"))
}

fn joined(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The hold-out checks go through the command line exactly as the issue specifies.
#[test]
fn logits_and_generate_commands_match_transformers() {
    let out_dir = tempfile::tempdir().unwrap();
    for dir in fixture_dirs() {
        let golden = read_golden(&dir);
        let out = out_dir.path().join("logits.bin");
        let status = ossterm()
            .args(["logits", "--model"])
            .arg(&golden.dir)
            .args(["--tokens", &joined(&golden.tokens), "--exact", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stderr)
        );
        let bytes = std::fs::read(&out).unwrap();
        let logits: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_close(
            &logits,
            &golden.logits,
            RELATIVE_TOLERANCE * max_abs(&golden.logits),
            "logits command",
        );

        let output = ossterm()
            .args(["generate", "--model"])
            .arg(&golden.dir)
            .args([
                "--tokens",
                &joined(&golden.prompt),
                "--greedy",
                "--exact",
                "--max-tokens",
            ])
            .arg(golden.generated.len().to_string())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8(output.stdout).unwrap();
        let last = stdout.lines().last().unwrap_or_default();
        assert_eq!(
            last,
            joined(&golden.generated),
            "generate command on {}",
            dir.display()
        );
    }
}
