//! KV cache tiers: snapshots of computed prefixes kept in RAM (LRU under a memory budget) and on
//! disk (compressed files under a disk budget), so a conversation computed once is never prefilled
//! again: switching chats, a new chat and back, an effort change and back, reopening yesterday's
//! chat after a restart.
//!
//! A turn asks [`KvTiers::best`] for the snapshot sharing the longest prefix with its prompt and
//! restores it when it beats what the live cache already holds. After a turn the session's state
//! goes into the RAM tier and, through a background writer thread, to disk; the writer gets the
//! shared snapshot (no copy on the engine thread beyond the one capture) and runs at the lowest
//! CPU priority, so it never delays the UI or the next token much.
//!
//! # File format (little-endian), version [`FORMAT_VERSION`]
//! ```text
//! magic "OSSTKV\r\n" | version u32 | header_len u32 | header (header_len bytes) |
//! header checksum u64 (xxh3 of everything before) | payload | payload checksum u64
//! payload: lz4 blocks of 1 MiB raw each, every block as u32 length + block
//! header: fingerprint u64, kv format u8, layers u32, kv_heads u32, head_dim u32, vocab u32,
//!         sliding window u32, first sliding position kept u32, per layer u8 (1: sliding),
//!         raw payload bytes u64, compressed bytes u64,
//!         label length u16 + UTF-8 label, token count u32 + ids u32 each
//! raw payload: every tensor (the order of `Tensors::byte_views`: a sliding layer's tensors
//!         hold the positions from the first kept one on), then the logits (f32)
//! ```
//! Anything that does not check out (magic, version, lengths, checksums, fingerprint, format,
//! shape) makes the file unusable: it is skipped with a one-line notice and deleted.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use rayon::prelude::*;

use crate::model::kv::{KvShape, RowSpan, Tensors};
use crate::model::{KvFormat, KvSnapshot};

use super::generate::common_prefix_len;

/// Bumped whenever the layout or the meaning of a file changes; other versions are ignored.
pub const FORMAT_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"OSSTKV\r\n";
/// Extension of snapshot files in the cache directory.
pub const EXTENSION: &str = "kv";
/// Default RAM budget of the snapshot tier.
pub const DEFAULT_RAM_MB: u64 = 2048;
/// Default disk budget (`cache.max_disk_mb`).
pub const DEFAULT_DISK_MB: u64 = 4096;
/// Longest label kept in a file.
const LABEL_CHARS: usize = 48;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a KV snapshot (bad magic)")]
    Magic { path: PathBuf },
    #[error("{path}: snapshot format version {found}, this build reads {FORMAT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: truncated ({what})")]
    Truncated { path: PathBuf, what: &'static str },
    #[error("{path}: {what} checksum mismatch (corrupt file)")]
    Checksum { path: PathBuf, what: &'static str },
    #[error("{path}: {what}")]
    Invalid { path: PathBuf, what: String },
}

/// What a snapshot file says about itself, read without its payload.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotHeader {
    pub fingerprint: u64,
    pub format: KvFormat,
    pub shape: KvShape,
    /// The positions the tensors hold per layer.
    pub rows: RowSpan,
    pub vocab: usize,
    pub raw_bytes: u64,
    pub compressed_bytes: u64,
    pub label: String,
    pub tokens: Vec<u32>,
}

fn format_code(format: KvFormat) -> u8 {
    match format {
        KvFormat::F16 => 0,
        KvFormat::F32 => 1,
        KvFormat::Q8 => 2,
    }
}

fn format_from_code(code: u8) -> Option<KvFormat> {
    match code {
        0 => Some(KvFormat::F16),
        1 => Some(KvFormat::F32),
        2 => Some(KvFormat::Q8),
        _ => None,
    }
}

/// The shortest restore a chat's snapshot should allow: where the last message of the prompt
/// starts (`without_last` is the conversation rendered without it). Continuing the chat,
/// regenerating its last reply and editing its last message all resume at or after that point,
/// so the snapshot's sliding-window layers keep only the rows from there on.
pub fn resume_floor(tokens: &[u32], without_last: &[u32]) -> usize {
    common_prefix_len(tokens, without_last)
}

/// A compact label for a conversation's snapshot: its title, else its first user message.
pub fn conversation_label(conversation: &crate::chat::Conversation) -> String {
    let title = conversation
        .extra
        .get("title")
        .and_then(|t| t.as_str())
        .filter(|t| !t.trim().is_empty());
    let text = title.map(str::to_string).unwrap_or_else(|| {
        conversation
            .messages
            .iter()
            .find(|m| m.role == crate::chat::Role::User)
            .map(|m| m.content.clone())
            .unwrap_or_default()
    });
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    flat.chars().take(LABEL_CHARS).collect()
}

/// The raw (uncompressed) payload of a snapshot: tensors then logits.
pub fn raw_payload(snapshot: &KvSnapshot) -> Vec<u8> {
    let mut raw = Vec::with_capacity(snapshot.tensor_bytes() + 4 * snapshot.logits.len());
    for part in payload_parts(snapshot) {
        raw.extend_from_slice(part);
    }
    raw
}

