//! KV snapshots: a restored session computes exactly what the session that prefilled the tokens
//! computes (RAM and disk, every path and KV type), and a snapshot that does not check out is
//! never used.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ossterm::engine::kv_tiers::{self, KvTiers, Tier, TierConfig};
use ossterm::engine::resume_from_tiers;
use ossterm::model::{
    ActivationFormat, KvFormat, KvSnapshot, LoadOptions, Model, Precision, Preset, Session,
    SnapshotError,
};

fn pool() -> Arc<rayon::ThreadPool> {
    ossterm::engine::build_pool(2).expect("a pool of two threads")
}

fn tiny(precision: Precision, kv: KvFormat, seed: u64) -> Arc<Model> {
    let opts = LoadOptions {
        precision,
        kv,
        ..LoadOptions::default()
    };
    Arc::new(Model::synthetic(Preset::Tiny, seed, &opts).expect("tiny model"))
}

/// Every (path, KV type) a session can run with.
fn variants() -> Vec<(Precision, KvFormat)> {
    vec![
        (Precision::Exact, KvFormat::F32),
        (Precision::Fast, KvFormat::F16),
        (Precision::Fast, KvFormat::F32),
        (Precision::Fast, KvFormat::Q8),
    ]
}

fn tokens(count: usize, salt: u32) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (i * 7919 + salt * 104_729 + 11) % 50_000)
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Logits after prefilling `tail` and decoding `steps` fixed tokens.
fn continue_with(session: &mut Session, tail: &[u32], steps: &[u32]) -> Vec<Vec<f32>> {
    let mut out = vec![session.prefill(tail).unwrap().to_vec()];
    for &t in steps {
        out.push(session.decode(t).unwrap().to_vec());
    }
    out
}

/// The snapshot restored in full gives the snapshot's logits and the same continuation; a prefix
/// of it continues exactly as the original session rewound to that prefix.
fn check_bit_exact(model: &Arc<Model>, label: &str) {
    let pool = pool();
    let prompt = tokens(70, 1);
    let (tail, steps) = (tokens(9, 2), [5u32, 99, 1234]);
    let mut original = model.new_session(&pool, 256);
    original.prefill(&prompt).unwrap();
    let snapshot = original.snapshot().unwrap();
    assert_eq!(snapshot.len(), 70);

    let mut restored = model.new_session(&pool, 200);
    restored.restore(&snapshot, 70).unwrap();
    assert_eq!(restored.tokens(), &prompt[..]);
    assert!(
        same_bits(restored.logits(), original.logits()),
        "{label}: logits after restore"
    );
    // Through the disk format too.
    let bytes = kv_tiers::encode(&snapshot, "test");
    let (decoded, _) = kv_tiers::decode(Path::new("mem"), &bytes).unwrap();
    assert_eq!(decoded, snapshot, "{label}: disk round trip");
    let mut from_disk = model.new_session(&pool, 256);
    from_disk.restore(&decoded, 70).unwrap();

    let want = continue_with(&mut original, &tail, &steps);
    for (name, session) in [("RAM", &mut restored), ("disk", &mut from_disk)] {
        let got = continue_with(session, &tail, &steps);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(same_bits(w, g), "{label} {name}: step {i} differs");
        }
    }

    // A prefix: the original rewound to 40 tokens against a fresh session restored to 40.
    let mut rewound = model.new_session(&pool, 256);
    rewound.prefill(&prompt).unwrap();
    rewound.truncate(40);
    let mut partial = model.new_session(&pool, 256);
    partial.restore(&snapshot, 40).unwrap();
    let want = continue_with(&mut rewound, &prompt[40..], &steps);
    let got = continue_with(&mut partial, &prompt[40..], &steps);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert!(same_bits(w, g), "{label} prefix: step {i} differs");
    }
}

#[test]
fn restored_sessions_compute_the_same_bits_on_every_path_and_kv_type() {
    for (precision, kv) in variants() {
        let model = tiny(precision, kv, 3);
        check_bit_exact(&model, &format!("tiny {precision:?} {kv}"));
    }
}

