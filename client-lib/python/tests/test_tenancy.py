"""Tokens and tenants from Python: a node with a token file lets in only its tokens, and one
tenant's models and kept tensors are unknown to another."""
import json

import pytest
import torch
from torch import nn

import djinn
from conftest import NodeProcess, scripted

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"
CAROL = "carol-token-0123456789"
MALLORY = "mallory-token-012345678"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    tokens = tmp_path_factory.mktemp("auth") / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "principals": [
                    {"name": "alice", "tokens": [ALICE], "rights": ["torchscript"]},
                    {"name": "bob", "tokens": [BOB], "rights": ["torchscript"]},
                    {"name": "carol", "tokens": [CAROL], "rights": ["torchscript"], "quota": {"device_memory": 4096}},
                    {"name": "mallory", "tokens": [MALLORY]},
                ]
            }
        )
    )
    n = NodeProcess("--auth-file", str(tokens))
    yield n
    n.stop()


def test_a_client_needs_a_known_token(secured, monkeypatch):
    monkeypatch.delenv("DJINN_TOKEN", raising=False)
    with pytest.raises(djinn.AuthenticationError, match="token"):
        djinn.Client(secured.address)
    with pytest.raises(djinn.AuthenticationError):
        djinn.Client(secured.address, token="alice-token-0123456788")
    monkeypatch.setenv("DJINN_TOKEN", ALICE)
    assert djinn.Client(secured.address).ping() > 0


def test_a_tenant_cannot_use_another_tenants_model_or_tensors(secured):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    x = torch.randn(2, 8)
    alice = djinn.Client(secured.address, token=ALICE)
    bob = djinn.Client(secured.address, token=BOB)
    remote = alice.register(model, x)
    assert torch.equal(remote(x), model(x))
    with pytest.raises(djinn.UnknownModelError):
        bob._native.execute(remote.fingerprint, [djinn._native.TensorSlot(0)], [x])
    assert bob.models() == []

    # Public weights: bob registers the same bytes and nothing is uploaded.
    shared = alice.register(model, x, public=True)
    again = bob.register(model, x, public=True)
    assert shared.uploaded and not again.uploaded
    assert torch.equal(again(x), model(x))


def test_a_tenant_over_its_quota_gets_a_typed_error(secured):
    carol = djinn.Client(secured.address, token=CAROL)
    small = nn.Linear(4, 4).eval()
    x = torch.randn(1, 4)
    remote = carol.register(small, x)
    assert torch.equal(remote(x), small(x))
    with pytest.raises(djinn.QuotaExceededError, match="quota"):
        carol.register(nn.Linear(64, 64).eval(), torch.randn(1, 64))
    # A remote error like any other: the client goes on.
    assert issubclass(djinn.QuotaExceededError, djinn.RemoteError)
    assert torch.equal(remote(x), small(x))
    # Another tenant's registration of the same size is not held to carol's quota.
    bob = djinn.Client(secured.address, token=BOB)
    bob.register(nn.Linear(64, 64).eval(), torch.randn(1, 64))


def test_a_tenant_without_the_right_is_refused_torchscript(secured):
    mallory = djinn.Client(secured.address, token=MALLORY)
    linear = nn.Linear(4, 4).eval()
    with pytest.raises(djinn.AuthenticationError, match='the right "torchscript"'):
        mallory.register(linear, torch.randn(1, 4), blocks=scripted([linear], torch.randn(1, 4)))
    # The same model as a graph is data: mallory may register it.
    assert torch.equal(mallory.register(linear, torch.randn(1, 4))(torch.ones(2, 4)), linear(torch.ones(2, 4)).detach())
    alice = djinn.Client(secured.address, token=ALICE)
    rm = alice.register(nn.Linear(4, 4).eval(), torch.randn(1, 4))
    assert rm(torch.ones(1, 4)).shape == (1, 4)
    assert mallory.keep(torch.ones(3)).cpu().tolist() == [1.0, 1.0, 1.0], "mallory is served otherwise"
