//! One step of a model worker: plan, forward, sample, route the whole batch, then commit,
//! hand off or finish each request.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::Tensor;

use super::*;
use crate::model::runner::with_f32_values;

/// Owned routing features of one batch.
#[derive(Default)]
struct Features {
    entropy: Vec<f32>,
    hidden: Vec<f32>,
    token_embedding: Vec<f32>,
    top_logits: Vec<f32>,
    max_prob: Vec<f32>,
}

impl Features {
    fn view(&self) -> BatchFeatures<'_> {
        BatchFeatures {
            entropy: &self.entropy,
            hidden: &self.hidden,
            token_embedding: &self.token_embedding,
            top_logits: &self.top_logits,
            max_prob: &self.max_prob,
        }
    }
}

/// A sampled request of the batch, with its logits row.
struct Sampled {
    id: RequestId,
    row: usize,
    token: u32,
    /// The distribution it was drawn from, when the router keeps it.
    dist: Option<Distribution>,
}

/// Draws the next token from `row` for a request whose committed output is `output`: from
/// the whole distribution, kept, when `keep` and sampling at temperature > 0.
fn draw(
    sampler: &mut Sampler,
    row: &[f32],
    prompt: &[u32],
    output: &[u32],
    keep: bool,
) -> (u32, Option<Distribution>) {
    if keep && sampler.params().temperature > 0.0 {
        let dist = sampler.distribution(row, prompt, output);
        (sampler.draw(&dist), Some(dist))
    } else {
        (sampler.sample(row, prompt, output), None)
    }
}

impl ModelWorker {
    /// Runs one step, planned now from whatever is ready (the device granted it, or, in
    /// lock-step, an empty round is due); in lock-step, finishes this model's round.
    pub fn step(&mut self) {
        let plan = self.sched.schedule();
        if !plan.items.is_empty() {
            let done = self.forward(&plan).and_then(|(logits, hidden)| {
                with_f32_values(&logits, |logits| self.after_forward(&plan, logits, &hidden))
                    .map_err(|e| format!("logits of model '{}': {e}", self.name))
            });
            if let Err(message) = done {
                self.fail_plan(&plan, &message);
            }
            self.sched.publish_prefixes(&self.prefixes);
        }
        if self.stepping == Stepping::Sync {
            let round = self.lockstep.finish_round(plan.items.is_empty());
            for peer in self.peers() {
                self.send(peer, PeerBody::RoundDone(round));
            }
        }
    }

    /// Runs the batch over the blocks the scheduler assigned; returns the logits of the
    /// sampling items, `[sampling items, vocab]` in plan order (read in place by
    /// [`with_f32_values`]), and (when the router reads them) their hidden states,
    /// `[sampling items, hidden]`. A panic inside the model is caught and reported like an
    /// error.
    fn forward(&mut self, plan: &Plan) -> Result<(Tensor, Vec<f32>), String> {
        let inputs: Vec<SeqInput> = plan
            .items
            .iter()
            .map(|item| {
                let local = &self.requests[&item.id];
                SeqInput {
                    tokens: &local.tokens[item.start..item.start + item.num_tokens],
                    start_pos: item.start,
                    blocks: self.sched.blocks(item.id),
                    logits: item.logits,
                }
            })
            .collect();
        let model = &self.model.model;
        let kv = &mut self.kv;
        #[cfg(feature = "failpoints")]
        let failpoint = self.failpoint;
        let want_hidden = self.router.needs().hidden;
        type Out = (Tensor, Vec<f32>);
        let run = catch_unwind(AssertUnwindSafe(|| -> crate::model::Result<Out> {
            #[cfg(feature = "failpoints")]
            if let Some(t) = failpoint.filter(|t| inputs.iter().any(|i| i.tokens.contains(t))) {
                panic!("failpoint: token {t} reached the forward pass");
            }
            let out = model.forward(&inputs, kv, want_hidden)?;
            let hidden = match out.hidden {
                Some(h) => h.flatten_all()?.to_vec1::<f32>()?,
                None => Vec::new(),
            };
            Ok((out.logits, hidden))
        }));
        self.stats.steps += 1;
        self.stats.batched_requests += plan.items.len() as u64;
        let unsampled = plan
            .items
            .iter()
            .map(|i| i.num_tokens.saturating_sub(i.logits));
        self.stats.extend_tokens += unsampled.sum::<usize>() as u64;
        match run {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(format!("forward pass of model '{}' failed: {e}", self.name)),
            Err(panic) => Err({
                self.mark_unhealthy();
                format!(
                    "forward pass of model '{}' panicked: {}",
                    self.name,
                    panic_message(&panic)
                )
            }),
        }
    }