/// The raw payload as the slices it is made of (no copy).
fn payload_parts(snapshot: &KvSnapshot) -> Vec<&[u8]> {
    let mut parts = snapshot.tensors.byte_views();
    // SAFETY: f32 has no padding; little-endian bytes as the file stores them (kv.rs asserts
    // the target's byte order).
    parts.push(unsafe {
        std::slice::from_raw_parts(
            snapshot.logits.as_ptr().cast::<u8>(),
            4 * snapshot.logits.len(),
        )
    });
    parts
}

/// Raw bytes per compressed block: small enough that a paused writer resumes or stops within a
/// millisecond or two of work, and that a reader decompresses blocks on every core.
pub const BLOCK_BYTES: usize = 1 << 20;

/// Splits `parts` (in order) into consecutive runs of `block` bytes each (the last one shorter):
/// each run is the list of part pieces it covers.
fn split_blocks<'a, T: SplitBytes<'a>>(parts: Vec<T>, block: usize) -> Vec<Vec<T>> {
    let mut blocks = vec![Vec::new()];
    let mut room = block;
    for mut part in parts {
        while !part.is_empty() {
            if room == 0 {
                blocks.push(Vec::new());
                room = block;
            }
            let take = room.min(part.len());
            let (head, rest) = part.split(take);
            blocks.last_mut().expect("one block at least").push(head);
            room -= take;
            part = rest;
        }
    }
    blocks.retain(|b| !b.is_empty());
    blocks
}

/// A byte slice, shared or writable, that [`split_blocks`] cuts.
trait SplitBytes<'a>: Sized {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn split(self, at: usize) -> (Self, Self);
}

impl<'a> SplitBytes<'a> for &'a [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at(at)
    }
}

impl<'a> SplitBytes<'a> for &'a mut [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn split(self, at: usize) -> (Self, Self) {
        self.split_at_mut(at)
    }
}

/// The payload made of `parts` as lz4 blocks of [`BLOCK_BYTES`] raw bytes, each
/// `[u32 length][block]`; `pause` runs before each block (the writer waits there while a turn
/// computes). Returns the payload and its raw length.
fn compress_parts(parts: Vec<&[u8]>, pause: &dyn Fn()) -> (Vec<u8>, usize) {
    let raw_len: usize = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(raw_len + raw_len / 200 + 64);
    let mut plain = Vec::with_capacity(BLOCK_BYTES);
    for pieces in split_blocks(parts, BLOCK_BYTES) {
        pause();
        plain.clear();
        pieces.iter().for_each(|p| plain.extend_from_slice(p));
        let block = lz4_flex::block::compress(&plain);
        out.extend_from_slice(&(block.len() as u32).to_le_bytes());
        out.extend_from_slice(&block);
    }
    (out, raw_len)
}

/// [`compress_parts`] of one raw buffer.
pub fn compress_payload(raw: &[u8]) -> Vec<u8> {
    compress_parts(vec![raw], &|| {}).0
}

/// Inverse of [`compress_parts`]: decompresses `payload` into `parts` (which together hold
/// exactly the raw bytes), blocks in parallel; `None` if the blocks do not decompress to exactly
/// that.
fn decompress_into(payload: &[u8], parts: Vec<&mut [u8]>) -> Option<()> {
    let raw_len: usize = parts.iter().map(|p| p.len()).sum();
    let mut blocks = Vec::new();
    let mut at = 0;
    while at < payload.len() {
        let len = u32::from_le_bytes(payload.get(at..at + 4)?.try_into().ok()?) as usize;
        blocks.push(payload.get(at + 4..at.checked_add(4 + len)?)?);
        at += 4 + len;
    }
    let targets = split_blocks(parts, BLOCK_BYTES);
    if blocks.len() != targets.len() || blocks.len() != raw_len.div_ceil(BLOCK_BYTES) {
        return None;
    }
    blocks
        .into_par_iter()
        .zip(targets)
        .map_init(
            || vec![0u8; BLOCK_BYTES],
            |plain, (block, mut pieces)| {
                // A block of one piece (most: a tensor is many blocks long) decompresses in
                // place; one spanning pieces goes through the scratch block.
                if let [piece] = &mut pieces[..] {
                    let got = lz4_flex::block::decompress_into(block, piece).ok()?;
                    return (got == piece.len()).then_some(());
                }
                let want: usize = pieces.iter().map(|p| p.len()).sum();
                let got = lz4_flex::block::decompress_into(block, &mut plain[..want]).ok()?;
                if got != want {
                    return None;
                }
                let mut from = 0;
                for piece in pieces {
                    let n = piece.len();
                    piece.copy_from_slice(&plain[from..from + n]);
                    from += n;
                }
                Some(())
            },
        )
        .collect::<Option<Vec<()>>>()
        .map(|_| ())
}

/// Inverse of [`compress_payload`] for a payload of `raw_len` raw bytes.
pub fn decompress_payload(payload: &[u8], raw_len: usize) -> Option<Vec<u8>> {
    let mut raw = vec![0u8; raw_len];
    decompress_into(payload, vec![&mut raw[..]])?;
    Some(raw)
}

