"""Worker: a short pipeline fit that records, once training has started, every socket listening on the
rendezvous port (from /proc/net/tcp and tcp6), as (address hex, port)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import payload

sys.path.insert(0, str(Path(__file__).parents[1]))
from user_modules import build, loader  # noqa: E402

import lightning_parallel  # noqa: E402, F401 - registers the strategies

LISTEN = "0A"


def listeners(port: int) -> list[str]:
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


class Record(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seen = listeners(int(os.environ["MASTER_PORT"]))


config, out = payload()
record = Record()
trainer = pl.Trainer(
    accelerator="cpu", devices=2, strategy="pipeline", max_steps=1, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
)  # fmt: skip
trainer.fit(build("sequential_mlp", "criterion"), train_dataloaders=loader(shuffle=False))
torch.save({"listening": record.seen}, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
