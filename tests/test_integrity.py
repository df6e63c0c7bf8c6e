"""Checkpoints and exports that cannot mix (dynashard/load/integrity.py), in one process.

A directory export swapped in whole (and killed between its two renames: both siblings whole, a load
names them), an earlier export's files never left beside a new one's, a DCP directory whose files
disagree with its metadata refused, and the fingerprint ranks compare telling two checkpoints of the
same shapes apart. The cross-rank checks run in test_parallelize.py (a stale copy on one rank).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import warnings

import pytest
import torch
from safetensors.torch import save_file

from dynashard.errors import UsageError
from dynashard.load import integrity
from dynashard.load.checkpoint import SafetensorsCheckpoint, _keys_of, open_checkpoint, owning

pytestmark = pytest.mark.unit


def _export(directory: str, files: dict[str, dict[str, torch.Tensor]]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, tensors in files.items():
        save_file(tensors, os.path.join(directory, name))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(8, 4, generator=g), "b": torch.randn(16, generator=g)}


def test_replacing_a_directory_keeps_foreign_files_and_drops_the_earlier_exports(tmp_path):
    target = str(tmp_path / "model")
    _export(target, {"model-00001-of-00002.safetensors": {"a": torch.zeros(2)},
                     "model-00002-of-00002.safetensors": {"b": torch.zeros(2)}})
    for name in ("model.safetensors.index.json", "tokenizer.json"):
        (tmp_path / "model" / name).write_text("{}")
    tmp = integrity.start_directory(target)
    _export(tmp, {"model.safetensors": _tensors(0)})
    integrity.replace_directory(tmp, target)
    assert sorted(os.listdir(target)) == ["model.safetensors", "tokenizer.json"]
    assert integrity.leftovers(target) == [] and os.listdir(tmp_path) == ["model"]


def _die_between_renames(tmp: str, target: str) -> None:
    real, calls = os.rename, []

    def rename(src, dst):
        real(src, dst)
        calls.append(dst)
        if len(calls) == 1:
            os._exit(9)  # killed after the old export moved aside, before the new one moved in

    integrity.os.rename = rename
    integrity.replace_directory(tmp, target)


def test_an_export_killed_between_its_renames_leaves_both_whole_and_a_load_names_them(tmp_path):
    target = str(tmp_path / "model")
    _export(target, {"model.safetensors": _tensors(0)})
    tmp = integrity.start_directory(target)
    _export(tmp, {"model.safetensors": _tensors(1)})
    child = mp.get_context("fork").Process(target=_die_between_renames, args=(tmp, target))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    left = integrity.leftovers(target)
    assert not os.path.exists(target) and len(left) == 2, os.listdir(tmp_path)
    for d in left:  # the previous export and the new one, each whole
        assert sorted(os.listdir(d)) == ["model.safetensors"]
    with pytest.raises(UsageError, match="interrupted while swapping directories"):
        open_checkpoint(target)
    again = integrity.start_directory(target)  # the next export cleans up after it
    _export(again, {"model.safetensors": _tensors(2)})
    integrity.replace_directory(again, target)
    assert integrity.leftovers(target) == [] and os.listdir(target) == ["model.safetensors"]


def test_the_fingerprint_tells_checkpoints_of_the_same_shapes_apart(tmp_path):
    for name, seed in (("one", 0), ("copy", 0), ("other", 1)):
        _export(str(tmp_path / name), {"model.safetensors": _tensors(seed)})
    prints = {name: SafetensorsCheckpoint(str(tmp_path / name), _keys_of(
        [str(tmp_path / name / "model.safetensors")])).fingerprint() for name in ("one", "copy", "other")}
    assert prints["one"] == prints["copy"] != prints["other"], prints
    # a change at the end of one tensor only (a partial fine-tune)
    changed = _tensors(0)
    changed["b"][-1] += 1
    _export(str(tmp_path / "late"), {"model.safetensors": changed})
    late = open_checkpoint(str(tmp_path / "late")).fingerprint()
    assert late != prints["one"]


def _dcp_save(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)


def test_a_dcp_directory_whose_files_disagree_with_its_metadata_is_refused(tmp_path):
    good, other = str(tmp_path / "good"), str(tmp_path / "other")
    _dcp_save(_tensors(0), good)
    _dcp_save({"a": torch.randn(8, 4), "c": torch.randn(32)}, other)
    assert open_checkpoint(good).read("a").shape == (8, 4)
    # a save over it that did not finish: its data files written, the old .metadata still there
    mixed = str(tmp_path / "mixed")
    shutil.copytree(good, mixed)
    data = [n for n in os.listdir(mixed) if n.endswith(".distcp")]
    meta_time = os.stat(os.path.join(mixed, ".metadata")).st_mtime
    os.utime(os.path.join(mixed, data[0]), (meta_time + 10, meta_time + 10))
    with pytest.raises(UsageError, match="written after .metadata"):
        open_checkpoint(mixed)
    stray = str(tmp_path / "stray")
    shutil.copytree(good, stray)
    shutil.copy(os.path.join(other, data[0]), os.path.join(stray, "__9_0.distcp"))
    with pytest.raises(UsageError, match="the metadata does not name"):
        open_checkpoint(stray)
    os.remove(os.path.join(stray, "__9_0.distcp"))
    os.remove(os.path.join(stray, data[0]))
    with pytest.raises(UsageError, match=f"{data[0]} is missing"):
        open_checkpoint(stray)


def test_a_slice_owns_exactly_its_bytes(tmp_path):
    file = str(tmp_path / "m.safetensors")
    save_file({"w": torch.randn(64, 32)}, file)
    piece = open_checkpoint(file).read("w", 0, [(16, 16)])
    assert piece.untyped_storage().nbytes() == piece.nbytes == 16 * 32 * 4
    whole = torch.randn(8, 8)
    assert owning(whole) is whole and owning(whole[2:4]).untyped_storage().nbytes() == 2 * 8 * 4
