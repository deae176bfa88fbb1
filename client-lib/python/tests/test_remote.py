"""The Python package against a real node: remote outputs equal local ones."""
import threading
import time
from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

import djinn
from conftest import scripted
from gpt import GPT, GPTConfig


def mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()


def test_an_mlp_is_one_block_per_layer_and_runs_exactly_as_locally(client):
    model = mlp()
    x = torch.randn(4, 256)
    rm = djinn.register(model, x, blocks=list(model.children()))
    assert rm.blocks == 3
    with torch.no_grad():
        expected = model(x)
    for _ in range(3):
        out = rm(x)
        assert out.dtype == torch.float32 and out.shape == (4, 256)
        assert torch.equal(out, expected)


def test_a_small_cnn_runs_exactly_as_locally(client):
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    rm = djinn.register(model, x)
    with torch.no_grad():
        assert torch.equal(rm(x), model(x))


def test_a_tiny_gpt_registers_one_block_per_layer_and_matches(client):
    torch.manual_seed(3)
    model = GPT(GPTConfig.tiny()).eval()
    idx = torch.randint(0, model.config.vocab, (2, 16))
    rm = djinn.register(model, idx, blocks=model.blocks())
    assert rm.blocks == model.config.layers + 2
    with torch.no_grad():
        expected = model(idx)
    out = rm(idx)
    assert out.shape == (2, 16, model.config.vocab)
    assert torch.equal(out, expected)
    # Another input than the example: the blocks generalise (scripted, not frozen traces).
    idx2 = torch.randint(0, model.config.vocab, (3, 9))
    with torch.no_grad():
        assert torch.equal(rm(idx2), model(idx2))


class Structured(nn.Module):
    def forward(self, x: torch.Tensor, k: int) -> Dict[str, Tuple[torch.Tensor, Tuple[torch.Tensor, List[torch.Tensor]]]]:
        return {"a": (x + k, (x * 2, [x - 1, x.sum(dim=0)])), "b": (x.t().contiguous(), (-x, []))}


def test_a_dict_of_nested_tuples_comes_back_in_the_same_structure(client):
    model = Structured()
    x = torch.randn(3, 4)
    rm = djinn.register(model, (x, 2))
    # Export fixed k at the example's 2.
    with pytest.raises(ValueError, match="registered with 2"):
        rm(x, 5)
    out = rm(x, 2)
    expected = model(x, 2)
    assert set(out) == {"a", "b"}
    assert isinstance(out["a"], tuple) and isinstance(out["a"][1][1], list)
    assert torch.equal(out["a"][0], expected["a"][0])
    assert torch.equal(out["a"][1][0], expected["a"][1][0])
    assert all(torch.equal(p, q) for p, q in zip(out["a"][1][1], expected["a"][1][1]))
    assert torch.equal(out["b"][0], expected["b"][0]) and out["b"][1][1] == []


class Mixed(nn.Module):
    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int, float, bool, str]:
        return x * 3, ids * 2 + 1, int(ids.shape[0]), 0.25, bool(ids.sum() > 0), "done"


def test_bf16_and_int64_inputs_and_scalar_outputs(client):
    model = Mixed()
    x = torch.randn(5, 7).to(torch.bfloat16)
    ids = torch.arange(11, dtype=torch.int64) * 1_000_000_007
    # Numbers and a string out: TorchScript the user scripted (a graph returns tensors and
    # sizes), which this principal has the right to register.
    rm = djinn.register(model, (x, ids), blocks=scripted([model], (x, ids)))
    out = rm(x, ids)
    expected = model(x, ids)
    assert out[0].dtype == torch.bfloat16 and torch.equal(out[0], expected[0])
    assert out[1].dtype == torch.int64 and torch.equal(out[1], expected[1])
    assert out[2:] == (11, 0.25, True, "done")


