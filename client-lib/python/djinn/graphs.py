"""Models as data: `torch.export` makes a graph of ATen operators of a model, and this module
writes it in Djinn's graph format (docs/graph-format.md), which a node checks against its
allowlist and runs through libtorch's dispatcher. No TorchScript is involved."""

from __future__ import annotations

import inspect
import json
import operator
import re
import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ._native import DjinnError

MAGIC = b"DJINNGR1"
FORMAT = 1
ALIGN = 64
# Sizes above this count as unbounded (export's upper bound for an open range is infinite).
UNBOUNDED = 1 << 62

_DTYPES = {
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bool: "bool",
    torch.bfloat16: "bfloat16",
}
_MEMORY_FORMATS = {
    torch.contiguous_format: "contiguous",
    torch.preserve_format: "preserve",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
}
# The runner's own operations on integers, for the Python operators export leaves on sizes.
_NATIVE = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.floordiv: "floordiv",
    operator.mod: "mod",
    operator.neg: "neg",
    operator.eq: "eq",
    operator.ne: "ne",
    operator.lt: "lt",
    operator.le: "le",
    operator.gt: "gt",
    operator.ge: "ge",
    operator.getitem: "getitem",
    torch.sym_max: "max",
    torch.sym_min: "min",
}
# Checks export inserts about the inputs it saw: the node checks the inputs itself (dtype, rank,
# size ranges), and these would pin the device.
_DROPPED = {"aten::_assert_tensor_metadata", "aten::_assert_scalar", "aten::sym_constrain_range_for_size",
            "aten::sym_constrain_range", "aten::_assert_async"}
# Random operators without a generator argument become the overloads that take one: the node
# passes each request's own generator there.
_WITH_GENERATOR = {
    ("aten::rand", ""): "generator",
    ("aten::randn", ""): "generator",
    ("aten::rand_like", ""): "generator",
    ("aten::randn_like", ""): "generator",
    ("aten::randint", ""): "generator",
    ("aten::randint", "low"): "low_generator",
    ("aten::randint_like", ""): "generator",
    ("aten::randint_like", "Tensor"): "Tensor_generator",
    ("aten::randint_like", "low_dtype"): "low_generator_dtype",
    ("aten::randperm", ""): "generator",
}
# Uninitialised memory may hold another tenant's bytes: these become their zeroed forms.
_ZEROED = {"aten::empty": "aten::zeros", "aten::new_empty": "aten::new_zeros", "aten::empty_like": "aten::zeros_like",
           "aten::empty_strided": "aten::zeros"}


class ExportError(DjinnError, ValueError):
    """The model could not be written as a graph: the message says what in the model caused it
    and what to pass instead; export's own error, where there was one, is the cause."""

    __module__ = "djinn"


_TENSOR = object()


@dataclass
class Graph:
    """A model written as graphs: one container per block (one block unless the model was
    split), what a call's inputs must look like (the example's structure, each leaf a tensor
    the call sends or a constant export fixed), how to rebuild the output structure, and the
    names of the values each block hands the next (`cuts[k]`: what block k passes on)."""

    containers: list
    in_spec: Any
    leaves: list  # _TENSOR, or the constant export fixed there
    out_spec: Any
    signature: inspect.Signature
    cuts: list = field(default_factory=list)
    # Tensors of the session state the model keeps on the node (a KV cache); 0 for none.
    state: int = 0
    # Their bytes.
    state_bytes: int = 0
    # Each operator the graphs call ("aten::name"), and the module of the model that first
    # calls it ("layers.0.mlp (LlamaMLP)"): where a refusal of it comes from.
    op_modules: dict = field(default_factory=dict)

    def __post_init__(self):
        # The common case costs no binding: positional tensors, one per parameter, in order.
        params = list(self.signature.parameters.values())
        self._positional = (
            all(leaf is _TENSOR for leaf in self.leaves)
            and self.in_spec == pytree.tree_flatten(((), {p.name: 0 for p in params[: len(self.leaves)]}))[1]
            and all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params[: len(self.leaves)])
        )
        self._single_output = self.out_spec.is_leaf()

    def call_tensors(self, args: tuple, kwargs: dict) -> list:
        """What a call sends: the tensors (or kept tensors) at the leaves where the example had
        tensors, its arguments bound to the forward's as the example's were."""
        if self._positional and not kwargs and len(args) == len(self.leaves) and all(
            not isinstance(a, (tuple, list, dict)) for a in args
        ):
            return list(args)
        try:
            bound = self.signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"the inputs do not fit the model's forward: {e}") from None
        leaves, spec = pytree.tree_flatten(((), dict(bound)))
        if spec != self.in_spec:
            raise TypeError(f"the inputs are not shaped as the example the model was registered with was: {spec} against {self.in_spec}")
        out = []
        for leaf, fixed in zip(leaves, self.leaves):
            if fixed is _TENSOR:
                out.append(leaf)
            elif leaf is not fixed and leaf != fixed:
                raise ValueError(f"{leaf!r} where the model was registered with {fixed!r}, which export fixed")
        return out

    def outputs(self, flat: list) -> Any:
        if self._single_output and len(flat) == 1:
            return flat[0]
        return pytree.tree_unflatten(flat, self.out_spec)

    def activation(self, block: int, value) -> dict:
        """What block `block` hands the next, as it came from the node (one tensor, or a tuple),
        by name."""
        names = self.cuts[block]
        items = list(value) if isinstance(value, (tuple, list)) and len(names) != 1 else [value]
        if len(items) != len(names):
            raise ValueError(f"block {block} passes on {len(names)} values; the node sent {len(items)}")
        return dict(zip(names, items))

    def replacement(self, block: int, activation) -> Any:
        """A replacement for what block `block` passes on, from the dict `activation` gave
        (the same names, each a tensor of the same shape and dtype: the node checks those),
        as the node takes it."""
        names = self.cuts[block]
        if not isinstance(activation, dict) or set(activation) != set(names):
            got = sorted(activation) if isinstance(activation, dict) else type(activation).__name__
            raise ValueError(f"block {block} passes on {{{', '.join(names)}}}; the replacement has {got}")
        items = [activation[n] for n in names]
        return items[0] if len(items) == 1 else tuple(items)


