"""How long a periodic checkpoint stops training, written in the step (sync) or in the background (async,
`callbacks.async_checkpoints`), for the GPT (`model=transformer data=synthetic_tokens`, sized so a checkpoint is
tens of MB) under single, ddp, pipeline pp2 and tensor tp2 on CPU, a save every 50 steps. Each run is train.py
(`harness.train_py`); `SaveClock` on every rank stamps each step's start and end, so a save's stall is the gap after
its step less the usual gap. Also: how many steps a background write overlapped and what it cost them, the step time,
the wait at the end of fit, other processes' load. Writes results/checkpoint_stall.{json,md}.
Usage: .venv/bin/python benchmarks/checkpoint_stall.py [--quick] [--steps 150 --warmup 10 --every 50 --repeats 1]
       [--strategies single ddp] [--modes none sync async]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from harness import arguments, machine, train_py, write_results
from timing import interleaved, other_cores
from typing_extensions import override

# depth 4, width 256: 3.2 M parameters; with AdamW's two moments a checkpoint is ~37 MB (split over pp / tp ranks)
GPT = ["model=transformer", "data=synthetic_tokens", "model.width=256", "model.depth=4", "data.batch_size=8"]
QUIET_RUN = [
    "trainer.accelerator=cpu", "trainer.limit_val_batches=0", "callbacks.progress_bar=null",
    "callbacks.lr_monitor=null", "callbacks.model_checkpoint=null", "~logger",
]  # fmt: skip
STRATEGIES = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "pipeline pp2": ["strategy=pipeline", "trainer.devices=2", "strategy.pipeline_parallel_size=2"],
    "tensor tp2": ["strategy=tensor", "trainer.devices=2", "strategy.tensor_parallel_size=2"],
}
MODES = {  # what saves, and how
    "none": ["callbacks.step_checkpoint=null", "+trainer.enable_checkpointing=false"],
    "sync": ["callbacks.async_checkpoints=null"],
    "async": [],
}
QUICK = {"steps": 100, "warmup": 5, "strategies": ["single", "pipeline pp2"], "modes": ["sync", "async"]}
AFTER = 10  # steps after a save whose extra time is counted as the background write's cost (it shares the cores)


class SaveClock(pl.Callback):
    """Every rank's step start and end times (ModelCheckpoint runs after every other callback, so a save falls
    between one step's end and the next one's start), whether a background write was in flight at each step's start,
    the end of training and of fit (after the strategy's teardown waited for a write in flight), and on rank 0 the
    checkpoints kept; written to `<out>/clock<rank>.json`."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.writing: list[bool] = []
        self.train_end = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append(time.perf_counter())
        writes = getattr(trainer.strategy.checkpoint_io, "writes", None)  # AsyncCheckpointIO's
        self.writing.append(bool(writes is not None and writes.in_flight))

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    @override
    def on_train_end(self, *args: Any) -> None:
        self.train_end = time.perf_counter()

    @override
    def on_fit_end(self, trainer: pl.Trainer, *args: Any) -> None:
        record = {"starts": self.starts, "ends": self.ends, "writing": self.writing, "train_end": self.train_end}
        record["fit_end"] = time.perf_counter()
        folder = Path(trainer.checkpoint_callback.dirpath or "") if trainer.checkpoint_callback else None
        if trainer.is_global_zero and folder is not None and folder.is_dir():
            sizes = {p.name: sum(f.stat().st_size for f in [p, *p.rglob("*")] if f.is_file()) for p in folder.iterdir()}
            record["kept"] = sizes
        (self.out / f"clock{trainer.global_rank}.json").write_text(json.dumps(record))


def run(strategy: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One train.py run: every rank's clock and `StepTimes` record, or {"error": why}."""
    with tempfile.TemporaryDirectory() as out:
        saving = [] if mode == "none" else [f"callbacks.step_checkpoint.every_n_train_steps={args.every}"]
        clock = [f"+callbacks.clock={{_target_: checkpoint_stall.SaveClock, out: '{out}'}}"]
        steps = [f"trainer.max_steps={args.warmup + args.steps}"]
        overrides = [*GPT, *QUIET_RUN, *STRATEGIES[strategy], *MODES[mode], *saving, *steps, *clock]
        result = train_py(overrides, timeout=args.timeout, step_times=True)
        if "error" in result:
            return {"error": result["error"]}
        clocks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("clock*.json"))]
    return {"clocks": clocks, "other_cores": other_cores(result["step_times"]), "run_s": result["run_s"]}


def per_rank(clock: dict[str, Any], every: int, warmup: int) -> dict[str, Any]:
    """One rank's numbers: each save's stall (the gap after its step less the median gap after the other steps),
    each save's background write (steps it overlapped, their time over the median step), step times."""
    starts, ends, writing = clock["starts"], clock["ends"], clock["writing"]
    gaps = [starts[i + 1] - ends[i] for i in range(len(starts) - 1)]  # after global step i + 1
    steps = [ends[i] - starts[i] for i in range(len(ends))]
    saved = [i for i in range(warmup, len(gaps)) if (i + 1) % every == 0]
    usual_gap = statistics.median(g for i, g in enumerate(gaps) if i not in saved and i >= warmup)
    usual_step = statistics.median(steps[warmup:])
    overlapped, extra = [], []
    for i in saved:
        after = range(i + 1, len(steps))
        overlapped.append(next((n for n, j in enumerate(after) if not writing[j]), len(after)))
        extra.append(sum(steps[j] - usual_step for j in after[: min(AFTER, every)]))  # not the next save's
    return {
        "stall_s": [gaps[i] - usual_gap for i in saved],
        "overlapped_steps": overlapped,
        "after_s": extra,
        "step_s": steps[warmup:],
        "train_s": clock["train_end"] - starts[warmup],
        "end_wait_s": clock["fit_end"] - clock["train_end"],
    }


