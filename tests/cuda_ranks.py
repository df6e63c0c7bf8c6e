"""What tests/test_cuda.py runs in processes of their own, on NCCL (a group must not outlive its test).

NEVER RUN ON A GPU: written on a CPU-only machine; read it as the specification of what should hold.

    python -m tests.cuda_ranks host_group                                      # one GPU, a 1-rank group
    torchrun --standalone --nproc-per-node 2 -m tests.cuda_ranks two_ranks     # two GPUs
    torchrun --standalone --nproc-per-node 2 -m tests.cuda_ranks two_ranks --device cpu   # a dry run, gloo

Each prints ``host_group: OK`` / ``rank R: OK ...`` once every check held, and raises (a non-zero exit)
at the first that did not.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os

import torch
import torch.distributed as dist

import dynashard
from dynashard.weights.store import STORE
from tests import models

# bfloat16: see test_cuda.BF16_RTOL (2**-5 of the output's magnitude)
BF16_RTOL = 2**-5


def host_group() -> None:
    """dynashard's host-side messages (handshake, agreements: small CPU tensors) cannot travel on NCCL,
    which has no CPU backend: ``dynashard.comm.protocol.host_group`` gives them a gloo companion over the same
    ranks, made once per group."""
    from dynashard.comm.protocol import host_group as host_of

    torch.cuda.set_device(0)
    # device_id: the README's recipe; NCCL makes its communicator now (eager init), not at the first collective
    dist.init_process_group("nccl", rank=0, world_size=1, store=dist.HashStore(), device_id=torch.device("cuda", 0))
    world = dist.group.WORLD
    host = host_of(world)
    # NOTE: ProcessGroup._device_types (torch 2.13) lists the device types a group has a backend for
    assert torch.device("cpu") not in world._device_types, world._device_types
    assert host is not world and torch.device("cpu") in host._device_types, (host, host._device_types)
    assert dist.get_process_group_ranks(host) == [0], dist.get_process_group_ranks(host)
    assert host_of(world) is host, "host_group made a second companion for the same group"
    gloo = dist.new_group([0], backend="gloo")
    assert host_of(gloo) is gloo, "a group with a CPU backend is its own host group"
    on_host = torch.tensor([3], dtype=torch.int64)
    dist.all_reduce(on_host, op=dist.ReduceOp.MAX, group=host)
    on_gpu = torch.ones(2, device="cuda")
    dist.all_reduce(on_gpu, group=world)
    assert int(on_host) == 3 and torch.equal(on_gpu, torch.ones(2, device="cuda"))
    # World 1: dynashard compiles the graph unsharded (dynamo_backend.py), on the GPU, through Inductor
    torch.manual_seed(0)
    model = models.MLP(256, 512).cuda().eval()
    x = torch.randn(4, 256, device="cuda")
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0})(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32; Triton fuses gelu and the biases
    import torch._inductor.config as inductor_config

    # mode="reduce-overhead" on the NCCL group: recorded once, then replayed; every replay equals eager
    graphs = torch.compile(copy.deepcopy(model), backend=dynashard.backend(mode="reduce-overhead", min_shard_numel=0))
    with torch.no_grad(), inductor_config.patch({"triton.cudagraph_or_error": True}):
        for i in range(4):
            xi = x + i
            torch.compiler.cudagraph_mark_step_begin()
            torch.testing.assert_close(graphs(xi).clone(), model(xi), rtol=1e-4, atol=1e-4)
    dist.destroy_process_group()
    print("host_group: OK", flush=True)


def _greedy(fn, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """bench_decode.decode's loop, with ``input_pos`` on the prompt's device."""
    t, device = prompt.shape[1], prompt.device
    token = fn(prompt, torch.arange(t, device=device))[:, -1].argmax(-1, keepdim=True)
    out = [token]
    for pos in range(t, t + new_tokens - 1):
        token = fn(token, torch.tensor([pos], device=device))[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, 1)


def two_ranks(kind: str) -> None:
    """Every rank: each model against its unsharded self, computed on this rank alone; NCCL carries the
    graphs' collectives, the CPU companion group the per-call handshake. ``kind`` "cpu": a dry run on
    gloo, which checks this script, not the GPU."""
    from benchmarks.bench_decode import SMOKE, Llama
    from dynashard.comm.protocol import host_group as host_of

    timeout = datetime.timedelta(minutes=3)
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    assert (host_of(dist.group.WORLD) is dist.group.WORLD) == (kind == "cpu"), "a gloo group is its own host group"
    options = {"min_shard_numel": 0}
    facts = []
    with torch.no_grad():
        # An MLP, fp32, three batch sizes (the second recompiles with a dynamic batch, then none)
        torch.manual_seed(0)
        mlp = models.MLP(256, 1024).to(device).eval()
        xs = [torch.randn(b, 256, device=device) for b in (4, 9, 2)]
        want = [mlp(x) for x in xs]
        whole = dynashard.held_bytes(mlp)
        fast = torch.compile(mlp, backend="dynashard", options=options)
        err = max(float((fast(x) - w).abs().max()) for x, w in zip(xs, want))
        assert err < 1e-4, f"MLP: max |sharded - unsharded| = {err}"  # fp32, O(1) values: reordered sums only
        assert dynashard.held_bytes(mlp) < 0.6 * whole, (dynashard.held_bytes(mlp), whole)
        facts.append(f"mlp err {err:.1e}")
        # A Llama decoder (GQA, RoPE, SDPA, SwiGLU, vocab-parallel embedding), bfloat16
        torch.manual_seed(0)
        dec = models.LlamaDecoder(vocab=96, hidden=64, n_heads=4, n_kv_heads=2, ffn=176).to(device, torch.bfloat16)
        ids = torch.randint(0, 96, (2, 16), device=device)
        want = dec.eval()(ids)
        got = torch.compile(dec, backend="dynashard", options=options)(ids)
        err, top = float((got.float() - want.float()).abs().max()), float(want.float().abs().max())
        assert err <= BF16_RTOL * top, f"Llama decoder bf16: max |sharded - unsharded| = {err}, logits up to {top}"
        facts.append(f"llama bf16 err {err:.1e} of {top:.1f}")
        # rank 0's deal (weights="rank0") onto this rank's device: only rank 0 holds real weights; its
        # buffers (RoPE's cos/sin, non-persistent) are dealt too, and must land on the device as well
        torch.manual_seed(0)
        if rank == 0:
            held = models.LlamaDecoder(vocab=96, hidden=64, n_heads=4, n_kv_heads=2, ffn=176)
        else:
            with dynashard.empty_weights():
                held = models.LlamaDecoder(vocab=96, hidden=64, n_heads=4, n_kv_heads=2, ffn=176)
        torch.manual_seed(0)
        want = models.LlamaDecoder(vocab=96, hidden=64, n_heads=4, n_kv_heads=2, ffn=176).to(device).eval()(ids)
        dealt = dynashard.parallelize(held, ids, options={**options, "weights": "rank0"}).eval()
        where = {str(t.device) for t in (*dealt.parameters(), *dealt.buffers())}
        assert where == {str(device)}, f"rank 0's deal left tensors on {where}, expected {device}"
        err = float((dealt(ids).float() - want.float()).abs().max())
        assert err < 1e-4, f"rank 0's deal: max |sharded - unsharded| = {err}"  # fp32: reordered sums only
        facts.append(f"rank0 deal err {err:.1e}, all on {device}")
        # bench_decode's model at its --smoke sizes: KV caches in buffers, prefill and decode graphs
        torch.manual_seed(0)
        base = Llama(SMOKE, max_len=8 + 4).to(device).eval()
        twin = copy.deepcopy(base)
        prompt = torch.randint(0, SMOKE.vocab, (1, 8), device=device)
        want = _greedy(base, prompt, 4)
        got = _greedy(torch.compile(twin, backend="dynashard", options=options), prompt, 4)
        assert torch.equal(got, want), f"decode: tokens {got.tolist()}, unsharded {want.tolist()}"
        cache = twin.layers[0].attention.kv_cache.k_cache
        assert STORE.shard_of(cache) is not None and cache.untyped_storage().nbytes() == 0, "cache held whole"
        facts.append(f"decode tokens {got.tolist()[0]} as unsharded, caches sharded")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: OK ({'; '.join(facts)})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["host_group", "two_ranks"])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="two_ranks only; cpu: a dry run of the script on gloo")
    args = parser.parse_args()
    host_group() if args.what == "host_group" else two_ranks(args.device)


if __name__ == "__main__":
    main()
