"""Activation checkpointing inside a sharded graph (``torch.utils.checkpoint``, HF's
``gradient_checkpointing_enable()``, selective checkpointing policies).

Dynamo captures a checkpointed block as a region of its graph; dynashard inlines it to plan and
rewrite, with the tags that make AOTAutograd's partitioner recompute it in the backward
(dynashard/_torch/). Inlined without them, the block's activations would all be kept for the
backward, the user's checkpointing dropped without a word: what these tests guard against.

What a user sees is measured here: the bytes autograd keeps for the backward of one call (a
``saved_tensors_hooks`` pack hook counts every tensor the compiled forward saves), on the fake group;
and on 2 gloo ranks, raw gradients over SGD steps against an unsharded twin.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.checkpoint as ckpt

from dynashard import _torch as private
from tests.scenarios import Scenarios

SCENARIOS_DEADLINE_S = 240  # one world-2 spawn: ~25 s quiet (HF Llama, aot_eager compiles); 3x slower, 3x margin
pytestmark = pytest.mark.timeout(SCENARIOS_DEADLINE_S + 60)
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=SCENARIOS_DEADLINE_S)
aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """Blocks, each run through ``torch.utils.checkpoint`` (non-reentrant, as torch.compile requires)
    with ``context_fn`` if given (selective checkpointing), or plainly."""

    def __init__(self, d: int, n: int, checkpointed: bool, context_fn=None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.checkpointed, self.context_fn = checkpointed, context_fn

    def forward(self, x):
        for block in self.blocks:
            if not self.checkpointed:
                x = block(x)
            elif self.context_fn is None:
                x = ckpt.checkpoint(block, x, use_reentrant=False)
            else:
                x = ckpt.checkpoint(block, x, use_reentrant=False, context_fn=self.context_fn)
        return x


def _hidden_kept(model, x, **options) -> int:
    """How many of the blocks' hidden activations (a [512, 128] shard: the up projection's output or its
    ReLU's) the compiled model keeps for its backward in one call (after the compiling call), at world 2."""
    torch._dynamo.reset()
    private.init_fake_process_group(2, 0)
    try:
        fast = torch.compile(model, backend="dynashard", options={"min_shard_numel": 0, **options})
        fast(x).sum().backward()  # (compiles; its tracing saves fake tensors, not counted)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() == HIDDEN
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fast(x)
        out.sum().backward()
        return total
    finally:
        dist.destroy_process_group()


def _saves_mm(ctx, op, *args, **kwargs):
    return ckpt.CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.addmm.default) else \
        ckpt.CheckpointPolicy.PREFER_RECOMPUTE


# 8 x 64 tokens, hidden 64, ffn 256 (128 per rank): a block's hidden activation is this rank's [512, 128],
# a size no input, weight or output of a block has.
D, TOKENS = 64, (8, 64)
HIDDEN = TOKENS[0] * TOKENS[1] * 2 * D