/// The whole file for `snapshot`.
pub fn encode(snapshot: &KvSnapshot, label: &str) -> Vec<u8> {
    encode_pausing(snapshot, label, &|| {})
}

/// [`encode`], calling `pause` between blocks.
pub fn encode_pausing(snapshot: &KvSnapshot, label: &str, pause: &dyn Fn()) -> Vec<u8> {
    pause();
    let (payload, raw_len) = compress_parts(payload_parts(snapshot), pause);
    let rows = &snapshot.rows;
    let mut header = Vec::with_capacity(80 + rows.sliding.len() + 4 * snapshot.len() + label.len());
    header.extend_from_slice(&snapshot.fingerprint.to_le_bytes());
    header.push(format_code(snapshot.format()));
    for v in [
        snapshot.shape.layers,
        snapshot.shape.kv_heads,
        snapshot.shape.head_dim,
        snapshot.logits.len(),
        rows.window,
        rows.sliding_from,
    ] {
        header.extend_from_slice(&(v as u32).to_le_bytes());
    }
    header.extend(rows.sliding.iter().map(|&s| s as u8));
    header.extend_from_slice(&(raw_len as u64).to_le_bytes());
    header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    let label: String = label.chars().take(LABEL_CHARS).collect();
    header.extend_from_slice(&(label.len() as u16).to_le_bytes());
    header.extend_from_slice(label.as_bytes());
    header.extend_from_slice(&(snapshot.len() as u32).to_le_bytes());
    for t in &snapshot.tokens {
        header.extend_from_slice(&t.to_le_bytes());
    }
    let mut file = Vec::with_capacity(32 + header.len() + payload.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    file.extend_from_slice(&(header.len() as u32).to_le_bytes());
    file.extend_from_slice(&header);
    let checksum = xxhash_rust::xxh3::xxh3_64(&file);
    file.extend_from_slice(&checksum.to_le_bytes());
    file.extend_from_slice(&payload);
    file.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&payload).to_le_bytes());
    file
}

/// Reads little-endian fields off a byte slice.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

/// Parses the magic, version and header of `bytes` (at least the header part of a file);
/// returns the header and where the payload starts.
fn decode_header(path: &Path, bytes: &[u8]) -> Result<(SnapshotHeader, usize), SnapshotFileError> {
    let truncated = |what| SnapshotFileError::Truncated {
        path: path.to_path_buf(),
        what,
    };
    let invalid = |what: String| SnapshotFileError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    let mut f = Fields { bytes, at: 0 };
    if f.take(8).ok_or_else(|| truncated("magic"))? != MAGIC {
        return Err(SnapshotFileError::Magic {
            path: path.to_path_buf(),
        });
    }
    let version = f.u32().ok_or_else(|| truncated("version"))?;
    if version != FORMAT_VERSION {
        return Err(SnapshotFileError::Version {
            path: path.to_path_buf(),
            found: version,
        });
    }
    let header_len = f.u32().ok_or_else(|| truncated("header length"))? as usize;
    let header_end = 16 + header_len;
    let checksum_end = header_end + 8;
    if bytes.len() < checksum_end {
        return Err(truncated("header"));
    }
    let stored = u64::from_le_bytes(bytes[header_end..checksum_end].try_into().unwrap());
    if xxhash_rust::xxh3::xxh3_64(&bytes[..header_end]) != stored {
        return Err(SnapshotFileError::Checksum {
            path: path.to_path_buf(),
            what: "header",
        });
    }
    let mut h = Fields {
        bytes: &bytes[..header_end],
        at: 16,
    };
    let bad = || invalid("header fields do not fit the header length".into());
    let fingerprint = h.u64().ok_or_else(bad)?;
    let code = h.u8().ok_or_else(bad)?;
    let format =
        format_from_code(code).ok_or_else(|| invalid(format!("unknown KV format {code}")))?;
    let shape = KvShape {
        layers: h.u32().ok_or_else(bad)? as usize,
        kv_heads: h.u32().ok_or_else(bad)? as usize,
        head_dim: h.u32().ok_or_else(bad)? as usize,
    };
    let vocab = h.u32().ok_or_else(bad)? as usize;
    let window = h.u32().ok_or_else(bad)? as usize;
    let sliding_from = h.u32().ok_or_else(bad)? as usize;
    let flags = h.take(shape.layers).ok_or_else(bad)?;
    if flags.iter().any(|&f| f > 1) {
        return Err(invalid("layer flags other than 0 and 1".into()));
    }
    let rows = RowSpan {
        sliding: flags.iter().map(|&f| f == 1).collect(),
        window,
        sliding_from,
    };
    let raw_bytes = h.u64().ok_or_else(bad)?;
    let compressed_bytes = h.u64().ok_or_else(bad)?;
    let label_len = h.u16().ok_or_else(bad)? as usize;
    let label = String::from_utf8_lossy(h.take(label_len).ok_or_else(bad)?).into_owned();
    let count = h.u32().ok_or_else(bad)? as usize;
    let ids = h
        .take(count.checked_mul(4).ok_or_else(bad)?)
        .ok_or_else(bad)?;
    let tokens: Vec<u32> = ids
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    if h.at != header_end {
        return Err(bad());
    }
    if rows.sliding_from > tokens.len() || (rows.sliding_from > 0 && rows.window == 0) {
        return Err(invalid(format!(
            "sliding rows from position {} (window {}) in a snapshot of {} tokens",
            rows.sliding_from,
            rows.window,
            tokens.len()
        )));
    }
    Ok((
        SnapshotHeader {
            fingerprint,
            format,
            shape,
            rows,
            vocab,
            raw_bytes,
            compressed_bytes,
            label,
            tokens,
        },
        checksum_end,
    ))
}

