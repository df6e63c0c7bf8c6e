"""Two ``torch.compile(model, backend="dynashard", options=o)`` objects on one HF Llama share Dynamo's cache:
the second call traces nothing (the route for parallelize's trace to serve the user's compile).
PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/probe_compile_cache_sharing.py
(2026-12-03: (2.6 s, 1 graph) then (0.02 s, 0 graphs) on each rank). The same with ``dynashard.backend(**o)``
(a BoundBackend, equal to another with equal options) on two MLPs: the second compile of one model traces
nothing, and the other model gets its own graph, both exact (2026-12-03: (0.5 s, 1), (0.007 s, 0), then 1 graph
for the other model; errors 1.2e-7 and 1.8e-7. Before BoundBackend, a closure: (0.226 s, 1) for the second).
Also the two aten trace modes on the Dynamo graph of a 10-layer Llama on rank 0 (quiet, in one process:
symbolic 0.40-0.65 s, fake 0.38-0.39 s; beside a test run: 1.22-1.53 s against 1.06-1.12 s; at most a quarter
of that one trace: not the way to the issue's target)."""
import time

import torch
import torch._dynamo.utils as dynamo_utils
import torch.distributed as dist
import transformers as T


def bound_probe() -> None:
    import dynashard
    from tests import models

    torch.manual_seed(0)
    a, b, x = models.MLP(32, 96), models.MLP(32, 96), torch.randn(4, 32)
    with torch.no_grad():
        ref_a, ref_b = a(x), b(x)
        out = []
        for model in (a, a, b):
            start, graphs = time.perf_counter(), dynamo_utils.counters["stats"]["unique_graphs"]
            y = torch.compile(model, backend=dynashard.backend(compiler="eager", min_shard_numel=0))(x)
            err = float((y - (ref_a if model is a else ref_b)).abs().max())
            out.append((round(time.perf_counter() - start, 3), dynamo_utils.counters["stats"]["unique_graphs"] - graphs,
                        err))
    print(dist.get_rank(), "dynashard.backend(**o) three times (model a, a, b): (s, new graphs, max err) =", out,
          flush=True)


def aten_trace_modes() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from dynashard import _torch as private

    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=10,
                                             num_attention_heads=8, num_key_value_heads=4, vocab_size=1000)).eval()
    got = {}

    def capture(gm, _example_inputs):
        got["gm"], got["fakes"] = gm, private.backend_fakes(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(torch.randint(0, 1000, (1, 32)), use_cache=False)
    gm, fakes = got["gm"], got["fakes"]
    for _ in range(3):
        times = []
        for mode in ("symbolic", "fake"):
            start = time.perf_counter()
            with torch.no_grad():
                if mode == "symbolic":
                    private.trace_aten(gm, fakes)
                else:
                    with private.fake_mode_of(fakes):
                        make_fx(gm, tracing_mode="real", record_module_stack=False)(*fakes)
            times.append(round(time.perf_counter() - start, 3))
        print("aten trace of a 10-layer Llama's Dynamo graph: (symbolic s, fake s) =", times, flush=True)


def main() -> None:
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
    bound_probe()
    if dist.get_rank() == 0:
        aten_trace_modes()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