    fn after_forward(&mut self, plan: &Plan, logits: &[f32], hidden: &[f32]) {
        self.sched.advance(plan);
        let vocab = self.model.model.config().vocab_size;
        let keep = self.router.needs().distribution;
        let mut sampled = Vec::new();
        let mut first = 0;
        for item in plan.items.iter().filter(|item| item.logits > 0) {
            let rows = first..first + item.logits;
            first = rows.end;
            let local = self.requests.get_mut(&item.id).expect("planned request");
            if local.drafts > 0 && local.drafter != self.index {
                sampled.extend(self.verify(item.id, rows.start, logits));
                continue;
            }
            let row = rows.end - 1;
            let (prompt, output) = local.tokens.split_at(local.meta.prompt_len);
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            let (token, dist) = draw(&mut local.sampler, row_logits, prompt, output, keep);
            sampled.push(Sampled {
                id: item.id,
                row,
                token,
                dist,
            });
        }
        let buffers = self.batch_features(logits, hidden, &sampled);
        let views: Vec<StepView> = sampled
            .iter()
            .map(|s| {
                let local = &self.requests[&s.id];
                StepView {
                    request: s.id,
                    model: self.index,
                    token: s.token,
                    tokens_here: local.tokens_here,
                    generated: local.generated(),
                    carried: local.carried,
                    drafts: local.drafts,
                    speculation: local.speculation,
                }
            })
            .collect();
        for s in &sampled {
            if let Some(local) = self.requests.get_mut(&s.id) {
                local.carried = None;
            }
        }
        let features = buffers.view();
        let mut routes = Vec::with_capacity(views.len());
        self.router
            .route(self.index, &features, &views, &mut routes);
        if let Some(online) = self.online.as_mut() {
            let here = self.index;
            let moves = routes
                .iter()
                .filter(|r| match **r {
                    Route::Move(to) | Route::Pass { to, .. } => to != here,
                    Route::Decide { next, .. } => next != here,
                    Route::Draft { verifier, send } => send && verifier != here,
                    Route::Stay => false,
                })
                .count();
            online.observe(routes.len(), moves);
        }
        for ((s, view), route) in sampled.into_iter().zip(&views).zip(routes) {
            self.apply_route(s.id, view, route, s.dist);
        }
    }

