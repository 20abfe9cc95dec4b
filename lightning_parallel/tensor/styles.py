"""Every tensor-parallel style's properties in one table: the torch `ParallelStyle` it makes, the module types it
accepts, which parameters it splits on which dimension (and so which size the tensor-parallel size must divide),
whether its input and output are shards, and its collectives.

`plans.py` validates and applies plans from this table, `pairing.py` counts what a pair shards with it, and the
planner estimates memory and communication with it. It holds no plan and shards nothing itself.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_parallel.tensor.conv import BatchNormParallel, ConvColwiseParallel, ConvRowwiseParallel

MakeStyle = Callable[[bool], ParallelStyle | None]  # sequence_parallel -> torch style, None = leave the module as is


class Conv1D(ABC):  # noqa: B024 - a marker recognised by __subclasshook__, nothing to implement
    """transformers' `Conv1D` (GPT-2's projections), recognised by class name (this library does not import
    transformers): a Linear whose weight is stored transposed, (in `nx`, out `nf`), computed as
    `addmm(bias, x, weight)`. torch's styles take nn.Linear only: `transposed_linear.py` has its column and row styles,
    and traced pipeline stages compute on its DTensor shards (`traced_stages.py`)."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        return other.__name__ == "Conv1D" and issubclass(other, nn.Module)


@dataclass(frozen=True)
class Sharding:
    """What a style splits of one module type.

    Args:
        module: The module type.
        parameters: Parameter name -> the dimension split across tensor-parallel ranks; the others stay replicated.
        size: The module attribute the tensor-parallel size must divide (the split dimension's length).
        size_name: How an error names that size.
    """

    module: type[nn.Module] | type[Conv1D]
    parameters: Mapping[str, int]
    size: str
    size_name: str


@dataclass(frozen=True)
class StyleTraits:
    """One style of a tensor-parallel plan (``{module pattern: style name}``).

    Args:
        name: The style name plans use.
        description: One line for users (``STYLES``).
        make: Builds the torch ``ParallelStyle`` for ``sequence_parallel``; None means the module stays whole.
        shardings: What it splits, per accepted module type; empty for styles that split no parameter.
        applies_to: Accepted module types of a style that splits no parameter (None: any module).
        sharded_input: The module's input arrives as a tensor-parallel shard.
        sharded_output: The module's output leaves as a tensor-parallel shard.
        collectives: Per forward + backward, ``(kind, "input" | "output")``: what is reduced or gathered, by size.
        sequence_only: Acts only with ``sequence_parallel=True``.
    """

    name: str
    description: str
    make: MakeStyle
    shardings: tuple[Sharding, ...] = ()
    applies_to: tuple[type[nn.Module], ...] | None = None
    sharded_input: bool = False
    sharded_output: bool = False
    collectives: tuple[tuple[str, str], ...] = ()
    sequence_only: bool = False

    @property
    def accepts(self) -> tuple[type[nn.Module] | type[Conv1D], ...] | None:
        """Module types the style applies to; None means any module."""
        return tuple(s.module for s in self.shardings) if self.shardings else self.applies_to

    def sharding(self, module: nn.Module) -> Sharding | None:
        """How this style splits ``module``, or None when it splits none of its parameters."""
        return next((s for s in self.shardings if isinstance(module, s.module)), None)

    def sharded_parameters(self, module: nn.Module) -> dict[str, int]:
        """Parameter name -> split dimension, for the parameters ``module`` actually has (a Linear may lack a bias)."""
        sharding = self.sharding(module)
        if sharding is None:
            return {}
        return {key: dim for key, dim in sharding.parameters.items() if getattr(module, key, None) is not None}


# ---- the torch styles, per sequence_parallel -------------------------------------------------------------------------
# Under sequence parallelism the residual stream between blocks is split along the sequence (dim 1): "colwise" inputs
# then arrive sequence-sharded and "rowwise" outputs leave sequence-sharded.
_SEQ = Shard(1)


def _colwise(sp: bool) -> ParallelStyle:
    return ColwiseParallel(input_layouts=_SEQ) if sp else ColwiseParallel()


def _rowwise(sp: bool) -> ParallelStyle:
    return RowwiseParallel(output_layouts=_SEQ, use_local_output=False) if sp else RowwiseParallel()


def _rowwise_from_channels(sp: bool) -> ParallelStyle:
    # (B, C / tp * H * W) local, this rank's block of features: Shard(1); the output is never sequence-sharded
    return RowwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())


def _colwise_gather(sp: bool) -> ParallelStyle:
    return ColwiseParallel(input_layouts=_SEQ if sp else Replicate(), output_layouts=Replicate())


