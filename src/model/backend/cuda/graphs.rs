//! Decode steps recorded as CUDA graphs and replayed. A decode step of the 8B launches
//! about 580 kernels, most of them a few microseconds of work, so launching them one by one
//! leaves the device idle between them; a graph launches them all with one call.
//!
//! A recording is kept per batch size. Its inputs live in a buffer of its own, which each
//! step refills before the replay (the step's words, see `step::pack`): the kernels of a
//! recording read token ids, positions and block tables from there, and attention splits
//! every context into the same number of parts whatever its length. A batch size is run
//! once eagerly (the rows it returns sized), recorded the second time and replayed after; a
//! recording whose capture fails leaves that batch size eager, with a warning.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};

use super::step::{self, Layout};
use super::{device_err, Cuda, DeviceRows, Step};
use crate::model::backend::{Backend, Pass};
use crate::model::batch::SeqInput;
use crate::model::config::RopeStyle;
use crate::model::error::{ModelError, Result};
use crate::model::kv_cache::DeviceKv;
use crate::model::timing::breakdown_on;

/// Largest batch recorded: up to here every matmul of a step is one of our kernels (the
/// matrix-vector or the tensor-core one, see `linear`), and launches are a large share of
/// a step; above, the step's GEMMs take far longer than its launches.
pub(super) const MOST_RECORDED_BATCH: usize = super::linear::DIRECT_ROWS;

/// The recordings of one model, by batch size and the passes' replay key.
#[derive(Default)]
pub(super) struct Recordings {
    slots: HashMap<(usize, u64), Slot>,
}

/// The recording of one batch size and key.
struct Slot {
    /// The staged inputs: a step's words, and room for its block tables to grow.
    words: CudaSlice<u32>,
    /// What the recording was made for: the KV cache and the layout of the words (a
    /// recording's kernels read both at fixed addresses).
    made_for: Option<(u64, Layout)>,
    state: State,
}

enum State {
    /// Not run at this batch size (and key) yet.
    New,
    /// Run once, eagerly: the shape (rows, width) of each row set it returned.
    Warm(Vec<(usize, usize)>),
    /// Recorded: the graph and the buffers its last copies fill.
    Recorded(Graph, Vec<DeviceRows>),
    /// Recording failed: this batch size runs eagerly.
    Eager,
}

