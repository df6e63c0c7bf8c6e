"""What one extra host-side collective costs a step on this machine, wherever it is placed.

Measured for the per-call handshake (its bar: 1.05x the step): no dynashard, two gloo ranks of
one thread each, a barrier before every timed step, the same step in five variants, interleaved:

- ``A``: compute (an MLP's two matmuls, 32 x 1024 -> 2048 -> 1024) then an all_reduce of its output;
- ``blocking``: a 48-byte all_reduce first (the handshake), then ``A``;
- ``overlapped``: that all_reduce started async, ``A``'s compute, its wait, then the all_reduce (the gate);
- ``sleep``: ``time.sleep(0.0006)`` (about the small all_reduce's own latency here) instead;
- ``compute``: the compute alone.

Launch: ``torchrun --standalone --nproc-per-node 2 tools/bench_host_collective.py [--iters 100]``.
Prints each rank's medians (ms). On the project's 2-core machine (2026-12-02): A 6.4, blocking 10.0,
overlapped 8.3-9.4, compute 4.9-5.5; in another run A 7.8, sleep 9.1; with --iters 40, A 8.0,
blocking 10.0, overlapped 9.4-9.6, sleep 8.3-8.7, compute 5.1-5.3. The small all_reduce costs 2 ms blocking
and 1.4-1.6 ms overlapped, several times its own latency: two ranks computing on two cores leave no core
for gloo's threads (a sleep of its latency costs 0.3-1.3 ms, varying between runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    a, w1, w2 = (torch.randn(*s, generator=g) for s in ((32, 1024), (2048, 1024), (1024, 2048)))
    small = torch.zeros(6, dtype=torch.int64)

    def compute() -> torch.Tensor:
        return torch.nn.functional.gelu(a @ w1.t()) @ w2.t()

    def plain() -> None:
        dist.all_reduce(compute())

    def blocking() -> None:
        dist.all_reduce(small.clone(), op=dist.ReduceOp.MAX)
        plain()

    def overlapped() -> None:
        work = dist.all_reduce(small.clone(), op=dist.ReduceOp.MAX, async_op=True)
        y = compute()
        work.wait()
        dist.all_reduce(y)

    def sleep() -> None:
        time.sleep(0.0006)
        plain()

    variants = {"A": plain, "blocking": blocking, "overlapped": overlapped, "sleep": sleep, "compute": compute}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.iters):
        for name, fn in variants.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    warm = args.iters // 10
    medians = {k: round(statistics.median(v[warm:]) * 1e3, 3) for k, v in times.items()}
    print(f"rank {dist.get_rank()}: median ms {medians}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
