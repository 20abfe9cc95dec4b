"""The user's own `training_step` under pipeline parallelism, unchanged.

It runs twice over: once on every rank up to its network call (to learn the network's inputs), then on the
last stage once per micro-batch, with that micro-batch's stage output in place of the network call, as the
schedule's loss. `self.log` calls are recorded there (`step_logs.py` replays them on every rank after the schedule,
so `sync_dist=True` collectives line up: running them inside the schedule deadlocks). Each micro-batch's loss is made
a share of the whole batch's mean over valid tokens (`token_mean.py`), counted at the step's first loss by running
it once more per micro-batch up to its loss call. Knows nothing about schedules or ranks: the strategy runs the
schedule and moves the records between ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torchmetrics import Metric

from lightning_parallel.pipeline.runtime import placeholder_loss
from lightning_parallel.pipeline.token_shares import TokenShares
from lightning_parallel.strategies.step_logs import LogRecord, plain
from lightning_parallel.token_mean import Counted, TokenMean

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_MISSING = object()


@contextmanager
def swap_attribute(obj: object, name: str, value: Any) -> Iterator[None]:
    """Set `obj.name = value` in the instance dict (shadowing methods and submodules), then undo it."""
    saved = obj.__dict__.get(name, _MISSING)
    obj.__dict__[name] = value
    try:
        yield
    finally:
        if saved is _MISSING:
            del obj.__dict__[name]
        else:
            obj.__dict__[name] = saved


class StepRefused(RuntimeError):
    """A training_step this strategy cannot run exactly; the message is one line with a HINT, and every rank
    raises the same one (so a caller prints it once)."""

    same_on_every_rank = True


class _NetworkCalled(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args_, self.kwargs = args, kwargs


def capture_network_inputs(
    run_step: Callable[[], Any], network: nn.Module, module: nn.Module
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run the user's step until it calls the network; return what the network receives, positional and keyword
    arguments (logs muted)."""

    def stop_at_network(*args: Any, **kwargs: Any) -> Any:
        raise _NetworkCalled(args, kwargs)

    with swap_attribute(network, "forward", stop_at_network), swap_attribute(module, "log", _ignore):
        try:
            run_step()
        except _NetworkCalled as called:
            return called.args_, called.kwargs
    raise StepRefused(
        f"{type(module).__name__}.training_step never called its network, so there is nothing to pipeline. "
        "HINT: compute the loss from self(x) or self.<network>(x)"
    )


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros(())


@dataclass
class StepReport:
    """What the last stage learned from the user's step: per micro-batch log records, or why it refused; and the
    warning line when its loss could not be made one device's (`token_mean.inexact_warning`)."""

    records: list[list[LogRecord]] = field(default_factory=list)
    error: str | None = None
    inexact: str | None = None


