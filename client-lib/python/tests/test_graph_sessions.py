"""Sessions of models registered as graphs, by a tenant without the TorchScript right: a Hugging
Face Llama and GPT-2 registered with a static KV cache (`cache_len=`) generate greedily through
a session, each step sending only its new token, token for token as the local `generate` does,
with the session swapped to host memory (IO_WAIT) in between; the node writes the cache where
it is (no copy of it per step); 200 sessions share a session budget that holds 20."""
import pytest
import torch

import djinn
from conftest import TENANT_TOKEN, NodeProcess, hf_gpt2, hf_llama

CACHE = 32


def register(client, model, prompt):
    return client.register(model, {"input_ids": prompt}, dynamic={"input_ids": {1: ("seq", 2, CACHE)}},
                           cache_len=CACHE)


def local_generate(model, prompt, new_tokens):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return out[:, prompt.shape[1]:].tolist()


def session_generate(session, prompt, new_tokens, between=None):
    """Greedy decoding through `session`: the prompt once, then one token per step."""
    logits = session.step(input_ids=prompt)
    tokens = []
    for i in range(new_tokens):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(tok)
        if i + 1 < new_tokens:
            if between is not None:
                between(i)
            logits = session.step(input_ids=tok)
    return torch.cat(tokens, 1).tolist()


@pytest.mark.parametrize("make", [hf_llama, hf_gpt2], ids=["llama", "gpt2"])
def test_greedy_generation_through_a_session_equals_local_generate(tenant, make):
    torch.manual_seed(0)
    model = make().eval()
    prompt = torch.randint(1, 97, (1, 7))
    rm = register(tenant, model, prompt)
    # One block holding the prefill and the decode graphs over one copy of the weights.
    assert rm.blocks == 1
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
    assert rm.weight_bytes <= weights * 1.05, (rm.weight_bytes, weights)
    want = local_generate(model, prompt, 12)
    before = tenant.node_stats()

    def swap(i):
        # The agent waits on a tool every third token: the node moves the cache to host memory.
        if i % 3 == 0:
            s.io_wait(5)

    with rm.session() as s:
        got = session_generate(s, prompt, 12, between=swap)
    assert got == want
    after = tenant.node_stats()
    assert after["session_swaps_out"] - before["session_swaps_out"] >= 3, after
    assert after["session_swaps_in"] - before["session_swaps_in"] >= 3, after
    # The cache (keys and values) is written where it is; only the position counters, 8 bytes
    # a layer, are new tensors each step.
    in_place = after["session_state_bytes_in_place"] - before["session_state_bytes_in_place"]
    replaced = after["session_state_bytes_replaced"] - before["session_state_bytes_replaced"]
    steps = after["session_steps"] - before["session_steps"]
    assert steps == 12 and replaced <= 8 * 2 * steps < in_place, (in_place, replaced, steps)
    # The same session twice: a fresh cache each time; the prompt as users hold one (every
    # other column of a wider batch).
    wide = torch.zeros(1, 14, dtype=torch.int64)
    wide[:, ::2] = prompt
    with rm.session() as s:
        assert not wide[:, ::2].is_contiguous()
        assert session_generate(s, wide[:, ::2], 4) == [want[0][:4]]


def test_a_model_with_a_cache_runs_only_in_sessions_and_a_given_state_is_checked(tenant):
    torch.manual_seed(1)
    model = hf_gpt2().eval()
    prompt = torch.randint(1, 97, (1, 5))
    rm = register(tenant, model, prompt)
    with pytest.raises(TypeError, match="session"):
        rm(input_ids=prompt)
    with pytest.raises(djinn.DjinnError, match="state"):
        rm.session(torch.zeros(3))
    # A prompt longer than the cache fits no graph of the model.
    with rm.session() as s, pytest.raises(djinn.DjinnError, match="fit none"):
        s.step(input_ids=torch.randint(1, 97, (1, CACHE + 1)))


