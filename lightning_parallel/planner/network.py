"""The planner's figures for any network the strategies take: an ``nn.Sequential`` of named blocks block by block
(``analysis.py``), any other (a transformers model, a custom ``nn.Module``) from one call on one batch's inputs
(``call_analysis.py``), sharded by the plan the strategies would resolve. It finds no inputs and times nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_parallel.parallelize.plan import resolve_plan
from lightning_parallel.planner.analysis import sequential_workload
from lightning_parallel.planner.call_analysis import workload_from_call
from lightning_parallel.planner.workload import Workload
from lightning_parallel.tensor.plans import expand_plan


def workload_from_module(
    model: nn.Module,
    sample: torch.Tensor,
    *,
    plan: Mapping[str, str] | None = None,
    name: str | None = None,
    tensor_parallel_size: int = 2,
) -> Workload:
    """Analyse a network called with one tensor, ``model(sample)``, on the meta device: nothing is materialised.

    Args:
        model: Any network: an ``nn.Sequential`` block by block, any other module by its units
            (``call_analysis.units_of``: e.g. a transformers model's embedding, decoder layers, norm and head).
        sample: A batch of at least 2 samples (BatchNorm needs 2), any device; only its shape and dtype are used.
        plan: Tensor-parallel plan ``{pattern: style}``; None: an ``nn.Sequential``'s own ``tp_plan``, if any, any
            other network's the plan the strategies resolve (``shard_styles``).
        name: Shown in the plan's header; defaults to the class name and parameter count.
        tensor_parallel_size: Where ``shard_styles`` resolves a plan.

    Returns:
        Per-sample figures (FLOPs, saved activations, outputs, collectives), parameters exact.
    """
    if isinstance(model, nn.Sequential):
        return sequential_workload(model, sample, plan=plan, name=name)
    styles = expand_plan(model, plan) if plan else None
    return workload_from_network(
        model, (sample,), {}, styles=styles, name=name, tensor_parallel_size=tensor_parallel_size
    )


def workload_from_network(
    network: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    styles: Mapping[str, str] | None = None,
    tensor_parallel_size: int = 2,
    traced: bool = False,
    name: str | None = None,
) -> Workload:
    """Analyse ``network(*args, **kwargs)``, one batch's inputs as the user's step passes them (e.g. ``input_ids``
    and ``labels``): what ``strategy=auto``, ``plan.py`` and the dry run's prediction all read.

    Args:
        network: Any network, best built on the meta device; a copy runs, the network is not changed.
        args, kwargs: The inputs (an ``nn.Sequential`` takes its first positional tensor, 1 row made 2).
        styles: The exact-name tensor-parallel plan (the dry run's: its strategy's); None = ``shard_styles``. An
            ``nn.Sequential`` reads its own ``tp_plan`` instead.
        tensor_parallel_size: Where ``shard_styles`` resolves a plan.
        traced: The network runs split into traced pipeline stages (``call_analysis.workload_from_call``).
        name: Shown in the plan's header; defaults to the class name and parameter count.
    """
    if isinstance(network, nn.Sequential):
        sample = args[0] if args and torch.is_tensor(args[0]) else None
        if sample is None or sample.dim() == 0:
            raise ValueError(
                f"an nn.Sequential takes one tensor batch, got {[type(a).__name__ for a in args]} positional and "
                f"{sorted(kwargs or {})} keyword inputs. HINT: call the network as network(x)"
            )
        sample = sample.to("meta")
        if sample.shape[0] < 2:
            sample = sample[:1].expand(2, *sample.shape[1:])
        return sequential_workload(network, sample, name=name)
    chosen = shard_styles(network, tensor_parallel_size) if styles is None else dict(styles)
    return workload_from_call(network, args, dict(kwargs or {}), styles=chosen, traced=traced, name=name)


def shard_styles(network: nn.Module, tensor_parallel_size: int = 2) -> dict[str, str]:
    """The exact-name plan the tensor and pipeline strategies resolve for ``network`` at ``tensor_parallel_size``
    (its own, by structure, or along an fx trace: ``parallelize.plan.resolve_plan``), or ``{}`` where they find none
    (the planner then ranks no tensor-parallel layout). The planner tries only sizes that divide every size this plan
    shards (``Workload.tp_modulus``); a plan found by pairing drops only pairs a larger size cannot split, so such a
    size finds the same one."""
    if tensor_parallel_size < 2:
        return {}
    try:
        return resolve_plan(network, None, tensor_parallel_size=tensor_parallel_size, sequence_parallel=False)[1]
    except ValueError:
        return {}
