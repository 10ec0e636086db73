use std::collections::HashMap;

use super::*;

fn limits(num_blocks: usize) -> SchedulerLimits {
    SchedulerLimits {
        block_size: 4,
        num_blocks,
        max_batch_tokens: 16,
        max_batch_requests: 8,
    }
}

/// A scheduler plus the token sequences a model actor would hold.
struct Sim {
    s: Scheduler,
    tokens: HashMap<RequestId, Vec<u32>>,
    now: Instant,
}

impl Sim {
    fn new(limits: SchedulerLimits) -> Self {
        Self {
            s: Scheduler::new(limits),
            tokens: HashMap::new(),
            now: Instant::now(),
        }
    }

    /// A request with `n` tokens unique to it.
    fn add(&mut self, id: RequestId, n: usize) {
        self.add_tokens(id, (0..n as u32).map(|i| id as u32 * 1000 + i).collect());
    }

    fn add_tokens(&mut self, id: RequestId, tokens: Vec<u32>) {
        self.s.add(id, &tokens, self.now);
        self.tokens.insert(id, tokens);
    }

    /// Computes a plan and commits a token for every sampled request.
    fn run(&mut self) -> Plan {
        let plan = self.s.schedule();
        self.s.advance(&plan);
        for item in plan.items.iter().filter(|i| i.logits > 0) {
            self.push(item.id);
            self.s.commit(item.id, &self.tokens[&item.id]);
        }
        plan
    }

    fn push(&mut self, id: RequestId) {
        let t = self.tokens.get_mut(&id).unwrap();
        t.push(id as u32 * 1000 + t.len() as u32);
    }

    fn leave(&mut self, id: RequestId, keep: bool) {
        if keep {
            self.push(id);
        }
        self.s.leave(id, &self.tokens[&id]);
    }

    /// Comes back after the peer produced `extra` tokens.
    fn resume(&mut self, id: RequestId, extra: usize, recompute: bool) {
        for _ in 0..extra {
            self.push(id);
        }
        self.s.resume(id, &self.tokens[&id], recompute, self.now);
    }
}

fn item(id: RequestId, start: usize, num_tokens: usize, samples: bool) -> PlanItem {
    PlanItem {
        id,
        start,
        num_tokens,
        logits: samples as usize,
    }
}

#[test]
fn decodes_go_first_and_prefill_is_chunked_by_the_token_budget() {
    let mut sim = Sim::new(limits(64));
    sim.add(1, 5);
    sim.run();
    sim.add(2, 40);
    let plan = sim.run();
    assert_eq!(plan.items, [item(1, 5, 1, true), item(2, 0, 15, false)]);
    let plan = sim.run();
    assert_eq!(plan.items, [item(1, 6, 1, true), item(2, 15, 15, false)]);
}

#[test]
fn pending_request_keeps_its_blocks_and_extends_only_the_new_tokens() {
    let mut sim = Sim::new(limits(16));
    sim.add(7, 6);
    let plan = sim.s.schedule();
    sim.s.advance(&plan);
    sim.leave(7, false);
    assert_eq!(sim.s.stats().free_blocks, 14);
    assert!(
        sim.s.schedule().items.is_empty(),
        "a pending request is not scheduled"
    );
    sim.resume(7, 3, false);
    assert_eq!(sim.s.schedule().items, [item(7, 6, 3, true)]);
    assert_eq!(sim.s.stats().free_blocks, 13);
}

#[test]
fn kept_token_is_counted_and_recompute_drops_the_prefix() {
    let mut sim = Sim::new(limits(16));
    sim.add(1, 5);
    sim.run();
    sim.leave(1, true);
    sim.resume(1, 2, true);
    assert_eq!(sim.s.computed(1), 0);
    // The first block is still cached: only the rest is computed again.
    assert_eq!(sim.s.schedule().items, [item(1, 4, 5, true)]);
}

