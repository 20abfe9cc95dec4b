"""`SharedCUDAAccelerator`: Lightning's CUDA accelerator whose `devices=N` means N ranks on cuda:0, so one GPU runs
tensor, pipeline and 3D parallelism (with `process_group_backend="gloo_host"`: NCCL refuses two ranks on one device).
For checking a layout's CUDA code on one GPU, not for speed; it does not share memory or streams between the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from typing_extensions import override


class SharedCUDAAccelerator(CUDAAccelerator):
    """Lightning's CUDA accelerator whose `devices=N` means N ranks on cuda:0 (no id checks against the machine)."""

    @staticmethod
    @override
    def parse_devices(devices: Any) -> int:  # type: ignore[override]
        count = len(devices) if isinstance(devices, (list, tuple)) else int(devices)
        if count < 1:
            raise ValueError(f"SharedCUDAAccelerator needs devices >= 1, got {devices}. HINT: devices=2")
        return count

    @staticmethod
    @override
    def get_parallel_devices(devices: Any) -> list[torch.device]:  # type: ignore[override]
        return [torch.device("cuda", 0)] * int(devices)

    @staticmethod
    @override
    def auto_device_count() -> int:
        return 1

    @override
    def setup_device(self, device: torch.device) -> None:
        # CUDA initialised before the strategy's DeviceMesh, which otherwise sets the device from LOCAL_RANK (past 0)
        torch.cuda.init()
        super().setup_device(device)
