"""Train one model with one strategy: `python train.py strategy=ddp trainer.devices=2`.

`train(cfg)` is the pure, importable composition root (config -> objects -> fit -> summary); the
`@hydra.main` entry point below only adds Hydra's command line. The library itself never imports Hydra.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from lightning_parallel.callbacks import RunSummary
from lightning_parallel.checkpoint import check_matches
from lightning_parallel.tasks import ClassificationTask, LanguageModelTask, Task


class ConfigError(ValueError):
    """A bad configuration, detected before any process is launched; the message is one line."""


DATA_FOR_KIND = {
    "image": "data=digits or data=synthetic_images",
    "tokens": "data=synthetic_tokens or data=text",
}


def check_config(cfg: DictConfig) -> None:
    """Reject configurations that cannot work, before anything is built or launched."""
    devices = cfg.trainer.devices
    if isinstance(devices, int) and devices < 1 and devices != -1:
        raise ConfigError(f"trainer.devices={devices}: a run needs at least one device. HINT: trainer.devices=1")
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


def build_model(cfg: DictConfig, hints: dict[str, int]) -> torch.nn.Module:
    """Instantiate the model, filling its `???` arguments from what the data determines."""
    missing = {key: value for key, value in hints.items() if OmegaConf.is_missing(cfg.model, key)}
    return instantiate(cfg.model, **missing)


def build_task(cfg: DictConfig, model: torch.nn.Module, data: pl.LightningDataModule) -> Task:
    optimizer = instantiate(cfg.optimizer)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    if data.kind == "image":
        num_classes = data.model_hints["num_classes"]
        return ClassificationTask(model, num_classes=num_classes, optimizer=optimizer, scheduler=scheduler)
    return LanguageModelTask(model, optimizer=optimizer, scheduler=scheduler)


def build_strategy(cfg: DictConfig) -> Any:
    strategy = instantiate(cfg.strategy)
    if isinstance(strategy, partial):  # single device: the device depends on the accelerator
        accelerator = cfg.trainer.accelerator
        use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        strategy = strategy(device=torch.device("cuda", 0) if use_cuda else torch.device("cpu"))
    return strategy


def build_trainer(cfg: DictConfig, summary: RunSummary) -> pl.Trainer:
    """The Trainer with its strategy, callbacks (plus the run summary) and logger."""
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    return instantiate(cfg.trainer, strategy=build_strategy(cfg), callbacks=[*callbacks, summary], logger=logger)


def root_message(error: BaseException) -> str:
    """The innermost cause's message, first line only (Hydra wraps errors raised by targets)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def build(cfg: DictConfig) -> tuple[pl.Trainer, Task, pl.LightningDataModule, RunSummary, str | None]:
    """Everything before launch, and the checkpoint to resume from; every configuration mistake (a checkpoint
    that is missing, not one, or of another model included) surfaces here as a ConfigError."""
    try:
        check_config(cfg)
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        data = instantiate(cfg.data)
        summary = RunSummary()
        trainer = build_trainer(cfg, summary)
        # Under a model-parallel strategy this builds on the meta device; each rank materialises its part.
        with trainer.init_module():
            model = build_model(cfg, data.model_hints)
        task = build_task(cfg, model, data)
        validate = getattr(trainer.strategy, "validate", None)  # our strategies check the model pre-launch
        if callable(validate):
            validate(task)
        resume_from = resolve_checkpoint(cfg)
        if resume_from is not None:
            check_matches(resume_from, task)
    except ConfigError:
        raise
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(f"{key} has no value. HINT: set it on the command line, e.g. {key}=...") from error
    except (ValueError, FileNotFoundError, InstantiationException, OmegaConfBaseException) as error:
        raise ConfigError(root_message(error)) from error
    except pl.utilities.exceptions.MisconfigurationException as error:
        raise ConfigError(root_message(error)) from error
    return trainer, task, data, summary, resume_from


