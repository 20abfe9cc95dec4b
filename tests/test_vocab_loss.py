"""Vocabulary-parallel cross-entropy in one process: torch's LocalTensorMode simulates the tensor-parallel ranks with
real numbers (collectives included), so the loss and the logits' gradient are compared with one device's, for the ways
users write the loss (`F.cross_entropy` on flattened logits, `nn.CrossEntropyLoss` on (B, V, T), ignore_index
padding, every reduction), on even and uneven vocabulary shards; what the loss cannot take, and what is not a loss,
sees the logits gathered, with one device's numbers. Traced stages' loss on the shards: test_traced_vocab_loss.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from vocab_shards import IGNORED, B, T, V, example, per_rank, simulated

pytest.importorskip("torch.distributed._local_tensor")


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "flat mean": lambda logits, labels: F.cross_entropy(logits.view(-1, V), labels.view(-1)),
    "criterion (B, V, T)": lambda logits, labels: nn.CrossEntropyLoss()(logits.transpose(1, 2), labels),
    "shifted sum": lambda logits, labels: F.cross_entropy(
        logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), reduction="sum", ignore_index=IGNORED
    ),
    "none, then a masked mean": lambda logits, labels: F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), reduction="none"
    )[:7].mean(),
    "one token, unbatched": lambda logits, labels: F.cross_entropy(logits[1, 2], labels[1, 2]),
}
# not a vocabulary-parallel loss: computed on the gathered logits
GATHERED: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "label smoothing": lambda logits, labels: F.cross_entropy(logits.view(-1, V), labels.view(-1), label_smoothing=0.1),
    "loss plus accuracy": lambda logits, labels: (
        F.cross_entropy(logits.view(-1, V), labels.view(-1)) + (logits.argmax(-1) == labels).float().mean()
    ),
    "log_softmax by hand": lambda logits, labels: -logits.log_softmax(-1)[..., 0].mean(),
}


def run_sharded(
    ranks: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, backward: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """(loss per rank, the logits' gradient per rank, the session's counts) with the logits sharded over `ranks`.
    `backward=False` for uneven shards: LocalTensorMode's backward through them raises NYI (torch 2.13)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_parallel.tensor.sharded_logits import ShardedLogits, _mark

    logits, labels = example()
    with simulated(ranks) as mesh:
        sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        with ShardedLogits() as session:
            loss = loss_fn(_mark(sharded.view_as(sharded)), labels)
        assert not hasattr(loss, "device_mesh"), "the loss must come back a plain tensor"
        if not backward:
            return per_rank(loss), [], session.counts
        loss.backward()
        assert sharded.grad is not None
        grad = sharded.grad.redistribute(placements=[Replicate()]).to_local()
        return per_rank(loss), per_rank(grad), session.counts


