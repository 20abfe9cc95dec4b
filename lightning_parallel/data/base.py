"""What every data module here shares: a train and a val split, loaders, size checks, and sampling
that gives the same global batches at any number of data-parallel replicas.

It does not generate, read or transform data; subclasses do.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override


def check_fraction(val_fraction: float, default: float) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(
            f"data.val_fraction={val_fraction} must lie strictly between 0 and 1. HINT: use data.val_fraction={default}"
        )


def check_batch_size(batch_size: int, num_train: int, what: str, fix: str = "") -> None:
    if batch_size < 1:
        raise ValueError(f"data.batch_size={batch_size} must be at least 1. HINT: use data.batch_size>=1")
    if batch_size > num_train:
        raise ValueError(
            f"data.batch_size={batch_size} exceeds the {num_train} training samples of {what}. "
            f"HINT: use data.batch_size<={num_train}{fix}"
        )


class SplitDataModule(LightningDataModule, ABC):
    """A LightningDataModule over one train and one val dataset; test and predict reuse val.

    The training sampler is always a `DistributedSampler` over the strategy's data-parallel replicas
    (one replica without a strategy). Its permutation depends only on the seed and the epoch, so with
    per-replica batch B/R, the R replicas of step k together hold exactly the single-process batch k:
    runs at different data-parallel sizes see the same global batches.
    """

    kind: ClassVar[str]  # "image" or "tokens": which models can consume the batches

    def __init__(self, *, batch_size: int, shuffle: bool, num_workers: int, seed: int) -> None:
        super().__init__()
        self.batch_size, self.shuffle, self.num_workers, self.seed = batch_size, shuffle, num_workers, seed

    @property
    @abstractmethod
    def model_hints(self) -> dict[str, int]:
        """Model constructor arguments fixed by the data."""

    @property
    @abstractmethod
    def num_train_samples(self) -> int:
        """Number of training samples before any sharding, known without loading the data."""

    @abstractmethod
    def splits(self) -> tuple[Dataset, Dataset]:
        """The (train, val) datasets; may load on first call."""

    @override
    def setup(self, stage: str) -> None:
        self.splits()

    def _replicas(self) -> tuple[int, int]:
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    @override
    def train_dataloader(self) -> DataLoader:
        train = self.splits()[0]
        replicas, rank = self._replicas()
        # Lightning keeps a DistributedSampler it finds instead of injecting its own.
        sampler: DistributedSampler[int] = DistributedSampler(
            train, num_replicas=replicas, rank=rank, shuffle=self.shuffle, seed=self.seed
        )
        return DataLoader(train, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)

    def _eval_loader(self) -> DataLoader:
        return DataLoader(self.splits()[1], batch_size=self.batch_size, num_workers=self.num_workers)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    @override
    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    @override
    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader()
