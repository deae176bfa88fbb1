"""The semantically rich graph (SRG): a captured graph's operations annotated with what they
are for, found by pattern recognition on the aten operations.

- phase: `prefill` or `decode` for a graph with attention (decode: one query over a longer key
  sequence), `vision` for convolution stages, else `forward`;
- residency of each operation's output: `weight` (tensors kept on the node and views of them),
  `kv_cache` (storages written by a cache update and read as attention keys or values), else
  `activation`;
- modality: `text` downstream of an embedding, `vision` downstream of a convolution,
  `multimodal` where both meet, else `tensor`;
- cost: FLOPs (PyTorch's flop counter formulas, on the meta shapes) and bytes read and written;
- pattern: `attention` (QK matmul, softmax, AV matmul, and what lies between, numbered by
  block), `kv_cache_update`, `convolution` (with its stage), `embedding`, `matmul`, `norm`,
  `pooling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.flop_counter import flop_registry

from ._recording import _meta_args, _meta_of, _Value
from .tensors import RemoteTensor

aten = torch.ops.aten

# Outputs that alias their first input.
_ALIASES = {
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten._reshape_alias,
    aten.expand,
    aten.transpose,
    aten.permute,
    aten.t,
    aten.unsqueeze,
    aten.squeeze,
    aten.slice,
    aten.select,
    aten.detach,
    aten.alias,
    aten.as_strided,
}
# ... and copies of it, as an attention's keys and values pass through on their way.
_VIEWS = _ALIASES | {aten.clone, aten.contiguous, aten._to_copy}
# What lies between an attention's scores and its softmax, or its softmax and the AV matmul.
_SCORE_OPS = _VIEWS | {aten.add, aten.sub, aten.mul, aten.div, aten.where, aten.masked_fill, aten.native_dropout}
_SCALE_OPS = {aten.mul, aten.div}
_MATMULS = {aten.bmm, aten.mm, aten.baddbmm, aten.matmul}
_SOFTMAX = {aten._softmax, aten._safe_softmax, aten.softmax}
_FUSED_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten.scaled_dot_product_attention,
}
_CACHE_WRITES = {aten.index_copy_, aten.index_copy, aten.index_put_, aten.copy_, aten.slice_scatter, aten.scatter_}
_CONVOLUTIONS = {aten.convolution, aten._convolution, aten.conv2d, aten.conv1d, aten.conv3d}
_PATTERNS = [
    (_MATMULS | {aten.addmm, aten.linear}, "matmul"),
    ({aten.embedding}, "embedding"),
    (
        {
            aten.native_layer_norm,
            aten.native_batch_norm,
            aten._native_batch_norm_legit_no_training,
            aten._native_batch_norm_legit,
            aten.native_group_norm,
        },
        "norm",
    ),
    (
        {
            aten.max_pool2d_with_indices,
            aten.avg_pool2d,
            aten._adaptive_avg_pool2d,
            aten.adaptive_max_pool2d,
            aten.max_pool1d_with_indices,
        },
        "pooling",
    ),
]


def _bytes(meta) -> int:
    return meta.numel() * meta.element_size()


def _shape_text(meta) -> str:
    dtype = str(meta.dtype).removeprefix("torch.")
    return f"{dtype}{list(meta.shape)}"


@dataclass
class Operation:
    """One operation of the graph: `op` called on `inputs` (its arguments: `%n` for operation
    n's output, `iK` for the graph's input K) makes `output`."""

    index: int
    op: str
    inputs: list[str]
    output: str
    phase: str
    residency: str
    modality: str
    flops: int
    bytes: int
    pattern: Optional[str] = None
    attention: Optional[int] = None
    stage: Optional[int] = None


@dataclass
class Attention:
    """An attention block: its operations, and its query and key lengths."""

    operations: list[int]
    query_len: int
    key_len: int
    phase: str
    kv_cache: bool


@dataclass
class SemanticGraph:
    operations: list[Operation]
    inputs: list[dict]
    attention: list[Attention]
    phase: str
    modality: str
    flops: int
    weight_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    io_bytes: int
    outputs: list[str] = field(default_factory=list)
    # The graph's fingerprint on the nodes, once it is registered.
    fingerprint: Optional[str] = None

    def summary(self) -> dict:
        """What travels to the control plane with the graph's registration."""
        return {
            "phase": self.phase,
            "modality": self.modality,
            "operations": len(self.operations),
            "attention": len(self.attention),
            "flops": float(self.flops),
            "weight_bytes": self.weight_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "activation_bytes": self.activation_bytes,
        }

    def description(self) -> dict:
        """The registration's description: the weights are inputs kept on the node, so the
        archive has none; the phase the control plane's cost model knows, when it is one."""
        return {
            "blocks": [(0, float(self.flops))],
            "io_bytes": self.io_bytes,
            "phase": self.phase if self.phase in ("prefill", "decode") else None,
            "graph": self.summary(),
        }

    def __str__(self) -> str:
        mib = 1 << 20
        lines = [
            f"SemanticGraph: {len(self.operations)} operations, phase {self.phase}, modality {self.modality}, "
            f"{self.flops / 1e6:.3f} MFLOP, weights {self.weight_bytes / mib:.3f} MiB, "
            f"KV cache {self.kv_cache_bytes / mib:.3f} MiB, {len(self.attention)} attention blocks",
            "inputs:",
        ]
        lines += [f"  i{i['index']:<4} {i['tensor']:<24} {i['residency']}" for i in self.inputs]
        for k, a in enumerate(self.attention):
            cache = ", over a KV cache" if a.kv_cache else ""
            lines.append(
                f"attention {k}: operations {a.operations[0]}..{a.operations[-1]}, {a.query_len} queries over "
                f"{a.key_len} keys: {a.phase}{cache}"
            )
        header = f"  {'#':<5}{'operation':<44}{'output':<30}{'phase':<9}{'residency':<12}{'modality':<11}{'FLOPs':>12}{'bytes':>12}  pattern"
        lines += ["operations:", header]
        for o in self.operations:
            call = f"{o.op}({', '.join(o.inputs)})"
            if len(call) > 43:
                call = call[:40] + "..."
            pattern = o.pattern or ""
            if o.attention is not None:
                pattern += f" {o.attention}"
            if o.stage is not None:
                pattern += f" stage {o.stage}"
            lines.append(
                f"  {o.index:<5}{call:<44}{o.output:<30}{o.phase:<9}{o.residency:<12}{o.modality:<11}"
                f"{o.flops:>12}{o.bytes:>12}  {pattern}"
            )
        lines.append(f"outputs: {', '.join(self.outputs)}")
        return "\n".join(lines)


