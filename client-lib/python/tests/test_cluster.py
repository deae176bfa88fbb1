"""The Python package against a control plane: real `djinn control` and `djinn node --control`
processes. Models go where the control plane places them, with the FLOPs the package counts,
and move when their node dies."""
import time

import pytest
import torch
from torch import nn

import djinn
from conftest import DjinnProcess, scripted


def mlp(seed: int):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()


class Cluster:
    """A control plane (embedded store, 1 s leases) and two nodes: `compute` computes fast and
    reads its memory slowly; `memory` the other way round."""

    def __init__(self, tmp_path):
        self.control = DjinnProcess("control", "--store", str(tmp_path / "control.redb"), "--lease-ttl", "1s")
        self.url = f"http://{self.control.address}"
        self.nodes = {}
        for name, flops, bandwidth in [("compute", "1e13", "1e9"), ("memory", "1e9", "1e13")]:
            self.nodes[name] = DjinnProcess(
                "node", "--device", "cpu", "--control", self.url, "--name", name,
                "--device-memory-budget", "256MiB", "--flops", flops, "--memory-bandwidth", bandwidth,
                "--host-to-device", "1e10",
            )
        self.wait_for_nodes(["compute", "memory"])

    def wait_for_nodes(self, names):
        """Waits until the control plane lists exactly `names` (a node joins within a moment of
        starting; one that died leaves when its 1 s lease lapses). A hang guard: it fails only
        when that has not happened in 30 s."""
        client = djinn.Client(self.url)
        deadline = time.monotonic() + 30
        while sorted(n["name"] for n in client.cluster()["nodes"]) != sorted(names):
            assert time.monotonic() < deadline, client.cluster()
            time.sleep(0.05)

    def stop(self):
        for node in self.nodes.values():
            if node.proc.poll() is None:
                node.stop()
        self.control.stop()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.stop()


def test_a_model_is_described_placed_run_and_explained(cluster):
    client = djinn.init(cluster.url)
    assert client.mode == "control"
    model = mlp(1)
    x = torch.randn(1, 256)
    rm = djinn.register(model, x, blocks=list(model.children()))
    # FLOPs counted on the example: two matrix products, 2·256·1024 each.
    assert [flops for _, flops in rm.description["blocks"]] == [2 * 256 * 1024, 0.0, 2 * 1024 * 256]
    assert rm.description["blocks"][0][0] == (256 * 1024 + 1024) * 4
    assert rm.description["io_bytes"] == 2 * 256 * 4
    with torch.no_grad():
        assert torch.equal(rm(x), model(x))
    placement = rm.placement
    assert placement["node"] in cluster.nodes and placement["rule"] == "policy"
    assert placement["cost"]["compute_s"] > 0 and placement["runner_up"] is not None
    status = djinn.status()
    [described] = [m for m in status["models"] if m["fingerprint"] == rm.fingerprint]
    assert described["nodes"] == [placement["node"]] and described["blocks"] == 3
    with pytest.raises(djinn.DjinnError, match="not to one node"):
        client.ping()


def test_the_phase_hint_sends_prefill_to_compute_and_decode_to_memory(cluster):
    djinn.init(cluster.url)
    x = torch.randn(4, 256)
    prefill = djinn.register(mlp(2), x, phase="prefill")
    decode = djinn.register(mlp(3), x, phase="decode")
    assert (prefill.placement["node"], prefill.placement["cost"]["bound"]) == ("compute", "compute")
    assert (decode.placement["node"], decode.placement["cost"]["bound"]) == ("memory", "memory")
    with pytest.raises(ValueError, match="phase"):
        djinn.register(mlp(4), x, phase="vision")
    with pytest.raises(djinn.ControlPlaneError, match="unknown variant `fastest`"):
        djinn.register(mlp(4), x, policy="fastest")


def test_a_killed_node_fails_over_with_every_result_correct(cluster):
    client = djinn.init(cluster.url, failover=20.0)
    model = mlp(5)
    rm = djinn.register(model, torch.randn(1, 256))
    first = rm.placement["node"]
    cluster.nodes[first].kill()
    for i in range(50):
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            assert torch.equal(rm(x), model(x))
    assert rm.placement["node"] != first
    stats = client.stats()
    assert stats["node_failures"] >= 1 and stats["reregistrations"] == 1, stats
    cluster.wait_for_nodes([n for n in cluster.nodes if n != first])


def test_a_bare_address_serving_http_is_a_control_plane(cluster):
    assert djinn.Client(cluster.control.address).mode == "control"
    assert djinn.Client(cluster.nodes["compute"].address).mode == "node"
    with pytest.raises(djinn.ControlPlaneError):
        djinn.Client(cluster.url + "/nowhere")


