"""Padded text trains as on one device: batches padded by their collate function to their own longest sequence
(16, 15 and 16 tokens), padding labelled -100, a last batch of 6 rows instead of 8 (`tests/padded_modules.py`).
Micro-batches and replicas hold different numbers of valid tokens; the losses of every step (the mean over replicas
under data parallelism, whose ranks each return their share), the logged `train_loss` (sync_dist=True) and the final
weights match one device within 1e-5, for a transformers GPT-2 computing its loss from labels and for
`F.cross_entropy(..., ignore_index=-100)` / `nn.CrossEntropyLoss` in training_step: under the pipeline's gpipe, 1f1b,
interleaved_1f1b and interleaved_zero_bubble, DDP, FSDP2 replicas, tp2 and dp2 x pp2; with class weights and the pad
id as `ignore_index` (not -100) under 1f1b, DDP and tp2. A hand-written masked mean gets one warning line on rank 0.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from conftest import needs_torch_2_13  # noqa: E402

TOL = 1e-5
STEPS = 3  # every batch of the epoch: 8 rows of 16 tokens, 8 of 15, 6 of 16
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"]
EXACT = ["gpt2", "functional", "criterion", "weighted"]
SCHEDULED = EXACT[:3]  # under every schedule; "weighted" (class weights, ignore_index=0) under 1f1b only
TOKEN_PLAN = {"1": "colwise", "3": "rowwise", "5": "vocab_head"}  # padded_modules.token_network's head is "5"
GPT2_PLAN = {"transformer.wte": "vocab_parallel", "lm_head": "vocab_head"}  # the head tied to the embedding
VOCAB_PLANS = [TOKEN_PLAN, GPT2_PLAN]
WARNED = "is averaged as"  # what the one line for a loss that cannot be made exact says
AVERAGED_LOGS = "per micro-batch: each is logged as the mean"  # the one line for other values logged in the step


def pipeline(name: str, schedule: str, **extra: Any) -> dict[str, Any]:
    """GPT-2 validates too: its `out.loss` over a forward-only schedule's micro-batches must be the batch's."""
    strategy = {"schedule": schedule, "microbatches": 4}
    return {"name": name, "devices": 2, "steps": STEPS, "strategy": strategy, "validate": name == "gpt2", **extra}


# One launch of 2 processes for every layout of 2 (per replica, batches of 8 / replicas rows)
TWO = [
    *(pipeline(name, schedule) for name in SCHEDULED for schedule in SCHEDULES),
    pipeline("weighted", "1f1b"),
    pipeline("functional", "1f1b", steps=2, trainer={"accumulate_grad_batches": 2}),  # 2 batches, then the last
    pipeline("masked_mean", "1f1b"),
    *({"name": name, "devices": 2, "steps": STEPS, "batch_size": 4, "kind": "ddp", "validate": name == "gpt2"}
      for name in [*EXACT, "masked_mean"]),  # GPT-2 validates: each rank's 4 rows of the padded batch of 8
    {"name": "functional", "devices": 2, "steps": STEPS, "batch_size": 4, "kind": "tensor",
     "strategy": {"data_parallel_size": 2, "tensor_parallel_size": 1}},  # FSDP2 replicas
    *({"name": name, "devices": 2, "steps": STEPS, "kind": "tensor",
       "strategy": {"tensor_parallel_size": 2, "plan": "auto"}} for name in ("functional", "weighted")),  # gathered
    # the LM head sharded by vocabulary: the loss read from its shards, whatever else reads the logits gathered
    *({"name": name, "devices": 2, "steps": STEPS, "kind": "tensor",
       "strategy": {"tensor_parallel_size": 2, "plan": plan}}
      for name, plan in [("functional", TOKEN_PLAN), ("criterion", TOKEN_PLAN), ("accuracy", TOKEN_PLAN),
                         ("gpt2", GPT2_PLAN)]),
]  # fmt: skip


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    from distributed import run_workers

    return run_workers("padded_text", 2, TWO, tmp_path_factory.mktemp("padded"))


def one_device(config: dict[str, Any]) -> dict[str, Any]:
    """The same module on one device with the whole batches (in the order DDP reads them, for DDP)."""
    from padded_modules import fit, shuffled_order

    order = shuffled_order() if config.get("kind") == "ddp" else None
    return fit(
        config["name"], strategy="auto", devices=1, steps=config["steps"], order=order,
        validate=config.get("validate", False), **config.get("trainer", {}),
    )  # fmt: skip


def assert_matches(config: dict[str, Any], results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    """Each step's loss (averaged over the ranks of replicas: each returns its share), the logged train_loss and
    every rank's weights equal one device's; returns the largest difference."""
    replicated = config.get("kind") == "ddp" or config.get("strategy", {}).get("data_parallel_size", 1) > 1
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in results), strict=True)]
    if not replicated:
        losses = results[0]["losses"]
        assert all(r["losses"] == losses for r in results)  # broadcast from the last stage, or computed alike
    assert len(losses) == len(ref["losses"]) >= config["steps"]
    worst = max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True))
    for result in results:
        worst = max(worst, abs(result["metrics"]["train_loss"] - ref["metrics"]["train_loss"]))
        for name, value in result["state"].items():
            worst = max(worst, float((value - ref["state"][name]).abs().max()))
    assert worst < TOL, (config, losses, ref["losses"])
    return worst


def warned(result: dict[str, Any]) -> list[str]:
    return [line for line in result["warnings"] if WARNED in line]


@needs_torch_2_13
@pytest.mark.slow
def test_pipeline_schedules_match_one_device_on_padded_batches(two_processes: list[list[dict[str, Any]]]) -> None:
    refs: dict[str, dict[str, Any]] = {}
    for index, config in enumerate(TWO):
        if config.get("kind") is not None or config["name"] not in EXACT:
            continue
        key = f"{config['name']} {config.get('trainer')}"
        refs[key] = refs.get(key) or one_device(config)
        results = [rank[index] for rank in two_processes]
        worst = assert_matches(config, results, refs[key])
        assert not any(warned(result) for result in results), config
        # train_loss is the returned loss (each micro-batch's share): not named as a mean of micro-batch values
        assert not any(AVERAGED_LOGS in line for result in results for line in result["warnings"]), config
        if config["validate"]:  # padded validation batches: the loss over each batch's valid labels, as one device's
            assert "val_loss" in refs[key]["metrics"]
            for result in results:
                assert abs(result["metrics"]["val_loss"] - refs[key]["metrics"]["val_loss"]) < TOL, config
        print(f"pipeline {config['name']} {config['strategy']['schedule']} {config.get('trainer', '')}: {worst:.1e}")


@needs_torch_2_13  # the one launch it shares runs GPT-2's labels through pipeline stages
@pytest.mark.slow
def test_replicas_and_tensor_parallelism_match_one_device_on_padded_batches(
    two_processes: list[list[dict[str, Any]]],
) -> None:
    for index, config in enumerate(TWO):
        if (
            config.get("kind") is None
            or config["name"] not in EXACT
            or config.get("strategy", {}).get("plan") in VOCAB_PLANS
        ):
            continue
        results = [rank[index] for rank in two_processes]
        ref = one_device(config)
        worst = assert_matches(config, results, ref)
        assert not any(warned(result) for result in results), config
        if config.get("validate"):  # DDP's validation loss over the replicas' rows together, as one device's
            for result in results:
                assert abs(result["metrics"]["val_loss"] - ref["metrics"]["val_loss"]) < TOL, config
        print(f"{config['kind']} {config['name']} {config.get('strategy', '')}: {worst:.1e}")


@needs_torch_2_13  # the one launch it shares runs GPT-2's labels through pipeline stages
@pytest.mark.slow
def test_the_vocabulary_parallel_loss_matches_one_device_and_gathers_for_anything_else(
    two_processes: list[list[dict[str, Any]]],
) -> None:
    """tp2 with the head sharded by vocabulary: `F.cross_entropy`, `nn.CrossEntropyLoss` and GPT-2's loss from labels
    ran on the logits' shards (summary.json says so); an accuracy from their argmax gathered them, the loss did not."""
    seen = set()
    for index, config in enumerate(TWO):
        if config.get("strategy", {}).get("plan") not in VOCAB_PLANS:
            continue
        results = [rank[index] for rank in two_processes]
        worst = assert_matches(config, results, one_device(config))
        described = results[0]["parallel"]
        assert described["vocab_parallel_loss"] and described["vocab_parallel_losses"] == STEPS, described
        assert described["logits_gathered"] == (STEPS if config["name"] == "accuracy" else 0), described
        assert abs(results[0]["metrics"].get("train_acc", 0) - one_device(config)["metrics"].get("train_acc", 0)) < TOL
        seen.add(config["name"])
        print(f"tp2 vocabulary-parallel {config['name']}: {worst:.1e}")
    assert seen == {"functional", "criterion", "accuracy", "gpt2"}


