"""torchrun on one machine, its workers forked from this process, which has imported train.py once.

`python elastic.py <max restarts> <train.py arguments>` runs what `torchrun --nproc-per-node=2 --rdzv-backend=c10d
--max-restarts=<n> train.py <arguments>` runs: torch's own launcher (`elastic_launch`, which torchrun calls), its
agent, c10d rendezvous, shared store, restarts and TORCHELASTIC_* variables. Only the workers start differently: forked
instead of executed, so an attempt does not pay ~5 s of CPU per worker importing torch, Lightning and Hydra again.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import train  # its imports: torch, Lightning, Hydra, the library


def worker(args: list[str]) -> None:
    """`python train.py <args>`, as a script (Hydra finds conf/ next to it); its imports are already loaded."""
    # As a freshly started worker has them: the rank Lightning read at import (before the fork), and SIGTERM's default
    # action (the fork inherits the agent's Python handler, which a worker blocked in C++ would never run).
    rank_zero_only.rank = utils_rank_zero_only.rank = int(os.environ["RANK"])  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [train.__file__, *args]
    runpy.run_path(train.__file__, run_name="__main__")


if __name__ == "__main__":
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id="elastic",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=int(sys.argv[1]),
        monitor_interval=0.2,
        start_method="fork",
    )
    elastic_launch(config, worker)(sys.argv[2:])
