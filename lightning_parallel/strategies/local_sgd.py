"""Local SGD: Lightning's DDP with torch's post-local SGD. `warmup_steps` steps of ordinary DDP (gradients
all-reduced), then each replica steps alone and torch's `PeriodicModelAverager` averages the parameters every
`period` steps (Lightning's `model_averaging_period`).

Only the glue Lightning lacks: the hook's state made per fit, the hook registered on CPU too, counters on resume, and
every replica's own state in checkpoints (replicas differ between averagings; Lightning keeps rank 0's only).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_parallel.strategies.arguments import check_int, reject
from lightning_parallel.strategies.ddp import DDPStrategy
from lightning_parallel.strategies.replica_states import gather_replica_states, restore_replica_state
from lightning_parallel.strategies.steps_alone import StepsAlone

# Set by this class: the post-local-SGD hook, its state and the averaging period.
OWN = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class LocalSGDStrategy(StepsAlone, DDPStrategy):
    """`DDPStrategy` (same arguments) running post-local SGD. Between averagings ranks do not meet: training-time
    `self.log(..., sync_dist=True)` logs each rank's own value (`steps_alone.StepsAlone`).

    Args:
        period: optimizer steps between parameter averagings (>= 1; 1 is DDP with extra work).
        warmup_steps: optimizer steps of ordinary DDP before the replicas start stepping alone (>= 0).
        **kwargs: `DDPStrategy`'s arguments, except the communication hook and averaging ones this class sets.
    """

    def __init__(self, *, period: int = 4, warmup_steps: int = 0, **kwargs: Any) -> None:
        check_int(self, "period", period, example=4)
        check_int(self, "warmup_steps", warmup_steps, example=0, minimum=0)
        for name in OWN:
            if name in kwargs:
                reject(self, name, kwargs[name], "left out (set from period and warmup_steps)", f"remove {name}")
        super().__init__(model_averaging_period=period, **kwargs)
        self.period = period
        self.warmup_steps = warmup_steps

    @override
    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": "local_sgd", "period": self.period, "warmup_steps": self.warmup_steps}

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers communication hooks on CUDA only; DDP takes them on gloo as well. The state is made
        # here, once the process group exists, fresh for each fit; Lightning's setup sees it and wraps the
        # optimizer step with a PeriodicModelAverager(period, warmup_steps=start_localSGD_iter).
        # post_local_gradient_allreduce=False: after the warm-up no gradient is all-reduced at all. torch's default
        # (True) all-reduces within a subgroup, by default one per node, which on one machine is every rank (no
        # local SGD at all), and whose default creation fails without CUDA (new_subgroups sizes it by GPU count).
        self._ddp_comm_state = PostLocalSGDState(
            process_group=None,
            subgroup=None,
            start_localSGD_iter=self.warmup_steps,
            post_local_gradient_allreduce=False,
        )
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_comm_state, post_localSGD_hook)

    @override
    def on_train_start(self) -> None:
        # A resumed fit continues the warm-up and averaging count where the checkpoint left it.
        super().on_train_start()
        steps = self.module.trainer.global_step
        if isinstance(self._ddp_comm_state, PostLocalSGDState) and self._model_averager is not None:
            self._ddp_comm_state.iter = steps
            self._model_averager.step = steps

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        # Every rank gets here (Trainer.save_checkpoint); only a full checkpoint (not weights_only) has optimizers.
        if "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, "local_sgd": {"replicas": gather_replica_states(self)}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        state = checkpoint.get("local_sgd")
        if state is not None:  # absent in e.g. a DDP checkpoint: every replica starts from the weights restored
            restore_replica_state(self, state["replicas"])
