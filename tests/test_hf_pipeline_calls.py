"""Hugging Face-style networks under the pipeline, in one process: called with keyword arguments, computing their
loss from `labels` inside forward and returning a `ModelOutput`, keyword inputs reach the stages that read them and
chained stages equal the eager model (the same tensor passed twice included); what cannot be traced, or cannot run
split, stops before launch in one line. On 2 and 4 processes: test_hf_pipeline.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from conftest import needs_torch_2_13  # noqa: E402
from hf_modules import CLASSES, SEQ, VOCAB, bert, gpt2  # noqa: E402

from lightning_parallel.pipeline.call import NetworkCall, network_call  # noqa: E402
from lightning_parallel.pipeline.traced import TracedNetwork, prune_children  # noqa: E402

TOL = 1e-5


def chain(stages: dict[int, nn.Module], inputs: tuple[torch.Tensor, ...]) -> object:
    values: object = inputs
    for index in sorted(stages):
        values = stages[index](*values)  # type: ignore[misc]
        if index < max(stages):
            values = values if isinstance(values, tuple) else (values,)
    return values


def stage_inputs(stage: nn.Module) -> list[str]:
    return [node.name for node in stage.graph.nodes if node.op == "placeholder"]  # type: ignore[union-attr]


def assert_chain_equals_eager(network: nn.Module, kwargs: dict[str, torch.Tensor], cut: list[int]) -> dict:
    """Chained stages (cut before the given block indices) compute the eager loss, logits and every gradient."""
    network.train()
    call, flat = network_call(network, (), kwargs)
    traced = TracedNetwork(network, flat, call)
    bounds = [0, *cut, len(traced.blocks)]
    split = [traced.blocks[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    stages = traced.stage_modules(split, range(len(split)), flat, network)
    network.zero_grad(set_to_none=True)
    eager = network(**kwargs)
    eager.loss.backward()
    want = {name: p.grad.clone() for name, p in network.named_parameters()}
    network.zero_grad(set_to_none=True)
    staged = traced.output(chain(stages, flat))
    assert type(staged) is type(eager)  # the ModelOutput class, not a dict: `out.loss` works
    staged.loss.backward()  # type: ignore[attr-defined]
    torch.testing.assert_close(staged.loss, eager.loss, atol=TOL, rtol=0)  # type: ignore[attr-defined]
    torch.testing.assert_close(staged.logits, eager.logits, atol=TOL, rtol=0)  # type: ignore[attr-defined]
    for name, p in network.named_parameters():
        torch.testing.assert_close(p.grad, want[name], atol=TOL, rtol=0, msg=lambda text, n=name: f"{n}: {text}")
    return {"call": call, "blocks": traced.blocks, "split": split, "stages": stages}


@needs_torch_2_13
def test_causal_lm_with_labels_the_same_tensor_routes_each_keyword_and_equals_eager() -> None:
    torch.manual_seed(0)
    network = gpt2()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    found = assert_chain_equals_eager(network, {"input_ids": ids, "labels": ids}, cut=[4, 6])
    # A user's model caches keys and values by default; a training step never reads them and a stage cannot send them
    assert found["call"] == NetworkCall(0, ("input_ids", "labels"), (("use_cache", False),))
    assert found["blocks"][0] == "transformer.wte" and "transformer.h.3" in found["blocks"]
    assert found["blocks"][-1] == "lm_head"
    # labels passed as the same tensor stay a second input: stage 0 takes both, carries labels to the loss
    stages = found["stages"]
    assert len(stage_inputs(stages[0])) == 2
    assert any("labels" in name for name in stage_inputs(stages[1]))
    assert any("labels" in name for name in stage_inputs(stages[2]))


@needs_torch_2_13
def test_a_rank_holding_the_embedding_but_not_the_tied_head_binds_it_by_its_own_name() -> None:
    """The trace names the tied embedding/head weight once (as `lm_head.weight`); the first rank prunes the head."""
    torch.manual_seed(0)
    network = gpt2()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    call, flat = network_call(network, (), {"input_ids": ids, "labels": ids})
    traced = TracedNetwork(network, flat, call)
    split = [traced.blocks[:5], traced.blocks[5:]]
    assert traced.tied_parameters() == {"transformer.wte.weight": ["transformer.wte", "lm_head"]}
    prune_children(network, split[0], traced.blocks)
    first = traced.stage_modules(split, [0], flat, network)[0]
    embedding = network.get_parameter("transformer.wte.weight")
    assert any(p is embedding for p in first.parameters())
    assert {id(p) for p in first.parameters()} <= {id(p) for p in network.parameters()}


@needs_torch_2_13
def test_gpt_neox_whose_split_graph_calls_stages_out_of_order_chains_in_stage_order() -> None:
    """GPT-NeoX (fused per-head query_key_value, parallel residual, partial rotary) on padded text: torch's split
    graph calls its rotary-embedding stage before the dropout stage numbered ahead of it (nothing reads the dropout
    yet); the chain follows the stage numbers, carrying the rotary stage's input through the dropout stage."""
    from hf_families import causal_lm
    from padded_modules import padded_loader

    torch.manual_seed(0)
    batch = next(iter(padded_loader(4)))
    assert (batch["labels"] == -100).any()  # padding that the mask and the loss must skip
    network = causal_lm("gpt_neox")
    found = assert_chain_equals_eager(network, batch, cut=[2, 4])
    assert found["split"][0] == ["gpt_neox.embed_in", "gpt_neox.emb_dropout"]
    assert found["split"][1][0] == "gpt_neox.rotary_emb"


