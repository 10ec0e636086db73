//! Step timing: where a forward pass's time goes, by part ([`timed`]), accounted process-wide
//! while [`set_breakdown`] is on. A leaf: the decoder and the layers time their parts here, and
//! `profile` reads the totals.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The parts of a forward pass [`timed`] accounts for.
#[derive(Debug, Clone, Copy)]
pub enum Part {
    /// Every matrix multiplication (the LM head's included).
    Matmul,
    /// The LM head's matrix multiplication alone.
    LmHead,
    /// Attention over the KV cache (the projections are matmuls).
    Attention,
    /// The residual adds and RMS norms between the matmuls.
    AddNorm,
    /// Splitting the q/k/v projection's rows, their per-head norms (Qwen3), rotary embedding
    /// (the angles are computed once per forward, outside) and the K/V rows' write into the
    /// cache.
    RotaryKvWrite,
    /// SiLU·gate between the FFN's matmuls, where it runs on its own (a gate/up kernel that
    /// applies it as it multiplies counts it as matmul time).
    Activation,
    /// The layers' projections, each also counted in `Matmul`: q, k and v (their bias
    /// included)…
    Qkv,
    /// … the attention output…
    AttnOut,
    /// … gate and up (with the SiLU·gate where it runs on its own, also counted in
    /// `Activation`)…
    GateUp,
    /// … and down.
    Down,
}

/// The layers' projections in the order of [`Breakdown::projections`], with the names of
/// their tensors within a layer (`blk.N.<name>.weight`, `.bias`).
pub const PROJECTIONS: [(Part, &[&str]); 4] = [
    (Part::Qkv, &["attn_q", "attn_k", "attn_v"]),
    (Part::AttnOut, &["attn_output"]),
    (Part::GateUp, &["ffn_gate", "ffn_up"]),
    (Part::Down, &["ffn_down"]),
];

/// The index in [`PROJECTIONS`] of the projection a layer tensor named `name` belongs to
/// (`blk.3.attn_k.bias`: q/k/v); `None` for the norms and for tensors outside the layers.
pub fn projection_of(name: &str) -> Option<usize> {
    let (_, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let (tensor, _) = rest.split_once('.')?;
    PROJECTIONS
        .iter()
        .position(|(_, names)| names.contains(&tensor))
}

/// Seconds spent in each [`Part`] over the timed decode steps of one measurement.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Breakdown {
    pub matmul: f64,
    pub lm_head: f64,
    pub attention: f64,
    pub add_norm: f64,
    pub rotary_kv_write: f64,
    pub activation: f64,
    /// Each of [`PROJECTIONS`], over every layer.
    pub projections: [f64; PROJECTIONS.len()],
}

static BREAKDOWN_ON: AtomicBool = AtomicBool::new(false);
/// Number of [`Part`]s.
const PARTS: usize = Part::Down as usize + 1;
static PART_NANOS: [AtomicU64; PARTS] = [const { AtomicU64::new(0) }; PARTS];

/// Turns the accounting of [`timed`] on or off. It is process-wide: meant for one model
/// measured at a time (`bench-model --breakdown`); off, a part costs one relaxed load.
pub fn set_breakdown(on: bool) {
    BREAKDOWN_ON.store(on, Ordering::Relaxed);
}

/// Whether the breakdown is on: a GPU backend then also times each kernel on the device.
#[inline]
pub fn breakdown_on() -> bool {
    BREAKDOWN_ON.load(Ordering::Relaxed)
}

/// Device time of one kernel (or library call) over the launches since the last reading: a
/// GPU runs asynchronously, so the host's wall time per part says little there.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub secs: f64,
    pub launches: usize,
}

/// Runs `f`, adding its wall time to `part` when the breakdown is on.
#[inline]
pub fn timed<R>(part: Part, f: impl FnOnce() -> R) -> R {
    if !BREAKDOWN_ON.load(Ordering::Relaxed) {
        return f();
    }
    let started = Instant::now();
    let result = f();
    PART_NANOS[part as usize].fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    result
}

/// The time accounted since the last call (zeroing it), `None` while the breakdown is off.
pub fn take_breakdown() -> Option<Breakdown> {
    let secs = |part: Part| PART_NANOS[part as usize].swap(0, Ordering::Relaxed) as f64 / 1e9;
    let breakdown = Breakdown {
        matmul: secs(Part::Matmul),
        lm_head: secs(Part::LmHead),
        attention: secs(Part::Attention),
        add_norm: secs(Part::AddNorm),
        rotary_kv_write: secs(Part::RotaryKvWrite),
        activation: secs(Part::Activation),
        projections: PROJECTIONS.map(|(part, _)| secs(part)),
    };
    BREAKDOWN_ON.load(Ordering::Relaxed).then_some(breakdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_tensors_belong_to_their_projection() {
        for (name, want) in [
            ("blk.0.attn_q.weight", Some(0)),
            ("blk.11.attn_k.bias", Some(0)),
            ("blk.2.attn_v.weight", Some(0)),
            ("blk.2.attn_output.weight", Some(1)),
            ("blk.5.ffn_gate.weight", Some(2)),
            ("blk.5.ffn_up.weight", Some(2)),
            ("blk.23.ffn_down.weight", Some(3)),
            // Norms, including the per-head ones whose names start as q's and k's do.
            ("blk.0.attn_q_norm.weight", None),
            ("blk.0.attn_norm.weight", None),
            ("blk.0.ffn_norm.weight", None),
            ("output.weight", None),
            ("token_embd.weight", None),
            ("blk.attn_q.weight", None),
        ] {
            assert_eq!(projection_of(name), want, "{name}");
        }
    }
}
