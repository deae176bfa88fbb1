"""A GPT-2-style transformer built in code (random weights, nothing downloaded): token and
position embedding, pre-norm layers of causal self-attention and an MLP, final layer norm and
LM head tied to the token embedding. `GPT(GPTConfig.small())` has GPT-2 small's shape (124M
parameters); `GPTConfig.tiny()` is for tests.

`model.blocks()` is the split Djinn registers: the embedding, each layer, the head.
`CachedGPT(model)` is the same model one step at a time with a KV cache, the shape a Djinn
session runs: `forward(tokens, cache, position) -> (logits, cache, position)`.
"""
from dataclasses import dataclass
from typing import Callable, Tuple

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    vocab: int
    context: int
    width: int
    heads: int
    layers: int

    @staticmethod
    def small() -> "GPTConfig":
        return GPTConfig(vocab=50257, context=1024, width=768, heads=12, layers=12)

    @staticmethod
    def tiny() -> "GPTConfig":
        return GPTConfig(vocab=97, context=32, width=64, heads=4, layers=2)


class Embedding(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.token = nn.Embedding(c.vocab, c.width)
        self.position = nn.Embedding(c.context, c.width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.token(idx) + self.position(positions)


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, w))

    def cached(
        self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Attention of the tokens `x` (at `positions`) over the cache, once their keys and
        values are written into it, in place. `keys`, `values`: [batch, heads, context,
        width / heads]."""
        b, t, w = x.shape
        q, k, v = self.qkv(x).split(w, dim=2)
        q = q.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, w // self.heads).transpose(1, 2)
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        visible = torch.arange(keys.size(2), device=x.device).unsqueeze(0) <= positions.unsqueeze(1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        return self.proj(y.transpose(1, 2).reshape(b, t, w))


class Layer(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.attention = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def cached(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention.cached(self.ln1(x), keys, values, positions)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, c: GPTConfig, embedding: nn.Embedding):
        super().__init__()
        self.ln = nn.LayerNorm(c.width)
        self.lm_head = nn.Linear(c.width, c.vocab, bias=False)
        self.lm_head.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.embedding = Embedding(c)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.head = Head(c, self.embedding.token)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def blocks(self) -> list:
        return [self.embedding, *self.layers, self.head]

    @torch.no_grad()
    def spread_weights(self, std: float) -> "GPT":
        """Draws every weight matrix from N(0, std²). With the default initialisation an
        untrained model's greedy decoding repeats one token; spread, it varies, so that a wrong
        KV cache shows in the tokens."""
        for p in self.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
        return self

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


class CachedGPT(nn.Module):
    """`gpt` (its weights, not a copy) one step at a time with a KV cache.

    `forward(tokens, cache, position) -> (logits, cache, position)`: `tokens` [batch, t] go at
    positions `position` to `position + t - 1` (`position`: int64 [1]); `cache`: keys and
    values, [layers, 2, batch, heads, context, width / heads]; `logits`: the last token's,
    [batch, vocab]. A prompt is one step, each generated token another.

    The new tokens' keys and values are written into `cache` in place (a step reads the cache
    but does not copy it), at positions no earlier step made visible: a step that fails
    midway leaves the state as good as it was, since its position has not moved."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.config = gpt.config
        self.embedding = gpt.embedding
        self.layers = gpt.layers
        self.head = gpt.head

    def forward(
        self, tokens: torch.Tensor, cache: torch.Tensor, position: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = position + torch.arange(tokens.size(1), device=tokens.device)
        x = self.embedding.token(tokens) + self.embedding.position(positions)
        for i, layer in enumerate(self.layers):
            x = layer.cached(x, cache[i, 0], cache[i, 1], positions)
        return self.head(x[:, -1]), cache, position + tokens.size(1)

    def blocks(self) -> list:
        """The same computation as blocks (embedding, each layer, head), each taking and
        returning `(x, cache, position)`, so that a session step can stop between them."""
        return [
            CachedEmbedding(self.embedding),
            *(CachedLayer(layer, i) for i, layer in enumerate(self.layers)),
            CachedHead(self.head),
        ]

    def empty_state(self, batch: int = 1, length: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """An empty cache for `length` tokens (by default the model's context) and position 0."""
        c = self.config
        cache = torch.zeros(c.layers, 2, batch, c.heads, length or c.context, c.width // c.heads)
        return cache, torch.zeros(1, dtype=torch.int64)


def _positions(x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return position + torch.arange(x.size(1), device=x.device)


class CachedEmbedding(nn.Module):
    def __init__(self, embedding: Embedding):
        super().__init__()
        self.embedding = embedding

    def forward(
        self, tokens: torch.Tensor, cache: torch.Tensor, position: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embedding.token(tokens) + self.embedding.position(_positions(tokens, position))
        return x, cache, position


class CachedLayer(nn.Module):
    def __init__(self, layer: Layer, index: int):
        super().__init__()
        self.layer = layer
        self.index = index

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor, position: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv = cache[self.index]
        return self.layer.cached(x, kv[0], kv[1], _positions(x, position)), cache, position


class CachedHead(nn.Module):
    def __init__(self, head: Head):
        super().__init__()
        self.head = head

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor, position: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.head(x[:, -1]), cache, position + x.size(1)


def greedy(step: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding through `step(tokens) -> logits of the last token`, which keeps its own
    KV cache (a remote session's `step`, or `CachedGPT` with its state threaded by the caller):
    the prompt is one step, each new token another. Returns the new tokens, [batch, new_tokens]."""
    logits = step(prompt)
    tokens = []
    for i in range(new_tokens):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        if i + 1 < new_tokens:
            logits = step(token)
    return torch.cat(tokens, 1)


@torch.no_grad()
def generate(gpt: GPT, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding the plain way, with no cache: the whole sequence through `gpt` for each
    new token. Returns the new tokens."""
    idx = prompt
    for _ in range(new_tokens):
        idx = torch.cat([idx, gpt(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    return idx[:, prompt.shape[1] :]
