"""Tensor-parallel plans without processes: wildcard expansion, the style names, validation messages, the models'
own plans, and strategy arguments that fail before anything is launched. The automatic plan: test_auto_plan.py."""

from __future__ import annotations

import sys
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from distributed import WORKERS
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel

from lightning_parallel.models import GPT, ResNet, SimpleCNN
from lightning_parallel.strategies.tensor import TensorParallelStrategy
from lightning_parallel.tasks import LanguageModelTask
from lightning_parallel.tensor import (
    STYLES,
    BatchNormParallel,
    ConvColwiseParallel,
    ConvRowwiseParallel,
    check_plan,
    expand_plan,
    make_style,
)

sys.path.insert(0, str(WORKERS))


def tiny_gpt(**sizes: int) -> GPT:
    return GPT(**{"vocab_size": 16, "context_length": 8, "depth": 2, "width": 16, "heads": 4, **sizes})


def checked(model: nn.Module, plan: dict[str, str], tp: int, *, sequence_parallel: bool = False) -> dict[str, str]:
    expanded = expand_plan(model, plan)
    check_plan(model, expanded, tensor_parallel_size=tp, sequence_parallel=sequence_parallel)
    return expanded


# ---- expansion -------------------------------------------------------------------------------------------------
def test_wildcards_expand_per_dotted_atom_in_module_order() -> None:
    plan = expand_plan(tiny_gpt(), {"block_*.mlp.down": "rowwise", "block_*.attn.q": "colwise"})
    assert list(plan) == ["block_0.attn.q", "block_0.mlp.down", "block_1.attn.q", "block_1.mlp.down"]
    # "*" does not cross a dot: "block_*" alone is the blocks, not their children.
    assert list(expand_plan(tiny_gpt(), {"block_*": "replicate"})) == ["block_0", "block_1"]


def test_models_carry_plans_that_fit_two_ranks() -> None:
    gpt = checked(tiny_gpt(), GPT.tp_plan, 2, sequence_parallel=True)
    assert gpt["block_1.attn.v"] == "colwise" and gpt["block_1.attn.proj"] == "rowwise"
    assert gpt["head.lm_head"] == "vocab_head" and gpt["embed.token"] == "vocab_parallel"
    cnn = checked(SimpleCNN(in_channels=3, image_size=16, num_classes=4), SimpleCNN.tp_plan, 2)
    assert cnn == {"conv1.0": "conv_colwise", "conv2.0": "conv_rowwise", "fc1.1": "colwise", "fc2.0": "rowwise"}
    for depth in (18, 50):
        with torch.device("meta"):
            resnet = ResNet(depth=depth, num_classes=4)
        plan = checked(resnet, ResNet.tp_plan, 4)
        blocks = [name for name, _ in resnet.named_children() if name.startswith("layer")]
        assert len(plan) == 3 * len(blocks) and plan[f"{blocks[-1]}.bn1"] == "batchnorm_sharded"


def test_style_names_map_to_torch_and_conv_styles() -> None:
    assert set(STYLES) >= {"colwise", "rowwise", "sequence_parallel", "conv_colwise", "conv_rowwise"}
    assert isinstance(make_style("colwise", sequence_parallel=False), ColwiseParallel)
    assert isinstance(make_style("rowwise", sequence_parallel=True), RowwiseParallel)
    assert isinstance(make_style("sequence_parallel", sequence_parallel=True), SequenceParallel)
    assert isinstance(make_style("shard_sequence", sequence_parallel=True), PrepareModuleOutput)
    assert make_style("sequence_parallel", sequence_parallel=False) is None
    assert make_style("replicate", sequence_parallel=True) is None
    assert isinstance(make_style("conv_colwise", sequence_parallel=False), ConvColwiseParallel)
    assert isinstance(make_style("conv_rowwise", sequence_parallel=False), ConvRowwiseParallel)
    assert isinstance(make_style("batchnorm_sharded", sequence_parallel=False), BatchNormParallel)
    from_channels = make_style("rowwise_from_channels", sequence_parallel=True)  # never sequence-sharded output
    assert isinstance(from_channels, RowwiseParallel)
    assert from_channels.input_layouts == (Shard(1),) and from_channels.output_layouts == (Replicate(),)


