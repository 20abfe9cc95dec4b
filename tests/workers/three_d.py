"""Worker: fit a tiny network under each PipelineParallelStrategy configuration of the payload (tensor parallelism
inside the stages, optionally replicas), then validate and predict if asked; save the losses, the metrics, the
predictions and this rank's parameters gathered whole over "tp"."""

from __future__ import annotations

import torch
from common import fit_model, full_state, payload

from lightning_parallel import PipelineParallelStrategy

configs, out = payload()
results = []
for config in configs:
    strategy = PipelineParallelStrategy(**config["strategy"], timeout=120)
    task, losses, trainer = fit_model(
        strategy,
        model=config["model"],
        devices=config["devices"],
        global_batch=config["global_batch"],
        replicas=config["strategy"].get("data_parallel_size", 1),
        steps=config["steps"],
        optimizer=config.get("optimizer"),
        save=config.get("save"),
        ckpt_path=config.get("ckpt_path"),
        val_batches=config.get("val_batches", 0),
        **config.get("trainer", {}),
    )
    validated = (
        trainer.validate(task, datamodule=trainer.datamodule, verbose=False) if config.get("val_batches") else []
    )
    predicted = trainer.predict(task, datamodule=trainer.datamodule) if config.get("predict") else []
    state = {name: t for name, t in full_state(task.model).items() if name in dict(task.model.named_parameters())}
    shapes = {name: tuple(getattr(p, "_local_tensor", p).shape) for name, p in task.model.named_parameters()}
    results.append(
        {
            "losses": losses,
            "state": state,
            "shapes": shapes,
            "parallel": trainer.strategy.describe(),
            "val": {key: float(value) for key, value in (validated[0] if validated else {}).items()},
            "predictions": torch.cat(predicted) if predicted else None,
            "setup_peak": trainer.strategy.setup_peak_parameter_bytes,
        }
    )
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