def test_every_wire_dtype_survives_an_identity(client):
    class Identity(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    # One TorchScript block for every dtype and rank; a graph takes the dtype and rank it was
    # exported with.
    identity = Identity()
    rm = djinn.register(identity, torch.zeros(1), blocks=scripted([identity], torch.zeros(1)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint8, torch.bool):
        x = (torch.randn(3, 5) * 100).to(dtype)
        out = rm(x)
        assert out.dtype == dtype and torch.equal(out, x), dtype
    assert rm(torch.zeros(0, 4)).shape == (0, 4)
    assert torch.equal(rm(torch.tensor(3.5)), torch.tensor(3.5))


def test_blocks_that_do_not_reproduce_the_model_are_refused(client):
    model = mlp()
    x = torch.randn(2, 256)
    with pytest.raises(djinn.BlockMismatchError, match="do not reproduce"):
        djinn.register(model, x, blocks=[model[0], model[2]])


def test_bad_requests_raise_clear_errors_and_the_node_keeps_serving(client):
    model = mlp()
    x = torch.randn(4, 256)
    rm = djinn.register(model, x, blocks=scripted([model], x))
    with pytest.raises(djinn.UnknownModelError):
        client._native.execute("ab" * 32, [], [])
    with pytest.raises(djinn.BadArchiveError):
        client._native.register_model([b"this is not a TorchScript archive"], None)
    with pytest.raises(djinn.ExecutionError):
        rm(x, x)  # too many inputs
    with pytest.raises(djinn.ExecutionError, match="dtype|Double|Float"):
        rm(x.double())
    with pytest.raises(djinn.ExecutionError, match="cannot be multiplied"):
        rm(torch.randn(4, 100))

    class Throws(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 1e9:
                raise RuntimeError("refusing huge inputs")
            return x

    # A data-dependent branch: export cannot write it as a graph, TorchScript can.
    throws = Throws()
    thrower = djinn.register(throws, torch.zeros(2), blocks=scripted([throws], torch.zeros(2)))
    with pytest.raises(djinn.ExecutionError, match="refusing huge inputs"):
        thrower(torch.full((2,), 1e10))
    with pytest.raises(TypeError, match="cannot send"):
        rm(object())
    # Still serving.
    with torch.no_grad():
        assert torch.equal(rm(x), model(x))
    assert isinstance(djinn.ExecutionError("x"), djinn.RemoteError)


def test_remote_registers_on_first_call(client):
    model = mlp()
    run = djinn.remote(model)
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert torch.equal(run(x), model(x))
        assert torch.equal(run(x * 2), model(x * 2))


def test_a_model_unregistered_behind_its_back_is_registered_again(client, node):
    model = mlp()
    x = torch.randn(1, 256)
    rm = djinn.register(model, x)
    djinn.Client(node.address)._native.unregister_model(rm.fingerprint)
    with torch.no_grad():
        assert torch.equal(rm(x), model(x))
    assert client.stats()["reregistrations"] == 1
    # Unregistered through its own client, a model is forgotten there too.
    rm.unregister()
    with pytest.raises(djinn.UnknownModelError):
        rm(x)


def test_identical_models_are_uploaded_once(client):
    first = djinn.register(mlp(), torch.randn(1, 256))
    second = djinn.register(mlp(), torch.randn(1, 256))
    assert first.fingerprint == second.fingerprint
    assert not second.uploaded


def test_stats_report_transport_bytes_and_requests(client):
    before = djinn.stats()
    rm = djinn.register(mlp(), torch.randn(1, 256))
    rm(torch.randn(8, 256))
    after = djinn.stats()
    assert after["transport"] == "tcp"
    assert after["requests"] > before["requests"]
    assert after["bytes_sent"] - before["bytes_sent"] > 8 * 256 * 4
    assert after["bytes_received"] - before["bytes_received"] > 8 * 256 * 4


def test_thirty_two_concurrent_clients_get_correct_results(node):
    model = mlp()
    rm = djinn.Client(node.address).register(model, torch.randn(1, 256))
    errors = []

    def run(i):
        try:
            c = djinn.Client(node.address)
            mine = djinn.RemoteModel(c, rm._archives)
            for j in range(10):
                x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i * 100 + j))
                with torch.no_grad():
                    expected = model(x)
                assert torch.equal(mine(x), expected)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_rdma_where_there_is_none_is_a_clear_error(node):
    # These hosts have no RDMA: asking for it fails clearly; auto falls back to TCP.
    with pytest.raises(djinn.DjinnError, match="RDMA"):
        djinn.Client(node.address, transport="rdma")
    assert djinn.Client(node.address, transport="auto").stats()["transport"] == "tcp"
    with pytest.raises(ValueError, match="transport"):
        djinn.Client(node.address, transport="carrier-pigeon")


def test_not_connected_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(djinn.client, "_default", None)
    with pytest.raises(djinn.DjinnError, match="djinn.init"):
        djinn.stats()


def test_the_node_counts_its_executions_and_the_time_they_took(client):
    """`execution_us`: the workers' time on executions (not the wire), which benches set beside
    the client's own time on a call."""
    model = mlp()
    x = torch.randn(64, 256)
    rm = djinn.register(model, x)
    before = client.node_stats()
    started = time.perf_counter()
    for _ in range(5):
        rm(x)
    elapsed_us = (time.perf_counter() - started) * 1e6
    after = client.node_stats()
    assert after["executions"] - before["executions"] == 5
    assert 0 < after["execution_us"] - before["execution_us"] <= elapsed_us
