"""Set-up step "plan": which layers are sharded over "tp" and how, resolved on the whole network before it is cut
(`resolve_plan`: the plan argument > the model's own > its structure > an fx trace), with what tensor parallelism
inside traced pipeline stages refuses. It shards nothing (`materialize.py` does) and finds no plan itself (`tensor/`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from torch import nn

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize.split import Stages
from lightning_parallel.parallelize.tied_plan import settle_tied
from lightning_parallel.seams import refuse_older_torch
from lightning_parallel.tensor.hf_plans import transformers_plan
from lightning_parallel.tensor.pairing import auto_plan
from lightning_parallel.tensor.plans import check_plan, expand_plan
from lightning_parallel.tensor.structure import structural_plan

# (source, exact-name plan, why each unplanned module stays whole)
Plan = tuple[str, dict[str, str], dict[str, str]]
CONFIGURED = "configure_model"  # the source when the LightningModule sharded its network itself


def plan_stages(
    network: nn.Module,
    plan: Mapping[str, str] | str | None,
    *,
    dims: ParallelDims,
    stages: Stages | None,
    replicas: str,
) -> tuple[Plan | None, Stages | None]:
    """The pipeline's plan for the whole network (a traced network's modules by their original names), before it is
    cut, so every stage shards its layers alike; None at tp=1, where nothing is sharded. Also the cut, its tied
    parameters saying how they are sharded (`tied_plan.py`: alike on every holder, or whole with the reason)."""
    if dims.tp == 1:
        return None, stages
    resolved = resolve_stage_plan(network, plan, dims.tp)
    if stages is not None and stages.traced:  # traced stages compute on the planned modules' DTensor shards
        refuse_traced_sharding(network, replicas=replicas, dp=dims.dp)
        resolved, tied = settle_tied(network, resolved, stages.tied)
        stages = replace(stages, tied=tied)
    return resolved, stages


def plan_layers(
    network: nn.Module, plan: Mapping[str, str] | str | None, *, tp: int, sequence_parallel: bool, configured: bool
) -> Plan:
    """The tensor strategy's plan, resolved at tp=1 too (summary.json reports it; the network stays plain), or none
    when the LightningModule's `configure_model()` sharded the network itself."""
    if configured:
        return CONFIGURED, {}, {}  # Lightning already called it, with the mesh on the module
    return resolve_plan(network, plan, tensor_parallel_size=tp, sequence_parallel=sequence_parallel)


def resolve_stage_plan(network: nn.Module, plan: Mapping[str, str] | str | None, tensor_parallel_size: int) -> Plan:
    """`resolve_plan` for pipeline stages, which shard without sequence parallelism."""
    return resolve_plan(network, plan, tensor_parallel_size=tensor_parallel_size, sequence_parallel=False)


def resolve_plan(
    network: nn.Module, plan: Mapping[str, str] | str | None, *, tensor_parallel_size: int, sequence_parallel: bool
) -> Plan:
    """(source, exact-name plan, why each unplanned module stays whole), the first of, in order:
    1. "argument": the `plan` argument;
    2. "model": the network's own plan when it has entries: `tp_plan` in our style names, or a transformers model's
       (`_tp_plan` + `config.base_model_tp_plan`) translated from transformers' style names (`tensor/hf_plans.py`);
    3. "structure": attention and MLP layers recognised by names and widths (`tensor/structure.py`);
    4. "auto": column -> row pairs along a torch.fx trace (`tensor/pairing.py`);
    5. "structure": the MLP pairs alone, when 4 cannot trace or pair (an attention 3 does not know stays whole).
    `plan="auto"` skips 2. Checked against `tensor_parallel_size` (raises ValueError with a fix)."""
    tp = tensor_parallel_size
    replicated: dict[str, str] = {}
    own = None if plan is not None else _own_plan(network)
    if isinstance(plan, Mapping):
        source, exact = "argument", expand_plan(network, plan)
        if tp > 1 and not exact:
            raise ValueError(
                f"tensor_parallel_size={tp}: the plan argument is empty, so nothing would be sharded and every rank "
                "would compute the whole network. HINT: pass plan=None to find a plan, or name the layers to shard: "
                "plan={'<module name pattern>': 'colwise' | 'rowwise' | ...}"
            )
    elif own:
        source, exact = "model", expand_plan(network, own)
    else:
        source, found = "structure", structural_plan(network, tensor_parallel_size=tp)
        if found is None:
            try:
                source, found = "auto", auto_plan(network, tensor_parallel_size=tp)
            except ValueError:  # untraceable, or no pair: MLP pairs by structure alone, else the trace's line
                source, found = "structure", structural_plan(network, tensor_parallel_size=tp, mlp_alone=True)
                if found is None:
                    raise
        exact, replicated = found.plan, found.replicated
    check_plan(network, exact, tensor_parallel_size=tp, sequence_parallel=sequence_parallel)
    return source, exact, replicated


def _own_plan(network: nn.Module) -> Mapping[str, str] | None:
    """The network's own plan in our style names (a transformers model's translated), None or empty without one."""
    translated = transformers_plan(network)
    if translated is not None:
        return translated
    own = getattr(network, "tp_plan", None)
    return own if isinstance(own, Mapping) else None


def refuse_traced_sharding(network: nn.Module, *, replicas: str, dp: int) -> None:
    """What tensor parallelism inside traced stages does not do yet, one line each (on every rank, before any
    collective): run under FSDP2 replicas (whose hooks are on the real modules' forwards, which traced stages never
    call), or run on a torch older than it passed on."""
    refuse_older_torch(
        "tensor parallelism inside traced pipeline stages",
        "use tensor_parallel_size=1, or write the network as an nn.Sequential of blocks",
    )
    if replicas == "fsdp" and dp > 1:
        raise ValueError(
            f"replicas='fsdp' does not yet shard replicas of {type(network).__name__}, which is split by tracing, "
            "with tensor_parallel_size > 1 (traced stages never call the modules' forwards, where FSDP2 gathers). "
            "HINT: use replicas='replicate'"
        )
