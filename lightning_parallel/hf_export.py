"""`export CHECKPOINT OUT_DIR --hf`: the transformers model a checkpoint recorded, read one output file's tensors at a
time from its DCP shards (or from a memory-mapped Lightning file) and written by `hf_directory.py`, so no process holds
the whole model. The command line is `checkpoint.py`'s."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_parallel.checkpoint import MODEL_KEY, load_shards, load_single_file, read_meta
from lightning_parallel.hf_directory import DEFAULT_MAX_SHARD_SIZE, write_pretrained
from lightning_parallel.hf_format import RECORD_KEY, Reader, pick_record, pretrained_config, pretrained_view
from lightning_parallel.unpickling import read_metadata

Tensors = dict[str, torch.Tensor]


def export_pretrained(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    weights_only: bool = True,
) -> Path:
    """Write the transformers model a checkpoint (a sharded directory or one Lightning file, of any layout) recorded
    at save time as a Hugging Face `save_pretrained` directory, without the LightningModule that trained it: files of
    at most `max_shard_size` bytes (save_pretrained's sizes and names), each read from the checkpoint and written before
    the next is read, so memory holds one file's tensors (and a tied copy, checked equal), never the whole model."""
    opened = _sharded(Path(path), weights_only) if Path(path).is_dir() else _single_file(Path(path), weights_only)
    (attribute, described), saved, read = opened
    tensors, read_named = pretrained_view(saved, read, attribute, described)
    config = pretrained_config(described, tensors)
    return write_pretrained(out_dir, tensors, read_named, config, max_shard_size=max_shard_size)


def _sharded(path: Path, weights_only: bool) -> tuple[tuple[str, dict], Tensors, Reader]:
    """The record, the model's tensors as meta tensors (DCP's global shapes) and a reader of some of them: a DCP load of
    just those, into whole tensors (tensor-parallel and FSDP shards put together by DCP)."""
    record = pick_record(read_meta(path, weights_only=weights_only).get(RECORD_KEY), path)  # before the shards
    prefix = MODEL_KEY + "."
    saved = {
        key[len(prefix) :]: torch.empty(item.size, dtype=item.properties.dtype, device="meta")
        for key, item in read_metadata(path, weights_only=weights_only).state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }

    def read(names: list[str]) -> Tensors:
        state = {MODEL_KEY: {name: torch.empty_like(saved[name], device="cpu") for name in names}}
        load_shards(state, path, weights_only=weights_only)
        return state[MODEL_KEY]

    return record, saved, read


def _single_file(path: Path, weights_only: bool) -> tuple[tuple[str, dict], Tensors, Reader]:
    """The record, the tensors and a reader of a Lightning checkpoint file, memory-mapped: the operating system pages
    each tensor in when it is written (resident pages it may drop under pressure, not memory the export allocates)."""
    checkpoint = load_single_file(path, weights_only=weights_only)
    record = pick_record(checkpoint.get(RECORD_KEY), path)
    saved = {key: value for key, value in checkpoint[MODEL_KEY].items() if isinstance(value, torch.Tensor)}
    return record, saved, lambda names: {name: saved[name] for name in names}
