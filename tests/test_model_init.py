"""Name-keyed initialisation: a pruned meta-device model re-initialised in place equals the full model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_parallel.models import GPT, ResNet, SimpleCNN
from lightning_parallel.weights import init_by_name, init_default, materialize, materialize_in_parts, parameter_bytes

Build = Callable[[], nn.Sequential]

BUILDS: dict[str, Build] = {
    "simple_cnn": lambda: SimpleCNN(in_channels=1, image_size=8, num_classes=10),
    "resnet18": lambda: ResNet(depth=18, in_channels=1, num_classes=10),
    "gpt": lambda: GPT(vocab_size=32, context_length=16, depth=4, width=32, heads=2),
}


def _build(build: Build, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return build()


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _middle(names: list[str]) -> list[str]:
    # Drop the first and last child: a stage with neither embedding/stem nor head.
    return names[1:-1]


def _head(names: list[str]) -> list[str]:
    return names[-1:]


@pytest.mark.parametrize("keep", [_middle, _head], ids=["middle", "head"])
@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_pruned_meta_model_matches_full_model(build: Build, keep: Callable[[list[str]], list[str]]) -> None:
    full = _tensors(_build(build, seed=3))
    torch.manual_seed(3)
    with torch.device("meta"):
        model = build()
    children = [name for name, _ in model.named_children()]
    kept = keep(children)
    for name in children:
        if name not in kept:
            setattr(model, name, nn.Identity())
    model.to_empty(device="cpu")
    # Draw from the global RNG in between, as other setup code would; init must not depend on it.
    torch.randn(100)
    model.init_weights()

    local = _tensors(model)
    assert local, "nothing kept"
    assert all(name.split(".")[0] in kept for name in local)
    for name, tensor in local.items():
        assert torch.equal(tensor, full[name]), name


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_same_seed_same_weights_different_seed_different_weights(build: Build) -> None:
    first, again, other = (_tensors(_build(build, seed)) for seed in (3, 3, 4))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    params = [name for name, t in first.items() if t.is_floating_point() and t.std() > 0]
    assert params
    assert not any(torch.equal(first[name], other[name]) for name in params)


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_init_weights_keeps_global_rng_state(build: Build) -> None:
    model = _build(build, seed=3)
    before = torch.get_rng_state()
    model.init_weights()
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("build", BUILDS.values(), ids=BUILDS.keys())
def test_init_weights_is_a_no_op_on_meta(build: Build) -> None:
    with torch.device("meta"):
        model = build()
    model.init_weights()
    assert all(t.is_meta for t in _tensors(model).values())


def test_modules_get_distinct_streams() -> None:
    # Equal shapes at different names must not draw the same numbers.
    model = GPT(vocab_size=32, context_length=16, depth=2, width=32, heads=2)
    assert not torch.equal(model.get_submodule("block_0.attn.q").weight, model.get_submodule("block_0.attn.k").weight)
    assert not torch.equal(model.get_submodule("block_0.mlp.up").weight, model.get_submodule("block_1.mlp.up").weight)


def test_explicit_seed_overrides_initial_seed() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    init_by_name(model, init_default, seed=7)
    first = model[0].weight.clone()
    torch.manual_seed(99)
    init_by_name(model, init_default, seed=7)
    assert torch.equal(first, model[0].weight)


def test_init_default_rejects_module_without_reset_parameters() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(RuntimeError, match="Scale.*HINT"):
        init_by_name(nn.Sequential(Scale()), init_default)


def test_meta_built_user_network_materialises_with_reset_parameters() -> None:
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))

    with torch.device("meta"):
        network = build()
    materialize(network, torch.device("cpu"))
    assert not any(t.is_meta for t in [*network.parameters(), *network.buffers()])
    again = build()
    materialize_by_name = again.to_empty(device="cpu")
    init_by_name(materialize_by_name, init_default)
    for (name, value), (_, expected) in zip(network.state_dict().items(), again.state_dict().items(), strict=True):
        torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)  # the same values on any layout


def test_meta_built_network_without_reset_parameters_is_refused() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        network = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(RuntimeError, match=r"\['Scale'\] own parameters or buffers and have no reset_parameters"):
        materialize(network, torch.device("cpu"))


class _HandInit(nn.Sequential):
    """A user network whose init_weights() does not go through init_by_name, so it cannot be restricted."""

    def init_weights(self) -> None:
        for p in self.parameters():
            nn.init.constant_(p, 0.5)


@pytest.mark.parametrize("name", [*BUILDS, "hand_init", "no_init_weights"])
def test_materialising_in_parts_gives_the_same_weights_and_never_holds_the_whole(name: str) -> None:
    """Each part gets storage and values, then `after_each` runs (a strategy shards it there: here it is replaced
    by nothing, as a stand-in for a shard); the values are the ones one process builds."""
    builds = {
        **BUILDS,
        "hand_init": lambda: _HandInit(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
        "no_init_weights": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)),
    }
    with torch.device("meta"):
        full, parted = _build(builds[name], 0), _build(builds[name], 0)
    torch.manual_seed(0)  # what init_by_name seeds from, as after seed_everything
    materialize(full, torch.device("cpu"))  # what one process builds from the meta device
    parts = [n for n, m in parted.named_modules() if isinstance(m, nn.Linear | nn.Conv2d | nn.Embedding)]
    seen: dict[str, torch.Tensor] = {}

    def keep_and_drop(part: str) -> None:  # the shard of a stand-in strategy: nothing kept, values recorded
        module = parted.get_submodule(part)
        seen.update({f"{part}.{n}": t.detach().clone() for n, t in module.named_parameters()})
        for n, t in list(module.named_parameters()):
            setattr(module, n, nn.Parameter(t.detach()[:0]))

    peak = materialize_in_parts(parted, torch.device("cpu"), parts, keep_and_drop)
    whole = _tensors(full)
    for key, value in seen.items():
        torch.testing.assert_close(value, whole[key], rtol=0, atol=0, msg=key)
    rest = {k: v for k, v in _tensors(parted).items() if k not in seen}
    for key, value in rest.items():
        torch.testing.assert_close(value, whole[key], rtol=0, atol=0, msg=key)
    total = parameter_bytes(full)
    if name == "hand_init":
        assert peak == total  # not name-keyed: materialised whole first, then handed over part by part
    else:
        largest = max(parameter_bytes(full.get_submodule(p)) for p in parts)
        assert peak == max(largest, parameter_bytes(parted)) < total  # one part at a time, or the rest at the end