    /// Verifies the drafts `id` brought (speculative decoding) against this model's logits
    /// rows `first..=first + drafts`: commits the longest prefix this model's sampling
    /// accepts, takes the rest back from the KV cache, and returns the token of its own that
    /// follows (drawn in place of the first rejected draft, or after the last accepted one)
    /// with its row; `None` when the request ended on an accepted draft.
    fn verify(&mut self, id: RequestId, first: usize, logits: &[f32]) -> Option<Sampled> {
        let vocab = self.model.model.config().vocab_size;
        let keep = self.router.needs().distribution;
        let local = self.requests.get_mut(&id)?;
        let k = local.drafts;
        let committed = local.tokens.len() - k;
        let drafts = local.tokens.split_off(committed);
        let dists = std::mem::take(&mut local.dists);
        local.drafts = 0;
        // Drafts drawn at temperature > 0 come with their distribution; greedy ones are
        // accepted when they are this model's greedy token.
        let sampling = local.sampler.params().temperature > 0.0 && dists.len() == k;
        let mut accepted = 0;
        let (token, dist) = loop {
            let row = &logits[(first + accepted) * vocab..(first + accepted + 1) * vocab];
            let (prompt, output) = local.tokens.split_at(local.meta.prompt_len);
            let Some(&draft) = drafts.get(accepted) else {
                break draw(&mut local.sampler, row, prompt, output, keep);
            };
            let replaced = if sampling {
                let p = local.sampler.distribution(row, prompt, output);
                local.sampler.verify(&p, &dists[accepted], draft)
            } else {
                let own = local.sampler.sample(row, prompt, output);
                (own != draft).then_some(own)
            };
            match replaced {
                Some(own) => break (own, None),
                None => {
                    local.tokens.push(draft);
                    accepted += 1;
                }
            }
        };
        local.tokens.truncate(committed);
        local.speculation.record(k, accepted);
        let (sink, drafter) = (local.meta.sink.clone(), local.drafter);
        self.sched.rollback(id, committed + accepted);
        let event = TokenEvent::Verified {
            model: self.index,
            drafted: k,
            accepted,
        };
        if !sink.send(event) {
            self.end(id);
            return None;
        }
        for &draft in &drafts[..accepted] {
            if !self.commit(id, draft, drafter) {
                return None;
            }
        }
        Some(Sampled {
            id,
            row: first + accepted,
            token,
            dist,
        })
    }

    /// The routing features the router asked for, for the sampled rows only, each computed
    /// once for the whole batch.
    fn batch_features(&self, logits: &[f32], hidden: &[f32], sampled: &[Sampled]) -> Features {
        let needs = self.router.needs();
        let config = self.model.model.config();
        let (vocab, width) = (config.vocab_size, config.hidden_size);
        let rows: Vec<usize> = sampled.iter().map(|s| s.row).collect();
        let mut f = Features::default();
        if needs.entropy {
            f.entropy = vec![0.0; rows.len()];
            entropy_rows(logits, vocab, &rows, &mut f.entropy);
        }
        if needs.max_prob {
            f.max_prob = vec![0.0; rows.len()];
            max_prob_rows(logits, vocab, &rows, &mut f.max_prob);
        }
        if needs.top_logits > 0 {
            f.top_logits = vec![0.0; rows.len() * needs.top_logits];
            top_logits_rows(logits, vocab, &rows, needs.top_logits, &mut f.top_logits);
        }
        if needs.hidden && hidden.len() >= (rows.iter().max().map_or(0, |r| r + 1)) * width {
            f.hidden = rows
                .iter()
                .flat_map(|&r| &hidden[r * width..(r + 1) * width])
                .copied()
                .collect();
        }
        if needs.token_embedding {
            let tokens: Vec<u32> = sampled.iter().map(|s| s.token).collect();
            f.token_embedding = self.model.model.embed(&tokens).unwrap_or_else(|e| {
                tracing::error!(model = %self.name, "token embeddings for routing: {e}");
                Vec::new()
            });
        }
        f
    }

    fn apply_route(
        &mut self,
        id: RequestId,
        view: &StepView,
        route: Route,
        dist: Option<Distribution>,
    ) {
        let peer = |to: ModelIndex| to != self.index && to < self.unsent.len();
        // Where the request goes, what it commits first (token, producing model) and what it
        // carries along.
        let (to, commit, carried) = match route {
            Route::Move(to) if peer(to) => {
                let keep = self.router.send(self.index, to, view).keep_token;
                (to, keep.then_some((view.token, self.index)), None)
            }
            Route::Pass { to, best } if peer(to) => (to, None, Some(best)),
            Route::Decide { best, next } if peer(next) => {
                (next, Some((best.token, best.model)), None)
            }
            Route::Decide { best, .. } => return self.commit_here(id, best.token, best.model),
            Route::Draft { verifier, send } if peer(verifier) => {
                return self.draft(id, view.token, dist, verifier, send)
            }
            _ => return self.commit_here(id, view.token, self.index),
        };
        if let Some((token, model)) = commit {
            if !self.commit(id, token, model) {
                return;
            }
        }
        self.hand_off(id, to, carried);
    }

