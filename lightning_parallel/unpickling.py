"""Reading checkpoint files without running code from them. A pickle can call any function while it loads, so every
file a user hands in is read with `torch.load(weights_only=True)`, and DCP's `.metadata` (which torch reads with
plain `pickle`) with an unpickler that builds only DCP's own metadata types; anything else is refused in one line
naming it. `weights_only=False` reads a file the user trusts the old way. This module only reads; nothing writes here.

Which types are allowed, and why (measured by saving with every strategy here: single, ddp, pipeline, tensor,
local_sgd, diloco, async_sgd, with optimizer state, an LR scheduler and ModelCheckpoint state):
- Checkpoint files (`meta.pt`, Lightning's single files, DCP's non-tensor entries such as optimizer
  hyperparameters) hold only tensors, containers, numbers, strings and `OrderedDict`, all in torch's own
  `weights_only` set, so nothing is added to it. The tasks save only `model_config` and `num_classes` as
  hyperparameters. A LightningModule that saves an arbitrary object as a hyperparameter (a `functools.partial`
  optimizer, an `nn.Module` passed to `__init__`) makes a checkpoint that is refused by name: building such an
  object is exactly what runs code, and Lightning 2.6 refuses it the same way (`pl_load` hands `weights_only=None`
  to torch, which reads it as True since torch 2.6), so the user opts in for a file they trust.
- DCP's `.metadata`: `METADATA_GLOBALS`, the dataclasses DCP pickles there plus what they hold (`torch.Size`,
  dtypes, the layout and memory-format encodings, the `pathlib` path DCP records as the checkpoint id).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
METADATA_GLOBALS = frozenset(
    {
        *(
            f"{_DCP}.metadata.{name}"
            for name in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        f"{_DCP}.filesystem._StorageInfo",
        "torch.Size",
        "torch.serialization._get_layout",
        *(f"torch.{name}" for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)),
        # The checkpoint id DCP records (`StorageMeta.checkpoint_id`); Python 3.13 pickles paths from pathlib._local.
        *(f"{module}.{kind}Path" for module in ("pathlib", "pathlib._local") for kind in ("Posix", "Windows")),
    }
)


class UntrustedCheckpoint(ValueError):
    """A file that only a full unpickling could read, which can run code from it; the message names what it needs.

    Args:
        path: the file refused.
        names: the pickled globals (types or functions) it needs beyond the allowed ones.
    """

    def __init__(self, path: str | os.PathLike, names: Iterable[str]) -> None:
        self.path, self.names = str(path), sorted(set(names))
        super().__init__(self.line("pass weights_only=False"))

    def __reduce__(self) -> tuple[type, tuple[str, list[str]]]:  # DCP gathers a rank's error to every rank
        return type(self), (self.path, self.names)

    def line(self, opt_in: str) -> str:
        """The one-line refusal, with `opt_in` (how this entry point reads a trusted file) in the HINT."""
        return (
            f"{self.path} needs {', '.join(self.names)} to load, and building those could run code from the file, "
            f"so it is not read. HINT: only for a file you trust: {opt_in}"
        )


def load_file(source: str | os.PathLike | IO[bytes], *, weights_only: bool, mmap: bool = False, name: str = "") -> Any:
    """`torch.load` onto the CPU; with `weights_only`, a file that needs other types raises `UntrustedCheckpoint`.
    Other errors (a truncated or foreign file) pass through for the caller to name. `name` names a buffer."""
    try:
        return torch.load(source, map_location="cpu", mmap=mmap or None, weights_only=weights_only)
    except pickle.UnpicklingError as error:
        if not weights_only:
            raise
        names = _unsafe_globals(source) or re.findall(r"GLOBAL (\S+)", str(error))
        if names:
            raise UntrustedCheckpoint(name or str(source), names) from None
        raise


def _unsafe_globals(source: str | os.PathLike | IO[bytes]) -> list[str]:
    """Every global a file's pickle names outside torch's `weights_only` set (read statically, nothing built)."""
    try:
        if not isinstance(source, str | os.PathLike):
            source.seek(0)
        return torch.serialization.get_unsafe_globals_in_checkpoint(source)
    except Exception:  # not a zip checkpoint: the load's own message is all there is
        return []


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only `METADATA_GLOBALS`; the first other global stops the load, before anything is called."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" not in METADATA_GLOBALS:
            raise UntrustedCheckpoint(self.path, [f"{module}.{name}"])
        return super().find_class(module, name)


def read_metadata(path: str | os.PathLike, *, weights_only: bool) -> Metadata:
    """DCP's `.metadata` of a checkpoint directory, as `FileSystemReader.read_metadata` reads it (which unpickles
    anything), built from `METADATA_GLOBALS` only unless `weights_only` is False."""
    file = Path(path) / METADATA_FILE
    with open(file, "rb") as handle:
        metadata = _MetadataUnpickler(handle, file).load() if weights_only else pickle.load(handle)
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class CheckedReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` with `read_metadata` (each rank reads it in `dcp.load`)."""

    def __init__(self, path: str | os.PathLike, *, weights_only: bool) -> None:
        super().__init__(path)
        self.weights_only = weights_only

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.path, weights_only=self.weights_only)
        # As FileSystemReader does: older checkpoints have no storage_meta; the load id is this reader's.
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but its non-tensor entries (optimizer hyperparameters, stored as pickles) are read
    with `load_file` instead of `torch.load(weights_only=False)`. Tensors are read by DCP with `weights_only=True`."""

    def __init__(self, path: str | os.PathLike, *, weights_only: bool) -> None:
        super().__init__()
        self.path, self.weights_only = path, weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        loaded = load_file(value, weights_only=self.weights_only, name=f"{key} in {self.path}")
        if not self.flatten_state_dict:
            self.state_dict[key] = loaded
            return
        *parents, last = self.mappings[key]  # where the flat key sits in the nested state dict being loaded
        node: Any = self.original_state_dict
        for part in parents:
            node = node[part]
        node[last] = loaded
