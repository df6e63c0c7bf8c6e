"""What compiling the sharded training graphs without AOTAutograd's CSE costs (``dynashard/_torch``'s
``_no_cse``: the partitioner's CSE merged two collectives of one rank only, where its pieces coincided).

Launch: python -m benchmarks.bench_cse [--layers 2 --hidden 64]

One training step (HF Llama, ``labels=``, 2 K/V heads, GQA) compiled through dynashard's own compile path
(aot_eager: AOTAutograd's min-cut partitioner) on rank 0 of torch's fake process group of 2 (one process, no
data moved), once as dynashard compiles it (CSE off) and once with CSE on: the ops of the forward and backward
graphs the partitioner makes, and the tensors the forward saves for the backward (count and elements).
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch._dynamo.backends import debugging

from dynashard import _torch as private
from dynashard.dynamo_backend import dynashard_backend


def _graphs(layers: int, hidden: int, cse: bool) -> dict[str, tuple[int, int, int]]:
    """Per graph: (call_function ops, outputs, elements of the tensor outputs)."""
    import transformers as T

    graphs: dict[str, tuple[int, int, int]] = {}
    nop, no_cse = debugging.boxed_nop, private._no_cse

    def capture(gm, example_inputs):
        outs = list(gm.graph.nodes)[-1].args[0]
        tensors = [n.meta["val"] for n in outs if isinstance(getattr(n, "meta", {}).get("val"), torch.Tensor)]
        graphs["backward" if "forward" in graphs else "forward"] = (
            sum(n.op == "call_function" for n in gm.graph.nodes), len(outs), sum(t.numel() for t in tensors))
        return nop(gm, example_inputs)

    debugging.boxed_nop = capture
    private._no_cse = contextlib.nullcontext if cse else no_cse
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        torch.manual_seed(0)
        lm = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                              num_hidden_layers=layers, num_attention_heads=4,
                                              num_key_value_heads=2, vocab_size=100))
        fast = torch.compile(lm, backend=lambda gm, ex: dynashard_backend(
            gm, ex, {"min_shard_numel": 0, "compiler": "aot_eager"}))
        ids = torch.randint(0, 100, (2, 16))
        fast(ids, labels=ids, use_cache=False).loss.backward()
    finally:
        dist.destroy_process_group()
        debugging.boxed_nop, private._no_cse = nop, no_cse
    return graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    print("graph     CSE       ops  saved/outputs  elements")
    for cse in (False, True):
        for kind, (ops, outs, elements) in _graphs(args.layers, args.hidden, cse).items():
            print(f"{kind:9} {'on' if cse else 'off':5} {ops:7} {outs:14} {elements:9}")


if __name__ == "__main__":
    main()
