"""Data-parallel replicas agreeing, step by step, that each makes the step's mean over valid targets (`token_mean.py`),
whose count they all-reduce: replicas that disagree (a skipped batch, a branch) end in one line naming them, within the
heartbeat's interval, instead of waiting in collectives that no longer match until the timeout.

Before the count's all-reduce a replica marks its call in the rendezvous store and waits until every replica has; a
replica whose step made no call marks that after its step. A waiting replica that finds such a mark, or a missing
replica waiting in another collective (its heartbeat), raises. Torch only; the strategies build one per run.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from lightning_parallel.heartbeat import WAITING, read_beats
from lightning_parallel.token_mean import summed

PREFIX = "lightning_parallel/token_mean_calls"
_made = 0  # agreements this process made: every replica counts the same, so each has keys of its own


class ReplicaCalls:
    """The call agreement of one data-parallel group over a run.

    Args:
        group: the replicas' process group (None: the default group).
        store: the rendezvous store every replica reaches (heartbeats are read from it too).
        timeout: seconds a replica waits for the others' calls (the collective timeout).
        poll: seconds between looks at the others' marks and heartbeats while waiting.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, store: dist.Store, timeout: float, poll: float) -> None:
        self.group, self.timeout, self.poll = group, timeout, poll
        self.replicas = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.replicas))
        global _made
        _made += 1
        self.base = store
        self.store = dist.PrefixStore(f"{PREFIX}/{_made}", store)
        self.step = 0
        self._called = False
        self._marks_none = True  # a step without the call is marked after a step with it (and on the first)

    def total(self, count: torch.Tensor, where: str) -> torch.Tensor:
        """The count summed over the replicas, once every replica has made the call in this step."""
        self._called = True
        self._agree(where)
        return summed(count, self.group)

    def after_step(self, where: str) -> None:
        """After the step (every replica): a replica that made no call marks it, and raises if another made one."""
        step, called = self.step, self._called
        self.step, self._called = step + 1, False
        if called:
            self._marks_none = True
            return
        if not self._marks_none:
            return
        self._marks_none = False
        self.store.append(f"{step}/none", f"{self.me},")  # type: ignore[attr-defined]  # not in the stubs
        if self.store.add(f"{step}/called", 0) > 0:
            raise RuntimeError(self._line(where, step, waited=None))

    def _agree(self, where: str) -> None:
        step = self.step
        self.store.append(f"{step}/at", f"{self.me},")  # type: ignore[attr-defined]  # not in the stubs
        if self.store.add(f"{step}/called", 1) == self.replicas:
            self.store.set(f"{step}/all", "1")
            if step >= 2:  # every replica is past step - 2: it made step - 1's call
                for name in ("at", "called", "all", "none"):
                    self.store.delete_key(f"{step - 2}/{name}")
            return
        started, pause, looked = time.time(), 0.0005, time.time()
        # checks, not Store.wait: a wait that times out logs two lines from C++ each time, and a straggler is normal
        while not self.store.check([f"{step}/all"]):
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            if time.time() - looked < self.poll:
                continue
            looked = time.time()
            absent = [r for r in range(self.replicas) if r not in self._marked(step, "at")]
            if self._marked(step, "none") or self._waiting_elsewhere(absent, since=started):
                raise RuntimeError(self._line(where, step, waited=time.time() - started))
            if looked - started > self.timeout:
                raise RuntimeError(self._line(where, step, waited=time.time() - started))

    def _marked(self, step: int, name: str) -> list[int]:
        """The replicas that marked `name` ("at": made the call, "none": did not) in `step`."""
        key = f"{step}/{name}"
        return [int(r) for r in self.store.get(key).decode().split(",") if r] if self.store.check([key]) else []

    def _waiting_elsewhere(self, absent: list[int], *, since: float) -> bool:
        """Whether a replica that has not made the call waits in another collective (a heartbeat taken after this
        replica began to wait: it cannot be one it is leaving, which this replica would have left too)."""
        beats = read_beats(self.base, max(self.ranks) + 1) or {}
        fresh = [beats.get(self.ranks[r]) for r in absent]
        return any(b is not None and b["time"] > since + self.poll and b["doing"].startswith(WAITING) for b in fresh)

    def _line(self, where: str, step: int, *, waited: float | None) -> str:
        made = self._marked(step, "at")
        others = [self.ranks[r] for r in range(self.replicas) if r not in made]
        after = f" (rank {self.ranks[self.me]} waited {waited:.1f} s for them)" if waited is not None else ""
        return (
            f"{where}: rank(s) {[self.ranks[r] for r in sorted(made)]} computed step {step}'s mean over valid "
            f"targets (F.cross_entropy / nll_loss, whose count the replicas total) and rank(s) {others} did "
            f"not{after}: a skipped batch or a branch, so their collectives no longer match. HINT: compute the loss "
            "the same way on every rank in every step (to skip a batch, multiply its loss by 0 instead of returning "
            "None)"
        )
