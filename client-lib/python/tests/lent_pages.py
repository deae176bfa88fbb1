"""Run by test_wire.py in a process of its own: every call's input lies in pages of its own,
made unreadable (mprotect PROT_NONE) as soon as the call returns. If anything read them after
that, this process would die of SIGSEGV; it prints "ok" when every later call worked.

Usage: python lent_pages.py NODE_ADDRESS NODE_PID"""
import ctypes
import mmap
import os
import signal
import sys

import torch
from torch import nn

import djinn
from conftest import scripted

PROT_NONE = 0
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class Pages:
    """`nbytes` of their own pages, as an f32 tensor of `shape`, filled at random."""

    def __init__(self, shape, seed: int):
        n = 1
        for d in shape:
            n *= d
        self.nbytes = 4 * n
        self.map = mmap.mmap(-1, max(self.nbytes, 1))
        self.tensor = torch.frombuffer(self.map, dtype=torch.float32, count=n).view(shape)
        self.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
        self.copy = self.tensor.clone()

    def _protect(self, prot: int) -> None:
        if libc.mprotect(self.tensor.data_ptr(), self.nbytes, prot) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")

    def forbid(self) -> None:
        self._protect(PROT_NONE)

    def allow(self) -> None:
        self._protect(PROT_READ_WRITE)


class Clone(nn.Module):
    def forward(self, x):
        return x.clone()


class WithState(nn.Module):
    """A session's model: returns the input and the state as they are; the state stays."""

    def forward(self, x, state):
        return x.clone(), state.clone(), state


class Pass(nn.Module):
    def forward(self, x, state_copy, state):
        return x.clone(), state_copy.clone(), state


class Stateful(nn.Module):
    """Two blocks: a session step can stop between them."""

    def __init__(self):
        super().__init__()
        self.first, self.second = WithState(), Pass()

    def forward(self, x, state):
        return self.second(*self.first(x, state))


def main(address: str, node_pid: int) -> None:
    client = djinn.init(address, timeout=1.5, failover=0.0)
    two = nn.Sequential(Clone(), Clone())
    # TorchScript (a session whose state the client gives, every rank through one model).
    rm = djinn.register(two, torch.zeros(4, 4), blocks=scripted(list(two), torch.zeros(4, 4)))
    lin = nn.Linear(256, 8)
    linear = djinn.register(lin, torch.zeros(2, 256), blocks=scripted([lin], torch.zeros(2, 256)))
    model = Stateful()
    example = (torch.zeros(2), torch.zeros(3))
    stateful = djinn.register(model, example, blocks=scripted([model.first, model.second], example))
    forbidden = []
    results = []

    def lend(shape, seed):
        pages = Pages(shape, seed)
        forbidden.append(pages)
        return pages

    # Returned normally, through every entry point that sends tensor bytes.
    p = lend((512, 512), 1)
    results.append((rm(p.tensor), p.copy))
    p.forbid()
    p = lend((512, 512), 2)
    kept = client.keep(p.tensor)
    p.forbid()
    results.append((kept.cpu(), p.copy))
    p = lend((1, 64), 3)
    s = stateful.session(p.tensor)
    p.forbid()
    q = lend((256, 64), 4)
    out, state = s.step(q.tensor)
    q.forbid()
    results += [(out, q.copy), (state, p.copy)]
    q = lend((256, 64), 5)
    paused = s.step_until(0, q.tensor)
    q.forbid()
    r = lend((256, 64), 6)
    out, state = paused.resume((r.tensor, p.copy, p.copy))
    r.forbid()
    results += [(out, r.copy), (state, p.copy)]
    s.close()
    q = lend((512, 512), 7)
    paused = rm.run_until(0, q.tensor)
    q.forbid()
    r = lend((512, 512), 8)
    results.append((paused.resume(r.tensor), r.copy))
    r.forbid()

    # Refused: the node fails the call.
    p = lend((4, 100), 9)
    try:
        linear(p.tensor)
        raise AssertionError("a 100-wide input to a 256-wide layer ran")
    except djinn.ExecutionError:
        pass
    p.forbid()

    # Timed out: the node stops while a large input is being sent.
    os.kill(node_pid, signal.SIGSTOP)
    try:
        p = lend((4096, 4096), 10)
        try:
            rm(p.tensor)
            raise AssertionError("a call to a stopped node returned")
        except djinn.TransportError:
            pass
        p.forbid()
    finally:
        os.kill(node_pid, signal.SIGCONT)

    # Later calls, from other memory, work; so do the results taken before.
    for seed in range(20, 25):
        x = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))
        results.append((rm(x.t()), x.t()))
    for got, want in results:
        assert torch.equal(got, want), "a result differs"
    for pages in forbidden:
        pages.allow()
    print("ok", len(forbidden), "calls' memory made unreadable")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
