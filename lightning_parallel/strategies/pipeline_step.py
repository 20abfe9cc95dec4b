"""The pipelined training step: the user's `training_step` unchanged, its network call served by the schedule on
every stage (`strategies/user_step.py`), gradients put back where autograd would have left them, replicas averaged
once per optimizer step. At pp=1 Lightning's own step runs. Evaluation is `pipeline_eval.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_parallel.pipeline.batchnorm import batchnorm_notice, commit_batchnorm
from lightning_parallel.pipeline.call import network_call
from lightning_parallel.pipeline.runtime import PipelineRuntime, put_gradients, take_gradients
from lightning_parallel.pipeline.schedule_plan import analytic_bubble
from lightning_parallel.pipeline.split import TracedSplit
from lightning_parallel.pipeline.tied import counted_elsewhere, sum_tied_gradients
from lightning_parallel.pipeline.token_shares import TokenShares
from lightning_parallel.replicas import average_
from lightning_parallel.strategies.pipeline_split import PipelineSplit
from lightning_parallel.strategies.step_logs import averaged_logs_line, replay_logs
from lightning_parallel.strategies.user_step import (
    MicroSteps,
    StepRefused,
    capture_network_inputs,
)
from lightning_parallel.tensor.plans import keep_gradients_sharded
from lightning_parallel.tensor.sharded_logits import Counts, StageLogits, gather_logits, logits_session, vocab_heads
from lightning_parallel.tensor.traced_stages import stages_on_mesh
from lightning_parallel.token_mean import model_label_counts


class PipelinedStep(PipelineSplit):
    """The step half of `PipelineParallelStrategy`: the runtime built on the split, and every step through it."""

    _runtime: PipelineRuntime | None
    _micro_steps: MicroSteps | None
    _gradient_hooks: list[RemovableHandle]
    _step_rest: tuple[Any, ...]
    _step_kwargs: dict[str, Any]
    _fresh_grads: list[torch.Tensor | None] | None
    _window_done: bool
    _local_params: list[nn.Parameter] | None
    _logit_counts: Counts
    _stage_logits: StageLogits | None = None  # how the last stage hands its logits on (evaluation rebuilds them)
    _warned_eval_loss = False
    _warned_logs = False

    @override
    def on_device(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        network = self.network_of(module)
        if self.dims.tp > 1:  # after Module.to(), which swaps DTensor parameters and drops their hooks
            for handle in self._gradient_hooks:
                handle.remove()
            self._gradient_hooks = keep_gradients_sharded(network)
        if not self.pipelined:
            if self.global_rank == 0:
                rank_zero_info(f"PipelineParallelStrategy: pp=1, the network runs whole; {self.describe_layout()}")
            return
        if self._runtime is not None:
            return
        assert self._split is not None  # split in parallelize(), before on_device()
        shares = TokenShares(replicas=self.dims.dp, group=self.group("dp"))
        # the last stage hands the loss its logits' local shard (traced stages too: `sharded_logits.handed_on`)
        split, logits = self._split, StageLogits() if self.vocab_heads else None
        self._stage_logits = logits
        rebuild = (lambda value: split.output(logits.restore(value))) if logits is not None else split.output
        self._micro_steps = MicroSteps(module, network, self._user_step, rebuild, shares)
        self._runtime = self._build_runtime(self.pp_rank, logits)
        if self.global_rank == 0:
            rank_zero_info(
                f"PipelineParallelStrategy: {self.spec.name}, {self.describe_layout()}\n{self.partition.table()}"
            )
            notice = batchnorm_notice(
                network,
                microbatches=self.microbatches_for(self.dims.pp),
                bubble_at_one=analytic_bubble("gpipe", pp=self.dims.pp, microbatches=1),
                deferred=self.deferred_batchnorm,
            )
            if notice is not None:
                rank_zero_warn(notice)

    def _build_runtime(self, pp_rank: int, logits: StageLogits | None = None) -> PipelineRuntime:
        partition, split = self.partition, self._split
        assert split is not None
        example = self._example or ()
        micro = tuple(t[: max(1, len(t) // self.microbatches_for(self.dims.pp))].to(self.root_device) for t in example)
        modules, factory = split.stage_modules(partition, pp_rank, micro), split.stage_factory(partition, pp_rank)
        if self._tensor_plan is not None and isinstance(split, TracedSplit):  # traced stages compute on DTensors
            modules, factory = stages_on_mesh(modules, factory, self.device_mesh["tp"], self.vocab_heads)
        if logits is not None:  # every stage module, those traced later per micro-batch shape included
            modules, factory = logits.watch(modules, factory)
        return PipelineRuntime(
            stage_modules=modules,
            stage_factory=factory,
            num_stages=len(partition.stages),
            schedule=self.spec.name,
            microbatches=self.microbatches_for(self.dims.pp),
            group=self.group("pp"),
            device=self.root_device,
            loss_fn=self._scaled(self.micro_steps.loss),
            warn=rank_zero_warn,
        )

    @property
    def runtime(self) -> PipelineRuntime:
        if self._runtime is None:
            raise RuntimeError("the pipeline runtime exists once the strategy is set up")
        return self._runtime

    # ---- the step ------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's training_step, unchanged: run up to its network call on every rank to learn the network's
        inputs, then per micro-batch on the last stage as the schedule's loss; its logs replayed everywhere."""
        if not self.pipelined:
            with self._sharded_logits():
                return gather_logits(super().training_step(*args, **kwargs))
        module = self.lightning_module
        assert module is not None
        network = self.network_of(module)
        if self._window_done and lightning_discards_gradients(module):
            take_gradients(self.local_parameters())  # the last window's: freed now, not held beside the activations
        self._window_done = False
        batch, self._step_rest, self._step_kwargs = args[0], args[1:], kwargs
        inputs = self._network_inputs(network, capture_network_inputs(lambda: self._user_step(batch), network, module))
        rows = inputs[0].shape[0]
        micro_steps = self.micro_steps
        micro_steps.begin(batch, rows, self._label_counts(network, inputs))
        params = self.local_parameters()
        earlier = take_gradients(params)  # gradients accumulated by earlier micro-steps
        with self.precision_plugin.train_step_context(), self._sharded_logits():
            loss = self.runtime.train_step(inputs, torch.arange(rows, device=self.root_device))
        micro_steps.end()
        commit_batchnorm(self._batchnorms)
        self._fresh_grads = take_gradients(params)
        put_gradients(params, earlier)
        if loss is not None and self._scaler is not None:
            loss = loss / self._scaler.get_scale()  # report the loss itself, not the scaled one
        # One object from the last stage: the loss, the logs to replay, or why the step was refused.
        # (and what its loss did with the logits, so every rank's summary says it)
        counts = self._logit_counts
        report = [(float(loss), micro_steps.report, counts) if loss is not None else None]
        dist.broadcast_object_list(report, src=self._last_stage_rank(), group=self.group("pp"))
        value, step_report, self._logit_counts = report[0]  # type: ignore[misc]
        if step_report.error is not None:
            raise StepRefused(step_report.error)
        if step_report.inexact is not None and not self._warned_inexact:
            rank_zero_warn(step_report.inexact)
            self._warned_inexact = True
        averaged = averaged_logs_line(f"{type(module).__name__}.training_step", step_report.records)
        if averaged is not None and not self._warned_logs:
            rank_zero_warn(averaged)
            self._warned_logs = True
        replay_logs(module, step_report.records, holds_metrics=self.runtime.has_last)
        return torch.tensor(value, dtype=torch.float32, device=self.root_device)

    @property
    def vocab_heads(self) -> list[str]:
        """The plan's `vocab_head`s whose logits a step's cross-entropy reads sharded (`sharded_logits.vocab_heads`)."""
        return vocab_heads(self._tensor_plan[1] if self._tensor_plan is not None else None)

    def _sharded_logits(self) -> AbstractContextManager[Any]:
        """Around a step (the schedule and the user's step, in training as its loss): `tensor/sharded_logits.py`."""
        return logits_session(self.vocab_heads, self._logit_counts)

    def _network_inputs(self, network: nn.Module, called: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[Any, ...]:
        """The tensors stage 0 takes, checked to be passed the way the split was traced (`self._call`)."""
        try:
            call, inputs = network_call(network, *called)
        except ValueError as error:
            raise StepRefused(str(error)) from error
        if self._call is not None and call != self._call:
            raise StepRefused(
                f"this step calls the network as {call.describe()}, but the pipeline was traced for "
                f"{self._call.describe()}. HINT: pass the same tensors and flags to the network in every step "
                "(training and evaluation)"
            )
        return inputs

    def _label_counts(
        self, network: nn.Module, inputs: tuple[Any, ...], *, evaluating: bool = False
    ) -> tuple[str, torch.Tensor | None] | None:
        """A transformers model computing its loss from `labels`: the valid labels per row it averages (in training
        on the last stage only, which computes the loss; in evaluation on every rank, which all rebuild the output)."""
        if not (self.runtime.has_last or evaluating) or self._call is None or "labels" not in self._call.keywords:
            return None
        keywords = self._call.bind(inputs)[1]
        ignore_index = dict(self._call.constants).get("ignore_index", -100)
        return model_label_counts(network, keywords, int(ignore_index))  # type: ignore[arg-type]

    def _user_step(self, batch: Any) -> Any:
        return self.lightning_step(batch, *self._step_rest, **self._step_kwargs)

    @property
    def micro_steps(self) -> MicroSteps:
        if self._micro_steps is None:
            raise RuntimeError("the micro-steps exist once the strategy is set up")
        return self._micro_steps

    @property
    def _scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self.precision_plugin, "scaler", None)  # fp16 mixed precision only

    def _scaled(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """Under fp16 loss scaling the schedule must back-propagate the scaled loss, as
        `precision_plugin.backward` would have; the plugin unscales the gradients afterwards."""

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            value = loss_fn(output, target)
            return self._scaler.scale(value) if self._scaler is not None else value  # type: ignore[return-value]

        return loss

    def _last_stage_rank(self) -> int:
        """Global rank of this replica's process that holds the last stage."""
        last_pp = self.partition.stage_to_rank[-1]
        return dist.get_global_rank(self.group("pp"), last_pp)

    def local_parameters(self) -> list[nn.Parameter]:
        # Cached: walking every parameter twice per step cost about 1 ms on a 389-tensor GPT.
        if self._local_params is None:
            self._local_params = [p for p in self.network_of(self.module).parameters() if p.requires_grad]
        return self._local_params

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The schedule already ran backward inside training_step; put those gradients where autograd
        # would have, scaled like Lightning's loss / accumulate_grad_batches, and fire the hooks.
        if not self.pipelined:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        scale = 1.0 / module.trainer.accumulate_grad_batches
        fresh = self._fresh_grads or []
        for p, g in zip(self.local_parameters(), fresh, strict=False):
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._fresh_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            result = closure()
            self._average_over_replicas()
            return result

        result = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self._window_done = True
        return result

    def _average_over_replicas(self) -> None:
        """Sum tied parameters' gradients over their stages, then all-reduce each stage's gradients across
        data-parallel replicas, once per optimizer step."""
        tp = (self.device_mesh.get_local_rank("tp"), self.dims.tp)
        sum_tied_gradients(self.network_of(self.module), self._tied, self.group("pp"), tp)
        if self.dims.dp == 1 or self.replicas == "fsdp":  # FSDP2 already reduce-scattered them
            return
        # DTensor gradients (tensor parallelism): each rank averages its own shard
        average_([_local(p.grad) for p in self.local_parameters() if p.grad is not None], self.group("dp"))

    @override
    def norm_group(self) -> dist.ProcessGroup:
        return self.group("pp")  # every stage of this replica; DTensor shards are summed over "tp" on their own

    @override
    def counted_elsewhere(self) -> set[int]:
        return counted_elsewhere(self.network_of(self.module), self._tied, self.pp_rank)


def lightning_discards_gradients(module: pl.LightningModule) -> bool:
    """Whether Lightning sets the gradients to None right after the first `training_step` of a window, unread:
    automatic optimization, Lightning's own `optimizer_zero_grad` and no `on_before_zero_grad` hook (module or
    callback) that could look at them. Then the last window's gradients can go before the schedule runs (one copy of
    the stage's gradients less at its peak) with no visible difference."""
    trainer = module.trainer
    hooks = [is_overridden("on_before_zero_grad", c, parent=pl.Callback) for c in trainer.callbacks]  # type: ignore[attr-defined]
    return (
        module.automatic_optimization
        and not is_overridden("optimizer_zero_grad", module)
        and not is_overridden("on_before_zero_grad", module)
        and not any(hooks)
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