# ---- validation: one line naming module, size and tp ----------------------------------------------------------
BAD_PLANS = {
    "pattern matches nothing": (tiny_gpt, {"block_*.attn.qkv": "colwise"}, 2, "pattern 'block_*.attn.qkv' matches no"),
    "unknown style": (tiny_gpt, {"block_*.attn.q": "columnwise"}, 2, "unknown style 'columnwise'"),
    "two styles": (tiny_gpt, {"block_*.attn.q": "colwise", "block_0.attn.*": "rowwise"}, 2, "block_0.attn.q is"),
    "wrong module type": (tiny_gpt, {"block_0.ln1": "colwise"}, 2, "block_0.ln1 is a LayerNorm"),
    "heads": (partial(tiny_gpt, heads=2), GPT.tp_plan, 4, "block_0.attn.q (Linear, colwise) has attention heads 2"),
    "vocabulary": (partial(tiny_gpt, vocab_size=17), GPT.tp_plan, 2, "embed.token (Embedding, vocab_parallel) has"),
    "channels": (
        partial(SimpleCNN, in_channels=3, image_size=8, num_classes=4),
        SimpleCNN.tp_plan,
        4,
        "conv1.0 (Conv2d, conv_colwise) has out_channels 6, not divisible by tensor_parallel_size 4",
    ),
    "batch norm": (
        lambda: nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6)),
        {"1": "batchnorm_sharded"},
        4,
        "1 (BatchNorm2d, batchnorm_sharded) has channels 6",
    ),
    "grouped conv": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2)), {"0": "conv_colwise"}, 2, "groups=2"),
    "depthwise conv": (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=4)), {"0": "conv_rowwise"}, 2, "groups=4"),
    "batch norm 1d": (
        lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)),
        {"1": "batchnorm_sharded"},
        4,
        "1 (BatchNorm1d, batchnorm_sharded) has features 6",
    ),
    "from channels": (
        lambda: nn.Sequential(nn.Flatten(), nn.Linear(18, 4)),
        {"1": "rowwise_from_channels"},
        4,
        "1 (Linear, rowwise_from_channels) has in_features 18",
    ),
}


@pytest.mark.parametrize("case", BAD_PLANS)
def test_bad_plans_fail_with_one_line_and_a_hint(case: str) -> None:
    build, plan, tp, expected = BAD_PLANS[case]
    with pytest.raises(ValueError) as error:
        checked(build(), plan, tp)
    message = str(error.value)
    assert expected in message and "HINT" in message and "\n" not in message, message


def test_vocabulary_message_names_size_and_tp() -> None:
    with pytest.raises(ValueError, match=r"vocabulary size 17, not divisible by tensor_parallel_size 2"):
        checked(tiny_gpt(vocab_size=17), GPT.tp_plan, 2)


def test_sequence_parallel_needs_sequence_entries() -> None:
    with pytest.raises(ValueError, match="sequence_parallel=True, but the plan for SimpleCNN"):
        checked(SimpleCNN(in_channels=3, image_size=8, num_classes=4), SimpleCNN.tp_plan, 2, sequence_parallel=True)


# ---- the strategy, before any process starts -------------------------------------------------------------------
def test_strategy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\): tensor_parallel_size must be an integer >= 1"):
        TensorParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"plan='megatron'\): plan must be None .* HINT"):
        TensorParallelStrategy(plan="megatron")
    with pytest.raises(ValueError, match=r"dp\(1\) \* pp\(1\) \* tp\(4\) = 4 != world size 2"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(tensor_parallel_size=4), logger=False)


def test_bad_plan_fails_in_the_main_process_before_launch() -> None:
    strategy = TensorParallelStrategy(plan={"block_*.attn.qkv": "colwise"})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    assert strategy.dims.tp == 2  # derived from the devices
    task = LanguageModelTask(tiny_gpt(), optimizer=partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ValueError, match="pattern 'block_.*attn.qkv' matches no module of GPT"):
        trainer.fit(task)
    assert not torch.distributed.is_initialized()  # the error came before any process group or child process
