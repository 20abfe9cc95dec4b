"""Idle check: the pipeline's measured idle share (the StageTimer's, the end-of-run table's "idle" column) against
torch's profiler on the same training steps. Writes results/idle_check.{json,md}.

The profiler's trace is classified without the StageTimer's hooks: inside each schedule.step, the rank's main
thread is in the stage's own forward/backward ops (compute), in send/recv ops or torch's wait on them (comm), in
other ops (the loss, splitting into micro-batches, copies, gradient scaling), or in no op at all (Python: the
schedule, hooks, autograd's engine between nodes). 2 single-threaded gloo ranks launched by torchrun.
Usage: .venv/bin/python benchmarks/idle_check.py [--warmup 3 --steps 4 --after 4 --repeats 3]  (~1.5 min, 2 cores)
Over 300 lines: one measurement, its worker mode and its report in one script, so a result file traces to one
command.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from harness import arguments, counts, launch, worker_setup, write_results
from ranks import bare_trainer
from timing import LoadMeter, machine, order
from torch.distributed.pipelining import schedules
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.data import DigitsDataModule, SyntheticImagesDataModule, SyntheticTokensDataModule
from lightning_parallel.models import GPT, SimpleCNN
from lightning_parallel.tasks import ClassificationTask, LanguageModelTask

PP = 2
STEP, WAIT, LOSS = "idle_check:schedule.step", "idle_check:wait", "idle_check:loss"
# (name, model, schedule): digits is train.py's default run; the other two make compute dominate.
CASES = [
    ("SimpleCNN, digits 8x8, batch 64", "cnn_digits", "1f1b"),
    ("SimpleCNN, digits 8x8, batch 64", "cnn_digits", "zbv"),
    ("SimpleCNN, synthetic 3x64x64, batch 64", "cnn_64", "1f1b"),
    ("GPT depth 4 width 256, 32 tokens, batch 16", "gpt_256", "1f1b"),
    ("GPT depth 4 width 256, 32 tokens, batch 16", "gpt_256", "zbv"),
]
# Top-level ops inside schedule.step that are not the stage's layers: torch's and the strategy's micro-batch
# handling (split, select targets, detach, clone, stack losses, scale gradients) and the loss's backward.
NOT_STAGE = {
    f"aten::{op}"
    for op in "tensor_split split chunk select slice item detach detach_ to _to_copy ones_like zeros_like "
    "empty_like clone copy_ stack cat div_ mul_".split()
}
LOSS_BACKWARD = {"NllLossBackward0", "LogSoftmaxBackward0"}
COMM_PREFIXES = ("c10d::", "gloo:", "record_param_comms")
COMPUTE_ACTION = re.compile(r"PP:\d+[FBIW]\d+")  # torch's range around a multi-stage schedule's compute action


# ---- inside each rank ------------------------------------------------------------------------------------------
def build(model: str) -> tuple[pl.LightningModule, pl.LightningDataModule]:
    optimizer = partial(torch.optim.AdamW, lr=3e-3)
    if model == "cnn_digits":
        network = SimpleCNN(in_channels=1, image_size=8, num_classes=10)
        return ClassificationTask(network, num_classes=10, optimizer=optimizer), DigitsDataModule(batch_size=64)
    if model == "cnn_64":
        network = SimpleCNN(in_channels=3, image_size=64, num_classes=10)
        data = SyntheticImagesDataModule(num_samples=2048, channels=3, image_size=64, num_classes=10, batch_size=64)
        return ClassificationTask(network, num_classes=10, optimizer=optimizer), data
    network = GPT(vocab_size=32, context_length=32, depth=4, width=256, heads=4)
    data = SyntheticTokensDataModule(vocab_size=32, seq_len=32, num_samples=1024, batch_size=16)
    return LanguageModelTask(network, optimizer=optimizer), data


def annotate(runtime: Any) -> None:
    """Profiler ranges around the StageTimer's window (begin to end) and around the loss."""
    timer, loss_fn, open_spans = runtime.timer, runtime.loss_fn, []
    begin, end = timer.begin, timer.end

    def annotated_begin() -> None:
        open_spans.append(record_function(STEP).__enter__())
        begin()

    def annotated_end(*, count: bool) -> None:
        end(count=count)
        open_spans.pop().__exit__(None, None, None)

    def annotated_loss(*args: Any) -> torch.Tensor:
        with record_function(LOSS):
            return loss_fn(*args)

    timer.begin, timer.end, runtime.loss_fn = annotated_begin, annotated_end, annotated_loss


