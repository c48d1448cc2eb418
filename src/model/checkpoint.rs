//! Memory-mapped safetensors shards and tensor lookup with dtype and shape checks.
//!
//! Tensor bytes are never copied here: a [`TensorBytes`] is a view into a shared mapping (or, for
//! synthetic models, a shared heap buffer), so the 13 GB of a real checkpoint stay in the page cache.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::SafeTensors;

use super::ModelError;

/// Element types the loader understands (others are reported by name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F16,
    F32,
    U8,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
        }
    }

    fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::BF16 => Some(Dtype::Bf16),
            safetensors::Dtype::F16 => Some(Dtype::F16),
            safetensors::Dtype::F32 => Some(Dtype::F32),
            safetensors::Dtype::U8 => Some(Dtype::U8),
            _ => None,
        }
    }
}

/// Something that owns bytes and can lend them out for as long as it lives.
pub trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// Lets the OS drop the resident pages of `range` if it can bring them back by itself
    /// (file-backed mappings); a no-op for heap memory.
    fn release(&self, _range: Range<usize>) {}

    /// Whether the bytes are a file's pages, which the OS can drop and read again, rather than
    /// memory the process owns.
    fn is_mapped(&self) -> bool {
        false
    }

    /// The bytes for writing, where the owner allows it (heap buffers that nothing else reads
    /// from: see [`TensorBytes::unique_aligned_mut`]).
    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

/// A read-only mapping of a weights file (safetensors shard or GGUF), watched by [`crate::fault`]
/// for as long as it is mapped: a file truncated on disk turns into an error naming it instead of
/// a fatal SIGBUS, and one overwritten in place (same length, no fault) is caught by
/// [`crate::fault::verify_files`] against the identity of the file as it was mapped.
pub struct WatchedMap {
    // Declared first so it drops first: the range stops being watched before it is unmapped.
    _watch: crate::fault::Registration,
    map: Mmap,
}

impl WatchedMap {
    /// Maps `path` read-only and watches it.
    pub(crate) fn open(path: &Path) -> Result<Self, ModelError> {
        let io = |source| ModelError::Io {
            path: path.to_owned(),
            source,
        };
        let handle = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only. If another process truncates the file while we run,
        // reads past the new end raise SIGBUS; the registration below hands the range to
        // `crate::fault`, whose handler turns that into zeros plus an error naming the file.
        let map = unsafe { Mmap::map(&handle) }.map_err(io)?;
        // Where the page cache holds the file in 2 MiB folios (recent kernels do for ext4, xfs,
        // tmpfs), this lets a fault map a whole folio with one entry: a product streaming 10 GB
        // of experts otherwise walks the page table every 4 KiB. A kernel that cannot (THP off,
        // small folios) refuses or ignores it, which is harmless.
        advise_huge_pages(&map);
        Ok(WatchedMap {
            _watch: crate::fault::register(map.as_ptr(), map.len(), path, &handle),
            map,
        })
    }
}

impl ByteOwner for WatchedMap {
    fn bytes(&self) -> &[u8] {
        &self.map
    }

    fn is_mapped(&self) -> bool {
        true
    }

