"""The private parts of torch and Lightning we rely on (`lightning_parallel.seams`): each check passes on the tested
versions and fails with one line naming the part and the fix when the part is gone or changed shape; the precision
plugin the strategies use is the user's own, re-classed, with an overflow-agreeing GradScaler."""

from __future__ import annotations

from importlib.metadata import requires, version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_parallel import one_process_ranks, seams
from lightning_parallel.callbacks import ExactResume
from lightning_parallel.precision import AgreeingGradScaler
from lightning_parallel.strategies.mesh_precision import MeshClipping, mesh_precision


def test_the_installed_torch_is_a_tested_one_in_the_declared_range() -> None:
    """A version the suite has not passed on is not supported: a new one goes into `seams.TESTED` once it passes."""
    declared = {r.name: r.specifier for r in map(Requirement, requires("lightning_parallel") or [])}
    for library in ("torch", "lightning"):
        assert declared[library] == SpecifierSet(seams.SUPPORTED[library])
        assert all(Version(v) in declared[library] for v in seams.TESTED[library])
    assert Version(version("torch")).base_version in seams.TESTED["torch"]


def test_the_installed_torch_has_every_seam() -> None:
    for schedule in (Schedule1F1B, ScheduleInterleaved1F1B):
        name, infer = seams.shape_inference(schedule)
        assert callable(infer) and name in ("_initialize_pp_stages", "_initialize_stage", "_initialize_stages")
    backward, weight = seams.stage_backward_calls(PipelineStage)
    assert callable(backward) and callable(weight)
    conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(seams.conv_forward(conv)(x, conv.weight, conv.bias), conv(x))
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # initialise_fsdp_root's part

    assert callable(seams.private_method(FSDPState(), "_lazy_init", library="torch", why="", parameters=0))
    mode, leaves, is_wrapper = seams.dispatch_mode()  # the dry run's live-byte count
    assert isinstance(mode, type) and leaves(((1,), {"a": 2})) == [1, 2] and not is_wrapper(x)


class _Gone:
    pass


class _SingleStage211:  # torch 2.11's single- and multi-stage schedules: no _initialize_pp_stages yet
    def _initialize_stage(self, args: Any, kwargs: Any) -> None: ...


class _MultiStage211:
    def _initialize_stages(self, args: Any, kwargs: Any) -> None: ...


class _Both:  # torch 2.12 on: _initialize_stage(s) calls _initialize_pp_stages, the one shape inference itself
    def _initialize_stage(self, args: Any, kwargs: Any) -> None: ...

    def _initialize_pp_stages(self, stages: Any, args: Any, kwargs: Any, target: Any, fwd: bool, bwd: bool) -> None: ...


@pytest.mark.parametrize(
    ("schedule", "name"),
    [
        (_SingleStage211(), "_initialize_stage"),
        (_MultiStage211(), "_initialize_stages"),
        (_Both(), "_initialize_pp_stages"),
    ],
    ids=["2.11 single-stage", "2.11 multi-stage", "2.12 on"],
)
def test_shape_inference_is_found_in_each_supported_form(schedule: object, name: str) -> None:
    found, method = seams.shape_inference(schedule)
    assert found == name and method == getattr(schedule, name)


class _Stage211:
    def __init__(self, peers: list[int]) -> None:
        self.peers = peers

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        return [SimpleNamespace(peer=peer) for peer in self.peers]


@pytest.mark.parametrize("schedule", [_MultiStage211(), _Both()], ids=["2.11", "2.12 on"])
def test_the_warm_up_skips_sends_to_this_rank_on_torch_2_11(schedule: object) -> None:
    stages = [_Stage211([0, 1]), _Stage211([1, 0])]  # a V on two ranks, seen from rank 1: stages 1 and 2
    seams.skip_self_warmup(schedule, stages, rank=1)
    kept = [[op.peer for op in stage._get_init_p2p_neighbors_ops()] for stage in stages]
    assert kept == ([[0], [0]] if isinstance(schedule, _MultiStage211) else [[0, 1], [1, 0]])
    with pytest.raises(seams.SeamChanged, match="_Gone._get_init_p2p_neighbors_ops"):
        seams.skip_self_warmup(_MultiStage211(), [_Gone()], rank=1)


