"""transformers' models under tensor parallelism, in one process: every transformers style name runs as one of our
rows or is refused in one line before launch; Llama's own plan is composed as transformers composes it; the structural
planner's choices on GPT-2, BERT, ViT and our GPT; a sharded GPT-2's local shapes and tied parameters on a fake
group. The parity runs on 2, 4 and 8 processes: test_hf_tensor.py."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import fake_world, needs_torch_2_13
from torch import nn

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_modules import HFLlama, bert, gpt2, llama, token_loader, vit  # noqa: E402

from lightning_parallel import TensorParallelStrategy  # noqa: E402
from lightning_parallel.models import GPT  # noqa: E402
from lightning_parallel.parallelize.plan import resolve_plan  # noqa: E402
from lightning_parallel.tensor.hf_plans import TRANSFORMERS_STYLES, compose_plan, transformers_plan  # noqa: E402
from lightning_parallel.tensor.packed import copy_back, savable  # noqa: E402
from lightning_parallel.tensor.plans import apply_plan, expand_plan, retie  # noqa: E402
from lightning_parallel.tensor.structure import structural_plan  # noqa: E402
from lightning_parallel.tensor.styles import STYLE_TRAITS, TRANSFORMERS_REFUSED  # noqa: E402


def plan_of(network: nn.Module, tp: int = 2, plan: Any = None) -> tuple[str, dict[str, str], dict[str, str]]:
    return resolve_plan(network, plan, tensor_parallel_size=tp, sequence_parallel=False)


def layer0(plan: dict[str, str], prefix: str) -> dict[str, str]:
    """The plan's entries for the first layer, by name relative to it."""
    return {name.removeprefix(prefix): style for name, style in plan.items() if name.startswith(prefix)}


# ---- transformers' style names and plans ------------------------------------------------------------------------
def test_every_transformers_style_is_run_by_a_row_or_refused_with_a_reason() -> None:
    """Read from the installed transformers: a style added there fails here until it is mapped or refused."""
    import transformers.distributed.expert_parallel  # noqa: F401 - registers its styles in the same registry
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    installed = set(ALL_PARALLEL_STYLES)
    assert installed == set(TRANSFORMERS_STYLES) | set(TRANSFORMERS_REFUSED)
    assert not set(TRANSFORMERS_STYLES) & set(TRANSFORMERS_REFUSED)
    assert all(ours in STYLE_TRAITS for ours in TRANSFORMERS_STYLES.values())
    # transformers' meaning, ours: their gathered / replicated-output column styles are one row, and so on
    assert TRANSFORMERS_STYLES["colwise_gather_output"] == TRANSFORMERS_STYLES["colwise_rep"] == "colwise_gather"
    assert TRANSFORMERS_STYLES["embedding_rowwise"] == "vocab_parallel"
    assert TRANSFORMERS_STYLES["rowwise_split_input"] == TRANSFORMERS_STYLES["rowwise_rep"] == "rowwise_split_input"


@pytest.mark.parametrize("style", sorted(TRANSFORMERS_REFUSED))
def test_a_style_no_row_runs_is_one_line_naming_the_module_and_the_style(style: str) -> None:
    model = llama()
    model._tp_plan = {**model.tp_plan, "model.layers.*.mlp": style}  # past transformers' own check of the name
    with pytest.raises(ValueError, match=rf"maps model\.layers\.0\.mlp to transformers' style '{style}'") as raised:
        plan_of(model)
    assert "cannot run yet" in str(raised.value) and "HINT" in str(raised.value) and "\n" not in str(raised.value)


def test_an_unrunnable_style_stops_the_trainer_before_launch() -> None:
    module = HFLlama()
    module.model.tp_plan = {**module.model.tp_plan, "model.layers.*.mlp.experts": "moe_tp_experts"}
    module.model.model.layers[0].mlp.add_module("experts", nn.Linear(2, 2))  # a module the entry names
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=TensorParallelStrategy(tensor_parallel_size=2), max_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.experts to transformers' style 'moe_tp_experts'"
    ) as e:
        trainer.fit(module, train_dataloaders=token_loader())  # raised in this process: no rank was started
    assert "\n" not in str(e.value)


