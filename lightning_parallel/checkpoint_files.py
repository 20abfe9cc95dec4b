"""A checkpoint's files on disk, replaced atomically: written under `<path>.partial`, `meta.pt` last, swapped in with
the previous one renamed aside (`<path>.old`) and removed last, and what an interrupted save left undone (`recover`).
It reads no checkpoint and decides nothing about who writes (`checkpoint.py`, the strategies).
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"
MODEL_KEY = "state_dict"


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it replaces `path`: a crash never leaves `path` half-written."""
    return path.with_name(path.name + ".partial")


def old_path(path: Path) -> Path:
    """Where the previous checkpoint waits while a new one moves in (see `replace_with`)."""
    return path.with_name(path.name + ".old")


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def replace_with(partial: Path, path: Path) -> None:
    """Swap a finished checkpoint into place (rank 0 only). The previous one is renamed aside first and
    removed last, so a kill at any moment leaves `path` or `<path>.old` whole (`recover` puts it back)."""
    remove(old_path(path))
    if path.exists():
        os.replace(path, old_path(path))
    os.replace(partial, path)
    remove(old_path(path))


def serialized(obj: Any) -> bytes:
    """`torch.save` into memory: a snapshot of small state that may change before it is written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def move_in(partial: Path, path: Path, meta: bytes) -> None:
    """Rank 0, once every rank's shards are in `partial`: write `meta.pt` (last, so a directory without it was cut
    short) and swap the checkpoint in for `path`."""
    (partial / META_FILE).write_bytes(meta)
    replace_with(partial, path)


def recover(folder: str | os.PathLike) -> None:
    """Undo what an interrupted save left in a checkpoint folder: a checkpoint renamed aside but never replaced
    goes back to its name; unfinished `.partial` writes and leftover `.old` copies are removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for old in folder.glob("*.old"):
        target = old.with_name(old.name[: -len(".old")])
        if target.exists():
            remove(old)
        else:
            os.replace(old, target)
    for partial in folder.glob("*.partial"):
        remove(partial)