#[test]
fn restored_sessions_compute_the_same_bits_on_a_golden_fixture() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_gqa8");
    for (precision, kv) in variants() {
        let opts = LoadOptions {
            precision,
            kv,
            ..LoadOptions::default()
        };
        let model = Arc::new(Model::load(&dir, &opts).unwrap());
        // The fixture's vocabulary is small: fold the ids into it.
        let vocab = model.config.vocab_size as u32;
        let pool = pool();
        let prompt: Vec<u32> = tokens(30, 4).iter().map(|t| t % vocab).collect();
        let mut original = model.new_session(&pool, 64);
        original.prefill(&prompt).unwrap();
        let snapshot = original.snapshot().unwrap();
        let mut restored = model.new_session(&pool, 64);
        restored.restore(&snapshot, 30).unwrap();
        for t in [1u32, 2, 3] {
            let want = original.decode(t % vocab).unwrap().to_vec();
            let got = restored.decode(t % vocab).unwrap().to_vec();
            assert!(same_bits(&want, &got), "fixture {precision:?} {kv}");
        }
    }
}

#[test]
fn a_snapshot_never_restores_into_another_model_type_or_format() {
    let pool = pool();
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let mut session = model.new_session(&pool, 64);
    assert_eq!(session.snapshot().unwrap_err(), SnapshotError::Empty);
    session.prefill(&tokens(10, 5)).unwrap();
    let snapshot = session.snapshot().unwrap();

    let other_seed = tiny(Precision::Fast, KvFormat::F16, 4);
    let mut other = other_seed.new_session(&pool, 64);
    assert!(matches!(
        other.restore(&snapshot, 10),
        Err(SnapshotError::Fingerprint { .. })
    ));
    let other_kv = model.new_session_with_kv(&pool, 64, KvFormat::Q8);
    let mut other_kv = other_kv;
    assert!(matches!(
        other_kv.restore(&snapshot, 10),
        Err(SnapshotError::Format { .. })
    ));
    let exact = tiny(Precision::Exact, KvFormat::F32, 3);
    assert!(matches!(
        exact.new_session(&pool, 64).restore(&snapshot, 10),
        Err(SnapshotError::Fingerprint { .. })
    ));
    let mut other_activations = model.new_session(&pool, 64);
    other_activations.set_activations(ActivationFormat::Q8x2);
    assert!(matches!(
        other_activations.restore(&snapshot, 10),
        Err(SnapshotError::Fingerprint { .. })
    ));
    let mut short = model.new_session(&pool, 8);
    assert!(matches!(
        short.restore(&snapshot, 10),
        Err(SnapshotError::Length { .. })
    ));
    assert!(matches!(
        session.restore(&snapshot, 11),
        Err(SnapshotError::Length { .. })
    ));
    // Tiled and row-order experts may be summed in another order: the same weights otherwise.
    let layout = |expert_layout| {
        let opts = LoadOptions {
            expert_layout,
            ..LoadOptions::default()
        };
        Arc::new(Model::synthetic(Preset::Tiny, 3, &opts).unwrap())
    };
    let (rows, tiles) = (
        layout(ossterm::model::ExpertLayout::Rows),
        layout(ossterm::model::ExpertLayout::Tiles),
    );
    let mut row_session = rows.new_session(&pool, 64);
    row_session.prefill(&tokens(10, 5)).unwrap();
    let row_snapshot = row_session.snapshot().unwrap();
    assert!(matches!(
        tiles.new_session(&pool, 64).restore(&row_snapshot, 10),
        Err(SnapshotError::Fingerprint { .. })
    ));
    rows.new_session(&pool, 64)
        .restore(&row_snapshot, 10)
        .unwrap();
    // The failed restores left the session alone.
    assert_eq!(session.len(), 10);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ossterm-kv-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn disk_tiers(dir: &Path, disk_bytes: u64) -> KvTiers {
    KvTiers::new(TierConfig {
        ram_budget_bytes: 0,
        disk_dir: Some(dir.to_path_buf()),
        disk_budget_bytes: disk_bytes,
    })
}

fn snapshot_of(model: &Arc<Model>, prompt: &[u32]) -> KvSnapshot {
    let mut session = model.new_session(&pool(), prompt.len() + 16);
    session.prefill(prompt).unwrap();
    session.snapshot().unwrap()
}

/// The one snapshot file of `dir`.
fn only_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kv"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

/// Through real files and a fresh tier, as a restarted app resumes: every path and KV type.
#[test]
fn a_disk_snapshot_resumes_a_later_process_bit_exactly() {
    for (precision, kv) in variants() {
        check_disk_resume(precision, kv);
    }
}

fn check_disk_resume(precision: Precision, kv: KvFormat) {
    let dir = temp_dir(&format!("resume-{precision:?}-{kv}"));
    let model = tiny(precision, kv, 3);
    let prompt = tokens(50, 6);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    tiers.store(snapshot_of(&model, &prompt), "chat one");
    tiers.flush();
    drop(tiers);

    // A new process: the tiers read the directory.
    let mut tiers = disk_tiers(&dir, 1 << 30);
    assert_eq!(tiers.usage().disk_snapshots, 1);
    let mut longer = prompt.clone();
    longer.extend(tokens(6, 7));
    let pool = pool();
    let mut session = model.new_session(&pool, 256);
    let resumed = resume_from_tiers(&mut session, &mut tiers, &longer).expect("a disk hit");
    assert_eq!((resumed.tokens, resumed.tier), (50, Tier::Disk));
    assert_eq!(tiers.usage().snapshot_hits, 1);
    let got = session.prefill(&longer[50..]).unwrap().to_vec();
    let mut cold = model.new_session(&pool, 256);
    cold.prefill(&prompt).unwrap();
    let want = cold.prefill(&longer[50..]).unwrap().to_vec();
    assert!(same_bits(&want, &got), "{precision:?} {kv}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Damages the one file of `dir` with `damage`, then checks that a lookup ignores it, says so
/// and deletes it.
fn check_rejected(name: &str, damage: impl Fn(&mut Vec<u8>)) {
    let dir = temp_dir(name);
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let prompt = tokens(40, 8);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    tiers.store(snapshot_of(&model, &prompt), "chat");
    tiers.flush();
    drop(tiers);
    let path = only_file(&dir);
    let mut bytes = std::fs::read(&path).unwrap();
    damage(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();

    let mut tiers = disk_tiers(&dir, 1 << 30);
    let mut session = model.new_session(&pool(), 256);
    let mut longer = prompt.clone();
    longer.push(17);
    assert!(
        resume_from_tiers(&mut session, &mut tiers, &longer).is_none(),
        "{name}: a damaged snapshot was used"
    );
    assert!(session.is_empty());
    let notices = tiers.take_notices();
    assert_eq!(notices.len(), 1, "{name}: {notices:?}");
    assert!(notices[0].contains("ignored"), "{name}: {notices:?}");
    assert!(!notices[0].contains('\n'), "{name}: one line: {notices:?}");
    assert!(!path.exists(), "{name}: the damaged file is still there");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn truncated_corrupt_and_other_version_snapshots_are_ignored_and_deleted() {
    check_rejected("truncated", |b| b.truncate(b.len() - 1000));
    check_rejected("payload-byte", |b| {
        let at = b.len() - 5000;
        b[at] ^= 0x40;
    });
    check_rejected("header-byte", |b| b[20] ^= 1);
    check_rejected("version", |b| b[8] = 99);
    check_rejected("checksum", |b| {
        let at = b.len() - 1;
        b[at] ^= 1;
    });
    check_rejected("empty", |b| b.clear());
}

#[test]
fn snapshots_of_another_model_or_kv_type_are_never_used() {
    let dir = temp_dir("other");
    let prompt = tokens(40, 9);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    tiers.store(
        snapshot_of(&tiny(Precision::Fast, KvFormat::F16, 4), &prompt),
        "other seed",
    );
    tiers.store(
        snapshot_of(&tiny(Precision::Fast, KvFormat::Q8, 3), &prompt),
        "other kv",
    );
    tiers.flush();
    drop(tiers);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let mut session = model.new_session(&pool(), 256);
    let mut longer = prompt.clone();
    longer.push(3);
    assert!(resume_from_tiers(&mut session, &mut tiers, &longer).is_none());
    // Valid snapshots of other models stay for those models.
    assert_eq!(tiers.usage().disk_snapshots, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_disk_tier_evicts_the_least_recently_used_under_its_budget() {
    let dir = temp_dir("evict");
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let one = kv_tiers::encode(&snapshot_of(&model, &tokens(30, 10)), "size").len() as u64;
    // Room for two snapshots of this size, not three.
    let mut tiers = disk_tiers(&dir, one * 2 + one / 2);
    let chats: Vec<Vec<u32>> = (0..3).map(|i| tokens(30, 20 + i)).collect();
    for (i, chat) in chats.iter().enumerate() {
        tiers.store(snapshot_of(&model, chat), &format!("chat {i}"));
        tiers.flush();
        // Modification times order the files; keep them apart on coarse clocks.
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (entries, _) = kv_tiers::list_dir(&dir);
    let labels: Vec<&str> = entries.iter().map(|e| e.header.label.as_str()).collect();
    assert_eq!(labels, ["chat 2", "chat 1"]);
    assert_eq!(tiers.usage().disk_snapshots, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ram_tier_keeps_the_longest_and_evicts_the_least_recently_used() {
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let first = snapshot_of(&model, &tokens(30, 30));
    let size = first.memory_bytes() as u64;
    let mut tiers = KvTiers::new(TierConfig {
        ram_budget_bytes: size * 2 + size / 2,
        disk_dir: None,
        disk_budget_bytes: 0,
    });
    let (a, b, c) = (tokens(30, 30), tokens(30, 31), tokens(30, 32));
    tiers.store(first, "a");
    tiers.store(snapshot_of(&model, &b), "b");
    // Using "a" makes "b" the least recently used.
    let mut session = model.new_session(&pool(), 256);
    let mut a_next = a.clone();
    a_next.push(1);
    let resumed = resume_from_tiers(&mut session, &mut tiers, &a_next).unwrap();
    assert_eq!((resumed.tokens, resumed.tier), (30, Tier::Ram));
    tiers.store(snapshot_of(&model, &c), "c");
    assert_eq!(tiers.ram_labels(), ["c", "a"]);
    // A longer snapshot of the same chat replaces the one it extends.
    let mut a_longer = a.clone();
    a_longer.extend(tokens(5, 33));
    tiers.store(snapshot_of(&model, &a_longer), "a2");
    assert_eq!(tiers.ram_labels(), ["a2", "c"]);
}

#[test]
fn the_cache_command_lists_and_clears_snapshots() {
    let dir = temp_dir("command");
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    tiers.store(snapshot_of(&model, &tokens(1234, 40)), "Budget question");
    tiers.flush();
    let run = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ossterm"))
            .args(args)
            .arg("--cache-dir")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8(output.stdout).unwrap()
    };
    let listing = run(&["cache"]);
    assert!(listing.contains("Budget question"), "{listing}");
    assert!(listing.contains("1,234"), "{listing}");
    assert!(listing.contains("1 snapshots"), "{listing}");
    let cleared = run(&["cache", "clear"]);
    assert!(cleared.contains("deleted 1 snapshot"), "{cleared}");
    assert!(run(&["cache", "list"]).contains("(none)"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A snapshot restorable from `floor` keeps only the sliding layers' rows from the window of
/// `floor` on; restored at the floor or later, into a session whose cache holds another chat's
/// rows everywhere, it continues exactly as the session that computed it (RAM and disk, every
/// path and KV type), and it refuses shorter restores.
#[test]
fn sliding_window_snapshots_keep_only_the_window_and_stay_bit_exact() {
    let pool = pool();
    let prompt = tokens(70, 11);
    let (tail, steps) = (tokens(5, 12), [7u32, 300]);
    for (precision, kv) in variants() {
        let model = tiny(precision, kv, 3);
        let window = model.config.sliding_window;
        assert!(window < 40, "the tiny preset has a short window");
        let mut original = model.new_session(&pool, 128);
        original.prefill(&prompt).unwrap();
        let full = original.snapshot().unwrap();
        let floor = 55;
        let trimmed = original.snapshot_restorable_from(floor).unwrap();
        assert_eq!(trimmed.rows.sliding_from, floor + 1 - window);
        assert_eq!(trimmed.min_restore(), floor);
        let sliding = trimmed.rows.sliding.iter().filter(|&&s| s).count();
        assert!(sliding > 0 && sliding < trimmed.shape.layers);
        let per_layer = full.tensor_bytes() / full.shape.layers;
        let kept = 70 - trimmed.rows.sliding_from;
        assert_eq!(
            trimmed.tensor_bytes(),
            per_layer * (full.shape.layers - sliding) + per_layer * sliding * kept / 70,
            "{precision:?} {kv}"
        );
        let bytes = kv_tiers::encode(&trimmed, "trimmed");
        let (decoded, _) = kv_tiers::decode(Path::new("mem"), &bytes).unwrap();
        assert_eq!(decoded, trimmed);
        assert!(bytes.len() < kv_tiers::encode(&full, "full").len());

        for len in [floor, 62, 70] {
            let mut rewound = model.new_session(&pool, 128);
            rewound.prefill(&prompt).unwrap();
            rewound.truncate(len);
            let want = continue_with(&mut rewound, &tail, &steps);
            for (name, snapshot) in [("RAM", &trimmed), ("disk", &decoded)] {
                // Another chat's rows fill the cache first: the restore must not depend on what
                // the rows it leaves alone hold.
                let mut dirty = model.new_session(&pool, 128);
                dirty.prefill(&tokens(100, 13)).unwrap();
                dirty.restore(snapshot, len).unwrap();
                let got = continue_with(&mut dirty, &tail, &steps);
                for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                    assert!(
                        same_bits(w, g),
                        "{precision:?} {kv} {name} restored to {len}: step {i} differs"
                    );
                }
            }
        }
        let mut session = model.new_session(&pool, 128);
        assert_eq!(
            session.restore(&trimmed, floor - 1).unwrap_err(),
            SnapshotError::Window {
                len: floor - 1,
                min: floor
            }
        );
        assert!(session.is_empty(), "a refused restore changes nothing");
    }
}

/// The tiers never pick a snapshot for a prompt shorter than its floor: they take another one
/// that covers less, or none.
#[test]
fn the_tiers_skip_a_snapshot_whose_window_does_not_reach_the_prompt() {
    let pool = pool();
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let chat = tokens(60, 14);
    let mut session = model.new_session(&pool, 128);
    session.prefill(&chat).unwrap();
    let trimmed = session.snapshot_restorable_from(50).unwrap();
    let mut tiers = KvTiers::new(TierConfig {
        ram_budget_bytes: u64::MAX,
        disk_dir: None,
        disk_budget_bytes: 0,
    });
    tiers.store(trimmed, "chat");

    // An edit at position 40: the trimmed snapshot cannot serve 40 tokens.
    let mut edited = chat[..40].to_vec();
    edited.extend(tokens(8, 15));
    let mut fresh = model.new_session(&pool, 128);
    assert!(resume_from_tiers(&mut fresh, &mut tiers, &edited).is_none());
    // A continuation past the floor is served.
    let mut longer = chat.clone();
    longer.extend(tokens(4, 16));
    let resumed = resume_from_tiers(&mut fresh, &mut tiers, &longer).expect("a RAM hit");
    assert_eq!(resumed.tokens, 60);
    let got = fresh.prefill(&longer[60..]).unwrap().to_vec();
    let want = session.prefill(&longer[60..]).unwrap().to_vec();
    assert!(same_bits(&want, &got));
}

/// While a turn computes the writer touches nothing on disk (it waits before its first block);
/// once the turn is done it writes the snapshot.
#[test]
fn the_writer_waits_while_a_turn_computes() {
    let dir = temp_dir("busy");
    let model = tiny(Precision::Fast, KvFormat::F16, 3);
    let mut tiers = disk_tiers(&dir, 1 << 30);
    tiers.set_busy(true);
    tiers.store(snapshot_of(&model, &tokens(40, 50)), "busy");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, 0, "the writer wrote while a turn computed");
    tiers.set_busy(false);
    tiers.flush();
    only_file(&dir);
    assert_eq!(tiers.usage().disk_snapshots, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A file written in pausing pieces is the file, and the pause runs between the pieces.
#[test]
fn pausing_writes_write_every_byte() {
    let dir = temp_dir("pieces");
    let path = dir.join("x.kv");
    let bytes: Vec<u8> = (0..(3 * kv_tiers::BLOCK_BYTES + 17))
        .map(|i| (i * 31 % 251) as u8)
        .collect();
    let pauses = std::sync::atomic::AtomicUsize::new(0);
    kv_tiers::write_atomic_pausing(&path, &bytes, &|| {
        pauses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    })
    .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    // Before each of the four pieces and before the fsync.
    assert_eq!(pauses.into_inner(), 5);
    let _ = std::fs::remove_dir_all(&dir);
}