def annotate(plan) -> SemanticGraph:
    """The SRG of a capture plan (`capture._Plan`: operations in order, the leaves they read,
    the values they make)."""

    ops = plan.ops
    packet = [op.func.overloadpacket for op in ops]
    position = {id(op): n for n, op in enumerate(ops)}
    leaf_index = {id(v): i for i, v in enumerate(plan.leaves)}

    def producer(v) -> Optional[int]:
        return None if v.op is None else position.get(id(v.op))

    def name(v) -> str:
        n = producer(v)
        return f"i{leaf_index[id(v)]}" if n is None else f"%{n}"

    consumers: dict[int, list[int]] = {}
    for n, op in enumerate(ops):
        for v in op.inputs:
            consumers.setdefault(id(v), []).append(n)
    outputs = [_meta_of(op.out) for op in ops]

    # The values each operation made that the graph uses (operations do not hold their
    # outputs' values; the values that read them, and the targets, do).
    made: dict[int, list] = {}
    for v in [v for op in ops for v in op.inputs] + list(plan.targets):
        p = producer(v)
        if p is not None and all(v is not w for w in made.get(p, [])):
            made.setdefault(p, []).append(v)

    def output_values(n: int) -> list:
        return made.get(n, [])

    def first_tensor(op):
        return next((v for v in op.inputs if isinstance(v, _Value) and v.meta.dim() > 0), None)

    def back(v, through: set, hops: int, goal: set):
        """Follows `v` up through operations of `through` to one of `goal`."""
        for _ in range(hops):
            n = producer(v)
            if n is None:
                return None
            if packet[n] in goal:
                return n
            if packet[n] not in through:
                return None
            v = first_tensor(ops[n])
            if v is None:
                return None
        return None

    def origin(v, through=_VIEWS | _SCALE_OPS):
        """The value `v` is made from by operations of `through` alone."""
        while True:
            n = producer(v)
            if n is None or packet[n] not in through:
                return v
            nxt = first_tensor(ops[n])
            if nxt is None:
                return v
            v = nxt

    # Attention: a softmax between a QK matmul and an AV matmul, or a fused attention call.
    groups: list[tuple[list[int], int, int, list]] = []
    for n, p in enumerate(packet):
        if p in _FUSED_ATTENTION:
            q, k, v = ops[n].inputs[:3]
            groups.append(([n], q.meta.shape[-2], k.meta.shape[-2], [k, v]))
        if p not in _SOFTMAX:
            continue
        qk = back(ops[n].inputs[0], _SCORE_OPS, 8, _MATMULS)
        if qk is None:
            continue
        av = None
        frontier = [n]
        for _ in range(6):
            nxt = []
            for m in frontier:
                for value in output_values(m):
                    for c in consumers.get(id(value), []):
                        if packet[c] in _MATMULS and ops[c].inputs[0] is value:
                            av = c
                        elif packet[c] in _SCORE_OPS:
                            nxt.append(c)
            if av is not None or not nxt:
                break
            frontier = nxt
        if av is None:
            continue
        scores = outputs[qk]
        members = sorted({qk, n, av} | set(_between(qk, av, ops, producer)))
        groups.append((members, scores.shape[-2], scores.shape[-1], [ops[qk].inputs[1], ops[av].inputs[1]]))

    attention: list[Attention] = []
    in_attention: dict[int, int] = {}
    kv_storages: set[int] = set()
    cache_writes: set[int] = set()
    for k, (members, q_len, k_len, kv) in enumerate(groups):
        cached = False
        for value in kv:
            root = origin(value)
            writes = [w for w in root.storage.writes if id(w) in position and w.func.overloadpacket in _CACHE_WRITES]
            grown = producer(root) is not None and packet[producer(root)] is aten.cat
            if writes or grown:
                cached = True
                kv_storages.add(id(root.storage))
                cache_writes.update(position[id(w)] for w in writes)
                if grown:
                    cache_writes.add(producer(root))
        phase = "decode" if q_len == 1 and k_len > 1 else "prefill"
        attention.append(Attention(members, q_len, k_len, phase, cached))
        for m in members:
            in_attention[m] = k

    convolutions = [n for n, p in enumerate(packet) if p in _CONVOLUTIONS]
    if attention:
        phase = "decode" if all(a.phase == "decode" for a in attention) else "prefill"
    elif convolutions:
        phase = "vision"
    else:
        phase = "forward"

    def residency_of(v) -> str:
        root = origin(v, _ALIASES)
        if id(root.storage) in kv_storages:
            return "kv_cache"
        if root.op is None and isinstance(root.leaf, RemoteTensor) and not root.storage.writes:
            return "weight"
        return "activation"

    modality: dict[int, set] = {}
    stage: dict[int, int] = {}
    operations = []
    totals = {"weight": 0, "kv_cache": 0, "activation": 0}
    flops_total = 0
    for n, op in enumerate(ops):
        tags = set()
        stages = []
        for v in op.inputs:
            p = producer(v)
            if p is not None:
                tags |= modality.get(p, set())
                if p in stage:
                    stages.append(stage[p])
        if packet[n] is aten.embedding:
            tags.add("text")
        if packet[n] in _CONVOLUTIONS:
            tags.add("vision")
            stage[n] = convolutions.index(n)
        elif stages:
            stage[n] = max(stages)
        modality[n] = tags
        out = outputs[n]
        out_metas = [m for m in _flat(out) if isinstance(m, torch.Tensor)]
        flops = _flops(op, out)
        flops_total += flops
        read = sum(_bytes(v.meta) for v in op.inputs)
        written = sum(_bytes(m) for m in out_metas)
        values = output_values(n)
        residency = residency_of(values[0]) if values else "activation"
        pattern = next((label for members, label in _PATTERNS if packet[n] in members), None)
        if n in in_attention:
            pattern = "attention"
        if n in cache_writes:
            pattern = "kv_cache_update"
            residency = "kv_cache"
        if packet[n] in _CONVOLUTIONS:
            pattern = "convolution"
        node_phase = "vision" if n in stage and attention else phase
        operations.append(
            Operation(
                index=n,
                op=str(op.func),
                inputs=[_argument(a, name) for a in op.args] + [f"{k}={_argument(a, name)}" for k, a in op.kwargs.items()],
                output=", ".join(_shape_text(m) for m in out_metas) or "-",
                phase=node_phase,
                residency=residency,
                modality=_modality(tags),
                flops=flops,
                bytes=read + written,
                pattern=pattern,
                attention=in_attention.get(n),
                stage=stage.get(n) if packet[n] in _CONVOLUTIONS or n in stage else None,
            )
        )
    inputs = []
    io_bytes = 0
    for i, v in enumerate(plan.leaves):
        residency = residency_of(v)
        totals[residency] += _bytes(v.meta)
        if not isinstance(v.leaf, RemoteTensor):
            io_bytes += _bytes(v.meta)
        inputs.append({"index": i, "tensor": _shape_text(v.meta), "residency": residency})
    for v in plan.targets:
        io_bytes += _bytes(v.meta)
    all_tags = set().union(*modality.values()) if modality else set()
    return SemanticGraph(
        operations=operations,
        inputs=inputs,
        attention=attention,
        phase=phase,
        modality=_modality(all_tags),
        flops=flops_total,
        weight_bytes=totals["weight"],
        kv_cache_bytes=totals["kv_cache"],
        activation_bytes=totals["activation"],
        io_bytes=io_bytes,
        outputs=[name(v) for v in plan.targets],
    )


def _between(first: int, last: int, ops, producer) -> list[int]:
    """Operations after `first` and before `last` that lie on a path from one to the other."""
    reach = {first}
    for n in range(first + 1, last):
        if any(producer(v) in reach for v in ops[n].inputs):
            reach.add(n)
    on_path = set()
    wanted = {last}
    for n in range(last - 1, first, -1):
        if n in reach and any(producer(v) == n for m in wanted for v in ops[m].inputs):
            on_path.add(n)
            wanted.add(n)
    return sorted(on_path)


def _argument(a, name) -> str:

    if isinstance(a, _Value):
        return name(a)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_argument(x, name) for x in a) + "]"
    return str(a).removeprefix("torch.")


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _modality(tags: set) -> str:
    if len(tags) > 1:
        return "multimodal"
    return next(iter(tags), "tensor")


def _flops(op, out) -> int:
    formula = flop_registry.get(op.func.overloadpacket)
    if formula is None:
        return 0

    args, kwargs = _meta_args(op)
    try:
        return int(formula(*args, out_val=out, **kwargs))
    except Exception:  # noqa: BLE001 - a formula that does not take these arguments counts nothing
        return 0
