"""Lightning callbacks usable in any project."""

from lightning_parallel.callbacks.async_checkpoints import AsyncCheckpoints
from lightning_parallel.callbacks.exact_resume import ExactResume
from lightning_parallel.callbacks.record_pretrained import RecordPretrained
from lightning_parallel.callbacks.resume_record import ResumeRecord
from lightning_parallel.callbacks.run_summary import RunSummary

__all__ = ["AsyncCheckpoints", "ExactResume", "RecordPretrained", "ResumeRecord", "RunSummary"]
