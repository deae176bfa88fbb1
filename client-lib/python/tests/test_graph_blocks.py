"""Graphs cut into blocks (`djinn.register(..., split=...)`), registered by a tenant without the
TorchScript right: a Hugging Face Llama and GPT-2 split after each decoder layer stop after any
layer with what the layer passes on (a dict: hidden states, mask, position embeddings), resume
to the model's own output, and resume from a steered activation to what the local model gives
with the same change made by a forward hook; a Llama larger than the node's device budget
streams its blocks' weights and gives the resident model's output bit for bit."""
import pytest
import torch

import djinn
from conftest import TENANT_TOKEN, NodeProcess, hf_gpt2, hf_llama, tokens_file

DYNAMIC = {"input_ids": {0: "batch", 1: ("seq", 2, 64)}}


def tiny_llama(layers=3, hidden=32):
    return hf_llama(layers, hidden, use_cache=False)


def tiny_gpt2(layers=3):
    return hf_gpt2(layers, use_cache=False)


def layers_of(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def layer_name(model, k):
    return f"model.layers.{k}" if hasattr(model, "model") else f"transformer.h.{k}"


def local(model, ids, steer=None):
    """The model's logits, with `steer(k, hidden)` applied to layer k's output when given."""
    hooks = []
    if steer is not None:
        for k, layer in enumerate(layers_of(model)):
            def hook(_module, _args, out, k=k):
                if isinstance(out, tuple):
                    return (steer(k, out[0]), *out[1:])
                return steer(k, out)
            hooks.append(layer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_a_model_split_by_decoder_layers_stops_after_any_layer_and_resumes(tenant, make):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, 97, (2, 12))
    rm = tenant.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
    layers = len(layers_of(model))
    # A block per layer, the last layer's ending where the final norm and head begin.
    assert rm.blocks == layers + 1
    want = local(model, ids)
    torch.testing.assert_close(rm(input_ids=ids).logits, want)
    for k in range(layers):
        p = rm.run_until(k, input_ids=ids)
        a = p.activation
        assert isinstance(a, dict) and layer_name(model, k) in a, sorted(a)
        hidden = a[layer_name(model, k)]
        assert hidden.shape == (2, 12, 32), hidden.shape
        # Resumed as it was: the model's output, in the model's own output type.
        got = p.resume()
        assert type(got) is type(rm(input_ids=ids))
        torch.testing.assert_close(got.logits, want, msg=lambda m: f"resumed after layer {k}: {m}")
    # Another size through the same blocks (export left the sequence dynamic).
    other = torch.randint(1, 97, (1, 7))
    p = rm.run_until(1, input_ids=other)
    assert p.activation[layer_name(model, 1)].shape == (1, 7, 32)
    torch.testing.assert_close(p.resume().logits, local(model, other))
    # Token ids as users hold them: a transposed batch (non-contiguous).
    transposed = ids.t().contiguous().t()
    assert not transposed.is_contiguous()
    p = rm.run_until(0, input_ids=transposed)
    torch.testing.assert_close(p.resume().logits, want)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_a_steered_activation_gives_what_the_local_model_gives_with_the_same_change(tenant, make):
    torch.manual_seed(1)
    model = make().eval()
    ids = torch.randint(1, 97, (2, 10))
    rm = tenant.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
    direction = torch.randn(32)
    for k in (0, 1):
        p = rm.run_until(k, input_ids=ids)
        a = dict(p.activation)
        name = layer_name(model, k)
        a[name] = a[name] + 3.0 * direction
        got = p.resume(a).logits
        want = local(model, ids, steer=lambda j, h, k=k: h + 3.0 * direction if j == k else h)
        torch.testing.assert_close(got, want, msg=lambda m: f"steered after layer {k}: {m}")
        assert not torch.allclose(got, local(model, ids)), "the steer changed nothing"
    # Stopping again part-way: after layer 0, then after layer 1, steered at both.
    p = rm.run_until(0, input_ids=ids)
    a = p.activation
    a[layer_name(model, 0)] = a[layer_name(model, 0)] * 0.5
    q = p.resume(a, until=1)
    b = q.activation
    b[layer_name(model, 1)] = b[layer_name(model, 1)] - direction
    got = q.resume(b).logits
    want = local(model, ids, steer=lambda j, h: h * 0.5 if j == 0 else (h - direction if j == 1 else h))
    torch.testing.assert_close(got, want)


def test_a_replacement_of_another_structure_is_refused_and_the_request_stays_parked(tenant):
    torch.manual_seed(2)
    model = tiny_llama().eval()
    ids = torch.randint(1, 97, (1, 8))
    rm = tenant.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
    p = rm.run_until(1, input_ids=ids)
    a = p.activation
    with pytest.raises(ValueError, match="passes on"):
        p.resume({"model.layers.1": a["model.layers.1"]})
    wrong = dict(a)
    wrong["model.layers.1"] = a["model.layers.1"][:, :4]
    with pytest.raises(djinn.BreakpointError, match="does not match"):
        p.resume(wrong)
    wrong["model.layers.1"] = a["model.layers.1"].double()
    with pytest.raises(djinn.BreakpointError, match="f64"):
        p.resume(wrong)
    # Still parked: the kept activation resumes to the model's output.
    torch.testing.assert_close(p.resume().logits, local(model, ids))
    with pytest.raises(djinn.BreakpointError, match="the last"):
        rm.run_until(rm.blocks - 1, input_ids=ids)


def test_a_model_larger_than_the_device_budget_streams_and_equals_the_resident_result(tenant_auth, tenant):
    torch.manual_seed(3)
    model = tiny_llama(layers=6, hidden=64).eval()
    ids = torch.randint(1, 97, (2, 16))
    resident = tenant.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # Room for about half the weights: some blocks stream through the ring.
    node = NodeProcess("--auth-file", tenant_auth, "--device-memory-budget", str(weights // 2))
    try:
        client = djinn.Client(node.address, token=TENANT_TOKEN)
        streamed = client.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
        stats = client.node_stats()
        assert stats["streamed_models"] == 1, stats
        for x in (ids, torch.randint(1, 97, (1, 9))):
            want = resident(input_ids=x).logits
            for _ in range(2):
                got = streamed(input_ids=x).logits
                assert torch.equal(got, want), (got - want).abs().max()
        # Breakpoints go through the ring too: stop in the middle, resume, same bits.
        p = streamed.run_until(3, input_ids=ids)
        assert torch.equal(p.resume().logits, resident(input_ids=ids).logits)
        stats = client.node_stats()
        assert stats["stream_bytes"] > 0 and stats["ring_bytes"] < weights, stats
    finally:
        node.stop()


def test_kept_tensors_public_weights_quotas_and_re_registration_on_split_graphs(tmp_path):
    """What the node does for any model, on a graph cut into blocks, for tenants without the
    TorchScript right: kept inputs and outputs (through a breakpoint too), public weights held
    once, a device quota that makes the model stream within it, and a model the node lost
    registered again by the client."""
    torch.manual_seed(4)
    model = tiny_llama(layers=4, hidden=64).eval()
    ids = torch.randint(1, 97, (2, 9))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    tokens = tokens_file(tmp_path, {
        "ann": "ann-token-0123456789ab",
        "ben": "ben-token-0123456789ab",
        "cat": {"tokens": ["cat-token-0123456789ab"], "quota": {"device_memory": weights // 2}},
    })
    node = NodeProcess("--auth-file", tokens)
    try:
        ann = djinn.Client(node.address, token="ann-token-0123456789ab")
        ben = djinn.Client(node.address, token="ben-token-0123456789ab")
        cat = djinn.Client(node.address, token="cat-token-0123456789ab")
        want = local(model, ids)
        # Public: ann uploads, ben's registration of the same bytes uploads nothing.
        a = ann.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True, public=True)
        b = ben.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True, public=True)
        assert a.uploaded and not b.uploaded and a.fingerprint == b.fingerprint
        torch.testing.assert_close(b(input_ids=ids).logits, want)
        assert ann.node_stats()["models"] == 1
        # Kept: the ids kept on the node feed a run that stops, and the resumed output stays there.
        kept_ids = ann.keep(ids)
        p = a.run_until(1, input_ids=kept_ids, keep=True)
        out = p.resume()
        assert isinstance(out.logits, djinn.RemoteTensor)
        torch.testing.assert_close(out.logits.cpu(), want)
        # cat's quota holds half the weights: its private copy streams within it.
        c = cat.register(model, {"input_ids": ids}, dynamic=DYNAMIC, split=True)
        assert torch.equal(c(input_ids=ids).logits, a(input_ids=ids).logits)
        assert cat.node_stats()["streamed_models"] == 1
        # Lost behind the client's back: the next call registers it again from the client's bytes.
        djinn.Client(node.address, token="ben-token-0123456789ab")._native.unregister_model(b.fingerprint)
        djinn.Client(node.address, token="ann-token-0123456789ab")._native.unregister_model(a.fingerprint)
        assert ann.node_stats()["models"] == 1, "cat's copy alone"
        torch.testing.assert_close(b(input_ids=ids).logits, want)
        assert ben.stats()["reregistrations"] == 1
    finally:
        node.stop()


def test_a_stack_splits_after_each_child_as_blocks_did(tenant):
    """A model written as a stack, which `blocks=[...]` sent as TorchScript: as graphs, one
    block per child, stopped and resumed on its activation, replaced or not."""
    torch.manual_seed(5)
    stack = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(4)))
    stack.eval()
    x = torch.randn(3, 16)
    rm = tenant.register(stack, x, split=True)
    assert rm.blocks == 4
    with torch.no_grad():
        want = stack(x)
        after_one = stack[:2](x)
    assert torch.equal(rm(x), want)
    p = rm.run_until(1, x)
    assert list(p.activation) == ["1"]
    assert torch.equal(p.activation["1"], after_one)
    with torch.no_grad():
        assert torch.equal(p.resume({"1": after_one * 2}), stack[2:](after_one * 2))


def test_blocks_given_as_a_list_are_graph_blocks_even_for_a_batch_of_one(tenant):
    """`blocks=[...]` from a tenant without the TorchScript right: the blocks chained are one
    graph cut after each. With a batch of one, which the layers' shapes fix while the input's
    batch stays open, a size a later block reads from the input passes the input on with the
    activation (named as the forward names it)."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(4)
    gpt = GPT(GPTConfig.tiny()).eval()
    idx = torch.randint(0, 97, (1, 12))
    rm = tenant.register(gpt, idx, blocks=gpt.blocks())
    assert rm.blocks == len(gpt.blocks())
    with torch.no_grad():
        assert torch.equal(rm(idx), gpt(idx))
        shorter = idx[:, :5]
        assert torch.equal(rm(shorter), gpt(shorter))
        hidden = gpt.layers[0](gpt.embedding(idx))
    p = rm.run_until(1, idx)
    assert set(p.activation) <= {"idx", "layers.0"} and torch.equal(p.activation["layers.0"], hidden)
    with torch.no_grad():
        assert torch.equal(p.resume({**p.activation, "layers.0": hidden * 0.5}),
                           gpt.head(gpt.layers[1](hidden * 0.5)))
