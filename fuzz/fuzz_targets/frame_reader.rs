//! The `frame_reader` target: see `fuzz/targets/frame_reader.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/frame_reader.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
