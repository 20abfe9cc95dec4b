"""`strategy.module`: the LightningModule as a non-Optional value, for both strategy families (the mesh strategies and
Lightning's DDP ones), which otherwise share no base class of ours. Holds nothing else."""

from __future__ import annotations

import lightning.pytorch as pl


class ModuleAccess:
    """Mixed into a Lightning `Strategy`: `module` fails loudly when used before the Trainer sets the strategy up."""

    lightning_module: pl.LightningModule | None  # Lightning's Strategy property

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule, which exists from set-up on (Lightning's `lightning_module` is typed Optional)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(f"{type(self).__name__} has no LightningModule before the Trainer sets it up")
        return module
