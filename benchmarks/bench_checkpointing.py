"""Activation checkpointing through dynashard: what a training step keeps for its backward, and its time.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_checkpointing [--tokens 1024]
        [--layers 4] [--compiler inductor] [--iters 5] [--smoke] [--out PATH]

Workload: workloads.py's decoder (tests/models.LlamaDecoder: hidden 1024, 8 heads, ffn 2816, vocab
32000), batch 1, float32, cross-entropy against random next tokens. "+ AC": every decoder layer runs
through ``torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)`` (what HF's
``gradient_checkpointing_enable()`` and torchtitan's per-block wrapping do).

Systems, each a deep copy of the same model: unsharded (torch.compile with ``--compiler``, every
rank training all of it), with and without AC; dynashard (``parallelize`` then ``torch.compile(
backend=dynashard.backend(compiler=...))``), with and without AC.

Kept for the backward: the bytes of every tensor the compiled forward saves for its backward in one
step (a ``torch.autograd.graph.saved_tensors_hooks`` pack hook), and of those that are not the
model's parameters: the activations; the largest rank's. What AC should show: the layers' activations
gone from what dynashard keeps, as from what the unsharded model keeps (what is left is outside the
checkpointed layers: the embedding's output, the final norm's, the logits).

Step: forward, loss and backward, timed interleaved (one step of each system per round), slowest
rank's median. Correctness, before timing: each system's first loss against unsharded eager's
(1e-4 relative); the run exits 1 after writing its record if one differs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import dynashard
from benchmarks._common import OUT_HELP, gather, init, out_path, record, time_interleaved, write_json
from benchmarks.workloads import SMOKE, WORKLOADS, Sizes


def checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer of ``model`` run through non-reentrant activation checkpointing."""
    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *args, _f=forward: ckpt.checkpoint(_f, *args, use_reentrant=False)
    return model


def kept_bytes(step, model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of every tensor one step saves for its backward, and of those that are not parameters (nor
    views of them): the activations."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = activations = 0

    def pack(t):
        nonlocal total, activations
        size = t.numel() * t.element_size()
        total += size
        activations += size * (t.untyped_storage().data_ptr() not in weights)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return total, activations


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", help=OUT_HELP.replace("<script>", "checkpointing_w<world>"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    rank, world = init(1)
    args.out = out_path(args.out, f"checkpointing_w{world}", args.smoke)
    sizes = Sizes(n_layer=args.layers)
    if args.smoke:
        sizes, args.tokens, args.iters, args.warmup, args.compiler = SMOKE, 16, 1, 0, "eager"
    workload = WORKLOADS["decoder"]
    torch.manual_seed(0)
    base = workload.build(sizes, args.tokens)
    ids = torch.randint(0, sizes.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, sizes.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(2))

    def loss_of(model):
        return F.cross_entropy(model(ids).flatten(0, 1), target.flatten())

    with torch.no_grad():
        reference = float(loss_of(base))
    options = {"compiler": args.compiler}
    systems = {}
    for name in ("unsharded", "unsharded + AC", "dynashard", "dynashard + AC"):
        model = copy.deepcopy(base)
        if name.endswith("AC"):
            checkpointed(model)
        if name.startswith("dynashard"):
            dynashard.parallelize(model, ids, options=options)
            fast = torch.compile(model, backend=dynashard.backend(**options))
        else:
            fast = torch.compile(model, backend="inductor" if args.compiler == "inductor" else args.compiler)
        systems[name] = (model, fast)
    per_system, calls, wrong = {}, {}, []
    for name, (model, fast) in systems.items():
        def step(fast=fast, model=model):
            loss = loss_of(fast)
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return loss

        loss = float(step().detach())  # (compiles)
        if abs(loss - reference) > 1e-4 * abs(reference):
            wrong.append(f"{name}: loss {loss} against unsharded eager's {reference}")
        kept, activations = kept_bytes(step, model)
        per_system[name] = {"kept_for_backward_bytes": kept, "activations_kept_bytes": activations, "loss": loss}
        calls[name] = step
    times = time_interleaved(calls, args.warmup, args.iters)
    results = []
    for name, mine in per_system.items():  # the largest rank's bytes, the slowest rank's median
        everyone = gather({**mine, "median_ms": 1e3 * statistics.median(times[name])})
        keys = ("kept_for_backward_bytes", "activations_kept_bytes", "median_ms")
        results.append({"system": name, **{k: max(r[k] for r in everyone) for k in keys}, "per_rank": everyone})
    wrong = sorted({w for ws in gather(wrong) for w in ws})
    config = {"workload": "decoder", "sizes": dataclasses.asdict(sizes), "tokens": args.tokens,
              "compiler": args.compiler, "iters": args.iters, "warmup": args.warmup, "wrong": wrong}
    if rank == 0:
        write_json(args.out, record(config, results, world, 1))
        for r in results:
            print(f"{r['system']:16s} kept for backward {r['kept_for_backward_bytes'] / 2**20:7.1f} MiB, "
                  f"activations {r['activations_kept_bytes'] / 2**20:7.1f} MiB; step {r['median_ms']:8.1f} ms")
        print("wrong:", wrong or "none", "->", args.out)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
