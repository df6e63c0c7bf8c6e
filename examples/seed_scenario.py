"""The seed prototype's scenario (docs/design.md, "The seed prototype"), through the dynashard backend.

    torchrun --standalone --nproc-per-node 4 examples/seed_scenario.py

Every rank builds its own ``nn.Linear(64, 24)`` and its own batch after
``torch.manual_seed(rank)``: different weights and different inputs on every rank. Each rank
gets its own model's output on its own batch while the linear is split across the ranks: the
weight's input-feature blocks are exchanged once at compile time (rank j keeps block j of every
rank's weight), and each call is one all-to-all of the input's feature blocks, one local batched
matmul over every rank's rows and one reduce-scatter back to the owners. The batch size may
change between calls without a recompile per size.
"""

import torch
import torch.distributed as dist

OPTIONS = {"inputs": "per_rank", "weights": "per_rank", "plan": {"*": "rowwise"}, "compiler": "eager"}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different weights and inputs on every rank, as in the seed
    model = torch.nn.Linear(64, 24)
    batches = [torch.rand(n, 64) for n in (100, 37, 5)]
    with torch.no_grad():
        expected = [model(x) for x in batches]
        sharded = torch.compile(model, backend="dynashard", options=OPTIONS)
        for x, want in zip(batches, expected):
            got = sharded(x)
            assert torch.allclose(got, want, atol=1e-5), (rank, float((got - want).abs().max()))
    held = sum(t.numel() for t in [model.weight] if t.untyped_storage().nbytes())
    print(f"[RANK {rank}] PASSED (batches 100, 37, 5; full weight still held: {bool(held)})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
