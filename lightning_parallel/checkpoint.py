"""Sharded checkpoints with torch.distributed.checkpoint (DCP), keyed by the model's original parameter
names, so a checkpoint written by any layout loads into any other, or into one plain process.

A checkpoint is a directory: DCP's shard files for the model and optimizer state, plus `meta.pt` with
everything else Lightning saves (loops, callbacks, epoch). This module reads and writes; the strategy
decides who writes what and when (see strategies/base.py). Every read runs no code from the files unless the
caller passes `weights_only=False` for a checkpoint it trusts (see unpickling.py).

Export to one file: `python -m lightning_parallel.checkpoint export CHECKPOINT_DIR OUT.ckpt`
Export a transformers model as a Hugging Face directory: `... export CHECKPOINT OUT_DIR --hf [--max-shard-size 5GB]`
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_parallel.checkpoint_files import (
    META_FILE,
    MODEL_KEY,
    move_in,
    old_path,
    partial_path,
    recover,
    remove,
    replace_with,
    serialized,
)
from lightning_parallel.hf_directory import DEFAULT_MAX_SHARD_SIZE
from lightning_parallel.unpickling import (
    METADATA_FILE,
    CheckedLoadPlanner,
    CheckedReader,
    UntrustedCheckpoint,
    load_file,
    read_metadata,
)

__all__ = [  # the atomic replacement's names too (`checkpoint_files.py`), imported from here by callers
    "META_FILE", "MODEL_KEY", "check_complete", "check_matches", "compare_tensors", "export", "is_sharded_checkpoint",
    "load_module", "load_shards", "load_single_file", "main", "move_in", "old_path", "partial_path", "read_meta",
    "recover", "remove", "replace_with", "saved_tensors", "serialized", "sharded_tensors", "whole_state",
]  # fmt: skip


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def check_complete(path: Path, *, weights_only: bool = True) -> None:
    """Every shard file DCP's metadata names is present and long enough, and `meta.pt` reads; one line naming
    the missing or short file otherwise (a copy cut short, a deleted shard), before anything loads."""
    hint = "HINT: resume from an earlier checkpoint of the run, or copy this one again"
    try:
        storage = read_metadata(path, weights_only=weights_only).storage_data
    except FileNotFoundError:
        raise ValueError(f"checkpoint {path} is incomplete: {METADATA_FILE} is missing. {hint}") from None
    except UntrustedCheckpoint:
        raise
    except Exception as error:  # a truncated pickle raises several types
        raise ValueError(
            f"checkpoint {path} is damaged: {METADATA_FILE} does not read ({type(error).__name__}). {hint}"
        ) from None
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise ValueError(f"checkpoint {path} is incomplete: shard {name} is missing. {hint}")
        if file.stat().st_size < size:
            raise ValueError(
                f"checkpoint {path} is incomplete: shard {name} has {file.stat().st_size} bytes, its metadata "
                f"needs {size}. {hint}"
            )


def read_meta(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """Everything but the tensors (`meta.pt`), after checking that the directory is a whole sharded checkpoint."""
    path = Path(path)
    if path.is_dir() and (path / METADATA_FILE).is_file() and not (path / META_FILE).is_file():
        raise ValueError(
            f"checkpoint {path} is incomplete: {META_FILE} is missing (the save was cut short). HINT: resume "
            "from an earlier checkpoint of the run"
        )
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a sharded checkpoint (no {META_FILE} inside). HINT: pass the directory a "
            "lightning_parallel strategy saved, e.g. <run>/checkpoints/last.ckpt"
        )
    check_complete(path, weights_only=weights_only)
    try:
        return load_file(path / META_FILE, weights_only=weights_only)
    except UntrustedCheckpoint:
        raise
    except Exception as error:  # a truncated pickle raises EOFError, RuntimeError or UnpicklingError
        raise ValueError(
            f"checkpoint {path} is damaged: {META_FILE} does not read ({type(error).__name__}). HINT: resume "
            "from an earlier checkpoint of the run, or copy this one again"
        ) from None


def saved_tensors(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the model tensors in a checkpoint (a sharded directory, or one Lightning file),
    read from DCP's metadata or a memory-mapped load, without reading the values."""
    path = Path(path)
    if path.is_dir():
        read_meta(path, weights_only=weights_only)
        return sharded_tensors(path, weights_only=weights_only)
    state = load_single_file(path, weights_only=weights_only)[MODEL_KEY]
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_single_file(path: Path, *, weights_only: bool) -> dict[str, Any]:
    """A Lightning checkpoint file, memory-mapped (tensors read when used); one line for a file that is not one."""
    try:
        checkpoint = load_file(path, weights_only=weights_only, mmap=True)
    except UntrustedCheckpoint:
        raise
    except Exception as error:  # torch raises several types for a file that is not a checkpoint
        raise ValueError(
            f"{path} is not a checkpoint torch can read ({type(error).__name__}). HINT: pass a .ckpt a run saved"
        ) from None  # one line: the cause names torch internals, not the file
    state = checkpoint.get(MODEL_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(
            f"{path} holds no '{MODEL_KEY}', so it is not a Lightning checkpoint. HINT: pass a .ckpt a run saved"
        )
    return checkpoint


def sharded_tensors(path: Path, *, weights_only: bool = True) -> dict[str, tuple[int, ...]]:
    """Names and global shapes of the model tensors in a sharded checkpoint already checked by `read_meta`."""
    metadata = read_metadata(path, weights_only=weights_only).state_dict_metadata
    prefix = MODEL_KEY + "."
    return {k[len(prefix) :]: tuple(v.size) for k, v in metadata.items() if k.startswith(prefix) and hasattr(v, "size")}


def check_matches(path: str | os.PathLike, module: nn.Module, *, weights_only: bool = True) -> None:
    """Before launch: the checkpoint holds exactly this module's tensors, with the same shapes (works on a
    meta-device module); one line naming the first differences otherwise."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    compare_tensors(path, saved_tensors(path, weights_only=weights_only), expected, whole=True)


def compare_tensors(
    path: str | os.PathLike, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], *, whole: bool
) -> None:
    """One line naming the tensors `expected` lacks in `saved` or has with other shapes, and with `whole` (the
    whole model, not one rank's part) also the saved tensors the model does not have."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys()) if whole else []
    reshaped = sorted(
        f"{k} {saved[k]} != {expected[k]}" for k in expected.keys() & saved.keys() if saved[k] != expected[k]
    )
    if missing or unexpected or reshaped:
        parts = [
            f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shapes", reshaped))
            if items
        ]
        raise ValueError(
            f"{path} was saved from another model ({'; '.join(parts)}). HINT: resume with the model and data "
            "options of the run that saved it"
        )


def load_module(module: nn.Module, path: str | os.PathLike, *, strict: bool = True, weights_only: bool = True) -> None:
    """Load a sharded checkpoint's model weights into one plain, whole module (no process group needed).

    `module` is what the strategy saved: the LightningModule (keys like `model.block_0.attn.q.weight`).
    """
    read_meta(path, weights_only=weights_only)  # clear error for a wrong path
    state = {MODEL_KEY: module.state_dict()}
    load_shards(state, path, weights_only=weights_only)
    module.load_state_dict(state[MODEL_KEY], strict=strict)


def load_shards(state: dict[str, Any], path: str | os.PathLike, *, weights_only: bool = True) -> None:
    """`dcp.load(state, path)` in place, reading `.metadata` and the non-tensor entries without running code from
    them (DCP's own reader and planner unpickle both in full)."""
    reader = CheckedReader(path, weights_only=weights_only)
    try:
        dcp.load(state, storage_reader=reader, planner=CheckedLoadPlanner(path, weights_only=weights_only))
    except CheckpointException as error:  # DCP gathers every rank's errors into this one
        refused = [found for found, _ in error.failures.values() if isinstance(found, UntrustedCheckpoint)]
        if refused:
            raise refused[0] from None
        raise


def whole_state(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """Everything a sharded checkpoint's shards hold, as whole tensors in their saved nesting (`state_dict`,
    `optimizer_0`, ...), built from its metadata (what `dcp_to_torch_save` does, with checked reads). Tensor-parallel
    shards come back whole."""
    metadata = read_metadata(path, weights_only=weights_only)
    state: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        value = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        *parents, last = (metadata.planner_data or {}).get(key, (key,))  # our saves nest by name: dicts only
        node = state
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    load_shards(state, path, weights_only=weights_only)
    return state


def export(path: str | os.PathLike, out: str | os.PathLike, *, weights_only: bool = True) -> Path:
    """Write a sharded checkpoint as one ordinary `torch.save` file with the full `state_dict`."""
    meta = read_meta(path, weights_only=weights_only)
    merged = {**meta, **whole_state(path, weights_only=weights_only)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    torch.save(merged, tmp)
    os.replace(tmp, out)
    return out


TRUSTED_HELP = "read a checkpoint you trust even if loading it can run code from it (weights_only=False)"
HF_HELP = (
    "write the transformers model the checkpoint recorded as a Hugging Face save_pretrained directory (config.json, "
    "safetensors files and their index) that AutoModel*.from_pretrained reads, one file in memory at a time"
)
SHARD_HELP = (
    f"with --hf: the largest weight file, in bytes or with a unit as save_pretrained takes it (5GB, 500MB; default "
    f"{DEFAULT_MAX_SHARD_SIZE}, transformers' own); the export's memory is about one such file"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_parallel.checkpoint", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    exporter = commands.add_parser("export", help="write a sharded checkpoint directory as one file")
    exporter.add_argument("checkpoint", help="the checkpoint (e.g. <run>/checkpoints/last.ckpt; with --hf also a file)")
    exporter.add_argument("out", help="the single file to write (with --hf: the directory)")
    exporter.add_argument("--hf", action="store_true", help=HF_HELP)
    exporter.add_argument("--max-shard-size", help=SHARD_HELP)
    exporter.add_argument("--trusted", action="store_true", help=TRUSTED_HELP)
    args = parser.parse_args(argv)
    if args.max_shard_size is not None and not args.hf:
        print("error: --max-shard-size sizes the files of --hf. HINT: add --hf, or leave it out", file=sys.stderr)
        return 2
    shards = {"max_shard_size": args.max_shard_size or DEFAULT_MAX_SHARD_SIZE} if args.hf else {}
    from lightning_parallel.hf_export import export_pretrained  # which imports this module

    write = export_pretrained if args.hf else export
    try:
        written = write(args.checkpoint, args.out, weights_only=not args.trusted, **shards)
    except UntrustedCheckpoint as error:
        print(f"error: {error.line('--trusted')}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
