"""The dry run: a strategy's real set-up at any world size in one process, on torch's fake process group and fake
tensors, one row per rank role with measured bytes next to the planner's (`run.dry_run`). Launches nothing.
"""

from lightning_parallel.dryrun.report import DryRun, RoleRow
from lightning_parallel.dryrun.run import dry_run

__all__ = ["DryRun", "RoleRow", "dry_run"]
