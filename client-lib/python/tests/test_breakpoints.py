"""Breakpoints against a real node: a remote model stopped after any block, its activation
looked at, replaced or left alone, then resumed; the same inside a session's greedy generation.
`blocks=[...]` are cuts of one graph: what block k hands on comes back as a dict, named as the
block is in the model."""
import pytest
import torch
from torch import nn

import djinn
from conftest import scripted
from gpt import GPT, CachedGPT, GPTConfig, generate, greedy

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(5)
    return GPT(GPTConfig.tiny()).spread_weights(0.3).eval()


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(6)
    return torch.randint(0, GPTConfig.tiny().vocab, (2, 8))


def mlp_stack():
    torch.manual_seed(7)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(5))).eval()


def only(activation: dict, name: str) -> torch.Tensor:
    """The one tensor a block hands on, checked to be named `name`."""
    assert list(activation) == [name]
    return activation[name]


def local(blocks, x):
    """Chains blocks as the node does: a tuple output is the next block's arguments."""
    args = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        for block in blocks:
            out = block(*args)
            args = out if isinstance(out, tuple) else (out,)
    return out


@pytest.mark.parametrize("which", ["mlp", "gpt"])
def test_pausing_at_each_block_and_resuming_unchanged_or_replaced(client, gpt, prompt, which):
    if which == "mlp":
        model, x = mlp_stack(), torch.randn(3, 64)
        blocks = list(model.children())
        names = [str(k) for k in range(len(blocks))]
    else:
        model, x, blocks = gpt, prompt, gpt.blocks()
        names = ["embedding", *(f"layers.{k}" for k in range(len(gpt.layers))), "head"]
    rm = djinn.register(model, x, blocks=blocks)
    straight = rm(x)
    for k in range(len(blocks) - 1):
        p = rm.run_until(k, x)
        assert p.block == k
        # The activation is what the first k + 1 blocks give locally, named as block k is.
        a = only(p.activation, names[k])
        assert torch.equal(a, local(blocks[: k + 1], x)), f"the activation after block {k}"
        assert torch.equal(p.resume(), straight), f"paused after block {k}"
        # Replaced by a + δ: exactly what the remaining blocks give on a + δ locally (one thread
        # each side, so bit for bit).
        delta = torch.full_like(a, 0.5)
        out = rm.run_until(k, x, fetch=False).resume({names[k]: a + delta})
        assert torch.equal(out, local(blocks[k + 1 :], a + delta)), f"replaced after block {k}"
    assert client.node_stats()["parked"] == 0


def test_a_greedy_generation_paused_at_every_step_gives_the_same_tokens(client, gpt, prompt):
    rm = djinn.register(gpt, prompt, blocks=gpt.blocks())
    stops = len(gpt.blocks()) - 1
    steps = 0

    def step(idx):
        nonlocal steps
        steps += 1
        return rm.run_until(steps % stops, idx, fetch=False).resume()[:, -1]

    def generate_paused(prompt):
        idx = prompt
        for _ in range(NEW_TOKENS):
            idx = torch.cat([idx, step(idx).argmax(-1, keepdim=True)], 1)
        return idx[:, prompt.shape[1] :]

    expected = generate(gpt, prompt, NEW_TOKENS)
    assert torch.equal(generate_paused(prompt), expected)
    assert steps == NEW_TOKENS


def test_a_session_paused_at_every_step_generates_the_same_tokens(client, gpt, prompt):
    cached = CachedGPT(gpt).eval()
    state = cached.empty_state(prompt.shape[0])
    # The client's state, written in place by each step: TorchScript the user scripts.
    rm = djinn.register(cached, (prompt, *state), blocks=scripted(cached.blocks(), (prompt, *state)))
    stops = len(cached.blocks()) - 1
    steps = 0
    with djinn.session(rm, *state) as s:

        def step(tokens):
            nonlocal steps
            steps += 1
            # The activation holds the KV cache as the blocks pass it on: left on the node.
            p = s.step_until(steps % stops, tokens, fetch=False)
            if steps % 4 == 0:
                p.abort()  # the state stays as it was: the step runs again
                p = s.step_until(0, tokens, fetch=False)
            return p.resume()

        tokens = greedy(step, prompt, NEW_TOKENS)
    assert torch.equal(tokens, generate(gpt, prompt, NEW_TOKENS))


def test_bad_resumes_raise_and_leave_the_request_parked(client):
    model = mlp_stack()
    x = torch.randn(3, 64)
    rm = djinn.register(model, x, blocks=list(model.children()))
    p = rm.run_until(1, x)
    with pytest.raises(ValueError, match="passes on"):
        p.resume(torch.zeros(3, 64))
    with pytest.raises(djinn.BreakpointError, match=r"f32\[3, 32\] tensor where a f32\[3, 64\] tensor was parked"):
        p.resume({"1": torch.zeros(3, 32)})
    with pytest.raises(djinn.BreakpointError, match="f64"):
        p.resume({"1": torch.zeros(3, 64, dtype=torch.float64)})
    with pytest.raises(djinn.BreakpointError, match="starts at block 2"):
        p.resume(until=1)
    with pytest.raises(djinn.BreakpointError, match="the last"):
        rm.run_until(4, x)
    assert torch.equal(p.resume(), rm(x))
    with pytest.raises(djinn.DjinnError, match="resumed or aborted already"):
        p.resume()
    q = rm.run_until(2, x, fetch=False)
    assert client.node_stats()["parked"] == 1
    assert torch.equal(only(q.activation, "2"), local(list(model.children())[:3], x))
    later = q.resume(until=3)
    assert later.block == 3 and isinstance(later, djinn.Paused)
    later.abort()
    dropped = rm.run_until(0, x)
    del dropped
    rm(x)  # the next call aborts what was dropped
    assert client.node_stats()["parked"] == 0
