"""Sessions against a real node: a KV-cached transformer's state stays on the node, goes to host
memory on io_wait, and generation gives exactly the tokens of a local generation."""
import gc

import pytest
import torch

import djinn
from conftest import NodeProcess, scripted
from gpt import GPT, CachedGPT, GPTConfig, generate, greedy

NEW_TOKENS = 24


def model():
    torch.manual_seed(3)
    return GPT(GPTConfig.tiny()).spread_weights(0.3).eval()


@pytest.fixture(scope="module")
def gpt():
    return model()


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(4)
    return torch.randint(0, GPTConfig.tiny().vocab, (2, 8))


@pytest.fixture(scope="module")
def expected(gpt, prompt):
    tokens = generate(gpt, prompt, NEW_TOKENS)
    assert len(set(tokens.flatten().tolist())) > 5, "the reference generation is degenerate"
    return tokens


def register(gpt, prompt, client=None):
    cached = CachedGPT(gpt).eval()
    # A session whose state the client gives and each step writes in place: TorchScript, which
    # the user scripts (graphs keep their state in buffers: test_graph_sessions.py).
    example = (prompt, *cached.empty_state(prompt.shape[0]))
    return djinn.register(cached, example, blocks=scripted([cached], example), client=client), cached


def state_bytes(cached, batch):
    return sum(t.numel() * t.element_size() for t in cached.empty_state(batch))


def test_tokens_generated_in_a_session_with_swaps_in_between_equal_a_local_generation(client, gpt, prompt, expected):
    rm, cached = register(gpt, prompt)
    before = client.node_stats()
    sent_before = client.stats()["bytes_sent"]
    steps = 0
    with djinn.session(rm, *cached.empty_state(prompt.shape[0])) as s:

        def step(tokens):
            nonlocal steps
            logits = s.step(tokens)
            steps += 1
            # The agent waits on a tool after each step: the state leaves the device, and
            # comes back by COMPUTE, by the next step, or ahead of the expected resume.
            if steps % 3 == 0:
                s.io_wait()
                s.compute()
            elif steps % 3 == 1:
                s.io_wait(1)
            else:
                s.io_wait(60_000)
            return logits

        tokens = greedy(step, prompt, NEW_TOKENS)
    assert torch.equal(tokens, expected)
    after = client.node_stats()
    assert after["session_swaps_out"] - before["session_swaps_out"] == steps
    # Each came back but perhaps the last (closed while its tool ran).
    assert after["session_swaps_in"] - before["session_swaps_in"] >= steps - 1
    assert after["sessions_closed"] - before["sessions_closed"] == 1
    assert after["sessions"] == before["sessions"]
    # The state crossed the network once, when the session opened: each step sends a few
    # tokens, not the cache.
    sent = client.stats()["bytes_sent"] - sent_before
    assert sent < 2 * state_bytes(cached, prompt.shape[0])


def test_a_local_cached_generation_equals_the_plain_one(gpt, prompt, expected):
    """The reference the sessions are held to: CachedGPT decodes as the model does uncached."""
    cached = CachedGPT(gpt).eval()
    state = list(cached.empty_state(prompt.shape[0]))

    def step(tokens):
        logits, *state[:] = cached(tokens, *state)
        return logits

    with torch.no_grad():
        assert torch.equal(greedy(step, prompt, NEW_TOKENS), expected)


def test_sessions_that_share_a_budget_for_one_are_swapped_in_turn_under_lru(gpt, prompt, expected):
    cached = CachedGPT(gpt).eval()
    one = state_bytes(cached, prompt.shape[0])
    node = NodeProcess("--session-policy", "lru", "--session-budget", str(one + one // 2))
    try:
        client = djinn.Client(node.address)
        rm, _ = register(gpt, prompt, client)
        a = rm.session(*cached.empty_state(prompt.shape[0]))
        b = rm.session(*cached.empty_state(prompt.shape[0]))
        # a and b step in turn: each step must first take the budget from the other.
        generated = {id(a): [], id(b): []}
        logits = {id(s): s.step(prompt) for s in (a, b)}
        for _ in range(NEW_TOKENS):
            for s in (a, b):
                token = logits[id(s)].argmax(-1, keepdim=True)
                generated[id(s)].append(token)
                logits[id(s)] = s.step(token)
        for s in (a, b):
            assert torch.equal(torch.cat(generated[id(s)], 1), expected)
        stats = client.node_stats()
        assert stats["session_swaps_out"] >= 2 * NEW_TOKENS
        assert stats["sessions_on_device"] == 1 and stats["sessions_on_host"] == 1
        a.close()
        b.close()
        assert client.node_stats()["sessions"] == 0
    finally:
        node.stop()


def test_bad_steps_raise_clear_errors_and_the_session_goes_on(client, gpt, prompt, expected):
    rm, cached = register(gpt, prompt)
    with rm.session(*cached.empty_state(prompt.shape[0])) as s:
        # Past the model's context: the model fails, the state is as it was.
        too_long = torch.zeros(prompt.shape[0], GPTConfig.tiny().context + 1, dtype=torch.int64)
        with pytest.raises(djinn.ExecutionError):
            s.step(too_long)
        with pytest.raises(TypeError):
            s.step(object())
        tokens = greedy(s.step, prompt, NEW_TOKENS)
        assert torch.equal(tokens, expected)
    with pytest.raises(djinn.DjinnError, match="closed"):
        s.step(prompt)
    s.close()  # closing twice is harmless

    # A TorchScript model that returns no state fails each step the same way; as a graph, it
    # keeps no state, and no session opens.
    add = lambda x, state: x + state  # noqa: E731
    example = (torch.randn(1, 4), torch.zeros(1))
    plain = djinn.register(add, example, blocks=scripted([add], example))
    with plain.session(torch.zeros(1)) as s:
        with pytest.raises(djinn.ExecutionError, match="state"):
            s.step(torch.randn(1, 4))
    with pytest.raises(TypeError, match="keeps no state"):
        djinn.register(add, example).session(torch.zeros(1))
    with pytest.raises(TypeError):
        rm.session([1, 2])


def test_a_session_dropped_without_closing_is_closed_with_the_next_call(client, gpt, prompt):
    rm, cached = register(gpt, prompt)
    before = client.node_stats()["sessions"]
    s = rm.session(*cached.empty_state(prompt.shape[0]))
    s.step(prompt)
    assert client.node_stats()["sessions"] == before + 1
    del s
    gc.collect()
    client.ping()
    assert client.node_stats()["sessions"] == before
