//! The chat template renderer on any template and messages.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tokenrouter::fuzzing::chat_template(data));
