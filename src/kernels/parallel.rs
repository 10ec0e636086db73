//! How kernels spread work over threads: a [`ComputePool`] of persistent workers in which the
//! calling thread takes part. The model actors of one device install that device's pool on
//! their threads ([`install`]) and take turns through its executor, so no two pools ever
//! compute on the same cores at once; a pool for a core set pins its threads there
//! ([`ComputePool::pinned`]). A thread without a pool uses a process-wide one over every core.
//!
//! Workers spin for a short while after each job (the next matmul of a forward pass follows
//! within microseconds), after requesting any announced prefetch region (below), and then
//! park, so an idle device costs no CPU. The caller never waits for a worker that has not
//! started: a job is closed when its items are all taken, and workers that arrive later skip
//! it. A caller waiting for workers still inside a job spins as long as they do, then parks
//! until the last one leaves (a preempted worker must not cost a core of spinning).
//!
//! A waiting thread need not idle: [`prefetch_ahead`] names the memory the next job will
//! read, and the pool's threads request it into the caches while they wait, so a decode
//! step streams weights through the gaps where one thread works alone.

use std::cell::RefCell;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{JoinHandle, Thread};
use std::time::Duration;

/// Spins of a worker waiting for the next job before it parks (tens of microseconds, counted
/// once any prefetch region is requested).
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
    /// Set while the caller is parked waiting for `active` to drain: the worker that leaves
    /// last wakes `waiter`.
    caller_parked: AtomicBool,
    waiter: Mutex<Option<Thread>>,
    /// The memory the next jobs will read ([`prefetch_ahead`]): the address of the next
    /// chunk a waiting worker requests, and the end. Only a hint: prefetches never fault, so
    /// a stale or torn pair costs at most some useless requests.
    ahead_next: AtomicUsize,
    ahead_end: AtomicUsize,
}

impl Shared {
    fn new() -> Self {
        Self {
            generation: AtomicUsize::new(0),
            closed: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            caller_parked: AtomicBool::new(false),
            waiter: Mutex::new(None),
            ahead_next: AtomicUsize::new(0),
            ahead_end: AtomicUsize::new(0),
        }
    }

    /// Makes `start..end` the prefetch region: stops the claims, moves the end, then opens the
    /// new region.
    fn announce(&self, start: usize, end: usize) {
        self.ahead_next.store(usize::MAX, Ordering::Relaxed);
        self.ahead_end.store(end, Ordering::Relaxed);
        self.ahead_next.store(start, Ordering::Release);
    }