/// Reads only the header of the file at `path`.
pub fn read_header(path: &Path) -> Result<SnapshotHeader, SnapshotFileError> {
    let io = |source| SnapshotFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut start = vec![0u8; 16];
    file.read_exact(&mut start)
        .map_err(|_| SnapshotFileError::Truncated {
            path: path.to_path_buf(),
            what: "header",
        })?;
    if &start[..8] != MAGIC {
        return Err(SnapshotFileError::Magic {
            path: path.to_path_buf(),
        });
    }
    let header_len = u32::from_le_bytes(start[12..16].try_into().unwrap()) as u64;
    // The header's checksum follows it; read both (bounded by the file, not by the field).
    let mut rest = Vec::new();
    file.take(header_len + 8)
        .read_to_end(&mut rest)
        .map_err(io)?;
    start.extend_from_slice(&rest);
    decode_header(path, &start).map(|(header, _)| header)
}

/// Decodes a whole file into a snapshot, checking everything. The payload is decompressed
/// straight into the snapshot's tensors (no intermediate copy of the raw payload).
pub fn decode(path: &Path, bytes: &[u8]) -> Result<(KvSnapshot, String), SnapshotFileError> {
    let (header, start) = decode_header(path, bytes)?;
    let invalid = |what: String| SnapshotFileError::Invalid {
        path: path.to_path_buf(),
        what,
    };
    let compressed =
        usize::try_from(header.compressed_bytes).map_err(|_| invalid("size".into()))?;
    let end = start
        .checked_add(compressed)
        .and_then(|e| e.checked_add(8))
        .ok_or_else(|| invalid("payload size overflows".into()))?;
    if bytes.len() < end {
        return Err(SnapshotFileError::Truncated {
            path: path.to_path_buf(),
            what: "payload",
        });
    }
    if bytes.len() > end {
        return Err(invalid(format!(
            "{} bytes after the payload",
            bytes.len() - end
        )));
    }
    let payload = &bytes[start..start + compressed];
    let stored = u64::from_le_bytes(bytes[end - 8..end].try_into().unwrap());
    if xxhash_rust::xxh3::xxh3_64(payload) != stored {
        return Err(SnapshotFileError::Checksum {
            path: path.to_path_buf(),
            what: "payload",
        });
    }
    let len = header.tokens.len();
    if header.rows.sliding.len() != header.shape.layers {
        return Err(invalid("layer flags do not match the layer count".into()));
    }
    let tensor_bytes = Tensors::byte_len(header.format, header.shape, &header.rows, len);
    let expected = tensor_bytes + 4 * header.vocab;
    if header.raw_bytes != expected as u64 {
        return Err(invalid(format!(
            "payload of {} bytes, the shape needs {expected}",
            header.raw_bytes
        )));
    }
    let mut tensors = Tensors::for_snapshot(header.format, header.shape, &header.rows, len);
    let mut logits = vec![0f32; header.vocab];
    {
        let mut parts = tensors.byte_views_mut();
        // SAFETY: every bit pattern is an f32; the file's little-endian bytes are the values.
        parts.push(unsafe {
            std::slice::from_raw_parts_mut(logits.as_mut_ptr().cast::<u8>(), 4 * logits.len())
        });
        decompress_into(payload, parts)
            .ok_or_else(|| invalid("the payload does not decompress to its size".into()))?;
    }
    let snapshot = KvSnapshot::new(
        header.fingerprint,
        header.shape,
        header.rows,
        header.tokens,
        logits,
        tensors,
    )
    .map_err(|e| invalid(e.to_string()))?;
    Ok((snapshot, header.label))
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsynced, renamed
/// over the target, and the directory fsynced so the rename itself survives a crash.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_pausing(path, bytes, &|| {})
}

