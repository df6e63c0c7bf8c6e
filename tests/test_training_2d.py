"""Two dimensions on real gloo ranks: dynashard over mesh["tp"], DDP or FSDP2 over mesh["dp"], on a 2x2 mesh.

Ranks 0,1 are data-parallel replica 0 and ranks 2,3 replica 1; each pair shares its layers
(``options={"group": mesh["tp"]}``) and trains on its own batch, while DDP averages the shards'
gradients over the replica pair holding the same shard (``process_group=mesh["dp"].get_group()``).
Every rank also trains an unsharded twin on the two replicas' batches concatenated: DDP's average of
two mean losses over equal batches is the mean loss of their concatenation, so raw gradients, clipped
norms, parameters and losses must be the twin's. FSDP2's ``fully_shard`` over mesh["dp"] trains the same
way after ``parallelize(..., dtensor=True)`` (its DTensor parameters), and is refused without it (README,
"Several machines": it swaps the module's parameters, the compiled program would read stale shards).
Each ``@on_ranks`` scenario runs on the 4 ranks and asserts there, after its last collective
(tests/scenarios.py); one spawn runs them all.
"""

from __future__ import annotations

import functools

import pytest

from tests.scenarios import Scenarios, raised

pytestmark = pytest.mark.gloo

# float32: the sharded matmuls and DDP's all_reduce sum the same products in another order; over 4 SGD
# steps with clipping the gradients stay within 7e-7 of each one's largest element (measured), the
# parameters within 2e-8, the losses and clipped norms within 1e-7 relative, and 10 AdamW steps after
# them within 2e-7. 1e-4 (1e-5 for losses, norms, parameters) leaves room for other thread counts, as
# tests/test_training.py does.
GRAD_RTOL = 1e-4
OPTIONS = {"min_shard_numel": 0, "compiler": "eager"}
DP, TP = 2, 2
# One world-4 spawn runs every scenario: 12 s on the 2-core machine under a load of 4 (other jobs);
# deadline 240 s.
on_ranks = Scenarios(__name__, worlds=(DP * TP,), deadline_s=240)


def _batch(name: str, hidden: int, vocab: int, step: int, replica: int):
    import torch

    g = torch.Generator().manual_seed(100 + 10 * step + replica)
    if name == "mlp":
        return torch.randn(2, 3, hidden, generator=g), None
    return torch.randint(0, vocab, (2, 7), generator=g), torch.randint(0, vocab, (2, 7), generator=g)


def _loss(out, target):
    import torch.nn.functional as F

    return out.pow(2).mean() if target is None else F.cross_entropy(out.flatten(0, -2), target.flatten())


def _both_batches(name: str, hidden: int, vocab: int, step: int):
    import torch

    batches = [_batch(name, hidden, vocab, step, d) for d in range(DP)]
    target = None if batches[0][1] is None else torch.cat([t for _, t in batches])
    return torch.cat([x for x, _ in batches]), target


def _step(fast, twin, name: str, hidden: int, vocab: int, i: int, mesh) -> float:
    """Forward and backward of the 2-D model (its replica's batch) and the twin (both replicas' batches) at
    step ``i``: the relative error of the replicas' mean loss."""
    import torch.distributed as dist

    x, target = _batch(name, hidden, vocab, i, mesh.get_local_rank("dp"))
    loss = _loss(fast(x), target)
    loss.backward()
    both, both_target = _both_batches(name, hidden, vocab, i)
    loss_twin = _loss(twin(both), both_target)
    loss_twin.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=mesh["dp"].get_group())
    return abs(float(mean) / DP - float(loss_twin.detach())) / float(loss_twin.detach())