    /// Requests the next chunk of the prefetch region into the caches; `false` when none is
    /// left. A region longer than [`AHEAD_LIMIT`] (one announcement's start read with
    /// another's end, when two threads announce at once) counts as none left, so a mixed pair
    /// never keeps the waiting threads requesting unrelated memory.
    fn prefetch_some(&self) -> bool {
        let mut next = self.ahead_next.load(Ordering::Acquire);
        loop {
            let end = self.ahead_end.load(Ordering::Relaxed);
            if next >= end || end - next > AHEAD_LIMIT {
                return false;
            }
            let stop = next.saturating_add(AHEAD_CHUNK).min(end);
            match self.ahead_next.compare_exchange_weak(
                next,
                stop,
                Ordering::Relaxed,
                Ordering::Acquire,
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
/// self-scheduling): a grab takes `1 / spread` of the items left (`spread` is the number of
/// threads), at least `min_chunk`. Large first chunks keep each thread on one long stretch of
/// memory; small last ones let the threads finish together, so none idles while another works
/// through a big final chunk.
///
/// Every grab starts a new stretch of memory: its first lines come in before the kernels'
/// requests ahead reach them, and the requests at the end of the thread's previous stretch ran
/// past it. With grabs of a quarter of the items left (twice as many), one activation row
/// through Q5_0 matrices of 0.5–0.6 MB streamed at 65–69 % of a plain read against 72–79 %
/// with halves, 4864 × 896 at 82 % against 83–88 %, and the 0.5B decoded at batch 1 at 82–83 %
/// of the roofline against 85–88 % (five alternated rounds on the Intel Xeon). Work stealing
/// (one share per thread) and exact halves (no balancing) did no better.
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
        Self::pinned(threads, name, &[])
    }

    /// [`new`](Self::new) with worker `i` pinned to `cores[i % cores.len()]` (no pinning when
    /// `cores` is empty). Callers pin themselves with [`pin_current_thread`].
    pub fn pinned(threads: usize, name: &str, cores: &[usize]) -> Arc<Self> {
        let shared = Arc::new(Shared::new());
        let workers = (1..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                let core = (!cores.is_empty()).then(|| cores[i % cores.len()]);
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || {
                        if let Some(core) = core {
                            if let Err(e) = pin_current_thread(&[core]) {
                                tracing::warn!(core, "cannot pin a compute thread: {e}");
                            }
                        }
                        worker(&shared)
                    })
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
            spread: threads,
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
        s.wait_for_workers();
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
            // A region to request is work of its own: the spin budget starts when it is done.
            if s.prefetch_some() {
                continue;
            }
            if spins < SPIN_LIMIT {
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
        if s.active.fetch_sub(1, Ordering::SeqCst) == 1 && s.caller_parked.load(Ordering::SeqCst) {
            if let Some(caller) = s.waiter.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                caller.unpark();
            }
        }
    }
}

impl Shared {
    /// The caller's wait for the workers still inside a closed job: spinning (requesting the
    /// next job's memory) while they finish their last chunks, then parked, so a worker
    /// preempted mid-chunk costs a time slice of latency but no core. The flag and `active`
    /// are both sequentially consistent: either the caller sees `active` drained or the last
    /// worker sees the flag and wakes it; the timeout only guards against the unexpected.
    fn wait_for_workers(&self) {
        let mut spins = 0u32;
        while self.active.load(Ordering::SeqCst) != 0 {
            if self.prefetch_some() {
                continue;
            }
            if spins < SPIN_LIMIT {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            *self.waiter.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::thread::current());
            self.caller_parked.store(true, Ordering::SeqCst);
            while self.active.load(Ordering::SeqCst) != 0 {
                std::thread::park_timeout(Duration::from_millis(1));
            }
            self.caller_parked.store(false, Ordering::SeqCst);
        }
    }
}

/// Pins the calling thread to `cores` (Linux; elsewhere a no-op).
pub fn pin_current_thread(cores: &[usize]) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit set on the stack, sized as the call says.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cores {
                libc::CPU_SET(c, &mut set);
            }
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cores;
    Ok(())
}

/// The cores this process may run on, in order (every core up to the count where the set
/// cannot be read).
pub fn process_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as in `pin_current_thread`.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                    .filter(|&c| libc::CPU_ISSET(c, &set))
                    .collect();
                if !cores.is_empty() {
                    return cores;
                }
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect()
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

/// The cores our kernels may use, decided once per process: the limit [`limit_cores`] set,
/// else every core this process may run on.
pub fn available_cores() -> usize {
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

static CORES: OnceLock<usize> = OnceLock::new();

/// Caps the cores our kernels use at `n` (at least 1): only before the first pool starts.
pub fn limit_cores(n: usize) -> Result<(), String> {
    let n = n.max(1);
    match *CORES.get_or_init(|| n) {
        set if set == n => Ok(()),
        set => Err(format!(
            "the kernels already run on {set} cores; limit them before they start"
        )),
    }
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
/// pool's threads request its first `AHEAD_LIMIT` bytes into the caches while they wait
/// (a worker for a job, the caller for the workers still inside one), so memory keeps
/// streaming while the calling thread works alone between two jobs (a norm, rotary, the
/// attention of a few heads). Replaces the region of an earlier call. A pool without workers
/// ignores it, and so does a call from inside a job (it would name a pool the job's threads
/// do not wait in).
pub fn prefetch_ahead<T>(data: &[T]) {
    if IN_JOB.with(|w| w.get()) {
        return;
    }
    let start = data.as_ptr() as usize;
    let end = start.saturating_add(std::mem::size_of_val(data).min(AHEAD_LIMIT));
    let announce = |pool: &ComputePool| {
        if !pool.workers.is_empty() {
            pool.shared.announce(start, end);
        }
    };
    CURRENT.with(|c| match c.borrow().as_deref() {
        Some(pool) => announce(pool),
        None => announce(process_pool()),
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
mod tests;
