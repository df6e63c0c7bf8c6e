"""Graph goldens: the rewritten aten graph for each linear form and style, single process.

Runs on torch's ``fake`` process group (collectives move no data), so only graph shape is
checked here; numerics live in test_numerics.py. Printed graphs are normalised (no liveness
comments, group names replaced) and every golden is backed by structural asserts: counts of
collective nodes and the shard shapes of the weight placeholders.
"""

from __future__ import annotations

import re

import expecttest
import pytest
import torch
import torch.distributed as dist

import dynashard
from dynashard import _torch as private
from dynashard.dynamo_backend import dynashard_backend
from tests import models

pytestmark = pytest.mark.unit


def _normalise(code: str) -> str:
    lines = []
    for line in code.strip().splitlines():
        line = re.sub(r";\s+[\w, =]+None$", "", line.rstrip())
        line = re.sub(r"(_c10d_functional\.\w+\.default\(.*)'[^']+'\)", r"\1'G')", line)
        if line.strip():
            lines.append(line)
    return "\n".join(lines)


def _count(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def rewritten(model, x, world=2, rank=0, dynamic=True, **options) -> torch.fx.GraphModule:
    """This rank's rewritten graph for ``model(x)`` with a fake group of ``world`` ranks (``dynamic``:
    torch.compile's; sequence_parallel needs static sizes)."""
    graphs = []

    def backend(gm, example_inputs):
        program = dynashard_backend(gm, example_inputs, {"compiler": "eager", "min_shard_numel": 0, **options})
        graphs.append(program.graph)
        return program

    torch._dynamo.reset()
    private.init_fake_process_group(world, rank)
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, dynamic=dynamic)(x)
    finally:
        dist.destroy_process_group()
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    return graphs[0]


