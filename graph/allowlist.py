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
import itertools
import math
import os
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
# Ints that libtorch casts to an enum without checking them, and floats that scale a size: a
# value outside the rule leaves an output unwritten or indexes out of bounds in the kernel. The
# node holds each argument of these names, on every overload, to its rule (graph/src/rules.rs).
DTYPE_CODES = (0, 1, 2, 3, 4, 5, 6, 7, 11, 15)  # c10::ScalarType of graph/src/format.rs's DTYPES
ONE_OF = {
    ("grid_sampler_2d", "interpolation_mode"): (0, 1, 2),  # bilinear, nearest, bicubic
    ("grid_sampler_2d", "padding_mode"): (0, 1, 2),  # zeros, border, reflection
    ("_embedding_bag", "mode"): (0, 1, 2),  # sum, mean, max
    ("_cdist_forward", "compute_mode"): (0, 1, 2),
    ("_fft_r2c", "normalization"): (0, 1, 2),  # none, 1/sqrt(n), 1/n
    ("_fft_c2r", "normalization"): (0, 1, 2),
    ("to.prim_dtype", "dtype"): DTYPE_CODES,  # a dtype as an int
    ("to.prim_Device", "dtype"): DTYPE_CODES,
    # Without running statistics, libtorch reads the ones it was not given (SIGSEGV).
    ("_native_batch_norm_legit.no_stats", "training"): (1,),
    # Training, it updates running_mean and running_var in place though its schema marks no
    # write: a weight or the caller's input passed as them was written (graph_exec's finding).
    # Exported models in eval mode pass False (or call _native_batch_norm_legit_no_training).
    ("batch_norm", "training"): (0,),
}
# Scale factors: a source index is the output's times 1/scale, so 1e-20 overflows it; 2^-10 to
# 2^10 is a thousandfold either way, with indices far from overflow.
SCALE = (2.0 ** -10, 2.0 ** 10)
WITHIN = {
    (op, arg): SCALE
    for op in ("upsample_nearest2d", "upsample_bilinear2d")
    for arg in ("scales_h", "scales_w", "scale_factors")
}
# col2im checks its input against sizes it reads as 32-bit ints, and its kernel computes with
# the 64-bit ones: a padding of 2^32 passed the check as 0 and the kernel then ran for ever
# (graph_exec's finding). Sizes a tensor's dimension can hold, no more.
INT32 = (0, 2 ** 31 - 1)
WITHIN.update({("col2im", arg): INT32 for arg in ("output_size", "kernel_size", "dilation", "padding", "stride")})
# Names of arguments that must have a rule wherever they appear (an int) ...
ENUM_WORDS = ("mode", "reduction", "normalization", "dtype")
# ... or (a float) where they scale a size.
SCALE_WORDS = ("scales", "scale_factor")

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


def rules(op):
    """The `rule` lines of one allowlisted operator; fails on an argument of a rule's kind
    without one."""
    out = []
    for a in op._schema.arguments:
        base = str(a.real_type).removeprefix("Optional[").removeprefix("List[").rstrip("]").split("[")[0]
        rule = rule_of(op, a.name)
        kinds = (("int", "one-of"), ("SymInt", "one-of"), ("bool", "one-of"), ("float", "within"), ("int", "within"),
                 ("SymInt", "within"))
        if rule and (base, rule[0]) not in kinds:
            raise SystemExit(f"{op._schema}: a {rule[0]} rule on the {base} {a.name}")
        if rule and rule[0] == "one-of":
            out.append(f"one-of {' '.join(map(str, rule[1]))}")
        elif rule:
            low, high = rule[1]
            out.append(f"within {low!r} {high!r}")
        elif base == "int" and any(w in a.name for w in ENUM_WORDS):
            raise SystemExit(f"{op._schema}: the int {a.name} reads as an enum; give it a rule in ONE_OF")
        elif base == "float" and a.name.startswith(SCALE_WORDS):
            raise SystemExit(f"{op._schema}: the float {a.name} scales a size; give it a rule in WITHIN")
        else:
            continue
        out[-1] = f"rule {qualified(op)} {a.name} {out[-1]}"
    return out


def rule_of(op, arg):
    """The rule on argument `arg` of `op` (by its name, or its name and overload), or None."""
    name = op._schema.name.split("::", 1)[1]
    for key in ((qualified(op).split("::", 1)[1], arg), (name, arg)):
        if key in ONE_OF:
            return ("one-of", ONE_OF[key])
        if key in WITHIN:
            return ("within", WITHIN[key])
    return None


def admitted(op, args):
    """Whether the rules admit `args` (what the node would refuse is not tried)."""
    def holds(rule, value):
        if value is None:
            return True
        if isinstance(value, (list, tuple)):
            return all(holds(rule, v) for v in value)
        kind, bound = rule
        if kind == "one-of":
            return isinstance(value, (bool, int)) and int(value) in bound
        return math.isfinite(value) and bound[0] <= value <= bound[1]
    return all(holds(rule_of(op, a.name), v) for a, v in zip(op._schema.arguments, args) if rule_of(op, a.name))


def qualified(op):
    schema = op._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


