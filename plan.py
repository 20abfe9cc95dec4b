"""`python -m lightning_parallel.plan model=resnet152 devices=8 device_memory=80GB`: rank every layout of a model.

The planner's composition root (like ``train.py``, the only other importer of Hydra): config -> workload, hardware
-> ranked table and one sentence. Also ``AutoStrategy``, which ``conf/strategy/auto.yaml`` instantiates so that
``train.py strategy=auto`` runs the planner's choice. The estimates themselves live in ``lightning_parallel.planner``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from lightning_parallel.models.init import materialize
from lightning_parallel.planner import (
    Hardware,
    Layout,
    Plan,
    Workload,
    describe,
    gpt_workload,
    measure_block_seconds,
    plan,
    workload_from_module,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
SPLIT_BACKWARD = {"interleaved_zero_bubble", "zbv", "dualpipev"}


# ---- layout -> train.py ---------------------------------------------------------------------------------------------
def strategy_choice(layout: Layout, *, cuda: bool = True) -> tuple[str, dict[str, Any]] | None:
    """The ``conf/strategy`` option and keys that run ``layout`` in train.py, or None when no strategy here can.

    ``cuda=False`` leaves out Lightning's FSDPStrategy, which runs on GPUs only.
    Pipeline and tensor parallelism do not combine yet, pipelines replicate (never shard) their stages across
    replicas, tensor parallelism with replicas always shards them (FSDP2), and the split-backward schedules
    (interleaved_zero_bubble, zbv, dualpipev) fail in torch 2.13's ``stage_backward_input`` when a stage's output
    is a view, as it is for the GPT and SimpleCNN here.
    """
    if layout.schedule in SPLIT_BACKWARD:
        return None
    if layout.devices == 1:
        return "single", {}
    if layout.pp == 1 and layout.tp == 1:
        if layout.dp_shard and not cuda:
            return None
        return ("fsdp" if layout.dp_shard else "ddp"), {}
    if layout.tp == 1 and not layout.dp_shard:
        keys: dict[str, Any] = {
            "schedule": layout.schedule,
            "microbatches": layout.microbatches,
            "data_parallel_size": layout.dp,
        }
        if layout.stages_per_rank not in (1, 2):
            keys["stages_per_rank"] = layout.stages_per_rank
        return "pipeline", keys
    if layout.pp == 1 and (layout.dp == 1 or layout.dp_shard):
        return "tensor", {"tensor_parallel_size": layout.tp, "data_parallel_size": layout.dp}
    return None


def train_overrides(layout: Layout, *, cuda: bool = True) -> list[str] | None:
    """``train.py`` command-line overrides that run ``layout``, or None when no strategy here can."""
    choice = strategy_choice(layout, cuda=cuda)
    if choice is None:
        return None
    name, keys = choice
    devices = [] if layout.devices == 1 else [f"trainer.devices={layout.devices}"]
    return [f"strategy={name}", *devices, *(f"strategy.{key}={value}" for key, value in keys.items())]


def runnable(layout: Layout, *, cuda: bool = True) -> bool:
    """Whether a strategy of this package (or Lightning's DDP / FSDP) runs ``layout``."""
    return strategy_choice(layout, cuda=cuda) is not None


def on_gpus(hardware: Hardware) -> bool:
    """Whether the plan is for GPUs (every preset but ``conf/hardware/cpu.yaml``, whose name starts with CPU)."""
    return not hardware.name.lower().startswith("cpu")


# ---- config -> workload, hardware -----------------------------------------------------------------------------------
def build_workload(model_cfg: DictConfig, data: Any, costs: Any = "flops") -> Workload:
    """The workload of a model config: closed form for the GPT, a meta-device analysis otherwise; timed if asked."""
    hints = data.model_hints
    missing = {key: value for key, value in hints.items() if OmegaConf.is_missing(model_cfg, key)}
    model_class = get_class(model_cfg._target_)
    if model_class.input_kind != data.kind:
        raise ValueError(
            f"model {model_class.__name__} takes {model_class.input_kind} input but the data gives {data.kind} "
            f"batches. HINT: use {'data=synthetic_tokens' if data.kind == 'image' else 'data=synthetic_images'}"
        )
    sample = data.splits()[0][0][0]
    if model_class.__name__ == "GPT" and costs == "flops":
        args = {**OmegaConf.to_container(model_cfg), **missing}
        workload = gpt_workload(
            depth=args["depth"], width=args["width"], heads=args["heads"], mlp_ratio=args.get("mlp_ratio", 4),
            vocab_size=args["vocab_size"], seq_len=int(sample.shape[-1]),
        )  # fmt: skip
        return workload
    with torch.device("meta"):
        model = instantiate(model_cfg, **missing)
    workload = workload_from_module(model, sample.unsqueeze(0).expand(2, *sample.shape))
    if costs == "flops":
        return workload
    if costs == "measure":
        materialize(model, torch.device("cpu"))
        seconds = measure_block_seconds(model, lambda n: sample.unsqueeze(0).expand(n, *sample.shape).contiguous())
        return workload.with_seconds(seconds)
    given = list(costs) if isinstance(costs, list | tuple) or OmegaConf.is_list(costs) else None
    if given is None:
        raise ValueError(f"costs={costs!r} is not flops, measure or a list of seconds. HINT: costs=measure")
    return workload.with_seconds([(0.0, float(s)) for s in given])


def build_hardware(hardware_cfg: DictConfig, device_memory: Any) -> Hardware:
    overrides = {} if device_memory is None else {"memory": str(device_memory)}
    return instantiate(hardware_cfg, **overrides)


def make_plan(cfg: DictConfig) -> Plan:
    """Everything the command does short of printing: config -> ranked plan."""
    data = instantiate(cfg.data)
    workload = build_workload(cfg.model, data, cfg.costs)
    hardware = build_hardware(cfg.hardware, cfg.device_memory)
    batch = {"global_batch": cfg.global_batch} if cfg.global_batch is not None else {"replica_batch": data.batch_size}
    cuda = on_gpus(hardware)
    return plan(
        workload,
        devices=cfg.devices,
        hardware=hardware,
        precision=str(cfg.precision),
        optimizer_states=cfg.optimizer_states,
        schedules=list(cfg.schedules) if cfg.schedules is not None else None,
        allow=(lambda layout: runnable(layout, cuda=cuda)) if cfg.runnable_only else None,
        **batch,
    )


def report(result: Plan, top: int) -> str:
    """The header, the ranked table, the sentence, and the train.py command of the best runnable layout."""
    hw = result.hardware
    cuda = on_gpus(hw)
    shown = len(result.estimates[:top])
    lines = [
        f"{result.workload.name} on {result.devices} x {hw.name} ({hw.memory} each); "
        f"{len(result.estimates)} layouts, best {shown} shown",
        result.table(
            top, note=lambda layout: (strategy_choice(layout, cuda=cuda) or ("-", {}))[0], note_header="train.py"
        ),
        "",
        result.explain(),
    ]
    best_here = next((e for e in result.estimates if e.fits and runnable(e.layout, cuda=cuda)), None)
    if best_here is not None:
        overrides = " ".join(train_overrides(best_here.layout, cuda=cuda) or [])
        lines.append(f"Best layout train.py runs: {describe(best_here.layout)} -> python train.py {overrides}")
    return "\n".join(lines)


def one_line(error: BaseException) -> str:
    """The innermost cause's first line (Hydra wraps what targets raise)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---- strategy=auto --------------------------------------------------------------------------------------------------
class AutoStrategy:
    """Instantiating it returns the strategy of the planner's best layout that this package runs.

    A factory in class form (as ``pathlib.Path()`` returns a ``PosixPath``) because Hydra's ``_target_`` and
    train.py's checks expect a class. Costs come from FLOP counts, never timings, so every rank of a run that
    re-instantiates it makes the same choice.

    Args:
        model: The run's model config (``???`` keys are filled from the data, as train.py does).
        data: The run's data config; ``batch_size`` is the per-replica batch.
        devices: ``trainer.devices``.
        accelerator: ``trainer.accelerator`` (picks the device of a single-device strategy).
        precision: ``trainer.precision``.
        hardware: A ``conf/hardware`` option; None picks ``cpu``, or ``h100`` sized to the GPU when CUDA is used.
    """

    def __new__(  # type: ignore[misc]
        cls,
        *,
        model: DictConfig,
        data: DictConfig,
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
        datamodule = instantiate(data)
        workload = build_workload(model, datamodule, "flops")
        ranked = plan(
            workload,
            devices=devices,
            hardware=_auto_hardware(hardware, use_cuda, devices),
            replica_batch=datamodule.batch_size,
            precision=str(precision),
            allow=lambda layout: runnable(layout, cuda=use_cuda),
        )
        chosen = ranked.best
        if chosen is None:
            raise ValueError(
                f"strategy=auto: no layout that train.py runs fits {workload.name} on {devices} devices. "
                "HINT: python -m lightning_parallel.plan shows every layout's memory"
            )
        name, keys = strategy_choice(chosen.layout, cuda=use_cuda) or ("single", {})
        strategy = instantiate(OmegaConf.merge(OmegaConf.load(CONF / "strategy" / f"{name}.yaml"), keys))
        if name == "single":  # a partial: the device depends on the accelerator
            strategy = strategy(device=torch.device("cuda", 0) if use_cuda else torch.device("cpu"))
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


def _auto_hardware(name: str | None, use_cuda: bool, devices: int) -> Hardware:
    preset = name or ("h100" if use_cuda else "cpu")
    path = CONF / "hardware" / f"{preset}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"unknown hardware {preset!r}. HINT: use one of {', '.join(options)}")
    memory: Any = None
    if name is None and use_cuda:
        memory = torch.cuda.get_device_properties(0).total_memory
    elif name is None:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = pages * size // devices  # processes on one machine share its memory
    return build_hardware(OmegaConf.load(path), memory)


# ---- the command ----------------------------------------------------------------------------------------------------
@hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        result = make_plan(cfg)
    except MissingMandatoryValue as error:
        print(f"error: {error.full_key} has no value. HINT: set it, e.g. {error.full_key}=...", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError, InstantiationException, OmegaConfBaseException) as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    print(report(result, cfg.top))


if __name__ == "__main__":
    main()
