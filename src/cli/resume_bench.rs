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
use crate::model::{KvFormat, Model, Session};

/// Tokens of the new user turn that follows the reopened chat.
const TURN_TOKENS: usize = 32;
/// Decoded tokens per decode-speed measurement.
const DECODE_TOKENS: usize = 24;
/// RAM resumes measured (medians reported).
const RAM_REPEATS: usize = 5;

fn median(d: &[Duration]) -> f64 {
    let mut v: Vec<f64> = d.iter().map(|d| d.as_secs_f64()).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

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

/// Byte-shuffles `src` into `dst` (same length) by elements of `width` bytes: every element's
/// byte 0, then every byte 1, and so on; a ragged tail is copied as it is. Measured against the
/// plain payload: it puts the f16 exponents together, which lz4 (no entropy coder) cannot use.
fn shuffle_bytes(src: &[u8], width: usize, dst: &mut [u8]) {
    let count = src.len() / width.max(1);
    if width <= 1 || count == 0 {
        dst.copy_from_slice(src);
        return;
    }
    for (i, element) in src.chunks_exact(width).enumerate() {
        for (b, &byte) in element.iter().enumerate() {
            dst[b * count + i] = byte;
        }
    }
    dst[count * width..].copy_from_slice(&src[count * width..]);
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
    // The state after the chat, as the engine keeps it at the end of a turn: restorable from the
    // chat's end on (the sliding-window layers keep their last window of rows only).
    let started = Instant::now();
    let snapshot = pool.install(|| original.snapshot_restorable_from(depth))?;
    let capture = started.elapsed();
    let full_bytes = original.snapshot()?.tensor_bytes();
    let started = Instant::now();
    pool.install(|| original.prefill(&prompt[depth..]))?;
    let turn_prefill = started.elapsed();
    let cold = chat_prefill + turn_prefill;
    let want = original.logits().to_vec();

    // RAM: restore + prefill the turn; into a fresh session (the app's first turn after start:
    // the cache's pages are mapped as the restore writes them) and into a used one (every later
    // switch), several times each.
    let mut ram = KvTiers::new(TierConfig {
        ram_budget_bytes: u64::MAX,
        disk_dir: None,
        disk_budget_bytes: 0,
    });
    ram.store(snapshot.clone(), "bench");
    let (mut fresh_restores, mut used_restores, mut ram_ttfts) =
        (Vec::new(), Vec::new(), Vec::new());
    let mut used = model.new_session(pool, context);
    for _ in 0..RAM_REPEATS {
        let mut session = model.new_session(pool, context);
        let started = Instant::now();
        let resumed = pool
            .install(|| resume_from_tiers(&mut session, &mut ram, &prompt))
            .context("a RAM hit")?;
        pool.install(|| session.prefill(&prompt[resumed.tokens..]))?;
        ram_ttfts.push(started.elapsed());
        fresh_restores.push(resumed.took);
        anyhow::ensure!(
            session.logits() == &want[..],
            "RAM resume changed the logits"
        );
        // The used session holds another chat's rows before each restore.
        used.truncate(0);
        let resumed = pool
            .install(|| resume_from_tiers(&mut used, &mut ram, &prompt))
            .context("a RAM hit")?;
        used_restores.push(resumed.took);
        pool.install(|| used.prefill(&prompt[resumed.tokens..]))?;
        anyhow::ensure!(used.logits() == &want[..], "RAM resume changed the logits");
    }
    let ram_ttft = median(&ram_ttfts);
    let ram_restore = median(&fresh_restores);
    let used_restore = median(&used_restores);

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
    let resumed = pool
        .install(|| resume_from_tiers(&mut session, &mut disk, &prompt))
        .context("a disk hit")?;
    pool.install(|| session.prefill(&prompt[resumed.tokens..]))?;
    let disk_ttft = started.elapsed();
    let disk_restore = resumed.took;
    anyhow::ensure!(
        session.logits() == &want[..],
        "disk resume changed the logits"
    );

    let width = if kv == KvFormat::F32 { 4 } else { 2 };
    let shuffled = {
        let mut out = vec![0u8; raw.len()];
        shuffle_bytes(&raw, width, &mut out);
        out
    };
    let lz4 = |bytes: &[u8]| {
        codec_figures(bytes, lz4_flex::block::compress, |p| {
            lz4_flex::block::decompress(p, bytes.len()).expect("lz4 round trip")
        })
    };
    let mut codecs = vec![
        ("lz4_flex".to_string(), lz4(&raw)),
        (
            format!("lz4_flex, bytes shuffled by {width}"),
            lz4(&shuffled),
        ),
    ];
    codecs.extend(zstd_figures(&raw, &shuffled, width));

    // Decode alone, then decode while the writer thread writes the snapshot.
    let mut decoder = model.new_session(pool, context);
    pool.install(|| decoder.restore(&snapshot, depth))?;
    // Warm-up: the pool's per-thread scratch comes to life on the first decodes.
    pool.install(|| decode_run(&mut decoder, 1))?;
    decoder.truncate(depth);
    let alone = pool.install(|| decode_run(&mut decoder, 1))?;
    decoder.truncate(depth);
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
        "| TTFT from RAM snapshot | {:.3} s = {:.0}x faster (median of {RAM_REPEATS}; restore {:.3} s into a fresh cache, {:.3} s into a used one; the rest is the turn's own prefill) |",
        ram_ttft,
        seconds(cold) / ram_ttft,
        ram_restore,
        used_restore,
    );
    println!(
        "| bound: prefill of the turn's {TURN_TOKENS} tokens at depth {depth} | {:.3} s: no resume can beat {:.0}x |",
        seconds(turn_prefill),
        seconds(cold) / seconds(turn_prefill)
    );
    println!(
        "| TTFT from disk snapshot | {:.3} s (read + check + decompress + restore {:.3} s) = {:.0}x faster; page cache {} |",
        seconds(disk_ttft),
        seconds(disk_restore),
        seconds(cold) / seconds(disk_ttft),
        if dropped { "dropped" } else { "NOT dropped (not permitted)" }
    );
    println!(
        "| snapshot ({kv}) | {:.0} bytes/token, {:.1} MiB for {depth} tokens (all rows: {:.1} MiB; the sliding-window layers keep their window); capture {:.3} s |",
        per_token,
        snapshot.tensor_bytes() as f64 / (1 << 20) as f64,
        full_bytes as f64 / (1 << 20) as f64,
        seconds(capture)
    );
    println!(
        "| file | {:.1} MiB, ratio {:.3}; encode (lz4) {:.3} s, write + fsync {:.3} s |",
        file.len() as f64 / (1 << 20) as f64,
        raw.len() as f64 / file.len() as f64,
        seconds(encode_time),
        seconds(write_time)
    );
    for (name, (size, c, d)) in codecs {
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

/// zstd at levels 1 and 3 on the plain and the shuffled payload: the comparison that picked lz4
/// (built with `--features zstd-compare`; the files never use zstd).
#[cfg(feature = "zstd-compare")]
fn zstd_figures(
    raw: &[u8],
    shuffled: &[u8],
    width: usize,
) -> Vec<(String, (usize, Duration, Duration))> {
    let mut out = Vec::new();
    for level in [1, 3] {
        for (name, bytes) in [
            (format!("zstd -{level}"), raw),
            (
                format!("zstd -{level}, bytes shuffled by {width}"),
                shuffled,
            ),
        ] {
            let figures = codec_figures(
                bytes,
                |r| zstd::bulk::compress(r, level).expect("zstd compresses"),
                |p| zstd::bulk::decompress(p, bytes.len()).expect("zstd round trip"),
            );
            out.push((name, figures));
        }
    }
    out
}

#[cfg(not(feature = "zstd-compare"))]
fn zstd_figures(_: &[u8], _: &[u8], _: usize) -> Vec<(String, (usize, Duration, Duration))> {
    Vec::new()
}
