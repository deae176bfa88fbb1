"""Hugging Face causal LMs as users load them (issue 50): each family from a tiny config with
its defaults (`use_cache=True`: the model returns a DynamicCache) registers with
`djinn.register(model, ids)` as a tenant without the TorchScript right, and its call returns
the model's own output class with logits equal to local (float32 tolerance); the cache is left
out, with one warning naming `cache_len=`. Export failures users meet are told in their terms,
naming the fix."""
import warnings

import pytest
import torch
from torch import nn

import djinn
import djinn.models


def families():
    import transformers as T

    small = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    return {
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)),
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=2)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**small, num_key_value_heads=2)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**small, num_key_value_heads=2, head_dim=8)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**small)),
    }


@pytest.mark.parametrize("family", list(families()))
def test_a_causal_lm_with_its_default_config_registers_and_returns_its_logits(tenant, family):
    torch.manual_seed(0)
    model = families()[family]().eval()
    assert model.config.use_cache, "the default config returns a cache"
    ids = torch.randint(1, 97, (2, 16))
    rm = djinn.register(model, ids)
    assert model.config.use_cache, "the user's config is left as it was"
    with torch.no_grad():
        want = model(ids)
    assert want.past_key_values is not None
    got = rm(ids)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, msg=lambda m: f"{family}: {m}")
    assert got.past_key_values is None, "the cache stays out of a plain call"
    # Another batch and length, as export left them dynamic.
    other = torch.randint(1, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(rm(other).logits, model(other).logits, msg=lambda m: f"{family} at 1×9: {m}")


def test_leaving_the_cache_out_warns_once_and_names_cache_len(tenant):
    import transformers as T

    djinn.models._CACHE_LEFT_OUT_WARNED = False
    ids = torch.randint(1, 97, (1, 8))
    make = families()["llama"]
    with pytest.warns(UserWarning, match=r"no past_key_values.*cache_len=N.*rm\.session\(\)"):
        djinn.register(make().eval(), ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        djinn.register(make().eval(), ids)
    # A model whose example asks for the cache itself is told how to keep it.
    with pytest.raises(djinn.ExportError, match=r"returns its KV cache \(a DynamicCache\).*use_cache=False.*cache_len=N") as e:
        djinn.register(make().eval(), {"input_ids": ids, "use_cache": True})
    assert e.value.__cause__ is not None, "export's own error is kept as the cause"
    assert isinstance(T.LlamaConfig().use_cache, bool)


def test_hidden_states_and_attentions_come_back_as_locally(tenant):
    import transformers as T

    torch.manual_seed(1)
    cfg = T.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        output_hidden_states=True, output_attentions=True, attn_implementation="eager")
    model = T.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 97, (2, 12))
    rm = djinn.register(model, ids)
    with torch.no_grad():
        want = model(ids)
    got = rm(ids)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    assert len(got.attentions) == len(want.attentions) == 2
    for name in ("logits", "hidden_states", "attentions"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), msg=lambda m: f"{name}: {m}")


class _Branches(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


@torch.library.custom_op("djinn_tests::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class _CallsACustomOperator(nn.Module):
    def forward(self, x):
        return _mystery(x) + 1


class _FixedWidth(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 4))

    def forward(self, x):
        return x @ self.w


class _ReturnsAnObject(nn.Module):
    def forward(self, x):
        return {"x": x, "why": object()}


@pytest.mark.parametrize(
    "model, example, dynamic, message",
    [
        (_Branches(), torch.randn(3), None,
         r"control flow or a size depends on a tensor's values \(at .*test_hf_as_they_come.py:\d+, in forward: "
         r"if x\.sum\(\) > 0:\).*torch\.where.*split="),
        (_CallsACustomOperator(), torch.randn(3), None,
         r"calls djinn_tests::mystery, a custom operator no node runs.*compute it on the client.*split="),
        (_FixedWidth(), torch.randn(2, 16), {"x": {1: ("width", 2, 64)}},
         r"x's dimension 1, named dynamic \('width'\), cannot vary: the model fixes it to 16.*Leave it out of dynamic="),
        (_ReturnsAnObject(), torch.randn(2), None,
         r"output holds a object, which graphs do not carry.*a wrapper whose forward returns the tensors"),
    ],
    ids=["data-dependent", "custom-operator", "fixed-dimension", "non-tensor-output"],
)
def test_export_failures_name_what_caused_them_and_the_fix(tenant, model, example, dynamic, message):
    with pytest.raises(djinn.ExportError, match=message) as e:
        djinn.register(model, example, dynamic=dynamic)
    assert "torch.export said" in str(e.value) or "cannot vary" in str(e.value)


class _TrainingDropout(nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


class _WithAnOperatorOffTheAllowlist(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.noise = _TrainingDropout()

    def forward(self, x):
        return self.noise(self.proj(x))


def test_an_operator_the_node_refuses_is_told_with_the_module_that_calls_it(tenant):
    with pytest.raises(djinn.GraphRefusedError) as e:
        djinn.register(_WithAnOperatorOffTheAllowlist().eval(), torch.randn(2, 4))
    text = str(e.value)
    assert "aten::native_dropout" in text and "not on the allowlist" in text, text
    assert "comes from noise (_TrainingDropout)" in text and "split=" in text, text
    assert isinstance(e.value.__cause__, djinn.GraphRefusedError)
