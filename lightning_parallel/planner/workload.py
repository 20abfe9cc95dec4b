"""What the planner knows about a model, block by block: parameters, FLOPs, saved activations, the pipeline message
and the tensor-parallel traffic, each split into the part tensor parallelism shards and the part it leaves whole;
and that description for the GPT in closed form, so 100B-parameter models cost no memory at all.

Data and formulas only: ``analysis.py`` fills it from a meta-device model, ``measure.py`` adds timings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, kw_only=True)
class Block:
    """One block of the model; every per-sample figure scales linearly with the micro-batch size.

    Args:
        name: The block's name in the ``nn.Sequential``.
        kind: Its module class: activation checkpointing applies to the kinds that repeat (``blocks.repeated``).
        params: Parameters of the block.
        tp_params: Of which split across tensor-parallel ranks (the rest is replicated).
        flops: Forward + backward FLOPs per sample.
        tp_flops: Of which split across tensor-parallel ranks.
        activations: Elements saved for backward per sample.
        tp_activations: Of which split across tensor-parallel ranks.
        selective_activations: Elements kept per sample under selective activation checkpointing (the outputs of
            matrix multiplications and attention; the block's input not included); None when not known.
        tp_selective_activations: Of which split across tensor-parallel ranks.
        outside_activations: Of ``activations``, elements a loss outside the network saves (the log-softmax of the
            logits): kept under any activation checkpointing.
        tp_outside_activations: Of which split across tensor-parallel ranks (a vocabulary-parallel loss's).
        loss_input: Elements per sample of that loss's input (the logits, the block's output), held beside what the
            loss saves only while the loss's forward runs: a micro-batch's peak on the rank holding the loss.
        tp_loss_input: Of which split across tensor-parallel ranks.
        loss_backward: Elements per sample of the gradients that loss's backward holds at once, until its input's
            gradient is made (``loss_backward.py``), held while the block's backward starts.
        tp_loss_backward: What a loss run on tensor-parallel shards (``tensor/vocab_loss.py``) holds instead, split
            across the ranks (its input's gradient made once, in place); 0 = the loss runs whole.
        output: Elements of the block's output per sample: what a pipeline boundary after it sends.
        weight_gradients: Elements per sample of the gradients a split backward (the zero-bubble schedules') keeps
            at the block's weights from its input-gradient action to its weight-gradient action
            (``split_backward.py``); 0 = not known.
        collectives: Tensor-parallel collectives per forward + backward: ``(kind, elements per sample)``.
        seconds: Measured forward + backward time ``(fixed, per sample)`` on one device; None = from FLOPs.
        replica_unit: The FSDP2 unit it belongs to: adjacent blocks naming the same one are gathered together (a
            transformers model's decoder layers inside its base model); "" = a unit of its own.
        parameters: Each parameter's elements and whether tensor parallelism splits it, in the order an optimizer
            updates them (one updating a parameter at a time makes temporaries of its size); () = not known.
    """

    name: str
    kind: str = ""
    params: int
    tp_params: int = 0
    flops: float = 0.0
    tp_flops: float = 0.0
    activations: float = 0.0
    tp_activations: float = 0.0
    selective_activations: float | None = None
    tp_selective_activations: float = 0.0
    outside_activations: float = 0.0
    tp_outside_activations: float = 0.0
    loss_input: float = 0.0
    tp_loss_input: float = 0.0
    loss_backward: float = 0.0
    tp_loss_backward: float = 0.0
    output: float = 0.0
    weight_gradients: float = 0.0
    collectives: tuple[tuple[str, float], ...] = ()
    seconds: tuple[float, float] | None = None
    replica_unit: str = ""
    parameters: tuple[tuple[int, bool], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A model as the planner sees it.

    Args:
        name: Shown in the plan's header.
        blocks: The blocks in model order (pipeline stages are contiguous runs of them).
        tp_modulus: Every tensor-parallel size must divide it (1: the model has no tensor-parallel plan).
    """

    name: str
    blocks: tuple[Block, ...]
    tp_modulus: int = 1

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError(f"workload {self.name} has no blocks. HINT: describe the model as named blocks")

    @property
    def params(self) -> int:
        """Parameters of the whole model."""
        return sum(block.params for block in self.blocks)

    @property
    def measured(self) -> bool:
        """Whether every block carries measured seconds."""
        return all(block.seconds is not None for block in self.blocks)

    def with_seconds(self, seconds: Sequence[tuple[float, float]]) -> Workload:
        """The same workload with measured (fixed, per-sample) forward + backward seconds per block."""
        if len(seconds) != len(self.blocks):
            raise ValueError(
                f"got {len(seconds)} block timings for {len(self.blocks)} blocks of {self.name}. "
                "HINT: give one (fixed, per-sample) pair per block, in model order"
            )
        bad = [
            (b.name, s)
            for b, s in zip(self.blocks, seconds, strict=True)
            if min(s) < 0 or not all(map(math.isfinite, s))
        ]
        if bad:
            raise ValueError(f"block timings must be finite and >= 0, got {bad}. HINT: re-measure these blocks")
        blocks = tuple(
            replace(b, seconds=(float(s[0]), float(s[1]))) for b, s in zip(self.blocks, seconds, strict=True)
        )
        return replace(self, blocks=blocks)


def gpt_workload(
    *, depth: int, width: int, heads: int, vocab_size: int, seq_len: int, mlp_ratio: int = 4, name: str | None = None
) -> Workload:
    """Closed-form workload of ``lightning_parallel.models.GPT`` (untied head, biases, learned positions).

    One sample is one sequence of ``seq_len`` tokens. Activations assume a fused attention kernel (no T x T matrix
    kept) and count what eager PyTorch saves: norm inputs and outputs, q/k/v, the attention output (one tensor: the
    kernel writes it (B, T, h, D)-major, so the projection's input is a view of it) and the MLP's hidden layer twice;
    a CPU block saves exactly that (tests/test_planner.py). Exact for parameters; FLOPs count matrix products only,
    attention at full T x T.
    """
    sizes = {"depth": depth, "width": width, "heads": heads, "vocab_size": vocab_size, "seq_len": seq_len}
    bad = {key: value for key, value in {**sizes, "mlp_ratio": mlp_ratio}.items() if value < 1}
    if bad or width % heads:
        raise ValueError(
            f"GPT needs sizes >= 1 and width divisible by heads, got {bad or sizes}. HINT: e.g. width=128 heads=4"
        )
    w, t, v, r = width, seq_len, vocab_size, mlp_ratio
    hidden = (4 + 2 * r) * w * w  # q, k, v, proj, up, down weights
    block = Block(
        name="block",
        kind="Block",
        params=hidden + (9 + r) * w,  # + biases (4w + rw + w) and two LayerNorms (4w)
        tp_params=hidden + (3 + r) * w,  # proj and down biases and the norms stay whole
        flops=3.0 * (2 * t * hidden + 4 * t * t * w),  # backward = 2x forward
        tp_flops=3.0 * (2 * t * hidden + 4 * t * t * w),
        activations=(8 + 2 * r) * t * w + 4 * t + heads * t,  # + norm statistics and the attention log-sum-exp
        tp_activations=(4 + 2 * r) * t * w + heads * t,
        # q, k, v, attention (and its log-sum-exp), proj, up and down outputs; proj's and down's are whole under tp
        selective_activations=(6 + r) * t * w + heads * t,
        tp_selective_activations=(4 + r) * t * w + heads * t,
        output=t * w,
        collectives=(("all_reduce", t * w),) * 6,  # forward: proj, down; backward: q, k, v, up inputs
    )
    embed = Block(
        name="embed",
        kind="GPTEmbedding",
        selective_activations=0.0,
        params=(v + t) * w,
        tp_params=v * w,
        output=t * w,
        collectives=(("all_reduce", t * w),),
    )
    head = Block(
        name="head",
        kind="LMHead",
        params=2 * w + v * w,
        tp_params=v * w,
        flops=3.0 * 2 * t * w * v,
        tp_flops=3.0 * 2 * t * w * v,
        activations=2 * t * w + 2 * t + t * v,  # norm input and output, and the loss's log-softmax of the logits
        # the head is "vocab_head": its logits stay split by vocabulary into the loss (`tensor/sharded_logits.py`),
        # whose three all-reduces of one number per token are left out
        tp_activations=t * v,
        selective_activations=t * v,  # the logits' matrix multiplication
        tp_selective_activations=t * v,
        outside_activations=t * v,
        tp_outside_activations=t * v,
        loss_input=t * v,
        tp_loss_input=t * v,
        # cross-entropy's backward: the log-softmax's gradient beside the logits' (`loss_backward.py`); the
        # vocabulary-parallel loss makes its input's gradient once, in place
        loss_backward=2 * t * v,
        tp_loss_backward=t * v,
        output=t * v,
        collectives=(("all_reduce", t * w),),
    )
    blocks = (embed, *(replace(block, name=f"block_{i}") for i in range(depth)), head)
    modulus = math.gcd(heads, w, r * w, v)
    total = embed.params + depth * block.params + head.params
    label = name or f"GPT depth {depth} width {width} ({human_count(total)} parameters)"
    return Workload(name=label, blocks=blocks, tp_modulus=modulus)


def human_count(count: float) -> str:
    """``102B``, ``60.2M``: a count with three significant digits."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return f"{count:.0f}"
