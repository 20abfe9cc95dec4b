"""The dry run of a traced pipeline (a transformers model split by tracing, not an nn.Sequential): each pipeline
rank's bytes against the same rank set up for real in this process, and the network traced once for every rank."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from conftest import needs_torch_2_13

import lightning_parallel as lp
from lightning_parallel.one_process_ranks import fake_rank, local_part
from lightning_parallel.parallelize import parallelize_pipeline
from lightning_parallel.pipeline.traced import TracedNetwork
from lightning_parallel.pipeline.traced_sharing import sharing_traces
from lightning_parallel.planner.presets import hardware_preset
from lightning_parallel.weights import materialize
from tests.hf_modules import HFLM, VOCAB, HFLlama

BATCH = {"input_ids": torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))}


def pipeline(world: int, tp: int = 2) -> lp.PipelineParallelStrategy:
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=tp)
    strategy._dims = strategy.resolve_dims(world)
    strategy.parallel_devices = [torch.device("cpu")] * world
    return strategy


def real_parameter_bytes(pp_rank: int) -> tuple[int, list[str]]:
    """Pipeline rank `pp_rank` of pp2 x tp2 set up on real tensors (a CPU-built Llama, real storage; only the
    collectives are the fake process group's): the bytes of the parameters it keeps, and its blocks."""
    torch.manual_seed(0)
    module = HFLlama()
    strategy = pipeline(4)
    with fake_rank(pp_rank * 2, 4):
        strategy._mesh = strategy.dims.build_mesh("cpu")
        done = parallelize_pipeline(
            module.model, strategy, lambda: strategy._example_inputs(module, BATCH, "training_step") or (None, None)
        )
        held = sum(local_part(p).numel() * local_part(p).element_size() for p in module.parameters())
    assert done.stages is not None and done.stages.traced
    return held, done.stages.partition.blocks_of(pp_rank)


@needs_torch_2_13  # tensor parallelism inside traced stages: refused before 2.13, in a dry run as in a real one
def test_traced_llama_at_pp2_tp2_holds_what_a_real_set_up_holds(monkeypatch) -> None:
    """A tiny LlamaForCausalLM built on meta, pp2 x tp2 as strategy=auto builds it: each role's blocks and parameter
    bytes are those of the same rank set up on real tensors, gradients as many bytes as parameters (each takes its
    parameter's placements), AdamW's two moments; the network is traced once for all roles (4 traces: whole, every
    block, the split on the meta device and on the batch's), not once more per role."""
    with torch.device("meta"):
        module = HFLlama()
    # pp2 x tp2 is what strategy=auto picks for it on 4 devices of 256 KiB (tests/test_auto_any.py): set it up here
    small = hardware_preset("cpu", memory="256KB")
    strategy = lp.AutoStrategy(model=module, data=[BATCH], devices=4, accelerator="cpu", hardware=small)
    assert strategy.auto_choice["layout"] == "dp1 x pp2 x tp2 (1f1b, 4 micro-batches)", strategy.auto_choice
    traces = []
    trace = TracedNetwork._trace
    monkeypatch.setattr(TracedNetwork, "_trace", lambda self, *a, **k: traces.append(1) or trace(self, *a, **k))
    result = lp.dry_run(module, strategy, devices=4, batch=BATCH)
    assert len(traces) == 4, len(traces)
    monkeypatch.undo()
    assert [row.role for row in result.rows] == ["pp rank 0", "pp rank 1"]
    with sharing_traces():  # the real set-ups trace the CPU-built network once between them
        real = [real_parameter_bytes(pp_rank) for pp_rank in range(2)]
    for row, (held, blocks) in zip(result.rows, real, strict=True):
        assert row.blocks == blocks and row.measured["params"] == held, (row.role, row.blocks, row.measured, held)
        assert row.measured["grads"] == row.measured["params"]
        assert 2 * held < row.measured["optimizer"] <= 2 * held + 4 * 64
        assert row.measured["activations"] > 0 and row.sharded  # the stage's layers planned over "tp"
    whole = sum(p.numel() * 4 for p in module.parameters())
    norms = sum(p.numel() * 4 for n, p in module.named_parameters() if "norm" in n)
    # every parameter but the norms is split over tp (Llama's own plan), the two ranks hold the network between them
    assert sum(row.measured["params"] for row in result.rows) == (whole - norms) // 2 + norms


class TiedQwen2(HFLM):
    """Qwen2 with its head tied to the embedding (as Qwen2-0.5B ships), AdamW."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True,
        )  # fmt: skip
        self.model, self.lr, self.adamw = Qwen2ForCausalLM(config), 1e-2, True


@needs_torch_2_13  # labels (integers) cross stages: refused before 2.13
@pytest.mark.parametrize("build", [TiedQwen2, HFLM], ids=["qwen2", "gpt2"])
def test_tied_transformers_model_built_on_meta_splits_at_pp2_with_one_process_values(build) -> None:
    """A tied transformers model built on meta (trainer.init_module()) at pp2: the dry run runs (transformers' own tie
    is left out on the rank holding one end) and each rank set up for real starts from the values one process
    materialises, but rank 0's embedding, which the tie step's broadcast (a no-op here) gives rank 1's value."""
    with torch.device("meta"):
        module = build()
    assert [row.role for row in lp.dry_run(module, pipeline(2, tp=1), devices=2, batch=BATCH).rows] == [
        "pp rank 0",
        "pp rank 1",
    ]
    torch.manual_seed(0)
    with torch.device("meta"):
        whole = build()
    materialize(whole.model, torch.device("cpu"))
    one = dict(whole.model.named_parameters(remove_duplicate=False))
    assert whole.model.lm_head.weight is whole.model.get_input_embeddings().weight  # tied again after materialising
    embedding = next(n for n, p in one.items() if p is whole.model.get_input_embeddings().weight and "lm_head" not in n)
    compared = set()
    with sharing_traces():  # the two set-ups trace the network once between them
        for pp_rank in range(2):
            for name, param in set_up_on_meta(build, pp_rank).named_parameters(remove_duplicate=False):
                if (pp_rank, name) != (0, embedding):  # the tie step gives it the last user's (rank 1's) value
                    assert torch.equal(param, one[name]), (pp_rank, name)
                    compared.add(name)
    assert compared == set(one) - {embedding}, set(one) - compared  # rank 1's head: that one tensor


def set_up_on_meta(build, pp_rank: int) -> torch.nn.Module:
    """Pipeline rank `pp_rank` of pp2 set up from a network built on meta (seed 0); only collectives are fake."""
    torch.manual_seed(0)
    with torch.device("meta"):
        module = build()
    strategy = pipeline(2, tp=1)
    with fake_rank(pp_rank, 2):
        strategy._mesh = strategy.dims.build_mesh("cpu")
        parallelize_pipeline(
            module.model, strategy, lambda: strategy._example_inputs(module, BATCH, "training_step") or (None, None)
        )
    return module.model


@needs_torch_2_13  # tensor parallelism inside traced stages: refused before 2.13
@pytest.mark.parametrize("family", ["gpt2", "gpt_neo"])
def test_transformers_family_dry_runs_at_pp2_tp2_on_padded_text(family) -> None:
    """Built on meta, on padded text (attention mask, -100 labels), pp2 x tp2: GPT-2's fused q/k/v split gathers a
    strided shard (its offsets found on real index tensors, not fake ones: DataDependentOutputException before),
    GPT-Neo's forward creates its mask value from a Python float (zeros of its shape stand in: refused before). Each
    role's parameters are the planner's, cut as the traced stages are, and the two roles hold the whole network."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_families import FamilyLM
    from padded_modules import padded_loader

    with torch.device("meta"):
        module = FamilyLM(family)
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2)
    result = lp.dry_run(module, strategy, devices=4, batch=next(iter(padded_loader())))
    assert [row.role for row in result.rows] == ["pp rank 0", "pp rank 1"]
    for row in result.rows:
        assert row.predicted is not None and row.predicted["params"] == row.measured["params"] > 0, row
        assert row.measured["grads"] == row.measured["params"] and row.measured["activations"] > 0, row
    blocks = [block for row in result.rows for block in row.blocks]
    assert blocks[-1] == "lm_head" and len(set(blocks)) == len(blocks), blocks


def test_the_planner_analyses_a_traced_pipelines_layers_as_their_trace_runs_them() -> None:
    """Under a pipeline transformers' Llama runs as torch.export traced it: its causal mask built (B, 1, T, T) rather
    than SDPA's `is_causal`, so attention repeats the grouped key / value heads and keeps a float copy of the mask.
    The planner's analysis at pp > 1 (`workload_from_call(traced=True)`) counts what that keeps per layer and row:
    k and v at every query head (split by heads) instead of their grouped heads, and the mask (whole); at 2,048
    tokens the mask alone is 16 MiB a layer and sequence (the planner was 10-22% low on traced pipelines there)."""
    from lightning_parallel.planner.call_analysis import workload_from_call
    from lightning_parallel.tensor.hf_plans import transformers_plan
    from lightning_parallel.tensor.plans import expand_plan
    from tests.hf_modules import llama

    network = llama()  # 2 layers, 4 query heads of 8, 2 key / value heads
    styles = expand_plan(network, transformers_plan(network) or {})
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    layers = [
        next(b for b in workload_from_call(network, (), {"input_ids": ids}, styles=styles, traced=t).blocks
             if b.name == "model.layers.1")
        for t in (False, True)
    ]  # fmt: skip
    heads, kv_heads, tokens, size = 4, 2, 8, 8
    repeated = 2 * (heads - kv_heads) * tokens * size  # k and v at every query head, per row
    assert layers[1].activations - layers[0].activations == repeated + tokens * tokens, layers
    assert layers[1].tp_activations - layers[0].tp_activations == repeated, layers


class WideVocabularyLlama(HFLM):
    """Llama with a 4,096-token vocabulary and 32-wide layers, AdamW: the logits and the embedding and head weights
    dominate each pipeline rank's step."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
        self.model, self.lr, self.adamw = LlamaForCausalLM(config), 1e-3, True


@needs_torch_2_13  # HFLM's labels (integers) cross traced stages: refused before 2.13
def test_the_last_stage_holds_its_logits_through_their_backward_and_the_planner_predicts_it() -> None:
    """pp2, 1F1B, 4 micro-batches of 2 x 16 tokens (logits 0.5 MiB each). torch's PipelineStage keeps the last stage's
    output (the logits) in `fwd_cache` until that micro-batch's backward has run, so the last rank's step peaks in the
    loss's backward with four copies: the held logits, the log-softmax the loss saves, its gradient and the logits'.
    A real 2-process run of a 8,192-token version held what the dry run holds (20.09 vs 20.02 MiB; 16.02 without the
    held logits). The planner predicts each rank within 2%: the held logits, the loss's backward, and on micro-batches
    after the first a parameter's new gradient beside the accumulated one (the first rank's embedding: -3.4%
    without)."""
    with torch.device("meta"):
        module = WideVocabularyLlama()
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4)
    batch = {"input_ids": torch.zeros(8, 16, dtype=torch.long)}
    first, last = lp.dry_run(module, strategy, devices=2, batch=batch).rows
    logits = 2 * 16 * 4096 * 4
    assert last.measured["activations"] >= 4 * logits, last.measured
    for row in (first, last):
        assert row.miss is not None and abs(row.miss) < 0.02, (row.role, row.measured, row.predicted)
