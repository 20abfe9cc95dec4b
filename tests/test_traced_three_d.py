"""Tensor parallelism inside traced pipeline stages ("3D" for any network): user-style LightningModules whose
networks have their own forward (a residual CNN; Hugging Face GPT-2 called positionally, with a plan given; a Qwen2
whose embedding is tied to its head across the stages, under its own plan) train at pp2 x tp2 (and a CNN at
dp2 x pp2 x tp2) exactly as one process does: losses and final weights within 1e-5. In one process: how a parameter
tied across stages is sharded (alike on every holder, or whole with the reason), dropout after a row-parallel
layer (its partial sums reduced first, one mask on every rank), and a traced Llama's and GPT-2's weight gradients
(shards, never whole-sized; attention by each rank's heads)."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import needs_torch_2_13
from distributed import replica_states, run_workers

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import causal_lm  # noqa: E402
from user_modules import CausalLM, build, fit, loader, tiny_gpt2, token_loader  # noqa: E402

from lightning_parallel import PipelineParallelStrategy  # noqa: E402
from lightning_parallel.parallelize.tied_plan import settle_tied  # noqa: E402
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
    if net in ("gpt2", "qwen2_tied"):
        module = CausalLM(tiny_gpt2() if net == "gpt2" else causal_lm(net))
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
    nets = ["residual_cnn", "gpt2", "qwen2_tied"]
    configs = [config(nets[0], microbatches=1, schedule="gpipe"), config(nets[1], plan=GPT2_PLAN), config(nets[2])]
    ranks = run_workers("traced_tensor", 4, configs, tmp_path)
    runs = list(zip(*ranks, strict=True))
    for index, net in enumerate(nets):
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
    # Qwen2 (its own plan, no override): the embedding and the head tied to it on the other stage, both split by
    # vocabulary rows, their gradients summed shard by shard; nothing kept whole
    qwen2 = runs[2]
    assert qwen2[0]["parallel"]["plan_source"] == "model" and "replicated_why" not in qwen2[0]["parallel"], qwen2[0]
    assert qwen2[0]["shapes"]["model.model.embed_tokens.weight"] == (32, 32), qwen2[0]["shapes"]  # (vocab / 2, C)
    assert qwen2[-1]["shapes"]["model.lm_head.weight"] == (32, 32), qwen2[-1]["shapes"]
    # the last stage hands its logits on split by vocabulary: the step's F.cross_entropy runs on the shards, and
    # nothing gathers them (not the stage's output, not the loss)
    loss = qwen2[-1]["parallel"]
    assert loss["vocab_parallel_loss"] and loss["logits_gathered"] == 0, loss


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


def test_a_parameter_tied_across_traced_stages_is_sharded_alike_or_kept_whole_with_the_reason() -> None:
    """An embedding tied to the head on another stage: split by vocabulary rows by both (their gradients are then
    summed shard by shard), else kept whole by both, the plan's other entries untouched and the reason recorded."""
    network = torch.nn.ModuleDict({"emb": torch.nn.Embedding(8, 4), "head": torch.nn.Linear(4, 8, bias=False)})
    network["head"].weight = network["emb"].weight
    network["mlp"] = torch.nn.Linear(4, 4)
    tied = [TiedGroup(("emb.weight", "head.weight"), (0, 1), 1, (8, 4), torch.float32)]
    both_rows = {"emb": "vocab_parallel", "head": "colwise", "mlp": "colwise"}
    (_, plan, whole), groups = settle_tied(network, ("model", both_rows, {}), tied)
    assert plan == both_rows and not whole and groups[0].shard_dim == 0
    assert groups[0].local_shape(1, 2) == (4, 4) and groups[0].local_shape(2, 3) == (2, 4)  # torch.chunk's sizes
    for differing in ({"emb": "vocab_parallel", "head": "rowwise"}, {"head": "colwise"}):
        (_, plan, whole), groups = settle_tied(network, ("model", {**differing, "mlp": "colwise"}, {}), tied)
        assert plan == {"mlp": "colwise"} and groups[0].shard_dim is None, plan
        assert set(whole) == set(differing) and "tied across pipeline stages" in whole["head"], whole
    (_, plan, whole), groups = settle_tied(network, ("model", {"mlp": "colwise"}, {}), tied)
    assert plan == {"mlp": "colwise"} and not whole and groups[0].shard_dim is None


