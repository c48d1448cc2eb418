//! Surviving a checkpoint file that changes on disk while it is mapped.
//!
//! The weights are read straight out of `mmap`ed shards. If another program truncates a shard
//! while it is mapped, the next read of a page past the new end raises SIGBUS, whose default
//! action kills the process at once: no message, the terminal left raw, unsaved output lost.
//!
//! Every checkpoint mapping is registered here ([`register`]). A SIGBUS handler checks whether
//! the faulting address lies inside a registered mapping; if so it maps an anonymous zero page
//! over the faulting page, marks the mapping as faulted and returns, so the interrupted
//! computation finishes on zeros. The generation loops ask [`check`] after every forward step
//! and turn a faulted mapping into [`MappingChanged`], an ordinary error that names the file.
//! A SIGBUS anywhere else goes to the handler that was installed before (the standard library's
//! stack-overflow reporter) or to the default action.
//!
//! The handler may only touch memory that is safe to read in a signal handler: the table of
//! mapped ranges is a fixed array of atomics; paths live beside it behind a mutex that only
//! ordinary code takes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, Once};

/// Mappings that can be watched at once (a checkpoint has a few shards; a reload holds two
/// checkpoints for a moment). A mapping beyond this is not watched, and a fault in it is fatal
/// as before.
const SLOTS: usize = 64;

struct Slot {
    /// Start address; written before `len` and read after it.
    start: AtomicUsize,
    /// 0 when the slot is free.
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE_SLOT: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};

static TABLE: [Slot; SLOTS] = [FREE_SLOT; SLOTS];
/// The file of each slot in use and its identity when mapped; only ordinary code touches it.
static PATHS: Mutex<[Option<WatchedFile>; SLOTS]> = Mutex::new([const { None }; SLOTS]);

struct WatchedFile {
    path: PathBuf,
    /// `None` when the file could not be examined; then only faults are noticed.
    mapped: Option<FileStamp>,
}
/// Faults handled since start; lets [`check`] return at once in the normal case.
static FAULTS: AtomicUsize = AtomicUsize::new(0);
static PAGE_SIZE: AtomicUsize = AtomicUsize::new(4096);
/// The SIGBUS action before ours, leaked so the handler can read it at any time.
static PREVIOUS: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
static INSTALL: Once = Once::new();

/// A mapped file changed on disk (it was truncated or overwritten) while the model used it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{} changed on disk while in use (truncated or overwritten by another program); \
     the weights read from it are no longer valid: load the model again",
    path.display()
)]
pub struct MappingChanged {
    pub path: PathBuf,
}

/// Which file a path names and how it was when mapped. The same inode with another size or
/// modification time was overwritten in place (the mapping now shows a mix of old and new
/// bytes); another inode means the path was replaced by a rename, and the mapping still holds
/// the old file whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    device: u64,
    inode: u64,
    len: u64,
    modified: (i64, i64),
}

impl FileStamp {
    fn of(path: &Path) -> Option<FileStamp> {
        Self::of_metadata(&std::fs::metadata(path).ok()?)
    }

    fn of_metadata(meta: &std::fs::Metadata) -> Option<FileStamp> {
        use std::os::unix::fs::MetadataExt;
        Some(FileStamp {
            device: meta.dev(),
            inode: meta.ino(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
        })
    }
}

/// Keeps a mapping watched until dropped. Drop it before unmapping the memory.
#[derive(Debug)]
pub struct Registration {
    slot: Option<usize>,
}

/// Watches `len` bytes at `start`, a read-only mapping of `file`, opened from `path`. Installs the
/// SIGBUS handler on first use. With every slot taken the mapping is simply not watched. The
/// file's identity (device, inode, length, modification time) is taken from the open handle, so
/// it is the file that was mapped even if the path was replaced in between; [`verify_files`]
/// compares the path against it.
pub fn register(start: *const u8, len: usize, path: &Path, file: &std::fs::File) -> Registration {
    INSTALL.call_once(install_handler);
    if len == 0 {
        return Registration { slot: None };
    }
    let mut paths = PATHS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let Some(slot) = paths.iter().position(Option::is_none) else {
        return Registration { slot: None };
    };
    paths[slot] = Some(WatchedFile {
        path: path.to_owned(),
        mapped: file
            .metadata()
            .ok()
            .and_then(|meta| FileStamp::of_metadata(&meta)),
    });
    let entry = &TABLE[slot];
    entry.faulted.store(false, Ordering::Release);
    entry.start.store(start as usize, Ordering::Release);
    entry.len.store(len, Ordering::Release);
    Registration { slot: Some(slot) }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(slot) = self.slot else { return };
        let mut paths = PATHS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let entry = &TABLE[slot];
        entry.len.store(0, Ordering::Release);
        entry.start.store(0, Ordering::Release);
        entry.faulted.store(false, Ordering::Release);
        paths[slot] = None;
    }
}

/// The first watched mapping that faulted, if any: its weights now read partly as zeros.
/// Cheap (one atomic load) while nothing has faulted, so loops may ask after every token.
pub fn check() -> Result<(), MappingChanged> {
    if FAULTS.load(Ordering::Acquire) == 0 {
        return Ok(());
    }
    let paths = PATHS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for (slot, entry) in TABLE.iter().enumerate() {
        if entry.faulted.load(Ordering::Acquire) {
            if let Some(watched) = &paths[slot] {
                return Err(MappingChanged {
                    path: watched.path.clone(),
                });
            }
        }
    }
    Ok(())
}

