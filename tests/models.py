"""Small models written in the ways users write linear layers; shared by the test tiers."""

from __future__ import annotations

import math

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


class CastsToWeights(nn.Module):
    """An MLP that casts its input to its weights' dtype (whatever the model was converted to)."""

    def __init__(self, hidden: int = 32, ffn: int = 96) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x.to(self.up.weight.dtype)))).float()


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


# --- Transformers as people write them (no head-count edits anywhere) ---------------------------


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: one fused ``c_attn`` split into q, k, v; ``n_head`` hard-coded."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, flash: bool = True) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.flash = n_head, n_embd, flash
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask, persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # softmax-matmul attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoGPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, flash: bool = True) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoGPTAttention(n_embd, n_head, block_size, flash)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """nanoGPT's GPT: token + position embeddings, blocks, final LayerNorm, LM head tied to ``wte``."""

    def __init__(self, vocab: int = 96, n_embd: int = 64, n_head: int = 4, n_layer: int = 2,
                 block_size: int = 32, flash: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(NanoGPTBlock(n_embd, n_head, block_size, flash) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x, n_rep: int):
    """HF's repeat_kv: [B, Hkv, T, D] -> [B, Hkv * n_rep, T, D] by expand + reshape."""
    b, h, t, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def flex_alibi(q, k, v, slopes, windows=None, gqa=False):
    """``flex_attention`` with an ALiBi bias read at the head index ``h`` (a per-head slope from a
    captured buffer, and ``h`` itself), under a causal block mask built for every head (H 1) or,
    with ``windows``, a sliding window per head (a block mask of one row per head; head ``h``
    reaches ``windows[h]`` keys back). A rank that saw its local ``h`` would read another head's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    t, heads = q.shape[-2], q.shape[-3]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) + 0.25 * h

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= windows[h])

    block = (create_block_mask(causal, None, None, t, t, device=q.device) if windows is None
             else create_block_mask(window, None, heads, t, t, device=q.device))
    return flex_attention(q, k, v, score_mod=alibi, block_mask=block, enable_gqa=gqa)


class LlamaAttention(nn.Module):
    """Separate q/k/v projections, GQA (``n_kv_heads`` <= ``n_heads``), RoPE, causal attention.

    ``rope``: "half" (HF: rotate_half with slices, cat, neg, mul on [B, H, T, D]) or "complex"
    (Meta: view_as_complex multiply on [B, T, H, D]). ``repeat``: "expand" (HF repeat_kv),
    "interleave" (``repeat_interleave``) or "sdpa" (no repeat: ``enable_gqa=True``, what HF's sdpa
    attention does without a mask). ``attention``: "sdpa", "manual" (softmax-matmul), "flex" or
    "flex_window" (``flex_alibi``, with ``enable_gqa`` where ``repeat`` is "sdpa").
    """

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, rope: str = "half",
                 repeat: str = "expand", attention: str = "sdpa") -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hidden // n_heads
        self.rope, self.repeat, self.attention = rope, repeat, attention
        self.q_proj = nn.Linear(hidden, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, hidden, bias=False)
        if attention.startswith("flex"):
            self.register_buffer("slopes", 2.0 ** -torch.arange(1.0, n_heads + 1))
            self.register_buffer("windows", torch.arange(1, n_heads + 1) if attention == "flex_window" else None)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope == "complex":  # cos holds freqs_cis [T, D/2] (complex), sin is unused
            f = cos[:t].view(1, t, 1, self.head_dim // 2)
            q = torch.view_as_real(torch.view_as_complex(q.float().reshape(b, t, self.n_heads, -1, 2)) * f)
            k = torch.view_as_real(torch.view_as_complex(k.float().reshape(b, t, self.n_kv_heads, -1, 2)) * f)
            q, k = q.flatten(3).type_as(x).transpose(1, 2), k.flatten(3).type_as(x).transpose(1, 2)
        else:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            c, s = cos[:t].unsqueeze(0).unsqueeze(0), sin[:t].unsqueeze(0).unsqueeze(0)
            q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        n_rep = self.n_heads // self.n_kv_heads
        if self.attention.startswith("flex") and self.repeat == "sdpa":
            y = flex_alibi(q, k, v, self.slopes, self.windows, gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        if self.repeat == "sdpa":
            return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                               .transpose(1, 2).reshape(b, t, -1))
        if self.repeat == "interleave":
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        else:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if self.attention.startswith("flex"):
            y = flex_alibi(q, k, v, self.slopes, self.windows)
        elif self.attention == "manual":
            att = (q @ k.transpose(2, 3)) / math.sqrt(self.head_dim)
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DiffAttention(nn.Module):
    """HF DiffLlama's differential attention as transformers 5.23 writes it: V's K/V heads taken in two
    halves (``chunk`` of the head dim), each repeated to every K/V head (``repeat(1, 2, 1, 1)``), the
    attention run once per half, head ``h`` paired with head ``h + H/2`` (``chunk`` of the heads), and an
    RMSNorm over each pair's ``2 * head_dim``. ``repeat`` as LlamaAttention's (HF's repeat_kv without a
    cache, SDPA's ``enable_gqa`` with one). ``forward(x, cos, sin)``."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, repeat: str = "expand") -> None:
        super().__init__()
        assert n_kv_heads % 2 == 0 and n_heads % n_kv_heads == 0, (n_heads, n_kv_heads)
        self.n_heads, self.n_kv_heads, self.head_dim, self.repeat = n_heads, n_kv_heads, hidden // n_heads, repeat
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.lam = nn.Parameter(torch.full((1,), 0.4))
        self.pair_norm = nn.RMSNorm(2 * self.head_dim, elementwise_affine=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        c, s = cos[:t].unsqueeze(0).unsqueeze(0), sin[:t].unsqueeze(0).unsqueeze(0)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        n_rep, halves = self.n_heads // self.n_kv_heads, []
        for half in torch.chunk(v, 2, dim=1):
            half = half.repeat(1, 2, 1, 1)
            if self.repeat == "sdpa":
                y = F.scaled_dot_product_attention(q, k, half, is_causal=True, enable_gqa=True)
            elif self.repeat == "interleave":
                y = F.scaled_dot_product_attention(q, k.repeat_interleave(n_rep, dim=1),
                                                   half.repeat_interleave(n_rep, dim=1), is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(half, n_rep), is_causal=True)
            halves.append(y.transpose(1, 2))
        first, second = torch.chunk(torch.cat(halves, dim=-1), 2, dim=2)  # [B, T, H/2, 2 * head_dim] each
        return self.o_proj(self.pair_norm(first - self.lam * second).reshape(b, t, -1))


class LlamaBlock(nn.Module):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU MLP -> residual. ``forward(x, cos, sin)``."""

    def __init__(self, hidden: int = 64, n_heads: int = 4, n_kv_heads: int | None = None, ffn: int = 176,
                 **attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, n_heads, n_kv_heads or n_heads, **attention)
        self.post_attention_layernorm = RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def rope_tables(head_dim: int, max_len: int, complex_form: bool = False):
    """(cos, sin) of shape [max_len, head_dim] (HF layout), or (freqs_cis [max_len, head_dim/2], None)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_len).float(), inv_freq)
    if complex_form:
        return torch.polar(torch.ones_like(freqs), freqs), None
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaDecoder(nn.Module):
    """Embedding, ``n_layer`` Llama blocks, RMSNorm, untied LM head; ids in, logits out."""

    def __init__(self, vocab: int = 96, hidden: int = 64, n_heads: int = 4, n_kv_heads: int | None = None,
                 ffn: int = 176, n_layer: int = 2, max_len: int = 64, **attention) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            LlamaBlock(hidden, n_heads, n_kv_heads, ffn, **attention) for _ in range(n_layer)
        )
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        cos, sin = rope_tables(hidden // n_heads, max_len, attention.get("rope") == "complex")
        self.register_buffer("cos", cos, persistent=False)
        if sin is not None:
            self.register_buffer("sin", sin, persistent=False)
        else:
            self.sin = None

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


class MaskedAttention(AttentionBlock):
    """SDPA with an explicit additive mask: per head ``[B, H, T, T]`` (narrowed to this rank's
    heads) or shared ``[T, T]`` (broadcast)."""

    def __init__(self, hidden: int = 32, heads: int = 4, per_head: bool = True) -> None:
        super().__init__(hidden, heads)
        self.per_head = per_head

    def forward(self, x):
        b, t, c = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = torch.arange(t, dtype=x.dtype).view(1, 1, t, 1) - torch.arange(t, dtype=x.dtype).view(1, 1, 1, t)
        if self.per_head:  # ALiBi-like: a slope per head
            mask = bias * torch.linspace(0.1, 1.0, self.heads, dtype=x.dtype).view(1, -1, 1, 1)
            mask = mask.expand(b, self.heads, t, t)
        else:
            mask = bias[0, 0]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(y.transpose(1, 2).reshape(b, t, c))


class PerHeadLinear(nn.Module):
    """A linear applied to every head (its input is sharded on the head dim, not on its features)."""

    def __init__(self, hidden: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.dh = heads, hidden // heads
        self.q, self.head, self.o = nn.Linear(hidden, hidden), nn.Linear(self.dh, self.dh), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        return self.o(self.head(self.q(x).view(b, t, self.heads, self.dh)).reshape(b, t, c))


class MergedTokens(nn.Module):
    """Features of 5 tokens flattened into one linear's input: a shard on a merged dim."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(48, 60), nn.Linear(60 * 5, 48)

    def forward(self, x):
        b, t, _ = x.shape
        return self.down(F.gelu(self.up(x)).reshape(b, t * 60))


class Gate(nn.Module):
    """A one-feature colwise output broadcast against a replicated value: ``sigmoid(g(x)) * x[..., :8]``."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Linear(300, 1)

    def forward(self, x):
        return torch.sigmoid(self.g(x)) * x[..., :8]


class EinsumAttention(nn.Module):
    """Attention written with einsum (its decomposition views through size-1 dims)."""

    def __init__(self, hidden: int = 48, heads: int = 6) -> None:
        super().__init__()
        self.heads, self.dh = heads, hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.dh) for p in (self.q, self.k, self.v))
        a = (torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.dh)).softmax(-1)
        return self.o(torch.einsum("bhts,bshd->bthd", a, v).reshape(b, t, c))


