"""Clients: a cluster reached through its control plane, or one node; the default client and
the calls that use it."""

from __future__ import annotations

import json
import os
import threading
from typing import Callable, Optional, Sequence, Union

import torch

from . import _native, _stats
from ._wire import CallTensors
from .errors import DjinnError
from .models import RemoteModel, register_with
from .tensors import RemoteTensor


class Client:
    """A cluster reached through its control plane, or one node alone. `djinn.init` makes the
    default one."""

    __module__ = "djinn"

    def __init__(
        self,
        address: Union[str, Sequence[str]],
        timeout: float = 60.0,
        transport: str = "auto",
        failover: float = 30.0,
        token: Optional[str] = None,
        tls: Optional[str] = None,
        tls_name: Optional[str] = None,
        max_reply_bytes: Optional[int] = None,
    ):
        """`address`: the control plane's "http://HOST:PORT" (models go where it places them,
        and move to another node when theirs dies), or several control processes that share an
        etcd (a list, or one string separated by commas: when one fails, the next answers), or
        a node's "HOST:PORT" (a bare HOST:PORT that serves HTTP is taken as a control plane). `transport`: "auto" (RDMA when both ends
        have it, else TCP), "rdma" or "tcp". `failover`: seconds a call may spend finding a
        live node when its node dies. `token`: the tenant's token, where the cluster needs
        one (default: the DJINN_TOKEN environment variable); models, tensors and sessions are
        then the tenant's own. `tls`: for nodes started with `--tls-cert`, the PEM file of the
        roots their certificates chain to (default: the DJINN_TLS_ROOTS environment variable);
        `tls_name`: the name expected in the certificates (default: the node's address).
        Frames then stay on TCP unless `transport="rdma"`: TLS does not cover RDMA.
        `max_reply_bytes`: the largest reply a call takes whose size its request does not fix
        (an execution's outputs; default 4 GiB); a larger one raises `BadReplyError` before it
        is read. A kept tensor's fetch is bounded by the tensor itself."""
        if token is None:
            token = os.environ.get("DJINN_TOKEN", "")
        if tls is None:
            tls = os.environ.get("DJINN_TLS_ROOTS") or None
        roots = None
        if tls is not None:
            with open(tls, "rb") as f:
                roots = f.read()
        if not isinstance(address, str):
            address = ",".join(address)
        self._native = _native.Client(address, timeout, transport, failover, token, roots, tls_name, max_reply_bytes)
        self.address = address

    @property
    def mode(self) -> str:
        """"control" (placed by a control plane) or "node" (one node alone)."""
        return self._native.mode

    def register(
        self, model, example_inputs, blocks=None, progress=None, policy=None, phase=None, public=False, dynamic=None,
        split=None, cache_len=None,
    ) -> "RemoteModel":
        """`djinn.register` on this client."""
        return register_with(
            self, model, example_inputs, blocks, progress, policy, phase, public, dynamic, split, cache_len
        )

    def cluster(self) -> dict:
        """The control plane's view: nodes (inventory, lease), models (and who holds them),
        sessions."""
        return json.loads(self._native.cluster())

    def ping(self) -> float:
        """Round-trip time to the node, seconds (a node alone)."""
        return self._native.ping()

    def models(self) -> list[dict]:
        return self._native.list_models()

    def stats(self) -> dict:
        """Transports in use, how the nodes' device memory meets the network (`memory_path`:
        "staging", through host memory), bytes sent and received, request counts, and failover
        counts (placements asked, node failures, re-registrations, replays), the inputs copied
        before sending (`input_copies`, `input_copy_bytes`: tensors not on the CPU or not
        contiguous; a contiguous CPU tensor is sent from its own memory), and under
        `capture` what transparent capture did in this process (operations recorded, graphs
        built, graph cache hits, graph executions, uploads)."""
        stats = self._native.stats()
        stats.update(_stats.snapshot(_stats.wire))
        stats["capture"] = _stats.snapshot(_stats.capture)
        return stats

    def keep(self, tensor: torch.Tensor, node: Optional[str] = None) -> "RemoteTensor":
        """Uploads `tensor` once to be kept in a node's device memory (`node`, by default the
        node this client was given) and returns it as a RemoteTensor to pass to models there."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"keep takes a tensor, not a {type(tensor).__name__}")
        call = CallTensors()
        call.flatten(tensor)
        return RemoteTensor(self._native.keep(call.tensors[0], node), self)

    def node_stats(self) -> dict:
        return self._native.node_stats()


_default: Optional[Client] = None
_default_lock = threading.Lock()


def init(
    address: Union[str, Sequence[str]],
    timeout: float = 60.0,
    transport: str = "auto",
    failover: float = 30.0,
    token: Optional[str] = None,
    tls: Optional[str] = None,
    tls_name: Optional[str] = None,
    max_reply_bytes: Optional[int] = None,
) -> Client:
    """Connects to a control plane ("http://host:port") or to one node ("host:port") and
    makes it the default. See `Client`."""
    global _default
    client = Client(address, timeout, transport, failover, token, tls, tls_name, max_reply_bytes)
    with _default_lock:
        _default = client
    return client


def _client(client: Optional[Client]) -> Client:
    if client is not None:
        return client
    if _default is None:
        raise DjinnError("not connected: call djinn.init('host:port') first")
    return _default


def stats() -> dict:
    """The default client's transports, bytes sent and received, request and failover counts."""
    return _client(None).stats()


