"""Worker: fit the tiny GPT under each pipeline configuration in the payload, then validate; save the training
losses, the validation metrics and the local weights."""

from __future__ import annotations

import torch
from common import fit_model, local_state, payload

from lightning_parallel import PipelineParallelStrategy

configs, out = payload()
results = []
for config in configs:
    strategy = PipelineParallelStrategy(**config["strategy"], timeout=60)
    task, losses, trainer = fit_model(
        strategy,
        model="gpt6",
        devices=config["devices"],
        global_batch=config["global_batch"],
        replicas=config["strategy"].get("data_parallel_size", 1),
        steps=config["steps"],
        val_batches=config.get("val_batches", 0),
        **config.get("trainer", {}),
    )
    metrics = (
        trainer.validate(task, datamodule=trainer.datamodule, verbose=False)[0] if config.get("val_batches") else {}
    )
    results.append({"losses": losses, "state": local_state(task), "val": {k: float(v) for k, v in metrics.items()}})
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
# Leave together and tear down cleanly: gloo aborts ranks still connected at exit.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
