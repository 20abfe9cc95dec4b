"""Single-device model tests: shapes, child names, validation, causality, meta-device builds, seeding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parallel.models import GPT, ResNet, SimpleCNN

TINY_GPT = {"vocab_size": 50, "context_length": 16, "depth": 2, "width": 32, "heads": 4}


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("depth", "expected"),
    [(18, 11_689_512), (34, 21_797_672), (50, 25_557_032), (101, 44_549_160), (152, 60_192_808)],
)
def test_resnet_parameter_counts_match_torchvision(depth: int, expected: int) -> None:
    with torch.device("meta"):
        model = ResNet(depth=depth)
    assert _count(model) == expected


@pytest.mark.parametrize("image_size", [8, 28, 32])
def test_simple_cnn_output_shape(image_size: int) -> None:
    model = SimpleCNN(in_channels=3, image_size=image_size, num_classes=10)
    out = model(torch.randn(2, 3, image_size, image_size))
    assert out.shape == (2, 10)


@pytest.mark.parametrize("depth", [18, 50])
@pytest.mark.parametrize("image_size", [8, 32])
def test_resnet_output_shape(depth: int, image_size: int) -> None:
    model = ResNet(depth=depth, in_channels=1, num_classes=10)
    out = model(torch.randn(2, 1, image_size, image_size))
    assert out.shape == (2, 10)


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 1), (2, 7), (3, 16)])
def test_gpt_output_shape(batch: int, seq_len: int) -> None:
    model = GPT(**TINY_GPT)
    out = model(torch.randint(0, 50, (batch, seq_len)))
    assert out.shape == (batch, seq_len, 50)


def test_simple_cnn_child_names() -> None:
    model = SimpleCNN(in_channels=1, image_size=8, num_classes=10)
    assert [name for name, _ in model.named_children()] == ["conv1", "conv2", "fc1", "fc2", "head"]


def test_resnet_child_names() -> None:
    with torch.device("meta"):
        model = ResNet(depth=50)
    counts = (3, 4, 6, 3)
    blocks = [f"layer{stage}_{i}" for stage, n in enumerate(counts, start=1) for i in range(n)]
    assert [name for name, _ in model.named_children()] == ["stem", *blocks, "head"]
    assert blocks[-1] == "layer4_2"


def test_gpt_child_names() -> None:
    model = GPT(**TINY_GPT)
    assert [name for name, _ in model.named_children()] == ["embed", "block_0", "block_1", "head"]
    names = {name for name, _ in model.named_modules()}
    expected = {
        "embed.token", "embed.position", "block_0.ln1", "block_0.attn.q", "block_0.attn.k",
        "block_0.attn.v", "block_0.attn.proj", "block_0.ln2", "block_0.mlp.up", "block_0.mlp.down",
        "head.norm", "head.lm_head",
    }  # fmt: skip
    assert expected <= names


def test_input_kinds() -> None:
    assert SimpleCNN.input_kind == "image"
    assert ResNet.input_kind == "image"
    assert GPT.input_kind == "tokens"


def test_gpt_rejects_too_long_input() -> None:
    model = GPT(**TINY_GPT)
    with pytest.raises(ValueError, match=r"17 tokens.*context_length is 16"):
        model(torch.randint(0, 50, (1, 17)))


def test_gpt_rejects_width_not_divisible_by_heads() -> None:
    with pytest.raises(ValueError, match="HINT"):
        GPT(vocab_size=10, context_length=8, width=30, heads=4)


def test_simple_cnn_rejects_small_images() -> None:
    with pytest.raises(ValueError, match=r"image_size >= 4, got 3.*HINT"):
        SimpleCNN(in_channels=1, image_size=3, num_classes=10)


def test_resnet_rejects_unknown_depth() -> None:
    with pytest.raises(ValueError, match=r"depth 20.*18, 34, 50, 101, 152"):
        ResNet(depth=20)


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(**TINY_GPT).eval()
    tokens = torch.randint(0, 50, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 50
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])


def test_gpt_attention_counts_heads_from_shape() -> None:
    # Simulates a tensor-parallel shard: q/k/v keep half the output features, proj half the inputs.
    torch.manual_seed(0)
    attn = GPT(**TINY_GPT).get_submodule("block_0.attn")
    half = 16
    for name in ("q", "k", "v"):
        full = getattr(attn, name)
        shard = nn.Linear(32, half)
        shard.weight.data.copy_(full.weight[:half])
        shard.bias.data.copy_(full.bias[:half])
        setattr(attn, name, shard)
    attn.proj = nn.Linear(half, 32)
    out = attn(torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32)


@pytest.mark.parametrize(
    "build",
    [
        lambda: SimpleCNN(in_channels=3, image_size=32, num_classes=10),
        lambda: ResNet(depth=18, in_channels=1, num_classes=10),
        lambda: GPT(**TINY_GPT),
    ],
    ids=["simple_cnn", "resnet18", "gpt"],
)
def test_models_build_on_meta_device(build) -> None:
    with torch.device("meta"):
        model = build()
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    "build",
    [
        lambda: SimpleCNN(in_channels=3, image_size=16, num_classes=10),
        lambda: ResNet(depth=18, in_channels=1, num_classes=10),
        lambda: GPT(**TINY_GPT),
    ],
    ids=["simple_cnn", "resnet18", "gpt"],
)
def test_same_seed_gives_identical_parameters(build) -> None:
    torch.manual_seed(123)
    first = build().state_dict()
    torch.manual_seed(123)
    second = build().state_dict()
    assert first.keys() == second.keys()
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0)
