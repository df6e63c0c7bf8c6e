"""Train a small Llama on a 2-D mesh: dynashard over mesh["tp"], FSDP2 or DDP over mesh["dp"], beside a twin.

One node:  torchrun --standalone --nproc-per-node 4 examples/train_2d.py [--tp 2] [--steps 30] [--dp ddp] [--sp]
Two nodes: torchrun --nnodes 2 --nproc-per-node 2 --node-rank R --rdzv-backend c10d \
               --rdzv-endpoint HOST0:29500 --rdzv-id job1 examples/train_2d.py      (on each node, R = 0, 1)

The mesh comes from torchrun's environment: world size / tp data-parallel replicas of tp ranks
each, the tp ranks of a replica consecutive (on one node, when --nproc-per-node is a multiple of
tp). HF Llama (2 layers, hidden 64, 8 heads, 4 K/V heads) reads the Zen of Python a character at a
time; each replica trains on its own batches, the same on its tp ranks. Every rank also trains an
unsharded twin on the replicas' batches concatenated: FSDP2 (or DDP) averages the replicas'
gradients, so the twin's mean loss is the replicas' mean loss, step after step (AdamW, clipping at
1.0). The last line prints both final losses and the largest relative difference over the run; the
run exits 1 if it passes --rtol.

``--dp fsdp2`` (the default): ``parallelize(..., dtensor=True)`` then ``fully_shard`` over mesh["dp"]
on each decoder layer and on the model, each rank holding 1/(tp x dp) of the cut weights and their
AdamW state.
``--dp ddp``: the plain shards, DDP over mesh["dp"] (README, "Several machines"). ``--sp``: sequence
parallelism between the tensor-parallel regions (options={"sequence_parallel": True}).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import io
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import dynashard


def batches(data: torch.Tensor, batch: int, context: int, step: int, replica: int) -> tuple[torch.Tensor, ...]:
    """Replica ``replica``'s batch at ``step``: the same on all its tp ranks, another on every replica."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=g)
    return (torch.stack([data[s:s + context] for s in starts]),
            torch.stack([data[s + 1:s + context + 1] for s in starts]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="sequences per replica")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--dp", default="fsdp2", choices=("fsdp2", "ddp"), help="what shards or replicates over dp")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism between the tp regions")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference allowed")
    args = parser.parse_args()
    import transformers as T

    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    replica, replicas = mesh.get_local_rank("dp"), world // args.tp
    with contextlib.redirect_stdout(io.StringIO()):  # (importing it prints it)
        import this
    text = codecs.decode(this.s, "rot13")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=4, vocab_size=len(chars), max_position_embeddings=args.context,
                           use_cache=False)
    model = T.LlamaForCausalLM(config)
    twin = copy.deepcopy(model)  # trained unsharded on every replica's batch, for comparison
    options = {"group": mesh["tp"], "compiler": args.compiler, "min_shard_numel": 0}  # a toy: shard every layer
    ids, _ = batches(data, args.batch, args.context, 0, replica)
    sp = {"sequence_parallel": True} if args.sp else {}
    dynamic = False if args.sp else None  # (sequence parallelism needs static lengths: one graph per length)
    if args.dp == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        dynashard.parallelize(model, ids, options=options, dtensor=True)  # DTensors on mesh["tp"]
        shard = {"shard_placement_fn": dynashard.fsdp_shard_placement}  # (a fused q/k/v over dp on another dim)
        for layer in model.model.layers:  # torchtitan's way: each block, then the root (one block gathered at a time)
            fully_shard(layer, mesh=mesh["dp"], **shard)
        fully_shard(model, mesh=mesh["dp"], **shard)  # 2-D: this rank's dp part of its tp shard
        fast = torch.compile(model, backend=dynashard.backend(**options, **sp), dynamic=dynamic)
    else:
        dynashard.parallelize(model, ids, options=options)
        torch._dynamo.config.optimize_ddp = False  # one graph (DDP's per-bucket split is refused)
        fast = torch.compile(DDP(model, process_group=mesh["dp"].get_group()),
                             backend=dynashard.backend(**options, **sp), dynamic=dynamic)
    held = dynashard.held_bytes(model) / sum(t.nbytes for t in twin.state_dict().values())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=args.lr)
    worst = 0.0
    for step in range(args.steps):
        ids, target = batches(data, args.batch, args.context, step, replica)
        loss = F.cross_entropy(fast(ids).logits.flatten(0, 1), target.flatten())
        loss.backward()  # FSDP2 (DDP) averages the shards' gradients over the replicas
        every = [batches(data, args.batch, args.context, step, r) for r in range(replicas)]
        both, both_target = torch.cat([x for x, _ in every]), torch.cat([y for _, y in every])
        loss_twin = F.cross_entropy(twin(both).logits.flatten(0, 1), both_target.flatten())
        loss_twin.backward()
        for net, optimizer in ((model, opt), (twin, opt_twin)):
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)  # the unsharded norm (a DTensor under FSDP2)
            optimizer.step()
            optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())  # the replicas' mean loss
        mean, reference = float(mean) / replicas, float(loss_twin.detach())
        worst = max(worst, abs(mean - reference) / abs(reference))
        if dist.get_rank() == 0:
            sys.stderr.write(f"\rstep {step + 1}/{args.steps}  loss {mean:.4f} (unsharded {reference:.4f})")
            sys.stderr.flush()
    if dist.get_rank() == 0:
        sys.stderr.write("\n")
        how = args.dp + (" + sp" if args.sp else "")
        print(f"final loss: dynashard {mean:.4f}, unsharded {reference:.4f}; largest relative difference "
              f"{worst:.1e} over {args.steps} steps (mesh dp={replicas} x tp={args.tp}, {how}, this rank holds "
              f"{held:.0%} of the model's bytes)")
    dist.destroy_process_group()
    return 0 if worst <= args.rtol else 1


if __name__ == "__main__":
    sys.exit(main())
