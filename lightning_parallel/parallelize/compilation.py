"""Set-up step "compile": `torch.compile` each block a rank holds, after activation checkpointing (so recomputation
is compiled too) and before replicas. It acts in place, on the block's `forward`, so parameter names, state dicts and
checkpoints stay the eager network's, and compiled and eager runs load each other's checkpoints. Pure torch.
"""

from __future__ import annotations

import logging
import re
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn


def compile_blocks(blocks: list[nn.Module], options: Mapping[str, Any] | None) -> int:
    """`torch.compile(**options)` each block's forward (None: nothing); returns how many were compiled. Compilation
    happens at each block's first call, so the first training step carries its time."""
    if options is None:
        return 0
    _warn_at_recompile_limit()
    for block in blocks:
        block.forward = torch.compile(_entry(block), **options)  # type: ignore[method-assign]
    return len(blocks)


def _entry(block: nn.Module) -> Callable[..., Any]:
    """A frame of our own around `block.forward`. TorchDynamo does not start tracing in torch's own files, so
    `Module.compile()` on a torch layer (`nn.Linear`, an `nn.Sequential` of them) silently stays eager; from
    this frame it inlines them. The frame's code object is the block's kind's (`_kind_code`): TorchDynamo keeps its
    graphs per code object and compiles one at most `recompile_limit` (8) times, then runs it eagerly."""
    forward = block.forward

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    code = _kind_code(block, compiled_forward.__code__)
    return types.FunctionType(code, compiled_forward.__globals__, code.co_name, None, compiled_forward.__closure__)


# kind -> its code object, while a block of the kind is compiled (a function made from the code holds it)
_CODES: weakref.WeakValueDictionary[tuple[Any, ...], types.CodeType] = weakref.WeakValueDictionary()
_KINDS: dict[str, str] = {}  # code name -> the kind in words, for the warning
_LOCK = threading.Lock()  # one-process ranks compile from several threads


def _kind_code(block: nn.Module, code: types.CodeType) -> types.CodeType:
    """One code object per block kind: the class, its submodules' names and classes, its parameters' and buffers'
    names, shapes and dtypes. Blocks of one kind (a transformer's layers) share graphs, as `Module.compile()` on one
    class would; blocks of other kinds (a ResNet stage's first block and the rest, an embedding, a head) count against
    their own recompile limit, not one shared by the whole network, other networks and Trainers in the process."""
    tensors = chain(block.named_parameters(), block.named_buffers())
    kind = (
        type(block),
        tuple((name, type(module)) for name, module in block.named_modules()),
        tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in tensors),
    )
    with _LOCK:
        found = _CODES.get(kind)
        if found is None:
            name = "compiled_" + re.sub(r"\W", "_", type(block).__name__) + f"_{len(_KINDS)}"
            first = next(iter(kind[2]), None)
            like = f" (the kind whose {first[0]} is {list(first[1])})" if first else ""
            _KINDS[name] = f"{type(block).__name__} blocks{like}"
            found = _CODES[kind] = code.replace(co_name=name)
        return found


_LIMIT_HIT = re.compile(r"hit config\.(\w+) \((\d+)\)\s+function: '(\w+)' \(([^\n]*):\d+\)\s+last reason: ([^\n]*)")


class _RecompileLimitWarning(logging.Filter):
    """Turns TorchDynamo's log record "hit config.recompile_limit" for one of our block kinds into one warning line:
    from then on those blocks run eagerly. Passes every record on unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
            found = _LIMIT_HIT.search(record.getMessage())
            if found and found[3] in _KINDS and found[4] == _entry.__code__.co_filename:
                limit, value, kind = found[1], found[2], _KINDS[found[3]]
                reason = re.sub(r"^\d+/\d+: ", "", found[5].split("  #")[0].strip())  # the failed guard alone
                warnings.warn(
                    f"compile=True: TorchDynamo reached {limit}={value} graphs for {kind}, so from now on such a "
                    f"block that needs a new graph runs eagerly, not compiled (the last guard that failed: {reason})."
                    " HINT: make what that guard checks the same on every call (a tensor instead of a Python number),"
                    f" or raise torch._dynamo.config.{limit} above {value} before fit.",
                    stacklevel=2,
                )
        return True


_FILTER = _RecompileLimitWarning()


def _warn_at_recompile_limit() -> None:
    """Installs the filter once on the logger TorchDynamo reports the limit with (torch 2.11 to 2.13)."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
