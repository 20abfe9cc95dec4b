"""`strategy.module`: the LightningModule as a non-Optional value, for both strategy families (the mesh strategies and
Lightning's DDP ones), which otherwise share no base class of ours; and `find_network`, the network in it that the
mesh strategies and `strategy=auto` work on. Holds nothing else."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch import nn


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


def find_network(
    module: pl.LightningModule, attr: str | None, *, required: type[nn.Module], need: str, owner: str | None
) -> Any:
    """The network: `module.<attr>`, or with no attribute named, the one child module holding parameters
    (`self.model`, `self.net`, ...). Otherwise one line naming what `need`s it (`owner`: the strategy that takes a
    `network_attr` argument, None where none does)."""
    where = type(module).__name__
    or_attr = f", or pass network_attr='<attribute>' to {owner}" if owner else ""
    if attr is None:
        candidates = [name for name, child in module.named_children() if any(True for _ in child.parameters())]
        if len(candidates) != 1:
            found = f"candidates {candidates}" if candidates else "no child module with parameters"
            raise ValueError(
                f"cannot tell which attribute of {where} is the network ({found}). HINT: keep the network in "
                f"one attribute (self.model = MyNetwork()){or_attr}"
            )
        attr = candidates[0]
    network = getattr(module, attr, None)
    if not isinstance(network, required):
        found = type(network).__name__ if network is not None else "nothing"
        raise ValueError(f"{need} at `{where}.{attr}`; found {found}. HINT: store it there{or_attr}")
    return network
