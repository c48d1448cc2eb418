//! A file of a mapped checkpoint's experts reordered into tiles, mapped at load instead of
//! copying them into memory the process owns.
//!
//! The copy of the 20b's experts costs seconds per load (fresh memory comes at about 1 GiB/s on a
//! VM), and beside the checkpoint's page cache it leaves too little room to keep both: the next
//! load reads the checkpoint from disk again. The file is written once, tensor by tensor, and
//! later loads map it like a shard: its pages are the page cache's to keep or drop.
//!
//! Layout: a header (magic, format version, key, file length, then per tensor its name, shape
//! and the offset and length of its tiled blocks and scales), then the bytes, each tensor's blocks
//! and scales at 4096-byte boundaries. The header is a function of the key and the tensors'
//! shapes, so a file is valid when it starts with exactly the header this load would write and
//! has the length that header states; anything else (another version, a replaced checkpoint, a
//! torn or truncated write) is written anew.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::checkpoint::{ByteOwner, TensorBytes, WatchedMap};
use super::options::TileCache;
use super::weights::{Mxfp4Experts, Weights};

const MAGIC: &[u8; 8] = b"OSSTILES";
/// Bumped whenever the header or the tile layout written by [`crate::kernels::tile_mxfp4`]
/// changes: files of another version are not read.
pub const FORMAT_VERSION: u32 = 1;
const ALIGN: u64 = 4096;
/// Below this many bytes of mapped experts [`TileCache::Auto`] copies them: a fraction of a second,
/// not worth a file (and tests on tiny fixtures leave nothing in the user's cache).
pub const MIN_CACHED_BYTES: u64 = 256 << 20;
/// Free disk space left beside a new file.
const DISK_MARGIN: u64 = 1 << 30;
/// Overrides [`TileCache::Auto`]'s directory; `off` turns the cache off.
pub const ENV: &str = "OSSTERM_TILE_CACHE";

/// Where a model's tiled experts came from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TileSource {
    /// The experts were not reordered.
    #[default]
    None,
    /// Reordered in memory the process already owned (generated, or repacked from a GGUF).
    InPlace,
    /// Copied out of the checkpoint's mapping into memory the process owns.
    Copied,
    /// Mapped from a cache file, which this load wrote first if `written`.
    CacheFile { path: PathBuf, written: bool },
}

impl TileSource {
    pub fn describe(&self) -> String {
        match self {
            TileSource::None => "not tiled".into(),
            TileSource::InPlace => "in place".into(),
            TileSource::Copied => "copied into memory".into(),
            TileSource::CacheFile {
                path,
                written: true,
            } => format!("written to {}", path.display()),
            TileSource::CacheFile {
                path,
                written: false,
            } => format!("mapped from {}", path.display()),
        }
    }
}

/// What names one checkpoint's tiles: `dir` hashes the checkpoint's directory (a file of the same
/// directory under another key is stale and removed when a new one is written), `key` its
/// contents as far as they can be known without reading the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheKey {
    pub dir: u64,
    pub key: u64,
}

impl CacheKey {
    /// The key of the checkpoint in `dir` with model fingerprint `fingerprint` (config.json and
    /// tensor headers) and shards `shards`, whose lengths and modification times are added: a
    /// checkpoint replaced by one with the same headers must not meet the old tiles.
    pub fn of_checkpoint<'a>(
        dir: &Path,
        fingerprint: u64,
        shards: impl Iterator<Item = &'a Path>,
    ) -> Option<CacheKey> {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&fingerprint.to_le_bytes());
        for shard in shards {
            let meta = std::fs::metadata(shard).ok()?;
            let modified = meta
                .modified()
                .ok()?
                .duration_since(std::time::UNIX_EPOCH)
                .ok()?;
            hasher.update(shard.as_os_str().as_encoded_bytes());
            hasher.update(&meta.len().to_le_bytes());
            hasher.update(&modified.as_nanos().to_le_bytes());
        }
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
        Some(CacheKey {
            dir: xxhash_rust::xxh3::xxh3_64(dir.as_os_str().as_encoded_bytes()),
            key: hasher.digest(),
        })
    }

    fn file_name(&self) -> String {
        format!("{:016x}-{:016x}.tiles", self.dir, self.key)
    }
}

