"""Text as it usually arrives: sequences of different lengths, each batch padded by its collate function to its own
longest sequence, padding masked and labelled -100, a last batch smaller than the rest. LightningModules written the
way their users write them: a transformers GPT-2 computing its loss from `labels`, and a plain token network whose
loss is `F.cross_entropy(..., ignore_index=-100)`, `nn.CrossEntropyLoss` in `self.criterion`, `F.cross_entropy`
with class weights and the pad id as `ignore_index`, or a hand-written masked mean. Nothing here knows about our
strategies.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

VOCAB, LONGEST, SAMPLES, BATCH = 64, 16, 22, 8  # 22 samples in batches of 8: the last batch holds 6


class Sequences(torch.utils.data.Dataset):
    """Token sequences of 2 to LONGEST tokens (a tokenizer's output, unpadded). In order, the batches of 8 are padded
    to 16, 15 and 16 tokens: two lengths, so a traced pipeline traces twice (the short batch's micro-batches of 2
    rows have the first one's shape)."""

    def __init__(self, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(2, LONGEST - 1, (SAMPLES,), generator=generator)
        lengths[[0, 8, 16]] = torch.tensor([LONGEST, LONGEST - 1, LONGEST])
        self.rows = [torch.randint(1, VOCAB, (int(n),), generator=generator) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows[index]


def pad_batch(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row: pad id 0, attention mask 0 and label -100 there."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def padded_loader(batch_size: int = BATCH, order: list[int] | None = None) -> DataLoader:
    """In dataset order, or in `order` (`shuffled_order`: the global batches Lightning's DDP trains on)."""
    return DataLoader(Sequences(), batch_size=batch_size, shuffle=False, sampler=order, collate_fn=pad_batch)


def shuffled_order() -> list[int]:
    """The order Lightning's DDP reads the training set in at epoch 0 (it shuffles training data whatever the loader
    says: a DistributedSampler with seed 0, replica r taking every r-th index): consecutive global batches."""
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0)).tolist()


class PaddedGPT2(pl.LightningModule):
    """transformers' GPT-2 computing its loss from `labels` (shifted inside the model, -100 ignored)."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=LONGEST, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.log("train_loss", out.loss, sync_dist=True)
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.log("val_loss", out.loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_network() -> nn.Sequential:
    """Per-token logits (B, T) -> (B, T, VOCAB); the pipeline splits it by its blocks."""
    return nn.Sequential(
        nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, VOCAB)
    )


class TokenClassifier(pl.LightningModule):
    """Next-token prediction with the loss in training_step; `loss` picks how it is computed."""

    def __init__(self, loss: str = "functional", lr: float = 0.5) -> None:
        super().__init__()
        self.model = token_network()
        self.criterion = nn.CrossEntropyLoss()  # ignore_index=-100 by default
        self.loss, self.lr = loss, lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])[:, :-1]  # (B, T-1, VOCAB): token t predicts token t+1
        labels = batch["labels"][:, 1:]
        if self.loss in ("functional", "accuracy"):
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            if self.loss == "accuracy":  # the logits used for something else than the loss as well
                self.log("train_acc", (logits.argmax(-1) == labels).float().mean(), sync_dist=True)
        elif self.loss == "criterion":
            loss = self.criterion(logits.transpose(1, 2), labels)  # (B, C, T) against (B, T)
        elif self.loss == "weighted":  # padding ignored by its own id (0, not -100), classes weighted
            ids = batch["input_ids"][:, 1:]
            loss = F.cross_entropy(logits.transpose(1, 2), ids, weight=CLASS_WEIGHTS, ignore_index=PAD)
        elif self.loss == "masked_mean":  # hand-written: a mean over this batch's own valid tokens
            per_token = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
            valid = (labels != -100).float()
            loss = (per_token * valid).sum() / valid.sum()
        else:
            raise ValueError(self.loss)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


PAD = 0  # the pad id `pad_batch` writes into input_ids
CLASS_WEIGHTS = torch.linspace(0.5, 1.5, VOCAB)  # every class its own weight, the ignored one's included


class Branching(TokenClassifier):
    """Rank 1's second step computes its loss by hand (a branch), every other step F.cross_entropy: the replicas
    disagree on making the call whose count they total."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.loss = "masked_mean" if self.global_rank == 1 and batch_idx == 1 else "functional"
        if self.loss == "masked_mean":
            print(f"branch taken at {time.time()}", flush=True)  # when the replicas' calls part ways
        return super().training_step(batch, batch_idx)


MODULES: dict[str, Any] = {
    "gpt2": PaddedGPT2,
    "functional": lambda: TokenClassifier("functional"),
    "criterion": lambda: TokenClassifier("criterion"),
    "accuracy": lambda: TokenClassifier("accuracy"),
    "masked_mean": lambda: TokenClassifier("masked_mean"),
    "weighted": lambda: TokenClassifier("weighted"),
    "branching": Branching,
}


def fit(
    name: str,
    *,
    strategy: Any,
    devices: int,
    steps: int,
    batch_size: int = BATCH,
    order: list[int] | None = None,
    validate: bool = False,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit `MODULES[name]` on the padded batches through `user_modules.fit` (the user's defaults); also the warnings
    raised on this rank. `validate`: the same batches validate after the epoch (`val_loss`)."""
    import warnings

    from user_modules import fit as fit_module

    torch.manual_seed(0)
    module = MODULES[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_module(
            module,
            strategy=strategy,
            devices=devices,
            steps=steps,
            shuffle=False,
            data=padded_loader(batch_size, order),
            val_data=padded_loader(batch_size) if validate else None,
            **trainer_kwargs,
        )
    return {**result, "warnings": [str(w.message) for w in caught]}
