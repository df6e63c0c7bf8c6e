"""Training state per rank on a dp x tp mesh: dynashard over tp with DDP or with FSDP2 over dp, side by side.

Launch: torchrun --standalone --nproc-per-node 4 -m benchmarks.bench_fsdp2 [--tp 2] [--layers 2]
        [--tokens 256] [--compiler inductor] [--iters 5] [--smoke] [--out PATH]

Workload: workloads.py's decoder (tests/models.LlamaDecoder: hidden 1024, 8 heads, ffn 2816, vocab
32000), batch 1, float32, cross-entropy against random next tokens; every replica trains on the same
batch here (the bytes and the step do not depend on it; the 2-D training's correctness is
tests/test_training_2d.py's).

Systems, each a deep copy of the same model with an AdamW of its own:
  tp + DDP     dynashard.parallelize over mesh["tp"], DDP over mesh["dp"] around it, compiled with
               the dynashard backend (README "Several machines"): parameters, gradients and AdamW
               state 1/tp per rank (the weights dynashard keeps whole: all of them)
  tp + FSDP2   dynashard.parallelize(..., dtensor=True) over mesh["tp"], fully_shard over mesh["dp"],
               compiled: 1/(tp x dp) of the cut weights and 1/dp of the whole ones

Per rank, after one step (the largest rank's): the bytes of the parameters the model holds, of their
gradients, and of AdamW's state (exp_avg, exp_avg_sq); a DTensor counts as its local tensor. DDP's
gradient buckets are not counted (a copy of the gradients' bytes unless gradient_as_bucket_view=True).
Step (forward, loss, backward, AdamW step) timed interleaved, the slowest rank's median. Correctness,
before timing: each system's first loss against unsharded eager's (1e-4 relative); the run exits 1
after writing its record if one differs.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import dynashard
from benchmarks._common import OUT_HELP, gather, init, out_path, record, time_interleaved, write_json
from benchmarks.workloads import SMOKE, WORKLOADS, Sizes


def local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors if t is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", help=OUT_HELP.replace("<script>", "fsdp2_w<world>"))
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    rank, world = init(1)
    args.out = out_path(args.out, f"fsdp2_w{world}", args.smoke)
    sizes = Sizes(n_layer=args.layers)
    if args.smoke:
        sizes, args.tokens, args.iters, args.warmup, args.compiler = SMOKE, 16, 1, 0, "eager"
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch._dynamo.config.optimize_ddp = False  # (DDP's per-bucket split is refused: README)
    torch.manual_seed(0)
    base = WORKLOADS["decoder"].build(sizes, args.tokens)
    ids = torch.randint(0, sizes.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, sizes.vocab, (1, args.tokens), generator=torch.Generator().manual_seed(2))

    def loss_of(model):
        return F.cross_entropy(model(ids).flatten(0, 1), target.flatten())

    with torch.no_grad():
        reference = float(loss_of(base))
    whole_bytes = sum(p.nbytes for p in base.parameters())
    options = {"compiler": args.compiler, "group": mesh["tp"]}
    systems = {}
    for name in ("tp + DDP", "tp + FSDP2"):
        model = copy.deepcopy(base)
        if name == "tp + DDP":
            dynashard.parallelize(model, ids, options=options)
            fast = torch.compile(DDP(model, process_group=mesh["dp"].get_group()), backend=dynashard.backend(**options))
        else:
            dynashard.parallelize(model, ids, options=options, dtensor=True)
            fully_shard(model, mesh=mesh["dp"])
            fast = torch.compile(model, backend=dynashard.backend(**options))
        systems[name] = (model, fast, torch.optim.AdamW(model.parameters(), lr=1e-4))
    per_system, calls, wrong = {}, {}, []
    for name, (model, fast, opt) in systems.items():
        def step(fast=fast, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(fast)
            loss.backward()
            opt.step()
            return loss

        loss = float(step().detach())  # (compiles)
        if abs(loss - reference) > 1e-4 * abs(reference):
            wrong.append(f"{name}: loss {loss} against unsharded eager's {reference}")
        params = list(model.parameters())
        state = [t for p in params for k, t in opt.state[p].items() if k != "step"]
        per_system[name] = {"parameter_bytes": local_bytes(params), "loss": loss,
                            "gradient_bytes": local_bytes(p.grad for p in params),
                            "optimizer_state_bytes": local_bytes(state)}
        calls[name] = step
    times = time_interleaved(calls, args.warmup, args.iters)
    results = []
    keys = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "median_ms")
    for name, mine in per_system.items():  # the largest rank's bytes, the slowest rank's median
        everyone = gather({**mine, "median_ms": 1e3 * statistics.median(times[name])})
        row = {"system": name, **{k: max(r[k] for r in everyone) for k in keys}}
        row["parameter_fraction"] = row["parameter_bytes"] / whole_bytes
        results.append({**row, "per_rank": everyone})
    wrong = sorted({w for ws in gather(wrong) for w in ws})
    config = {"workload": "decoder", "sizes": dataclasses.asdict(sizes), "tokens": args.tokens, "tp": args.tp,
              "dp": world // args.tp, "compiler": args.compiler, "iters": args.iters, "warmup": args.warmup,
              "model_parameter_bytes": whole_bytes, "wrong": wrong}
    if rank == 0:
        write_json(args.out, record(config, results, world, 1))
        print(f"model: {whole_bytes / 2**20:.1f} MiB of parameters; mesh dp={world // args.tp} x tp={args.tp}")
        for r in results:
            print(f"{r['system']:10s} per rank: parameters {r['parameter_bytes'] / 2**20:7.1f} MiB "
                  f"({r['parameter_fraction']:.3f}), gradients {r['gradient_bytes'] / 2**20:7.1f} MiB, AdamW state "
                  f"{r['optimizer_state_bytes'] / 2**20:7.1f} MiB; step {r['median_ms']:8.1f} ms")
        print("wrong:", wrong or "none", "->", args.out)
    if wrong:
        sys.exit(1)


if __name__ == "__main__":
    main()
