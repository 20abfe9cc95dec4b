"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes) as a LightningDataModule.

Real data with no network: loaded lazily, split by a fixed permutation; no augmentation or stratification.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from lightning_parallel.data.base import SplitDataModule, check_batch_size, check_fraction

_NUM_DIGITS = 1797  # known up front so that sizes can be validated before anything is loaded
_NUM_CLASSES = 10
_NATIVE_SIZE = 8
_MAX_PIXEL = 16.0  # load_digits stores pixel intensities as 0..16
# The split must not move with the run seed, or validation metrics of different seeds are incomparable.
_SPLIT_SEED = 0


class DigitsDataModule(SplitDataModule):
    """The 8x8 digits, one channel, standardised with the training mean and standard deviation.

    Args:
        batch_size: Per-process batch size.
        val_fraction: Fraction of the 1797 images held out for validation (also used for test and predict).
        image_size: Side length of the images; values above 8 upscale bilinearly once, at load time.
        shuffle: Shuffle the training set each epoch.
        num_workers: DataLoader worker processes.
        seed: Seeds the shuffle order only; the data and the split never depend on it.
    """

    kind: ClassVar[str] = "image"

    def __init__(
        self,
        *,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        image_size: int = 8,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, seed=seed)
        check_fraction(val_fraction, 0.2)
        num_train = int(_NUM_DIGITS * (1 - val_fraction))
        if num_train < 1 or num_train == _NUM_DIGITS:
            raise ValueError(
                f"data.val_fraction={val_fraction} splits the {_NUM_DIGITS} digits into {num_train} train "
                f"and {_NUM_DIGITS - num_train} val samples; both need at least 1. "
                "HINT: use data.val_fraction=0.2"
            )
        if image_size < _NATIVE_SIZE:
            raise ValueError(
                f"data.image_size={image_size} is below the native {_NATIVE_SIZE}x{_NATIVE_SIZE} digits and "
                f"only upscaling is supported. HINT: use data.image_size>={_NATIVE_SIZE}"
            )
        check_batch_size(batch_size, num_train, "digits")
        self.val_fraction, self.image_size = val_fraction, image_size
        self._num_train = num_train
        self._splits: tuple[TensorDataset, TensorDataset] | None = None

    @property
    def model_hints(self) -> dict[str, int]:
        """Model constructor arguments fixed by the data."""
        return {"in_channels": 1, "image_size": self.image_size, "num_classes": _NUM_CLASSES}

    @property
    def num_train_samples(self) -> int:
        """Number of training images (before any distributed sharding), known without loading."""
        return self._num_train

    def splits(self) -> tuple[TensorDataset, TensorDataset]:
        if self._splits is not None:
            return self._splits
        # Deferred: importing scikit-learn takes about a second that construction should not pay.
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = torch.from_numpy(bunch.images).float().div_(_MAX_PIXEL)  # (N, 8, 8) in [0, 1]
        labels = torch.from_numpy(bunch.target).long()  # (N,)
        if len(labels) != _NUM_DIGITS:
            raise RuntimeError(
                f"load_digits returned {len(labels)} samples, expected {_NUM_DIGITS}. "
                "HINT: update _NUM_DIGITS in lightning_parallel/data/digits.py for this scikit-learn"
            )
        order = torch.randperm(_NUM_DIGITS, generator=torch.Generator().manual_seed(_SPLIT_SEED))
        train_index, val_index = order[: self._num_train], order[self._num_train :]
        # One scalar mean/std: per-pixel std is zero on the always-blank border pixels.
        train_pixels = images[train_index]
        images = ((images - train_pixels.mean()) / train_pixels.std()).unsqueeze(1)  # (N, 1, 8, 8)
        if self.image_size != _NATIVE_SIZE:
            size = (self.image_size, self.image_size)
            images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)  # (N, 1, S, S)
        self._splits = (
            TensorDataset(images[train_index], labels[train_index]),
            TensorDataset(images[val_index], labels[val_index]),
        )
        return self._splits
