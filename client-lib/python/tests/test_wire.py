"""Tensors as users pass them (views, transposes, expanded, channels_last, empty, every wire
dtype, up to 64 MiB), through every entry point that sends tensor bytes, against a real node:
what comes back is what was sent, bit for bit, whatever Python allocates and frees between
calls. The calls hold the memory they read: see lent_pages.py."""
import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

import djinn
from conftest import NodeProcess, scripted
from lent_pages import Clone, WithState
from djinn.tensors import WIRE_DTYPES


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    # A fresh tensor: its strides are the standard ones (a size-1 dimension's included).
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(bits(got), bits(want))


def churn(seed: int) -> None:
    """Allocates and frees memory of assorted sizes, as a program does between calls: memory
    freed too early is handed out again here."""
    g = torch.Generator().manual_seed(seed)
    junk = [torch.full((int(n),), 7, dtype=torch.uint8) for n in torch.randint(1, 1 << 18, (8,), generator=g)]
    del junk


@dataclass(frozen=True)
class Recipe:
    """How a user's tensor is made: random bits of `dtype` in `shape`, then a layout."""

    dtype: torch.dtype
    shape: tuple
    layout: str
    seed: int

    def make(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        n = 1
        for d in self.shape:
            n *= d
        if self.dtype == torch.bool:
            base = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
        else:
            size = torch.tensor([], dtype=self.dtype).element_size()
            # Any bit pattern: NaNs with payloads, denormals, negative zeros.
            base = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8).view(self.dtype)
        t = base.view(self.shape)
        if self.layout == "transposed" and t.dim() >= 2:
            t = t.transpose(0, t.dim() - 1)
        elif self.layout == "strided" and t.dim() >= 1:
            t = t[..., ::2]
        elif self.layout == "offset" and t.dim() >= 1 and t.shape[0] > 1:
            t = t[1:]
        elif self.layout == "expanded" and t.dim() >= 1 and n > 0:
            t = t.reshape(-1)[:1].view([1] * t.dim()).expand(*self.shape)
        elif self.layout == "broadcast" and t.dim() >= 1:
            t = t[:1].expand(3, *t.shape[1:]) if t.shape[0] > 0 else t
        elif self.layout == "channels_last" and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        elif self.layout == "permuted" and t.dim() >= 3:
            t = t.permute(2, 0, 1, *range(3, t.dim()))
        return t


LAYOUTS = ["contiguous", "transposed", "strided", "offset", "expanded", "broadcast", "channels_last", "permuted"]

recipes = st.builds(
    Recipe,
    dtype=st.sampled_from(list(WIRE_DTYPES)),
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**31),
)


@pytest.fixture
def models(client):
    # TorchScript blocks (scripted here, by a principal with the right): they take every dtype
    # and rank, which the wire paths are tested on.
    two = nn.Sequential(Clone(), Clone())
    rm = djinn.register(two, torch.zeros(4, 4), blocks=scripted(list(two), torch.zeros(4, 4)))
    with_state = WithState()
    example = (torch.zeros(2), torch.zeros(3))
    stateful = djinn.register(with_state, example, blocks=scripted([with_state], example))
    return rm, stateful


MiB = 1 << 20


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recipe=recipes, other=recipes)
@example(recipe=Recipe(torch.float32, (4096, 4096), "transposed", 1), other=Recipe(torch.uint8, (0,), "contiguous", 2))
@example(recipe=Recipe(torch.bfloat16, (32 * MiB,), "contiguous", 3), other=Recipe(torch.int64, (2, 1, 3), "expanded", 4))
@example(recipe=Recipe(torch.float16, (8, 64, 128, 32), "channels_last", 5), other=Recipe(torch.bool, (), "contiguous", 6))
def test_every_path_returns_what_was_sent_bit_for_bit(client, models, recipe, other):
    rm, stateful = models
    x, y = recipe.make(), other.make()
    want_x, want_y = x.clone(), y.clone()

    got = rm(x)
    churn(recipe.seed)
    kept = client.keep(x)
    churn(recipe.seed + 1)
    fetched = kept.cpu()
    kept.release()
    assert same_bits(got, want_x)
    assert same_bits(fetched, want_x)

    with stateful.session(y) as s:
        churn(recipe.seed + 2)
        out, state = s.step(x)
        assert same_bits(out, want_x) and same_bits(state, want_y)

    paused = rm.run_until(0, torch.zeros_like(want_x))
    churn(recipe.seed + 3)
    assert same_bits(paused.resume(x), want_x)
    # Nothing the calls did changed the caller's tensors.
    assert same_bits(x, want_x) and same_bits(y, want_y)


def test_a_transposed_input_gives_the_transpose_every_time(client):
    rm = djinn.register(nn.Sequential(Clone()), torch.zeros(4, 4), blocks=scripted([Clone()], torch.zeros(4, 4)))
    equal = 0
    for i in range(50):
        x = torch.randn(64, 64)
        y = rm(x.t())
        churn(i)
        equal += torch.equal(y, x.t())
    assert equal == 50
    big = torch.randn(1024, 1024)
    assert torch.equal(rm(big.t()), big.t())


