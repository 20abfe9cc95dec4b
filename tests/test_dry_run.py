"""The dry run (`lightning_parallel.dryrun`): a layout of 16 ranks set up in this process on the fake process group,
its bytes per role against a direct count, tensor ranks alike, the refusal line and dry_run.json; one CLI run."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import lightning_parallel as lp
from lightning_parallel.dryrun.role import Role, measure_role
from lightning_parallel.dryrun.run import _untried
from lightning_parallel.insight.sweep_report import load_jobs, markdown_table
from lightning_parallel.models import GPT
from lightning_parallel.tasks import LanguageModelTask
from tests.conftest import run_cli

WIDTH, VOCAB, CONTEXT = 32, 64, 16
SHARDED = {  # GPT's tp_plan: the parameters it splits over "tp" (the rowwise biases and the norms stay whole)
    "embed.token.weight", "attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight",
    "attn.v.bias", "attn.proj.weight", "mlp.up.weight", "mlp.up.bias", "mlp.down.weight", "head.lm_head.weight",
}  # fmt: skip


def tiny_task() -> LanguageModelTask:
    with torch.device("meta"):
        network = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=4, width=WIDTH, heads=4)
    return LanguageModelTask(network, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


def tiny_batch(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


def expected_bytes(blocks: list[str], *, tp: int, dp: int) -> int:
    """What a rank holding `blocks` keeps, counted from a real network's shapes: the plan's splits over tp, then
    FSDP2's over dp (every size here divides both)."""
    network = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=4, width=WIDTH, heads=4)
    total = 0
    for name, p in network.named_parameters():
        if name.split(".")[0] in blocks:
            split = tp if any(name.endswith(s) for s in SHARDED) else 1
            total += p.numel() // split // dp * p.element_size()
    return total


@pytest.fixture(scope="module")
def three_d() -> lp.dryrun.DryRun:
    """dp4 x pp2 x tp2 = 16 ranks with FSDP2 replicas, once for the tests below."""
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, replicas="fsdp")
    return lp.dry_run(tiny_task(), strategy, devices=16, batch=tiny_batch())


def test_one_role_per_pipeline_rank_holding_what_a_rank_holds(three_d: lp.dryrun.DryRun) -> None:
    assert [row.role for row in three_d.rows] == ["pp rank 0", "pp rank 1"]
    assert [row.ranks for row in three_d.rows] == [8, 8]
    assert three_d.rows[0].blocks == ["embed", "block_0", "block_1"]
    assert three_d.rows[1].blocks == ["block_2", "block_3", "head"]
    for row in three_d.rows:
        assert row.measured["params"] == expected_bytes(row.blocks, tp=2, dp=4)
        assert row.measured["grads"] == row.measured["params"]  # fp32, every parameter trained
        moments = 2 * row.measured["params"]  # AdamW's two moments, plus a 4-byte step count per parameter tensor
        assert moments < row.measured["optimizer"] <= moments + 4 * 16 * len(row.blocks)
        assert row.measured["total"] >= row.measured["params"] + row.measured["activations"]
        assert row.predicted is not None and row.predicted["grads"] == pytest.approx(row.measured["grads"], rel=0.05)
    assert three_d.rows[1].sharded["head.lm_head"] == "vocab_head"


def test_tensor_ranks_hold_alike() -> None:
    """Why one role stands for every tensor rank: rank 0 and rank 1 of tp2 hold the same bytes."""
    strategy = lp.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)
    task, batch = tiny_task(), tiny_batch()
    strategy._dims = strategy.resolve_dims(2)
    strategy.parallel_devices = [torch.device("cpu")] * 2
    held = [measure_role(task, strategy, Role(0, rank, 1), batch, None) for rank in (0, 1)]
    assert held[0].parameter_bytes == held[1].parameter_bytes == expected_bytes(["embed", "block_0", "block_1",
        "block_2", "block_3", "head"], tp=2, dp=1)  # fmt: skip
    assert held[0].step["peak_total"] == held[1].step["peak_total"]


