"""Train a small GPT with dynashard, and the same GPT unsharded beside it.

Launch: torchrun --standalone --nproc-per-node 2 examples/train.py [--steps 150] [--compiler inductor]

The text is the Zen of Python (it ships with Python: ``this.s``), read a character at a time. Every
rank builds the same model from seed 0; ``dynashard.parallelize`` shards it (each rank keeps its
part of every weight as the model's parameters), AdamW is built over those shards, and the model is
trained through ``torch.compile(model, backend="dynashard")`` with ordinary torch code (backward,
``clip_grad_norm_``, ``step``). An unsharded copy trains on the same batches in the same process,
so the two loss curves can be compared; the last line prints both final losses.
"""

from __future__ import annotations

import argparse
import codecs
import copy
import sys
import this

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dynashard


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, heads: int = 4, layers: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(text: str, chars: list[str], batch: int, context: int, steps: int, seed: int):
    data = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(seed)  # the same batches on every rank
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + context] for s in starts])
        y = torch.stack([data[s + 1:s + context + 1] for s in starts])
        yield x, y


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    text = codecs.decode(this.s, "rot13")
    chars = sorted(set(text))
    torch.manual_seed(0)
    model = GPT(len(chars), context=args.context)
    twin = copy.deepcopy(model)  # trained unsharded, for comparison
    example = torch.zeros(args.batch, args.context, dtype=torch.long)
    options = {"compiler": args.compiler, "min_shard_numel": 0}  # a toy model: shard every layer
    dynashard.parallelize(model, example, options=options)
    held = dynashard.held_bytes(model) / sum(t.nbytes for t in twin.state_dict().values())
    fast = torch.compile(model, backend=dynashard.backend(**options))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=args.lr)
    for step, (x, y) in enumerate(batches(text, chars, args.batch, args.context, args.steps, seed=1)):
        losses = []
        for net, optimizer in ((fast, opt), (twin, opt_twin)):
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in optimizer.param_groups[0]["params"]], 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        if rank == 0:
            done = (step + 1) * 30 // args.steps
            sys.stderr.write(f"\r[{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps}  "
                             f"loss {losses[0]:.4f} (unsharded {losses[1]:.4f})")
            sys.stderr.flush()
    if rank == 0:
        sys.stderr.write("\n")
        print(f"final loss: dynashard {losses[0]:.4f}, unsharded {losses[1]:.4f} "
              f"(world {dist.get_world_size()}, this rank holds {held:.0%} of the model's bytes)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
