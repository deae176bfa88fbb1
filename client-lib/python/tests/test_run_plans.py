"""A node plans every graph run before it runs it: the graph over meta tensors at the call's
shapes gives its floating-point operations and the most memory its intermediates and outputs
hold at once (each value freed after the last operator that reads it). A run planned over the
node's bound per run (`--max-run-memory`) or over the tenant's device-memory quota is refused
before it runs, and its operations come out of the tenant's compute quota (`flops_per_second`,
`flops_burst`). The figures are checked exactly on a small MLP, whose costs are worked out by
hand below."""
import time

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess, hf_gpt2, hf_llama, tokens_file

FREE = "free-tenant-token-0123456"
METERED = "metered-tenant-token-0123"
SMALL = "small-quota-token-0123456"

# nn.Linear(256, 1024), ReLU, nn.Linear(1024, 256), per row of the batch: each product two
# operations per multiply-add, a bias one per output, the ReLU one per element.
FLOPS_PER_ROW = (2 * 256 * 1024 + 1024) + 1024 + (2 * 1024 * 256 + 256)
# At most two [rows, 1024] float32 values live at once: the first product, and the ReLU's output
# (the product is freed once the ReLU has read it; the second product's [rows, 256] comes while
# the ReLU's output is still read).
PEAK_BYTES_PER_ROW = 2 * 1024 * 4
MAX_RUN = 8 << 20


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).eval()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    tokens = tokens_file(
        tmp_path_factory.mktemp("auth"),
        {
            "free": FREE,
            # A row's worth a second, eight at once.
            "metered": {"tokens": [METERED], "quota": {"flops_per_second": FLOPS_PER_ROW, "flops_burst": 8 * FLOPS_PER_ROW}},
            # The MLP's weights (2.1 MB) and 64 KiB besides.
            "small": {"tokens": [SMALL], "quota": {"device_memory": 2_102_272 + 65_536}},
        },
    )
    n = NodeProcess("--auth-file", tokens, "--max-run-memory", str(MAX_RUN))
    yield n
    n.stop()


@pytest.fixture(scope="module")
def unbounded_node(tmp_path_factory):
    """A node without a bound per run: the models below allocate more than 8 MiB at once as
    they run (libtorch's convolutions take 9 MiB of scratch for ResNet-18 at 64×64), which the
    node's allocator counts against the bound whatever the plan saw."""
    n = NodeProcess("--auth-file", tokens_file(tmp_path_factory.mktemp("auth"), {"free": FREE}))
    yield n
    n.stop()


def client(node, token):
    return djinn.Client(node.address, token=token)


def test_a_runs_operations_and_peak_are_planned_exactly_and_scale_with_its_shapes(node):
    free = client(node, FREE)
    model = mlp()
    rm = free.register(model, torch.randn(4, 256), dynamic={"input": {0: "batch"}})
    for rows in (4, 2, 4, 1024):
        before = free.node_stats()
        x = torch.randn(rows, 256)
        with torch.no_grad():
            torch.testing.assert_close(rm(x), model(x))
        after = free.node_stats()
        assert after["planned_flops"] - before["planned_flops"] == rows * FLOPS_PER_ROW, rows
        assert after["largest_planned_run_bytes"] == max(before["largest_planned_run_bytes"], rows * PEAK_BYTES_PER_ROW)
    # 1,024 rows plan exactly the node's bound per run, which admits them.
    assert free.node_stats()["largest_planned_run_bytes"] == MAX_RUN
    assert free.node_stats()["partly_planned_runs"] == 0


def test_a_run_planned_over_the_nodes_bound_is_refused_before_it_runs(node):
    free = client(node, FREE)
    rm = free.register(mlp(), torch.randn(4, 256), dynamic={"input": {0: "batch"}})
    before = free.node_stats()
    with pytest.raises(djinn.OverBudgetError, match=f"would hold {1025 * PEAK_BYTES_PER_ROW} bytes at once; the node lets one run hold {MAX_RUN}"):
        rm(torch.randn(1025, 256))
    after = free.node_stats()
    assert after["runs_refused_by_plan"] == before["runs_refused_by_plan"] + 1
    assert after["planned_flops"] == before["planned_flops"], "nothing of it ran"
    # A transposed, strided input of the same shape is planned and refused alike; the node
    # serves the next call.
    with pytest.raises(djinn.OverBudgetError):
        rm(torch.randn(256, 2050).t()[::2])
    assert rm(torch.randn(3, 256)).shape == (3, 256)


