"""Tensor-parallel building blocks over torch's DTensor: plans as data, and channel-parallel CNN styles."""

from lightning_parallel.tensor.conv import BatchNormParallel, ConvColwiseParallel, ConvRowwiseParallel
from lightning_parallel.tensor.pairing import AutoPlan, auto_plan
from lightning_parallel.tensor.plans import (
    STYLES,
    apply_plan,
    check_plan,
    expand_plan,
    make_style,
)

__all__ = [
    "STYLES",
    "AutoPlan",
    "BatchNormParallel",
    "ConvColwiseParallel",
    "ConvRowwiseParallel",
    "apply_plan",
    "auto_plan",
    "check_plan",
    "expand_plan",
    "make_style",
]
