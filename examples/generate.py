"""Greedy decoding of a gpt-fast-style Llama whose KV caches are module buffers, sharded by dynashard.

    torchrun --standalone --nproc-per-node 2 examples/generate.py

Every rank builds the same model (same seed) and compiles it with dynashard; the weights and the KV
caches are cut by heads on the first call (each rank holds about 1/N of both), prefill is one graph
and each decode step another. An unsharded copy, compiled the same way, decodes beside it: the
tokens must be equal, and both are timed, interleaved.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dynashard


class KVCache(nn.Module):
    def __init__(self, batch: int, max_len: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, max_len, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, max_len, head_dim))

    def update(self, input_pos, k, v):
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, batch: int, max_len: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache = KVCache(batch, max_len, kv_heads, self.head_dim)

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        c, s = cos[input_pos], sin[input_pos]
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        k, v = self.kv_cache.update(input_pos, k, v)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, batch: int, max_len: int) -> None:
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads, batch, max_len)
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, layers: int, batch: int, max_len: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, batch, max_len) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // heads
        freqs = torch.outer(torch.arange(max_len).float(), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
        self.register_buffer("cos", torch.cat((freqs, freqs), -1).cos())
        self.register_buffer("sin", torch.cat((freqs, freqs), -1).sin())
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())

    def forward(self, ids, input_pos):
        x = self.tok_embeddings(ids)
        mask = self.causal[None, None, input_pos]
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, mask, input_pos)
        return self.output(self.norm(x))


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy tokens; seconds of the prefill and per decoded token."""
    t = prompt.shape[1]
    start = time.perf_counter()
    token = model(prompt, torch.arange(t))[:, -1].argmax(-1, keepdim=True)
    prefill = time.perf_counter() - start
    out = [token]
    start = time.perf_counter()
    for pos in range(t, t + new_tokens - 1):
        token = model(token, torch.tensor([pos]))[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, 1), prefill, (time.perf_counter() - start) / max(1, new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same weights and prompt on every rank
    model = Llama(args.vocab, args.dim, args.heads, args.kv_heads, args.layers, 1, args.prompt + args.new_tokens)
    model.eval()
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    twin = copy.deepcopy(model)
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    sharded = torch.compile(model, backend="dynashard", options={"compiler": args.compiler})
    unsharded = torch.compile(twin, backend=args.compiler)
    times = {"dynashard": [], "unsharded": []}
    for _ in range(1 + args.rounds):  # the first round compiles both (prefill and decode graphs)
        got, *t_sharded = generate(sharded, prompt, args.new_tokens)
        want, *t_whole = generate(unsharded, prompt, args.new_tokens)
        times["dynashard"].append(t_sharded)
        times["unsharded"].append(t_whole)
    if not torch.equal(got, want):
        raise SystemExit(f"rank {rank}: the sharded model's tokens differ from the unsharded model's")
    if rank == 0:
        held = dynashard.held_bytes(model)
        print(f"world {world}: tokens equal to the unsharded model's; this rank holds {held / 2**20:.1f} of "
              f"{total / 2**20:.1f} MiB (weights and KV caches)")
        for name, runs in times.items():
            prefill = statistics.median(t[0] for t in runs[1:]) * 1e3
            decode = statistics.median(t[1] for t in runs[1:])
            print(f"{name:>9}: prefill of {args.prompt} tokens {prefill:7.1f} ms, decode {decode * 1e3:6.1f} ms/token "
                  f"({1 / decode:6.1f} tokens/s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
