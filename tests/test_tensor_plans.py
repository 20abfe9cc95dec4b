"""Tensor-parallel plans without processes: wildcard expansion, validation messages, the automatic plan for Linear
stacks, the models' own plans, and strategy arguments that fail before anything is launched."""

from __future__ import annotations

from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel, SequenceParallel

from lightning_parallel.models import GPT, ResNet, SimpleCNN
from lightning_parallel.strategies.tensor import TensorParallelStrategy
from lightning_parallel.tasks import LanguageModelTask
from lightning_parallel.tensor import (
    STYLES,
    BatchNormParallel,
    ConvColwiseParallel,
    ConvRowwiseParallel,
    auto_plan,
    check_plan,
    expand_plan,
    make_style,
)


def tiny_gpt(**sizes: int) -> GPT:
    return GPT(**{"vocab_size": 16, "context_length": 8, "depth": 2, "width": 16, "heads": 4, **sizes})


def checked(model: nn.Module, plan: dict[str, str], tp: int, *, sequence_parallel: bool = False) -> dict[str, str]:
    expanded = expand_plan(model, plan)
    check_plan(model, expanded, tensor_parallel_size=tp, sequence_parallel=sequence_parallel)
    return expanded


class FourLinear(nn.Module):
    """The classic tutorial network: a plain stack of Linear layers in a custom module (no nn.Sequential)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, hidden), nn.Linear(hidden, 10)
        self.net3, self.net4 = nn.Linear(10, hidden), nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net2(torch.relu(self.net1(x)))
        return self.net4(nn.functional.gelu(self.net3(x)))


class Branches(nn.Module):
    """q, k, v read the same input: registration order would pair q with k, the data flow must not."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x)


# ---- expansion -------------------------------------------------------------------------------------------------
def test_wildcards_expand_per_dotted_atom_in_module_order() -> None:
    plan = expand_plan(tiny_gpt(), {"block_*.mlp.down": "rowwise", "block_*.attn.q": "colwise"})
    assert list(plan) == ["block_0.attn.q", "block_0.mlp.down", "block_1.attn.q", "block_1.mlp.down"]
    # "*" does not cross a dot: "block_*" alone is the blocks, not their children.
    assert list(expand_plan(tiny_gpt(), {"block_*": "replicate"})) == ["block_0", "block_1"]


def test_models_carry_plans_that_fit_two_ranks() -> None:
    gpt = checked(tiny_gpt(), GPT.tp_plan, 2, sequence_parallel=True)
    assert gpt["block_1.attn.v"] == "colwise" and gpt["block_1.attn.proj"] == "rowwise"
    assert gpt["head.lm_head"] == "colwise_gather" and gpt["embed.token"] == "vocab_parallel"
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


# ---- automatic plan --------------------------------------------------------------------------------------------
def test_auto_plan_pairs_consecutive_linears_column_then_row() -> None:
    found = auto_plan(FourLinear(), tensor_parallel_size=2)
    assert found.plan == {"net1": "colwise", "net2": "rowwise", "net3": "colwise", "net4": "rowwise"}
    assert found.replicated == {}
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    found = auto_plan(mlp, tensor_parallel_size=2)
    assert found.plan == {"0": "colwise", "3": "rowwise"}
    assert set(found.replicated) == {"4", "5"}  # the norm, and a last Linear without a partner


def test_auto_plan_follows_data_flow_not_attribute_order() -> None:
    with pytest.raises(ValueError) as error:
        auto_plan(Branches(), tensor_parallel_size=2)
    message = str(error.value)
    assert "found nothing to shard in Branches" in message
    assert all(f"{name}: no single Linear consumes" in message for name in "qkv") and "HINT" in message


def test_auto_plan_names_hidden_sizes_it_cannot_split() -> None:
    # Hidden 7 does not split over 2, but net2 -> net3 (width 10) does: shard that, report the rest.
    found = auto_plan(FourLinear(hidden=7), tensor_parallel_size=2)
    assert found.plan == {"net2": "colwise", "net3": "rowwise"}
    assert found.replicated["net1"] == "hidden size 7 not divisible by 2" and "net4" in found.replicated
    with pytest.raises(ValueError, match=r"in Sequential at tensor_parallel_size 2 \(0: hidden size 7 not divisible"):
        auto_plan(nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3)), tensor_parallel_size=2)


def test_auto_plan_refuses_what_fx_cannot_trace() -> None:
    # GPT checks the sequence length in Python (`if seq_len > context_length`), which symbolic tracing cannot do.
    with pytest.raises(ValueError, match=r"torch.fx cannot trace GPT .*HINT: give the model a `tp_plan`"):
        auto_plan(tiny_gpt(), tensor_parallel_size=2)


# ---- the strategy, before any process starts -------------------------------------------------------------------
def test_strategy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0 must be an integer >= 1"):
        TensorParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"plan='megatron' is not a plan. HINT"):
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
