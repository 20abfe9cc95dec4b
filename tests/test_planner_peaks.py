"""Layout planner, where a rank's step peaks: gradients beside the activations the schedule still holds, FSDP2
units' gathered bytes in torch's order, and the optimizer step's temporaries as torch's AdamW makes them."""

from __future__ import annotations

import pytest
import torch
from planner_models import H100
from torch import nn

from lightning_parallel.planner import Block, CostModel, Layout, Workload, gpt_workload
from lightning_parallel.planner.presets import hardware_preset


def test_gradients_and_activations_peak_apart_as_the_schedule_holds_them() -> None:
    """A rank's gradients are whole from its first backward on: at one stage (and in an all-forwards-first order)
    they grow while the activations go, so the step holds the worse end of that sweep, not both whole; where
    forwards follow that backward (1F1B), the schedule's in-flight activations sit beside the whole gradients."""
    from lightning_parallel.planner.memory import peak_of_step

    grads, acts = [4.0, 4.0, 4.0], [1.0, 1.0, 1.0]
    assert peak_of_step(grads, acts, at_first_grad=1, with_grads=0) == 12.0 + 1.0  # whole grads + block 0's acts
    assert peak_of_step(acts, grads, at_first_grad=1, with_grads=0) == 12.0 + 1.0  # whole acts + the last block's
    assert peak_of_step(grads, acts, at_first_grad=3, with_grads=3) == 12.0 + 3 * 3.0  # 1F1B's steady state
    assert peak_of_step(grads, acts, at_first_grad=4, with_grads=0) == 3 * 3.0 + 13.0  # GPipe: the last sweep
    # after the first micro-batch a parameter's new gradient (4) is made beside its accumulated one, at its block's
    # backward (the last block's: all 3 of that micro-batch's activations still held, 2 others in flight)
    assert peak_of_step(grads, acts, at_first_grad=3, with_grads=3, accumulating=[4.0] * 3) == 12.0 + 2 * 3.0 + 3 + 4
    workload = gpt_workload(depth=8, width=256, heads=8, vocab_size=512, seq_len=128)
    model = CostModel(workload, H100)  # fp32: 26 MB of gradients; 17 MB of activations per sample
    for batch in (1, 4):  # gradients outweigh the activations, then the other way round
        memory = model.estimate(Layout(dp=1), batch=batch).memory
        whole = sum(block.activations for block in workload.blocks) * batch * 4
        assert memory["activations"] + memory["grads"] < 0.8 * (whole + memory["grads"]), (batch, memory, whole)


def test_fsdp2_units_peak_where_torch_holds_their_gathered_bytes() -> None:
    """FSDP2's transient bytes follow torch's order: a unit's backward starts with its all-gather output and copy-out
    (2p) beside every activation before it and the later unit's reduce-scatter input; it ends with its parameters,
    its whole gradients, that input and the earlier unit's prefetched all-gather output; not 3p at its end."""
    from lightning_parallel.planner.memory import RankBytes, rank_memory

    # a base model (embedding, layers, norm: one unit of 90) and a head (a unit of 10), bytes of 1 per element
    rank = RankBytes(params=[10.0, 80.0, 0.0, 10.0], activations=[1.0, 20.0, 1.0, 5.0], rematerialised=0.0,
                     replica_units=[90.0, 10.0], unit_starts=[0, 3])  # fmt: skip
    kwargs = {"micro": 1, "stages_per_rank": 1, "at_first_grad": 1, "with_grads": 0, "sizes": (1, 1, 1)}
    memory = rank_memory(rank, shard=8, optimizer_states=2, **kwargs)
    # the base model's backward start: activations to the norm (22), gradients made (the head's, 1.25), 2 x 90
    # gathered, the head's reduce-scatter input (10)
    assert memory["gathered"] == 190.0 and memory["total"] == 4 * 12.5 - 12.5 + 22 + 1.25 + 190, memory
    equal = RankBytes(params=[4.0] * 4, activations=[0.0] * 4, rematerialised=0.0, replica_units=[4.0] * 4,
                      unit_starts=[0, 1, 2, 3])  # fmt: skip
    # an inner unit's end: its parameters and gradients, the next unit prefetched, the last one's input (4 x 4)
    assert rank_memory(equal, shard=4, optimizer_states=2, **kwargs)["gathered"] == 16.0


@pytest.mark.parametrize("update", ["for-loop", "foreach"])
def test_the_optimizer_steps_temporaries_are_those_torch_adamw_makes(update) -> None:
    """AdamW's step counted by the dry run's LiveBytes (state made, gradients held) makes the temporaries the
    planner's `update` rule gives: one parameter at a time, the previous quotient still bound beside the current
    sqrt and quotient; all at once, one of every parameter."""
    from lightning_parallel.dryrun.live_bytes import LiveBytes

    net = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 8))
    params = list(net.parameters())
    optimizer = torch.optim.AdamW(params, foreach=update == "foreach")
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()  # its state made, as in every step after the first
    state = [v for s in optimizer.state.values() for v in s.values()]
    with LiveBytes([*params, *(p.grad for p in params), *state]) as live:
        optimizer.step()
    held = sum(t.numel() * t.element_size() for t in [*params, *(p.grad for p in params), *state])
    block = Block(name="net", params=sum(p.numel() for p in params),
                  parameters=tuple((p.numel(), False) for p in params))  # fmt: skip
    model = CostModel(Workload(name="mlp", blocks=(block,)), hardware_preset("cpu"), update=update)
    predicted = model.estimate(Layout(dp=1), batch=2).memory_per_rank[0]["activations"]
    assert predicted == pytest.approx(live.peak - held, abs=16 * len(params)), (predicted, live.peak - held)
    # for-loop: the third layer's weight (2 copies) beside the second's bias; foreach: every parameter once
    assert predicted == (256 + 2 * 256 * 256 if update == "for-loop" else sum(p.numel() for p in params)) * 4
