"""The dry run of transformers causal LMs at published shapes under a traced pipeline (no weights: built on the meta
device from their configs): Llama-3-8B at pp4 x tp2 (8 ranks) and dp8 x pp4 x tp2 (64), Llama-3-70B at dp8 x pp4 x tp8
(256), Qwen2-7B at pp4 x tp2; per pipeline rank the bytes of one AdamW step beside the planner's prediction, and the
wall and CPU seconds of each.
Replicas all-reduce (replicas='replicate': FSDP2 does not reach traced stages under tp yet).
Writes results/dry_run_transformers. Usage: .venv/bin/python benchmarks/dry_run_transformers.py [--rows 0 2]
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

GIB = 2**30
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {  # published configs (the fields that set the shapes)
    "Llama-3-8B": ("llama", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "vocab_size": 128256, "intermediate_size": 14336}),
    "Llama-3-70B": ("llama", {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                              "num_key_value_heads": 8, "vocab_size": 128256, "intermediate_size": 28672}),
    "Qwen2-7B": ("qwen2", {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                           "num_key_value_heads": 4, "vocab_size": 152064, "intermediate_size": 18944}),
}  # fmt: skip
ROWS = [("Llama-3-8B", 1, 4, 2), ("Llama-3-8B", 8, 4, 2), ("Llama-3-70B", 8, 4, 8), ("Qwen2-7B", 1, 4, 2)]


def measure(name: str, dp: int, pp: int, tp: int, *, rows: int, seq: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import lightning_parallel as lp

    model_type, shape = SHAPES[name]
    config = AutoConfig.for_model(model_type, **shape, tie_word_embeddings=False)
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        module = CausalLM(AutoModelForCausalLM.from_config(config))
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp)
    ids = torch.zeros(rows, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    result = lp.dry_run(module, strategy, devices=dp * pp * tp, batch=batch)
    print(result, flush=True)
    return {
        "model": name, "layout": result.layout, "ranks": result.world_size,
        "wall_s": round(time.perf_counter() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
        "roles": [{"role": r.role, "blocks": f"{r.blocks[0]}..{r.blocks[-1]}", **r.measured,
                   "predicted": r.predicted, "miss": r.miss} for r in result.rows],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(range(len(ROWS))), help="indices into ROWS")
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica's batch")
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    started = time.perf_counter()
    done = [measure(*ROWS[i], rows=args.batch, seq=args.seq) for i in args.rows]
    lines = [
        f"transformers causal LMs built on meta, {args.batch} x {args.seq} tokens per replica, fp32, AdamW, the "
        f"pipeline's default schedule and micro-batches; per pipeline rank, GiB (miss: the planner's total against the "
        f"step peak); {machine()} (shared: wall >> CPU).",
        "",
        "| model | layout | ranks | pp rank | blocks | params | grads | optimizer | activations | step peak | "
        "planner's activations | planner's total | miss | wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in done:
        for role in row["roles"]:
            sizes = " | ".join(f"{role[k] / GIB:.2f}" for k in ("params", "grads", "optimizer", "activations", "total"))
            guess = role["predicted"] or {}
            planner = " | ".join(f"{guess[k] / GIB:.2f}" if k in guess else "-" for k in ("activations", "total"))
            miss = f"{role['miss']:+.1%}" if role["miss"] is not None else "-"
            lines.append(
                f"| {row['model']} | {row['layout']} | {row['ranks']} | {role['role']} | {role['blocks']} | {sizes} | "
                f"{planner} | {miss} | {row['wall_s']} | {row['cpu_s']} |"
            )
    report = {"batch": args.batch, "seq": args.seq, "rows": done, "machine": machine()}
    write_results("dry_run_transformers", report, "\n".join(lines) + "\n", time.perf_counter() - started)


if __name__ == "__main__":
    main()
