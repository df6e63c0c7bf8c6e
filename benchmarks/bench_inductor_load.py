"""What a new process pays before a graph Inductor cached on disk runs: part of a warm restart, dynashard's or not.

Launch: python -m benchmarks.bench_inductor_load [--layers 1,8] [--repeats 3] [--out PATH]

Each measurement is a new Python process (``python -c``, torch imported before the clock starts) that compiles a
``Sequential`` of ``--layers`` ``Linear(64, 64)`` each followed by a GELU (a C++ kernel: a graph of matmuls
alone has none, and loads without the probe below) with plain ``torch.compile`` (Inductor, no dynashard: what is
measured is Inductor's own cost, which HF's TP under ``torch.compile`` and dynashard pay alike) on a cache the
first, unrecorded process of each configuration filled (``TORCHINDUCTOR_CACHE_DIR``, a fresh directory per
run of this script). Columns, seconds:

- ``first call``: the compiled module's first call (Dynamo's trace, the FX graph cache's hit, the load of the
  cached module and its kernels);
- ``pick_vec_isa``: ``torch._inductor.cpu_vec_isa.pick_vec_isa()`` called on its own before the first call, which
  it then leaves out: on x86 it builds a test library per vector instruction set and loads each in a child Python
  (Inductor needs the answer to name the cached kernels' build), once per process;
- ``torch_key``: ``torch._inductor.codecache.torch_key()`` the same way (the hash of torch's sources in every
  cache key); "n/a" where this torch release has no such function.

Three variants per layer count, alternated per repeat: ``plain`` (the first call alone), ``split`` (the two
functions first, then the first call) and ``isa_ok`` (``TORCHINDUCTOR_VEC_ISA_OK=1``: Inductor's setting that trusts
``/proc/cpuinfo`` instead of the probe's builds and loads). Medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
import torch
layers, split = int(sys.argv[1]), sys.argv[2] == "split"
torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())])
x = torch.randn(4, 64)
out = {}
if split:  # (Inductor's internals, as torch 2.13 names them: a release without one reports None for it)
    for name, module, fn in (("pick_vec_isa", "cpu_vec_isa", "pick_vec_isa"), ("torch_key", "codecache", "torch_key")):
        try:
            call = getattr(__import__(f"torch._inductor.{module}", fromlist=[fn]), fn)
        except (ImportError, AttributeError):
            out[name] = None
            continue
        start = time.perf_counter(); call(); out[name] = time.perf_counter() - start
start = time.perf_counter()
torch.compile(model)(x)
out["first call"] = time.perf_counter() - start
print(json.dumps(out))
"""


def _child(layers: int, variant: str, cache: str) -> dict[str, float]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
    if variant == "isa_ok":
        env["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(layers), "split" if variant == "split" else "plain"],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({layers} layers, {variant}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="a JSON file for every measurement")
    args = parser.parse_args()
    variants = ("plain", "split", "isa_ok")
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as root:
        for layers in [int(n) for n in args.layers.split(",")]:
            cache = os.path.join(root, f"inductor-{layers}")
            _child(layers, "plain", cache)  # fills the cache; not recorded
            runs = {v: [] for v in variants}
            for _ in range(args.repeats):
                for variant in variants:
                    runs[variant].append(_child(layers, variant, cache))
            raw[layers] = runs
            med = {v: {k: None if any(r[k] is None for r in runs[v]) else statistics.median(r[k] for r in runs[v])
                       for k in runs[v][0]} for v in variants}
            rows.append((layers, med["plain"]["first call"], med["split"]["pick_vec_isa"], med["split"]["torch_key"],
                         med["split"]["first call"], med["isa_ok"]["first call"]))
    print("| layers | first call | pick_vec_isa | torch_key | first call after both | first call, VEC_ISA_OK=1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print("| " + " | ".join([str(row[0])] + ["n/a" if v is None else f"{v:.2f}" for v in row[1:]]) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": __import__("torch").__version__, "repeats": args.repeats, "runs": raw}, f, indent=1)


if __name__ == "__main__":
    main()
