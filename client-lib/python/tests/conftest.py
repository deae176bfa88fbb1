"""A real `djinn node` process for the tests, and the real built extension."""
import os
import subprocess
import warnings
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


TENANT_TOKEN = "tenant-without-torchscript-0123"


@pytest.fixture(scope="module")
def tenant_auth(tmp_path_factory) -> str:
    """A token file with one tenant, which has no right to TorchScript."""
    return tokens_file(tmp_path_factory.mktemp("auth"), {"tenant": TENANT_TOKEN})


@pytest.fixture(scope="module")
def tenant(tenant_auth):
    """A node with that token file, and the tenant's client, made the default one (for
    `djinn.register` and capture)."""
    import djinn

    node = NodeProcess("--auth-file", tenant_auth)
    try:
        yield djinn.init(node.address, token=TENANT_TOKEN)
    finally:
        node.stop()


def hf_llama(layers: int = 2, hidden: int = 32, use_cache: bool = True):
    """A Hugging Face Llama from a tiny config (vocabulary 97, 4 heads over 2 KV heads), random
    weights."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                   use_cache=use_cache)
    return transformers.LlamaForCausalLM(cfg)


def hf_gpt2(layers: int = 2, use_cache: bool = True):
    """A Hugging Face GPT-2 from a tiny config (vocabulary 97, width 32, 4 heads), random
    weights."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=layers, n_head=4,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=use_cache)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="session")
def node():
    n = NodeProcess()
    yield n
    n.stop()


@pytest.fixture
def client(node):
    import djinn

    return djinn.init(node.address)


def scripted(blocks, example) -> list:
    """TorchScript of `blocks` as a user with the right "torchscript" makes it (the client
    never does): each block scripted, or traced on the inputs the blocks before hand it where
    TorchScript cannot compile it."""
    out, args = [], example if isinstance(example, tuple) else (example,)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", DeprecationWarning)
        for block in blocks:
            try:
                script = torch.jit.script(block)
            except Exception:  # noqa: BLE001 - not scriptable: traced on its inputs
                script = torch.jit.trace(block, args, strict=False, check_trace=False)
            out.append(script)
            result = script(*args)
            args = result if isinstance(result, tuple) else (result,)
    return out


def hostile_binary() -> str:
    path = ROOT / "target" / "debug" / "examples" / "hostile_node"
    if not path.exists():
        pytest.skip("no hostile_node example: run cargo build -p djinn --example hostile_node")
    return str(path)


class HostileNode:
    """A compromised node as a process (`tools/examples/hostile_node.rs`): it relays to the node
    at `upstream` but for what `flags` attack."""

    def __init__(self, upstream: str, *flags: str):
        self.proc = subprocess.Popen([hostile_binary(), upstream, *flags], stdout=subprocess.PIPE)
        line = self.proc.stdout.readline().decode()
        if not line.startswith("hostile node listening on "):
            self.stop()
            raise RuntimeError(f"hostile_node printed {line!r}")
        self.address = line.split()[-1]

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)
