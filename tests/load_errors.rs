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

#[test]
fn a_shard_that_is_a_directory_is_called_one() {
    let dir = copy_of("tiny_sharded");
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    let message = load_err(dir.path());
    assert!(message.contains("is a directory"), "{message}");
    assert!(!message.contains("does not exist"), "{message}");
}

/// Overwrites element `index` of `tensor` in a safetensors file with `bytes`.
fn poke(file: &Path, tensor: &str, index: usize, bytes: &[u8]) {
    let mut data = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + n]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + n + start + index * bytes.len();
    data[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(file, data).unwrap();
}

const BF16_NAN: [u8; 2] = [0xc0, 0x7f];
const BF16_INFINITY: [u8; 2] = [0x80, 0x7f];

#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    for tensor in [
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.sinks",
        "model.layers.1.mlp.router.weight",
        "model.layers.1.mlp.router.bias",
        "model.layers.0.mlp.experts.down_proj_bias",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ] {
        for value in [BF16_NAN, BF16_INFINITY] {
            let dir = copy_of("tiny_single");
            poke(&dir.path().join("model.safetensors"), tensor, 3, &value);
            let message = load_err(dir.path());
            assert!(
                message.contains(&format!("tensor {tensor} holds")),
                "{message}"
            );
            assert!(message.contains("element 3"), "{message}");
        }
    }
}

#[test]
fn nan_mxfp4_scales_are_refused_naming_the_tensor() {
    let dir = copy_of("tiny_single");
    let tensor = "model.layers.1.mlp.experts.gate_up_proj_scales";
    poke(&dir.path().join("model.safetensors"), tensor, 17, &[0xff]);
    let message = load_err(dir.path());
    assert!(message.contains(tensor), "{message}");
    assert!(
        message.contains("0xFF") && message.contains("element 17"),
        "{message}"
    );
}

fn ossterm(args: &[&str], dir: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
        .args(args)
        .arg(dir)
        .output()
        .unwrap()
}

#[test]
fn generate_refuses_nan_weights_instead_of_printing_token_zero() {
    let dir = copy_of("tiny_single");
    poke(
        &dir.path().join("model.safetensors"),
        "model.layers.0.self_attn.q_proj.weight",
        0,
        &BF16_NAN,
    );
    for exact in [&["--exact"][..], &[][..]] {
        let mut args = vec!["generate", "--greedy", "--tokens", "1,2"];
        args.extend_from_slice(exact);
        args.push("--model");
        let output = ossterm(&args, dir.path());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(output.stdout.is_empty(), "{args:?}: printed ids");
        assert!(
            stderr.contains("model.layers.0.self_attn.q_proj.weight holds NaN"),
            "{stderr}"
        );
    }
}

#[test]
fn info_check_reports_every_bad_tensor() {
    let dir = copy_of("tiny_single");
    let file = dir.path().join("model.safetensors");
    poke(
        &file,
        "model.layers.0.self_attn.k_proj.weight",
        5,
        &BF16_NAN,
    );
    poke(&file, "model.embed_tokens.weight", 7, &BF16_INFINITY);
    poke(&file, "model.embed_tokens.weight", 9, &BF16_NAN);
    poke(
        &file,
        "model.layers.1.mlp.experts.down_proj_scales",
        2,
        &[0xff],
    );
    let output = ossterm(&["info", "--check", "--model"], dir.path());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    for line in [
        "bad tensor model.embed_tokens.weight: 2 NaN or infinite values, the first at element 7",
        "bad tensor model.layers.0.self_attn.k_proj.weight: 1 NaN or infinite values, the first at element 5",
        "bad tensor model.layers.1.mlp.experts.down_proj_scales: 1 scale bytes 0xFF (E8M0 NaN), the first at element 2",
    ] {
        assert!(stdout.contains(line), "{line}\n{stdout}");
    }
    assert_eq!(stdout.matches("bad tensor").count(), 3, "{stdout}");
    assert!(stderr.contains("3 of 79 tensors"), "{stderr}");

    let clean = ossterm(&["info", "--check", "--model"], &fixture("tiny_single"));
    let stdout = String::from_utf8_lossy(&clean.stdout);
    assert!(
        clean.status.success(),
        "{}",
        String::from_utf8_lossy(&clean.stderr)
    );
    assert!(stdout.contains("all 79 tensors finite"), "{stdout}");
    assert!(stdout.contains("vocab_size:"), "{stdout}");
}
