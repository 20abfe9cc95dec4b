"""Checkpoint writes off the training thread, one at a time: a write starts only after the previous one ended, its
tensors copied to CPU memory first (`stage`), and what must wait for it (removing an older checkpoint) runs after
it succeeded. Deliberately knows nothing of files, formats or Lightning: the caller says what a write does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_parallel.seams import stager_spent


class BackgroundWrite:
    """At most one write in flight, in one background thread.

    `start` waits for the write before it (and raises that write's error), so two writes never run at once and a
    staged copy is never overwritten while a write still reads it. `wait` blocks until the write in flight ended.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._after: list[Callable[[], None]] = []
        self._writing = False
        self._failed = False  # the last write failed: what waited for it is dropped
        self._stager: DefaultStager | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state` whose tensors are CPU copies taken now (containers and other objects deep-copied),
        so training may change the originals while the copy is written. The CPU storage is kept and reused by the
        next save (allocating it anew costs ~4x the copy, measured); pinned when CUDA is there."""
        return self.stager.stage(state)  # type: ignore[return-value]  # no async staging: the copy, not a Future

    @property
    def stager(self) -> DefaultStager:
        """torch's staging (`async_save(async_stager=...)` takes it too), kept across saves for its CPU storage;
        only usable once the previous write ended (the storage it reuses is that write's)."""
        self.wait()
        if self._stager is not None and stager_spent(self._stager):  # torch 2.11: one stage per stager
            self._stager = None
        if self._stager is None:
            options = StagingOptions(  # in this thread, into private memory; pinned only where CUDA copies from it
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def start(self, write: Callable[[], None]) -> None:
        """Run `write` in the background once the previous write ended (its error, if any, is raised here)."""
        self.wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-write")
        with self._lock:
            self._writing, self._failed = True, False
        self._pending = self._executor.submit(self._run, write)

    def after(self, action: Callable[[], None]) -> None:
        """Run `action` once the write in flight succeeded (now if none is); dropped if that write failed, so an
        older checkpoint is removed only when the newer one is whole."""
        with self._lock:
            if self._writing:
                self._after.append(action)
                return
            if self._failed:
                return
        action()

    def wait(self) -> None:
        """Block until the write in flight (and what waited for it) ended; raise its error once."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the write in flight, then release the thread and the staged copy (even if it failed)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
            while True:
                with self._lock:
                    if not self._after:
                        self._writing = False
                        return
                    action = self._after.pop(0)
                action()
        except BaseException:
            with self._lock:
                self._writing, self._failed, self._after = False, True, []
            raise


def result_of(future: Any) -> Any:
    """The result of what `torch.distributed.checkpoint.async_save` returned: a Future, or (torch >= 2.9 with a
    staging future) an `AsyncSaveResponse` whose `upload_completion` is one."""
    return getattr(future, "upload_completion", future).result()