def one_device(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits, labels = example()
    logits.requires_grad_()
    loss = loss_fn(logits, labels)
    loss.backward()
    assert logits.grad is not None
    return loss.detach(), logits.grad


@pytest.mark.parametrize("ranks", [2, 3])  # 3: shards of 4, 4 and 2 columns
def test_the_loss_on_vocabulary_shards_is_one_devices(ranks: int) -> None:
    for name, loss_fn in LOSSES.items():
        losses, grads, counts = run_sharded(ranks, loss_fn, backward=V % ranks == 0)
        loss, grad = one_device(loss_fn)
        assert counts.parallel == 1 and counts.gathered == 0, (name, counts)
        assert len(losses) == ranks and all(float((value - loss).abs().max()) < 1e-6 for value in losses), name
        assert all(float((value - grad).abs().max()) < 1e-6 for value in grads), name


def test_what_is_not_a_plain_cross_entropy_sees_the_logits_gathered() -> None:
    for name, loss_fn in GATHERED.items():
        losses, grads, counts = run_sharded(2, loss_fn)
        loss, grad = one_device(loss_fn)
        assert counts.gathered >= 1, (name, counts)
        for rank_loss, rank_grad in zip(losses, grads, strict=True):
            assert float((rank_loss - loss).abs().max()) < 1e-6, name
            assert float((rank_grad - grad).abs().max()) < 1e-6, name


def test_the_head_leaves_its_logits_sharded_only_inside_a_session() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_parallel.tensor.sharded_logits import ShardedLogits, VocabHead, gather_logits, is_sharded_logits

    torch.manual_seed(0)
    whole = nn.Linear(4, V, bias=False)
    x = torch.randn(B, T, 4)
    with simulated(2) as mesh:
        head = nn.Linear(4, V, bias=False)
        head.weight.data.copy_(whole.weight.data)
        parallelize_module(head, mesh, VocabHead(), src_data_rank=None)
        outside = head(x)
        with ShardedLogits():
            inside = head(x)
            shape = (inside.shape, inside.size(-1), inside.dtype)
        assert not isinstance(outside, DTensor) and is_sharded_logits(inside)
        assert shape == ((B, T, V), V, torch.float32)
        for gathered in (*per_rank(outside), *per_rank(gather_logits({"logits": inside})["logits"])):
            assert float((gathered - whole(x).detach()).abs().max()) < 1e-6


def test_the_planner_splits_the_logits_by_tensor_parallel_size() -> None:
    """The zoo GPT's head is `vocab_head`: per rank the planner keeps its logits (and the loss's copy of them) split
    by tp, under every activation checkpointing mode. Llama-3's 128,256-token vocabulary, one sequence of 8,192."""
    from lightning_parallel.planner.checkpointing import kept_and_rematerialised
    from lightning_parallel.planner.workload import gpt_workload

    t, w, v = 8192, 4096, 128_256
    head = gpt_workload(depth=1, width=w, heads=32, vocab_size=v, seq_len=t).blocks[-1]
    for tp in (1, 2, 8):
        assert kept_and_rematerialised(head, tp, "none", 0.0)[0] == 2 * t * w + 2 * t + t * v / tp
        assert kept_and_rematerialised(head, tp, "full", 0.0)[0] == t * v / tp
    assert t * v * 4 / 8 == 525_336_576  # fp32 logits of one sequence per rank at tp 8 (4.2 GB whole)


def test_a_backward_hook_on_the_logits_fires_on_the_loss_path() -> None:
    """FSDP2 registers the hook that gathers a module's parameters again for its backward on the module's output: on
    the head's sharded logits it must land on them, not on a gathered copy off the loss's path (which never fired:
    the head's backward then read freed storage, "setStorage ... storage of size 0", at dp2 x tp2)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_parallel.tensor.sharded_logits import ShardedLogits, _mark

    logits, labels = example()
    fired: list[tuple[int, ...]] = []
    with simulated(2) as mesh:
        sharded = _mark(distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_().view_as(logits))
        with ShardedLogits() as session:
            sharded.register_hook(lambda grad: fired.append(tuple(grad.shape)))
            F.cross_entropy(sharded.flatten(0, 1), labels.flatten()).backward()
    assert fired == [(B, T, V)] and session.counts.gathered == 0, (fired, session.counts)


def test_bf16_logits_under_autocast_give_one_devices_fp32_loss_and_bf16_gradient() -> None:
    """precision="bf16-mixed" runs the step under autocast, whose cross-entropy computes and returns fp32 from bf16
    logits: the loss on the shards does too (it returned bf16 before: 0.02 off at a loss of ~5, one bf16 step). Stated
    tolerance: the loss within 1e-6 relative (summation order over tokens), the bf16 gradient within one bf16 step
    of its largest value (measured: equal)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_parallel.tensor.sharded_logits import ShardedLogits, _mark

    logits, labels = example()
    logits = logits.bfloat16()
    for name, loss_fn in LOSSES.items():
        one = logits.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = loss_fn(one, labels)
        expected.backward()
        with simulated(2) as mesh:
            sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16), ShardedLogits() as session:
                loss = loss_fn(_mark(sharded.view_as(sharded)), labels)
            loss.backward()
            grads = per_rank(sharded.grad.redistribute(placements=[Replicate()]).to_local())
        assert session.counts.parallel == 1 and loss.dtype == expected.dtype == torch.float32, (name, loss.dtype)
        assert all(float((value - expected).abs()) <= 1e-6 * float(expected.abs()) for value in per_rank(loss)), name
        step = float(one.grad.abs().max()) * 2**-8
        assert all(g.dtype == torch.bfloat16 and float((g - one.grad).abs().max()) <= step for g in grads), name


def test_the_loss_holds_its_logits_and_one_copy_at_once() -> None:
    """The loss on a rank's (M, V / tp) shard holds the logits and one copy of that size at once in its forward (the
    exponentials, made in place on the shifted logits) and two in its backward (the saved exponentials and the
    gradient, scaled in place); a copy more in each before (the shifted logits beside their exponentials, the
    softmax beside the gradient): 501 MiB a copy at Llama-3-8B tp2, 2,048 tokens. Bytes by `LiveBytes`, on one rank
    of the fake process group."""
    import torch.distributed as dist

    from lightning_parallel.dryrun.live_bytes import LiveBytes
    from lightning_parallel.one_process_ranks import fake_rank
    from lightning_parallel.tensor.vocab_loss import _VocabParallelCrossEntropy

    rows, columns = 64, 1024  # a copy: 256 KiB; the other tensors: a few numbers a row
    logits = torch.randn(rows, columns).requires_grad_()
    target = torch.randint(0, 2 * columns, (rows,))
    copy, small = logits.nbytes, 16 * rows * 8  # a dozen numbers a row at most
    with fake_rank(0, 2), LiveBytes([logits, target]) as live:
        loss = _VocabParallelCrossEntropy.apply(logits, target, 0, IGNORED, dist.group.WORLD).sum()
        forward = live.peak
        loss.backward()
    assert 2 * copy <= forward < 2 * copy + small, (forward, copy)  # the logits and the exponentials
    assert 3 * copy <= live.peak < 3 * copy + small, (live.peak, copy)  # and the gradient