/// [`write_atomic`] in pieces of [`BLOCK_BYTES`], calling `pause` before each: copying a
/// hundred megabytes into the page cache is CPU work too, and the writer must not hold a core
/// through it while a turn computes.
pub fn write_atomic_pausing(path: &Path, bytes: &[u8], pause: &dyn Fn()) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = File::create(&temp)?;
        for piece in bytes.chunks(BLOCK_BYTES) {
            pause();
            file.write_all(piece)?;
        }
        pause();
        file.sync_all()?;
        fs::rename(&temp, path)?;
        if let Ok(dir) = File::open(dir) {
            let _ = dir.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// The file name of `snapshot`: a hash of what identifies it (the computation, the KV type,
/// the tokens), so snapshots of one chat by two models never overwrite each other.
pub fn file_name(snapshot: &KvSnapshot) -> String {
    let mut bytes = Vec::with_capacity(9 + 4 * snapshot.len());
    bytes.extend_from_slice(&snapshot.fingerprint.to_le_bytes());
    bytes.push(format_code(snapshot.format()));
    snapshot
        .tokens
        .iter()
        .for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
    format!("{:016x}.{EXTENSION}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// One snapshot file: its header and when it was last used.
#[derive(Clone, Debug)]
pub struct DiskEntry {
    pub path: PathBuf,
    pub header: SnapshotHeader,
    pub size: u64,
    pub last_used: SystemTime,
}

/// Every snapshot file in `dir`, newest first; files that cannot be read are reported in the
/// second list (with why) and left alone.
pub fn list_dir(dir: &Path) -> (Vec<DiskEntry>, Vec<SnapshotFileError>) {
    let (mut entries, mut bad) = (Vec::new(), Vec::new());
    let Ok(read) = fs::read_dir(dir) else {
        return (entries, bad);
    };
    for item in read.flatten() {
        let path = item.path();
        if path.extension().is_none_or(|e| e != EXTENSION) {
            continue;
        }
        let meta = match item.metadata() {
            Ok(meta) => meta,
            Err(source) => {
                bad.push(SnapshotFileError::Io { path, source });
                continue;
            }
        };
        match read_header(&path) {
            Ok(header) => entries.push(DiskEntry {
                path,
                header,
                size: meta.len(),
                last_used: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            }),
            Err(error) => bad.push(error),
        }
    }
    entries.sort_by_key(|e| std::cmp::Reverse(e.last_used));
    (entries, bad)
}

/// Deletes the least recently used files of `dir` until the snapshot files fit in `budget`
/// bytes; returns the deleted paths. Leftover temporary files of crashed writes go too.
pub fn enforce_budget(dir: &Path, budget: u64) -> Vec<PathBuf> {
    let mut files: Vec<(PathBuf, u64, SystemTime)> = Vec::new();
    let mut deleted = Vec::new();
    if let Ok(read) = fs::read_dir(dir) {
        for item in read.flatten() {
            let path = item.path();
            let name = item.file_name().to_string_lossy().into_owned();
            let Ok(meta) = item.metadata() else { continue };
            if name.starts_with('.') && name.ends_with(".tmp") {
                // Another process's write in progress is recent; only stale leftovers go.
                let stale = meta
                    .modified()
                    .ok()
                    .and_then(|m| m.elapsed().ok())
                    .is_some_and(|age| age > Duration::from_secs(3600));
                if stale && fs::remove_file(&path).is_ok() {
                    deleted.push(path);
                }
                continue;
            }
            if path.extension().is_some_and(|e| e == EXTENSION) {
                let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                files.push((path, meta.len(), used));
            }
        }
    }
    files.sort_by_key(|f| f.2);
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    for (path, size, _) in files {
        if total <= budget {
            break;
        }
        if fs::remove_file(&path).is_ok() {
            total -= size;
            deleted.push(path);
        }
    }
    deleted
}

/// Deletes every snapshot file in `dir`; returns how many and their bytes.
pub fn clear_dir(dir: &Path) -> std::io::Result<(usize, u64)> {
    let (mut count, mut bytes) = (0, 0);
    let read = match fs::read_dir(dir) {
        Ok(read) => read,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(e) => return Err(e),
    };
    for item in read.flatten() {
        let path = item.path();
        let name = item.file_name().to_string_lossy().into_owned();
        let ours = path.extension().is_some_and(|e| e == EXTENSION)
            || (name.starts_with('.') && name.ends_with(".tmp"));
        if ours {
            let size = item.metadata().map(|m| m.len()).unwrap_or(0);
            fs::remove_file(&path)?;
            count += 1;
            bytes += size;
        }
    }
    Ok((count, bytes))
}

/// Where a resumed prefix came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Ram,
    Disk,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Tier::Ram => "RAM",
            Tier::Disk => "disk",
        }
    }
}

/// Use of both tiers, for the stats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    pub ram_bytes: u64,
    pub ram_snapshots: usize,
    pub disk_bytes: u64,
    pub disk_snapshots: usize,
    /// Turns that resumed from a snapshot.
    pub snapshot_hits: u64,
}

struct RamEntry {
    snapshot: Arc<KvSnapshot>,
    label: String,
    last_used: u64,
}

/// What the writer thread reports back.
enum WriterReport {
    Written {
        entry: Box<DiskEntry>,
        deleted: Vec<PathBuf>,
        took: Duration,
    },
    Failed(String),
}

struct WriteJob {
    snapshot: Arc<KvSnapshot>,
    label: String,
    /// Files this one supersedes (snapshots of a prefix of its tokens): deleted once it is written.
    supersedes: Vec<PathBuf>,
}

