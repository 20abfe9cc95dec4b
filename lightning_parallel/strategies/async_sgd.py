"""`strategy=async_sgd`: every process trains alone; each optimizer step pushes the local gradient to a parameter
server (threads beside rank 0's worker, `lightning_parallel/async_sgd.py`) and takes its current weights back.

Validation, checkpoints and the end of training are the only points where ranks meet: there every rank loads the
server's weights. Not deterministic with more than one worker; no fp16 GradScaler, no manual optimisation.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from lightning_parallel.parameter_server import SERVER_RANK, ParameterServer, ServerClient, flat_gradient, load_flat
from lightning_parallel.replicas import average_
from lightning_parallel.strategies.arguments import check_int
from lightning_parallel.strategies.ddp import DEFAULT_TIMEOUT, DDPStrategy
from lightning_parallel.strategies.steps_alone import StepsAlone


class _PushingOptimizer:
    """What the precision plugin steps in place of the user's optimizer: its `step(closure)` runs the closure
    (forward, backward, hooks and clipping on the worker's own gradients) and then the exchange with the server.
    Everything else (param_groups, state) is the user's optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, exchange: Callable[[], None]) -> None:
        self._optimizer, self._exchange = optimizer, exchange

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        self._exchange()
        return loss


class AsyncSGDStrategy(StepsAlone, DDPStrategy):
    """Asynchronous SGD: Lightning's DDP processes and data sharding without DDP's wrapper or gradient all-reduce.

    Every rank is a worker; rank 0 also hosts the parameter server, which steps a copy of the optimizer that
    `configure_optimizers` returned on a copy of the parameters, one gradient at a time, as they arrive. A worker's
    `trainer.max_steps` counts its own steps, so the server applies up to `devices x max_steps` updates. The
    server's learning rate follows rank 0's LR scheduler. Training-time `self.log(..., sync_dist=True)` is not
    reduced across ranks (each worker logs its own value): a reduction would make every step wait for the slowest
    worker. A worker that dies ends the run at rank 0's next step with a line naming it.

    Args:
        max_staleness: Drop a gradient computed on weights more than this many server updates old (the worker
            gets the current weights and goes on; see `lightning_parallel/async_sgd.py`). None keeps every gradient.
        **kwargs: As for `lightning_parallel.strategies.ddp.DDPStrategy` (timeout, process_group_backend, ...).
    """

    def __init__(
        self, *, max_staleness: int | None = None, timeout: float | timedelta | None = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> None:
        check_int(self, "max_staleness", max_staleness, example=4, minimum=0, optional=True)
        super().__init__(timeout=timeout, **kwargs)
        self.max_staleness = max_staleness
        self._server: ParameterServer | None = None
        self._client: ServerClient | None = None
        self._params: list[Tensor] = []
        self._version = 0
        self.exchanging = False  # between set-up for fitting and the end of training

    @property
    def serves(self) -> bool:
        """Whether fitting runs the parameter server: not for one worker, which would push every gradient to a copy of
        its own optimizer and load the same weights back (ResNet-50's CPU step cost 1.86x); it steps in place."""
        return self.world_size > 1

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: gradients go to the server, not into an all-reduce."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if len(self.optimizers) != 1 or not self.module.automatic_optimization:
            raise ValueError(
                f"AsyncSGDStrategy needs exactly one optimizer and automatic optimisation, got {len(self.optimizers)} "
                "optimizer(s). HINT: return one optimizer from configure_optimizers"
            )
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "AsyncSGDStrategy does not support fp16's GradScaler. HINT: precision=bf16-mixed or 32-true"
            )
        if not self.serves:
            return
        optimizer = self.optimizers[0]
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        # Every rank creates every pair group, in the same order (torch requires it), but uses only its own.
        groups = {
            rank: dist.new_group([SERVER_RANK, rank], backend="gloo", timeout=self._timeout)
            for rank in range(1, self.world_size)
        }
        if self.global_rank == SERVER_RANK:
            self._server = ParameterServer(copy.deepcopy(optimizer), max_staleness=self.max_staleness)
            self._server.serve(groups)
        else:
            numel = sum(p.numel() for p in self._params)
            self._client = ServerClient(groups[self.global_rank], numel=numel, dtype=self._params[0].dtype)
        self.exchanging = True
        self.load_server_weights()  # rank 0's weights (those of a resumed checkpoint included) everywhere

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if not self.exchanging:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        pushing = _PushingOptimizer(optimizer, partial(self._exchange, optimizer))
        module = model or self.module
        if not isinstance(module, pl.LightningModule):  # as Lightning's own Strategy.optimizer_step requires
            raise TypeError(f"AsyncSGDStrategy steps a LightningModule, got {type(module).__name__}")
        return self.precision_plugin.optimizer_step(pushing, model=module, closure=closure)

    def _exchange(self, optimizer: torch.optim.Optimizer) -> None:
        if all(p.grad is None for p in self._params):  # training_step returned None: nothing to push
            return
        grad = flat_gradient(self._params)
        if self._server is not None:
            self._server.check()  # a lost worker ends the run here
            self._server.follow(optimizer.param_groups)
            reply = self._server.push(SERVER_RANK, grad, self._version)
        else:
            assert self._client is not None
            reply = self._client.exchange(grad, self._version)
        load_flat(self._params, reply.weights)
        self._version = reply.version
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()  # on rank 0 Lightning's zero_grad would reach only the user's optimizer anyway

    def load_server_weights(self) -> None:
        """Every rank loads the server's latest weights (a collective over all ranks); floating-point buffers
        (BatchNorm statistics) are averaged over the workers."""
        if self._server is not None:
            self._server.check()  # name a lost worker rather than fail in the broadcast below
            flat, version = self._server.snapshot()
        else:
            flat, version = torch.empty(sum(p.numel() for p in self._params), dtype=self._params[0].dtype), 0
        flat, header = flat.to(self.root_device), torch.tensor([version], device=self.root_device)
        dist.broadcast(flat, SERVER_RANK)
        dist.broadcast(header, SERVER_RANK)
        load_flat(self._params, flat)
        self._version = int(header.item())
        average_([b for b in self.module.buffers() if b.is_floating_point()])

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.exchanging:
            self.load_server_weights()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.exchanging:  # trainer.save_checkpoint runs on every rank
            self.load_server_weights()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        if self._server is not None:
            return self._server.optimizer_state()  # type: ignore[return-value]
        return super().optimizer_state(optimizer)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # The optimizer state is the server's; the workers' optimizers take only the hyperparameters (LR schedules).
        if not self.serves:  # the one worker's optimizer is the one that steps
            return super().load_optimizer_state_dict(checkpoint)
        [state] = checkpoint["optimizer_states"]
        self.optimizers[0].load_state_dict({**state, "state": {}})
        if self._server is not None:
            self._server.load_optimizer_state(state)

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        if not self.exchanging:
            return
        if self._client is not None:
            self._client.leave(self._version)
        else:
            assert self._server is not None
            self._server.wait_for_workers(self._timeout.total_seconds() if self._timeout else 1800.0)
        self.load_server_weights()  # the trained model everywhere is the server's
        self.exchanging = False  # the server object stays: checkpoints after fit save its optimizer state

    def describe(self) -> dict[str, Any]:
        """summary.json's `parallel`: the server's updates and per-worker staleness (complete on rank 0 only)."""
        described: dict[str, Any] = {
            "kind": "async_sgd",
            "workers": self.world_size,
            "max_staleness": self.max_staleness,
            "collectives": self.world_size > 1,
        }
        if self._server is not None:
            described["server"] = f"threads on rank {SERVER_RANK}"
            described["updates"] = self._server.version
            described["staleness"] = [{"rank": rank, **seen} for rank, seen in self._server.staleness().items()]
        return described
