"""Type and range checks for strategy constructor arguments: a wrong value fails in the constructor with one line
(`PipelineParallelStrategy(microbatches='abc'): microbatches must be ...`), not inside launched processes.

Only the checks and the message; each strategy decides what its arguments accept.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def reject(owner: object, name: str, value: Any, expected: str, hint: str) -> None:
    """Raise the one-line error: who was called with what, what it needs, and a fix."""
    got = f"{value!r} ({type(value).__name__})"
    raise ValueError(f"{type(owner).__name__}({name}={value!r}): {name} must be {expected}, got {got}. HINT: {hint}")


def is_integer(value: Any) -> bool:
    """A real integer: not a bool (True == 1), a float (2.5) or a string ('4')."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(owner: object, name: str, value: Any, *, example: int, minimum: int = 1, optional: bool = False) -> None:
    """`value` is an integer >= `minimum` (or None when `optional`)."""
    if (optional and value is None) or (is_integer(value) and value >= minimum):
        return
    reject(owner, name, value, f"an integer >= {minimum}" + (" or None" if optional else ""), f"{name}={example}")


def check_bool(owner: object, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        reject(owner, name, value, "True or False", f"{name}=True")


def check_name(owner: object, name: str, value: Any, *, example: str) -> None:
    """`value` is None or a non-empty string (an attribute name)."""
    if value is not None and not (isinstance(value, str) and value):
        reject(owner, name, value, "None or a non-empty string", f"{name}={example!r}")


def check_choice(owner: object, name: str, value: Any, choices: Iterable[str], *, example: str) -> None:
    names = list(choices)
    if not (isinstance(value, str) and value in names):
        reject(owner, name, value, f"one of {', '.join(names)}", f"{name}={example!r}")


def check_timeout(owner: object, value: Any) -> None:
    """Seconds (a positive, finite number) or a positive timedelta."""
    if isinstance(value, timedelta):
        ok = value > timedelta(0)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
    if not ok:
        reject(owner, "timeout", value, "a positive number of seconds or a timedelta", "timeout=300")


def check_backend(owner: object, value: Any) -> None:
    """None, a torch.distributed backend ("gloo"), or one per device type ("cpu:gloo,cuda:nccl")."""
    if value is None:
        return
    known = [name for name in dist.Backend.backend_list if name != "undefined"]  # includes registered ones
    names = [part.rpartition(":")[2].strip().lower() for part in value.split(",")] if isinstance(value, str) else [""]
    if not all(name in known for name in names):
        expected = f"None (gloo on CPU, nccl on GPU) or one of {', '.join(known)}"
        reject(owner, "process_group_backend", value, expected, "process_group_backend=None")