    /// Moves `id` to the peer `to` with its tokens (and drafts), carrying `carried`; it
    /// stays pending here with its blocks.
    fn hand_off(&mut self, id: RequestId, to: ModelIndex, carried: Option<Candidate>) {
        let local = self.requests.get_mut(&id).expect("routed request");
        self.sched.leave(id, local.known(self.index));
        let handoff = Handoff {
            meta: local.meta.clone(),
            tokens: local.tokens.clone(),
            carried,
            drafts: local.drafts,
            dists: std::mem::take(&mut local.dists),
            speculation: local.speculation,
        };
        if !local.meta.sink.send(TokenEvent::Moved {
            from: self.index,
            to,
        }) {
            return self.end(id);
        }
        self.stats.handoffs_out += 1;
        self.handed[to] += 1;
        self.send(to, PeerBody::Handoff(handoff));
    }

    /// Keeps `token` as a draft of `id`: not committed, not shown to the client. The drafts
    /// go to `verifier` when `send`, or when this one could end the request (a stop token,
    /// `max_tokens` or the length limit reached), since a verifier commits nothing past it.
    fn draft(
        &mut self,
        id: RequestId,
        token: u32,
        dist: Option<Distribution>,
        verifier: ModelIndex,
        send: bool,
    ) {
        let local = self.requests.get_mut(&id).expect("routed request");
        local.tokens.push(token);
        local.drafts += 1;
        local.drafter = self.index;
        local.dists.extend(dist);
        let meta = &local.meta;
        let ends = meta.stop_ids.contains(&token)
            || local.tokens.len() - meta.prompt_len >= meta.max_tokens
            || local.tokens.len() + 1 >= self.max_len;
        if send || ends {
            self.hand_off(id, verifier, None);
        } else {
            self.sched.commit(id, local.known(self.index));
        }
    }

    /// Commits `token` (produced by `model`) and keeps the request here.
    fn commit_here(&mut self, id: RequestId, token: u32, model: ModelIndex) {
        if self.commit(id, token, model) {
            self.sched.commit(id, &self.requests[&id].tokens);
        }
    }

    /// Commits `token` (produced by `model`) for `id` and reports it; ends the request on a
    /// stop token, at its length limit, or when nobody listens. Returns whether the request
    /// goes on.
    fn commit(&mut self, id: RequestId, token: u32, model: ModelIndex) -> bool {
        let local = self.requests.get_mut(&id).expect("sampled request");
        local.tokens.push(token);
        local.tokens_here += 1;
        self.stats.tokens_committed += 1;
        let meta = local.meta.clone();
        let generated = local.tokens.len() - meta.prompt_len;
        if !meta.sink.send(TokenEvent::Token { token, model }) {
            self.end(id);
            return false;
        }
        let full = local.tokens.len() >= self.max_len;
        let reason = match FinishReason::after(token, generated, &meta.stop_ids, meta.max_tokens) {
            Some(reason) => reason,
            None if full => FinishReason::Length,
            None => return true,
        };
        meta.sink.send(TokenEvent::Finished { reason });
        self.end(id);
        false
    }

    fn fail_plan(&mut self, plan: &Plan, message: &str) {
        tracing::error!(model = %self.name, requests = plan.items.len(), "{message}");
        for item in &plan.items {
            if let Some(local) = self.requests.get(&item.id) {
                local.meta.sink.send(TokenEvent::Failed {
                    message: message.to_string(),
                });
            }
            self.end(item.id);
        }
    }
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