def resolve_checkpoint(cfg: DictConfig) -> str | None:
    """`ckpt_path`: a checkpoint (a .ckpt file or a sharded .ckpt directory), a run directory (its newest
    checkpoint), or `last`: the newest checkpoint of this run's own directory (with hydra.run.dir=<that run>)."""
    value = cfg.get("ckpt_path")
    if value is None or str(value) == "":
        return None
    if str(value) == "last":
        folder = Path(cfg.paths.output_dir) / "checkpoints"
        if not folder.is_dir():
            raise ConfigError(
                f"ckpt_path=last: this run's directory {cfg.paths.output_dir} has no checkpoints/. HINT: resume "
                "into the earlier run's directory (hydra.run.dir=<run dir>), or give ckpt_path=<run dir or .ckpt>"
            )
        return str(newest_checkpoint(folder))
    path = Path(str(value))
    if not path.exists():
        raise ConfigError(f"ckpt_path={value} does not exist. HINT: give a run directory or its checkpoints/*.ckpt")
    if (path / "checkpoints").is_dir():  # a run directory
        return str(newest_checkpoint(path / "checkpoints"))
    return str(path)


def newest_checkpoint(folder: Path) -> Path:
    """`last.ckpt` when the run saved one, else the most recently written checkpoint."""
    if (folder / "last.ckpt").exists():
        return folder / "last.ckpt"
    found = [path for path in folder.glob("*.ckpt") if not path.name.endswith(".partial")]
    if not found:
        raise ConfigError(f"{folder} holds no checkpoint (*.ckpt). HINT: give ckpt_path=<a .ckpt file> directly")
    return max(found, key=lambda path: path.stat().st_mtime)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run `fit` as configured and return the summary (also written to `<output_dir>/summary.json`)."""
    trainer, task, data, recorder, resume_from = build(cfg)
    parameters = sum(p.numel() for p in task.model.parameters())  # before a strategy splits the model
    environment = dict(os.environ)
    try:
        trainer.fit(task, datamodule=data, ckpt_path=resume_from)
    finally:
        # Lightning leaves the process group and its launcher's variables (LOCAL_RANK, MASTER_PORT, ...)
        # behind; the next job of a sweep must launch its own processes and start its own group.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    if trainer.interrupted:
        raise RuntimeError("training was interrupted; no summary.json written")
    summary = {
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__,
        "devices": trainer.num_devices,
        "world_size": trainer.world_size,
        "precision": trainer.precision,
        "model": type(task.model).__name__,
        "data": type(data).__name__,
        "parameters": parameters,
        "seed": cfg.seed,
        "resumed_from": resume_from,
        **recorder.summary,
    }
    describe = getattr(trainer.strategy, "describe", None)
    if callable(describe):
        summary["parallel"] = describe()
    if HydraConfig.initialized():
        summary["choices"] = {k: v for k, v in HydraConfig.get().runtime.choices.items() if "hydra" not in k}
    if trainer.is_global_zero:
        write_atomically(Path(cfg.paths.output_dir) / "summary.json", json.dumps(summary, indent=2))
        print_summary(summary, cfg.paths.output_dir)
    return summary


def write_atomically(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def print_summary(summary: dict[str, Any], output_dir: str) -> None:
    from rich.console import Console

    metrics = summary["metrics"]
    headline = next((name for name in ("val/acc", "val/ppl", "val/loss") if name in metrics), None)
    best = f"best {headline} {metrics[headline]['best']:.4f}" if headline else "no validation metric"
    rate = summary["throughput_samples_per_s"]
    Console(stderr=True).print(
        f"[bold green]done[/] {best} | {summary['strategy']} x{summary['world_size']} | "
        f"{summary['steps']} steps in {summary['wall_time_s']:.1f} s"
        + (f" | {rate:.0f} samples/s" if rate else "")
        + f" | files: {output_dir}"
    )


def pin_job_for_relaunch() -> None:
    """Make Lightning's subprocess launcher re-run exactly this job, even inside a multirun sweep.

    Lightning starts ranks > 0 by re-executing `sys.argv` plus `hydra.run.dir=<HydraConfig run.dir>`.
    In a sweep that would start a whole new sweep per rank in a fresh directory, so replace the
    command line by this job's own overrides and point run.dir at this job's output directory.
    """
    hydra_cfg = HydraConfig.get()
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
    with read_write(hydra_cfg.run):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    pin_job_for_relaunch()
    try:
        train(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
