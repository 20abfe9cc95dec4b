"""What each strategy declares it runs (`strategies/layouts.py`): the keys are constructor arguments the strategy
accepts and keeps, at most one option runs a layout, the Python-built options equal `conf/strategy/*.yaml`, and
`strategy=auto` works without Hydra. No processes."""

from __future__ import annotations

import ast
import inspect
from datetime import timedelta
from itertools import product
from pathlib import Path

import pytest
import torch
from conftest import CONF, ROOT
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_parallel.data import DigitsDataModule
from lightning_parallel.models import GPT, SimpleCNN
from lightning_parallel.pipeline.schedules import SCHEDULE_TRAITS
from lightning_parallel.planner import Layout, describe, plan, workload_from_module
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.strategies.auto import AutoStrategy
from lightning_parallel.strategies.layouts import OPTIONS, build_strategy, strategy_choice


def grid() -> list[Layout]:
    """Every layout shape on up to 8 devices: each size, schedule at its default stages, sharded replicas or not."""
    shapes = []
    for dp, pp, tp, shard in product((1, 2, 4), (1, 2, 4), (1, 2), (False, True)):
        if dp * pp * tp > 8 or (shard and dp == 1):
            continue
        if pp == 1:
            shapes.append(Layout(dp=dp, tp=tp, dp_shard=shard))
            continue
        for name, traits in SCHEDULE_TRAITS.items():
            v = traits.default_stages_per_rank
            sizes = {"dp": dp, "pp": pp, "tp": tp, "dp_shard": shard, "microbatches": 2 * pp, "stages_per_rank": v}
            shapes.append(Layout(schedule=name, **sizes))
    return shapes


def named_parameters(cls: type) -> set[str]:
    return {
        name
        for klass in cls.__mro__
        if "__init__" in vars(klass)
        for name, p in inspect.signature(klass.__init__).parameters.items()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"
    }


def keeps(strategy: object, keys: dict[str, object]) -> bool:
    """The strategy holds each key's value, as a public or a private attribute."""
    kept = {name.lstrip("_"): value for name, value in vars(strategy).items()}
    return all(kept.get(key) == value for key, value in keys.items())


def test_at_most_one_option_runs_a_layout() -> None:
    for layout, cuda in product(grid(), (True, False)):
        running = [name for name, option in OPTIONS.items() if option.runs(layout, cuda=cuda) is not None]
        assert len(running) <= 1, (layout, running)


def test_declared_keys_are_constructor_arguments_the_strategy_keeps() -> None:
    """Every key a declaration produces is a named argument of its class (not swallowed by **kwargs), and the built
    strategy holds the value."""
    seen: set[str] = set()
    for layout in grid():
        choice = strategy_choice(layout, cuda=True)
        if choice is None:
            continue
        name, keys = choice
        seen.add(name)
        option = OPTIONS[name]
        assert set(keys) <= named_parameters(option.strategy_class), (name, keys)
        if name in ("pipeline", "tensor"):
            assert keeps(build_strategy(name, keys, cuda=False), keys), (name, keys)
    assert seen == set(OPTIONS)


def test_what_no_strategy_runs_yet() -> None:
    """Pinned so that it shrinks on purpose: replicated tensor-parallel replicas, and Lightning's FSDP without a
    GPU. The split-backward schedules all run; pipeline replicas may be copies or FSDP2 shards."""
    for layout in grid():
        replicas = layout.dp > 1
        reasons = {
            "replicated tensor-parallel replicas": layout.pp == 1
            and layout.tp > 1
            and replicas
            and not layout.dp_shard,
        }
        assert (strategy_choice(layout, cuda=True) is None) == any(reasons.values()), (layout, reasons)
        fsdp_only = layout.pp == layout.tp == 1 and layout.dp_shard
        assert (strategy_choice(layout, cuda=False) is None) == (any(reasons.values()) or fsdp_only), layout


def test_pipeline_x_tensor_runs_as_the_pipeline_option() -> None:
    keys = {"schedule": "1f1b", "microbatches": 4, "data_parallel_size": 2, "tensor_parallel_size": 2}
    assert strategy_choice(Layout(dp=2, pp=2, tp=2, schedule="1f1b", microbatches=4)) == ("pipeline", keys)
    assert keeps(build_strategy("pipeline", keys, cuda=False), keys)
    sharded = {**keys, "replicas": "fsdp"}
    assert strategy_choice(Layout(dp=2, pp=2, tp=2, dp_shard=True, schedule="1f1b", microbatches=4)) == (
        "pipeline",
        sharded,
    )
    assert keeps(build_strategy("pipeline", sharded, cuda=False), sharded)


def settings(strategy: object) -> dict[str, object]:
    plain = (bool, int, float, str, timedelta, type(None), dict, tuple, list, torch.device)
    return {key: value for key, value in vars(strategy).items() if isinstance(value, plain)}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_python_built_options_equal_the_yaml_options(name: str) -> None:
    """strategy=auto builds the option without Hydra; it must be what `train.py strategy=<name>` builds."""
    from_yaml = instantiate(OmegaConf.load(CONF / "strategy" / f"{name}.yaml"))
    if name == "single":  # a partial: train.py adds the device
        from_yaml = from_yaml(device=torch.device("cpu"))
    built = build_strategy(name, {}, cuda=False)
    assert type(built) is type(from_yaml) and settings(built) == settings(from_yaml)


def test_auto_strategy_takes_built_objects_and_plans_as_the_planner() -> None:
    data = DigitsDataModule(batch_size=16, num_workers=0, seed=0)
    strategy = AutoStrategy(
        model=SimpleCNN(**data.model_hints), data=data, devices=2, accelerator="cpu", hardware="cpu"
    )
    sample = data.splits()[0][0][0]
    workload = workload_from_module(SimpleCNN(**data.model_hints), sample.expand(2, *sample.shape))
    runs_on_cpu = lambda layout: strategy_choice(layout, cuda=False) is not None  # noqa: E731
    best = plan(workload, devices=2, hardware=hardware_preset("cpu"), replica_batch=16, allow=runs_on_cpu).best
    assert best is not None and strategy.auto_choice["layout"] == describe(best.layout)
    name, keys = strategy_choice(best.layout, cuda=False) or ("", {})
    assert type(strategy) is OPTIONS[name].strategy_class


def test_auto_strategy_builds_the_model_on_the_meta_device() -> None:
    built: list[torch.device] = []

    def build() -> GPT:
        model = GPT(vocab_size=32, context_length=32, depth=2, width=16, heads=2)
        built.append(next(model.parameters()).device)
        return model

    class Tokens:  # what AutoStrategy reads of a datamodule
        batch_size = 4

        def splits(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list]:
            return [(torch.zeros(32, dtype=torch.long), torch.zeros(32, dtype=torch.long))], []

    strategy = AutoStrategy(model=build, data=Tokens(), devices=1, accelerator="cpu")
    assert built == [torch.device("meta")] and type(strategy).__name__ == "SingleDeviceStrategy"


def test_the_library_never_imports_hydra() -> None:
    """Only the composition roots (train.py, config_checks.py, plan.py) do; strategy=auto must work from a wheel."""
    offenders = []
    for path in sorted((ROOT / "lightning_parallel").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in ("hydra", "omegaconf") for n in names):
                offenders.append(str(Path(path).relative_to(ROOT)))
    assert offenders == []
