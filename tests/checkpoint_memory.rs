//! `Checkpoint::from_memory`, the fuzz targets' way into the loader, reads files exactly as
//! `Checkpoint::open` reads a directory: same tensors, same errors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ossterm::model::checkpoint::Checkpoint;
use ossterm::model::weights::Weights;
use ossterm::model::ModelConfig;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn files_of(dir: &Path) -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let name = entry.file_name().into_string().unwrap();
            (name, std::fs::read(entry.path()).unwrap())
        })
        .collect()
}

#[test]
fn memory_and_disk_give_the_same_tensors_and_weights_load() {
    for case in ["tiny_single", "tiny_sharded"] {
        let dir = fixture(case);
        let on_disk = Checkpoint::open(&dir).unwrap();
        let in_memory = Checkpoint::from_memory(&dir, &files_of(&dir)).unwrap();
        let mut names: Vec<&str> = on_disk.tensor_names().collect();
        let mut memory_names: Vec<&str> = in_memory.tensor_names().collect();
        names.sort_unstable();
        memory_names.sort_unstable();
        assert_eq!(names, memory_names, "{case}");
        for name in names {
            let (disk, memory) = (on_disk.info(name).unwrap(), in_memory.info(name).unwrap());
            assert_eq!(
                (disk.dtype, &disk.shape),
                (memory.dtype, &memory.shape),
                "{name}"
            );
        }
        let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let weights = Weights::load(&config, &in_memory).unwrap();
        assert_eq!(weights.layers.len(), config.num_hidden_layers);
    }
}

#[test]
fn damaged_files_give_the_errors_of_the_disk_loader() {
    let dir = fixture("tiny_sharded");
    let mut files = files_of(&dir);
    let shard = "model-00001-of-00002.safetensors";
    let bytes = files.get_mut(shard).unwrap();
    bytes.truncate(bytes.len() / 2);
    let truncated = tempfile::tempdir().unwrap();
    for (name, data) in &files {
        std::fs::write(truncated.path().join(name), data).unwrap();
    }
    let disk = Checkpoint::open(truncated.path())
        .err()
        .unwrap()
        .to_string();
    let memory = Checkpoint::from_memory(truncated.path(), &files)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(disk, memory);
    assert!(
        memory.contains(shard) && memory.contains("truncated"),
        "{memory}"
    );

    files.remove(shard);
    let error = Checkpoint::from_memory(&dir, &files)
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains(shard) && error.contains("does not exist"),
        "{error}"
    );
    files.clear();
    let error = Checkpoint::from_memory(&dir, &files)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("holds no weights"), "{error}");
}
