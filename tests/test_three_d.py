"""Parity of pipeline x tensor (x data) parallelism, "3D": PipelineParallelStrategy with tensor_parallel_size > 1
shards each stage's layers with the model's plan; losses and final parameters match one process with the same
seed and global batch within 1e-5 (fp32), with clipping by one global norm and accumulation, also resumed from a
mid-epoch checkpoint; bf16-mixed tracks one process's bf16 run; validation and prediction (the logits crossing the
pipeline split by vocabulary) are one device's too."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed import WORKERS, replica_states, run_workers

sys.path.insert(0, str(WORKERS))
from common import fit_model, local_state  # noqa: E402

STEPS = 20
CLIP = {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
BF16 = {"precision": "bf16-mixed", **CLIP}
FUSED_ADAMW = ("AdamW", {"lr": 1e-3, "fused": True})
ADAMW = ("AdamW", {"lr": 1e-3})


def reference(model: str, global_batch: int, **trainer: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process; `trainer` may also hold `optimizer` (see `fit_model`)."""
    task, losses, _ = fit_model(
        "auto", model=model, devices=1, global_batch=global_batch, replicas=1, steps=STEPS, **trainer
    )
    return losses, local_state(task)


def assert_matches(
    per_rank: list[list[dict]], index: int, ref: tuple[list[float], dict[str, torch.Tensor]], dp: int
) -> None:
    ref_losses, ref_state = ref
    results = [rank[index] for rank in per_rank]
    for result in results:
        assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses, strict=True)) < 1e-5, result["losses"]
    for merged in replica_states(results, dp):  # every replica holds the whole model over its stages
        assert merged.keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-5, msg=name)


def config(model: str, schedule: str, dp: int, trainer: dict | None = None) -> dict:
    return {
        "model": model,
        "devices": dp * 4,
        "global_batch": 16,
        "steps": STEPS,
        "trainer": trainer or {},
        "strategy": {"schedule": schedule, "tensor_parallel_size": 2, "data_parallel_size": dp, "microbatches": 4},
    }


@pytest.mark.slow
def test_pipeline_by_tensor_with_clipping_accumulation_bf16_and_fsdp_replicas(tmp_path: Path) -> None:
    """GPT at pp2 x tp2: SGD with clipping and accumulation (saved, resumed), bf16, FSDP2 replicas, and AdamW with
    its cross-entropy on the logits' vocabulary shards."""
    fsdp = {
        **config("gpt", "1f1b", 1, CLIP),
        "strategy": {"schedule": "1f1b", "data_parallel_size": 2, "replicas": "fsdp", "microbatches": 4},
    }
    saved = {**config("gpt", "1f1b", 1, CLIP), "save": [str(tmp_path / "saved"), 14]}  # 28 of 40 accumulated batches
    resumed = {**config("gpt", "1f1b", 1, CLIP), "ckpt_path": str(tmp_path / "saved" / "step=14.ckpt")}
    adamw = {**config("gpt", "1f1b", 1, {"limit_predict_batches": 2}), "steps": 6, "optimizer": ("AdamW", {"lr": 1e-3})}
    adamw.update(val_batches=2, predict=True)
    configs = [saved, config("gpt", "1f1b", 1, BF16), fsdp, resumed, adamw]  # SimpleCNN: the 8-process test
    per_rank = run_workers("three_d", 4, configs, tmp_path)
    # AdamW, the loss on the logits' vocabulary shards (GPT's head is "vocab_head"): every rank's summary says so;
    # then validated: each batch's logits reach every rank split by vocabulary, the loss runs on the shards and the
    # perplexity metric gathers them (counted), both one device's; predicted logits leave whole
    task, losses, trainer = fit_model("auto", model="gpt", devices=1, global_batch=16, replicas=1, steps=6,
                                      optimizer=adamw["optimizer"], val_batches=2, **adamw["trainer"])  # fmt: skip
    assert_matches(per_rank, 4, (losses, local_state(task)), dp=1)
    val = {key: float(value) for key, value in trainer.validate(task, trainer.datamodule, verbose=False)[0].items()}
    predictions = torch.cat(trainer.predict(task, trainer.datamodule))  # (rows, T, V): predict_step returns logits
    for rank in per_rank:
        assert rank[4]["val"].keys() == val.keys() == {"val/loss", "val/ppl"}, rank[4]["val"]
        assert all(abs(rank[4]["val"][key] - value) < 1e-5 * max(1.0, value) for key, value in val.items()), val
        torch.testing.assert_close(rank[4]["predictions"], predictions, rtol=0, atol=1e-5)  # whole, gathered
        loss = {
            key: rank[4]["parallel"][key] for key in ("vocab_parallel_loss", "vocab_parallel_losses", "logits_gathered")
        }
        assert loss["vocab_parallel_loss"] and loss["vocab_parallel_losses"] == 6 * 4 + 2, loss
        assert loss["logits_gathered"] == 2, loss  # the metric, once a batch
    clipped = reference("gpt", 16, **CLIP)
    assert_matches(per_rank, 0, clipped, dp=1)
    # resumed from the step-14 checkpoint (mid-epoch): the rest of the uninterrupted run
    assert_matches(per_rank, 3, (clipped[0][-len(per_rank[0][3]["losses"]) :], clipped[1]), dp=1)
    assert len(per_rank[0][3]["losses"]) == len(clipped[0]) - 28  # 2 batches per optimizer step
    # dp2 x pp2 with FSDP2 replicas: the same training, each replica holding half of each block's parameters
    assert_matches(per_rank, 2, clipped, dp=2)
    assert per_rank[0][2]["parallel"]["replicas"] == "fsdp"
    shape, whole = per_rank[0][2]["shapes"]["block_0.attn.q.weight"], per_rank[0][2]["state"]["block_0.attn.q.weight"]
    assert shape[0] * 2 == whole.shape[0], (shape, whole.shape)
    # bf16 rounds differently when layers are cut into shards (a row-parallel layer sums bf16 partial products): close,
    # not equal, and cutting the batch as the micro-batches do does not bring it closer (1.5e-4 / 6.3e-4 then).
    # Measured (2026-11-28, CPU, torch 2.13): losses 7.3e-5 and weights 6.6e-4 from one process's bf16 run. That noise
    # hides what bugs would show: one micro-batch's loss scaled by 1.01 moves one process 2.2e-4 / 4.4e-4 (the clipping
    # takes most of it) and the same run in fp32 is 7.7e-5 / 4.2e-4 away. So the bounds are 4x the gap (one micro-batch
    # at 1.05 is 7.7e-4 away: caught, where the old 1e-3 passed it), and the Linear layers of every stage must have
    # computed in bf16 (a stage left out of autocast was 9e-5 / 7.7e-4 from the bf16 run, inside any bound the shards'
    # rounding allows); fp32 weights: assert_close checks the dtype.
    bf16_losses, bf16_state = reference("gpt", 16, **BF16)
    for rank in per_rank:
        gaps = [abs(a - b) for a, b in zip(rank[1]["losses"], bf16_losses, strict=True)]
        assert max(gaps) < 3e-4, gaps
        dtypes = rank[1]["linear_dtypes"], rank[0]["linear_dtypes"]
        assert dtypes == (["bfloat16"], ["float32"]), dtypes  # the bf16 run's Linear outputs, the fp32 run's
    merged = replica_states([rank[1] for rank in per_rank], 1)[0]
    assert merged.keys() == bf16_state.keys()
    for name, value in bf16_state.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=2.5e-3, msg=name)
    parallel = per_rank[0][0]["parallel"]
    assert (parallel["data_parallel_size"], parallel["pipeline_size"], parallel["tensor_parallel_size"]) == (1, 2, 2)
    assert parallel["plan_source"] == "model" and parallel["sharded"]["block_0.attn.q"] == "colwise"
    shapes = {name: shape for rank in per_rank for name, shape in rank[0]["shapes"].items()}
    state = {name: value for rank in per_rank for name, value in rank[0]["state"].items()}
    for name in ("block_0.attn.q.weight", "block_1.mlp.down.weight", "head.lm_head.weight"):  # on both stages
        dim = 1 if "down" in name else 0  # row-parallel layers split their inputs
        assert shapes[name][dim] * 2 == state[name].shape[dim], (name, shapes[name], state[name].shape)
    for rank in per_rank:  # layers were materialised one at a time and sharded at once: never the whole stage
        stage_bytes = sum(t.numel() * t.element_size() for t in rank[0]["state"].values())
        assert 0 < rank[0]["setup_peak"] < stage_bytes, (rank[0]["setup_peak"], stage_bytes)