class Window(pl.Callback):
    """Profiles steps [warmup, warmup + steps); records the StageTimer's busy and wall seconds after every step."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        # after each step: (timer busy, timer wall, training step seconds, this step's forward seconds)
        self.marks: list[tuple[float, float, float, float]] = []
        self.profiler: Any = None
        self._start = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        annotate(trainer.strategy.runtime)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if len(self.marks) == self.warmup:
            self.profiler = profile(activities=[ProfilerActivity.CPU]).__enter__()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        timer = trainer.strategy.runtime.timer
        forward = sum(end - start for start, end, kind, *_ in timer.last_events if kind == "F")
        self.marks.append((timer.busy_s, timer.wall_s, time.perf_counter() - self._start, forward))
        if len(self.marks) == self.warmup + self.steps:
            self.profiler.__exit__(None, None, None)


def top_level(event: Any) -> tuple[bool, set[str]]:
    """(not nested in another op, the annotations above it); torch's "PP:0F0"-style ranges are annotations."""
    names, parent = set(), event.cpu_parent
    while parent is not None:
        if not parent.is_user_annotation:
            return False, names
        names.add(parent.name)
        parent = parent.cpu_parent
    return True, names


def kind(event: Any, above: set[str]) -> str:
    name = event.name
    if name.startswith(COMM_PREFIXES):
        return "comm"
    if LOSS in above or name in NOT_STAGE:
        return "other"
    node = name.removeprefix("autograd::engine::evaluate_function: ")
    return "other" if node in LOSS_BACKWARD else "compute"


