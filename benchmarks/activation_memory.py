"""Activation checkpointing's memory and time on CPU, measured against the planner's prediction: one GPT trained by
train.py under `strategy=tensor trainer.devices=1` (plain at tp=1) with `activation_checkpointing` none, full and
selective; peak RSS and step time from summary.json, and the planner's activation bytes and compute for the same
model, batch and mode. What a mode saves is its peak below `none`'s (the rest of the process is the same), measured
twice: peak RSS (what the machine gave the process; glibc keeps freed pages) and the peak of live tensor bytes over
one step (torch's MemTracker: what the planner models, and what a GPU's max_memory_allocated would show).
Writes results/activation_memory.{json,md}. Usage: .venv/bin/python benchmarks/activation_memory.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from harness import ROOT, machine, train_py, write_results
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.distributed._tools.mem_tracker import MemTracker

sys.path.insert(0, str(ROOT))

from lightning_parallel.blocks import blocks_of  # noqa: E402
from lightning_parallel.parallelize.checkpointing import checkpoint_activations  # noqa: E402
from lightning_parallel.planner import CostModel, Layout  # noqa: E402
from lightning_parallel.planner.presets import hardware_preset  # noqa: E402
from plan import build_workload  # noqa: E402

MiB = 2**20
MODES = ("none", "full", "selective")
BATCH = 16
MODEL = ["model=transformer", "model.depth=8", "model.width=256", "model.heads=8"]
DATA = ["data=synthetic_tokens", "data.seq_len=256", "data.vocab_size=256", f"data.batch_size={BATCH}"]
RUN = [
    "strategy=tensor", "trainer.devices=1", "trainer.accelerator=cpu", "trainer.max_steps=4",
    "trainer.limit_val_batches=0", "callbacks=none", "~logger", "+trainer.enable_progress_bar=false",
    "+trainer.enable_checkpointing=false",
]  # fmt: skip


def measure(mode: str) -> dict[str, Any]:
    summary = train_py([*MODEL, *DATA, *RUN, f"strategy.activation_checkpointing={mode}"])
    if "error" in summary:
        raise SystemExit(f"{mode} failed: {summary['output_tail']}")
    return {"peak_rss": summary["peak_memory_bytes"][0], "step_s": summary["step_time_s"]}


def tensor_peak(mode: str) -> int:
    """Peak live tensor bytes over one AdamW step after a warm-up step, the blocks checkpointed as the strategies do
    (`parallelize/checkpointing.checkpoint_activations`), in this process."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*MODEL, *DATA])
    data = instantiate(cfg.data)
    torch.manual_seed(0)
    network = instantiate(cfg.model, **data.model_hints)
    if mode != "none":
        checkpoint_activations(blocks_of(network), mode)
    optimizer = torch.optim.AdamW(network.parameters())
    tokens = torch.randint(0, data.model_hints["vocab_size"], (BATCH, data.model_hints["context_length"] + 1))

    def step() -> None:
        logits = network(tokens[:, :-1])  # (B, T, V)
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer's state exists from here on, as in every later step
    tracker = MemTracker()
    tracker.track_external(network, optimizer)
    with tracker:
        step()
    return int(sum(device["Total"] for device in tracker.get_tracker_snapshot("peak").values()))


def predict(mode: str) -> dict[str, float]:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*MODEL, *DATA])
    workload = build_workload(cfg.model, instantiate(cfg.data))
    model = CostModel(workload, hardware_preset("cpu"), activation_checkpointing=mode)
    estimate = model.estimate(Layout(dp=1), batch=BATCH)
    return {"activations": estimate.memory["activations"], "compute_s": estimate.time["compute"]}


def markdown(rows: dict[str, dict[str, Any]], header: str) -> str:
    base = rows["none"]
    lines = [
        header,
        "",
        "| mode | peak RSS (MiB) | saved, RSS (MiB) | peak tensors (MiB) | saved, tensors (MiB) | saved, predicted "
        "(MiB) | predicted vs tensors | step (ms) | step vs none, measured | compute vs none, predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in rows.items():
        saved = (base["peak_rss"] - row["peak_rss"]) / MiB
        saved_tensors = (base["peak_tensors"] - row["peak_tensors"]) / MiB
        predicted = (base["activations"] - row["activations"]) / MiB
        ratio = f"{predicted / saved_tensors:.2f}" if saved_tensors > 0 else "-"
        lines.append(
            f"| {mode} | {row['peak_rss'] / MiB:.0f} | {saved:.0f} | {row['peak_tensors'] / MiB:.0f} | "
            f"{saved_tensors:.0f} | {predicted:.0f} | {ratio} | {row['step_s'] * 1e3:.0f} | "
            f"{row['step_s'] / base['step_s']:.2f}x | {row['compute_s'] / base['compute_s']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode (the lowest peak and step kept)")
    args = parser.parse_args()
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        runs = [measure(mode) for _ in range(args.repeats)]
        rows[mode] = {
            "peak_rss": min(r["peak_rss"] for r in runs),
            "step_s": min(r["step_s"] for r in runs),
            "runs": runs,
            "peak_tensors": tensor_peak(mode),
            **predict(mode),
        }
    header = (
        f"# Activation checkpointing on CPU ({machine()}, {time.strftime('%Y-%m-%d %H:%M')})\n\n"
        f"GPT depth 8 width 256 heads 8, vocabulary 256, 256 tokens, batch {BATCH}, fp32, AdamW, one process "
        "(`strategy=tensor trainer.devices=1`, plain at tp=1); lowest of "
        f"{args.repeats} runs of 4 steps each. Peak tensors: MemTracker over one step of the same network in one "
        "process. Predicted: the planner's activation bytes and compute (cpu preset)."
    )
    report = {"machine": machine(), "batch": BATCH, "model": MODEL, "data": DATA, "rows": rows}
    write_results("activation_memory", report, markdown(rows, header), time.perf_counter() - started)


if __name__ == "__main__":
    main()
