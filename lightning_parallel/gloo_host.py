"""The "gloo_host" process-group backend: gloo with every CUDA tensor staged through host memory, so ranks sharing one
GPU (NCCL refuses two ranks on a device; gloo cannot send CUDA tensors and crashes on their coalesced all-gather) run
tensor, pipeline and 3D parallelism with CUDA compute. Every op copies device -> host -> device: for checking, not
speed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from lightning_parallel.process_group_seams import answer_to_every_name, gloo_group, inner_method, serve_cpu_by

BACKEND = "gloo_host"
# Tests set this before the groups are made: CPU tensors are staged too (copied out, and back after the wait), and
# nothing reaches gloo past the staging (an op torch called past this group's methods fails), as with CUDA tensors.
STAGE_CPU_TENSORS = False


class StagedWork(dist.Work):
    """The inner gloo ops' works; waiting them copies the host buffers back into the caller's tensors (once)."""

    def __init__(self, works: list[dist.Work], copy_back: list[Callable[[], Any]], result: Any) -> None:
        super().__init__()
        self._works, self._copy_back, self._result, self._done = works, copy_back, result, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            for work in self._works:
                work.wait() if timeout is None else work.wait(timeout)
            with torch.no_grad():  # as the backend writing it would: a pipeline's receive buffers require grad
                for copy in self._copy_back:
                    copy()
            self._done = True
        return True

    def get_future(self) -> torch.futures.Future:
        """A future already done (gloo's host ops have no stream to hand a callback to): waits first."""
        self.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


class _Staging:
    """Host copies of one op's tensors: `give` for what the op reads, `take` for what it writes (copied back at the
    wait), `both` for in-place ops. A CPU tensor passes through as itself unless STAGE_CPU_TENSORS."""

    def __init__(self) -> None:
        self.copy_back: list[Callable[[], Any]] = []

    @staticmethod
    def _host(tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)

    def give(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not STAGE_CPU_TENSORS:
            return tensor
        with torch.no_grad():
            return self._host(tensor).copy_(tensor)  # synchronous: the device's values as of this call

    def take(self, tensor: torch.Tensor, *, read: bool = False) -> torch.Tensor:
        if tensor.device.type == "cpu" and not STAGE_CPU_TENSORS:
            return tensor
        host = self._host(tensor)
        if read:
            with torch.no_grad():
                host.copy_(tensor)
        self.copy_back.append(lambda: tensor.copy_(host))
        return host

    def both(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.take(tensor, read=True)


def _each(tensors: Any, stage: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`stage` applied to every tensor of a tensor, a list of them or a list of lists."""
    return [_each(t, stage) for t in tensors] if isinstance(tensors, list) else stage(tensors)


# torch's stubs give the C++ group's Python-facing overloads; a Python group implements the signatures its C++
# trampoline calls (PyProcessGroup.hpp), which those stubs do not describe.
_PythonGroup: Any = dist.ProcessGroup


@answer_to_every_name
class HostStagedGroup(_PythonGroup):
    """A process group whose every op runs on an inner gloo group over host copies of the tensors."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._inner, gloo = gloo_group(store, rank, size, timeout)
        if not STAGE_CPU_TENSORS:
            serve_cpu_by(self, gloo)

    def getBackendName(self) -> str:
        return BACKEND

    def _run(self, name: str, roles: str, *args: Any) -> dist.Work:
        """Op `name` on the inner group; `roles` has a letter per argument: r (read), w (written), b (both), - (not a
        tensor)."""
        staging = _Staging()
        act = {"r": staging.give, "w": staging.take, "b": staging.both}
        staged = [_each(arg, act[role]) if role in act else arg for role, arg in zip(roles, args, strict=True)]
        written = [arg for role, arg in zip(roles, args, strict=True) if role in "wb"]
        result = (written[0] if isinstance(written[0], list) else written) if written else []  # as gloo's futures
        return StagedWork([inner_method(self._inner, name)(*staged)], staging.copy_back, result)

    # In-place collectives (the tensors are read and written).
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("allreduce", "b-", tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        single = dist.AllreduceOptions()
        single.reduceOp, single.timeout = opts.reduceOp, opts.timeout
        return StagedWork([self.allreduce([t], single) for t in tensors], [], tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("broadcast", "b-", tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("reduce", "b-", tensors, opts)

    # Gathers: outputs first, then inputs.
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("allgather", "wr-", outputs, inputs, opts)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        works = [self.allgather([o], [i], opts) for o, i in zip(outputs, inputs, strict=True)]
        return StagedWork(works, [], outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("all_gather_single", "wr-", output, input, opts or AllgatherOptions())

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None):
        """One all-gather per tensor (gloo's coalesced one wants one dtype, and crashes on CUDA: pytorch#152645)."""
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return StagedWork(works, [], outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("gather", "wr-", outputs, inputs, opts)

    # Scatters and reduce-scatters: outputs first, then inputs.
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._run("scatter", "wr-", outputs, inputs, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._run("reduce_scatter", "wr-", outputs, inputs, opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._run("reduce_scatter_single", "wr-", output, input, opts or dist.ReduceScatterOptions())

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return StagedWork(works, [], outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                          input_splits: list[int], opts: Any = None) -> dist.Work:  # fmt: skip
        opts = opts or dist.AllToAllOptions()
        return self._run("all_to_all_single", "wr---", output, input, output_splits, input_splits, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._run("alltoall", "wr-", outputs, inputs, opts)

    # Point to point: the send starts at once (the peer may post its own send first) and copies nothing back.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._run("send", "r--", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._run("recv", "w--", tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self._run("recv_anysource", "w-", tensors, tag)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run("barrier", "-", opts or dist.BarrierOptions())


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> HostStagedGroup:
    return HostStagedGroup(store, rank, size, timeout)


def register() -> None:
    """Make `process_group_backend="gloo_host"` (and `init_process_group("gloo_host")`) known to torch; once."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
