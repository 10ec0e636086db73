//! The three request parsers and their conversion into runtime requests.
#![no_main]

libfuzzer_sys::fuzz_target!(|body: &[u8]| tokenrouter::fuzzing::requests(body));