def weight_shapes(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """Static 2-D placeholders: the weights (inputs have a symbolic batch dim under dynamic=True)."""
    shapes = [getattr(n.meta["val"], "shape", ()) for n in gm.graph.nodes if n.op == "placeholder"]
    return [tuple(s) for s in shapes if len(s) == 2 and all(isinstance(d, int) for d in s)]


class TestRewrittenGraphs(expecttest.TestCase):
    def test_linear_pair_3d(self):
        torch.manual_seed(0)
        gm = rewritten(models.MLP(32, 96), torch.randn(2, 3, 32))
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(_count(gm, "all_gather"), 0)
        self.assertEqual(weight_shapes(gm), [(48, 32), (32, 48)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    mul = arg2_1 * arg3_1
    view = torch.ops.aten.view.default(arg4_1, [mul, 32])
    t = torch.ops.aten.t.default(arg0_1)
    addmm = torch.ops.aten.addmm.default(arg1_1, view, t)
    view_1 = torch.ops.aten.view.default(addmm, [arg2_1, arg3_1, 48])
    gelu = torch.ops.aten.gelu.default(view_1)
    view_2 = torch.ops.aten.view.default(gelu, [mul, 48])
    t_1 = torch.ops.aten.t.default(arg5_1)
    mm = torch.ops.aten.mm.default(view_2, t_1)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    add = torch.ops.aten.add.Tensor(wait_tensor, arg6_1)
    view_3 = torch.ops.aten.view.default(add, [arg2_1, arg3_1, 32])
    return (view_3,)""")

    def test_functional_linear_2d(self):
        gm = rewritten(models.FunctionalLinear(32, 96), torch.randn(4, 32))
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(weight_shapes(gm), [(48, 32), (32, 48)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    t = torch.ops.aten.t.default(arg0_1)
    addmm = torch.ops.aten.addmm.default(arg1_1, arg3_1, t)
    relu = torch.ops.aten.relu.default(addmm)
    t_1 = torch.ops.aten.t.default(arg4_1)
    mm = torch.ops.aten.mm.default(relu, t_1)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    return (wait_tensor,)""")

    def test_matmul_transpose_bias_add(self):
        gm = rewritten(models.MatmulTranspose(32, 96), torch.randn(2, 3, 32))
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(_count(gm, "all_gather"), 0)
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1):
    t = torch.ops.aten.t.default(arg0_1)
    mul = arg1_1 * arg2_1
    view = torch.ops.aten.view.default(arg3_1, [mul, 32])
    mm = torch.ops.aten.mm.default(view, t)
    view_1 = torch.ops.aten.view.default(mm, [arg1_1, arg2_1, 48])
    slice_1 = torch.ops.aten.slice.Tensor(arg4_1, -1, 0, 48)
    add = torch.ops.aten.add.Tensor(view_1, slice_1)
    tanh = torch.ops.aten.tanh.default(add)
    permute = torch.ops.aten.permute.default(arg5_1, [1, 0])
    view_2 = torch.ops.aten.view.default(tanh, [mul, 48])
    mm_1 = torch.ops.aten.mm.default(view_2, permute)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm_1, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    view_3 = torch.ops.aten.view.default(wait_tensor, [arg1_1, arg2_1, 32])
    return (view_3,)""")

    def test_conv1d_weight_in_out(self):
        gm = rewritten(models.GPT2MLP(32, 96), torch.randn(2, 3, 32), rank=1)
        self.assertEqual(_count(gm, "all_reduce"), 1)
        # Conv1D stores [in, out]: colwise splits dim 1, rowwise dim 0.
        self.assertEqual(weight_shapes(gm), [(32, 48), (48, 32)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    view = torch.ops.aten.view.default(arg2_1, [-1, 32])
    addmm = torch.ops.aten.addmm.default(arg3_1, view, arg4_1)
    view_1 = torch.ops.aten.view.default(addmm, [arg0_1, arg1_1, 48])
    gelu = torch.ops.aten.gelu.default(view_1, approximate = 'tanh')
    view_2 = torch.ops.aten.view.default(gelu, [-1, 48])
    mm = torch.ops.aten.mm.default(view_2, arg6_1)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    add = torch.ops.aten.add.Tensor(wait_tensor, arg5_1)
    view_3 = torch.ops.aten.view.default(add, [arg0_1, arg1_1, 32])
    return (view_3,)""")

    def test_colwise_gather_uneven(self):
        # 90 outputs on 4 ranks, balanced: 23, 23, 22, 22. Rank 3 pads to 23 before the gather;
        # after it the padding of ranks 2 and 3 is cut away (one narrow per run of equal ranks).
        gm = rewritten(models.Head(32, 90), torch.randn(5, 32), world=4, rank=3, plan={"proj": "colwise"})
        self.assertEqual(_count(gm, "all_gather_into_tensor"), 1)
        self.assertEqual(_count(gm, "all_reduce"), 0)
        self.assertEqual(weight_shapes(gm), [(22, 32)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    t = torch.ops.aten.t.default(arg0_1)
    addmm = torch.ops.aten.addmm.default(arg1_1, arg3_1, t)
    constant_pad_nd = torch.ops.aten.constant_pad_nd.default(addmm, [0, 1], 0.0)
    all_gather_into_tensor = torch.ops._c10d_functional.all_gather_into_tensor.default(constant_pad_nd, 4, 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor)
    view = torch.ops.aten.view.default(wait_tensor, [4, arg2_1, 23])
    permute = torch.ops.aten.permute.default(view, [1, 0, 2])
    slice_1 = torch.ops.aten.slice.Tensor(permute, -2, 0, 2)
    clone = torch.ops.aten.clone.default(slice_1, memory_format = torch.contiguous_format)
    _unsafe_view = torch.ops.aten._unsafe_view.default(clone, [arg2_1, 46])
    slice_2 = torch.ops.aten.slice.Tensor(permute, -2, 2, 4)
    slice_3 = torch.ops.aten.slice.Tensor(slice_2, -1, 0, 22)
    clone_1 = torch.ops.aten.clone.default(slice_3, memory_format = torch.contiguous_format)
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(clone_1, [arg2_1, 44])
    cat = torch.ops.aten.cat.default([_unsafe_view, _unsafe_view_1], -1)
    _softmax = torch.ops.aten._softmax.default(cat, -1, False)
    return (_softmax,)""")

    def test_rowwise_narrows_replicated_input(self):
        gm = rewritten(models.MLP(32, 96), torch.randn(4, 32), rank=1, plan={"up": "rowwise"})
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(_count(gm, "slice"), 1)
        self.assertEqual(weight_shapes(gm), [(96, 16), (32, 96)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1):
    t = torch.ops.aten.t.default(arg0_1)
    slice_1 = torch.ops.aten.slice.Tensor(arg3_1, -1, 16, 32)
    mm = torch.ops.aten.mm.default(slice_1, t)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    add = torch.ops.aten.add.Tensor(wait_tensor, arg1_1)
    gelu = torch.ops.aten.gelu.default(add)
    t_1 = torch.ops.aten.t.default(arg4_1)
    addmm = torch.ops.aten.addmm.default(arg5_1, gelu, t_1)
    return (addmm,)""")

    def test_vocab_parallel_embedding(self):
        # 50 ids on 4 ranks: rank 1 owns ids [13, 26); others' ids look up zeros, one all_reduce sums.
        gm = rewritten(models.TinyLM(8, 50).embed_only(), torch.randint(0, 50, (2, 5)), world=4, rank=1)
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(weight_shapes(gm), [(13, 8)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1):
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(arg4_1)
    sub = torch.ops.aten.sub.Tensor(arg3_1, 13)
    ge = torch.ops.aten.ge.Scalar(sub, 0)
    lt = torch.ops.aten.lt.Scalar(sub, 13)
    bitwise_and = torch.ops.aten.bitwise_and.Tensor(ge, lt)
    clamp = torch.ops.aten.clamp.default(sub, 0, 12)
    embedding = torch.ops.aten.embedding.default(arg0_1, clamp)
    unsqueeze = torch.ops.aten.unsqueeze.default(bitwise_and, -1)
    zeros = torch.ops.aten.zeros.default([], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    where = torch.ops.aten.where.self(unsqueeze, embedding, zeros)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(where, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    return (wait_tensor,)""")

    def test_vocab_parallel_embedding_carries_its_options(self):
        # padding_idx=15 on 4 ranks of 13/13/12/12 ids: rank 1 holds ids [13, 26), so its lookup pads its
        # row 2; rank 0 holds no padding row (-1, the default: absent from the printed args). sparse is passed on.
        def lookups(rank):
            embed = torch.nn.Embedding(50, 8, padding_idx=15, sparse=True)
            gm = rewritten(models._Embed(embed), torch.randint(0, 50, (2, 5)), world=4, rank=rank)
            return [n.args[2:] for n in gm.graph.nodes if n.target is torch.ops.aten.embedding.default]

        self.assertEqual(lookups(1), [(2, False, True)])
        self.assertEqual(lookups(0), [(-1, False, True)])

    def test_nanogpt_attention_fused_qkv_uneven_heads(self):
        # nanoGPT's c_attn [q | k | v] with n_head=6 hard-coded, 4 ranks: rank 3 holds head 5 of
        # each of q, k and v (2/2/1/1 heads), the split sizes and head counts are rewritten
        # (split 96 -> 16, view 6 -> 1 head), and the block costs one all_reduce.
        torch.manual_seed(0)
        gm = rewritten(models.NanoGPTAttention(96, 6, 32), torch.randn(2, 5, 96), world=4, rank=3)
        self.assertEqual(_count(gm, "all_reduce"), 1)
        self.assertEqual(_count(gm, "all_gather"), 0)
        self.assertEqual(weight_shapes(gm), [(48, 96), (96, 16)])
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    mul = arg0_1 * arg1_1
    view = torch.ops.aten.view.default(arg2_1, [mul, 96])
    t = torch.ops.aten.t.default(arg3_1)
    addmm = torch.ops.aten.addmm.default(arg4_1, view, t)
    view_1 = torch.ops.aten.view.default(addmm, [arg0_1, arg1_1, 48])
    split_with_sizes = torch.ops.aten.split_with_sizes.default(view_1, [16, 16, 16], -1)
    getitem = split_with_sizes[0]
    getitem_1 = split_with_sizes[1]
    getitem_2 = split_with_sizes[2]
    view_2 = torch.ops.aten.view.default(getitem_1, [arg0_1, arg1_1, 1, 16])
    transpose = torch.ops.aten.transpose.int(view_2, 1, 2)
    view_3 = torch.ops.aten.view.default(getitem, [arg0_1, arg1_1, 1, 16])
    transpose_1 = torch.ops.aten.transpose.int(view_3, 1, 2)
    view_4 = torch.ops.aten.view.default(getitem_2, [arg0_1, arg1_1, 1, 16])
    transpose_2 = torch.ops.aten.transpose.int(view_4, 1, 2)
    _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(transpose_1, transpose, transpose_2, 0.0, True)
    getitem_3 = _scaled_dot_product_flash_attention_for_cpu[0]
    getitem_4 = _scaled_dot_product_flash_attention_for_cpu[1]
    transpose_3 = torch.ops.aten.transpose.int(getitem_3, 1, 2)
    view_5 = torch.ops.aten.view.default(transpose_3, [arg0_1, arg1_1, 16])
    view_6 = torch.ops.aten.view.default(view_5, [mul, 16])
    t_1 = torch.ops.aten.t.default(arg5_1)
    mm = torch.ops.aten.mm.default(view_6, t_1)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    add = torch.ops.aten.add.Tensor(wait_tensor, arg6_1)
    view_7 = torch.ops.aten.view.default(add, [arg0_1, arg1_1, 96])
    return (view_7,)""")

    def test_llama_decoder_two_all_reduces_per_block(self):
        # GQA (8 query heads, 4 KV heads), RoPE (rotate-half: slices, neg, cat, mul), repeat_kv
        # (expand + reshape), SDPA, SwiGLU; 4 ranks: 2 query heads and 1 KV head each. Per block one
        # all_reduce after attention and one after the MLP, plus one for the vocab-parallel embedding.
        torch.manual_seed(0)
        model = models.LlamaDecoder(vocab=90, hidden=128, n_heads=8, n_kv_heads=4, n_layer=2)
        gm = rewritten(model, torch.randint(0, 90, (2, 5)), world=4, rank=1)
        self.assertEqual(_count(gm, "all_reduce"), 1 + 2 * 2)
        self.assertEqual(_count(gm, "all_gather"), 0)
        shapes = weight_shapes(gm)
        # per layer: q 2 heads of 16, k and v 1 head, o 32 inputs, gate/up/down 176 / 4 = 44; embedding 23 of 90 ids
        expected = {(32, 128): 2, (16, 128): 4, (128, 32): 2, (44, 128): 4, (128, 44): 2, (23, 128): 1}
        self.assertEqual({s: shapes.count(s) for s in expected}, expected)
        heads = sorted({n.args[1][1] for n in gm.graph.nodes if "expand" in str(n.target) and len(n.args[1]) == 5})
        self.assertEqual(heads, [1])  # repeat_kv expands this rank's one KV head (of 4)

    def test_gqa_in_sdpa_runs_each_rank_on_its_query_heads_kv_heads(self):
        # K/V not repeated (SDPA enable_gqa=True, as HF does without a mask): query head h reads K/V
        # head h // n. 8 query heads, 4 KV heads on 4 ranks: each rank runs 2 query heads against its
        # 1 KV head. With 1 KV head (MQA) K/V stay whole and each rank repeats it for its 2 heads.
        torch.manual_seed(0)
        for n_kv, kv_heads, kv_rows in ((4, 1, 16), (1, 2, 16)):
            model = models.LlamaDecoder(vocab=90, hidden=128, n_heads=8, n_kv_heads=n_kv, n_layer=2, repeat="sdpa")
            gm = rewritten(model, torch.randint(0, 90, (2, 5)), world=4, rank=1)
            self.assertEqual(_count(gm, "all_reduce"), 1 + 2 * 2)
            self.assertEqual(_count(gm, "all_gather"), 0)
            sdpa = [n for n in gm.graph.nodes if "flash_attention" in str(n.target)]
            self.assertEqual(len(sdpa), 2)
            for node in sdpa:
                q, k, v = (a.meta["val"].shape[1] for a in node.args[:3])
                self.assertEqual((q, k, v), (2, kv_heads, kv_heads))
            shapes = weight_shapes(gm)
            self.assertEqual(shapes.count((32, 128)), 2)  # q_proj: 2 heads of 16 per layer
            self.assertEqual(shapes.count((kv_rows, 128)), 4)  # k/v: 1 head of 16 (cut), or whole (MQA)

    def test_a_shard_never_broadcasts(self):
        # A one-feature colwise output times x[..., :8] must not broadcast the shard: rank 0
        # (1 feature) and rank 1 (none) would send different shapes to one all_gather.
        torch.manual_seed(0)
        x = torch.randn(2, 5, 300)
        gathered = []
        for rank in (0, 1):
            gm = rewritten(models.Gate(), x, world=2, rank=rank, plan={"g": "colwise"})
            (gather,) = [n for n in gm.graph.nodes if "all_gather" in str(n.target)]
            gathered.append(gather.args[0].meta["val"].dim())
            self.assertEqual(gm.graph.output_node().args[0][0].meta["val"].shape[-1], 8)
        self.assertEqual(gathered[0], gathered[1])

    def test_einsum_attention_recompiles_for_new_shapes(self):
        # einsum's views through a size-1 dim are followed with symbolic sizes too; otherwise the
        # dynamic recompile plans another cut of the freed o.weight and raises.
        torch.manual_seed(0)
        model = models.EinsumAttention(48, 6)
        compiled = torch.compile(model, backend=dynashard.backend(compiler="eager", min_shard_numel=0))
        torch._dynamo.reset()
        private.init_fake_process_group(4, 0)
        try:
            with torch.no_grad():
                outs = [compiled(torch.randn(b, t, 48)).shape for b, t in ((2, 5), (3, 7))]
        finally:
            dist.destroy_process_group()
        self.assertEqual(outs, [torch.Size([2, 5, 48]), torch.Size([3, 7, 48])])
        self.assertEqual(model.o.weight.untyped_storage().nbytes(), 0)

    def test_a_cache_grown_by_cat_is_read_and_returned_by_heads(self):
        # HF DynamicCache's decode step: the past k/v come in, k/v of the new token are appended by
        # cat along the sequence, attention reads the grown cache, the grown cache goes back out. The
        # past is held cut like k (a graph input of 2 of the 4 heads, [2, 2, 3, 8]), the cat and its
        # output stay this rank's heads (returned as the rank's parts, program.py's facades): no
        # gather; the layer's one all_reduce is o's.
        torch.manual_seed(0)
        graphs = []

        def backend(gm, example_inputs):
            program = dynashard_backend(gm, example_inputs, {"compiler": "eager", "min_shard_numel": 0})
            graphs.append(program.graph)
            return program

        torch._dynamo.reset()
        private.init_fake_process_group(2, 0)
        try:
            with torch.no_grad():
                torch.compile(_GrownCacheAttention(), backend=backend)(
                    torch.randn(2, 1, 32), torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
        finally:
            dist.destroy_process_group()
        gm = graphs[0]
        self.assertEqual((_count(gm, "all_reduce"), _count(gm, "all_gather")), (1, 0))
        past = [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder" and n.name in ("arg4_1", "arg5_1")]
        self.assertEqual(past, [(2, 2, 3, 8)] * 2)
        self.assertExpectedInline(_normalise(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    t = torch.ops.aten.t.default(arg1_1)
    view = torch.ops.aten.view.default(arg0_1, [2, 32])
    mm = torch.ops.aten.mm.default(view, t)
    view_1 = torch.ops.aten.view.default(mm, [2, 1, 16])
    view_2 = torch.ops.aten.view.default(view_1, [2, 1, 2, 8])
    transpose = torch.ops.aten.transpose.int(view_2, 1, 2)
    t_1 = torch.ops.aten.t.default(arg2_1)
    mm_1 = torch.ops.aten.mm.default(view, t_1)
    view_3 = torch.ops.aten.view.default(mm_1, [2, 1, 16])
    view_4 = torch.ops.aten.view.default(view_3, [2, 1, 2, 8])
    transpose_1 = torch.ops.aten.transpose.int(view_4, 1, 2)
    t_2 = torch.ops.aten.t.default(arg3_1)
    mm_2 = torch.ops.aten.mm.default(view, t_2)
    view_5 = torch.ops.aten.view.default(mm_2, [2, 1, 16])
    view_6 = torch.ops.aten.view.default(view_5, [2, 1, 2, 8])
    transpose_2 = torch.ops.aten.transpose.int(view_6, 1, 2)
    cat = torch.ops.aten.cat.default([arg4_1, transpose_1], 2)
    cat_1 = torch.ops.aten.cat.default([arg5_1, transpose_2], 2)
    _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(transpose, cat, cat_1)
    getitem = _scaled_dot_product_flash_attention_for_cpu[0]
    getitem_1 = _scaled_dot_product_flash_attention_for_cpu[1]
    transpose_3 = torch.ops.aten.transpose.int(getitem, 1, 2)
    view_7 = torch.ops.aten.view.default(transpose_3, [2, 1, 16])
    t_3 = torch.ops.aten.t.default(arg6_1)
    view_8 = torch.ops.aten.view.default(view_7, [2, 16])
    mm_3 = torch.ops.aten.mm.default(view_8, t_3)
    all_reduce = torch.ops._c10d_functional.all_reduce.default(mm_3, 'sum', 'G')
    wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
    view_9 = torch.ops.aten.view.default(wait_tensor, [2, 1, 32])
    return (view_9, cat, cat_1)""")

    def test_replicate_plan_leaves_graph_alone(self):
        torch._dynamo.reset()
        private.init_fake_process_group(2, 0)
        seen = []

        def backend(gm, example_inputs):
            out = dynashard_backend(gm, example_inputs, {"compiler": "eager", "plan": {"up": "replicate"}})
            seen.append(out)
            return out

        try:
            with torch.no_grad():
                torch.compile(models.MLP(32, 96), backend=backend)(torch.randn(4, 32))
        finally:
            dist.destroy_process_group()
        # Nothing sharded: the compiler gets Dynamo's graph unchanged (a bound forward, no program).
        self.assertFalse(hasattr(seen[0], "specs"))


class _GrownCacheAttention(torch.nn.Module):
    """One attention layer of 4 heads of 8 decoding with a cache grown by ``torch.cat`` (HF's DynamicCache)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32, bias=False) for _ in range(4))

    def forward(self, x, past_k, past_v):
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, 4, 8).transpose(1, 2) for proj in (self.q, self.k, self.v))
        k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, 32)), k, v


if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    run_tests()


def test_kernels_get_the_layout_they_were_traced_with():
    """The one-head pieces of a per-head split, gathered one by one, and ``cat`` of those gathers
    (each contiguous, with an arbitrary stride on its size-1 head dim) lay q out with a last-dim
    stride of 4; CPU flash attention reads its inputs as if that stride were 1 (max error 1e20 under
    eager: a silent wrong result). Any op input whose traced value had a unit-stride last dim and
    whose converted one does not is made contiguous; others are passed as they are (no copy)."""
    from dynashard.rewrite.local_conversions import as_traced

    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    for p in (q, k, v):
        p.meta["val"] = torch.empty(2, 4, 5, 64)
    flash = graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v))
    strided_q = torch.randn(2, 5, 64, 4).permute(0, 3, 1, 2)  # what cat made of the gathered pieces
    other = torch.randn(2, 4, 5, 64).transpose(1, 2).transpose(1, 2)  # unit last-dim stride: kept
    (q2, k2, v2), _ = as_traced(flash, (strided_q, other, other), {})
    assert q2.stride()[-1] == 1 and torch.equal(q2, strided_q)
    assert k2 is other and v2 is other


def test_attention_kernels_get_the_layout_they_were_traced_with():
    """A per-head unbind/stack of q (like the split/cat form: a silent wrong result under eager
    if mishandled) is gathered before the unbind, the attention runs on this rank's heads of k
    and v, and every input of the attention kernel has a unit-stride last dim, as when Dynamo traced
    the model (a gathered, permuted q does not, unless made contiguous)."""
    torch.manual_seed(0)
    for rank in (0, 1):
        gm = rewritten(models.PerHeadScaleAttention(256, 4, unbind=True), torch.randn(2, 5, 256), rank=rank)
        flash = [n for n in gm.graph.nodes if "flash_attention" in str(n.target)]
        assert len(flash) == 1 and _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 1
        for arg in flash[0].args[:3]:
            assert arg.meta["val"].stride()[-1] == 1, (rank, arg, arg.meta["val"].stride())
        # q gathered (4 heads of 64), k and v this rank's 2 heads: the attention runs on 2 heads
        assert [tuple(a.meta["val"].shape)[1] for a in flash[0].args[:3]] == [2, 2, 2]


def test_per_head_pieces_stay_on_the_rank_that_holds_those_heads():
    """``q.split(1, dim=heads)``, a scale per head, ``cat``: each rank scales the heads it holds
    (its pieces of the others are empty) and the cat gives back its heads: no gather, one
    all_reduce; the split's sizes are this rank's share of each one-head piece (1, 1, 0, 0 on rank 0)."""
    torch.manual_seed(0)
    for rank in (0, 1):
        gm = rewritten(models.PerHeadScaleAttention(256, 4), torch.randn(2, 5, 256), rank=rank)
        assert _count(gm, "all_gather") == 0 and _count(gm, "all_reduce") == 1, gm.code
        (split,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.split_with_sizes.default]
        assert list(split.args[1]) == ([1, 1, 0, 0] if rank == 0 else [0, 0, 1, 1])
        (flash,) = [n for n in gm.graph.nodes if "flash_attention" in str(n.target)]
        assert [tuple(a.meta["val"].shape)[1] for a in flash.args[:3]] == [2, 2, 2]


def test_cuda_sdpa_kernels_run_on_this_ranks_heads():
    """The rewritten graph calls each CUDA kernel on this rank's 2 of 4 heads (log-sum-exp included),
    with the per-head bias narrowed; one all_reduce, no gather."""
    from tests.gpu_attention_on_cpu import CudaKernelAttention, register

    register()
    for kernel in ("flash", "efficient", "cudnn"):
        torch.manual_seed(0)
        gm = rewritten(CudaKernelAttention(kernel, 64, 4, bias=kernel != "flash"), torch.randn(2, 5, 64), rank=1)
        (op,) = [n for n in gm.graph.nodes if f"_scaled_dot_product_{kernel}" in str(n.target)]
        assert _count(gm, "all_reduce") == 1 and _count(gm, "all_gather") == 0, kernel
        assert [a.meta["val"].shape[1] for a in op.args[:3]] == [2, 2, 2], kernel
        out, lse = op.meta["val"][:2]
        assert out.shape[1] == 2 and lse.shape[1] == 2, (kernel, out.shape, lse.shape)
        if kernel != "flash":
            assert op.args[3].meta["val"].shape[1] == 2, kernel  # the bias, narrowed to 2 heads
