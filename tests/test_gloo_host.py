"""The gloo_host backend's ops on two ranks in one process (a thread each, over one in-memory store), CPU tensors staged
as CUDA ones are: point to point in both orders, the coalesced all-gather and reduce-scatter under torch 2.11's and
2.13's names, in-place collectives; results land in the caller's tensors at the wait, not before. And FSDP2 replicas
under the tensor strategy (dp2 x tp2) on four threads, each with a world of its own, against one process, and their
checkpoint view of a conv_colwise weight staged for a background write."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions
from torch.distributed.tensor import DTensor

from lightning_parallel import TensorParallelStrategy, gloo_host
from lightning_parallel.process_group_seams import inner_method
from lightning_parallel.seams import SeamChanged


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[gloo_host.HostStagedGroup]]:
    """Two ranks' groups over one store, CPU tensors staged (and no gloo past the staging)."""
    monkeypatch.setattr(gloo_host, "STAGE_CPU_TENSORS", True)
    store = dist.HashStore()
    yield on_ranks(lambda rank: gloo_host.HostStagedGroup(store, rank, 2, timedelta(seconds=30)))


def on_ranks(step: Callable[[int], Any], size: int = 2) -> list[Any]:
    """`step(rank)` for ranks 0 .. size - 1 at once, each in its thread; their results, or the first error raised."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = step(rank)
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def on_threaded_ranks(step: Callable[[int], Any], size: int) -> list[Any]:
    """`on_ranks` with each thread a rank of torch's thread-local world (a default group of its own, group names
    resolved per thread) over gloo_host staging CPU tensors as CUDA ones."""
    from torch.testing._internal.distributed import multi_threaded_pg
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gloo_host, "STAGE_CPU_TENSORS", True)
        _install_threaded_pg()
        if not hasattr(multi_threaded_pg.ThreadLocalWorld, "comms"):  # torch 2.11's lacks the list its
            patch.setattr(multi_threaded_pg.ThreadLocalWorld, "comms", [], raising=False)  # destroy clears
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        try:
            return on_ranks(step, size=size)
        finally:
            torch._C._distributed_c10d._set_thread_isolation_mode(False)
            _uninstall_threaded_pg()


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

    assert on_ranks(both_send_first) == [[0.0] * 3 + [2.0] * 3, [0.0] * 3 + [1.0] * 3]

    def receive_first_on_rank_0(rank: int) -> list[float]:
        group, out = groups[rank], torch.zeros(2)
        if rank == 0:
            group.recv([out], 1, 5).wait()
            group.send([out * 10], 1, 6).wait()
        else:
            group.send([torch.tensor([4.0, 5.0])], 0, 5).wait()
            group.recv([out], 0, 6).wait()
        return out.tolist()

    assert on_ranks(receive_first_on_rank_0) == [[4.0, 5.0], [40.0, 50.0]]


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

    rank0, rank1 = on_ranks(step)
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

    rank0, rank1 = on_ranks(step)
    assert rank0[:3] == rank1[:3] == [[3.0, 3.0], [7.0, 7.0], [0.5, 1.5]]
    assert rank0[4] == rank1[4] == [3.0, 2]
    assert (rank0[3], rank1[3]) == ([0.0, 2.0], [1.0, 3.0])


def test_an_op_torch_no_longer_has_is_named_in_one_line() -> None:
    with pytest.raises(SeamChanged, match=r"changed ProcessGroup\.all_gather_single, .* HINT: "):
        inner_method(object(), "all_gather_single")  # type: ignore[arg-type]


def test_fsdp2_replicas_under_the_tensor_strategy_go_through_it() -> None:
    """dp2 x tp2 of the zoo GPT set up by the tensor strategy's order (FSDP2 over "dp" around tp shards) on four
    threads, each a rank with a process group of its own (torch's thread-local world) over gloo_host staging CPU
    tensors as CUDA ones: FSDP2's all-gathers and reduce-scatters, DTensor's collectives, and two AdamW steps equal one
    process's (losses as each replica's mean of its half batch, every parameter within 1e-5)."""
    from simulated import next_token_loss, settings

    from lightning_parallel.dims import ParallelDims
    from lightning_parallel.models.transformer import GPT
    from lightning_parallel.parallelize import parallelize_tensor

    def gpt() -> torch.nn.Module:
        return GPT(vocab_size=32, context_length=8, depth=2, width=32, heads=4, dropout=0.0)

    generator = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 32, (4, 8), generator=generator) for _ in range(2)]  # (rows, tokens), no padding

    def train(network: torch.nn.Module, rows: slice) -> tuple[list[float], dict[str, torch.Tensor]]:
        optimizer, losses = torch.optim.AdamW(network.parameters(), lr=1e-3, eps=1e-6), []
        for ids in data:
            loss = next_token_loss(network(ids[rows]), ids[rows])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        whole = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in network.named_parameters()}
        return losses, {name: value.detach() for name, value in whole.items()}

    torch.manual_seed(0)
    expected_losses, expected = train(gpt(), slice(None))
    dims, store, building = ParallelDims(dp=2, pp=1, tp=2), dist.HashStore(), threading.Lock()
    ops: list[tuple[str, int]] = []
    run = gloo_host.HostStagedGroup._run

    def counted(group: gloo_host.HostStagedGroup, name: str, roles: str, *args: Any) -> dist.Work:
        ops.append((name, group.size()))
        return run(group, name, roles, *args)

    def rank(rank: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        dist.init_process_group("gloo_host", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=60))
        try:
            mesh = dims.build_mesh("cpu")
            with building:  # one seed for all the threads: one builds at a time
                torch.manual_seed(0)
                network = gpt()
            parallelize_tensor(network, network, settings(dims, mesh), configured=False)
            replica = dims.coords(rank)[0]
            return train(network, slice(2 * replica, 2 * replica + 2))
        finally:
            dist.destroy_process_group()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gloo_host.HostStagedGroup, "_run", counted)
        results = on_threaded_ranks(rank, size=4)
    assert {("all_gather_single", 2), ("reduce_scatter_single", 2)} <= set(ops), sorted(set(ops))  # FSDP2's, on "dp"
    for rank, (losses, state) in enumerate(results):
        other = results[(rank + 2) % 4][0]  # the other replica's rank at the same tensor rank
        means = [(a + b) / 2 for a, b in zip(losses, other, strict=True)]
        torch.testing.assert_close(torch.tensor(means), torch.tensor(expected_losses), rtol=0, atol=1e-5)
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=f"{name} on rank {rank}")


def test_fsdp2_replicas_over_conv_colwise_stage_for_a_background_checkpoint() -> None:
    """dp2 x tp2 of a 256-channel conv_colwise (ResNet-18's layer3/4 conv1) under FSDP2 replicas: its checkpoint view
    (`savable`, the interleaved shard as a contiguous one) is copied to CPU memory as a background write stages it,
    on every rank. DTensor's redistribution handed tensor rank 1 a view into its gathered buffer, which torch's
    staging failed on ('copy_() on an invalid python storage'); the copy equals the view, which equals the weight."""
    from simulated import settings
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from lightning_parallel.background_write import BackgroundWrite
    from lightning_parallel.dims import ParallelDims
    from lightning_parallel.parallelize import parallelize_tensor
    from lightning_parallel.tensor.packed import savable

    torch.manual_seed(0)
    whole = torch.randn(256, 256, 3, 3)
    dims, store = ParallelDims(dp=2, pp=1, tp=2), dist.HashStore()

    def save(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dist.init_process_group("gloo_host", store=store, rank=rank, world_size=4, timeout=timedelta(seconds=60))
        try:
            network = torch.nn.Sequential(torch.nn.Conv2d(256, 256, 3, bias=False))
            with torch.no_grad():
                network[0].weight.copy_(whole)
            options = settings(dims, dims.build_mesh("cpu"))
            options.plan = {"0": "conv_colwise"}
            parallelize_tensor(network, network, options, configured=False)
            view = savable(get_model_state_dict(network))["0.weight"]
            staged = BackgroundWrite().stage({"0.weight": view})["0.weight"]
            return staged.to_local(), view.to_local(), view.full_tensor()
        finally:
            dist.destroy_process_group()

    for rank, (staged, view, gathered) in enumerate(on_threaded_ranks(save, size=4)):
        assert staged.device.type == "cpu" and torch.equal(staged, view), rank
        assert torch.equal(view, whole[64 * rank : 64 * rank + 64]), rank  # (Shard(0), Shard(0)): ranks in order
        assert torch.equal(gathered, whole), rank