def _setup(name: str, hidden: int, vocab: int, mesh, ddp_inside: bool, **ddp_options):
    """Model parallelized over tp and wrapped in DDP over dp (around the model, then compiled; or around
    the compiled model), with its unsharded twin."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dynashard
    from tests import models

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.build(name, hidden, vocab)
    twin = copy.deepcopy(model)
    options = {**OPTIONS, "group": mesh["tp"]}
    x0, _ = _batch(name, hidden, vocab, 0, mesh.get_local_rank("dp"))
    dynashard.parallelize(model, x0, options=options)
    dp = mesh["dp"].get_group()
    if ddp_inside:  # the README's order: DDP over the shards, the DDP model compiled
        fast = torch.compile(DDP(model, process_group=dp, **ddp_options), backend="dynashard", options=options)
    else:
        fast = DDP(torch.compile(model, backend="dynashard", options=options), process_group=dp, **ddp_options)
    return model, twin, fast


@functools.cache
def _mesh():
    """The 2x2 mesh (ranks 0,1: replica 0; 2,3: replica 1), made once per rank for every scenario."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


# case -> (model, hidden, DDP around the model then compiled (the README's order) or around the compiled
# model, AdamW steps after the SGD ones)
CASES = {"mlp": ("mlp", 32, False, 0), "nanogpt": ("nanogpt", 64, True, 10)}


@on_ranks(cases=list(CASES))
def test_tp_inside_ddp_trains_as_the_unsharded_model_on_both_batches(rank, world, case):
    """2x2 mesh, each replica on its own batch: the MLP (DDP around the compiled model) and nanoGPT
    (fused qkv, a vocab-parallel embedding tied to the head: one parameter read by two layers; the DDP model
    compiled) for 4 SGD steps with clipping at half the twin's norm: raw gradients, clipped norms and
    parameters are the twin's on the concatenated batch, replicated gradients bit-identical on all 4 ranks;
    then nanoGPT for 10 AdamW steps: the losses within 1e-4 relative."""
    import torch
    import torch.distributed as dist

    from dynashard.comm.protocol import all_gather_objects
    from dynashard.load.registered import facades as facades_of
    from dynashard.weights.store import STORE, cut

    name, hidden, ddp_inside, adamw_steps = CASES[case]
    vocab, mesh = 96, _mesh()

    def mine(n, t):  # this rank's cut of the twin's tensor
        s = STORE.spec_of(facades[n]) if n in facades else None
        return t if s is None else cut(t, s.dim, s.split, s.world, s.rank)

    def step(i: int) -> float:
        return _step(fast, twin, name, hidden, vocab, i, mesh)

    with torch._dynamo.config.patch(optimize_ddp=False):
        model, twin, fast = _setup(name, hidden, vocab, mesh, ddp_inside)
        facades = {
            f"{p}.{a}" if p else a: f for p, m in model.named_modules() for a, f in facades_of(m).items()
        }
        params, reference = list(model.parameters()), dict(twin.named_parameters())
        opt, opt_twin = torch.optim.SGD(params, lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
        grad_err, loss_err, norms, replicated_same, missing = 0.0, 0.0, [], True, []
        for i in range(4):
            loss_err = max(loss_err, step(i))
            replicated = []
            for n, p in model.named_parameters():
                if p.grad is None:
                    missing.append(n)
                    continue
                g = mine(n, reference[n].grad)
                scale = float(g.abs().max()) or 1.0  # (a zero gradient: rows of a table no id of the batch read)
                grad_err = max(grad_err, float((p.grad - g).abs().max()) / scale)
                if n not in facades:
                    replicated.append(p.grad.tolist())
            everyone = all_gather_objects(replicated, dist.group.WORLD)
            replicated_same &= all(e == everyone[0] for e in everyone)
            max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()]))
            norms.append((float(torch.nn.utils.clip_grad_norm_(params, max_norm)),
                          float(torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm))))
            for o in (opt, opt_twin):
                o.step()
                o.zero_grad()
        param_err = max(
            float((p.detach() - mine(n, reference[n].detach())).abs().max()) for n, p in model.named_parameters()
        )
        opt, opt_twin = torch.optim.AdamW(params, lr=1e-3), torch.optim.AdamW(twin.parameters(), lr=1e-3)
        adamw_loss_err = 0.0
        for i in range(4, 4 + adamw_steps):
            adamw_loss_err = max(adamw_loss_err, step(i))
            for o in (opt, opt_twin):
                o.step()
                o.zero_grad()
    assert grad_err < GRAD_RTOL and not missing, (
        f"raw gradients vs the twin's cut: {grad_err} relative; without a gradient: {missing}")
    assert replicated_same, "replicated gradients differ across ranks"
    assert all(abs(a - b) <= 1e-5 * b for a, b in norms), f"(clipped norm, the twin's) per step: {norms}"
    assert loss_err < 1e-5, f"the replicas' mean loss vs the twin's: {loss_err} relative"
    assert param_err < 1e-5, f"parameters after 4 SGD steps vs the twin's cut: max abs diff {param_err}"
    # AdamW divides by the gradients' running scale, so a gradient wrong by a constant factor would
    # hardly show here: the SGD steps above check the raw gradients; this checks the optimizer path
    assert adamw_loss_err < 1e-4, f"{adamw_steps} AdamW steps: the mean loss vs the twin's, {adamw_loss_err} relative"


