"""GPT-2 and Llama decoders in plain PyTorch (no transformers), for timing against Tessel on the
same shapes: pre-norm blocks, SDPA causal attention (grouped-query for Llama), GELU MLP (GPT-2) or
SwiGLU (Llama), tied (GPT-2) or separate (Llama) output head, no dropout. Built from a Tessel
model section (the resolved config.yaml's keys)."""
import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope(x, cos, sin):  # x [b, h, s, d]: rotate halves (the Llama convention)
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        llama = m["arch"] == "llama"
        h, heads, kv = int(m["hidden"]), int(m["heads"]), int(m.get("kv_heads") or m["heads"])
        ffn = int(m.get("ffn_hidden") or 4 * h)
        eps = float(m.get("norm_eps") or 1e-5)
        self.llama, self.heads, self.kv, self.d = llama, heads, kv, h // heads
        norm = (lambda: RMSNorm(h, eps)) if llama else (lambda: nn.LayerNorm(h, eps=eps))
        self.n1, self.n2 = norm(), norm()
        self.qkv = nn.Linear(h, (heads + 2 * kv) * self.d, bias=not llama)
        self.o = nn.Linear(h, h, bias=not llama)
        self.up = nn.Linear(h, ffn, bias=not llama)
        self.gate = nn.Linear(h, ffn, bias=False) if llama else None
        self.down = nn.Linear(ffn, h, bias=not llama)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], -1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        if self.llama:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        hn = self.n2(x)
        mlp = F.silu(self.gate(hn)) * self.up(hn) if self.llama else F.gelu(self.up(hn), approximate="tanh")
        return x + self.down(mlp)


class Decoder(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        h, vocab, seq = int(m["hidden"]), int(m["vocab_size"]), int(m["max_seq_len"])
        llama = m["arch"] == "llama"
        self.embed = nn.Embedding(vocab, h)
        self.pos = None if llama else nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(m) for _ in range(int(m["layers"])))
        eps = float(m.get("norm_eps") or 1e-5)
        self.norm = RMSNorm(h, eps) if llama else nn.LayerNorm(h, eps=eps)
        self.head = nn.Linear(h, vocab, bias=False)
        tie = str(m.get("tie_embeddings", "auto")).lower()
        if tie == "true" or (tie == "auto" and not llama):
            self.head.weight = self.embed.weight
        d = h // int(m["heads"])
        theta = float(m.get("rope_theta") or 10000.0)
        inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        ang = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", torch.cat((ang.cos(), ang.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((ang.sin(), ang.sin()), -1), persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(1 if p.size(0) != h else 2 * int(m["layers"])))

    def forward(self, tokens, targets):
        s = tokens.size(1)
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(s, device=tokens.device))
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
