//! The `message_decode` target: see `fuzz/targets/message_decode.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/message_decode.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
