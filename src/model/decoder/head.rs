//! The end of a forward pass: the final norm and the LM head on the device, and the rows
//! they return, back in host memory, as the pass's output.

use candle_core::{DType, Device, Tensor};

use super::{Decoder, ForwardOutput};
use crate::model::backend::Backend;
use crate::model::error::Result;
use crate::model::timing::{timed, Part};

impl<B: Backend> Decoder<B> {
    /// The final norm and the LM head over `rows` residual rows `x`: the logits, then (when
    /// `want_hidden`) the normalised rows. `draft`: through the draft head, if the model has
    /// one.
    pub(super) fn head(
        &self,
        mut x: B::Rows,
        rows: usize,
        want_hidden: bool,
        draft: bool,
    ) -> Result<Vec<B::Rows>> {
        let b = &self.backend;
        timed(Part::AddNorm, || b.norm_in_place(&self.norm, &mut x))?;
        let head = match self.draft_head.as_ref().filter(|_| draft) {
            Some((head, _)) => head,
            None => &self.lm_head,
        };
        let logits = timed(Part::LmHead, || b.project_one(head, &x, rows))?;
        Ok(match want_hidden {
            true => vec![logits, x],
            false => vec![logits],
        })
    }

    /// [`Self::head`]'s rows, back in host memory, as the forward's output (a draft head's
    /// logits widened to the vocabulary, the ids it lacks at -inf).
    pub(super) fn output(
        &self,
        out: Vec<Vec<f32>>,
        rows: usize,
        draft: bool,
    ) -> Result<ForwardOutput> {
        let c = &self.config;
        let mut out = out.into_iter();
        let logits = out.next().unwrap_or_default();
        let logits = match self.draft_head.as_ref().filter(|_| draft) {
            Some((_, n)) => {
                let mut all = vec![f32::NEG_INFINITY; rows * c.vocab_size];
                for (row, values) in all.chunks_mut(c.vocab_size).zip(logits.chunks(*n)) {
                    row[..*n].copy_from_slice(values);
                }
                all
            }
            None => logits,
        };
        let host = Device::Cpu;
        Ok(ForwardOutput {
            logits: Tensor::from_vec(logits, (rows, c.vocab_size), &host)?,
            hidden: out
                .next()
                .map(|h| Tensor::from_vec(h, (rows, c.hidden_size), &host))
                .transpose()?,
        })
    }

    pub(super) fn empty_output(&self, want_hidden: bool) -> Result<ForwardOutput> {
        let c = &self.config;
        Ok(ForwardOutput {
            logits: Tensor::zeros((0, c.vocab_size), DType::F32, &Device::Cpu)?,
            hidden: want_hidden
                .then(|| Tensor::zeros((0, c.hidden_size), DType::F32, &Device::Cpu))
                .transpose()?,
        })
    }
}
