"""Training steps that do not meet, for strategies whose replicas sync now and then (local SGD, DiLoCo) or never
wait for each other (async SGD).

Lightning meets all ranks at every training batch even when the strategy does not: rank 0's SIGTERM flag is
broadcast before each batch, and `self.log(..., sync_dist=True)` reduces the value over the ranks. Either would pace
every worker by the slowest at every step, which is what these methods exist to avoid. While training, each rank
answers for its own SIGTERM and a training-time reduce returns the rank's own value (each worker logs its own
training loss); validation and testing reduce as usual.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_parallel.seams import private_method
from lightning_parallel.strategies.ddp import DDPStrategy


class StepsAlone(DDPStrategy):
    """Mixin, listed before the DDP strategy it modifies: no meeting of all ranks inside a training step.

    A `DDPStrategy` itself, so that its `super()` calls and `module` resolve to DDP's, as they do at run time."""

    _alone = False  # set from the start to the end of training
    token_mean_over_replicas = False  # a per-step count over the replicas would be a meeting too

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        loop = self.module.trainer.fit_loop.epoch_loop
        private_method(
            loop, "_broadcast_sigterm_tensor", library="lightning", why="train without meeting", parameters=0
        )
        # on the instance (what `loop.x = ...` does), where on_train_end pops it from
        vars(loop)["_broadcast_sigterm_tensor"] = partial(_local_sigterm, self.module.trainer)
        self._alone = True

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if self._alone and self.module.trainer.training:
            return tensor  # this rank's own value: a reduction is a meeting of all ranks at every step
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def on_train_end(self) -> None:
        self._alone = False
        vars(self.module.trainer.fit_loop.epoch_loop).pop("_broadcast_sigterm_tensor", None)
        super().on_train_end()


def _local_sigterm(trainer: pl.Trainer) -> None:
    """Lightning's per-batch SIGTERM check without the broadcast: each rank answers for its own signal."""
    if trainer.received_sigterm:
        raise SIGTERMException(1)
