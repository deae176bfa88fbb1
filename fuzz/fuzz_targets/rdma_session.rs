//! The `rdma_session` target: see `fuzz/targets/rdma_session.rs`, which the seeds' replay in CI runs too.
#![no_main]

#[path = "../targets/rdma_session.rs"]
mod target;

libfuzzer_sys::fuzz_target!(|data: &[u8]| target::run(data));
