"""Tensor-parallel building blocks over torch's DTensor: the style table, plans as data (a model's own, a transformers
model's translated, found from structure or from an fx trace), channel-parallel CNN styles."""

from lightning_parallel.tensor.conv import BatchNormParallel, ConvColwiseParallel, ConvRowwiseParallel
from lightning_parallel.tensor.hf_plans import transformers_plan
from lightning_parallel.tensor.pairing import AutoPlan, auto_plan
from lightning_parallel.tensor.plans import (
    STYLES,
    apply_plan,
    check_plan,
    expand_plan,
    make_style,
)
from lightning_parallel.tensor.structure import structural_plan
from lightning_parallel.tensor.styles import STYLE_TRAITS, Sharding, StyleTraits

__all__ = [
    "STYLES",
    "STYLE_TRAITS",
    "AutoPlan",
    "BatchNormParallel",
    "ConvColwiseParallel",
    "ConvRowwiseParallel",
    "Sharding",
    "StyleTraits",
    "apply_plan",
    "auto_plan",
    "check_plan",
    "expand_plan",
    "make_style",
    "structural_plan",
    "transformers_plan",
]
