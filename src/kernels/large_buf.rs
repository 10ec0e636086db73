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
//! dropped buffer's whole pages goes back at once. Where mapping fails, or off x86-64 Linux, a
//! buffer is an ordinary zeroed heap allocation. [`coverage`] tells how much of the regions the OS
//! actually backs with 2 MB pages.
//!
//! Fresh mappings are zero-filled, so a buffer starts zeroed at no cost. Untouched 2 MB
//! extents hold no memory; a touched one is backed whole, and the kernel's background
//! collapsing may back partly used ones too. A released part of a 2 MB page splits it, and the
//! memory comes back when the kernel reclaims it. Regions exist on x86-64 Linux only (4 KB base
//! pages, 2 MB huge ones). The module knows nothing of what the buffers hold.

use std::alloc::Layout;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// The page size transparent huge pages use on x86-64 (and the region alignment).
const HUGE_PAGE: usize = 2 << 20;
/// Whether this target maps regions at all: the sizes here are x86-64's (elsewhere a base page
/// may be 16 or 64 KB, and releasing "whole pages" would reach into a neighbour).
const REGIONS: bool = cfg!(all(target_os = "linux", target_arch = "x86_64"));
/// Bytes of address space per shared region.
const REGION: usize = 64 << 20;
/// The base page size on x86-64.
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
        if REGIONS && layout.size() >= MIN_CARVED {
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

    /// `len` elements, element `i` being `f(i)`: every page written (committed) here.
    pub fn from_fn(len: usize, mut f: impl FnMut(usize) -> T) -> Self {
        let mut buf = LargeBuf::<std::mem::MaybeUninit<T>>::uninit(len);
        for (i, slot) in buf.iter_mut().enumerate() {
            slot.write(f(i));
        }
        // SAFETY: every element was written just above.
        unsafe { buf.assume_init() }
    }

    /// Whether the buffer lies in a region the OS accepted the huge-page advice for (whether
    /// it actually backs it with 2 MB pages depends on free memory: see [`coverage`]).
    pub fn in_huge_page_region(&self) -> bool {
        match &self.owner {
            Owner::Region(region) => region.advised,
            Owner::Heap(_) | Owner::Empty => false,
        }
    }
}

impl<T: Copy> LargeBuf<std::mem::MaybeUninit<T>> {
    /// `len` elements to be written before use (zero bytes are a valid `MaybeUninit`).
    pub fn uninit(len: usize) -> Self {
        // SAFETY: any bytes are a valid `MaybeUninit<T>`.
        unsafe { Self::zeroed(len) }
    }

