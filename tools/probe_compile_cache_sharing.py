"""Two ``torch.compile(model, backend="dynashard", options=o)`` objects on one HF Llama share Dynamo's cache:
the second call traces nothing (issue 29 item 4: the route for parallelize's trace to serve the user's compile).
PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/probe_compile_cache_sharing.py
(2026-12-03: (2.6 s, 1 graph) then (0.02 s, 0 graphs) on each rank)."""
import time

import torch
import torch._dynamo.utils as dynamo_utils
import torch.distributed as dist
import transformers as T

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=8, num_key_value_heads=4, vocab_size=128)).eval()
    ids = torch.randint(0, 128, (1, 5))
    opts = {"min_shard_numel": 0, "compiler": "eager"}
    out = []
    for _ in range(2):
        start, graphs = time.perf_counter(), dynamo_utils.counters["stats"]["unique_graphs"]
        with torch.no_grad():
            torch.compile(model, backend="dynashard", options=opts)(ids)
        out.append((round(time.perf_counter() - start, 2), dynamo_utils.counters["stats"]["unique_graphs"] - graphs))
    print(dist.get_rank(), "two torch.compile objects, same backend and options: (s, new graphs) =", out, flush=True)
    dist.destroy_process_group()
