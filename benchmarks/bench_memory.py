"""Memory freed by dynashard: process RSS per rank before and after the first compiled call.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_memory [--smoke] [--out PATH]

Model: a stack of ``blocks`` MLP blocks ``x + down(gelu(up(x)))`` (nn.Linear, fp32). The default
8 blocks of hidden 2048 / ffn 8192 hold 8 * 2 * 2048 * 8192 * 4 B = 1 GiB of linear weights,
built from the same seed on every rank. For each compiler (a fresh model each time):

1. a tiny throw-away model is compiled first, so that loading Dynamo/Inductor is not counted;
2. the model is built and reference outputs for two batch sizes (``tokens``, ``tokens2``) are
   computed eagerly, before anything is compiled; RSS is read (VmRSS from /proc/self/status);
3. the first call of ``torch.compile(model, backend="dynashard", options={"compiler": ...})``
   shards the weights and frees the full ones; RSS is read after ``gc.collect()``, then again
   after glibc's ``malloc_trim(0)`` (glibc may keep freed heap memory instead of returning it);
4. a call with the second batch size (a recompile after the weights were freed) is checked
   against its reference, and RSS is read once more;
5. the model and compiled model are deleted and ``torch._dynamo.reset()`` is called: RSS should
   return to where the phase started, and the shards should be gone (checked with a weakref).

The peak (VmHWM) is reset before each phase through /proc/self/clear_refs where the kernel
allows it. Expected drop per rank: (1 - 1/N) of the linear weight bytes; "held" counts the
parameter bytes this rank still has (its shards plus anything not sharded). Exits 1 when a
max abs diff exceeds --tol (so --smoke doubles as a CI check).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import weakref

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._common import MLP, OUT_HELP, gather, init, mib, out_path, record, rss, write_json
from dynashard import held_bytes


def trim() -> bool:
    """Ask glibc to hand freed heap memory back to the OS; False where that is not possible."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def phase(args: argparse.Namespace, compiler: str, world: int) -> dict:
    """One compiler: build, reference, first call, second batch size; RSS at each step."""
    options = {"compiler": compiler, "min_shard_numel": args.min_shard_numel}
    torch.manual_seed(0)  # dynashard checks that weights agree across ranks even when it shards nothing
    with torch.no_grad():  # load and warm the compile machinery on a model too small to shard
        torch.compile(nn.Linear(8, 8), backend="dynashard", options={**options, "min_shard_numel": 1 << 30})(
            torch.randn(2, 8)
        )
    torch._dynamo.reset()
    gc.collect()
    trim()
    out = {"compiler": compiler, "peak_reset": reset_peak(), "rss_start": rss()}

    torch.manual_seed(0)
    model = nn.Sequential(*(MLP(args.hidden, args.ffn) for _ in range(args.blocks))).eval()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    out["weight_bytes"] = sum(m.weight.nbytes for m in linears)
    out["bias_bytes"] = sum(m.bias.nbytes for m in linears)
    xs = [torch.randn(1, t, args.hidden) for t in (args.tokens, args.tokens2)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
    gc.collect()
    out["rss_built"] = rss()
    out["held_before"] = held_bytes(model)

    compiled = torch.compile(model, backend="dynashard", options=options)
    with torch.no_grad():
        y1 = compiled(xs[0])
    gc.collect()
    out["rss_first"] = rss()
    out["malloc_trim"] = trim()
    out["rss_first_trim"] = rss()
    out["held_after"] = held_bytes(model)
    with torch.no_grad():
        y2 = compiled(xs[1])
    gc.collect()
    out["rss_second"] = rss()
    out["max_abs_diff"] = [(y - r).abs().max().item() for y, r in zip((y1, y2), refs)]
    out["expected_freed"] = (1 - 1 / world) * out["weight_bytes"]

    # NOTE: the one look into dynashard's private weight store: a weak reference to a shard shows
    # whether deleting the model releases it (RSS alone cannot tell a leak from glibc keeping pages).
    from dynashard.weights.store import STORE

    shard = STORE.shard_of(linears[0].weight)
    shard_ref = weakref.ref(shard) if shard is not None else None
    del compiled, model, linears, refs, y1, y2, shard
    torch._dynamo.reset()
    gc.collect()
    trim()
    out["rss_end"] = rss()
    out["shards_freed_after_del"] = shard_ref is None or shard_ref() is None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tokens2", type=int, default=48, help="second batch size: a recompile after freeing")
    ap.add_argument("--compilers", default="eager,inductor", help="comma-separated dynashard compilers")
    ap.add_argument("--min-shard-numel", type=int, default=1 << 16, help="dynashard option (its default: 65536)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-3, help="exit 1 if any max abs diff exceeds this")
    ap.add_argument("--out", help=OUT_HELP)
    ap.add_argument("--smoke", action="store_true", help="CI sizes: 2 blocks of hidden 64, ffn 256")
    args = ap.parse_args()
    args.out = out_path(args.out, "memory", args.smoke)
    if args.smoke:
        args.hidden, args.ffn, args.blocks, args.tokens, args.tokens2, args.min_shard_numel = 64, 256, 2, 8, 12, 0

    rank, world = init(args.threads)
    results = []
    for compiler in args.compilers.split(","):
        per_rank = gather({"rank": rank, **phase(args, compiler.strip(), world)})
        results.append({"compiler": compiler, "per_rank": per_rank})

    if rank == 0:
        r0 = results[0]["per_rank"][0]
        print(f"\n{args.blocks} MLP blocks hidden={args.hidden} ffn={args.ffn}: linear weights "
              f"{mib(r0['weight_bytes'])} MiB (+ {mib(r0['bias_bytes'])} MiB biases) per full model, world {world}")
        print("RSS in MiB (VmRSS); delta = after first call (after malloc_trim) - after build; "
              "expected = -(1 - 1/N) * weight bytes\n")
        print("| compiler | rank | RSS after build | RSS after 1st call | after malloc_trim | delta | expected "
              "| peak (VmHWM) | RSS after 2nd batch size | params held before -> after | max abs diff (1st, 2nd) |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
        for res in results:
            for r in res["per_rank"]:
                built, first, trimmed = (r[k]["VmRSS"] for k in ("rss_built", "rss_first", "rss_first_trim"))
                diffs = ", ".join(f"{d:.3g}" for d in r["max_abs_diff"])
                print(f"| {res['compiler']} | {r['rank']} | {mib(built)} | {mib(first)} | {mib(trimmed)} "
                      f"| {mib(trimmed - built)} | {mib(-r['expected_freed'])} | {mib(r['rss_second']['VmHWM'])} "
                      f"| {mib(r['rss_second']['VmRSS'])} | {mib(r['held_before'])} -> {mib(r['held_after'])} "
                      f"| {diffs} |")
        dropped_without_trim = all(
            r["rss_built"]["VmRSS"] - r["rss_first"]["VmRSS"] >= 0.5 * r["expected_freed"]
            for res in results for r in res["per_rank"]
        )
        print("\n| compiler | rank | RSS at phase start | RSS after del model + dynamo reset | shards freed |")
        print("|---|---:|---:|---:|---|")
        for res in results:
            for r in res["per_rank"]:
                start, end = mib(r["rss_start"]["VmRSS"]), mib(r["rss_end"]["VmRSS"])
                print(f"| {res['compiler']} | {r['rank']} | {start} | {end} | {r['shards_freed_after_del']} |")
        print(f"\nRSS dropped by at least half the expected amount before malloc_trim: {dropped_without_trim}")
        print(f"peak reset through /proc/self/clear_refs: {r0['peak_reset']} (if False, peak is process-lifetime)")
        keys = ("hidden", "ffn", "blocks", "tokens", "tokens2", "compilers", "min_shard_numel", "smoke")
        config = {k: getattr(args, k) for k in keys}
        config.update(dtype="float32", plan="auto", backend="gloo")
        write_json(args.out, record(config, results, world, args.threads))
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    worst = max(d for res in results for r in res["per_rank"] for d in r["max_abs_diff"])
    if worst > args.tol:
        raise SystemExit(f"max abs diff {worst:.3g} exceeds --tol {args.tol:g}")


if __name__ == "__main__":
    main()
