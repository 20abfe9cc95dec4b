"""What train.py checks before anything is launched: every configuration mistake (a value of the wrong type or
range, an unknown option or key, an impossible pairing, a checkpoint that cannot be resumed) becomes one
`ConfigError` line naming the key and a fix, which train.py prints with exit code 2. Hydra lives here and in
train.py only; the library never imports it.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.errors import InstantiationException, MissingConfigException, OverrideParseException
from hydra.utils import get_class, get_object, instantiate
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from lightning_parallel.checkpoint import META_FILE, is_sharded_checkpoint, recover, saved_tensors
from lightning_parallel.strategies.peers import check_launched
from lightning_parallel.unpickling import UntrustedCheckpoint


class ConfigError(ValueError):
    """A bad configuration, detected before any process is launched; the message is one line."""


DATA_FOR_KIND = {
    "image": "data=digits or data=synthetic_images",
    "tokens": "data=synthetic_tokens or data=text",
}


# The integer keys train.py hands on, checked before anything is built so that `seed=abc` names its key instead of
# failing deep inside Lightning: key -> (minimum, null allowed, value for the HINT). Absent keys are skipped.
INTEGER_KEYS: dict[str, tuple[int, bool, str]] = {
    "seed": (0, False, "42"),
    "trainer.max_epochs": (-1, True, "15 (-1: no limit)"),
    "trainer.max_steps": (-1, False, "1000 (-1: no limit)"),
    "trainer.accumulate_grad_batches": (1, False, "1"),
    "trainer.log_every_n_steps": (0, True, "10"),
    "trainer.check_val_every_n_epoch": (1, True, "1"),
    "trainer.num_sanity_val_steps": (-1, True, "0"),
    "trainer.num_nodes": (1, False, "1"),
    "data.batch_size": (1, False, "32"),
    "data.num_workers": (0, False, "0"),
}


def check_integers(cfg: DictConfig) -> None:
    """Every key of INTEGER_KEYS present in `cfg` holds an integer (not a bool, a float or a string) in range."""
    for key, (minimum, nullable, example) in INTEGER_KEYS.items():
        value = OmegaConf.select(cfg, key, default=KeyError)  # the default also for `???`: reported in build
        if value is KeyError or (value is None and nullable):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            accepted = f"an integer >= {minimum}" + (" or null" if nullable else "")
            raise ConfigError(f"{key}={value} must be {accepted}. HINT: {key}={example}")


# key -> (smallest value allowed, or 0 excluded when None; nullable; example): real numbers train.py hands on
NUMBER_KEYS: dict[str, tuple[float | None, bool, str]] = {
    "optimizer.lr": (None, False, "3.0e-3"),
    "trainer.gradient_clip_val": (0.0, True, "1.0"),  # 0 = no clipping, as in Lightning
}


def check_numbers(cfg: DictConfig) -> None:
    """Every key of NUMBER_KEYS present in `cfg` holds a finite number in range (not a bool or a string)."""
    for key, (minimum, nullable, example) in NUMBER_KEYS.items():
        value = OmegaConf.select(cfg, key, default=KeyError)
        if value is KeyError or (value is None and nullable):
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (value <= 0 if minimum is None else value < minimum):
            accepted = "a positive number" if minimum is None else f"a number >= {minimum:g}"
            raise ConfigError(
                f"{key}={value} must be {accepted}" + (" or null" if nullable else "") + f". HINT: {key}={example}"
            )


def check_config(cfg: DictConfig) -> None:
    """Reject configurations that cannot work, before anything is built or launched."""
    check_integers(cfg)
    check_numbers(cfg)
    trust = cfg.get("ckpt_weights_only")
    if not isinstance(trust, bool):  # a string "false" would read as trusting nothing, or everything
        raise ConfigError(
            f"ckpt_weights_only={trust} must be true or false. HINT: ckpt_weights_only=true (false only for a "
            "checkpoint you trust)"
        )
    devices = cfg.trainer.devices
    if isinstance(devices, int) and devices < 1 and devices != -1:
        raise ConfigError(f"trainer.devices={devices}: a run needs at least one device. HINT: trainer.devices=1")
    if isinstance(devices, int) and get_class(cfg.strategy._target_) is not pl.strategies.SingleDeviceStrategy:
        check_launcher(devices)
    limit = cfg.trainer.get("limit_train_batches")
    if limit is not None and not isinstance(limit, bool) and limit == 0:
        raise ConfigError(
            f"trainer.limit_train_batches={limit} trains on no batches, so the run would train nothing. "
            "HINT: a positive count or fraction (null = every batch)"
        )
    model_kind = get_class(cfg.model._target_).input_kind
    data_kind = get_class(cfg.data._target_).kind
    if model_kind != data_kind:
        model_name = cfg.model._target_.rsplit(".", 1)[-1]
        raise ConfigError(
            f"model {model_name} takes {model_kind} input but the data gives {data_kind} batches. "
            f"HINT: use {DATA_FOR_KIND[model_kind]}"
        )
    if get_class(cfg.strategy._target_) is pl.strategies.SingleDeviceStrategy and devices != 1:
        warnings.warn(f"strategy=single uses one device; ignoring trainer.devices={devices}", stacklevel=2)
        with open_dict(cfg):
            cfg.trainer.devices = 1


def check_launcher(devices: int) -> None:
    """Under torchrun or srun, processes per node other than trainer.devices: one line on every rank before anything
    is built, whatever the strategy (Lightning's FSDP too; strategy=auto builds the model before the Trainer). Our
    strategies check it again as the Trainer is built, for users of the library without train.py."""
    # the cluster environment Lightning would pick, in its order (torchrun may run inside a SLURM allocation)
    environment = next((e() for e in (TorchElasticEnvironment, SLURMEnvironment) if e.detect()), None)
    try:
        check_launched(devices, environment)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def instantiate_at(cfg: DictConfig, key: str, **kwargs: Any) -> Any:
    """`instantiate(cfg.<key>)`, with an argument of the wrong kind named by its key (Lightning's own errors do not
    say which value was wrong): a keyword the target does not take lists those it does."""
    node = cfg[key]
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        located = re.match(r"Error locating target '([^']+)'.*\nfull_key: (\S*)", str(error), re.DOTALL)
        if located:  # a `_target_` anywhere under the node that does not import (e.g. a misspelt optimizer class)
            raise ConfigError(unknown_target(located[2] or key, located[1])) from error
        if not isinstance(error.__cause__, TypeError):
            raise
        target = get_object(node._target_)
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(error.__cause__))
        if unknown is None or unknown[1] not in node:
            raise ConfigError(
                f"{key} ({target.__name__}): {root_message(error)}. HINT: check the types of the {key}.* values "
                "(`python train.py --cfg job` prints them)"
            ) from error
        parameters = inspect.signature(target).parameters.values()
        accepted = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise ConfigError(unknown_name(f"{key}.", unknown[1], f"an argument of {target.__name__}", accepted)) from error


def unknown_name(prefix: str, name: str, what: str, known: list[str]) -> str:
    """One line for `<prefix><name>` when `name` is not one of `known`: the nearest one, then all of them."""
    nearest = difflib.get_close_matches(name, known, n=1)
    guess = f"did you mean {prefix}{nearest[0]}? " if nearest else ""
    return f"{prefix}{name} is not {what}. HINT: {guess}known: {', '.join(known)}"


def unknown_target(key: str, target: str) -> str:
    """One line for `<key>._target_=<target>` that does not import: the nearest name its module has, if any."""
    module_name, _, name = target.rpartition(".")
    try:
        known = [n for n in dir(importlib.import_module(module_name)) if not n.startswith("_")] if module_name else []
    except ImportError:
        known = []
    nearest = difflib.get_close_matches(name, known, n=1)
    fix = f"did you mean {key}._target_={module_name}.{nearest[0]}?" if nearest else "give an importable dotted path"
    return f"{key}._target_={target} cannot be imported. HINT: {fix}"


def root_message(error: BaseException) -> str:
    """The innermost cause's message, first line only (Hydra wraps errors raised by targets)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def resolve_checkpoint(cfg: DictConfig) -> str | None:
    """`ckpt_path`: a checkpoint (a .ckpt file or a sharded .ckpt directory), a run directory (its newest complete
    checkpoint), or `last`: the newest complete checkpoint of this run's own directory, and None (a fresh start, as
    Lightning's own "last" means) while it has none, so one command both starts a run and resumes it."""
    value = cfg.get("ckpt_path")
    if value is None or str(value) == "":
        return None
    weights_only = cfg.get("ckpt_weights_only", True)
    if str(value) == "last":
        found = newest_checkpoint(Path(cfg.paths.output_dir), weights_only=weights_only)
        return str(found) if found is not None else None
    path = Path(str(value))
    if not path.exists():
        recover_shared(path.parent)  # a run killed while swapping in a new checkpoint left the previous one aside
    if not path.exists():
        raise ConfigError(f"ckpt_path={value} does not exist. HINT: give a run directory or its checkpoints/*.ckpt")
    if path.is_dir() and not path.name.endswith(".ckpt"):  # a run directory
        passed_over: list[str] = []
        found = newest_checkpoint(path, weights_only=weights_only, passed_over=passed_over)
        if found is None and passed_over:  # the newest one's damage, in its own words (with its HINT)
            raise ConfigError(f"{path} holds no complete checkpoint: {passed_over[0]}")
        if found is None:
            raise ConfigError(
                f"{path} holds no complete checkpoint (*.ckpt). HINT: give ckpt_path=<a .ckpt file> directly"
            )
        return str(found)
    return str(path)


def newest_checkpoint(run: Path, *, weights_only: bool = True, passed_over: list[str] | None = None) -> Path | None:
    """The most recently written complete checkpoint anywhere under a run directory (`last.ckpt` on a tie), None if
    there is none. Interrupted saves are undone first (`checkpoint.recover`: a `.partial` write removed, a checkpoint
    renamed aside put back); a checkpoint cut short (a missing or short shard, a truncated file) is passed over, its
    one-line reason appended to `passed_over`."""
    for folder in {p.parent for pattern in ("*.partial", "*.old") for p in run.rglob(pattern)}:
        recover_shared(folder)
    candidates = [p for p in run.rglob("*.ckpt") if p.is_file() or is_sharded_checkpoint(p)]
    written = {p: (p / META_FILE if p.is_dir() else p).stat().st_mtime for p in candidates}
    for path in sorted(candidates, key=lambda p: (written[p], p.name == "last.ckpt"), reverse=True):
        try:
            saved_tensors(path, weights_only=weights_only)  # reads the index and metadata only
        except UntrustedCheckpoint:
            raise
        except (ValueError, FileNotFoundError) as error:
            warnings.warn(f"passing over an incomplete checkpoint: {error}", stacklevel=2)
            if passed_over is not None:
                passed_over.append(str(error))
            continue
        return path
    return None


def recover_shared(folder: Path) -> None:
    """`checkpoint.recover(folder)` while the other ranks of a launch (under torchrun or SLURM, all of them at once)
    may be recovering it too: a rename or removal another one made first is retried, so that every rank then sees the
    same checkpoints."""
    for _ in range(10):
        try:
            recover(folder)
            return
        except FileNotFoundError:
            continue
    recover(folder)


def hydra_error_line(error: Exception) -> str:
    """Hydra's composition error in one line: an unknown option lists its group's options, an unknown key its
    node's keys (Hydra would suggest `+key=...`, which only fails later as an unexpected argument)."""
    if isinstance(error, MissingConfigException) and error.options and error.missing_cfg_file:
        group, _, option = error.missing_cfg_file.rpartition("/")
        return unknown_name(f"{group}=", option, f"an option of {group}", list(error.options))
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException) and isinstance(cause.parent_node, DictConfig) and cause.full_key:
        keys = [str(key) for key in cause.parent_node if not str(key).startswith("_")]
        parent, _, name = cause.full_key.rpartition(".")
        if difflib.get_close_matches(name, keys, n=1):  # else Hydra's `+key=...` (a new key) may be what was meant
            return unknown_name(f"{parent}." if parent else "", name, f"a key of {parent or 'the config'}", keys)
    first, *rest = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, OverrideParseException):
        first = f"{error.override}: {first}"
    return f"{first.rstrip('.')}. HINT: {' '.join(rest)}" if rest else first
