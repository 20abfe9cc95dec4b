"""LightningModules written the way users write them (the network in `self.model`, `self.criterion`, plain
DataLoaders, metrics in training_step), for the drop-in tests. Nothing here knows about our strategies.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

CLASSES = 10
SAMPLES = 96  # 1x8x8 images, digits-sized


def sequential_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES)
    )


class TutorialCNN(nn.Module):
    """The classic tutorial CNN (conv-relu-pool twice, view, three Linear), sized for 1x8x8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class BatchNormCNN(TutorialCNN):
    """The tutorial CNN with a BatchNorm after its first convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.norm(self.conv1(x))))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


class ResidualCNN(nn.Module):
    """A residual CNN with its own forward (stem, two residual blocks written inline, BatchNorm, pooling, a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv4 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.stem(x)))
        x = x + self.conv2(F.relu(self.conv1(x)))
        x = F.max_pool2d(x + self.conv4(F.relu(self.conv3(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class FourLinearMLP(nn.Module):
    """The four-Linear MLP of the multi-GPU tutorials, with its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 48)
        self.fc2 = nn.Linear(48, 32)
        self.fc3 = nn.Linear(32, 32)
        self.fc4 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        x = F.relu(self.fc3(x))
        return self.fc4(x)


class Classifier(pl.LightningModule):
    """A plain classifier; `step` picks how training_step computes its loss."""

    def __init__(self, net: nn.Module, step: str = "criterion", lr: float = 0.1) -> None:
        super().__init__()
        self.model = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.step = step
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.step == "criterion":
            return self.criterion(self(x), y)
        if self.step == "functional_with_metrics":
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.train_acc(logits.argmax(1), y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
            self.log("train_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        if self.step == "scaled":
            return 2 * self.criterion(self(x), y)
        if self.step == "l2":
            return self.criterion(self(x), y) + 0.05 * sum(p.pow(2).sum() for p in self.parameters())
        if self.step == "two_forwards":
            return self.criterion(self(x), y) + self.criterion(self(x.flip(0)), y.flip(0))
        raise ValueError(self.step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


# What TutorialOptimizers is trained with: clipping by norm and accumulation over two batches.
CLIP_ACCUMULATE = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}


class TutorialOptimizers(Classifier):
    """configure_optimizers as tutorials write it: any torch optimizer over `self.parameters()` (`foreach=True` or
    `fused=True` is what CUDA runs by default or on request) and a learning rate that decays every step."""

    def __init__(self, net: nn.Module, optimizer: str, **optimizer_kwargs: Any) -> None:
        super().__init__(net)
        self.optimizer_name, self.optimizer_kwargs = optimizer, optimizer_kwargs

    def configure_optimizers(self) -> Any:  # type: ignore[override]
        optimizer = getattr(torch.optim, self.optimizer_name)(self.parameters(), **self.optimizer_kwargs)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.2 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Loss(pl.Callback):
    """The loss each training step returned, as Lightning saw it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


class CausalLM(pl.LightningModule):
    """A Hugging Face causal language model called positionally, the loss computed in training_step."""

    def __init__(self, model: nn.Module, lr: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.model(ids).logits  # (B, T, vocab): the ModelOutput, rebuilt after the last stage
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def tiny_gpt2() -> nn.Module:
    """transformers' GPT2LMHeadModel, tiny, without dropout (which would draw differently per micro-batch)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def token_loader(*, batch_size: int = 16, seed: int = 0) -> DataLoader:
    ids = torch.randint(0, 64, (SAMPLES, 16), generator=torch.Generator().manual_seed(seed))
    return DataLoader(TensorDataset(ids), batch_size=batch_size, shuffle=False)


def loader(*, shuffle: bool, batch_size: int = 16, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, 1, 8, 8, generator=generator)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def fit(
    module: pl.LightningModule,
    *,
    strategy: Any,
    devices: int,
    steps: int,
    shuffle: bool,
    batch_size: int = 16,
    save_every: int | None = None,
    save_dir: str | None = None,
    ckpt_path: str | None = None,
    accelerator: str = "cpu",
    data: DataLoader | None = None,
    val_data: DataLoader | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit with the user's defaults (use_distributed_sampler=True); losses, logged metrics, local weights, the
    optimizer steps taken. With `save_every`, a checkpoint `step=<N>.ckpt` in `save_dir` every that many optimizer
    steps; `ckpt_path` resumes; `data` replaces the digits-sized images; `val_data` validates."""
    pl.seed_everything(0, verbose=False)
    losses = Loss()
    callbacks: list[pl.Callback] = [losses]
    if save_every is not None:
        callbacks.append(ModelCheckpoint(save_dir, filename="{step}", save_top_k=-1, every_n_train_steps=save_every))
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=save_every is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    data = data if data is not None else loader(shuffle=shuffle, batch_size=batch_size)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=val_data, ckpt_path=ckpt_path)
    # DTensors gathered whole (a collective, and every rank gets here)
    # every name of a shared (tied) parameter, so one process's state lines up with each stage's
    state = {name: _whole(p).detach().cpu().clone() for name, p in module.named_parameters(remove_duplicate=False)}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return {"losses": losses.losses, "state": state, "metrics": metrics, "step": trainer.global_step}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def build(net: str, step: str) -> Classifier:
    torch.manual_seed(0)
    return Classifier(NETWORKS[net](), step=step)


def tied_sequential() -> nn.Sequential:
    """Two blocks sharing one weight matrix, far enough apart to land on different pipeline stages."""
    first, second = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)
    second.weight = first.weight
    return nn.Sequential(nn.Flatten(), first, nn.ReLU(), second, nn.Linear(64, CLASSES))


NETWORKS: dict[str, Any] = {
    "sequential_mlp": sequential_mlp,
    "tied_sequential": tied_sequential,
    "tutorial_cnn": TutorialCNN,
    "batchnorm_cnn": BatchNormCNN,
    "four_linear_mlp": FourLinearMLP,
    "residual_cnn": ResidualCNN,
}
