"""DataModules: batch shapes, determinism, splits, task structure and one-line errors; no processes."""

from pathlib import Path

import pytest
import torch

from lightning_parallel.data import (
    DigitsDataModule,
    SyntheticImagesDataModule,
    SyntheticTokensDataModule,
    TextDataModule,
)


def first_batch(loader: torch.utils.data.DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    return next(iter(loader))


def all_val(dm) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*dm.val_dataloader(), strict=True)
    return torch.cat(xs), torch.cat(ys)


# --- digits -------------------------------------------------------------------------------------------


def test_digits_batch_hints_and_sizes():
    dm = DigitsDataModule(batch_size=16)
    assert dm.kind == "image"
    assert dm.num_train_samples == 1437
    assert dm.model_hints == {"in_channels": 1, "image_size": 8, "num_classes": 10}
    dm.setup("fit")
    x, y = first_batch(dm.train_dataloader())
    assert x.shape == (16, 1, 8, 8) and x.dtype == torch.float32
    assert y.shape == (16,) and y.dtype == torch.int64
    train_size = len(dm.train_dataloader().dataset)
    val_size = len(dm.val_dataloader().dataset)
    assert (train_size, val_size) == (1437, 360)
    assert train_size + val_size == 1797
    assert len(dm.test_dataloader().dataset) == len(dm.predict_dataloader().dataset) == 360


def test_digits_standardised_with_train_statistics():
    dm = DigitsDataModule()
    train_x = dm.train_dataloader().dataset.tensors[0]
    assert abs(train_x.mean().item()) < 1e-5
    assert abs(train_x.std().item() - 1.0) < 1e-4


