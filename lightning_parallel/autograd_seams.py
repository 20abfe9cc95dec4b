"""The private parts of torch's autograd graph this project relies on (through `seams.changed`'s one line), and what
is built on them: which leaves a backward reaches (torch 2.11 / 2.12's pipeline stage mended to send no gradient for a
detached input, `send_zero_gradients`) and when a backward has made every gradient of a set (the stage timer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_parallel.seams import changed, private_method, torch_at_least

_WHY = "follow gradients through the autograd graph"


def autograd_node(tensor: torch.Tensor) -> Any:
    """A tensor's node in the autograd graph: what made it, or a leaf's gradient accumulator (None for a tensor that
    needs no gradient), as torch's own `register_multi_grad_hook` finds it."""
    find = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
    if find is None:
        raise changed("torch", "torch.autograd.graph._get_grad_fn_or_grad_acc", _WHY)
    return find(tensor) if tensor.requires_grad else None


def when_gradients_made(params: Sequence[torch.Tensor], done: Callable[[], Any]) -> None:
    """Call `done()` in each backward once every parameter whose gradient it makes has it accumulated. torch's
    `register_multi_grad_hook` keeps every incoming gradient until the last, so autograd cannot steal one into
    `.grad` (it copies it) and both copies live to the stage's last gradient: one more copy of a stage's gradients
    on every backward (a pp2 x tp2 GPT rank 1.0 MB of 24.9 MB over its dry run). Post-accumulate hooks hold none."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if task_id is None or will_run is None:
        raise changed("torch", "torch._C._current_graph_task_id / _will_engine_execute_node", _WHY)
    nodes = [autograd_node(p) for p in params]  # their AccumulateGrad nodes, kept as torch's hook keeps them
    left: dict[int, int] = {}  # backward (graph task) -> gradients still to come

    def made(_param: torch.Tensor) -> None:
        task = task_id()
        if task not in left:
            left[task] = sum(map(will_run, nodes))
        left[task] -= 1
        if left[task] == 0:
            del left[task]
            done()

    for param in params:
        param.register_post_accumulate_grad_hook(made)


def send_zero_gradients(stage: Any) -> None:
    """Torch 2.11 / 2.12's stage sends a gradient back for every input it received (its receive buffers all require
    one) and fails on one it has none for ("has gradients None and is expecting to send gradients"): an input a traced
    stage takes detached (`stage_gradients`: RoPE's cos / sin, a float mask) gets zeros there, so nothing is computed
    or saved for it, but the previous stage still receives as many bytes. 2.12's buffer requires grad as stage 0's
    output did, and the previous stage receives none for one that does not: none is sent. Their split backward's input
    pass (zero-bubble schedules, DualPipeV) differentiates every such input and every output ("One of the
    differentiated Tensors appears to not have been used in the graph"): it gets only those autograd can. From torch
    2.13 on none of this is needed."""
    if torch_at_least((2, 13)):
        return
    why = "send no gradient for detached inputs"
    send = private_method(stage, "get_bwd_send_ops", library="torch", why=why)
    backward = private_method(stage, "backward_maybe_with_nosync", library="torch", why=why, parameters=3)

    def filled(chunk: int, send: Callable[[int], list[Any]] = send) -> list[Any]:
        grads = stage.bwd_cache.get(chunk) if not stage.is_first else None
        if grads is not None:
            infos = stage.args_recv_info[chunk]
            if stage.grad_send_info is None:  # 2.12: none back for a buffer not requiring grad (none is received)
                stage.grad_send_info = [info.source if _needs_grad(info) else None for info in infos]
            stage.bwd_cache[chunk] = tuple(
                torch.zeros_like(info.buffer) if grad is None and _needs_grad(info) else grad
                for grad, info in zip(grads, infos, strict=False)
            )
        return send(chunk)

    def input_pass(kind: str, kwargs: dict, last_backward: bool = False, backward: Callable = backward) -> Any:
        if kind != "input":
            return backward(kind, kwargs, last_backward)
        outputs, output_grads, values = kwargs["stage_output"], kwargs["output_grads"], kwargs["input_values"]
        kept = [i for i, out in enumerate(outputs) if out.requires_grad]
        outputs = [outputs[i] for i in kept]
        used = _reached(outputs, values)
        grads, groups = backward(kind, {
            **kwargs, "stage_output": outputs, "input_values": [v for v, u in zip(values, used, strict=True) if u],
            "output_grads": None if output_grads is None else [output_grads[i] for i in kept],
        }, last_backward)  # fmt: skip
        given = iter(grads)
        return tuple(next(given) if u else None for u in used), groups

    stage.get_bwd_send_ops = filled
    stage.backward_maybe_with_nosync = input_pass


def _needs_grad(info: Any) -> bool:
    return isinstance(getattr(info, "buffer", None), torch.Tensor) and info.buffer.requires_grad


def _reached(outputs: list[torch.Tensor], values: list[Any]) -> list[bool]:
    """Which of `values` (leaves) a backward from `outputs` reaches: their gradient accumulators in its graph."""
    nodes = [autograd_node(out) for out in outputs]
    seen: set[Any] = set()
    while nodes:
        node = nodes.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nodes.extend(following for following, _ in node.next_functions)
    return [isinstance(v, torch.Tensor) and v.requires_grad and autograd_node(v) in seen for v in values]