    /// The same buffer as `T`.
    ///
    /// # Safety
    /// Every element has been written with a valid `T`.
    pub unsafe fn assume_init(self) -> LargeBuf<T> {
        let this = std::mem::ManuallyDrop::new(self);
        LargeBuf {
            ptr: this.ptr.cast(),
            len: this.len,
            // SAFETY: `this` is never dropped, so its owner moves out exactly once.
            owner: unsafe { std::ptr::read(&this.owner) },
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
            // The region unmaps itself when its last buffer's `Arc` goes (at once if this is
            // the last); until then the memory of the whole pages this buffer alone covered
            // goes back to the OS.
            Owner::Region(region) if Arc::strong_count(region) > 1 => {
                let start = (self.ptr.as_ptr() as usize).next_multiple_of(PAGE);
                let end = (self.ptr.as_ptr() as usize + self.len * std::mem::size_of::<T>()) / PAGE
                    * PAGE;
                if end > start {
                    // SAFETY: `start..end` is whole pages inside this buffer, which no one uses
                    // any more and whose space is never carved again.
                    unsafe { release(start, end - start) };
                }
            }
            Owner::Region(_) | Owner::Empty => {}
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
    /// Whether the OS took the huge-page advice.
    advised: bool,
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
        #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
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
    if layout.align() > HUGE_PAGE {
        return None;
    }
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
    let open = current
        .0
        .upgrade()
        .and_then(|region| fits(&region, current.1).map(|at| (region, at)));
    let (region, at) = match open {
        Some(open) => open,
        None => {
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
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn map(len: usize) -> Option<Self> {
        let padded = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                padded,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
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
        // stays is `start..start + len`, inside it too (and not null: mmap never maps page 0
        // for us, and `start >= raw > 0`).
        let advised = unsafe {
            if start > raw {
                libc::munmap(raw as *mut libc::c_void, start - raw);
            }
            let tail = raw + padded - (start + len);
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: a kernel without transparent huge pages refuses it, and the
            // region still works on small pages.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) == 0
        };
        let region = Self {
            start: NonNull::new(start as *mut u8)?,
            len,
            advised,
        };
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((start, len));
        Some(region)
    }

    #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
    fn map(_len: usize) -> Option<Self> {
        None
    }
}

/// Gives the memory of `len` bytes of whole pages at `start` back to the OS; reading them
/// afterwards gives zeros.
///
/// # Safety
/// The range lies in a region and no one uses its bytes any more.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
unsafe fn release(start: usize, len: usize) {
    libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED);
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
unsafe fn release(_start: usize, _len: usize) {}

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
/// A region is a mapping of its own or merged with adjacent ones of the same flags: other
/// regions, or (an upper bound then) other code's anonymous memory also marked for huge pages,
/// as glibc's with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`.
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

    /// A type aligned more strictly than its size suggests.
    #[derive(Clone, Copy)]
    #[repr(C, align(32))]
    struct Wide([u8; 40]);

    fn fill(buf: &mut [u32], seed: u32) {
        buf.iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = seed.wrapping_mul(31).wrapping_add(i as u32));
    }

    fn holds(buf: &[u32], seed: u32) -> bool {
        buf.iter()
            .enumerate()
            .all(|(i, &x)| x == seed.wrapping_mul(31).wrapping_add(i as u32))
    }

    #[test]
    fn buffers_of_every_kind_start_zeroed() {
        // SAFETY: zero is a valid u32 and f32.
        let small = unsafe { LargeBuf::<u32>::zeroed(10) };
        let carved = unsafe { LargeBuf::<f32>::zeroed(70_000) };
        let empty = unsafe { LargeBuf::<u64>::zeroed(0) };
        assert!(empty.is_empty());
        assert!(!small.in_huge_page_region());
        assert_eq!(matches!(carved.owner, Owner::Region(_)), REGIONS);
        assert!(small.iter().all(|&x| x == 0) && carved.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn carved_buffers_are_aligned_and_do_not_overlap() {
        // An odd-sized buffer first, so the next one's start needs rounding.
        // SAFETY: zero bytes are a valid u8, u32 and `Wide`.
        let mut odd = unsafe { LargeBuf::<u8>::zeroed(MIN_CARVED + 13) };
        let mut wide = unsafe { LargeBuf::<Wide>::zeroed(MIN_CARVED / 40 + 1) };
        let mut words = unsafe { LargeBuf::<u32>::zeroed(100_000) };
        assert_eq!(wide.as_ptr() as usize % 32, 0);
        odd.fill(0xAB);
        wide.iter_mut().for_each(|w| w.0 = [0xCD; 40]);
        fill(&mut words, 3);
        assert!(odd.iter().all(|&b| b == 0xAB));
        assert!(wide.iter().all(|w| w.0 == [0xCD; 40]));
        assert!(holds(&words, 3));
    }

    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn dropping_a_buffer_keeps_a_neighbours_bytes_on_a_shared_page() {
        // Buffers are carved in order; another test may carve in between, so try until two
        // neighbours share a page.
        for _ in 0..16 {
            // SAFETY: zero is a valid u32.
            let mut a = unsafe { LargeBuf::<u32>::zeroed(40_001) };
            let mut b = unsafe { LargeBuf::<u32>::zeroed(40_000) };
            let a_end = a.as_ptr_range().end as usize;
            let b_start = b.as_ptr() as usize;
            if b_start < a_end || b_start / PAGE != (a_end - 1) / PAGE {
                continue;
            }
            fill(&mut a, 1);
            fill(&mut b, 2);
            drop(a);
            assert!(holds(&b, 2));
            return;
        }
        panic!("no two neighbouring buffers in sixteen tries");
    }

    #[test]
    fn an_uninitialised_buffer_written_whole_becomes_a_plain_one() {
        let mut buf = LargeBuf::<std::mem::MaybeUninit<u32>>::uninit(50_000);
        for (i, x) in buf.iter_mut().enumerate() {
            x.write(i as u32);
        }
        // SAFETY: every element was written.
        let buf = unsafe { buf.assume_init() };
        assert!(buf.iter().enumerate().all(|(i, &x)| x == i as u32));
    }

    #[test]
    fn from_fn_gives_each_element_its_value() {
        for len in [0, 10, 50_000] {
            let buf = LargeBuf::from_fn(len, |i| 3 * i as u64);
            assert_eq!(buf.len(), len);
            assert!(buf.iter().enumerate().all(|(i, &x)| x == 3 * i as u64));
        }
    }

    #[test]
    fn threads_carving_and_dropping_at_once_keep_their_own_elements() {
        std::thread::scope(|scope| {
            for t in 0..4u32 {
                scope.spawn(move || {
                    let mut kept = Vec::new();
                    for n in 0..24u32 {
                        // SAFETY: zero is a valid u32.
                        let mut buf = unsafe { LargeBuf::<u32>::zeroed(20_000 + 997 * n as usize) };
                        let seed = 100 * t + n;
                        fill(&mut buf, seed);
                        if n % 3 == 0 {
                            drop(buf);
                        } else {
                            kept.push((seed, buf));
                        }
                    }
                    for (seed, buf) in &kept {
                        assert!(holds(buf, *seed));
                    }
                });
            }
        });
    }

    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn large_buffers_take_aligned_regions_of_their_own_unmapped_with_them() {
        // SAFETY: zero is a valid u8.
        let mut big = unsafe { LargeBuf::<u8>::zeroed(REGION / 2 + 1) };
        assert!((big.as_ptr() as usize).is_multiple_of(HUGE_PAGE));
        big[REGION / 2] = 7;
        let region = match &big.owner {
            Owner::Region(r) => Arc::downgrade(r),
            _ => panic!("a region of its own"),
        };
        let start = big.as_ptr() as usize;
        assert_eq!(region.strong_count(), 1);
        assert!(coverage().unwrap().region_bytes >= REGION / 2);
        drop(big);
        assert!(region.upgrade().is_none());
        let live = LIVE.lock().unwrap();
        assert!(live.iter().all(|&(s, _)| s != start));
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