@on_ranks
def test_ddp_optimizer_is_refused_and_gradient_as_bucket_view_warns(rank, world, tmp_path):
    """Dynamo's DDPOptimizer left on (its default; it compiles the graph in per-bucket pieces): refused at
    compile time, naming the fix. DDP's gradient_as_bucket_view=True (gradients that norm as this rank's
    part only, which breaks the clipping norm): a warning."""
    import warnings

    import torch

    import dynashard

    mesh = _mesh()
    with torch._dynamo.config.patch(optimize_ddp=False), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, fast = _setup("mlp", 32, 96, mesh, ddp_inside=False, gradient_as_bucket_view=True)
        fast(torch.randn(2, 3, 32)).sum().backward()
    bucket_view = [str(w.message) for w in caught if "gradient_as_bucket_view" in str(w.message)]
    assert len(bucket_view) == 1 and "clip_grad_norm_" in bucket_view[0], (
        f"warnings naming gradient_as_bucket_view: {bucket_view}")
    model, _, fast = _setup("mlp", 32, 96, mesh, ddp_inside=True)
    msg = str(raised(lambda: fast(torch.randn(2, 3, 32)).sum().backward()))  # Dynamo wraps the backend's error
    assert "DDPOptimizer" in msg and "optimize_ddp = False" in msg, msg
    # export_safetensors over the world group of shards cut over tp: refused before any collective, naming the
    # tp group of one replica (unchecked: an IndexError on rank 0 and the others' connections closed)
    export = str(raised(lambda: dynashard.export_safetensors(model, f"{tmp_path}/ddp.safetensors")))
    assert "mesh['tp'].get_group()" in export and "up.weight" in export, export


def _fsdp_model(case: str, vocab: int):
    """(model, twin, its loss on one batch): the MLP (whole bias: a Replicate DTensor) or HF Llama (8 heads,
    4 KV heads, vocab-parallel embedding and head)."""
    import copy

    import torch

    from tests import models

    torch.manual_seed(0)
    if case in ("mlp", "nanogpt"):
        model = models.build(case, 32, 96)
    else:
        import transformers as T

        # (hf_llama: two decoder layers, each its own FSDP unit, gathered one at a time; hf_llama_bf16 shards
        # the root only, and one layer runs its mixed precision as two do)
        layers = 2 if case == "hf_llama" else 1
        model = _Logits(T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=64, use_cache=False)))
    return model, copy.deepcopy(model)


def _Logits(hf):
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, hf):
            super().__init__()
            self.hf = hf

        def forward(self, ids):
            return self.hf(input_ids=ids, use_cache=False).logits

    return Logits(hf)


