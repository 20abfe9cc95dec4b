"""One device's loss when a batch is split into parts (pipeline micro-batches, data-parallel replicas) that hold
different numbers of valid tokens (padding, labels of -100).

A mean over valid targets, `F.cross_entropy` / `F.nll_loss` with reduction 'mean' (so `nn.CrossEntropyLoss` too), is
computed per part as its sum over the batch's mean count per part, `divisor = count of the whole batch / parts`, and a
transformers model's loss from `labels` (a mean over the part's own valid labels) is rescaled to the same. Averaging
the parts' losses and gradients, as schedules and replicas do, then gives the whole batch's mean, as transformers'
`num_items_in_batch` does. Other losses are named for one warning line. Torch only: the strategies total the counts
(an all-reduce over "dp") and say into how many parts a batch was split.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

# Means over valid targets: what a part holds varies with padding and ignored labels.
MEAN_OF_VALID: dict[Callable[..., Any], str] = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}
# Means over every element (or every row): equal parts hold equal numbers, so the mean of their means is exact.
MEAN_OF_ALL: dict[Callable[..., Any], str] = {
    f: f.__name__
    for f in (
        F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits, F.kl_div, F.poisson_nll_loss, F.gaussian_nll_loss, F.soft_margin_loss,
        F.multilabel_soft_margin_loss, F.multilabel_margin_loss, F.multi_margin_loss, F.hinge_embedding_loss,
        F.cosine_embedding_loss, F.margin_ranking_loss, F.triplet_margin_loss, F.ctc_loss,
    )
}  # fmt: skip
_SIGNATURES = {f: inspect.signature(f) for f in (*MEAN_OF_VALID, *MEAN_OF_ALL)}
# Divides one part's sum: the whole batch's count of valid targets over the number of parts (given the part's count).
Divisor = Callable[[torch.Tensor], torch.Tensor | float]


class Counted(Exception):  # noqa: N818 - control flow, not an error
    """Raised by a counting `TokenMean` at the first mean over valid targets, with that call's count."""

    def __init__(self, count: torch.Tensor) -> None:
        super().__init__()
        self.count = count


