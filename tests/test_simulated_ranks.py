"""Exact at real degrees, in one process: tp 8 and dp2 x tp4 training steps of the zoo GPT, transformers' Llama
(grouped-query attention), Qwen2 (tied embeddings), Qwen3 (per-head q / k norms) and Falcon (MLP pairs alone), and
pp 8 and dp2 x pp2 x tp4 (16 ranks) of the zoo GPT, set up by the strategies' own order on simulated ranks
(`simulated_ranks`), against one process: losses and every rank's final weights within 1e-5 (AdamW, padded text). The
simulation has no FSDP2 (replicas here are the all-reduced kind) and no pipeline transport: the pipeline's stages are
chained in one process (`simulated_stages.py`). Also: column- and row-parallel outputs are no views and no copies, so a
user's model that changes one in place (`nn.ReLU(inplace=True)`, `out += residual`, Falcon's MLP, after a bias-free
row-parallel convolution) trains exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import fake_world
from simulated import (
    SEQ,
    VOCAB,
    assert_like_one_process,
    batches,
    full_values,
    lm_loss,
    settings,
    train_one_process,
    train_simulated,
)
from torch import nn

from lightning_parallel.dims import ParallelDims
from lightning_parallel.models.transformer import GPT
from lightning_parallel.one_process_ranks import simulated_ranks
from lightning_parallel.parallelize import parallelize_tensor
from lightning_parallel.parallelize.replicas import spans

pytest.importorskip("transformers")


def gpt() -> nn.Module:
    return GPT(vocab_size=VOCAB, context_length=SEQ, depth=2, width=64, heads=8, dropout=0.0)


def llama(tied: bool = False) -> nn.Module:
    """Sixteen query heads sharing eight key / value heads: tp 8 gives each rank two query heads and one pair."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def qwen2() -> nn.Module:
    """Qwen2 with its input embedding tied to its output head, as Qwen2 and Llama-3.2 1B / 3B ship."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def qwen3() -> nn.Module:
    """Qwen3: a norm over each head of q and of k (its plan's `replicated_with_grad_allreduce`, our "head_norm"),
    whose whole weight's gradient is summed over the ranks' heads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=8, head_dim=4, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def falcon() -> nn.Module:
    """Falcon: no plan of its own, untraceable by torch.fx, its fused multi-query attention unknown to the structural
    plan: its MLP pairs alone are sharded, and its code adds the attention's output to the row-parallel MLP output in
    place (`mlp_output += attention_output`)."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=16, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    return FalconForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": gpt, "llama": llama, "qwen2": qwen2, "qwen3": qwen3, "falcon": falcon,
}  # fmt: skip
# dp2 x tp4 as users launch it (strategy=tensor) keeps replicas with FSDP2, which the simulation cannot run; here its
# replicas are kept by the all-reduce of the pipeline's replicas="replicate" (its order at pp=1): the same plan, token
# mean over replicas and gradient average that dp2 x pp2 x tp4 runs inside each stage.
LAYOUTS = {"tp8": (ParallelDims(dp=1, pp=1, tp=8), "tensor"), "dp2xtp4": (ParallelDims(dp=2, pp=1, tp=4), "pipeline")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_tensor_and_data_degrees_train_like_one_process(model: str, layout: str) -> None:
    dims, order = LAYOUTS[layout]
    data = batches()
    reference = train_one_process(MODELS[model], data)
    with simulated_ranks(dims.world_size) as mode:
        simulated = train_simulated(mode, dims, MODELS[model], data, order=order)
        assert_like_one_process(simulated, reference)
    network = simulated[1]
    if model == "qwen2":  # still one parameter, sharded alike for both uses
        assert network.lm_head.weight is network.model.embed_tokens.weight


def test_simulated_ranks_draw_what_one_process_draws() -> None:
    """The seam's workaround: a name-keyed initialisation (`weights.materialize`) inside the simulation gives every
    rank the values one process gives (the mode's per-rank generators would otherwise ignore its seeding)."""
    import torch

    from lightning_parallel.weights import materialize

    torch.manual_seed(0)
    expected = gpt()
    materialize(expected, torch.device("cpu"))
    with simulated_ranks(4):
        torch.manual_seed(0)
        with torch.device("meta"):
            network = gpt()
        materialize(network, torch.device("cpu"))
        for (name, param), want in zip(network.named_parameters(), expected.parameters(), strict=True):
            for rank, value in param.detach()._local_tensors.items():  # type: ignore[attr-defined]
                assert torch.equal(value, want), f"{name} on rank {rank}"


# ---- pipeline degrees: the stages chained in one process (tests/simulated_stages.py) ---------------------------------
def gpt_of(depth: int, width: int, heads: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return GPT(vocab_size=VOCAB, context_length=SEQ, depth=depth, width=width, heads=heads, dropout=0.0)

    return build


# pp 8: the embedding, six blocks and the head, one on each rank; the 16 ranks: 2 blocks and one head per tp rank
PIPELINED = {
    "pp8": (ParallelDims(dp=1, pp=8, tp=1), gpt_of(6, 32, 4)),
    "dp2xpp2xtp4": (ParallelDims(dp=2, pp=2, tp=4), gpt_of(2, 32, 4)),
}


@pytest.mark.parametrize("layout", list(PIPELINED))
def test_pipeline_degrees_train_like_one_process(layout: str) -> None:
    from simulated_stages import train_pipelined

    from lightning_parallel.weights import materialize

    dims, build = PIPELINED[layout]

    def whole() -> nn.Module:
        network = build()
        materialize(network, torch.device("cpu"))
        return network

    data = batches()
    expected_losses, expected = train_one_process(whole, data)
    simulation = simulated_ranks(dims.world_size) if dims.dp * dims.tp > 1 else fake_world(dims.world_size)
    with simulation as mode:
        losses, networks = train_pipelined(mode, dims, build, data, microbatches=4 // dims.dp)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=1e-5)
        held = {name: p for network in networks for name, p in network.named_parameters()}
        assert sorted(held) == sorted(expected), "the stages do not hold every parameter once"
        assert dims.tp == 1 or any(spans(p, "tp", sharded=True) for p in held.values()), "nothing sharded over tp"
        for name, param in held.items():
            for rank, value in full_values(param).items():
                torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=f"{name} on rank {rank}")


class InPlaceResidual(nn.Module):
    """A user's block: its own forward changes its column- and row-parallel projections' outputs in place."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, 2 * width), nn.ReLU(inplace=True), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(self.act(self.up(x)))
        out += x  # autograd refuses both on torch's styles' outputs (views made inside a custom Function)
        return out.mul_(0.5)


class InPlaceLM(nn.Module):
    """A user's small LM of `InPlaceResidual` blocks, with its own plan in our style names."""

    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.blocks = nn.Sequential(*(InPlaceResidual(width) for _ in range(depth)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


def test_a_users_model_changing_column_and_row_parallel_outputs_in_place_trains_like_one_process() -> None:
    """tp2, 3 AdamW steps: a model whose forward changes column- and row-parallel outputs in place is exact."""
    dims = ParallelDims(dp=1, pp=1, tp=2)
    data = batches()
    reference = train_one_process(InPlaceLM, data)
    with simulated_ranks(dims.world_size) as mode:
        assert_like_one_process(train_simulated(mode, dims, InPlaceLM, data, order="tensor"), reference)


def clones(loss: torch.Tensor) -> int:
    """How many copies (CloneBackward nodes) the backward graph of `loss` holds."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__.startswith("CloneBackward")
        todo.extend(next_node for next_node, _ in node.next_functions)
    return count


# the styles whose output model code receives as a local tensor
LOCAL_OUTPUTS = {"colwise", "qkv_colwise", "packed_colwise", "colwise_gather", "rowwise", "rowwise_split_input",
                 "rowwise_from_channels", "vocab_parallel"}  # fmt: skip


@pytest.mark.parametrize("model", ["gpt", "llama", "falcon"])
def test_column_and_row_parallel_outputs_are_no_views_and_no_copies(model: str) -> None:
    """Column- and row-parallel layers hand model code their local output as a tensor of its own (no view, so Falcon's
    `mlp_output += attention_output` runs) without copying it: a tp2 training step's backward graph holds as many
    copies as one device's. One step's forward and backward on simulated ranks."""
    dims = ParallelDims(dp=1, pp=1, tp=2)
    ids, labels = batches()[0]
    torch.manual_seed(0)
    one_device = clones(lm_loss(MODELS[model](), ids, labels))
    with simulated_ranks(dims.world_size):
        torch.manual_seed(0)
        network = MODELS[model]()
        set_up = parallelize_tensor(network, network, settings(dims, dims.build_mesh("cpu")), configured=False)
        rows = [name for name, style in set_up.plan[1].items() if style in LOCAL_OUTPUTS]
        views: dict[str, bool] = {}
        for name in rows:
            network.get_submodule(name).register_forward_hook(
                lambda module, args, out, name=name: views.__setitem__(name, out._base is not None)
            )
        loss = lm_loss(network, ids, labels)
        assert clones(loss) == one_device, (clones(loss), one_device)
        loss.backward()
    assert rows and views == dict.fromkeys(rows, False), views


def test_a_bias_free_row_parallel_convolution_hands_on_no_view() -> None:
    """`conv_rowwise` without a bias returns its all-reduced map as no view, so `nn.ReLU(inplace=True)` after it
    trains: one tp2 step's loss and input gradient equal one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_parallel.tensor.conv import ConvColwiseParallel, ConvRowwiseParallel

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 5, 3, bias=False), nn.ReLU(inplace=True))

    torch.manual_seed(1)
    x = torch.randn(2, 3, 8, 8)
    reference = x.clone().requires_grad_()
    one_process = net()(reference).square().sum()
    one_process.backward()
    with simulated_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        sharded = parallelize_module(net(), mesh, {"0": ConvColwiseParallel(), "1": ConvRowwiseParallel()})
        inputs = x.clone().requires_grad_()
        loss = sharded(inputs).square().sum()
        loss.backward()
        losses, grads = full_values(loss), full_values(inputs.grad)
    assert len(losses) == len(grads) == 2
    for rank in (0, 1):
        torch.testing.assert_close(losses[rank], one_process.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(grads[rank], reference.grad, rtol=0, atol=1e-5)
