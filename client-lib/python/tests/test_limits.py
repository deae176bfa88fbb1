"""The node's limits on what one request may take, against a real node: a graph that runs past
`--execute-deadline` is ended between two operators with `djinn.DeadlineExceededError`, what it
computed freed (the node's memory does not grow with every such request), and the node goes on
serving that tenant and others."""
import pytest
import torch
from torch import nn

import djinn
from conftest import TENANT_TOKEN, NodeProcess, tokens_file


class Grind(nn.Module):
    """Matrix products, one after another: seconds of work on one thread, 4 MiB each."""

    def __init__(self, rounds: int):
        super().__init__()
        self.rounds = rounds

    def forward(self, x):
        outs = []
        for _ in range(self.rounds):
            x = torch.tanh(x @ x)
            outs.append(x)
        return torch.stack(outs).sum(0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


DEADLINE = 0.4


def node_seconds(client, run) -> float:
    """The node's own time on executions (its `execution_us`: the worker's time on each run,
    not the wire, the queue or this process) while `run()` ran; only `run` executes meanwhile."""
    before = client.node_stats()["execution_us"]
    run()
    return (client.node_stats()["execution_us"] - before) / 1e6


def test_a_graph_past_the_deadline_is_ended_and_the_node_goes_on(tmp_path):
    auth = tokens_file(tmp_path, {"tenant": TENANT_TOKEN, "other": "other-tenant-token-0123456"})
    node = NodeProcess("--auth-file", auth, "--execute-deadline", str(DEADLINE), "--workers", "1")
    try:
        tenant = djinn.Client(node.address, token=TENANT_TOKEN)
        other = djinn.Client(node.address, token="other-tenant-token-0123456")
        x = torch.randn(1024, 1024) / 32
        long = tenant.register(Grind(200), x)  # about 200 × 2 GFLOP: many seconds
        short = other.register(nn.Linear(8, 8).eval(), torch.randn(2, 8))
        short(torch.randn(2, 8))
        # One round of the long model, as the node times it: tens of milliseconds here.
        one = tenant.register(Grind(1), x)
        round_s = max(node_seconds(tenant, lambda: one(x)) for _ in range(3))

        def ended():
            with pytest.raises(djinn.DeadlineExceededError, match="limit"):
                long(x)

        took = []
        sizes = []
        for _ in range(10):
            took.append(node_seconds(tenant, ended))
            sizes.append(rss_bytes(node.proc.pid))
        # Ended at the first operator past the deadline: the node spent the deadline and about
        # one round more on each run, where the whole run takes 200 rounds. The bound, from the
        # configured deadline: 10 rounds past it, or 2 s if more (a loaded machine), but at most
        # 100 rounds, half of what a run not ended between operators would take. The node
        # measures it, so neither the wire nor this process's scheduling counts.
        bound = DEADLINE + min(max(10 * round_s, 2.0), 100 * round_s)
        # A run may end sooner: a step that would run past the deadline at the node's rate is
        # refused before it runs.
        assert all(0 < t < bound for t in took), (took, round_s)
        # What an ended run computed is freed: once the allocator has grown to the runs' peak
        # (the first few), the node's memory moves by a few MiB at most over five more runs
        # (its arenas grow in steps of 4 or 8). Were each run's products kept (4 MiB each, a
        # few a run before the deadline), it would grow by tens of MiB a run.
        assert sizes[-1] - sizes[4] < 48 << 20, str([s >> 20 for s in sizes])
        assert isinstance(djinn.DeadlineExceededError("x"), djinn.RemoteError)
        # Served throughout: the other tenant, and this one's short work.
        assert short(torch.ones(2, 8)).shape == (2, 8)
        assert tenant.register(Grind(1), torch.eye(4))(torch.eye(4)).shape == (4, 4)
        stats = tenant.node_stats()
        assert stats["execution_errors"] >= 4
    finally:
        node.stop()
