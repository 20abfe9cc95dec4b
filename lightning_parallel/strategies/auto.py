"""`strategy=auto`: the strategy of the layout planner's best layout among those this package runs.

The model is analysed on the meta device and costed from FLOP counts (never timings), so every launched rank that
re-creates the strategy makes the same choice. No Hydra and no files outside the package (the hardware presets ship
with it), so it works from an installed wheel; train.py hands in the model builder and the datamodule.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_parallel.planner import Hardware, describe, plan, workload_from_module
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.strategies.layouts import build_strategy, runnable, strategy_choice


class AutoStrategy:
    """Instantiating it returns the strategy of the planner's best layout that this package runs.

    A factory in class form (as ``pathlib.Path()`` returns a ``PosixPath``) because Hydra's ``_target_`` and
    train.py's checks expect a class. The returned strategy carries ``auto_choice`` (layout, train.py keys, reason),
    which train.py records in summary.json.

    Args:
        model: The network (an ``nn.Sequential`` of named blocks), or a callable building it; the callable runs under
            ``torch.device("meta")``, so nothing is allocated.
        data: The datamodule: ``batch_size`` is the per-replica batch and its first training sample
            (``splits()[0][0]``) is the input the model is analysed on.
        devices: ``trainer.devices``.
        accelerator: ``trainer.accelerator`` (picks the device of a single-device strategy).
        precision: ``trainer.precision``.
        hardware: A preset (``lightning_parallel.planner.presets``: cpu, h100, a100); None picks ``cpu`` with the
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
        hardware: str | None = None,
    ) -> Any:
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise ValueError(
                f"strategy=auto needs trainer.devices as a count, got {devices!r}. HINT: trainer.devices=2"
            )
        use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
        if not isinstance(model, nn.Module):
            with torch.device("meta"):
                model = model()
        sample = data.splits()[0][0][0]
        workload = workload_from_module(model, sample.unsqueeze(0).expand(2, *sample.shape))
        ranked = plan(
            workload,
            devices=devices,
            hardware=_hardware(hardware, use_cuda, devices),
            replica_batch=data.batch_size,
            precision=str(precision),
            allow=lambda layout: runnable(layout, cuda=use_cuda),
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


def _hardware(name: str | None, use_cuda: bool, devices: int) -> Hardware:
    if name is not None:
        return hardware_preset(name)
    if use_cuda:
        return hardware_preset("h100", memory=torch.cuda.get_device_properties(0).total_memory)
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return hardware_preset("cpu", memory=pages * size // devices)  # processes on one machine share its memory
