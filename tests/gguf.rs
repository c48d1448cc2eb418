//! GGUF files written from the golden fixtures by `tools/make_gguf.py` (llama.cpp's converter
//! layout) against the safetensors checkpoints they came from, and `ollama:` names resolved through
//! a fake ollama store.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ossterm::model::{ollama, LoadOptions, Model, ModelError, Precision};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn tokens(dir: &Path) -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn logits(path: &Path, tokens: &[u32], precision: Precision) -> Vec<f32> {
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    let model =
        Arc::new(Model::load(path, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
    let pool = ossterm::engine::build_pool(2).expect("a pool of two threads");
    let mut session = model.new_session(&pool, tokens.len());
    let mut out = Vec::new();
    session.prefill_all_logits(tokens, &mut out).unwrap();
    out
}

/// (safetensors case, GGUF file with the same weight bytes)
const SAME_BYTES: [(&str, &str); 2] = [
    ("tiny_single", "tiny_single.gguf"),
    ("tiny_gqa8", "tiny_gqa8.gguf"),
];

#[test]
fn gguf_configs_equal_the_config_json_ones() {
    for (case, file) in SAME_BYTES {
        let dir = fixtures().join(case);
        let from_json = ossterm::model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let gguf =
            ossterm::model::gguf::GgufFile::open(&fixtures().join("gguf").join(file)).unwrap();
        assert_eq!(gguf.config().unwrap(), from_json, "{file}");
    }
}

#[test]
fn gguf_logits_are_bit_identical_to_safetensors_on_both_paths() {
    for (case, file) in SAME_BYTES {
        let dir = fixtures().join(case);
        let gguf = fixtures().join("gguf").join(file);
        let tokens = tokens(&dir);
        for precision in [Precision::Exact, Precision::Fast] {
            let want = logits(&dir, &tokens, precision);
            let got = logits(&gguf, &tokens, precision);
            assert_eq!(got.len(), want.len());
            let differing = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differing, 0, "{file} {precision:?}: logits differ");
        }
    }
}

#[test]
fn q8_0_gguf_weights_are_the_checkpoints_within_quantization_error() {
    let dir = fixtures().join("tiny_single");
    let gguf = fixtures().join("gguf/tiny_single_q8_0.gguf");
    let opts = LoadOptions {
        precision: Precision::Exact,
        ..LoadOptions::default()
    };
    let want = Model::load(&dir, &opts).unwrap();
    let got = Model::load(&gguf, &opts).unwrap();
    let bf16 = |bits: u16| f32::from_bits((bits as u32) << 16);
    let mut matrices = vec![
        (&want.weights.embed, &got.weights.embed),
        (&want.weights.lm_head, &got.weights.lm_head),
    ];
    for (w, g) in want.weights.layers.iter().zip(&got.weights.layers) {
        let (a, b) = (&w.attention, &g.attention);
        matrices.extend([
            (&a.q.weight, &b.q.weight),
            (&a.k.weight, &b.k.weight),
            (&a.v.weight, &b.v.weight),
            (&a.o.weight, &b.o.weight),
            (&w.router.weight, &g.router.weight),
        ]);
    }
    let mut changed = 0;
    for (w, g) in matrices {
        assert_eq!((w.rows(), w.cols()), (g.rows(), g.cols()));
        for r in 0..w.rows() {
            for (block_w, block_g) in w.row(r).chunks(32).zip(g.row(r).chunks(32)) {
                let amax = block_w.iter().fold(0.0f32, |m, &v| m.max(bf16(v).abs()));
                for (&a, &b) in block_w.iter().zip(block_g) {
                    // Half a Q8_0 step, plus the bf16 rounding of the result.
                    let bound = amax / 254.0 * 1.01 + bf16(b).abs() / 256.0;
                    let err = (bf16(a) - bf16(b)).abs();
                    assert!(
                        err <= bound,
                        "row {r}: {} vs {} (bound {bound})",
                        bf16(a),
                        bf16(b)
                    );
                    changed += (a != b) as usize;
                }
            }
        }
    }
    assert!(changed > 0, "Q8_0 cannot hold every bf16 weight exactly");
    // Non-matrix tensors are the same values, the experts the same bytes.
    assert_eq!(want.weights.final_norm, got.weights.final_norm);
    let (w, g) = (&want.weights.layers[1], &got.weights.layers[1]);
    assert_eq!(w.attention.sinks, g.attention.sinks);
    for e in 0..w.gate_up.num_experts() {
        assert_eq!(w.gate_up.bias(e), g.gate_up.bias(e));
    }
    for e in 0..w.gate_up.num_experts() {
        assert_eq!(w.gate_up.blocks(e), g.gate_up.blocks(e));
        assert_eq!(w.down.scales(e), g.down.scales(e));
    }

    // And the model still computes: top-1 agrees with the checkpoint's almost everywhere.
    let tokens = tokens(&dir);
    let vocab = want.config.vocab_size;
    for precision in [Precision::Exact, Precision::Fast] {
        let a = logits(&dir, &tokens, precision);
        let b = logits(&gguf, &tokens, precision);
        let argmax = |row: &[f32]| {
            row.iter()
                .enumerate()
                .fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
        };
        let agree = a
            .chunks(vocab)
            .zip(b.chunks(vocab))
            .filter(|(x, y)| argmax(x) == argmax(y))
            .count();
        assert!(
            agree * 10 >= tokens.len() * 9,
            "{precision:?}: top-1 agrees at {agree} of {}",
            tokens.len()
        );
    }
}

