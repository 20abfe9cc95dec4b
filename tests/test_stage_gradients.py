"""Values between traced pipeline stages that depend on no trained parameter (a Llama's RoPE cos / sin, a float mask
made from token ids, positions from a buffer) enter each stage detached: even fed as every float input requiring a
gradient (torch 2.11's receive buffers, the dry run), a stage saves nothing for them and gives them no
gradient, and hands them on without one. In one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.pipeline.call import network_call
from lightning_parallel.pipeline.traced import TracedNetwork


def stage_step(stage: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], tuple]:
    """`stage` run on copies of `inputs`, every float one requiring a gradient, and its backward from the outputs
    that require one: (those inputs, the outputs)."""
    fed = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = stage(*fed)
    out = out if isinstance(out, tuple) else (out,)
    grads = [t for t in out if t.requires_grad]
    torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
    return fed, out


def test_rope_cos_and_sin_enter_later_llama_stages_without_a_gradient() -> None:
    """pp3 of a 2-layer Llama: stage 1 (layers.0) takes the hidden states, cos, sin and the causal mask; only the hidden
    states get a gradient, and cos / sin leave for stage 2 without one (before, both got a gradient, and every
    layer's RoPE kept q and k for it)."""
    pytest.importorskip("transformers")
    from tests.hf_modules import SEQ, VOCAB, llama

    torch.manual_seed(0)
    network = llama()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    call, flat = network_call(network, (), {"input_ids": ids})
    traced = TracedNetwork(network, flat, call)
    split = [
        ["model.embed_tokens", "model.rotary_emb"],
        ["model.layers.0"],
        ["model.layers.1", "model.norm", "lm_head"],
    ]
    stages = traced.stage_modules(split, [0, 1], flat, network)
    with torch.no_grad():
        received = stages[0](*flat)
    shapes = [(tuple(t.shape), t.dtype) for t in received]
    assert shapes == [((2, SEQ, 32), torch.float32), ((1, SEQ, 8), torch.float32), ((1, SEQ, 8), torch.float32),
                      ((2, 1, SEQ, SEQ), torch.bool)]  # fmt: skip
    fed, out = stage_step(stages[1], received)
    assert fed[0].grad is not None and fed[0].grad.abs().sum() > 0
    assert fed[1].grad is None and fed[2].grad is None, "RoPE's cos / sin got a gradient"
    handed_on = [(tuple(t.shape), t.requires_grad) for t in out]  # what a stage computed first, first
    assert handed_on == [((1, SEQ, 8), False), ((1, SEQ, 8), False), ((2, 1, SEQ, SEQ), False), ((2, SEQ, 32), True)]


class PositionsAndMask(nn.Module):
    """Blocks whose outputs are masked by a float mask made from the token ids and shifted by positions computed from a
    buffer, both made before the first block, so both cross every stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.register_buffer("table", torch.randn(5, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, 5)
        mask = (ids > 2).float().unsqueeze(-1)  # (B, 5, 1)
        h = self.embed(ids)  # (B, 5, 8)
        positions = self.table.exp()  # (5, 8)
        for block in self.blocks:
            h = block(h) * mask + positions
        return h


def test_a_float_mask_and_buffer_positions_need_no_gradient_and_a_frozen_embedding_still_hands_on_one() -> None:
    torch.manual_seed(0)
    network = PositionsAndMask()
    x = torch.randint(0, 10, (3, 5))
    split = [["embed"], ["blocks.0"], ["blocks.1"]]
    stages = TracedNetwork(network, x).stage_modules(split, [0, 1], x, network)
    received = stages[0](x)
    assert [tuple(t.shape) for t in received] == [(3, 5, 8), (3, 5, 1), (5, 8)]
    fed, out = stage_step(stages[1], received)
    assert fed[0].grad is not None and fed[1].grad is None and fed[2].grad is None, "the mask or positions got one"
    assert [(tuple(t.shape), t.requires_grad) for t in out] == [((3, 5, 1), False), ((5, 8), False), ((3, 5, 8), True)]
    network.embed.requires_grad_(False)  # frozen when split: unfrozen later, it must still get its gradient
    stages = TracedNetwork(network, x).stage_modules(split, [1], x, network)
    fed, out = stage_step(stages[1], received)
    assert fed[0].grad is not None and fed[1].grad is None and fed[2].grad is None, "a frozen layer's output cut"
    assert not network.embed.weight.requires_grad  # left as the user set it