/// The directory `setting` puts the tiles of `mapped_bytes` of experts in, if any.
pub fn cache_dir(setting: &TileCache, mapped_bytes: u64) -> Option<PathBuf> {
    match setting {
        TileCache::Off => None,
        TileCache::Dir(dir) => Some(dir.clone()),
        TileCache::Auto if mapped_bytes < MIN_CACHED_BYTES => None,
        TileCache::Auto => match std::env::var_os(ENV) {
            Some(value) if value == "off" => None,
            Some(value) if !value.is_empty() => Some(PathBuf::from(value)),
            _ => crate::config::project_dirs().map(|dirs| dirs.cache_dir().join("tiles")),
        },
    }
}

/// One tensor's entry in the header, offsets from the start of the file.
struct Entry {
    blocks: (u64, u64),
    scales: (u64, u64),
}

/// The header a file of `tensors` under `key` has, their entries and the file's length.
fn layout(key: &CacheKey, tensors: &[(String, &mut Mxfp4Experts)]) -> (Vec<u8>, Vec<Entry>, u64) {
    let header_len = 8
        + 4
        + 4
        + 16
        + 8
        + tensors
            .iter()
            .map(|(name, _)| 4 + name.len() + 3 * 8 + 4 * 8)
            .sum::<usize>();
    let align = |at: u64| at.div_ceil(ALIGN) * ALIGN;
    let mut at = align(header_len as u64);
    let mut entries = Vec::with_capacity(tensors.len());
    for (_, experts) in tensors {
        let blocks_len = (experts.num_experts() * experts.rows() * experts.cols() / 2) as u64;
        let scales_len = experts.byte_len() as u64 - blocks_len;
        let blocks = (at, blocks_len);
        at = align(at + blocks_len);
        let scales = (at, scales_len);
        at = align(at + scales_len);
        entries.push(Entry { blocks, scales });
    }
    let total = at;
    let mut header = Vec::with_capacity(header_len);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u32).to_le_bytes());
    header.extend_from_slice(&key.dir.to_le_bytes());
    header.extend_from_slice(&key.key.to_le_bytes());
    header.extend_from_slice(&total.to_le_bytes());
    for ((name, experts), entry) in tensors.iter().zip(&entries) {
        header.extend_from_slice(&(name.len() as u32).to_le_bytes());
        header.extend_from_slice(name.as_bytes());
        for n in [experts.num_experts(), experts.rows(), experts.cols()] {
            header.extend_from_slice(&(n as u64).to_le_bytes());
        }
        for n in [
            entry.blocks.0,
            entry.blocks.1,
            entry.scales.0,
            entry.scales.1,
        ] {
            header.extend_from_slice(&n.to_le_bytes());
        }
    }
    debug_assert_eq!(header.len(), header_len);
    (header, entries, total)
}

/// Reorders every expert tensor of `weights` that can be into tiles held by the cache file for
/// `key` in `dir`: maps a valid file, or writes one first (tensor by tensor through one buffer).
/// `progress` hears each tensor done. Returns the bytes tiled and where they are, or why the
/// cache could not be used, in which case `weights` are as they were.
pub fn tile_through_cache(
    weights: &mut Weights,
    dir: &Path,
    key: CacheKey,
    progress: &mut dyn FnMut(),
) -> Result<(usize, TileSource), String> {
    let mut tensors = weights.tileable_experts_named();
    let (header, entries, total) = layout(&key, &tensors);
    let path = dir.join(key.file_name());
    let mut written = false;
    let map = match open_valid(&path, &header, total) {
        Some(map) => map,
        None => {
            write(
                dir, &path, &key, &header, &entries, total, &tensors, progress,
            )?;
            written = true;
            open_valid(&path, &header, total)
                .ok_or_else(|| format!("{} does not read back as written", path.display()))?
        }
    };
    let mut bytes = 0;
    for ((_, experts), entry) in tensors.iter_mut().zip(&entries) {
        let range = |(at, len): (u64, u64)| at as usize..(at + len) as usize;
        let blocks = TensorBytes::new(map.clone(), range(entry.blocks));
        let scales = TensorBytes::new(map.clone(), range(entry.scales));
        experts
            .use_tiled(blocks, scales)
            .map_err(|error| error.to_string())?;
        bytes += experts.byte_len();
        if !written {
            progress();
        }
    }
    Ok((bytes, TileSource::CacheFile { path, written }))
}