def test_a_run_over_the_tenants_memory_quota_is_refused_and_its_charge_released(node):
    small = client(node, SMALL)
    rm = small.register(mlp(), torch.randn(4, 256), dynamic={"input": {0: "batch"}})
    # 4 rows plan 32 KiB, within what the quota leaves past the weights; 16 rows, 128 KiB, not.
    assert rm(torch.randn(4, 256)).shape == (4, 256)
    with pytest.raises(djinn.QuotaExceededError, match=f"would hold {16 * PEAK_BYTES_PER_ROW} bytes at once: over .*'s memory quota: 131072 bytes asked for, 2102272 of 2167808 in use"):
        rm(torch.randn(16, 256))
    # A run's charge lasts while it runs: a hundred runs in a row all fit.
    for _ in range(100):
        rm(torch.randn(4, 256))
    # Another tenant's same shapes are its own business.
    free = client(node, FREE)
    assert free.register(mlp(), torch.randn(4, 256), dynamic={"input": {0: "batch"}})(torch.randn(16, 256)).shape == (16, 256)


def test_the_compute_quota_meters_a_tenant_and_no_other(node):
    metered, free = client(node, METERED), client(node, FREE)
    rm = metered.register(mlp(), torch.randn(4, 256), dynamic={"input": {0: "batch"}})
    other = free.register(mlp(), torch.randn(4, 256), dynamic={"input": {0: "batch"}})
    with pytest.raises(djinn.QuotaExceededError, match="more than the tenant's compute burst.*can never run"):
        rm(torch.randn(9, 256))
    # The bucket starts full: eight rows' worth, then it refills at a row a second (four rows
    # more would take four seconds).
    rm(torch.randn(4, 256))
    rm(torch.randn(4, 256))
    with pytest.raises(djinn.QuotaExceededError, match="over the tenant's compute rate.*enough in"):
        rm(torch.randn(4, 256))
    # Meanwhile another tenant's work is not metered.
    for _ in range(20):
        assert other(torch.randn(64, 256)).shape == (64, 256)
    time.sleep(1.2)
    assert rm(torch.randn(1, 256)).shape == (1, 256), "a row's worth has come back"


def test_users_models_are_planned_to_their_end(unbounded_node):
    """Hugging Face GPT-2 and Llama, torchvision's ResNet-18: every operator of their graphs
    has a meta kernel in a node (libtorch's, or the node's own for what libtorch keeps in
    Python), so their plans reach the end."""
    import torchvision

    free = client(unbounded_node, FREE)
    torch.manual_seed(0)
    for model, x, dynamic in [
        (hf_gpt2(use_cache=False), torch.randint(1, 97, (2, 16)), {"input_ids": {0: "batch", 1: ("seq", 2, 64)}}),
        (hf_llama(use_cache=False), torch.randint(1, 97, (2, 16)), {"input_ids": {0: "batch", 1: ("seq", 2, 64)}}),
        (torchvision.models.resnet18(weights=None, num_classes=10), torch.randn(2, 3, 64, 64), {"x": {0: "batch"}}),
    ]:
        model = model.eval()
        rm = free.register(model, x, dynamic=dynamic)
        before = free.node_stats()
        with torch.no_grad():
            want = model(x)
        got = rm(x)
        key = "logits" if isinstance(want, dict) else None
        torch.testing.assert_close(got[key] if key else got, want[key] if key else want)
        after = free.node_stats()
        assert after["partly_planned_runs"] == before["partly_planned_runs"], type(model).__name__
        assert after["planned_flops"] > before["planned_flops"]
    # ResNet-18's convolutions and product at 64×64: within 1% of the 0.59 GFLOP of two images.
    before = free.node_stats()["planned_flops"]
    rm(torch.randn(2, 3, 64, 64))
    assert abs(free.node_stats()["planned_flops"] - before - 593.4e6) < 6e6


def test_a_run_whose_sizes_depend_on_its_data_is_planned_as_far_as_they_allow(node):
    class Positives(nn.Module):
        def forward(self, x):
            return (x[x > 0] * 2).sum()

    free = client(node, FREE)
    rm = free.register(Positives(), torch.randn(8))
    before = free.node_stats()["partly_planned_runs"]
    x = torch.randn(8)
    torch.testing.assert_close(rm(x), (x[x > 0] * 2).sum())
    assert free.node_stats()["partly_planned_runs"] == before + 1
