"""One device's mean over valid tokens from a batch split into parts (`token_mean.py`, `pipeline/token_shares.py`), in
one process: each part's rewritten loss, averaged over the parts, is the whole batch's mean with its gradient; a
transformers model's own loss rescaled equals what its `num_items_in_batch` gives; other losses are named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.pipeline.token_shares import PartCounts, TokenShares
from lightning_parallel.token_mean import Counted, TokenMean, inexact_warning, model_label_counts

TOL = 1e-6
CLASSES = 5


def batch(rows: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (rows, CLASSES, 3) and targets (rows, 3), about a third of them ignored (-100), unevenly by row."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, CLASSES, 3, generator=generator, requires_grad=True)
    target = torch.randint(0, CLASSES, (rows, 3), generator=generator)
    target[torch.rand(rows, 3, generator=generator) < 0.35] = -100
    target[0] = -100  # a row without a valid target: a part may hold none
    return logits, target


def parts_mean(loss: object, logits: torch.Tensor, target: torch.Tensor, parts: int) -> torch.Tensor:
    """The mean over `parts` equal row slices of `loss(slice)` under `TokenMean`, each divided by the batch's count
    per part: what a schedule or replicas average."""
    total = float((target != -100).sum()) if not target.is_floating_point() else None
    size = len(logits) // parts
    losses = []
    for part in range(parts):
        rows = slice(part * size, (part + 1) * size)
        divisor = (lambda count: total / parts) if total is not None else (lambda count: count * 1.0)
        with TokenMean(divisor) as mode:
            losses.append(loss(logits[rows], target[rows]))  # type: ignore[operator]
        assert mode.normalised is not None and mode.inexact() is None
    return torch.stack(losses).mean()


@pytest.mark.parametrize(
    "loss",
    [
        lambda x, y: F.cross_entropy(x, y),
        lambda x, y: F.cross_entropy(x, y, ignore_index=-100, label_smoothing=0.1),
        lambda x, y: nn.CrossEntropyLoss()(x, y),
        lambda x, y: F.nll_loss(F.log_softmax(x, 1), y),
    ],
    ids=["cross_entropy", "label_smoothing", "CrossEntropyLoss", "nll_loss"],
)
def test_parts_averaged_give_the_whole_batch_mean_and_its_gradient(loss: object) -> None:
    logits, target = batch()
    whole = loss(logits, target)  # type: ignore[operator]
    (want,) = torch.autograd.grad(whole, logits)
    for parts in (2, 4, 8):
        split = parts_mean(loss, logits, target, parts)
        (got,) = torch.autograd.grad(split, logits)
        assert abs(float(split.detach() - whole.detach())) < TOL and float((got - want).abs().max()) < TOL, parts
    # without the rewriting, the mean of part means is not the batch mean: the case this exists for
    plain = torch.stack([loss(logits[r : r + 2], target[r : r + 2]) for r in range(2, 8, 2)])  # type: ignore[operator]
    assert abs(float(plain.mean() - loss(logits[2:], target[2:]))) > 1e-3  # type: ignore[operator]


def test_class_weights_count_each_target_by_its_weight() -> None:
    logits, target = batch()
    weight = torch.rand(CLASSES, generator=torch.Generator().manual_seed(1))
    whole = F.cross_entropy(logits, target, weight=weight)
    valid = target != -100
    total = float(torch.where(valid, weight[target.clamp(0)], 0).sum())
    losses = []
    for rows in (slice(0, 4), slice(4, 8)):
        with TokenMean(lambda count: total / 2):
            losses.append(F.cross_entropy(logits[rows], target[rows], weight=weight))
    assert abs(float(torch.stack(losses).mean() - whole)) < TOL


@pytest.mark.parametrize("ignore_index", [0, 3, 255, -1], ids=["pad0", "class3", "outside255", "minus1"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("loss", ["cross_entropy", "label_smoothing", "nll_loss"])
def test_any_ignore_index_and_class_weights_give_the_whole_batch_mean(
    ignore_index: int, weighted: bool, loss: str
) -> None:
    """The count is taken by the call's own `ignore_index` (a pad id inside the classes, one outside them, -1) and
    its class weights (the ignored class's weight included, which must not count): counted on the whole batch as a
    pipeline or replicas count it, then shared out over the parts."""
    logits, target = batch()
    target[target == -100] = ignore_index
    weight = torch.rand(CLASSES, generator=torch.Generator().manual_seed(1)) + 0.5 if weighted else None
    options = {"weight": weight, "ignore_index": ignore_index}

    def compute(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if loss == "nll_loss":
            return F.nll_loss(F.log_softmax(x, 1), y, **options)
        return F.cross_entropy(x, y, label_smoothing=0.1 if loss == "label_smoothing" else 0.0, **options)

    whole = compute(logits, target)
    (want,) = torch.autograd.grad(whole, logits)
    with pytest.raises(Counted) as counted, TokenMean(None, counting=True):
        compute(logits, target)
    total = float(counted.value.count)
    for parts in (2, 4, 8):
        size, losses, share = len(logits) // parts, [], total / parts
        for part in range(parts):
            rows = slice(part * size, (part + 1) * size)
            with TokenMean(lambda count, share=share: share):
                losses.append(compute(logits[rows], target[rows]))
        split = torch.stack(losses).mean()
        (got,) = torch.autograd.grad(split, logits)
        assert abs(float(split.detach() - whole.detach())) < TOL and float((got - want).abs().max()) < TOL, parts


def test_counting_stops_at_the_first_mean_and_reports_its_count() -> None:
    logits, target = batch()
    with pytest.raises(Counted) as counted, TokenMean(None, counting=True):
        F.cross_entropy(logits, target)
    assert float(counted.value.count) == float((target != -100).sum())
    with TokenMean(None) as mode:  # not counted before the step: left a mean, and named
        F.cross_entropy(logits, target)
    assert mode.inexact() == "cross_entropy, whose targets were not counted before the step"


def test_losses_that_cannot_be_made_exact_are_named() -> None:
    logits, target = batch()
    with TokenMean(lambda count: count) as mode:  # a hand-written masked mean
        per_token = F.cross_entropy(logits, target.clamp(min=0), reduction="none")
        (per_token * (target != -100)).sum() / (target != -100).sum()
    assert mode.inexact() == "cross_entropy(reduction='none')"
    with TokenMean(lambda count: count) as mode:
        (logits**2).mean()
    assert mode.inexact() == "computed without torch's loss functions"
    with TokenMean(lambda count: count) as mode:  # a mean over every element: equal parts, exact
        F.mse_loss(logits, torch.zeros_like(logits))
    assert mode.inexact() is None
    with TokenMean(lambda count: count) as mode:
        F.cross_entropy(logits, target) + F.cross_entropy(logits, target)
    assert mode.normalised == "cross_entropy" and mode.inexact() == "a second cross_entropy"
    line = inexact_warning("M.training_step", "cross_entropy(reduction='none')", averaged="the mean of 2 replicas'")
    assert "\n" not in line and "HINT" in line and "M.training_step's loss (cross_entropy(reduction='none'))" in line


def test_part_counts_share_the_batch_count_and_rescale_a_model_mean() -> None:
    counts = PartCounts.totalled([3.0, 0.0, 5.0, 4.0], [6.0, 2.0, 2.0, 2.0], parts=4, replicas=1, group=None)
    assert counts.divisor() == 3.0  # 12 valid targets over 4 parts
    assert counts.model_scale(0) == 1.0 and counts.model_scale(1) == 0.0 and counts.model_scale(2) == 5 / 3
    shares = TokenShares(replicas=1, group=None)
    shares.begin(("ForCausalLMLoss", torch.tensor([0.0, 0.0, 1.0, 5.0])))  # valid labels per row
    shares.count(2, 2, lambda part: None)  # the step makes no mean over valid targets: the model's loss is the one
    assert shares.counts is not None and shares.counts.called is None and shares.mode(0) is not None
    logits = torch.randn(2, 3, requires_grad=True)
    rescaled = shares.output({"loss": torch.tensor(2.0), "logits": logits}, 1)
    assert abs(float(rescaled["loss"]) - 2.0 * 6 / 3) < TOL  # 6 labels in the part, 3 per part
    # a part without labels: the model's mean is 0/0; its share is a zero still connected to the output
    empty = shares.output({"loss": torch.tensor(float("nan")), "logits": logits}, 0)
    empty["loss"].backward()
    assert float(empty["loss"]) == 0.0 and float(logits.grad.abs().sum()) == 0.0  # type: ignore[union-attr]
    assert shares.verdict("M.training_step") is None
    shares.begin(("ForQuestionAnsweringLoss", None))  # a model loss it cannot count: named
    shares.count(2, 2, lambda part: None)
    verdict = shares.verdict("M.training_step")
    assert verdict is not None and "(ForQuestionAnsweringLoss from labels)" in verdict


def test_a_causal_lm_loss_rescaled_equals_transformers_num_items_in_batch() -> None:
    """transformers' `ForCausalLMLoss` with `num_items_in_batch` is what one device's mean is split into: each part's
    model mean times its shifted valid labels over the count per part equals it (GPT-2's loss, labels -100 padded)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    network = transformers.GPT2LMHeadModel(config).eval()  # no dropout: two calls compute alike
    ids = torch.randint(0, 32, (4, 8))
    labels = ids.masked_fill(torch.arange(8) >= torch.tensor([[8], [2], [5], [1]]), -100)  # rows of 8, 2, 5, 1 tokens
    named, per_row = model_label_counts(network, {"input_ids": ids, "labels": labels})
    assert named == "ForCausalLMLoss" and per_row.tolist() == [7, 1, 4, 0]  # shifted: the first token predicts none
    total = torch.tensor(float(per_row.sum()))
    for rows in (slice(0, 2), slice(2, 4)):  # 8 and 4 of the 12 labels
        own = network(input_ids=ids[rows], labels=labels[rows]).loss  # a mean over the part's own labels
        want = network(input_ids=ids[rows], labels=labels[rows], num_items_in_batch=total).loss
        assert abs(float(own * per_row[rows].sum() / total - want)) < TOL
    assert model_label_counts(network, {"input_ids": ids}) is None  # no labels: the loss is the user's
    assert model_label_counts(nn.Linear(2, 2), {"labels": labels}) is None  # not a model computing its loss
