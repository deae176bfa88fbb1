"""The Python package against a node whose device is a GPU, from a host whose torch sees it:
CUDA tensors as inputs (copied to host memory once, counted), a model no one here wrote, kept
outputs and parked activations in device memory, a session's state swapped to pinned host
memory and back. gpu-suite.sh runs these on GPU hosts; elsewhere they are skipped."""
import copy

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess, hf_llama, scripted
from gpt import GPT, CachedGPT, GPTConfig, greedy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (gpu-suite.sh runs this on a GPU host)"
)


@pytest.fixture(scope="module")
def gpu_client():
    node = NodeProcess("--device", "cuda:0", "--session-policy", "semantic")
    try:
        yield djinn.init(node.address)
    finally:
        node.stop()


def test_a_torchvision_model_on_a_gpu_node_takes_cuda_inputs(gpu_client):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    rm = djinn.register(model, torch.randn(2, 3, 64, 64))
    local = copy.deepcopy(model).cuda()
    x = torch.randn(2, 3, 64, 64, device="cuda")
    before = djinn.stats()
    out = rm(x)
    after = djinn.stats()
    # A CUDA input leaves through host memory: one copy, counted.
    assert after["input_copies"] == before["input_copies"] + 1
    assert after["input_copy_bytes"] == before["input_copy_bytes"] + x.numel() * 4
    with torch.no_grad():
        want = local(x).cpu()
    # Same GPU, same libtorch kernels; cuDNN may pick another algorithm in another process.
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)


def test_kept_outputs_and_parked_activations_stay_in_device_memory(gpu_client):
    torch.manual_seed(7)
    stack = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6))).eval()
    blocks = list(stack.children())
    x = torch.randn(8, 256)
    rm = djinn.register(stack, x, blocks=blocks)
    straight = rm(x)
    for k in range(len(blocks) - 1):
        # Paused after block k, the activation parked on the GPU, resumed: the straight output.
        assert torch.equal(rm.run_until(k, x, fetch=False).resume(), straight), f"paused after block {k}"
    head = djinn.register(nn.Sequential(*blocks[:3]), x)
    tail = djinn.register(nn.Sequential(*blocks[3:]), x)
    kept = head(x, keep=True)
    assert torch.equal(tail(kept), tail(head(x)))
    big = torch.randn(64 << 20 >> 2)
    assert torch.equal(gpu_client.keep(big).cpu(), big), "64 MiB through device memory"


def test_a_sessions_state_goes_to_pinned_memory_and_back_between_steps(gpu_client):
    torch.manual_seed(3)
    gpt = GPT(GPTConfig.tiny()).spread_weights(0.3).eval()
    torch.manual_seed(4)
    prompt = torch.randint(0, GPTConfig.tiny().vocab, (2, 8))
    cached = CachedGPT(gpt).eval()
    # A session whose state the client gives and each step writes in place: TorchScript, which
    # the user scripts (as in test_sessions.py).
    example = (prompt, *cached.empty_state(prompt.shape[0]))
    rm = djinn.register(cached, example, blocks=scripted([cached], example))
    before = gpu_client.node_stats()
    with djinn.session(rm, *cached.empty_state(prompt.shape[0])) as s:

        def step(tokens):
            logits = s.step(tokens)
            s.io_wait()
            return logits

        tokens = greedy(step, prompt, 12)
    after = gpu_client.node_stats()
    assert after["session_swaps_out"] - before["session_swaps_out"] >= 11
    # The GPU's arithmetic may differ from the CPU's in the last bits, and greedy decoding then
    # picks another token: compare against the same generation run without swaps on the GPU.
    with djinn.session(rm, *cached.empty_state(prompt.shape[0])) as s:
        unswapped = greedy(s.step, prompt, 12)
    assert torch.equal(tokens, unswapped)


def test_graph_blocks_stream_and_a_graph_session_keeps_its_cache_on_the_gpu():
    """A Hugging Face Llama cut into decoder layers streams through the ring on the copy stream
    under a device budget of half its weights, equal to the resident copy; greedy decoding
    through a session of the Llama with a static cache on the GPU (written in place there)
    gives the tokens of local `generate` on the same GPU."""
    pytest.importorskip("transformers")

    torch.manual_seed(11)
    # Without a cache for the split model (a block graph returns tensors, not a DynamicCache);
    # with one for the session, which registers it static (`cache_len=`).
    model = hf_llama(layers=6, hidden=64, use_cache=False).eval()
    ids = torch.randint(1, 97, (2, 16))
    dynamic = {"input_ids": {1: ("seq", 2, 32)}}
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    resident_node = NodeProcess("--device", "cuda:0")
    streamed_node = NodeProcess("--device", "cuda:0", "--device-memory-budget", str(weights // 2))
    try:
        on_resident = djinn.Client(resident_node.address)
        resident = on_resident.register(model, {"input_ids": ids}, dynamic=dynamic, split=True)
        client = djinn.Client(streamed_node.address)
        streamed = client.register(model, {"input_ids": ids}, dynamic=dynamic, split=True)
        assert client.node_stats()["streamed_models"] == 1
        assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)
        p = streamed.run_until(2, input_ids=ids, fetch=False)
        assert torch.equal(p.resume().logits, resident(input_ids=ids).logits)

        prompt = ids[:1, :7]
        model.config.use_cache = True
        # Whole, the model does not fit the streamed node's budget: the session runs on the other.
        rm = on_resident.register(model, {"input_ids": prompt}, dynamic=dynamic, cache_len=32)
        with torch.no_grad():
            want = copy.deepcopy(model).cuda().generate(prompt.cuda(), max_new_tokens=10, do_sample=False)[:, 7:].cpu()
        with rm.session() as s:
            logits = s.step(input_ids=prompt)
            got = []
            for i in range(10):
                tok = logits[:, -1].argmax(-1, keepdim=True)
                got.append(tok)
                if i == 4:
                    s.io_wait(5)
                logits = s.step(input_ids=tok)
        assert torch.cat(got, 1).tolist() == want.tolist()
        assert on_resident.node_stats()["session_state_bytes_in_place"] > 0
    finally:
        resident_node.stop()
        streamed_node.stop()
