"""The logits' bytes per rank under the vocabulary-parallel loss, measured by the dry run: a transformers Llama at
Llama-3's 128,256-token vocabulary (one small layer, so the logits dominate the step), one sequence, its loss from
`labels`, under `strategy=tensor` at tp 1, 2, 4 and 8 (no replicas). Each row is the
step's activation peak per rank from the dry run (fake tensors: nothing is allocated), next to the whole logits' bytes.
Writes results/vocab_logits. Usage: .venv/bin/python benchmarks/vocab_logits.py [--tokens 2048] [--tp 1 2 4 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from causal_lm import CausalLM
from harness import ROOT, machine, write_results

sys.path.insert(0, str(ROOT))

VOCAB = 128_256  # Llama-3's
GIB = 2**30


def measure(tokens: int, tp: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_parallel import TensorParallelStrategy, dry_run

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=tokens, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        network = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (1, tokens))
    strategy = TensorParallelStrategy(tensor_parallel_size=tp, data_parallel_size=1)
    row = dry_run(CausalLM(network), strategy, devices=tp, batch={"input_ids": ids, "labels": ids}).rows[0]
    return {"tp": tp, "activations": row.measured["activations"], "total": row.measured["total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    started = time.perf_counter()
    rows = [measure(args.tokens, tp) for tp in args.tp]
    logits = args.tokens * VOCAB * 4  # fp32, one sequence
    lines = [
        f"Llama (1 layer, width 512) at a {VOCAB:,}-token vocabulary, one sequence of {args.tokens} tokens, fp32, loss "
        f"from labels, `strategy=tensor`; the dry run's step peak of activations per rank; {machine()}.",
        "",
        f"Whole logits: {logits / GIB:.3f} GiB.",
        "",
        "| tp | activations per rank (GiB) | against tp 1 | whole logits / tp (GiB) |",
        "|---|---|---|---|",
    ]
    first = rows[0]["activations"]
    for row in rows:
        lines.append(
            f"| {row['tp']} | {row['activations'] / GIB:.3f} | {row['activations'] / first:.2f} | "
            f"{logits / row['tp'] / GIB:.3f} |"
        )
    report = {"tokens": args.tokens, "vocab": VOCAB, "logits_bytes": logits, "rows": rows, "machine": machine()}
    write_results("vocab_logits", report, "\n".join(lines) + "\n", time.perf_counter() - started)


if __name__ == "__main__":
    main()
