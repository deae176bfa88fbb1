"""Models as data: `torch.export` makes a graph of ATen operators of a model, and this module
writes it in Djinn's graph format (docs/graph-format.md), which a node checks against its
allowlist and runs through libtorch's dispatcher. No TorchScript is involved."""

from __future__ import annotations

import inspect
import json
import operator
import struct
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

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


class ExportError(ValueError):
    """The model could not be written as a graph (the message says why)."""


_TENSOR = object()


@dataclass
class Graph:
    """A model written as a graph: the container's bytes, what a call's inputs must look like
    (the example's structure, each leaf a tensor the call sends or a constant export fixed),
    and how to rebuild the output structure."""

    container: bytes
    in_spec: Any
    leaves: list  # _TENSOR, or the constant export fixed there
    out_spec: Any
    signature: inspect.Signature

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


def export(model: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None, dynamic: Optional[dict] = None) -> Graph:
    """Exports `model` on the example inputs (`args`, `kwargs`) with torch.export (non-strict)
    and writes the graph. `dynamic` names the dimensions that may change between calls, by
    input name: `{"input_ids": {0: "batch", 1: "seq"}}`, or with bounds the node enforces:
    `{1: ("seq", 2, 64)}`; a name used twice is one size."""
    signature = inspect.signature(model.forward)
    try:
        bound = signature.bind(*args, **(kwargs or {}))
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
    attempts = [(shapes, True), (shapes, False), (everywhere_auto, True), (everywhere_auto, False)]
    was_training = model.training
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
        model.train(was_training)
    if ep is None:
        e = first_error
        raise ExportError(f"torch.export could not export the model: {type(e).__name__}: {e}") from e
    ep = ep.run_decompositions({})
    return _write(ep, signature, bounds)


def _size_oblivious(on: bool):
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=on)


def _write(ep, signature: inspect.Signature, bounds: dict) -> Graph:
    graph = ep.graph
    sig = ep.graph_signature
    ids: dict[str, int] = {}
    constants_of: dict[str, Any] = {}  # placeholder name -> constant value (baked inputs)

    def new_id(name: str) -> int:
        ids[name] = len(ids)
        return ids[name]

    inputs, weights, blobs, offset = [], [], [], 0
    leaves = []
    params = {**ep.state_dict, **getattr(ep, "constants", {})}
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    for spec in sig.input_specs:
        kind = spec.kind.name
        name = spec.arg.name
        if kind == "USER_INPUT":
            if type(spec.arg).__name__ == "ConstantArgument":
                constants_of[name] = spec.arg.value
                leaves.append(spec.arg.value)
                continue
            val = placeholders[name].meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ExportError(f"input {name!r} is not a tensor")
            if val.dtype not in _DTYPES:
                raise ExportError(f"input {name!r} is {val.dtype}, which graphs do not carry")
            dims = []
            given = bounds.get(name, {})
            for at, d in enumerate(val.shape):
                if isinstance(d, int):
                    dims.append({"min": d, "max": d})
                else:
                    r = ep.range_constraints.get(d.node.expr)
                    lo, hi = _bound(r and r.lower, 0), min(_bound(r and r.upper, UNBOUNDED), UNBOUNDED)
                    if at in given:
                        lo, hi = max(lo, given[at][0]), min(hi, given[at][1])
                    dims.append({"min": lo, "max": hi})
            inputs.append({"name": name, "value": new_id(name), "dtype": _DTYPES[val.dtype], "dims": dims})
            leaves.append(_TENSOR)
        elif kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            tensor = params[spec.target]
            if not isinstance(tensor, torch.Tensor):
                raise ExportError(f"{spec.target} is a {type(tensor).__name__}, not a tensor")
            if tensor.dtype not in _DTYPES:
                raise ExportError(f"{spec.target} is {tensor.dtype}, which graphs do not carry")
            data = tensor.detach().to("cpu").contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            weights.append({"name": spec.target, "value": new_id(name), "dtype": _DTYPES[data.dtype],
                            "shape": list(data.shape), "offset": offset})
            blobs.append((offset, raw))
            offset = (offset + len(raw) + ALIGN - 1) // ALIGN * ALIGN
        else:
            raise ExportError(f"an input of kind {kind} ({name}): not in graphs of this format")
    for spec in sig.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            raise ExportError(f"the model updates its state ({spec.kind.name} {spec.target}): sessions are not graphs yet")

    def arg(a) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.name in constants_of:
                return arg(constants_of[a.name])
            if a.name not in ids:
                raise ExportError(f"{a.name} is used before it is defined")
            return {"v": ids[a.name]}
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
            return {"list": [arg(x) for x in a]}
        raise ExportError(f"an argument of type {type(a).__name__} ({a!r}) is not carried by graphs")

    nodes = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        outputs = []
        if isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            name, overload = schema.name, schema.overload_name
            if name in _DROPPED:
                continue
            if name == "aten::sym_size" and overload == "int":
                nodes.append({"op": "native::size", "args": [arg(a) for a in node.args], "outputs": [new_id(node.name)]})
                continue
            kwargs = {k: arg(v) for k, v in node.kwargs.items()}
            overload = _WITH_GENERATOR.get((name, overload), overload)
            if name in _ZEROED:
                name = _ZEROED[name]
                overload = ""
                kwargs.pop("memory_format", None)
                node_args = list(node.args)
                if schema.name == "aten::empty_strided":
                    node_args = node_args[:1]
                args = [arg(a) for a in node_args]
            else:
                args = [arg(a) for a in node.args]
            n_returns = len(schema.returns)
            if n_returns == 1:
                outputs = [new_id(node.name)]
            elif n_returns > 1:
                # Several returns: a tuple the graph takes apart with getitem; each is a value.
                outputs = [new_id(f"{node.name}#{i}") for i in range(n_returns)]
            nodes.append({"op": name, "overload": overload, "args": args, "kwargs": kwargs, "outputs": outputs})
        elif target in _NATIVE:
            src = node.args[0] if node.args else None
            if target is operator.getitem and isinstance(src, torch.fx.Node) and f"{src.name}#0" in ids:
                # An item of a multi-return operator: that return's value.
                ids[node.name] = ids[f"{src.name}#{node.args[1]}"]
                continue
            nodes.append({"op": f"native::{_NATIVE[target]}", "args": [arg(a) for a in node.args], "outputs": [new_id(node.name)]})
        else:
            raise ExportError(f"{target} is not an ATen operator (higher-order operators such as autocast or control flow are not carried by graphs)")
    out_node = next(n for n in graph.nodes if n.op == "output")
    leaves_out = pytree.tree_leaves(out_node.args[0])
    for leaf in leaves_out:
        if not isinstance(leaf, (torch.fx.Node, int, float, bool)) and leaf is not None:
            raise ExportError(f"the model returns a {type(leaf).__name__}; graphs return tensors and numbers")
    outputs = [arg(a) for a in leaves_out]
    program = {"format": FORMAT, "inputs": inputs, "weights": weights, "nodes": nodes, "outputs": outputs}
    text = json.dumps(program, separators=(",", ":")).encode()
    head = MAGIC + struct.pack("<Q", len(text)) + text
    head += b"\0" * (-len(head) % ALIGN)
    body = bytearray(offset)
    for at, raw in blobs:
        body[at:at + len(raw)] = raw
    return Graph(bytes(head) + bytes(body), ep.call_spec.in_spec, leaves, ep.call_spec.out_spec, signature)
