"""A small GPT (decoder-only transformer, GPT-2 layout), as in the paper's nanoGPT runs.

The paper pretrains GPT-2 125M (``PRESETS["gpt2-124m"]``: 12 layers, 12 heads, 768 wide,
context 1024, GPT-2's vocabulary padded to 50304).  The smaller presets have the same
layout and serve tests and CPU benchmarks.

Layout: token and position embeddings, pre-LayerNorm blocks (causal self-attention
through ``F.scaled_dot_product_attention``, then a 4x GELU MLP), a final LayerNorm, and
an output head tied to the token embedding.  Initialisation as GPT-2: normal(0, 0.02),
the residual projections scaled by 1/sqrt(2 * n_layer).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"GPTConfig.{k} must be >= 1, got {getattr(self, k)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def as_dict(self):
        return asdict(self)


PRESETS = {
    # the paper's model (GPT-2 small, 124M parameters with the tied head)
    "gpt2-124m": GPTConfig(),
    # 6 layers, 384 wide: about 30M parameters with GPT-2's vocabulary
    "gpt-small": GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    # CPU benchmarks: about 0.9M parameters, byte-level vocabulary
    "gpt-tiny": GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=128),
    # tests
    "gpt-test": GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out.residual = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight            # tied
        self.apply(self._init)

    def _init(self, m):
        if isinstance(m, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual", False) \
                else 0.02
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        """Logits (B, T, vocab); with ``targets``, (logits, mean cross-entropy)."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} > block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss
