"""Reproduces a torch 2.13 bug: a gloo process aborts at interpreter exit after a run that succeeded.

Not a benchmark of dynashard: it counts how often a bare funcol loop aborts at exit, with and
without the grace sleep dynashard registers at exit (``entry._drain_gloo_at_exit``).

Launch (a driver; it starts torchrun itself), from the repository root:
    python tools/bench_exit_abort.py [--runs 30] [--ranks 4] [--grace 0 0.1] [--smoke] [--out PATH]

The bug: once ``torch._dynamo`` is imported after ``init_process_group``, torch 2.13 keeps the
process group alive past ``destroy_process_group()`` (something still references the group
object), so gloo's worker threads outlive the script. A worker that frees a finished
collective's tensors takes the GIL; when the interpreter is already finalizing, the thread is
ended inside a destructor and the process aborts with "terminate called without an active
exception" (SIGABRT). Each launch here runs ``--ranks`` processes that import Dynamo after
``init_process_group``, run 20 funcol all_to_alls, destroy the group and exit; ``--grace S``
registers an atexit sleep of S seconds first. It counts the launches that exited non-zero with
that message.

Upstream: pytorch/pytorch#190489 (open) reports background threads, a gloo
``AsyncAllgatherWork`` among them, aborting in ``take_gil()`` while Python finalizes;
pytorch/pytorch#179291 (a pull request, closed unmerged) proposed destroying process groups from
an atexit handler for the same abort. Neither mentions Dynamo keeping the group alive after
``destroy_process_group()``, the part that makes an explicit destroy not enough here.

Last record (``tools/exit_abort.json``, 2026-11-30, torch 2.13.0+cpu, 2-core Xeon, 4 ranks,
30 launches per setting): 3 of 30 aborted without a grace sleep, 0 of 30 with 0.1 s.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
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


def write_record(path: str, args: argparse.Namespace, results: list[dict]) -> None:
    import torch

    rec = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "hardware": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                     "python": platform.python_version()},
        "world_size": args.ranks,
        "threads_per_rank": 1,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
        "results": results,
    }
    with open(path, "w") as f:
        json.dump(rec, f, indent=2)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--grace", type=float, nargs="+", default=[0.0, 0.1])
    ap.add_argument("--smoke", action="store_true", help="2 launches of 2 ranks per setting")
    ap.add_argument("--out", default=None, help="JSON record (default: tools/exit_abort.json; --smoke: none)")
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.smoke:
        args.runs, args.ranks = 2, 2
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
    here = os.path.dirname(os.path.abspath(__file__))
    out = args.out or (None if args.smoke else os.path.join(here, "exit_abort.json"))
    if out:
        write_record(out, args, results)
        print(f"wrote {out}")
    if any(r["failed"] > r["aborted"] for r in results):
        raise SystemExit("a launch failed for another reason than the exit abort")


if __name__ == "__main__":
    main()
