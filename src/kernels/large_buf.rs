//! Long-lived buffers that the kernels stream (repacked weights, the K/V cache), placed where
//! the OS can back them with 2 MB pages.
//!
//! A decode step reads every weight byte once; on 4 KB pages that is a new TLB entry every
//! 64 cache lines, and the cache's blocks of one head lie a few KB apart. Linux backs anonymous
//! memory with transparent huge pages only inside regions marked `MADV_HUGEPAGE` (under the
//! common `madvise` setting) and only for whole, aligned 2 MB extents, so a buffer alone
//! would get none unless it spans several megabytes: SmolLM2's matrices are 0.2–1 MB each.
//! Buffers are therefore carved, in order, out of shared 64 MB regions mapped 2 MB-aligned
//! and marked so; a buffer of a quarter region or more gets a region of its own. A region
//! returns to the OS when the last buffer carved from it is dropped; carved space is never
//! reused meanwhile (these buffers live as long as a model or a cache), but the memory of a
//! dropped buffer's whole pages goes back at once. Where mapping fails, or off Linux, a buffer
//! is an ordinary zeroed heap allocation. [`coverage`] tells how much of the regions the OS
//! actually backs with 2 MB pages.
//!
//! Fresh mappings are zero-filled, so a buffer starts zeroed at no cost; untouched pages hold
//! no memory, so a region's unused tail costs address space only.

use std::alloc::Layout;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// The page size transparent huge pages use on x86-64 (and the region alignment).
const HUGE_PAGE: usize = 2 << 20;
/// Bytes of address space per shared region.
const REGION: usize = 64 << 20;
/// The small page size.
const PAGE: usize = 4096;
/// Buffers smaller than this come from the heap: they span no huge page worth the bookkeeping.
const MIN_CARVED: usize = 64 << 10;

/// A fixed-length, zero-initialised array of `T` (see the module documentation).
pub struct LargeBuf<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    /// What keeps the memory alive: a region (shared with other buffers) or a heap block.
    owner: Owner,
}

enum Owner {
    Region(Arc<Region>),
    Heap(Layout),
    Empty,
}

// SAFETY: a `LargeBuf` owns its elements exclusively, like a `Box<[T]>`; the shared region
// only keeps the mapping alive and is never read or written through.
unsafe impl<T: Copy + Send> Send for LargeBuf<T> {}
// SAFETY: as for `Send`: shared references give shared access to the elements only.
unsafe impl<T: Copy + Sync> Sync for LargeBuf<T> {}

impl<T: Copy> LargeBuf<T> {
    /// `len` elements, every byte zero.
    ///
    /// # Safety
    /// All-zero bytes must be a valid `T` (plain integers, floats, `f16`, and arrays and
    /// `repr(C)` structs of them).
    pub unsafe fn zeroed(len: usize) -> Self {
        let layout = Layout::array::<T>(len).expect("buffer size overflows");
        if layout.size() == 0 {
            return Self {
                ptr: NonNull::dangling(),
                len,
                owner: Owner::Empty,
            };
        }
        if layout.size() >= MIN_CARVED {
            if let Some((region, ptr)) = carve(layout) {
                return Self {
                    ptr: ptr.cast(),
                    len,
                    owner: Owner::Region(region),
                };
            }
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self {
            ptr: ptr.cast(),
            len,
            owner: Owner::Heap(layout),
        }
    }

    /// Whether the buffer lies in a region marked for huge pages (whether the OS actually
    /// backs it with them depends on its settings and free memory).
    pub fn in_huge_page_region(&self) -> bool {
        match &self.owner {
            Owner::Region(region) => region.len >= HUGE_PAGE,
            Owner::Heap(_) | Owner::Empty => false,
        }
    }
}

impl<T: Copy> Drop for LargeBuf<T> {
    fn drop(&mut self) {
        match &self.owner {
            // SAFETY: allocated in `zeroed` with this layout.
            Owner::Heap(layout) => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr().cast(), *layout)
            },
            // The region unmaps itself when its last buffer's `Arc` goes; until then the
            // memory of the whole pages this buffer alone covered goes back to the OS now.
            Owner::Region(_) => {
                let start = (self.ptr.as_ptr() as usize).next_multiple_of(PAGE);
                let end = (self.ptr.as_ptr() as usize + self.len * std::mem::size_of::<T>()) / PAGE
                    * PAGE;
                #[cfg(target_os = "linux")]
                if end > start {
                    // SAFETY: `start..end` lies inside this buffer, which no one uses any more
                    // and whose space is never carved again.
                    unsafe {
                        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED)
                    };
                }
                let _ = (start, end);
            }
            Owner::Empty => {}
        }
    }
}

