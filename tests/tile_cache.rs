//! The tile cache: a mapped checkpoint's experts tiled into a file once, mapped by later loads,
//! rebuilt when it is damaged or the checkpoint changes, and never a reason for a load to fail.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ossterm::kernels::Mxfp4Layout;
use ossterm::model::tile_cache::TileSource;
use ossterm::model::{ExpertLayout, LoadOptions, Model, TileCache};

mod support;
use support::fixtures::{golden_dirs, golden_tokens};

fn fixture() -> PathBuf {
    golden_dirs().remove(0)
}

fn opts(tile_cache: TileCache) -> LoadOptions {
    LoadOptions {
        expert_layout: ExpertLayout::Tiles,
        tile_cache,
        ..LoadOptions::default()
    }
}

/// Loads `dir` with `opts`: where its tiles came from, why the cache was not used, and the
/// logits of every position of the fixture's tokens.
fn load(dir: &Path, opts: &LoadOptions) -> (TileSource, Option<String>, Vec<u32>) {
    let model = Arc::new(Model::load(dir, opts).unwrap());
    for layer in &model.weights.layers {
        assert_eq!(layer.gate_up.layout(), Mxfp4Layout::Tiles);
        assert_eq!(layer.down.layout(), Mxfp4Layout::Tiles);
    }
    let fast = model.fast.as_ref().unwrap();
    assert!(fast.tiled_bytes > 0);
    let (source, note) = (fast.tile_source.clone(), fast.tile_cache_note.clone());
    let pool = ossterm::engine::build_pool(2).unwrap();
    let tokens = golden_tokens(dir);
    let mut session = model.new_session(&pool, tokens.len());
    let mut logits = Vec::new();
    session.prefill_all_logits(&tokens, &mut logits).unwrap();
    (source, note, logits.iter().map(|v| v.to_bits()).collect())
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

fn cache_file(source: &TileSource, written: bool) -> PathBuf {
    match source {
        TileSource::CacheFile { path, written: w } if *w == written => path.clone(),
        other => panic!("expected a cache file (written: {written}), got {other:?}"),
    }
}

#[test]
fn the_first_load_writes_the_cache_and_the_next_maps_it_with_the_same_logits() {
    let dir = fixture();
    let temp = tempfile::tempdir().unwrap();
    let cache = temp.path().join("tiles");
    let with_cache = opts(TileCache::Dir(cache.clone()));

    let (first, note, first_logits) = load(&dir, &with_cache);
    assert_eq!(note, None);
    let file = cache_file(&first, true);
    assert_eq!(cache_files(&cache), vec![file.clone()], "no temporary left");
    let len = std::fs::metadata(&file).unwrap().len();
    assert_eq!(len % 4096, 0);

    let (second, note, second_logits) = load(&dir, &with_cache);
    assert_eq!(note, None);
    assert_eq!(cache_file(&second, false), file);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), len);
    assert!(first_logits == second_logits, "logits differ once mapped");

    let (copied, note, copied_logits) = load(&dir, &opts(TileCache::Off));
    assert_eq!((copied, note), (TileSource::Copied, None));
    assert!(
        first_logits == copied_logits,
        "logits differ from tiles in memory"
    );
}

#[test]
fn a_damaged_cache_file_is_written_again() {
    let dir = fixture();
    let temp = tempfile::tempdir().unwrap();
    let with_cache = opts(TileCache::Dir(temp.path().to_owned()));
    let (first, _, want) = load(&dir, &with_cache);
    let file = cache_file(&first, true);
    let len = std::fs::metadata(&file).unwrap().len();
    let damages: [(&str, Damage); 4] = [
        ("truncated", |path, len| {
            let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
            file.set_len(len - 4096).unwrap();
        }),
        ("empty", |path, _| std::fs::write(path, b"").unwrap()),
        ("another magic", |path, _| flip(path, 0)),
        ("another key", |path, _| flip(path, 20)),
    ];
    for (damage, apply) in damages {
        apply(&file, len);
        let (source, note, got) = load(&dir, &with_cache);
        assert_eq!(note, None, "{damage}");
        assert_eq!(cache_file(&source, true), file, "{damage}");
        assert_eq!(std::fs::metadata(&file).unwrap().len(), len, "{damage}");
        assert!(got == want, "{damage}: logits differ");
        let (source, _, _) = load(&dir, &with_cache);
        cache_file(&source, false);
    }
}

/// Damages the cache file at a path, given its length as written.
type Damage = fn(&Path, u64);

fn flip(path: &Path, at: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at] ^= 0x55;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_replaced_checkpoint_gets_new_tiles_and_the_old_file_goes() {
    let fixture = fixture();
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let cache = temp.path().join("tiles");
    let with_cache = opts(TileCache::Dir(cache.clone()));
    let (first, _, want) = load(&dir, &with_cache);
    let old = cache_file(&first, true);

    // The same bytes written again: same headers, another modification time.
    let shard = cache_files(&dir)
        .into_iter()
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&shard, std::fs::read(&shard).unwrap()).unwrap();

    let (second, _, got) = load(&dir, &with_cache);
    let new = cache_file(&second, true);
    assert_ne!(new, old);
    assert_eq!(cache_files(&cache), vec![new], "the stale file is removed");
    assert!(got == want);
}

#[test]
fn an_unwritable_cache_dir_falls_back_to_tiles_in_memory() {
    let dir = fixture();
    let temp = tempfile::tempdir().unwrap();
    // A directory under a plain file cannot be made, even by root.
    let blocker = temp.path().join("file");
    std::fs::write(&blocker, b"").unwrap();
    let (source, note, got) = load(&dir, &opts(TileCache::Dir(blocker.join("tiles"))));
    assert_eq!(source, TileSource::Copied);
    assert!(note.unwrap().contains("cannot create"));
    let (_, _, want) = load(&dir, &opts(TileCache::Off));
    assert!(got == want);
}

#[test]
fn models_not_mapped_from_a_checkpoint_never_touch_the_cache() {
    let temp = tempfile::tempdir().unwrap();
    let cache = temp.path().join("tiles");
    let model = Model::synthetic(
        ossterm::model::Preset::Tiny,
        1,
        &opts(TileCache::Dir(cache.clone())),
    )
    .unwrap();
    assert_eq!(model.fast.unwrap().tile_source, TileSource::InPlace);
    assert!(!cache.exists());
}
