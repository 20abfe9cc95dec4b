"""One-line refusals for what torch's tracing frontend cannot split, naming the user's source line: a value that
is not a tensor (or whose shape depends on the data) crossing a stage boundary, and a forward export cannot trace.

Reads traced graphs and exceptions only; tracing and splitting are ``traced.py``'s.
"""

from __future__ import annotations

import linecache
import re
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

_SOURCE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def check_boundary(stage: nn.Module, name: str, next_block: str | None) -> None:
    """Every value a stage hands on must be a tensor of a static shape: ``PipelineStage`` sends only those."""
    if next_block is None:
        return
    for node in _output_nodes(stage):
        value = node.meta.get("val")
        where = _where(node.meta.get("stack_trace", ""))
        if not isinstance(value, torch.Tensor):
            numeric = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
            kind = "Python number" if isinstance(value, numeric) else type(value).__name__
            raise ValueError(
                f"pipeline tracing: {name}.forward passes a {kind} computed{where} to "
                f"block {next_block!r} across a stage boundary; stages exchange tensors only. HINT: keep it a "
                "tensor (no .item()), or split elsewhere."
            )
        if any(not isinstance(size, int) for size in value.shape):
            raise ValueError(
                f"pipeline tracing: {name}.forward passes a tensor whose shape {tuple(value.shape)} depends on the "
                f"data{where} to block {next_block!r} across a stage boundary. HINT: keep data-dependent shapes "
                "(boolean masks, nonzero) inside one block, or split elsewhere."
            )


def _output_nodes(stage: nn.Module) -> list[torch.fx.Node]:
    graph = stage.graph  # torch's split returns each stage as a GraphModule
    if not isinstance(graph, torch.fx.Graph):
        raise RuntimeError(f"{type(stage).__name__} is not a traced stage: it has no fx graph. HINT: report this.")
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(graph.output_node().args, found.append)
    return found


def _where(stack_trace: str) -> str:
    """`` at file.py:12 (code)`` for the innermost frame of a torch stack trace, or ``""``."""
    matches = _SOURCE.findall(stack_trace)
    if not matches:
        return ""
    path, line, _ = matches[-1]
    code = linecache.getline(path, int(line)).strip()
    return f" at {path}:{line}" + (f" ({code})" if code else "")


def explain_failure(name: str, error: Exception) -> str:
    """One line saying which construct of the forward torch could not trace, where, and what to do."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    where = _where("\n".join(str(e) for e in chain))
    if any(isinstance(e, GuardOnDataDependentSymNode) for e in chain):
        return (
            f"pipeline tracing: {name}.forward branches on a tensor value{where}. HINT: make the branch a "
            "module-level choice (a constructor argument), or wrap the network as an nn.Sequential of blocks."
        )
    # torch's fake tensors, met on the meta device: torch 2.13's error type; torch 2.11 raises a RuntimeError instead
    if type(chain[-1]).__name__ == "FakeTensorDeviceMismatchError" or str(chain[-1]).startswith(
        "Unhandled FakeTensor Device Propagation"
    ):
        where = where or _user_frame(chain[-1])
        return (
            f"pipeline tracing: {name}.forward makes a tensor on a fixed device and uses it with its inputs{where}; "
            "the trace runs on the meta device. HINT: create it on the input's device, e.g. torch.zeros(..., "
            "device=x.device) or nn.Transformer.generate_square_subsequent_mask(T, device=x.device)"
        )
    first = str(chain[-1]).strip().splitlines()[0] if str(chain[-1]).strip() else type(chain[-1]).__name__
    return (
        f"pipeline tracing: torch.export cannot trace {name}.forward{where}: {type(chain[-1]).__name__}: {first}. "
        "HINT: remove that construct from forward, or wrap the network as an nn.Sequential of blocks."
    )


def _user_frame(error: BaseException) -> str:
    """`` at file.py:12 (code)`` for the innermost frame of `error`'s traceback outside torch and this package."""
    skipped = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith(skipped)]
    if not frames:
        return ""
    frame = frames[-1]
    return f" at {frame.filename}:{frame.lineno}" + (f" ({frame.line.strip()})" if frame.line else "")
