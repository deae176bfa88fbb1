"""Replies from a node the client cannot trust (issue 49): a kept tensor's fetch answered with
far more bytes than the tensor holds is refused before it is read, as a djinn exception (not
torch's RuntimeError), and the client's memory stays bounded. Against a real node behind a
hostile one (`target/debug/examples/hostile_node`, tests/support/hostile_node.rs)."""
import os

import pytest
import torch

import djinn
from conftest import HostileNode, NodeProcess

OVERSIZED = 512 << 20


@pytest.fixture(scope="module")
def oversized():
    """A client whose node answers fetches with 512 MiB of zeros."""
    node = NodeProcess()
    hostile = HostileNode(node.address, "--oversized-reply", str(OVERSIZED))
    try:
        yield djinn.Client(hostile.address, transport="tcp")
    finally:
        hostile.stop()
        node.stop()


def rss() -> int:
    """Resident memory of this process, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_kept_tensor_answered_with_512_mib_raises_a_djinn_error_without_reading_it(oversized):
    kept = oversized.keep(torch.arange(16, dtype=torch.uint8))
    assert kept.nbytes == 16
    before = rss()
    with pytest.raises(djinn.BadReplyError, match=f"{OVERSIZED} bytes .* at most 16") as raised:
        kept.cpu()
    assert isinstance(raised.value, djinn.DjinnError)
    assert rss() - before < 64 << 20, "the 512 MiB reply was read into memory"
    # The connection that carried the reply was closed; the next request opens another.
    assert oversized.ping() > 0


def test_a_reply_over_max_reply_bytes_raises_a_djinn_error_and_the_default_takes_it():
    """An execution's outputs are bounded by `max_reply_bytes` (their size is not fixed by the
    request): 16 KiB of output past a 4 KiB bound raises BadReplyError; the default takes it."""
    node = NodeProcess()
    try:
        model = torch.nn.Linear(8, 1024).eval()
        x = torch.randn(4, 8)
        small = djinn.Client(node.address, transport="tcp", max_reply_bytes=4096)
        rm = djinn.register(model, x, client=small)
        with pytest.raises(djinn.BadReplyError, match="at most 4096"):
            rm(x)
        assert small.ping() > 0
        whole = djinn.register(model, x, client=djinn.Client(node.address, transport="tcp"))
        with torch.no_grad():
            torch.testing.assert_close(whole(x), model(x))
    finally:
        node.stop()
