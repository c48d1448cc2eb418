//! `ossterm bench --resume`: the time to the first token of the next turn after reopening a chat
//! of `--depth` tokens (default 4096): cold (prefill everything), from a RAM snapshot, from a disk
//! snapshot (page cache dropped when the system lets us). Also the snapshot's size per token, the
//! compression of lz4 against zstd on its real rows, the write time, and what a background write
//! costs a decode running at the same time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::engine::kv_tiers::{self, KvTiers, TierConfig};
use crate::engine::resume_from_tiers;
use crate::model::{Model, Session};

/// Tokens of the new user turn that follows the reopened chat.
const TURN_TOKENS: usize = 32;
/// Decoded tokens per decode-speed measurement.
const DECODE_TOKENS: usize = 24;

/// Deterministic ids spread over the vocabulary's ordinary tokens.
fn chat_tokens(count: usize, vocab: usize, salt: u32) -> Vec<u32> {
    let range = vocab.min(199_998) as u64;
    (0..count as u64)
        .map(|i| ((i * 7919 + salt as u64 * 104_729 + 11) % range) as u32)
        .collect()
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Asks the kernel to drop the page cache; false when not permitted (containers, non-root).
fn drop_page_cache() -> bool {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Compression of the raw payload by one codec: (compressed bytes, compress time, decompress time).
fn codec_figures(
    raw: &[u8],
    compress: impl Fn(&[u8]) -> Vec<u8>,
    decompress: impl Fn(&[u8]) -> Vec<u8>,
) -> (usize, Duration, Duration) {
    let started = Instant::now();
    let packed = compress(raw);
    let compress_time = started.elapsed();
    let started = Instant::now();
    let unpacked = decompress(&packed);
    let decompress_time = started.elapsed();
    assert_eq!(unpacked.len(), raw.len(), "codec round trip");
    (packed.len(), compress_time, decompress_time)
}

/// Seconds per decoded token over `DECODE_TOKENS` tokens, each token's (start, end) returned.
fn decode_run(session: &mut Session, first: u32) -> anyhow::Result<Vec<(Instant, Instant)>> {
    let mut marks = Vec::with_capacity(DECODE_TOKENS);
    let mut token = first;
    for _ in 0..DECODE_TOKENS {
        let started = Instant::now();
        let logits = session.decode(token)?;
        token = crate::engine::sampler::argmax(logits).unwrap_or(0);
        marks.push((started, Instant::now()));
    }
    Ok(marks)
}

pub fn run(model: &Arc<Model>, pool: &Arc<rayon::ThreadPool>, depth: usize) -> anyhow::Result<()> {
    let vocab = model.config.vocab_size;
    let chat = chat_tokens(depth, vocab, 1);
    let mut prompt = chat.clone();
    prompt.extend(chat_tokens(TURN_TOKENS, vocab, 2));
    let context = prompt.len() + DECODE_TOKENS + 8;
    let kv = model.kv_format;
    println!(
        "resume benchmark: {} · {} threads · KV {kv} · chat {depth} tokens + turn {TURN_TOKENS}",
        model.source,
        pool.current_num_threads()
    );

    // Cold: the chat as a reopened one is today without snapshots: everything prefilled.
    let mut original = model.new_session(pool, context);
    let started = Instant::now();
    pool.install(|| original.prefill(&chat))?;
    let chat_prefill = started.elapsed();
    // The state after the chat, as the engine keeps it at the end of a turn.
    let started = Instant::now();
    let snapshot = original.snapshot()?;
    let capture = started.elapsed();
    let started = Instant::now();
    pool.install(|| original.prefill(&prompt[depth..]))?;
    let cold = chat_prefill + started.elapsed();
    let want = original.logits().to_vec();

    // RAM: restore + prefill the turn.
    let mut ram = KvTiers::new(TierConfig {
        ram_budget_bytes: u64::MAX,
        disk_dir: None,
        disk_budget_bytes: 0,
    });
    ram.store(snapshot.clone(), "bench");
    let mut session = model.new_session(pool, context);
    let started = Instant::now();
    let resumed = resume_from_tiers(&mut session, &mut ram, &prompt).context("a RAM hit")?;
    pool.install(|| session.prefill(&prompt[resumed.tokens..]))?;
    let ram_ttft = started.elapsed();
    let ram_restore = resumed.took;
    anyhow::ensure!(
        session.logits() == &want[..],
        "RAM resume changed the logits"
    );

    // Disk: write, drop the page cache, a new tier reads the directory, restore + prefill.
    let dir = std::env::temp_dir().join(format!("ossterm-resume-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let raw = kv_tiers::raw_payload(&snapshot);
    let started = Instant::now();
    let file = kv_tiers::encode(&snapshot, "bench");
    let encode_time = started.elapsed();
    let path = dir.join(kv_tiers::file_name(&snapshot));
    let started = Instant::now();
    kv_tiers::write_atomic(&path, &file)?;
    let write_time = started.elapsed();
    let dropped = drop_page_cache();
    let mut disk = KvTiers::new(TierConfig {
        ram_budget_bytes: u64::MAX,
        disk_dir: Some(dir.clone()),
        disk_budget_bytes: u64::MAX,
    });
    let mut session = model.new_session(pool, context);
    let started = Instant::now();
    let resumed = resume_from_tiers(&mut session, &mut disk, &prompt).context("a disk hit")?;
    pool.install(|| session.prefill(&prompt[resumed.tokens..]))?;
    let disk_ttft = started.elapsed();
    let disk_restore = resumed.took;
    anyhow::ensure!(
        session.logits() == &want[..],
        "disk resume changed the logits"
    );

    let (lz4, lz4_c, lz4_d) = codec_figures(&raw, lz4_flex::block::compress, |p| {
        lz4_flex::block::decompress(p, raw.len()).expect("lz4 round trip")
    });
    let zstd_at = |level: i32| {
        codec_figures(
            &raw,
            |r| zstd::bulk::compress(r, level).expect("zstd compresses"),
            |p| zstd::bulk::decompress(p, raw.len()).expect("zstd round trip"),
        )
    };
    let (zstd1, zstd1_c, zstd1_d) = zstd_at(1);
    let (zstd3, zstd3_c, zstd3_d) = zstd_at(3);

    // Decode alone, then decode while the writer thread writes the snapshot.
    let mut decoder = model.new_session(pool, context);
    pool.install(|| decoder.restore(&snapshot, depth))?;
    // Warm-up: the pool's per-thread scratch comes to life on the first decodes.
    pool.install(|| decode_run(&mut decoder, 1))?;
    decoder.truncate(depth);
    let alone = pool.install(|| decode_run(&mut decoder, 1))?;
    decoder.truncate(depth);
    let median = |d: &[Duration]| {
        let mut v: Vec<f64> = d.iter().map(|d| d.as_secs_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let alone_times: Vec<Duration> = alone.iter().map(|(s, e)| *e - *s).collect();
    let base = median(&alone_times);
    let shared = Arc::new(snapshot.clone());
    // Without pausing (the raw cost of sharing the cores) and as the engine runs it (the writer
    // waits between blocks while a turn computes).
    let mut during_write = Vec::new();
    for paused in [false, true] {
        let busy = Arc::new(AtomicBool::new(paused));
        let (done_sender, done) = std::sync::mpsc::channel();
        let write_path = dir.join(format!("during-{paused}.kv"));
        let writer = {
            let (shared, busy) = (Arc::clone(&shared), Arc::clone(&busy));
            std::thread::spawn(move || {
                kv_tiers::lower_thread_priority();
                let started = Instant::now();
                let pause = || {
                    while busy.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                };
                let bytes = kv_tiers::encode_pausing(&shared, "bench", &pause);
                pause();
                let written = kv_tiers::write_atomic(&write_path, &bytes);
                let _ = done_sender.send((started, Instant::now(), written.is_ok()));
            })
        };
        let during = pool.install(|| decode_run(&mut decoder, 1))?;
        decoder.truncate(depth);
        busy.store(false, Ordering::Relaxed);
        writer.join().ok();
        let (write_start, write_end, written) = done.recv()?;
        anyhow::ensure!(written, "the background write failed");
        let times: Vec<Duration> = during.iter().map(|(s, e)| *e - *s).collect();
        let overlapping = during
            .iter()
            .filter(|(s, e)| *s < write_end && *e > write_start)
            .count();
        during_write.push((paused, median(&times), overlapping, write_end - write_start));
    }
    let _ = std::fs::remove_dir_all(&dir);

    let per_token = snapshot.tensor_bytes() as f64 / depth as f64;
    println!();
    println!("| measure | value |");
    println!("| --- | --- |");
    println!(
        "| TTFT cold (prefill {} tokens) | {:.2} s |",
        prompt.len(),
        seconds(cold)
    );
    println!(
        "| TTFT from RAM snapshot | {:.3} s (restore {:.3} s) = {:.0}x faster |",
        seconds(ram_ttft),
        seconds(ram_restore),
        seconds(cold) / seconds(ram_ttft)
    );
    println!(
        "| TTFT from disk snapshot | {:.3} s (read + check + decompress + restore {:.3} s) = {:.0}x faster; page cache {} |",
        seconds(disk_ttft),
        seconds(disk_restore),
        seconds(cold) / seconds(disk_ttft),
        if dropped { "dropped" } else { "NOT dropped (not permitted)" }
    );
    println!(
        "| snapshot ({kv}) | {:.0} bytes/token, {:.1} MiB for {depth} tokens; capture {:.3} s |",
        per_token,
        snapshot.tensor_bytes() as f64 / (1 << 20) as f64,
        seconds(capture)
    );
    println!(
        "| file | {:.1} MiB, ratio {:.3}; encode (lz4) {:.3} s, write + fsync {:.3} s |",
        file.len() as f64 / (1 << 20) as f64,
        raw.len() as f64 / file.len() as f64,
        seconds(encode_time),
        seconds(write_time)
    );
    for (name, size, c, d) in [
        ("lz4_flex", lz4, lz4_c, lz4_d),
        ("zstd -1", zstd1, zstd1_c, zstd1_d),
        ("zstd -3", zstd3, zstd3_c, zstd3_d),
    ] {
        println!(
            "| {name} | ratio {:.3}, compress {:.3} s, decompress {:.3} s |",
            raw.len() as f64 / size as f64,
            seconds(c),
            seconds(d)
        );
    }
    for (paused, with_write, overlapping, took) in during_write {
        println!(
            "| decode while a snapshot is written ({}) | {:.1} ms/token alone, {:.1} ms/token with the writer (medians of {DECODE_TOKENS}; {overlapping} overlapped the write, which took {:.2} s): {:+.1}% |",
            if paused { "writer waits while a turn computes, as in the app" } else { "writer not paused" },
            base * 1e3,
            with_write * 1e3,
            seconds(took),
            (with_write / base - 1.0) * 100.0
        );
    }
    Ok(())
}