def _vocab_parallel(sp: bool) -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _sequence_parallel(sp: bool) -> ParallelStyle | None:
    return SequenceParallel() if sp else None


def _shard_sequence(sp: bool) -> ParallelStyle | None:
    if not sp:
        return None
    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=_SEQ, use_local_output=False)


# ---- the table -------------------------------------------------------------------------------------------------------
_OUT = Sharding(nn.Linear, {"weight": 0, "bias": 0}, "out_features", "out_features")
_IN = Sharding(nn.Linear, {"weight": 1}, "in_features", "in_features")  # the bias is added once, after the reduction
_OUT_T = Sharding(Conv1D, {"weight": 1, "bias": 0}, "nf", "out_features")  # weight stored (in, out)
_IN_T = Sharding(Conv1D, {"weight": 0}, "nx", "in_features")
_ALL_REDUCE_INPUT = (("all_reduce", "input"),)  # backward: the replicated input's gradient is summed
_ALL_REDUCE_OUTPUT = (("all_reduce", "output"),)  # forward: partial outputs are summed
_TABLE = (
    StyleTraits(
        "colwise", "Linear/Embedding/Conv1D: shard output features; input replicated", _colwise,
        shardings=(_OUT, Sharding(nn.Embedding, {"weight": 1}, "embedding_dim", "embedding_dim"), _OUT_T),
        sharded_output=True, collectives=_ALL_REDUCE_INPUT,
    ),
    StyleTraits(
        "rowwise", "Linear/Conv1D: shard input features; all-reduce the output", _rowwise,
        shardings=(_IN, _IN_T), sharded_input=True, collectives=_ALL_REDUCE_OUTPUT,
    ),
    StyleTraits(
        "rowwise_from_channels",
        "Linear after flattening a conv_colwise feature map: input features are channel-major, so a rank's channels "
        "are one contiguous block of them; all-reduce the output",
        _rowwise_from_channels, shardings=(_IN,), sharded_input=True, collectives=_ALL_REDUCE_OUTPUT,
    ),
    StyleTraits(
        "colwise_gather", "Linear: shard output features, then gather the full output (e.g. logits)", _colwise_gather,
        shardings=(_OUT,), collectives=(("all_gather", "output"), *_ALL_REDUCE_INPUT),
    ),
    StyleTraits(
        "vocab_parallel", "Embedding: shard the vocabulary; output replicated", _vocab_parallel,
        shardings=(Sharding(nn.Embedding, {"weight": 0}, "num_embeddings", "vocabulary size"),),
        collectives=_ALL_REDUCE_OUTPUT,
    ),
    StyleTraits(
        "sequence_parallel", "LayerNorm/RMSNorm/Dropout: run on sequence shards when sequence_parallel=True",
        _sequence_parallel, applies_to=(nn.LayerNorm, nn.RMSNorm, nn.Dropout), sequence_only=True,
    ),
    StyleTraits(
        "shard_sequence", "any module: split its output along the sequence when sequence_parallel=True",
        _shard_sequence, sequence_only=True,
    ),
    StyleTraits(
        "conv_colwise", "Conv2d: shard output channels; input replicated", lambda sp: ConvColwiseParallel(),
        shardings=(Sharding(nn.Conv2d, {"weight": 0, "bias": 0}, "out_channels", "out_channels"),),
        sharded_output=True, collectives=_ALL_REDUCE_INPUT,
    ),
    StyleTraits(
        "conv_rowwise", "Conv2d: shard input channels; all-reduce the output", lambda sp: ConvRowwiseParallel(),
        shardings=(Sharding(nn.Conv2d, {"weight": 1}, "in_channels", "in_channels"),),
        sharded_input=True, collectives=_ALL_REDUCE_OUTPUT,
    ),
    StyleTraits(
        "batchnorm_sharded", "BatchNorm1d/BatchNorm2d: on feature / channel shards (after colwise / conv_colwise)",
        lambda sp: BatchNormParallel(),
        shardings=(
            Sharding(nn.BatchNorm1d, {"weight": 0, "bias": 0}, "num_features", "features"),
            Sharding(nn.BatchNorm2d, {"weight": 0, "bias": 0}, "num_features", "channels"),
        ),
        sharded_input=True, sharded_output=True,  # per-channel statistics: no communication
    ),
    StyleTraits("replicate", "leave the module whole on every rank", lambda sp: None),
)  # fmt: skip
STYLE_TRAITS: dict[str, StyleTraits] = {traits.name: traits for traits in _TABLE}
