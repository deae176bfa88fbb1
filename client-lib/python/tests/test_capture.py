"""Transparent capture against a real node: modules moved to remote_accelerator:0 and called as
usual give what they give locally; factories, views, in-place operations, indexing, tuples;
the graph cache; the semantic graph; what cannot be captured raises."""
import copy
import json
import time
import urllib.request

import pytest
import torch
from torch import nn

import djinn
from conftest import DjinnProcess
from gpt import GPT, CachedGPT, GPTConfig

REMOTE = "remote_accelerator:0"


@pytest.fixture
def client(tenant):
    """Every capture test as a tenant without the TorchScript right: what capture sends is a
    tenant's graph."""
    djinn.client._default = tenant
    return tenant


def capture_stats(client):
    return client.stats()["capture"]


def test_an_mlp_moved_to_the_remote_device_runs_there_exactly_and_its_graph_is_cached(client):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    local = copy.deepcopy(model)
    with torch.no_grad():
        expected = model(x)
    before = capture_stats(client)
    model.to(REMOTE)
    assert all(p.device == torch.device(REMOTE) for p in model.parameters())
    uploaded = capture_stats(client)
    assert uploaded["uploads"] - before["uploads"] == 4  # two weights, two biases, once
    with torch.no_grad():
        y = model(x)
    assert isinstance(y, djinn.LazyTensor) and y.device == torch.device(REMOTE)
    assert y.shape == (4, 8) and y.dtype == torch.float32
    assert capture_stats(client)["graph_executions"] == uploaded["graph_executions"]  # nothing ran yet
    assert torch.equal(y.cpu(), expected)
    first = capture_stats(client)
    assert first["graph_executions"] == uploaded["graph_executions"] + 1
    for _ in range(3):
        with torch.no_grad():
            assert torch.equal(model(x).cpu(), expected)
    again = capture_stats(client)
    assert again["graph_cache_hits"] - first["graph_cache_hits"] == 3
    assert again["graphs_built"] == first["graphs_built"]
    assert again["uploads"] == first["uploads"]  # the weights went once
    # Other inputs, even of another batch size (nothing in this graph depends on it), are the
    # same graph; another computation is another graph.
    x2 = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.equal(model(x2).cpu(), local(x2))
        assert capture_stats(client)["graphs_built"] == again["graphs_built"]
        assert torch.equal(model[0](x2).cpu(), local[0](x2))
    assert capture_stats(client)["graphs_built"] == again["graphs_built"] + 1


def test_a_cnn_moved_to_the_remote_device_gives_the_local_outputs(client):
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
    model.to(REMOTE)
    out = model(x)  # autograd on, as a user calls it
    assert torch.equal(out.cpu(), expected)
    graph = djinn.get_graph()
    assert graph.phase == "vision" and graph.modality == "vision"
    convolutions = [o for o in graph.operations if o.pattern == "convolution"]
    assert [o.stage for o in convolutions] == [0, 1]
    assert any(o.pattern == "norm" for o in graph.operations)


def tiny_gpt(seed=3):
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny()).eval().spread_weights(0.5)


def test_the_tiny_transformer_moved_to_the_remote_device_gives_the_local_logits(client):
    model = tiny_gpt()
    idx = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        expected = model(idx)
    model.to(REMOTE)
    with torch.no_grad():
        logits = model(idx)
        got = logits.cpu()
    # Attention is recorded whole and runs as the node's fused CPU kernel, as it does here; the
    # rest may round differently (one thread there, several here).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_semantic_graph_marks_attention_and_tells_prefill_from_decode(client):
    model = tiny_gpt()
    cached = CachedGPT(model).eval()
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        cache, position = cached.empty_state()
        local_logits, local_cache, _ = cached(prompt, cache.clone(), position.clone())
    cached.to(REMOTE)
    with torch.no_grad():
        cache = cache.to(REMOTE)
        logits, cache, position = cached(prompt, cache, position)
        prefill = djinn.get_graph(logits)
        token = logits.argmax(-1, keepdim=True)
        logits, cache, position = cached(token.cpu(), cache, position)
        decode = djinn.get_graph(logits)

    assert prefill.phase == "prefill" and prefill.modality == "text"
    assert len(prefill.attention) == 2  # one per layer
    for block in prefill.attention:
        assert block.query_len == 6 and block.phase == "prefill"
        # Recorded whole, as the model called it (the node runs its fused kernel).
        assert [prefill.operations[i].op for i in block.operations] == ["aten.scaled_dot_product_attention.default"]
        assert all(prefill.operations[i].pattern == "attention" for i in block.operations)
    assert decode.phase == "decode"
    assert [(b.query_len, b.phase, b.kv_cache) for b in decode.attention] == [(1, "decode", True)] * 2
    updates = [o for o in decode.operations if o.pattern == "kv_cache_update"]
    assert len(updates) == 4 and all(o.residency == "kv_cache" for o in updates)  # keys and values, per layer
    assert decode.kv_cache_bytes == cache.numel() * 4
    assert {i["residency"] for i in decode.inputs} == {"weight", "kv_cache", "activation"}
    assert decode.weight_bytes > 0 and decode.flops > 0
    text = str(decode)
    assert "phase decode" in text and "kv_cache_update" in text and "attention 1:" in text
    # get_graph() runs nothing; reading does, and the prefill's results are still right.
    assert djinn.get_graph(logits).phase == "decode"
    torch.testing.assert_close(cache.cpu()[:, :, :, :, :6], local_cache[:, :, :, :, :6], rtol=1e-5, atol=1e-5)
    assert torch.equal(local_logits.argmax(-1), token.cpu().squeeze(-1))


