"""Train one model with one strategy: `python train.py strategy=ddp trainer.devices=2`.

`train(cfg)` is the pure, importable composition root (config -> objects -> fit -> summary); the
`@hydra.main` entry point below only adds Hydra's command line. The library itself never imports Hydra.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from functools import partial, wraps
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import (
    ConfigCompositionException,
    InstantiationException,
    OverrideParseException,
)
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from config_checks import (
    ConfigError,
    check_config,
    hydra_error_line,
    instantiate_at,
    resolve_checkpoint,
    root_message,
)
from job_output import finished, print_summary, report_failure, run_summary, say, write_atomically
from lightning_parallel.callbacks import ExactResume, ResumeRecord, RunSummary
from lightning_parallel.checkpoint import check_matches
from lightning_parallel.strategies.base import MeshStrategy
from lightning_parallel.tasks import ClassificationTask, LanguageModelTask, Task
from lightning_parallel.unpickling import UntrustedCheckpoint

__all__ = ["ConfigError", "build", "build_model", "build_strategy", "check_config", "hydra_error_line", "train"]


def build_model(cfg: DictConfig, hints: dict[str, int]) -> torch.nn.Module:
    """Instantiate the model, filling its `???` arguments from what the data determines."""
    missing = {key: value for key, value in hints.items() if OmegaConf.is_missing(cfg.model, key)}
    return instantiate_at(cfg, "model", **missing)


def build_task(cfg: DictConfig, model: torch.nn.Module, data: pl.LightningDataModule) -> Task:
    optimizer = instantiate(cfg.optimizer)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    # Saved as a hyperparameter: `ClassificationTask.load_from_checkpoint(file)` rebuilds the network from it.
    saved = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(saved, dict)
    config = {key: data.model_hints[key] if value == "???" else value for key, value in saved.items()}
    kwargs: dict[str, Any] = {"optimizer": optimizer, "scheduler": scheduler, "model_config": config}
    if data.kind == "image":
        return ClassificationTask(model, num_classes=data.model_hints["num_classes"], **kwargs)
    return LanguageModelTask(model, **kwargs)


def build_strategy(cfg: DictConfig, data: pl.LightningDataModule | None = None) -> Any:
    if OmegaConf.is_missing(cfg.strategy, "data"):  # strategy=auto plans from this run's model and data
        data = data if data is not None else instantiate_at(cfg, "data")
        return instantiate_at(cfg, "strategy", model=partial(build_model, cfg, data.model_hints), data=data)
    if not cfg.strategy.get("_partial_"):
        return instantiate_at(cfg, "strategy")
    # single device: the device depends on the accelerator (built here, so a wrong argument fails in instantiate_at)
    accelerator = cfg.trainer.accelerator
    use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    return instantiate_at(cfg, "strategy", _partial_=False, device=device)


def build_trainer(cfg: DictConfig, recorders: list[pl.Callback], data: pl.LightningDataModule) -> pl.Trainer:
    """The Trainer with its strategy, callbacks (plus `ExactResume` and the recorders of summary.json) and logger."""
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node is not None]
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    strategy = build_strategy(cfg, data)
    callbacks += [ExactResume(), *recorders]
    return instantiate_at(cfg, "trainer", strategy=strategy, callbacks=callbacks, logger=logger)


def build(cfg: DictConfig) -> tuple[pl.Trainer, Task, pl.LightningDataModule, RunSummary, str | None]:
    """Everything before launch, and the checkpoint to resume from; every configuration mistake (a checkpoint
    that is missing, not one, or of another model included) surfaces here as a ConfigError."""
    try:
        check_config(cfg)
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        data = instantiate_at(cfg, "data")
        summary = RunSummary()
        trainer = build_trainer(cfg, [summary, ResumeRecord(cfg.paths.output_dir)], data)
        # Under a model-parallel strategy this builds on the meta device; each rank materialises its part.
        # Our models initialise by name, so the mesh strategies may build them on the meta device and materialise
        # only each rank's part (Lightning's DDP would take empty_init=True as "leave the weights uninitialised").
        with trainer.init_module(empty_init=isinstance(trainer.strategy, MeshStrategy) or None):
            model = build_model(cfg, data.model_hints)
        task = build_task(cfg, model, data)
        validate = getattr(trainer.strategy, "validate", None)  # our strategies check the model pre-launch
        if callable(validate):
            validate(task)
        resume_from = resolve_checkpoint(cfg)
        if resume_from is not None:
            check_matches(resume_from, task, weights_only=cfg.ckpt_weights_only)
        elif str(cfg.get("ckpt_path")) == "last":
            say(f"ckpt_path=last: no checkpoint in {cfg.paths.output_dir} yet, starting from scratch")
    except ConfigError:
        raise
    except UntrustedCheckpoint as error:
        raise ConfigError(error.line("ckpt_weights_only=false")) from error
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(f"{key} has no value. HINT: set it on the command line, e.g. {key}=...") from error
    except (ValueError, FileNotFoundError, InstantiationException, OmegaConfBaseException) as error:
        raise ConfigError(root_message(error)) from error
    except pl.utilities.exceptions.MisconfigurationException as error:
        raise ConfigError(root_message(error)) from error
    return trainer, task, data, summary, resume_from


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run `fit` as configured and return the summary (also written to `<output_dir>/summary.json`)."""
    if cfg.get("dry_run"):
        return dry_run_job(cfg)
    earlier = finished(cfg)
    if earlier is not None:
        say(f"nothing left to train: {cfg.paths.output_dir} already ran {earlier.get('steps')} steps (summary.json)")
        return earlier
    trainer, task, data, recorder, resume_from = build(cfg)
    parameters = sum(p.numel() for p in task.model.parameters())  # before a strategy splits the model
    environment = dict(os.environ)
    fitted = False
    try:
        trainer.fit(task, datamodule=data, ckpt_path=resume_from, weights_only=cfg.ckpt_weights_only)
        fitted = not trainer.interrupted
    finally:
        # Lightning leaves the process group and its launcher's variables (LOCAL_RANK, MASTER_PORT, ...)
        # behind; the next job of a sweep must launch its own processes and start its own group. After a run
        # that ended normally the ranks leave together: a rank whose peers were already gone aborted at exit
        # ("terminate called without an active exception", exit -6) once in a 4-task SLURM test.
        if torch.distributed.is_initialized():
            if fitted:
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    if trainer.interrupted:
        raise RuntimeError("training was interrupted; no summary.json written")
    record = next(c for c in trainer.callbacks if isinstance(c, ResumeRecord))  # type: ignore[attr-defined]
    if trainer.global_step == 0 and trainer.max_steps != 0:  # e.g. the data gave no full batch
        fix = "trainer.max_epochs>=1" if trainer.max_epochs == 0 else "training data of at least one batch"
        raise RuntimeError(
            f"training ran no optimizer step ({trainer.num_training_batches} training batches per epoch, "
            f"max_epochs={trainer.max_epochs}); no summary.json written. HINT: {fix}"
        )
    summary = run_summary(trainer, task, data, parameters=parameters, seed=cfg.seed, resumed_from=resume_from,
                          resumes=record.resumes, recorded=recorder.summary)  # fmt: skip
    if trainer.is_global_zero:
        write_atomically(Path(cfg.paths.output_dir) / "summary.json", json.dumps(summary, indent=2))
        print_summary(summary, cfg.paths.output_dir)
    return summary


