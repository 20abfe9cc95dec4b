"""Set-up step "tie": a parameter read on several pipeline ranks (an embedding tied to the output head) starts from
one value on every holder; its gradients are summed before each optimizer step (`pipeline/tied.py`, which also
holds the mechanics). Ties within one rank are made again where sharding broke them (`materialize.py`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_parallel.parallelize.split import Stages
from lightning_parallel.pipeline.tied import broadcast_tied_values


def tie_across_stages(network: nn.Module, stages: Stages | None, mesh: DeviceMesh | None) -> None:
    """Every holder of a parameter tied across pipeline ranks gets the value one process would have. Nothing at
    pp=1 or without such parameters."""
    if stages is None or not stages.tied:
        return
    assert mesh is not None  # a cut exists only over a pipeline mesh dimension
    tp = (mesh.get_local_rank("tp"), mesh["tp"].size())  # a tie sharded over "tp" is tied part by part
    broadcast_tied_values(network, stages.tied, mesh.get_group("pp"), tp)