    fn release(&self, range: Range<usize>) {
        // madvise wants page-aligned ranges: release only whole pages inside the range.
        const PAGE: usize = 4096;
        let start = range.start.div_ceil(PAGE) * PAGE;
        let end = range.end / PAGE * PAGE;
        if end > start {
            // SAFETY: the mapping is a read-only private file mapping, so MADV_DONTNEED only drops
            // clean pages that the kernel re-reads from the file on the next access; no data the
            // process wrote can be lost, and outstanding slices stay valid.
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    end - start,
                )
            };
        }
    }
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// Zero-filled heap bytes starting on a 64-byte boundary, for data the kernels read in 512-bit
/// vectors: a large `Vec<u8>` starts 16 bytes past a cache line, so every such load would touch
/// two lines.
pub struct AlignedBytes {
    buffer: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBytes {
    const ALIGN: usize = 64;

    /// `len` zero bytes. Large buffers come from the OS already zeroed and are backed by huge
    /// pages where the kernel allows: gigabytes of weights in 4 KiB pages cost a TLB miss every
    /// few rows.
    pub fn zeroed(len: usize) -> Self {
        let buffer = vec![0u8; len + Self::ALIGN - 1];
        let start = buffer.as_ptr().align_offset(Self::ALIGN);
        advise_huge_pages(&buffer);
        AlignedBytes { buffer, start, len }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buffer[self.start..self.start + self.len]
    }

    /// Moves the written bytes onto huge pages where the kernel can find them (see
    /// [`crate::kernels::collapse_into_huge_pages`]).
    pub fn collapse_huge_pages(&self) {
        crate::kernels::collapse_into_huge_pages(self.bytes());
    }
}

impl ByteOwner for AlignedBytes {
    fn bytes(&self) -> &[u8] {
        &self.buffer[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.as_mut_slice())
    }
}

/// Asks for transparent huge pages over the whole 2 MiB pages inside `buffer`, before they are
/// first touched. A kernel without them (or set to `never`) refuses, which is harmless.
fn advise_huge_pages(buffer: &[u8]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE_PAGE: usize = 2 << 20;
        let start = buffer.as_ptr() as usize;
        let first = start.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let end = (start + buffer.len()) / HUGE_PAGE * HUGE_PAGE;
        if end > first {
            // SAFETY: the range lies inside `buffer`'s allocation and is page aligned;
            // MADV_HUGEPAGE changes only how the kernel backs those pages, never their contents
            // or lifetime.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buffer;
}

/// A cheap, cloneable view of part of a mapping or buffer.
#[derive(Clone)]
pub struct TensorBytes {
    owner: Arc<dyn ByteOwner>,
    range: Range<usize>,
}

impl TensorBytes {
    pub fn new(owner: Arc<dyn ByteOwner>, range: Range<usize>) -> Self {
        assert!(
            range.end <= owner.bytes().len(),
            "tensor range past its buffer"
        );
        TensorBytes { owner, range }
    }

    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        TensorBytes::new(Arc::new(bytes), 0..len)
    }

    /// All of `bytes`.
    pub fn from_aligned(bytes: AlignedBytes) -> Self {
        let len = bytes.len;
        TensorBytes::new(Arc::new(bytes), 0..len)
    }

    /// The bytes for writing in place, if no other view shares their owner, the owner lends
    /// them for writing (an [`AlignedBytes`]) and they start on a 64-byte boundary.
    pub fn unique_aligned_mut(&mut self) -> Option<&mut [u8]> {
        let range = self.range.clone();
        let bytes = &mut Arc::get_mut(&mut self.owner)?.bytes_mut()?[range];
        (bytes.as_ptr() as usize)
            .is_multiple_of(AlignedBytes::ALIGN)
            .then_some(bytes)
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.range.clone()]
    }

    /// Drops these bytes from the process's resident memory where the OS can reload them.
    pub fn release_pages(&self) {
        self.owner.release(self.range.clone());
    }

    /// Whether the bytes are a file's pages (see [`ByteOwner::is_mapped`]).
    pub fn is_mapped(&self) -> bool {
        self.owner.is_mapped()
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// The bytes reinterpreted as little-endian u16, if the start is 2-byte aligned.
    pub fn as_u16(&self) -> Option<&[u16]> {
        let bytes = self.as_slice();
        // SAFETY: u16 has no invalid bit patterns; align_to only yields a middle part that is
        // correctly aligned and in bounds. x86-64 is little-endian, matching safetensors.
        let (head, middle, tail) = unsafe { bytes.align_to::<u16>() };
        (head.is_empty() && tail.is_empty()).then_some(middle)
    }
}

/// One tensor's place in the checkpoint.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    shard: usize,
    range: Range<usize>,
}

impl TensorInfo {
    pub fn byte_len(&self) -> usize {
        self.range.len()
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<dyn ByteOwner>,
}

/// All shards of a checkpoint, mapped, with an index of their tensors.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorInfo>,
    /// Tensors whose dtype this loader does not read (name, dtype as written).
    unsupported: HashMap<String, String>,
}

