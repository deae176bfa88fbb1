//! The `registration` target: see `fuzz/targets/registration.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/registration.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
