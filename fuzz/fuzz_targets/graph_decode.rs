//! A graph container as a node receives it, then the check, on arbitrary bytes: neither may
//! panic, and what they accept must hold together:
//! - a decoded container's weights lie inside it, aligned, without overlap;
//! - a checked program has one step per node, each operator step bound to its schema's
//!   arguments, and every value it names defined;
//! - a decoded program written again decodes to the same program.
//!
//! Input layout: byte 0 bit 0 chooses the bytes as a whole container, else as the program's
//! JSON put in a container with the rest of the input's bytes as its weights.
#![no_main]

use djinn_graph::format::{MAGIC, WEIGHT_ALIGN, dtype};
use djinn_graph::{Step, allowlist, check, decode, encode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let bytes = if mode & 1 == 1 {
        rest.to_vec()
    } else {
        // The JSON up to the first NUL, the weights after it.
        let (json, weights) = rest.split_at(rest.iter().position(|&b| b == 0).unwrap_or(rest.len()));
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(json);
        out.resize(out.len().next_multiple_of(64), 0);
        out.extend_from_slice(weights);
        out
    };
    let Ok(decoded) = decode(&bytes) else { return };
    let region = bytes.len() - decoded.weights_start.min(bytes.len());
    let mut spans = Vec::new();
    for w in &decoded.program.weights {
        let (size, _) = dtype(&w.dtype).expect("decode checked the dtype");
        let len = w.shape.iter().map(|&d| d as u64).product::<u64>() * size;
        assert_eq!(w.offset % WEIGHT_ALIGN, 0);
        assert!(w.offset + len <= region as u64, "a weight past the end");
        spans.push((w.offset, w.offset + len));
    }
    spans.sort_unstable();
    assert!(spans.windows(2).all(|p| p[1].0 >= p[0].1), "overlapping weights");
    let slices: Vec<&[u8]> = decoded
        .program
        .weights
        .iter()
        .map(|w| {
            let start = decoded.weights_start + w.offset as usize;
            let len = w.shape.iter().map(|&d| d as usize).product::<usize>() * dtype(&w.dtype).unwrap().0 as usize;
            &bytes[start..start + len]
        })
        .collect();
    let again = encode(&decoded.program, &slices).expect("a decoded program encodes");
    assert_eq!(decode(&again).expect("and decodes").program, decoded.program);
    let nodes = decoded.program.nodes.len();
    if let Ok(checked) = check(decoded.program, allowlist()) {
        assert_eq!(checked.steps.len(), nodes);
        for step in &checked.steps {
            if let Step::Op { schema, args, .. } = step {
                assert_eq!(args.len(), schema.arguments.len());
            }
        }
        for node in &checked.program.nodes {
            assert!(node.outputs.iter().all(|&v| (v as usize) < checked.values));
        }
    }
});
