"""The Python package against a node whose device is a GPU, from a host whose torch sees it:
CUDA tensors as inputs (copied to host memory once, counted), a model no one here wrote, kept
outputs and parked activations in device memory, a session's state swapped to pinned host
memory and back. gpu-suite.sh runs these on GPU hosts; elsewhere they are skipped."""
import copy

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess
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
    rm = djinn.register(cached, (prompt, *cached.empty_state(prompt.shape[0])))
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
