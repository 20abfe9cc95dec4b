"""Checkpoints written in the background, for any strategy: Lightning's `AsyncCheckpointIO` plugin made whole and
bounded, and the callback that turns it on from a callback list (where a Hydra config names checkpoint behaviour).
The step stalls only while the checkpoint is copied to CPU memory; the file goes to `<path>.partial` and is swapped
in when written; a save, a removal, a load and the end of fit wait for the write in flight. The mesh strategies write
their DCP shards through its `writes` (`strategies/sharded_checkpoints.py`). When to save and what to keep stays
`ModelCheckpoint`'s.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO as LightningAsyncCheckpointIO
from typing_extensions import override

from lightning_parallel.background_write import BackgroundWrite
from lightning_parallel.checkpoint import partial_path, replace_with


class AsyncCheckpointIO(LightningAsyncCheckpointIO):
    """Lightning's `AsyncCheckpointIO`, with what a long run needs from it.

    - The copy is taken on CPU memory (reused from save to save; pinned with CUDA), not a second copy on the GPU.
    - One write at a time: a save first waits for the previous one (Lightning's queues them; a checkpoint removed
      while still queued would be written afterwards).
    - Whole or absent: written to `<path>.partial`, then swapped in (`checkpoint.replace_with`); a kill mid-write
      leaves the previous checkpoint, and `checkpoint.recover` removes the `.partial`.
    - A removal (ModelCheckpoint's `save_top_k`) waits until the newer checkpoint is whole, and is dropped if its
      write failed.
    - A failed write raises at the next save or at teardown, or is warned about when the run is already failing.

    Args:
        checkpoint_io: the plugin that writes one file (Lightning's `TorchCheckpointIO` when None).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io)
        self.writes = BackgroundWrite()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        copy = self.writes.stage(checkpoint)  # waits for the previous write first
        inner = self.checkpoint_io
        assert inner is not None  # the strategy sets Lightning's TorchCheckpointIO when none was given
        target = Path(path)
        if "://" in str(path):  # a remote path cannot be renamed into place: its own IO's semantics
            self.writes.start(lambda: inner.save_checkpoint(copy, path, storage_options=storage_options))
            return

        def write() -> None:
            inner.save_checkpoint(copy, partial_path(target), storage_options=storage_options)
            replace_with(partial_path(target), target)

        self.writes.start(write)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        inner = self.checkpoint_io
        assert inner is not None
        self.writes.after(lambda: inner.remove_checkpoint(path))

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.writes.wait()  # never read a checkpoint that is still being written
        return super().load_checkpoint(*args, **kwargs)

    @override
    def teardown(self) -> None:
        """End of fit (or of a failed one): wait for the write in flight. Its error is raised, unless the run is
        already failing with another one (then a warning: the original error is the one to see)."""
        failing = sys.exc_info()[1]  # Lightning tears down inside its `except` when the run failed
        try:
            self.writes.close()
        except Exception as error:
            if failing is None:
                raise
            warnings.warn(
                f"the checkpoint written when the run failed is incomplete and was not kept: {error!r}", stacklevel=2
            )
        finally:
            if self.checkpoint_io is not None:
                self.checkpoint_io.teardown()


class AsyncCheckpoints(pl.Callback):
    """Every checkpoint of the run's fit, validate, test or predict is written in the background: the step stalls
    only while it is copied to CPU memory (`AsyncCheckpointIO`; the mesh strategies' sharded checkpoints through
    `dcp.async_save`). Afterwards the run's own checkpoint plugin is back, so a `trainer.save_checkpoint` after
    `fit` has written its file when it returns.

    The same as `Trainer(plugins=[AsyncCheckpointIO()])` during the run. The run's own plugin stays the one that
    writes each file; Lightning's `AsyncCheckpointIO`, if given, gives way to this one (the mesh strategies write in
    the background only through this one).
    """

    def __init__(self) -> None:
        self._installed: AsyncCheckpointIO | None = None
        self._replaced: CheckpointIO | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        found: CheckpointIO | None = strategy.checkpoint_io
        if isinstance(found, AsyncCheckpointIO):
            return
        self._replaced = found
        if isinstance(found, LightningAsyncCheckpointIO):
            found.teardown()  # nothing is in flight before the run starts; this releases its thread
            found = found.checkpoint_io
        self._installed = strategy.checkpoint_io = AsyncCheckpointIO(found)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._installed is not None and trainer.strategy.checkpoint_io is self._installed:
            self._installed.teardown()  # the strategy's teardown already waited; nothing is left in flight
            trainer.strategy.checkpoint_io = self._replaced  # type: ignore[assignment]  # it was never None
        self._installed = self._replaced = None