class MicroSteps:
    """The schedule's loss on the last stage: the user's training_step on one micro-batch of the batch.

    Args:
        module: the LightningModule.
        network: the (pruned) network whose output is substituted.
        run_step: calls the user's training_step on a batch (the strategy adds the other step arguments).
        rebuild: turns what the last stage returns (a tensor or a flat tuple of tensors) into the network's own output
            (a tuple, dict or ``ModelOutput``), what the user's step reads (``out.loss``).
        shares: this replica's micro-batch shares of the batch's mean over valid tokens.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        network: nn.Module,
        run_step: Callable[[Any], Any],
        rebuild: Callable[[Any], Any] = lambda value: value,
        shares: TokenShares | None = None,
    ) -> None:
        self.module = module
        self.network = network
        self.run_step = run_step
        self.rebuild = rebuild
        self.shares = shares if shares is not None else TokenShares(replicas=1, group=None)
        self._param_names = {id(p): name for name, p in module.named_parameters()}
        self._metrics = [m for m in module.modules() if isinstance(m, Metric)]
        self._metric_paths = {id(m): name for name, m in module.named_modules() if isinstance(m, Metric)}
        self._batch: Any = None
        self._rows = 0
        self._counted = False
        self.report = StepReport()

    def begin(self, batch: Any, rows: int, labels: tuple[str, torch.Tensor | None] | None = None) -> None:
        """A new batch of `rows` samples (the network input's leading size) is about to be scheduled. `labels`: the
        network's own loss from `labels` and its valid labels per row (`token_mean.model_label_counts`)."""
        self._batch, self._rows, self._counted, self.report = batch, rows, False, StepReport()
        self.shares.begin(labels)

    def loss(self, output: Any, rows: torch.Tensor) -> torch.Tensor:
        """Loss of the micro-batch whose sample indices are `rows` (contiguous), from its stage output."""
        if self.report.error is not None:
            return placeholder_loss(output)  # finish the schedule quietly; every rank raises afterwards
        start, stop = int(rows[0]), int(rows[-1]) + 1
        size = stop - start
        if not self._counted:  # the step's first loss on this rank: every micro-batch's valid tokens
            self._counted = True
            self.shares.count(self._rows // size, size, lambda part: self._count(output, part * size, size))
        micro_batch = slice_batch(self._batch, start, stop, self._rows)
        records: list[LogRecord] = []
        try:
            with (
                swap_attribute(self.network, "forward", _once(self.shares.output(self.rebuild(output), start // size))),
                swap_attribute(self.module, "log", self._recorder(records)),
                _ParameterGuard(self._param_names),
                self.shares.mode(start // size),
            ):
                result = self.run_step(micro_batch)
            loss = _loss_of(result)
            for record in records:
                record.is_loss = isinstance(record.value, float) and record.value == float(loss.detach())
        except StepRefused as refused:
            self.report.error = str(refused)
            return placeholder_loss(output)
        self.report.records.append(records)
        return loss

    def end(self) -> None:
        """After the schedule: the warning line when this step's loss is not one device's (`report.inexact`)."""
        if self.report.error is None:
            self.report.inexact = self.shares.verdict(f"{type(self.module).__name__}.training_step")

    def _count(self, output: Any, start: int, size: int) -> float | None:
        """The count of valid targets of the step's mean over them on rows [start, start + size), found by running the
        step with this micro-batch's output (every micro-batch's output has its shape) up to that call, without
        gradients, logs or metric updates; None when it makes no such call."""
        with ExitStack() as muted:
            muted.enter_context(torch.no_grad())
            muted.enter_context(swap_attribute(self.network, "forward", _once(self.rebuild(output))))
            muted.enter_context(swap_attribute(self.module, "log", _ignore))
            for metric in self._metrics:  # a metric updated before the loss must not count this pass
                muted.enter_context(swap_attribute(metric, "forward", _zero))
                muted.enter_context(swap_attribute(metric, "update", _ignore))
            muted.enter_context(TokenMean(None, counting=True))
            try:
                self.run_step(slice_batch(self._batch, start, start + size, self._rows))
            except Counted as counted:
                return float(counted.count)
            except Exception:  # noqa: BLE001 - the real step raises it again, in its own words
                return None
        return None

    def _recorder(self, records: list[LogRecord]) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            bound = _LOG_SIGNATURE.bind(self.module, *args, **kwargs).arguments
            name, value = bound.pop("name"), bound.pop("value")
            bound.pop("self")
            bound.pop("sync_dist_group", None)  # a process group does not travel; sync_dist covers the world
            if isinstance(value, Metric):
                path = self._metric_paths.get(id(value))
                if path is None:
                    raise StepRefused(
                        f"self.log({name!r}, <metric>) logs a torchmetrics Metric that is not an attribute of "
                        f"{type(self.module).__name__}. HINT: create it in __init__ (self.train_acc = Accuracy(...))"
                    )
                records.append(LogRecord(name, plain(value._forward_cache), bound, metric=path))
            else:
                records.append(LogRecord(name, plain(value), bound))

        return record


def slice_batch(batch: Any, start: int, stop: int, rows: int) -> Any:
    """Rows [start, stop) of every tensor in the batch whose leading size is `rows`; everything else as is."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == rows else batch
    if isinstance(batch, Mapping):
        return type(batch)({k: slice_batch(v, start, stop, rows) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, start, stop, rows) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(v, start, stop, rows) for v in batch)
    return batch


def _once(output: Any) -> Callable[..., Any]:
    calls = 0

    def substitute(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise StepRefused(
                "training_step calls the network twice; a pipeline runs one forward per step, so the second call "
                "has no stage output. HINT: concatenate the inputs into one call (self(torch.cat([x1, x2])))"
            )
        return output

    return substitute


def _loss_of(result: Any) -> torch.Tensor:
    loss = result.get("loss") if isinstance(result, Mapping) else result
    if isinstance(loss, torch.Tensor) and loss.numel() != 1:
        raise StepRefused(
            f"training_step returned a loss of shape {tuple(loss.shape)}, not a scalar (a loss built with "
            "reduction='none'?). HINT: return its mean, e.g. loss.mean()"
        )
    if not isinstance(loss, torch.Tensor):
        raise StepRefused(
            f"training_step returned {type(result).__name__}; under pipeline parallelism it must return the loss "
            "(a scalar tensor, or a dict with 'loss') for every batch. HINT: skipping a batch (None) is not supported"
        )
    loss = loss.sum() if loss.dim() else loss
    # torch's split backward detaches stage outputs in place, which a view (e.g. losses[0]) does not allow
    return loss.clone() if loss._is_view() else loss


class _ParameterGuard(TorchFunctionMode):
    """Refuses a loss that computes with parameters directly (e.g. an L2 term over self.parameters()): each stage
    holds only its own, so such a term would silently count one stage's parameters only."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for value in [*args, *(kwargs or {}).values()]:
            candidates = value if isinstance(value, (list, tuple)) else (value,)
            for tensor in candidates:
                if isinstance(tensor, nn.Parameter):
                    name = self.names.get(id(tensor), "a parameter")
                    raise StepRefused(
                        f"training_step computes with the parameter `{name}` directly (a regularisation term?); "
                        "under pipeline parallelism each stage holds only its own parameters, so the term would "
                        "count one stage only. HINT: use the optimizer's weight_decay, or strategy='ddp'/'tensor'"
                    )
        return func(*args, **(kwargs or {}))
