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
        // The first grab takes a half; a floor of 1000 would have taken everything.
        assert!(largest.load(Ordering::Relaxed) < 1000);
    });
}

/// Chunks shrink from half the items (two threads) to the floor, cover every item once in
/// order, and end exactly at `n`.
#[test]
fn chunks_shrink_to_the_floor() {
    let f = |_: Range<usize>| {};
    let job = Job {
        f: &f,
        n: 1000,
        spread: 2,
        min_chunk: 32,
        cursor: AtomicUsize::new(0),
    };
    let chunks: Vec<Range<usize>> = std::iter::from_fn(|| job.grab()).collect();
    let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
    assert_eq!(sizes, [500, 250, 125, 62, 32, 31], "guided sizes");
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

/// An announced region is requested a chunk at a time, each chunk once, its last chunk
/// short; a new region replaces the old; an empty one, or a start and an end more than
/// `AHEAD_LIMIT` apart (two announcements mixed), is nothing to request.
#[test]
fn an_announced_region_is_claimed_once_in_chunks() {
    let s = Shared::new();
    let claims = |s: &Shared| std::iter::from_fn(|| s.prefetch_some().then_some(())).count();
    let base = 1 << 30;
    s.announce(base, base + 5 * AHEAD_CHUNK + 100);
    assert_eq!(claims(&s), 6);
    assert_eq!(
        s.ahead_next.load(Ordering::Relaxed),
        base + 5 * AHEAD_CHUNK + 100
    );
    s.announce(base, base + 100);
    assert_eq!(claims(&s), 1);
    s.announce(base, base);
    assert_eq!(claims(&s), 0);
    s.announce(base, base + AHEAD_LIMIT);
    assert_eq!(claims(&s), AHEAD_LIMIT / AHEAD_CHUNK);
    s.announce(base, base + AHEAD_LIMIT + 1);
    assert_eq!(claims(&s), 0);
}

/// `prefetch_ahead` caps a region at `AHEAD_LIMIT`, a pool without workers ignores it, and
/// the threads waiting after a job request it on their own.
#[test]
fn waiting_threads_prefetch_the_announced_region() {
    let data = vec![1u8; AHEAD_LIMIT + 5 * AHEAD_CHUNK];
    let start = data.as_ptr() as usize;
    let alone = ComputePool::new(1, "test");
    with_pool(&alone, || prefetch_ahead(&data));
    assert_eq!(alone.shared.ahead_end.load(Ordering::Relaxed), 0);

    let pool = ComputePool::new(2, "test");
    let s = &*pool.shared;
    with_pool(&pool, || prefetch_ahead(&data));
    assert_eq!(s.ahead_end.load(Ordering::Relaxed), start + AHEAD_LIMIT);
    pool.for_each_range(2, |_| {});
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while s.ahead_next.load(Ordering::Relaxed) < start + AHEAD_LIMIT {
        assert!(
            std::time::Instant::now() < deadline,
            "the region was left unclaimed"
        );
        std::thread::yield_now();
    }
    assert!(!s.prefetch_some());
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
