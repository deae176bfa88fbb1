"""A Hugging Face causal language model with its static KV cache as buffers: each forward
writes its tokens' keys and values at the cache's position (in place, as `StaticCache` does)
and returns the logits. Exported, the buffers it writes are the state a djinn session keeps on
the node: `djinn.register(model, example, cache_len=N)` registers this."""

from __future__ import annotations

import torch
from torch import nn

from .graphs import ExportError


class StaticCacheLM(nn.Module):
    """`model` (a Hugging Face causal LM) with a `StaticCache` of `cache_len` positions for
    `batch` sequences, held as buffers: `forward(input_ids)` runs the tokens at the cache's
    position, writes their keys and values there and advances it, and returns the logits."""

    def __init__(self, model: nn.Module, batch: int, cache_len: int):
        super().__init__()
        try:
            from transformers import StaticCache
        except ImportError as e:  # pragma: no cover - the package is installed with djinn's tests
            raise ExportError("cache_len= needs the transformers package") from e
        self.model = model
        self.train(model.training)
        cfg = model.config
        self.cache = StaticCache(config=cfg, max_cache_len=cache_len)
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.cache.early_initialization(batch, heads, head_dim, dtype, torch.device("cpu"))
        self.layers = len(self.cache.layers)
        for i, layer in enumerate(self.cache.layers):
            missing = [a for a in ("keys", "values", "cumulative_length") if not isinstance(getattr(layer, a, None), torch.Tensor)]
            if missing:
                raise ExportError(f"this transformers' StaticCache layers have no {', '.join(missing)} tensors")
            self.register_buffer(f"keys_{i}", layer.keys, persistent=False)
            self.register_buffer(f"values_{i}", layer.values, persistent=False)
            self.register_buffer(f"length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The cache reads and writes the buffers as this module holds them (export traces
        # module buffers, not the tensors the cache object was made with).
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"keys_{i}")
            layer.values = getattr(self, f"values_{i}")
            layer.cumulative_length = getattr(self, f"length_{i}")
        return self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True).logits
