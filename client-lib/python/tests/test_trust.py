"""Where the client follows a node: a compromised node (tools/examples/hostile_node.rs, relaying
to a real node) that answers "it moved to ADDR", where ADDR is no node, does not get the client
(nor its token) there: the client raises UntrustedAddressError and ADDR sees no connection.
Under a control plane the client follows only the live nodes it lists; given one node's
address, it follows nothing."""
import json
import socket
import time
import urllib.request

import pytest
import torch
from torch import nn

import djinn
from conftest import DjinnProcess, HostileNode, scripted

ALICE = "alice-token-0123456789abcdef"
NODES = "nodes-token-0123456789ab"


class Catcher:
    """A listener on a free port that is no node: it must never see a connection."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.address = "%s:%d" % self.sock.getsockname()

    def assert_untouched(self):
        with pytest.raises(BlockingIOError):
            conn, peer = self.sock.accept()
            conn.close()
            raise AssertionError(f"the catcher was connected to, from {peer}")


class Offset(nn.Module):
    """A session's step: `x` plus the state (which it leaves as it is)."""

    def forward(self, x, state):
        return x + state


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A control plane with tokens, a real node joined to it, a catcher, and a hostile node
    relaying to the real node that sends kept tensors and sessions to the catcher, registered
    (as a node principal may) as a node of the cluster."""
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"principals": [
        {"name": "alice", "tokens": [ALICE], "rights": ["torchscript"]},
        {"name": "nodes", "role": "node", "tokens": [NODES]},
    ]}))
    control = DjinnProcess("control", "--store", str(tmp_path / "control.redb"), "--lease-ttl", "60s",
                           "--auth-file", str(tokens))
    url = f"http://{control.address}"
    monkeypatch.setenv("DJINN_TOKEN", NODES)
    node = DjinnProcess("node", "--device", "cpu", "--control", url, "--name", "real", "--auth-file", str(tokens))
    monkeypatch.delenv("DJINN_TOKEN")
    catcher = Catcher()
    hostile = HostileNode(node.address, "--kept-moved-to", catcher.address, "--session-moved-to", catcher.address)

    inventory = {
        "addr": hostile.address, "device": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30,
        "host_memory_free": 1 << 30, "host_to_device": 1e9, "flops": 1e9, "memory_bandwidth": 1e9,
        "link_bandwidth": 1e9, "transports": ["tcp"], "queue_depth": 0, "cost_per_hour": 1.0, "models": [],
    }
    request = urllib.request.Request(
        f"{url}/v1/nodes", data=json.dumps({"name": "hostile", "inventory": inventory}).encode(), method="POST",
        headers={"Authorization": f"Bearer {NODES}", "Content-Type": "application/json"},
    )
    assert urllib.request.urlopen(request, timeout=20).status == 201
    # A tenant may list the live nodes: what its client follows moves to.
    listed = urllib.request.Request(f"{url}/v1/nodes", headers={"Authorization": f"Bearer {ALICE}"})
    deadline = time.monotonic() + 30
    while {node.address, hostile.address} - {n["addr"] for n in json.load(urllib.request.urlopen(listed))["nodes"]}:
        assert time.monotonic() < deadline, "the nodes did not join"
        time.sleep(0.05)
    client = djinn.Client(url, token=ALICE, timeout=10)
    try:
        yield client, hostile, catcher, node
    finally:
        hostile.stop()
        node.stop()
        control.stop()


def test_a_listed_node_cannot_send_a_kept_tensor_fetch_elsewhere(cluster):
    client, hostile, catcher, _ = cluster
    kept = client.keep(torch.arange(4, dtype=torch.float32), node=hostile.address)
    with pytest.raises(djinn.UntrustedAddressError, match=catcher.address):
        kept.cpu()
    catcher.assert_untouched()


def test_a_listed_node_cannot_send_a_session_elsewhere(cluster):
    client, hostile, catcher, _ = cluster
    model = Offset().eval()
    example = (torch.ones(3), torch.zeros(3))
    rm = djinn.register(model, example, blocks=scripted([model], example), client=client)
    s = djinn.session(rm, torch.zeros(3), prefill=hostile.address)
    assert s.node == hostile.address
    with pytest.raises(djinn.UntrustedAddressError, match=catcher.address):
        s.compute()
    assert s.node == hostile.address, "the session did not follow"
    catcher.assert_untouched()


def test_a_client_of_one_node_follows_nothing(tmp_path):
    node = DjinnProcess("node", "--device", "cpu")
    catcher = Catcher()
    hostile = HostileNode(node.address, "--kept-moved-to", catcher.address)
    try:
        client = djinn.Client(hostile.address, timeout=10)
        kept = client.keep(torch.arange(4, dtype=torch.float32))
        with pytest.raises(djinn.UntrustedAddressError, match="one node"):
            kept.cpu()
        catcher.assert_untouched()
    finally:
        hostile.stop()
        node.stop()
