"""Traced pipeline stages' vocabulary-parallel loss in one process (tensor ranks simulated by LocalTensorMode): a
traced head and transformers' loss from padded labels run on the logits' shards with one device's numbers, and a
traced last stage hands its logits on split by vocabulary (`StageLogits`), never gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_torch_2_13
from torch import nn
from vocab_shards import B, T, V, example, per_rank, simulated

pytest.importorskip("torch.distributed._local_tensor")


def test_traced_stages_compute_the_loss_on_the_logits_shards() -> None:
    """A traced last stage (transformers' loss from padded labels) runs `aten.linear` and `aten.cross_entropy_loss`
    on DTensors: the head takes its input whole even when it arrives as partial sums (as from a traced Llama's last
    norm; DTensor left alone gathered the head's weight and returned partial sums, whole-sized logits on every rank),
    and in a session the loss runs on the vocabulary shards, counted, with one device's loss and gradients."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from lightning_parallel.tensor.sharded_logits import ShardedLogits
    from lightning_parallel.tensor.traced_linear import head_linear
    from lightning_parallel.tensor.traced_stages import _cross_entropy, distribute_planned

    torch.manual_seed(0)
    hidden, whole = torch.randn(B * T, 4), nn.Linear(4, V, bias=False)
    labels = example()[1].flatten()
    with simulated(2) as mesh:
        head = nn.Linear(4, V, bias=False)
        head.weight.data.copy_(whole.weight.data)
        distribute_planned(head, "vocab_head", mesh)
        x = DTensor.from_local(hidden, mesh, [Partial()], run_check=False)  # partial sums
        value = per_rank(x.full_tensor())[0]  # what they sum to
        expected = F.cross_entropy(whole(value), labels)
        expected.backward()
        logits = head_linear(x, head.weight)
        target = distribute_tensor(labels, mesh, [Replicate()])
        with ShardedLogits() as session:
            loss = _cross_entropy(logits, target)
        loss.backward()
        assert logits.placements == (Shard(1),) and session.counts.parallel == 1, (logits.placements, session.counts)
        assert all(float((value - expected).abs()) < 1e-6 for value in per_rank(loss.to_local()))
        grad = head.weight.grad.full_tensor()
        assert all(float((value - whole.weight.grad).abs().max()) < 1e-6 for value in per_rank(grad))


@needs_torch_2_13  # labels (integers) cross traced stages: refused before 2.13
def test_a_traced_last_stage_hands_its_logits_on_split_by_vocabulary() -> None:
    """A traced Llama at pp2 x tp2 (its own plan, labels padded with -100, the loss from them inside the last stage):
    in a session the last stage returns its logits split by vocabulary, never gathered (each rank V / 2 columns), and
    `StageLogits` passes their local shard through `PipelineStage` and back; the loss, the logits and the head's and
    the embedding's gradients (its own rows only) are one device's; another pipeline rank rebuilds the whole batch's
    shard (evaluation) with its rows. Outside a session they leave whole."""
    pytest.importorskip("transformers")
    from hf_modules import VOCAB, one_layer_llama, padded
    from torch.distributed.tensor import DTensor, Shard

    from lightning_parallel.pipeline.call import network_call
    from lightning_parallel.pipeline.traced import TracedNetwork
    from lightning_parallel.tensor.hf_plans import transformers_plan
    from lightning_parallel.tensor.plans import matches
    from lightning_parallel.tensor.sharded_logits import (
        Counts,
        ShardedLogits,
        StageLogits,
        gather_logits,
        is_sharded_logits,
        sharded_again,
    )
    from lightning_parallel.tensor.traced_stages import distribute_planned, stages_on_mesh

    torch.manual_seed(0)
    one = one_layer_llama()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    call, inputs = network_call(one, (), {"input_ids": ids, "labels": padded(ids)})
    expected = one(input_ids=ids, labels=padded(ids), use_cache=False)
    expected.loss.backward()
    traced, plan = TracedNetwork(one, inputs, call), transformers_plan(one) or {}
    split = [traced.blocks[:3], traced.blocks[3:]]  # the norm and lm_head on stage 1
    traced.stage_modules(split, [0, 1], inputs, one)  # traced out here: torch.export does not run in the simulation
    with simulated(2) as mesh:
        network = one_layer_llama()
        network.load_state_dict(one.state_dict())
        for name, module in network.named_modules():
            for style in [style for pattern, style in plan.items() if name and matches(pattern, name)][:1]:
                distribute_planned(module, style, mesh)
        stages, _ = stages_on_mesh(traced.stage_modules(split, [0, 1], inputs, network), None, mesh, ["lm_head"])
        logits = StageLogits()
        logits.watch(stages)
        with ShardedLogits() as session:
            sent = stages[1](*stages[0](*inputs))  # what PipelineStage gets: plain tensors
            assert not isinstance(sent[1], DTensor) and sent[1].shape == (2, 8, VOCAB // 2), sent[1].shape
            loss, handed = logits.restore(sent)
            assert is_sharded_logits(handed) and handed.placements == (Shard(2),), handed
            # evaluation: the whole batch's shard (two micro-batches' rows) rebuilt as another pipeline rank does
            layout = logits.layout()
            assert layout == {1: ((Shard(2),), VOCAB)}, layout
            again = sharded_again([sent[0], torch.cat([sent[1], sent[1]])], layout, mesh)
            assert again[0] is sent[0] and is_sharded_logits(again[1]) and again[1].shape == (4, 8, VOCAB)
            whole = gather_logits({"logits": again[1]})["logits"]  # as a predict_step returns them
            assert not isinstance(whole, DTensor) and whole.shape == (4, 8, VOCAB), whole.shape
            twice = torch.cat([expected.logits, expected.logits]).detach()
            assert all(float((value - twice).abs().max()) < 1e-5 for value in per_rank(whole.detach()))
            loss.sum().backward()
        assert session.counts == Counts(parallel=1, gathered=0), session.counts
        gathered = handed.full_tensor().detach()  # only here, to compare
        assert all(float((value - expected.loss.detach()).abs().max()) < 1e-6 for value in per_rank(loss))
        assert all(float((value - expected.logits.detach()).abs().max()) < 1e-5 for value in per_rank(gathered))
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            grad = network.get_parameter(name).grad
            assert isinstance(grad, DTensor) and grad.to_local().shape == (VOCAB // 2, 16), (name, grad)
            gap = (grad.full_tensor() - one.get_parameter(name).grad).abs().max()
            assert all(float(value) < 1e-6 for value in per_rank(gap)), name
        with torch.no_grad():
            evaluated = stages[1](*stages[0](*inputs))[1]
        assert not isinstance(evaluated, DTensor) and evaluated.shape == (2, 8, VOCAB), evaluated.shape