@needs_torch_2_13
def test_a_tensor_the_forward_creates_from_python_values_keeps_its_value_in_the_stages() -> None:
    """GPT-Neo's attention masks with `torch.tensor(finfo.min)`: the meta trace keeps that constant without a value,
    which a trace of the real network supplies; a network on the meta device cannot, and says so in one line."""
    from hf_families import causal_lm
    from padded_modules import padded_loader

    torch.manual_seed(0)
    batch = next(iter(padded_loader(4)))
    assert_chain_equals_eager(causal_lm("gpt_neo"), batch, cut=[3])
    with torch.device("meta"):
        network = causal_lm("gpt_neo")
    call, flat = network_call(network, (), batch)
    with pytest.raises(ValueError, match=r"creates tensors from Python values .*lifted_tensor_0") as raised:
        TracedNetwork(network, flat, call)
    assert "HINT: build the model on the CPU" in str(raised.value) and "\n" not in str(raised.value)


@needs_torch_2_13
def test_encoder_classifier_gets_its_mask_in_every_stage_and_equals_eager() -> None:
    torch.manual_seed(0)
    network = bert()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    mask = torch.ones(4, SEQ, dtype=torch.long)
    mask[1, -3:] = 0  # padding: a mask that matters
    labels = torch.randint(0, CLASSES, (4,))
    found = assert_chain_equals_eager(network, {"input_ids": ids, "attention_mask": mask, "labels": labels}, [3])
    assert found["call"] == NetworkCall(0, ("input_ids", "attention_mask", "labels"))  # no use_cache parameter
    assert found["split"][0][-1] == "bert.encoder.layer.1"


def test_network_call_keeps_flags_and_refuses_what_a_stage_cannot_take() -> None:
    network = gpt2()
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    call, flat = network_call(network, (ids,), {"labels": ids, "use_cache": True, "return_dict": True})
    assert call == NetworkCall(1, ("labels",), (("use_cache", True), ("return_dict", True)))  # the user's choice
    assert len(flat) == 2 and flat[0] is ids and flat[1] is ids
    assert call.bind(flat) == ((ids,), {"labels": ids})
    assert call.describe() == "network(<1 tensor>, labels=<tensor>, use_cache=True, return_dict=True)"
    assert network_call(nn.Linear(2, 2), (torch.zeros(1, 2),), {})[0] == NetworkCall(1)
    with pytest.raises(ValueError, match=r"called with past= a list.*HINT") as raised:
        network_call(network, (), {"input_ids": ids, "past": [ids]})
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=r"a int as positional argument 1.*HINT"):
        network_call(network, (ids, 3), {})


class BranchOnLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.b(self.a(x))
        if labels.sum() > 0:  # a branch on data: the tracer cannot follow it
            h = h * 2
        return {"loss": (h - labels).square().mean(), "logits": h}


def test_untraceable_keyword_call_names_the_source_line() -> None:
    network = BranchOnLabels()
    call, flat = network_call(network, (), {"x": torch.randn(2, 4), "labels": torch.randn(2, 4)})
    with pytest.raises(ValueError) as raised:
        TracedNetwork(network, flat, call)
    message = str(raised.value)
    assert "BranchOnLabels.forward branches on a tensor value" in message and "HINT" in message
    assert "test_hf_pipeline_calls.py" in message and "if labels.sum() > 0" in message and "\n" not in message


@needs_torch_2_13
def test_untraceable_keyword_call_stops_the_trainer_before_launch_naming_the_source_line() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = BranchOnLabels()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.model(x=x, labels=y)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 4)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="pipeline", max_steps=1, logger=False)
    with pytest.raises(ValueError, match="HINT") as raised:
        trainer.fit(Module(), train_dataloaders=data)
    message = str(raised.value)
    assert "BranchOnLabels.forward branches on a tensor value" in message and "if labels.sum() > 0" in message
    assert "\n" not in message


@needs_torch_2_13
def test_split_backward_with_a_tied_weight_in_two_stages_of_one_rank_is_refused_before_launch() -> None:
    import lightning.pytorch as pl
    from hf_modules import build, token_loader

    from lightning_parallel import PipelineParallelStrategy
    from lightning_parallel.pipeline.tied import refuse_ties_within_a_rank

    tied = {"transformer.wte.weight": ["transformer.wte", "lm_head"]}
    stages = [["transformer.wte", "transformer.h.0"], ["transformer.h.1"], ["transformer.h.2"], ["lm_head"]]
    refuse_ties_within_a_rank(tied, stages, [0, 1, 0, 1], "interleaved_zero_bubble")  # loop: ranks 0 and 1
    strategy = PipelineParallelStrategy(schedule="zbv")  # V: stages 0 and 3 on rank 0
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(ValueError, match="HINT") as raised:
        trainer.fit(build("gpt2"), train_dataloaders=token_loader())
    message = str(raised.value)
    assert "schedule='zbv' splits the backward" in message and "'transformer.wte.weight'" in message
    assert "stages [0, 3]" in message and "pipeline rank 0" in message and "\n" not in message


def test_older_torch_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On torch 2.11 / 2.12 labels crossing stages and tensor parallelism inside traced stages fail deep in torch
    (measured); they stop before the first step instead, naming the version."""
    from lightning_parallel.parallelize.plan import refuse_traced_sharding

    monkeypatch.setattr(torch, "__version__", "2.12.1+cpu")
    ids = torch.randint(0, VOCAB, (4, SEQ))
    call, flat = network_call(gpt2(), (), {"input_ids": ids, "labels": ids.clone()})
    with pytest.raises(ValueError, match=r"integer tensors between pipeline stages needs torch >= 2\.13") as error:
        TracedNetwork(gpt2(), flat, call)
    assert "installed 2.12.1+cpu" in str(error.value) and "\n" not in str(error.value)
    positional = gpt2()  # positional ids, the loss in training_step: nothing integer crosses a stage
    TracedNetwork(positional, *reversed(network_call(positional, (ids,), {})))
    with pytest.raises(ValueError, match="tensor parallelism inside traced pipeline stages needs torch") as error:
        refuse_traced_sharding(gpt2(), replicas="replicate", dp=1)
    assert "HINT" in str(error.value) and "\n" not in str(error.value)
