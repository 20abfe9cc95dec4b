"""The precision plugin the user chose (`Trainer(precision=...)`), with clipping by one norm over the whole mesh
and fp16 overflow agreed by every rank; autocast, conversion and loss scaling stay the plugin's own.

Lightning builds the plugin before the strategy sees it, and its class depends on `precision=`; so the strategy
re-classes that instance to a subclass of its own class with `MeshClipping` in front (see `mesh_precision`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lightning_parallel.precision import AgreeingGradScaler, clip_grad_value_mixed


class ClipsOverMesh(Protocol):
    """What the plugin needs of its strategy (a `MeshStrategy`; named by this protocol so neither module imports the
    other)."""

    def clip_norm_over_mesh(self, parameters: list[torch.nn.Parameter], max_norm: float) -> None: ...


class MeshClipping(Precision):
    """Clip gradients the way one process would clip the whole model: by one global norm (the strategy says over
    which groups), or element-wise on each rank's shards. Lightning's own clipping uses the local norm, which
    differs per pipeline stage, and refuses a mix of DTensor and plain gradients."""

    mesh_strategy: ClipsOverMesh

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self.mesh_strategy.clip_norm_over_mesh(_parameters(optimizer), float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        clip_grad_value_mixed(_parameters(optimizer), float(clip_val))


def mesh_precision(plugin: Precision, strategy: ClipsOverMesh) -> Precision:
    """`plugin`, re-classed to clip over the mesh, with an fp16 GradScaler that agrees on overflow. Idempotent."""
    if not isinstance(plugin, MeshClipping):
        plugin.__class__ = _with_mesh_clipping(type(plugin))
    assert isinstance(plugin, MeshClipping)
    plugin.mesh_strategy = strategy
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, AgreeingGradScaler):
        plugin.scaler = AgreeingGradScaler.like(scaler, device=str(getattr(plugin, "device", "cuda")))  # type: ignore[attr-defined]
    return plugin


_CLASSES: dict[type[Precision], type[Precision]] = {}  # one subclass per plugin class, so isinstance checks hold


def _with_mesh_clipping(base: type[Precision]) -> type[Precision]:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Mesh{base.__name__}", (MeshClipping, base), {})
    return _CLASSES[base]


def _parameters(optimizer: Any) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]
