"""LightningModules around tiny, randomly initialised Hugging Face `transformers` models, written the way their users
write them: the model in `self.model`, called with keyword arguments and `labels`, the loss read from `out.loss`.
Nothing here knows about our strategies. Needs `transformers` (the dev extra); the library itself never imports it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, SAMPLES, CLASSES, IMAGE = 64, 16, 64, 3, 8


def gpt2(tied: bool = True, layers: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    # dropout off: a parity test compares two runs' arithmetic, and dropout masks differ between them
    config = GPT2Config(
        n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    """Llama as transformers ships it, with its own tensor plan: grouped-query attention (4 query heads sharing 2 key /
    value heads), RoPE, RMSNorm, SwiGLU, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def one_layer_llama() -> torch.nn.Module:
    """The cheapest Llama to trace with every part (grouped-query attention, RoPE, RMSNorm, the head): one layer, 16
    wide, 8 positions; no dimension of its weights is 6, so a 6-token activation's shape is never a weight's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=IMAGE,
        patch_size=4, num_channels=3, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return ViTForImageClassification(config)


def bert(layers: int = 4) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config)


class HFLM(pl.LightningModule):
    """A causal LM as its users write it: labels are the very input tensor (the model shifts them) and the loss comes
    back inside the model's output. `tied=False` unties the embedding from the head; `adamw` trains with AdamW."""

    def __init__(self, lr: float = 0.1, tied: bool = True, adamw: bool = False, layers: int = 4) -> None:
        super().__init__()
        self.model = gpt2(tied, layers)
        self.lr, self.adamw = lr, adamw

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        out = self.model(input_ids=ids, labels=ids)
        self.log("loss", out.loss)
        return out.loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        out = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        self.log("val_loss", out.loss)
        self.log("val_logit_mean", out.logits.mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters(), self.lr, self.adamw)


