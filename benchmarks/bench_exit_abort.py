"""How often a gloo process aborts at interpreter exit, with and without a grace sleep at exit.

Launch (a driver; it starts torchrun itself): python benchmarks/bench_exit_abort.py [--runs 30]
[--ranks 4] [--grace 0 0.1] [--smoke] [--out PATH]

Each launch runs ``--ranks`` processes that import Dynamo after ``init_process_group`` (torch
2.13 then keeps the group alive past ``destroy_process_group()``), run 20 funcol all_to_alls,
destroy the group and exit. A gloo worker that frees a finished collective's tensors while the
interpreter is finalizing aborts the process ("terminate called without an active exception").
``--grace S`` registers an atexit sleep of S seconds first, what dynashard does
(``entry._drain_gloo_at_exit``). Counts the launches that exited non-zero with that message.
"""

from __future__ import annotations

import argparse
import atexit
import os
import subprocess
import sys
import time


def worker(grace: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import torch._dynamo  # noqa: F401  (after init: torch keeps the group alive)

    if grace > 0:
        atexit.register(time.sleep, grace)
    name = dist.group.WORLD.group_name
    for i in range(20):
        x = torch.ones(4 * dist.get_world_size()) * i
        funcol.wait_tensor(funcol.all_to_all_single(x, None, None, name))
        del x
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--grace", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--smoke", action="store_true", help="2 launches of 2 ranks per setting")
    ap.add_argument("--out", default="benchmarks/results/exit_abort.json")
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.smoke:
        args.runs, args.ranks = 2, 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import record, write_json

    results = []
    for grace in args.grace:
        aborted = failed = 0
        for i in range(args.runs):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.ranks), os.path.abspath(__file__), "--worker", str(grace)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                failed += 1
                aborted += "terminate called without an active exception" in done.stdout + done.stderr
            print(f"\rgrace {grace} s: {i + 1}/{args.runs} launches, {aborted} aborted", end="", flush=True)
        print()
        results.append({"grace_s": grace, "launches": args.runs, "aborted": aborted, "failed": failed})
    print("| grace at exit | launches | aborted at exit | failed (any reason) |")
    print("|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['grace_s']} s | {r['launches']} | {r['aborted']} | {r['failed']} |")
    write_json(args.out, record(vars(args), results, args.ranks, 1))
    if any(r["failed"] > r["aborted"] for r in results):
        raise SystemExit("a launch failed for another reason than the exit abort")


if __name__ == "__main__":
    main()
