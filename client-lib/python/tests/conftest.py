"""A real `djinn node` process for the tests, and the real built extension."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "client-lib" / "python" / "examples"))

# The node runs libtorch with one thread per operation; so does the reference here, so that
# "equal" can mean bit for bit.
torch.set_num_threads(1)


def node_binary() -> str:
    if os.environ.get("DJINN_BIN"):
        return os.environ["DJINN_BIN"]
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / "djinn"
        if path.exists():
            return str(path)
    raise RuntimeError("no djinn binary: run cargo build (scripts/test.sh does)")


class DjinnProcess:
    """`djinn COMMAND --listen LISTEN ARGS`; `address` is what its first line announced."""

    def __init__(self, command: str, *args: str, listen: str = "127.0.0.1:0"):
        self.proc = subprocess.Popen(
            [node_binary(), command, "--listen", listen, "--log", "error", *args],
            stdout=subprocess.PIPE,
        )
        line = self.proc.stdout.readline().decode()
        if not line.startswith(f"djinn {command} listening on "):
            self.stop()
            raise RuntimeError(f"djinn {command} printed {line!r}")
        self.address = line.split()[-1]

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


class NodeProcess(DjinnProcess):
    def __init__(self, *args: str, listen: str = "127.0.0.1:0"):
        super().__init__("node", *args, listen=listen)


def tokens_file(directory, principals: dict) -> str:
    """A node's token file: `principals` maps a name to its token (a principal without rights)
    or to its whole entry."""
    import json

    entries = [{"name": n, "tokens": [v]} if isinstance(v, str) else {"name": n, **v} for n, v in principals.items()]
    path = directory / "tokens.json"
    path.write_text(json.dumps({"principals": entries}))
    return str(path)


@pytest.fixture(scope="session")
def node():
    n = NodeProcess()
    yield n
    n.stop()


@pytest.fixture
def client(node):
    import djinn

    return djinn.init(node.address)
