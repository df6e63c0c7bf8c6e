"""Int8 weight-only decode at world N: dynashard's cut int8 model against the int8 model unsharded and the
float32 model cut.

Launch: torchrun --standalone --nproc-per-node 2 -m benchmarks.bench_quantized [--layers 4 --dim 1024 --heads 16
        --kv-heads 8 --ffn 2816 --vocab 8192] [--prompt 32 --new-tokens 32] [--reps 3 --warmup 1] [--smoke] [--out PATH]

Model: transformers' ``LlamaForCausalLM`` from one seed on every rank (random weights), ``use_cache=True`` with
HF's default DynamicCache, batch 1, greedy: a prefill of ``--prompt`` tokens, then ``--new-tokens - 1`` decode
steps of one token each. int8 systems: ``torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`` (per-row
scales; torchao's weight-only path ``mm(x, qdata.t().to(f32)) * scale``).

Systems (every one run eagerly underneath: the comparison is the cut, not a compiler):
  int8 unsharded     the int8 model, every rank decoding all of it (the token reference for int8)
  int8 dynashard     torch.compile(int8 copy, backend="dynashard", options={"compiler": "eager"}): qdata cut
                     by rows / columns like the float layers, KV cache held by heads
  fp32 dynashard     the same on the float32 model (tokens checked against the float32 model unsharded)

Tokens, before timing: each dynashard system's greedy tokens equal its unsharded model's (exit 1 otherwise).
Timing: ``--warmup`` untimed and ``--reps`` timed rounds, one whole generation of every system per round
(interleaved, a barrier before each); ms/token: the median over every decode step of every timed round, the
slowest rank's. Bytes per rank: ``dynashard.held_bytes`` (a cut weight as its shard; an int8 weight as its int8
data, scales and zero points), the largest rank's. Ratios: each system against "int8 unsharded".
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks._common import OUT_HELP, gather, init, mib, out_path, record, write_json
from dynashard import held_bytes

SYSTEMS = ("int8 unsharded", "int8 dynashard", "fp32 dynashard")


def build(args):
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(hidden_size=args.dim, intermediate_size=args.ffn, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, num_hidden_layers=args.layers, vocab_size=args.vocab,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return T.LlamaForCausalLM(config).eval()


def quantized(model):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = copy.deepcopy(model)
    quantize_(model, Int8WeightOnlyConfig())
    return model


@torch.no_grad()
def generate(fn, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy tokens and the seconds of each decode step (the model call and its argmax)."""
    out = fn(input_ids=ids, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    tokens, steps = [tok], []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        out = fn(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t0)
        tokens.append(tok)
    return torch.cat(tokens, 1), steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    ap.add_argument("--out", help=OUT_HELP)
    args = ap.parse_args()
    args.out = out_path(args.out, "quantized", args.smoke)
    if args.smoke:
        args.layers, args.dim, args.heads, args.kv_heads, args.ffn, args.vocab = 1, 64, 8, 4, 128, 96
        args.prompt, args.new_tokens, args.reps, args.warmup = 5, 4, 1, 0
    rank, world = init(args.threads)
    base = build(args)
    ids = torch.randint(3, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    options = {"compiler": "eager", "min_shard_numel": 0 if args.smoke else 65536}
    int8 = quantized(base)
    fp32_tokens, _ = generate(base, ids, args.new_tokens)
    models = {"int8 unsharded": int8, "int8 dynashard": quantized(base), "fp32 dynashard": copy.deepcopy(base)}
    calls = {name: (m if name.endswith("unsharded") else torch.compile(m, backend="dynashard", options=options))
             for name, m in models.items()}
    want = {"int8 unsharded": None, "int8 dynashard": generate(int8, ids, args.new_tokens)[0],
            "fp32 dynashard": fp32_tokens}
    wrong = []
    for name, fn in calls.items():  # (first runs: compiles, and the token check)
        got, _ = generate(fn, ids, args.new_tokens)
        if want[name] is not None and not torch.equal(got, want[name]):
            wrong.append(name)
    steps: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(args.warmup + args.reps):
        for name, fn in calls.items():
            dist.barrier()
            _, times = generate(fn, ids, args.new_tokens)
            if i >= args.warmup:
                steps[name] += times
    mine = {name: {"ms_per_token": 1e3 * statistics.median(steps[name]), "held_bytes": held_bytes(m)}
            for name, m in models.items()}
    per_rank = gather(mine)
    results = {name: {"ms_per_token": max(r[name]["ms_per_token"] for r in per_rank),
                      "held_bytes": max(r[name]["held_bytes"] for r in per_rank),
                      "tokens_equal": name not in wrong} for name in calls}
    ref = results["int8 unsharded"]
    for r in results.values():
        r["time_vs_int8_unsharded"] = r["ms_per_token"] / ref["ms_per_token"]
        r["bytes_vs_int8_unsharded"] = r["held_bytes"] / ref["held_bytes"]
    if rank == 0:
        print(f"int8 weight-only decode: Llama {args.layers} layers, dim {args.dim}, {args.heads} heads / "
              f"{args.kv_heads} KV, ffn {args.ffn}, vocab {args.vocab}; prompt {args.prompt}, {args.new_tokens} "
              f"new tokens; world {world}, {torch.get_num_threads()} thread(s) per rank")
        print("| system | ms/token | vs int8 unsharded | held MiB/rank | vs int8 unsharded | tokens |")
        print("|---|---:|---:|---:|---:|---|")
        for name, r in results.items():
            print(f"| {name} | {r['ms_per_token']:.2f} | {r['time_vs_int8_unsharded']:.2f} | {mib(r['held_bytes'])} "
                  f"| {r['bytes_vs_int8_unsharded']:.2f} | {'equal' if r['tokens_equal'] else 'WRONG'} |")
        write_json(args.out, record(vars(args), results, world, torch.get_num_threads()))
    dist.destroy_process_group()
    if wrong:
        raise SystemExit(f"greedy tokens differ from the unsharded model's: {wrong}")


if __name__ == "__main__":
    main()
