"""Every tensor-parallel style's properties in one table: the torch `ParallelStyle` it makes, the module types it
accepts, which parameters it splits on which dimension (and so which size the tensor-parallel size must divide),
whether its input and output are shards, its collectives, and the `transformers` style names it runs (with the ones
no row runs, and why, in `TRANSFORMERS_REFUSED`).

`plans.py` validates and applies plans from this table, `pairing.py` counts what a pair shards with it, `hf_plans.py`
translates a transformers model's own plan with it, and the planner estimates memory and communication with it. It
holds no plan and shards nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleOutput,
    SequenceParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_parallel.tensor.conv import BatchNormParallel, ConvColwiseParallel, ConvRowwiseParallel
from lightning_parallel.tensor.head_norm import HeadNorm
from lightning_parallel.tensor.local_heads import LocalHeads, attribute_sizes
from lightning_parallel.tensor.local_output import OwnOutputColwise, OwnOutputRowwise
from lightning_parallel.tensor.packed import PackedColwiseParallel
from lightning_parallel.tensor.sharded_logits import VocabHead
from lightning_parallel.tensor.transposed_linear import Conv1D
from lightning_parallel.tensor.vocab_embedding import VocabParallelEmbedding

MakeStyle = Callable[[bool], ParallelStyle | None]  # sequence_parallel -> torch style, None = leave the module as is


@dataclass(frozen=True)
class Sharding:
    """What a style splits of one module type.

    Args:
        module: The module type.
        parameters: Parameter name -> the dimension split across tensor-parallel ranks; the others stay replicated.
        size: The module attribute the tensor-parallel size must divide (the split dimension's length).
        size_name: How an error names that size.
        pieces: The split dimension holds this many equal blocks (q | k | v of a fused projection): each rank keeps
            its share of every block (an interleaved shard, torch's `_StridedShard`), so it holds whole heads.
    """

    module: type[nn.Module] | type[Conv1D]
    parameters: Mapping[str, int]
    size: str
    size_name: str
    pieces: int = 1

    def placement(self, dim: int) -> Placement:
        """The DTensor placement of a parameter split on `dim` by this sharding."""
        return Shard(dim) if self.pieces == 1 else _StridedShard(dim, split_factor=self.pieces)


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
        transformers: The `transformers` style names (its ``ALL_PARALLEL_STYLES``) this row runs.
        sizes: For a style that splits no parameter, (what, size) of the module that the tensor-parallel size must
            divide (``local_heads``: head counts and widths).
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
    transformers: tuple[str, ...] = ()
    sizes: Callable[[nn.Module], list[tuple[str, int]]] | None = None

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
    # local outputs no views (`local_output.py`): model code may change them in place
    return OwnOutputColwise(input_layouts=_SEQ) if sp else OwnOutputColwise()


def _rowwise(sp: bool) -> ParallelStyle:
    return OwnOutputRowwise(output_layouts=_SEQ, use_local_output=False) if sp else OwnOutputRowwise()


def _rowwise_from_channels(sp: bool) -> ParallelStyle:
    # (B, C / tp * H * W) local, this rank's block of features: Shard(1); the output is never sequence-sharded
    return OwnOutputRowwise(input_layouts=Shard(1), output_layouts=Replicate())


def _colwise_gather(sp: bool) -> ParallelStyle:
    return OwnOutputColwise(input_layouts=_SEQ if sp else Replicate(), output_layouts=Replicate())


def _vocab_head(sp: bool) -> ParallelStyle:
    return VocabHead(sequence_parallel=sp)


def _rowwise_split_input(sp: bool) -> ParallelStyle:
    # the input arrives whole (e.g. after a `chunk`): each rank takes its slice of the features locally
    if sp:
        return OwnOutputRowwise(input_layouts=Replicate(), output_layouts=_SEQ, use_local_output=False)
    return OwnOutputRowwise(input_layouts=Replicate(), output_layouts=Replicate())


def _packed(pieces: int) -> MakeStyle:
    return lambda sp: PackedColwiseParallel(pieces, input_layouts=_SEQ if sp else None)


def _vocab_parallel(sp: bool) -> ParallelStyle:
    return VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Replicate())


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
_EMBEDDING_WIDTH = Sharding(nn.Embedding, {"weight": 1}, "embedding_dim", "embedding_dim")


def _packed_shardings(pieces: int) -> tuple[Sharding, ...]:
    return (
        Sharding(nn.Linear, {"weight": 0, "bias": 0}, "out_features", "out_features", pieces),
        Sharding(Conv1D, {"weight": 1, "bias": 0}, "nf", "out_features", pieces),
    )


_ALL_REDUCE_INPUT = (("all_reduce", "input"),)  # backward: the replicated input's gradient is summed
_ALL_REDUCE_OUTPUT = (("all_reduce", "output"),)  # forward: partial outputs are summed
_TABLE = (
    StyleTraits(
        "colwise", "Linear/Embedding/Conv1D: shard output features; input replicated (model code may change the output "
        "in place)", _colwise,
        shardings=(_OUT, _EMBEDDING_WIDTH, _OUT_T), sharded_output=True, collectives=_ALL_REDUCE_INPUT,
        transformers=("colwise",),
    ),
    StyleTraits(
        "rowwise", "Linear/Conv1D: shard input features; all-reduce the output (model code may change it in place)",
        _rowwise,
        shardings=(_IN, _IN_T), sharded_input=True, collectives=_ALL_REDUCE_OUTPUT, transformers=("rowwise",),
    ),
    StyleTraits(
        "rowwise_split_input", "Linear: shard input features of a whole input (each rank takes its slice); all-reduce "
        "the output", _rowwise_split_input, shardings=(_IN,), collectives=_ALL_REDUCE_OUTPUT,
        transformers=("rowwise_split_input", "rowwise_rep"),
    ),
    StyleTraits(
        "rowwise_from_channels",
        "Linear after flattening a conv_colwise feature map: input features are channel-major, so a rank's channels "
        "are one contiguous block of them; all-reduce the output",
        _rowwise_from_channels, shardings=(_IN,), sharded_input=True, collectives=_ALL_REDUCE_OUTPUT,
    ),
    StyleTraits(
        "colwise_gather", "Linear/Embedding: shard output features, then gather the full output (e.g. logits)",
        _colwise_gather, shardings=(_OUT, _EMBEDDING_WIDTH), collectives=(("all_gather", "output"), *_ALL_REDUCE_INPUT),
        transformers=("colwise_gather_output", "colwise_rep", "embedding_colwise"),
    ),
    StyleTraits(
        "vocab_head", "Linear to the vocabulary (an LM head): shard output features; a step's cross-entropy reads "
        "them sharded (vocabulary-parallel, `sharded_logits.py`), anything else sees them gathered", _vocab_head,
        shardings=(_OUT,), collectives=_ALL_REDUCE_INPUT,
    ),
    StyleTraits(
        "qkv_colwise", "Linear/Conv1D packing q | k | v: shard each block's output features, so a rank keeps whole "
        "heads of each", _packed(3), shardings=_packed_shardings(3), sharded_output=True, collectives=_ALL_REDUCE_INPUT,
    ),
    StyleTraits(
        "packed_colwise", "Linear/Conv1D packing gate | up: shard each block's output features", _packed(2),
        shardings=_packed_shardings(2), sharded_output=True, collectives=_ALL_REDUCE_INPUT,
        transformers=("packed_colwise",),
    ),
    StyleTraits(
        "local_heads", "attention module over column-sharded projections: its head counts and widths "
        "(num_heads, split_size, all_head_size, ...) become this rank's", lambda sp: LocalHeads(),
        sizes=attribute_sizes,
    ),
    StyleTraits(
        "head_norm", "norm over each head of this rank's heads (q_norm / k_norm after a colwise projection): weight "
        "whole on every rank, its gradient summed over the ranks", lambda sp: HeadNorm(), sharded_input=True,
        sharded_output=True, transformers=("replicated_with_grad_allreduce",),
    ),
    StyleTraits(
        "vocab_parallel", "Embedding: shard the vocabulary; output replicated", _vocab_parallel,
        shardings=(Sharding(nn.Embedding, {"weight": 0}, "num_embeddings", "vocabulary size"),),
        collectives=_ALL_REDUCE_OUTPUT, transformers=("embedding_rowwise",),
    ),
    StyleTraits(
        "sequence_parallel", "LayerNorm/RMSNorm/Dropout: run on sequence shards when sequence_parallel=True",
        _sequence_parallel, applies_to=(nn.LayerNorm, nn.RMSNorm, nn.Dropout), sequence_only=True,
        transformers=("sequence_parallel",),
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
    StyleTraits("replicate", "leave the module whole on every rank", lambda sp: None, transformers=("replicate",)),
)  # fmt: skip
STYLE_TRAITS: dict[str, StyleTraits] = {traits.name: traits for traits in _TABLE}

# transformers' style names that no row runs, and why (one line each before launch, `hf_plans.py`)
TRANSFORMERS_REFUSED: dict[str, str] = {
    "packed_rowwise": "it shards mixture-of-experts weights packed along their last dimension",
    "local_params": "it runs a module on the local shards of bare parameters (attention sinks)",
    "all_reduce": "it sums partial outputs of mixture-of-experts layers",
    "mla_kv_a_proj": "it splits multi-head latent attention's compressed key/value projection",
    "moe_tp_experts": "it shards mixture-of-experts experts",
    "moe_identity_expert": "it scales mixture-of-experts identity experts",
    # expert parallelism's styles, in the same registry once transformers imports its expert_parallel module
    "grouped_gemm": "it shards mixture-of-experts weights by expert (expert parallelism)",
    "ep_dispatch_experts": "it dispatches tokens to experts on other ranks (expert parallelism)",
}
