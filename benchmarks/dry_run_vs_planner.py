"""The planner's memory per pipeline rank against the dry run's measurement (`train.py ... dry_run=true`: the real
set-up and one step on the fake process group with fake tensors), for zoo GPTs of 8B and 66B shapes at 8 to 512 ranks
and transformers' Llama-3 8B and 70B shapes (from `LlamaConfig`, loss from labels) at 8 to 256 ranks, tensor and
FSDP2 x tensor layouts (each its own process: `--llama SIZE TP DP DIR`). Writes results/dry_run_vs_planner.{json,md}.
Usage: .venv/bin/python benchmarks/dry_run_vs_planner.py [--quick] [--rows NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import ROOT, THREADS_ENV, machine, one_line, run, write_results

GPT_8B = ["model=transformer", "model.depth=32", "model.width=4096", "model.heads=32"]
GPT_66B = ["model=transformer", "model.depth=80", "model.width=8192", "model.heads=64"]
DATA = ["data=synthetic_tokens", "data.seq_len=128", "data.batch_size=8"]


def layout(model: list[str], strategy: str, *, pp: int = 1, tp: int = 1, dp: int = 1, nodes: int = 1) -> list[str]:
    """Overrides for dp x pp x tp on 8 devices a node (FSDP2 replicas where the pipeline has replicas)."""
    sizes = [f"strategy.tensor_parallel_size={tp}", "trainer.devices=8", f"trainer.num_nodes={nodes}"]
    if strategy == "tensor":
        return [*model, "strategy=tensor", *sizes, f"strategy.data_parallel_size={dp}"]
    fsdp = ["strategy.replicas=fsdp"] if dp > 1 else []
    return [*model, "strategy=pipeline", *sizes, f"strategy.pipeline_parallel_size={pp}", *fsdp]


def schedule(name: str, *, pp: int = 4) -> list[str]:
    """A pp-only GPT-8B row under schedule `name` with 8 micro-batches (the zero-bubble schedules keep a split
    backward's state from I to W; the multi-stage ones hold their sends until the step ends)."""
    sizes = [f"strategy.pipeline_parallel_size={pp}", "strategy.tensor_parallel_size=1", f"trainer.devices={pp}"]
    return [*GPT_8B, "strategy=pipeline", *sizes, f"strategy.schedule={name}", "strategy.microbatches=8"]


LLAMA = {  # Llama-3's published shapes
    "8B": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "70B": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
}


def llama(size: str, *, tp: int, dp: int = 1, pp: int = 1) -> list[str]:
    """A Llama row, run by this script's `--llama` mode: the tensor strategy with FSDP2 replicas where dp > 1, or at
    pp > 1 the pipeline strategy (traced stages; replicas all-reduce, FSDP2 not reaching traced stages under tp)."""
    return ["--llama", size, str(tp), str(dp), *([str(pp)] if pp > 1 else [])]


ROWS: dict[str, list[str]] = {  # name -> overrides (or this script's --llama arguments)
    "8B tp8 (8 ranks)": layout(GPT_8B, "tensor", tp=8),
    "8B pp4 x tp2 (8 ranks)": layout(GPT_8B, "pipeline", pp=4, tp=2),
    "8B dp2 x pp2 x tp2 fsdp (8 ranks)": layout(GPT_8B, "pipeline", pp=2, tp=2, dp=2),
    "8B dp8 x tp8 (64 ranks)": layout(GPT_8B, "tensor", tp=8, dp=8, nodes=8),
    "8B dp8 x pp4 x tp2 fsdp (64 ranks)": layout(GPT_8B, "pipeline", pp=4, tp=2, dp=8, nodes=8),
    "8B pp4 x tp2, seq 2048 (8 ranks)": [*layout(GPT_8B, "pipeline", pp=4, tp=2), "data.seq_len=2048"],
    "66B dp64 x pp4 x tp2 fsdp (512 ranks)": layout(GPT_66B, "pipeline", pp=4, tp=2, dp=64, nodes=64),
    "Llama-3-8B tp8 (8 ranks)": llama("8B", tp=8),
    "Llama-3-8B dp8 x tp8 fsdp (64 ranks)": llama("8B", tp=8, dp=8),
    "Llama-3-70B dp8 x tp8 fsdp (64 ranks)": llama("70B", tp=8, dp=8),
    "Llama-3-70B dp32 x tp8 fsdp (256 ranks)": llama("70B", tp=8, dp=32),
    "Llama-3-8B pp4 x tp2 (8 ranks)": llama("8B", tp=2, pp=4),
    "Llama-3-70B dp8 x pp4 x tp8 (256 ranks)": llama("70B", tp=8, dp=8, pp=4),
    **{
        f"8B pp4 {name} (4 ranks)": schedule(name)
        for name in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
    },
}
QUICK = ("8B pp4 x tp2 (8 ranks)", "8B dp2 x pp2 x tp2 fsdp (8 ranks)")
KEYS = ("params", "grads", "optimizer", "activations", "total")


def dry_run(overrides: list[str], timeout: float) -> dict[str, Any]:
    """One `train.py ... dry_run=true` in a scratch directory: its dry_run.json, or {"error": the line why}."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(ROOT / "train.py"), *DATA, *overrides, "trainer.accelerator=cpu", "dry_run=true",
                   f"hydra.run.dir={tmp}/run"]  # fmt: skip
        if overrides[0] == "--llama":
            command = [sys.executable, __file__, *overrides[:4], f"{tmp}/run", *overrides[4:]]
        started = time.perf_counter()
        code, output = run(command, timeout=timeout, env=THREADS_ENV, cwd=Path(tmp))
        report = Path(tmp) / "run" / "dry_run.json"
        if code != 0 or not report.exists():
            return {"error": one_line(output, code)}
        return json.loads(report.read_text()) | {"wall_s": time.perf_counter() - started}


def llama_dry_run(size: str, tp: int, dp: int, directory: str, pp: int = 1) -> None:
    """`--llama`: `lightning_parallel.dry_run` of a LlamaForCausalLM of `size`'s shapes (built on meta, no weights;
    loss from labels, AdamW) under the tensor strategy, or the pipeline's at pp > 1, with this benchmark's batch;
    writes `directory/dry_run.json`."""
    import torch
    from causal_lm import CausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    import lightning_parallel as lp

    config = LlamaConfig(vocab_size=128_256, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500_000.0,
                         tie_word_embeddings=False, **LLAMA[size])  # fmt: skip
    with torch.device("meta"):
        network = LlamaForCausalLM(config)
    settings = dict(item.split("=") for item in DATA)
    ids = torch.randint(0, config.vocab_size, (int(settings["data.batch_size"]), int(settings["data.seq_len"])))
    strategy: Any = lp.TensorParallelStrategy(tensor_parallel_size=tp, data_parallel_size=dp)
    if pp > 1:
        strategy = lp.PipelineParallelStrategy(
            pipeline_parallel_size=pp, tensor_parallel_size=tp, data_parallel_size=dp
        )
    world = tp * dp * pp
    lp.dry_run(CausalLM(network), strategy, devices=min(world, 8), num_nodes=max(1, world // 8),
               batch={"input_ids": ids, "labels": ids}, output_dir=directory)  # fmt: skip


def miss(row: dict[str, Any], key: str) -> float | None:
    predicted = (row.get("predicted") or {}).get(key)
    measured = row["measured"][key]
    return None if predicted is None or not measured else predicted / measured - 1


def table(rows: list[dict[str, Any]], wall_s: float) -> str:
    gib = 2**30
    lines = [
        "# The planner against the dry run, per pipeline rank",
        "",
        "`benchmarks/dry_run_vs_planner.py`: each row is `train.py <overrides> dry_run=true` (data "
        f"`{' '.join(DATA)}`, fp32, AdamW); **measured**: the step's peak of live bytes of that pipeline rank "
        "(parameters, gradients, optimizer state and everything the step holds at its peak); **predicted**: the "
        "planner's `Estimate.memory_per_rank` for the same layout; **miss**: predicted / measured - 1 (within 5%: "
        f"ok). {machine()}, a shared machine (wall times are contended); {wall_s:.0f} s in all.",
        "",
        "| layout | pp rank | measured GiB | predicted GiB | miss | params miss | activations GiB (measured / "
        "predicted) | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed: {r['error']} | | | | | |")
            continue
        for role in r["rows"]:
            total, params = miss(role, "total"), miss(role, "params")
            predicted = role.get("predicted") or {}
            act = f"{role['measured']['activations'] / gib:.2f} / {predicted.get('activations', 0) / gib:.2f}"
            ok = "yes" if total is not None and abs(total) <= 0.05 else "**no**"
            lines.append(
                f"| {r['name']} | {role['role']} | {role['measured']['total'] / gib:.2f} | "
                f"{predicted.get('total', 0) / gib:.2f} | {_pct(total)} | {_pct(params)} | {act} | {ok} |"
            )
    lines += [
        "",
        "Llama-3 rows: transformers' LlamaForCausalLM from `LlamaConfig` at the published shapes (128,256-token "
        "vocabulary, 8 key-value heads), its loss from labels; the planner analyses it from one call on fake tensors "
        "(`planner/call_analysis.py`), at pp > 1 cut as the traced stages are (`dryrun/prediction.stage_cut`); its "
        "pipeline rows' replicas all-reduce (FSDP2 does not reach traced stages under tp).",
    ]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--rows", nargs="*", help="only these rows (names as in ROWS)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--llama", nargs="+", metavar="SIZE TP DP DIR [PP]", help="one Llama row's dry run")
    args = parser.parse_args()
    if args.llama:
        size, tp, dp, directory, *pp = args.llama
        return llama_dry_run(size, int(tp), int(dp), directory, int(pp[0]) if pp else 1)
    names = [n for n in ROWS if (not args.quick or n in QUICK) and (not args.rows or n in args.rows)]
    started = time.perf_counter()
    rows = []
    for name in names:
        result = {"name": name, "overrides": ROWS[name], **dry_run(ROWS[name], args.timeout)}
        print(name, result.get("error") or [(r["role"], miss(r, "total")) for r in result["rows"]], flush=True)
        rows.append(result)
    wall_s = time.perf_counter() - started
    report = {"machine": machine(), "data": DATA, "rows": rows, "wall_s": wall_s}
    write_results("dry_run_vs_planner", report, table(rows, wall_s), wall_s, indent=2)


if __name__ == "__main__":
    main()
