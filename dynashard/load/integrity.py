"""Checkpoints and exports that cannot mix: what every rank read is the same, a directory is whole.

Unchecked, ``parallelize(checkpoint=dir)`` reads whatever each rank's ``dir`` holds (a stale copy on one
node: the ranks run a mix of two models); an export into a directory leaves an earlier export's files
beside the new ones; a killed ``dcp.save`` over an old checkpoint loads half old, half new. The checks:

- :func:`fingerprint_files`, :func:`fingerprint_dcp`: a checkpoint's identity (``Checkpoint.fingerprint``),
  cheap to take on every rank: each file's name, size and header (safetensors) or DCP's ``.metadata``,
  and 32 bytes at both ends of every tensor's (or saved chunk's) data. Two checkpoints of the same shapes
  differ there unless their values agree at both ends of every tensor. ``parallelize`` compares it across
  ranks before reading, and a digest of every tensor read whole after.
- :func:`check_dcp`: a DCP directory whose files disagree with its ``.metadata`` (a file missing or
  short, a data file the metadata does not name, a data file written after it: DCP writes the
  metadata last) is refused.
- :func:`replace_directory`: a directory export is written into a sibling temporary directory and
  swapped in, the files an earlier export did not write (a tokenizer, a README) carried over: a
  killed export leaves the old export or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable
from typing import Any

import torch

from dynashard.errors import UsageError

_SAMPLE = 32  # bytes read at each end of each tensor's data
EXPORTED = ("model.safetensors.index.json", "config.json", "generation_config.json")  # besides *.safetensors
_TMP, _OLD = ".dynashard-writing-", ".dynashard-replaced-"
# A data file newer than .metadata by more than this was written after it (by a save that did not finish).
_MTIME_SLACK_S = 2.0


def fingerprint_files(files: Iterable[str]) -> str:
    """A short digest of safetensors ``files`` (module docstring)."""
    h = hashlib.sha256()
    for file in sorted(set(files)):
        _safetensors_file(h, file)
    return h.hexdigest()[:16]


def fingerprint_dcp(path: str, metadata: Any) -> str:
    """A short digest of the DCP directory ``path`` whose ``.metadata`` reads ``metadata`` (module docstring)."""
    h = hashlib.sha256()
    _dcp_directory(h, path, metadata)
    return h.hexdigest()[:16]


def _safetensors_file(h: Any, file: str) -> None:
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        h.update(f"{os.path.basename(file)}:{size}:".encode() + raw)
        header = json.loads(raw)
        for key in sorted(k for k in header if k != "__metadata__"):
            begin, end = header[key]["data_offsets"]
            _ends(h, f, 8 + n + begin, 8 + n + end)


def _dcp_directory(h: Any, path: str, metadata: Any) -> None:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        h.update(f.read())
    handles: dict[str, Any] = {}
    try:
        for info in sorted(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset)):
            f = handles.get(info.relative_path)
            if f is None:
                f = handles[info.relative_path] = open(os.path.join(path, info.relative_path), "rb")
            _ends(h, f, info.offset, info.offset + info.length)
    finally:
        for f in handles.values():
            f.close()


def _ends(h: Any, f: Any, begin: int, end: int) -> None:
    for at in {begin, max(begin, end - _SAMPLE)}:
        f.seek(at)
        h.update(f.read(min(_SAMPLE, end - at)))


def digest(t: torch.Tensor) -> str:
    """A digest of a tensor's bytes (a tensor every rank read whole: they must agree exactly)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


def disagreement(per_rank: list[Any], what: str) -> str | None:
    """Which ranks saw another ``what`` than rank 0 (None when they all agree)."""
    differ = [r for r, v in enumerate(per_rank) if v != per_rank[0]]
    return None if not differ else f"ranks {differ} {what} other than rank 0's"


def check_dcp(path: str, metadata: Any) -> None:
    """Refuse a DCP directory whose files disagree with its ``.metadata`` (module docstring)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    meta_time = os.stat(os.path.join(path, ".metadata")).st_mtime
    problems = []
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            problems.append(f"{name} is missing")
        elif os.path.getsize(file) < size:
            problems.append(f"{name} holds {os.path.getsize(file)} bytes, the metadata reads {size}")
        elif os.stat(file).st_mtime > meta_time + _MTIME_SLACK_S:
            problems.append(f"{name} was written after .metadata (a save into this directory that did not finish)")
    stray = sorted(n for n in os.listdir(path) if n.endswith(".distcp") and n not in needed)
    if stray:
        problems.append(f"{stray[:3]} are data files the metadata does not name (another save's)")
    if problems:
        raise UsageError(
            f"dynashard: the DCP checkpoint {path} disagrees with its .metadata: {'; '.join(problems[:4])}. Loading it "
            "would mix two saves. Expected a directory one dcp.save wrote completely: save each step into a fresh "
            "directory (checkpoint_id=f'{root}/step-{step}'). (A copy that did not keep file times trips the "
            "time check: `touch .metadata` there once you know the copy is whole.)")


def start_directory(target: str) -> str:
    """A fresh sibling of ``target`` to write an export into (stale ones of interrupted exports removed)."""
    for stale in leftovers(target):
        if _TMP in os.path.basename(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = sibling(target, _TMP)
    os.makedirs(tmp)
    return tmp


def replace_directory(tmp: str, target: str) -> None:
    """``tmp`` (a complete export) becomes ``target``; files of ``target`` no export writes (a tokenizer, a
    README) are carried over. Two renames: killed between them, ``target`` is gone and both siblings are
    whole (the previous export, the new one), which a load names."""
    previous = target if os.path.isdir(target) else next(iter(leftovers(target)), None)
    if previous is not None and os.path.isdir(previous):
        for name in os.listdir(previous):
            if name.endswith(".safetensors") or name in EXPORTED or name.endswith(".partial"):
                continue
            src, dst = os.path.join(previous, name), os.path.join(tmp, name)
            if not os.path.exists(dst):
                (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, dst)
    if os.path.isdir(target):
        old = sibling(target, _OLD)
        os.rename(target, old)
    os.rename(tmp, target)
    for stale in leftovers(target):  # the replaced export, and any an earlier interrupted swap left
        shutil.rmtree(stale, ignore_errors=True)


def sibling(target: str, kind: str = _TMP) -> str:
    target = os.path.normpath(target)
    return os.path.join(os.path.dirname(target) or ".", f"{os.path.basename(target)}{kind}{os.getpid()}")


def leftovers(target: str) -> list[str]:
    """Siblings of ``target`` an interrupted export left (whole exports, the old or the new one)."""
    target = os.path.normpath(target)
    parent, base = os.path.dirname(target) or ".", os.path.basename(target)
    if not os.path.isdir(parent):
        return []
    return sorted(os.path.join(parent, n) for n in os.listdir(parent)
                  if n.startswith(base + _TMP) or n.startswith(base + _OLD))
