"""Models users have, registered as graphs (torch.export, checked and run by the node through
libtorch's dispatcher) by a tenant without the TorchScript right: Hugging Face GPT-2, Llama and
BERT from tiny configs with random weights, torchvision's ResNet-18, and a small MLP. Outputs
equal the local ones: bit for bit where the node runs the same kernels on the same memory
layout, else within torch.testing's float32 tolerance (rtol 1.3e-6, atol 1e-5); sizes that
export left dynamic change between calls without registering again. The Hugging Face models and
ResNet-18 run both in the node and in an executor process of the tenant's own
(`--executor-processes`), with inputs in users' layouts (transposed, strided, channels_last)."""
import gc

import pytest
import torch
from torch import nn

import djinn
from conftest import TENANT_TOKEN, NodeProcess, hf_gpt2, hf_llama, scripted


def same(got, want, what):
    torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")


def tiny_gpt2():
    return hf_gpt2(use_cache=False)


def tiny_llama():
    return hf_llama(use_cache=False)


def tiny_bert():
    import transformers

    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    return transformers.BertModel(cfg)


@pytest.fixture(scope="module", params=[(), ("--executor-processes",)], ids=["in-the-node", "executor-processes"])
def either_tenant(request, tenant_auth):
    """The tenant's client on a node that runs its models in the node, and on one that runs them
    in an executor process of the tenant's own (not made the default client)."""
    node = NodeProcess("--auth-file", tenant_auth, *request.param)
    try:
        yield djinn.Client(node.address, token=TENANT_TOKEN)
    finally:
        node.stop()


@pytest.mark.parametrize("make", [tiny_gpt2, tiny_llama, tiny_bert], ids=["gpt2", "llama", "bert"])
def test_hugging_face_models_register_as_graphs_and_take_other_sizes(either_tenant, make):
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, 97, (2, 16))
    rm = either_tenant.register(model, {"input_ids": ids}, dynamic={"input_ids": {0: "batch", 1: ("seq", 2, 64)}})
    for batch, seq in [(2, 16), (1, 7), (3, 64)]:
        x = torch.randint(1, 97, (batch, seq))
        with torch.no_grad():
            want = model(input_ids=x)
        got = rm(input_ids=x)
        # The output comes back as the model's own dataclass.
        assert type(got) is type(want)
        key = "logits" if "logits" in want else "last_hidden_state"
        same(got[key], want[key], f"{make.__name__} at {batch}×{seq}")
    # Token ids as users hold them: a transposed batch, every other column of a wider one.
    wide = torch.randint(1, 97, (24, 2))
    for x in (wide.t(), torch.randint(1, 97, (2, 40))[:, ::2]):
        with torch.no_grad():
            want = model(input_ids=x.contiguous())
        key = "logits" if "logits" in want else "last_hidden_state"
        same(rm(input_ids=x)[key], want[key], f"{make.__name__} on a {'transposed' if x.stride(0) == 1 else 'strided'} input")
    # Sizes outside what export allowed are refused by the node, naming the input.
    with pytest.raises(djinn.ExecutionError, match="input_ids"):
        rm(input_ids=torch.randint(1, 97, (2, 65)))


def test_torchvision_resnet18_registers_as_a_graph(either_tenant):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    rm = either_tenant.register(model, torch.randn(2, 3, 64, 64), dynamic={"x": {0: "batch"}})
    for batch in (2, 5):
        x = torch.randn(batch, 3, 64, 64)
        with torch.no_grad():
            same(rm(x), model(x), f"batch {batch}")
    # Users' layouts: channels_last, a transposed crop.
    images = torch.randn(2, 3, 80, 80)
    for x in (images.contiguous(memory_format=torch.channels_last)[:, :, :64, :64], images.transpose(2, 3)[:, :, 8:72, 8:72]):
        with torch.no_grad():
            same(rm(x), model(x.contiguous()), "a user's layout")


def test_a_small_mlp_is_bit_for_bit_and_its_batch_is_dynamic(tenant):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    rm = djinn.register(model, torch.randn(4, 16), dynamic={"input": {0: "batch"}})
    for batch in (1, 4, 8, 64):
        x = torch.randn(batch, 16)
        with torch.no_grad():
            assert torch.equal(rm(x), model(x)), f"batch {batch}"
    # A kept output feeds the next call without crossing the network.
    kept = rm(torch.randn(4, 16), keep=True)
    assert kept.shape == (4, 4)