# case -> (relative tolerance of gradients, norms and losses; absolute one of parameters). float32: as above.
# "hf_llama_bf16": FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) gathers bfloat16 parameters, so the
# forward and backward run in bfloat16 against the float32 twin: gradients measured within 2.3e-2 of each
# one's largest element over 5 steps, parameters 3e-4; 6e-2 and 1e-3 leave room, and still catch a
# gradient missing or off by a factor (2x is 1.0).
FSDP_CASES = {"mlp": (GRAD_RTOL, 1e-5), "nanogpt": (GRAD_RTOL, 1e-5), "hf_llama": (GRAD_RTOL, 1e-5),
              "hf_llama_bf16": (6e-2, 1e-3)}


@on_ranks(cases=list(FSDP_CASES))
def test_fsdp2_over_dp_with_dtensor_shards_trains_as_the_unsharded_model(rank, world, case, tmp_path):
    """torchtitan's recipe: ``parallelize(..., dtensor=True)`` over mesh["tp"], then ``fully_shard`` over
    mesh["dp"], then ``torch.compile``. Every parameter is a 2-D DTensor holding 1/4 of each cut weight and 1/2
    of each whole one; 5 SGD steps with ``clip_grad_norm_`` at half the twin's norm (DTensor's norm sums over
    both dims) give the twin's raw gradients, clipped norms and parameters; 10 AdamW steps the twin's losses.
    Then a DCP checkpoint of the 2x2 model and its AdamW state (``get_state_dict``) resumes in the model
    parallelized 1x4 (tp over all 4 ranks): its parameters and AdamW moments are the 2x2 model's bit for
    bit, and its next AdamW steps the twin's; so are its parameters loaded from a save of the parameters
    themselves. nanoGPT's fused ``c_attn`` is ``_StridedShard`` on tp and sharded over dp on dim 1
    (``dynashard.fsdp_shard_placement``; its bias whole on tp), and saved at its true offsets. HF Llama has
    ``fully_shard`` on each decoder layer and the root (torchtitan's way: Dynamo breaks the graph at each
    layer's FSDP hooks, runs the model's loop eagerly and compiles each layer on its own) and runs with
    ``sequence_parallel``. With FSDP2's
    MixedPrecisionPolicy (bfloat16 parameters gathered; the root only), the facades follow the gathered
    dtype and the same checks hold within bfloat16's tolerance."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import dynashard

    vocab, hidden, mesh = 96, 32, _mesh()
    name = case if case in ("mlp", "nanogpt") else "llama"
    rtol, atol = FSDP_CASES[case]
    model, twin = _fsdp_model(case, vocab)
    torch._dynamo.reset()
    options = {**OPTIONS, "group": mesh["tp"]}
    x0, _ = _batch(name, hidden, vocab, 0, mesh.get_local_rank("dp"))
    dynashard.parallelize(model, x0, options=options, dtensor=True)
    if case == "hf_llama_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        fully_shard(model, mesh=mesh["dp"], mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    else:
        # (nanoGPT's fused [q | k | v] sharded over dp on dim 1; the others' parameters on dim 0, as by default)
        placement = {"shard_placement_fn": dynashard.fsdp_shard_placement}
        if case == "hf_llama":  # torchtitan's way: each block, then the root (one block gathered at a time)
            for layer in model.hf.model.layers:
                fully_shard(layer, mesh=mesh["dp"], **placement)
        fully_shard(model, mesh=mesh["dp"], **placement)
    if case == "hf_llama":  # with sequence parallelism (7 tokens: 4/3 on the tp pair); static lengths
        fast = torch.compile(model, backend="dynashard", options={**options, "sequence_parallel": True},
                             dynamic=False)
    else:
        fast = torch.compile(model, backend="dynashard", options=options)
    total = sum(q.numel() for q in twin.parameters())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    two_d = all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in model.parameters())
    held = sum(p.to_local().numel() for p in model.parameters())
    reference = dict(twin.named_parameters())

    def step(i: int) -> float:
        return _step(fast, twin, name, hidden, vocab, i, mesh)

    params = list(model.parameters())
    opt, opt_twin = torch.optim.SGD(params, lr=0.05), torch.optim.SGD(twin.parameters(), lr=0.05)
    grad_err, loss_err, norms, missing = 0.0, 0.0, [], []
    for i in range(5):
        loss_err = max(loss_err, step(i))
        for n, p in model.named_parameters():
            if p.grad is None:
                missing.append(n)
                continue
            g = reference[n].grad
            scale = float(g.abs().max()) or 1.0
            grad_err = max(grad_err, float((p.grad.full_tensor() - g).abs().max()) / scale)
        max_norm = 0.5 * float(torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()]))
        mine = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norms.append((float(mine.full_tensor() if isinstance(mine, DTensor) else mine),
                      float(torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm))))
        for o in (opt, opt_twin):
            o.step()
            o.zero_grad()
    with torch.no_grad():
        param_err = max(float((p.full_tensor() - reference[n]).abs().max()) for n, p in model.named_parameters())
    opt, opt_twin = torch.optim.AdamW(params, lr=1e-3), torch.optim.AdamW(twin.parameters(), lr=1e-3)
    adamw_loss_err = 0.0
    for i in range(5, 15):
        adamw_loss_err = max(adamw_loss_err, step(i))
        for o in (opt, opt_twin):
            o.step()
            o.zero_grad()
    state = sum(opt.state[p]["exp_avg"].to_local().numel() for p in params)
    # DCP: the 2x2 model's 2-D DTensors and their AdamW state, resumed by the model parallelized over all 4
    # ranks as tp (1x4), which takes the next AdamW step on both replicas' batches as the twin does
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{tmp_path}/fsdp_{case}")
    # and the parameters read from the modules themselves, not through state_dict (nanoGPT's fused c_attn: DCP's
    # own protocol reads its _StridedShard at the wrong offset; dynashard's, on the parameter, at the true ones)
    dcp.save(dict(model.named_parameters()), checkpoint_id=f"{tmp_path}/fsdp_{case}_parameters")
    dist.barrier()
    wide = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    other, _ = _fsdp_model(case, vocab)  # (fresh values: the load must replace them)
    torch._dynamo.reset()
    wide_options = {**OPTIONS, "group": wide["tp"]}
    dynashard.parallelize(other, _batch(name, hidden, vocab, 0, 0)[0], options=wide_options, dtensor=True)
    with torch.no_grad():
        dcp.load(dict(other.named_parameters()), checkpoint_id=f"{tmp_path}/fsdp_{case}_parameters")
        from_parameters = {n: p.full_tensor() for n, p in other.named_parameters()}
    opt_other = torch.optim.AdamW(other.parameters(), lr=1e-3)
    model_state, optim_state = get_state_dict(other, opt_other)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=f"{tmp_path}/fsdp_{case}")
    set_state_dict(other, opt_other, model_state_dict=model_state, optim_state_dict=optim_state)
    with torch.no_grad():  # parameters and AdamW moments, the 2x2 model's bit for bit
        def saved(net, optimizer):
            return {f"{n}.{k}": t.full_tensor() for n, p in net.named_parameters()
                    for k, t in [("", p), *((k, v) for k, v in optimizer.state[p].items() if k != "step")]}

        trained = saved(model, opt)
        # dynashard.full_tensor of a 2-D DTensor parameter: its whole value, a plain tensor (every rank, in order)
        wholes = [(n, dynashard.full_tensor(p)) for n, p in model.named_parameters()]
        full_tensor_same = all(type(w) is torch.Tensor and torch.equal(w, trained[n + "."]) for n, w in wholes)
        loaded = saved(other, opt_other)
        loaded_same = loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
        parameters_same = all(torch.equal(t, trained[n + "."]) for n, t in from_parameters.items())
    # the whole weights as safetensors: DTensors gathered over their mesh, every rank calling (gathered
    # over the wrong group instead, every tensor is written with the right shape and wrong values)
    from safetensors.torch import load_file

    dynashard.export_safetensors(model, f"{tmp_path}/fsdp_{case}.safetensors")
    exported = load_file(f"{tmp_path}/fsdp_{case}.safetensors") if rank == 0 else None
    export_same = rank != 0 or (exported.keys() == {k[:-1] for k in trained if k.endswith(".")} and all(
        torch.equal(exported[n], trained[n + "."]) for n in exported))
    for i in (15, 16):  # two more AdamW steps from the loaded state, on both replicas' batches, as the twin's
        both, both_target = _both_batches(name, hidden, vocab, i)
        resumed_loss = _loss(other(both), both_target)
        resumed_loss.backward()
        twin_loss = _loss(twin(both), both_target)
        twin_loss.backward()
        for o in (opt_other, opt_twin):
            o.step()
            o.zero_grad()
    resumed_err = abs(float(resumed_loss) - float(twin_loss)) / float(twin_loss)
    assert two_d and all(shapes[n] == tuple(q.shape) for n, q in reference.items()), shapes
    # each cut weight 1/4 per rank, each whole one 1/2 (FSDP pads the last rank's rows: a few rows' slack)
    assert held <= 0.55 * total and state == held, (held, total, state)
    assert grad_err < rtol and not missing, (grad_err, missing)
    assert all(abs(a - b) <= max(1e-5, rtol / 4) * b for a, b in norms), f"(clipped norm, the twin's): {norms}"
    assert loss_err < max(1e-5, rtol / 4) and param_err < atol, (loss_err, param_err)
    assert adamw_loss_err < max(1e-4, rtol), f"10 AdamW steps: the mean loss vs the twin's, {adamw_loss_err}"
    assert loaded_same, "the 1x4 model's parameters or AdamW moments loaded from the 2x2 checkpoint differ"
    assert parameters_same, "the 1x4 model's parameters loaded from the 2x2 one's (not their state_dict) differ"
    assert export_same, "export_safetensors of the 2x2 model wrote other values than its parameters"
    assert full_tensor_same, "dynashard.full_tensor of a DTensor parameter is not its whole value as a plain tensor"
    # the 1x4 model runs the checkpoint in float32, as the twin does (bfloat16 training left it atol apart);
    # its second AdamW step's loss (the first one's update in it) within the AdamW tolerance above
    assert resumed_err < max(1e-4, rtol), f"the resumed 1x4 model's loss vs the twin's: {resumed_err}"


@on_ranks
def test_fsdp2_is_refused_naming_the_ddp_recipe(rank, world):
    """Without ``dtensor=True``: FSDP2's ``fully_shard`` swaps each parameter for its own copy, gathered over
    dp before every forward: a weight dynashard cut would be read stale and its gradient lost (measured
    without this refusal: the cut parameters of an MLP fully_shard'ed and then compiled end every backward
    with no gradient, the loss going down on the others alone). Both orders raise on every rank, naming the DDP recipe:
    ``fully_shard`` after ``parallelize`` (at fully_shard), and a compile of a fully_shard'ed model (at
    the first call, before any weight is cut), each naming ``dtensor=True`` too. With it, fused components of
    unequal sizes and a group given as a ProcessGroup are refused at parallelize, and nanoGPT's fused
    ``[q | k | v]`` at ``fully_shard`` without ``shard_placement_fn=dynashard.fsdp_shard_placement``."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import dynashard
    from tests import models

    mesh = _mesh()
    options = {**OPTIONS, "group": mesh["tp"]}
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = dynashard.parallelize(models.build("mlp", 32, 96), x, options=options)
    after_parallelize = str(raised(lambda: fully_shard(model, mesh=mesh["dp"])))
    torch.manual_seed(0)
    model = models.build("mlp", 32, 96)
    fully_shard(model, mesh=mesh["dp"])
    before_compile = str(raised(lambda: torch.compile(model, backend="dynashard", options=options)(x)))
    # (FSDP had gathered its copies for the forward that raised: plain tensors now, none of them freed)
    untouched = all(getattr(p, "_local_tensor", p).untyped_storage().nbytes() > 0 for p in model.parameters())
    # dtensor=True: fused components of unequal sizes (8 query heads, 2 KV heads) have no DTensor placement;
    # nanoGPT's fused [q | k | v] has one, _StridedShard, which FSDP2's default dp shard on the same dim breaks
    # (dtensor_params.placement): refused at fully_shard without dynashard.fsdp_shard_placement. The tp mesh
    # must be given as a DeviceMesh.
    unequal = str(raised(lambda: dynashard.parallelize(models.build("fused_gqa", 64, 2), torch.randn(2, 3, 64),
                                                       options=options, dtensor=True)))
    nanogpt = dynashard.parallelize(models.build("nanogpt", 32, 96), torch.randint(0, 96, (2, 7)), options=options,
                                    dtensor=True)
    same_dim = str(raised(lambda: fully_shard(nanogpt, mesh=mesh["dp"])))
    no_mesh = str(raised(lambda: dynashard.parallelize(models.build("mlp", 32, 96), x, dtensor=True,
                                                       options={**OPTIONS, "group": mesh["tp"].get_group()})))
    assert "qkv_proj.weight" in unequal and "dtensor=False" in unequal, unequal
    assert "c_attn.weight" in same_dim and "shard_placement_fn=dynashard.fsdp_shard_placement" in same_dim, same_dim
    assert "DeviceMesh" in no_mesh and "mesh['tp']" in no_mesh, no_mesh
    for msg in (after_parallelize, before_compile):
        assert "FSDP2" in msg and "DDP" in msg and "mesh['dp']" in msg and "dtensor=True" in msg, msg
    assert "up.weight" in before_compile, before_compile
    assert untouched, "the refused compile freed FSDP's weights"