def test_the_logits_are_counted_split_by_vocabulary_as_a_rank_holds_them() -> None:
    """A large vocabulary and a narrow network, so the logits (and the loss's copies of them) dominate the step: at
    tp2 the GPT's `vocab_head` keeps them split into the loss, and the step's activations about halve. The planner
    counts the task's loss after the network's last block (`planner/loss_block.py`): within 1% at tp1 and tp2 (it
    was 73% and 64% low without it; real CPU launches agree: benchmarks/results/dry_run_vs_launch.md), and so does
    the closed-form GPT (`gpt_workload`; 26% low at tp1 without its loss's backward, 2 copies of the logits)."""
    from lightning_parallel.planner import CostModel, Layout, gpt_workload
    from lightning_parallel.planner.presets import hardware_preset

    vocab, context = 8192, 64
    formula = CostModel(gpt_workload(depth=1, width=32, heads=4, vocab_size=vocab, seq_len=context),
                        hardware_preset("cpu"))  # fmt: skip
    with torch.device("meta"):
        network = GPT(vocab_size=vocab, context_length=context, depth=1, width=32, heads=4)
    task = LanguageModelTask(network, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    tokens = torch.randint(0, vocab, (4, context + 1), generator=torch.Generator().manual_seed(0))
    activations = []
    for tp in (1, 2):
        strategy = lp.TensorParallelStrategy(tensor_parallel_size=tp, data_parallel_size=1)
        result = lp.dry_run(task, strategy, devices=tp, batch=(tokens[:, :-1], tokens[:, 1:]))
        activations.append(result.rows[0].measured["activations"])
        row = result.rows[0]
        assert row.miss is not None and abs(row.miss) < 0.01, (tp, row.measured, row.predicted)
        closed_form = formula.estimate(Layout(dp=1, tp=tp), batch=4).memory["total"]
        assert closed_form == pytest.approx(row.measured["total"], rel=0.01), (tp, closed_form, row.measured)
    logits = 4 * context * vocab * 4  # fp32 bytes of one step's whole logits
    assert activations[0] > 2 * logits  # the logits and the loss's softmax, at least
    assert activations[1] < 0.6 * activations[0], activations


def test_refusal_names_the_role_its_bytes_and_the_limit(three_d: lp.dryrun.DryRun) -> None:
    assert three_d.refusal is None
    limit = three_d.rows[0].measured["total"] - 1
    line = replace(three_d, limit=limit).refusal
    assert line is not None and "\n" not in line
    assert "pp rank 0" in line and str(three_d.rows[0].measured["total"]) in line and f"({limit} bytes)" in line
    assert replace(three_d, limit=max(r.measured["total"] for r in three_d.rows)).refusal is None


def test_the_refusal_suggests_only_what_would_change_the_peak(three_d: lp.dryrun.DryRun) -> None:
    """Its HINT suggested replicas=fsdp where it was set already, and a smaller batch for a set-up peak (parameters
    alone): it names only the options not yet set, and for a set-up peak none that act on the step."""
    step = replace(three_d, limit=three_d.rows[0].measured["total"] - 1).refusal
    assert step is not None and "replicas=fsdp" not in step  # three_d's replicas are FSDP2 already
    assert "HINT: raise the tensor or pipeline size, use activation_checkpointing=full or use a smaller batch" in step
    row = replace(three_d.rows[0], set_up_peak_bytes=three_d.rows[0].measured["total"] + 1)
    set_up = replace(three_d, rows=[row], limit=row.set_up_peak_bytes - 1, untried=("replicas=fsdp", "x=y")).refusal
    assert set_up is not None and "while materialising" in set_up
    assert "HINT: raise the tensor or pipeline size or use replicas=fsdp; a network that does not initialise" in set_up
    assert "batch" not in set_up and "x=y" not in set_up
    tensor = lp.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=8, activation_checkpointing="full")
    cases = [
        (lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 16, ["replicas", "full"]),
        (lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 4, ["full"]),  # one replica
        (lp.PipelineParallelStrategy(pipeline_parallel_size=2, activation_checkpointing="full"), 8, ["replicas"]),
        (tensor, 16, []),  # its replicas are FSDP2 always
    ]
    names = {"replicas": "replicas=fsdp", "full": "activation_checkpointing=full"}
    for strategy, world, expected in cases:
        strategy._dims = strategy.resolve_dims(world)
        assert _untried(strategy) == tuple(names[e] for e in expected), (strategy, world)


