"""`RecordPretrained`: records a transformers model's class and config in every checkpoint, as the mesh strategies do
themselves, so that `python -m lightning_parallel.checkpoint export CKPT OUT_DIR --hf` works for checkpoints saved
under any other strategy (one device, Lightning's DDP or FSDP). The record is `hf_format.py`'s; nothing else here."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_parallel.hf_format import RECORD_KEY, describe_pretrained


class RecordPretrained(pl.Callback):
    """Adds `checkpoint["hugging_face"]` (the model's attribute path, class, config and tied weights as plain data)
    whenever the module holds a transformers model; adds nothing otherwise."""

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        pretrained = describe_pretrained(module)
        if pretrained:
            checkpoint[RECORD_KEY] = pretrained