def test_kept_outputs_of_users_models_feed_the_next_model_on_the_node(tenant):
    """BERT's hidden states and ResNet-18's pooled features, kept on the node (keep=True), are
    the inputs of heads registered apart: the results equal the local pipelines', the kept
    bytes never come back to the client, and released handles are freed on the node."""
    import torchvision

    torch.manual_seed(2)
    bert = tiny_bert().eval()
    backbone = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    backbone.fc = nn.Identity()
    text_head = nn.Sequential(nn.Linear(32, 5), nn.Tanh()).eval()
    image_head = nn.Linear(512, 3).eval()
    ids = torch.randint(1, 97, (2, 16))
    images = torch.randn(2, 3, 64, 64)
    rm_bert = djinn.register(bert, {"input_ids": ids})
    rm_backbone = djinn.register(backbone, images)
    rm_text_head = djinn.register(text_head, torch.randn(2, 16, 32))
    rm_image_head = djinn.register(image_head, torch.randn(2, 512))
    gc.collect()  # tensors earlier tests dropped are released with the next call, before counting
    handles = tenant.node_stats()["handles"]

    # BERT keeps both its outputs (the hidden states and the pooled one).
    bert_out = rm_bert(input_ids=ids, keep=True)
    hidden, features = bert_out.last_hidden_state, rm_backbone(images, keep=True)
    assert isinstance(hidden, djinn.RemoteTensor) and isinstance(features, djinn.RemoteTensor)
    assert (hidden.shape, features.shape) == ((2, 16, 32), (2, 512))
    assert tenant.node_stats()["handles"] == handles + 3
    received = tenant.stats()["bytes_received"]
    text, image = rm_text_head(hidden), rm_image_head(features)
    assert tenant.stats()["bytes_received"] - received < hidden.nbytes, "the kept bytes came back to the client"
    with torch.no_grad():
        same(text, text_head(bert(input_ids=ids).last_hidden_state), "BERT's kept hidden states through a head")
        same(image, image_head(backbone(images)), "ResNet-18's kept features through a head")
        same(features.cpu(), backbone(images), "ResNet-18's kept features, fetched")

    hidden.release()
    features.release()
    assert tenant.node_stats()["handles"] == handles + 1
    del bert_out  # the pooled output, dropped: released with the next call
    assert tenant.node_stats()["handles"] == handles


def test_a_tenant_without_the_right_cannot_register_torchscript_and_is_told_how_to_move(tenant):
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(djinn.AuthenticationError, match="djinn.register"):
        djinn.register(model, torch.randn(2, 4), blocks=scripted([model], torch.randn(2, 4)))


def test_random_operators_draw_from_each_requests_own_generator(tenant):
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.rand_like(x), torch.randn(x.shape[0], 3) * 0

    rm = djinn.register(Noisy(), torch.zeros(1000), dynamic={"x": {0: "n"}})
    first, zeros = rm(torch.zeros(1000))
    second, _ = rm(torch.zeros(1000))
    assert torch.equal(zeros, torch.zeros(1000, 3))
    assert ((first >= 0) & (first < 1)).all() and first.std() > 0.2, "uniform draws"
    assert not torch.equal(first, second), "each request draws afresh"


def test_what_the_node_will_not_run_is_refused_with_the_operator_and_why(tenant):
    class TrainingDropout(nn.Module):
        def forward(self, x):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    with pytest.raises(djinn.GraphRefusedError, match="aten::native_dropout.*not on the allowlist"):
        djinn.register(TrainingDropout(), torch.randn(3))
    # Still serving.
    linear = nn.Linear(3, 2).eval()
    assert djinn.register(linear, torch.randn(1, 3))(torch.ones(1, 3)).shape == (1, 2)


def test_indices_out_of_range_are_refused_before_their_operator_runs(tenant):
    """Index operands (embedding's, gather's, indexing's), given or computed on the node, are
    checked against what they index before the operator runs (on CUDA a bad one would be a
    device-side assert that breaks the node's CUDA context for every tenant): the request gets
    an ExecutionError naming the operator and the index, and the node serves on."""

    class Indexing(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids, rows, idx):
            return self.emb(ids + 7), torch.gather(rows, 1, idx), rows[idx[:, 0]]

    torch.manual_seed(0)
    model = Indexing().eval()
    ids, rows, idx = torch.tensor([0, 2, 1]), torch.randn(3, 4), torch.tensor([[0, 3], [2, 1], [-1, 0]]).abs()
    rm = djinn.register(model, (ids, rows, idx))
    # Columns of a wider tensor, as users slice them: strided indices.
    wide = torch.tensor([[1, 9, 0, 9], [2, 9, 3, 9], [0, 9, 1, 9]])[:, ::2]
    for args in [(ids, rows, idx), (torch.tensor([2, 0, 1]), rows.t().contiguous().t(), wide)]:
        with torch.no_grad():
            want = model(*args)
        for got, w in zip(rm(*args), want):
            assert torch.equal(got, w)
    bad = [
        ((torch.tensor([0, 5, 1]), rows, idx), "aten::embedding: index 12 is out of range for dimension 0, of size 10"),
        ((ids, rows, torch.tensor([[0, 4], [0, 0], [0, 0]])), "aten::gather: index 4 is out of range for dimension 1, of size 4"),
        ((ids, rows, torch.tensor([[0, 0], [-1, 0], [0, 0]])), "aten::gather: index -1 is out of range for dimension 1"),
        ((ids, rows, torch.tensor([[0, 0], [3, 0], [0, 0]])), "aten::index.Tensor: index 3 is out of range for dimension 0, of size 3"),
    ]
    for args, message in bad:
        with pytest.raises(djinn.ExecutionError, match=message.replace(".", r"\.")):
            rm(*args)
    with torch.no_grad():
        want = model(ids, rows, idx)
    assert all(torch.equal(g, w) for g, w in zip(rm(ids, rows, idx), want)), "served on"
