"""A GPT-2-style transformer built in code (random weights, nothing downloaded): token and
position embedding, pre-norm layers of causal self-attention and an MLP, final layer norm and
LM head tied to the token embedding. `GPT(GPTConfig.small())` has GPT-2 small's shape (124M
parameters); `GPTConfig.tiny()` is for tests.

`model.blocks()` is the split Djinn registers: the embedding, each layer, the head.
"""
from dataclasses import dataclass

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

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())
