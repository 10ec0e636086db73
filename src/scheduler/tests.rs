use super::*;

fn limits(num_blocks: usize) -> SchedulerLimits {
    SchedulerLimits {
        block_size: 4,
        num_blocks,
        max_batch_tokens: 16,
        max_batch_requests: 8,
    }
}

/// Runs a plan as the model actor would: compute, then commit every sampled request.
fn run(s: &mut Scheduler, now: Instant) -> Plan {
    let plan = s.schedule();
    s.advance(&plan);
    for item in plan.items.iter().filter(|i| i.samples) {
        s.commit(item.id, now);
    }
    plan
}

#[test]
fn decodes_go_first_and_prefill_is_chunked_by_the_token_budget() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(64));
    s.add(1, 5, now);
    run(&mut s, now);
    s.add(2, 40, now);
    let plan = s.schedule();
    assert_eq!(
        plan.items[0],
        PlanItem {
            id: 1,
            start: 5,
            num_tokens: 1,
            samples: true
        }
    );
    assert_eq!(
        plan.items[1],
        PlanItem {
            id: 2,
            start: 0,
            num_tokens: 15,
            samples: false
        }
    );
    s.advance(&plan);
    s.commit(1, now);
    let plan = s.schedule();
    assert_eq!(plan.items[1].start, 15);
    assert_eq!(plan.items.iter().map(|i| i.num_tokens).sum::<usize>(), 16);
}

#[test]
fn pending_request_keeps_its_blocks_and_extends_only_the_new_tokens() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(16));
    s.add(7, 6, now);
    let plan = s.schedule();
    s.advance(&plan);
    s.leave(7, false);
    assert_eq!(s.stats().free_blocks, 14);
    assert!(
        s.schedule().items.is_empty(),
        "a pending request is not scheduled"
    );
    s.resume(7, 9, false, now);
    let plan = s.schedule();
    assert_eq!(
        plan.items,
        [PlanItem {
            id: 7,
            start: 6,
            num_tokens: 3,
            samples: true
        }]
    );
    assert_eq!(s.stats().free_blocks, 13);
}

#[test]
fn kept_token_is_counted_and_recompute_drops_the_prefix() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(16));
    s.add(1, 4, now);
    run(&mut s, now);
    s.leave(1, true);
    s.resume(1, 8, true, now);
    assert_eq!(s.computed(1), 0);
    assert_eq!(s.schedule().items[0].num_tokens, 8);
}

#[test]
fn pending_requests_are_preempted_before_ready_ones() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(4));
    s.add(1, 8, now); // 2 blocks
    s.add(2, 4, now); // 1 block
    run(&mut s, now);
    s.leave(2, false);
    s.add(3, 8, now);
    let plan = s.schedule();
    assert_eq!(plan.preempted, [2]);
    assert!(plan.items.iter().any(|i| i.id == 3 && i.start == 0));
    s.advance(&plan);
    s.resume(2, 5, false, now);
    assert_eq!(
        s.computed(2),
        0,
        "a preempted request recomputes its prefix"
    );
}

#[test]
fn newer_requests_are_preempted_for_older_ones_never_the_reverse() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(4));
    s.add(1, 8, now);
    s.add(2, 8, now);
    run(&mut s, now); // both prefilled: 2 blocks each, 9 tokens each now
    let plan = s.schedule(); // both decode position 8: each needs a third block
    assert_eq!(plan.preempted, [2]);
    assert_eq!(
        plan.items,
        [
            PlanItem {
                id: 1,
                start: 8,
                num_tokens: 1,
                samples: true
            },
            // The preempted request recomputes what fits in the block that is left.
            PlanItem {
                id: 2,
                start: 0,
                num_tokens: 4,
                samples: false
            },
        ]
    );
    assert_eq!(s.stats().free_blocks, 0);
}

#[test]
fn blocks_return_to_the_pool_whatever_the_path() {
    let now = Instant::now();
    let mut s = Scheduler::new(limits(8));
    for id in 0..6 {
        s.add(id, 3 + id as usize, now);
    }
    for step in 0..20 {
        let plan = run(&mut s, now);
        if step == 3 {
            s.leave(plan.items[0].id, true);
        }
        if step == 5 {
            s.finish(plan.items[0].id);
        }
    }
    for id in 0..6 {
        s.finish(id);
    }
    assert!(s.is_empty());
    assert_eq!(s.stats().free_blocks, 8);
}

#[test]
fn a_request_larger_than_free_memory_is_prefilled_in_chunks_that_fit() {
    let now = Instant::now();
    let mut s = Scheduler::new(SchedulerLimits {
        max_batch_tokens: 64,
        ..limits(3)
    });
    s.add(1, 4, now);
    run(&mut s, now);
    s.add(2, 12, now);
    let plan = s.schedule();
    let item = plan.items.iter().find(|i| i.id == 2).unwrap();
    assert_eq!((item.num_tokens, item.samples), (4, false));
    assert!(plan.preempted.is_empty());
}

#[test]
fn ready_counts_and_the_oldest_wait() {
    let t0 = Instant::now();
    let t1 = t0 + std::time::Duration::from_millis(5);
    let mut s = Scheduler::new(limits(8));
    assert_eq!(s.ready(), (0, None));
    s.add(1, 3, t1);
    s.add(2, 3, t0);
    assert_eq!(s.ready(), (2, Some(t0)));
    s.leave(2, false);
    assert_eq!(s.ready(), (1, Some(t1)));
}
