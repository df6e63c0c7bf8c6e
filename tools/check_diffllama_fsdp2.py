"""DiffLlama (8 heads, 4 K/V heads, 2 layers) on a 2x2 gloo mesh: ``parallelize(dtensor=True)`` over tp (q/k/v
cut in two halves of heads), ``fully_shard`` over dp per layer and at the root, 3 SGD steps against the unsharded
twin on both replicas' batches concatenated: raw gradients and parameters.
PYTHONPATH=. OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 tools/check_diffllama_fsdp2.py [COMPILER]
(2026-12-03, eager: parameters within 2.5e-7 of the twin's after 3 SGD steps at lr 0.5; gradients within 2.7e-4
of each parameter's largest gradient, the worst being lambda_q1's, whose largest is 3.4e-6: 9e-10 absolute.
A gradient off by a factor would move a parameter by about lr x gradient, 1e-2 here.)"""
import copy
import sys

import torch
import torch.distributed as dist
import transformers as T
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dynashard

if __name__ == "__main__":
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    cfg = T.DiffLlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, vocab_size=96, max_position_embeddings=64, use_cache=False)
    model = T.AutoModelForCausalLM.from_config(cfg)
    twin = copy.deepcopy(model)
    batches = [torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    dp = mesh.get_local_rank("dp")
    options = {"min_shard_numel": 0, "compiler": sys.argv[1] if len(sys.argv) > 1 else "eager", "group": mesh["tp"]}
    error = None
    try:
        dynashard.parallelize(model, batches[dp], options=options, dtensor=True)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement)
        fully_shard(model, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement)
    except Exception as e:  # (a refusal naming the recipe is an acceptable outcome; a wrong gradient is not)
        error = e
    if error is not None:
        print(dist.get_rank(), "refused:", type(error).__name__, str(error)[:600], flush=True)
    else:
        fast = torch.compile(model, backend="dynashard", options=options)
        opt, opt_twin = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
        ref = dict(twin.named_parameters())
        grad_err, worst = 0.0, None
        for step in range(3):
            mine, both = batches[2 * step + dp], torch.cat([batches[2 * step], batches[2 * step + 1]])
            a = fast(mine, labels=mine).loss
            b = twin(both, labels=both).loss
            a.backward()
            b.backward()
            for n, p in model.named_parameters():
                g = ref[n].grad
                err = float((p.grad.full_tensor() - g).abs().max()) / (float(g.abs().max()) or 1.0)
                if err > grad_err:
                    worst = (n, step, float(g.abs().max()))
                grad_err = max(grad_err, err)
            for o in (opt, opt_twin):
                o.step()
                o.zero_grad()
        with torch.no_grad():
            param_err = max(float((p.full_tensor() - ref[n]).abs().max()) for n, p in model.named_parameters())
        print(dist.get_rank(), "relative grad err", grad_err, "at (name, step, its largest gradient)", worst,
              "param err after 3 SGD steps", param_err, flush=True)
    dist.destroy_process_group()
