"""Traced pipeline splits of networks with their own forward (tests/traced_networks.py): stages chained by hand in
one process must compute exactly what the eager network computes, on the network's own (pruned, rebound) tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from traced_networks import MLP, Branch, Labelled, NormDrop, Scalar, Skip, Tied, TutorialCNN

from lightning_parallel.pipeline.balance import split_by_cost
from lightning_parallel.pipeline.partition import parameter_costs
from lightning_parallel.pipeline.traced import TracedNetwork, check_traceable, prune_children

TOL = 1e-6


def run_chain(stages: dict[int, nn.Module], *inputs: torch.Tensor) -> object:
    values: object = inputs
    for index in sorted(stages):
        values = stages[index](*values)
        if index < max(stages):
            values = values if isinstance(values, tuple) else (values,)
    return values


def leaves(output: object) -> list[torch.Tensor]:
    return list(output) if isinstance(output, tuple) else [output]  # type: ignore[list-item]


def assert_same_step(network: nn.Module, stages: dict[int, nn.Module], x: torch.Tensor) -> None:
    """Outputs, input gradient and every parameter gradient of the chained stages equal eager ones."""
    network.zero_grad(set_to_none=True)
    x_eager = x.clone().requires_grad_(x.is_floating_point())
    eager = leaves(network(x_eager))
    sum(out.square().sum() for out in eager).backward()
    eager_grads = {name: p.grad.clone() for name, p in network.named_parameters()}
    network.zero_grad(set_to_none=True)
    x_staged = x.clone().requires_grad_(x.is_floating_point())
    staged = leaves(run_chain(stages, x_staged))
    sum(out.square().sum() for out in staged).backward()
    assert len(staged) == len(eager)
    for got, want in zip(staged, eager, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    if x.is_floating_point():
        torch.testing.assert_close(x_staged.grad, x_eager.grad, atol=TOL, rtol=TOL)
    for name, p in network.named_parameters():
        torch.testing.assert_close(
            p.grad, eager_grads[name], atol=TOL, rtol=TOL, msg=lambda text, name=name: f"{name}: {text}"
        )


@pytest.mark.parametrize(
    ("make", "shape", "stages"),
    [
        (TutorialCNN, (4, 3, 32, 32), [["conv1"], ["conv2", "fc"]]),
        (MLP, (5, 8), [["fc0", "fc1"], ["fc2", "fc3"]]),
        (Skip, (5, 8), [["a"], ["b"], ["c", "d"]]),
        (Skip, (5, 8), [["a", "b"], ["c"], ["d"]]),
    ],
)
def test_chained_stages_equal_eager(make, shape, stages) -> None:
    torch.manual_seed(0)
    network = make()
    x = torch.randn(shape)
    traced = TracedNetwork(network, x)
    built = traced.stage_modules(stages, range(len(stages)), x, network)
    assert_same_step(network, built, x)


def test_names_and_tensors_are_the_networks_own() -> None:
    network = TutorialCNN()
    x = torch.randn(2, 3, 32, 32)
    traced = TracedNetwork(network, x)
    assert traced.blocks == ["conv1", "conv2", "fc"]  # pool runs twice: not a split point
    built = traced.stage_modules([["conv1"], ["conv2", "fc"]], [0, 1], x, network)
    named = {name: p for stage in built.values() for name, p in stage.named_parameters()}
    assert named.keys() == dict(network.named_parameters()).keys()
    assert all(p is network.get_parameter(name) for name, p in named.items())


def test_each_microbatch_shape_gets_its_own_trace() -> None:
    torch.manual_seed(0)
    network = TutorialCNN()
    traced = TracedNetwork(network, torch.randn(4, 3, 32, 32))
    split = [["conv1", "conv2"], ["fc"]]
    for batch in (4, 6, 1):
        x = torch.randn(batch, 3, 32, 32)
        assert_same_step(network, traced.stage_modules(split, [0, 1], x, network), x)
    x = torch.randn(6, 3, 32, 32)
    again = traced.stage_modules(split, [1], x, network)[1]
    assert again is traced.stage_modules(split, [1], x, network)[1]
    assert again is not traced.stage_modules(split, [1], torch.randn(4, 3, 32, 32), network)[1]


def test_meta_built_pruned_ranks_rebind_to_their_real_tensors() -> None:
    torch.manual_seed(0)
    reference = Skip()
    with torch.device("meta"):
        meta = Skip()
    x = torch.randn(3, 8)
    traced = TracedNetwork(meta, x)  # traced from the meta model: no real weights anywhere
    split = [["a", "b"], ["c", "d"]]
    stages = {}
    for rank, blocks in enumerate(split):
        local = copy.deepcopy(meta)
        prune_children(local, blocks, traced.blocks)
        local.to_empty(device="cpu")
        local.load_state_dict({k: v for k, v in reference.state_dict().items() if k.split(".")[0] in blocks})
        stage = traced.stage_modules(split, [rank], x, local)[rank]
        assert all(p is local.get_parameter(name) for name, p in stage.named_parameters())
        stages[rank] = stage
        with pytest.raises(ValueError, match="does not hold"):
            traced.stage_modules(split, [1 - rank], x, local)
    for got, want in zip(run_chain(stages, x), reference(x), strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_modulelist_items_tied_weights_and_traced_devices() -> None:
    torch.manual_seed(0)
    network = Tied()
    tokens = torch.randint(0, 11, (3, 5))
    traced = TracedNetwork(network, tokens)
    assert traced.blocks == ["emb", "layers.0", "layers.1", "head"]
    assert traced.tied_parameters() == {"emb.weight": ["emb", "head"]}
    # arange(device=tokens.device) was traced on meta; the stage runs on the inputs' device
    built = traced.stage_modules([["emb", "layers.0"], ["layers.1", "head"]], [0, 1], tokens, network)
    assert_same_step(network, built, tokens)
    assert built[1].get_parameter("head.weight") is network.emb.weight  # shared, not duplicated

    pruned = copy.deepcopy(network)
    prune_children(pruned, ["layers.1", "head"], traced.blocks)
    assert isinstance(pruned.layers[0], nn.Identity) and isinstance(pruned.emb, nn.Identity)
    assert [name for name, _ in pruned.named_parameters()] == ["layers.1.weight", "layers.1.bias", "head.weight"]


def test_tied_weights_rebind_on_each_pruned_rank_under_any_of_their_names() -> None:
    """torch names a tied tensor once in the trace (GPT-2's wte / lm_head: as `lm_head.weight`); the rank that
    pruned the block of that name finds it under the other."""
    torch.manual_seed(0)
    network = Tied()
    network.head.weight = network.emb.weight = nn.Parameter(network.emb.weight.detach().clone())  # head's name first
    tokens = torch.randint(0, 11, (3, 5))
    traced = TracedNetwork(network, tokens)
    split = [["emb", "layers.0"], ["layers.1", "head"]]
    for rank, blocks in enumerate(split):
        pruned = copy.deepcopy(network)
        prune_children(pruned, blocks, traced.blocks)
        stage = traced.stage_modules(split, [rank], tokens, pruned)[rank]
        tied = pruned.emb.weight if rank == 0 else pruned.head.weight
        assert any(p is tied for p in stage.parameters()), rank


def test_batchnorm_statistics_follow_eager_in_train_and_eval() -> None:
    torch.manual_seed(0)
    network = NormDrop()
    eager = copy.deepcopy(network)
    traced = TracedNetwork(network, torch.randn(4, 3, 8, 8))
    split = [["conv", "bn"], ["drop", "head"]]
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 3, 8, 8) + step
        for model, opt, out in ((eager, eager_optimizer, None), (network, optimizer, "staged")):
            opt.zero_grad()
            y = run_chain(traced.stage_modules(split, [0, 1], x, network), x) if out else model(x)
            y.square().mean().backward()
            opt.step()
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(
            network.get_buffer(name), buffer, atol=TOL, rtol=TOL, msg=lambda text, name=name: f"{name}: {text}"
        )
    assert network.bn.num_batches_tracked.item() == 3

    network.eval(), eager.eval()
    before = network.bn.running_mean.clone()
    x = torch.randn(2, 3, 8, 8)
    staged = run_chain(traced.stage_modules(split, [0, 1], x, network), x)
    torch.testing.assert_close(staged, eager(x), atol=TOL, rtol=TOL)
    assert torch.equal(network.bn.running_mean, before)  # eval uses the statistics, never updates them


def test_dropout_is_random_in_train_and_off_in_eval() -> None:
    network = NormDrop(p=0.5)
    x = torch.randn(4, 3, 8, 8)
    traced = TracedNetwork(network, x)
    split = [["conv", "bn", "drop"], ["head"]]
    torch.manual_seed(1)
    eager = network(x)
    torch.manual_seed(1)
    staged = run_chain(traced.stage_modules(split, [0, 1], x, network), x)
    torch.testing.assert_close(staged, eager, atol=TOL, rtol=TOL)  # same masks from the same generator
    again = run_chain(traced.stage_modules(split, [0, 1], x, network), x)
    assert not torch.allclose(again, staged)
    network.eval()
    off = run_chain(traced.stage_modules(split, [0, 1], x, network), x)
    torch.testing.assert_close(off, network(x), atol=TOL, rtol=TOL)
    torch.testing.assert_close(off, run_chain(traced.stage_modules(split, [0, 1], x, network), x))


def test_untraceable_forward_fails_in_one_line_naming_the_construct() -> None:
    with pytest.raises(ValueError) as info:
        check_traceable(Branch(), torch.randn(2, 4))
    message = str(info.value)
    assert "\n" not in message
    assert "Branch.forward branches on a tensor value" in message
    assert "traced_networks.py" in message and "(if x.sum() > 0:)" in message and "HINT:" in message


@pytest.mark.parametrize(
    ("make", "expected"),
    [(Scalar, "passes a Python number"), (Labelled, "returns non-tensor values \\(str\\)")],
)
def test_non_tensor_values_fail_before_launch(make, expected) -> None:
    with pytest.raises(ValueError, match=expected) as info:
        check_traceable(make(), torch.randn(2, 4))
    assert "\n" not in str(info.value) and "HINT:" in str(info.value)


def test_flop_costs_balance_compute_where_parameters_do_not() -> None:
    network = TutorialCNN()
    traced = check_traceable(network, torch.randn(2, 3, 32, 32))
    by_params = split_by_cost(
        traced.blocks, parameter_costs(nn.Sequential(network.conv1, network.conv2, network.fc)), 2
    )
    by_flops = split_by_cost(traced.blocks, traced.costs, 2)
    assert by_params == [["conv1", "conv2"], ["fc"]]  # fc holds most parameters but almost no compute
    assert by_flops == [["conv1"], ["conv2", "fc"]]
    assert min(traced.costs[:2]) > 50 * traced.costs[2]