def test_llama_family_plans_are_composed_as_transformers_composes_them_and_translated() -> None:
    """The class's `_tp_plan` (lm_head) + `config.base_model_tp_plan` under `model.` + the vocabulary-parallel input
    embedding transformers adds, equal to transformers' own `tp_plan`; Mistral and Qwen2 ship the same plan."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 64}  # fmt: skip
    models = [llama(), MistralForCausalLM(MistralConfig(**sizes)), Qwen2ForCausalLM(Qwen2Config(**sizes))]
    for model in models:
        assert compose_plan(model) == model.tp_plan
        source, plan, _ = plan_of(model)
        assert source == "model", type(model).__name__
        assert plan["model.embed_tokens"] == "vocab_parallel" and plan["lm_head"] == "vocab_head"
        assert layer0(plan, "model.layers.0.") == {
            "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }  # fmt: skip
    assert (
        transformers_plan(GPT(vocab_size=16, context_length=8)) is None
    )  # not a transformers model: its own tp_plan is ours already


def test_grouped_query_attention_keeps_whole_key_value_heads_per_rank() -> None:
    """2 key/value heads of 8: tp2 gives each rank one; tp4 cannot, refused before anything is sharded."""
    model = llama()
    plan_of(model, tp=2)
    with pytest.raises(ValueError, match=r"k_proj \(Linear, colwise\) has attention heads 2, not divisible by") as e:
        plan_of(model, tp=4)
    assert "\n" not in str(e.value)


# ---- structural plans ---------------------------------------------------------------------------------------------
def test_the_structural_plan_of_gpt2_splits_whole_heads_of_its_fused_attention() -> None:
    source, plan, replicated = plan_of(gpt2())
    assert source == "structure"  # transformers ships GPT-2 with an empty plan; torch.fx cannot trace it
    assert layer0(plan, "transformer.h.0.") == {
        "attn": "local_heads", "attn.c_attn": "qkv_colwise", "attn.c_proj": "rowwise",
        "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise",
    }  # fmt: skip
    assert len(plan) == 4 * 5  # every block alike
    assert {"transformer.wte", "lm_head", "transformer.h.0.ln_1"} <= replicated.keys()


def test_the_structural_plans_of_bert_vit_llama_and_our_gpt() -> None:
    _, plan, replicated = plan_of(bert())
    assert layer0(plan, "bert.encoder.layer.0.") == {
        "attention.self": "local_heads", "attention.self.query": "colwise", "attention.self.key": "colwise",
        "attention.self.value": "colwise", "attention.output.dense": "rowwise", "intermediate.dense": "colwise",
        "output.dense": "rowwise",
    }  # fmt: skip
    assert {"bert.pooler.dense", "classifier"} <= replicated.keys()
    source, plan, _ = plan_of(vit())
    assert source == "structure" and layer0(plan, "vit.layers.0.") == {
        "attention": "local_heads", "attention.q_proj": "colwise", "attention.k_proj": "colwise",
        "attention.v_proj": "colwise", "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise",
    }  # fmt: skip
    source, plan, _ = plan_of(llama(), plan="auto")  # its own plan set aside: grouped-query attention, SwiGLU
    assert source == "structure" and layer0(plan, "model.layers.0.") == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
    }  # fmt: skip
    ours = GPT(vocab_size=16, context_length=8, depth=2, width=16, heads=2)
    found = structural_plan(ours, tensor_parallel_size=2)
    assert found is not None and found.plan == {  # what its authors wrote, minus vocabulary and sequence entries
        name: style for name, style in expand_plan(ours, GPT.tp_plan).items() if style in ("colwise", "rowwise")
    }
    assert structural_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), tensor_parallel_size=2) is None


def test_heads_that_do_not_divide_leave_the_attention_whole_with_the_reason() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    three = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=24, n_head=3, vocab_size=64, n_positions=16))
    found = structural_plan(three, tensor_parallel_size=2)
    assert found is None  # no attention to shard: the fx planner is asked next, which cannot trace GPT-2
    # then the MLP pairs alone (as for Falcon, Bloom, GPTBigCode), the attention whole with the reason
    source, plan, whole = plan_of(three)
    assert source == "structure" and plan == {
        "transformer.h.0.mlp.c_fc": "colwise",
        "transformer.h.0.mlp.c_proj": "rowwise",
    }
    assert whole["transformer.h.0.attn.c_attn"] == "3 heads of 8 features are not divisible by tensor_parallel_size 2"
    no_mlp = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=24, n_inner=24, n_head=3, vocab_size=64, n_positions=16))
    with pytest.raises(ValueError, match="torch.fx cannot trace GPT2LMHeadModel") as raised:
        plan_of(no_mlp)  # an MLP as wide as the model is not recognised: nothing to shard, the trace's line
    assert "\n" not in str(raised.value)
    mlp_only = structural_plan(three, tensor_parallel_size=3)  # 3 heads, 3 ranks: whole heads again
    assert mlp_only is not None and mlp_only.plan["transformer.h.0.attn.c_attn"] == "qkv_colwise"


@needs_torch_2_13  # GPT-2's fused q | k | v split by heads is refused before 2.13
def test_a_sharded_gpt2_holds_its_heads_and_computes_with_local_counts() -> None:
    """On a fake 2-rank group: the interleaved q | k | v shard, the local head count and width, one forward whose
    views and splits fit the local shapes (the values need peers; the shapes do not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    model = gpt2()
    _, plan, _ = plan_of(model)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        apply_plan(model, plan, mesh, sequence_parallel=False)
        attn = model.transformer.h[0].attn
        assert (attn.num_heads, attn.split_size, attn.embed_dim, attn.head_dim) == (2, 16, 16, 8)
        weight = attn.c_attn.weight
        assert isinstance(weight, DTensor) and weight.placements == (_StridedShard(1, split_factor=3),)
        assert weight.to_local().shape == (32, 48)  # (in, q | k | v of 2 heads of 8)
        logits = model(input_ids=torch.zeros(2, 16, dtype=torch.long)).logits
        assert logits.shape == (2, 16, 64)


def test_a_fused_projection_split_by_heads_is_refused_on_older_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's DTensor cannot redistribute the interleaved q | k | v shard in the backward (measured): GPT-2's
    c_attn stops at set-up, naming the version and what to leave out of the plan."""
    from torch.distributed.device_mesh import init_device_mesh

    model = gpt2()
    _, plan, _ = plan_of(model)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(ValueError, match=r"fused projection split by heads .* needs torch >= 2\.13") as error:
            apply_plan(model, plan, mesh, sequence_parallel=False)
    assert "installed 2.11.0+cu130" in str(error.value) and "HINT" in str(error.value) and "\n" not in str(error.value)


def test_values_a_checkpoint_load_replaces_reach_the_state_it_was_loaded_for() -> None:
    """torch.distributed.checkpoint fills tensors in place but replaces other values (an optimizer's learning rate,
    a step count) in the dict it loads into, which for a packed model is `savable(state)`'s copy."""
    state = {"optimizer_0": {"param_groups": [{"lr": 0.1, "params": ["w"]}], "state": {"w": {"step": 1}}}}
    view = savable(state)
    view["optimizer_0"]["param_groups"][0]["lr"], view["optimizer_0"]["state"]["w"]["step"] = 0.02, 7  # as a load does
    copy_back(state, view)
    assert state["optimizer_0"]["param_groups"][0]["lr"] == 0.02 and state["optimizer_0"]["state"]["w"]["step"] == 7


def test_a_tied_parameter_is_split_alike_under_each_name_or_refused() -> None:
    model = gpt2(tied=True)
    with pytest.raises(ValueError, match=r"lm_head.weight.*one tied parameter.*HINT") as raised:
        plan_of(model, plan={"lm_head": "colwise_gather"})
    assert "\n" not in str(raised.value)
    from torch.distributed.device_mesh import init_device_mesh

    plan = {"transformer.wte": "vocab_parallel", "lm_head": "colwise_gather"}
    _, exact, _ = plan_of(model, plan=plan)
    with fake_world(2):
        apply_plan(model, exact, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False)
        assert model.lm_head.weight is not model.transformer.wte.weight  # each module sharded its own copy
        retie(model, [["transformer.wte.weight", "lm_head.weight"]])
        assert model.lm_head.weight is model.transformer.wte.weight
