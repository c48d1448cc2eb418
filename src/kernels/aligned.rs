//! A growable buffer whose storage starts on a 64-byte boundary.
//!
//! Every group the kernels read (128 int8 values, 64 nibble bytes, 16 lanes of f32 or i32) is a
//! whole number of 64-byte lines, so with an aligned start each 512-bit load touches one cache
//! line. A plain `Vec` from the allocator starts 16 bytes past a line for large sizes, which
//! splits every such load in two and measured about half the load throughput.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// One cache line of storage; only its alignment and size matter.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

const LINE: usize = std::mem::size_of::<Line>();

/// Element types the buffer may hold: plain numbers for which every bit pattern (including all
/// zeros) is a valid value, and whose size divides a line.
///
/// # Safety
/// Implementors must be `Copy`, valid for every bit pattern, without padding, and have an
/// alignment of at most 64.
pub(crate) unsafe trait Plain: Copy + Default + 'static {}

// SAFETY: integers and floats are valid for every bit pattern and have no padding.
unsafe impl Plain for u8 {}
// SAFETY: as above.
unsafe impl Plain for u16 {}
// SAFETY: as above.
unsafe impl Plain for i8 {}
// SAFETY: as above.
unsafe impl Plain for i32 {}
// SAFETY: as above.
unsafe impl Plain for u32 {}
// SAFETY: as above.
unsafe impl Plain for f32 {}
// SAFETY: `half::f16` is a `repr(transparent)` u16, valid for every bit pattern.
unsafe impl Plain for half::f16 {}

/// A `Vec<T>`-like buffer aligned to 64 bytes. Dereferences to `[T]`.
#[derive(Clone, Default)]
pub(crate) struct AlignedVec<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _element: std::marker::PhantomData<T>,
}

impl<T: Plain> AlignedVec<T> {
    fn lines_for(len: usize) -> usize {
        (len * std::mem::size_of::<T>()).div_ceil(LINE)
    }

    /// An empty buffer with room for `capacity` elements.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        let lines = Vec::with_capacity(Self::lines_for(capacity));
        advise_huge_pages(&lines);
        Self {
            lines,
            len: 0,
            _element: std::marker::PhantomData,
        }
    }

    /// `len` copies of `value`.
    pub(crate) fn filled(len: usize, value: T) -> Self {
        let mut v = Self::with_capacity(len);
        v.resize(len, value);
        v
    }

    /// A copy of `values`.
    pub(crate) fn from_slice(values: &[T]) -> Self {
        let mut v = Self::filled(values.len(), T::default());
        v.copy_from_slice(values);
        v
    }

    /// Grow or shrink to `len` elements; new elements are `value`. Reallocates only when the
    /// capacity is too small, like `Vec::resize`.
    pub(crate) fn resize(&mut self, len: usize, value: T) {
        let old = self.len;
        let lines = Self::lines_for(len);
        if lines > self.lines.capacity() {
            // Grow first (untouched), so the new storage can be advised before it is written.
            self.lines.reserve_exact(lines - self.lines.len());
            advise_huge_pages(&self.lines);
        }
        self.lines.resize(lines, Line([0; LINE]));
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }
}

/// Transparent huge pages: the size of one, and the least allocation worth advising.
const HUGE_PAGE: usize = 2 << 20;

/// Bytes [`collapse_into_huge_pages`] asks for in one call.
const COLLAPSE_STEP: usize = 32 << 20;

/// Asks Linux to back the whole 2 MiB pages inside a large buffer's storage with transparent
/// huge pages (`MADV_HUGEPAGE`; distributions often default THP to "madvise", where only advised
/// ranges get them). The quantized weights live in these buffers and the GEMVs stream them once
/// per token: with 4 KiB pages every 4 KiB costs a TLB miss and stops the hardware prefetchers,
/// which do not cross pages. On a Zen 4 guest a plain 512-bit read loop over 4 KiB pages read 45
/// GB/s on two threads against 61 over huge pages. Advice only: the contents do not change, and a
/// kernel without THP ignores it.
fn advise_huge_pages(lines: &Vec<Line>) {
    let bytes = lines.capacity() * LINE;
    if bytes < 2 * HUGE_PAGE {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        let start = lines.as_ptr() as usize;
        let first = start.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let end = (start + bytes) / HUGE_PAGE * HUGE_PAGE;
        if end > first {
            // SAFETY: the range lies inside this buffer's own allocation and is page aligned;
            // MADV_HUGEPAGE changes only how the kernel backs those pages, never their contents
            // or their mapping's lifetime. A failure (no THP in this kernel) is harmless.
            unsafe {
                libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
            }
        }
    }
}

