//! How kernels spread work over threads: a [`ComputePool`] of persistent workers in which the
//! calling thread takes part. Each model actor installs a pool of its own on its thread
//! ([`install`]), so a model's kernels run on its share of the cores and never wait for
//! another model's; a thread without one uses a process-wide pool over every core.
//!
//! Workers spin for a short while after each job (the next matmul of a forward pass follows
//! within microseconds) and then park, so an idle model's workers leave the cores to the
//! others. The caller never waits for a worker that has not started: a job is closed when
//! its items are all taken, and workers that arrive later skip it.
//!
//! A waiting thread need not idle: [`prefetch_ahead`] names the memory the next job will
//! read, and the pool's threads request it into the caches while they wait, so a decode
//! step streams weights through the gaps where one thread works alone.

use std::cell::RefCell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

/// Spins of a worker waiting for the next job before it parks (tens of microseconds).
const SPIN_LIMIT: u32 = 20_000;
/// Bytes of a [`prefetch_ahead`] region a waiting worker requests between two looks for a
/// job.
const AHEAD_CHUNK: usize = 1024;
/// Most bytes of one [`prefetch_ahead`] region requested: what the caches keep until the job
/// that reads them comes.
const AHEAD_LIMIT: usize = 2 << 20;

/// A fixed set of compute threads (the caller plus `threads - 1` workers).
pub struct ComputePool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time.
    call: Mutex<()>,
}

struct Shared {
    /// Bumped for every job; workers wait for it to change.
    generation: AtomicUsize,
    /// The newest generation whose job is closed: its items are all taken, its `Job` may be
    /// gone (and so may every older one's).
    closed: AtomicUsize,
    /// Workers inside the current job.
    active: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    stop: AtomicBool,
    panicked: AtomicBool,
    /// The memory the next jobs will read ([`prefetch_ahead`]): the address of the next
    /// chunk a waiting worker requests, and the end. Only a hint: prefetches never fault, so
    /// a stale or torn pair costs at most some useless requests.
    ahead_next: AtomicUsize,
    ahead_end: AtomicUsize,
}

impl Shared {
    /// Requests the next chunk of the prefetch region into the caches; `false` when none is
    /// left.
    fn prefetch_some(&self) -> bool {
        let mut next = self.ahead_next.load(Ordering::Relaxed);
        loop {
            let end = self.ahead_end.load(Ordering::Relaxed);
            if next >= end {
                return false;
            }
            let stop = next.saturating_add(AHEAD_CHUNK).min(end);
            match self.ahead_next.compare_exchange_weak(
                next,
                stop,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    super::prefetch_lines(next as *const u8, stop - next);
                    return true;
                }
                Err(now) => next = now,
            }
        }
    }
}

/// One parallel call: items `0..n` handed out from `cursor` in shrinking chunks (guided
/// self-scheduling): a grab takes `1 / spread` of the items left, at least `min_chunk`. Large
/// first chunks keep each thread on one long stretch of memory; small last ones let the
/// threads finish together, so none idles while another works through a big final chunk.
struct Job<'a> {
    f: &'a (dyn Fn(Range<usize>) + Sync),
    n: usize,
    spread: usize,
    min_chunk: usize,
    cursor: AtomicUsize,
}

impl Job<'_> {
    fn work(&self) {
        while let Some(range) = self.grab() {
            (self.f)(range);
        }
    }

    /// The next chunk, `None` when every item is taken.
    fn grab(&self) -> Option<Range<usize>> {
        let mut start = self.cursor.load(Ordering::Relaxed);
        loop {
            let left = self.n.checked_sub(start).filter(|&l| l > 0)?;
            let size = (left / self.spread).max(self.min_chunk).min(left);
            match self.cursor.compare_exchange_weak(
                start,
                start + size,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(start..start + size),
                Err(now) => start = now,
            }
        }
    }
}

