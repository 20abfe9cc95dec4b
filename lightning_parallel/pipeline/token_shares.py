"""Each micro-batch's share of one device's token mean under a pipeline (`token_mean.py`): the valid counts of a
replica's micro-batches, totalled over the data-parallel replicas once per step; what a micro-batch's mean over valid
targets is divided by, how a model's own mean from `labels` is rescaled; the step's line when its loss cannot be exact.

Torch only, and blind to the user's step: `strategies/user_step.py` runs the step and finds the targets it counts.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from lightning_parallel.pipeline.runtime import placeholder_loss
from lightning_parallel.token_mean import TokenMean, inexact_warning, summed


@dataclass
class PartCounts:
    """One step's valid counts on one replica, per part (micro-batch), and their totals over every replica: what a
    part's mean over valid targets is divided by (`divisor`) and how a model's own mean is rescaled (`model_scale`).
    `model` / `called`: per part, a transformers model's labels and the step's mean over valid targets (None: not
    there, or not counted on every replica)."""

    parts: int
    replicas: int
    model: list[float] | None
    called: list[float] | None
    model_total: float = 0.0
    called_total: float = 0.0

    @classmethod
    def totalled(
        cls,
        model: list[float] | None,
        called: list[float] | None,
        *,
        parts: int,
        replicas: int,
        group: dist.ProcessGroup | None,
    ) -> PartCounts:
        """Totals over the replicas in one all-reduce (none for one replica); a kind of count is kept only where
        every replica found it, so all replicas divide alike."""
        found = [sum(model or []), model is not None, sum(called or []), called is not None]
        vector = torch.tensor(found, dtype=torch.float64)
        totals = summed(vector, group).tolist() if replicas > 1 else vector.tolist()
        return cls(
            parts, replicas, model if totals[1] == replicas else None, called if totals[3] == replicas else None,
            totals[0], totals[2],
        )  # fmt: skip

    def _per_part(self, total: float) -> float:
        return total / (self.parts * self.replicas)

    def divisor(self) -> float | None:
        """What each part's sum over valid targets is divided by: the whole batch's count per part."""
        return self._per_part(self.called_total) if self.called is not None else None

    def model_scale(self, part: int) -> float | None:
        """The factor turning the model's mean over this part's labels into its sum over the count per part."""
        if self.model is None:
            return None
        mean = self._per_part(self.model_total)
        return self.model[part] / mean if mean > 0 else 0.0


class TokenShares:
    """The micro-batch shares of one replica, step by step, on the rank that computes the loss (the last stage).

    Args:
        replicas: data-parallel replicas, each running the step's schedule on its own rows.
        group: the process group over those replicas' last stages, which totals the counts.
    """

    def __init__(self, *, replicas: int, group: dist.ProcessGroup | None) -> None:
        self.replicas, self.group = replicas, group
        self.begin(None)

    def begin(self, labels: tuple[str, torch.Tensor | None] | None) -> None:
        """A new step; `labels`: a model's own loss from `labels` and its valid labels per row
        (`token_mean.model_label_counts`)."""
        self.labels = labels
        self.counts: PartCounts | None = None
        self._modes: list[TokenMean] = []
        self._checks: list[tuple[torch.Tensor, float]] = []  # (count at the loss, count found before) per part
        self._rescaled = False

    def count(self, parts: int, size: int, called: Callable[[int], float | None]) -> None:
        """At the step's first loss: every micro-batch's counts (`called(part)`: of the step's mean over valid
        targets, None if it makes none), totalled over the replicas. Nothing to share out for one part in all."""
        if parts * self.replicas == 1:
            return
        model = None
        if self.labels is not None and self.labels[1] is not None:
            per_row = self.labels[1]
            model = [float(per_row[m * size : (m + 1) * size].sum()) for m in range(parts)]
        found = [called(part) for part in range(parts)]
        complete = None if any(count is None for count in found) else [float(count or 0) for count in found]
        self.counts = PartCounts.totalled(model, complete, parts=parts, replicas=self.replicas, group=self.group)

    def output(self, rebuilt: Any, part: int) -> Any:
        """The network's output for the user's step; a model's own mean over this micro-batch's labels becomes its
        sum over the whole batch's count per micro-batch (a micro-batch without labels: zero, not 0/0)."""
        scale = self.counts.model_scale(part) if self.counts is not None else None
        if scale is None or not isinstance(rebuilt, MutableMapping) or rebuilt.get("loss") is None:
            return rebuilt
        others = [value for key, value in rebuilt.items() if key != "loss"]
        rebuilt["loss"] = rebuilt["loss"] * scale if scale > 0 else placeholder_loss(others)
        self._rescaled = True
        return rebuilt

    def mode(self, part: int) -> AbstractContextManager[Any]:
        """Where the user's step computes this micro-batch's loss: its mean over valid targets divided as shared."""
        if self.counts is None:
            return nullcontext()
        divisor = self.counts.divisor()
        expected = self.counts.called[part] if self.counts.called is not None else 0.0

        def checked(count: torch.Tensor) -> float:
            self._checks.append((count, expected))
            return divisor  # type: ignore[return-value]  # only installed with a divisor

        mode = TokenMean(checked if divisor is not None else None)
        self._modes.append(mode)
        return mode

    def verdict(self, where: str) -> str | None:
        """After the schedule: the warning line when this step's loss is not one device's, else None."""
        if self.counts is None:
            return None
        problems = [mode.inexact(model_loss=self._rescaled) for mode in self._modes]
        if self.labels is not None and not self._rescaled:
            problems.append(f"{self.labels[0]} from labels")
        if any(float(seen) != expected for seen, expected in self._checks):
            problems.append(f"{self._modes[0].normalised}, whose targets depend on the network's output")
        loss = next((problem for problem in problems if problem is not None), None)
        if loss is None:
            return None
        averaged = f"the mean of {self.counts.parts} micro-batches' losses"
        if self.replicas > 1:
            averaged += f", then of {self.replicas} replicas'"
        return inexact_warning(where, loss, averaged=averaged)


