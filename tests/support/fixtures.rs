//! The committed golden fixtures (tests/fixtures/*/golden.json, written by tools/): where they
//! are and the prompt tokens each was made with.

use std::path::{Path, PathBuf};

/// tests/fixtures.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every fixture directory with a golden.json, sorted.
pub fn golden_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("golden.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// The prompt tokens of the fixture in `dir`.
pub fn golden_tokens(dir: &Path) -> Vec<u32> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    json["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}
