"""How long the test harness takes to start ranks: "spawn" against a forkserver with torch preloaded.

Launch: python tools/bench_spawn.py

Runs a 2-rank job (compile an MLP with dynashard, eager) three times through tests/multiproc.py with
each start method and prints the mean seconds per job. Measured on the project's 2-core machine:
spawn 2.9 s, forkserver with torch, Dynamo, dynashard and the test models preloaded 0.95 s (the
harness uses the latter: tests/multiproc.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tests.multiproc as harness  # noqa: E402 - after the path above


def job(rank: int, world: int) -> bool:
    import torch

    import dynashard
    from tests import models

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.build("mlp", 32, 96)
    with torch.no_grad():
        torch.compile(model, backend=dynashard.backend(compiler="eager", min_shard_numel=0))(torch.randn(2, 32))
    return True


def main() -> None:
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["torch", "torch._dynamo", "dynashard.dynamo_backend", "tests.battery"])
        harness._CTX = ctx
        t = time.time()
        for _ in range(3):
            harness.run_ranks(job, 2)
        print(f"{method}: {(time.time() - t) / 3:.2f} s per 2-rank job")


if __name__ == "__main__":
    main()