def status() -> dict:
    """The cluster as the default client's control plane sees it (what `djinn status` prints)."""
    return _client(None).cluster()


def register(
    model,
    example_inputs,
    blocks: Optional[Sequence] = None,
    progress: Optional[Callable[[int, int], None]] = None,
    client: Optional[Client] = None,
    policy: Optional[str] = None,
    phase: Optional[str] = None,
    public: bool = False,
    dynamic: Optional[dict] = None,
    split=None,
    cache_len: Optional[int] = None,
) -> "RemoteModel":
    """Uploads `model` (once per node and tenant) and returns a RemoteModel to call. `public`
    weights are held once per node for every tenant that registers the same bytes as public;
    else the model is the tenant's alone.

    By default the model is exported with torch.export (non-strict) on `example_inputs` and
    sent as a graph: data the node checks (every operator on its allowlist) and runs through
    libtorch's dispatcher. `example_inputs`: one input, a tuple of positional inputs, or a dict
    of keyword inputs (`{"input_ids": ids}`). `dynamic` names the dimensions that may change
    between calls, by input name: `{"input_ids": {0: "batch", 1: "seq"}}` (other sizes are
    those of the example). Non-tensor inputs are fixed at their example values.

    `split` cuts the exported graph into blocks after submodules: `split=True` after each
    decoder layer of a Hugging Face model (the classes its `_no_split_modules` names), after
    each child of a Sequential, else after each item of the model's longest ModuleList, or
    after the submodules named
    (`["model.layers.3"]`). Block k ends with the k-th cut module, and what it passes on to
    the next block is every value computed up to there and used after it (for a decoder:
    the hidden states, the attention mask, the position embeddings), which a breakpoint
    (`run_until(k, ...)`) hands back as a dict, named by the module that computed each value
    (`"model.layers.3"`: that layer's output, as a forward hook on it sees it). A model
    larger than the node's memory streams its blocks' weights. A weight used in several
    blocks (tied embeddings) is held once per block.

    `cache_len` registers a Hugging Face causal LM with a static KV cache of that many
    positions, for sessions: `example_inputs` is a prompt (`{"input_ids": ids}`, `dynamic`
    naming its length), and the model is sent as two graphs over one copy of the weights, a
    prefill on prompts and a decode step of one token. `rm.session()` opens a cache on the
    node; each `s.step(input_ids=...)` sends only its tokens and returns their logits, the
    node writing their keys and values into the cache in place.

    With `blocks` (submodules or functions in execution order whose chained application
    reproduces `model`: block 0 takes the inputs, each later one the output before it, spread
    over its arguments when a tuple) the blocks chained are exported as one graph cut after
    each block; a breakpoint after block k gives its output named as the block is in `model`
    (`{"layers.3": tensor}`). Blocks the user scripted with torch.jit are sent as TorchScript,
    which only principals with the right "torchscript" may register. `progress(sent, total)`
    follows the upload.

    With a control plane, the model is described to it first: its weight bytes and FLOPs
    (counted on the example inputs), the bytes of one call's inputs and outputs, and `phase`
    when given ("prefill": compute-bound; "decode": bound by reading the weights). `policy`
    chooses the node: "minimize_latency" (the control plane's default), "maximize_throughput",
    "load_balance" or "minimize_cost"."""
    return _client(client).register(
        model, example_inputs, blocks, progress, policy, phase, public, dynamic, split, cache_len
    )


class _LazyRemote:
    def __init__(self, model, client):
        self._model = model
        self._client = client
        self._remote: Optional[RemoteModel] = None
        self._lock = threading.Lock()

    def __call__(self, *inputs):
        if self._remote is None:
            with self._lock:
                if self._remote is None:
                    self._remote = register(self._model, inputs, client=self._client)
        return self._remote(*inputs)


def remote(model, client: Optional[Client] = None) -> Callable:
    """A callable that registers `model` on its first call (with that call's inputs as the
    example) and runs it remotely from then on."""
    return _LazyRemote(model, client)
