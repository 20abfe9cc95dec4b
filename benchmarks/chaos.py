"""Chaos: the torchrun command a user runs (`--max-restarts`, `ckpt_path=last`, a checkpoint every few steps) while a
killer thread SIGKILLs a random worker at random steps, for pipeline (pp2), tensor (tp2) and DiLoCo (2 replicas), each
against the same command uninterrupted: restarts, steps and wall time lost, final loss and weights. Writes
results/chaos.{json,md}. Usage: .venv/bin/python benchmarks/chaos.py [--seed 0] [--kills 3] [--quick] [--strategies ...]

The kill choices (which rank, which kind of moment, how far into the attempt) come from `--seed`; the instants are
wall-clock, so each kill records the step it landed on (chaos_killer.py); chaos_report.py compares the runs. It tests
nothing by itself: `tests/test_chaos.py` checks the schedule and the report from canned runs; `tests/test_restarts.py`
is the deterministic proof.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chaos_killer import Kill, Killer, schedule
from chaos_report import compare, table
from harness import ROOT, machine, one_line, run, write_results
from timing import LoadMeter, children_cpu_s

STRATEGIES = {  # name -> train.py overrides; every one runs on 2 CPU processes
    "pipeline": ["strategy=pipeline"],  # pp2, 1f1b, 4 micro-batches
    "tensor": ["strategy=tensor"],  # tp2, the GPT's Megatron plan
    "diloco": ["strategy=diloco", "strategy.period=5"],  # 2 replicas, an outer step every 5 steps
}
SIZES = {  # the run: model overrides, steps, a checkpoint every `every` steps
    "default": {"model": [], "steps": 40, "every": 5},
    "quick": {"model": ["model.depth=2", "model.width=32", "model.heads=2"], "steps": 20, "every": 4},
}
EVERY = "callbacks.model_checkpoint.every_n_train_steps"


# ---- one job: the command, run straight or with the killer -----------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def command(run_dir: Path, strategy: str, size: dict[str, Any], max_restarts: int) -> list[str]:
    """What a user types (docs/clusters.md, "Surviving failures"), with this run's strategy, size and directory."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--max-restarts={max_restarts}"]
    torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    train = [str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", "ckpt_path=last", *STRATEGIES[strategy]]
    train += ["trainer=cpu", "trainer.devices=2", "model=transformer", *size["model"], "data=synthetic_tokens"]
    train += [f"trainer.max_steps={size['steps']}", "callbacks.model_checkpoint.monitor=null"]
    train += ["callbacks.model_checkpoint.save_top_k=0", f"+{EVERY}={size['every']}"]
    return [*torchrun, *train, "callbacks.progress_bar=null", "+trainer.enable_progress_bar=false"]


def job(strategy: str, size: dict[str, Any], kills: list[Kill], *, timeout: float) -> dict[str, Any]:
    """The command in a scratch directory, the killer firing `kills` (none: uninterrupted): what it did and ended
    with (summary.json, the final weights), or the line that says why it did not finish."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        killer = Killer(run_dir, kills, steps=size["steps"], every=size["every"])
        meter, before = LoadMeter(), children_cpu_s()
        meter.start()
        killer.start()
        code, output = run(command(run_dir, strategy, size, len(kills) + 1), timeout=timeout, cwd=Path(tmp))
        wall_s = killer.elapsed()
        killer.done.set()
        killer.join()
        other = meter.other_cores(children_cpu_s() - before)
        result: dict[str, Any] = {"exit_code": code, "wall_s": wall_s, "other_cores": other, "planned": len(kills)}
        result |= {"kills": [asdict(k) for k in kills if k.pid is not None], "attempts": killer.attempts}
        result["restarts"] = max((a["attempt"] for a in killer.attempts), default=0)  # TORCHELASTIC_RESTART_COUNT
        summary = run_dir / "summary.json"
        if code != 0 or not summary.exists():
            return result | {"error": one_line(output, code), "output_tail": output[-3000:]}
        return result | {"summary": json.loads(summary.read_text()), "weights": final_weights(run_dir)}


def final_weights(run_dir: Path) -> dict[str, Any]:
    """The last checkpoint's weights, whole (a sharded checkpoint exported to one file)."""
    import torch

    from lightning_parallel.checkpoint import export

    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if checkpoint.is_dir():
        checkpoint = export(checkpoint, run_dir / "whole.pt")
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def kept(result: dict[str, Any]) -> dict[str, Any]:
    """A job's record for the JSON: no weights, and of summary.json what the report reads."""
    summary = result.get("summary")
    out = {k: v for k, v in result.items() if k not in ("summary", "weights")}
    if summary is not None:
        loss = summary["metrics"]["train/loss"]
        out["summary"] = {"steps": summary["steps"], "resumes": summary["resumes"], "loss": loss["history"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny GPT, 20 steps")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--kills", type=int, default=3, help="kills per run (each kind once for 3)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kills' ranks, kinds and moments")
    parser.add_argument("--timeout", type=float, default=420, help="seconds before a job's processes are killed")
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "default"]
    report: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "seed": args.seed}
    report |= {"size": size, "strategies": {}}
    started = time.perf_counter()
    for name in args.strategies:
        print(f"{name}: uninterrupted, then {args.kills} kills")
        straight = job(name, size, [], timeout=args.timeout)
        chaos = job(name, size, schedule(args.seed, name, args.kills), timeout=args.timeout)
        row = compare(straight, chaos, size["steps"])
        report["strategies"][name] = {"row": row, "straight": kept(straight), "chaos": kept(chaos)}
        print(f"  {row}")
    name = "chaos_quick" if args.quick else "chaos"
    write_results(name, report, table(report), time.perf_counter() - started)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # lightning_parallel, to export sharded checkpoints
    main()
