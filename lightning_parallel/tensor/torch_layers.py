"""Tensor plans for torch's own transformer layers (`nn.TransformerEncoderLayer`, `nn.TransformerDecoderLayer`, the
parts of `nn.Transformer`), found from the module structure: torch.fx treats these layers as leaves and cannot see
inside them. Each layer's feed-forward pair is sharded, `linear1` column-parallel and `linear2` row-parallel (its
`_ff_block` calls them in that order with only the activation and a dropout between). The attention stays whole:
`nn.MultiheadAttention` keeps q|k|v packed in one weight and computes with the global head count and its weights
directly (`F.multi_head_attention_forward`, never its `out_proj`'s forward), so no torch style shards it; a plan that
shards inside one is refused. Plans only: checking and applying them is `plans.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn.functional as F
from torch import nn

LAYERS: tuple[type[nn.Module], ...] = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
_PER_ELEMENT = (F.relu, F.gelu)


def feed_forward_plan(model: nn.Module, *, tensor_parallel_size: int) -> tuple[dict[str, str], dict[str, str]]:
    """(plan, why each layer's attention and each unsharded feed-forward pair stays whole) for every torch
    transformer layer in `model`."""
    plan: dict[str, str] = {}
    whole: dict[str, str] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LAYERS):
            continue
        prefix = f"{name}." if name else ""
        for attention in ("self_attn", "multihead_attn"):
            if isinstance(getattr(layer, attention, None), nn.MultiheadAttention):
                whole[prefix + attention] = _ATTENTION_WHOLE
        why = _why_whole(layer, tensor_parallel_size)
        if why:
            whole.update({prefix + "linear1": why, prefix + "linear2": why})
        else:
            plan.update({prefix + "linear1": "colwise", prefix + "linear2": "rowwise"})
    return plan, whole


_ATTENTION_WHOLE = (
    "nn.MultiheadAttention packs q|k|v in one weight and computes with the global head count, which no style shards"
)


def _why_whole(layer: nn.Module, tp: int) -> str:
    """Why `layer`'s feed-forward pair cannot be sharded as column -> row, or ""."""
    own = type(layer)
    if own not in LAYERS and ("forward" in vars(own) or "_ff_block" in vars(own)):
        return f"{own.__name__} overrides torch's forward, so linear1 -> linear2 may not be its feed-forward pair"
    activation = layer.activation
    if not (activation in _PER_ELEMENT or isinstance(activation, nn.ReLU | nn.GELU)):
        return f"its activation {getattr(activation, '__name__', type(activation).__name__)} is not relu or gelu"
    width = layer.get_submodule("linear1").out_features
    if not isinstance(width, int) or width % tp != 0:
        return f"dim_feedforward {width} not divisible by {tp}"
    return ""


def refuse_sharded_attention(model: nn.Module, plan: Mapping[str, str]) -> None:
    """One line for a plan that shards an `nn.MultiheadAttention` or a layer inside one (its `out_proj`)."""
    attentions = [name for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]
    for name, style in plan.items():
        inside = [a for a in attentions if name == a or name.startswith(f"{a}.")]
        if inside and style != "replicate":
            raise ValueError(
                f"tensor plan: {name} ({style}) is inside the nn.MultiheadAttention {inside[0]}, which computes with "
                "its weights directly and the global head count (F.multi_head_attention_forward), so sharding it "
                f"would fail or be wrong. HINT: leave {inside[0]} whole and shard the feed-forward pair (linear1 "
                "'colwise', linear2 'rowwise'; the automatic plan does)"
            )