impl<T: Copy> Deref for LargeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialised elements owned by this buffer (or is
        // dangling with nothing to read).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for LargeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// A mapping of `len` bytes at a 2 MB-aligned `start`, unmapped on drop.
struct Region {
    start: NonNull<u8>,
    len: usize,
}

// SAFETY: the region is only an owner of address space; no access goes through it.
unsafe impl Send for Region {}
// SAFETY: as for `Send`.
unsafe impl Sync for Region {}

/// Address ranges of the live regions, for [`coverage`].
static LIVE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

impl Drop for Region {
    fn drop(&mut self) {
        let start = self.start.as_ptr() as usize;
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|&(s, _)| s != start);
        drop(live);
        #[cfg(target_os = "linux")]
        // SAFETY: `start..start + len` is a mapping this region made and owns alone; every
        // buffer carved from it is gone (each held an `Arc` of the region).
        unsafe {
            libc::munmap(self.start.as_ptr().cast(), self.len);
        }
    }
}

/// The region buffers are carved from now and the offset of its free space. Held weakly: a
/// region whose buffers are all dropped is unmapped, and the next buffer starts a new one.
static CURRENT: Mutex<(Weak<Region>, usize)> = Mutex::new((Weak::new(), 0));

/// Space for `layout` in a huge-page region: a shared one, or its own for a large buffer.
fn carve(layout: Layout) -> Option<(Arc<Region>, NonNull<u8>)> {
    let size = layout.size();
    if size >= REGION / 4 {
        let region = Arc::new(Region::map(size.next_multiple_of(HUGE_PAGE))?);
        let start = region.start;
        return Some((region, start));
    }
    let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
    let fits = |region: &Region, used: usize| {
        let at = used.next_multiple_of(layout.align());
        (at + size <= region.len).then_some(at)
    };
    let (region, at) = match current.0.upgrade() {
        Some(region) if fits(&region, current.1).is_some() => {
            let at = fits(&region, current.1)?;
            (region, at)
        }
        _ => {
            let region = Arc::new(Region::map(REGION)?);
            *current = (Arc::downgrade(&region), 0);
            (region, 0)
        }
    };
    current.1 = at + size;
    // SAFETY: `at + size` lies inside the region (checked by `fits`, or a fresh region of
    // `REGION > size` bytes).
    let ptr = unsafe { NonNull::new_unchecked(region.start.as_ptr().add(at)) };
    Some((region, ptr))
}