impl Checkpoint {
    /// Maps the shards named by `model.safetensors.index.json`, or the single `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        if !dir.is_dir() {
            return Err(ModelError::MissingDir(dir.to_owned()));
        }
        let index_path = dir.join("model.safetensors.index.json");
        let single_path = dir.join("model.safetensors");
        let shard_files: Vec<String> = if index_path.is_file() {
            read_index(&index_path)?
        } else if single_path.is_file() {
            vec!["model.safetensors".into()]
        } else {
            return Err(ModelError::NoWeights(dir.to_owned()));
        };

        let mut checkpoint = Checkpoint {
            dir: dir.to_owned(),
            shards: Vec::new(),
            tensors: HashMap::new(),
            unsupported: HashMap::new(),
        };
        for file in shard_files {
            checkpoint.map_shard(&file, &index_path)?;
        }
        Ok(checkpoint)
    }

    /// A checkpoint whose files (`model.safetensors.index.json`, shards) are held in memory, read
    /// by the same parsing as [`Checkpoint::open`]; `dir` only names the files in messages. For
    /// the fuzz targets, which cannot afford a directory per input.
    pub fn from_memory(dir: &Path, files: &HashMap<String, Vec<u8>>) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let shard_files: Vec<String> = match files.get("model.safetensors.index.json") {
            Some(bytes) => {
                let text = std::str::from_utf8(bytes).map_err(|error| ModelError::Io {
                    path: index_path.clone(),
                    source: std::io::Error::new(std::io::ErrorKind::InvalidData, error),
                })?;
                parse_index(text, &index_path)?
            }
            None if files.contains_key("model.safetensors") => vec!["model.safetensors".into()],
            None => return Err(ModelError::NoWeights(dir.to_owned())),
        };
        let mut checkpoint = Checkpoint {
            dir: dir.to_owned(),
            shards: Vec::new(),
            tensors: HashMap::new(),
            unsupported: HashMap::new(),
        };
        for file in shard_files {
            let path = dir.join(&file);
            let Some(bytes) = files.get(&file) else {
                return Err(ModelError::MissingShard {
                    index: index_path,
                    shard: path,
                });
            };
            checkpoint.add_shard(path, Arc::new(bytes.clone()))?;
        }
        Ok(checkpoint)
    }

    fn map_shard(&mut self, file: &str, index_path: &Path) -> Result<(), ModelError> {
        let path = self.dir.join(file);
        if path.is_dir() {
            return Err(ModelError::BadShard {
                path,
                message: format!(
                    "is a directory, but {} names it as a shard file",
                    index_path.display()
                ),
            });
        }
        if !path.is_file() {
            return Err(ModelError::MissingShard {
                index: index_path.to_owned(),
                shard: path,
            });
        }
        let map = WatchedMap::open(&path)?;
        self.add_shard(path, Arc::new(map))
    }

    /// Indexes the tensors of one shard's bytes (its file's mapping, or a buffer).
    fn add_shard(&mut self, path: PathBuf, map: Arc<dyn ByteOwner>) -> Result<(), ModelError> {
        let shard_index = self.shards.len();
        let bad = |message: String| ModelError::BadShard {
            path: path.clone(),
            message,
        };
        if map.bytes().len() < 8 {
            return Err(bad(format!(
                "the file is {} bytes; a safetensors file starts with an 8-byte header length",
                map.bytes().len()
            )));
        }
        let parsed = SafeTensors::deserialize(map.bytes());
        // A shard cut short while its header was read has read zeros: report that, not the
        // header those zeros make.
        crate::fault::check()?;
        let parsed = parsed.map_err(|e| bad(describe_safetensors_error(e)))?;
        let base = map.bytes().as_ptr() as usize;
        for (name, view) in parsed.tensors() {
            let data = view.data();
            let start = data.as_ptr() as usize - base;
            let Some(dtype) = Dtype::from_safetensors(view.dtype()) else {
                self.unsupported.insert(name, format!("{:?}", view.dtype()));
                continue;
            };
            if let Some(previous) = self.tensors.get(&name) {
                let first = &self.shards.get(previous.shard).map(|s| s.path.clone());
                return Err(bad(format!(
                    "tensor {name} is also in {}",
                    first
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                )));
            }
            self.tensors.insert(
                name,
                TensorInfo {
                    dtype,
                    shape: view.shape().to_vec(),
                    shard: shard_index,
                    range: start..start + data.len(),
                },
            );
        }
        drop(parsed);
        self.shards.push(Shard { path, map });
        Ok(())
    }

    /// A hash of every tensor's header entry (name, dtype, shape, shard, byte range): two
    /// checkpoints with the same fingerprint and config lay out the same tensors. Weight bytes
    /// are not read (that would take minutes for the 20b).
    pub fn fingerprint(&self) -> u64 {
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        for name in names {
            let info = &self.tensors[name];
            hasher.update(name.as_bytes());
            let entry = format!(
                "|{:?}|{:?}|{}|{:?};",
                info.dtype, info.shape, info.shard, info.range
            );
            hasher.update(entry.as_bytes());
        }
        for shard in &self.shards {
            hasher.update(&(shard.map.bytes().len() as u64).to_le_bytes());
        }
        hasher.digest()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Every tensor's (dtype, byte length), for `ossterm info`.
    pub fn tensor_sizes(&self) -> impl Iterator<Item = (Dtype, usize)> + '_ {
        self.tensors.values().map(|t| (t.dtype, t.range.len()))
    }

    /// The tensor `name`, which must have `shape` and one of `dtypes`.
    pub fn get(
        &self,
        name: &str,
        shape: &[usize],
        dtypes: &[Dtype],
    ) -> Result<(Dtype, TensorBytes), ModelError> {
        let Some(info) = self.tensors.get(name) else {
            if let Some(dtype) = self.unsupported.get(name) {
                return Err(ModelError::WrongDtype {
                    tensor: name.into(),
                    expected: dtype_list(dtypes),
                    found: dtype.clone(),
                });
            }
            return Err(ModelError::MissingTensor {
                tensor: name.into(),
                dir: self.dir.clone(),
            });
        };
        if !dtypes.contains(&info.dtype) {
            return Err(ModelError::WrongDtype {
                tensor: name.into(),
                expected: dtype_list(dtypes),
                found: info.dtype.name().into(),
            });
        }
        if info.shape != shape {
            return Err(ModelError::WrongShape {
                tensor: name.into(),
                expected: shape.to_vec(),
                found: info.shape.clone(),
            });
        }
        let shard = &self.shards[info.shard];
        Ok((
            info.dtype,
            TensorBytes::new(shard.map.clone(), info.range.clone()),
        ))
    }
}

