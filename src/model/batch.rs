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
    /// Whether the caller reads the logits (and hidden state) at the last new position: false
    /// for a prefill chunk that does not end the sequence's known tokens, whose K/V are all
    /// the step is for. `Model::forward_all_positions` ignores it.
    pub logits: bool,
}