/// A gate a background writer waits at while a turn computes. The writer blocks on a condition
/// variable, not a polling loop: paused it takes no wake-ups at all (a polling writer woke every
/// few milliseconds for the whole turn, each wake a context switch on a core the forward pass
/// wants), and it resumes the moment the gate opens instead of up to a poll period later.
#[derive(Default)]
pub struct PauseGate {
    closed: Mutex<bool>,
    opened: Condvar,
}

impl PauseGate {
    /// Closes (`true`) or opens the gate; opening wakes every waiter at once.
    pub fn set_closed(&self, closed: bool) {
        // A waiter that panicked cannot leave the flag half-written: a poisoned lock still
        // holds a valid bool.
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = closed;
        if !closed {
            self.opened.notify_all();
        }
    }

    /// Returns at once while the gate is open; while it is closed, blocks until it opens.
    pub fn wait(&self) {
        let closed = self.closed.lock().unwrap_or_else(PoisonError::into_inner);
        drop(
            self.opened
                .wait_while(closed, |closed| *closed)
                .unwrap_or_else(PoisonError::into_inner),
        );
    }
}

/// The background writer: encodes, compresses and writes snapshot files, then keeps the directory
/// under its budget.
struct Writer {
    jobs: Option<Sender<WriteJob>>,
    reports: Receiver<WriterReport>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    fn spawn(dir: PathBuf, budget: u64, gate: Arc<PauseGate>) -> std::io::Result<Writer> {
        let (jobs, job_receiver) = mpsc::channel::<WriteJob>();
        let (report_sender, reports) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("ossterm-kv-writer".into())
            .spawn(move || {
                lower_thread_priority();
                for job in job_receiver {
                    let started = Instant::now();
                    // While a turn computes, the writer waits between blocks: it only uses the
                    // time between turns (the user reading and typing).
                    let pause = || gate.wait();
                    let bytes = encode_pausing(&job.snapshot, &job.label, &pause);
                    let path = dir.join(file_name(&job.snapshot));
                    let report = match write_atomic_pausing(&path, &bytes, &pause) {
                        Ok(()) => {
                            let mut deleted = Vec::new();
                            for old in job.supersedes.into_iter().filter(|old| *old != path) {
                                if fs::remove_file(&old).is_ok() {
                                    deleted.push(old);
                                }
                            }
                            deleted.extend(enforce_budget(&dir, budget));
                            match read_header(&path) {
                                Ok(header) => WriterReport::Written {
                                    entry: Box::new(DiskEntry {
                                        path,
                                        header,
                                        size: bytes.len() as u64,
                                        last_used: SystemTime::now(),
                                    }),
                                    deleted,
                                    took: started.elapsed(),
                                },
                                // Evicted at once: larger than the whole budget.
                                Err(_) => WriterReport::Failed(format!(
                                    "KV snapshot of {} tokens is larger than the disk budget",
                                    job.snapshot.len()
                                )),
                            }
                        }
                        Err(error) => WriterReport::Failed(format!(
                            "cannot write KV snapshot {}: {error}",
                            path.display()
                        )),
                    };
                    if report_sender.send(report).is_err() {
                        return;
                    }
                }
            })?;
        Ok(Writer {
            jobs: Some(jobs),
            reports,
            thread: Some(thread),
        })
    }

    /// Waits for queued writes to finish.
    fn finish(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Runs the calling thread at the lowest CPU priority: the snapshot writer only uses cycles the
/// forward pass leaves idle. On Linux that is the SCHED_IDLE policy: the thread runs only on a
/// core nothing else wants and yields it the moment a forward-pass thread wakes (nice 19 alone
/// still takes its time slices from a busy core, and the forward pass waits at every barrier for
/// its slowest thread). Where SCHED_IDLE is refused, nice 19.
pub fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain syscalls on the calling thread's own id; `param` is fully initialized.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
}

/// A match found for a prompt.
pub struct Found {
    pub snapshot: Arc<KvSnapshot>,
    /// Prompt tokens the snapshot covers.
    pub matched: usize,
    pub tier: Tier,
}

/// The RAM and disk tiers of one engine.
pub struct KvTiers {
    ram: Vec<RamEntry>,
    ram_budget: u64,
    clock: u64,
    disk_dir: Option<PathBuf>,
    disk_limit: u64,
    disk: Vec<DiskEntry>,
    writer: Option<Writer>,
    /// Closed while a turn computes; the writer waits at it meanwhile.
    gate: Arc<PauseGate>,
    /// Lines for the user (files skipped, writes that failed), taken by [`KvTiers::take_notices`].
    notices: Vec<String>,
    hits: u64,
    /// The last background write's duration, for the benchmark.
    pub last_write: Option<Duration>,
}

/// Budgets and place of the tiers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    pub ram_budget_bytes: u64,
    /// `None` keeps snapshots in RAM only.
    pub disk_dir: Option<PathBuf>,
    pub disk_budget_bytes: u64,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            ram_budget_bytes: DEFAULT_RAM_MB << 20,
            disk_dir: None,
            disk_budget_bytes: DEFAULT_DISK_MB << 20,
        }
    }
}

/// The platform cache directory for snapshots (`~/.cache/ossterm/kv` on Linux).
pub fn default_cache_dir() -> Option<PathBuf> {
    crate::config::project_dirs().map(|dirs| dirs.cache_dir().join("kv"))
}

