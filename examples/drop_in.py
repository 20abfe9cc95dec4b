"""Drop-in: the classic tutorial CNN in the plainest LightningModule, trained on scikit-learn's digits, with
nothing changed but `strategy=`. The network has its own `forward`; the loss goes through `self.criterion`;
training accuracy is a torchmetrics metric updated in `training_step`; the loaders are plain DataLoaders.

    python examples/drop_in.py                                        # one process
    python examples/drop_in.py --strategy pipeline --devices 2        # 2 pipeline stages (split by tracing)
    python examples/drop_in.py --strategy tensor_parallel --devices 2 # convs and Linears sharded automatically
    python examples/drop_in.py --strategy ddp --devices 2             # Lightning's own DDP, for comparison
    python examples/drop_in.py --strategy diloco --devices 2          # or local_sgd, async_sgd
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_parallel  # noqa: F401 - registers strategy="pipeline", "tensor_parallel", "diloco", ...


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(x.size(0), -1)
        return self.fc2(F.relu(self.fc1(x)))


class LitClassifier(L.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.model = net
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.train_acc(logits.argmax(1), y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def loaders() -> tuple[DataLoader, DataLoader]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16  # (N, 1, 8, 8)
    y = torch.tensor(digits.target)
    train, val = TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=100)


def fit(strategy: str = "auto", devices: int = 1, epochs: int = 3, max_steps: int = -1) -> L.Trainer:
    """Train, then validate: `trainer.callback_metrics["val_acc"]` is the same on every rank."""
    L.seed_everything(0)
    train_loader, val_loader = loaders()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,  # strategy="pipeline", ...
                        max_epochs=epochs, max_steps=max_steps, logger=False, enable_checkpointing=False)  # fmt: skip
    with trainer.init_module():  # optional: under pipeline, each rank materialises only its own stages
        net = Net()
    model = LitClassifier(net)
    trainer.fit(model, train_loader, val_loader)
    trainer.validate(model, val_loader, verbose=False)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto", help="auto, pipeline, tensor_parallel, local_sgd, diloco, ...")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1)
    args = parser.parse_args()
    trainer = fit(args.strategy, args.devices, args.epochs, args.max_steps)
    if trainer.is_global_zero:
        print(f"val_acc {float(trainer.callback_metrics['val_acc']):.3f}")


if __name__ == "__main__":
    main()