def test_digits_split_does_not_depend_on_seed():
    a, b = DigitsDataModule(seed=0), DigitsDataModule(seed=7)
    xa, ya = all_val(a)
    xb, yb = all_val(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # The seed moves only the shuffle order, and the same seed repeats it exactly.
    assert torch.equal(first_batch(a.train_dataloader())[1], first_batch(DigitsDataModule().train_dataloader())[1])
    assert not torch.equal(first_batch(a.train_dataloader())[1], first_batch(b.train_dataloader())[1])


def test_digits_upscaled_to_16():
    dm = DigitsDataModule(batch_size=8, image_size=16)
    assert dm.model_hints["image_size"] == 16
    x, _ = first_batch(dm.val_dataloader())
    assert x.shape == (8, 1, 16, 16) and x.dtype == torch.float32


def test_digits_errors():
    with pytest.raises(ValueError, match=r"data.batch_size=5000 exceeds the 1437 training samples of digits"):
        DigitsDataModule(batch_size=5000)
    with pytest.raises(ValueError, match=r"data.batch_size=0 must be at least 1"):
        DigitsDataModule(batch_size=0)
    with pytest.raises(ValueError, match=r"data.image_size=4 .* HINT: use data.image_size>=8"):
        DigitsDataModule(image_size=4)
    with pytest.raises(ValueError, match=r"data.val_fraction=1.0 must lie strictly between 0 and 1"):
        DigitsDataModule(val_fraction=1.0)


# --- synthetic images ---------------------------------------------------------------------------------


def images(**overrides) -> SyntheticImagesDataModule:
    kwargs = dict(num_samples=64, channels=3, image_size=16, num_classes=5, batch_size=8) | overrides
    return SyntheticImagesDataModule(**kwargs)


def test_synthetic_images_batch_hints_and_sizes():
    dm = images()
    assert dm.kind == "image"
    assert dm.model_hints == {"in_channels": 3, "image_size": 16, "num_classes": 5}
    assert dm.num_train_samples == 57  # int(64 * 0.9)
    assert len(dm.val_dataloader().dataset) == 7
    x, y = first_batch(dm.train_dataloader())
    assert x.shape == (8, 3, 16, 16) and x.dtype == torch.float32
    assert y.shape == (8,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 5


def test_synthetic_images_default_size_is_lazy():
    dm = SyntheticImagesDataModule(num_samples=100_000)
    x, y = dm.train_dataloader().dataset[89_999]
    assert x.shape == (3, 224, 224) and 0 <= int(y) < 1000


def test_synthetic_images_deterministic_per_seed():
    x0, y0 = all_val(images())
    x1, y1 = all_val(images())
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    x2, _ = all_val(images(seed=1))
    assert not torch.equal(x0, x2)


def test_synthetic_images_carry_class_signal():
    # Same-class images share a template, so their mean is far from zero where pure noise would not be.
    dm = images(num_samples=400, num_classes=2, batch_size=8)
    xs, ys = zip(*(dm.train_dataloader().dataset[i] for i in range(300)), strict=True)
    x, y = torch.stack(xs), torch.stack(ys)
    template_0, template_1 = x[y == 0].mean(0), x[y == 1].mean(0)
    assert (template_0 - template_1).abs().mean() > 0.3


def test_synthetic_images_errors():
    with pytest.raises(ValueError, match=r"data.batch_size=100 exceeds the 57 training samples"):
        images(batch_size=100)
    with pytest.raises(ValueError, match=r"data.channels=0 must be at least 1"):
        images(channels=0)
    with pytest.raises(ValueError, match=r"data.num_samples=1 .* gives 0 train and 1 val"):
        images(num_samples=1, batch_size=1)


# --- synthetic tokens ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [8, 9])
def test_synthetic_tokens_copy_and_reverse_structure(seq_len):
    for task in ("copy", "reverse"):
        dm = SyntheticTokensDataModule(task=task, vocab_size=11, seq_len=seq_len, num_samples=40, batch_size=4)
        assert dm.kind == "tokens"
        assert dm.model_hints == {"vocab_size": 11, "context_length": seq_len}
        assert dm.num_train_samples == 36
        x, y = first_batch(dm.train_dataloader())
        assert x.shape == y.shape == (4, seq_len)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        sequence = torch.cat([x, y[:, -1:]], dim=1)  # (B, T + 1)
        half = (seq_len + 2) // 2
        prefix, echo = sequence[:, :half], sequence[:, half:]
        expected = prefix if task == "copy" else prefix.flip(1)
        assert torch.equal(echo, expected[:, : echo.shape[1]])
        assert int(sequence.max()) < 11


def test_synthetic_tokens_deterministic_per_seed():
    def val(seed):
        return all_val(SyntheticTokensDataModule(num_samples=64, batch_size=4, seed=seed))

    assert torch.equal(val(0)[0], val(0)[0])
    assert not torch.equal(val(0)[0], val(1)[0])


def test_synthetic_tokens_errors():
    with pytest.raises(ValueError, match=r"data.task='sort' is unknown. HINT: .*copy \| reverse"):
        SyntheticTokensDataModule(task="sort")
    with pytest.raises(ValueError, match=r"data.seq_len=1 must be at least 2"):
        SyntheticTokensDataModule(seq_len=1)
    with pytest.raises(ValueError, match=r"data.batch_size=4096 exceeds the 1843 training samples"):
        SyntheticTokensDataModule(batch_size=4096)


# --- text ---------------------------------------------------------------------------------------------


def write(tmp_path: Path, content: str | bytes, name: str = "corpus.txt") -> Path:
    path = tmp_path / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def test_text_vocab_windows_and_shift(tmp_path):
    text = "abcdefghij" * 10  # 100 characters: 90 train, 10 val
    dm = TextDataModule(path=str(write(tmp_path, text)), seq_len=4, batch_size=2)
    assert dm.kind == "tokens"
    assert dm.vocab == sorted(set(text))
    assert dm.model_hints == {"vocab_size": 10, "context_length": 4}
    assert dm.num_train_samples == 90 // 5
    assert len(dm.val_dataloader().dataset) == 10 // 5
    x, y = dm.train_dataloader().dataset[1]
    assert "".join(dm.vocab[i] for i in x) == text[5:9]  # non-overlapping windows of seq_len + 1
    assert "".join(dm.vocab[i] for i in y) == text[6:10]
    bx, by = first_batch(dm.train_dataloader())
    assert bx.shape == by.shape == (2, 4) and bx.dtype == by.dtype == torch.int64
    assert torch.equal(bx[:, 1:], by[:, :-1])


def test_text_unicode_and_relative_path(tmp_path, monkeypatch):
    text = "héllo wörld ✓ " * 20
    write(tmp_path, "\ufeff" + text)  # a byte-order mark is not part of the vocabulary
    monkeypatch.chdir(tmp_path)
    dm = TextDataModule(path="corpus.txt", seq_len=8, batch_size=1)
    assert dm.path == tmp_path / "corpus.txt"
    assert dm.vocab == sorted(set(text))


def test_text_shuffle_deterministic(tmp_path):
    path = str(write(tmp_path, "the quick brown fox jumps over the lazy dog. " * 40))

    def batch(seed, shuffle=True):
        data = TextDataModule(path=path, seq_len=8, batch_size=4, seed=seed, shuffle=shuffle)
        return first_batch(data.train_dataloader())[0]

    assert torch.equal(batch(3), batch(3))  # the same seed repeats the order
    assert not torch.equal(batch(3), batch(4))  # and it does shuffle: another seed, another order
    assert not torch.equal(batch(3), batch(3, shuffle=False))
    assert torch.equal(batch(3, shuffle=False), batch(4, shuffle=False))


def test_text_errors(tmp_path):
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match=rf"data.path={missing} does not exist. HINT: data.path=/path/to"):
        TextDataModule(path=str(missing))
    with pytest.raises(FileNotFoundError, match=r"is a directory, not a file"):
        TextDataModule(path=str(tmp_path))
    with pytest.raises(ValueError, match=r"corpus.txt is empty \(0 bytes\)"):
        TextDataModule(path=str(write(tmp_path, b"")))
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(invalid byte 0xff at offset 3\)"):
        TextDataModule(path=str(write(tmp_path, b"abc\xffdef")))
    short = str(write(tmp_path, "x" * 100))
    with pytest.raises(ValueError, match=r"has 100 characters, .* needs at least 1290. HINT: use data.seq_len<=9"):
        TextDataModule(path=short, seq_len=128)
    with pytest.raises(ValueError, match=r"data.batch_size=50 exceeds the 18 training samples of"):
        TextDataModule(path=short, seq_len=4, batch_size=50)


def test_text_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, "abcdefghij" * 10)
    assert TextDataModule(path="~/corpus.txt", seq_len=4, batch_size=1).path == tmp_path / "corpus.txt"