impl KvTiers {
    /// Opens the tiers: reads the headers of the files in the disk directory (skipping, with a
    /// notice, and deleting those that are not snapshots of this build) and starts the writer.
    pub fn new(config: TierConfig) -> KvTiers {
        let mut tiers = KvTiers {
            ram: Vec::new(),
            ram_budget: config.ram_budget_bytes,
            clock: 0,
            disk_dir: None,
            disk_limit: config.disk_budget_bytes,
            disk: Vec::new(),
            writer: None,
            gate: Arc::default(),
            notices: Vec::new(),
            hits: 0,
            last_write: None,
        };
        if let Some(dir) = config.disk_dir {
            if let Err(error) = fs::create_dir_all(&dir) {
                tiers.notices.push(format!(
                    "KV snapshots stay in RAM: cannot create {}: {error}",
                    dir.display()
                ));
                return tiers;
            }
            let (entries, bad) = list_dir(&dir);
            for error in bad {
                tiers.skip(error);
            }
            tiers.disk = entries;
            match Writer::spawn(
                dir.clone(),
                config.disk_budget_bytes,
                Arc::clone(&tiers.gate),
            ) {
                Ok(writer) => {
                    tiers.writer = Some(writer);
                    tiers.disk_dir = Some(dir);
                }
                Err(error) => tiers.notices.push(format!(
                    "KV snapshots stay in RAM: cannot start the writer: {error}"
                )),
            }
        }
        tiers
    }

    /// Records an unusable file: a notice, and the file is deleted (it can never be used).
    fn skip(&mut self, error: SnapshotFileError) {
        let path = match &error {
            SnapshotFileError::Io { .. } => None,
            SnapshotFileError::Magic { path }
            | SnapshotFileError::Version { path, .. }
            | SnapshotFileError::Truncated { path, .. }
            | SnapshotFileError::Checksum { path, .. }
            | SnapshotFileError::Invalid { path, .. } => Some(path.clone()),
        };
        if let Some(path) = path {
            let _ = fs::remove_file(&path);
            self.disk.retain(|e| e.path != path);
        }
        self.notices
            .push(format!("KV snapshot ignored and deleted: {error}"));
    }

    /// Notices since the last call.
    pub fn take_notices(&mut self) -> Vec<String> {
        self.collect_reports();
        std::mem::take(&mut self.notices)
    }

    /// Applies what the writer finished.
    fn collect_reports(&mut self) {
        let Some(writer) = &self.writer else { return };
        let reports: Vec<WriterReport> = writer.reports.try_iter().collect();
        for report in reports {
            match report {
                WriterReport::Written {
                    entry,
                    deleted,
                    took,
                } => {
                    self.last_write = Some(took);
                    self.disk
                        .retain(|e| e.path != entry.path && !deleted.contains(&e.path));
                    self.disk.insert(0, *entry);
                }
                WriterReport::Failed(message) => self.notices.push(message),
            }
        }
    }

    /// Marks a turn as computing (`true`) or done: background writes wait while it computes.
    pub fn set_busy(&self, busy: bool) {
        self.gate.set_closed(busy);
    }

    /// Waits for every queued disk write (a command's exit, tests and the benchmark).
    pub fn flush(&mut self) {
        self.set_busy(false);
        if let Some(writer) = &mut self.writer {
            writer.finish();
        }
        self.collect_reports();
        if let Some(dir) = self.disk_dir.clone() {
            // The writer is gone after finish; a new one serves later writes.
            self.writer = Writer::spawn(dir, self.disk_limit, Arc::clone(&self.gate)).ok();
        }
    }

    /// Keeps `snapshot` in RAM (dropping snapshots of a prefix of its tokens, which it covers, and
    /// the least recently used beyond the budget) and queues it for disk.
    pub fn store(&mut self, snapshot: KvSnapshot, label: &str) {
        let snapshot = Arc::new(snapshot);
        self.store_ram(Arc::clone(&snapshot), label);
        self.store_disk(snapshot, label);
    }

    fn covers(
        newer: &KvSnapshot,
        older_tokens: &[u32],
        fingerprint: u64,
        format: KvFormat,
    ) -> bool {
        fingerprint == newer.fingerprint
            && format == newer.format()
            && older_tokens.len() <= newer.len()
            && newer.tokens[..older_tokens.len()] == *older_tokens
    }