def test_two_hundred_sessions_through_a_budget_that_holds_twenty(tenant_auth):
    torch.manual_seed(2)
    model = hf_gpt2().eval()
    cfg = model.config
    per_session = cfg.n_layer * (2 * CACHE * cfg.n_embd * 4 + 8)
    node = NodeProcess("--auth-file", tenant_auth, "--session-budget", str(20 * per_session + per_session // 2))
    try:
        client = djinn.Client(node.address, token=TENANT_TOKEN)
        prompts = [torch.randint(1, 97, (1, 3 + i % 5)) for i in range(200)]
        rm = register(client, model, prompts[0])
        sessions = [rm.session() for _ in prompts]
        # Every session takes its turn: the prompt, then three tokens one step at a time.
        last = [s.step(input_ids=p)[:, -1].argmax(-1, keepdim=True) for s, p in zip(sessions, prompts)]
        tokens = [[t] for t in last]
        for _ in range(3):
            for i, s in enumerate(sessions):
                tokens[i].append(s.step(input_ids=tokens[i][-1])[:, -1].argmax(-1, keepdim=True))
        stats = client.node_stats()
        assert stats["sessions"] == 200 and stats["sessions_on_device"] <= 20, stats
        assert stats["session_swaps_out"] >= 200, stats
        for p, ts in zip(prompts, tokens):
            assert torch.cat(ts, 1).tolist() == local_generate(model, p, 4)
        for s in sessions:
            s.close()
        assert client.node_stats()["sessions"] == 0
    finally:
        node.stop()


def test_a_cache_model_lost_by_the_node_is_registered_again_and_its_state_is_bounded(tenant_auth):
    torch.manual_seed(3)
    model = hf_gpt2().eval()
    prompt = torch.randint(1, 97, (1, 6))
    cfg = model.config
    per_session = cfg.n_layer * (2 * CACHE * cfg.n_embd * 4 + 8)
    # Room for one session's cache, not two.
    node = NodeProcess("--auth-file", tenant_auth, "--session-budget", str(per_session + per_session // 2),
                       "--session-host-pool", str(per_session // 2))
    try:
        client = djinn.Client(node.address, token=TENANT_TOKEN)
        rm = register(client, model, prompt)
        want = local_generate(model, prompt, 5)
        djinn.Client(node.address, token=TENANT_TOKEN)._native.unregister_model(rm.fingerprint)
        with rm.session() as s:
            assert session_generate(s, prompt, 5) == want
            # A second cache fits neither the budget nor the host pool beside the first.
            with pytest.raises(djinn.OverBudgetError):
                rm.session()
        assert client.stats()["reregistrations"] == 1
        assert client.node_stats()["sessions"] == 0
        # Once the first is closed, there is room again.
        with rm.session() as s:
            assert session_generate(s, prompt, 5) == want
    finally:
        node.stop()


def test_a_buffer_is_written_in_place_only_when_nothing_reads_it_afterwards():
    from djinn.graphs import _writable_in_place

    aten = torch.ops.aten

    def graph(after):
        """buffer, index, source; the buffer's update; then `after(g, buffer, view)`."""
        g = torch.fx.Graph()
        buffer, index, source = g.placeholder("buffer"), g.placeholder("index"), g.placeholder("source")
        view = g.call_function(aten.slice.Tensor, (buffer, 0, 0, 2))
        value = g.call_function(aten.index_copy.default, (buffer, 0, index, source))
        out = after(g, buffer, view, value)
        g.output((value, out))
        return g, buffer, value

    def reads(what):
        return lambda g, buffer, view, value: g.call_function(aten.add.Tensor, ({"buffer": buffer, "view": view,
                                                                                 "value": value}[what], 1))

    assert _writable_in_place(*graph(reads("value")))
    assert not _writable_in_place(*graph(reads("buffer")))
    assert not _writable_in_place(*graph(reads("view")))
    # The old buffer as one of the call's results.
    assert not _writable_in_place(*graph(lambda g, buffer, view, value: view))
