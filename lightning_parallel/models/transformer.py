"""A GPT-style decoder-only transformer as a flat sequence: embed, block_0 ... block_{n-1}, head.

Single-device only: no parallelism here, but attention reads the head count from the tensor shape so
that sharding q/k/v by output features (tensor parallelism) works without changing this file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.weights import init_by_name, init_default


class GPTEmbedding(nn.Module):
    """Token plus learned position embeddings, then dropout.

    Args:
        vocab_size: Number of token ids.
        context_length: Longest sequence accepted.
        width: Embedding width.
        dropout: Dropout probability after the sum.
    """

    def __init__(self, *, vocab_size: int, context_length: int, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.context_length = context_length
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(context_length, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq_len = idx.size(1)
        if seq_len > self.context_length:
            raise ValueError(
                f"Input has {seq_len} tokens but context_length is {self.context_length}. "
                f"HINT: crop inputs to {self.context_length} tokens or build the GPT with a larger "
                "context_length."
            )
        positions = torch.arange(seq_len, device=idx.device)
        # (B, T, C) + (T, C) broadcasts over the batch.
        return self.dropout(self.token(idx) + self.position(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate ``q``, ``k``, ``v`` projections and ``proj``.

    Args:
        width: Model width.
        heads: Number of heads; ``width`` must be divisible by it.
        dropout: Dropout on attention weights and on the output (training only).
    """

    def __init__(self, *, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if heads < 1 or width % heads != 0:
            raise ValueError(
                f"width {width} is not divisible by heads {heads}. "
                "HINT: pick heads that divides width, e.g. width=128 with heads=4."
            )
        self.head_dim = width // heads
        self.dropout = dropout
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.proj = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        # Under tensor parallelism q holds only this rank's heads, so count them from the shape.
        local_heads = q.size(-1) // self.head_dim
        # (B, T, h*D) -> (B, h, T, D)
        q = q.view(batch, seq_len, local_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq_len, local_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq_len, local_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        # (B, h, T, D) -> (B, T, h*D)
        out = out.transpose(1, 2).reshape(batch, seq_len, local_heads * self.head_dim)
        return self.resid_dropout(self.proj(out))


class MLP(nn.Module):
    """Position-wise feed-forward: ``up`` (width -> ratio * width), GELU, ``down``, dropout.

    Args:
        width: Model width.
        mlp_ratio: Expansion factor of the hidden layer.
        dropout: Dropout on the output.
    """

    def __init__(self, *, width: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(width, mlp_ratio * width)
        self.act = nn.GELU()
        self.down = nn.Linear(mlp_ratio * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

    Args:
        width: Model width.
        heads: Number of attention heads.
        mlp_ratio: Expansion factor of the MLP.
        dropout: Dropout probability used in attention and MLP.
    """

    def __init__(self, *, width: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width=width, heads=heads, dropout=dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width=width, mlp_ratio=mlp_ratio, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Final LayerNorm and the (untied) projection to vocabulary logits.

    Args:
        width: Model width.
        vocab_size: Number of output logits per position.
    """

    def __init__(self, *, width: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class GPT(nn.Sequential):
    """Decoder-only transformer mapping token ids (B, T) to logits (B, T, vocab_size).

    Children, in order: ``embed``, ``block_0`` ... ``block_{depth-1}``, ``head``. The output projection is
    not tied to the token embedding, so any split of the children into pipeline stages is valid.

    Args:
        vocab_size: Number of token ids.
        context_length: Longest sequence accepted at forward.
        depth: Number of transformer blocks.
        width: Model width; must be divisible by ``heads``.
        heads: Number of attention heads.
        mlp_ratio: Expansion factor of the MLP hidden layer.
        dropout: Dropout probability (embeddings, attention, residual branches).
    """

    input_kind = "tokens"
    # Tensor-parallel plan (module-name pattern -> style name, applied by a strategy): Megatron-style, heads split
    # across ranks (q/k/v column-parallel, proj row-parallel; MLP up column, down row), vocabulary-parallel
    # embedding and LM head (a step's cross-entropy reads its logits sharded). The "sequence_parallel" /
    # "shard_sequence" entries act only with sequence parallelism.
    tp_plan = {
        "embed.token": "vocab_parallel",
        "embed": "shard_sequence",
        "block_*.ln1": "sequence_parallel",
        "block_*.attn.q": "colwise",
        "block_*.attn.k": "colwise",
        "block_*.attn.v": "colwise",
        "block_*.attn.proj": "rowwise",
        "block_*.ln2": "sequence_parallel",
        "block_*.mlp.up": "colwise",
        "block_*.mlp.down": "rowwise",
        "head.norm": "sequence_parallel",
        "head.lm_head": "vocab_head",
    }

    def __init__(
        self,
        *,
        vocab_size: int,
        context_length: int,
        depth: int = 4,
        width: int = 128,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
    ) -> None:
        sizes = {
            "vocab_size": vocab_size,
            "context_length": context_length,
            "depth": depth,
            "width": width,
            "heads": heads,
            "mlp_ratio": mlp_ratio,
        }
        bad = {name: value for name, value in sizes.items() if value < 1}
        if bad:
            raise ValueError(f"GPT sizes must be >= 1, got {bad}. HINT: check the model config.")
        if width % heads != 0:
            raise ValueError(
                f"GPT width {width} is not divisible by heads {heads}. "
                "HINT: pick heads that divides width, e.g. width=128 with heads=4."
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"GPT dropout must be in [0, 1), got {dropout}. HINT: use e.g. 0.1.")
        super().__init__()
        self.add_module(
            "embed",
            GPTEmbedding(vocab_size=vocab_size, context_length=context_length, width=width, dropout=dropout),
        )
        for index in range(depth):
            self.add_module(f"block_{index}", Block(width=width, heads=heads, mlp_ratio=mlp_ratio, dropout=dropout))
        self.add_module("head", LMHead(width=width, vocab_size=vocab_size))
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter, keyed by name (see ``init_by_name``)."""
        init_by_name(self, _init_module)


def _init_module(module: nn.Module) -> None:
    # GPT-2 style: N(0, 0.02) weights for projections and embeddings, zero biases; LayerNorm 1 and 0.
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    else:
        init_default(module)
