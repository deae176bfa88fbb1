//! Every fuzz target's seeds and regression cases run through the target's own checks
//! (`fuzz/targets/TARGET.rs`, which the cargo-fuzz binaries run too) on stable Rust, a few
//! seconds in all: an input that once found a bug keeps being tried, and the seeds a fresh
//! checkout's fuzzing starts from (`fuzz/run.sh`) stay valid. The seeds are
//! `fuzz/seeds/TARGET.hex`, an input per line in hex (a corpus merged to one input per coverage
//! edge); the regression cases are files in `fuzz/regressions/TARGET/`.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

#[path = "../fuzz/targets/control_api.rs"]
mod control_api;
#[path = "../fuzz/targets/frame_reader.rs"]
mod frame_reader;
#[path = "../fuzz/targets/graph_decode.rs"]
mod graph_decode;
#[path = "../fuzz/targets/message_decode.rs"]
mod message_decode;
#[path = "../fuzz/targets/principals.rs"]
mod principals;
#[path = "../fuzz/targets/rdma_session.rs"]
mod rdma_session;
#[path = "../fuzz/targets/registration.rs"]
mod registration;
#[path = "../fuzz/targets/tensor_layout.rs"]
mod tensor_layout;

/// Runs `target` on each of its seeds and regression cases, naming the input that fails.
fn replay(target: &str, run: fn(&[u8])) {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let seeds = std::fs::read_to_string(fuzz.join("seeds").join(format!("{target}.hex"))).expect("the seeds");
    let mut inputs: Vec<(String, Vec<u8>)> = seeds
        .lines()
        .enumerate()
        .map(|(i, line)| (format!("fuzz/seeds/{target}.hex, line {}", i + 1), hex(line)))
        .collect();
    assert!(!inputs.is_empty(), "{target} has no seeds");
    if let Ok(entries) = std::fs::read_dir(fuzz.join("regressions").join(target)) {
        let mut paths: Vec<_> = entries.map(|e| e.expect("a directory entry").path()).collect();
        paths.sort();
        inputs.extend(paths.into_iter().map(|p| (p.display().to_string(), std::fs::read(&p).expect("a case"))));
    }
    for (name, data) in inputs {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| run(&data))) {
            let why = panic.downcast_ref::<String>().map(String::as_str).or(panic.downcast_ref::<&str>().copied());
            panic!("{name}: {}", why.unwrap_or("a panic"));
        }
    }
}

fn hex(line: &str) -> Vec<u8> {
    let digit = |c: u8| (c as char).to_digit(16).expect("a hex digit") as u8;
    line.as_bytes().chunks(2).map(|pair| digit(pair[0]) << 4 | digit(pair[1])).collect()
}

#[test]
fn control_api_seeds() {
    replay("control_api", control_api::run);
}

#[test]
fn frame_reader_seeds() {
    replay("frame_reader", frame_reader::run);
}

#[test]
fn graph_decode_seeds() {
    replay("graph_decode", graph_decode::run);
}

#[test]
fn message_decode_seeds() {
    replay("message_decode", message_decode::run);
}

#[test]
fn principals_seeds() {
    replay("principals", principals::run);
}

#[test]
fn rdma_session_seeds() {
    replay("rdma_session", rdma_session::run);
}

#[test]
fn registration_seeds() {
    replay("registration", registration::run);
}

#[test]
fn tensor_layout_seeds() {
    replay("tensor_layout", tensor_layout::run);
}
