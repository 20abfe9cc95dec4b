"""strategy=auto and the planner for any network the strategies take, not only an nn.Sequential: a transformers Llama
and a custom nn.Module, each in its LightningModule, analysed from the call its training_step makes (the dry run's
analysis, `planner.workload_from_network`); the same choice on every rank; a model-parallel choice set up by the
strategy's own dry run (the traced Llama's: tests/test_dry_run_traced.py). No processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CONF
from hf_modules import HFLlama, token_loader
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from user_modules import Classifier, ResidualCNN, loader

import lightning_parallel as lp
from lightning_parallel.planner import Layout, describe, plan, workload_from_network
from lightning_parallel.planner.network import shard_styles
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.strategies.auto import AutoStrategy
from lightning_parallel.strategies.layouts import build_strategy, runnable
from lightning_parallel.strategies.user_step import capture_network_inputs
from plan import make_plan, report


def custom() -> Classifier:
    """A custom network (its own forward, residuals written inline) in a plain LightningModule; the network built on
    the meta device and the module (its metric) outside, as under trainer.init_module()."""
    with torch.device("meta"):
        network = ResidualCNN()
    return Classifier(network)


# the builder, its loader, the planner's units (those of the network's call, in the order it runs them)
CASES: dict[str, tuple[Any, Any, list[str]]] = {
    "llama": (
        HFLlama,
        lambda: token_loader(batch_size=8),
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
    ),
    "custom": (
        custom,
        lambda: loader(shuffle=False, batch_size=8),
        ["stem", "norm", "conv1", "conv2", "conv3", "conv4", "fc1", "fc2"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_auto_strategy_plans_any_network_alike_on_every_rank(name: str, monkeypatch) -> None:  # noqa: ANN001
    build, data, units = CASES[name]
    strategy = AutoStrategy(model=build, data=data(), devices=2, accelerator="cpu", hardware="cpu")
    # the planner's own ranking of the network, from the call the module's training_step makes
    with torch.device("meta"):
        module = build()
    batch = next(iter(data()))
    args, kwargs = capture_network_inputs(lambda: module.training_step(batch, 0), module.model, module)
    workload = workload_from_network(module.model, args, kwargs)
    assert [block.name for block in workload.blocks] == units
    assert workload.params == sum(p.numel() for p in module.model.parameters())
    cpu = lambda layout: runnable(layout, cuda=False, traced=True)  # noqa: E731
    best = plan(workload, devices=2, hardware=hardware_preset("cpu"), replica_batch=8, allow=cpu).best
    assert best is not None and strategy.auto_choice["layout"] == describe(best.layout)
    # a launched rank re-creates the strategy: from FLOP counts on shapes, its weights' values do not count
    monkeypatch.setenv("LOCAL_RANK", "1")
    torch.manual_seed(1)
    again = AutoStrategy(model=build, data=data(), devices=2, accelerator="cpu", hardware="cpu")
    assert type(again) is type(strategy) and again.auto_choice == strategy.auto_choice


def test_auto_strategy_on_small_devices_picks_tensor_parallelism_that_sets_up(monkeypatch) -> None:  # noqa: ANN001
    """On 2 devices of 256 KiB the custom network fits only split over "tp", on every rank; the tensor strategy
    strategy=auto builds sets it up in a dry run (every rank role, fake process group) with the plan it costed."""
    small = hardware_preset("cpu", memory="256KB")
    strategy = AutoStrategy(model=custom, data=loader(shuffle=False, batch_size=8), devices=2, hardware=small)
    assert isinstance(strategy, lp.TensorParallelStrategy), strategy.auto_choice
    assert strategy.auto_choice["strategy"] == "strategy=tensor strategy.tensor_parallel_size=2 " + (
        "strategy.data_parallel_size=1"
    )
    monkeypatch.setenv("LOCAL_RANK", "1")
    torch.manual_seed(1)
    again = AutoStrategy(model=custom, data=loader(shuffle=False, batch_size=8), devices=2, hardware=small)
    assert type(again) is type(strategy) and again.auto_choice == strategy.auto_choice
    module = custom()
    (row,) = lp.dry_run(module, strategy, devices=2, batch=next(iter(loader(shuffle=False, batch_size=8)))).rows
    whole = sum(p.numel() * 4 for p in module.model.parameters())
    assert row.sharded == shard_styles(module.model) and len(row.sharded) == 6  # the plan the planner costed
    assert row.measured["params"] == row.predicted["params"] < whole * 0.6


LLAMA_CONFIG = {  # a transformers model as a Hydra node: the class and its config, both instantiated
    "_target_": "transformers.LlamaForCausalLM",
    "config": {
        "_target_": "transformers.LlamaConfig", "vocab_size": 32, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    },
}  # fmt: skip
PLANNED = {  # model config, data, the workload's name and tensor-parallel modulus
    "custom": ({"_target_": "user_modules.ResidualCNN"}, "digits", "ResidualCNN (6.89K parameters)", 8),
    "llama": (LLAMA_CONFIG, "synthetic_tokens", "LlamaForCausalLM (20.6K parameters)", 2),
}


@pytest.mark.parametrize("name", list(PLANNED))
def test_plan_command_ranks_a_network_that_is_not_sequential(name: str) -> None:
    """plan.py with a model config of a custom network or a transformers model (no `input_kind`, not an
    nn.Sequential): ranked from one call, and its train.py column leaves out what a traced pipeline refuses (tensor
    parallelism with FSDP2 replicas)."""
    model, data, label, modulus = PLANNED[name]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("plan", overrides=[f"data={data}", "devices=8", "hardware=cpu", "device_memory=1MB"])
    with open_dict(cfg):
        cfg.model = OmegaConf.create(model)
    result = make_plan(cfg)
    assert result.workload.name == label and result.workload.tp_modulus == modulus
    assert any(e.layout.tp > 1 for e in result.estimates) and any(e.layout.pp > 1 for e in result.estimates)
    column = {False: {}, True: {}}  # the train.py column of the 3D rows, of a network split by tracing and not
    for traced, found in column.items():
        for line in report(result, len(result.estimates), traced=traced).splitlines():
            if "dp2 x pp2 x tp2" in line and line.split()[0].isdigit():  # a row of the table
                found.setdefault("fsdp" in line, set()).add(line.split()[-1])
    assert column == {False: {True: {"pipeline"}, False: {"pipeline"}}, True: {True: {"-"}, False: {"pipeline"}}}
    refused = Layout(dp=2, pp=2, tp=2, dp_shard=True, schedule="1f1b", microbatches=4)
    assert not runnable(refused, cuda=False, traced=True) and runnable(refused, cuda=False)


def test_what_strategy_auto_cannot_analyse_is_one_line() -> None:
    class NoNetworkCall(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return batch[0].sum()

    with pytest.raises(ValueError, match=r"training_step never called its network \(ResidualCNN\).*HINT") as error:
        AutoStrategy(model=NoNetworkCall(ResidualCNN()), data=loader(shuffle=False), devices=2)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"one training batch, but data is a int\. HINT"):
        AutoStrategy(model=ResidualCNN(), data=42, devices=2)
    # the refusal the traced filter stands for: the pipeline strategy's own, before it traces anything
    keys = {"schedule": "1f1b", "microbatches": 4, "data_parallel_size": 2, "tensor_parallel_size": 2}
    pipeline = build_strategy("pipeline", {**keys, "replicas": "fsdp"}, cuda=False)
    pipeline._dims = pipeline.resolve_dims(8)
    with pytest.raises(ValueError, match=r"replicas='fsdp' does not yet shard replicas of ResidualCNN"):
        pipeline.validate(custom(), batch=next(iter(loader(shuffle=False))))