thread_local! {
    /// The pool this thread's kernels use, when it has one of its own.
    static CURRENT: RefCell<Option<Arc<ComputePool>>> = const { RefCell::new(None) };
    /// Set while a thread works on a job (pool workers always): a kernel called from inside
    /// a job runs inline.
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl ComputePool {
    /// A pool of `threads` compute threads (at least 1: the caller alone), its workers named
    /// `{name}-{i}`.
    pub fn new(threads: usize, name: &str) -> Arc<Self> {
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            closed: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            ahead_next: AtomicUsize::new(0),
            ahead_end: AtomicUsize::new(0),
        });
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("cannot start a compute thread")
            })
            .collect();
        Arc::new(Self {
            shared,
            workers,
            call: Mutex::new(()),
        })
    }

    /// Compute threads, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Calls `f` on disjoint ranges covering `0..n_items` on this pool's threads; returns
    /// when all are done. A panic in `f` on any thread panics here.
    pub fn for_each_range(&self, n_items: usize, f: impl Fn(Range<usize>) + Sync) {
        self.for_each_range_with(n_items, self.min_chunk(n_items), f)
    }

    /// The smallest chunk a grab takes unless the caller says otherwise: a sixteenth of a
    /// thread's share.
    fn min_chunk(&self, n_items: usize) -> usize {
        n_items.div_ceil(16 * self.threads())
    }

    /// [`for_each_range`](Self::for_each_range) whose grabs take at least `min_chunk` items
    /// (or all that are left): the last grabs of a call take that many, so it bounds how long
    /// one thread may still work after the others ran dry.
    pub fn for_each_range_with(
        &self,
        n_items: usize,
        min_chunk: usize,
        f: impl Fn(Range<usize>) + Sync,
    ) {
        if n_items == 0 {
            return;
        }
        if self.workers.is_empty() || n_items == 1 || IN_JOB.with(|w| w.get()) {
            f(0..n_items);
            return;
        }
        let threads = self.threads();
        let job = Job {
            f: &f,
            n: n_items,
            spread: 2 * threads,
            min_chunk: min_chunk.max(1),
            cursor: AtomicUsize::new(0),
        };
        let _one_job = self.call.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // SAFETY (of the lifetime change): workers dereference the pointer only while the job
        // is open and they are counted in `active`; it is closed, and `active` drained, before
        // `job` goes out of scope below.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        s.job.store(ptr, Ordering::SeqCst);
        let generation = s.generation.fetch_add(1, Ordering::SeqCst) + 1;
        for w in &self.workers {
            w.thread().unpark();
        }
        IN_JOB.with(|w| w.set(true));
        let mine = catch_unwind(AssertUnwindSafe(|| job.work()));
        IN_JOB.with(|w| w.set(false));
        // Every item is taken (ours ran dry): close the job, then wait for the workers
        // still inside it.
        s.closed.store(generation, Ordering::SeqCst);
        while s.active.load(Ordering::SeqCst) != 0 {
            if !s.prefetch_some() {
                std::hint::spin_loop();
            }
        }
        if let Err(payload) = mine {
            std::panic::resume_unwind(payload);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a compute thread panicked in a parallel kernel");
        }
    }
}

