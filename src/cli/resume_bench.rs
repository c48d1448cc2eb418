//! `ossterm bench --resume`: the time to the first token of the next turn after reopening a chat
//! of `--depth` tokens (default 4096): cold (prefill everything), from a RAM snapshot, from a disk
//! snapshot whose pages were evicted from the page cache. Each resumed time is printed as its
//! parts: rendering the prompt, the restore, and the prefill of the new turn (what no snapshot can
//! hold). Also the snapshot's size per token, lz4 against zstd on its real rows, the write time,
//! and what a background write costs a decode running at the same time (interleaved rounds).
//!
//! The chat is a real harmony conversation (user questions, final answers) rendered with the
//! tokenizer, and the next turn is what the app prefills after reopening it: the `<|end|>` that
//! closes the last reply in history (the session generated `<|return|>` there), then
//! `<|start|>user<|message|>`, a short question, `<|end|><|start|>assistant`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::chat::tokenizer::special;
use crate::chat::{
    render_for_completion, render_history, Channel, ChatMessage, Conversation, RenderOptions,
    Tokenizer,
};
use crate::engine::kv_tiers::{self, KvTiers, PauseGate, TierConfig};
use crate::engine::resume_from_tiers;
use crate::model::{KvFormat, KvSnapshot, Model, Session};

/// The question of the new turn: a typical follow-up, 12 tokens of text.
const NEXT_QUESTION: &str = "Thanks! Could you show the second step with a short example?";
/// Decoded tokens per decode-speed run.
const DECODE_TOKENS: usize = 16;
/// At least this many resumes of each kind and rounds of the decode comparison.
const MIN_ROUNDS: usize = 3;

/// What the benchmark is asked to do.
pub struct ResumePlan {
    /// Tokens of the reopened chat (the conversation is built to about this length).
    pub depth: usize,
    /// Resumes of each kind, and rounds of the decode comparison (at least [`MIN_ROUNDS`]).
    pub repeat: usize,
}

