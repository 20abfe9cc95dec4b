"""Tensor parallelism inside traced pipeline stages ("3D" for any network): user-style LightningModules whose
networks have their own forward (a residual CNN; Hugging Face GPT-2 called positionally, with a plan given) train at
pp2 x tp2 (and a CNN at dp2 x pp2 x tp2) exactly as one process does: losses and final weights within 1e-5."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import needs_torch_2_13
from distributed import replica_states, run_workers

sys.path.insert(0, str(Path(__file__).parent))
from user_modules import CausalLM, build, fit, loader, tiny_gpt2, token_loader  # noqa: E402

from lightning_parallel import PipelineParallelStrategy  # noqa: E402
from lightning_parallel.parallelize.plan import refuse_traced_sharding  # noqa: E402
from lightning_parallel.pipeline.tied import TiedGroup  # noqa: E402

STEPS = 3

GPT2_PLAN = {  # transformers' Conv1D (a transposed Linear): the attention and MLP pairs of every block
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}


def reference(net: str, batch_size: int = 16) -> dict:
    torch.manual_seed(0)
    if net == "gpt2":
        module = CausalLM(tiny_gpt2())
        data = token_loader(batch_size=batch_size)
        return fit(module, strategy="auto", devices=1, steps=STEPS, shuffle=False, data=data)
    return fit(build(net, "criterion"), strategy="auto", devices=1, steps=STEPS, shuffle=False, batch_size=batch_size)


def config(net: str, *, devices: int = 4, dp: int = 1, batch_size: int = 16, **strategy: object) -> dict:
    strategy = {"tensor_parallel_size": 2, "data_parallel_size": dp, "microbatches": 2, **strategy}
    return {"net": net, "devices": devices, "steps": STEPS, "batch_size": batch_size, "strategy": strategy}


def max_gaps(results: list[dict], ref: dict, replicas: int = 1) -> tuple[float, float]:
    """(largest loss gap, largest weight gap) of every rank against one process; fails on an error."""
    for result in results:
        assert "error" not in result, result["error"]
    losses = torch.tensor([result["losses"] for result in results]).reshape(replicas, -1, STEPS).mean(0)
    loss_gap = float((losses - torch.tensor(ref["losses"])).abs().max())
    weight_gap = 0.0
    for merged in replica_states(results, replicas):  # every replica, not only the last one's ranks
        assert merged.keys() == ref["state"].keys()
        gaps = [float((merged[name] - value).abs().max()) for name, value in ref["state"].items()]
        weight_gap = max(weight_gap, *gaps)
    return loss_gap, weight_gap


@needs_torch_2_13
@pytest.mark.slow
def test_residual_cnn_and_gpt2_at_pp2_by_tp2(tmp_path: Path) -> None:
    """The CNN's automatic plan shards its conv pairs and Linear pair; GPT-2's plan its Conv1D attention and MLP
    pairs (its lm_head, tied to the embedding across the stages, stays whole). BatchNorm normalises by micro-batch,
    so the CNN runs one micro-batch per step to be exact; GPT-2 runs 1F1B over two."""
    pytest.importorskip("transformers")
    configs = [config("residual_cnn", microbatches=1, schedule="gpipe"), config("gpt2", plan=GPT2_PLAN)]
    ranks = run_workers("traced_tensor", 4, configs, tmp_path)
    runs = list(zip(*ranks, strict=True))
    for index, net in enumerate(["residual_cnn", "gpt2"]):
        loss_gap, weight_gap = max_gaps(list(runs[index]), reference(net))
        print(f"{net} pp2 x tp2: loss gap {loss_gap:.1e}, weight gap {weight_gap:.1e}")
        assert loss_gap < 1e-5 and weight_gap < 1e-5, (net, loss_gap, weight_gap)
    cnn, gpt2 = runs[0][0]["parallel"], runs[1][0]["parallel"]
    assert cnn["plan_source"] == "auto" and cnn["sharded"]["conv1"] == "conv_colwise", cnn
    assert gpt2["plan_source"] == "argument" and gpt2["sharded"]["transformer.h.0.mlp.c_fc"] == "colwise", gpt2
    shapes = runs[1][0]["shapes"]  # stage 0, tensor rank 0: half of each sharded dimension
    assert shapes["model.transformer.h.0.mlp.c_fc.weight"] == (32, 64), shapes  # (in, out / 2)
    assert shapes["model.transformer.h.0.attn.c_proj.weight"] == (16, 32), shapes  # (in / 2, out)
    assert shapes["model.transformer.wte.weight"] == (64, 32), shapes  # tied to lm_head on the other stage: whole


@needs_torch_2_13
@pytest.mark.slow
def test_tutorial_cnn_at_dp2_by_pp2_by_tp2(tmp_path: Path) -> None:
    """(GPT-2 at dp2 x pp2 x tp2, with its structural plan: test_hf_tensor.py.)"""
    configs = [config("tutorial_cnn", devices=8, dp=2, batch_size=8)]
    ranks = run_workers("traced_tensor", 8, configs, tmp_path)
    loss_gap, weight_gap = max_gaps([rank[0] for rank in ranks], reference("tutorial_cnn"), replicas=2)
    print(f"tutorial_cnn dp2 x pp2 x tp2: loss gap {loss_gap:.1e}, weight gap {weight_gap:.1e}")
    assert loss_gap < 1e-5 and weight_gap < 1e-5, (loss_gap, weight_gap)
    sharded = ranks[0][0]["parallel"]["sharded"]
    assert "conv_colwise" in sharded.values() and "rowwise" in sharded.values(), sharded


@needs_torch_2_13
def test_fsdp_replicas_of_traced_stages_with_tensor_parallelism_are_refused_before_launch() -> None:
    strategy = PipelineParallelStrategy(tensor_parallel_size=2, data_parallel_size=2, replicas="fsdp")
    trainer = pl.Trainer(accelerator="cpu", devices=8, strategy=strategy, max_steps=1, logger=False)
    with pytest.raises(ValueError, match="HINT: use replicas='replicate'") as raised:
        trainer.fit(build("tutorial_cnn", "criterion"), train_dataloaders=loader(shuffle=False))
    assert "split by tracing" in str(raised.value) and "\n" not in str(raised.value)


@needs_torch_2_13
def test_sharding_a_parameter_tied_across_traced_stages_is_refused() -> None:
    network = torch.nn.ModuleDict({"emb": torch.nn.Embedding(8, 4), "head": torch.nn.Linear(4, 8, bias=False)})
    network["head"].weight = network["emb"].weight
    tied = [TiedGroup(("emb.weight", "head.weight"), (0, 1), 1, (8, 4), torch.float32)]
    refuse_traced_sharding(network, {"head": "replicate"}, tied, replicas="replicate", dp=1)
    with pytest.raises(ValueError, match=r"head \(colwise\) would shard head.weight, which is tied") as raised:
        refuse_traced_sharding(network, {"head": "colwise"}, tied, replicas="replicate", dp=1)
    assert "HINT: map head to 'replicate'" in str(raised.value) and "\n" not in str(raised.value)