def _bound(value, otherwise: int) -> int:
    """A range's bound as an int; `otherwise` for none or an infinite one."""
    try:
        return int(value) if value is not None else otherwise
    except (TypeError, ValueError, AttributeError, OverflowError):
        return otherwise


def _dims(shapes: dict, names: dict[str, torch.export.Dim]) -> dict:
    """Export's dimensions for one input: a label ("seq") or a label with bounds
    (("seq", 2, 64)); one label is one size wherever it is used."""
    out = {}
    for dim, label in shapes.items():
        if isinstance(label, tuple):
            name, lo, hi = label
            out[dim] = names.setdefault(name, torch.export.Dim(name, min=lo, max=hi))
        else:
            out[dim] = names.setdefault(label, torch.export.Dim(label))
    return out


def export(model: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, dynamic: Optional[dict] = None,
           split=None, entries: Sequence[dict] = ()) -> Graph:
    """Exports `model` on the example inputs (`args`, `kwargs`) with torch.export (non-strict)
    and writes the graph. `dynamic` names the dimensions that may change between calls, by
    input name: `{"input_ids": {0: "batch", 1: "seq"}}`, or with bounds the node enforces:
    `{1: ("seq", 2, 64)}`; a name used twice is one size. `split` cuts the graph into blocks
    at submodules (see `split_points`). `entries`: more examples (keyword inputs), each
    exported with its sizes fixed as a further graph over the same weights (a decode step
    beside a prefill); a call runs the first graph whose inputs it fits.

    Buffers the model writes in place (a static KV cache) are the state a session keeps on
    the node: their values now are its initial values, each graph takes them as its last
    inputs and writes them in place where the graph's update allows it."""
    points = split_points(model, split)
    signature = inspect.signature(model.forward)
    if entries and points:
        raise ExportError("split= with entries: a model cut into blocks has one graph")
    ep, bounds = _export_one(model, signature, args, kwargs or {}, dynamic)
    eps = [ep] + [_export_one(model, signature, (), entry, None, static=True)[0] for entry in entries]
    return _write(eps, signature, bounds, points)


