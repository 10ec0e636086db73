//! A worker's KV-cache event stream, split into events and applied to the gateway's index.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tokenrouter::fuzzing::kv_events(data));