@pytest.mark.slow
def test_data_by_pipeline_by_tensor_on_eight_processes(tmp_path: Path) -> None:
    """SimpleCNN with fused AdamW and clipping (CUDA's optimizer kernels; SimpleCNN's head stays plain beside
    sharded layers), the GPT with SGD, and with AdamW under FSDP2 replicas, its loss on the logits' vocabulary
    shards, then validated (val/loss and val/ppl one device's)."""
    runs = [("gpt", "1f1b"), ("gpt", "interleaved_1f1b"), ("simple_cnn", "1f1b")]
    configs = [config(model, schedule, 2) for model, schedule in runs]
    configs[0] = {**configs[0], "optimizer": ADAMW, "val_batches": 2}
    configs[0]["strategy"] = {**configs[0]["strategy"], "replicas": "fsdp"}
    configs[2] = {**configs[2], "optimizer": FUSED_ADAMW, "trainer": {"gradient_clip_val": 0.5}}
    per_rank = run_workers("three_d", 8, configs, tmp_path, timeout=600)
    task, losses, trainer = fit_model("auto", model="gpt", devices=1, global_batch=16, replicas=1, steps=STEPS,
                                      optimizer=ADAMW, val_batches=2)  # fmt: skip
    val = {key: float(value) for key, value in trainer.validate(task, trainer.datamodule, verbose=False)[0].items()}
    cnn = {"optimizer": FUSED_ADAMW, "gradient_clip_val": 0.5}
    references = [(losses, local_state(task)), reference("gpt", 16), reference("simple_cnn", 16, **cnn)]
    for index, (model, schedule) in enumerate(runs):
        try:
            assert_matches(per_rank, index, references[index], dp=2)
        except AssertionError as error:
            raise AssertionError(f"{model} {schedule}: {error}") from error
    for rank in per_rank:  # dp2 x pp2 x tp2 under FSDP2: the loss on the logits' shards, gathered only for the metric
        parallel = rank[0]["parallel"]
        assert parallel["replicas"] == "fsdp" and "vocab_parallel_loss_off" not in parallel, parallel
        assert parallel["vocab_parallel_losses"] == STEPS * 4 + 2 and parallel["logits_gathered"] == 2, parallel
        # validated: each replica's half of 2 batches, the logits split by vocabulary over its pp group: one device's
        assert rank[0]["val"].keys() == val.keys() == {"val/loss", "val/ppl"}, rank[0]["val"]
        assert all(abs(rank[0]["val"][key] - value) < 1e-5 * max(1.0, value) for key, value in val.items()), val
    assert per_rank[0][1]["parallel"]["stages_per_rank"] == 2