def _export_one(model, signature, args, kwargs, dynamic, static=False):
    """One export of `model` on one example, decomposed; and the bounds the caller gave."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise ExportError(f"the example inputs do not fit the model's forward: {e}") from None
    example = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) and name in example:
            raise ExportError(f"the model's forward takes *{name}: name its inputs instead")
    dynamic = dynamic or {}
    unknown = set(dynamic) - set(example)
    if unknown:
        raise ExportError(f"dynamic names {', '.join(sorted(unknown))}, which the example does not give")
    names: dict[str, torch.export.Dim] = {}
    # Named dimensions as named; every other one as export finds it (dynamic unless the model
    # fixes it), without specialising sizes 0 and 1: a model called on batches of 1 and 8
    # should not need registering twice.
    auto = lambda v: {i: torch.export.Dim.AUTO for i in range(v.dim())} if isinstance(v, torch.Tensor) else None  # noqa: E731
    shapes = {n: ({**auto(v), **_dims(dynamic[n], names)} if n in dynamic else pytree.tree_map(auto, v)) for n, v in example.items()}
    everywhere_auto = {n: pytree.tree_map(auto, v) for n, v in example.items()}
    # The bounds the caller gave, which the node enforces whichever attempt below succeeds.
    bounds = {n: {d: (label[1], label[2]) for d, label in dims.items() if isinstance(label, tuple)} for n, dims in dynamic.items()}
    # Export's symbolic reasoning cannot always prove what named dimensions promise (a model
    # that branches on a size being 1; torch 2.11 on grouped-query attention): then the same
    # with every dimension left to export, the caller's bounds enforced by the node.
    attempts = [(None, False)] if static else [(shapes, True), (shapes, False), (everywhere_auto, True), (everywhere_auto, False)]
    # Each module's own mode is put back after (a wrapper's mode is not its children's).
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    first_error = None
    ep = None
    try:
        with torch.no_grad():
            for dynamic_shapes, oblivious in attempts:
                try:
                    with _size_oblivious(oblivious):
                        ep = torch.export.export(model, (), kwargs=example, dynamic_shapes=dynamic_shapes, strict=False)
                    break
                except Exception as e:  # noqa: BLE001 - export raises many kinds; the first is reported
                    first_error = first_error or e
    finally:
        for m, training in modes:
            m.training = training
    if ep is None:
        raise ExportError(_explained(first_error)) from first_error
    if not static:
        _check_named_dims_vary(ep, dynamic, first_error)
    with warnings.catch_warnings():
        # torch 2.13's own decomposition copies its pytree specs through a deprecated
        # isinstance check: a warning about torch's code, not the caller's, on every export.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        return ep.run_decompositions({}), bounds


def _explained(e: Exception) -> str:
    """What went wrong in an export, in the terms of the user's model, and what to pass instead;
    export's own message follows (and the error stays the cause)."""
    text = str(e)
    own = f"\n\ntorch.export said: {type(e).__name__}: {text}"
    if found := re.search(r"Found <class '([\w.]+)'> in output", text):
        kind = found.group(1).rsplit(".", 1)[-1]
        if "Cache" in kind:
            return (f"the model returns its KV cache (a {kind}), which graphs do not carry: pass use_cache=False "
                    "in the example (or set model.config.use_cache = False) to get the logits alone, or register "
                    "with cache_len=N to keep the cache on the node and decode in a session (rm.session())" + own)
        return (f"the model's output holds a {kind}, which graphs do not carry (they return tensors, numbers and "
                "their tuples, lists, dicts and dataclasses): register a wrapper whose forward returns the tensors "
                "you need" + own)
    if "data-dependent" in text or "DataDependent" in type(e).__name__:
        # The line of the user's code that needed the value, as export tells it.
        call = re.search(r'raised this error:\s*File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)', text)
        where = f" (at {call[1]}:{call[2]}, in {call[3]}: {call[4].strip()})" if call else ""
        return (f"the model's control flow or a size depends on a tensor's values{where}, and a graph takes one "
                "path for every call: decide it outside the model and pass the decision as an input, compute "
                "both sides and pick with torch.where, or cut the model before it with split= and run that part "
                "yourself" + own)
    if "no fake impl" in text or ("fake impl" in text and "register_fake" in text):
        op = re.search(r"CustomOpDef\(([^)]+)\)", text)
        name = op.group(1) if op else "an operator"
        return (f"the model calls {name}, a custom operator no node runs (graphs carry ATen operators): compute "
                "it on the client and pass its result in (a wrapper whose forward takes it as an input), or cut "
                "the model before it with split=" + own)
    if "Constraints violated" in text or ("specialized" in text and "Dim" in text):
        return ("a dimension named in dynamic= cannot vary as named: the model fixes it or ties it to another "
                "(export's reasons below): leave it out of dynamic=, give it the bounds the model allows "
                "(dynamic={name: {dim: (label, min, max)}}), or give one label to the dimensions that must be "
                "equal" + own)
    return f"torch.export could not export the model: {type(e).__name__}: {text}"


def _check_named_dims_vary(ep, dynamic: dict, why) -> None:
    """Refuses an export that fixed a dimension the caller named dynamic (a fallback without
    the names may have let the model fix it): every call with another size would be refused."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for name, dims in dynamic.items():
        shape = getattr(placeholders.get(name) and placeholders[name].meta.get("val"), "shape", None)
        if shape is None:
            continue
        for dim, label in dims.items():
            fixed = _concrete(shape[dim]) if dim < len(shape) else None
            if fixed is not None:
                label = label[0] if isinstance(label, tuple) else label
                because = f"\n\ntorch.export said: {type(why).__name__}: {why}" if why is not None else ""
                raise ExportError(
                    f"{name}'s dimension {dim}, named dynamic ({label!r}), cannot vary: the model fixes it to "
                    f"{fixed} (a weight's size, or a size the code compares it with). Leave it out of dynamic= "
                    f"to register the model for that size, or change the model so that the size may vary" + because)


def _concrete(size) -> Optional[int]:
    """A dimension's size when export fixed it (an int, or a symbol it solved to one)."""
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return size if isinstance(size, int) else None