def test_kept_tensors_stay_where_they_are_and_the_model_goes_to_them(cluster):
    """A model's output kept on its node, pushed to the other node, feeds a model placed
    elsewhere: the call runs where the tensor is, and that node gets the model from the kept
    archives. The memory path is reported by the control plane and by the client."""
    client = djinn.Client(cluster.url)
    torch.manual_seed(4)
    first = nn.Sequential(nn.Linear(256, 64), nn.ReLU()).eval()
    second = nn.Sequential(nn.Linear(64, 32)).eval()
    x = torch.randn(2, 256)
    with torch.no_grad():
        h_local = first(x)
        expected = second(h_local)
    rm1 = client.register(first, x)
    rm2 = client.register(second, h_local)
    h = rm1(x, keep=True)
    assert h.node == rm1.placement["addr"]
    other = next(n["inventory"]["addr"] for n in client.cluster()["nodes"] if n["inventory"]["addr"] != h.node)
    moved = h.push(other)
    before = client.stats()
    assert torch.equal(rm2(moved), expected)
    assert torch.equal(rm2(h), expected)
    # h and its copy are on the two nodes, rm2 was placed on one of them: the other got it.
    assert client.stats()["reregistrations"] == before["reregistrations"] + 1
    assert {n["inventory"]["memory_path"] for n in client.cluster()["nodes"]} == {"staging"}
    assert client.stats()["memory_path"] == "staging"


def test_a_session_lives_on_the_node_its_model_was_placed_on_and_is_lost_with_it(cluster):
    from gpt import CachedGPT, generate, greedy
    from test_sessions import NEW_TOKENS, model

    client = djinn.Client(cluster.url, failover=20.0)
    gpt = model()
    cached = CachedGPT(gpt).eval()
    prompt = torch.randint(0, gpt.config.vocab, (1, 8), generator=torch.Generator().manual_seed(6))
    example = (prompt, *cached.empty_state())
    rm = client.register(cached, example, blocks=scripted([cached], example))
    first = rm.placement
    with rm.session(*cached.empty_state()) as s:
        assert s.node == first["addr"]

        def step(tokens):
            logits = s.step(tokens)
            s.io_wait(5)
            return logits

        assert torch.equal(greedy(step, prompt, NEW_TOKENS), generate(gpt, prompt, NEW_TOKENS))
        cluster.nodes[first["node"]].kill()
        with pytest.raises(djinn.HandleLostError):
            s.step(prompt)
        # Closing it is harmless: there is nothing left to free.
    # The model fails over; a new session goes where it went.
    with rm.session(*cached.empty_state()) as s:
        assert s.node == rm.placement["addr"] != first["addr"]
        assert torch.equal(greedy(s.step, prompt, NEW_TOKENS), generate(gpt, prompt, NEW_TOKENS))


def test_a_llama_session_prefills_on_one_node_and_decodes_on_another(cluster, tmp_path):
    """A Hugging Face Llama (random weights, a static KV cache) generates greedily, token for
    token as the local `generate` does: prefill on the node it was placed on, decode on the
    other, moved back in the middle of decoding (by name); its first node killed after a move
    (it goes on where it went); the node it was to go to killed before the move (it goes on
    where it was)."""
    from conftest import hf_llama
    from test_graph_sessions import local_generate, register

    torch.manual_seed(0)
    model = hf_llama().eval()
    prompt = torch.randint(1, 97, (1, 7))
    new_tokens = 10
    want = local_generate(model, prompt, new_tokens)[0]
    client = djinn.Client(cluster.url, failover=20.0)
    rm = register(client, model, prompt)
    address = {name: node.address for name, node in cluster.nodes.items()}
    name_at = {addr: name for name, addr in address.items()}

    def other(addr):
        return next(a for a in address.values() if a != addr)

    def decode(s, logits, between=lambda i: None):
        tokens = []
        for i in range(new_tokens):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(tok.item())
            between(i)
            if i + 1 < new_tokens:
                logits = s.step(input_ids=tok)
        return tokens

    def sessions_on(addr):
        return djinn.Client(addr).node_stats()["sessions"]

    with rm.session() as s:
        first = s.node
        logits = s.step(input_ids=prompt)
        s.move(other(first))
        assert s.node == other(first)
        assert sessions_on(first) == 0 and sessions_on(s.node) == 1

        def back_at_five(i):
            if i == 5:
                s.move(name_at[first])
                assert s.node == first

        assert decode(s, logits, back_at_five) == want

    # Moved, then its first node killed: it goes on where it went.
    with rm.session() as s:
        first = s.node
        logits = s.step(input_ids=prompt)
        s.move(other(first))
        cluster.nodes[name_at[first]].kill()
        assert decode(s, logits) == want

    # A third node joins; the node a session was to move to is killed before the move: the
    # move fails and the session goes on where it was.
    cluster.nodes["spare"] = DjinnProcess(
        "node", "--device", "cpu", "--control", cluster.url, "--name", "spare", "--device-memory-budget", "256MiB",
    )
    live = [n for n, node in cluster.nodes.items() if node.proc.poll() is None]
    cluster.wait_for_nodes(live)
    with rm.session() as s:
        here = s.node
        logits = s.step(input_ids=prompt)
        there = next(n for n in live if cluster.nodes[n].address != here)
        cluster.nodes[there].kill()
        with pytest.raises(djinn.TransportError):
            s.move(cluster.nodes[there].address)
        assert s.node == here
        assert decode(s, logits) == want


