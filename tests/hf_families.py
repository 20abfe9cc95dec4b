"""The decoder families transformers ships, each as a tiny causal LM built offline from its config (2 layers, width
32, 4 query heads, vocabulary 64), and a LightningModule that trains one on padded text as its users write it
(`self.model(**batch)`, the loss from `labels` with -100 at the padding, AdamW). Nothing here knows our strategies.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from padded_modules import LONGEST, VOCAB

COMMON = {  # every family's: dropout off (two runs' masks differ), ids inside the tiny vocabulary
    "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "intermediate_size": 64, "max_position_embeddings": LONGEST, "bos_token_id": 0, "eos_token_id": 0,
    "pad_token_id": 0,
}  # fmt: skip
NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout",
              "embedding_dropout", "residual_dropout", "resid_dropout", "embed_dropout")  # fmt: skip

# name -> (transformers model_type, what differs from COMMON); each family's own defaults otherwise (its ties, its
# biases, its residual layout), so the model is the one its users get at a smaller size
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_key_value_heads": 2}),
    "mistral": ("mistral", {"num_key_value_heads": 2, "head_dim": 8}),
    "qwen2": ("qwen2", {"num_key_value_heads": 2}),
    "qwen2_tied": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"num_key_value_heads": 2, "head_dim": 8}),
    "phi3": ("phi3", {"num_key_value_heads": 2}),
    "gemma": ("gemma", {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma2": ("gemma2", {"num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gptj": ("gptj", {"rotary_dim": 4}),
    "opt": ("opt", {"ffn_dim": 64, "word_embed_proj_dim": 32}),
    "falcon": ("falcon", {}),
    "stablelm": ("stablelm", {"num_key_value_heads": 2}),
    "olmo": ("olmo", {"num_key_value_heads": 2}),
    "phi": ("phi", {}),
    "olmo2": ("olmo2", {"num_key_value_heads": 2}),
    "gemma3_text": ("gemma3_text", {"num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8}),
    "starcoder2": ("starcoder2", {"num_key_value_heads": 2}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "bloom": ("bloom", {}),
    "gpt_neo": ("gpt_neo", {"attention_types": [[["global", "local"], 1]], "window_size": 8}),
}


def causal_lm(name: str) -> torch.nn.Module:
    """`FAMILIES[name]` built from its config on the CPU (no download), in float32, with the eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    for key in NO_DROPOUT:
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


class FamilyLM(pl.LightningModule):
    """A causal LM trained on padded batches (`padded_modules.pad_batch`): ids, attention mask and labels by keyword,
    the loss from the model's output. AdamW with eps=1e-6: a key projection's bias has an exactly zero gradient, which
    AdamW's default 1e-8 would turn from float noise into full-size steps that differ between summation orders."""

    def __init__(self, name: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = causal_lm(name)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-6, foreach=True)


def build(name: str) -> FamilyLM:
    torch.manual_seed(0)
    return FamilyLM(name)