def _size_oblivious(on: bool):
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=on)


def split_points(model: torch.nn.Module, split) -> list[str]:
    """The submodules after which the graph is cut into blocks, in execution order: none for
    `split=None`; for `split=True` a Hugging Face model's decoder layers (the classes its
    `_no_split_modules` names), a Sequential's children, else the items of the model's longest
    ModuleList; or the names given (`["model.layers.3", ...]`, as `named_modules` names
    them)."""
    if split is None or split is False:
        return []
    modules = dict(model.named_modules())
    if split is True:
        classes = set(getattr(model, "_no_split_modules", None) or ())
        found = [n for n, m in modules.items() if n and type(m).__name__ in classes]
        if not found and isinstance(model, torch.nn.Sequential):
            found = [n for n, _ in model.named_children()]
        if not found:
            lists = [(n, m) for n, m in modules.items() if isinstance(m, torch.nn.ModuleList) and len(m)]
            if lists:
                name, longest = max(lists, key=lambda item: len(item[1]))
                found = [f"{name}.{i}" if name else str(i) for i in range(len(longest))]
        # A layer inside another (an encoder's blocks of layers) is cut at the outer one.
        found = [n for n in found if not any(n.startswith(f"{o}.") for o in found)]
        if not found:
            raise ExportError(f"split=True finds no layers in {type(model).__name__}: name the submodules to cut after")
        return found
    names = [split] if isinstance(split, str) else list(split)
    unknown = [n for n in names if n not in modules or not n]
    if unknown:
        raise ExportError(f"split names {', '.join(map(repr, unknown))}, which are not submodules of the model")
    return names


def _range(expr, ranges: dict) -> dict:
    """The sizes a symbolic dimension may take, as export's range constraints bound them."""
    from torch.utils._sympy.value_ranges import bound_sympy

    try:
        r = bound_sympy(expr, ranges)
        lo, hi = _bound(r.lower, 0), _bound(r.upper, UNBOUNDED)
    except Exception:  # noqa: BLE001 - an expression sympy cannot bound is left open
        lo, hi = 0, UNBOUNDED
    return {"min": max(lo, 0), "max": min(hi, UNBOUNDED)}