    fn store_ram(&mut self, snapshot: Arc<KvSnapshot>, label: &str) {
        self.ram.retain(|e| {
            !KvTiers::covers(
                &snapshot,
                &e.snapshot.tokens,
                e.snapshot.fingerprint,
                e.snapshot.format(),
            )
        });
        self.clock += 1;
        self.ram.push(RamEntry {
            snapshot,
            label: label.to_string(),
            last_used: self.clock,
        });
        while self.ram_bytes() > self.ram_budget {
            let oldest = self
                .ram
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i);
            match oldest {
                Some(i) => {
                    self.ram.remove(i);
                }
                None => break,
            }
        }
    }

    fn store_disk(&mut self, snapshot: Arc<KvSnapshot>, label: &str) {
        self.collect_reports();
        let Some(writer) = &self.writer else { return };
        let supersedes = self
            .disk
            .iter()
            .filter(|e| {
                KvTiers::covers(
                    &snapshot,
                    &e.header.tokens,
                    e.header.fingerprint,
                    e.header.format,
                )
            })
            .map(|e| e.path.clone())
            .collect();
        let job = WriteJob {
            snapshot,
            label: label.to_string(),
            supersedes,
        };
        if let Some(jobs) = &writer.jobs {
            let _ = jobs.send(job);
        }
    }

    /// The snapshot (RAM first, then disk) sharing the longest prefix with `prompt` among those of
    /// `fingerprint` and `format`, if it covers more than `at_least` tokens. A disk snapshot is
    /// read and checked here; one that fails is skipped with a notice and deleted, and the search
    /// goes on.
    pub fn best(
        &mut self,
        fingerprint: u64,
        format: KvFormat,
        prompt: &[u32],
        at_least: usize,
    ) -> Option<Found> {
        self.collect_reports();
        // At least one prompt token is always prefilled (its logits pick the first token); a
        // snapshot without the sliding rows a shorter restore needs cannot serve it at all.
        let usable = |tokens: &[u32], rows: &RowSpan| {
            let matched = common_prefix_len(tokens, prompt).min(prompt.len().saturating_sub(1));
            if matched >= rows.min_restore() {
                matched
            } else {
                0
            }
        };
        let ram = self
            .ram
            .iter_mut()
            .filter(|e| e.snapshot.fingerprint == fingerprint && e.snapshot.format() == format)
            .map(|e| (usable(&e.snapshot.tokens, &e.snapshot.rows), e))
            .max_by_key(|(matched, _)| *matched);
        let mut best_ram = None;
        if let Some((matched, entry)) = ram {
            if matched > at_least {
                self.clock += 1;
                entry.last_used = self.clock;
                best_ram = Some(Found {
                    snapshot: Arc::clone(&entry.snapshot),
                    matched,
                    tier: Tier::Ram,
                });
            }
        }
        let floor = best_ram.as_ref().map_or(at_least, |f| f.matched);
        loop {
            let candidate = self
                .disk
                .iter()
                .filter(|e| e.header.fingerprint == fingerprint && e.header.format == format)
                .map(|e| (usable(&e.header.tokens, &e.header.rows), e.path.clone()))
                .filter(|(matched, _)| *matched > floor)
                .max_by_key(|(matched, _)| *matched);
            let Some((matched, path)) = candidate else {
                break;
            };
            match fs::read(&path)
                .map_err(|source| SnapshotFileError::Io {
                    path: path.clone(),
                    source,
                })
                .and_then(|bytes| decode(&path, &bytes))
            {
                Ok((snapshot, label)) => {
                    // Used now: the disk LRU goes by modification time.
                    if let Ok(file) = File::options().write(true).open(&path) {
                        let _ = file.set_modified(SystemTime::now());
                    }
                    if let Some(entry) = self.disk.iter_mut().find(|e| e.path == path) {
                        entry.last_used = SystemTime::now();
                    }
                    let snapshot = Arc::new(snapshot);
                    self.store_ram(Arc::clone(&snapshot), &label);
                    return Some(Found {
                        snapshot,
                        matched,
                        tier: Tier::Disk,
                    });
                }
                Err(SnapshotFileError::Io { path, source }) => {
                    // Gone or unreadable right now: forget it without deleting.
                    self.disk.retain(|e| e.path != path);
                    self.notices
                        .push(format!("KV snapshot skipped: {}: {source}", path.display()));
                }
                Err(error) => self.skip(error),
            }
        }
        best_ram
    }

    /// Counts a turn that resumed from a snapshot.
    pub fn record_hit(&mut self) {
        self.hits += 1;
    }

    fn ram_bytes(&self) -> u64 {
        self.ram
            .iter()
            .map(|e| e.snapshot.memory_bytes() as u64)
            .sum()
    }

    /// Applies finished background writes.
    pub fn poll(&mut self) {
        self.collect_reports();
    }

    /// Use as of the last [`KvTiers::poll`] (or any other call).
    pub fn usage(&self) -> TierUsage {
        TierUsage {
            ram_bytes: self.ram_bytes(),
            ram_snapshots: self.ram.len(),
            disk_bytes: self.disk.iter().map(|e| e.size).sum(),
            disk_snapshots: self.disk.len(),
            snapshot_hits: self.hits,
        }
    }

    /// Labels of the RAM snapshots, most recently used first (tests, diagnostics).
    pub fn ram_labels(&self) -> Vec<String> {
        let mut entries: Vec<&RamEntry> = self.ram.iter().collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.last_used));
        entries.iter().map(|e| e.label.clone()).collect()
    }

    /// Paths of the disk snapshots the tier knows of.
    pub fn disk_paths(&mut self) -> Vec<PathBuf> {
        self.collect_reports();
        self.disk.iter().map(|e| e.path.clone()).collect()
    }
}
