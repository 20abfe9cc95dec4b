"""Strategy-agnostic LightningModules."""

from lightning_parallel.tasks.base import Task
from lightning_parallel.tasks.classification import ClassificationTask
from lightning_parallel.tasks.language_model import LanguageModelTask

__all__ = ["ClassificationTask", "LanguageModelTask", "Task"]