#[test]
fn pending_requests_are_preempted_before_ready_ones() {
    let mut sim = Sim::new(limits(4));
    sim.add(1, 8); // 2 blocks, then a third for its next token
    sim.add(2, 3); // 1 block
    sim.run();
    sim.leave(2, false);
    sim.add(3, 3);
    let plan = sim.s.schedule();
    assert_eq!(plan.preempted, [2]);
    assert_eq!(plan.items, [item(1, 8, 1, true), item(3, 0, 3, true)]);
    sim.s.advance(&plan);
    sim.resume(2, 2, false);
    assert_eq!(
        sim.s.computed(2),
        0,
        "a preempted request recomputes its prefix"
    );
}

#[test]
fn newer_requests_are_preempted_for_older_ones_never_the_reverse() {
    let mut sim = Sim::new(limits(4));
    sim.add(1, 7);
    sim.add(2, 7);
    sim.run(); // both prefilled: 2 blocks each, 8 tokens each now
    sim.run(); // both decode position 7, still in their second block
    let plan = sim.s.schedule(); // position 8 needs a third block each
    assert_eq!(plan.preempted, [2]);
    assert_eq!(plan.items, [item(1, 8, 1, true)]);
    // The preempted request's tail block was evicted for request 1; its head is still cached
    // and taken back, so only the tail will be recomputed once memory allows.
    assert_eq!(sim.s.computed(2), 4);
    assert_eq!(sim.s.stats().free_blocks, 0);
}

#[test]
fn blocks_return_to_the_pool_whatever_the_path() {
    let mut sim = Sim::new(limits(8));
    for id in 0..6 {
        sim.add(id, 3 + id as usize);
    }
    for step in 0..20 {
        let plan = sim.run();
        if step == 3 {
            sim.leave(plan.items[0].id, true);
        }
        if step == 5 {
            sim.s.finish(plan.items[0].id);
        }
    }
    for id in 0..6 {
        sim.s.finish(id);
    }
    assert!(sim.s.is_empty());
    assert_eq!(sim.s.stats().free_blocks, 8);
}

#[test]
fn a_request_larger_than_free_memory_is_prefilled_in_chunks_that_fit() {
    let mut sim = Sim::new(SchedulerLimits {
        max_batch_tokens: 64,
        ..limits(3)
    });
    sim.add(1, 4);
    sim.run();
    sim.add(2, 12);
    let plan = sim.s.schedule();
    assert_eq!(
        plan.items.iter().find(|i| i.id == 2),
        Some(&item(2, 0, 4, false))
    );
    assert!(plan.preempted.is_empty());
}

#[test]
fn a_shared_prompt_prefix_is_computed_once() {
    let mut sim = Sim::new(limits(16));
    let prompt: Vec<u32> = (0..10).collect();
    sim.add_tokens(1, prompt.clone());
    sim.run();
    let mut other = prompt[..9].to_vec();
    other.push(99);
    sim.add_tokens(2, other);
    sim.add_tokens(3, prompt[..8].to_vec());
    let plan = sim.s.schedule();
    // Two full blocks (8 tokens) are shared; an exact 8-token prompt still computes its last
    // token, so it reuses one block.
    assert_eq!(plan.items[1..], [item(2, 8, 2, true), item(3, 4, 4, true)]);
    assert_eq!(sim.s.blocks(2)[..2], sim.s.blocks(1)[..2]);
    assert_eq!(sim.s.stats().prefix_hit_tokens, 12);
}

#[test]
fn ready_counts_and_the_oldest_wait() {
    let t0 = Instant::now();
    let t1 = t0 + std::time::Duration::from_millis(5);
    let mut s = Scheduler::new(limits(8));
    assert_eq!(s.ready(), (0, None));
    s.add(1, &[1, 2, 3], t1);
    s.add(2, &[4, 5, 6], t0);
    assert_eq!(s.ready(), (2, Some(t0)));
    s.leave(2, &[4, 5, 6]);
    assert_eq!(s.ready(), (1, Some(t1)));
}

