"""A GPT-style decoder: token + position embedding, pre-LN blocks, LM head tied to the embedding.

It exercises what the splitter must handle: a ``ModuleList`` of blocks (not a
``Sequential``), blocks called with keyword arguments, a keyword-only ``forward`` option, and
the LM head's weight being the embedding's (shared across the first and last layer).

Entry points (no arguments, for ``pipeplan profile --model examples.gpt:tiny``):
``tiny`` (4 blocks, hidden 64), ``small`` (8 blocks, hidden 256), ``tiny_with_data`` (``tiny``
plus a data function: a deterministic toy token stream, see :func:`token_stream`).  Dropout is off by default
so runs are exactly repeatable; ``build(GPTConfig(dropout=0.1))`` turns it on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples._seed import seeded


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn: int | None = None  # default 4 * hidden
    dropout: float = 0.0
    tied: bool = True
    batch: int = 8  # batch size of the example inputs
    seed: int = 0


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        out: Tensor = self.drop(self.tok(idx) + self.pos(pos))
        return out


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool)).view(1, 1, cfg.seq, cfg.seq)
        self.mask: Tensor
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: Tensor, *, causal: bool = True) -> Tensor:
        b, t, h = x.shape
        # the fused projection's outputs are grouped by head (q, k and v of head 0, then of head
        # 1, ...), as in Megatron-LM: a tensor-parallel shard of its rows is whole heads, so
        # attention runs on each rank's heads without gathering q, k and v
        qkv = self.qkv(x).view(b, t, self.heads, 3, h // self.heads)
        q, k, v = (qkv.select(3, i).transpose(1, 2) for i in range(3))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
        if causal:
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, h)
        out: Tensor = self.resid_drop(self.proj(y))
        return out


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        ffn = cfg.ffn or 4 * cfg.hidden
        self.fc = nn.Linear(cfg.hidden, ffn)
        self.act = nn.GELU()
        self.out = nn.Linear(ffn, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.drop(self.out(self.act(self.fc(x))))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, *, causal: bool = True) -> Tensor:
        x = x + self.attn(self.ln1(x), causal=causal)
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.proj(self.ln(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.head = Head(cfg)
        if cfg.tied:
            self.head.proj.weight = self.embed.tok.weight

    def forward(self, idx: Tensor, *, causal: bool = True) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, causal=causal)
        out: Tensor = self.head(x)
        return out


def build(cfg: GPTConfig) -> tuple[GPT, tuple[Tensor]]:
    """A seeded model and example token ids of shape ``(cfg.batch, cfg.seq)``."""

    def make() -> tuple[GPT, tuple[Tensor]]:
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
        return model, (idx,)

    return seeded(cfg.seed, make)


def lm_loss(logits: Tensor) -> Tensor:
    """Cross-entropy of every position toward token 0 (a language-model loss that needs no
    targets, so it works at any micro-batch size)."""
    flat = logits.float().flatten(0, 1)
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def tiny() -> tuple[GPT, tuple[Tensor], Callable[[Tensor], Tensor]]:
    """4 blocks, hidden 64, 4 heads, sequence 32, vocabulary 256 (0.2M parameters); LM loss."""
    model, inputs = build(GPTConfig())
    return model, inputs, lm_loss


def small() -> tuple[GPT, tuple[Tensor], Callable[[Tensor], Tensor]]:
    """8 blocks, hidden 256, 8 heads, sequence 128, vocabulary 4096 (7.4M parameters); LM loss."""
    model, inputs = build(GPTConfig(vocab=4096, seq=128, layers=8, hidden=256, heads=8))
    return model, inputs, lm_loss


def token_stream(cfg: GPTConfig) -> Callable[[int, int], Tensor]:
    """A data function over a deterministic toy token stream, for ``pipeplan run``.

    The stream is one endless sequence of tokens ``(7 * p + (p // cfg.seq) ** 2) % cfg.vocab``
    at positions ``p = 0, 1, ...``, cut into rows of ``cfg.seq`` tokens; step ``s`` with batch
    size ``B`` takes rows ``s * B ... s * B + B - 1``.  Any rank can compute any step's batch on
    its own, and the same ``(step, batch_size)`` always gives the same tokens.
    """

    def data_fn(step: int, batch_size: int) -> Tensor:
        rows = torch.arange(step * batch_size, (step + 1) * batch_size, dtype=torch.long)
        pos = rows[:, None] * cfg.seq + torch.arange(cfg.seq, dtype=torch.long)[None, :]
        return (7 * pos + rows[:, None] ** 2) % cfg.vocab

    return data_fn


def tiny_with_data() -> tuple[GPT, tuple[Tensor], Callable[[Tensor], Tensor], Callable[[int, int], Tensor]]:
    """``tiny`` (same weights, same layers) trained on :func:`token_stream` instead of synthetic data.

    The loss is :func:`lm_loss` on the model output; the data function returns model inputs
    only (token ids), no labels.
    """
    cfg = GPTConfig()
    model, _ = build(cfg)
    data = token_stream(cfg)
    return model, (data(0, cfg.batch),), lm_loss, data