fn worker(s: &Shared) {
    IN_JOB.with(|w| w.set(true));
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        let generation = loop {
            let g = s.generation.load(Ordering::SeqCst);
            if g != seen {
                break g;
            }
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            if s.prefetch_some() {
                // Waiting with work of its own: the spin budget starts when it runs out.
            } else if spins < SPIN_LIMIT {
                spins += 1;
                std::hint::spin_loop();
            } else {
                // An unpark that came first makes this return at once: no wake-up is lost.
                std::thread::park();
            }
        };
        seen = generation;
        s.active.fetch_add(1, Ordering::SeqCst);
        // The caller closes a job before it waits for `active`; a worker counted after the
        // close sees it here and leaves the job alone.
        if s.closed.load(Ordering::SeqCst) < generation {
            // SAFETY: the job is open and this worker is counted in `active`, so the caller
            // is still waiting and `Job` is alive.
            let job = unsafe { &*s.job.load(Ordering::SeqCst) };
            if catch_unwind(AssertUnwindSafe(|| job.work())).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.active.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for ComputePool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Makes `pool` the one this thread's kernels use from now on.
pub fn install(pool: Arc<ComputePool>) {
    CURRENT.with(|c| *c.borrow_mut() = Some(pool));
}

/// Runs `f` with `pool` as this thread's pool, then restores the previous one.
pub fn with_pool<R>(pool: &Arc<ComputePool>, f: impl FnOnce() -> R) -> R {
    let previous = CURRENT.with(|c| c.borrow_mut().replace(pool.clone()));
    struct Restore(Option<Arc<ComputePool>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CURRENT.with(|c| *c.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(previous);
    f()
}

/// The cores our kernels may use: `TOKENROUTER_THREADS` when set, else every core this
/// process may run on.
pub fn available_cores() -> usize {
    std::env::var("TOKENROUTER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The pool of threads without one of their own: every core.
fn process_pool() -> &'static Arc<ComputePool> {
    static POOL: OnceLock<Arc<ComputePool>> = OnceLock::new();
    POOL.get_or_init(|| ComputePool::new(available_cores(), "compute"))
}

/// Calls `f` on disjoint ranges that together cover `0..n_items`, in parallel on this
/// thread's pool; returns when all are done.
pub fn for_each_range(n_items: usize, f: impl Fn(Range<usize>) + Sync) {
    current_pool().for_each_range(n_items, f)
}

/// [`for_each_range`] with at most `max_chunk` items in the last grabs (fewer where the
/// pool's own floor, a sixteenth of a thread's share, is smaller).
pub fn for_each_range_tail(n_items: usize, max_chunk: usize, f: impl Fn(Range<usize>) + Sync) {
    let pool = current_pool();
    pool.for_each_range_with(n_items, max_chunk.min(pool.min_chunk(n_items)), f)
}

/// Says that the next parallel jobs will read `data` (the next matmul's weights, say): this
/// pool's threads request its first [`AHEAD_LIMIT`] bytes into the caches while they wait
/// (a worker for a job, the caller for the workers still inside one), so memory keeps
/// streaming while the calling thread works alone between two jobs (a norm, rotary, the
/// attention of a few heads). Replaces the region of an earlier call; a pool without workers
/// ignores it.
pub fn prefetch_ahead<T>(data: &[T]) {
    let start = data.as_ptr() as usize;
    let end = start.saturating_add(std::mem::size_of_val(data).min(AHEAD_LIMIT));
    let set = |pool: &ComputePool| {
        if pool.workers.is_empty() {
            return;
        }
        let s = &*pool.shared;
        // Stop the claims, move the end, then open the new region.
        s.ahead_next.store(usize::MAX, Ordering::Relaxed);
        s.ahead_end.store(end, Ordering::Relaxed);
        s.ahead_next.store(start, Ordering::Relaxed);
    };
    CURRENT.with(|c| match c.borrow().as_deref() {
        Some(pool) => set(pool),
        None => set(process_pool()),
    })
}

/// This thread's pool: its own, or the process-wide one.
fn current_pool() -> Arc<ComputePool> {
    CURRENT
        .with(|c| c.borrow().clone())
        .unwrap_or_else(|| process_pool().clone())
}

/// Compute threads of this thread's pool (the caller included).
pub fn current_threads() -> usize {
    current_pool().threads()
}

/// A raw output pointer that parallel tasks write through, each to elements no other task
/// touches.
pub struct DisjointOut<T = f32>(*mut T);

impl<T> Clone for DisjointOut<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DisjointOut<T> {}

// SAFETY: every user writes disjoint elements, and the pointer outlives the parallel call.
unsafe impl<T: Send> Send for DisjointOut<T> {}
unsafe impl<T: Send> Sync for DisjointOut<T> {}

impl<T> DisjointOut<T> {
    pub fn new(out: &mut [T]) -> Self {
        Self(out.as_mut_ptr())
    }

    /// Over memory not yet initialised (a vector's spare capacity): the tasks fill it with
    /// [`write`](Self::write) only (a [`slice`](Self::slice) of it would be a reference to
    /// uninitialised values), and every element before anyone reads it.
    pub fn uninit(out: &mut [std::mem::MaybeUninit<T>]) -> Self {
        Self(out.as_mut_ptr() as *mut T)
    }

    /// Copies `values` to the elements starting at `offset`.
    ///
    /// # Safety
    /// As for [`slice`](Self::slice): the range lies inside the original memory and is this
    /// task's alone.
    pub unsafe fn write(self, offset: usize, values: &[T])
    where
        T: Copy,
    {
        std::ptr::copy_nonoverlapping(values.as_ptr(), self.0.add(offset), values.len())
    }

    /// The `len` elements starting at `offset`.
    ///
    /// # Safety
    /// The range must lie inside the original slice, be accessed by this task only, and not
    /// be used after the slice the pointer came from.
    pub unsafe fn slice<'a>(self, offset: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item is visited exactly once, for many job sizes on one pool, back to back.
    #[test]
    fn every_item_once() {
        let pool = ComputePool::new(3, "test");
        for n in [0usize, 1, 2, 3, 7, 64, 1000, 4097] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each_range(n, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}"
            );
        }
    }

    /// A chosen chunk floor (0 read as 1, one larger than the job) still covers every item
    /// once, and the tail floor never exceeds the pool's own.
    #[test]
    fn every_item_once_with_any_chunk_floor() {
        let pool = ComputePool::new(2, "test");
        for (n, min_chunk) in [
            (1000usize, 0usize),
            (1000, 1),
            (1000, 7),
            (5, 100),
            (4097, 3),
        ] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.for_each_range_with(n, min_chunk, |r| {
                for i in r {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "n = {n}, floor {min_chunk}"
            );
        }
        assert_eq!(pool.min_chunk(1000), 32);
        with_pool(&pool, || {
            let largest = AtomicUsize::new(0);
            for_each_range_tail(1000, 1000, |r| {
                largest.fetch_max(r.len(), Ordering::Relaxed);
            });
            // The first grab takes a quarter; a floor of 1000 would have taken everything.
            assert!(largest.load(Ordering::Relaxed) < 1000);
        });
    }

    /// Chunks shrink from a quarter of the items (two threads) to the floor, cover every item
    /// once in order, and end exactly at `n`.
    #[test]
    fn chunks_shrink_to_the_floor() {
        let f = |_: Range<usize>| {};
        let job = Job {
            f: &f,
            n: 1000,
            spread: 4,
            min_chunk: 32,
            cursor: AtomicUsize::new(0),
        };
        let chunks: Vec<Range<usize>> = std::iter::from_fn(|| job.grab()).collect();
        let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        assert_eq!(
            sizes,
            [250, 187, 140, 105, 79, 59, 45, 33, 32, 32, 32, 6],
            "guided sizes"
        );
        assert!(chunks.windows(2).all(|w| w[0].end == w[1].start));
        assert_eq!((chunks[0].start, chunks.last().unwrap().end), (0, 1000));
    }

    /// Work spreads over the workers (they wake from parking) and the results add up.
    #[test]
    fn workers_take_part_after_parking() {
        let pool = ComputePool::new(2, "test");
        // Long enough for the worker to park.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let threads = Mutex::new(std::collections::HashSet::new());
        let sum = AtomicUsize::new(0);
        pool.for_each_range(64, |r| {
            threads.lock().unwrap().insert(std::thread::current().id());
            // Slow items, so the worker wakes before the caller takes them all.
            std::thread::sleep(std::time::Duration::from_millis(2));
            sum.fetch_add(r.sum::<usize>(), Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), (0..64).sum::<usize>());
        assert_eq!(threads.lock().unwrap().len(), 2);
    }

    /// An announced region is requested a chunk at a time, each chunk once, up to
    /// `AHEAD_LIMIT`; a new region replaces the old; the threads waiting after a job request
    /// it on their own.
    #[test]
    fn waiting_threads_prefetch_the_announced_region() {
        let pool = ComputePool::new(2, "test");
        let s = &*pool.shared;
        // Long enough for the worker to park: only this thread claims chunks.
        std::thread::sleep(std::time::Duration::from_millis(50));
        let data = vec![1u8; AHEAD_LIMIT + 5 * AHEAD_CHUNK];
        let start = data.as_ptr() as usize;
        with_pool(&pool, || prefetch_ahead(&data));
        let claims = std::iter::from_fn(|| s.prefetch_some().then_some(())).count();
        // All of them here unless the worker was slow to park.
        assert!(
            claims > 0 && claims <= AHEAD_LIMIT / AHEAD_CHUNK,
            "{claims} claims"
        );
        assert_eq!(s.ahead_next.load(Ordering::Relaxed), start + AHEAD_LIMIT);
        assert!(!s.prefetch_some());

        // A short region, then one a job's waiting threads consume on their own.
        with_pool(&pool, || prefetch_ahead(&data[..100]));
        assert!(s.prefetch_some());
        assert!(!s.prefetch_some());
        with_pool(&pool, || prefetch_ahead(&data));
        pool.for_each_range(2, |_| {});
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while s.ahead_next.load(Ordering::Relaxed) < start + AHEAD_LIMIT {
            assert!(
                std::time::Instant::now() < deadline,
                "the region was left unclaimed"
            );
            std::thread::yield_now();
        }
    }

    /// `with_pool` routes `for_each_range` to the given pool and restores the previous one.
    #[test]
    fn with_pool_scopes_the_pool() {
        let one = ComputePool::new(1, "test");
        let caller = std::thread::current().id();
        with_pool(&one, || {
            for_each_range(100, |_| assert_eq!(std::thread::current().id(), caller));
        });
        assert!(CURRENT.with(|c| c.borrow().is_none()));
    }

    /// A panic in a task reaches the caller, and the pool keeps working.
    #[test]
    fn a_panicking_task_panics_the_caller() {
        let pool = ComputePool::new(2, "test");
        let result = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_range(100, |r| {
                if r.contains(&57) {
                    panic!("item 57");
                }
            })
        }));
        assert!(result.is_err());
        let sum = AtomicUsize::new(0);
        pool.for_each_range(10, |r| {
            sum.fetch_add(r.len(), Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 10);
    }
}