def test_a_contiguous_cpu_input_is_sent_from_its_own_memory(client):
    rm = djinn.register(nn.Sequential(Clone()), torch.zeros(4, 4), blocks=scripted([Clone()], torch.zeros(4, 4)))
    x = torch.randn(16 * MiB)  # 64 MiB
    before = djinn.stats()
    assert torch.equal(rm(x), x)
    kept = client.keep(x)
    after = djinn.stats()
    assert (after["input_copies"], after["input_copy_bytes"]) == (before["input_copies"], before["input_copy_bytes"])
    kept.release()
    rm(x[::2])
    strided = djinn.stats()
    assert strided["input_copies"] == after["input_copies"] + 1
    assert strided["input_copy_bytes"] == after["input_copy_bytes"] + 32 * MiB


def test_a_torchvision_model_takes_inputs_as_users_pass_them(client):
    """A model no one here wrote (torchvision's ResNet-18, random weights from its config) on
    crops, transposes, strided and expanded batches and channels_last images: what the node
    returns is what the model gives here, bit for bit."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    rm = djinn.register(model, torch.randn(2, 3, 64, 64))
    images = torch.randn(4, 3, 80, 80)
    inputs = {
        "a channels_last crop": images.contiguous(memory_format=torch.channels_last)[:2, :, :64, :64],
        "transposed height and width": images.transpose(2, 3)[:2, :, 8:72, 8:72],
        "every other image": images[::2, :, :64, :64],
        "one image expanded": images[:1, :, :64, :64].expand(2, 3, 64, 64),
    }
    with torch.no_grad():
        for what, x in inputs.items():
            assert torch.equal(rm(x), model(x.contiguous())), what


def test_unsendable_inputs_are_refused_with_the_reason(client):
    rm = djinn.register(nn.Sequential(Clone()), torch.zeros(4, 4), blocks=scripted([Clone()], torch.zeros(4, 4)))
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="torch.from_numpy"):
        rm(np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(TypeError, match="complex64 cannot be sent"):
        rm(torch.zeros(4, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="cannot send a object"):
        rm(object())
    # The native call takes nothing but contiguous CPU tensors of a wire dtype.
    with pytest.raises(ValueError, match="must be contiguous"):
        client._native.execute(rm.fingerprint, [djinn._native.TensorSlot(0)], [torch.zeros(4, 4).t()])
    with pytest.raises(TypeError, match="no wire dtype"):
        client._native.execute(rm.fingerprint, [djinn._native.TensorSlot(0)], [torch.zeros(2, dtype=torch.complex64)])
    with pytest.raises(AttributeError):
        client._native.execute(rm.fingerprint, [djinn._native.TensorSlot(0)], [memoryview(b"abcd")])
    assert torch.equal(rm(torch.ones(2)), torch.ones(2)), "the client serves on"


def test_errors_present_themselves_as_djinn_errors():
    for name in ("TransportError", "RemoteError", "ExecutionError", "HandleLostError", "BlockMismatchError",
                 "UnsupportedOperationError", "DjinnError"):
        error = getattr(djinn, name)
        assert f"{error.__module__}.{error.__qualname__}" == f"djinn.{name}"
    assert issubclass(djinn.HandleLostError, djinn.TransportError)


def test_no_module_of_the_package_imports_in_a_cycle():
    """Every import between the package's modules that runs, at the top or inside a
    function, points down: the graph they make has no cycle, and `__init__` only re-exports.
    (Imports for type checkers alone, under `if TYPE_CHECKING:`, never run.)"""
    root = Path(djinn.__file__).parent

    def imported(node) -> set:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return set()
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            return {node.module} if node.module else {a.name for a in node.names}
        return set().union(*(imported(child) for child in ast.iter_child_nodes(node)))

    imports = {path.stem: imported(ast.parse(path.read_text())) - {"_native"} for path in root.glob("*.py")}
    assert set(imports["__init__"]) <= set(imports) and all(
        isinstance(n, (ast.ImportFrom, ast.Expr, ast.Assign)) for n in ast.parse((root / "__init__.py").read_text()).body
    ), "__init__ re-exports only"
    done: set = set()

    def visit(module, path):
        assert module not in path, f"an import cycle: {' -> '.join(path + [module])}"
        if module not in done:
            for m in imports[module]:
                visit(m, path + [module])
            done.add(module)

    for module in imports:
        visit(module, [])


def test_memory_lent_to_a_call_is_not_read_after_it_returns():
    node = NodeProcess()
    try:
        script = Path(__file__).with_name("lent_pages.py")
        done = subprocess.run(
            [sys.executable, str(script), node.address, str(node.proc.pid)], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"exit {done.returncode}: {done.stdout[-2000:]} {done.stderr[-4000:]}"
        assert done.stdout.startswith("ok"), done.stdout
    finally:
        node.stop()
