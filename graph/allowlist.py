"""Writes graph/allowlist.txt: the operators a node runs in a graph, one schema per line, as the
dispatcher of the torch that runs this script has them.

Usage: .venv/bin/python graph/allowlist.py [graph/allowlist.txt]

What is on it: the core ATen operators (torch's `core` tag: what export's decompositions end in)
and the operators that torch.export leaves in the graphs of the models our tests register
(EXPORTED below, kept in step with client-lib/python/tests/test_graphs.py). What is kept off,
whatever its tags: operators that write an argument other than through the alias rules the
checker enforces (out= variants, in-place variants but those state updates need), random ones
but those that take a generator, which the node gives per request; the two that are random only
through an argument are on it, and the checker requires that argument off), uninitialised memory (`empty*`: the
client rewrites them to `zeros*`), anything that reads or writes files, processes, the network
or global state, and operators whose arguments a graph cannot carry (generators, storages,
streams).
"""
import sys

import torch

EXPORTED = """
_softmax _to_copy _unsafe_view abs add addmm alias all any arange argmax avg_pool2d
adaptive_avg_pool2d baddbmm batch_norm _native_batch_norm_legit_no_training bitwise_and
bitwise_not bitwise_or bmm cat clamp clamp_min clone contiguous conv2d convolution cos cumsum
detach diff div embedding eq erf exp expand flatten floor_divide full full_like ge gelu gt index
index_select layer_norm le linear log log_softmax logical_and logical_not lt masked_fill matmul
max max_pool2d max_pool2d_with_indices mean min mm mul native_layer_norm ne neg new_ones
new_zeros ones ones_like permute pow reciprocal relu reshape rsqrt scaled_dot_product_attention
select sigmoid silu sin slice softmax split split_with_sizes sqrt squeeze stack sub sum t tanh
to transpose tril triu type_as unbind unflatten unsqueeze view where zeros zeros_like __and__
__or__ __rshift__ __lshift__ __xor__ remainder fmod sign index_copy
""".split()

# And those transparent capture records below autograd in the same models and the capture tests
# (client-lib/python/tests/test_capture.py), where export's decompositions have not run.
CAPTURED = """
_safe_softmax eye linspace logspace _native_batch_norm_legit isin rsub
""".split()

# Random only through an argument the checker requires to be constant and off (dropout_p = 0,
# train = False): graph/src/check.rs.
RANDOM_UNLESS = {"scaled_dot_product_attention", "dropout"}

# Random operators that take a generator: the node gives each request's run its own, freshly
# seeded, so no tenant's draws depend on or reveal another's. (The client rewrites rand_like
# and the like to these overloads.)
RANDOM = {"rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
          "multinomial", "normal", "uniform"}

# Updates a session's state in place (what graphs.py makes of export's functional updates of
# the buffers a model writes); the checker lets them write only the state and the graph's own.
IN_PLACE = {"copy_", "index_copy_", "fill_", "zero_", "masked_fill_"}

FORBIDDEN_WORDS = (
    "from_file", "save", "load", "_local_scalar_dense", "item", "set_", "resize", "record_stream",
    "_copy_from", "mkldnn", "sparse", "quantize", "_nested", "empty", "_assert", "print", "_cudnn",
    "_fused", "_foreach", "cuda", "pin_memory", "share_memory", "data_ptr", "storage", "_version",
    "requires_grad", "retain_grad", "backward", "_make_", "lift", "_has_", "is_", "_sync", "c10d",
)
UNCARRIABLE = ("Generator", "Storage", "Stream", "Dimname", "Any", "Dict", "Future", "Capsule", "Object")


def candidates():
    names = set(EXPORTED) | set(CAPTURED) | set(IN_PLACE) | RANDOM_UNLESS | RANDOM
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.core in op.tags:
                names.add(name)
    return sorted(names)


def admissible(op):
    schema = op._schema
    name = schema.name.split("::", 1)[1]
    if any(word in name for word in FORBIDDEN_WORDS):
        return False
    takes_generator = any("Generator" in str(a.type) for a in schema.arguments)
    if torch.Tag.nondeterministic_seeded in op.tags and name not in RANDOM_UNLESS and not (name in RANDOM and takes_generator):
        return False
    writes = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if writes and (name not in IN_PLACE or any(a.kwarg_only for a in writes)):
        return False
    # TorchScript's own overloads on Python values (`aten::eq.int`, `aten::copy.t`): no tensor in
    # or out, or a type variable.
    types = [str(a.type) for a in schema.arguments] + [str(r.type) for r in schema.returns]
    if not any("Tensor" in t for t in types) or any(t.split("[")[0].rstrip("?") in ("t", "t1", "t2", "tVal") for t in types):
        return False
    # An argument a graph cannot carry must be one it can leave to its default, or the
    # generator the node passes.
    for a in schema.arguments:
        if any(word in str(a.type) for word in UNCARRIABLE) and not a.has_default_value() and str(a.type) != "Optional[Generator]":
            return False
    for r in schema.returns:
        if any(word in str(r.type) for word in UNCARRIABLE):
            return False
    return True


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "graph/allowlist.txt"
    lines = []
    for name in candidates():
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in sorted(packet.overloads()):
            op = getattr(packet, overload)
            if overload == "out" or overload.endswith("_out") or not admissible(op):
                continue
            lines.append(str(op._schema))
    with open(out, "w") as f:
        f.write(f"# The operators a node runs in a graph: {len(lines)} schemas, written by graph/allowlist.py\n")
        f.write(f"# with torch {torch.__version__}. One schema per line, as libtorch's dispatcher prints it.\n")
        for line in sorted(set(lines)):
            f.write(line + "\n")
    print(f"{out}: {len(set(lines))} operators")


if __name__ == "__main__":
    main()