/// [`check`], and also asks the file system whether a watched file was overwritten in place
/// since it was mapped (a write that keeps the file's length faults nowhere, but the weights
/// change under the model). One `stat` per shard: for the start and end of a generation, not
/// for every token. A file found changed stays reported, like a fault.
pub fn verify_files() -> Result<(), MappingChanged> {
    check()?;
    let paths = PATHS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    for (slot, entry) in paths.iter().enumerate() {
        let Some(WatchedFile {
            path,
            mapped: Some(mapped),
        }) = entry
        else {
            continue;
        };
        // A file removed or renamed away leaves the mapping with the old file, whole.
        let Some(now) = FileStamp::of(path) else {
            continue;
        };
        if (now.device, now.inode) == (mapped.device, mapped.inode) && now != *mapped {
            TABLE[slot].faulted.store(true, Ordering::Release);
            FAULTS.fetch_add(1, Ordering::AcqRel);
            return Err(MappingChanged { path: path.clone() });
        }
    }
    Ok(())
}

fn install_handler() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if page > 0 {
        PAGE_SIZE.store(page as usize, Ordering::Relaxed);
    }
    // SAFETY: both sigaction structs are fully initialised (zeroed, then the fields we use set);
    // the handler only does async-signal-safe work (atomics, mmap, sigaction).
    unsafe {
        let mut previous: libc::sigaction = std::mem::zeroed();
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        // SA_ONSTACK: a fault can hit a thread near its stack's end; Rust gives each thread an
        // alternate signal stack for exactly that.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGBUS, &action, &mut previous) == 0 {
            PREVIOUS.store(Box::into_raw(Box::new(previous)), Ordering::Release);
        }
    }
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for a handler installed with SA_SIGINFO.
    let address = unsafe { (*info).si_addr() } as usize;
    if let Some(slot) = watched_slot(address) {
        let page = PAGE_SIZE.load(Ordering::Relaxed);
        let page_start = address & !(page - 1);
        // SAFETY: the page lies inside a registered read-only mapping that the process owns and
        // that is still mapped (registrations end before their unmapping). Replacing it with a
        // zero page changes what the weights read, which `check` then reports; no other memory
        // is touched. mmap is a plain system call, safe in a signal handler.
        let mapped = unsafe {
            libc::mmap(
                page_start as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            TABLE[slot].faulted.store(true, Ordering::Release);
            FAULTS.fetch_add(1, Ordering::AcqRel);
            return;
        }
    }
    pass_on(signal, info, context);
}

fn watched_slot(address: usize) -> Option<usize> {
    TABLE.iter().position(|entry| {
        let len = entry.len.load(Ordering::Acquire);
        let start = entry.start.load(Ordering::Acquire);
        len != 0 && address >= start && address - start < len
    })
}

/// Hands a SIGBUS that is not ours to the action installed before, or restores the default
/// action so the faulting instruction, run again on return, ends the process as it would have.
fn pass_on(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.load(Ordering::Acquire);
    // SAFETY: PREVIOUS is null or a leaked, never-freed sigaction. A handler address taken from
    // it was installed for this signal with the calling convention its flags say.
    unsafe {
        if !previous.is_null() {
            let previous = &*previous;
            let handler = previous.sa_sigaction;
            if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
                if previous.sa_flags & libc::SA_SIGINFO != 0 {
                    let handler: extern "C" fn(
                        libc::c_int,
                        *mut libc::siginfo_t,
                        *mut libc::c_void,
                    ) = std::mem::transmute(handler);
                    handler(signal, info, context);
                } else {
                    let handler: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
                    handler(signal);
                }
                return;
            }
        }
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut default.sa_mask);
        libc::sigaction(signal, &default, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The table is global: tests that fault or look for faults take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn a_fault_inside_a_watched_mapping_reads_zeros_and_is_reported() {
        let _serial = serial();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.bin");
        let page = 4096;
        std::fs::write(&path, vec![7u8; 4 * page]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test owns the file; the truncation below is the point.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let registration = register(map.as_ptr(), map.len(), &path, &file);
        assert_eq!(check(), Ok(()));
        assert_eq!(map[3 * page], 7);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(page as u64)
            .unwrap();
        // SAFETY: volatile, so the read really happens; it faults and the handler maps zeros.
        let value = unsafe { std::ptr::read_volatile(map.as_ptr().add(3 * page)) };
        assert_eq!(value, 0);
        let error = check().unwrap_err();
        assert_eq!(error.path, path);
        assert!(error.to_string().contains("changed on disk while in use"));
        drop(registration);
        assert_eq!(check(), Ok(()));
    }

    #[test]
    fn a_file_overwritten_in_place_is_reported_and_one_replaced_by_rename_is_not() {
        let _serial = serial();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.bin");
        std::fs::write(&path, vec![1u8; 8192]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test owns the file and only rewrites it while it is mapped read-only.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let registration = register(map.as_ptr(), map.len(), &path, &file);

        // Replaced by a rename: a new inode at the path, the mapping keeps the old file.
        let fresh = dir.path().join("fresh.bin");
        std::fs::write(&fresh, vec![2u8; 8192]).unwrap();
        std::fs::rename(&fresh, &path).unwrap();
        assert_eq!(verify_files(), Ok(()));
        drop(registration);
        drop(map);

        // Overwritten in place, same length: no fault, but the bytes changed under the mapping.
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: as above.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let _registration = register(map.as_ptr(), map.len(), &path, &file);
        assert_eq!(verify_files(), Ok(()));
        let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        std::io::Write::write_all(&mut &writer, &[3u8; 100]).unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        writer.set_modified(later).unwrap();
        let error = verify_files().unwrap_err();
        assert_eq!(error.path, path);
        // It stays reported: the weights already read are a mix.
        assert_eq!(check().unwrap_err().path, path);
    }
}
