"""Which layouts each `conf/strategy` option runs, and the keys that make it run one: the planner's train.py column
and `strategy=auto` both read these declarations, so neither can promise a layout the strategies do not run.

It plans nothing (`planner/` ranks layouts) and launches nothing; `build_strategy` only constructs the option's class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS
from lightning_parallel.seams import NEEDS_TORCH, torch_at_least
from lightning_parallel.strategies.base import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from lightning_parallel.planner.estimate import Layout


def _no_arguments(cuda: bool) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class StrategyOption:
    """One option of `conf/strategy`: the class it builds and the layouts it runs.

    Args:
        name: The option (``train.py strategy=<name>``).
        target: The class, as the option's ``_target_``.
        keys: The option's keys that run a layout, or None when the option does not run it.
        arguments: Constructor arguments the option's YAML sets beyond the class defaults, per ``cuda``.
        gpu_only: Runs on GPUs only (Lightning's FSDPStrategy).
    """

    name: str
    target: str
    keys: Callable[[Layout], dict[str, Any] | None]
    arguments: Callable[[bool], dict[str, Any]] = _no_arguments
    gpu_only: bool = False

    def runs(self, layout: Layout, *, cuda: bool = True) -> dict[str, Any] | None:
        """The keys that run ``layout`` with this option, or None."""
        if self.gpu_only and not cuda:
            return None
        return self.keys(layout)

    @property
    def strategy_class(self) -> type:
        module, _, name = self.target.rpartition(".")
        return getattr(importlib.import_module(module), name)


# ---- what each strategy runs -----------------------------------------------------------------------------------------
def _single(layout: Layout) -> dict[str, Any] | None:
    return {} if layout.devices == 1 else None


def _ddp(layout: Layout) -> dict[str, Any] | None:
    return {} if layout.devices > 1 and layout.pp == layout.tp == 1 and not layout.dp_shard else None


def _fsdp(layout: Layout) -> dict[str, Any] | None:
    return {} if layout.devices > 1 and layout.pp == layout.tp == 1 and layout.dp_shard else None


def _pipeline(layout: Layout) -> dict[str, Any] | None:
    """Replicas are copies or FSDP2 shards (`replicas`); tensor parallelism runs inside the stages (3D)."""
    if layout.pp == 1 or layout.schedule is None:
        return None
    keys: dict[str, Any] = {
        "schedule": layout.schedule,
        "microbatches": layout.microbatches,
        "data_parallel_size": layout.dp,
    }
    if layout.stages_per_rank != SCHEDULE_TRAITS[layout.schedule].default_stages_per_rank:
        keys["stages_per_rank"] = layout.stages_per_rank
    if layout.tp > 1:
        keys["tensor_parallel_size"] = layout.tp
    if layout.dp_shard and layout.dp > 1:
        keys["replicas"] = "fsdp"
    return keys


def _tensor(layout: Layout) -> dict[str, Any] | None:
    """Replicas of a tensor-parallel model are always sharded (FSDP2 over the data-parallel dimension)."""
    if layout.tp == 1 or layout.pp > 1 or (layout.dp > 1 and not layout.dp_shard):
        return None
    return {"tensor_parallel_size": layout.tp, "data_parallel_size": layout.dp}


def _single_device(cuda: bool) -> dict[str, Any]:
    return {"device": torch.device("cuda", 0) if cuda else torch.device("cpu")}


OPTIONS: dict[str, StrategyOption] = {
    option.name: option
    for option in (
        StrategyOption(
            "single", "lightning.pytorch.strategies.SingleDeviceStrategy", _single, arguments=_single_device
        ),
        StrategyOption(
            "ddp",
            "lightning_parallel.strategies.ddp.DDPStrategy",
            _ddp,
            arguments=lambda cuda: {
                "timeout": DEFAULT_TIMEOUT,
                "find_unused_parameters": False,
                "gradient_as_bucket_view": True,
            },
        ),
        StrategyOption(
            "fsdp",
            "lightning.pytorch.strategies.FSDPStrategy",
            _fsdp,
            arguments=lambda cuda: {"timeout": DEFAULT_TIMEOUT},
            gpu_only=True,
        ),
        StrategyOption("pipeline", "lightning_parallel.strategies.pipeline.PipelineParallelStrategy", _pipeline),
        StrategyOption("tensor", "lightning_parallel.strategies.tensor.TensorParallelStrategy", _tensor),
    )
}


# ---- layout -> train.py --------------------------------------------------------------------------------------------
def strategy_choice(layout: Layout, *, cuda: bool = True) -> tuple[str, dict[str, Any]] | None:
    """The ``conf/strategy`` option and keys that run ``layout`` in train.py, or None when no option here can.

    ``cuda=False`` leaves out Lightning's FSDPStrategy, which runs on GPUs only. At most one option runs a layout.
    """
    for option in OPTIONS.values():
        keys = option.runs(layout, cuda=cuda)
        if keys is not None:
            return option.name, keys
    return None


def train_overrides(layout: Layout, *, cuda: bool = True, activation_checkpointing: str = "none") -> list[str] | None:
    """``train.py`` command-line overrides that run ``layout``, or None when no strategy here can. With activation
    checkpointing, a data-parallel-only layout runs on the mesh strategies at degree 1, which cost nothing there:
    copies on the pipeline strategy at one stage, shards (FSDP2) on the tensor strategy at tp=1."""
    choice = strategy_choice(layout, cuda=cuda)
    if choice is None:
        return None
    name, keys = choice
    if activation_checkpointing != "none":
        if name not in ("pipeline", "tensor"):
            size = "tensor_parallel_size" if layout.dp_shard else "pipeline_parallel_size"
            name, keys = ("tensor" if layout.dp_shard else "pipeline"), {size: 1, "data_parallel_size": layout.dp}
        keys = {**keys, "activation_checkpointing": activation_checkpointing}
    devices = [] if layout.devices == 1 else [f"trainer.devices={layout.devices}"]
    return [f"strategy={name}", *devices, *(f"strategy.{key}={value}" for key, value in keys.items())]


def runnable(layout: Layout, *, cuda: bool = True, traced: bool = False) -> bool:
    """Whether a strategy of this package (or Lightning's single-device / FSDP one) runs ``layout``; ``traced``: for
    a network the pipeline splits by tracing (any but an ``nn.Sequential``), whose stages take tensor parallelism
    only with plain replicas and on a torch that passed it (``parallelize.plan.refuse_traced_sharding``)."""
    if traced and layout.pp > 1 and layout.tp > 1:
        newest = torch_at_least(NEEDS_TORCH["tensor parallelism inside traced pipeline stages"][0])
        if not newest or (layout.dp_shard and layout.dp > 1):
            return False
    return strategy_choice(layout, cuda=cuda) is not None


def build_strategy(name: str, keys: dict[str, Any], *, cuda: bool) -> Any:
    """The strategy ``train.py strategy=<name>`` with these keys builds, constructed in Python (no Hydra, no conf/).

    Raises:
        ValueError: An unknown option; the message lists the known ones.
    """
    if name not in OPTIONS:
        raise ValueError(f"unknown strategy option {name!r}. HINT: use one of {', '.join(OPTIONS)}")
    option = OPTIONS[name]
    return option.strategy_class(**option.arguments(cuda), **keys)
