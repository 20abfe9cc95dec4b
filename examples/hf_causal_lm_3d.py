"""A transformers causal LM fine-tuned under pipeline x tensor parallelism on padded batches, then exported back
as a `save_pretrained` directory that `AutoModelForCausalLM.from_pretrained` reads. Text is tokenised as bytes
(no tokenizer download); any transformers causal LM called with keywords and `labels` trains the same way.

    python examples/hf_causal_lm_3d.py                                  # pp2 x tp2 on 4 CPU processes
    python examples/hf_causal_lm_3d.py --devices 8                      # dp2 x pp2 x tp2
    python examples/hf_causal_lm_3d.py --devices 1 --pp 1 --tp 1        # one process, for comparison
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.callbacks import RecordPretrained
from lightning_parallel.checkpoint import main as checkpoint_cli

TEXT = """Pipeline parallelism splits a network into stages on different devices.
Tensor parallelism splits each layer's weights across devices.
Data parallelism trains copies of the model on different batches.
A micro-batch flows through every stage before its gradients flow back.
Padding fills a short row up to the longest row of its batch.
Labels of -100 are left out of the loss.""".splitlines()


def pad_batch(rows: list[bytes]) -> dict[str, torch.Tensor]:
    """Bytes as token ids (1..255), right-padded to the batch's longest row: id 0, mask 0 and label -100 there."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(list(row)), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class CausalLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.log("train_loss", out.loss, prog_bar=True, sync_dist=True)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tiny_gpt2(layers: int) -> GPT2LMHeadModel:
    # or AutoModelForCausalLM.from_pretrained("<a model directory>"); every layer becomes a block of the pipeline
    # dropout off: under tensor parallelism inside traced stages it is refused by DTensor (see docs/limitations.md)
    config = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=layers, n_head=4, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks per stage")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="hf_example")
    args = parser.parse_args()
    out = Path(args.out)
    L.seed_everything(0)

    # data parallelism is what is left: devices / (pp x tp) replicas
    strategy = PipelineParallelStrategy(pipeline_parallel_size=args.pp, tensor_parallel_size=args.tp, microbatches=2)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        callbacks=[RecordPretrained()], logger=False, enable_checkpointing=False)  # fmt: skip
    module = CausalLM(tiny_gpt2(args.layers))
    rows = [line.encode() for line in TEXT] * 4
    loader = DataLoader(rows, batch_size=4, shuffle=True, collate_fn=pad_batch)
    trainer.fit(module, loader)
    trainer.save_checkpoint(out / "last.ckpt")  # every rank writes its shards
    torch.distributed.destroy_process_group()  # the export below reads the shards in one plain process

    if trainer.is_global_zero:
        # the same as: python -m lightning_parallel.checkpoint export hf_example/last.ckpt hf_example/gpt2 --hf
        assert checkpoint_cli(["export", str(out / "last.ckpt"), str(out / "gpt2"), "--hf"]) == 0
        model = AutoModelForCausalLM.from_pretrained(out / "gpt2")
        batch = pad_batch(rows[:4])
        with torch.no_grad():
            loss = model(**batch).loss
        print(f"trained loss {float(trainer.callback_metrics['train_loss']):.3f}; exported to {out / 'gpt2'}, "
              f"its loss on the first batch {float(loss):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
