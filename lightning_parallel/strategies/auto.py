"""`strategy=auto`: the strategy of the layout planner's best layout among those this package runs, for any network
the strategies take (an `nn.Sequential`, a transformers model, a custom `nn.Module`, bare or in its LightningModule).

The model is analysed on the meta device from one batch's shapes and costed from FLOP counts (never timings), so every
launched rank that re-creates the strategy makes the same choice. No Hydra and no files outside the package (the
hardware presets ship with it), so it works from an installed wheel; train.py hands in the model builder and the
datamodule.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import default_collate

from lightning_parallel.planner import Hardware, Workload, describe, plan, workload_from_network
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.strategies.layouts import build_strategy, runnable, strategy_choice
from lightning_parallel.strategies.module_access import find_network
from lightning_parallel.strategies.user_step import StepRefused, capture_network_inputs


class AutoStrategy:
    """Instantiating it returns the strategy of the planner's best layout that this package runs.

    A factory in class form (as ``pathlib.Path()`` returns a ``PosixPath``) because Hydra's ``_target_`` and
    train.py's checks expect a class. The returned strategy carries ``auto_choice`` (layout, train.py keys, reason),
    which train.py records in summary.json.

    Args:
        model: The network (any the strategies take: an ``nn.Sequential`` of named blocks, a transformers model, a
            custom ``nn.Module``, called with the batch's inputs), or the LightningModule holding it (its one child
            module with parameters, called as its ``training_step`` calls it), or a callable building either; the
            callable runs under ``torch.device("meta")``, so nothing is allocated.
        data: What gives one training batch, the shapes the model is analysed on: this package's datamodules (their
            first training sample, twice), any LightningDataModule (``train_dataloader()`` after ``setup("fit")``) or
            a DataLoader. Its ``batch_size`` is the per-replica batch (without one, the batch's rows).
        devices: ``trainer.devices``.
        accelerator: ``trainer.accelerator`` (picks the device of a single-device strategy).
        precision: ``trainer.precision``.
        hardware: A preset (``lightning_parallel.planner.presets``: cpu, h100, a100) or a ``planner.Hardware`` (e.g.
            ``hardware_preset("a100", memory="40GB")``); None picks ``cpu`` with the
            machine's memory shared by the processes, or ``h100`` sized to the GPU when CUDA is used.
    """

    def __new__(  # type: ignore[misc]
        cls,
        *,
        model: nn.Module | Callable[[], nn.Module],
        data: Any,
        devices: Any,
        accelerator: str = "auto",
        precision: Any = "32-true",
        hardware: str | Hardware | None = None,
    ) -> Any:
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(
                f"strategy=auto needs trainer.devices as a count, got {devices!r}. HINT: trainer.devices=2"
            )
        use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        if not isinstance(model, nn.Module):
            with torch.device("meta"):
                model = model()
        workload, replica_batch, traced = _analyse(model, data, devices)
        ranked = plan(
            workload,
            devices=devices,
            hardware=_hardware(hardware, use_cuda, devices),
            replica_batch=replica_batch,
            precision=str(precision),
            allow=lambda layout: runnable(layout, cuda=use_cuda, traced=traced),
        )
        chosen = ranked.best
        if chosen is None:
            raise ValueError(
                f"strategy=auto: no layout that train.py runs fits {workload.name} on {devices} devices. "
                "HINT: python plan.py shows every layout's memory"
            )
        name, keys = strategy_choice(chosen.layout, cuda=use_cuda) or ("single", {})
        strategy = build_strategy(name, keys, cuda=use_cuda)
        command = " ".join([f"strategy={name}", *(f"strategy.{key}={value}" for key, value in keys.items())])
        # Said once (not by every launched rank) and kept on the strategy, so train.py records it in summary.json.
        strategy.auto_choice = {"layout": describe(chosen.layout), "strategy": command, "reason": ranked.explain()}
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(
                f"strategy=auto (this package's layout planner, not Lightning's 'auto') runs {command}: "
                f"{ranked.explain()}",
                file=sys.stderr,
            )
        return strategy


def _hardware(name: str | Hardware | None, use_cuda: bool, devices: int) -> Hardware:
    if isinstance(name, Hardware):
        return name
    if name is not None:
        return hardware_preset(name)
    if use_cuda:
        return hardware_preset("h100", memory=torch.cuda.get_device_properties(0).total_memory)
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return hardware_preset("cpu", memory=pages * size // devices)  # processes on one machine share its memory


def _analyse(model: nn.Module, data: Any, devices: int) -> tuple[Workload, int, bool]:
    """The planner's figures for the network from one batch of ``data``, the batch per replica, and whether the
    pipeline would split the network by tracing (any network but an ``nn.Sequential``)."""
    batch = _first_batch(data)
    if isinstance(model, pl.LightningModule):
        network = find_network(model, None, required=nn.Module, need="strategy=auto plans the network", owner=None)
        try:
            args, kwargs = capture_network_inputs(lambda: model.training_step(batch, 0), network, model)
        except StepRefused as error:
            raise ValueError(
                f"strategy=auto: {type(model).__name__}.training_step never called its network "
                f"({type(network).__name__}), so there is nothing to analyse it on. HINT: compute the loss from "
                "self(x) or self.<network>(x)"
            ) from error
    else:
        network = model
        args, kwargs = _inputs(batch)
    smallest = next((tp for tp in range(2, devices + 1) if devices % tp == 0), 2)
    workload = workload_from_network(network, tuple(args), kwargs, tensor_parallel_size=smallest)
    size = getattr(data, "batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        first = next(t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim())
        size = int(first.shape[0])
    return workload, size, not isinstance(network, nn.Sequential)


def _first_batch(data: Any) -> Any:
    """One training batch: of this package's datamodules their first training sample twice (``splits()``), of a
    LightningDataModule its loader's first, of a DataLoader (any iterable) its first."""
    if callable(getattr(data, "splits", None)):
        sample = data.splits()[0][0]
        return default_collate([sample, sample])
    if callable(getattr(data, "train_dataloader", None)):
        if callable(getattr(data, "setup", None)):
            data.setup("fit")
        return next(iter(data.train_dataloader()))
    if isinstance(data, Iterable):
        return next(iter(data))
    raise ValueError(
        f"strategy=auto analyses the model on one training batch, but data is a {type(data).__name__}. "
        "HINT: pass a LightningDataModule or a DataLoader"
    )


def _inputs(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A bare network's inputs from a batch: ``(x, y)`` -> ``x``, a dict (a tokenizer's) -> its keys by keyword."""
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (list, tuple)):
        return (batch[0],), {}
    return (batch,), {}
