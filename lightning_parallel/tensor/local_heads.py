"""The "local_heads" style: an attention module whose projections are column-sharded holds only its rank's heads, so
the head counts and widths it keeps as attributes (GPT-2's `split_size`, BERT's `all_head_size`, `num_heads`) are
divided by the tensor-parallel size, as torchtitan does for its own attention. It shards no parameter.

Only where torch's styles run the real forwards (pp=1, nn.Sequential stages): traced pipeline stages compute on
DTensors with global shapes (`traced_stages.py`), where the global values are the right ones, so there it does nothing.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["LOCAL_ATTRIBUTES", "LocalHeads", "local_attributes"]

# Attribute names attention modules keep for a count of heads or for the width of their projections (all heads x
# head size). Per-head sizes (`head_dim`) and ratios (`num_key_value_groups`) are the same on every rank and stay.
LOCAL_ATTRIBUTES = (
    "num_heads", "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "num_kv_heads",
    "split_size", "all_head_size", "embed_dim", "inner_dim", "hidden_size",
)  # fmt: skip
_GLOBAL = "_lightning_parallel_global_heads"  # the values before division, kept on the module


def local_attributes(module: nn.Module) -> dict[str, int]:
    """The module's own head counts and widths, by name, as one process has them (before any division)."""
    kept = getattr(module, _GLOBAL, None)
    if isinstance(kept, dict):
        return dict(kept)
    return {name: value for name in LOCAL_ATTRIBUTES if type(value := getattr(module, name, None)) is int}


def attribute_sizes(module: nn.Module) -> list[tuple[str, int]]:
    """(what, size) pairs the tensor-parallel size must divide (`plans.check_plan`)."""
    return [(name, value) for name, value in local_attributes(module).items()]


class LocalHeads(ParallelStyle):
    """Divide an attention module's head counts and widths by the mesh size, once (a second set-up keeps them)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if getattr(module, _GLOBAL, None) is not None:
            return module
        found = local_attributes(module)
        size = device_mesh.size()
        for name, value in found.items():
            if value % size:
                raise ValueError(
                    f"{type(module).__name__}.{name} = {value} is not divisible by tensor_parallel_size {size}. "
                    f"HINT: use a tensor_parallel_size that divides {value}"
                )
            setattr(module, name, value // size)
        setattr(module, _GLOBAL, found)
        return module