fn median_secs(d: &[Duration]) -> f64 {
    let mut v: Vec<f64> = d.iter().map(|d| d.as_secs_f64()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Deterministic prose: words from a fixed list picked by a linear congruential generator, in
/// sentences, so the chat tokenizes like text (not like random ids).
struct Prose(u64);

impl Prose {
    const WORDS: [&'static str; 48] = [
        "the",
        "model",
        "reads",
        "a",
        "cache",
        "of",
        "keys",
        "and",
        "values",
        "for",
        "every",
        "layer",
        "when",
        "you",
        "open",
        "chat",
        "again",
        "it",
        "restores",
        "rows",
        "from",
        "disk",
        "instead",
        "computing",
        "them",
        "so",
        "first",
        "token",
        "comes",
        "sooner",
        "this",
        "is",
        "why",
        "snapshot",
        "matters",
        "on",
        "slow",
        "machine",
        "with",
        "two",
        "cores",
        "but",
        "memory",
        "bandwidth",
        "limits",
        "decode",
        "speed",
        "then",
    ];

    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn text(&mut self, words: usize) -> String {
        let mut out = String::new();
        let mut in_sentence = 0;
        for i in 0..words {
            let word = Prose::WORDS[self.next() as usize % Prose::WORDS.len()];
            if in_sentence == 0 {
                let mut chars = word.chars();
                if let Some(first) = chars.next() {
                    out.extend(first.to_uppercase());
                    out.push_str(chars.as_str());
                }
            } else {
                out.push_str(word);
            }
            in_sentence += 1;
            let end = i + 1 == words || (in_sentence >= 6 && self.next().is_multiple_of(5));
            if end {
                out.push('.');
                in_sentence = 0;
            }
            if i + 1 < words {
                out.push(' ');
            }
        }
        out
    }
}

/// A conversation of questions and final answers whose history renders to at least `depth`
/// tokens (its last message an answer), and that history's ids.
fn build_chat(tokenizer: &Tokenizer, depth: usize) -> anyhow::Result<(Conversation, Vec<u32>)> {
    let options = RenderOptions::default();
    let mut prose = Prose(0x5eed);
    let mut chat = Conversation::default();
    loop {
        let history = render_history(tokenizer, &chat, &options)?;
        if history.len() >= depth && !chat.messages.is_empty() {
            return Ok((chat, history));
        }
        let question = 12 + prose.next() as usize % 30;
        let answer = 60 + prose.next() as usize % 140;
        chat.messages.push(ChatMessage::user(prose.text(question)));
        chat.messages
            .push(ChatMessage::assistant(Channel::Final, prose.text(answer)));
    }
}

/// Evicts `path`'s pages from the page cache (the file was fsynced, so they are clean).
#[cfg(target_os = "linux")]
fn evict_from_page_cache(path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path)?;
    file.sync_all()?;
    // SAFETY: a plain syscall on an open descriptor.
    let code = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if code != 0 {
        return Err(std::io::Error::from_raw_os_error(code));
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn evict_from_page_cache(_: &Path) -> std::io::Result<()> {
    Err(std::io::Error::other("not supported on this system"))
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

/// The time of each of `count` decoded tokens; `before_token(i)` runs before token `i`.
fn decode_run(
    session: &mut Session,
    count: usize,
    before_token: &dyn Fn(usize),
) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(count);
    let mut token = 1;
    for i in 0..count {
        before_token(i);
        let started = Instant::now();
        let logits = session.decode(token)?;
        token = crate::engine::sampler::argmax(logits).unwrap_or(0);
        times.push(started.elapsed());
    }
    Ok(times)
}

/// Tokens per phase of the toggled writer: long enough for the writer to get going (it polls
/// its pause every 5 ms), short enough that the machine's load drifts little within a pair.
const PHASE_TOKENS: usize = 4;

/// Token times of decodes beside the snapshot writer.
#[derive(Default)]
struct BesideWriter {
    /// No writer thread at all (runs of their own).
    alone: Vec<Duration>,
    /// The writer writing back to back, never pausing.
    writing: Vec<Duration>,
    /// The writer paused at its next 1 MiB block, as the engine pauses it while a turn computes.
    paused: Vec<Duration>,
    /// The app's case: a write under way when a turn starts, paused for the whole turn (its
    /// block in flight and the kernel's writeback of what it wrote so far still run), resumed
    /// after the turn. Interleaved with `alone` round by round.
    pending: Vec<Duration>,
    /// Bytes of files the writer finished during the decodes.
    written: u64,
}

/// Starts the benchmark's snapshot writer: the engine's encode and atomic write of `snapshot`
/// to `path`, again and again until `stop`, waiting at each 1 MiB block while `gate` is closed
/// (the engine's writer waits at its gate while a turn computes); files finished before `stop` add
/// to `written`. Open the gate after setting `stop`, or a paused writer never sees it.
fn spawn_writer(
    snapshot: &Arc<KvSnapshot>,
    path: PathBuf,
    gate: &Arc<PauseGate>,
    stop: &Arc<AtomicBool>,
    written: &Arc<AtomicU64>,
) -> std::io::Result<std::thread::JoinHandle<std::io::Result<()>>> {
    let (snapshot, gate, stop, written) = (
        Arc::clone(snapshot),
        Arc::clone(gate),
        Arc::clone(stop),
        Arc::clone(written),
    );
    std::thread::Builder::new()
        .name("ossterm-bench-writer".into())
        .spawn(move || -> std::io::Result<()> {
            kv_tiers::lower_thread_priority();
            let pause = || gate.wait();
            while !stop.load(Ordering::Relaxed) {
                let bytes = kv_tiers::encode_pausing(&snapshot, "bench", &pause);
                kv_tiers::write_atomic_pausing(&path, &bytes, &pause)?;
                if !stop.load(Ordering::Relaxed) {
                    written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                }
            }
            Ok(())
        })
}

fn join_writer(writer: std::thread::JoinHandle<std::io::Result<()>>) -> anyhow::Result<()> {
    match writer.join() {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error).context("the background write failed"),
        Err(_) => anyhow::bail!("the background writer panicked"),
    }
}

/// One round: `DECODE_TOKENS` tokens with no writer, then `2 * DECODE_TOKENS` with the writer
/// writing the snapshot again and again while the pause flag flips every [`PHASE_TOKENS`]
/// tokens. Writing and paused tokens alternate within one run, so drift in the machine's load
/// hits both alike; the paused ones are what a turn sees in the app (the writer waits while a
/// turn computes).
fn decode_beside_writer(
    pool: &rayon::ThreadPool,
    decoder: &mut Session,
    depth: usize,
    snapshot: &Arc<KvSnapshot>,
    dir: &Path,
    into: &mut BesideWriter,
) -> anyhow::Result<()> {
    decoder.truncate(depth);
    let alone = pool.install(|| decode_run(decoder, DECODE_TOKENS, &|_| {}))?;
    into.alone.extend(alone);
    decoder.truncate(depth);
    let gate = Arc::new(PauseGate::default());
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let writer = spawn_writer(snapshot, dir.join("during.kv"), &gate, &stop, &written)?;
    // The writer is under way when the first phase starts.
    std::thread::sleep(Duration::from_millis(30));
    let paused_phase = |i: usize| (i / PHASE_TOKENS) % 2 == 1;
    let times = pool.install(|| {
        decode_run(decoder, 2 * DECODE_TOKENS, &|i| {
            gate.set_closed(paused_phase(i))
        })
    });
    stop.store(true, Ordering::Relaxed);
    gate.set_closed(false);
    let outcome = join_writer(writer);
    let times = times?;
    outcome?;
    for (i, time) in times.into_iter().enumerate() {
        if paused_phase(i) {
            into.paused.push(time);
        } else {
            into.writing.push(time);
        }
    }
    into.written += written.load(Ordering::Relaxed);

    // The app's case: the writer is under way when the turn starts and pauses for all of it.
    decoder.truncate(depth);
    let gate = Arc::new(PauseGate::default());
    let stop = Arc::new(AtomicBool::new(false));
    let writer = spawn_writer(snapshot, dir.join("pending.kv"), &gate, &stop, &written)?;
    // Mid-write when the turn starts, as the app's writer would be a moment after the previous
    // reply ended.
    std::thread::sleep(Duration::from_millis(200));
    gate.set_closed(true);
    let times = pool.install(|| decode_run(decoder, DECODE_TOKENS, &|_| {}));
    // The turn is over: the writer finishes the file it is in and stops.
    stop.store(true, Ordering::Relaxed);
    gate.set_closed(false);
    let outcome = join_writer(writer);
    into.pending.extend(times?);
    outcome?;
    Ok(())
}

/// Restore and turn prefill of one resume.
struct ResumeTimes {
    restore: Duration,
    prefill: Duration,
}

/// Resumes `prompt` from `tiers` into `session` and prefills the rest; checks the logits.
fn resume_once(
    pool: &rayon::ThreadPool,
    session: &mut Session,
    tiers: &mut KvTiers,
    prompt: &[u32],
    want: &[f32],
    what: &str,
) -> anyhow::Result<ResumeTimes> {
    let started = Instant::now();
    let resumed = pool
        .install(|| resume_from_tiers(session, tiers, prompt))
        .with_context(|| format!("no {what} hit"))?;
    let restore = started.elapsed();
    let started = Instant::now();
    pool.install(|| session.prefill(&prompt[resumed.tokens..]))?;
    let prefill = started.elapsed();
    anyhow::ensure!(
        session.logits() == want,
        "the {what} resume changed the logits"
    );
    Ok(ResumeTimes { restore, prefill })
}

pub fn run(
    model: &Arc<Model>,
    pool: &Arc<rayon::ThreadPool>,
    plan: ResumePlan,
) -> anyhow::Result<()> {
    let rounds = plan.repeat.max(MIN_ROUNDS);
    let tokenizer = Tokenizer::shared()?;
    let vocab = model.config.vocab_size;
    anyhow::ensure!(
        vocab >= crate::chat::tokenizer::VOCAB_SIZE,
        "the resume benchmark renders harmony text: it needs the o200k_harmony vocabulary ({} tokens), this model has {vocab}",
        crate::chat::tokenizer::VOCAB_SIZE
    );
    let options = RenderOptions::default();
    let (chat, history) = build_chat(tokenizer, plan.depth)?;
    // What the session held after the chat's last turn: the reply ended in `<|return|>`, which
    // history renders as `<|end|>`.
    let mut held = history.clone();
    *held.last_mut().expect("a chat of one message at least") = special::RETURN;
    let depth = held.len();
    // Where the snapshot must be restorable from: the start of the last turn's question, as the
    // engine computes it after that turn.
    let before_last_turn = Conversation {
        messages: chat.messages[..chat.messages.len() - 2].to_vec(),
        ..chat.clone()
    };
    let floor = kv_tiers::resume_floor(
        &held,
        &render_for_completion(tokenizer, &before_last_turn, &options)?,
    );
    let mut next = chat.clone();
    next.messages.push(ChatMessage::user(NEXT_QUESTION));
    // The engine renders the whole conversation for every turn: timed as part of the TTFT.
    let mut render_times = Vec::new();
    let mut prompt = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        prompt = render_for_completion(tokenizer, &next, &options)?;
        render_times.push(started.elapsed());
    }
    let render = Duration::from_secs_f64(median_secs(&render_times));
    let common = crate::engine::common_prefix_len(&held, &prompt);
    anyhow::ensure!(common == depth - 1, "the next prompt extends the chat");
    let turn = prompt.len() - common;
    let question_tokens = tokenizer.encode_text(NEXT_QUESTION)?.len();
    let context = prompt.len() + 2 * DECODE_TOKENS + 8;
    let kv = model.kv_format;
    println!(
        "resume benchmark: {} · {} threads · KV {kv} · chat of {} messages, {depth} tokens",
        model.source,
        pool.current_num_threads(),
        chat.messages.len(),
    );
    println!(
        "next turn: {turn} tokens = <|end|> closing the last reply + <|start|>user<|message|> + {question_tokens} tokens of question + <|end|><|start|>assistant"
    );

    // Cold: the chat as a reopened one is without snapshots: everything prefilled. The session
    // first computes the shared prefix, then the last turn's `<|return|>` (the state a snapshot
    // holds), then, rewound, the next turn.
    let mut original = model.new_session(pool, context);
    let started = Instant::now();
    pool.install(|| original.prefill(&prompt[..common]))?;
    let chat_prefill = started.elapsed();
    pool.install(|| original.prefill(&held[common..]))?;
    let started = Instant::now();
    let snapshot = pool.install(|| original.snapshot_restorable_from(floor))?;
    let capture = started.elapsed();
    let full_bytes = original.snapshot()?.tensor_bytes();
    original.truncate(common);
    let started = Instant::now();
    pool.install(|| original.prefill(&prompt[common..]))?;
    let turn_prefill = started.elapsed();
    let cold = render + chat_prefill + turn_prefill;
    let want = original.logits().to_vec();

    // RAM: restore + prefill of the turn, into a fresh session (the first turn after the app
    // starts: the cache's pages are mapped as the restore writes them) and into a used one
    // (every later switch), interleaved.
    let mut ram = KvTiers::new(TierConfig {
        ram_budget_bytes: u64::MAX,
        disk_dir: None,
        disk_budget_bytes: 0,
    });
    ram.store(snapshot.clone(), "bench");
    let (mut fresh, mut used_runs) = (Vec::new(), Vec::new());
    let mut used = model.new_session(pool, context);
    for _ in 0..rounds {
        let mut session = model.new_session(pool, context);
        fresh.push(resume_once(
            pool,
            &mut session,
            &mut ram,
            &prompt,
            &want,
            "RAM",
        )?);
        drop(session);
        // The used session holds another chat's rows (the last round's) before each restore.
        used.truncate(0);
        used_runs.push(resume_once(
            pool, &mut used, &mut ram, &prompt, &want, "RAM",
        )?);
    }
    // How the turn's prefill grows with its length at this depth: what is fixed (every weight
    // read once, as a decoded token reads them) and what each token adds.
    let lengths: Vec<usize> = [1, 4, 8, 16, turn]
        .into_iter()
        .filter(|&m| m <= turn)
        .collect();
    // At depth 0 too: what attention over the chat adds to each token.
    let mut by_length = vec![Vec::new(); lengths.len()];
    let mut by_length_at_0 = vec![Vec::new(); lengths.len()];
    for _ in 0..rounds {
        for (i, &m) in lengths.iter().enumerate() {
            used.truncate(common);
            let started = Instant::now();
            pool.install(|| used.prefill(&prompt[common..common + m]))?;
            by_length[i].push(started.elapsed());
            used.truncate(0);
            let started = Instant::now();
            pool.install(|| used.prefill(&prompt[..m]))?;
            by_length_at_0[i].push(started.elapsed());
        }
    }

    // Disk: the file as the writer leaves it, its pages evicted from the page cache before every
    // read; a tier with no RAM budget, so every resume reads the file.
    let dir = std::env::temp_dir().join(format!("ossterm-resume-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let outcome = disk_and_writes(
        model, pool, &dir, &snapshot, &prompt, &want, context, depth, rounds,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let disk = outcome?;

    let raw = kv_tiers::raw_payload(&snapshot);
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

    let mib = |bytes: f64| bytes / (1u64 << 20) as f64;
    let restore_of =
        |runs: &[ResumeTimes]| median_secs(&runs.iter().map(|r| r.restore).collect::<Vec<_>>());
    let prefill_of =
        |runs: &[ResumeTimes]| median_secs(&runs.iter().map(|r| r.prefill).collect::<Vec<_>>());
    let ttft_of = |runs: &[ResumeTimes]| {
        median_secs(
            &runs
                .iter()
                .map(|r| render + r.restore + r.prefill)
                .collect::<Vec<_>>(),
        )
    };
    println!();
    println!("| measure | value |");
    println!("| --- | --- |");
    println!(
        "| render the next prompt (tokenize the whole chat, as every turn does) | {:.1} ms |",
        seconds(render) * 1e3
    );
    println!(
        "| TTFT cold | {:.2} s: render, prefill of {common} tokens {:.2} s ({:.1} tokens/s), then the turn's {turn} at depth {common} {:.3} s |",
        seconds(cold),
        seconds(chat_prefill),
        common as f64 / seconds(chat_prefill),
        seconds(turn_prefill),
    );
    for (name, runs) in [
        ("RAM snapshot, into a fresh session", &fresh),
        ("RAM snapshot, into a used session", &used_runs),
        (
            "disk snapshot (file evicted from the page cache)",
            &disk.resumes,
        ),
    ] {
        let ttft = ttft_of(runs);
        println!(
            "| TTFT from the {name} | {:.3} s = {:.0}x faster: render {:.1} ms + restore {:.3} s + the turn's prefill {:.3} s (medians of {}) |",
            ttft,
            seconds(cold) / ttft,
            seconds(render) * 1e3,
            restore_of(runs),
            prefill_of(runs),
            runs.len(),
        );
    }
    println!(
        "| bound: the turn's prefill alone (cold run) | {:.3} s: no resume can beat {:.0}x |",
        seconds(turn_prefill),
        seconds(cold) / (seconds(render) + seconds(turn_prefill))
    );
    for (at, runs) in [(common, &by_length), (0, &by_length_at_0)] {
        let shape: Vec<String> = lengths
            .iter()
            .zip(runs)
            .map(|(m, times)| format!("{m}: {:.3} s", median_secs(times)))
            .collect();
        println!(
            "| prefill at depth {at} by tokens in the turn | {} (medians of {rounds}) |",
            shape.join(", ")
        );
    }
    println!(
        "| disk restore, parts | read {:.3} s, checksums + decompression into the snapshot {:.3} s, copy into the cache {:.3} s (medians; {}) |",
        median_secs(&disk.read),
        median_secs(&disk.decode),
        median_secs(&disk.copy),
        match disk.resident {
            Some(share) => format!("pages of the file in the page cache before a read: {:.1}% at most, evicted with posix_fadvise(DONTNEED) after fsync", share * 100.0),
            None => "page cache residency unknown".to_string(),
        }
    );
    println!(
        "| snapshot ({kv}) | {:.0} bytes/token, {:.1} MiB for {depth} tokens (all rows: {:.1} MiB; the sliding-window layers keep their window from position {}); capture {:.3} s |",
        snapshot.tensor_bytes() as f64 / depth as f64,
        mib(snapshot.tensor_bytes() as f64),
        mib(full_bytes as f64),
        snapshot.rows.sliding_from,
        seconds(capture)
    );
    println!(
        "| file | {:.1} MiB, ratio {:.3}; encode (lz4) {:.3} s, write + fsync {:.3} s |",
        mib(disk.file_bytes as f64),
        raw.len() as f64 / disk.file_bytes as f64,
        seconds(disk.encode),
        seconds(disk.write),
    );
    for (name, (size, c, d)) in codecs {
        println!(
            "| {name} | ratio {:.3}, compress {:.3} s, decompress {:.3} s |",
            raw.len() as f64 / size as f64,
            seconds(c),
            seconds(d)
        );
    }
    let beside = &disk.beside;
    let (alone, writing, paused) = (
        median_secs(&beside.alone),
        median_secs(&beside.writing),
        median_secs(&beside.paused),
    );
    println!(
        "| decode at depth {depth} beside the snapshot writer | {:.1} ms/token with the writer writing back to back, {:.1} with it paused (as while a turn computes in the app): writing costs {:+.1}%; paused against no writer ({:.1}): {:+.1}% (medians of {} / {} / {} tokens; {rounds} rounds, the writer's pause flipped every {PHASE_TOKENS} tokens within a run; it wrote {:.0} MiB meanwhile) |",
        writing * 1e3,
        paused * 1e3,
        (writing / paused - 1.0) * 100.0,
        alone * 1e3,
        (paused / alone - 1.0) * 100.0,
        beside.writing.len(),
        beside.paused.len(),
        beside.alone.len(),
        mib(beside.written as f64),
    );
    let pending = median_secs(&beside.pending);
    println!(
        "| decode at depth {depth} while a write is under way, as the app runs it (the writer mid-file when the turn starts, paused for the turn) | {:.1} ms/token against {:.1} with no writer: {:+.1}% (medians of {} / {} tokens, {rounds} rounds, each round's two runs back to back) |",
        pending * 1e3,
        alone * 1e3,
        (pending / alone - 1.0) * 100.0,
        beside.pending.len(),
        beside.alone.len(),
    );
    Ok(())
}

/// What the disk part measures.
struct DiskFigures {
    resumes: Vec<ResumeTimes>,
    read: Vec<Duration>,
    decode: Vec<Duration>,
    copy: Vec<Duration>,
    /// The largest share of the file found in the page cache before a read.
    resident: Option<f64>,
    file_bytes: usize,
    encode: Duration,
    write: Duration,
    beside: BesideWriter,
}

#[allow(clippy::too_many_arguments)]
fn disk_and_writes(
    model: &Arc<Model>,
    pool: &Arc<rayon::ThreadPool>,
    dir: &Path,
    snapshot: &KvSnapshot,
    prompt: &[u32],
    want: &[f32],
    context: usize,
    depth: usize,
    rounds: usize,
) -> anyhow::Result<DiskFigures> {
    let started = Instant::now();
    let file = kv_tiers::encode(snapshot, "bench");
    let encode = started.elapsed();
    let path = dir.join(kv_tiers::file_name(snapshot));
    let started = Instant::now();
    kv_tiers::write_atomic(&path, &file)?;
    let write = started.elapsed();
    let file_bytes = file.len();
    drop(file);
    let mut disk = KvTiers::new(TierConfig {
        ram_budget_bytes: 0,
        disk_dir: Some(dir.to_path_buf()),
        disk_budget_bytes: u64::MAX,
    });
    let evict = |resident: &mut Option<f64>| -> anyhow::Result<()> {
        evict_from_page_cache(&path)
            .with_context(|| format!("cannot evict {} from the page cache", path.display()))?;
        if let Some(share) = crate::bench::probe::resident_share(&path) {
            *resident = Some(resident.unwrap_or(0.0).max(share));
        }
        Ok(())
    };
    let mut resident = None;
    let (mut resumes, mut read, mut decode, mut copy) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut session = model.new_session(pool, context);
    for _ in 0..rounds {
        // Through the tiers, as the engine resumes.
        session.truncate(0);
        evict(&mut resident)?;
        resumes.push(resume_once(
            pool,
            &mut session,
            &mut disk,
            prompt,
            want,
            "disk",
        )?);
        // The same steps one by one, for their parts.
        session.truncate(0);
        evict(&mut resident)?;
        let started = Instant::now();
        let bytes = std::fs::read(&path)?;
        read.push(started.elapsed());
        let started = Instant::now();
        let (decoded, _) = pool.install(|| kv_tiers::decode(&path, &bytes))?;
        decode.push(started.elapsed());
        drop(bytes);
        let started = Instant::now();
        pool.install(|| session.restore(&decoded, depth - 1))?;
        copy.push(started.elapsed());
    }
    drop(disk);

    // Decode alone and beside the writer, interleaved round by round.
    let shared = Arc::new(snapshot.clone());
    let mut decoder = model.new_session(pool, context);
    pool.install(|| decoder.restore(snapshot, depth))?;
    // Warm-up: the pool's per-thread scratch comes to life on the first decodes.
    pool.install(|| decode_run(&mut decoder, 4, &|_| {}))?;
    let mut beside = BesideWriter::default();
    for _ in 0..rounds {
        decode_beside_writer(pool, &mut decoder, depth, &shared, dir, &mut beside)?;
    }
    Ok(DiskFigures {
        resumes,
        read,
        decode,
        copy,
        resident,
        file_bytes,
        encode,
        write,
        beside,
    })
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
