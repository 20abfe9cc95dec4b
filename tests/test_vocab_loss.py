"""Vocabulary-parallel cross-entropy in one process: torch's LocalTensorMode simulates the tensor-parallel ranks with
real numbers (collectives included), so the loss and the logits' gradient are compared with one device's, for the ways
users write the loss (`F.cross_entropy` on flattened logits, `nn.CrossEntropyLoss` on (B, V, T), ignore_index
padding, every reduction), on even and uneven vocabulary shards; what the loss cannot take, and what is not a loss,
sees the logits gathered, with one device's numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from conftest import fake_world  # noqa: E402

local_tensor = pytest.importorskip("torch.distributed._local_tensor")

B, T, V, IGNORED = 3, 5, 10, -100


@contextmanager
def simulated(ranks: int) -> Iterator[Any]:
    """`ranks` tensor-parallel ranks in this process; yields their 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(ranks), local_tensor.LocalTensorMode(ranks):
        yield init_device_mesh("cpu", (ranks,))


def per_rank(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Each simulated rank's value of a plain (replicated) tensor."""
    held = getattr(tensor, "_local_tensors", None)
    return [t.detach().clone() for t in held.values()] if held is not None else [tensor.detach().clone()]


def example() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=generator) * 3
    labels = torch.randint(0, V, (B, T), generator=generator)
    labels[0, -2:] = IGNORED  # padding
    labels[2, 0] = IGNORED
    return logits, labels


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


def test_traced_stages_compute_the_loss_on_the_logits_shards() -> None:
    """A traced last stage (transformers' loss from padded labels) runs `aten.linear` and `aten.cross_entropy_loss`
    on DTensors: the head takes its input whole even when it arrives as partial sums (as from a traced Llama's last
    norm; DTensor left alone gathered the head's weight and returned partial sums, whole-sized logits on every rank),
    and in a session the loss runs on the vocabulary shards, counted, with one device's loss and gradients."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lightning_parallel.tensor.sharded_logits import ShardedLogits
    from lightning_parallel.tensor.traced_linear import head_linear
    from lightning_parallel.tensor.traced_stages import _cross_entropy, distribute_planned

    torch.manual_seed(0)
    hidden, whole = torch.randn(B * T, 4), nn.Linear(4, V, bias=False)
    labels = example()[1].flatten()
    with simulated(2) as mesh:
        head = nn.Linear(4, V, bias=False)
        head.weight.data.copy_(whole.weight.data)
        distribute_planned(head, "vocab_head", mesh)
        x = DTensor.from_local(hidden, mesh, [Partial()], run_check=False)  # partial sums
        value = per_rank(x.full_tensor())[0]  # what they sum to
        expected = F.cross_entropy(whole(value), labels)
        expected.backward()
        logits = head_linear(x, head.weight)
        target = distribute_tensor(labels, mesh, [Replicate()])
        with ShardedLogits() as session:
            loss = _cross_entropy(logits, target)
        loss.backward()
        assert logits.placements == (Shard(1),) and session.counts.parallel == 1, (logits.placements, session.counts)
        assert all(float((value - expected).abs()) < 1e-6 for value in per_rank(loss.to_local()))
        grad = head.weight.grad.full_tensor()
        assert all(float((value - whole.weight.grad).abs().max()) < 1e-6 for value in per_rank(grad))


def test_a_traced_last_stage_hands_its_logits_on_split_by_vocabulary() -> None:
    """A traced Llama at pp2 x tp2 (its own plan, labels padded with -100, the loss from them inside the last stage):
    in a session the last stage returns its logits split by vocabulary, never gathered (each rank V / 2 columns), and
    `StageLogits` passes their local shard through `PipelineStage` and back; the loss, the logits and the head's and
    the embedding's gradients (its own rows only) are one device's; another pipeline rank rebuilds the whole batch's
    shard (evaluation) with its rows. Outside a session they leave whole."""
    pytest.importorskip("transformers")
    from hf_modules import VOCAB, one_layer_llama, padded
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.pipeline.call import network_call
    from lightning_parallel.pipeline.traced import TracedNetwork
    from lightning_parallel.tensor.hf_plans import transformers_plan
    from lightning_parallel.tensor.plans import matches
    from lightning_parallel.tensor.sharded_logits import (
        Counts,
        ShardedLogits,
        StageLogits,
        gather_logits,
        is_sharded_logits,
        sharded_again,
    )
    from lightning_parallel.tensor.traced_stages import distribute_planned, stages_on_mesh

    torch.manual_seed(0)
    one = one_layer_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    call, inputs = network_call(one, (), {"input_ids": ids, "labels": padded(ids)})
    expected = one(input_ids=ids, labels=padded(ids), use_cache=False)
    expected.loss.backward()
    traced, plan = TracedNetwork(one, inputs, call), transformers_plan(one) or {}
    split = [traced.blocks[:3], traced.blocks[3:]]  # the norm and lm_head on stage 1
    traced.stage_modules(split, [0, 1], inputs, one)  # traced out here: torch.export does not run in the simulation
    with simulated(2) as mesh:
        network = one_layer_llama()
        network.load_state_dict(one.state_dict())
        for name, module in network.named_modules():
            for style in [style for pattern, style in plan.items() if name and matches(pattern, name)][:1]:
                distribute_planned(module, style, mesh)
        stages, _ = stages_on_mesh(traced.stage_modules(split, [0, 1], inputs, network), None, mesh, ["lm_head"])
        logits = StageLogits()
        logits.watch(stages)
        with ShardedLogits() as session:
            sent = stages[1](*stages[0](*inputs))  # what PipelineStage gets: plain tensors
            assert not isinstance(sent[1], DTensor) and sent[1].shape == (2, 8, VOCAB // 2), sent[1].shape
            loss, handed = logits.restore(sent)
            assert is_sharded_logits(handed) and handed.placements == (Shard(2),), handed
            # evaluation: the whole batch's shard (two micro-batches' rows) rebuilt as another pipeline rank does
            layout = logits.layout()
            assert layout == {1: ((Shard(2),), VOCAB)}, layout
            again = sharded_again([sent[0], torch.cat([sent[1], sent[1]])], layout, mesh)
            assert again[0] is sent[0] and is_sharded_logits(again[1]) and again[1].shape == (4, 8, VOCAB)
            whole = gather_logits({"logits": again[1]})["logits"]  # as a predict_step returns them
            assert not isinstance(whole, DTensor) and whole.shape == (4, 8, VOCAB), whole.shape
            twice = torch.cat([expected.logits, expected.logits]).detach()
            assert all(float((value - twice).abs().max()) < 1e-5 for value in per_rank(whole.detach()))
            loss.sum().backward()
        assert session.counts == Counts(parallel=1, gathered=0), session.counts
        gathered = handed.full_tensor().detach()  # only here, to compare
        assert all(float((value - expected.loss.detach()).abs().max()) < 1e-6 for value in per_rank(loss))
        assert all(float((value - expected.logits.detach()).abs().max()) < 1e-5 for value in per_rank(gathered))
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            grad = network.get_parameter(name).grad
            assert isinstance(grad, DTensor) and grad.to_local().shape == (VOCAB // 2, 16), (name, grad)
            gap = (grad.full_tensor() - one.get_parameter(name).grad).abs().max()
            assert all(float(value) < 1e-6 for value in per_rank(gap)), name
        with torch.no_grad():
            evaluated = stages[1](*stages[0](*inputs))[1]
        assert not isinstance(evaluated, DTensor) and evaluated.shape == (2, 8, VOCAB), evaluated.shape


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