@pytest.mark.slow
@on_ranks.alone(DP * TP)
def test_lora_adapters_under_fsdp2_over_dp_train_as_the_twin(rank, world):
    """PEFT's LoRA on HF Llama, ``parallelize(dtensor=True)`` over mesh["tp"] then FSDP2 over mesh["dp"] (each block,
    then the root, ``fsdp_shard_placement``): 2 SGD steps, each replica on its own batch, against the unsharded twin
    on both batches. Every adapter after the steps (gathered whole) is the twin's, having moved O(10%)."""
    import copy

    import peft
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    import dynashard
    from tests.test_lora import TARGETS, llama, randomise_b

    mesh = _mesh()
    replica = mesh.get_local_rank("dp")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    randomise_b(model, 1)
    twin = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in twin.named_parameters() if p.requires_grad}
    g = torch.Generator().manual_seed(7)
    batches = [[torch.randint(0, 96, (2, 7), generator=g) for _ in range(DP)] for _ in range(2)]
    options = {**OPTIONS, "group": mesh["tp"]}
    dynashard.parallelize(model, input_ids=batches[0][replica], use_cache=False, options=options, dtensor=True)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement)
    fully_shard(model, mesh=mesh["dp"], shard_placement_fn=dynashard.fsdp_shard_placement)
    fast = torch.compile(model, backend=dynashard.backend(**options))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt_twin = torch.optim.SGD([p for p in twin.parameters() if p.requires_grad], lr=0.5)
    for step in range(2):
        ids, both = batches[step][replica], torch.cat(batches[step])
        F.cross_entropy(fast(input_ids=ids, use_cache=False).logits.flatten(0, 1), ids.flatten()).backward()
        F.cross_entropy(twin(input_ids=both, use_cache=False).logits.flatten(0, 1), both.flatten()).backward()
        for o in (opt, opt_twin):
            o.step()
            o.zero_grad()
    want = dict(twin.named_parameters())
    got = {n: p.full_tensor().detach() for n, p in model.named_parameters() if p.requires_grad}
    assert got.keys() == before.keys(), sorted(set(got) ^ set(before))
    # float32, SGD from equal values: the sharded sums in another order (measured 3.9e-7 of each tensor's largest)
    worst = max(float((got[n] - want[n].detach()).abs().max() / want[n].detach().abs().max()) for n in got)
    moved = max(float((want[n].detach() - before[n]).abs().max() / before[n].abs().max()) for n in got)
    assert worst < 1e-5 and moved > 0.05, (worst, moved)
