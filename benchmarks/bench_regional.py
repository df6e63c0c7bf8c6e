"""Compile time of a Llama decoder compiled whole, one block at a time, and as nested compile regions.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_regional [--layers 8,16,32]
        [--compiler aot_eager|inductor|eager] [--modes whole,regional,nested,nested-flat] [--repeats 1]
        [--hidden 64] [--smoke] [--out PATH]

Model: ``tests.models.LlamaDecoder(vocab=256, hidden, n_heads=4, ffn=2*hidden+16, n_layer=L)``, float32,
ids ``[1, 16]``, every rank the same weights. Modes (dynashard/regions.py):

- whole: ``torch.compile(model, backend=...)``;
- regional: ``block.compile(backend=...)`` for every block of ``model.layers`` (the rest eager);
- nested: every block's forward a ``torch.compiler.nested_compile_region``, the model compiled whole;
- nested-flat (dynashard only): nested with the rewritten graph handed to the compiler flat, as before
  ``rewrite/outline.py`` (its ``outline_regions`` replaced by the identity for that system): the "before".

Backends: dynashard (``options={"compiler": C, "min_shard_numel": 0}``) and plain ``torch.compile`` with
the same compiler C (every rank the whole model: the baseline). For each layer count the systems
run interleaved (``--repeats`` rounds of them all), each after ``torch._dynamo.reset()`` on a freshly built
model; "first call s" is the slowest rank's time from the compile call to the first output (tracing,
planning, compiling, the call), the median of the rounds. Ratios: each mode against whole with the same
backend, and dynashard against plain in the same mode. Outputs are checked against the unsharded eager
model (exit 1 past --rtol); "held" is ``dynashard.held_bytes(model)`` over the unsharded model's bytes.

Under ``--compiler inductor`` each system gets a fresh ``TORCHINDUCTOR_CACHE_DIR`` (no FX graph cache
hit from an earlier system), but kernels compiled earlier in the process may still be reused in memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import dynashard
from benchmarks._common import OUT_HELP, gather, init, out_path, record, write_json
from dynashard import dynamo_backend
from tests import models

MODES = ("whole", "regional", "nested", "nested-flat")
BACKENDS = ("dynashard", "plain")


class RegionBlock(models.LlamaBlock):
    forward = torch.compiler.nested_compile_region(models.LlamaBlock.forward)


def build(layers: int, hidden: int) -> models.LlamaDecoder:
    torch.manual_seed(0)
    return models.LlamaDecoder(vocab=256, hidden=hidden, n_heads=4, ffn=2 * hidden + 16, n_layer=layers)


def first_call(mode: str, backend: str, layers: int, hidden: int, compiler: str, ids: torch.Tensor):
    """(seconds to the first output, the output, held fraction) of one freshly built system."""
    torch._dynamo.reset()
    model = build(layers, hidden)
    full = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    if mode.startswith("nested"):
        for block in model.layers:
            block.__class__ = RegionBlock
    kwargs = ({"backend": "dynashard", "options": {"compiler": compiler, "min_shard_numel": 0}}
              if backend == "dynashard" else {"backend": compiler})
    if compiler == "inductor" and backend == "plain":
        kwargs = {}
    if compiler == "inductor":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-regional-")
    outline = dynamo_backend.outline_regions
    if mode == "nested-flat":
        dynamo_backend.outline_regions = lambda gm, fake_args: gm
    dist.barrier()
    start = time.perf_counter()
    try:
        if mode == "regional":
            for block in model.layers:
                block.compile(**kwargs)
            fast = model
        else:
            fast = torch.compile(model, **kwargs)
        out = fast(ids)
    finally:
        dynamo_backend.outline_regions = outline
    seconds = time.perf_counter() - start
    return seconds, out, dynashard.held_bytes(model) / full


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="8,16,32")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--compiler", default="aot_eager", choices=["aot_eager", "inductor", "eager"])
    parser.add_argument("--modes", default=",".join(MODES), help="a subset of " + ",".join(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every system; the median is recorded")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--smoke", action="store_true", help="layers 2,3, eager: seconds")
    parser.add_argument("--out", help=OUT_HELP)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.compiler = "2,3", "eager"
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        parser.error(f"--modes: expected some of {','.join(MODES)}, found {args.modes}")
    rank, world = init(args.threads)
    layer_counts = [int(n) for n in args.layers.split(",")]
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    results, worst = [], 0.0
    with torch.no_grad():
        for layers in layer_counts:
            ref = build(layers, args.hidden)(ids)
            row: dict = {"layers": layers}
            systems = [(m, b) for m in modes for b in BACKENDS if not (m == "nested-flat" and b == "plain")]
            runs: dict = {}
            for _ in range(args.repeats):  # (rounds of every system in turn: a load change hits all alike)
                for mode, backend in systems:
                    seconds, out, held = first_call(mode, backend, layers, args.hidden, args.compiler, ids)
                    err = float((out - ref).abs().max() / ref.abs().max())
                    worst = max(worst, err)
                    runs.setdefault((mode, backend), []).append(max(gather(seconds)))
                    row[f"{backend} {mode} held"] = round(held, 3)
                    row[f"{backend} {mode} rel err"] = max(row.get(f"{backend} {mode} rel err", 0.0), max(gather(err)))
            for (mode, backend), seconds in runs.items():
                row[f"{backend} {mode} s"] = statistics.median(seconds)
                if args.repeats > 1:
                    row[f"{backend} {mode} runs s"] = [round(t, 2) for t in seconds]
            for mode, backend in systems:
                if mode != "whole" and f"{backend} whole s" in row:
                    row[f"{backend} {mode}/whole"] = round(row[f"{backend} {mode} s"] / row[f"{backend} whole s"], 2)
                if backend == "dynashard" and f"plain {mode} s" in row:
                    row[f"dynashard/plain {mode}"] = round(row[f"dynashard {mode} s"] / row[f"plain {mode} s"], 2)
            if "dynashard nested-flat s" in row and "dynashard nested s" in row:
                row["dynashard nested/nested-flat"] = round(
                    row["dynashard nested s"] / row["dynashard nested-flat s"], 2)
            results.append(row)
            if rank == 0:
                cells = [f"{b} {m} {row[f'{b} {m} s']:.2f} (held {row[f'{b} {m} held']:.2f})" for m, b in systems]
                ratios = [f"{k} {v}" for k, v in row.items() if "/" in k]
                print(f"layers {layers}: first call s " + ", ".join(cells) + "; " + ", ".join(ratios), flush=True)
    config = {"layers": layer_counts, "hidden": args.hidden, "n_heads": 4, "ffn": 2 * args.hidden + 16,
              "vocab": 256, "ids": list(ids.shape), "compiler": args.compiler, "modes": modes,
              "backends": BACKENDS, "repeats": args.repeats, "rtol": args.rtol, "smoke": args.smoke, "backend": "gloo"}
    if rank == 0:
        write_json(out_path(args.out, f"regional_w{world}_{args.compiler}", args.smoke),
                   record(config, results, world, args.threads))
    dist.barrier()
    if worst > args.rtol:
        raise SystemExit(f"max relative error {worst:.2e} > --rtol {args.rtol}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