def covered(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Length of the union of `spans` inside the (disjoint) `windows`."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans for lo, hi in windows if min(b, hi) > max(a, lo))
    total, reach = 0.0, float("-inf")
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def breakdown(events: Any) -> dict[str, float]:
    """Shares of the schedule.step windows on the main thread: compute, comm, other ops, no op."""
    steps = [e for e in events if e.name == STEP]
    thread, windows = steps[0].thread, [(e.time_range.start, e.time_range.end) for e in steps]
    spans: dict[str, list[tuple[float, float]]] = {"compute": [], "comm": [], "other": [], "actions": []}
    for e in events:
        if e.thread != thread:
            continue
        if e.is_user_annotation:
            if e.name == WAIT:
                spans["comm"].append((e.time_range.start, e.time_range.end))
            elif COMPUTE_ACTION.fullmatch(e.name):
                spans["actions"].append((e.time_range.start, e.time_range.end))
            continue
        outermost, above = top_level(e)
        if outermost:
            spans[kind(e, above)].append((e.time_range.start, e.time_range.end))
    wall = sum(b - a for a, b in windows)
    compute = covered(spans["compute"], windows)
    with_comm = covered(spans["compute"] + spans["comm"], windows)
    ops = covered(spans["compute"] + spans["comm"] + spans["other"], windows)
    return {
        "schedule_step_ms": wall / 1e3 / len(windows),
        "compute": compute / wall,
        "comm": (with_comm - compute) / wall,
        "other_ops": (ops - with_comm) / wall,
        "no_op": 1 - ops / wall,
        # inside torch's F/B/I/W action ranges but not in their waits for a receive (multi-stage schedules only)
        "actions": (covered(spans["actions"] + spans["comm"], windows) - covered(spans["comm"], windows)) / wall
        if spans["actions"]
        else None,
    }


def timer_share(marks: list[tuple[float, float, float, float]], first: int, last: int) -> dict[str, float]:
    """The StageTimer's idle over steps [first, last) (its own busy / wall sums), and the training step."""
    busy = marks[last - 1][0] - marks[first - 1][0]
    wall = marks[last - 1][1] - marks[first - 1][1]
    n = last - first
    return {
        "idle": 1 - busy / wall,
        "idle_forward_only": 1 - sum(m[3] for m in marks[first:last]) / wall,  # split backward's timing before
        "busy_ms": busy * 1e3 / n,
        "schedule_step_ms": wall * 1e3 / n,
        "training_step_ms": statistics.mean(m[2] for m in marks[first:last]) * 1e3,
    }


def run_case(model: str, schedule: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    task, data = build(model)
    strategy = PipelineParallelStrategy(schedule=schedule, microbatches=4, timeout=300)
    window = Window(args.warmup, args.steps)
    total = args.warmup + args.steps + args.after
    bare_trainer(strategy, PP, total, [window]).fit(task, datamodule=data)
    profiled = args.warmup + args.steps
    parallel = strategy.describe()
    rank = dist.get_rank()
    return {
        "blocks": [b for s, r in enumerate(parallel["stage_to_rank"]) if r == rank for b in parallel["stages"][s]],
        "bubble_fraction": parallel["bubble_fraction"],
        "profiler": breakdown(window.profiler.events()),
        "stage_timer": timer_share(window.marks, args.warmup, profiled),
        "stage_timer_unprofiled": timer_share(window.marks, profiled, total),
    }


def worker(out: Path, args: argparse.Namespace) -> None:
    rank = worker_setup()  # the strategy reuses its process group
    wait = schedules._wait_batch_p2p  # torch's wait on a batch of sends/receives: no op of its own in the trace

    def annotated_wait(work: list[dist.Work]) -> None:
        with record_function(WAIT):
            wait(work)

    schedules._wait_batch_p2p = annotated_wait
    runs, meter = [], LoadMeter()
    for repeat in range(args.repeats):
        for name, model, schedule in order(repeat, CASES):
            runs.append(
                {"case": name, "schedule": schedule, "repeat": repeat, **measure_case(model, schedule, meter, args)}
            )
    (out / f"rank{rank}.json").write_text(json.dumps(runs))
    dist.destroy_process_group()


def measure_case(model: str, schedule: str, meter: LoadMeter, args: argparse.Namespace) -> dict[str, Any]:
    """One case, and how many cores other processes kept busy meanwhile."""
    dist.barrier()
    meter.start()
    cpu = time.process_time()
    run = run_case(model, schedule, args)
    own = [0.0] * PP
    dist.all_gather_object(own, time.process_time() - cpu)
    return {"other_load_cores": meter.other_cores(sum(own)), **run}


# ---- in the main process -------------------------------------------------------------------------------------
def aggregate(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (case, schedule, rank): the median of each share over the repeats, and the StageTimer's idle range."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for rank, runs in enumerate(per_rank):
        for run in runs:
            groups.setdefault((run["case"], run["schedule"], rank), []).append(run)
    rows = []
    for (case, schedule, rank), runs in groups.items():
        row: dict[str, Any] = {"case": case, "schedule": schedule, "rank": rank, "repeats": len(runs)}
        row.update({key: runs[0][key] for key in ("blocks", "bubble_fraction")})
        row["other_load_cores"] = max(r["other_load_cores"] for r in runs)
        for part in ("profiler", "stage_timer", "stage_timer_unprofiled"):
            row[part] = {
                key: statistics.median(r[part][key] for r in runs) if runs[0][part][key] is not None else None
                for key in runs[0][part]
            }
        row["stage_timer_idle_range"] = [f(r["stage_timer"]["idle"] for r in runs) for f in (min, max)]
        rows.append(row)
    order = {(name, schedule): i for i, (name, _, schedule) in enumerate(CASES)}
    return sorted(rows, key=lambda r: (order[(r["case"], r["schedule"])], r["rank"]))


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# Pipeline idle: the StageTimer against torch's profiler",
        "",
        f"`benchmarks/idle_check.py`, {cfg['date']}, {cfg['machine']}; {cfg['minutes']:.1f} min. "
        f"PipelineParallelStrategy, PP={PP}, 4 micro-batches, AdamW, 2 single-threaded gloo ranks (torchrun); per "
        f"case {cfg['steps']} profiled training steps after {cfg['warmup']} warm-up steps, then {cfg['after']} "
        f"unprofiled; medians of {cfg['repeats']} repeats. The machine may be shared with other jobs (2 cores; "
        "see other load): a busy core stretches the waits, so absolute times and the tiny model's shares vary "
        "from run to run; compare columns within one row.",
        "",
        "- **profiler**: shares of schedule.step on the rank's main thread from torch's profiler trace: the stage's "
        "own forward and backward ops (**compute**), send/recv ops and torch's wait on them (**comm**), other ops "
        "(the loss, micro-batch splitting, copies, gradient scaling) and no op (Python: the schedule, hooks, "
        "autograd's engine). **profiler idle** = 1 - compute. **1 - actions**: 1 - the share inside torch's own "
        "`PP:<stage><F|B|I|W><mb>` ranges around each compute action, less the comm inside them (multi-stage "
        "schedules only): the stage's compute with torch's Python around it.",
        "- **StageTimer idle**: the end-of-run table's column for the same steps (1 - hooked forward/backward "
        "time / schedule.step time; min-max over the repeats in brackets); unprofiled: the steps after, without "
        "the profiler's overhead; forward only: counting only forwards as busy, as the StageTimer did for "
        "split-backward schedules (zbv) before it timed their I and W passes.",
        "- **bubble**: the schedule's analytic idle share under unit costs (the table's caption). **other load**: "
        "cores other processes kept busy during the case, the largest of the repeats (anything above ~0.1 "
        "inflates the waits).",
        "",
        "| case | schedule | rank | blocks | schedule.step ms | compute | comm | other ops | no op | profiler idle "
        "| 1 - actions | StageTimer idle | StageTimer idle, unprofiled | forward only | bubble | other load (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        p, t, u = row["profiler"], row["stage_timer"], row["stage_timer_unprofiled"]
        actions = f"{1 - p['actions']:.0%}" if p["actions"] is not None else "-"
        low, high = row["stage_timer_idle_range"]
        lines.append(
            f"| {row['case']} | {row['schedule']} | {row['rank']} | {', '.join(row['blocks'])} | "
            f"{p['schedule_step_ms']:.1f} | {p['compute']:.0%} | {p['comm']:.0%} | {p['other_ops']:.0%} | "
            f"{p['no_op']:.0%} | {1 - p['compute']:.0%} | {actions} | {t['idle']:.0%} ({low:.0%}-{high:.0%}) | "
            f"{u['idle']:.0%} | {t['idle_forward_only']:.0%} | {row['bubble_fraction']:.0%} | "
            f"{row['other_load_cores']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    def after(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--after", type=int, default=4, help="unprofiled steps after the profiled ones")

    args = arguments(__doc__.split("\n", 1)[0], steps=4, warmup=3, repeats=3, timeout=900, extra=after)
    if args.worker:
        worker(args.worker, args)
        return
    begin = time.perf_counter()
    per_rank = launch(__file__, PP, counts(args, ("warmup", "steps", "after", "repeats")), timeout=args.timeout)
    result = {
        "config": {
            "date": datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": machine(),
            "minutes": (time.perf_counter() - begin) / 60,
            **{k: getattr(args, k) for k in ("warmup", "steps", "after", "repeats")},
        },
        "rows": aggregate(per_rank),
        "runs_per_rank": per_rank,
    }
    write_results("idle_check", result, markdown(result))


if __name__ == "__main__":
    main()
