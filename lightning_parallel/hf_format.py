"""Checkpoints back to Hugging Face: which submodule of a LightningModule is a `transformers` model (recorded at save
time as plain data, so checkpoints still read with weights_only=True) and the `save_pretrained` directory written from
its whole tensors (config.json + model.safetensors, tied weights once). transformers itself is never imported: a model
is recognised by its `config` (`to_dict` and a `model_type`). Reading the checkpoint is `checkpoint.py`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

RECORD_KEY = "hugging_face"  # the checkpoint entry: {attribute path: description} of each transformers model
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def pretrained_models(module: nn.Module) -> dict[str, nn.Module]:
    """The outermost submodules (by attribute path, "" for `module` itself) whose `config` is a transformers
    configuration: `GPT2LMHeadModel` under `self.model`, not its inner `GPT2Model` as well."""
    found: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        if any(prefix == "" or name.startswith(prefix + ".") for prefix in found):
            continue
        config = getattr(child, "config", None)
        if callable(getattr(config, "to_dict", None)) and isinstance(getattr(config, "model_type", None), str):
            found[name] = child
    return found


def describe_pretrained(module: nn.Module) -> dict[str, dict[str, Any]]:
    """What an export needs to know of each transformers model in `module`, as JSON-able data: its class, its config
    as a dict, the weights it ties (`{target: source}`, transformers' `all_tied_weights_keys`; only the source is
    saved) and the keys it never saves. Works on a pruned or sharded model: nothing here reads a parameter."""
    described: dict[str, dict[str, Any]] = {}
    for path, model in pretrained_models(module).items():
        config: Any = model.config
        described[path] = {"class": type(model).__name__, "module": type(model).__module__}
        try:
            described[path]["config"] = json.loads(json.dumps(config.to_dict(), default=_dtype_name))
        except (TypeError, ValueError) as error:  # a save never fails for the record's sake: the export says why
            described[path]["unrecorded"] = f"its config is not JSON ({error})"
            continue
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        described[path]["tied"] = {str(target): str(source) for target, source in tied.items()}
        described[path]["not_saved"] = sorted(str(k) for k in getattr(model, "_keys_to_ignore_on_save", None) or ())
    return described


def _dtype_name(value: object) -> str:
    if isinstance(value, torch.dtype):  # older configs keep `torch_dtype` as a torch.dtype
        return str(value).removeprefix("torch.")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def pick_record(records: Any, source: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """The one recorded transformers model of a checkpoint (its attribute path and description); one line otherwise."""
    if not isinstance(records, dict) or not records:
        raise ValueError(
            f"{source} records no transformers model, so it cannot be written as a Hugging Face directory. HINT: a "
            "model whose `config` has a `model_type` is recorded when a lightning_parallel strategy saves (add "
            "lightning_parallel.callbacks.RecordPretrained() to the Trainer's callbacks under other strategies); "
            "`export CKPT OUT.ckpt` without --hf writes any checkpoint as one file"
        )
    if len(records) > 1:
        raise ValueError(
            f"{source} holds {len(records)} transformers models ({', '.join(sorted(records))}), and a Hugging Face "
            "directory holds one. HINT: save the one to export from a LightningModule that holds only it"
        )
    path, record = next(iter(records.items()))
    if "unrecorded" in record:
        raise ValueError(
            f"{source} holds a {record['class']} whose config could not be recorded when it was saved: "
            f"{record['unrecorded']}. HINT: make the config's values JSON-serialisable and save again"
        )
    return path, record


def pretrained_tensors(state: dict[str, Any], path: str, record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's tensors from a LightningModule's whole state dict, named as in the model class (the attribute
    prefix `path.` stripped), each tied weight once under its source's name, as `save_pretrained` stores them."""
    prefix = f"{path}." if path else ""
    tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(
            f"the checkpoint has no tensors under '{path}', where its {record['class']} was recorded. HINT: export "
            "a checkpoint the run saved with its weights (not a partial or foreign state dict)"
        )
    for target, source in record["tied"].items():
        if target in tensors and source in tensors:
            if not torch.equal(tensors[target], tensors[source]):
                gap = float((tensors[target].float() - tensors[source].float()).abs().max())
                raise ValueError(
                    f"{record['class']} ties {target} to {source}, but the checkpoint holds different values "
                    f"(max abs difference {gap:.2e}), so one of them would be lost. HINT: export with --hf only "
                    "checkpoints whose tied weights stayed tied in training"
                )
            del tensors[target]
    for key in record["not_saved"]:
        tensors.pop(key, None)
    return tensors


def write_pretrained(out_dir: str | os.PathLike, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> Path:
    """Write `config.json` and `model.safetensors` (metadata `{"format": "pt"}`) as `save_pretrained` does, so
    `AutoModel*.from_pretrained(out_dir)` builds the recorded class with these weights."""
    try:
        from safetensors.torch import save_file  # installed with transformers; the library does not need it otherwise
    except ImportError:
        raise ValueError("export --hf writes model.safetensors. HINT: pip install safetensors") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    config = {**record["config"], "architectures": [record["class"]]}
    if floating:  # save_pretrained records the model's dtype, which from_pretrained may load in
        config["dtype"] = str(floating[0]).removeprefix("torch.")
    _replace(out / CONFIG_FILE, lambda tmp: tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n"))
    _replace(out / WEIGHTS_FILE, lambda tmp: save_file(_unshared(tensors), str(tmp), metadata={"format": "pt"}))
    return out


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