#[test]
fn a_request_that_stays_keeps_the_start_of_its_visit() {
    let t0 = Instant::now();
    let later = t0 + std::time::Duration::from_millis(50);
    let mut s = Scheduler::new(limits(8));
    s.add(1, &[1, 2, 3], t0);
    let plan = s.schedule();
    s.advance(&plan);
    s.commit(1, &[1, 2, 3, 4]);
    assert_eq!(
        s.ready(),
        (1, Some(t0)),
        "a decode step does not start a new visit"
    );
    s.leave(1, &[1, 2, 3, 4]);
    s.resume(1, &[1, 2, 3, 4, 5], false, later);
    assert_eq!(s.ready(), (1, Some(later)), "the return from a peer does");
}

fn drafted(tokens: &[u32], drafts: usize) -> Known<'_> {
    Known {
        tokens,
        drafts,
        logits: drafts + 1,
    }
}

#[test]
fn drafts_to_verify_are_computed_in_one_chunk_with_their_logits() {
    let mut s = Scheduler::new(limits(16));
    let tokens: Vec<u32> = (0..20).collect();
    // 20 tokens, the last 5 drafts: with a 16-token budget the first chunk stops before the
    // 6 positions whose logits are wanted, the second computes them all.
    s.add(1, drafted(&tokens, 5), Instant::now());
    let plan = s.schedule();
    assert_eq!(plan.items, [item(1, 0, 14, false)]);
    s.advance(&plan);
    let plan = s.schedule();
    assert_eq!(
        plan.items,
        [PlanItem {
            id: 1,
            start: 14,
            num_tokens: 6,
            logits: 6,
        }]
    );
}

#[test]
fn rollback_drops_rejected_drafts_and_their_blocks_and_never_caches_drafts() {
    let mut s = Scheduler::new(limits(16));
    let tokens: Vec<u32> = (0..10).collect();
    // 10 tokens of which the last 6 are drafts: only the first block holds committed tokens.
    s.add(1, drafted(&tokens, 6), Instant::now());
    let plan = s.schedule();
    s.advance(&plan);
    assert_eq!(s.computed(1), 10);
    assert_eq!(s.blocks(1).len(), 3);
    assert_eq!(s.stats().free_blocks, 13);
    // Two drafts accepted: positions 0..6 stay, the rest goes, and the third block with it.
    s.rollback(1, 6);
    assert_eq!(s.computed(1), 6);
    assert_eq!(s.blocks(1).len(), 2);
    assert_eq!(s.stats().free_blocks, 14);
    // The next token (the verifier's own) is committed; only it is computed next.
    let mut kept = tokens[..6].to_vec();
    kept.push(77);
    s.commit(1, &kept);
    assert_eq!(s.schedule().items, [item(1, 6, 1, true)]);
    // A second request with the drafted tokens as its prompt finds only the committed block
    // cached: the second block held drafts when it filled.
    s.add(2, &tokens, Instant::now());
    s.schedule();
    assert_eq!(s.stats().prefix_hit_tokens, 4);
}

#[test]
fn rollback_into_a_cached_block_gives_it_back_whole() {
    let mut sim = Sim::new(limits(16));
    sim.add(1, 9);
    sim.run();
    // Blocks 0 and 1 are full and indexed; taking back to position 6 cannot write into
    // block 1 again, so it goes back and positions 4..6 are computed again.
    sim.s.rollback(1, 6);
    assert_eq!(sim.s.computed(1), 4);
    assert_eq!(sim.s.blocks(1).len(), 1);
    sim.tokens.get_mut(&1).unwrap().truncate(6);
    sim.s.commit(1, &sim.tokens[&1]);
    assert_eq!(sim.s.schedule().items, [item(1, 4, 2, true)]);
}

#[test]
fn a_request_handed_back_fewer_tokens_than_it_computed_computes_its_last_again() {
    let mut sim = Sim::new(limits(16));
    sim.add(1, 6);
    sim.run();
    // 7 tokens known, 6 computed; a peer hands back only the first 5.
    sim.s.leave(1, &sim.tokens[&1]);
    sim.s.rollback(1, 5);
    sim.tokens.get_mut(&1).unwrap().truncate(5);
    sim.s.resume(1, &sim.tokens[&1], false, sim.now);
    assert_eq!(sim.s.schedule().items, [item(1, 4, 1, true)]);
}
