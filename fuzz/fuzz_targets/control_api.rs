//! The `control_api` target: see `fuzz/targets/control_api.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/control_api.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
