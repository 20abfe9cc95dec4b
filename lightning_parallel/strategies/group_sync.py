"""How fault-tolerant replica groups agree, one class per kind, and the ledger of what became of each optimizer step.

`EveryStep` (sync="ddp"): a quorum before each step's forward, the gradients averaged over the groups of the quorum,
the step applied only where torchft's commit vote says yes. `Periodic` (sync="local_sgd" / "diloco"): torchft's own
`LocalSGD` / `DiLoCo` on the inner optimizer, a quorum at each sync only. Neither knows Lightning's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer

from lightning_parallel.replica_groups import average_gradients_, require_torchft
from lightning_parallel.token_mean import Divisor, summed


@dataclass
class StepLedger:
    """One group's account of its optimizer steps; `applied` is what Lightning's global_step shows.

    Args:
        applied: steps in effect in the weights (max_steps counts these); a rejoining group takes the sender's.
        not_committed: steps (ddp) or syncs (local SGD) the commit vote refused: nothing of them was applied.
        discarded: inner steps a failed DiLoCo sync undid (torchft restores the last synced weights).
        heals: live states this group received (its first quorum counts one: torchft's init_sync).
        fewest_groups: the fewest groups that took part in one quorum (0 before the first).
    """

    applied: int = 0
    not_committed: int = 0
    discarded: int = 0
    heals: int = 0
    fewest_groups: int = 0

    def saw_quorum(self, groups: int) -> None:
        self.fewest_groups = groups if self.fewest_groups == 0 else min(self.fewest_groups, groups)


class EveryStep:
    """sync="ddp": every step is a quorum, a gradient average over its groups and a commit vote."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.committed = False
        self._quorum_open = False

    def begin_batch(self, ledger: StepLedger) -> None:
        """Before the forward of a step's first batch: the quorum (a group that is behind heals here, before it
        computes anything on its old weights)."""
        if not self._quorum_open:
            self.manager.start_quorum()
            ledger.saw_quorum(self.manager.num_participants())
            self._quorum_open = True

    def token_divisor(self, world_size: int) -> Divisor:
        """What one rank's sum over valid tokens is divided by (`token_mean.TokenMean`) so that the gradients, averaged
        over the group's `world_size` ranks and then over the quorum's groups, are the mean over the valid tokens of
        every group's batch: the count summed over the group, then over the quorum through the manager (a collective
        that fails leaves a wrong divisor on a step the commit vote then refuses)."""

        def divisor(count: Tensor) -> Tensor:
            total = summed(count, None) if world_size > 1 else count.clone()
            self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
            return total / (world_size * max(self.manager.num_participants(), 1))

        return divisor

    def around_closure(
        self, closure: Callable[[], Any], optimizer: Optimizer, parameters: Sequence[Tensor]
    ) -> Callable[[], Any]:
        """Lightning's closure (forward, backward), then the average over the groups and the vote. A refused step
        leaves no gradient, so the optimizer changes nothing (torch's optimizers skip a parameter without one)."""

        def agreed() -> Any:
            result = closure()
            average_gradients_(self.manager, parameters)
            self.committed = self.manager.should_commit()
            if not self.committed:
                optimizer.zero_grad(set_to_none=True)
            return result

        return agreed

    def after_step(self, ledger: StepLedger) -> str | None:
        self._quorum_open = False
        if self.committed:
            ledger.applied += 1
            return None
        ledger.not_committed += 1
        return f"step {ledger.applied + 1} was not committed (a group was lost mid-step); nothing was applied"

    def close(self) -> None:
        pass


class Periodic:
    """sync="local_sgd" or "diloco": torchft's `LocalSGD` (parameters averaged every `period` steps) or `DiLoCo`
    (pseudo-gradients averaged and an outer step every `period` steps), hooked on the inner optimizer."""

    def __init__(
        self,
        manager: Any,
        *,
        kind: str,
        module: nn.Module,
        optimizer: Optimizer,
        period: int,
        outer_optimizer: Callable[[list[Tensor]], Optimizer] | None,
    ) -> None:
        local_sgd = require_torchft("torchft.local_sgd")
        self.manager, self.kind, self.period = manager, kind, period
        if kind == "local_sgd":
            self.torchft_sync: Any = local_sgd.LocalSGD(manager, module, optimizer, sync_every=period)
        else:
            assert outer_optimizer is not None
            outer = outer_optimizer(list(module.parameters()))  # torchft's DiLoCo steps the parameters themselves
            self.torchft_sync = local_sgd.DiLoCo(manager, [module], optimizer, outer, sync_every=period)
        self.torchft_sync.__enter__()  # registers its hooks on the inner optimizer
        self._since_sync = 0
        self._syncs = manager.current_step()

    def begin_batch(self, ledger: StepLedger) -> None:
        pass

    def around_closure(
        self, closure: Callable[[], Any], optimizer: Optimizer, parameters: Sequence[Tensor]
    ) -> Callable[[], Any]:
        return closure

    def after_step(self, ledger: StepLedger) -> str | None:
        """Count the inner step; after a sync, whether it committed (torchft counts committed syncs)."""
        ledger.applied += 1
        self._since_sync += 1
        if self._since_sync < self.period:
            return None
        self._since_sync = 0
        synced, self._syncs = self.manager.current_step() > self._syncs, self.manager.current_step()
        if synced:
            ledger.saw_quorum(self.manager.num_participants())
            return None
        ledger.not_committed += 1
        if self.kind == "local_sgd":
            return f"the sync after step {ledger.applied} was not committed; parameters stay unaveraged till the next"
        ledger.applied -= self.period
        ledger.discarded += self.period
        return (
            f"the sync after step {ledger.applied + self.period} was not committed; DiLoCo restored the weights of "
            f"step {ledger.applied} (the inner optimizer's state is not restored)"
        )

    def close(self) -> None:
        self.torchft_sync.__exit__(None, None, None)