def test_a_drained_nodes_llama_sessions_decode_on_elsewhere_token_for_token(cluster):
    """`djinn drain` on the node of twenty Hugging Face Llama sessions (random weights) while
    they decode: every session goes on at the other node, token for token as the local
    `generate`, no step fails, and the drained node ends holding nothing."""
    import contextlib
    import subprocess

    from conftest import hf_llama, node_binary
    from test_graph_sessions import local_generate, register

    torch.manual_seed(0)
    model = hf_llama().eval()
    new_tokens = 16
    prompts = [torch.randint(1, 97, (1, 5)) for _ in range(20)]
    want = [local_generate(model, p, new_tokens)[0] for p in prompts]
    client = djinn.Client(cluster.url, failover=20.0)
    rm = register(client, model, prompts[0])
    name_at = {node.address: name for name, node in cluster.nodes.items()}
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(rm.session()) for _ in prompts]
        logits = [s.step(input_ids=p) for s, p in zip(sessions, prompts)]
        drained = sessions[0].node
        assert all(s.node == drained for s in sessions)
        drain = subprocess.Popen([node_binary(), "drain", name_at[drained], "--control", cluster.url, "--timeout", "60"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tokens = [[] for _ in prompts]
        ended_at = None
        for i in range(new_tokens):
            for k, s in enumerate(sessions):
                tok = logits[k][:, -1].argmax(-1, keepdim=True)
                tokens[k].append(tok.item())
                if i + 1 < new_tokens:
                    logits[k] = s.step(input_ids=tok)
            if ended_at is None and drain.poll() is not None:
                ended_at = i
            time.sleep(0.1)
        printed, _ = drain.communicate(timeout=60)
        assert drain.returncode == 0 and "is drained: it holds nothing" in printed, printed
        assert ended_at is not None and ended_at + 1 < new_tokens, "the drain ended after the decoding"
        assert tokens == want
        assert all(s.node != drained for s in sessions)
        assert djinn.Client(drained).node_stats()["sessions"] == 0


def test_several_control_endpoints_are_tried_in_turn(cluster):
    """A list of control processes: one that is down is passed over."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = djinn.Client([down, cluster.url])
    assert client.mode == "control"
    assert sorted(n["name"] for n in client.cluster()["nodes"]) == ["compute", "memory"]
    rm = client.register(mlp(3), torch.randn(2, 256))
    x = torch.randn(2, 256)
    assert torch.allclose(rm(x), mlp(3)(x), atol=1e-6)


def test_a_keyed_session_moves_and_the_control_plane_follows(cluster):
    """A session opened under a key is where the control plane places that key; moved, the
    control plane records it at its new node."""
    from conftest import hf_llama
    from test_graph_sessions import register

    torch.manual_seed(1)
    model = hf_llama().eval()
    prompt = torch.randint(1, 97, (1, 5))
    client = djinn.Client(cluster.url)
    rm = register(client, model, prompt)
    name_at = {node.address: name for name, node in cluster.nodes.items()}
    with rm.session(key="chat-1") as s:
        s.step(input_ids=prompt)
        assert dict(map(tuple, client.cluster()["sessions"]))["chat-1"] == name_at[s.node]
        there = next(a for a in name_at if a != s.node)
        s.move(there)
        assert dict(map(tuple, client.cluster()["sessions"]))["chat-1"] == name_at[there]


def test_prefill_goes_to_compute_and_decode_to_memory_with_the_move_weighed(cluster):
    """`prefill="auto", decode="auto"`: the prompt runs on the node with the FLOP/s, the tokens
    on the node with the memory bandwidth, the move's cost in the decision; token for token as
    the local `generate`."""
    from conftest import hf_llama
    from test_graph_sessions import local_generate, register

    torch.manual_seed(0)
    model = hf_llama().eval()
    prompt = torch.randint(1, 97, (1, 7))
    want = local_generate(model, prompt, 8)[0]
    assert len(want) == 8, "the local generation stopped at its end token"
    client = djinn.Client(cluster.url)
    rm = register(client, model, prompt)
    address = {name: node.address for name, node in cluster.nodes.items()}
    with rm.session(prefill="auto", decode="auto") as s:
        assert s.node == address["compute"]
        logits = s.step(input_ids=prompt)
        tokens = []
        for i in range(8):
            tok = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(tok.item())
            if i < 7:
                logits = s.step(input_ids=tok)
        assert s.node == address["memory"]
        assert tokens == want
    prefill, decode = s.placements
    assert (prefill["node"], decode["node"]) == ("compute", "memory")
    assert decode["cost"]["move_s"] > 0 and prefill["cost"]["move_s"] == 0
    # A state of 32 MiB (reserved) moved for one step is not worth the microseconds the other
    # node saves: the session stays.
    with rm.session(prefill="auto", decode="auto", decode_steps=1, reserve=32 << 20) as s:
        s.step(input_ids=prompt)
        s.step(input_ids=prompt[:, :1])
        assert s.node == address["compute"], s.placements
