"""Per-rank memory by strategy: model state (parameters, gradients, AdamW state) and peak RSS of one GPT trained by
train.py under 9 layouts on CPU (FSDP also tried as Lightning's), against the layout planner's per-device memory.
Writes results/memory_by_strategy.{json,md}. Usage: .venv/bin/python benchmarks/memory_by_strategy.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from typing import Any

from harness import ROOT, machine, train_py, write_results
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, str(ROOT))

from lightning_parallel.planner import CostModel, Layout  # noqa: E402
from lightning_parallel.planner.presets import hardware_preset  # noqa: E402
from lightning_parallel.strategies.layouts import train_overrides  # noqa: E402
from plan import build_workload  # noqa: E402

MiB = 2**20
DATA = ["data=synthetic_tokens", "data.batch_size=8"]  # 32 tokens, vocabulary 32
MODELS = {  # model overrides: measured, quick (--quick) and tiny (the baseline each layout is run with too)
    "full": ["model=transformer", "model.depth=8", "model.width=512", "model.heads=8"],
    "quick": ["model=transformer", "model.depth=4", "model.width=128", "model.heads=4"],
    "tiny": ["model=transformer", "model.depth=4", "model.width=16", "model.heads=4"],
}
RUN = [
    "trainer.accelerator=cpu", "trainer.max_epochs=1", "trainer.limit_val_batches=0",
    "callbacks=none", "~logger", "+trainer.enable_progress_bar=false", "+trainer.enable_checkpointing=false",
]  # fmt: skip
# Lightning's FSDPStrategy refuses CPU; the library's TensorParallelStrategy with tp=1 shards 2 replicas with FSDP2
FSDP2 = ["strategy=tensor", "trainer.devices=2", "strategy.tensor_parallel_size=1", "strategy.data_parallel_size=2"]
LAYOUTS: list[tuple[str, Layout]] = [  # overrides from the planner's train_overrides, but for FSDP2
    ("single", Layout(dp=1)),
    ("ddp", Layout(dp=2)),
    ("fsdp (Lightning)", Layout(dp=2, dp_shard=True)),
    ("fsdp (FSDP2, tp=1)", Layout(dp=2, dp_shard=True)),
    ("pp2 (1f1b)", Layout(dp=1, pp=2, schedule="1f1b", microbatches=4)),
    ("pp4 (1f1b)", Layout(dp=1, pp=4, schedule="1f1b", microbatches=8)),
    ("tp2", Layout(dp=1, tp=2)),
    ("tp4", Layout(dp=1, tp=4)),
    ("dp2 x pp2 (1f1b)", Layout(dp=2, pp=2, schedule="1f1b", microbatches=4)),
    ("dp2 x tp2 (fsdp)", Layout(dp=2, tp=2, dp_shard=True)),
]
QUICK = {"single", "ddp", "pp2 (1f1b)", "tp2"}
STATE_KEYS = ("parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_state_bytes_per_rank")


def run_train(model: list[str], strategy: list[str], steps: int) -> dict[str, Any]:
    """One train.py run; its summary.json, or {"error": the failure's last telling line}."""
    return train_py([*model, *DATA, *strategy, *RUN, f"trainer.limit_train_batches={steps}"], timeout=400)


def planner_estimate(model: list[str], layout: Layout) -> dict[str, Any]:
    """The planner's memory for the layout (fullest device), and its model-state bytes for every rank."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*model, *DATA, "paths.output_dir=/tmp/unused"])
    workload = build_workload(cfg.model, instantiate(cfg.data), "flops")
    hardware = hardware_preset("cpu")
    estimate = CostModel(workload, hardware, precision="32-true", optimizer_states=2).estimate(
        layout, batch=int(cfg.data.batch_size)
    )
    # ranks: data-parallel outermost, tensor-parallel innermost; (4 + 4 + 2 x 4) bytes per fp32 parameter with AdamW
    per_rank = [estimate.parameters_per_rank[(r // layout.tp) % layout.pp] * 16 for r in range(layout.devices)]
    return {"memory": estimate.memory, "model_state_per_rank": per_rank, "workload": workload.name}


def measure(name: str, layout: Layout, model: list[str], steps: int) -> dict[str, Any]:
    overrides = FSDP2 if name.startswith("fsdp (FSDP2") else train_overrides(layout)  # cuda=True: keeps fsdp
    assert overrides is not None, name
    print(f"{name:18s} {' '.join(overrides)}", flush=True)
    row: dict[str, Any] = {"layout": name, "planner_layout": asdict(layout), "overrides": overrides}
    row["predicted"] = planner_estimate(model, layout)
    big = run_train(model, overrides, steps)
    tiny = big if "error" in big else run_train(MODELS["tiny"], overrides, steps)
    if "error" in big or "error" in tiny:
        row["error"] = big.get("error") or f"tiny model: {tiny['error']}"
        print(f"  FAILED: {row['error']}", flush=True)
        return row
    row |= {key: big[key] for key in (*STATE_KEYS, "peak_memory_bytes", "run_s", "parameters")}
    row["model_state_bytes_per_rank"] = [sum(v) for v in zip(*(big[k] for k in STATE_KEYS), strict=True)]
    row["tiny_peak_memory_bytes"] = tiny["peak_memory_bytes"]
    pairs = zip(big["peak_memory_bytes"], tiny["peak_memory_bytes"], strict=True)
    row["added_bytes_per_rank"] = [a - b for a, b in pairs]
    print(f"  model state {mib_span(row['model_state_bytes_per_rank'])} MiB, peak RSS "
          f"{mib_span(row['peak_memory_bytes'])} MiB, added {mib_span(row['added_bytes_per_rank'])} MiB "
          f"({big['run_s']:.0f} s)", flush=True)  # fmt: skip
    return row


# ---- report --------------------------------------------------------------------------------------------------------
def mib_span(values: list[float]) -> str:
    """``96.4`` when every rank agrees to 0.1 MiB, else ``min-max``."""
    low, high = min(values) / MiB, max(values) / MiB
    return f"{high:,.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:,.1f}-{high:,.1f}"


def relative(predicted: float, measured: float) -> str:
    return f"{predicted / measured - 1:+.2%}" if measured else "-"


def write_report(result: dict[str, Any]) -> None:
    rows = [r for r in result["layouts"] if "error" not in r]
    single = next((max(r["model_state_bytes_per_rank"]) for r in rows if r["layout"] == "single"), None)
    lines = [
        "# Per-rank memory by strategy",
        "",
        f"`benchmarks/memory_by_strategy.py{' --quick' if result['quick'] else ''}`, {result['when']}, "
        f"{result['machine']}; {result['wall_s'] / 60:.1f} min. One `train.py` run per layout of "
        f"`{' '.join(result['model'] + DATA)}` ({result['parameters']:,} parameters, fp32, AdamW as in "
        f"`conf/train.yaml`): {' '.join(RUN)} trainer.limit_train_batches={result['steps']}; CPU, gloo, one thread "
        "per process.",
        "",
        "- **params / grads / optimizer**: summary.json's `parameter_bytes_per_rank`, `gradient_bytes_per_rank`, "
        "`optimizer_state_bytes_per_rank` (the tensors this rank holds, DTensor / FSDP shards counted locally, after "
        "the last step); **model state** is their sum. One number when the ranks agree to 0.1 MiB, else min-max.",
        "- **model state vs single**: the fullest rank's model state over the single process's.",
        "- **fsdp**: Lightning's FSDPStrategy (`strategy=fsdp`) runs on GPUs only; `fsdp (FSDP2, tp=1)` runs the same "
        "layout as `" + " ".join(FSDP2) + "`: the library's TensorParallelStrategy at tensor-parallel size 1 shards "
        "its 2 replicas with torch's FSDP2 (`fully_shard`), as it does in `dp2 x tp2 (fsdp)`.",
        "- **peak RSS**: summary.json's `peak_memory_bytes` (each process's `ru_maxrss`). **added by training**: "
        "peak RSS minus that of the same layout run with a tiny GPT (`" + " ".join(MODELS["tiny"][1:]) + "`), "
        "rank by rank, which removes Python + torch + Lightning's own footprint; **rest** = added - model state "
        "(activations, allocator slack, temporaries of the optimizer step, communication buffers). RSS still grows "
        "over the first steps (see the notes), so after a few steps peak RSS is a lower bound on a long run's.",
        "",
        "**Fullest rank's model state vs the single process**: "
        + ", ".join(f"{r['layout']} {max(r['model_state_bytes_per_rank']) / single:.2f}" for r in rows if single)
        + "".join(f"; {r['layout']} failed" for r in result["layouts"] if "error" in r)
        + ".",
        "",
        "| layout | train.py overrides | ranks | params MiB | grads MiB | optimizer MiB | model state MiB | "
        "model state vs single | peak RSS MiB | tiny-model peak RSS MiB | added by training MiB | rest MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["layouts"]:
        if "error" in r:
            lines.append(f"| {r['layout']} | `{' '.join(r['overrides'])}` | failed: {r['error']} |" + " |" * 9)
            continue
        state, added = r["model_state_bytes_per_rank"], r["added_bytes_per_rank"]
        rest = [a - s for a, s in zip(added, state, strict=True)]
        ratio = f"{max(state) / single:.3f}" if single else "-"
        lines.append(
            f"| {r['layout']} | `{' '.join(r['overrides'])}` | {len(state)} | "
            + " | ".join(mib_span(r[k]) for k in STATE_KEYS)
            + f" | {mib_span(state)} | **{ratio}** | {mib_span(r['peak_memory_bytes'])} | "
            f"{mib_span(r['tiny_peak_memory_bytes'])} | {mib_span(added)} | {mib_span(rest)} |"
        )
    lines += [
        "",
        "## Planner vs measured",
        "",
        f"`CostModel({result['workload']!r}, hardware preset cpu, precision='32-true', optimizer_states=2)"
        ".estimate(layout, batch=8)`: the planner's memory on the fullest device (its `memory` dict) against the "
        "fullest measured rank, and its model state per rank (parameters per pipeline rank x 16 bytes: fp32 "
        "weight, gradient and two AdamW moments) against every measured rank (largest difference shown).",
        "",
        "| layout | planner layout | predicted params / grads / optimizer MiB | measured (fullest rank) MiB | "
        "predicted model state MiB | measured MiB | difference | per rank: largest difference | "
        "predicted activations MiB | measured rest MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        memory, state = r["predicted"]["memory"], r["model_state_bytes_per_rank"]
        fullest = max(range(len(state)), key=state.__getitem__)
        predicted_state = memory["params"] + memory["grads"] + memory["optimizer"]
        per_rank = [p / m - 1 for p, m in zip(r["predicted"]["model_state_per_rank"], state, strict=True)]
        measured = " / ".join(f"{r[k][fullest] / MiB:,.1f}" for k in STATE_KEYS)
        lines.append(
            f"| {r['layout']} | {r['planner_label']} | "
            + " / ".join(f"{memory[k] / MiB:,.1f}" for k in ("params", "grads", "optimizer"))
            + f" | {measured} | {predicted_state / MiB:,.1f} | {state[fullest] / MiB:,.1f} | "
            f"{relative(predicted_state, state[fullest])} | {max(per_rank, key=abs):+.2%} | "
            f"{memory['activations'] / MiB:,.1f} | "
            f"{(r['added_bytes_per_rank'][fullest] - state[fullest]) / MiB:,.1f} |"
        )
    table = "\n".join(lines + ["", *notes(rows, result["steps"])]) + "\n"
    write_results("memory_by_strategy", result, table, result["wall_s"], indent=2, show=False)


def notes(rows: list[dict[str, Any]], run_steps: int) -> list[str]:
    """Where the planner's model state differs from the measured one, and why (each only when it happens)."""
    found = ["Where prediction and measurement differ:", ""]
    pairs = [zip(r[STATE_KEYS[2]], r["predicted"]["model_state_per_rank"], strict=True) for r in rows]
    steps = [optimizer - state // 2 for ranks in pairs for optimizer, state in ranks]
    found.append(
        f"- optimizer: the measured state also holds AdamW's `step`, a 4-byte scalar per parameter tensor "
        f"({min(steps):,}-{max(steps):,} bytes per rank more than predicted)."
    )
    whole = [r["layout"] for r in rows if any(g > p for g, p in zip(r[STATE_KEYS[1]], r[STATE_KEYS[0]], strict=True))]
    if whole:
        extra = max(g - p for r in rows for g, p in zip(r[STATE_KEYS[1]], r[STATE_KEYS[0]], strict=True))
        found.append(
            f"- gradients larger than parameters ({', '.join(whole)}; up to {extra:,} bytes): a gradient held whole "
            "while its parameter is sharded. Under tensor parallelism the vocabulary-parallel token embedding "
            "(`embed.token`, `Shard(0)`) gets a `Replicate()` gradient, vocabulary x width on every rank (checked "
            "with a callback printing each parameter's and gradient's placements); the planner counts it sharded."
        )
    if any(r["planner_layout"]["dp_shard"] for r in rows):
        found.append(
            "- fsdp layouts: the planner's params add the blocks FSDP all-gathers while it computes (the largest "
            "block x 2 x (1 - 1/dp): this one and the next), a transient that summary.json's count after the step "
            "does not see; its sharded params, grads and optimizer state are compared per rank."
        )
    by_name = {r["layout"]: r for r in rows}
    if "single" in by_name and "ddp" in by_name:
        single, ddp = by_name["single"], by_name["ddp"]
        extra = min(ddp["added_bytes_per_rank"]) - single["added_bytes_per_rank"][0]
        found.append(
            f"- rest vs predicted activations: the planner counts activations only; the rest also holds the AdamW "
            f"step's temporaries, allocator slack and communication buffers (ddp's training adds "
            f"{extra / MiB:+.0f} MiB to single's; conf/strategy/ddp.yaml sets gradient_as_bucket_view, so DDP's "
            "buckets are the gradients)."
        )
    if any(r["layout"].startswith("fsdp (FSDP2") for r in rows):
        found.append(
            f"- peak RSS after {run_steps} steps is a lower bound for a long run: RSS still grows over the first "
            "steps (most under FSDP2 on CPU, which allocates its all-gather and reduce-scatter buffers every step "
            "with no caching allocator to reuse them)."
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layouts of a smaller GPT (a smoke run)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    args = parser.parse_args()
    started = time.perf_counter()
    model = MODELS["quick" if args.quick else "full"]
    layouts = [(n, lay) for n, lay in LAYOUTS if not args.quick or n in QUICK]
    rows = []
    for name, layout in layouts:
        rows.append(measure(name, layout, model, args.steps))
        rows[-1]["planner_label"] = layout.label + (" (fsdp)" if layout.dp_shard else "")
    done = [r for r in rows if "error" not in r]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "quick": args.quick, "steps": args.steps, "model": model, "data": DATA, "run": RUN,
        "tiny_model": MODELS["tiny"],
        "parameters": done[0]["parameters"] if done else None, "workload": rows[0]["predicted"]["workload"],
        "wall_s": time.perf_counter() - started, "layouts": rows,
    }  # fmt: skip
    write_report(result)


if __name__ == "__main__":
    main()