def test_greedy_decoding_with_a_remote_kv_cache_matches_local_and_reaches_the_graph_cache(client):
    model = tiny_gpt(4)
    cached = CachedGPT(model).eval()
    prompt = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        cache, position = cached.empty_state()
        logits, cache, position = cached(prompt, cache, position)
        expected = []
        for _ in range(8):
            token = logits.argmax(-1, keepdim=True)
            expected.append(token.item())
            logits, cache, position = cached(token, cache, position)
    cached.to(REMOTE)
    with torch.no_grad():
        cache, position = cached.empty_state()
        cache = cache.to(REMOTE)
        logits, cache, position = cached(prompt, cache, position)
        got = []
        for i in range(8):
            token = logits.argmax(-1, keepdim=True).cpu()
            got.append(token.item())
            if i == 3:
                warm = capture_stats(client)
            logits, cache, position = cached(token, cache, position)
    assert got == expected
    end = capture_stats(client)
    # The cache is kept on the node after each step: the steps' graphs are all the same one.
    assert end["graphs_built"] == warm["graphs_built"]
    assert end["graph_cache_hits"] - warm["graph_cache_hits"] == 4
    assert end["state_kept"] > warm["state_kept"]


def test_factories_create_remote_tensors(client):
    zeros = torch.zeros(2, 3, device=REMOTE)
    assert isinstance(zeros, djinn.LazyTensor)
    assert torch.equal(zeros.cpu(), torch.zeros(2, 3))
    assert torch.equal(torch.ones(4, dtype=torch.int32, device=REMOTE).cpu(), torch.ones(4, dtype=torch.int32))
    assert torch.equal(torch.full((2, 2), 7.5, device=REMOTE).cpu(), torch.full((2, 2), 7.5))
    assert torch.equal(torch.arange(3, 11, 2, device=REMOTE).cpu(), torch.arange(3, 11, 2))
    assert torch.equal(torch.eye(3, device=REMOTE).cpu(), torch.eye(3))
    assert torch.equal(torch.linspace(0, 1, 5, device=REMOTE).cpu(), torch.linspace(0, 1, 5))
    assert torch.equal(torch.tensor([[1, 2], [3, 4]], device=REMOTE).cpu(), torch.tensor([[1, 2], [3, 4]]))
    assert torch.equal(torch.empty(3, device=REMOTE).fill_(2).cpu(), torch.full((3,), 2.0))
    # Random numbers are drawn on the node once: every read sees the same ones.
    r = torch.randn(5, 4, device=REMOTE)
    first = r.cpu()
    assert torch.equal(r.cpu(), first)
    assert torch.equal((r * 2 + 1).cpu(), first * 2 + 1)
    assert first.std() > 0.1
    u = torch.rand(100, device=REMOTE)
    assert 0 <= u.cpu().min() and u.cpu().max() < 1
    with djinn.capture():
        a = torch.ones(2, 2)
        b = a * 3
        layer = nn.Linear(2, 2)
    assert isinstance(b, djinn.LazyTensor) and layer.weight.device == torch.device(REMOTE)
    assert torch.equal(b.cpu(), torch.full((2, 2), 3.0))
    w, bias = layer.weight.cpu(), layer.bias.cpu()
    assert torch.equal(layer(torch.ones(1, 2)).cpu(), torch.ones(1, 2) @ w.T + bias)