class ViTAttention(nn.Module):
    """timm's ``Attention``: one qkv projection, its parts and heads taken apart by reshape + unbind."""

    def __init__(self, dim: int = 96, heads: int = 6) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class FusedGateUp(nn.Module):
    """One linear producing [gate | up], chunked: ``down(silu(gate) * up)``."""

    def __init__(self, hidden: int = 64, ffn: int = 96) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FusedGQAAttention(nn.Module):
    """Phi-3 style: one ``qkv_proj`` for q (8 heads) and k, v (``n_kv`` heads each), sliced apart.
    ``probe``: the fused output is also read whole, so it is gathered too: "mean" adds its mean,
    "heads" its per-head maxima (a view of all of it into heads first)."""

    def __init__(self, hidden: int = 128, n_heads: int = 8, n_kv: int = 2, probe: str | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.dh, self.probe = n_heads, n_kv, hidden // n_heads, probe
        self.qkv_proj = nn.Linear(hidden, (n_heads + 2 * n_kv) * self.dh, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        q_end, k_end = self.n_heads * self.dh, (self.n_heads + self.n_kv) * self.dh
        q = qkv[..., :q_end].view(b, t, self.n_heads, self.dh).transpose(1, 2)
        k = qkv[..., q_end:k_end].view(b, t, self.n_kv, self.dh).transpose(1, 2)
        v = qkv[..., k_end:].view(b, t, self.n_kv, self.dh).transpose(1, 2)
        k, v = repeat_kv(k, self.n_heads // self.n_kv), repeat_kv(v, self.n_heads // self.n_kv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        if self.probe == "heads":
            return out + qkv.view(b, t, -1, self.dh).amax(-1).mean(-1, keepdim=True)
        return out + qkv.mean(-1, keepdim=True) if self.probe == "mean" else out


class PerHeadScaleAttention(nn.Module):
    """A per-head scale on q applied by splitting q into one-head pieces and concatenating them
    back (found by a new user: a silent wrong result under eager at world 2). ``unbind``: taken
    apart by ``unbind`` and put back by ``stack`` instead."""

    def __init__(self, hidden: int = 256, heads: int = 4, infer_head_dim: bool = False, unbind: bool = False):
        super().__init__()
        self.h, self.infer, self.unbind = heads, infer_head_dim, unbind
        self.g = nn.Parameter(torch.rand(heads) + 0.5)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape
        dh = -1 if self.infer else d // self.h
        q, k, v = (lin(x).view(b, t, self.h, dh).transpose(1, 2) for lin in (self.q, self.k, self.v))
        if self.unbind:
            q = torch.stack([p * self.g[i] for i, p in enumerate(q.unbind(1))], 1)
        else:
            q = torch.cat([p * self.g[i] for i, p in enumerate(q.split(1, dim=1))], 1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))


class QKNormAttention(nn.Module):
    """Attention with q/k normalised over head_dim before the heads are transposed, as Qwen3
    (RMSNorm: ``pow``, ``mean(-1, keepdim)``, ``rsqrt``) or Phi / StableLM ``qk_layernorm``
    (``nn.LayerNorm(head_dim)``) write it; optionally GPT-J's rotate_every_two RoPE (``stack``)."""

    def __init__(self, hidden: int = 128, heads: int = 4, norm: str = "rms", rotate_every_two: bool = False):
        super().__init__()
        self.h, self.dh, self.norm, self.rot2 = heads, hidden // heads, norm, rotate_every_two
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        if norm == "rms":
            self.q_norm, self.k_norm = RMSNorm(self.dh), RMSNorm(self.dh)
        else:
            self.q_norm, self.k_norm = nn.LayerNorm(self.dh), nn.LayerNorm(self.dh)

    @staticmethod
    def _rotate_every_two(x):
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q_norm(self.q(x).view(b, t, self.h, self.dh)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, self.h, self.dh)).transpose(1, 2)
        v = self.v(x).view(b, t, self.h, self.dh).transpose(1, 2)
        if self.rot2:
            q, k = q + self._rotate_every_two(q), k + self._rotate_every_two(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class BloomStyleAttention(nn.Module):
    """BLOOM's attention as HF writes it: fused query_key_value viewed [B, T, H, 3, Dh], scores by
    ``torch.baddbmm(alibi, q, k^T)`` on a merged batch*heads dim, softmax, bmm, dense out.
    ``full_bias``: an ALiBi of ``[B * H, T, T]`` instead of ``[B * H, 1, T]``."""

    def __init__(self, hidden: int = 64, heads: int = 4, full_bias: bool = False):
        super().__init__()
        self.h, self.dh, self.full = heads, hidden // heads, full_bias
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.slopes = nn.Parameter(torch.rand(heads) + 0.1)

    def forward(self, x):
        b, t, d = x.shape
        fused = self.query_key_value(x).view(b, t, self.h, 3, self.dh)
        q, k, v = (fused[..., i, :].transpose(1, 2).reshape(b * self.h, t, self.dh) for i in range(3))
        pos = torch.arange(t, dtype=x.dtype)
        rel = pos[None, :] - pos[:, None] if self.full else pos[None, :]  # [T, T] or [1, T]
        alibi = (self.slopes[:, None, None] * rel).expand(b, self.h, *rel.shape).reshape(b * self.h, *rel.shape)
        scores = torch.baddbmm(alibi, q, k.transpose(-1, -2), beta=1.0, alpha=self.dh ** -0.5)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        y = torch.bmm(probs, v).view(b, self.h, t, self.dh).transpose(1, 2).reshape(b, t, d)
        return self.dense(y)


class CatMLP(nn.Module):
    """Two up projections concatenated along their (cut) features, then one down projection: the
    down weight's rows are cut as the concatenation is, two components each rank holds part of."""

    def __init__(self, hidden: int = 48, f1: int = 40, f2: int = 30):
        super().__init__()
        self.a, self.b = nn.Linear(hidden, f1), nn.Linear(hidden, f2)
        self.down = nn.Linear(f1 + f2, hidden)

    def forward(self, x):
        return self.down(F.gelu(torch.cat([self.b(x), self.a(x)], -1)))


class FalconStyleAttention(nn.Module):
    """HF Falcon's attention with ``new_decoder_architecture`` (Falcon-40B/180B, Falcon 2): one
    fused query_key_value grouped per KV head, ``[B, T, Hkv, n + 2, Dh]`` (n query heads, then
    one k and one v per group), taken apart by a slice and by list indexing (``qkv[..., [-2], :]``),
    K/V broadcast to the query heads, the group dim flattened into heads. ``multi_query``: Falcon-7B's
    older form, ``[q heads | k | v]`` viewed into heads and k, v taken by ``qkv[..., [-2], :]``.
    ``cache``: K/V appended to an empty cache first, as HF's DynamicCache does on its first update
    (``cat([tensor([]), k], -2)``)."""

    def __init__(self, hidden: int = 128, heads: int = 8, kv_heads: int = 2, cache: bool = False,
                 multi_query: bool = False):
        super().__init__()
        self.h, self.kv, self.dh, self.cache, self.mq = heads, kv_heads, hidden // heads, cache, multi_query
        self.query_key_value = nn.Linear(hidden, (heads + 2 * (1 if multi_query else kv_heads)) * self.dh, bias=False)
        self.dense = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        if self.mq:  # Falcon-7B: [q heads | k | v], one K/V head broadcast by SDPA
            qkv = self.query_key_value(x).view(b, t, self.h + 2, self.dh)
            q, k, v = (z.transpose(1, 2) for z in (qkv[..., :-2, :], qkv[..., [-2], :], qkv[..., [-1], :]))
        else:
            qkv = self.query_key_value(x).view(b, t, -1, self.h // self.kv + 2, self.dh)
            q = qkv[:, :, :, :-2]
            k = torch.broadcast_to(qkv[:, :, :, [-2]], q.shape)
            v = torch.broadcast_to(qkv[:, :, :, [-1]], q.shape)
            q, k, v = (z.flatten(2, 3).transpose(1, 2) for z in (q, k, v))
        if self.cache:
            k, v = (torch.cat([torch.tensor([], dtype=z.dtype), z], dim=-2) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, -1))


class MoE(nn.Module):
    """A mixture-of-experts block as HF's ``batched_mm`` experts run it (Mixtral, Qwen-MoE, ...): a
    router picks ``top_k`` of ``experts`` per token, every expert's weights are one slice of a 3-D
    parameter (``gate_up [E, 2 * ffn, hidden]``, ``down [E, hidden, ffn]``) gathered per token pair
    (``W[ids]``) for a ``bmm``; the rows are weighted by the router and summed over top-k. A residual
    follows, as in a decoder layer. ``loop=True``: a python loop over experts with ``F.linear(x,
    W[e])`` on masked tokens instead (every expert computes every token; no data-dependent shapes).
    ``transposed``: weights stored ``[E, in, out]``, used as ``bmm(x.unsqueeze(1), W[ids])``.
    ``whole``: Llama4's form, weights stored ``[E, in, out]`` and every expert running every token
    scaled by its router weight (0 where not picked): ``bmm(x.view(E, -1, hidden), W)``, the whole
    parameter, then a sum over experts. ``bias``: HF's expert biases (GPT-OSS), added in place to
    each projection's output (``out.add_(b[ids])``; not in the loop form). ``residual=False``: the
    experts' weighted sum alone."""

    def __init__(self, hidden: int = 64, ffn: int = 48, experts: int = 4, top_k: int = 2, loop: bool = False,
                 transposed: bool = False, residual: bool = True, whole: bool = False, bias: bool = False):
        super().__init__()
        self.e, self.k, self.ffn, self.loop, self.transposed = experts, top_k, ffn, loop, transposed or whole
        self.residual, self.whole = residual, whole
        self.gate_up_bias = nn.Parameter(torch.randn(experts, 2 * ffn) / 4) if bias and not loop else None
        self.down_bias = nn.Parameter(torch.randn(experts, hidden) / 4) if bias and not loop else None
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / math.sqrt(hidden))
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) / math.sqrt(ffn))
        if self.transposed:  # stored [E, in, out] and used as x @ W[ids] (HF's is_transposed experts, gpt-oss)
            self.gate_up_proj = nn.Parameter(self.gate_up_proj.data.transpose(1, 2).contiguous())
            self.down_proj = nn.Parameter(self.down_proj.data.transpose(1, 2).contiguous())

    def forward(self, x):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, ids = torch.topk(F.softmax(self.router(h), -1), self.k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        if self.loop:
            out = torch.zeros_like(h)
            for e in range(self.e):
                gate, up = F.linear(h, self.gate_up_proj[e]).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
                out = out + y * (weights * (ids == e)).sum(-1, keepdim=True)
            return x + out.view(shape) if self.residual else out.view(shape)
        if self.whole:
            scores = torch.zeros(h.shape[0], self.e, dtype=weights.dtype, device=h.device).scatter(-1, ids, weights)
            routed = (h.repeat(self.e, 1) * scores.t().reshape(-1, 1)).view(self.e, -1, shape[-1])
            gate_up = torch.bmm(routed, self.gate_up_proj)
            if self.gate_up_bias is not None:
                gate_up.add_(self.gate_up_bias.unsqueeze(1))
            gate, up = gate_up.chunk(2, -1)
            y = torch.bmm(F.silu(gate) * up, self.down_proj)
            if self.down_bias is not None:
                y.add_(self.down_bias.unsqueeze(1))
            y = y.view(self.e, -1, shape[-1]).sum(0)
            return x + y.view(shape) if self.residual else y.view(shape)
        pairs = h.repeat_interleave(self.k, dim=0)  # [tokens * top_k, hidden]
        flat = ids.reshape(-1)
        if self.transposed:
            gate_up = torch.bmm(pairs.unsqueeze(1), self.gate_up_proj[flat]).squeeze(1)
        else:
            gate_up = torch.bmm(self.gate_up_proj[flat], pairs.unsqueeze(-1)).squeeze(-1)
        if self.gate_up_bias is not None:
            gate_up.add_(self.gate_up_bias[flat])
        gate, up = gate_up.chunk(2, -1)
        if self.transposed:
            y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.down_proj[flat]).squeeze(1)
        else:
            y = torch.bmm(self.down_proj[flat], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        if self.down_bias is not None:
            y.add_(self.down_bias[flat])
        y = (y * weights.reshape(-1, 1)).view(-1, self.k, shape[-1]).sum(1)
        return x + y.view(shape) if self.residual else y.view(shape)


class HFMixtral(nn.Module):
    """A tiny HF Mixtral (transformers 5.x, its default ``grouped_mm`` experts: on CPU in float32
    transformers' own ``grouped_mm_fallback`` op), ids in, logits out, no cache."""

    def __init__(self, hidden: int = 64, vocab: int = 96, experts_implementation: str = "grouped_mm"):
        super().__init__()
        import transformers

        cfg = transformers.MixtralConfig(
            hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=4,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=vocab, num_hidden_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, experts_implementation=experts_implementation)
        self.model = transformers.AutoModelForCausalLM.from_config(cfg)

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


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
        # transformers: ids in, ffn = vocabulary
        "nanogpt": lambda: NanoGPT(vocab=ffn, n_embd=hidden, n_head=4, n_layer=2),
        "nanogpt_manual": lambda: NanoGPT(vocab=ffn, n_embd=hidden, n_head=4, n_layer=2, flash=False),
        "llama": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=4),
        "llama_complex": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=4, rope="complex",
                                              repeat="interleave"),
        "llama_manual": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=4, attention="manual"),
        "llama_few_kv": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=2),
        "llama_6_heads": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=6),
        "llama_sdpa_gqa": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=4, repeat="sdpa"),
        "llama_mqa": lambda: LlamaDecoder(vocab=ffn, hidden=hidden, n_heads=8, n_kv_heads=1, repeat="sdpa"),
        "fused_gqa": lambda: FusedGQAAttention(hidden, 8, ffn),  # ffn = KV heads
        "fused_gqa_probe": lambda: FusedGQAAttention(hidden, 8, ffn, probe="mean"),
        "fused_gqa_heads": lambda: FusedGQAAttention(hidden, 8, ffn, probe="heads"),
        "per_head_scale": lambda: PerHeadScaleAttention(hidden, ffn),  # ffn = heads
        "per_head_scale_infer": lambda: PerHeadScaleAttention(hidden, ffn, infer_head_dim=True),
        "qk_norm": lambda: QKNormAttention(hidden, ffn),  # ffn = heads
        "qk_layernorm_rot2": lambda: QKNormAttention(hidden, ffn, norm="layer", rotate_every_two=True),
        "bloom_alibi": lambda: BloomStyleAttention(hidden, ffn, full_bias=True),  # ffn = heads
        "falcon_gqa": lambda: FalconStyleAttention(hidden, 8, ffn),  # ffn = KV heads
        "falcon_mqa": lambda: FalconStyleAttention(hidden, ffn, 1, multi_query=True),  # ffn = query heads
        "cat_mlp": lambda: CatMLP(hidden, ffn, ffn // 2 + 5),
        "moe": lambda: MoE(hidden, ffn),
        "moe_loop": lambda: MoE(hidden, ffn, loop=True),
        "hf_mixtral": lambda: HFMixtral(hidden, ffn),  # ffn = vocabulary
    }[name]()


