//! Bad checkpoints give clear errors naming what is wrong, never a panic.

use std::path::{Path, PathBuf};

use ossterm::model::{LoadOptions, Model, ModelError};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A private copy of a fixture to break.
fn copy_of(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir, &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded, but it is broken", dir.display()),
        Err(err) => err.to_string(),
    }
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json.as_object_mut().unwrap());
    std::fs::write(path, json.to_string()).unwrap();
}

/// Rewrites the safetensors header of `file`, keeping the data.
fn edit_header(file: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(header.as_object_mut().unwrap());
    let mut text = header.to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

#[test]
fn missing_directory() {
    let message = load_err(Path::new("/nonexistent/ossterm-model"));
    assert!(message.contains("does not exist"), "{message}");
}

#[test]
fn directory_without_weights() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("tiny_single").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("holds no weights"), "{message}");
    assert!(message.contains("huggingface-cli download"), "{message}");
}

#[test]
fn missing_config() {
    let dir = copy_of("tiny_single");
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("config.json"), "{message}");
}

#[test]
fn index_names_a_missing_shard() {
    let dir = copy_of("tiny_sharded");
    let shard = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    std::fs::remove_file(&shard).unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("names shard"), "{message}");
    assert!(
        message.contains(shard.file_name().unwrap().to_str().unwrap()),
        "{message}"
    );
}

#[test]
fn index_without_weight_map() {
    let dir = copy_of("tiny_sharded");
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        "{\"metadata\": {}}",
    )
    .unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("weight_map"), "{message}");
}

#[test]
fn truncated_shard() {
    let dir = copy_of("tiny_single");
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 1000]).unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("model.safetensors"), "{message}");
    assert!(message.contains("truncated"), "{message}");
}

#[test]
fn file_shorter_than_its_header() {
    let dir = copy_of("tiny_single");
    let file = dir.path().join("model.safetensors");
    std::fs::write(&file, [1u8, 2, 3]).unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("8-byte header"), "{message}");
    let bytes = std::fs::read(fixture("tiny_single").join("model.safetensors")).unwrap();
    std::fs::write(&file, &bytes[..100]).unwrap();
    let message = load_err(dir.path());
    assert!(
        message.contains("header length points past the end"),
        "{message}"
    );
}

#[test]
fn header_offsets_past_the_end() {
    let dir = copy_of("tiny_single");
    let file = dir.path().join("model.safetensors");
    edit_header(&file, |header| {
        let entry = header["model.norm.weight"].as_object_mut().unwrap();
        entry.insert(
            "data_offsets".into(),
            serde_json::json!([1u64 << 40, (1u64 << 40) + 128]),
        );
    });
    let message = load_err(dir.path());
    assert!(message.contains("model.safetensors"), "{message}");
}

#[test]
fn wrong_dtype() {
    let dir = copy_of("tiny_single");
    edit_header(&dir.path().join("model.safetensors"), |header| {
        let entry = header["model.layers.0.self_attn.q_proj.weight"]
            .as_object_mut()
            .unwrap();
        entry.insert("dtype".into(), "F16".into());
    });
    let message = load_err(dir.path());
    assert!(
        message.contains("model.layers.0.self_attn.q_proj.weight"),
        "{message}"
    );
    assert!(
        message.contains("dtype F16") && message.contains("BF16"),
        "{message}"
    );
}

#[test]
fn wrong_shape() {
    let dir = copy_of("tiny_single");
    edit_header(&dir.path().join("model.safetensors"), |header| {
        let entry = header["model.layers.1.mlp.router.weight"]
            .as_object_mut()
            .unwrap();
        let shape = entry["shape"].as_array().unwrap().clone();
        let (a, b) = (shape[0].as_u64().unwrap(), shape[1].as_u64().unwrap());
        entry.insert("shape".into(), serde_json::json!([b, a]));
    });
    let message = load_err(dir.path());
    assert!(
        message.contains("model.layers.1.mlp.router.weight"),
        "{message}"
    );
    assert!(message.contains("shape"), "{message}");
}

#[test]
fn config_disagrees_with_tensors() {
    let dir = copy_of("tiny_single");
    edit_config(dir.path(), |c| {
        c.insert("num_local_experts".into(), 5.into());
    });
    let message = load_err(dir.path());
    assert!(message.contains("expected [5,"), "{message}");
}

#[test]
fn missing_tensor() {
    let dir = copy_of("tiny_single");
    edit_config(dir.path(), |c| {
        c.insert("num_hidden_layers".into(), 5.into());
        c.remove("layer_types");
    });
    let message = load_err(dir.path());
    assert!(
        message.contains("model.layers.4.") && message.contains("missing"),
        "{message}"
    );
}

type ConfigEdit = Box<dyn Fn(&mut serde_json::Map<String, serde_json::Value>)>;

#[test]
fn unsupported_config_values_name_the_key() {
    let cases: Vec<(&str, ConfigEdit)> = vec![
        (
            "rope_scaling.rope_type",
            Box::new(|c| {
                c["rope_scaling"]["rope_type"] = "longrope".into();
            }),
        ),
        (
            "model_type",
            Box::new(|c| {
                c.insert("model_type".into(), "llama".into());
            }),
        ),
        (
            "layer_types",
            Box::new(|c| {
                c["layer_types"][0] = "chunked_attention".into();
            }),
        ),
        (
            "hidden_size",
            Box::new(|c| {
                c.insert("hidden_size".into(), 48.into());
            }),
        ),
        (
            "num_key_value_heads",
            Box::new(|c| {
                c.insert("num_key_value_heads".into(), 3.into());
            }),
        ),
        (
            "quantization_config.quant_method",
            Box::new(|c| {
                c["quantization_config"]["quant_method"] = "gptq".into();
            }),
        ),
        (
            "vocab_size",
            Box::new(|c| {
                c.insert("vocab_size".into(), "many".into());
            }),
        ),
        (
            "num_experts_per_tok",
            Box::new(|c| {
                c.insert("num_experts_per_tok".into(), 99.into());
            }),
        ),
    ];
    for (key, edit) in cases {
        let dir = copy_of("tiny_single");
        edit_config(dir.path(), edit);
        let message = load_err(dir.path());
        assert!(message.contains(&format!("\"{key}\"")), "{key}: {message}");
        assert!(message.contains("config.json"), "{key}: {message}");
    }
}

#[test]
fn config_that_is_not_json() {
    let dir = copy_of("tiny_single");
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("config.json"), "{message}");
}

#[test]
fn errors_are_typed() {
    let err = Model::load(Path::new("/nonexistent"), &LoadOptions::default())
        .err()
        .unwrap();
    assert!(matches!(err, ModelError::MissingDir(_)));
}

#[test]
fn cli_reports_errors_without_panicking() {
    let dir = copy_of("tiny_single");
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    for args in [
        vec!["info", "--model"],
        vec!["generate", "--greedy", "--tokens", "1,2", "--model"],
        vec!["logits", "--tokens", "1,2", "--out", "/dev/null", "--model"],
    ] {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
            .args(&args)
            .arg(dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains("truncated"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    // Token ids outside the vocabulary are an error too.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(["generate", "--greedy", "--tokens", "999999", "--model"])
        .arg(fixture("tiny_single"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("outside the vocabulary"), "{stderr}");
}
