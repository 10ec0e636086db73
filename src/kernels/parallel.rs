//! How kernels spread work over threads: candle's persistent barrier pool, in which the calling
//! thread takes part. Our kernels and candle's then share one set of threads; a second pool
//! (rayon's) would spin beside it on the same cores between calls.

use std::ops::Range;

/// Calls `f` on disjoint ranges that together cover `0..n_items`, in parallel; returns when
/// all are done. Ranges are handed out from a shared cursor, several per thread.
pub fn for_each_range(n_items: usize, f: impl Fn(Range<usize>) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n_items, f);
}

/// A raw output pointer that parallel tasks write through, each to elements no other task
/// touches.
#[derive(Clone, Copy)]
pub struct DisjointOut(*mut f32);

// SAFETY: every user writes disjoint elements, and the pointer outlives the parallel call.
unsafe impl Send for DisjointOut {}
unsafe impl Sync for DisjointOut {}

impl DisjointOut {
    pub fn new(out: &mut [f32]) -> Self {
        Self(out.as_mut_ptr())
    }

    /// The `len` elements starting at `offset`.
    ///
    /// # Safety
    /// The range must lie inside the original slice, be accessed by this task only, and not
    /// be used after the slice the pointer came from.
    pub unsafe fn slice<'a>(self, offset: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(offset), len)
    }
}