def _module_of(node, with_class: bool = False) -> str:
    """The innermost module a node of the exported graph runs in ("" for the model's own);
    `with_class`: with its class ("layers.0.mlp (LlamaMLP)", "the model's own forward")."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, kind in reversed(list(stack.values())):
        if isinstance(path, str) and not path.startswith("_"):
            if not with_class:
                return path
            kind = kind.__name__ if isinstance(kind, type) else str(kind).strip("<>'").rsplit(".", 1)[-1]
            return f"{path} ({kind})"
    return "" if not with_class else "the model's own forward"


def encode_arg(a, value) -> Any:
    """An argument as the format writes it: `value(a)`, the writer's encoding of a value of its
    graph, when that is not None; else the constant (lists recursively)."""
    v = value(a)
    if v is not None:
        return v
    if a is None:
        return "none"
    if isinstance(a, bool):
        return {"b": a}
    if isinstance(a, int):
        return {"i": a}
    if isinstance(a, float):
        return {"f": repr(a)}
    if isinstance(a, str):
        return {"s": a}
    if isinstance(a, torch.dtype):
        if a not in _DTYPES:
            raise ExportError(f"dtype {a} is not carried by graphs")
        return {"dtype": _DTYPES[a]}
    if isinstance(a, torch.device):
        # Whatever device the node runs the model on.
        return {"device": "node"}
    if isinstance(a, torch.layout):
        if a != torch.strided:
            raise ExportError(f"layout {a}: graphs carry strided tensors only")
        return {"layout": "strided"}
    if isinstance(a, torch.memory_format):
        return {"memory_format": _MEMORY_FORMATS[a]}
    if isinstance(a, (list, tuple)):
        return {"list": [encode_arg(x, value) for x in a]}
    raise ExportError(f"an argument of type {type(a).__name__} ({a!r}) is not carried by graphs")


def _raw(tensor, what: str) -> tuple:
    """A tensor as the container stores it: (dtype, shape, bytes)."""
    if not isinstance(tensor, torch.Tensor):
        raise ExportError(f"{what} is a {type(tensor).__name__}, not a tensor")
    if tensor.dtype not in _DTYPES:
        raise ExportError(f"{what} is {tensor.dtype}, which graphs do not carry")
    data = tensor.detach().to("cpu").contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return _DTYPES[data.dtype], list(data.shape), raw


# Functional updates export leaves for a buffer written in place, and the in-place operators
# (on the allowlist, for a session's state only) that write it where it is.
_IN_PLACE = {
    ("aten::index_copy", ""): ("aten::index_copy_", ""),
    ("aten::masked_fill", "Scalar"): ("aten::masked_fill_", "Scalar"),
    ("aten::masked_fill", "Tensor"): ("aten::masked_fill_", "Tensor"),
    ("aten::fill", "Scalar"): ("aten::fill_", "Scalar"),
    ("aten::fill", "Tensor"): ("aten::fill_", "Tensor"),
    ("aten::zero", ""): ("aten::zero_", ""),
    ("aten::copy", ""): ("aten::copy_", ""),
}


class _Export:
    """One exported program, as its graphs draw on it: its weights, the constants export fixed,
    the buffers it writes (a session's state) and how each is written."""

    def __init__(self, ep):
        self.ep = ep
        self.params = {**ep.state_dict, **getattr(ep, "constants", {})}
        self.weight_of: dict[str, str] = {}  # placeholder name -> weight name
        self.constants: dict[str, Any] = {}  # placeholder name -> the value export fixed
        self.state_of: dict[str, str] = {}  # placeholder name -> the buffer it is
        self.updates: dict[str, Any] = {}  # buffer -> the node of its new value
        # Nodes whose functional update becomes its in-place operator: node name -> (op, overload).
        self.in_place: dict[str, tuple] = {}
        self.op_modules: dict[str, str] = {}
        sig = ep.graph_signature
        mutations = [spec for spec in sig.output_specs if spec.kind.name == "BUFFER_MUTATION"]
        mutated = {spec.target for spec in mutations}
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind.name == "BUFFER" and spec.target in mutated:
                self.state_of[name] = spec.target
            elif spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
                self.weight_of[name] = spec.target
        placeholder_of = {target: name for name, target in self.state_of.items()}
        for spec in sig.output_specs:
            if spec.kind.name not in ("USER_OUTPUT", "BUFFER_MUTATION"):
                raise ExportError(f"the model updates {spec.kind.name} {spec.target}, which graphs do not carry")
        nodes = {n.name: n for n in ep.graph.nodes}
        out_node = next(n for n in ep.graph.nodes if n.op == "output")
        new_values = out_node.args[0][: len(mutations)]
        for spec, value in zip(mutations, new_values):
            self.updates[spec.target] = value
            placeholder = nodes[placeholder_of[spec.target]]
            if _writable_in_place(ep.graph, placeholder, value):
                schema = value.target._schema
                self.in_place[value.name] = _IN_PLACE[(schema.name, schema.overload_name)]
        # The state's values now (before any eager call writes them) are a session's first.
        self.initial = {target: _raw(self.params[target], target) for target in self.state_of.values()}


def _writable_in_place(graph, buffer, value) -> bool:
    """Whether `value`, the buffer's new value, can be computed by writing the buffer in place:
    a functional update of the buffer with an in-place form, after which nothing (the call's
    results included) reads the buffer or a view of it."""
    if value.op != "call_function" or not isinstance(value.target, torch._ops.OpOverload):
        return False
    schema = value.target._schema
    if (schema.name, schema.overload_name) not in _IN_PLACE or not value.args or value.args[0] is not buffer:
        return False
    aliases = {buffer}
    after = False
    for node in graph.nodes:
        if node is value:
            after = True
            continue
        if node.op not in ("call_function", "output"):
            continue
        overload = node.target if isinstance(node.target, torch._ops.OpOverload) else None
        if overload is not None and overload._schema.name in _DROPPED:
            continue
        if not any(a in aliases for a in node.all_input_nodes):
            continue
        if after:
            return False
        # A view of the buffer (an operator returning an alias of its first argument), or an
        # item of a list of views, reads it later.
        returns = overload._schema.returns if overload is not None else ()
        view = bool(returns) and returns[0].alias_info is not None and node.args[0] in aliases
        if view or node.target is operator.getitem:
            aliases.add(node)
    return True


class _Container:
    """One container: the weights its graphs share, the session's state, and the value ids,
    which its graphs number from one count (each graph's own never meet another's)."""

    def __init__(self):
        self.count = 0
        self.weights, self.state, self.blobs = [], [], []
        self.offset = 0
        self.weight_ids: dict[str, int] = {}

    def new_id(self) -> int:
        self.count += 1
        return self.count - 1

    def store(self, raw: bytes) -> int:
        at = self.offset
        self.blobs.append((at, raw))
        self.offset = (self.offset + len(raw) + ALIGN - 1) // ALIGN * ALIGN
        return at

    def weight(self, target: str, raw: tuple) -> int:
        if target not in self.weight_ids:
            dtype, shape, data = raw
            self.weight_ids[target] = self.new_id()
            self.weights.append({"name": target, "value": self.weight_ids[target], "dtype": dtype, "shape": shape,
                                 "offset": self.store(data)})
        return self.weight_ids[target]

    def add_state(self, target: str, raw: tuple) -> None:
        dtype, shape, data = raw
        spec = {"name": target, "dtype": dtype, "shape": shape}
        if any(data):
            spec["offset"] = self.store(data)
        self.state.append(spec)

    def encode(self, graphs: list[dict]) -> bytes:
        program = {"format": FORMAT, **graphs[0], "weights": self.weights}
        if self.state:
            program["state"] = self.state
        if len(graphs) > 1:
            program["entries"] = graphs[1:]
        body = bytearray(self.offset)
        for at, raw in self.blobs:
            body[at:at + len(raw)] = raw
        return container_head(json.dumps(program, separators=(",", ":")).encode()) + bytes(body)


def container_head(text: bytes) -> bytes:
    """A container's head: the magic, the program's JSON `text`, padding to the body."""
    head = MAGIC + struct.pack("<Q", len(text)) + text
    return head + b"\0" * (-len(head) % ALIGN)


class _Program:
    """One graph: its inputs (the caller's, or what the block before passes on, then the
    session's state), its nodes, its outputs; over its container's weights."""

    def __init__(self, container: _Container, export: _Export):
        self.c = container
        self.x = export
        self.ids: dict[str, int] = {}
        self.inputs, self.nodes = [], []
        # Each tensor input's dimensions as export's symbolic expressions, for sizes computed
        # in an earlier block (read again here from what this block receives).
        self.shapes: list[tuple[str, list]] = []

    def new_id(self, name: str) -> int:
        self.ids[name] = self.c.new_id()
        return self.ids[name]

    def add_input(self, node, name: str, dims: list, state: bool = False) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ExportError(f"input {name!r} is not a tensor")
        if val.dtype not in _DTYPES:
            raise ExportError(f"input {name!r} is {val.dtype}, which graphs do not carry")
        spec = {"name": name, "value": self.new_id(node.name), "dtype": _DTYPES[val.dtype], "dims": dims}
        if state:
            spec["state"] = True
        self.inputs.append(spec)
        self.shapes.append((node.name, [d.node.expr if isinstance(d, torch.SymInt) else None for d in val.shape]))

    def value(self, node) -> dict:
        if node.name in self.ids:
            return {"v": self.ids[node.name]}
        if node.name in self.x.constants:
            return self.arg(self.x.constants[node.name])
        if node.name in self.x.weight_of:
            target = self.x.weight_of[node.name]
            self.ids[node.name] = self.c.weight(target, _raw(self.x.params[target], target))
            return {"v": self.ids[node.name]}
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt):
            return self.size(node, val.node.expr)
        raise ExportError(f"{node.name} is used before it is defined")

    def graph(self, outputs: list) -> dict:
        return {"inputs": self.inputs, "nodes": self.nodes, "outputs": [self.arg(a) for a in outputs]}

    def size(self, node, expr) -> dict:
        """A size computed in an earlier block: read from a tensor this block receives, or
        computed again from such sizes."""
        for source, exprs in self.shapes:
            for dim, e in enumerate(exprs):
                if e is not None and e == expr:
                    self.nodes.append({"op": "native::size", "args": [{"v": self.ids[source]}, {"i": dim}],
                                       "outputs": [self.new_id(node.name)]})
                    return {"v": self.ids[node.name]}
        if node.op == "call_function" and (node.target in _NATIVE or _is_sym_size(node.target)):
            self.emit(node)
            return {"v": self.ids[node.name]}
        raise ExportError(f"the size {expr} is needed after a cut, and no tensor passed on has it")

    def arg(self, a) -> Any:
        return encode_arg(a, lambda x: self.value(x) if isinstance(x, torch.fx.Node) else None)

    def emit(self, node) -> None:
        """Writes one call_function node of the exported graph."""
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            name, overload = schema.name, schema.overload_name
            if name in _DROPPED:
                return
            if _is_sym_size(target):
                args = [self.arg(a) for a in node.args]
                self.nodes.append({"op": "native::size", "args": args, "outputs": [self.new_id(node.name)]})
                return
            kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
            overload = _WITH_GENERATOR.get((name, overload), overload)
            # A session's state updated where it is, not copied (see `_writable_in_place`).
            name, overload = self.x.in_place.get(node.name, (name, overload))
            node_args = list(node.args)
            if name in _ZEROED:
                name, overload = _ZEROED[name], ""
                kwargs.pop("memory_format", None)
                if schema.name == "aten::empty_strided":
                    node_args = node_args[:1]
            args = [self.arg(a) for a in node_args]
            n_returns = len(schema.returns)
            if n_returns == 1:
                outputs = [self.new_id(node.name)]
            elif n_returns > 1:
                # Several returns: a tuple the graph takes apart with getitem; each is a value.
                outputs = [self.new_id(f"{node.name}#{i}") for i in range(n_returns)]
            else:
                outputs = []
            self.nodes.append({"op": name, "overload": overload, "args": args, "kwargs": kwargs, "outputs": outputs})
            self.x.op_modules.setdefault(name, _module_of(node, with_class=True))
        elif target in _NATIVE:
            src = node.args[0] if node.args else None
            if target is operator.getitem and isinstance(src, torch.fx.Node) and f"{src.name}#0" in self.ids:
                # An item of a multi-return operator: that return's value.
                self.ids[node.name] = self.ids[f"{src.name}#{node.args[1]}"]
                return
            args = [self.arg(a) for a in node.args]
            self.nodes.append({"op": f"native::{_NATIVE[target]}", "args": args, "outputs": [self.new_id(node.name)]})
        else:
            raise ExportError(f"{target} is not an ATen operator (higher-order operators such as autocast or control "
                              "flow are not carried by graphs)")