/// An ollama store with `library/NAME/TAG` pointing at a copy of a fixture GGUF.
fn fake_store(root: &Path, name: &str, tag: &str, blob_source: &Path) {
    let hex = "ab".repeat(32);
    let blobs = root.join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::copy(blob_source, blobs.join(format!("sha256-{hex}"))).unwrap();
    let dir = root.join("manifests/registry.ollama.ai/library").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": format!("sha256:{}", "cd".repeat(32)), "size": 10},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": format!("sha256:{}", "ef".repeat(32)), "size": 10},
            {"mediaType": "application/vnd.ollama.image.model",
             "digest": format!("sha256:{hex}"), "size": 331264}
        ]
    });
    std::fs::write(dir.join(tag), manifest.to_string()).unwrap();
}

#[test]
fn ollama_names_resolve_through_the_manifest() {
    let store = tempfile::tempdir().unwrap();
    let gguf = fixtures().join("gguf/tiny_single.gguf");
    fake_store(store.path(), "gpt-oss", "20b", &gguf);
    let blob = ollama::resolve("ollama:gpt-oss:20b", store.path()).unwrap();
    assert_eq!(std::fs::read(&blob).unwrap(), std::fs::read(&gguf).unwrap());

    // Through Model::load and $OLLAMA_MODELS, as `--model ollama:gpt-oss:20b` runs it.
    std::env::set_var("OLLAMA_MODELS", store.path());
    let tokens = tokens(&fixtures().join("tiny_single"));
    let via_ollama = logits(Path::new("ollama:gpt-oss:20b"), &tokens, Precision::Exact);
    assert_eq!(via_ollama, logits(&gguf, &tokens, Precision::Exact));

    let err = ollama::resolve("ollama:gpt-oss:120b", store.path()).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, ModelError::Ollama { .. }));
    assert!(message.contains("gpt-oss/120b"), "{message}");
    assert!(message.contains("models found: gpt-oss:20b"), "{message}");

    let empty = tempfile::tempdir().unwrap();
    let message = ollama::resolve("ollama:gpt-oss:20b", &empty.path().join("none"))
        .unwrap_err()
        .to_string();
    assert!(message.contains("OLLAMA_MODELS"), "{message}");
    let message = ollama::resolve("ollama:../etc:20b", store.path())
        .unwrap_err()
        .to_string();
    assert!(message.contains("not a model name"), "{message}");
}

#[test]
fn ollama_manifest_without_model_layer_or_blob_is_refused() {
    let store = tempfile::tempdir().unwrap();
    let gguf = fixtures().join("gguf/tiny_single.gguf");
    fake_store(store.path(), "gpt-oss", "20b", &gguf);
    let manifest = store
        .path()
        .join("manifests/registry.ollama.ai/library/gpt-oss/20b");
    std::fs::write(
        &manifest,
        r#"{"layers":[{"mediaType":"application/vnd.ollama.image.license","digest":"sha256:00"}]}"#,
    )
    .unwrap();
    let message = ollama::resolve("ollama:gpt-oss:20b", store.path())
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("application/vnd.ollama.image.model"),
        "{message}"
    );

    let digest = format!("sha256:{}", "12".repeat(32));
    std::fs::write(
        &manifest,
        serde_json::json!({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}).to_string(),
    )
    .unwrap();
    let message = ollama::resolve("ollama:gpt-oss:20b", store.path())
        .unwrap_err()
        .to_string();
    assert!(message.contains("missing"), "{message}");
}

fn ossterm(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_takes_a_gguf_wherever_it_takes_a_checkpoint() {
    let out = tempfile::tempdir().unwrap();
    let (a, b) = (out.path().join("a.bin"), out.path().join("b.bin"));
    let gguf = fixtures().join("gguf/tiny_single.gguf");
    let dir = fixtures().join("tiny_single");
    for (model, file) in [(&gguf, &a), (&dir, &b)] {
        let run = ossterm(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "1,2,3,4,5",
            "--exact",
            "--out",
            file.to_str().unwrap(),
        ]);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());

    let info = ossterm(&["info", "--model", gguf.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    assert!(text.contains("GGUF v3") && text.contains("MXFP4"), "{text}");
}

#[test]
fn info_describes_the_120b_layout_without_building_it() {
    let info = ossterm(&["info", "--synthetic", "120b"]);
    let text = String::from_utf8_lossy(&info.stdout);
    assert!(
        info.status.success(),
        "{}",
        String::from_utf8_lossy(&info.stderr)
    );
    assert!(text.contains("layers:             36"), "{text}");
    assert!(text.contains("128 per layer, 4 per token"), "{text}");
    assert!(text.contains("116.83B"), "{text}");
    assert!(text.contains("5.13B"), "{text}");
    assert!(text.contains("weights 60.77 GiB"), "{text}");
}

#[test]
fn the_app_treats_gguf_files_and_ollama_names_as_models() {
    use ossterm::model::looks_loadable;
    assert!(looks_loadable(&fixtures().join("gguf/tiny_single.gguf")));
    assert!(looks_loadable(&fixtures().join("tiny_single")));
    assert!(looks_loadable(Path::new("ollama:gpt-oss:20b")));
    assert!(!looks_loadable(&fixtures().join("gguf/absent.gguf")));
    assert!(!looks_loadable(&fixtures().join("harmony")));
}

#[test]
fn gguf_fingerprints_tell_files_apart() {
    use ossterm::model::gguf::GgufFile;
    let open = |name: &str| GgufFile::open(&fixtures().join("gguf").join(name)).unwrap();
    let single = open("tiny_single.gguf").fingerprint();
    assert_eq!(single, open("tiny_single.gguf").fingerprint());
    assert_ne!(single, open("tiny_single_q8_0.gguf").fingerprint());
    assert_ne!(single, open("tiny_gqa8.gguf").fingerprint());
}
