"""Sharded checkpoints of a mesh strategy (torch.distributed.checkpoint), keyed by the network's original parameter
names: every rank writes its own shards and reads what its part needs, so a checkpoint loads into any layout. Reading
runs no code from the files (`unpickling.py`). The file format itself is `checkpoint.py`'s. A transformers model in the
module is recorded (`hf_format.py`), so `export --hf` needs no LightningModule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from typing_extensions import override

from lightning_parallel.background_write import BackgroundWrite, result_of
from lightning_parallel.callbacks.async_checkpoints import AsyncCheckpointIO
from lightning_parallel.checkpoint import (
    MODEL_KEY,
    compare_tensors,
    load_shards,
    move_in,
    partial_path,
    read_meta,
    recover,
    serialized,
    sharded_tensors,
)
from lightning_parallel.hf_format import RECORD_KEY, describe_pretrained
from lightning_parallel.lightning_seams import finish_restored_epoch, fit_weights_only
from lightning_parallel.parameter_kinds import groups_by_kind
from lightning_parallel.strategies.mesh_processes import MeshProcesses
from lightning_parallel.tensor.packed import copy_back, savable

# Flattened optimizer keys ("state.<param name>.exp_avg") are per parameter: no two ranks write the same
# key with different values, and a checkpoint loads into any other split of the parameters.
OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ShardedCheckpoints(MeshProcesses):
    """Save and load a mesh strategy's checkpoints shard by shard, after set-up (the model split and the optimizers
    built), and resume exactly more than once."""

    _checkpoint_writes_group: dist.ProcessGroup | None = None  # see `_checkpoint_group`

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None  # training has started
        finish_restored_epoch(self.lightning_module.trainer)  # a second resume stays exact (lightning_seams says why)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model must be split and the optimizers built before state can load into them

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        assert self.lightning_module is not None
        return optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank writes its shards into `<path>.partial`; rank 0 then writes `meta.pt` and swaps it in for
        `<path>`. With `AsyncCheckpointIO` the step waits only for the copy to CPU memory: the shards are written by
        `dcp.async_save` and the swap follows in the background, once every rank's shards are written."""
        path = Path(self.broadcast(str(filepath)))
        writes = self._background_writes()
        if writes is not None:
            writes.wait()  # the previous write and its swap ended: never two writes, never a half-written swap
        partial = partial_path(path)
        if self.is_global_zero:
            recover(path.parent)  # what a run killed during an earlier save left behind
        self.barrier()
        assert self.lightning_module is not None  # saving happens in a fit
        pretrained = describe_pretrained(self.lightning_module)  # class and config: `export --hf` builds nothing
        if pretrained:
            checkpoint[RECORD_KEY] = pretrained
        shards = {MODEL_KEY: checkpoint.pop(MODEL_KEY)}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = serialized(checkpoint) if self.is_global_zero else b""  # a snapshot: the loops go on meanwhile
        if writes is None:
            dcp.save(savable(shards), checkpoint_id=str(partial))  # interleaved shards (q | k | v) as contiguous ones
            if self.is_global_zero:
                move_in(partial, path, meta)
            self.barrier()
            return
        written = dcp.async_save(
            savable(shards),
            checkpoint_id=str(partial),
            process_group=self._checkpoint_group(),
            async_stager=writes.stager,
        )
        is_writer = self.is_global_zero

        def finish() -> None:
            result_of(written)  # DCP ends on every rank only after all ranks' shards and its .metadata are written
            if is_writer:
                move_in(partial, path, meta)

        writes.start(finish)

    def _background_writes(self) -> BackgroundWrite | None:
        """The writes in flight when checkpoints are written in the background (`AsyncCheckpointIO`), else None."""
        return self.checkpoint_io.writes if isinstance(self.checkpoint_io, AsyncCheckpointIO) else None

    def _checkpoint_group(self) -> dist.ProcessGroup:
        """A gloo group of all ranks for the background writes' own collectives (DCP plans and gathers over it):
        the training thread's groups stay the training thread's. Made at the first background save, which every
        rank reaches together."""
        if self._checkpoint_writes_group is None:
            self._checkpoint_writes_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._checkpoint_writes_group

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model and optimizer shards in place and return the rest. Nothing in the files runs as code unless
        `trainer.fit(..., weights_only=False)` says the checkpoint is trusted (None means True, as in torch)."""
        module = self.lightning_module
        assert module is not None
        if weights_only is None:
            weights_only = fit_weights_only()  # Lightning 2.6 does not pass it to strategies that restore after setup
        trusted = weights_only is False
        path = Path(self.broadcast(str(checkpoint_path)))
        writes = self._background_writes()
        if writes is not None:
            writes.wait()  # never read a checkpoint that is still being written
        meta = read_meta(path, weights_only=not trusted)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        state: dict[str, Any] = {MODEL_KEY: get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = optimizer_state_dict(module, optimizer)
        expected = {k: tuple(v.shape) for k, v in state[MODEL_KEY].items()}  # this rank's part, global shapes
        compare_tensors(path, sharded_tensors(path, weights_only=not trusted), expected, whole=False)
        view = savable(state)  # interleaved shards (q | k | v) read as the contiguous ones saved
        load_shards(view, path, weights_only=not trusted)
        copy_back(state, view)
        set_model_state_dict(module, state[MODEL_KEY], options=StateDictOptions(strict=module.strict_loading))
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=OPTIMIZER_OPTIONS)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # already loaded, shard by shard, in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # already loaded in load_checkpoint


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's flattened state dict of `optimizer`. DCP first steps an optimizer that has no state yet (at lr 0), and
    that step too takes one parameter kind at a time; flattened keys name parameters, so the split never shows."""
    with groups_by_kind(optimizer):
        return get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_OPTIONS)