def valid_count(
    input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """What `reduction='mean'` divides the sum by, as a float64 tensor: the targets that are not `ignore_index`, each
    counted by its class weight when there are weights; for class probabilities, every position (no ignoring)."""
    if target.is_floating_point():  # probabilities over the classes (dimension 1, or 0 unbatched)
        classes = input.shape[1] if input.dim() > 1 else input.shape[0]
        return torch.tensor(target.numel() // classes, dtype=torch.float64)
    valid = target != ignore_index
    if weight is None:
        count = valid.sum()
    else:  # ignored targets may lie outside the classes (ignore_index=255): clamp before indexing, then drop them
        count = torch.where(valid, weight[target.clamp(0, weight.numel() - 1)], 0).sum()
    count = count.full_tensor() if isinstance(count, DTensor) else count
    return count.detach().to(torch.float64)


class TokenMean(TorchFunctionMode):
    """While active, the step's first `F.cross_entropy` / `F.nll_loss` with reduction 'mean' returns its sum over
    valid targets divided by `divisor(count)`; with `counting=True` it raises `Counted(count)` instead, and with
    `divisor=None` it stays a mean. Every torch loss is noted: `inexact()` names what is not one device's.
    """

    def __init__(self, divisor: Divisor | None, *, counting: bool = False) -> None:
        super().__init__()
        self.divisor, self.counting = divisor, counting
        self.normalised: str | None = None  # the call rewritten, e.g. "cross_entropy"
        self.exact_means: list[str] = []  # means over equal-sized parts' elements
        self.others: list[str] = []  # losses left as they are whose average over parts is not one device's

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in MEAN_OF_VALID:
            return self._mean_of_valid(func, args, kwargs)
        if func in MEAN_OF_ALL:
            reduction = _SIGNATURES[func].bind(*args, **kwargs).arguments.get("reduction", "mean")
            named = MEAN_OF_ALL[func]
            if reduction in ("mean", "batchmean"):
                self.exact_means.append(named)
            else:
                self.others.append(f"{named}(reduction={reduction!r})")
        return func(*args, **kwargs)

    def _mean_of_valid(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        bound = _SIGNATURES[func].bind(*args, **kwargs)
        named, arguments = MEAN_OF_VALID[func], bound.arguments
        legacy = arguments.get("size_average") is not None or arguments.get("reduce") is not None
        if arguments.get("reduction", "mean") != "mean" or legacy:
            self.others.append(f"{named}(reduction={arguments.get('reduction', 'mean')!r})")
            return func(*args, **kwargs)
        if self.normalised is not None:  # one mean per step is made exact: the one the count was taken for
            self.others.append(f"a second {named}")
            return func(*args, **kwargs)
        count = valid_count(arguments["input"], arguments["target"], arguments.get("weight"), _ignored(bound))
        if self.counting:
            raise Counted(count)
        if self.divisor is None:
            self.others.append(f"{named}, whose targets were not counted before the step")
            return func(*args, **kwargs)
        self.normalised = named
        arguments["reduction"] = "sum"
        divisor = self.divisor(count)
        total = func(*bound.args, **bound.kwargs)
        if isinstance(divisor, torch.Tensor):  # a loss sharded over "tp" (loss parallel) is divided by a number
            divisor = float(divisor) if isinstance(total, DTensor) else divisor.to(total.dtype)
        return total / divisor

    def inexact(self, *, model_loss: bool = False) -> str | None:
        """The losses whose average over parts is not one device's, named for a warning; None when the step's loss
        is exact (a mean rewritten here, a model's `labels` loss rescaled, or means over equal-sized parts)."""
        if self.others:
            return ", ".join(self.others)
        if self.normalised is not None or model_loss or self.exact_means:
            return None
        return "computed without torch's loss functions"


def _ignored(bound: inspect.BoundArguments) -> int:
    return int(bound.arguments.get("ignore_index", -100))


def step_over_replicas(
    step: Callable[[], Any], *, group: dist.ProcessGroup | None, replicas: int, where: str, calls: Any = None
) -> tuple[Any, str | None]:
    """Run a training step whole on each of `replicas` data-parallel replicas (`group`), its mean over valid targets
    divided by the whole batch's count per replica (summed over `group` when the loss is computed: one all-reduce),
    so the replicas' averaged gradients are the whole batch's mean. Returns the step's result and the warning line
    when its loss is not one device's (`where`: e.g. "MyModule.training_step"). `calls`: the run's
    `replica_calls.ReplicaCalls`, which ends replicas that disagree on making that call in one line (None: none)."""

    def divisor(count: torch.Tensor) -> torch.Tensor:
        return (calls.total(count, where) if calls is not None else summed(count, group)) / replicas

    with TokenMean(divisor) as mode:
        result = step()
    if calls is not None:
        calls.after_step(where)
    loss = mode.inexact()
    averaged = f"the mean of {replicas} replicas' losses"
    return result, inexact_warning(where, loss, averaged=averaged) if loss is not None else None


def summed(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`tensor` summed over `group` (a new tensor, on the device the backend reduces on: nccl takes CUDA only)."""
    device = tensor.device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = tensor.to(device, copy=True)
    dist.all_reduce(total, group=group)
    return total


def model_label_counts(network: nn.Module, keywords: Mapping[str, torch.Tensor], ignore_index: int = -100) -> Any:
    """Per row of the batch, the labels a transformers model's own loss counts when it is called with `labels`: its
    `loss_function` shifts them for causal language models (`ForCausalLMLoss`, unless `shift_labels` is passed) and
    averages the ones that are not -100. Returns (the loss's name, counts (rows,) or None when its count is not
    known), or None when the network does not compute its loss from labels."""
    labels = keywords.get("labels")
    loss_function = getattr(network, "loss_function", None) if labels is not None else None
    if labels is None or not callable(loss_function):
        return None
    named = getattr(loss_function, "__name__", type(loss_function).__name__)
    rows = labels.shape[0]
    if named == "ForCausalLMLoss":
        shifted = keywords.get("shift_labels")
        valid = (shifted if shifted is not None else labels[..., 1:]) != ignore_index
    elif named in ("ForMaskedLMLoss", "ForTokenClassification", "ForSequenceClassificationLoss"):
        # a float label (regression, multi-label) is one item per row, like every other row's
        valid = labels != ignore_index if not labels.is_floating_point() else torch.ones(rows, dtype=torch.bool)
    else:
        return named, None
    return named, valid.reshape(rows, -1).sum(1).to(torch.float64)


def inexact_warning(where: str, loss: str, *, averaged: str) -> str:
    """The one line for a step whose loss cannot be made one device's (`where`: e.g. "MyModule.training_step")."""
    return (
        f"{where}'s loss ({loss}) is averaged as {averaged}, each a mean over its own items: that equals one device's "
        "loss only when every part holds as many valid items (no padding, no ignored labels). HINT: compute it with "
        "F.cross_entropy / nn.CrossEntropyLoss (ignore_index for padding, reduction='mean') or a transformers "
        "model's labels: those are averaged over the whole batch's valid tokens"
    )