def analyse(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A run's row: per save the slowest rank's stall (every rank waits for it at the next collective) and the
    largest after-save cost; the stalls' share of the training time after warm-up; checkpoint size."""
    if "error" in result:
        return result
    ranks = [per_rank(clock, args.every, args.warmup) for clock in result["clocks"]]
    saves = range(len(ranks[0]["stall_s"]))
    stall = [max(r["stall_s"][k] for r in ranks) for k in saves]
    after = [max(r["after_s"][k] for r in ranks) for k in saves]
    train_s = max(r["train_s"] for r in ranks)
    steps = [statistics.median(r["step_s"]) for r in ranks]
    kept = result["clocks"][0].get("kept", {})
    return {
        "stall_ms": [s * 1e3 for s in stall],
        "stall_share": sum(stall) / train_s,
        "overlapped_steps": ranks[0]["overlapped_steps"],
        "after_ms": [s * 1e3 for s in after],
        "after_share": sum(after) / train_s,
        "step_ms_median": max(steps) * 1e3,
        "train_s": train_s,
        "end_wait_ms": max(r["end_wait_s"] for r in ranks) * 1e3,
        "other_cores": result["other_cores"],
        "checkpoint_mb": sum(kept.values()) / 2**20 / len(kept) if kept else 0.0,
        "kept": sorted(kept),
    }


def cell(values: list[float], fmt: str = "{:.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values) or "-"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> str:
    load = [r["other_cores"] for r in rows]
    lines = [
        f"Checkpoint stall: GPT depth 4 width 256 (AdamW), batch 8 x 32 tokens, a save every {args.every} steps, "
        f"{args.warmup} + {args.steps} steps per run (the first {args.warmup} left out), CPU, one thread per "
        f"process; {machine()}; {time.strftime('%Y-%m-%d')}; {wall_s / 60:.0f} min. Other processes kept "
        f"{min(load):.1f}-{max(load):.1f} cores busy (mean {statistics.mean(load):.1f}) of the 2.",
        "",
        "| strategy | mode | checkpoint | stall per save (ms) | stall share of training | background write: steps "
        "overlapped | their extra time (ms) | extra share | step, median (ms) | wait at the end (ms) | other cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['strategy']} | {r['mode']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} |" + " |" * 8 + f" {r['other_cores']:.1f} |")
            continue
        size = f"{r['checkpoint_mb']:.0f} MB" if r["kept"] else "-"
        share = f"{100 * r['stall_share']:.2f}%" if r["mode"] != "none" else "-"
        overlapped = cell(r["overlapped_steps"], "{}") if r["mode"] == "async" else "-"
        lines.append(
            f"{head} {size} | {cell(r['stall_ms'])} | {share} | {overlapped} | {cell(r['after_ms'])} | "
            f"{100 * r['after_share']:.1f}% | {r['step_ms_median']:.0f} | {r['end_wait_ms']:.0f} | "
            f"{r['other_cores']:.1f} |"
        )
    lines += [
        "",
        "Stall per save: the gap between the saving step's end and the next step's start, less the median gap after "
        "steps without a save (the slowest rank). Share: all stalls over the training time after warm-up (goal: <= "
        "5%). Background write: the steps that started while the write was in flight (rank 0), and the time the "
        f"{AFTER} steps after each save (fewer if the next save comes first) took over the median step: the write "
        "shares the 2 cores with training (`none` rows show this number's noise). Wait at the end: from the end of "
        "training to the end of fit (a write still in flight is waited for there). Other cores: cores other "
        "processes kept busy during the run (> 0.1 inflates and scatters every timing).",
    ]
    return "\n".join(lines) + "\n"


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--every", type=int, default=50, help="steps between saves")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), help="default: all")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), help="default: all")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} unless given")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], steps=150, warmup=10, repeats=1, timeout=1200, extra=options)
    if args.quick:
        args.steps, args.warmup = QUICK["steps"], QUICK["warmup"]
    args.strategies = args.strategies or (QUICK["strategies"] if args.quick else list(STRATEGIES))
    args.modes = args.modes or (QUICK["modes"] if args.quick else list(MODES))
    started = time.perf_counter()
    runs = [(strategy, mode) for strategy in args.strategies for mode in args.modes]
    rows = []
    for repeat, (strategy, mode) in interleaved(args.repeats, runs):
        row = {"strategy": strategy, "mode": mode, "repeat": repeat, **analyse(run(strategy, mode, args), args)}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "kept"}, flush=True)
    wall_s = time.perf_counter() - started
    given = {k: v for k, v in vars(args).items() if k not in ("worker", "case", "out")}
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "arguments": given}
    report |= {"overrides": GPT + QUIET_RUN, "wall_s": wall_s, "rows": rows}
    write_results("checkpoint_stall", report, table(rows, args, wall_s), wall_s)


if __name__ == "__main__":
    main()
