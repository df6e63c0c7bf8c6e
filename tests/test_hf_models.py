"""Hugging Face models as they ship (transformers 5.23), tiny random configs, planned and simulated.

Each architecture is planned for 2 ranks (12 of them also for 4) and every rank's sharded program is run against the
unsharded model (``explain(verify=True)``: layer by layer and at the output). The table pins what
dynashard does with each one today: which layers stay whole and which values are gathered. A change
here must be deliberate. Caches are off (``use_cache=False``) except in the test of HF's default cache,
which checks that the plan stays the same with it (the cache is held by heads, not gathered).

Why layers stay whole here: ``lm_head`` has ``in_features`` 64 < 256 and no rowwise partner, so a
gather would not pay; k/v projections with 2 KV heads cannot be cut over 4 ranks (each rank narrows
them to its query heads); Falcon's 2 KV groups of 2 query heads cannot be cut over 4 ranks (the fused
projection stays whole, and the small ``dense`` with it; with 4 query heads a group, ``falcon_groups``, each
rank holds one of every group's and every group's k and v); an MoE router (4 x 64) has no partner. A tied
LM head follows its vocab-parallel embedding: its logits are gathered at the output.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T

import dynashard
from tests.hf_configs import CONFIGS, EXPECTED, _llama_like
from tests.test_graphs import _count, rewritten

pytestmark = pytest.mark.unit


# At 4 ranks: the forms whose plan changes with the world size (KV heads or groups fewer than ranks,
# fused projections) and one of each other attention family; the rest run at 2 ranks only.
AT_FOUR = {"llama", "olmo2", "qwen3", "gemma2", "phi3", "stablelm", "gpt2", "bloom", "falcon", "falcon_groups",
           "falcon_mqa", "mixtral", "diffllama"}


@pytest.mark.parametrize("arch,world", [(a, 2) for a in sorted(CONFIGS)] + [(a, 4) for a in sorted(AT_FOUR)])
def test_hf_architecture_sharded_and_verified(arch, world):
    _check(arch, world)


# Models whose float attributes -- RoPE's attention_scaling, the norms' eps, attention's scaling -- Dynamo
# passes under dynamic=True as inputs read with .item(): dynashard's retrace must keep the values Dynamo knew
# for them (GuardOnDataDependentSymNode while planning otherwise).
@pytest.mark.parametrize("arch,world", [("llama", 4), ("gpt2", 2)])  # (Qwen2: tests/test_serving.py)
def test_hf_architecture_under_dynamic_shapes_has_the_same_plan_and_is_verified(arch, world):
    _check(arch, world, dynamic=True)


# HF's default DynamicCache, prefill (grown from an empty tensor) and a decode step on a past of 7
# positions: the plan above unchanged (no k or v gathered for the cache), each rank's program verified,
# the past held by heads (k and v of the one layer; whole where one K/V head is shared: falcon_mqa). A
# few architectures here, every one in the slow tier (3 s each).
_CACHED = ("llama", "gemma2", "gpt2", "bloom", "falcon_mqa", "diffllama")  # (diffllama: held in two halves)


@pytest.mark.parametrize("arch", [a if a in _CACHED else pytest.param(a, marks=pytest.mark.slow)
                                  for a in sorted(CONFIGS)])
def test_hf_architecture_with_its_default_cache_holds_it_by_heads(arch):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    ids, step = torch.randint(3, 96, (2, 7)), torch.randint(3, 96, (2, 1))
    with torch.no_grad():
        past = model(ids, use_cache=True).past_key_values
    for args, kwargs in (((ids,), {}), ((step,), {"past_key_values": past})):
        report = dynashard.explain(model, *args, world_size=2, verify=True, options={"min_shard_numel": 0},
                                   use_cache=True, **kwargs)
        whole = {r.fqn.rsplit(".", 1)[-1] for r in report.rows if r.style == "replicate"}
        gathers = {r.fqn.rsplit(".", 1)[-1]: r.collectives for r in report.rows
                   if r.collectives not in ("-", "all_reduce")}
        assert (whole, gathers) == EXPECTED[arch][2], str(report)
    held = [r for g in report.graphs for r in g.caches]
    assert len(held) == (0 if arch == "falcon_mqa" else 2), str(report)


def test_falcon_kv_groups_fewer_than_ranks_are_cut_into_their_components():
    # HF Falcon (new decoder architecture), 8 query heads in 2 KV groups at world 4: the fused query_key_value
    # ([4 q | k | v] per group, 96 x 64) is cut in every group's components, each rank holding one query head
    # of every group and both groups' k and v (6 of 12 heads: half the bytes, rather than the whole projection), and
    # dense is rowwise over those heads: one all_reduce for the attention, nothing gathered, every rank verified.
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS["falcon_groups"]()).eval()
    report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=4, verify=True,
                               options={"min_shard_numel": 0}, use_cache=False)
    rows = {r.fqn.rsplit(".", 1)[-1]: (r.style, r.collectives, r.weight_bytes) for r in report.rows
            if ".self_attention." in r.fqn}
    assert rows == {"query_key_value": ("colwise", "-", 96 * 64 * 4 // 2),
                    "dense": ("rowwise", "all_reduce", 64 * 64 * 4 // 4)}, str(report)


def test_diffllama_costs_two_all_reduces_per_layer():
    # Counted on the rewritten graph, one layer and two: a second layer costs Llama's 2 all_reduces (o_proj
    # and down_proj rowwise) and no gather. (A plan keeping q/k/v whole and carrying the residual cut costs
    # 7 all_reduces a layer.)
    counts = []
    for layers in (1, 2):
        torch.manual_seed(0)
        config = _llama_like(T.DiffLlamaConfig, num_attention_heads=8, num_key_value_heads=4,
                             num_hidden_layers=layers, use_cache=False)
        model = T.AutoModelForCausalLM.from_config(config).eval()
        gm = rewritten(model, torch.randint(3, 96, (2, 7)), world=2)
        counts.append((_count(gm, "all_reduce"), _count(gm, "all_gather")))
    assert counts[1][0] - counts[0][0] == 2 and counts[0][1] == counts[1][1] == 0, counts


# DiffLlama's halves dealt unevenly (6 heads a half on 4 ranks: 2/2/1/1; 4 on 3: 2/1/1), with fewer K/V
# heads a half than ranks (k and v whole, narrowed to each rank's query heads): q still cut in halves, o_proj
# rowwise, no gather, every rank's program verified. (The query heads, grouped in twos for the repeated keys,
# are cut in single heads again so that both halves deal every rank one.) World 3 in the slow tier: the
# world-4 case runs the same re-cut, and the fuzz draws DiffLlama's form at worlds 2-4.
@pytest.mark.parametrize("world,heads,kv", [(4, 12, 6), pytest.param(3, 8, 4, marks=pytest.mark.slow)])
def test_diffllama_halves_dealt_unevenly_stay_cut(world, heads, kv):
    torch.manual_seed(0)
    config = _llama_like(T.DiffLlamaConfig, num_attention_heads=heads, num_key_value_heads=kv, head_dim=8)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    report = dynashard.explain(model, torch.randint(3, 96, (2, 7)), world_size=world, verify=True,
                               options={"min_shard_numel": 0}, use_cache=False)
    styles = {r.fqn.rsplit(".", 1)[-1]: r.style for r in report.rows if ".self_attn." in r.fqn}
    assert styles == {"q_proj": "colwise", "k_proj": "replicate", "v_proj": "replicate", "o_proj": "rowwise"}, \
        str(report)
    assert all(r.collectives in ("-", "all_reduce") for r in report.rows), str(report)


def _check(arch: str, world: int, dynamic: bool = False) -> None:
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    ids = torch.randint(3, 96, (2, 7))
    report = dynashard.explain(model, ids, world_size=world, verify=True, options={"min_shard_numel": 0},
                               use_cache=False, dynamic=dynamic)  # raises if any rank's program differs
    whole = {r.fqn.rsplit(".", 1)[-1] for r in report.rows if r.style == "replicate"}
    gathers = {r.fqn.rsplit(".", 1)[-1]: r.collectives for r in report.rows
               if r.collectives not in ("-", "all_reduce")}
    assert (whole, gathers) == EXPECTED[arch][world], str(report)  # every layer not listed is sharded
