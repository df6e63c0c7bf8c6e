"""A LoRA fine-tuning step at world N against full fine-tuning and the unsharded LoRA twin, side by side.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_lora [--layers 4] [--hidden 256]
        [--tokens 512] [--rank 16] [--compiler eager] [--base int8] [--iters 10] [--smoke] [--out PATH]

Model: HF Llama (transformers' LlamaForCausalLM from a config, random weights; 8 heads, 4 K/V heads,
SwiGLU ``intermediate = 2.75 x hidden``, vocab 2048), float32, batch 1 of ``--tokens`` tokens, the
same weights and inputs on every rank. LoRA: PEFT ``LoraConfig(r, lora_alpha=2r)`` on q, k, v, o,
gate, up, down (7 per layer), base frozen. ``--base int8``: QLoRA's layout, the base's linears quantized by
torchao's ``Int8WeightOnlyConfig`` (per-row int8) before PEFT wraps them (``TorchaoLoraLinear``); "full sharded"
is then left out (int8 weights do not train).

Systems (each a deep copy of the same model with an SGD of its own, lr 1e-3, over its trainable
parameters; the step is ``zero_grad``, cross-entropy of the logits against random tokens, backward,
``step``):
  full sharded    dynashard.parallelize(model) then torch.compile(backend=dynashard.backend(compiler=...)):
                  every parameter trained (full fine-tuning)
  lora sharded    the same, the PEFT model: only the adapters trained
  lora unsharded  the PEFT model compiled with torch.compile(backend=<compiler>), every rank all of it

Correctness, before timing: the first step of "lora sharded" and "lora unsharded" start from the same
weights on the same tokens; the logits and each adapter's raw gradient (dynashard.full_tensor of a cut
one) are compared, the largest difference recorded; the run exits 1 after writing its record if it
exceeds 1e-4 (relative to each gradient's largest element).

Collectives per step: the c10d:: op events of the second step in torch.profiler sessions (forward,
backward, optimizer each), as bench_train counts them (train_metrics.count_collectives).

Timing: every system stepped twice (compiles, the check), then timed interleaved (one step of each
per round, a barrier before each), the slowest rank's median and min. Ratios: lora sharded / full
sharded and lora sharded / lora unsharded, of the medians.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import dynashard
from benchmarks._common import Progress, init, out_path, record, summarize, time_interleaved, write_json
from benchmarks.train_metrics import PHASES, count_collectives

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SYSTEMS = ("full sharded", "lora sharded", "lora unsharded")
LORA_ONLY = ("lora sharded", "lora unsharded")  # (--base int8: int8 weights do not train)


class Logits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def build_base(args: argparse.Namespace) -> nn.Module:
    import transformers as T

    torch.manual_seed(0)
    ffn = int(2.75 * args.hidden) // 8 * 8
    model = T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=ffn, num_hidden_layers=args.layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=args.vocab))
    if args.base == "int8":
        import warnings

        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig())
        # (PEFT's TorchaoLoraLinear warns that merge() needs HF's TorchAoConfig: no merge here)
        warnings.filterwarnings("ignore", "TorchaoLoraLinear was instantiated")
    return model


def with_lora(base: nn.Module, r: int) -> nn.Module:
    import peft

    torch.manual_seed(1)
    lm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS))
    g = torch.Generator().manual_seed(1)  # B at random: PEFT's zeros would make every B gradient's check trivial
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return lm


class System:
    def __init__(self, model: nn.Module, run: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.model, self.run = model, run
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=1e-3)

    def step(self, ids: torch.Tensor, target: torch.Tensor, phase: Callable[[str, Callable[[], Any]], Any]) -> Any:
        self.opt.zero_grad(set_to_none=True)
        loss = phase("forward", lambda: F.cross_entropy(self.run(ids).flatten(0, 1), target.flatten()))
        phase("backward", loss.backward)
        phase("optimizer", self.opt.step)
        return loss


def build(name: str, base: nn.Module, adapted: nn.Module, ids: torch.Tensor, args: argparse.Namespace) -> System:
    """``name``'s system over a deep copy of ``base`` or of ``adapted`` (one PEFT model: the same A)."""
    options = {"min_shard_numel": 0, "compiler": args.compiler}
    if name == "lora unsharded":
        model = Logits(copy.deepcopy(adapted))
        return System(model, torch.compile(model, backend=args.compiler, dynamic=False))
    model = Logits(copy.deepcopy(adapted if name == "lora sharded" else base))
    dynashard.parallelize(model, ids, options=options)
    return System(model, torch.compile(model, backend=dynashard.backend(**options), dynamic=False))