def whole_batch_model_loss(output: Any, merged: list[torch.Tensor], per_row: torch.Tensor) -> bool:
    """Evaluation: set `output["loss"]` (a model's own mean over its labels, which a forward-only schedule computes per
    micro-batch and merges as `merged[i]`, shape (micro-batches,)) to one device's mean over the whole batch's valid
    labels, `per_row` of them per row, each micro-batch weighted by its count (rows split as torch's schedules split
    them, `tensor_split`). Returns False when the output has no such loss to weight."""
    if not isinstance(output, MutableMapping) or output.get("loss") is None:
        return False
    paths = [path for path, _ in pytree.tree_flatten_with_path(output)[0]]
    key: tuple[Any, ...] = (pytree.MappingKey("loss"),)
    if key not in paths or len(paths) != len(merged) or merged[paths.index(key)].dim() != 1:
        return False
    per_micro = merged[paths.index(key)].float()  # (micro-batches,)
    counts = torch.stack([part.sum() for part in torch.tensor_split(per_row, per_micro.numel())])
    counts = counts.to(per_micro)
    if float(counts.sum()) > 0:  # a micro-batch without labels has a mean of 0/0: it weighs nothing
        output["loss"] = torch.where(counts > 0, per_micro * counts, 0).sum() / counts.sum()
    return True


def unweighted_eval_loss(named: str) -> str:
    """The one line for a model's own loss in evaluation whose count of items is not known (`model_label_counts`)."""
    return (
        f"{named} from labels (out.loss) in evaluation is the mean of the micro-batches' own means (its count of "
        "items is not known here): one device's only when each micro-batch holds as many valid labels. HINT: compute "
        "the loss in validation_step from out.logits with F.cross_entropy(..., ignore_index=-100), on the whole batch"
    )
