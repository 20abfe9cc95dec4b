"""Idle check: the pipeline's measured idle share (the StageTimer's, the end-of-run table's "idle" column) against
torch's profiler on the same training steps. Writes results/idle_check.{json,md}.

The profiler's trace is classified without the StageTimer's hooks: inside each schedule.step, the rank's main
thread is in the stage's own forward/backward ops (compute), in send/recv ops or torch's wait on them (comm), in
other ops (the loss, splitting into micro-batches, copies, gradient scaling), or in no op at all (Python: the
schedule, hooks, autograd's engine between nodes). 2 single-threaded gloo ranks launched by torchrun.
idle_check_trace.py classifies the trace, idle_check_report.py writes the table.
Usage: .venv/bin/python benchmarks/idle_check.py [--warmup 3 --steps 4 --after 4 --repeats 3]  (~1.5 min, 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from harness import arguments, counts, launch, machine, worker_done, worker_setup, write_results
from idle_check_report import aggregate, markdown
from idle_check_trace import LOSS, STEP, WAIT, breakdown
from ranks import bare_trainer
from timing import LoadMeter, order
from torch.distributed.pipelining import schedules
from torch.profiler import ProfilerActivity, profile, record_function

from lightning_parallel import PipelineParallelStrategy
from lightning_parallel.data import DigitsDataModule, SyntheticImagesDataModule, SyntheticTokensDataModule
from lightning_parallel.models import GPT, SimpleCNN
from lightning_parallel.tasks import ClassificationTask, LanguageModelTask

PP = 2
# (name, model, schedule): digits is train.py's default run; the other two make compute dominate.
CASES = [
    ("SimpleCNN, digits 8x8, batch 64", "cnn_digits", "1f1b"),
    ("SimpleCNN, digits 8x8, batch 64", "cnn_digits", "zbv"),
    ("SimpleCNN, synthetic 3x64x64, batch 64", "cnn_64", "1f1b"),
    ("GPT depth 4 width 256, 32 tokens, batch 16", "gpt_256", "1f1b"),
    ("GPT depth 4 width 256, 32 tokens, batch 16", "gpt_256", "zbv"),
]


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
    worker_done(out, rank, runs)


def measure_case(model: str, schedule: str, meter: LoadMeter, args: argparse.Namespace) -> dict[str, Any]:
    """One case, and how many cores other processes kept busy meanwhile."""
    dist.barrier()
    meter.start()
    cpu = time.process_time()
    run = run_case(model, schedule, args)
    own = [0.0] * PP
    dist.all_gather_object(own, time.process_time() - cpu)
    return {"other_load_cores": meter.other_cores(sum(own)), **run}


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
        "rows": aggregate(per_rank, CASES),
        "runs_per_rank": per_rank,
    }
    write_results("idle_check", result, markdown(result, PP))


if __name__ == "__main__":
    main()
