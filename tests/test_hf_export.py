"""Checkpoints back to Hugging Face in one process: `export CKPT OUT_DIR --hf` writes a `save_pretrained` directory
that `AutoModelForCausalLM.from_pretrained` loads with the trained weights (tied weights stored once), from a checkpoint
saved under Lightning's own single-device strategy with `RecordPretrained`, and from a DCP checkpoint in the files,
index and tensors save_pretrained writes at a small max_shard_size; bad input is one line and exit 2. The pipeline and
3D round trips run inside tests/test_hf_pipeline.py's and test_hf_tensor.py's launches."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from hf_modules import build, exported_logits_gap, token_loader  # noqa: E402

from lightning_parallel.callbacks import RecordPretrained  # noqa: E402
from lightning_parallel.checkpoint import META_FILE, MODEL_KEY, main  # noqa: E402
from lightning_parallel.hf_format import RECORD_KEY, describe_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[pl.LightningModule, Path]:
    """GPT-2 trained 2 steps on one device and its Lightning checkpoint, which records the model (RecordPretrained)."""
    folder = tmp_path_factory.mktemp("trained")
    module = build("gpt2")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[RecordPretrained()], default_root_dir=folder,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=token_loader())
    trainer.save_checkpoint(folder / "trained.ckpt")
    return module, folder / "trained.ckpt"


def test_a_single_device_checkpoint_exports_as_a_directory_from_pretrained_reads(
    trained: tuple[pl.LightningModule, Path], tmp_path: Path
) -> None:
    from safetensors import safe_open

    module, checkpoint = trained
    state = {name: p.detach().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    gap = exported_logits_gap(str(checkpoint), state, str(tmp_path / "hf"))
    print(f"single device export: logits gap {gap:.1e}")
    assert gap < 1e-5
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]  # one shard
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as weights:
        assert weights.metadata() == {"format": "pt"}
        keys = set(weights.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # tied: stored once, as transformers does
    assert not any(key.startswith("model.") for key in keys)


def test_a_sharded_checkpoint_exports_file_by_file_as_save_pretrained_splits_it(
    trained: tuple[pl.LightningModule, Path], tmp_path: Path
) -> None:
    """The DCP checkpoint a strategy writes (here from one process), exported in files of at most 60 kB: the files,
    their index and every tensor are save_pretrained's at the same max_shard_size, and from_pretrained reads the
    trained weights exactly. An earlier export's model.safetensors in the directory is removed."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    module, _ = trained
    sharded, out, reference = tmp_path / "sharded.ckpt", tmp_path / "hf", tmp_path / "reference"
    dcp.save({MODEL_KEY: module.state_dict()}, checkpoint_id=str(sharded))  # what a strategy writes
    torch.save({"global_step": 2, RECORD_KEY: describe_pretrained(module)}, sharded / META_FILE)
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an earlier export")
    assert main(["export", str(sharded), str(out), "--hf", "--max-shard-size", "60KB"]) == 0
    module.model.save_pretrained(reference, max_shard_size="60KB")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == 5 and files == sorted(p.name for p in reference.glob("*.safetensors")), files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == json.loads((reference / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for name in files:
        with safe_open(str(out / name), "pt") as ours, safe_open(str(reference / name), "pt") as theirs:
            assert ours.metadata() == {"format": "pt"} and list(ours.keys()) == list(theirs.keys())
            assert all(torch.equal(ours.get_tensor(key), theirs.get_tensor(key)) for key in ours.keys())
            held = sum(ours.get_tensor(key).nbytes for key in ours.keys())
            assert held <= 60_000 or len(ours.keys()) == 1, (name, held)  # a larger tensor alone, as save_pretrained
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    trained_state = module.model.state_dict()
    assert loaded.keys() == trained_state.keys()
    assert all(torch.equal(loaded[key], trained_state[key]) for key in trained_state)  # tied lm_head included


def test_a_bad_max_shard_size_is_one_line(
    trained: tuple[pl.LightningModule, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    checkpoint = str(trained[1])
    assert main(["export", checkpoint, str(tmp_path / "hf"), "--hf", "--max-shard-size", "5 parsecs"]) == 2
    error = capsys.readouterr().err
    assert "max shard size '5 parsecs' is not a size" in error and "HINT" in error and error.count("\n") == 1
    assert main(["export", checkpoint, str(tmp_path / "hf"), "--hf", "--max-shard-size", "0"]) == 2
    assert "is not positive" in capsys.readouterr().err
    assert main(["export", checkpoint, str(tmp_path / "one.ckpt"), "--max-shard-size", "5GB"]) == 2
    assert "--max-shard-size sizes the files of --hf" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "one.ckpt").exists()


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