/// What [`Checkpoint::scan_values`] found in one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueScan {
    pub bytes: usize,
    pub bad: Option<BadValues>,
}

/// Values that are not numbers: NaN or infinity, or (in MXFP4 scale tensors) the NaN scale 0xFF.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadValues {
    pub count: usize,
    /// Index of the first bad element.
    pub first: usize,
    pub nan_scales: bool,
}

impl std::fmt::Display for BadValues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.nan_scales {
            "scale bytes 0xFF (E8M0 NaN)"
        } else {
            "NaN or infinite values"
        };
        write!(
            f,
            "{} {what}, the first at element {}",
            self.count, self.first
        )
    }
}

impl Checkpoint {
    /// Reads every element of tensor `name` and counts those that are not numbers. MXFP4 scale
    /// tensors (U8, named `*_scales`) are checked for 0xFF; other U8 tensors hold FP4 codes,
    /// every value of which is valid.
    pub fn scan_values(&self, name: &str) -> Result<ValueScan, ModelError> {
        let Some(info) = self.tensors.get(name) else {
            return Err(ModelError::MissingTensor {
                tensor: name.into(),
                dir: self.dir.clone(),
            });
        };
        let bytes = &self.shards[info.shard].map.bytes()[info.range.clone()];
        let is_bad: fn(&[u8]) -> bool = match info.dtype {
            Dtype::Bf16 => |e| u16::from_le_bytes([e[0], e[1]]) & 0x7f80 == 0x7f80,
            Dtype::F16 => |e| u16::from_le_bytes([e[0], e[1]]) & 0x7c00 == 0x7c00,
            Dtype::F32 => |e| !f32::from_le_bytes([e[0], e[1], e[2], e[3]]).is_finite(),
            Dtype::U8 if name.ends_with("_scales") => |e| e[0] == 0xff,
            Dtype::U8 => |_| false,
        };
        Ok(scan_units(
            bytes,
            info.dtype.size(),
            1,
            info.dtype == Dtype::U8,
            is_bad,
        ))
    }
}

