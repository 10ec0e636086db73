//! A request's progress as plain data: detokenizer, stop conditions, timing and attribution.

use super::*;

pub struct RequestState {
    shared: Arc<RuntimeShared>,
    decoder: IncrementalDecoder,
    stop: Vec<String>,
    /// Decoded text not shown yet because it may begin a stop string.
    held: String,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    prompt_tokens: usize,
    tokens_per_model: Vec<usize>,
    completion_tokens: usize,
    handoffs: usize,
    speculation: Speculation,
    started: Instant,
    first_token: Option<Instant>,
}

impl RequestState {
    pub fn new(
        shared: Arc<RuntimeShared>,
        meta: &RequestMeta,
        stop: Vec<String>,
        now: Instant,
    ) -> Self {
        Self {
            tokens_per_model: vec![0; shared.models.len()],
            shared,
            decoder: IncrementalDecoder::new(),
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stop_ids: meta.stop_ids.clone(),
            max_tokens: meta.max_tokens,
            prompt_tokens: meta.prompt_len,
            completion_tokens: 0,
            handoffs: 0,
            speculation: Speculation::default(),
            started: now,
            first_token: None,
        }
    }

    pub fn on_moved(&mut self) {
        self.handoffs += 1;
    }

    /// A verifier examined `drafted` drafts and accepted the first `accepted`.
    pub fn on_verified(&mut self, drafted: usize, accepted: usize) {
        self.speculation.record(drafted, accepted);
    }

    /// Takes one committed token: the text it makes final, and the summary when it ends the
    /// request (an end-of-sequence token, a stop string, or `max_tokens`).
    pub fn on_token(
        &mut self,
        token: u32,
        model: ModelIndex,
        now: Instant,
    ) -> (RequestEvent, Option<Summary>) {
        self.first_token.get_or_insert(now);
        self.completion_tokens += 1;
        if let Some(n) = self.tokens_per_model.get_mut(model) {
            *n += 1;
        }
        let piece = self
            .decoder
            .push(&self.shared.lead.tokenizer, token)
            .unwrap_or_default();
        self.held.push_str(&piece);
        let tokens = vec![(token, model)];
        if let Some((at, stop)) = self.find_stop() {
            let text = self.held[..at].to_string();
            self.held.clear();
            let mut summary = self.summary(FinishReason::Stop, now);
            summary.stop = Some(stop);
            return (RequestEvent::Text { text, tokens }, Some(summary));
        }
        let reason = FinishReason::after(
            token,
            self.completion_tokens,
            &self.stop_ids,
            self.max_tokens,
        );
        if let Some(reason) = reason {
            let (text, summary) = self.finish(reason, now);
            let text = match text {
                Some(RequestEvent::Text { text, .. }) => text,
                _ => String::new(),
            };
            return (RequestEvent::Text { text, tokens }, Some(summary));
        }
        let keep = self.stop_prefix_len();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (RequestEvent::Text { text, tokens }, None)
    }

    /// The request ended for `reason`: the text still held back (if any) and the summary.
    pub fn finish(
        &mut self,
        reason: FinishReason,
        now: Instant,
    ) -> (Option<RequestEvent>, Summary) {
        let rest = self
            .decoder
            .flush(&self.shared.lead.tokenizer)
            .unwrap_or_default();
        self.held.push_str(&rest);
        let text = std::mem::take(&mut self.held);
        let event = (!text.is_empty()).then(|| RequestEvent::Text {
            text,
            tokens: Vec::new(),
        });
        (event, self.summary(reason, now))
    }

    fn summary(&self, finish: FinishReason, now: Instant) -> Summary {
        Summary {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            finish,
            stop: None,
            tokens_per_model: self.tokens_per_model.clone(),
            handoffs: self.handoffs,
            speculation: self.speculation,
            ttft: self.first_token.map(|t| t - self.started),
            e2e: now - self.started,
        }
    }

    /// The earliest stop string in the held text: its byte offset and the string.
    fn find_stop(&self) -> Option<(usize, String)> {
        self.stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s.clone())))
            .min_by_key(|(at, _)| *at)
    }

    /// Length of the longest tail of the held text that begins some stop string.
    fn stop_prefix_len(&self) -> usize {
        let held = &self.held;
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        (1..longest.min(held.len() + 1))
            .rev()
            .find(|&k| {
                let at = held.len() - k;
                held.is_char_boundary(at) && self.stop.iter().any(|s| s.starts_with(&held[at..]))
            })
            .unwrap_or(0)
    }
}