# (Inductor partitions as aot_eager does, after 25 s of compiling: the slow tier)
@pytest.mark.unit
@pytest.mark.parametrize("compiler", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_checkpointed_block_keeps_no_activation_for_the_backward(compiler):
    """2 blocks: checkpointed, the backward keeps no hidden activation of either block (only their inputs
    and weights), where it keeps at least one per block when they are not. ``compiler="eager"`` runs
    through AOTAutograd for it (its partitioner is what recomputes). Fails without the recompute tags:
    the checkpointed model keeps what the plain one keeps."""
    x = torch.randn(*TOKENS, D)
    torch.manual_seed(0)
    plain = _hidden_kept(Stack(D, 2, checkpointed=False), x, compiler=compiler)
    torch.manual_seed(0)
    checkpointed = _hidden_kept(Stack(D, 2, checkpointed=True), x, compiler=compiler)
    assert plain >= 2 and checkpointed == 0, (plain, checkpointed)


@pytest.mark.unit
@pytest.mark.parametrize("form", ["function", "list"])
def test_selective_checkpointing_keeps_what_its_policy_saves(form):
    """A policy that saves the matmuls (torchtitan's op-level SAC) keeps each block's up-projection
    output, one hidden activation per block, and recomputes its ReLU: plain checkpointing keeps none.
    The list form of ``create_selective_checkpoint_contexts`` means the same."""
    policy = _saves_mm if form == "function" else [aten.mm.default, aten.addmm.default]
    context_fn = functools.partial(ckpt.create_selective_checkpoint_contexts, policy)
    x = torch.randn(*TOKENS, D)
    kept = {}
    for name, model in (("all", Stack(D, 2, True)), ("selective", Stack(D, 2, True, context_fn))):
        torch.manual_seed(0)
        kept[name] = _hidden_kept(model, x, compiler="aot_eager")
    assert kept == {"all": 0, "selective": 2}, kept


def _train(case: str, rank: int, world: int) -> None:
    """3 SGD steps of the checkpointed model and its twin (trained unsharded): raw gradients of every
    parameter, this rank's cut of the twin's for a sharded one."""
    import transformers as T

    import dynashard
    from tests.test_training import GRAD_RTOL, _compare, _facades

    torch.manual_seed(0)
    if case == "hf_llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                 num_attention_heads=8, num_key_value_heads=4, vocab_size=96))
        model.gradient_checkpointing_enable()  # (HF 5.x: non-reentrant, one region per decoder layer)
        model.train()

        def batch(step):
            return torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(step))

        def loss_of(net, ids):
            return net(input_ids=ids, labels=ids, use_cache=False).loss
    else:  # "per_block": torchtitan's order, applied after parallelize: each block wrapped, then compiled
        model = Stack(32, 2, checkpointed=case == "stack")

        def batch(step):
            return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(step))

        def loss_of(net, x):
            return net(x).pow(2).mean()
    twin = copy.deepcopy(model)
    options = {"min_shard_numel": 0, "compiler": "eager"}
    dynashard.parallelize(model, batch(0), options=options)
    facades = _facades(model)
    fast = torch.compile(model, backend="dynashard", options=options)
    if case == "per_block":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
            model.blocks[i].compile(backend="dynashard", options=options)
        fast = model
    opt, opt_twin = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    worst, missing, same = 0.0, [], True
    for step in range(3):
        loss_of(fast, batch(step)).backward()
        loss_of(twin, batch(step)).backward()
        err, step_missing, step_same = _compare(_Unwrapped(model), twin, facades, world)
        worst, missing, same = max(worst, err), missing + step_missing, same and step_same
        for o in (opt, opt_twin):
            o.step()
            o.zero_grad()
    sharded = [n for n in facades if "proj" in n or "up" in n or "down" in n]
    assert sharded, f"nothing was sharded: {sorted(facades)}"
    assert worst < GRAD_RTOL and not missing, (worst, missing)
    assert same, "replicated gradients differ across ranks"


class _Unwrapped:
    """``model``'s parameters named as without checkpoint_wrapper's ``_checkpoint_wrapped_module`` level."""

    def __init__(self, model) -> None:
        self.model = model

    def named_parameters(self):
        for name, p in self.model.named_parameters():
            yield name.replace("._checkpoint_wrapped_module", ""), p


@pytest.mark.gloo
@on_ranks(cases=["stack", "hf_llama", "per_block"])
def test_checkpointed_models_train_as_the_unsharded_twin(rank, world, case):
    """A stack of blocks each checkpointed, HF Llama with ``gradient_checkpointing_enable()`` (train mode),
    and torchtitan's order after ``parallelize`` (each block wrapped by ``checkpoint_wrapper``, then
    compiled on its own): 3 SGD steps, raw gradients against the twin's within test_training's tolerance
    (the backward recomputes the same sharded forward, so the sums are the ones without checkpointing)."""
    _train(case, rank, world)