@needs_torch_2_13
@pytest.mark.slow
def test_a_hand_written_masked_mean_is_named_in_one_line_on_rank_zero(
    two_processes: list[list[dict[str, Any]]],
) -> None:
    for index, config in enumerate(TWO):
        if config["name"] != "masked_mean":
            continue
        first, second = (rank[index] for rank in two_processes)
        (line,) = warned(first)  # once, at the first step, on rank 0 only
        assert not warned(second) and "\n" not in line and "HINT" in line
        assert "TokenClassifier.training_step's loss (cross_entropy(reduction='none'))" in line
        averaged = "the mean of 2 replicas' losses" if config.get("kind") == "ddp" else "the mean of 4 micro-batches'"
        assert averaged in line, line
        ref = one_device(config)  # and it does differ: the case the line is about
        assert max(float((value - ref["state"][name]).abs().max()) for name, value in first["state"].items()) > 1e-4


@pytest.mark.slow
def test_data_by_pipeline_parallelism_matches_one_device_on_padded_batches(tmp_path: Path) -> None:
    """dp2 x pp2 on 4 processes: each replica's last stage counts its micro-batches (of 3 rows in the short batch: one,
    on gpipe), one all-reduce totals them; and pp2 x tp2 with the head sharded by vocabulary. `F.cross_entropy` only:
    GPT-2 here would double this test's time (it traces per shape on 4 processes), and its labels are counted per
    micro-batch and totalled by the same code."""
    from distributed import run_workers

    strategy = {"schedule": "1f1b", "microbatches": 2, "data_parallel_size": 2}
    config = {**pipeline("functional", "1f1b"), "devices": 4, "batch_size": 4, "strategy": strategy}
    # and pp2 x tp2, the head sharded by vocabulary: each micro-batch's share of the token mean on the logits' shards
    three_d = {**pipeline("functional", "1f1b"), "devices": 4}
    three_d["strategy"] = {**three_d["strategy"], "tensor_parallel_size": 2, "plan": TOKEN_PLAN}
    ranks = run_workers("padded_text", 4, [config, three_d], tmp_path)
    results = [rank[0] for rank in ranks]
    ref = one_device(config)
    assert {**results[0]["state"], **results[1]["state"]}.keys() == ref["state"].keys()  # replica 0's two stages
    print(f"dp2 x pp2 functional: {assert_matches(config, results, ref):.1e}")
    results = [rank[1] for rank in ranks]
    print(f"pp2 x tp2 functional, vocabulary-parallel: {assert_matches(three_d, results, ref):.1e}")
    assert all(r["parallel"]["vocab_parallel_loss"] and not r["parallel"]["logits_gathered"] for r in results)


