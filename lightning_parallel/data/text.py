"""Character-level language modelling on any UTF-8 text file the user names.

Reads and encodes the file at construction (the vocabulary sizes the model); no tokenizer, no streaming.
"""

import math
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_parallel.data.base import SplitDataModule, check_batch_size, check_fraction

_PATH_HINT = "HINT: data.path=/path/to/file.txt"


def _resolve(path: str) -> Path:
    resolved = Path(path).expanduser()
    return resolved if resolved.is_absolute() else Path.cwd() / resolved


def _read_text(path: Path) -> str:
    if not path.is_file():
        problem = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"data.path={path} {problem}. {_PATH_HINT}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # -sig: a leading byte-order mark is not a character of the text
    except UnicodeDecodeError as error:
        raise ValueError(
            f"data.path={path} is not UTF-8 text "
            f"(invalid byte {raw[error.start]:#04x} at offset {error.start}). "
            "HINT: convert it with `iconv -t UTF-8` or point data.path at a UTF-8 file"
        ) from None
    if not text:
        raise ValueError(f"data.path={path} is empty ({len(raw)} bytes). HINT: point data.path at a non-empty file")
    return text


def _min_chars(window: int, val_fraction: float) -> int:
    """Fewest characters whose split gives both train and val at least one `window`."""
    chars = math.ceil(window / min(val_fraction, 1 - val_fraction))
    while min(int(chars * (1 - val_fraction)), chars - int(chars * (1 - val_fraction))) < window:
        chars += 1  # float rounding of the split can cost a character or two
    return chars


class _Windows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of `window` token ids; a sample is (window[:-1], window[1:])."""

    def __init__(self, ids: Tensor, window: int) -> None:
        self.ids, self.window = ids, window

    def __len__(self) -> int:
        return len(self.ids) // self.window

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        chunk = self.ids[index * self.window : (index + 1) * self.window].long()  # (T + 1,)
        return chunk[:-1], chunk[1:]


class TextDataModule(SplitDataModule):
    """Characters of a UTF-8 file: the first `1 - val_fraction` of the text trains, the rest validates.

    Args:
        path: The text file; `~` is expanded and relative paths start at the current working directory.
        seq_len: Context length T; each sample is a window of T + 1 characters.
        batch_size: Per-process batch size.
        val_fraction: Trailing fraction of the text held out for validation (also used for test and predict).
        shuffle: Shuffle the training windows each epoch.
        num_workers: DataLoader worker processes.
        seed: Seeds the shuffle order only.
    """

    kind: ClassVar[str] = "tokens"

    def __init__(
        self,
        *,
        path: str,
        seq_len: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, seed=seed)
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be at least 1. HINT: use data.seq_len>=1")
        check_fraction(val_fraction, 0.1)
        self.path = _resolve(path)
        text = _read_text(self.path)
        # Vectorised encoding: a Python loop over a large corpus would take minutes.
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        vocab_codepoints = np.unique(codepoints)  # sorted, so the vocabulary is the sorted set of characters
        self.vocab: list[str] = [chr(c) for c in vocab_codepoints]
        # int32 halves the memory of the whole encoded text; windows become int64 when sampled.
        ids = torch.from_numpy(np.searchsorted(vocab_codepoints, codepoints).astype(np.int32))
        split = int(len(ids) * (1 - val_fraction))
        window = seq_len + 1
        if min(split, len(ids) - split) < window:
            largest = min(split, len(ids) - split) - 1
            fix = f"data.seq_len<={largest} or a longer file" if largest >= 1 else "a longer file"
            raise ValueError(
                f"data.path={self.path} has {len(ids)} characters, too few for one train and one val "
                f"window of data.seq_len+1={window} with data.val_fraction={val_fraction}: "
                f"needs at least {_min_chars(window, val_fraction)}. HINT: use {fix}"
            )
        self._train, self._val = _Windows(ids[:split], window), _Windows(ids[split:], window)
        check_batch_size(
            batch_size,
            len(self._train),
            f"{self.path} (windows of data.seq_len+1 characters)",
            " or a smaller data.seq_len",
        )
        self.seq_len, self.val_fraction = seq_len, val_fraction

    @property
    def model_hints(self) -> dict[str, int]:
        """Model constructor arguments fixed by the data."""
        return {"vocab_size": len(self.vocab), "context_length": self.seq_len}

    @property
    def num_train_samples(self) -> int:
        """Number of training windows (before any distributed sharding)."""
        return len(self._train)

    def splits(self) -> tuple[Dataset, Dataset]:
        return self._train, self._val