# What each argument type is tried with, to find the operators whose output can be an input
# though their schemas say not (`type_as(w, w)` is `w`, `dropout(w, 0., False)` is `w`,
# `_unsafe_view(w, size)` views `w`): the checker treats their outputs as views of every input.
def tries(arg):
    t = str(arg.real_type)
    tensor = lambda: torch.randn(2, 3)
    pool = {
        "Tensor": [tensor],
        "Optional[Tensor]": [lambda: None, tensor],
        "List[Tensor]": [lambda: [torch.randn(2, 3), torch.randn(2, 3)], lambda: [torch.randn(2, 3)]],
        "int": [lambda: 0, lambda: 1],
        "SymInt": [lambda: 0, lambda: 1],
        "Optional[int]": [lambda: None, lambda: 0],
        "List[int]": [lambda: [2, 3], lambda: [6], lambda: [0], lambda: [1]],
        "List[SymInt]": [lambda: [2, 3], lambda: [6], lambda: [0], lambda: [1]],
        "Optional[List[int]]": [lambda: None, lambda: [0]],
        "float": [lambda: 0.0, lambda: 1.0],
        "Optional[float]": [lambda: None],
        "bool": [lambda: False, lambda: True],
        "Optional[bool]": [lambda: None],
        "number": [lambda: 0, lambda: 1],
        "Optional[number]": [lambda: None],
        "ScalarType": [lambda: torch.float32, lambda: torch.int64],
        "Optional[ScalarType]": [lambda: None, lambda: torch.float32],
        "str": [lambda: "ij->ji", lambda: "none", lambda: "mean", lambda: "tanh"],
        "Optional[str]": [lambda: None],
    }
    if arg.has_default_value() and t not in ("bool", "ScalarType", "Optional[ScalarType]"):
        return [lambda: arg.default_value]
    return pool.get(t, [lambda: arg.default_value] if arg.has_default_value() else [])


def tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return []


def shares_memory(a, b):
    """As libtorch's `is_alias_of`: the same storage's memory."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() != 0


def returns_input(op):
    """Whether some call of `op` on sample arguments gives back (a view of) an input where the
    schema has no alias annotation on that return."""
    schema = op._schema
    if all(r.alias_info is not None for r in schema.returns):
        return False
    makers = [tries(a) for a in schema.arguments]
    if any(not m for m in makers):
        return False
    for combination in itertools.islice(itertools.product(*makers), 512):
        args = [make() for make in combination]
        if not admitted(op, args):
            continue
        positional = [v for a, v in zip(schema.arguments, args) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(schema.arguments, args) if a.kwarg_only}
        try:
            with torch.no_grad():
                out = op(*positional, **keywords)
        except Exception:
            continue
        outs = out if isinstance(out, tuple) else (out,)
        inputs = tensors(args)
        for ret, value in zip(schema.returns, outs):
            if ret.alias_info is None and any(shares_memory(o, i) for o in tensors(value) for i in inputs):
                return True
    return False


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "graph/allowlist.txt"
    ops = {}
    for name in candidates():
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in sorted(packet.overloads()):
            op = getattr(packet, overload)
            if overload == "out" or overload.endswith("_out") or not admissible(op):
                continue
            ops[str(op._schema)] = op
    used = set()
    rule_lines, alias_lines, crashed = [], [], []
    for text in sorted(ops):
        op = ops[text]
        rule_lines += rules(op)
        for a in op._schema.arguments:
            used |= {(op._schema.name.split("::", 1)[1], a.name), (qualified(op).split("::", 1)[1], a.name)}
        # Tried in a child: libtorch's kernels do not all survive what the samples pass them.
        child = os.fork()
        if child == 0:
            os._exit(3 if returns_input(op) else 0)
        _, status = os.waitpid(child, 0)
        if os.WIFSIGNALED(status):
            crashed.append(f"{text} (signal {os.WTERMSIG(status)})")
        elif os.WEXITSTATUS(status) == 3:
            alias_lines.append(f"returns-input {qualified(op)}")
    if crashed:
        raise SystemExit("libtorch died on sample arguments the rules admit (add a rule):\n  " + "\n  ".join(crashed))
    stale = (set(ONE_OF) | set(WITHIN)) - used
    if stale:
        raise SystemExit(f"rules for arguments no allowlisted operator has: {sorted(stale)}")
    with open(out, "w") as f:
        f.write(f"# The operators a node runs in a graph: {len(ops)} schemas, written by graph/allowlist.py\n")
        f.write(f"# with torch {torch.__version__}. One schema per line, as libtorch's dispatcher prints it.\n")
        for text in sorted(ops):
            f.write(text + "\n")
        f.write("# Rules on argument values (graph/src/rules.rs): an int libtorch reads as an enum, a float\n")
        f.write("# that scales a size.\n")
        for line in rule_lines:
            f.write(line + "\n")
        f.write("# Operators an output of which was an input (or a view of one) on sample arguments, though\n")
        f.write("# their schemas say not: the checker takes such an output for a view of every input.\n")
        for line in alias_lines:
            f.write(line + "\n")
    print(f"{out}: {len(ops)} operators, {len(rule_lines)} rules, {len(alias_lines)} returning an input")


if __name__ == "__main__":
    main()
