//! A graph container as a node receives it, then the check, on arbitrary bytes: neither may
//! panic, and what they accept must hold together:
//! - a decoded container's weights and stored state lie inside it, aligned, without overlap;
//! - each graph of a checked program has one step per node, each operator step bound to its
//!   schema's arguments, and every value it names defined;
//! - a decoded program written again decodes to the same program.
//!
//! Input layout: byte 0 bit 0 chooses the bytes as a whole container, else as the program's
//! JSON put in a container with the rest of the input's bytes as its weights.

use djinn_graph::format::{MAGIC, WEIGHT_ALIGN};
use djinn_graph::{Step, allowlist, check, decode, encode, tensor_len};

pub fn run(data: &[u8]) {
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
    let program = &decoded.program;
    // Every tensor with bytes in the container: the weights, and the state's stored values.
    let stored: Vec<(u64, u64)> = program
        .weights
        .iter()
        .map(|w| (w.offset, tensor_len(&w.dtype, &w.shape).expect("decode checked the shape")))
        .chain(program.state.iter().filter_map(|s| Some((s.offset?, tensor_len(&s.dtype, &s.shape)?))))
        .collect();
    assert_eq!(stored.len(), program.stored_offsets().count());
    let mut spans = Vec::new();
    for &(offset, len) in &stored {
        assert_eq!(offset % WEIGHT_ALIGN, 0);
        assert!(offset + len <= region as u64, "a tensor past the end");
        spans.push((offset, offset + len));
    }
    spans.sort_unstable();
    assert!(spans.windows(2).all(|p| p[1].0 >= p[0].1), "overlapping tensors");
    let slices: Vec<&[u8]> = stored
        .iter()
        .map(|&(offset, len)| {
            let start = decoded.weights_start + offset as usize;
            &bytes[start..start + len as usize]
        })
        .collect();
    let again = encode(program, &slices).expect("a decoded program encodes");
    assert_eq!(&decode(&again).expect("and decodes").program, program);
    let graphs: Vec<usize> = program.graphs().map(|g| g.nodes.len()).collect();
    if let Ok(checked) = check(decoded.program, allowlist()) {
        assert_eq!(checked.graphs.iter().map(|g| g.steps.len()).collect::<Vec<_>>(), graphs);
        for (graph, checked_graph) in checked.program.graphs().zip(&checked.graphs) {
            for step in &checked_graph.steps {
                if let Step::Op { schema, args, .. } = step {
                    assert_eq!(args.len(), schema.arguments.len());
                }
            }
            for node in graph.nodes {
                assert!(node.outputs.iter().all(|&v| (v as usize) < checked_graph.values));
            }
        }
    }
}
