//! The `graph_exec` target: see `fuzz/targets/graph_exec.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/graph_exec.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
