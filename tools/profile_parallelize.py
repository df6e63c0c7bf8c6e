"""Where time to the first output goes when loading with dynashard.parallelize (benchmarks/bench_load.py).

Launch (after bench_load.py has written its checkpoint to /tmp/dynashard-bench-load):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/profile_parallelize.py [DIR]

Prints, on rank 0, the seconds of the imports, of ``parallelize`` (meta model + the HF safetensors
directory) and of the user's compile and first call, then a cProfile of ``parallelize`` by
cumulative time (``PROFILE_FILTER=dynashard``: dynashard's own functions only). Measured on the
project's 2-core machine (2.16 GiB Llama, world 2, compiler eager,
checkpoint in the page cache): parallelize 6.3 s, of which Dynamo's trace of the model about 2.7 s and
the backend (aten trace, planning, rewrite, cutting) 2.8 s; compile + first call 2.4 s (a second
Dynamo trace and planning). Later runs gave parallelize 6.4 s (9.1 s with the checkpoint out of the page
cache) and compile + first call 2.6-2.7 s: the
split between tracing and the rest is what to read, not the totals.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import sys
import time


def main() -> None:
    t0 = time.time()
    import torch
    import torch.distributed as dist
    import transformers as T

    import dynashard

    imports = time.time() - t0
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    where = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dynashard-bench-load"
    with open(f"{where}/bench_config.json") as f:
        cfg = T.LlamaConfig(**json.load(f))
    ids = torch.load(f"{where}/reference.pt")["ids"]
    with dynashard.empty_weights():
        model = T.LlamaForCausalLM(cfg).eval()
    profile = cProfile.Profile()
    t1 = time.time()
    profile.enable()
    dynashard.parallelize(model, ids, options={"compiler": "eager"}, checkpoint=f"{where}/hf", use_cache=False)
    profile.disable()
    t2 = time.time()
    with torch.no_grad():
        torch.compile(model, backend=dynashard.backend(compiler="eager"))(ids, use_cache=False)
    t3 = time.time()
    if dist.get_rank() == 0:
        print(f"imports {imports:.1f} s, parallelize {t2 - t1:.1f} s, compile + first call {t3 - t2:.1f} s")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(os.environ.get("PROFILE_FILTER", ""), 40)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
