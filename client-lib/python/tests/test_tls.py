"""TLS on the data plane from Python: a node started with a certificate is reached with
`tls=` (the roots its certificate chains to), models and tensors cross as over plain TCP, and a
client that does not trust it, or speaks plain TCP, is refused."""
import subprocess

import pytest
import torch

import djinn
from conftest import TENANT_TOKEN, NodeProcess, hf_gpt2


def certificate(directory, name: str):
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", "/CN=djinn-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-addext", "basicConstraints=critical,CA:FALSE", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory, tenant_auth):
    directory = tmp_path_factory.mktemp("tls")
    cert, key = certificate(directory, "node")
    other, _ = certificate(directory, "other")
    node = NodeProcess("--auth-file", tenant_auth, "--tls-cert", cert, "--tls-key", key)
    yield node, cert, other
    node.stop()


def test_a_hugging_face_model_runs_over_tls(tls_node):
    node, cert, _ = tls_node
    client = djinn.Client(node.address, token=TENANT_TOKEN, tls=cert)
    assert client.stats()["transport"] == "tcp"
    torch.manual_seed(0)
    model = hf_gpt2(use_cache=False).eval()
    ids = torch.randint(1, 97, (2, 16))
    rm = client.register(model, {"input_ids": ids}, dynamic={"input_ids": {0: "batch", 1: ("seq", 2, 64)}})
    # Token ids as users hold them: a transposed batch.
    for x in (ids, torch.randint(1, 97, (24, 2)).t()):
        with torch.no_grad():
            want = model(input_ids=x.contiguous()).logits
        assert torch.equal(rm(input_ids=x).logits, want)


def test_clients_that_do_not_trust_the_node_or_speak_plain_tcp_are_refused(tls_node, monkeypatch):
    node, cert, other = tls_node
    monkeypatch.delenv("DJINN_TLS_ROOTS", raising=False)
    with pytest.raises(djinn.DjinnError, match="invalid peer certificate"):
        djinn.Client(node.address, token=TENANT_TOKEN, tls=other, failover=0)
    with pytest.raises(djinn.DjinnError):
        djinn.Client(node.address, token=TENANT_TOKEN, timeout=5, failover=0)
    monkeypatch.setenv("DJINN_TLS_ROOTS", cert)
    assert djinn.Client(node.address, token=TENANT_TOKEN).ping() > 0
