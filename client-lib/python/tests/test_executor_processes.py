"""A node that runs each tenant's models in an executor process of its own
(`--executor-processes`), from Python: one tenant's process killed while it runs that tenant's
request costs that tenant only: its request fails with `djinn.ExecutorLostError`, the other
tenant's calls go on, and its next calls are served by a new process that has loaded its models
again, with nothing uploaded."""
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess, tokens_file

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


class Grind(nn.Module):
    """Matrix products, one after another: seconds of work on one thread."""

    def __init__(self, rounds: int):
        super().__init__()
        self.rounds = rounds

    def forward(self, x):
        for _ in range(self.rounds):
            x = torch.tanh(x @ x)
        return x


def executor_processes(node_pid: int) -> dict:
    """The node's executor processes: pid → command line."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if parent == node_pid and " executor " in cmdline:
            found[int(entry)] = cmdline
    return found


def cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_tenants_executor_process_killed_mid_request_costs_only_that_tenant(tmp_path):
    auth = tokens_file(tmp_path, {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}})
    node = NodeProcess("--executor-processes", "--auth-file", auth)
    try:
        alice = djinn.Client(node.address, token=ALICE)
        bob = djinn.Client(node.address, token=BOB)
        x = torch.randn(1024, 1024) / 32
        grind = alice.register(Grind(30), x)  # seconds of work on the node's one thread
        small = nn.Linear(8, 8).eval()
        y = torch.randn(2, 8)
        bobs = bob.register(small, y)
        alices = alice.register(small, y)
        assert torch.equal(bobs(y), small(y)) and torch.equal(alices(y), small(y))
        [alices_pid] = [p for p, cmd in executor_processes(node.proc.pid).items() if "--first-id=1 " in cmd]

        failure = []

        def run():
            try:
                grind(x)
                failure.append(None)
            except djinn.DjinnError as e:
                failure.append(e)

        caller = threading.Thread(target=run)
        caller.start()
        # The grind is running once alice's process spends CPU time on it.
        start = cpu_ticks(alices_pid)
        deadline = time.monotonic() + 60
        while cpu_ticks(alices_pid) < start + 20:
            assert time.monotonic() < deadline, "the grind never ran"
            time.sleep(0.01)
        os.kill(alices_pid, signal.SIGKILL)
        # Bob is served throughout.
        for _ in range(20):
            assert torch.equal(bobs(y), small(y))
        caller.join(timeout=60)
        assert not caller.is_alive()
        [error] = failure
        assert isinstance(error, djinn.ExecutorLostError), repr(error)
        assert isinstance(error, djinn.RemoteError)
        assert "SIGKILL" in str(error) or "signal: 9" in str(error), str(error)

        # Alice's models run in a new process, loaded there again: she registers nothing.
        assert torch.equal(alices(y), small(y))
        assert alices_pid not in executor_processes(node.proc.pid)
        assert len(alice.models()) == 2
        assert torch.equal(bobs(y), small(y))
    finally:
        node.stop()


class WritesAFile(nn.Module):
    """TorchScript that maps a file shared (`torch.from_file(shared=True)` opens it for writing,
    creating it) and writes `x` into it: what a principal with the right to TorchScript can do
    with libtorch's own operators."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, x):
        mapped = torch.from_file(self.path, shared=True, size=4, dtype=torch.float32)
        mapped.copy_(x)
        return mapped.clone()


@pytest.mark.parametrize("processes", [False, True], ids=["in-the-node", "executor-processes"])
def test_torchscript_that_writes_a_file_is_refused_by_landlock_in_an_executor_process(tmp_path, processes):
    """The same TorchScript, registered by a principal with the right: run in the node's own
    process it writes the file; run in the tenant's executor process it is refused (Landlock:
    no file is written anywhere but /dev/null and the GPU's devices), the error says so, and
    the tenant is served next."""
    auth = tokens_file(tmp_path, {"alice": {"tokens": [ALICE], "rights": ["torchscript"]}})
    node = NodeProcess(*(["--executor-processes"] if processes else []), "--auth-file", auth)
    try:
        alice = djinn.Client(node.address, token=ALICE)
        target = tmp_path / "written-by-the-model"
        model, x = WritesAFile(str(target)).eval(), torch.arange(4, dtype=torch.float32)
        writes = djinn.register(model, x, blocks=[torch.jit.script(model)], client=alice)
        target.unlink(missing_ok=True)  # the client ran the model once as it registered it
        if processes:
            with pytest.raises(djinn.DjinnError, match="Permission denied"):
                writes(x)
            assert not target.exists(), "nothing written"
        else:
            assert torch.equal(writes(x), x)
            assert target.read_bytes() == x.numpy().tobytes(), "written by the node's own process"
        small = nn.Linear(4, 2).eval()
        assert torch.equal(alice.register(small, x)(x), small(x)), "served next"
    finally:
        node.stop()


