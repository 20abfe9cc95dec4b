"""DataModules sharing one small protocol: `kind`, `model_hints`, `num_train_samples`, `(x, y)` batches.

Exports only; each module's data lives in its own file.
"""

from lightning_parallel.data.digits import DigitsDataModule
from lightning_parallel.data.synthetic import SyntheticImagesDataModule, SyntheticTokensDataModule
from lightning_parallel.data.text import TextDataModule

__all__ = ["DigitsDataModule", "SyntheticImagesDataModule", "SyntheticTokensDataModule", "TextDataModule"]