def test_split_chunk_views_in_place_and_indexing(client):
    torch.manual_seed(5)
    local = torch.randn(6, 8)
    x = local.to(REMOTE)

    parts = torch.split(x, [2, 4], dim=0)
    assert isinstance(parts, tuple) and len(parts) == 2
    assert torch.equal(parts[1].cpu(), local[2:])
    chunks = x.chunk(4, dim=1)
    assert [c.shape for c in chunks] == [(6, 2)] * 4
    assert torch.equal(chunks[3].cpu(), local[:, 6:])
    q, k, v = (x @ torch.ones(8, 9)).split(3, dim=1)
    assert torch.equal(v.cpu(), (local @ torch.ones(8, 9))[:, 6:])

    assert torch.equal(x.view(2, 24).cpu(), local.view(2, 24))
    assert torch.equal(x.t().reshape(4, 12).cpu(), local.t().reshape(4, 12))
    assert torch.equal(x.permute(1, 0).unsqueeze(0).expand(3, 8, 6).cpu(), local.permute(1, 0).unsqueeze(0).expand(3, 8, 6))
    assert torch.equal(x[1:5:2, ::3].cpu(), local[1:5:2, ::3])
    assert torch.equal(x[torch.tensor([4, 0, 4])].cpu(), local[torch.tensor([4, 0, 4])])
    assert torch.equal(x[..., -1].cpu(), local[..., -1])
    assert x[2, 3].item() == local[2, 3].item()
    assert x[0].tolist() == local[0].tolist()

    # In place, through views: the base sees it, as in eager PyTorch.
    expected = local.clone()
    y = local.to(REMOTE)
    row = y[1]
    row.add_(10)
    expected[1].add_(10)
    y[:, 0] = torch.arange(6.0)
    expected[:, 0] = torch.arange(6.0)
    y[2:4].mul_(y[0:2])
    expected[2:4].mul_(expected[0:2].clone())
    y.relu_()
    expected.relu_()
    assert torch.equal(y.cpu(), expected)
    assert torch.equal(row.cpu(), expected[1])
    # Reading twice runs the writes once each time, from the uploaded tensor.
    assert torch.equal(y.cpu(), expected)


def test_local_operands_reads_printing_and_comparisons(client):
    torch.manual_seed(6)
    local = torch.randn(3, 4)
    x = local.to(REMOTE)
    other = torch.randn(3, 4)
    assert torch.equal((x + other).cpu(), local + other)  # the local operand becomes an input
    assert torch.equal((other * x).cpu(), other * local)
    assert torch.equal(torch.cat([x, other]).cpu(), torch.cat([local, other]))
    assert torch.equal(x.to(torch.float64).cpu(), local.double())
    assert torch.equal(x, local) and not torch.equal(x, other)
    assert torch.allclose(x + 1e-9, local)
    assert bool((x == local).all())
    assert (x > 0).sum().item() == (local > 0).sum().item()
    assert float(x.sum()) == pytest.approx(float(local.sum()))
    assert x.numpy().tolist() == local.numpy().tolist()
    # Constants as written: a zero's sign, infinities and NaN (0.0 first, so that a cache of
    # constants' text keyed by equality would give -0.0 its text).
    assert torch.equal(1 / (x * 0.0).abs().cpu(), torch.full((3, 4), float("inf")))
    assert torch.equal(1 / (x.abs() * -0.0).cpu(), torch.full((3, 4), float("-inf")))
    assert (x * float("nan")).cpu().isnan().all() and torch.equal((x + float("inf")).cpu(), local + float("inf"))
    text = repr(x)
    assert text.startswith("tensor([[") and text.endswith(f"device='{REMOTE}')")
    assert repr(local)[:-1] in text
    # A local tensor written from a remote one gets its data.
    target = torch.zeros(3, 4)
    target.copy_(x * 2)
    assert torch.equal(target, local * 2)


def test_what_cannot_be_captured_or_run_raises_and_names_it(client):
    x = torch.randn(5, device=REMOTE)
    with pytest.raises(djinn.UnsupportedOperationError, match="aten.nonzero"):
        torch.nonzero(x > 0)
    with pytest.raises(djinn.UnsupportedOperationError, match="aten.masked_select"):
        torch.masked_select(x, x > 0)
    with pytest.raises(djinn.UnsupportedOperationError, match="local tensor"):
        torch.zeros(5).add_(x)
    # Accepted by the meta kernels, refused by the node: the node's error, never a local run.
    bad = torch.zeros(3, device=REMOTE).index_select(0, torch.tensor([7]))
    with pytest.raises(djinn.ExecutionError):
        bad.cpu()
    # The process and the node carry on.
    assert torch.equal((x * 0).cpu(), torch.zeros(5))


