"""Transparent capture of models no one here wrote, as a tenant without the TorchScript right:
Hugging Face GPT-2 and Llama (tiny configs, random weights) moved to `remote_accelerator:0`
give the local logits, and greedy `generate` through capture gives the local tokens. Capture
writes graphs: `torch.jit` is never called."""
import copy
import importlib

import pytest
import torch

import djinn
from conftest import hf_gpt2, hf_llama

REMOTE = "remote_accelerator:0"


@pytest.fixture
def no_torchscript(monkeypatch):
    """Any use of torch.jit's compilers fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("capture used torch.jit")

    for name in ("script", "trace", "save"):
        monkeypatch.setattr(torch.jit, name, refuse)


@pytest.mark.parametrize("make", [hf_gpt2, hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_forward_and_generate_through_capture_equal_local(tenant, no_torchscript, make):
    torch.manual_seed(0)
    model = make().eval()
    prompt = torch.randint(1, 97, (1, 7))
    with torch.no_grad():
        want_logits = model(prompt).logits
        want = model.generate(prompt, max_new_tokens=8, do_sample=False)
    before = djinn.stats()["capture"]
    model.to(REMOTE)
    with torch.no_grad():
        logits = model(prompt.to(REMOTE)).logits
        assert isinstance(logits, djinn.LazyTensor)
        torch.testing.assert_close(logits.cpu(), want_logits)
        # The prompt as users hold one: every other column of a wider batch.
        wide = torch.zeros(1, 14, dtype=torch.int64)
        wide[:, ::2] = prompt
        got = model.generate(wide[:, ::2].to(REMOTE), max_new_tokens=8, do_sample=False)
    assert got.cpu().tolist() == want.tolist()
    after = djinn.stats()["capture"]
    assert after["graph_executions"] - before["graph_executions"] >= 9, after


def test_capture_sends_ordinary_graphs_which_the_node_checks(tenant, no_torchscript):
    """What capture sends is a tenant's graph like any other: an operator the node does not run
    (`erfinv`, not on the allowlist) is refused by name, and capture goes on; dropout in training
    mode draws with the node's per-request generator, once (every read sees the same draw);
    in-place updates of the graph's own tensors, views and factories are written as the format
    allows (functional forms and copy_) and give the local values."""
    x = torch.randn(4, 4)
    remote = x.to(REMOTE)
    with pytest.raises(djinn.GraphRefusedError, match="erfinv"):
        torch.special.erfinv(remote.tanh()).cpu()
    # A scalar read with .item(): the local value, within float32 rounding of the reduction.
    assert (remote @ remote).sum().item() == pytest.approx((x @ x).sum().item(), rel=1e-5, abs=1e-5)
    ones = torch.ones(64, 64).to(REMOTE)
    dropped = torch.nn.functional.dropout(ones, 0.25, training=True)
    first = dropped.cpu()
    assert torch.equal(dropped.cpu(), first)
    assert first.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert 0.15 < (first == 0).float().mean().item() < 0.35
    assert torch.equal(torch.nn.functional.dropout(ones, 0.25, training=False).cpu(), torch.ones(64, 64))
    y = torch.zeros(4, 4, device=REMOTE)
    y[1:3].add_(remote[1:3])
    y.mul_(2)
    local = torch.zeros(4, 4)
    local[1:3].add_(x[1:3])
    assert torch.equal(y.cpu(), local * 2)


def test_a_generation_through_capture_builds_a_few_graphs_whatever_its_length(tenant, monkeypatch):
    """Symbolic sizes: every decode step of a generation runs one graph (a few more where a
    length meets a size of the model, 16 or 32 here), so a long generation builds a few
    graphs, not several per step; and nothing computed is replayed, so each step's forward
    graph has as many operations as the one before."""
    capture = importlib.import_module("djinn.capture")
    torch.manual_seed(0)
    model = hf_gpt2().eval()
    prompt = torch.randint(1, 97, (1, 3))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=24, do_sample=False)
    local = copy.deepcopy(model)
    model.to(REMOTE)
    sizes = []
    run = capture._run

    def counting(targets, keep=False, plan=None):
        plan = plan or capture._Plan(targets)
        sizes.append(len(plan.ops))
        return run(targets, keep, plan)

    monkeypatch.setattr(capture, "_run", counting)
    before = djinn.stats()["capture"]
    with torch.no_grad():
        got = model.generate(prompt.to(REMOTE), max_new_tokens=24, do_sample=False)
    built = djinn.stats()["capture"]["graphs_built"] - before["graphs_built"]
    assert got.cpu().tolist() == want.tolist()
    assert built <= 12, built  # 24 steps: 2 or 3 graphs each before
    # The decode steps' forward graphs (each step's largest; the prefill's and the first
    # step's aside) do not grow.
    forwards = [n for n in sizes if n > max(sizes) // 2][2:]
    assert len(forwards) >= 20 and max(forwards) == min(forwards), forwards
    # The logits of the whole generated sequence, through capture, are the local ones.
    with torch.no_grad():
        torch.testing.assert_close(model(got).logits.cpu(), local(want).logits)
