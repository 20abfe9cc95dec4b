"""Checking or loading a checkpoint never runs code from it (issue "Trust", item 1). A pickle whose loading would
call `os.system` is refused in one line naming what it needs, and the marker file it would create stays absent:
through train.py (exit code 2, before launch), the mesh strategies' `load_checkpoint` (a sharded directory and a
single file), the sharded reader (`meta.pt`, DCP's `.metadata` and its non-tensor entries) and the export. A checkpoint
the user trusts loads with the opt-in (`ckpt_weights_only=false`, `trainer.fit(weights_only=False)`, `--trusted`);
what the library itself writes loads without it (here a tensor-parallel resume; the resume tests cover the rest)."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import run_cli
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from lightning_parallel import TensorParallelStrategy
from lightning_parallel.checkpoint import META_FILE, MODEL_KEY, check_matches, export, load_module, read_meta
from lightning_parallel.checkpoint import main as checkpoint_command
from lightning_parallel.data import SyntheticTokensDataModule
from lightning_parallel.lightning_seams import fit_weights_only
from lightning_parallel.models import GPT
from lightning_parallel.strategies.base import OPTIMIZER_OPTIONS
from lightning_parallel.tasks import LanguageModelTask
from lightning_parallel.unpickling import UntrustedCheckpoint
from train import ConfigError, build


class RunsCode:
    """Pickles as a call of `os.system`: loading it in full creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


REFUSED = (
    r"needs posix\.system to load, and building those could run code from the file, so it is not read\. "
    "HINT: only for a file you trust:"
)


def test_train_py_refuses_a_file_that_would_run_code_before_launch(tmp_path: Path) -> None:
    marker, evil = tmp_path / "PWNED", tmp_path / "evil.ckpt"
    torch.save({MODEL_KEY: RunsCode(marker)}, evil)
    result = run_cli("trainer.accelerator=cpu", f"ckpt_path={evil}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "posix.system" in errors[0] and "HINT: only for a file you trust: ckpt_weights_only=false" in errors[0]
    assert not marker.exists()


def test_objects_in_hyperparameters_need_the_opt_in(compose_cfg, tmp_path: Path) -> None:  # noqa: ANN001
    """A LightningModule that saves a partial optimizer as a hyperparameter: refused by name unless trusted."""
    _, task, *_ = build(compose_cfg("trainer.accelerator=cpu"))
    path = tmp_path / "partial.ckpt"
    torch.save(
        {MODEL_KEY: task.state_dict(), "hyper_parameters": {"optimizer": partial(torch.optim.SGD, lr=0.1)}}, path
    )
    expected = r"needs functools\.partial, torch\.optim\.sgd\.SGD to load.* HINT: .*: ckpt_weights_only=false$"
    with pytest.raises(ConfigError, match=expected):
        build(compose_cfg("trainer.accelerator=cpu", f"ckpt_path={path}"))
    build(compose_cfg("trainer.accelerator=cpu", f"ckpt_path={path}", "ckpt_weights_only=false"))
    with pytest.raises(ConfigError, match=r"ckpt_weights_only=maybe must be true or false\. HINT"):
        build(compose_cfg("trainer.accelerator=cpu", "ckpt_weights_only=maybe"))


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)


def sharded(
    path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, code: RunsCode | None = None, where: str = ""
) -> Path:
    """What a mesh strategy writes (model and flattened optimizer shards, `meta.pt`), with `code` hidden `where`."""
    optimizer_state = get_optimizer_state_dict(module, optimizer, options=OPTIMIZER_OPTIONS)
    if where == "an optimizer entry":  # DCP stores non-tensor values (lr, betas, ...) as pickles
        optimizer_state["param_groups.net.weight.lr"] = code
    dcp.save({MODEL_KEY: module.state_dict(), "optimizer_0": optimizer_state}, checkpoint_id=str(path))
    torch.save({"global_step": code if where == "meta.pt" else 1, "epoch": 0}, path / META_FILE)
    if where == ".metadata":
        (path / ".metadata").write_bytes(pickle.dumps(code))
    return path