def test_train_py_dry_run_writes_its_rows_and_refuses_what_does_not_fit(tmp_path: Path) -> None:
    """One CLI run: 16 ranks (dp4 x pp2 x tp2), nothing launched; dry_run.json and summary.json written, then exit 2
    with one line, since 100 KiB cannot hold a role."""
    run_dir = tmp_path / "run"
    result = run_cli(
        "model=transformer", "model.depth=4", "model.width=32", "model.heads=4", "data=synthetic_tokens",
        "data.batch_size=8", "data.num_samples=64", "strategy=pipeline", "trainer.devices=8", "trainer.num_nodes=2",
        "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=2", "strategy.replicas=fsdp",
        "trainer.accelerator=cpu", "dry_run=true", "dry_run_device_memory=100KB", f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"pp rank \d .* needs .* over the device memory of 100 KiB", errors[0])
    report = json.loads((run_dir / "dry_run.json").read_text())
    assert report["world_size"] == 16 and report["fits"] is False and len(report["rows"]) == 2
    for row in report["rows"]:
        assert set(row["measured"]) == set(row["predicted"]) == {"params", "grads", "optimizer", "activations", "total"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["strategy"].endswith("(dry run)") and len(summary["peak_memory_bytes"]) == 2
    assert "dry run: PipelineParallelStrategy dp4 x pp2 x tp2 on 16 ranks" in result.stderr
    (job,) = load_jobs(run_dir)  # a sweep's job directory: its row in the sweep report
    assert "PipelineParallelStrategy (dry run)" in markdown_table([job])


def test_transformers_llama_from_a_config_without_weights() -> None:
    """A tiny LlamaForCausalLM built on meta, its own tensor plan at tp2 x dp8 (16 ranks): every parameter but the
    norms split over tp, then all over dp by FSDP2 (its traced pipeline: test_dry_run_traced.py)."""
    from tests.hf_modules import HFLlama

    with torch.device("meta"):
        module = HFLlama()
    batch = {"input_ids": torch.randint(0, 64, (8, 16))}
    result = lp.dry_run(module, lp.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=8), devices=16,
                        batch=batch)  # fmt: skip
    (row,) = result.rows
    norms = sum(p.numel() for n, p in module.named_parameters() if "norm" in n)
    others = sum(p.numel() for n, p in module.named_parameters() if "norm" not in n)
    assert row.measured["params"] == (others // 2 + norms) // 8 * 4
    assert row.ranks == 16 and row.predicted is not None and "self_attn" in " ".join(row.sharded)


def test_the_planner_counts_the_logits_a_vocabulary_parallel_loss_holds() -> None:
    """Llama with a 4,096-token vocabulary and a 32-wide layer at tp2, so the logits dominate the step: while the
    vocabulary-parallel loss runs, its input logits (1 MiB a rank) lie beside the exponentials it keeps; the planner
    counts them (`Block.loss_input`) and is within 5% of the dry run's step peak (18.5% low before: one copy of the
    logits short; Llama-3-8B's last pipeline rank at tp2, 2,048 tokens: 501 MiB)."""
    import lightning.pytorch as pl
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.hf_modules import HFLM

    class WideVocabulary(HFLM):
        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
            self.model, self.lr, self.adamw = LlamaForCausalLM(config), 1e-3, True

    with torch.device("meta"):
        module = WideVocabulary()
    batch = {"input_ids": torch.zeros(4, 32, dtype=torch.long)}
    strategy = lp.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_size=1)
    (row,) = lp.dry_run(module, strategy, devices=2, batch=batch).rows
    assert row.miss is not None and abs(row.miss) < 0.05, (row.measured, row.predicted)


def test_fsdp_replicas_keep_few_blocks_gathered_at_the_step_peak() -> None:
    """dp8 x pp2 with FSDP2 replicas: besides its shards, a rank's step peak holds a few whole blocks (the one
    gathered, its gradient and the reduce-scatter's input, the next one prefetched), not its whole stage, which it
    held while each block was an FSDP2 root of its own (kept gathered to backward, its gradient to backward's end)."""
    with torch.device("meta"):
        network = GPT(vocab_size=VOCAB, context_length=8, depth=12, width=256, heads=4)
    task = LanguageModelTask(network, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    tokens = torch.randint(0, VOCAB, (4, 9), generator=torch.Generator().manual_seed(0))
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, replicas="fsdp", microbatches=2)
    result = lp.dry_run(task, strategy, devices=16, batch=(tokens[:, :-1], tokens[:, 1:]))
    block = sum(p.numel() * 4 for p in GPT(vocab_size=VOCAB, context_length=8, depth=1, width=256).block_0.parameters())
    for row in result.rows:
        m = row.measured
        beyond_shards = m["total"] - m["params"] - m["grads"] - m["optimizer"]
        whole_stage = m["params"] * 8
        # 4 blocks (2 gathered, a block's gradients twice) and the step's few activations, not the whole stage
        assert beyond_shards < 5 * block < whole_stage, (row.role, beyond_shards, block, whole_stage)


class BuiltInConfigureModel(LanguageModelTask):
    """The tiny GPT task, its network built in configure_model() (once), as Lightning's docs build large models."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Identity(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        self.model = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=4, width=WIDTH, heads=4)


def test_a_network_built_in_configure_model_is_built_on_meta_for_each_role(three_d: lp.dryrun.DryRun) -> None:
    """configure_model() runs on the meta device on a copy (the user's module keeps no network), and the roles hold
    what they hold when the network is built in __init__; the tensor strategy, which runs the hook instead of a plan,
    is refused in one line."""
    module = BuiltInConfigureModel()
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, replicas="fsdp")
    result = lp.dry_run(module, strategy, devices=16, batch=tiny_batch())
    assert module.model is None
    assert [row.measured for row in result.rows] == [row.measured for row in three_d.rows]
    with pytest.raises(ValueError, match=r"overrides configure_model\(\).*HINT: give the strategy a plan"):
        lp.dry_run(module, lp.TensorParallelStrategy(tensor_parallel_size=2), devices=2, batch=tiny_batch())