IDS_IN = {"tiny_lm", "nanogpt", "nanogpt_manual", "llama", "llama_complex", "llama_manual", "llama_few_kv",
          "llama_6_heads", "llama_sdpa_gqa", "llama_mqa", "hf_mixtral"}


class KVCache(nn.Module):
    """gpt-fast's cache: ``[batch, kv_heads, max_len, head_dim]`` buffers written in place at
    ``input_pos``. ``form``: "index_put" (gpt-fast: ``k_out[:, :, input_pos] = k``), "index_copy"
    (HF StaticCache: ``index_copy_(2, input_pos, k)``), "slice" (Meta's Llama:
    ``k_out[:, :, start:start + T] = k``, ``start`` a Python int), "lazy" (HF StaticCache's lazy
    initialisation: ``torch.zeros`` at the first update, inside the compiled graph, then ``index_copy_``)
    or "cat" (HF DynamicCache: plain attributes grown by ``torch.cat`` on the sequence dim from an empty
    ``torch.tensor([])``, returned from the graph and read back by the next call; ``max_len`` unused)."""

    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int, form: str = "index_put") -> None:
        super().__init__()
        self.form, self.shape = form, (batch, kv_heads, max_len, head_dim)
        if form in ("lazy", "cat"):  # plain attributes, made by the first update (in the graph)
            self.k_cache = self.v_cache = None
            return
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, max_len, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, max_len, head_dim))

    def update(self, input_pos, k, v):
        if self.form == "cat":
            if self.k_cache is None:
                self.k_cache, self.v_cache = torch.tensor([], dtype=k.dtype), torch.tensor([], dtype=v.dtype)
            self.k_cache, self.v_cache = torch.cat([self.k_cache, k], dim=-2), torch.cat([self.v_cache, v], dim=-2)
            return self.k_cache, self.v_cache
        if self.form == "lazy":
            if self.k_cache is None:
                self.k_cache, self.v_cache = torch.zeros(self.shape), torch.zeros(self.shape)
            return self.k_cache.index_copy_(2, input_pos, k), self.v_cache.index_copy_(2, input_pos, v)
        if self.form == "index_copy":
            return self.k_cache.index_copy_(2, input_pos, k), self.v_cache.index_copy_(2, input_pos, v)
        if self.form == "slice":
            start = int(input_pos)
            self.k_cache[:, :, start:start + k.shape[2]] = k
            self.v_cache[:, :, start:start + v.shape[2]] = v
            return self.k_cache, self.v_cache
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class CachedAttention(nn.Module):
    """gpt-fast's Attention: fused ``wqkv``, RoPE, a KV cache, ``repeat_interleave`` for GQA, SDPA
    over the whole cache with a mask row per position."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, batch: int, max_len: int, form: str,
                 bias: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, hidden // n_heads
        self.wqkv = nn.Linear(hidden, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.kv_cache = KVCache(batch, max_len, n_kv_heads, self.head_dim, form)

    def forward(self, x, cos, sin, mask, input_pos, positions):
        b, t, _ = x.shape
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        c, s = cos[positions].unsqueeze(0).unsqueeze(0), sin[positions].unsqueeze(0).unsqueeze(0)
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        k, v = self.kv_cache.update(input_pos, k, v)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        if self.kv_cache.form == "cat":  # the cache is as long as what it holds
            mask = mask[..., :k.shape[2]]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class CachedDecoder(nn.Module):
    """A gpt-fast-style Llama with KV-cache buffers: ``forward(ids, input_pos)`` -> logits; prefill
    passes the prompt and ``arange(T)``, each decode step one token and its position (the "slice"
    form: the first position, an int)."""

    def __init__(self, vocab: int = 96, hidden: int = 64, n_heads: int = 8, n_kv_heads: int = 4, n_layer: int = 2,
                 batch: int = 2, max_len: int = 32, form: str = "index_put", bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(  # (bias: Qwen2-style, on the fused q|k|v)
            CachedAttention(hidden, n_heads, n_kv_heads, batch, max_len, form, bias) for _ in range(n_layer))
        self.mlps = nn.ModuleList(SwiGLU(hidden, 2 * hidden) for _ in range(n_layer))
        self.norms = nn.ModuleList(RMSNorm(hidden) for _ in range(2 * n_layer + 1))
        self.output = nn.Linear(hidden, vocab, bias=False)
        cos, sin = rope_tables(hidden // n_heads, max_len)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, ids, input_pos):
        x = self.embed(ids)
        positions = input_pos if torch.is_tensor(input_pos) else torch.arange(
            input_pos, input_pos + ids.shape[1], device=ids.device)
        mask = self.causal[None, None, positions]
        for i, (attn, mlp) in enumerate(zip(self.layers, self.mlps)):
            x = x + attn(self.norms[2 * i](x), self.cos, self.sin, mask, input_pos, positions)
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.output(self.norms[-1](x))


class HFLogits(nn.Module):
    """An HF causal LM called as ids in, logits out, without a cache (``self.m``)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.m = lm

    def forward(self, ids):
        return self.m(ids, use_cache=False).logits