def test_nothing_runs_locally_without_a_node(client, monkeypatch):
    x = torch.ones(2, device=REMOTE) + 1
    monkeypatch.setattr(djinn.client, "_default", None)
    with pytest.raises(djinn.DjinnError, match="not connected"):
        x.cpu()
    with pytest.raises(djinn.DjinnError, match="not connected"):
        torch.ones(2).to(REMOTE)
    monkeypatch.undo()
    with pytest.raises(djinn.DjinnError, match="one node"):
        torch.zeros(2, device="remote_accelerator:1").cpu()
    assert torch.equal(x.cpu(), torch.full((2,), 2.0))


def test_the_annotations_travel_to_the_control_plane(tmp_path):
    control = DjinnProcess("control", "--store", str(tmp_path / "control.redb"), "--lease-ttl", "1s")
    node = DjinnProcess("node", "--device", "cpu", "--control", f"http://{control.address}", "--name", "n0")
    try:
        client = djinn.init(f"http://{control.address}")
        deadline = time.monotonic() + 10
        while not client.cluster()["nodes"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        model = tiny_gpt()
        idx = torch.randint(0, 97, (1, 7))
        with torch.no_grad():
            expected = model(idx)
        model.to(REMOTE)
        with torch.no_grad():
            torch.testing.assert_close(model(idx).cpu(), expected, rtol=1e-5, atol=1e-5)
        graph = djinn.get_graph()
        with urllib.request.urlopen(f"http://{control.address}/v1/models/{graph.fingerprint}") as r:
            record = json.load(r)
        assert record["phase"] == "prefill"
        assert record["graph"]["phase"] == "prefill" and record["graph"]["attention"] == 2
        assert record["graph"]["modality"] == "text"
        assert record["graph"]["weight_bytes"] == graph.weight_bytes > 0
    finally:
        node.stop()
        control.stop()


def test_what_a_read_computed_is_kept_and_never_run_again(client):
    """A read runs every pending tensor Python still holds, and keeps it on the node: what it
    computed is not recorded history any more. Position ids grown by `cat` from their own last
    column between unrelated reads (as Hugging Face's generate does) stay one operation deep,
    instead of a graph that replays every step since the first."""
    x = torch.randn(8, 8)
    remote = x.to(REMOTE)
    a = remote @ remote
    assert torch.equal((a + 1).cpu(), x @ x + 1)
    later = a * 2
    assert [o.op for o in djinn.get_graph(later).operations] == ["aten.mul.Tensor"]
    assert torch.equal(later.cpu(), (x @ x) * 2)

    positions = torch.arange(4)[None].to(REMOTE)
    depths = []
    for step in range(12):
        positions = torch.cat([positions, positions[:, -1:] + 1], 1)
        assert torch.ones(1, device=REMOTE).item() == 1.0  # a read of something else
        depths.append(len(djinn.get_graph(positions[:, -1:]).operations))
    assert max(depths) <= 1, depths  # a view of what the last read kept
    assert positions.cpu().tolist() == [list(range(16))]


def test_one_graph_serves_calls_whose_sizes_differ(client):
    """Sizes in a captured graph (a view's shape, an arange's end, a count compared with a
    length) are read from its tensors where one has them, so calls that differ only in sizes
    share one graph; each still gives its local result. (A size no tensor has, such as m // 2
    before anything of that size exists, is a constant: a graph per value.)"""

    def f(x):
        n, m = x.shape
        halves = x.view(n, -1, 2).sum(-1)
        return halves + torch.arange(halves.shape[1], device=x.device), ((x > 0).sum(-1) == m).all()

    results, before = [], capture_stats(client)
    for m in (10, 14, 22, 26, 34):
        x = torch.randn(3, m)
        got, all_positive = f(x.to(REMOTE))
        want, want_all = f(x)
        assert torch.equal(got.cpu(), want)
        results.append(bool(all_positive.cpu()) == bool(want_all))
    after = capture_stats(client)
    assert all(results)
    assert after["graph_executions"] - before["graph_executions"] >= 10
    assert after["graphs_built"] - before["graphs_built"] <= 2, after
