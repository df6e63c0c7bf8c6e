"""Checkpoints read a slice at a time: each rank reads only the parts of each tensor it holds.

Before: a path (one ``.safetensors`` file, a directory of them, an HF sharded checkpoint with
``model.safetensors.index.json``, or a ``torch.distributed.checkpoint`` directory).
After: a :class:`Checkpoint` that answers ``read(fqn, dim, pieces, dtype)`` with this rank's
pieces of one tensor side by side -- the layout :func:`dynashard.weights.store.cut` gives a full tensor,
so a shard read here equals a shard cut from the whole model.

How little is read:

- safetensors: ``safe_open(...).get_slice(fqn)[slices]`` reads only the bytes of the slice (the
  file is memory-mapped; a slice along dim 0 is one contiguous byte range);
- DCP: a :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` whose plan asks for exactly
  the chunks wanted (``create_read_items_for_chunk_list``; :class:`~dynashard.weights.dcp_planners.SlicePlanner`),
  loaded into buffers of the target dtype with ``no_dist=True`` (every rank reads on its own, no
  collective). Pieces may overlap across ranks (K/V heads several ranks hold whole). DCP's own
  ``FileSystemReader`` loads each saved chunk whole and then narrows it, so an unsharded-saved
  tensor is read one at a time.

DCP's planner protocol for shards (saving them at global offsets, ``LoadPlanner``) is ``dcp_planners.py``.

Errors name the tensor, what was expected and what was found, and the fix (a path that does not
exist, a tensor missing from the checkpoint, a slice outside the saved shape, a corrupt file).
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from dynashard.errors import UsageError
from dynashard.load.integrity import check_dcp, fingerprint_dcp, fingerprint_files, leftovers
from dynashard.weights.dcp_planners import SlicePlanner

Pieces = list[tuple[int, int]]  # (start, length) along one dim

_INDEX = "model.safetensors.index.json"
_DCP_METADATA = ".metadata"


class Checkpoint:
    """Tensors by FQN, read in slices. Build with :func:`open_checkpoint`."""

    path: str
    # the files' own metadata (safetensors' header ``__metadata__``): torchao describes its quantized weights there
    metadata: dict[str, str] = {}

    def keys(self) -> set[str]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A short digest of what the files hold, cheap on every rank (integrity.py); "" for tensors in memory."""
        return ""

    def shape(self, fqn: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, fqn: str) -> torch.dtype:
        raise NotImplementedError

    def _read(self, fqn: str, dim: int, pieces: Pieces, dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
        raise NotImplementedError

    def read(self, fqn: str, dim: int = 0, pieces: Pieces | None = None, dtype: torch.dtype | None = None,
             device: Any = None) -> torch.Tensor:
        """``fqn``'s ``pieces`` along ``dim``, side by side, in ``dtype`` (default: as saved), on ``device``
        (default: the CPU; tensors held in memory stay where they are); ``pieces=None`` reads the whole tensor."""
        self._check_key(fqn)
        shape = self.shape(fqn)
        dtype = dtype or self.dtype(fqn)
        if pieces is None:
            dim, pieces = 0, [(0, shape[0])] if shape else []
            if not shape:  # a 0-d tensor: one element, no dim to slice
                return self._read(fqn, 0, [], dtype, device)[0]
        if not -len(shape) <= dim < len(shape):
            raise UsageError(f"dynashard: cannot slice {fqn!r} on dim {dim}: it is saved with shape {list(shape)} "
                             f"in {self.path}; expected a tensor with that dim.")
        dim %= len(shape)
        for start, length in pieces:
            if start < 0 or length < 0 or start + length > shape[dim]:
                raise UsageError(
                    f"dynashard: {fqn!r} in {self.path} has {shape[dim]} elements on dim {dim} (shape {list(shape)}); "
                    f"expected elements [{start}, {start + length}) to exist there. The checkpoint was saved from "
                    "a model of another size: check that the model's config matches it.")
        parts = self._read(fqn, dim, pieces, dtype, device) if pieces else []
        if not parts:
            empty = list(shape)
            empty[dim] = 0
            return torch.empty(empty, dtype=dtype, device=device)
        return owning(parts[0]) if len(parts) == 1 else torch.cat(parts, dim)

    def _check_key(self, fqn: str) -> None:
        if fqn not in self.keys():
            close = difflib.get_close_matches(fqn, sorted(self.keys()), n=3, cutoff=0.5)
            raise UsageError(
                f"dynashard: {fqn!r} is not in the checkpoint {self.path}" + (f"; closest: {close}" if close else "")
                + ". Expected a checkpoint saved from this model (its state_dict() names).")


def owning(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a storage of exactly its own bytes: a slice safetensors reads along dim 0 is a view of
    the whole tensor's (memory-mapped) storage, which ``untyped_storage()`` and ``torch.save`` would
    count and write whole, and which a copy to a device would allocate whole."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.is_contiguous():
        return t
    return t.clone(memory_format=torch.contiguous_format)


class SafetensorsCheckpoint(Checkpoint):
    """One file, a directory of files, or an HF sharded checkpoint (``model.safetensors.index.json``)."""

    def __init__(self, path: str, files: dict[str, str]) -> None:
        from safetensors import safe_open  # NOTE: a dependency of dynashard; imported where used

        self.path, self._where = path, files  # fqn -> file
        self._open: dict[str, object] = {}
        self._safe_open = safe_open
        self._meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.metadata = {}
        for file in sorted(set(files.values())):
            handle = self._handle(file)
            self.metadata.update(handle.metadata() or {})
            for key in handle.keys():
                if files.get(key) == file:
                    piece = handle.get_slice(key)
                    self._meta[key] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
        self._open.clear()  # (unmapped: see _read)
        missing = sorted(set(files) - set(self._meta))
        if missing:
            raise UsageError(f"dynashard: the index of {path} lists {missing[:5]} but their files do not hold them; "
                             "expected the files the index names, as save_pretrained wrote them.")

    def _handle(self, file: str, device: Any = None):
        if file not in self._open:
            try:  # (safetensors reads a slice straight to the device it was opened for)
                self._open[file] = self._safe_open(file, framework="pt", device=str(torch.device(device or "cpu")))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
                raise UsageError(f"dynashard: cannot read {file}: {e}. Expected a complete safetensors file; "
                                 "it may be truncated or corrupt: save it again.") from e
        return self._open[file]

    def keys(self) -> set[str]:
        return set(self._meta)

    def fingerprint(self) -> str:
        return fingerprint_files(self._where.values())

    def shape(self, fqn: str) -> tuple[int, ...]:
        return self._meta[fqn][0]

    def dtype(self, fqn: str) -> torch.dtype:
        return self._meta[fqn][1]

    def _read(self, fqn: str, dim: int, pieces: Pieces, dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
        # A handle maps its whole file, and every page a slice touched stays in this process's RSS while
        # it is mapped: a handle per read, closed after it, keeps that to one tensor's pages (measured by
        # benchmarks/bench_load.py, 2.2 GiB Llama at world 2: a handle held across the load took a rank's peak
        # RSS to 2.4 GiB; a handle per read, 1.5 GiB for 1.06 GiB of shards).
        file = self._where[fqn]
        try:
            source = self._handle(file, device).get_slice(fqn)
            if not pieces:
                return [source[...].to(dtype)]
            lead = (slice(None),) * dim
            return [source[(*lead, slice(start, start + length))].to(dtype) for start, length in pieces]
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"dynashard: reading {fqn!r} from {file} failed: {e}. Expected a complete "
                             "safetensors file; it may be truncated or corrupt: save it again.") from e
        finally:
            source = None
            self._open.pop(file, None)  # the last reference to the handle: unmapped


class DCPCheckpoint(Checkpoint):
    """A ``torch.distributed.checkpoint`` directory (saved by ``dcp.save``, sharded or not)."""

    def __init__(self, path: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._reader = FileSystemReader(path)
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"dynashard: cannot read the DCP metadata of {path}: {e}. Expected a directory "
                             "written by torch.distributed.checkpoint.save.") from e
        check_dcp(path, metadata)  # (files another save left, or a save that did not finish: refused)
        self._metadata = metadata
        self._tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def keys(self) -> set[str]:
        return set(self._tensors)

    def fingerprint(self) -> str:
        return fingerprint_dcp(self.path, self._metadata)

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        return self._tensors[fqn].properties.dtype

    def _read(self, fqn: str, dim: int, pieces: Pieces, dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        shape = list(self.shape(fqn))
        chunks = []
        for start, length in pieces or [(0, shape[0] if shape else 1)]:
            offsets, sizes = [0] * len(shape), list(shape)
            if shape:
                offsets[dim], sizes[dim] = start, length
            chunks.append((offsets, sizes))
        buffers = [torch.empty(sizes, dtype=dtype, device=device) for _, sizes in chunks]  # DCP copies into them
        wanted = [(o, s, b) for (o, s), b in zip(chunks, buffers) if b.numel()]
        if wanted:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({}, storage_reader=self._reader, planner=SlicePlanner(fqn, self._tensors[fqn], wanted),
                         no_dist=True)
        return buffers


class TensorsCheckpoint(Checkpoint):
    """Tensors held in memory, by name: rank 0's own model under ``weights="rank0"``."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: str) -> None:
        self.path, self._tensors = path, tensors

    def keys(self) -> set[str]:
        return set(self._tensors)

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._tensors[fqn].shape)

    def dtype(self, fqn: str) -> torch.dtype:
        return self._tensors[fqn].dtype

    def _read(self, fqn: str, dim: int, pieces: Pieces, dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
        t = self._tensors[fqn].detach()
        device = device or t.device
        if not pieces:
            return [t.to(device=device, dtype=dtype, copy=True)]
        return [t.narrow(dim, start, length).to(device=device, dtype=dtype, copy=True) for start, length in pieces]


class Beside(Checkpoint):
    """A checkpoint with tensors held in memory beside it (PEFT's initial adapters of a model built on meta, which a
    base model's checkpoint does not hold): the checkpoint's own tensor where both have a name."""

    def __init__(self, first: Checkpoint, beside: TensorsCheckpoint) -> None:
        self.first, self.beside, self.path, self.metadata = first, beside, first.path, first.metadata
        self._keys = first.keys() | beside.keys()

    def keys(self) -> set[str]:
        return self._keys

    def fingerprint(self) -> str:
        return self.first.fingerprint()

    def _of(self, fqn: str) -> Checkpoint:
        return self.first if fqn in self.first.keys() else self.beside

    def shape(self, fqn: str) -> tuple[int, ...]:
        return self._of(fqn).shape(fqn)

    def dtype(self, fqn: str) -> torch.dtype:
        return self._of(fqn).dtype(fqn)

    def _read(self, fqn: str, dim: int, pieces: Pieces, dtype: torch.dtype, device: Any) -> list[torch.Tensor]:
        return self._of(fqn)._read(fqn, dim, pieces, dtype, device)


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The checkpoint at ``path``: a ``.safetensors`` file, a directory holding safetensors files
    (with or without ``model.safetensors.index.json``), or a DCP directory (``.metadata``)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        left = leftovers(path)
        hint = (f" An export into it was interrupted while swapping directories: {left} hold the previous "
                "export and the new one (the newer is the one named .dynashard-writing-); rename the one you want "
                "to it." if left else "")
        raise UsageError(f"dynashard: checkpoint {path!r} does not exist; expected a .safetensors file, a directory "
                         f"of them (an HF checkpoint) or a torch.distributed.checkpoint directory.{hint}")
    if os.path.isfile(path):
        return SafetensorsCheckpoint(path, _keys_of([path]))
    if os.path.exists(os.path.join(path, _DCP_METADATA)):
        return DCPCheckpoint(path)
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        return SafetensorsCheckpoint(path, {k: os.path.join(path, v) for k, v in weight_map.items()})
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise UsageError(f"dynashard: {path!r} holds no .safetensors file, no {_INDEX} and no DCP {_DCP_METADATA}; "
                         "expected a checkpoint directory (save_pretrained, safetensors.torch.save_file or dcp.save).")
    return SafetensorsCheckpoint(path, _keys_of(files))


def _keys_of(files: Iterable[str]) -> dict[str, str]:
    """fqn -> file for files without an index (a key in two files is ambiguous: refused)."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"dynashard: cannot read {file}: {e}. Expected a complete safetensors file; it may be "
                             "truncated or corrupt: save it again.") from e
        for key in keys:
            if key in where:
                raise UsageError(f"dynashard: {key!r} is in both {where[key]} and {file}; expected each tensor in "
                                 "one file (or a model.safetensors.index.json saying which).")
            where[key] = file
    return where


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