class HFLlama(HFLM):
    """Llama trained as its users train it: AdamW (foreach, as on a GPU), a cosine schedule stepped every batch and
    gradient clipping (the Trainer's `gradient_clip_val`); its labels padded at the end of the rows (-100: 0 to 4
    tokens a row, by the row's first id), so the token-normalised mean counts a different number of tokens per row."""

    def __init__(self, lr: float = 1e-2) -> None:
        pl.LightningModule.__init__(self)
        self.model = llama()
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        out = self.model(input_ids=ids, labels=padded(ids))
        self.log("loss", out.loss)
        return out.loss

    def configure_optimizers(self) -> Any:
        adamw = optimizer(self.parameters(), self.lr, adamw=True)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(adamw, T_max=8)
        return {"optimizer": adamw, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def padded(ids: torch.Tensor) -> torch.Tensor:
    """`ids` as labels with the last (first id % 5) positions of each row ignored (-100)."""
    positions = torch.arange(ids.shape[1], device=ids.device)
    return ids.masked_fill(positions >= ids.shape[1] - ids[:, :1] % 5, -100)


def optimizer(parameters: Any, lr: float, adamw: bool) -> torch.optim.Optimizer:
    """SGD, or AdamW with foreach=True (CUDA's default, which takes plain tensors or DTensors per call, never both).
    eps=1e-6: a key projection's bias has an exactly zero gradient (softmax ignores a per-row constant), and AdamW
    with its default 1e-8 turns float noise of ~1e-9 there into steps of ~lr/10 that differ between summation orders."""
    if adamw:
        return torch.optim.AdamW(parameters, lr=lr, eps=1e-6, foreach=True)
    return torch.optim.SGD(parameters, lr=lr)


class HFClassifier(pl.LightningModule):
    """An encoder classifier: token ids, an attention mask and labels by keyword, a tuple batch."""

    def __init__(self, lr: float = 0.1, adamw: bool = False, layers: int = 4) -> None:
        super().__init__()
        self.model = bert(layers)
        self.lr, self.adamw = lr, adamw

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        self.log("train_loss", out.loss, prog_bar=True)
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        self.log("val_loss", out.loss)
        self.log("val_acc", (out.logits.argmax(-1) == labels).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters(), self.lr, self.adamw)


class HFImageClassifier(pl.LightningModule):
    """A vision transformer classifier: pixel values and labels by keyword, AdamW."""

    def __init__(self, lr: float = 1e-3, adamw: bool = True) -> None:
        super().__init__()
        self.model = vit()
        self.lr, self.adamw = lr, adamw

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        out = self.model(pixel_values=images, labels=labels)
        self.log("train_loss", out.loss)
        return out.loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_loss", self.model(pixel_values=images, labels=labels).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer(self.parameters(), self.lr, adamw=self.adamw)


class DictDataset(torch.utils.data.Dataset):
    """Token rows as a tokenizer's output gives them: a dict per sample."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index]}


def token_loader(*, batch_size: int = 8, seed: int = 0) -> DataLoader:
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(seed))
    return DataLoader(DictDataset(ids), batch_size=batch_size, shuffle=False)


def classification_loader(*, batch_size: int = 8, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    mask = torch.ones(SAMPLES, SEQ, dtype=torch.long)  # every token counted: micro-batch means average exactly
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return DataLoader(TensorDataset(ids, mask, labels), batch_size=batch_size, shuffle=False)


def image_loader(*, batch_size: int = 8, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=generator)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=generator)
    return DataLoader(TensorDataset(images, labels), batch_size=batch_size, shuffle=False)


MODULES: dict[str, Any] = {
    "gpt2": HFLM,
    "gpt2_untied": lambda: HFLM(tied=False),
    "gpt2_adamw": lambda: HFLM(lr=1e-3, adamw=True, layers=2),
    "bert": HFClassifier,
    "bert_adamw": lambda: HFClassifier(lr=1e-3, adamw=True, layers=2),
    "llama": HFLlama,
    "vit": HFImageClassifier,
    "vit_sgd": lambda: HFImageClassifier(lr=1e-2, adamw=False),
}
LOADERS: dict[str, Any] = {name: token_loader for name in MODULES if name.startswith(("gpt2", "llama"))}
LOADERS.update(
    {"bert": classification_loader, "bert_adamw": classification_loader, "vit": image_loader, "vit_sgd": image_loader}
)


def build(name: str) -> pl.LightningModule:
    torch.manual_seed(0)
    return MODULES[name]()


def fit(
    name: str,
    *,
    strategy: Any,
    devices: int,
    steps: int,
    batch_size: int = 8,
    save_every: int | None = None,
    save_dir: str | None = None,
    ckpt_path: str | None = None,
    validate: bool = True,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit `MODULES[name]` through `user_modules.fit` (the user's defaults: use_distributed_sampler=True, a sanity
    check), with `validate` on 2 batches every 2 steps; also how many parameters are DTensors (a plan applied) and
    each parameter's local shape; `trainer_kwargs` (e.g. gradient_clip_val) go to the Trainer."""
    from user_modules import fit as fit_module

    module, loader = build(name), LOADERS[name]
    result = fit_module(
        module, strategy=strategy, devices=devices, steps=steps, shuffle=False, save_every=save_every,
        save_dir=save_dir, ckpt_path=ckpt_path, data=loader(batch_size=batch_size),
        val_data=loader(batch_size=batch_size, seed=1), val_check_interval=2, limit_val_batches=2 if validate else 0,
        **trainer_kwargs,
    )  # fmt: skip
    shapes = {name: tuple(getattr(p, "_local_tensor", p).shape) for name, p in module.model.named_parameters()}
    return {**result, "sharded": sum(_is_dtensor(p) for p in module.parameters()), "shapes": shapes}


def _is_dtensor(param: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor)


def exported_logits_gap(
    checkpoint: str,
    state: dict[str, torch.Tensor],
    out_dir: str,
    tied: bool = True,
    layers: int = 4,
    max_shard_size: str | None = None,
) -> float:
    """`export CHECKPOINT OUT_DIR --hf [--max-shard-size SIZE]`, then `AutoModelForCausalLM.from_pretrained(OUT_DIR)`:
    the largest gap between its logits and those of GPT-2 holding `state` (a LightningModule's parameters, `model.`
    names: the trained run)."""
    from transformers import AutoModelForCausalLM

    from lightning_parallel.checkpoint import main

    sized = ["--max-shard-size", max_shard_size] if max_shard_size else []
    assert main(["export", checkpoint, out_dir, "--hf", *sized]) == 0
    trained = gpt2(tied, layers)
    trained.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    loaded = AutoModelForCausalLM.from_pretrained(out_dir)
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return float((loaded(ids).logits - trained.eval()(ids).logits).abs().max())
