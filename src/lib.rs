//! tokenrouter: a serving system for token-level routed LLM inference.
//!
//! Layers, from the bottom up (dependencies point downward only):
//! * [`kernels`]: hot loops on plain slices (paged attention, rotary embedding, quantized
//!   matmul, routing features) and the thread pool they share.
//! * [`model`]: weight loading, the decoder, the paged KV cache, tokenizer, chat template and
//!   sampler. Knows nothing of actors or HTTP.
//! * [`scheduler`]: batch planning, KV block accounting, preemption, delayed batching and the
//!   lock-step barrier; pure logic over numbers.
//! * [`routing`]: the request-centric route / send / receive interface and the algorithms.
//! * [`actors`]: one model actor per model, one request actor per request, their messages, and
//!   the runtime that wires them from the config.
//!
//! * [`server`]: the HTTP API (OpenAI and SGLang schemas, SSE, errors, metrics).
//! * [`tuning`]: the throughput model of delayed batching and its threshold optimizer.
//! * [`gateway`]: the cache-aware router in front of many servers; talks to them only over
//!   HTTP.
//!
//! [`config`] reads `config.toml`. `fuzzing` (with the `fixtures` feature) holds what the fuzz
//! targets run.

pub mod actors;
pub mod config;
#[cfg(feature = "fixtures")]
pub mod fuzzing;
pub mod gateway;
pub mod kernels;
pub mod model;
pub mod routing;
pub mod scheduler;
pub mod server;
pub mod tuning;
