"""Tensors kept on the node (RemoteTensor): outputs kept and fed to the next call without
crossing the network, uploads kept once, node-to-node pushes, and the errors of handles whose
node died or restarted."""
import gc

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess


def stages():
    torch.manual_seed(3)
    first = nn.Sequential(nn.Linear(256, 1024), nn.ReLU()).eval()
    second = nn.Sequential(nn.Linear(1024, 256), nn.Tanh()).eval()
    return first, second


def test_a_kept_output_feeds_the_next_model_without_crossing_the_network(client):
    first, second = stages()
    x = torch.randn(64, 256)
    rm1 = djinn.register(first, x)
    with torch.no_grad():
        h_local = first(x)
        expected = second(h_local)
    rm2 = djinn.register(second, h_local)
    assert client.stats()["memory_path"] == "staging"

    before = client.stats()
    h = rm1(x, keep=True)
    after_keep = client.stats()
    assert isinstance(h, djinn.RemoteTensor)
    assert h.shape == (64, 1024) and h.dtype == torch.float32 and h.node == client.address
    # 256 KiB kept on the node: only its description came back.
    assert after_keep["bytes_received"] - before["bytes_received"] < 1024

    y = rm2(h)
    after_use = client.stats()
    assert after_use["bytes_sent"] - after_keep["bytes_sent"] < 1024
    assert torch.equal(y, expected)
    assert torch.equal(h.cpu(), h_local)

    # Structured outputs keep every tensor.
    kept_twice = rm2(h, keep=True)
    assert isinstance(kept_twice, djinn.RemoteTensor)
    assert torch.equal(kept_twice.cpu(), expected)


def test_uploaded_once_released_and_collected(client):
    node_handles = lambda: client.node_stats()["handles"]  # noqa: E731
    start = node_handles()
    w = client.keep(torch.arange(12, dtype=torch.int64).reshape(3, 4))
    assert w.shape == (3, 4) and w.dtype == torch.int64
    assert torch.equal(w.cpu(), torch.arange(12).reshape(3, 4))
    assert node_handles() == start + 1
    w.release()
    assert node_handles() == start
    with pytest.raises(djinn.DjinnError, match="released"):
        w.cpu()

    # Dropped by Python: freed with the client's next call.
    for _ in range(3):
        client.keep(torch.ones(1000))
    gc.collect()
    client.ping()
    assert node_handles() == start


def test_a_tensor_pushed_node_to_node_is_used_on_the_other_node():
    b = NodeProcess()
    a = NodeProcess("--push-peers", b.address)
    try:
        on_a = djinn.Client(a.address)
        on_b = djinn.Client(b.address)
        first, second = stages()
        x = torch.randn(8, 256)
        with torch.no_grad():
            expected = second(first(x))
        rm1 = on_a.register(first, x)
        rm2 = on_b.register(second, torch.randn(8, 1024))

        h = rm1(x, keep=True)
        moved = h.push(b.address)
        assert moved.node == b.address and moved.path == "staging-tcp"
        assert torch.equal(rm2(moved), expected)
        with pytest.raises(djinn.DjinnError, match="several nodes"):
            on_b.register(lambda p, q: p + q, (torch.randn(8, 1024), torch.randn(8, 1024)))(moved, h)
    finally:
        a.stop()
        b.stop()


def test_a_handle_whose_node_died_or_restarted_raises_a_clear_error():
    node = NodeProcess()
    client = djinn.Client(node.address, timeout=5.0)
    t = client.keep(torch.ones(16))
    node.kill()
    with pytest.raises(djinn.HandleLostError, match="lost"):
        t.cpu()

    restarted = NodeProcess(listen=node.address)  # the same address, a new life
    try:
        with pytest.raises(djinn.StaleHandleError, match="earlier life"):
            t.cpu()
        assert client.keep(torch.ones(1))._kept.epoch != t._kept.epoch
    finally:
        restarted.stop()
