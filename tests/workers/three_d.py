"""Worker: fit a tiny network under each PipelineParallelStrategy configuration of the payload (tensor parallelism
inside the stages, optionally replicas), then validate and predict if asked; save the losses, the metrics, the
predictions, this rank's parameters gathered whole over "tp" and the dtypes its Linear layers computed in training."""

from __future__ import annotations

import torch
from common import fit_model, full_state, payload

from lightning_parallel import PipelineParallelStrategy


def record_linear_dtypes(seen: set[str]) -> torch.utils.hooks.RemovableHandle:
    """Every training forward of a Linear layer adds its output's dtype to `seen` (bf16-mixed: bfloat16 alone)."""

    def hook(module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(module, torch.nn.Linear) and module.training and isinstance(output, torch.Tensor):
            seen.add(str(output.dtype).removeprefix("torch."))

    return torch.nn.modules.module.register_module_forward_hook(hook)


configs, out = payload()
results = []
for config in configs:
    strategy = PipelineParallelStrategy(**config["strategy"], timeout=120)
    linear_dtypes: set[str] = set()
    recording = record_linear_dtypes(linear_dtypes)
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
    recording.remove()
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
            "linear_dtypes": sorted(linear_dtypes),
        }
    )
torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
