"""One training and one validation step for every compatible model/data pair, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from train import train

SMALL_IMAGES = ["data.image_size=16", "data.num_classes=10", "data.num_samples=32", "data.batch_size=4"]
SMALL_TOKENS = ["model.depth=2", "model.width=32", "model.heads=2", "data.batch_size=4"]
PAIRS = {
    "simple_cnn-digits": ["model=simple_cnn", "data=digits"],
    "simple_cnn-synthetic_images": ["model=simple_cnn", "data=synthetic_images", *SMALL_IMAGES],
    "resnet18-digits": ["model=resnet18", "data=digits", "data.batch_size=4"],
    "resnet50-synthetic_images": ["model=resnet50", "data=synthetic_images", *SMALL_IMAGES],
    "resnet152-synthetic_images": ["model=resnet152", "data=synthetic_images", *SMALL_IMAGES],
    "transformer-synthetic_tokens": ["model=transformer", "data=synthetic_tokens", "data.seq_len=16", *SMALL_TOKENS],
    "transformer-text": ["model=transformer", "data=text", "data.seq_len=16", *SMALL_TOKENS],
}


@pytest.mark.parametrize("pair", PAIRS)
def test_fast_dev_run(compose_cfg, tmp_path: Path, pair: str) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("a small corpus of characters, repeated. " * 50, encoding="utf-8")
    overrides = [o.replace("data=text", f"data=text data.path={text}") for o in PAIRS[pair]]
    cfg = compose_cfg(
        *" ".join(overrides).split(), "trainer.fast_dev_run=true", "trainer.accelerator=cpu", "callbacks=none"
    )
    summary = train(cfg)
    assert summary["steps"] == 1
    assert summary["metrics"]["train/loss"]["final"] > 0
    assert (tmp_path / "summary.json").exists()