def dry_run_job(cfg: DictConfig) -> dict[str, Any]:
    """`dry_run=true`: the strategy set up for every rank role of `trainer.devices x trainer.num_nodes` in this
    process, on the fake process group (`lightning_parallel.dryrun`); writes dry_run.json and a summary.json the sweep
    report reads. A role over `dry_run_device_memory` is a ConfigError naming it."""
    from lightning_parallel.dryrun import dry_run

    devices, nodes = int(cfg.trainer.devices), int(cfg.trainer.num_nodes)
    cfg.trainer.devices, cfg.trainer.num_nodes = devices * nodes, 1  # one process plays them all: nothing launches
    trainer, task, data, _, _ = build(cfg)
    if not isinstance(trainer.strategy, MeshStrategy) or not hasattr(trainer.strategy, "resolve_dims"):
        raise ConfigError(
            f"dry_run=true sets up the pipeline and tensor strategies; strategy {type(trainer.strategy).__name__} "
            "runs as it is. HINT: strategy=pipeline or strategy=tensor"
        )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    try:
        result = dry_run(
            task, trainer.strategy, devices=devices, num_nodes=nodes,
            batch=batch, precision=str(cfg.trainer.precision), device_memory=cfg.get("dry_run_device_memory"),
            output_dir=cfg.paths.output_dir,
        )  # fmt: skip
    except ValueError as error:
        raise ConfigError(root_message(error)) from error
    print(result, file=sys.stderr, flush=True)
    rows = result.rows
    summary = {
        "strategy": f"{type(trainer.strategy).__name__} (dry run)",
        "devices": result.world_size,
        "world_size": result.world_size,
        "model": type(task.model).__name__,
        "peak_memory_bytes": [row.measured["total"] for row in rows],  # per role (pipeline rank), not per rank
        "parameter_bytes_per_rank": [row.measured["params"] for row in rows],
        "metrics": {},
        "dry_run": result.to_json(),
    }
    write_atomically(Path(cfg.paths.output_dir) / "summary.json", json.dumps(summary, indent=2))
    if result.refusal is not None:
        raise ConfigError(result.refusal)
    return summary


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


FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra raises its errors under "1"; else it prints several lines and exits 1
_cli_raises = False  # True while `cli` has set HYDRA_FULL_ERROR=1 (the user had not) for Hydra's composition


def as_job(task: Callable[[DictConfig], None]) -> Callable[[DictConfig], None]:
    """Each Hydra job, and the ranks it launches, runs without `cli`'s HYDRA_FULL_ERROR=1, as the user asked;
    the next job of a sweep is composed under it again."""

    @wraps(task)
    def job(cfg: DictConfig) -> None:
        if not _cli_raises:
            return task(cfg)
        os.environ.pop(FULL_ERROR, None)
        task(cfg)
        os.environ[FULL_ERROR] = "1"

    return job


def cli() -> None:
    """`python train.py ...`: Hydra's own errors (an unknown option of a config group, an unknown key, bad override
    syntax) end like ours, with one `error:` line and exit 2. HYDRA_FULL_ERROR=1 keeps Hydra's full traceback."""
    global _cli_raises
    if os.environ.get(FULL_ERROR) == "1":
        main()
        return
    os.environ[FULL_ERROR], _cli_raises = "1", True
    try:
        main()
    except (ConfigCompositionException, OverrideParseException) as error:
        print(f"error: {hydra_error_line(error)}", file=sys.stderr)
        sys.exit(2)
    finally:
        os.environ.pop(FULL_ERROR, None)
        _cli_raises = False


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
@as_job
def main(cfg: DictConfig) -> None:
    pin_job_for_relaunch()
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a launched rank: rank 0 of the node says the same warnings once
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
    try:
        train(cfg)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except Exception as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        line = report_failure(error, cfg.paths.output_dir)
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli()
