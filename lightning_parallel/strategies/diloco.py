"""DiLoCo as a Lightning strategy: each process trains its own replica (no DDP wrapper, so no gradient all-reduce)
and every `period` optimizer steps `diloco.OuterLoop` averages the replicas' change and takes an outer step.

Only the Lightning glue: when to step, which state a checkpoint carries. The outer step itself is `diloco.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.outer_loop import OuterLoop
from lightning_parallel.replicas import broadcast_module
from lightning_parallel.strategies.arguments import check_int, reject
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.replica_states import gather_replica_states, restore_replica_state
from lightning_parallel.strategies.steps_alone import StepsAlone

# The DiLoCo paper's outer optimizer (Douillard et al., 2023): Nesterov SGD.
DEFAULT_OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
OUTER_HINT = "outer_optimizer={_target_: torch.optim.SGD, _partial_: true, lr: 0.7, momentum: 0.9, nesterov: true}"
# What the strategy takes besides its own keys: the process-group side of DDP, none of the wrapper's arguments.
ACCEPTED = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
ACCEPTED |= {"process_group_backend", "timeout", "start_method"}


class DiLoCoStrategy(StepsAlone, DDPStrategy):
    """Replicas step alone for `period` steps; then their mean pseudo-gradient goes through `outer_optimizer`.

    The replicas are all processes (the data-parallel group); the state a resume needs (every replica's weights and
    inner optimizer state, the synced copy, the outer optimizer) travels in the Lightning checkpoint. Between syncs
    ranks do not meet: training-time `self.log(..., sync_dist=True)` logs each rank's own value (`StepsAlone`).

    Args:
        period: inner optimizer steps between syncs (H; the paper uses 500).
        outer_optimizer: builds the outer optimizer from a list of tensors; None: Nesterov SGD, lr 0.7, momentum 0.9.
        **kwargs: `DDPStrategy`'s process-group arguments (`timeout`, `process_group_backend`, ...).
    """

    def __init__(
        self,
        *,
        period: int = 500,
        outer_optimizer: Callable[[list[torch.Tensor]], Optimizer] | None = None,
        **kwargs: Any,
    ) -> None:
        check_int(self, "period", period, example=500)
        outer_optimizer = DEFAULT_OUTER if outer_optimizer is None else outer_optimizer
        check_outer_optimizer(self, outer_optimizer)
        for name in sorted(set(kwargs) - ACCEPTED):  # DistributedDataParallel's arguments: nothing would use them
            reject(self, name, kwargs[name], "left out (DiLoCo wraps no model in DDP)", f"remove {name}")
        super().__init__(**kwargs)
        self.period = period
        self.outer_optimizer = outer_optimizer
        self._outer: OuterLoop | None = None

    @override
    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "diloco", "period": self.period}

    @property
    def outer(self) -> OuterLoop:
        """The outer loop of the current fit (exists from `setup` on)."""
        if self._outer is None:
            raise RuntimeError("DiLoCoStrategy.outer exists once fitting has set the strategy up")
        return self._outer

    @override
    def configure_ddp(self) -> None:
        # No DDP wrapper: nothing is all-reduced per step. The replicas only have to start from the same weights.
        assert self.model is not None
        broadcast_module(self.model)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1:
            raise ValueError(
                f"DiLoCoStrategy steps one inner optimizer, configure_optimizers returned {len(self.optimizers)}. "
                "HINT: return one optimizer"
            )
        module = self.module
        self._outer = OuterLoop(
            ((name, p) for name, p in module.named_parameters() if p.requires_grad),
            buffers=((name, b) for name, b in module.named_buffers() if b.is_floating_point()),
            outer_optimizer=self.outer_optimizer,
            period=self.period,
            group=None,  # every process is a replica here; a mesh strategy would pass its "dp" group
        )

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.outer.step()
        return output

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank gets here (Trainer.save_checkpoint); only a full checkpoint (not weights_only) has optimizers.
        if self._outer is not None and "optimizer_states" in checkpoint:
            checkpoint = {
                **checkpoint,
                "diloco": {"outer": self._outer.state_dict(), "replicas": gather_replica_states(self)},
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        state = checkpoint.get("diloco")
        if state is None:  # e.g. a DDP checkpoint: the outer loop starts from the weights it restored
            return
        restore_replica_state(self, state["replicas"])
        self.outer.load_state_dict(state["outer"])


def check_outer_optimizer(owner: object, factory: Any) -> None:
    """`factory([tensor])` builds a torch optimizer: tried on one tensor, so a wrong one fails before launch."""
    if not callable(factory):
        reject(owner, "outer_optimizer", factory, "a callable returning a torch.optim.Optimizer", OUTER_HINT)
    try:
        built = factory([torch.zeros(1)])
    except Exception as error:  # e.g. SGD(lr=-1): say what the optimizer said, on one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        reject(owner, "outer_optimizer", factory, f"an optimizer factory that works ({reason})", OUTER_HINT)
    if not isinstance(built, Optimizer):
        expected = f"a callable returning a torch.optim.Optimizer, not {type(built).__name__}"
        reject(owner, "outer_optimizer", factory, expected, OUTER_HINT)
