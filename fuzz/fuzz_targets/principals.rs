//! The `principals` target: see `fuzz/targets/principals.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/principals.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
