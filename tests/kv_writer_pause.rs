//! The KV snapshot writer while a turn computes: it writes nothing, takes no wake-ups (a paused
//! writer costs the forward pass nothing), and resumes by itself when the turn ends. Alone in its
//! own test binary so that the process has exactly one writer thread to watch.
#![cfg(target_os = "linux")]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ossterm::engine::kv_tiers::{KvTiers, TierConfig};
use ossterm::model::{LoadOptions, Model, Preset};

/// Generous: the writer runs at SCHED_IDLE, so on a loaded machine it waits for an idle core.
const PATIENCE: Duration = Duration::from_secs(30);

/// The thread id of the process's one snapshot writer (its name, cut to 15 bytes by the kernel).
fn writer_tid() -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        for task in std::fs::read_dir("/proc/self/task").unwrap() {
            let task = task.unwrap().path();
            let name = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
            if name.starts_with("ossterm-kv-writ") {
                return task.file_name().unwrap().to_string_lossy().into_owned();
            }
        }
        assert!(Instant::now() < deadline, "no writer thread started");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// How many times the thread has blocked: one more each time it sleeps or waits and is woken.
fn times_blocked(tid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("voluntary_ctxt_switches:"))
        .expect("a voluntary_ctxt_switches line")
        .trim()
        .parse()
        .unwrap()
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_paused_writer_neither_writes_nor_wakes_and_resumes_when_the_turn_ends() {
    let dir = tempfile::tempdir().unwrap();
    let mut tiers = KvTiers::new(TierConfig {
        ram_budget_bytes: 0,
        disk_dir: Some(dir.path().to_path_buf()),
        disk_budget_bytes: 1 << 30,
    });
    let model = Arc::new(Model::synthetic(Preset::Tiny, 5, &LoadOptions::default()).unwrap());
    let pool = ossterm::engine::build_pool(1).unwrap();
    let mut session = model.new_session(&pool, 64);
    session.prefill(&(1..40).collect::<Vec<u32>>()).unwrap();
    let snapshot = session.snapshot().unwrap();

    // The writer waits for its first job; once it has blocked again after the job came, it is
    // waiting for the turn to end.
    let tid = writer_tid();
    let idle = times_blocked(&tid);
    tiers.set_busy(true);
    tiers.store(snapshot, "paused");
    let deadline = Instant::now() + PATIENCE;
    while times_blocked(&tid) == idle {
        if Instant::now() > deadline {
            tiers.set_busy(false);
            panic!("the writer never took its job");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let paused = times_blocked(&tid);
    std::thread::sleep(Duration::from_millis(500));
    let wakeups = times_blocked(&tid) - paused;
    let written_while_paused = entries(dir.path());

    // The turn ends: the writer writes the snapshot by itself (no flush to push it). The gate
    // opens before any assertion, so that a failing one does not leave the writer paused and
    // the tiers' drop waiting for it.
    let ended = Instant::now();
    tiers.set_busy(false);
    // A writer polling its pause flag every 5 ms wakes about a hundred times in 0.5 s.
    assert!(
        wakeups <= 1,
        "the paused writer woke {wakeups} times in 0.5 s"
    );
    assert_eq!(
        written_while_paused,
        Vec::<String>::new(),
        "the writer wrote while a turn computed"
    );
    while !entries(dir.path()).iter().any(|name| name.ends_with(".kv")) {
        assert!(
            ended.elapsed() < PATIENCE,
            "the writer did not resume within {PATIENCE:?} of the turn's end"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!(
        "the snapshot file appeared {:?} after the turn ended",
        ended.elapsed()
    );
    tiers.flush();
    assert_eq!(tiers.usage().disk_snapshots, 1);
}
