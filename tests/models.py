"""Small models written in the ways users write linear layers; shared by the test tiers."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``down(gelu(up(x)))`` with nn.Linear: the canonical colwise -> rowwise pair."""

    def __init__(self, hidden: int = 32, ffn: int = 96, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MLPStack(nn.Module):
    def __init__(self, hidden: int = 32, ffn: int = 96, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP(hidden, ffn) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class ResidualBlock(nn.Module):
    """Pre-norm residual SwiGLU block: ``x + down(silu(gate(ln(x))) * up(ln(x)))``."""

    def __init__(self, hidden: int = 32, ffn: int = 80) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FunctionalLinear(nn.Module):
    """``F.linear`` on bare parameters."""

    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(ffn, hidden) / hidden**0.5)
        self.b1 = nn.Parameter(torch.randn(ffn) / 10)
        self.w2 = nn.Parameter(torch.randn(hidden, ffn) / ffn**0.5)

    def forward(self, x):
        return F.linear(torch.relu(F.linear(x, self.w1, self.b1)), self.w2)


class MatmulTranspose(nn.Module):
    """``x @ W.t() + b`` then ``torch.matmul(h, W.T)`` (no bias)."""

    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(ffn, hidden) / hidden**0.5)
        self.b1 = nn.Parameter(torch.randn(ffn) / 10)
        self.w2 = nn.Parameter(torch.randn(hidden, ffn) / ffn**0.5)

    def forward(self, x):
        h = torch.tanh(x @ self.w1.t() + self.b1)
        return torch.matmul(h, self.w2.T)


class Conv1D(nn.Module):
    """HF GPT-2's Conv1D: weight stored [in, out], ``torch.addmm(b, x2d, W)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) / nx**0.5)
        self.bias = nn.Parameter(torch.randn(nf) / 10)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.c_fc = Conv1D(ffn, hidden)
        self.c_proj = Conv1D(hidden, ffn)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Head(nn.Module):
    """A lone linear (no rowwise partner) whose output feeds a reduction: colwise + gather."""

    def __init__(self, hidden: int = 32, out: int = 90) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, out)

    def forward(self, x):
        return self.proj(x).softmax(-1)


class InPlace(nn.Module):
    """In-place ops on a sharded value (``relu_``, ``mul_``) and on a replicated one (``+=``)."""

    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        h = self.up(x)
        h.relu_()
        h.mul_(0.5)
        y = x.clone()
        y += self.down(h)
        return y


class CalledTwice(MLP):
    """The same linears applied to two inputs: each weight feeds two matmuls."""

    def forward(self, x):
        return super().forward(x) + super().forward(x * 2)


class MixedDtypes(nn.Module):
    """A float32 pair feeding a bfloat16 pair."""

    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.first = MLP(hidden, ffn)
        self.second = MLP(hidden, ffn).to(torch.bfloat16)

    def forward(self, x):
        return self.second(self.first(x).to(torch.bfloat16)).float()


class TinyLM(nn.Module):
    """Embedding -> residual MLP -> LM head tied to the embedding (ids in, logits out)."""

    def __init__(self, hidden: int = 32, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = MLP(hidden, 3 * hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(h)
        return self.head(self.norm(h))

    def embed_only(self) -> nn.Module:
        return _Embed(self.embed)


class _Embed(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids):
        return self.embed(ids)


class AttentionBlock(nn.Module):
    """Pre-norm self-attention with a hard-coded head count: views into heads, SDPA, back."""

    def __init__(self, hidden: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, c))


def build(name: str, hidden: int, ffn: int) -> nn.Module:
    return {
        "mlp": lambda: MLP(hidden, ffn),
        "mlp_nobias": lambda: MLP(hidden, ffn, bias=False),
        "mlp_stack": lambda: MLPStack(hidden, ffn),
        "residual": lambda: ResidualBlock(hidden, ffn),
        "functional": lambda: FunctionalLinear(hidden, ffn),
        "matmul": lambda: MatmulTranspose(hidden, ffn),
        "conv1d": lambda: GPT2MLP(hidden, ffn),
        "head": lambda: Head(hidden, ffn),
        "inplace": lambda: InPlace(hidden, ffn),
        "seed": lambda: nn.Linear(hidden, ffn),
        "tiny_lm": lambda: TinyLM(hidden, ffn),
        "attention": lambda: AttentionBlock(hidden, ffn),  # ffn = number of heads
    }[name]()
