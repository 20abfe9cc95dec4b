"""compile=True compiles every block, in one process, under TorchDynamo's recompile limit: one code object per block
kind (`parallelize/compilation.py`), so identical blocks share a graph and other kinds count against their own limit;
a kind that still reaches it says so in one line. TorchDynamo alone: a counting backend, no AOTAutograd or Inductor."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_parallel.blocks import blocks_of
from lightning_parallel.parallelize.compilation import compile_blocks


class Counting:
    """A torch.compile backend that runs each graph as traced and counts the graphs and their calls."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1

        def run(*args: Any) -> Any:
            self.calls += 1
            return graph(*args)

        return run


class Wide(nn.Module):
    """Updates the first `width` features: blocks of other widths are other kinds (other parameter shapes)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.linear = width, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(self.linear(x[:, : self.width])), x[:, self.width :]], dim=1)


class Gated(Wide):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = x[:, : self.width]
        return torch.cat([torch.sigmoid(self.gate(head)) * self.linear(head), x[:, self.width :]], dim=1)


class Scaled(nn.Module):
    """Blocks of one kind that differ in an int attribute: TorchDynamo guards on it, a graph per value."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor, self.linear = factor, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.factor


def run_blocks(network: nn.Module, inputs: torch.Tensor, backend: Counting) -> list[str]:
    """One forward and backward; the names of the blocks that ran no compiled graph."""
    eager = []
    for name, block in network.named_children():
        calls = backend.calls
        inputs = block(inputs)
        if backend.calls == calls:
            eager.append(name)
    inputs.sum().backward()
    return eager


def test_more_block_kinds_than_the_recompile_limit_all_compile_and_identical_blocks_share_a_graph() -> None:
    """12 kinds (two classes at six widths each, as a ResNet's stages differ), two blocks of each: with one code
    object for every block, compiled at most 8 times, the blocks from the 9th kind on ran eagerly (measured: 8
    graphs, 8 blocks eager). ResNet-50's 18 blocks are 10 kinds: none eager now in training and eval (3 and 18 were)."""
    torch.manual_seed(0)
    kinds = [kind(width) for width in range(13, 1, -1) for kind in [Wide if width % 2 else Gated]]
    network = nn.Sequential(*[block for kind in kinds for block in (kind, type(kind)(kind.width))])
    backend = Counting()
    with torch._dynamo.config.patch(recompile_limit=8, automatic_dynamic_shapes=False):
        assert compile_blocks(blocks_of(network), {"backend": backend}) == 24
        eager = run_blocks(network, torch.randn(3, 13, requires_grad=True), backend)
    assert eager == [], f"ran eagerly: {eager}"
    assert backend.graphs == 12  # one per kind: the second block of each kind ran the first one's graph


def test_a_kind_past_the_recompile_limit_is_named_in_one_line_with_a_hint() -> None:
    network = nn.Sequential(*[Scaled(factor) for factor in range(1, 5)])
    backend = Counting()
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning, match="compile=True") as warned:
        compile_blocks(blocks_of(network), {"backend": backend})
        eager = run_blocks(network, torch.randn(2, 4, requires_grad=True), backend)
    assert eager == ["2", "3"]  # factors 3 and 4: past the limit of 2 graphs
    messages = [str(w.message) for w in warned if "compile=True" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert "recompile_limit=2 graphs for Scaled blocks" in messages[0] and "factor == 2" in messages[0]
    assert "HINT" in messages[0]
