"""`python plan.py model=resnet152 devices=8 device_memory=80GB`: rank every data x pipeline x tensor layout of a model.

The planner's composition root (like ``train.py``, next to it; the library never imports Hydra): config -> workload,
hardware -> ranked table, one sentence, and the train.py command of the best layout that a strategy here runs
(``lightning_parallel.strategies.layouts``). The estimates live in ``lightning_parallel.planner``; ``strategy=auto``
is ``lightning_parallel.strategies.auto``.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from config_checks import root_message
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
from lightning_parallel.strategies.layouts import runnable, strategy_choice, train_overrides
from lightning_parallel.weights import materialize


def on_gpus(hardware: Hardware) -> bool:
    """Whether the plan is for GPUs (every hardware preset but ``cpu``, whose name starts with CPU)."""
    return not hardware.name.lower().startswith("cpu")


# ---- config -> workload, hardware -----------------------------------------------------------------------------------
def build_workload(model_cfg: DictConfig, data: Any, costs: Any = "flops") -> Workload:
    """The workload of a model config: closed form for the GPT, a meta-device analysis otherwise; timed if asked."""
    hints = data.model_hints
    missing = {key: value for key, value in hints.items() if OmegaConf.is_missing(model_cfg, key)}
    model_class = get_class(model_cfg._target_)
    if getattr(model_class, "input_kind", data.kind) != data.kind:  # this package's models say; others are tried
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
        if not isinstance(model, torch.nn.Sequential):
            raise ValueError(
                f"costs=measure times an nn.Sequential's blocks one by one; {model_class.__name__} is not one. "
                "HINT: costs=flops"
            )
        materialize(model, torch.device("cpu"))
        seconds = measure_block_seconds(model, lambda n: sample.unsqueeze(0).expand(n, *sample.shape).contiguous())
        return workload.with_seconds(seconds)
    given = list(costs) if isinstance(costs, list | tuple) or OmegaConf.is_list(costs) else None
    if given is None:
        raise ValueError(f"costs={costs!r} is not flops, measure or a list of seconds. HINT: costs=measure")
    return workload.with_seconds([(0.0, float(s)) for s in given])


def split_by_tracing(model_cfg: DictConfig) -> bool:
    """Whether the pipeline strategy would split the model by tracing (any network but an ``nn.Sequential``), whose
    stages run fewer layouts (``strategies.layouts.runnable``)."""
    return not issubclass(get_class(model_cfg._target_), torch.nn.Sequential)


def build_hardware(hardware_cfg: DictConfig, device_memory: Any) -> Hardware:
    overrides = {} if device_memory is None else {"memory": str(device_memory)}
    return instantiate(hardware_cfg, **overrides)


def make_plan(cfg: DictConfig) -> Plan:
    """Everything the command does short of printing: config -> ranked plan."""
    data = instantiate(cfg.data)
    workload = build_workload(cfg.model, data, cfg.costs)
    hardware = build_hardware(cfg.hardware, cfg.device_memory)
    # Every row at the same global batch (by default data.batch_size), so step times compare; the train.py command
    # then gives each replica its share (data.batch_size is per replica there).
    global_batch = cfg.global_batch if cfg.global_batch is not None else data.batch_size
    cuda, traced = on_gpus(hardware), split_by_tracing(cfg.model)
    return plan(
        workload,
        devices=cfg.devices,
        hardware=hardware,
        precision=str(cfg.precision),
        optimizer_states=cfg.optimizer_states,
        activation_checkpointing=str(cfg.activation_checkpointing),
        schedules=list(cfg.schedules) if cfg.schedules is not None else None,
        allow=(lambda layout: runnable(layout, cuda=cuda, traced=traced)) if cfg.runnable_only else None,
        global_batch=global_batch,
    )


def report(result: Plan, top: int, *, traced: bool = False) -> str:
    """The header, the ranked table, the sentence, and the train.py command of the best runnable layout (``traced``:
    of a model the pipeline splits by tracing, ``split_by_tracing``)."""
    hw = result.hardware
    cuda = on_gpus(hw)

    def runs(layout: Layout) -> str:
        return (
            (strategy_choice(layout, cuda=cuda) or ("-", {}))[0] if runnable(layout, cuda=cuda, traced=traced) else "-"
        )

    shown = len(result.estimates[:top])
    lines = [
        f"{result.workload.name} on {result.devices} x {hw.name} ({hw.memory} each); "
        f"{len(result.estimates)} layouts, best {shown} shown",
        result.table(top, note=runs, note_header="train.py"),
        "",
        result.explain(),
    ]
    best_here = next((e for e in result.estimates if e.fits and runnable(e.layout, cuda=cuda, traced=traced)), None)
    if best_here is not None:
        checkpointing = result.activation_checkpointing
        command = train_command(
            best_here.layout, result.global_batch, cuda=cuda, activation_checkpointing=checkpointing
        )
        lines.append(f"Best layout train.py runs: {describe(best_here.layout)} -> {command}")
    return "\n".join(lines)


def train_command(
    layout: Layout, global_batch: int | None, *, cuda: bool, activation_checkpointing: str = "none"
) -> str:
    """`python train.py ...` for a layout the strategies run; with replicas, each gets its share of `global_batch`
    (train.py's data.batch_size is per replica)."""
    overrides = train_overrides(layout, cuda=cuda, activation_checkpointing=activation_checkpointing) or []
    if global_batch is not None and layout.dp > 1:
        overrides.append(f"data.batch_size={global_batch // layout.dp}")
    return " ".join(["python train.py", *overrides])


# ---- the command ----------------------------------------------------------------------------------------------------
@hydra.main(version_base="1.3", config_path="conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    try:
        result = make_plan(cfg)
    except MissingMandatoryValue as error:
        print(f"error: {error.full_key} has no value. HINT: set it, e.g. {error.full_key}=...", file=sys.stderr)
        sys.exit(2)
    except (ValueError, FileNotFoundError, InstantiationException, OmegaConfBaseException) as error:
        print(f"error: {root_message(error)}", file=sys.stderr)
        sys.exit(2)
    print(report(result, cfg.top, traced=split_by_tracing(cfg.model)))


if __name__ == "__main__":
    main()