@pytest.mark.parametrize("where", ["meta.pt", ".metadata", "an optimizer entry"])
def test_the_sharded_reader_and_the_mesh_strategy_run_no_code(tmp_path: Path, where: str) -> None:
    marker, module = tmp_path / "PWNED", Tiny()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    path = sharded(tmp_path / "last.ckpt", module, optimizer, RunsCode(marker), where)
    strategy = TensorParallelStrategy()
    strategy.connect(module)
    strategy.optimizers = [optimizer]
    readers: dict[str, Callable[[], Any]] = {
        "the strategy": lambda: strategy.load_checkpoint(path),
        "export": lambda: export(path, tmp_path / "out.ckpt"),
    }
    if where != "an optimizer entry":  # these read the model only
        readers |= {
            "read_meta": lambda: read_meta(path),
            "check_matches": lambda: check_matches(path, module),
            "load_module": lambda: load_module(module, path),
        }
    for name, read in readers.items():
        with pytest.raises(UntrustedCheckpoint, match=REFUSED + " pass weights_only=False$"):
            read()
        assert not marker.exists(), name
    assert checkpoint_command(["export", str(path), str(tmp_path / "out.ckpt")]) == 2
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()


def test_the_mesh_strategy_reads_no_single_file(tmp_path: Path) -> None:
    marker, evil, module = tmp_path / "PWNED", tmp_path / "evil.ckpt", Tiny()
    torch.save({MODEL_KEY: RunsCode(marker), "global_step": RunsCode(marker)}, evil)
    strategy = TensorParallelStrategy()
    strategy.connect(module)
    with pytest.raises(FileNotFoundError, match="is not a sharded checkpoint"):
        strategy.load_checkpoint(evil)
    assert not marker.exists()


def test_export_of_a_trusted_checkpoint_needs_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = Tiny()
    path = sharded(tmp_path / "last.ckpt", module, torch.optim.SGD(module.parameters(), lr=0.1))
    torch.save(
        {"global_step": 1, "hyper_parameters": {"optimizer": partial(torch.optim.SGD, lr=0.1)}}, path / META_FILE
    )
    out = tmp_path / "out.ckpt"
    assert checkpoint_command(["export", str(path), str(out)]) == 2
    assert "functools.partial" in capsys.readouterr().err and not out.exists()
    assert checkpoint_command(["export", str(path), str(out), "--trusted"]) == 0
    assert torch.load(out, weights_only=False)["hyper_parameters"]["optimizer"].func is torch.optim.SGD


def fit_tensor_parallel(steps: int, ckpt_path: Path | None = None, save: Path | None = None, **fit: Any) -> int:
    """A tiny GPT on one process under the tensor strategy; the global step reached."""
    pl.seed_everything(0, verbose=False)
    data = SyntheticTokensDataModule(vocab_size=16, seq_len=8, num_samples=40, batch_size=8, seed=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=TensorParallelStrategy(), max_steps=steps, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = GPT(vocab_size=16, context_length=8, depth=1, width=8, heads=2)
    task = LanguageModelTask(model, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    environment = dict(os.environ)
    try:
        trainer.fit(task, datamodule=data, ckpt_path=ckpt_path, **fit)
        if save is not None:
            trainer.save_checkpoint(save)
    finally:  # as train.py does: the next fit starts its own process group and rendezvous
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    return trainer.global_step


def test_fit_weights_only_reaches_the_mesh_strategy(tmp_path: Path) -> None:
    """Lightning 2.6.6 drops `fit(weights_only=...)` for strategies that restore after setup (lightning_seams.py)."""
    path = tmp_path / "tp.ckpt"
    fit_tensor_parallel(2, save=path)
    assert fit_tensor_parallel(3, path) == 3  # what the strategy wrote loads with the default
    meta = torch.load(path / META_FILE, weights_only=True)
    meta["hyper_parameters"]["optimizer"] = partial(torch.optim.SGD, lr=0.1)  # as a user's module may save it
    torch.save(meta, path / META_FILE)
    with pytest.raises(UntrustedCheckpoint, match=r"meta\.pt needs functools\.partial, torch\.optim\.sgd\.SGD"):
        fit_tensor_parallel(3, path)
    assert fit_tensor_parallel(3, path, weights_only=False) == 3
    assert fit_weights_only() is None  # outside a fit