/// A graph, kept behind the recordings' lock.
struct Graph(CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as no two calls on one run
// at once; every use of a `Graph` holds the lock of the `Recordings` that owns it.
unsafe impl Send for Graph {}

/// Whether a pass over `batch` is one a recording can replay: a decode step (one new token
/// and its logits per sequence) of at most [`MOST_RECORDED_BATCH`] sequences, whose launches
/// depend on nothing but the batch size.
pub(super) fn replayable(batch: &[SeqInput]) -> bool {
    !batch.is_empty()
        && batch.len() <= MOST_RECORDED_BATCH
        && batch.iter().all(|s| s.tokens.len() == 1 && s.logits == 1)
}

impl Cuda {
    /// Tells one KV cache from another: the addresses of its layers and its block size,
    /// which a recording's kernels take as arguments.
    fn kv_identity(&self, kv: &DeviceKv) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        kv.block_size.hash(&mut h);
        for (k, v) in kv.k.iter().zip(&kv.v) {
            (self.ptr(k), self.ptr(v)).hash(&mut h);
        }
        h.finish()
    }

    /// Whether decode steps run from recordings (on unless turned off).
    pub fn set_recording(&self, on: bool) {
        self.eager.store(!on, Ordering::Relaxed);
    }

    /// How many decode steps ran from a recording so far.
    pub fn replays(&self) -> u64 {
        self.replays.load(Ordering::Relaxed)
    }

    /// [`Backend::run_pass`]: a replayable pass from its batch size's recording, others
    /// (and every pass while the per-kernel breakdown times launches) eagerly.
    pub(super) fn run_recorded<'a, F>(
        &self,
        pass: &Pass<'_, 'a>,
        kv: &mut DeviceKv,
        mut launch: F,
    ) -> Result<Vec<Vec<f32>>>
    where
        F: FnMut(&Step<'a>, &mut DeviceKv) -> Result<Vec<DeviceRows>>,
    {
        let key = pass.replay_key.filter(|_| {
            !self.eager.load(Ordering::Relaxed) && !breakdown_on() && replayable(pass.batch)
        });
        let Some(key) = key else {
            let step = self.begin_step(pass)?;
            return self.bring_back(launch(&step, kv)?);
        };
        let (words, layout) = step::pack(pass);
        let made_for = (self.kv_identity(kv), layout.replay_shape());
        let mut recordings = self.recordings.lock().expect("no panic holds the lock");
        let n = pass.batch.len();
        // Too few words for this step's block tables: a new buffer, and a new recording
        // (the old one reads the old buffer).
        let slots = &mut recordings.slots;
        if slots
            .get(&(n, key))
            .is_none_or(|s| s.words.len() < words.len())
        {
            slots.remove(&(n, key));
            let slot = Slot {
                words: self.uninit(words.len().next_power_of_two())?,
                made_for: None,
                state: State::New,
            };
            slots.insert((n, key), slot);
        }
        let slot = slots.get_mut(&(n, key)).expect("inserted above");
        if slot.made_for.as_ref() != Some(&made_for) {
            slot.made_for = Some(made_for);
            slot.state = State::New;
        }
        self.stream
            .memcpy_htod(&words, &mut slot.words.slice_mut(..words.len()))
            .map_err(device_err)?;
        let neox = pass.config.rope_style == RopeStyle::Neox;
        let step = Step::at(self.ptr(&slot.words), &layout, None, neox, true);
        match std::mem::replace(&mut slot.state, State::Eager) {
            State::Recorded(graph, outputs) => {
                let replayed = self.replay(&graph);
                let out = replayed.and_then(|()| outputs.iter().map(|o| self.read(o)).collect());
                slot.state = State::Recorded(graph, outputs);
                out
            }
            State::New => {
                let rows = launch(&step, kv);
                if let Ok(rows) = &rows {
                    slot.state = State::Warm(rows.iter().map(|r| (r.rows, r.width)).collect());
                } else {
                    slot.state = State::New;
                }
                self.bring_back(rows?)
            }
            State::Warm(shapes) => {
                match self
                    .record(&step, kv, &mut launch, &shapes)
                    .and_then(|(graph, outputs)| {
                        // The first launch maps the graph's memory: where that fails, eagerly.
                        self.replay(&graph)?;
                        Ok((graph, outputs))
                    }) {
                    Ok((graph, outputs)) => {
                        let out = outputs.iter().map(|o| self.read(o)).collect();
                        slot.state = State::Recorded(graph, outputs);
                        out
                    }
                    Err(e) => {
                        tracing::warn!(
                            "decode steps of {n} sequences run without a CUDA graph: \
                         recording one failed: {e}"
                        );
                        self.bring_back(launch(&step, kv)?)
                    }
                }
            }
            State::Eager => self.bring_back(launch(&step, kv)?),
        }
    }

    /// `launch`'s pass at `step`, captured into a graph that ends by copying the rows it
    /// returns (of `shapes`) into buffers of their own, which it returns too. Everything
    /// the pass allocates it frees again inside the graph.
    fn record<'a, F>(
        &self,
        step: &Step<'a>,
        kv: &mut DeviceKv,
        launch: &mut F,
        shapes: &[(usize, usize)],
    ) -> Result<(Graph, Vec<DeviceRows>)>
    where
        F: FnMut(&Step<'a>, &mut DeviceKv) -> Result<Vec<DeviceRows>>,
    {
        let mut outputs = shapes
            .iter()
            .map(|&(rows, width)| self.alloc(rows, width))
            .collect::<Result<Vec<_>>>()?;
        // Thread-local: another model's stream on this device, driven from another thread,
        // does not invalidate the capture.
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(device_err)?;
        let captured = (|| -> Result<()> {
            let rows = launch(step, kv)?;
            let got: Vec<_> = rows.iter().map(|r| (r.rows, r.width)).collect();
            if got != shapes {
                return Err(ModelError::Device(format!(
                    "a recorded pass returned rows of {got:?}, its first run {shapes:?}"
                )));
            }
            for (r, o) in rows.iter().zip(&mut outputs) {
                let n = r.rows * r.width;
                if n > 0 {
                    self.stream
                        .memcpy_dtod(&r.buf.slice(..n), &mut o.buf.slice_mut(..n))
                        .map_err(device_err)?;
                }
            }
            Ok(())
        })();
        // A pass that failed leaves errors on the context (its frees on the invalidated
        // capture), which would stop `end_capture` before it ends the capture and leave the
        // stream capturing: they are taken first, and returned after.
        let pending = self.ctx.check_err();
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        pending.map_err(device_err)?;
        let graph = graph
            .map_err(device_err)?
            .ok_or_else(|| ModelError::Device("the recorded pass launched nothing".into()))?;
        Ok((Graph(graph), outputs))
    }

    /// Launches `graph`, counted.
    fn replay(&self, graph: &Graph) -> Result<()> {
        graph.0.launch().map_err(device_err)?;
        self.replays.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Row sets in host memory, in order.
    fn bring_back(&self, rows: Vec<DeviceRows>) -> Result<Vec<Vec<f32>>> {
        rows.into_iter().map(|r| self.to_host(r)).collect()
    }

    /// The values of `x` in host memory (`x` stays).
    fn read(&self, x: &DeviceRows) -> Result<Vec<f32>> {
        let n = x.rows * x.width;
        self.stream
            .clone_dtoh(&x.buf.slice(..n.max(1)))
            .map(|mut v| {
                v.truncate(n);
                v
            })
            .map_err(device_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq<'a>(tokens: &'a [u32], logits: usize) -> SeqInput<'a> {
        SeqInput {
            tokens,
            start_pos: 7,
            blocks: &[3],
            logits,
        }
    }

    #[test]
    fn decode_steps_are_replayable() {
        let one = [5u32];
        assert!(replayable(&[seq(&one, 1)]));
        assert!(replayable(&vec![seq(&one, 1); MOST_RECORDED_BATCH]));
        // Empty, too many sequences, a prefill chunk, a step without logits: eager.
        assert!(!replayable(&[]));
        assert!(!replayable(&vec![seq(&one, 1); MOST_RECORDED_BATCH + 1]));
        assert!(!replayable(&[seq(&one, 1), seq(&[1, 2], 1)]));
        assert!(!replayable(&[seq(&one, 0)]));
    }
}