@pytest.mark.parametrize("waits", [False, True], ids=["2.11 to 2.14", "2.15 on"])
def test_forward_actions_keep_the_send_waits_where_torch_has_them(monkeypatch: Any, waits: bool) -> None:
    from torch.distributed.pipelining import schedules

    if waits:
        monkeypatch.setattr(schedules, "WAIT_SEND_F", "WAIT_SEND_F", raising=False)
    else:
        monkeypatch.delattr(schedules, "WAIT_SEND_F", raising=False)
    kinds = {schedules.FORWARD, schedules.SEND_F, schedules.RECV_F, schedules.UNSHARD, schedules.RESHARD}
    assert seams.forward_actions() == kinds | ({"WAIT_SEND_F"} if waits else set())
    monkeypatch.delattr(schedules, "RECV_F")
    with pytest.raises(seams.SeamChanged, match="changed torch.distributed.pipelining.schedules.RECV_F"):
        seams.forward_actions()


class _Reshaped:
    def _conv_forward(self, x: torch.Tensor) -> torch.Tensor:  # one argument fewer than torch 2.13's
        return x


@pytest.mark.parametrize(
    ("check", "part"),
    [
        (lambda: seams.shape_inference(_Gone()), "_Gone._initialize_pp_stages"),
        (lambda: seams.conv_forward(_Reshaped()), "the signature of _Reshaped._conv_forward"),  # type: ignore[arg-type]
        (lambda: seams.action_order(_Gone()), "_Gone.pipeline_order_with_comms"),
        (lambda: seams.stage_backward_calls(_Gone()), "_Gone.backward_one_chunk"),
        (lambda: seams.found_inf_flags(_Gone(), None), "GradScaler._per_optimizer_states"),  # type: ignore[arg-type]
    ],
)
def test_a_changed_seam_is_named_in_one_line(check: Any, part: str) -> None:
    with pytest.raises(seams.SeamChanged) as error:
        check()
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"torch {version('torch')} changed {part}")
    assert "tested with torch 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0" in message
    assert message.endswith("HINT: pip install 'torch>=2.11,<2.16', or adapt lightning_parallel/seams.py")


@pytest.fixture
def one_process_group() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("value", [1.0, float("inf")])
def test_the_agreeing_scaler_records_overflow_like_torchs(one_process_group: Any, value: float) -> None:
    layer = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = AgreeingGradScaler("cpu", init_scale=4.0)
    scaler.scale(layer(torch.full((1, 2), value)).sum()).backward()
    scaler.unscale_(optimizer)
    flags = seams.found_inf_flags(scaler, optimizer)
    assert [float(f) for f in flags] == [float(value == float("inf"))]
    before = layer.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(layer.weight, before) == (value == float("inf"))  # an overflow skips the step
    assert scaler.get_scale() == (2.0 if value == float("inf") else 4.0)


