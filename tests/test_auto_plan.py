"""The automatic tensor-parallel plan, without processes: Linear and Conv2d stacks paired by data flow, the networks
of `workers/user_networks.py`, the pairs that shard most, and refusals by name (untraceable code, flattens a channel
shard does not survive, grouped convolutions, norms). Explicit plans and their validation: test_tensor_plans.py."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from distributed import WORKERS
from torch import nn

from lightning_parallel.models import GPT
from lightning_parallel.tensor import (
    auto_plan,
)

sys.path.insert(0, str(WORKERS))
from user_networks import NETWORKS  # noqa: E402


def tiny_gpt(**sizes: int) -> GPT:
    return GPT(**{"vocab_size": 16, "context_length": 8, "depth": 2, "width": 16, "heads": 4, **sizes})


class FourLinear(nn.Module):
    """The classic tutorial network: a plain stack of Linear layers in a custom module (no nn.Sequential)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net1, self.net2 = nn.Linear(10, hidden), nn.Linear(hidden, 10)
        self.net3, self.net4 = nn.Linear(10, hidden), nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net2(torch.relu(self.net1(x)))
        return self.net4(nn.functional.gelu(self.net3(x)))


class Branches(nn.Module):
    """q, k, v read the same input: registration order would pair q with k, the data flow must not."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x)


# ---- automatic plan --------------------------------------------------------------------------------------------
def test_auto_plan_pairs_consecutive_linears_column_then_row() -> None:
    found = auto_plan(FourLinear(), tensor_parallel_size=2)
    assert found.plan == {"net1": "colwise", "net2": "rowwise", "net3": "colwise", "net4": "rowwise"}
    assert found.replicated == {}
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    found = auto_plan(mlp, tensor_parallel_size=2)
    assert found.plan == {"0": "colwise", "3": "rowwise"}
    assert set(found.replicated) == {"4", "5"}  # the norm, and a last Linear without a partner


def test_auto_plan_follows_data_flow_not_attribute_order() -> None:
    with pytest.raises(ValueError) as error:
        auto_plan(Branches(), tensor_parallel_size=2)
    message = str(error.value)
    assert "found nothing to shard in Branches" in message
    assert all(f"{name}: no single Linear consumes" in message for name in "qkv") and "HINT" in message


def test_auto_plan_names_hidden_sizes_it_cannot_split() -> None:
    # Hidden 7 does not split over 2, but net2 -> net3 (width 10) does: shard that, report the rest.
    found = auto_plan(FourLinear(hidden=7), tensor_parallel_size=2)
    assert found.plan == {"net2": "colwise", "net3": "rowwise"}
    assert found.replicated["net1"] == "hidden size 7 not divisible by 2" and "net4" in found.replicated
    with pytest.raises(ValueError, match=r"in Sequential at tensor_parallel_size 2 \(0: hidden size 7 not divisible"):
        auto_plan(nn.Sequential(nn.Linear(4, 7), nn.ReLU(), nn.Linear(7, 3)), tensor_parallel_size=2)


def test_auto_plan_refuses_what_fx_cannot_trace() -> None:
    # GPT checks the sequence length in Python (`if seq_len > context_length`), which symbolic tracing cannot do.
    with pytest.raises(ValueError, match=r"torch.fx cannot trace GPT .*HINT: give the model a `tp_plan`"):
        auto_plan(tiny_gpt(), tensor_parallel_size=2)


class ConvStack(nn.Module):
    """conv_a -> conv_b -> head, with the ops between them chosen per test: the flatten, a grouped middle conv."""

    def __init__(self, *, flatten: str = "torch", groups: int = 1, norm: int = 4) -> None:
        super().__init__()
        self.flatten, self.groups = flatten, groups
        self.conv_a, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(norm)
        self.middle = nn.Conv2d(4, 4, 3, padding=1, groups=groups)
        self.conv_b, self.head = nn.Conv2d(4, 8, 3, padding=1), nn.Linear(8 * 4 * 4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv_a(x)))
        if self.groups > 1:
            x = self.middle(x)
        x = F.avg_pool2d(self.conv_b(x), 2)  # (B, 8, 4, 4) from 8 x 8 images
        if self.flatten == "torch":
            x = torch.flatten(x, 1)
        elif self.flatten == "shape":
            x = x.reshape(x.shape[0], -1)
        elif self.flatten == "literal":
            x = x.view(-1, 8 * 4 * 4)  # the local shard holds 8 / tp channels: this would fold channels into the batch
        elif self.flatten == "all":
            x = torch.flatten(x)
        return self.head(x)


def test_auto_plan_shards_the_user_networks() -> None:
    found = {name: auto_plan(build(), tensor_parallel_size=2) for name, build in NETWORKS.items()}
    cnn = {"conv1": "conv_colwise", "conv2": "conv_rowwise", "fc1": "colwise", "fc2": "rowwise"}
    assert found["tutorial_cnn"].plan == found["tutorial_cnn_view"].plan == cnn  # pool used twice: stateless, fine
    assert "fc2 -> fc3 loses" in found["tutorial_cnn"].replicated["fc3"]
    vgg = found["vgg"]
    assert vgg.plan == {
        "conv2": "conv_colwise",
        "bn2": "batchnorm_sharded",
        "conv3": "conv_rowwise",
        "conv4": "conv_colwise",
        "bn4": "batchnorm_sharded",
        "classifier": "rowwise_from_channels",
    }
    assert set(vgg.replicated) == {"conv1", "bn1", "bn3"}
    dense = found["simple_dense_net"]  # `batch_size, channels, width, height = x.size()` traces
    assert dense.plan == {
        "model.0": "colwise",
        "model.1": "batchnorm_sharded",
        "model.3": "rowwise",
        "model.6": "colwise",
        "model.7": "batchnorm_sharded",
        "model.9": "rowwise",
    }
    assert set(dense.replicated) == {"model.4"}


def test_auto_plan_chooses_the_pairs_that_shard_most() -> None:
    # conv_a -> conv_b shards 4*3*9+4 + 8*4*9 = 400 parameters, conv_b -> head 8*4*9+8 + 2*128 = 552: the latter.
    found = auto_plan(ConvStack(), tensor_parallel_size=2)
    assert found.plan == {"conv_b": "conv_colwise", "head": "rowwise_from_channels"}
    assert found.replicated["conv_a"] == "pairing conv_a -> conv_b loses to neighbouring pairs that shard more"
    assert auto_plan(ConvStack(flatten="shape"), tensor_parallel_size=2).plan == found.plan
    # At tp 8 conv_b's 8 output channels still split; conv_a's 4 would not.
    assert auto_plan(ConvStack(), tensor_parallel_size=8).plan == found.plan


@pytest.mark.parametrize(
    ("stack", "conv_b_reason"),
    [
        (ConvStack(flatten="literal"), "stops at call_method view"),
        (ConvStack(flatten="all"), "stops at call_function flatten"),
        (ConvStack(flatten="none"), "head is a Linear on an unflattened feature map"),
    ],
)
def test_auto_plan_refuses_flattens_a_channel_shard_does_not_survive(stack: ConvStack, conv_b_reason: str) -> None:
    found = auto_plan(stack, tensor_parallel_size=2)  # conv_b cannot pair with head, so conv_a pairs with conv_b
    assert found.plan == {"conv_a": "conv_colwise", "bn": "batchnorm_sharded", "conv_b": "conv_rowwise"}
    assert "head" in found.replicated
    with pytest.raises(ValueError, match=rf"conv_b: no single Conv2d or flattening Linear .*\({conv_b_reason}\)"):
        auto_plan(stack, tensor_parallel_size=8)  # conv_a's 4 channels do not split: conv_b's reason is left


def test_auto_plan_refuses_grouped_convolutions_by_name() -> None:
    found = auto_plan(ConvStack(groups=2), tensor_parallel_size=2)
    assert found.plan == {"conv_b": "conv_colwise", "head": "rowwise_from_channels"}
    assert (
        found.replicated["middle"]
        == "Conv2d with groups=2: the channel-parallel styles split only groups=1 convolutions"
    )
    assert "middle: Conv2d with groups=2" in found.replicated["conv_a"]
    with pytest.raises(ValueError, match=r"\(0: Conv2d with groups=3: the channel-parallel styles split only"):
        auto_plan(nn.Sequential(nn.Conv2d(3, 6, 3, groups=3), nn.ReLU(), nn.Conv2d(6, 6, 3)), tensor_parallel_size=2)


def test_auto_plan_refuses_norms_it_cannot_shard_with_the_pair() -> None:
    # A BatchNorm over other features than the column layer's, and one module called twice, stay replicated.
    with pytest.raises(ValueError, match=r"0: 1 normalises 4 features, not the 8 of 0"):
        auto_plan(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(4), nn.Linear(8, 2)), tensor_parallel_size=2)

    class SharedNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up1, self.up2, self.bn = nn.Linear(4, 8), nn.Linear(4, 8), nn.BatchNorm1d(8)
            self.down1, self.down2 = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down1(self.bn(self.up1(x))) + self.down2(self.bn(self.up2(x)))

    with pytest.raises(ValueError, match=r"up1: bn is called 2 times; a sharded layer must be called once"):
        auto_plan(SharedNorm(), tensor_parallel_size=2)


def test_auto_plan_never_flattens_a_linear_shard() -> None:
    # (B, T, F / tp) flattened is not one contiguous block of T * F: a Linear -> flatten -> Linear stays whole.
    model = nn.Sequential(nn.Linear(4, 8), nn.Flatten(), nn.Linear(24, 2), nn.ReLU(), nn.Linear(2, 2))
    found = auto_plan(model, tensor_parallel_size=2)
    assert found.plan == {"2": "colwise", "4": "rowwise"}
    assert found.replicated["0"].endswith("(stops at 1)")