/// Counts the `width`-byte units of `bytes` for which `is_bad` holds, each standing for
/// `elements` values (a quantized block), for [`ValueScan`]. Pieces of 64k units are counted in
/// parallel on the current pool: the largest tensors are a gigabyte.
pub(crate) fn scan_units(
    bytes: &[u8],
    width: usize,
    elements: usize,
    nan_scales: bool,
    is_bad: fn(&[u8]) -> bool,
) -> ValueScan {
    use rayon::prelude::*;
    const PIECE: usize = 1 << 16;
    let (count, first) = bytes
        .par_chunks(PIECE * width)
        .enumerate()
        .map(|(piece, part)| {
            let mut count = 0usize;
            let mut first = usize::MAX;
            for (i, unit) in part.chunks_exact(width).enumerate() {
                if is_bad(unit) {
                    count += 1;
                    first = first.min(piece * PIECE + i);
                }
            }
            (count, first)
        })
        .reduce(|| (0, usize::MAX), |a, b| (a.0 + b.0, a.1.min(b.1)));
    ValueScan {
        bytes: bytes.len(),
        bad: (count > 0).then_some(BadValues {
            count,
            first: first * elements,
            nan_scales,
        }),
    }
}

fn dtype_list(dtypes: &[Dtype]) -> String {
    dtypes
        .iter()
        .map(|d| d.name())
        .collect::<Vec<_>>()
        .join(" or ")
}

fn read_index(path: &Path) -> Result<Vec<String>, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_index(&text, path)
}

/// The shard file names of an index's `weight_map`, sorted, each once; `path` names the index in
/// messages.
fn parse_index(text: &str, path: &Path) -> Result<Vec<String>, ModelError> {
    let bad = |message: String| ModelError::BadIndex {
        path: path.to_owned(),
        message,
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("the shard of {tensor} is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(bad(format!(
                "shard name {file:?} of {tensor} is not a plain file name"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_owned());
        }
    }
    if files.is_empty() {
        return Err(bad("\"weight_map\" is empty".into()));
    }
    files.sort();
    Ok(files)
}

fn describe_safetensors_error(err: safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match err {
        E::HeaderTooLarge => "the header length is larger than the format allows".into(),
        E::HeaderTooSmall => "the file is too small to hold its header".into(),
        E::InvalidHeaderLength => {
            "the header length points past the end of the file (truncated file?)".into()
        }
        E::MetadataIncompleteBuffer => {
            "the tensor data is shorter than the header says (truncated file?)".into()
        }
        E::InvalidOffset(name) => format!(
            "the data offsets of tensor {name} are out of order or past the end of the file"
        ),
        E::TensorInvalidInfo => "a tensor's shape and dtype do not match its byte length".into(),
        other => format!("not a valid safetensors file: {other}"),
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The `VmFlags` line of the mapping that starts at `start`, from `/proc/self/smaps`.
    fn vm_flags_of(start: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((from, to)) = range.split_once('-') {
                if let (Ok(from), Ok(to)) = (
                    usize::from_str_radix(from, 16),
                    usize::from_str_radix(to, 16),
                ) {
                    inside = from <= start && start < to;
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.trim().to_owned());
                }
            }
        }
        None
    }

    #[test]
    fn file_mappings_ask_for_huge_pages() {
        // A kernel without transparent huge pages refuses the advice: nothing to check there.
        if !Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("weights.bin");
        std::fs::write(&path, vec![7u8; 4 << 20]).unwrap();
        let map = WatchedMap::open(&path).unwrap();
        assert_eq!(map.bytes()[12345], 7);
        // The advice covers the whole 2 MiB pages inside the mapping (4 MiB holds at least one).
        let first_huge_page = (map.bytes().as_ptr() as usize).div_ceil(2 << 20) * (2 << 20);
        let flags = vm_flags_of(first_huge_page).expect("the mapping is listed");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "no huge-page advice on the mapping: {flags}"
        );
    }
}
