"""Export: a sharded model's whole weights written back out as safetensors, one tensor at a time.

Before: a model dynashard sharded (``parallelize`` or a compile): every rank holds its pieces.
After: one ``.safetensors`` file, or an HF directory (files of at most ``max_shard_size`` and
``model.safetensors.index.json``), that ``from_pretrained`` and ``parallelize(checkpoint=...)`` read.

How: the safetensors header (names, dtypes, shapes, byte offsets) is known from the full shapes before
any data, so group rank 0 writes it first, then each tensor as ``transport.gather_to_first``
assembles it from every rank's pieces; no rank holds more than one whole tensor. The format: an 8-byte
little-endian header length, the JSON header padded with spaces to 8 bytes, the data
(https://github.com/huggingface/safetensors, "Format").
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import struct
from typing import Any

import torch

from dynashard.comm.protocol import first_rank_status, peer_guard, resolve_group
from dynashard.comm.transport import gather_to_first
from dynashard.errors import UsageError
from dynashard.load import integrity
from dynashard.load.checkpoint import _INDEX, _SAFETENSORS_DTYPES
from dynashard.load.quantized_state import quantized_slots
from dynashard.load.registered import facades
from dynashard.weights.store import STORE


def export_safetensors(model: torch.nn.Module, path: str | os.PathLike, max_shard_size: int | str | None = None,
                       group: Any = None) -> None:
    """Write ``model``'s whole weights as safetensors from a model dynashard sharded (by
    ``dynashard.parallelize`` or a compile): ``path`` ending in ``.safetensors`` is one file; any other
    path is an HF directory (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at
    most ``max_shard_size`` bytes ("5GB", as ``save_pretrained`` takes it) and
    ``model.safetensors.index.json``, plus an HF model's ``config.json`` and generation config) that
    ``from_pretrained`` and ``parallelize(checkpoint=...)`` read. A directory is written into a sibling
    temporary directory and swapped in when complete (integrity.replace_directory): an earlier export's
    files never stay beside the new ones, and files no export writes (a tokenizer) are kept.

    Every rank of the group calls it. Group rank 0 gathers one tensor at a time (every rank sends
    its pieces) and streams it into the file, so no rank ever holds the whole model. A tied weight
    is written once, under its first name (as safetensors' ``save_model`` does). Files are written
    under a temporary name and renamed when complete: a failure (raised on every rank) leaves no
    partial checkpoint.
    """
    import torch.distributed as dist

    group = resolve_group(group)
    rank = dist.get_rank(group)
    path = os.fspath(path)
    entries = _export_entries(model, STORE)  # [(name, value, facade or None)], the same on every rank
    _check_meshes(entries, group)
    sizes = [(name, math.prod(full.shape) * full.element_size()) for name, _, full in entries]
    directory = not path.endswith(".safetensors")
    error, writers, into, files = None, [], path, []
    try:
        if rank == 0 and directory:
            into = integrity.start_directory(path)
            for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
                if hasattr(config, "save_pretrained"):  # an HF model: from_pretrained needs its config
                    config.save_pretrained(into)
        files = _file_plan(into, sizes, _parse_size(max_shard_size))
        for file, names in files if rank == 0 else []:
            writers.append(_Writer(file, [(n, full) for n, _, full in entries if n in names]))
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        error = e
    try:
        with peer_guard(group, f"export_safetensors into {path}"):
            _write_all(entries, files, sizes, writers, error, group, path, into)
    finally:
        for w in writers:
            w.close()
        if rank == 0 and directory and into != path and os.path.isdir(into):  # failed before the swap
            shutil.rmtree(into, ignore_errors=True)


def _write_all(entries: list, files: list, sizes: list, writers: list, error: Exception | None, group: Any,
               path: str, into: str) -> None:
    """Rank 0 writes, every rank sends its pieces: each tensor gathered and streamed into its file
    (``into``: a directory export's temporary sibling, swapped in for ``path`` when complete)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    by_name = {n: w for w in writers for n in w.names}
    first_rank_status(error, group, f"opening {path} to export into")
    for name, value, full in entries:
        error = None
        spec = STORE.spec_of(full) if full is not value else None
        if _is_dtensor(value):  # parallelize(dtensor=True), FSDP2: gathered over its own mesh, every rank
            whole = value.detach().full_tensor()
            whole = whole if rank == 0 else None
        elif spec is not None:
            whole = gather_to_first(value, list(full.shape), spec.dim,
                                    lambda r, s=spec: s.split.pieces(s.world, r), group)
        else:
            whole = value.detach() if rank == 0 else None
        if rank == 0:
            try:
                by_name[name].write(name, whole)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
        del whole
        first_rank_status(error, group, f"writing {name!r} to {path}")
    error = None
    if rank == 0:
        try:
            for w in writers:
                w.finish()
            if len(files) > 1:
                total = sum(size for _, size in sizes)
                weight_map = {n: os.path.basename(file) for file, names in files for n in names}
                with open(os.path.join(into, _INDEX), "w") as f:
                    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            if into != path:
                integrity.replace_directory(into, path)
        except Exception as e:  # noqa: BLE001
            error = e
    first_rank_status(error, group, f"finishing {path}")




def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_meshes(entries: list, group: Any) -> None:
    """Each tensor can be gathered over the export's group: a shard dynashard cut over that group (not over a
    tp group inside it), a DTensor (``parallelize(dtensor=True)``, FSDP2) over a mesh whose every rank is
    exporting too (else the gather would wait for ranks that never come). Raised before any collective."""
    import torch.distributed as dist

    members = set(dist.get_process_group_ranks(group))
    for name, value, full in entries:
        spec = STORE.spec_of(full) if full is not value else None
        if spec is not None and (spec.world, spec.rank) != (dist.get_world_size(group), dist.get_rank(group)):
            raise UsageError(
                f"dynashard.export_safetensors: {name!r} is cut over a group of {spec.world} ranks (this rank is its "
                f"rank {spec.rank}), and the export's group has {len(members)}: on a dp x tp mesh every tp group "
                "holds the same shards. Expected one replica to export over its tp group: if "
                "mesh.get_local_rank('dp') == 0: export_safetensors(model, path, group=mesh['tp'].get_group()).")
        if _is_dtensor(value):
            outside = sorted(set(value.device_mesh.mesh.flatten().tolist()) - members)
            if outside:
                raise UsageError(
                    f"dynashard.export_safetensors: {name!r} is a DTensor over ranks {outside} outside the export's "
                    "group; expected every rank of the model's mesh to call export_safetensors with a group "
                    "holding them all (the default, the world group).")


def _export_entries(model: torch.nn.Module, store: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, value this rank holds, full-shape tensor)`` for each distinct state_dict tensor: for a
    sharded weight the value is this rank's shard and the full tensor its storage-less facade."""
    facade_of: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for facade in facades(module).values():
            facade_of[id(store.shard_of(facade))] = facade
        for inner in quantized_slots(module).values():  # (state_dict() holds their shards: quantized_state.py)
            facade_of.update((id(store.shard_of(t)), t) for _, t in inner if store.is_sharded(t))
    entries, seen = [], set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen or not isinstance(value, torch.Tensor):
            continue
        seen.add(id(value))
        if store.is_sharded(value):  # compiled without parallelize: the parameter is the freed full tensor
            entries.append((name, store.shard_of(value), value))
        else:
            entries.append((name, value, facade_of.get(id(value), value)))
    return entries


def _parse_size(size: int | str | None) -> int | None:
    if size is None or isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = size.strip().upper()
    for unit, factor in units.items():
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * factor)
    raise UsageError(f"dynashard: max_shard_size={size!r} is not a size; expected bytes (an int) or a string "
                     "such as '5GB' or '500MB'.")


def _file_plan(path: str, sizes: list[tuple[str, int]], limit: int | None) -> list[tuple[str, set[str]]]:
    """Which tensors go into which file, in order, each file under ``limit`` bytes (a larger tensor
    alone), as ``save_pretrained`` splits them."""
    if path.endswith(".safetensors"):
        return [(path, {n for n, _ in sizes})]
    groups: list[list[str]] = [[]]
    held = 0
    for name, size in sizes:
        if limit is not None and groups[-1] and held + size > limit:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    if len(groups) == 1:
        return [(os.path.join(path, "model.safetensors"), set(groups[0]))]
    n = len(groups)
    return [(os.path.join(path, f"model-{i + 1:05d}-of-{n:05d}.safetensors"), set(g)) for i, g in enumerate(groups)]


class _Writer:
    """One safetensors file written a tensor at a time: the header (names, dtypes, shapes, byte
    offsets: all known from the full shapes) first, then each tensor's bytes as it arrives, in the
    header's order. The format: an 8-byte little-endian header length, the JSON header padded with
    spaces to 8 bytes, the data (https://github.com/huggingface/safetensors, "Format")."""

    def __init__(self, file: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.file, self.tmp = file, file + ".partial"
        self.names = [n for n, _ in tensors]
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, t in tensors:
            size = math.prod(t.shape) * t.element_size()
            header[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
        self.expected = {n: header[n] for n in self.names}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.f = open(self.tmp, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        if self.names[self.next] != name:
            raise UsageError(f"dynashard: export wrote {name!r} out of order (expected {self.names[self.next]!r})")
        meta = self.expected[name]
        if list(t.shape) != meta["shape"] or _dtype_name(t.dtype) != meta["dtype"]:
            raise UsageError(f"dynashard: {name!r} gathered as {t.dtype}{list(t.shape)}; expected {meta}")
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            self.f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
        self.next += 1

    def finish(self) -> None:
        if self.next != len(self.names):
            raise UsageError(f"dynashard: export of {self.file} stopped after {self.next} of {len(self.names)} tensors")
        self.f.close()
        os.replace(self.tmp, self.file)

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
            os.remove(self.tmp)


def _dtype_name(dtype: torch.dtype) -> str:
    names = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
    if dtype not in names:
        raise UsageError(f"dynashard: safetensors cannot hold {dtype}; expected one of {sorted(map(str, names))}")
    return names[dtype]