@pytest.mark.parametrize(
    "plugin",
    [Precision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", "cpu")],
    ids=["32-true", "bf16-true", "bf16-mixed"],
)
def test_mesh_precision_keeps_the_users_plugin(plugin: Precision) -> None:
    base = type(plugin)
    strategy = object()
    mesh = mesh_precision(plugin, strategy)  # type: ignore[arg-type]
    assert mesh is plugin and isinstance(mesh, base) and isinstance(mesh, MeshClipping)
    assert type(mesh).__name__ == f"Mesh{base.__name__}" and mesh.mesh_strategy is strategy
    assert mesh_precision(mesh, strategy) is mesh and type(mesh).__mro__.count(MeshClipping) == 1  # type: ignore[arg-type]


def test_mesh_precision_swaps_in_an_agreeing_scaler_with_the_same_state() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    plugin = mesh_precision(MixedPrecision("16-mixed", "cpu", scaler=scaler), object())  # type: ignore[arg-type]
    assert isinstance(plugin.scaler, AgreeingGradScaler)  # type: ignore[attr-defined]
    assert plugin.scaler.state_dict() == scaler.state_dict()  # type: ignore[attr-defined]


# ---- a second resume (Lightning 2.6.6 miscounts the epoch after resuming from an epoch-end checkpoint) -------------
class _UserModule(pl.LightningModule):
    """Written the way users write one: its own layers, criterion and DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.criterion = nn.MSELoss()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.criterion(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(20, 4, generator=generator), torch.randn(20, 1, generator=generator))
        # A sampler shuffled by epoch number, as Lightning's DistributedSampler is under every multi-process
        # strategy (a plain shuffle draws from the global RNG, which no Lightning resume restores).
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(data, batch_size=5, sampler=sampler)  # 4 batches per epoch


def _fit(epochs: int, resume: Path | None, save: Path | None, callbacks: list[pl.Callback]) -> list[float]:
    pl.seed_everything(0, verbose=False)
    module = _UserModule()
    if save is not None:  # an epoch's last batch: Lightning resumes a plain DataLoader exactly only there
        callbacks = [
            *callbacks,
            ModelCheckpoint(dirpath=save, filename="{step}", save_top_k=-1, every_n_train_steps=4),
        ]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=save is not None, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=resume)
    return module.losses


@pytest.mark.parametrize("fixed", [True, False], ids=["with ExactResume", "Lightning alone"])
def test_a_second_resume_is_exact_with_exact_resume(tmp_path: Path, fixed: bool) -> None:
    """Three epochs straight equal one epoch, a resume to two, and a resume to three; Lightning alone trains the
    third epoch on another shuffle (if this half starts passing, Lightning fixed it and the seam can go)."""
    callbacks: list[pl.Callback] = [ExactResume()] if fixed else []
    straight = _fit(3, None, None, [])
    first = _fit(1, None, tmp_path / "a", callbacks)
    second = _fit(2, tmp_path / "a" / "step=4.ckpt", tmp_path / "b", callbacks)
    third = _fit(3, tmp_path / "b" / "step=8.ckpt", None, callbacks)
    assert first + second == pytest.approx(straight[:8], abs=1e-6)  # one resume is exact either way
    assert (third == pytest.approx(straight[8:], abs=1e-6)) == fixed


def test_simulated_ranks_name_a_changed_local_tensor_mode_in_one_line(monkeypatch: Any) -> None:
    """`simulated_ranks` checks the parts of torch's LocalTensorMode its workaround touches (the values it
    draws: test_simulated_ranks.py), and refuses to simulate inside a process group of another size."""
    from torch.distributed import _local_tensor

    class Changed:
        def __init__(self, ranks: int) -> None:
            self.ranks = ranks

    monkeypatch.setattr(_local_tensor, "LocalTensorMode", Changed)
    with pytest.raises(seams.SeamChanged, match="LocalTensorMode._per_rank_rng_states") as error:
        with one_process_ranks.simulated_ranks(2):
            pass
    assert "\n" not in str(error.value) and "HINT" in str(error.value)
    monkeypatch.undo()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=3)
    try:
        with pytest.raises(ValueError, match=r"simulated_ranks\(2\) inside a process group of 3 ranks"):
            with one_process_ranks.simulated_ranks(2):
                pass
    finally:
        dist.destroy_process_group()
    with one_process_ranks.simulated_ranks(2) as mode:  # opens the fake group itself, and closes it
        each = mode.rank_map(lambda rank: torch.tensor(float(rank)))._local_tensors
        assert dist.get_world_size() == 2 and [float(each[rank]) for rank in (0, 1)] == [0.0, 1.0]
    assert not dist.is_initialized()
