"""Evaluation under the pipeline strategy: the user's validation / test / predict step unchanged, its network call
served by a forward-only schedule whose output is broadcast from the last stage and rebuilt on every rank (a
`vocab_head`'s logits split by vocabulary, as in training: each tensor rank gets its own shard). No training here
(`pipeline_step.py`); at pp=1 Lightning's own steps run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_parallel.pipeline.token_shares import unweighted_eval_loss, whole_batch_model_loss
from lightning_parallel.strategies.evaluation_steps import EvaluationThrough
from lightning_parallel.strategies.pipeline_step import PipelinedStep
from lightning_parallel.strategies.user_step import swap_attribute
from lightning_parallel.tensor.sharded_logits import gather_logits, sharded_again


class PipelinedEvaluation(EvaluationThrough, PipelinedStep):
    """The evaluation half of `PipelineParallelStrategy`: every evaluation step through a forward-only schedule."""

    def _pipelined_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The network call of an evaluation step: a forward-only schedule, its output's tensors broadcast from the
        last stage and rebuilt into the network's own output (a tensor, tuple, dict or ModelOutput) on every rank.
        Logits the last stage hands on split by vocabulary cross as each tensor rank's shard (a pp group joins ranks
        of one tensor rank) and are sharded logits again on every rank, for the step's session."""
        network = self.network_of(self.module)
        inputs = self._network_inputs(network, (args, kwargs))
        output = self.runtime.forward(inputs)
        leaves: list[torch.Tensor] = [] if output is None else list(output) if isinstance(output, tuple) else [output]
        shards = self._stage_logits.layout() if self._stage_logits is not None else {}
        meta = [
            (isinstance(output, tuple), [(t.shape, t.dtype) for t in leaves], shards) if output is not None else None
        ]
        dist.broadcast_object_list(meta, src=self._last_stage_rank(), group=self.group("pp"))
        assert meta[0] is not None  # the last stage always has an output
        several, shapes, shards = meta[0]
        tensors = [
            self._from_last_stage(leaves[i] if leaves else None, shape, dtype)
            for i, (shape, dtype) in enumerate(shapes)
        ]
        handed = sharded_again(tensors, shards, self.device_mesh["tp"]) if shards else tensors
        assert self._split is not None
        rebuilt = self._split.output(tuple(handed) if several else handed[0])
        counts = self._label_counts(network, inputs, evaluating=True)
        if counts is not None and counts[1] is not None:
            whole_batch_model_loss(rebuilt, tensors, counts[1])
        elif counts is not None and not self._warned_eval_loss:
            rank_zero_warn(unweighted_eval_loss(counts[0]))
            self._warned_eval_loss = True
        return rebuilt

    def _from_last_stage(self, tensor: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Broadcast a tensor from the rank holding the last stage to every rank of the pipeline."""
        buffer = (
            tensor.to(dtype).contiguous()
            if tensor is not None
            else torch.empty(shape, dtype=dtype, device=self.root_device)
        )
        dist.broadcast(buffer, src=self._last_stage_rank(), group=self.group("pp"))
        return buffer

    # ---- evaluation ----------------------------------------------------------------------------
    @override
    def _evaluating(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """In the logits session, as a training step: what the step returns (predictions) leaves with them gathered."""
        with self._sharded_logits():
            if not self.pipelined:
                return gather_logits(step(*args, **kwargs))
            with swap_attribute(self.network_of(self.module), "forward", self._pipelined_forward):
                return gather_logits(step(*args, **kwargs))
