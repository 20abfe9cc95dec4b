"""The private parts of Lightning the strategies and callbacks rely on to resume exactly and to honour
`trainer.fit(weights_only=...)`, each reached through one function here that checks its form in Lightning 2.6 and
otherwise fails in one line (`seams.changed`); torch's private parts are seams.py's.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_parallel.seams import changed


def finish_restored_epoch(trainer: Any) -> None:
    """Let a run resumed from a checkpoint saved on an epoch's last batch count its next epoch.

    Lightning 2.6.6's `FitLoop.reset` completes such a restored epoch but leaves the loop "restarted mid-epoch", so
    the next epoch is never counted as ready or started (nor `on_train_epoch_start` called), and a checkpoint this
    run saves later resumes into the previous epoch's shuffle: a second resume silently trains on other batches.
    Called at `on_train_start`; does nothing for fresh runs or real mid-epoch restarts.
    """
    why = "resume exactly more than once"
    loop = trainer.fit_loop
    for name in ("restarted_mid_epoch", "reset_restart_stage", "epoch_progress"):
        if not hasattr(loop, name):
            raise changed("lightning", f"FitLoop.{name}", why)
    total = loop.epoch_progress.total
    if loop.restarted_mid_epoch and total.completed == total.ready:
        loop.reset_restart_stage()


def skip_training_batches(trainer: Any, count: int) -> None:
    """Move a fit restored mid-epoch `count` batches into its epoch, where the checkpoint was saved.

    Lightning 2.6.6 restores the epoch's batch count but restarts a plain DataLoader's iterator at its first batch (only
    a loader with `state_dict` resumes its position), so a resumed epoch trains on its first batches again and skips
    its last. Called at `on_train_start`, after the fit loop made the epoch's iterator and before any batch is taken:
    the samplers get the epoch's number (Lightning gives it later, before the first batch) and `count` batches are
    drawn and dropped from the iterator, under the fetcher's count, which Lightning has already advanced by them.
    """
    why = "resume mid-epoch at the saved batch"
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "iterator") or not isinstance(getattr(fetcher, "batches", []), list):
        raise changed("lightning", "FitLoop._data_fetcher.iterator", why)
    epoch = trainer.fit_loop.epoch_progress.current.processed  # what Lightning passes to set_epoch
    for loader in _leaves(trainer.train_dataloader):
        batch_sampler = getattr(loader, "batch_sampler", None)
        for sampler in (getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
    prefetched = getattr(fetcher, "batches", [])
    refill = len(prefetched)
    dropped = min(count, refill)
    del prefetched[:dropped]
    try:
        for _ in range(count - dropped):
            next(fetcher.iterator)
        for _ in range(refill - len(prefetched)):
            prefetched.append(next(fetcher.iterator))
    except StopIteration:
        fetcher.done = not prefetched


def _leaves(iterables: Any) -> list[Any]:
    """The loaders of a `train_dataloader` (one, or a list / dict of them)."""
    if isinstance(iterables, dict):
        return [leaf for value in iterables.values() for leaf in _leaves(value)]
    if isinstance(iterables, (list, tuple)):
        return [leaf for value in iterables for leaf in _leaves(value)]
    return [] if iterables is None else [iterables]


def fit_weights_only() -> bool | None:
    """The `weights_only` given to the running `Trainer.fit` (or validate, test, predict), None outside one.

    Lightning 2.6.6's `Trainer._run` hands it to `Strategy.load_checkpoint` only for strategies that restore before
    setup; the mesh strategies restore after it and are called with None, so a user's `weights_only=False` for a
    trusted checkpoint would be lost. It is read from `_run`'s frame, which is on the stack while it loads.
    """
    from lightning.pytorch import Trainer

    why = "honour trainer.fit(weights_only=...) under the mesh strategies"
    run = getattr(Trainer, "_run", None)
    code = getattr(run, "__code__", None)
    if code is None or "weights_only" not in inspect.signature(run).parameters:  # type: ignore[arg-type]
        raise changed("lightning", "Trainer._run(model, ckpt_path, weights_only)", why)
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is code:
            return frame.f_locals["weights_only"]
        frame = frame.f_back
    return None
