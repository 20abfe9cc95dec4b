"""A Hugging Face `save_pretrained` directory written one safetensors file at a time: the files planned from the
tensors' names, shapes and dtypes alone, split as `save_pretrained` splits them, each file's tensors read and written
before the next file's are read, so one file (plus one tensor) is in memory at most. It reads no checkpoint itself.
"""

from __future__ import annotations

import json
import os
import re
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_parallel.hf_format import Reader

# transformers 5's `save_pretrained(max_shard_size=...)` default (4.x: "5GB"); a tensor larger gets a file of its own
DEFAULT_MAX_SHARD_SIZE = "50GB"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"  # the one file of a model within one shard
INDEX_FILE = "model.safetensors.index.json"  # the map of a model in several: model-00001-of-0000N.safetensors, ...
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def plan_files(tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> Any:
    """Which file holds which tensor, from shapes and dtypes alone (meta tensors do): huggingface_hub's
    `split_torch_state_dict_into_shards`, what `save_pretrained` calls, in the tensors' order. A `StateDictSplit`."""
    try:  # installed with transformers; the library does not need it otherwise
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError:
        raise ValueError("export --hf plans its files with huggingface_hub. HINT: pip install transformers") from None
    size: int | str = int(max_shard_size) if str(max_shard_size).strip().isdigit() else max_shard_size
    try:
        if isinstance(size, int) and size <= 0:
            raise ValueError("it is not positive")
        return split_torch_state_dict_into_shards(tensors, max_shard_size=size)
    except ValueError as error:  # huggingface_hub's own line names the unit it read
        raise ValueError(
            f"max shard size {max_shard_size!r} is not a size: {error}. HINT: give a number of bytes or digits and a "
            f"unit, as save_pretrained takes them (e.g. --max-shard-size 5GB; default {DEFAULT_MAX_SHARD_SIZE})"
        ) from None


def write_pretrained(
    out_dir: str | os.PathLike,
    tensors: dict[str, torch.Tensor],
    read: Reader,
    config: dict[str, Any],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write `config.json` and the weights as `save_pretrained` does: `model.safetensors` within one shard, otherwise
    `model-0000i-of-0000N.safetensors` files of at most `max_shard_size` bytes each (a larger tensor alone in one) and
    `model.safetensors.index.json`, metadata `{"format": "pt"}` in every file, so `AutoModel*.from_pretrained(out_dir)`
    builds the model. `tensors` gives names, shapes and dtypes (their values are not read); `read(names)` returns those
    tensors whole, and is called once per file. An earlier export's weight files that this one does not write are
    removed."""
    try:
        from safetensors.torch import save_file  # installed with transformers; the library does not need it otherwise
    except ImportError:
        raise ValueError("export --hf writes safetensors files. HINT: pip install safetensors") from None
    split = plan_files(tensors, max_shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():  # from_pretrained would read an old model.safetensors before a new index
        if _WEIGHT_FILE.fullmatch(stale.name) and stale.name not in split.filename_to_tensors:
            stale.unlink()
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _replace(out / CONFIG_FILE, lambda tmp: tmp.write_text(text))
    for filename, names in split.filename_to_tensors.items():  # one file's tensors alive at a time
        _replace(out / filename, partial(_write_weights, save_file, read, names))
    if split.is_sharded:
        # save_pretrained's index; its total_parameters counts parameters, here every saved tensor's elements
        total = sum(t.numel() for t in tensors.values())
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        index_text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        _replace(out / INDEX_FILE, lambda tmp: tmp.write_text(index_text))
    return out


def _write_weights(save_file: Any, read: Reader, names: list[str], file: Path) -> None:
    save_file(_unshared(read(names)), str(file), metadata={"format": "pt"})  # freed when this returns


def _replace(file: Path, write: Any) -> None:
    """Write through a temporary name, so an interrupted export never leaves a half-written file under `file`."""
    tmp = file.with_name(file.name + ".partial")
    write(tmp)
    os.replace(tmp, file)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing storage with another (safetensors refuses aliases; a plain checkpoint's
    tensors may be views of one storage)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out
