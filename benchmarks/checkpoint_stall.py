"""How long a periodic checkpoint stops training, written in the step (sync) or in the background (async,
`callbacks.async_checkpoints`), for the GPT (`model=transformer data=synthetic_tokens`, sized so a checkpoint is
tens of MB) under single, ddp, pipeline pp2 and tensor tp2 on CPU, saving every 50 steps. Each run is train.py; a
clock callback on every rank stamps each step's start and end: a save's stall is the gap after its step minus the
median gap after the other steps. Also reported: the step time with and without saving, and each run's machine load.
Writes results/checkpoint_stall.{json,md}.
Usage: .venv/bin/python benchmarks/checkpoint_stall.py [--steps 170] [--every 50] [--repeats 1] [--strategies single]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from measure import LoadMeter, machine, write_results  # noqa: E402

# depth 4, width 256: 3.2 M parameters; with AdamW's two moments a checkpoint is ~38 MB (split over pp / tp ranks)
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
WARMUP = 5  # steps left out of the step-time statistics


class StepClock(pl.Callback):
    """Every rank's step start and end times (ModelCheckpoint runs after every other callback, so a save falls
    between one step's end and the next one's start), the end of training and the end of the run's teardown (which
    waits for a background write still in flight), written to `<out>/clock<rank>.json`."""

    def __init__(self, out: str) -> None:
        self.out, self.starts, self.ends = Path(out), [], []  # type: ignore[var-annotated]
        self.train_end = 0.0

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    @override
    def on_train_end(self, *args: Any) -> None:
        self.train_end = time.perf_counter()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        record = {"starts": self.starts, "ends": self.ends, "train_end": self.train_end, "done": time.perf_counter()}
        (self.out / f"clock{trainer.global_rank}.json").write_text(json.dumps(record))


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(strategy: str, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One train.py run; every rank's clock, its checkpoint size and the machine's load meanwhile."""
    out = tmp / f"{strategy.replace(' ', '_')}-{mode}"
    out.mkdir(parents=True)
    saving = [] if mode == "none" else [f"callbacks.step_checkpoint.every_n_train_steps={args.every}"]
    command = [sys.executable, "train.py", *GPT, *QUIET_RUN, *STRATEGIES[strategy], *MODES[mode], *saving]
    command += [f"trainer.max_steps={args.steps}", f"hydra.run.dir={out}/run"]
    command += [f"+callbacks.clock={{_target_: checkpoint_stall.StepClock, out: '{out}'}}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    meter, before, started = LoadMeter(), children_cpu_s(), time.perf_counter()
    meter.start()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    load = meter.other_cores(children_cpu_s() - before)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or [f"exit {done.returncode}"]
        return {"error": lines[-1], "other_cores": load}
    clocks = [json.loads(p.read_text()) for p in sorted(out.glob("clock*.json"))]
    checkpoints = out / "run" / "checkpoints"
    size = sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file()) if checkpoints.exists() else 0
    kept = sorted(p.name for p in checkpoints.iterdir()) if checkpoints.exists() else []
    return {"clocks": clocks, "other_cores": load, "run_s": time.perf_counter() - started, "bytes": size, "kept": kept}


def analyse(result: dict[str, Any], every: int) -> dict[str, Any]:
    """Per save: the gap after its step minus the median gap after other steps (the slowest rank, since every rank
    waits for it at the next collective); step times; the stall's share of the training time."""
    if "error" in result:
        return result
    per_rank = []
    for clock in result["clocks"]:
        starts, ends = clock["starts"], clock["ends"]
        gaps = [starts[i + 1] - ends[i] for i in range(len(starts) - 1)]  # after step i + 1
        steps = [starts[i + 1] - starts[i] for i in range(WARMUP, len(starts) - 1)]
        saved = [i for i in range(len(gaps)) if (i + 1) % every == 0]
        usual = statistics.median(g for i, g in enumerate(gaps) if i not in saved and i >= WARMUP)
        per_rank.append({
            "stall_s": [gaps[i] - usual for i in saved], "step_s": steps, "train_s": starts[-1] - starts[WARMUP],
            "end_wait_s": clock["done"] - clock["train_end"],
        })  # fmt: skip
    stall = [max(r["stall_s"][k] for r in per_rank) for k in range(len(per_rank[0]["stall_s"]))]
    steps = per_rank[0]["step_s"]
    train_s = max(r["train_s"] for r in per_rank)
    return {
        "stall_ms": [s * 1e3 for s in stall],
        "step_ms_median": statistics.median(steps) * 1e3,
        "step_ms_mean": statistics.mean(steps) * 1e3,
        "stall_share": sum(stall) / train_s if stall else 0.0,
        "end_wait_ms": max(r["end_wait_s"] for r in per_rank) * 1e3,
        "other_cores": result["other_cores"],
        "checkpoint_mb": result["bytes"] / 2**20 / max(1, len(result["kept"])),
        "kept": result["kept"],
    }


def table(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    lines = [
        f"Checkpoint stall, GPT depth 4 width 256 (AdamW), batch 8 x 32 tokens, a save every {args.every} steps, "
        f"{args.steps} steps per run, CPU, one thread per process. {machine()}.",
        "",
        "| strategy | mode | checkpoint | stall per save (ms) | step, median (ms) | step, mean (ms) "
        "| stall share of training | wait at the end (ms) | other cores busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, modes in results.items():
        for mode, repeats in modes.items():
            for r in repeats:
                if "error" in r:
                    lines.append(f"| {strategy} | {mode} | failed: {r['error']} | | | | | | {r['other_cores']:.1f} |")
                    continue
                stall = ", ".join(f"{s:.0f}" for s in r["stall_ms"]) or "-"
                size = f"{r['checkpoint_mb']:.0f} MB" if r["kept"] else "-"
                share = f"{100 * r['stall_share']:.2f}%" if mode != "none" else "-"
                lines.append(
                    f"| {strategy} | {mode} | {size} | {stall} | {r['step_ms_median']:.0f} | {r['step_ms_mean']:.0f} "
                    f"| {share} | {r['end_wait_ms']:.0f} | {r['other_cores']:.1f} |"
                )
    lines += [
        "",
        "Stall per save: the gap between the saving step's end and the next step's start, minus the median gap after "
        "steps without a save (the slowest rank). Share: all stalls over the training time after warm-up. Wait at the "
        "end: from the end of training to the end of teardown (a background write still in flight is waited for "
        "there). Other cores busy: cores other processes kept busy during the run (2-core machine; > 0.1 inflates "
        "and scatters every timing).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=170, help="optimizer steps per run")
    parser.add_argument("--every", type=int, default=50, help="steps between saves")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats of every run")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    started = time.perf_counter()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {m: [] for m in args.modes} for s in args.strategies}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for strategy in args.strategies:
                for mode in args.modes:
                    result = analyse(run(strategy, mode, args, Path(tmp) / str(repeat)), args.every)
                    results[strategy][mode].append(result)
                    print(strategy, mode, {k: v for k, v in result.items() if k != "kept"}, flush=True)
    report = {"machine": machine(), "arguments": vars(args), "overrides": GPT + QUIET_RUN, "results": results}
    write_results(
        ROOT / "benchmarks" / "results", "checkpoint_stall", report, table(results, args), time.perf_counter() - started
    )


if __name__ == "__main__":
    main()
