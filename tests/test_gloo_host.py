"""The gloo_host backend's ops on two ranks in one process (a thread each, over one in-memory store), CPU tensors staged
as CUDA ones are: point to point in both orders, the coalesced all-gather and reduce-scatter under torch 2.11's and
2.13's names, in-place collectives; results land in the caller's tensors at the wait, not before."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from lightning_parallel import TensorParallelStrategy, gloo_host
from lightning_parallel.process_group_seams import inner_method
from lightning_parallel.seams import SeamChanged


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[gloo_host.HostStagedGroup]]:
    """Two ranks' groups over one store, CPU tensors staged (and no gloo past the staging)."""
    monkeypatch.setattr(gloo_host, "STAGE_CPU_TENSORS", True)
    store = dist.HashStore()
    yield on_two_ranks(lambda rank: gloo_host.HostStagedGroup(store, rank, 2, timedelta(seconds=30)))


def on_two_ranks(step: Callable[[int], Any]) -> list[Any]:
    """`step(rank)` for ranks 0 and 1 at once, each in its thread; their results, or the first error raised."""
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = step(rank)
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def test_the_backend_is_registered_and_strategies_take_it() -> None:
    assert gloo_host.BACKEND in dist.Backend.backend_list
    TensorParallelStrategy(tensor_parallel_size=2, process_group_backend="gloo_host")  # no refusal


def test_point_to_point_in_both_orders_lands_at_the_wait(groups: list[gloo_host.HostStagedGroup]) -> None:
    def both_send_first(rank: int) -> list[float]:
        group, peer = groups[rank], 1 - rank
        received = torch.zeros(3, requires_grad=True)  # as a pipeline's receive buffer: a leaf that requires grad
        sent = group.send([torch.full((3,), rank + 1.0)], peer, 0)
        receiving = group.recv([received], peer, 0)
        sent.wait()
        before = received.detach().clone()
        receiving.wait()
        return [*before.tolist(), *received.tolist()]

    assert on_two_ranks(both_send_first) == [[0.0] * 3 + [2.0] * 3, [0.0] * 3 + [1.0] * 3]

    def receive_first_on_rank_0(rank: int) -> list[float]:
        group, out = groups[rank], torch.zeros(2)
        if rank == 0:
            group.recv([out], 1, 5).wait()
            group.send([out * 10], 1, 6).wait()
        else:
            group.send([torch.tensor([4.0, 5.0])], 0, 5).wait()
            group.recv([out], 0, 6).wait()
        return out.tolist()

    assert on_two_ranks(receive_first_on_rank_0) == [[4.0, 5.0], [40.0, 50.0]]


def test_coalesced_gathers_and_reduce_scatters_under_both_names(groups: list[gloo_host.HostStagedGroup]) -> None:
    def step(rank: int) -> dict[str, list[float]]:
        group, out = groups[rank], {}
        for name in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"):  # torch 2.13's, 2.11's
            gathered = [torch.zeros(4), torch.zeros(2, dtype=torch.int64)]  # two dtypes: one gather each
            getattr(group, name)(
                gathered, [torch.full((2,), rank + 1.0), torch.full((1,), -rank, dtype=torch.int64)], None
            ).wait()
            out[name] = [*gathered[0].tolist(), *gathered[1].tolist()]
        for name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
            scattered = [torch.zeros(1), torch.zeros(2)]
            inputs = [torch.tensor([1.0, 2.0]) * (rank + 1), torch.arange(4.0) + rank]
            getattr(group, name)(scattered, inputs, dist.ReduceScatterOptions()).wait()
            out[name] = torch.cat(scattered).tolist()
        single = torch.zeros(2)
        group._reduce_scatter_base(single, torch.arange(4.0), dist.ReduceScatterOptions()).wait()
        out["reduce_scatter_single"] = single.tolist()
        return out

    rank0, rank1 = on_two_ranks(step)
    for name in ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"):
        assert rank0[name] == rank1[name] == [1.0, 1.0, 2.0, 2.0, 0, -1]
    for name in ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"):
        assert (rank0[name], rank1[name]) == ([3.0, 1.0, 3.0], [6.0, 5.0, 7.0])
    assert (rank0["reduce_scatter_single"], rank1["reduce_scatter_single"]) == ([0.0, 2.0], [4.0, 6.0])


def test_in_place_collectives_and_gathers(groups: list[gloo_host.HostStagedGroup]) -> None:
    def step(rank: int) -> list[list[float]]:
        group = groups[rank]
        summed, sent = torch.full((2,), rank + 1.0), torch.full((2,), 7.0 * rank)
        future = group.allreduce([summed], dist.AllreduceOptions()).get_future()  # as DDP's communication hooks
        assert future.wait()[0] is summed
        pair = [torch.tensor([1.0 + rank]), torch.tensor([2 * rank])]  # two dtypes: one all-reduce each
        group.allreduce_coalesced(pair, dist.AllreduceCoalescedOptions()).wait()
        options = dist.BroadcastOptions()
        options.rootRank = 1
        group.broadcast([sent], options).wait()
        listed = [torch.zeros(1), torch.zeros(1)]
        group.allgather([listed], [torch.tensor([rank + 0.5])], AllgatherOptions()).wait()
        swapped = torch.zeros(2)
        group.all_to_all_single(swapped, torch.tensor([rank * 2.0, rank * 2.0 + 1]), [1, 1], [1, 1]).wait()
        group.barrier().wait()
        return [summed.tolist(), sent.tolist(), torch.cat(listed).tolist(), swapped.tolist(), [p.item() for p in pair]]

    rank0, rank1 = on_two_ranks(step)
    assert rank0[:3] == rank1[:3] == [[3.0, 3.0], [7.0, 7.0], [0.5, 1.5]]
    assert rank0[4] == rank1[4] == [3.0, 2]
    assert (rank0[3], rank1[3]) == ([0.0, 2.0], [1.0, 3.0])


def test_an_op_torch_no_longer_has_is_named_in_one_line() -> None:
    with pytest.raises(SeamChanged, match=r"changed ProcessGroup\.all_gather_single, .* HINT: "):
        inner_method(object(), "all_gather_single")  # type: ignore[arg-type]
