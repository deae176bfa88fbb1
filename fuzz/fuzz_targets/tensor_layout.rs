//! The `tensor_layout` target: see `fuzz/targets/tensor_layout.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/tensor_layout.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
