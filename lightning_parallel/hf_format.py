"""Checkpoints back to Hugging Face: which submodule of a LightningModule is a `transformers` model (recorded at save
time as plain data, so checkpoints still read with weights_only=True) and which saved tensors its `save_pretrained`
directory holds, under which names (tied weights once). transformers itself is never imported: a model is recognised
by its `config` (`to_dict` and a `model_type`). Reading the checkpoint is `hf_export.py`'s, writing `hf_directory.py`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

RECORD_KEY = "hugging_face"  # the checkpoint entry: {attribute path: description} of each transformers model
Reader = Callable[[list[str]], dict[str, torch.Tensor]]  # names -> those tensors, read whole


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


def pretrained_view(
    saved: dict[str, torch.Tensor], read: Reader, path: str, record: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], Reader]:
    """The model's tensors as `save_pretrained` stores them, from a LightningModule's saved tensors (`saved`: their
    shapes and dtypes, e.g. on the meta device; `read`: the whole tensors of some of those names): named as in the model
    class (the attribute prefix `path.` stripped), each tied weight once under its source's name, the model's
    `_keys_to_ignore_on_save` left out. Returns those tensors' shapes and a reader by those names, which also reads each
    tied copy with its source and refuses one that differs (one more tensor in memory, never the whole model)."""
    prefix = f"{path}." if path else ""
    names = {k[len(prefix) :]: k for k, v in saved.items() if k.startswith(prefix) and isinstance(v, torch.Tensor)}
    if not names:
        raise ValueError(
            f"the checkpoint has no tensors under '{path}', where its {record['class']} was recorded. HINT: export "
            "a checkpoint the run saved with its weights (not a partial or foreign state dict)"
        )
    ties = [(target, source) for target, source in record["tied"].items() if target in names and source in names]
    copies = {target: names.pop(target) for target, _ in ties}
    for key in record["not_saved"]:
        names.pop(key, None)

    def read_named(wanted: list[str]) -> dict[str, torch.Tensor]:
        checked = [(target, source) for target, source in ties if source in wanted]
        tensors = read([names[name] for name in wanted] + [copies[target] for target, _ in checked])
        for target, source in checked:
            _check_tied(record["class"], target, source, tensors.pop(copies[target]), tensors[names[source]])
        return {name: tensors[names[name]] for name in wanted}

    return {name: saved[key] for name, key in names.items()}, read_named


def _check_tied(model: str, target: str, source: str, copy: torch.Tensor, kept: torch.Tensor) -> None:
    if not torch.equal(copy, kept):
        gap = float((copy.float() - kept.float()).abs().max())
        raise ValueError(
            f"{model} ties {target} to {source}, but the checkpoint holds different values (max abs difference "
            f"{gap:.2e}), so one of them would be lost. HINT: export with --hf only checkpoints whose tied weights "
            "stayed tied in training"
        )


def pretrained_config(record: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """`config.json` as `save_pretrained` writes it: the recorded config plus `architectures` and the model's `dtype`
    (its first floating tensor's), which `from_pretrained` may load in."""
    config = {**record["config"], "architectures": [record["class"]]}
    floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floating:
        config["dtype"] = str(floating[0]).removeprefix("torch.")
    return config
