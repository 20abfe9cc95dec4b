"""Generated image and token data for throughput runs and learnability checks.

Every sample is generated on demand from (seed, index), so nothing is held in memory up front;
nothing here downloads, writes to disk or augments.
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from lightning_parallel.data.base import SplitDataModule, check_batch_size, check_fraction

TASKS = ("copy", "reverse")

_INDEX_STRIDE = 1_000_003  # sample seed = seed * stride + index: distinct streams for up to a million samples
_TEMPLATE_SEED = 2**62  # far above any sample seed, so class templates never share a stream with a sample
_TEMPLATE_GRID = 4  # coarse (4x4) templates, upsampled: tiny to store and visible to a CNN at any size


def _sample_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * _INDEX_STRIDE + index)


def _require_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"data.{name}={value} must be at least {minimum}. HINT: use data.{name}>={minimum}")


def _split_sizes(num_samples: int, val_fraction: float) -> tuple[int, int]:
    check_fraction(val_fraction, 0.1)
    num_train = int(num_samples * (1 - val_fraction))
    if num_train < 1 or num_train == num_samples:
        raise ValueError(
            f"data.num_samples={num_samples} with data.val_fraction={val_fraction} gives {num_train} train "
            f"and {num_samples - num_train} val samples; both need at least 1. HINT: raise data.num_samples"
        )
    return num_train, num_samples - num_train


class _ImageSamples(Dataset[tuple[Tensor, Tensor]]):
    """Samples `start .. start + length - 1` of the image stream: class template + unit Gaussian noise."""

    def __init__(self, *, seed: int, start: int, length: int, channels: int, image_size: int, num_classes: int) -> None:
        self.seed, self.start, self.length = seed, start, length
        self.channels, self.image_size, self.num_classes = channels, image_size, num_classes
        self._templates: Tensor | None = None

    def __len__(self) -> int:
        return self.length

    def _template(self, label: int) -> Tensor:
        if self._templates is None:  # built on first use so that construction stays free
            generator = torch.Generator().manual_seed(_TEMPLATE_SEED + self.seed)
            shape = (self.num_classes, self.channels, _TEMPLATE_GRID, _TEMPLATE_GRID)
            self._templates = torch.randn(shape, generator=generator)
        size = (self.image_size, self.image_size)
        coarse = self._templates[label].unsqueeze(0)  # (1, C, G, G)
        return F.interpolate(coarse, size=size, mode="bilinear", align_corners=False)[0]  # (C, S, S)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        generator = _sample_generator(self.seed, self.start + index)
        label = int(torch.randint(self.num_classes, (1,), generator=generator))
        shape = (self.channels, self.image_size, self.image_size)
        noise = torch.randn(shape, generator=generator)
        return self._template(label) + noise, torch.tensor(label, dtype=torch.int64)


class _TokenSamples(Dataset[tuple[Tensor, Tensor]]):
    """Samples `start .. start + length - 1` of the token stream: a random prefix, then its copy/reversal."""

    def __init__(self, *, seed: int, start: int, length: int, task: str, vocab_size: int, seq_len: int) -> None:
        self.seed, self.start, self.length = seed, start, length
        self.task, self.vocab_size, self.seq_len = task, vocab_size, seq_len

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} samples")
        generator = _sample_generator(self.seed, self.start + index)
        half = (self.seq_len + 2) // 2  # ceil((seq_len + 1) / 2): the echo fills the rest, truncated if odd
        prefix = torch.randint(self.vocab_size, (half,), generator=generator)
        echo = prefix if self.task == "copy" else prefix.flip(0)
        sequence = torch.cat([prefix, echo])[: self.seq_len + 1]  # (T + 1,)
        return sequence[:-1], sequence[1:]


class SyntheticImagesDataModule(SplitDataModule):
    """Random labelled images, weakly learnable: each class adds a fixed smooth template to Gaussian noise.

    Train samples are indices `0 .. num_train - 1` of the stream, val (and test, and predict) the rest.
    """

    kind: ClassVar[str] = "image"

    def __init__(
        self,
        *,
        num_samples: int = 1024,
        channels: int = 3,
        image_size: int = 224,
        num_classes: int = 1000,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, seed=seed)
        for name, value in (("channels", channels), ("image_size", image_size), ("num_classes", num_classes)):
            _require_at_least(name, value, 1)
        num_train, num_val = _split_sizes(num_samples, val_fraction)
        check_batch_size(batch_size, num_train, "synthetic images", " or raise data.num_samples")
        self.channels, self.image_size, self.num_classes = channels, image_size, num_classes
        self._train, self._val = (
            _ImageSamples(
                seed=seed,
                start=start,
                length=length,
                channels=channels,
                image_size=image_size,
                num_classes=num_classes,
            )
            for start, length in ((0, num_train), (num_train, num_val))
        )

    @property
    def model_hints(self) -> dict[str, int]:
        """Model constructor arguments fixed by the data."""
        return {"in_channels": self.channels, "image_size": self.image_size, "num_classes": self.num_classes}

    @property
    def num_train_samples(self) -> int:
        """Number of training samples (before any distributed sharding)."""
        return len(self._train)

    def splits(self) -> tuple[Dataset, Dataset]:
        return self._train, self._val


class SyntheticTokensDataModule(SplitDataModule):
    """A learnable sequence task: a random prefix followed by its copy ("copy") or reversal ("reverse").

    The prefix is unpredictable, so the loss falls to about half of ln(vocab_size), not to zero.
    """

    kind: ClassVar[str] = "tokens"

    def __init__(
        self,
        *,
        task: str = "copy",
        vocab_size: int = 32,
        seq_len: int = 32,
        num_samples: int = 2048,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, seed=seed)
        if task not in TASKS:
            raise ValueError(f"data.task={task!r} is unknown. HINT: use one of data.task={' | '.join(TASKS)}")
        _require_at_least("vocab_size", vocab_size, 2)
        _require_at_least("seq_len", seq_len, 2)
        num_train, num_val = _split_sizes(num_samples, val_fraction)
        check_batch_size(batch_size, num_train, f"synthetic {task} sequences", " or raise data.num_samples")
        self.task, self.vocab_size, self.seq_len = task, vocab_size, seq_len
        self._train, self._val = (
            _TokenSamples(seed=seed, start=start, length=length, task=task, vocab_size=vocab_size, seq_len=seq_len)
            for start, length in ((0, num_train), (num_train, num_val))
        )

    @property
    def model_hints(self) -> dict[str, int]:
        """Model constructor arguments fixed by the data."""
        return {"vocab_size": self.vocab_size, "context_length": self.seq_len}

    @property
    def num_train_samples(self) -> int:
        """Number of training sequences (before any distributed sharding)."""
        return len(self._train)

    def splits(self) -> tuple[Dataset, Dataset]:
        return self._train, self._val
