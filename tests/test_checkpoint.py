"""Checkpoints read a slice at a time (``dynashard.load.checkpoint``).

Every format the loader accepts (one safetensors file, a directory of them, an HF sharded
checkpoint with its index, a torch.distributed.checkpoint directory) gives, for every split the
planner makes, exactly the shard ``weights.cut`` cuts from the whole tensor: the same bytes, so a
model loaded slice by slice equals one sharded after loading whole. Bad checkpoints raise
``UsageError`` naming the tensor or file and the fix. All in one process (unit tier) but one gloo
test: a DCP checkpoint saved as DTensor shards by 2 ranks, read back at other splits.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import save_file

from dynashard.errors import UsageError
from dynashard.layout.split import Split
from dynashard.load.checkpoint import open_checkpoint
from dynashard.weights.store import cut
from tests.scenarios import Scenarios, from_rank0

# Splits the planner makes: balanced and uneven (23/23/22/22 of 90), a fused [q | k | v] cut per
# component, k and v held whole by every rank (their pieces overlap across ranks), a carved piece
# some ranks hold none of, and heads (units of 16).
SPLITS = {
    "even": Split((96,)),
    "uneven": Split((90,)),
    "fused": Split((48, 24, 24)),
    "whole_kv": Split((64, 16, 16), whole=frozenset({1, 2})),
    "dealt": Split((3, 93), deals=((3, 0, 0, 0), (24, 23, 23, 23))),
    "heads": Split((6,), unit=16),
}


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"w": torch.randn(96, 40), "c_attn.weight": torch.randn(40, 96), "b": torch.randn(96).bfloat16()}


def _dcp_save(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _write(fmt: str, tmp_path) -> str:
    state = _tensors()
    if fmt == "file":
        save_file(state, tmp_path / "model.safetensors")
        return str(tmp_path / "model.safetensors")
    if fmt == "directory":  # several files, no index
        save_file({"w": state["w"]}, tmp_path / "a.safetensors")
        save_file({k: v for k, v in state.items() if k != "w"}, tmp_path / "b.safetensors")
        return str(tmp_path)
    if fmt == "hf_index":  # as save_pretrained(max_shard_size=...) lays it out
        names = {"w": "model-00001-of-00002.safetensors", "c_attn.weight": "model-00002-of-00002.safetensors",
                 "b": "model-00002-of-00002.safetensors"}
        for file in set(names.values()):
            save_file({k: v for k, v in state.items() if names[k] == file}, tmp_path / file)
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
        return str(tmp_path)
    _dcp_save(state, str(tmp_path))
    return str(tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["file", "directory", "hf_index", "dcp"])
def test_every_format_reads_exactly_what_cut_takes(fmt, tmp_path):
    ck = open_checkpoint(_write(fmt, tmp_path))
    full = _tensors()
    assert ck.keys() == set(full) and ck.shape("c_attn.weight") == (40, 96) and ck.dtype("b") == torch.bfloat16
    for name, split in SPLITS.items():
        world = 4
        for rank in range(world):
            pieces = split.pieces(world, rank)
            # nn.Linear [out, in] cut on dim 0, HF Conv1D [in, out] on dim 1, a bias in another dtype
            assert torch.equal(ck.read("w", 0, pieces), cut(full["w"], 0, split, world, rank)), (name, rank)
            assert torch.equal(ck.read("c_attn.weight", 1, pieces), cut(full["c_attn.weight"], 1, split, world, rank))
            got = ck.read("b", 0, pieces, torch.float32)
            assert got.dtype == torch.float32 and torch.equal(got, cut(full["b"].float(), 0, split, world, rank))
    assert torch.equal(ck.read("w"), full["w"])  # whole
    assert torch.equal(ck.read("w", 0, [], torch.float16), torch.empty(0, 40, dtype=torch.float16))  # nothing


@pytest.mark.unit
@pytest.mark.parametrize("fmt", ["file", "dcp"])
def test_reads_land_on_the_device_asked_for(fmt, tmp_path, monkeypatch):
    """``read(device=...)``: safetensors opens each file for that device (``safe_open(device=...)`` reads
    a slice straight there), DCP copies into buffers made there. Only a CPU is here: the device asked
    of safe_open is recorded (its reads then stay on the CPU), and device="cpu" is read for real."""
    ck = open_checkpoint(_write(fmt, tmp_path))
    full = _tensors()
    if fmt == "file":
        asked, real = [], ck._safe_open
        monkeypatch.setattr(ck, "_safe_open", lambda f, framework, device: asked.append(device) or
                            real(f, framework=framework, device="cpu"))
        ck.read("w", 0, [(8, 16)], device=torch.device("cuda", 1))
        assert asked == ["cuda:1"]
    got = ck.read("w", 0, [(8, 16)], device="cpu")
    assert got.device == torch.device("cpu") and torch.equal(got, full["w"][8:24])
    assert ck.read("w", 0, [], device="cpu").device == torch.device("cpu")


@pytest.mark.unit
def test_an_hf_checkpoint_saved_by_save_pretrained(tmp_path):
    """GPT-2 (Conv1D [in, out] weights, a tied LM head absent from the file) saved in several
    files with its index, as transformers writes it."""
    import transformers as T

    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=96))
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    ck = open_checkpoint(tmp_path)
    state = model.state_dict()
    assert "lm_head.weight" not in ck.keys()  # tied to the embedding: saved once
    split = Split((64, 64, 64))  # c_attn: [q | k | v] cut per component
    for rank in range(2):
        want = cut(state["transformer.h.1.attn.c_attn.weight"], 1, split, 2, rank)
        assert torch.equal(ck.read("transformer.h.1.attn.c_attn.weight", 1, split.pieces(2, rank)), want)


@pytest.mark.unit
def test_bad_checkpoints_say_what_and_how_to_fix(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        open_checkpoint(tmp_path / "nope.safetensors")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(UsageError, match="holds no .safetensors file"):
        open_checkpoint(tmp_path / "empty")
    ck = open_checkpoint(_write("file", tmp_path))
    with pytest.raises(UsageError, match=r"'wq' is not in the checkpoint .*closest: \['w'\]"):
        ck.read("wq")
    with pytest.raises(UsageError, match=r"'w' .* has 96 elements on dim 0 .*expected elements \[90, 100\)"):
        ck.read("w", 0, [(90, 10)])
    whole = (tmp_path / "model.safetensors").read_bytes()
    for cut_at in (200, len(whole) - 100):  # in the header; in the data
        truncated = tmp_path / f"truncated{cut_at}.safetensors"
        truncated.write_bytes(whole[:cut_at])
        with pytest.raises(UsageError, match="truncated or corrupt"):
            open_checkpoint(truncated)
    os.makedirs(tmp_path / "twice")
    save_file({"w": torch.zeros(2)}, tmp_path / "twice" / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "twice" / "b.safetensors")
    with pytest.raises(UsageError, match="'w' is in both"):
        open_checkpoint(tmp_path / "twice")


# The gloo scenario's spawn (2 ranks save, rank 0 reads): 4 s on the 2-core machine under a load of 4; deadline 240 s
on_ranks = Scenarios(__name__, worlds=(2,), deadline_s=240)


@pytest.mark.gloo
@on_ranks
def test_dcp_saved_sharded_at_world_2_reads_at_any_split(rank, world, tmp_path):
    """Save DTensor shards (rows of ``w`` cut in two, columns of ``c``) and a replicated tensor
    with ``dcp.save`` on 2 ranks; rank 0 then reads the pieces of every split at worlds 1-4: each
    equals what ``cut`` takes from the whole tensor (asserted on every rank, from rank 0's reads)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w, c = torch.randn(90, 40), torch.randn(40, 96)
    path = str(tmp_path / "dcp")
    dcp.save({"w": distribute_tensor(w, mesh, [Shard(0)]), "c": distribute_tensor(c, mesh, [Shard(1)]),
              "r": distribute_tensor(c, mesh, [Replicate()])}, checkpoint_id=path)
    dist.barrier()
    differ = []  # (tensor, split, readers, reader) whose read is not what cut takes
    if rank == 0:
        ck = open_checkpoint(path)
        for readers in (1, 2, 3, 4):
            for split_name, split in SPLITS.items():
                if split.size != 90 and split.size != 96:
                    continue
                name, full, dim = ("w", w, 0) if split.size == 90 else ("c", c, 1)
                for r in range(readers):  # pieces spanning both saved chunks, uneven, overlapping
                    if not torch.equal(ck.read(name, dim, split.pieces(readers, r)), cut(full, dim, split, readers, r)):
                        differ.append((name, split_name, readers, r))
        if not torch.equal(ck.read("r", 1, [(5, 50)]), c[:, 5:55]):
            differ.append(("r", "columns 5:55", 1, 0))
    differ = from_rank0(differ)  # (nobody leaves the group while rank 0 reads)
    assert not differ, f"rank 0's reads of the DCP checkpoint that differ from cut of the saved tensor: {differ}"