/// `path` mapped, if it is a file of `total` bytes that starts with `header`.
fn open_valid(path: &Path, header: &[u8], total: u64) -> Option<Arc<dyn ByteOwner>> {
    if std::fs::metadata(path).ok()?.len() != total {
        return None;
    }
    let map = WatchedMap::open(path).ok()?;
    let valid = map.bytes().len() as u64 == total && map.bytes().starts_with(header);
    // A file cut short after the length was taken read as zeros: not valid either.
    (valid && crate::fault::check().is_ok()).then(|| Arc::new(map) as Arc<dyn ByteOwner>)
}

#[allow(clippy::too_many_arguments)]
fn write(
    dir: &Path,
    path: &Path,
    key: &CacheKey,
    header: &[u8],
    entries: &[Entry],
    total: u64,
    tensors: &[(String, &mut Mxfp4Experts)],
    progress: &mut dyn FnMut(),
) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    remove_stale(dir, key, path);
    if let Some(free) = free_bytes(dir) {
        if free < total.saturating_add(DISK_MARGIN) {
            let gib = |bytes: u64| bytes as f64 / (1u64 << 30) as f64;
            return Err(format!(
                "{} has {:.1} GiB free; the tiles need {:.1} GiB and a margin",
                dir.display(),
                gib(free),
                gib(total)
            ));
        }
    }
    let temporary = dir.join(format!("{}.{}.tmp", key.file_name(), std::process::id()));
    let result = write_file(&temporary, header, entries, total, tensors, progress)
        .and_then(|()| std::fs::rename(&temporary, path));
    if let Err(error) = result {
        let _ = std::fs::remove_file(&temporary);
        return Err(format!("cannot write {}: {error}", temporary.display()));
    }
    // The rename is durable once the directory is synced; a crash before leaves no file, or the
    // old one, never a torn one under the final name.
    let _ = File::open(dir).and_then(|d| d.sync_all());
    Ok(())
}

fn write_file(
    path: &Path,
    header: &[u8],
    entries: &[Entry],
    total: u64,
    tensors: &[(String, &mut Mxfp4Experts)],
    progress: &mut dyn FnMut(),
) -> std::io::Result<()> {
    let mut file = OpenOptions::new().write(true).create_new(true).open(path)?;
    let mut at = 0u64;
    let mut put = |file: &mut File, offset: u64, bytes: &[u8]| -> std::io::Result<()> {
        const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];
        while at < offset {
            let pad = (offset - at).min(ALIGN) as usize;
            file.write_all(&ZEROS[..pad])?;
            at += pad as u64;
        }
        file.write_all(bytes)?;
        at += bytes.len() as u64;
        Ok(())
    };
    put(&mut file, 0, header)?;
    // One buffer for every tensor: memory grows by the largest tensor, not by all of them.
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    for ((_, experts), entry) in tensors.iter().zip(entries) {
        blocks.resize(entry.blocks.1 as usize, 0);
        scales.resize(entry.scales.1 as usize, 0);
        experts
            .tile_into(&mut blocks, &mut scales)
            .map_err(std::io::Error::other)?;
        put(&mut file, entry.blocks.0, &blocks)?;
        put(&mut file, entry.scales.0, &scales)?;
        progress();
    }
    put(&mut file, total, &[])?;
    file.sync_all()
}

/// Removes what earlier loads of the same checkpoint directory left that nothing will read:
/// files under other keys (the checkpoint was replaced) and temporary files of processes that
/// are gone.
fn remove_stale(dir: &Path, key: &CacheKey, keep: &Path) {
    let Ok(listing) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("{:016x}-", key.dir);
    for entry in listing.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(&prefix) || path == keep {
            continue;
        }
        let stale = if let Some(rest) = name.strip_suffix(".tmp") {
            rest.rsplit('.')
                .next()
                .and_then(|pid| pid.parse::<i32>().ok())
                .is_some_and(|pid| !process_alive(pid))
        } else {
            name.ends_with(".tiles")
        };
        if stale {
            let _ = std::fs::remove_file(&path);
        }
    }
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Bytes an unprivileged process may still write on `dir`'s file system.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data, for which all zeros is a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string and `stat` a valid statvfs to fill.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return None;
    }
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}
