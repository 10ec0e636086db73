//! tokenrouter: a serving system for token-level routed LLM inference.
//!
//! Layers, from the bottom up (dependencies point downward only):
//! * [`kernels`]: hot loops on plain slices (paged attention, rotary embedding, quantized
//!   matmul) and the thread pool they share.
//! * [`model`]: weight loading, the decoder, the paged KV cache, tokenizer, chat template and
//!   sampler. Knows nothing of actors or HTTP.
//!
//! [`config`] reads `config.toml`.
//!
//! See `ARCHITECTURE.md` in the shared design folder for the layers still to come (scheduler,
//! routing, actors, server, tuning, gateway).

pub mod actors;
pub mod config;
pub mod kernels;
pub mod model;
pub mod routing;
pub mod scheduler;
