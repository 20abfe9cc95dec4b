"""Training steps of many ranks in one process (`simulated_ranks`), set up by the strategies' own order
(`parallelize/order.py`), against one process: the harness of test_simulated_ranks.py. Networks are built inside the
simulation (a parameter made outside stays one tensor shared by every simulated rank, and its optimizer step goes
wrong); pipeline stages, which need point-to-point transport, are chained in one process instead (`chain_stages`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_parallel.dims import ParallelDims
from lightning_parallel.parallelize import parallelize_pipeline, parallelize_tensor
from lightning_parallel.parallelize.replicas import spans
from lightning_parallel.pipeline.schedule_plan import resolve_schedule
from lightning_parallel.replicas import average_
from lightning_parallel.token_mean import step_over_replicas

VOCAB, SEQ, ROWS, STEPS, LR = 64, 16, 8, 3, 1e-3
# AdamW eps=1e-6 (hf_modules.optimizer): a key bias has an exactly zero gradient, whose float noise (~1e-9) the
# default 1e-8 turns into steps of ~lr/10 that differ between summation orders
EPS = 1e-6
Batch = tuple[torch.Tensor, torch.Tensor]  # (token ids, labels with -100 for padding)


def batches(seed: int = 1) -> list[Batch]:
    """Padded text: each row's tail labels ignored, rows holding different numbers of valid tokens."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
        labels = ids.clone()
        lengths = torch.randint(SEQ // 4, SEQ + 1, (ROWS,), generator=generator)
        labels[torch.arange(SEQ) >= lengths[:, None]] = -100  # (ROWS, SEQ)
        made.append((ids, labels))
    return made


def lm_loss(network: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss as each model's users compute it: a transformers model's from `labels`, the zoo GPT's
    with `F.cross_entropy` on logits (gathered first where a plan left them sharded)."""
    if hasattr(network, "config"):
        return network(input_ids=ids, labels=labels).loss
    return next_token_loss(network(ids), labels)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())  # (B * (T - 1), V)


def train_one_process(build: Callable[[], nn.Module], data: list[Batch]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: the losses of each AdamW step and the final parameters."""
    torch.manual_seed(0)
    network = build()
    optimizer = torch.optim.AdamW(network.parameters(), lr=LR, eps=EPS)
    losses = []
    for ids, labels in data:
        loss = lm_loss(network, ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in network.named_parameters()}


def settings(dims: ParallelDims, mesh: Any, **options: Any) -> SimpleNamespace:
    """A strategy's sizes and arguments, as `order.py` reads them: automatic plans, replicas kept by an all-reduce."""
    return SimpleNamespace(
        dims=dims,
        device_mesh=mesh,
        root_device=torch.device("cpu"),
        plan=None,
        spec=resolve_schedule("1f1b", pp=dims.pp, microbatches=2 * dims.pp),
        balance="parameters",
        replicas="replicate",
        deferred_batchnorm=False,
        activation_checkpointing="none",
        compile_options=None,
        sequence_parallel=False,
        microbatches_for=lambda pp: 2 * pp,
        **options,
    )


def rows_of_replica(mode: Any, dims: ParallelDims, tensor: torch.Tensor) -> torch.Tensor:
    """Each simulated rank's share of the batch: the rows of its data-parallel replica (the whole batch at dp=1)."""
    share = tensor.shape[0] // dims.dp
    if mode is None:  # dp = tp = 1: every rank computes alike, and the fake group's collectives change nothing
        return tensor
    return mode.rank_map(lambda rank: tensor[dims.coords(rank)[0] * share :][:share].clone())


def replicas_mean(mode: Any, dims: ParallelDims, loss: torch.Tensor) -> float:
    """The step's loss as Lightning logs it: the mean of the replicas' losses (rank 0 of each)."""
    if mode is None:
        return loss.item()
    values = loss._local_tensors  # type: ignore[attr-defined]
    firsts = [values[d * dims.pp * dims.tp].item() for d in range(dims.dp)]
    return sum(firsts) / dims.dp


def full_values(param: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every simulated rank's whole value of `param` (a DTensor's shards gathered)."""
    whole = (param.full_tensor() if isinstance(param, DTensor) else param).detach()
    return dict(whole._local_tensors) if hasattr(whole, "_local_tensors") else {0: whole}


def train_simulated(
    mode: Any, dims: ParallelDims, build: Callable[[], nn.Module], data: list[Batch], *, order: str
) -> tuple[list[float], nn.Module]:
    """The same steps on dp x tp simulated ranks, set up by the tensor strategy's order (`order="tensor"`, dp=1) or
    the pipeline's at pp=1 (`order="pipeline"`, replicas averaged by an all-reduce over "dp"); each replica's loss
    normalised by the whole batch's valid tokens (`token_mean.step_over_replicas`)."""
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    network = build()
    if order == "tensor":
        parallelize_tensor(network, network, settings(dims, mesh), configured=False)
    else:
        parallelize_pipeline(network, settings(dims, mesh), lambda: (None, None))
    optimizer = torch.optim.AdamW(network.parameters(), lr=LR, eps=EPS)
    losses = []
    for ids, labels in data:
        ids, labels = rows_of_replica(mode, dims, ids), rows_of_replica(mode, dims, labels)

        def step(ids: torch.Tensor = ids, labels: torch.Tensor = labels) -> torch.Tensor:
            loss = lm_loss(network, ids, labels)
            loss.backward()
            return loss

        loss, inexact = step_over_replicas(step, group=mesh.get_group("dp"), replicas=dims.dp, where="test")
        assert inexact is None, inexact
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in network.parameters()]
        average_([g for g in grads if g is not None], mesh.get_group("dp"))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(replicas_mean(mode, dims, loss))
    return losses, network


def assert_like_one_process(
    simulated: tuple[list[float], nn.Module], reference: tuple[list[float], dict[str, torch.Tensor]]
) -> None:
    """Losses and every rank's final parameters within 1e-5 of one process's."""
    (losses, network), (expected_losses, expected) = simulated, reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=0, atol=1e-5)
    names = [name for name, _ in network.named_parameters()]
    assert names == list(expected), "parameter names differ from one process's"
    assert any(spans(p, "tp", sharded=True) for p in network.parameters()), "nothing was sharded over tp"
    for name, param in network.named_parameters():
        for rank, value in full_values(param).items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=f"{name} on rank {rank}")