impl<T: Plain> AlignedVec<T> {
    /// See [`collapse_into_huge_pages`]: for a buffer whose contents are written and will be
    /// read for the process's lifetime (weights).
    pub(crate) fn collapse_huge_pages(&self) {
        let bytes = self.lines.len() * LINE;
        // SAFETY: the lines are initialized plain bytes.
        collapse_into_huge_pages(unsafe {
            std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), bytes)
        });
    }
}

/// Asks Linux to move the whole 2 MiB pages inside `buffer` onto transparent huge pages now
/// (`MADV_COLLAPSE`, Linux 6.1 and later), after they were written.
///
/// Why: `MADV_HUGEPAGE` only asks for huge pages when a page is first touched, and a machine
/// whose memory is full of page cache (the checkpoint just read, earlier models) often has no free
/// 2 MiB page then, so the fault falls back to 4 KiB pages for good. On the Zen 4 guest a loaded
/// 20b held its unembedding 12% in huge pages and half the later layers' experts in 4 KiB
/// pages, and its dense products streamed about a quarter slower per byte than the experts that
/// had them. A collapse may reclaim and compact to find the pages (a second or two of load at
/// most); where it cannot, or the kernel is older, the pages stay as they were: same contents,
/// only the backing changes.
pub(crate) fn collapse_into_huge_pages(buffer: &[u8]) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let start = buffer.as_ptr() as usize;
        let first = start.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let end = (start + buffer.len()) / HUGE_PAGE * HUGE_PAGE;
        // In steps: the kernel gives up on a whole call at the first huge page it cannot get,
        // and a step that fails leaves the next ones a chance once reclaim has caught up.
        let mut at = first;
        while at < end {
            let step = (end - at).min(COLLAPSE_STEP);
            // SAFETY: the range lies inside `buffer`'s allocation and is page aligned;
            // MADV_COLLAPSE changes only which physical pages back it, never its contents or
            // its mapping's lifetime. A failure (older kernel, no memory) is harmless.
            unsafe {
                libc::madvise(at as *mut libc::c_void, step, libc::MADV_COLLAPSE);
            }
            at += step;
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = buffer;
}

impl<T: Plain> Deref for AlignedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len * size_of::<T>()` initialized bytes (lines are
        // zero-initialized, then written as T), every bit pattern is a valid T (`Plain`), and the
        // start is 64-byte aligned, which satisfies T's alignment (at most 64 by `Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for AlignedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; the exclusive borrow of `self` makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain + fmt::Debug> fmt::Debug for AlignedVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_aligned_and_resize_keeps_values() {
        let mut v = AlignedVec::<i8>::with_capacity(1000);
        let start = v.as_ptr();
        v.resize(100, 3);
        assert_eq!(v.as_ptr() as usize % 64, 0);
        assert!(v.iter().all(|&x| x == 3));
        v[99] = -1;
        v.resize(300, 7);
        assert_eq!((v[98], v[99], v[100], v[299]), (3, -1, 7, 7));
        v.resize(10, 0);
        assert_eq!(v.len(), 10);
        assert_eq!(v.as_ptr(), start, "no reallocation within the capacity");
        let f = AlignedVec::<f32>::from_slice(&[1.0, 2.5, -3.0]);
        assert_eq!(&f[..], &[1.0, 2.5, -3.0]);
        assert_eq!(f.as_ptr() as usize % 64, 0);
    }

    #[test]
    fn collapsing_into_huge_pages_keeps_every_value() {
        // Below one huge page, across a few (with partial pages at both ends), and a slice that
        // starts inside a page.
        for len in [1000, (5 << 20) + 12_345] {
            let mut v = AlignedVec::<i8>::with_capacity(len);
            v.resize(len, 0);
            for (i, x) in v.iter_mut().enumerate() {
                *x = (i * 31 % 251) as i8;
            }
            v.collapse_huge_pages();
            collapse_into_huge_pages(&bytes_of(&v)[3..]);
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, &x)| x == (i * 31 % 251) as i8));
        }
    }

    fn bytes_of(v: &AlignedVec<i8>) -> &[u8] {
        // SAFETY: i8 and u8 have the same size and every bit pattern is valid for both.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len()) }
    }
}
