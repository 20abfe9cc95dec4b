"""Checkpoints back to Hugging Face in one process: `export CKPT OUT_DIR --hf` writes a `save_pretrained` directory
that `AutoModelForCausalLM.from_pretrained` loads with the trained weights (tied weights stored once), from a checkpoint
saved under Lightning's own single-device strategy with `RecordPretrained`; a checkpoint of no transformers model is
one line and exit 2. The pipeline and 3D round trips run inside tests/test_hf_pipeline.py's launches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_modules import build, exported_logits_gap, token_loader  # noqa: E402

from lightning_parallel.callbacks import RecordPretrained  # noqa: E402
from lightning_parallel.checkpoint import main  # noqa: E402
from lightning_parallel.hf_format import describe_pretrained  # noqa: E402


def test_a_single_device_checkpoint_exports_as_a_directory_from_pretrained_reads(tmp_path: Path) -> None:
    from safetensors import safe_open

    module = build("gpt2")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RecordPretrained()], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=token_loader())
    checkpoint = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(checkpoint)
    state = {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    gap = exported_logits_gap(str(checkpoint), state, str(tmp_path / "hf"))
    print(f"single device export: logits gap {gap:.1e}")
    assert gap < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as weights:
        assert weights.metadata() == {"format": "pt"}
        keys = set(weights.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # tied: stored once, as transformers does
    assert not any(key.startswith("model.") for key in keys)


def test_the_record_is_plain_data_and_finds_the_outermost_model() -> None:
    record = describe_pretrained(build("gpt2"))
    assert list(record) == ["model"]  # not model.transformer, the GPT2Model inside
    assert record["model"]["class"] == "GPT2LMHeadModel" and record["model"]["tied"] == {
        "lm_head.weight": "transformer.wte.weight"
    }
    assert json.loads(json.dumps(record)) == record
    assert describe_pretrained(torch.nn.Linear(2, 2)) == {}


def test_a_checkpoint_of_no_transformers_model_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    checkpoint = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"model.weight": torch.zeros(2, 2)}, "epoch": 0}, checkpoint)
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--hf"]) == 2
    error = capsys.readouterr().err
    assert "records no transformers model" in error and "HINT" in error and error.count("\n") == 1
    assert not (tmp_path / "hf").exists()


class _Config:
    model_type = "toy"

    def __init__(self, value: object) -> None:
        self.value = value

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "value": self.value}


class _Toy(torch.nn.Module):
    """Recognised by structure alone, as any transformers model is: a `config` with `to_dict` and `model_type`."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.config = _Config(value)
        self.layer = torch.nn.Linear(2, 2)


def test_a_config_json_cannot_write_is_named_at_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    holder = torch.nn.Module()
    holder.net = _Toy(object())  # a value json cannot write: the save still succeeds
    checkpoint = tmp_path / "toy.ckpt"
    torch.save({"state_dict": holder.state_dict(), "hugging_face": describe_pretrained(holder)}, checkpoint)
    assert main(["export", str(checkpoint), str(tmp_path / "hf"), "--hf"]) == 2
    error = capsys.readouterr().err
    assert "_Toy whose config could not be recorded" in error and "not JSON" in error and error.count("\n") == 1
    holder.net = _Toy(3)
    assert describe_pretrained(holder)["net"]["config"] == {"model_type": "toy", "value": 3}