def _plain(_name: str, fn: Callable[[], Any]) -> Any:
    return fn()


def check(sharded: System, twin: System, ids: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """The first step of both from the same weights: logits and every adapter's raw gradient."""
    out, want = sharded.run(ids), twin.run(ids)
    F.cross_entropy(out.flatten(0, 1), target.flatten()).backward()
    F.cross_entropy(want.flatten(0, 1), target.flatten()).backward()
    reference = dict(twin.model.named_parameters())
    worst = 0.0
    for name, p in sharded.model.named_parameters():
        if p.requires_grad:
            got, g = dynashard.full_tensor(p.grad), reference[name].grad
            worst = max(worst, float((got - g).abs().max()) / (float(g.abs().max()) or 1.0))
    for s in (sharded, twin):
        s.opt.zero_grad(set_to_none=True)
    return {"logits_max_abs_diff": float((out - want).abs().max()), "grad_max_rel_err": worst}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rank", type=int, default=16, help="LoRA's r")
    p.add_argument("--compiler", default="eager", help="dynashard's compiler option and the twin's backend")
    p.add_argument("--base", choices=("float", "int8"), default="float",
                   help="int8: the base's linears torchao per-row int8 weight-only (QLoRA's layout)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="2 layers, hidden 64, 64 tokens, 2 iterations")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.vocab, args.tokens, args.rank, args.iters, args.warmup = 2, 64, 256, 64, 4, 2, 1
    return args


def main() -> None:
    args = parse()
    rank, world = init(args.threads)
    names = LORA_ONLY if args.base == "int8" else SYSTEMS
    progress = Progress(len(names) * 2 + args.warmup + args.iters, rank == 0)
    base = build_base(args)
    adapted = with_lora(base, args.rank)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    target = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    systems, per_system = {}, {}
    for name in names:
        progress.step(label=f"building {name}")
        systems[name] = build(name, base, adapted, ids, args)
    checked = check(systems["lora sharded"], systems["lora unsharded"], ids, target)
    for name, s in systems.items():
        progress.step(label=f"second step of {name} (collectives)")
        counts = count_collectives(lambda phase, s=s: s.step(ids, target, phase))
        per_system[name] = {"first_s": 0.0, "max_abs_diff": None, "collectives": {k: counts[k]["text"] for k in PHASES},
                            "trainable_params": sum(p.numel() for p in s.params)}
    times = time_interleaved({n: (lambda s=s: s.step(ids, target, _plain)) for n, s in systems.items()},
                             args.warmup, args.iters, on_round=lambda: progress.step(label="timing"))
    progress.close()
    results = summarize(rank, per_system, times)
    by = {r["system"]: r for r in results}
    ratios = {"lora sharded / lora unsharded": by["lora sharded"]["median_ms"] / by["lora unsharded"]["median_ms"]}
    if "full sharded" in by:
        ratios["lora sharded / full sharded"] = by["lora sharded"]["median_ms"] / by["full sharded"]["median_ms"]
    config = {k: v for k, v in vars(args).items() if k != "out"}
    rec = record({**config, "targets": TARGETS, "dtype": "float32", "batch": 1, "optimizer": "SGD lr 1e-3"},
                 {"systems": results, "ratios": ratios, "check": checked}, world, args.threads)
    ok = checked["grad_max_rel_err"] < 1e-4 and checked["logits_max_abs_diff"] < 1e-4
    if rank == 0:
        path = out_path(args.out, f"lora_w{world}" + ("_int8" if args.base == "int8" else ""), args.smoke)
        write_json(path, rec)
        for r in results:
            c = per_system[r["system"]]["collectives"]
            print(f"{r['system']:16s} median {r['median_ms']:8.1f} ms  min {r['min_ms']:8.1f} ms  "
                  f"forward: {c['forward']}; backward: {c['backward']}")
        for k, v in ratios.items():
            print(f"{k}: {v:.2f}x")
        print(f"check: {checked}; record: {path}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