class ClothedLinear(nn.Module):
    """A linear on ``x [B, S, in]`` written in one of ``FORMS`` (linears in other clothes);
    the weight stored as the form reads it: ``[out, in]``, ``[in, out]`` (``*_in_out``) or a
    Conv1d's ``[out, in, 1]`` (Conv2d's ``[out, in, 1, 1]``); the bias, if any, added after.
    ``weight_norm``: F.linear on ``weight_norm(dim=0)``'s weight (``_in``: dim=1), cut either way (colwise
    (rowwise) on its norm dim, v and g alike; the other across its norms, g whole, the norms summed over
    the ranks). ``spectral_norm``: F.linear on its weight (cut either way; in train mode, its power
    iteration writes the buffers u and v on every call)."""

    FORMS = ("linear", "einsum", "einsum_in_out", "einsum_ellipsis", "conv1x1", "bmm_expand", "bmm_in_out",
             "einsum_first", "einsum_first_in_out", "conv2d_1x1", "weight_norm", "weight_norm_in", "spectral_norm")

    def __init__(self, in_features: int, out_features: int, form: str, bias: bool = True) -> None:
        super().__init__()
        self.form = form
        shape = {"conv1x1": (out_features, in_features, 1), "einsum_in_out": (in_features, out_features),
                 "bmm_in_out": (in_features, out_features), "einsum_first_in_out": (in_features, out_features),
                 "conv2d_1x1": (out_features, in_features, 1, 1)}
        shape = shape.get(form, (out_features, in_features))
        self.weight = nn.Parameter(torch.randn(*shape) / max(in_features, 1) ** 0.5)
        self.bias = nn.Parameter(torch.randn(out_features) / 4) if bias else None
        if form.startswith("weight_norm"):
            nn.utils.parametrizations.weight_norm(self, "weight", dim=1 if form.endswith("_in") else 0)
        if form == "spectral_norm":
            nn.utils.parametrizations.spectral_norm(self, "weight")

    def forward(self, x):
        w, form = self.weight, self.form
        if form == "conv1x1":  # on [B, C, L], as a 1x1 conv MLP holds its activations
            return F.conv1d(x.transpose(1, 2), w, self.bias).transpose(1, 2)
        if form == "conv2d_1x1":  # on [B, C, S, 1]
            return F.conv2d(x.transpose(1, 2).unsqueeze(-1), w, self.bias).squeeze(-1).transpose(1, 2)
        if form in ("linear", "weight_norm", "weight_norm_in", "spectral_norm"):
            y = F.linear(x, w)
        elif form in ("einsum_first", "einsum_first_in_out"):  # W first, features before the tokens
            y = torch.einsum("hd,bsd->bhs" if form == "einsum_first" else "dh,bsd->bhs", w, x).transpose(1, 2)
        elif form == "einsum":
            y = torch.einsum("bsd,hd->bsh", x, w)
        elif form == "einsum_in_out":
            y = torch.einsum("bsd,dh->bsh", x, w)
        elif form == "einsum_ellipsis":
            y = torch.einsum("...d,hd->...h", x, w)
        elif form == "bmm_expand":
            y = torch.bmm(x, w.t().expand(x.shape[0], -1, -1))
        else:  # "bmm_in_out"
            y = torch.bmm(x, w.unsqueeze(0).expand(x.shape[0], -1, -1))
        return y if self.bias is None else y + self.bias


class ClothedMLP(nn.Module):
    """up -> activation -> down, each a :class:`ClothedLinear` of its own form, with a residual."""

    def __init__(self, hidden: int, ffn: int, up: str, down: str, bias: bool = True) -> None:
        super().__init__()
        self.up, self.down = ClothedLinear(hidden, ffn, up, bias), ClothedLinear(ffn, hidden, down, bias)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class TiedAutoencoder(nn.Module):
    """Encoder ``F.linear(x, W)``, decoder ``F.linear(h, W.t())``: one W, read as stored by the decoder."""

    def __init__(self, hidden: int, code: int) -> None:
        super().__init__()
        self.tied = nn.Parameter(torch.randn(code, hidden) / hidden ** 0.5)
        self.enc_bias, self.dec_bias = nn.Parameter(torch.randn(code) / 4), nn.Parameter(torch.randn(hidden) / 4)

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.tied, self.enc_bias)), self.tied.t(), self.dec_bias)
