"""Clients nobody here wrote: Lightning's own demo modules, unmodified, under both strategies by registry name.
BoringModel stops before any process is launched with one line that says what to change (the outcomes the README
lists); none trains silently wrong. The demo `LightningTransformer` trains under both and matches one device
(tests/test_torch_transformer.py)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_parallel  # noqa: F401 - registers the strategies

CASES = {
    "pipeline": "Linear.forward calls no submodule exactly once",
    "tensor_parallel": "found nothing to shard in Linear",
}


@pytest.mark.parametrize("strategy", list(CASES))
def test_the_boring_demo_stops_before_launch_with_one_line(strategy: str) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False)
    with pytest.raises(ValueError, match="HINT") as raised:
        trainer.fit(BoringModel())  # its own train_dataloader hook
    message = str(raised.value)
    assert CASES[strategy] in message and "\n" not in message
    assert trainer.strategy.launcher is not None and not getattr(trainer.strategy.launcher, "procs", [])