@pytest.mark.slow
def test_replicas_that_disagree_on_the_token_mean_call_end_in_one_line_not_a_hang(tmp_path: Path) -> None:
    """DDP: rank 1's second step computes its loss by hand while rank 0's calls F.cross_entropy, whose count the
    replicas total, and then waits in its own collective (sync_dist logging). Rank 0 finds it there through its
    heartbeat and ends the run with one line naming both ranks, long before the collective timeout (20 s) would."""
    import time

    from distributed import run_workers

    timeout = 20
    config = {"name": "branching", "devices": 2, "steps": STEPS, "batch_size": 4, "kind": "ddp"}
    with pytest.raises(AssertionError, match=r"ranks \[.*\] failed"):
        run_workers("padded_text", 2, [{**config, "strategy": {"timeout": timeout}}], tmp_path, timeout=120)
    branched = re.search(r"branch taken at ([0-9.]+)", (tmp_path / "rank1.log").read_text())
    assert branched is not None
    seconds = time.time() - float(branched.group(1))
    line = "Branching.training_step: rank(s) [0] computed step 1's mean over valid targets"
    logs = "".join((tmp_path / f"rank{rank}.log").read_text() for rank in (0, 1))
    assert line in logs and "and rank(s) [1] did not (rank 0 waited" in logs, logs[-3000:]
    assert seconds < timeout, f"the run ended {seconds:.0f} s after the branch (collective timeout {timeout} s)"


def test_values_logged_in_a_pipelined_step_other_than_its_loss_are_named_in_one_line() -> None:
    """A token accuracy logged per micro-batch is replayed as the mean of the micro-batches' values: named once;
    the returned loss (each micro-batch's share of the batch's mean) and Metrics (their states add up) are not."""
    from lightning_parallel.strategies.step_logs import LogRecord, averaged_logs_line

    def micro(accuracy: float) -> list[LogRecord]:
        loss = LogRecord("train_loss", 2.0, {}, is_loss=True)
        return [loss, LogRecord("train_acc", accuracy, {}), LogRecord("acc_metric", 0.5, {}, metric="accuracy")]

    line = averaged_logs_line("MyModule.training_step", [micro(0.5), micro(0.25)])
    assert line is not None and "\n" not in line and "HINT: " in line
    assert line.startswith("MyModule.training_step logs train_acc per micro-batch: each is logged as the mean of its 2")
    assert averaged_logs_line("M.training_step", [micro(0.5)]) is None  # one micro-batch: the batch's own value
    assert averaged_logs_line("M.training_step", [micro(0.5)[:1], micro(0.25)[:1]]) is None  # the loss only
