"""How a network is called, in the form a pipeline passes it: its positional and keyword tensors flattened into
one tuple (stage 0's inputs, in that order) and its non-tensor keywords (flags) kept as constants a trace bakes in.

Knows no model library (a Hugging Face model is just an ``nn.Module`` whose forward takes keywords); does not trace
or run anything.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Constant = bool | int | float | str | None
_CONSTANTS = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class NetworkCall:
    """The shape of one network call: ``positional`` tensors, then one tensor per name in ``keywords``, and the
    keyword ``constants`` (name, value) passed as they are. Hashable: traces and schedules are cached per call.

    A call with only positional tensors is ``NetworkCall(positional=n)``: what every ``nn.Sequential`` takes.
    """

    positional: int
    keywords: tuple[str, ...] = ()
    constants: tuple[tuple[str, Constant], ...] = ()

    def bind(self, flat: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """The positional and keyword tensor arguments for ``flat`` (the constants are not included)."""
        if len(flat) != self.positional + len(self.keywords):
            raise ValueError(
                f"{len(flat)} tensors for a call taking {self.positional} positional and {len(self.keywords)} keyword "
                "tensors. HINT: flatten the inputs with network_call"
            )
        return tuple(flat[: self.positional]), dict(zip(self.keywords, flat[self.positional :], strict=True))

    def describe(self) -> str:
        """``network(<2 tensors>, input_ids=<tensor>, use_cache=False)``: for one-line messages."""
        parts = [f"<{self.positional} tensor{'s' if self.positional != 1 else ''}>"] if self.positional else []
        parts += [f"{name}=<tensor>" for name in self.keywords]
        parts += [f"{name}={value!r}" for name, value in self.constants]
        return f"network({', '.join(parts)})"


def network_call(
    network: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[NetworkCall, tuple[torch.Tensor, ...]]:
    """Flatten a call ``network(*args, **kwargs)`` into its ``NetworkCall`` and the tensors, in stage 0's order.

    A tensor passed twice (``input_ids=ids, labels=ids``, as causal language-model users write it) stays two
    inputs: each reaches the stages that read it. ``use_cache=False`` is added when the forward takes a
    ``use_cache`` parameter the caller left out: a key/value cache serves token-by-token generation, which no
    pipelined step does, and it is not a tensor a stage can send, so tracing a model that returns one would fail
    although the user changed nothing (Hugging Face models default to ``use_cache=True``).
    """
    name = type(network).__name__
    for index, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{name} is called with a {type(value).__name__} as positional argument {index}; pipeline stages "
                "receive tensors. HINT: pass it as a keyword argument if it is a flag (bool, int, float, str, None)"
            )
    keywords: list[str] = []
    constants: list[tuple[str, Constant]] = []
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            keywords.append(key)
        elif isinstance(value, _CONSTANTS):
            constants.append((key, value))
        else:
            raise ValueError(
                f"{name} is called with {key}= a {type(value).__name__}; a pipeline passes tensors and plain flags "
                "(bool, int, float, str, None) to the network. HINT: pass each tensor as its own keyword argument"
            )
    if "use_cache" not in kwargs and "use_cache" in _parameters(network):
        constants.append(("use_cache", False))
    call = NetworkCall(len(args), tuple(keywords), tuple(constants))
    flat = (*args, *(kwargs[key] for key in keywords))
    if not flat:
        raise ValueError(f"{name} is called without a tensor ({call.describe()}). HINT: pass its inputs as tensors")
    return call, flat


def _parameters(network: nn.Module) -> Mapping[str, inspect.Parameter]:
    """The class's forward parameters: the instance's forward may be swapped for the pipeline's own meanwhile."""
    try:
        return inspect.signature(type(network).forward).parameters
    except (TypeError, ValueError):  # a forward without a signature (a C extension): nothing to add
        return {}
