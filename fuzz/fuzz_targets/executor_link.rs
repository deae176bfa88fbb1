//! The `executor_link` target: see `fuzz/targets/executor_link.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/executor_link.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