impl Region {
    /// Maps `len` bytes (a multiple of [`HUGE_PAGE`]) at a 2 MB boundary and marks them for
    /// huge pages; `None` where that is not possible.
    #[cfg(target_os = "linux")]
    fn map(len: usize) -> Option<Self> {
        let padded = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                padded,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as usize;
        let start = raw.next_multiple_of(HUGE_PAGE);
        // SAFETY: both trimmed ranges lie inside the mapping just made and hold nothing; what
        // stays is `start..start + len`, inside it too.
        unsafe {
            if start > raw {
                libc::munmap(raw as *mut libc::c_void, start - raw);
            }
            let tail = raw + padded - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: a kernel without transparent huge pages refuses it, and the
            // region still works on small pages.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, len));
        Some(Self {
            start: NonNull::new(start as *mut u8)?,
            len,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn map(_len: usize) -> Option<Self> {
        None
    }
}

/// How much of the huge-page regions the OS backs with 2 MB pages now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    /// Bytes of address space in live regions (touched or not).
    pub region_bytes: usize,
    /// Bytes of them on 2 MB pages (`AnonHugePages` of their mappings).
    pub huge_bytes: usize,
}

/// The live regions' [`Coverage`], from `/proc/self/smaps`; `None` where that cannot be read
/// (off Linux, say).
pub fn coverage() -> Option<Coverage> {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(Coverage {
        region_bytes: live.iter().map(|r| r.1).sum(),
        huge_bytes: huge_bytes_in(&smaps, &live),
    })
}

/// The `AnonHugePages` of the mappings in `smaps` that overlap one of `ranges` (start, length).
/// A region is a mapping of its own, or merged with an adjacent region (same flags), so a
/// mapping that overlaps one holds regions only.
fn huge_bytes_in(smaps: &str, ranges: &[(usize, usize)]) -> usize {
    let mut total = 0;
    let mut overlaps = false;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                overlaps = ranges.iter().any(|&(s, l)| s < hi && lo < s + l);
                continue;
            }
        }
        if overlaps && first == "AnonHugePages:" {
            total += words
                .next()
                .and_then(|kb| kb.parse::<usize>().ok())
                .unwrap_or(0)
                << 10;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_zeroed_and_keep_their_own_elements() {
        // SAFETY: zero is a valid u32 and f32.
        let mut small = unsafe { LargeBuf::<u32>::zeroed(10) };
        let mut a = unsafe { LargeBuf::<u32>::zeroed(100_000) };
        let mut b = unsafe { LargeBuf::<f32>::zeroed(70_000) };
        let empty = unsafe { LargeBuf::<u64>::zeroed(0) };
        assert!(empty.is_empty());
        assert!(!small.in_huge_page_region());
        for buf in [&small[..], &a[..]] {
            assert!(buf.iter().all(|&x| x == 0));
        }
        assert!(b.iter().all(|&x| x == 0.0));
        small
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as u32);
        a.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = 3 * i as u32);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
        // Buffers carved one after another do not overlap.
        assert!(a.iter().enumerate().all(|(i, &x)| x == 3 * i as u32));
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
        assert!(small.iter().enumerate().all(|(i, &x)| x == i as u32));
        let addr = |p: *const u8| p as usize;
        let (a0, a1) = (addr(a.as_ptr().cast()), addr(a.as_ptr_range().end.cast()));
        let (b0, b1) = (addr(b.as_ptr().cast()), addr(b.as_ptr_range().end.cast()));
        assert!(a1 <= b0 || b1 <= a0);
        assert_eq!(b0 % std::mem::align_of::<f32>(), 0);
        // Dropping one returns its whole pages only: a neighbour sharing a page keeps its data.
        drop(a);
        assert!(b.iter().enumerate().all(|(i, &x)| x == i as f32));
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn large_buffers_take_aligned_regions_of_their_own_unmapped_with_them() {
        // SAFETY: zero is a valid u8.
        let mut big = unsafe { LargeBuf::<u8>::zeroed(REGION / 2 + 1) };
        assert!(big.in_huge_page_region());
        assert_eq!(big.as_ptr() as usize % HUGE_PAGE, 0);
        big[REGION / 2] = 7;
        let region = match &big.owner {
            Owner::Region(r) => Arc::downgrade(r),
            _ => unreachable!(),
        };
        assert_eq!(region.strong_count(), 1);
        drop(big);
        assert!(region.upgrade().is_none());
        // SAFETY: as above.
        let carved = unsafe { LargeBuf::<u8>::zeroed(MIN_CARVED) };
        assert!(carved.in_huge_page_region());
        assert!(carved.iter().all(|&x| x == 0));
        let seen = coverage().unwrap();
        assert!(seen.region_bytes >= REGION && seen.huge_bytes <= seen.region_bytes);
    }

    #[test]
    fn huge_page_bytes_are_summed_over_the_mappings_that_overlap_a_region() {
        let smaps = "\
200000-600000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
600000-700000 rw-p 00000000 00:00 0
AnonHugePages:      1024 kB
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 [heap]
AnonHugePages:      4096 kB
";
        assert_eq!(huge_bytes_in(smaps, &[(0x400000, 0x200000)]), 2 << 20);
        assert_eq!(
            huge_bytes_in(smaps, &[(0x200000, 0x400000), (0x600000, 0x100000)]),
            3 << 20
        );
        assert_eq!(huge_bytes_in(smaps, &[(0x800000, 0x200000)]), 0);
    }
}
