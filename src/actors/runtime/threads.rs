//! The compute-thread budget: how many cores each model gets when `[compute] split =
//! "by-size"` gives every model a device of its own on disjoint cores (placement).

use crate::config::CoreSplit;

/// Threads per model: a model with `requested[i]` set gets that many. With
/// [`CoreSplit::Shared`] every other model gets all `cores` (the models then share one device
/// and take turns on it: docs/benchmarks.md, "Core split"). With [`CoreSplit::BySize`] the
/// cores left are split among the others in proportion to `weight_bytes` (a step streams its
/// weights, so time per step grows with them), at least one each, never more in total than
/// `cores` unless the requests ask for it or there are more models than cores.
pub fn thread_budget(
    requested: &[Option<usize>],
    weight_bytes: &[usize],
    cores: usize,
    split: CoreSplit,
) -> Vec<usize> {
    if split == CoreSplit::Shared {
        return requested
            .iter()
            .map(|r| r.unwrap_or(cores.max(1)))
            .collect();
    }
    let fixed: usize = requested.iter().flatten().sum();
    let open: Vec<usize> = (0..requested.len())
        .filter(|&i| requested[i].is_none())
        .collect();
    let mut budget: Vec<usize> = requested.iter().map(|r| r.unwrap_or(1)).collect();
    let left = cores.saturating_sub(fixed);
    if open.len() >= left {
        return budget;
    }
    // Every open model has its one thread; the rest go by largest remainder of the
    // proportional share.
    let total: f64 = open.iter().map(|&i| weight_bytes[i].max(1) as f64).sum();
    let spare = left - open.len();
    let share = |i: usize| spare as f64 * weight_bytes[i].max(1) as f64 / total;
    for &i in &open {
        budget[i] += share(i).floor() as usize;
    }
    let given: usize = open.iter().map(|&i| budget[i] - 1).sum();
    let mut by_remainder = open.clone();
    by_remainder.sort_by(|&a, &b| {
        let frac = |i: usize| share(i) - share(i).floor();
        frac(b).total_cmp(&frac(a)).then(a.cmp(&b))
    });
    for &i in by_remainder.iter().take(spare - given) {
        budget[i] += 1;
    }
    budget
}

#[cfg(test)]
mod tests {
    use super::thread_budget;
    use crate::config::CoreSplit;

    fn by_size(requested: &[Option<usize>], bytes: &[usize], cores: usize) -> Vec<usize> {
        thread_budget(requested, bytes, cores, CoreSplit::BySize)
    }

    #[test]
    fn shared_gives_every_core_to_each_model_without_a_request() {
        let shared = |r: &[Option<usize>]| thread_budget(r, &[400, 1000], 16, CoreSplit::Shared);
        assert_eq!(shared(&[None, None]), vec![16, 16]);
        assert_eq!(shared(&[Some(4), None]), vec![4, 16]);
        assert_eq!(thread_budget(&[None], &[1], 0, CoreSplit::Shared), vec![1]);
    }

    #[test]
    fn splits_the_cores_by_weight_bytes() {
        // The shipped pair: ~0.4 GB and ~1 GB.
        assert_eq!(by_size(&[None, None], &[400, 1000], 2), vec![1, 1]);
        assert_eq!(by_size(&[None, None], &[400, 1000], 16), vec![5, 11]);
        assert_eq!(by_size(&[None, None], &[400, 1000], 3), vec![1, 2]);
        assert_eq!(by_size(&[None], &[400], 8), vec![8]);
        let three = by_size(&[None, None, None], &[1, 1, 1], 8);
        assert_eq!(three.iter().sum::<usize>(), 8);
        assert!(three.iter().all(|&t| (2..=3).contains(&t)));
    }

    #[test]
    fn requests_are_kept_and_the_rest_is_shared() {
        assert_eq!(by_size(&[Some(2), None], &[400, 1000], 8), vec![2, 6]);
        assert_eq!(by_size(&[Some(3), Some(3)], &[400, 1000], 2), vec![3, 3]);
        // Nothing left: the open model still gets one thread.
        assert_eq!(by_size(&[Some(2), None], &[400, 1000], 2), vec![2, 1]);
    }

    #[test]
    fn more_models_than_cores_get_one_each() {
        assert_eq!(by_size(&[None, None, None], &[5, 1, 1], 2), vec![1, 1, 1]);
        assert_eq!(by_size(&[None, None], &[0, 0], 1), vec![1, 1]);
    }
}