class GrindFor(nn.Module):
    """`rounds` matrix products in one TorchScript call: libtorch runs it whole, and the
    executor's check of the deadline between operators and blocks never comes."""

    def forward(self, x, rounds):
        for _ in range(int(rounds)):
            x = torch.tanh(x @ x)
        return x


def test_a_run_past_the_deadline_inside_one_call_is_ended_by_a_kill_and_others_are_served(tmp_path):
    """Under `--execute-deadline 1`, a TorchScript call of a hundred seconds of work: the node
    kills the tenant's executor process once its run has answered nothing past the limit and
    its grace, the call fails `DeadlineExceededError` saying so, another tenant is served
    throughout, and the tenant is served next by a new process."""
    auth = tokens_file(tmp_path, {"alice": {"tokens": [ALICE], "rights": ["torchscript"]}, "bob": {"tokens": [BOB]}})
    node = NodeProcess("--executor-processes", "--auth-file", auth, "--execute-deadline", "1")
    try:
        alice = djinn.Client(node.address, token=ALICE)
        bob = djinn.Client(node.address, token=BOB)
        x, one = torch.randn(1024, 1024) / 32, torch.tensor(1)
        model = GrindFor().eval()
        grind = djinn.register(model, (x, one), blocks=[torch.jit.script(model)], client=alice)
        assert torch.allclose(grind(x, one), model(x, one), atol=1e-5)
        small = nn.Linear(8, 8).eval()
        y = torch.randn(2, 8)
        bobs = bob.register(small, y)

        stop, bobs_failures, bobs_calls = threading.Event(), [], [0]

        def bob_calls():
            while not stop.is_set():
                try:
                    assert torch.equal(bobs(y), small(y))
                    bobs_calls[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    bobs_failures.append(e)

        caller = threading.Thread(target=bob_calls)
        caller.start()
        started = time.monotonic()
        try:
            with pytest.raises(djinn.DeadlineExceededError, match="limit of 1s.*killed") as ended:
                grind(x, torch.tensor(1000))  # a thousand products of 1024x1024: minutes on this CPU
        finally:
            stop.set()
            caller.join()
        print(f"ended after {time.monotonic() - started:.2f} s: {ended.value}")
        assert not bobs_failures and bobs_calls[0] > 0, (bobs_failures, bobs_calls)
        assert torch.allclose(grind(x, one), model(x, one), atol=1e-5), "served next, by a new process"
    finally:
        node.stop()


class Big(nn.Module):
    """A 1 GiB tensor from a 4-byte input."""

    def forward(self, x):
        return torch.ones(1 << 28) * x.sum()


def node_resident_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def test_an_executor_process_past_the_nodes_memory_limit_is_killed_and_the_node_does_not_grow(tmp_path):
    """A tenant keeps a 1 GiB result, within its executor's budgets (4 GiB) and past the node's
    limit on an executor process's resident memory (`--executor-memory-limit 900MiB`, an idle
    executor holds about 400 MiB): the node kills the process, the call fails
    `ExecutorLostError` naming its memory, the node's own memory does not grow, and another
    tenant is served after, and the tenant too, by a new process."""
    auth = tokens_file(tmp_path, {"alice": {"tokens": [ALICE]}, "bob": {"tokens": [BOB]}})
    node = NodeProcess("--executor-processes", "--auth-file", auth, "--device-memory-budget", "4GiB",
                       "--host-memory-budget", "4GiB", "--tenant-host-memory", "2GiB", "--executor-memory-limit", "900MiB")
    try:
        alice = djinn.Client(node.address, token=ALICE)
        bob = djinn.Client(node.address, token=BOB)
        x = torch.ones(1)
        big = alice.register(Big().eval(), x)
        small = nn.Linear(8, 8).eval()
        y = torch.randn(2, 8)
        bobs = bob.register(small, y)
        assert torch.equal(bobs(y), small(y))
        before = node_resident_kib(node.proc.pid)
        with pytest.raises(djinn.ExecutorLostError, match="resident, past the node's limit of 943718400"):
            big(x, keep=True)
        assert node_resident_kib(node.proc.pid) < before + 128 * 1024, "the node did not take what its child took"
        assert torch.equal(bobs(y), small(y)), "another tenant served"
        alices = alice.register(small, y)
        assert torch.equal(alices(y), small(y)), "the tenant served next, by a new process"
    finally:
        node.stop()