def test_dropout_after_a_row_parallel_layer_in_a_traced_stage_drops_the_reduced_sum() -> None:
    """A row-parallel layer's output was a Partial DTensor in traced stages (a planned one's is now summed in the
    layer); dropout on partial sums (GPT-2's `resid_dropout`) has no DTensor rule (`aten.bernoulli_` on a Partial):
    the sum is reduced first, then dropped alike on every rank, and a partial gradient is summed on its way back (as
    a planned layer's input: the matmul making the sum would build a whole-sized weight gradient from it).
    On 4 processes, GPT-2 with dropout 0.1 at pp2 x tp2 gave pp2's losses exactly (4.16580, 4.14928)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from lightning_parallel.one_process_ranks import simulated_ranks
    from lightning_parallel.tensor.traced_stages import _REPLACED

    aten = torch.ops.aten
    with simulated_ranks(2) as mode:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parts = mode.rank_map(lambda rank: torch.full((64, 8), 1.0 + rank))  # each rank's partial sum: 1 and 2
        x = DTensor.from_local(parts, mesh, [Partial()], run_check=False).detach().requires_grad_()
        dropped = _REPLACED[aten.dropout.default](x, 0.5, True)
        out, mask = _REPLACED[aten.native_dropout.default](x, 0.5, True)
        assert dropped.placements == out.placements == (Replicate(),)
        for value in (dropped, out):
            ranks = value.to_local()._local_tensors.values()  # type: ignore[attr-defined]
            first, *others = ranks
            assert all(torch.equal(first, other) for other in others)  # one mask on every rank
            assert set(first.unique().tolist()) == {0.0, 6.0}  # the sum 3, kept at 3 / (1 - 0.5), or dropped
        dropped.backward(DTensor.from_local(torch.ones(64, 8), mesh, [Partial()], run_check=False))
        assert x.grad is not None and x.grad.placements == (Replicate(),), x.grad  # summed: Partial without


@needs_torch_2_13  # labels (integers) cross traced stages: refused before 2.13
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_planned_weights_gradients_in_traced_stages_at_tp2_are_shards_never_whole(family: str) -> None:
    """A traced Llama (planned `aten.linear`s) and GPT-2 (transformers' `Conv1D`: `aten.addmm` on a weight stored
    (in, out), its q | k | v an interleaved shard) at pp2 x tp2 in one process, each under its own plan: every matmul
    in backward that makes a planned weight's gradient makes this rank's shard (a Partial or Replicate of a weight's
    whole shape was 2 x a Llama-3-70B tp8 MLP weight per rank; GPT-2's c_attn and attention c_proj were whole), each
    gradient is placed like its weight, and each is one device's; a Llama's attention runs on each rank's heads
    (nothing is all-gathered, forward or backward)."""
    from contextlib import nullcontext

    from hf_modules import VOCAB, gpt2, one_layer_llama, padded
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_parallel.one_process_ranks import simulated_ranks
    from lightning_parallel.parallelize.plan import resolve_stage_plan
    from lightning_parallel.pipeline.call import network_call
    from lightning_parallel.pipeline.traced import TracedNetwork
    from lightning_parallel.tensor.sharded_logits import ShardedLogits
    from lightning_parallel.tensor.traced_stages import distribute_planned, stages_on_mesh

    aten = torch.ops.aten

    class Matmuls(TorchDispatchMode):
        """(shape, placements) of each DTensor a matmul makes."""

        def __init__(self) -> None:
            super().__init__()
            self.made: list[tuple[tuple[int, ...], tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func in (aten.mm.default, aten.addmm.default) and isinstance(out, DTensor):
                self.made.append((tuple(out.shape), out.placements))
            return out

    # planned weights (Llama: q k v o, gate up down, the head, the embedding; GPT-2: c_attn c_proj c_fc c_proj) and
    # the matmuls in backward at least (2 per planned linear or Conv1D)
    build, weights, matmuls = {"llama": (one_layer_llama, 9, 14), "gpt2": (lambda: gpt2(layers=1), 4, 8)}[family]
    torch.manual_seed(0)
    one = build()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    call, inputs = network_call(one, (), {"input_ids": ids, "labels": padded(ids)})
    one(input_ids=ids, labels=padded(ids), use_cache=False).loss.backward()
    traced, (_, plan, _) = TracedNetwork(one, inputs, call), resolve_stage_plan(one, None, 2)
    split = [traced.blocks[:3], traced.blocks[3:]]
    traced.stage_modules(split, [0, 1], inputs, one)  # traced out here: torch.export does not run in the simulation
    with simulated_ranks(2):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        network = build()
        network.load_state_dict(one.state_dict())
        for name, style in plan.items():
            distribute_planned(network.get_submodule(name), style, mesh)
        heads = [name for name, style in plan.items() if style == "vocab_head"]
        stages, _ = stages_on_mesh(traced.stage_modules(split, [0, 1], inputs, network), None, mesh, heads)
        # CommDebugMode under the simulation fails on GPT-2's stage output (a LocalTensor inside it): Llama only
        comm = CommDebugMode() if family == "llama" else None
        with ShardedLogits(), comm or nullcontext():
            loss = stages[1](*stages[0](*inputs))[0]
            with Matmuls() as backward:
                loss.backward()
        # attention by each rank's heads (traced_attention.py): q, k, v are never gathered (3 all-gathers whole)
        assert comm is None or not [op for op in comm.get_comm_counts() if "all_gather" in str(op)], comm
        planned = {n: p for n, p in network.named_parameters() if isinstance(p, DTensor) and p.dim() == 2}
        assert len(planned) == weights, sorted(planned)
        whole = {shape for p in planned.values() for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
        shards = {p.placements for p in planned.values()} | {(Shard(0),), (Shard(1),)}
        made_whole = [(shape, placed) for shape, placed in backward.made if shape in whole and placed not in shards]
        assert len(backward.made) >= matmuls and not made_whole, made_whole
        for name, parameter in planned.items():
            grad = parameter.grad
            assert isinstance(grad, DTensor) and grad.placements == parameter.placements, (name, grad)
            gap = (grad.full_tensor() - one.get_parameter(name).grad).abs().max()
            assert all(float(value) < 1e-6 for value in gap._local_tensors.values()), name  # type: ignore[attr-defined]
