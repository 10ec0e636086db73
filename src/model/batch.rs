//! What a forward pass is asked to compute: one [`SeqInput`] per sequence of the batch. A leaf
//! of the model layer: the decoder and every backend read it.

/// One sequence of a forward batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// KV block ids of the sequence, in order (from the block allocator,
    /// `scheduler::BlockPool`); must already hold `start_pos + tokens.len()` positions.
    pub blocks: &'a [u32],
    /// How many of the last new positions the caller reads the logits (and hidden states)
    /// of, at most `tokens.len()`: 1 for a decode or the chunk that ends a prefill, 0 for a
    /// prefill chunk whose K/V are all the step is for, `k + 1` to verify `k` drafted tokens.
    /// `Model::forward_all_positions` ignores it.
    pub logits: usize,
}

/// The rows, among the batch's new tokens in order, whose logits the caller reads: the last
/// `logits` of each sequence's.
pub fn logit_rows(batch: &[SeqInput]) -> Vec<usize> {
    let mut rows = Vec::new();
    let mut end = 0;
    for s in batch {
        end += s.tokens.len();
        rows.extend(end - s.logits.min(s.tokens.len())..end);
    }
    rows
}