def _is_sym_size(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.name == "aten::sym_size" \
        and target._schema.overload_name == "int"


def _blocks_of(nodes: list, points: list[str]) -> list[int]:
    """Each node's block: a node in the k-th cut module is in block k, a node after it and
    before the next cut module's in block k + 1."""
    index = {p: k for k, p in enumerate(points)}
    blocks, after = [], -1
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        own = [index[path] for path, _ in stack.values() if path in index]
        if own:
            k = own[0]
            if k < after:
                raise ExportError(f"{points[k]} runs after {points[after]}: the cut modules must run once each, "
                                  "in the order given")
            after = k
            blocks.append(k)
        else:
            blocks.append(after + 1)
    return blocks


def _user_inputs(x: _Export) -> tuple[list, list]:
    """The placeholders of the caller's tensors, and the leaves of a call (a tensor's, or the
    constant export fixed); the constants noted in `x`."""
    placeholders = {n.name: n for n in x.ep.graph.nodes if n.op == "placeholder"}
    inputs, leaves = [], []
    for spec in x.ep.graph_signature.input_specs:
        kind, name = spec.kind.name, spec.arg.name
        if kind == "USER_INPUT":
            if type(spec.arg).__name__ == "ConstantArgument":
                x.constants[name] = spec.arg.value
                leaves.append(spec.arg.value)
                continue
            inputs.append(placeholders[name])
            leaves.append(_TENSOR)
        elif kind not in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            raise ExportError(f"an input of kind {kind} ({name}): not in graphs of this format")
    return inputs, leaves


def _input_dims(node, given: dict, ranges: dict) -> list:
    """A caller's input's dimensions: export's ranges, within the bounds the caller gave."""
    dims = []
    for at, d in enumerate(getattr(node.meta.get("val"), "shape", ())):
        if isinstance(d, int):
            dims.append({"min": d, "max": d})
            continue
        r = _range(d.node.expr, ranges)
        if at in given:
            r = {"min": max(r["min"], given[at][0]), "max": min(r["max"], given[at][1])}
        dims.append(r)
    return dims


def _results(x: _Export) -> list:
    """What a call returns, flattened: the output node's values after the buffers' updates."""
    out_node = next(n for n in x.ep.graph.nodes if n.op == "output")
    results = pytree.tree_leaves(out_node.args[0][len(x.updates):])
    for leaf in results:
        if not isinstance(leaf, (torch.fx.Node, int, float, bool)) and leaf is not None:
            raise ExportError(f"the model returns a {type(leaf).__name__}; graphs return tensors and numbers")
    return results


def _write(eps: list, signature: inspect.Signature, bounds: dict, points: list[str]) -> Graph:
    exports = [_Export(ep) for ep in eps]
    first = exports[0]
    state = list(first.state_of.values())
    if state and points:
        raise ExportError("split= with a model that writes its buffers (a session's state): state is kept by "
                          "models of one block")
    user_inputs, leaves = _user_inputs(first)
    for x in exports[1:]:
        if sorted(x.state_of.values()) != sorted(state):
            raise ExportError("the examples write different buffers")
        if x.ep.call_spec.in_spec != first.ep.call_spec.in_spec:
            raise ExportError("the examples are not shaped alike")
    if len(exports) > 1 or state:
        return _write_entries(exports, signature, bounds, state, leaves)
    ep = first.ep
    graph = ep.graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    blocks = _blocks_of(calls, points) if points else [0] * len(calls)
    # An item of an operator's list or tuple belongs with the operator.
    block_of = {}
    for node, k in zip(calls, blocks):
        src = node.args[0] if node.args else None
        block_of[node.name] = block_of.get(src.name, k) if node.target is operator.getitem and isinstance(src, torch.fx.Node) else k
    last = max(block_of.values(), default=0)
    out_node = next(n for n in graph.nodes if n.op == "output")
    results = _results(first)
    # What each block passes on: the tensors defined up to it and used after it.
    last_use: dict[str, int] = {}
    for node in [*calls, out_node]:
        k = block_of.get(node.name, last)
        if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in _DROPPED:
            continue
        for a in node.all_input_nodes:
            last_use[a.name] = max(last_use.get(a.name, -1), k)
    carried = [n for n in [*user_inputs, *calls] if isinstance(n.meta.get("val"), torch.Tensor)]

    def passed_on() -> list[list]:
        return [[n for n in carried if block_of.get(n.name, 0) <= k < last_use.get(n.name, -1)] for k in range(last)]

    cut_nodes = passed_on()
    # A size a later block needs is read again from a tensor it receives with that size; where
    # none has it (a batch of 1 that the layers' shapes fixed), the tensor it was read from
    # (an input's) is passed on too.
    for node in [*calls, out_node]:
        k = block_of.get(node.name, last)
        for a in node.all_input_nodes:
            if isinstance(a.meta.get("val"), torch.SymInt) and block_of.get(a.name, 0) < k:
                have = {d.node.expr for n in cut_nodes[k - 1] for d in n.meta["val"].shape if isinstance(d, torch.SymInt)}
                for source in _size_sources(a, have):
                    last_use[source.name] = max(last_use.get(source.name, -1), k)
    cut_nodes = passed_on()
    cuts = [_names(nodes, points) for nodes in cut_nodes]
    ranges = ep.range_constraints
    containers = []
    for k in range(last + 1):
        container = _Container()
        program = _Program(container, first)
        if k == 0:
            for node in user_inputs:
                program.add_input(node, node.name, _input_dims(node, bounds.get(node.name, {}), ranges))
        else:
            for node, name in zip(cut_nodes[k - 1], cuts[k - 1]):
                val = node.meta["val"]
                dims = [{"min": d, "max": d} if isinstance(d, int) else _range(d.node.expr, ranges) for d in val.shape]
                program.add_input(node, name, dims)
        for node in calls:
            if block_of[node.name] == k:
                program.emit(node)
        containers.append(container.encode([program.graph(results if k == last else cut_nodes[k])]))
    return Graph(containers, ep.call_spec.in_spec, leaves, ep.call_spec.out_spec, signature, cuts, 0,
                 op_modules=first.op_modules)


def _write_entries(exports: list, signature, bounds: dict, state: list, leaves: list) -> Graph:
    """One container: a graph per export over the same weights, each taking the session's
    state after the caller's inputs and giving its new value after the call's results."""
    container = _Container()
    for target in state:
        container.add_state(target, exports[0].initial[target])
    graphs = []
    for j, x in enumerate(exports):
        program = _Program(container, x)
        user_inputs, _ = _user_inputs(x)
        for node in user_inputs:
            program.add_input(node, node.name, _input_dims(node, bounds.get(node.name, {}) if j == 0 else {},
                                                           x.ep.range_constraints))
        placeholders = {n.name: n for n in x.ep.graph.nodes if n.op == "placeholder"}
        state_inputs = {target: placeholders[name] for name, target in x.state_of.items()}
        for target in state:
            node = state_inputs[target]
            program.add_input(node, target, [{"min": d, "max": d} for d in node.meta["val"].shape], state=True)
        for node in x.ep.graph.nodes:
            if node.op == "call_function":
                program.emit(node)
        # A buffer the graph does not write is its own new value.
        new_state = [x.updates.get(target, state_inputs[target]) for target in state]
        graphs.append(program.graph(_results(x) + new_state))
    ep = exports[0].ep
    state_bytes = sum(len(exports[0].initial[target][2]) for target in state)
    modules = {op: module for x in exports for op, module in x.op_modules.items()}
    return Graph([container.encode(graphs)], ep.call_spec.in_spec, leaves, ep.call_spec.out_spec, signature, [],
                 len(state), state_bytes, op_modules=modules)


def _size_sources(node, have: set) -> list:
    """The tensors a size (`node`, a SymInt of the graph) is read from, where its expression is
    not among `have` (the sizes of what a block receives)."""
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt) and val.node.expr in have:
        return []
    if node.op == "call_function" and _is_sym_size(node.target):
        return [node.args[0]]
    if node.op == "call_function" and node.target in _NATIVE:
        return [t for a in node.all_input_nodes for t in _size_sources(a, have)]
    return []


def _names(nodes: list, points: list[str]) -> list[str]:
    """Names for what a block passes on: a caller's input by its name, another value by the
    module that computed it (as a forward hook on it sees it): the cut module it was computed
    in, else the innermost; a module that passes on several is indexed
    (`model.rotary_emb[0]`)."""

    def module(node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        cut = [path for path, _ in stack.values() if path in points]
        return cut[0] if cut else _module_of(node)

    names = [n.name if n.op == "placeholder" else (module(n) or n.name) for n in nodes]
    counts = {name: names.count(name) for name in names}
    seen: dict[str, int] = {}
    out = []
    for name in names:
        if counts[name] > 1:
            i = seen.get(name, 0)
            seen[name] = i + 1
            name = f"{name}[{i}]"
        out.append(name)
    return out
