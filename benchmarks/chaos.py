"""Chaos: the torchrun command a user runs (`--max-restarts`, `ckpt_path=last`, a checkpoint every few steps) while a
killer thread SIGKILLs a random worker at random steps, for pipeline (pp2), tensor (tp2) and DiLoCo (2 replicas), each
against the same command uninterrupted: restarts, steps and wall time lost, final loss and weights. Writes
results/chaos.{json,md}. Usage: .venv/bin/python benchmarks/chaos.py [--seed 0] [--kills 3] [--quick] [--strategies ...]

The kill choices (which rank, which kind of moment, how far into the attempt) come from `--seed`; the instants are
wall-clock, so each kill records the step it landed on. It tests nothing by itself: `tests/test_chaos.py` checks the
schedule and the report from canned runs; `tests/test_restarts.py` is the deterministic proof.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness import ROOT, LoadMeter, children_cpu_s, machine, one_line, run, write_results

STRATEGIES = {  # name -> train.py overrides; every one runs on 2 CPU processes
    "pipeline": ["strategy=pipeline"],  # pp2, 1f1b, 4 micro-batches
    "tensor": ["strategy=tensor"],  # tp2, the GPT's Megatron plan
    "diloco": ["strategy=diloco", "strategy.period=5"],  # 2 replicas, an outer step every 5 steps
}
SIZES = {  # the run: model overrides, steps, a checkpoint every `every` steps
    "default": {"model": [], "steps": 40, "every": 5},
    "quick": {"model": ["model.depth=2", "model.width=32", "model.heads=2"], "steps": 20, "every": 4},
}
# One kill of each kind per run: "step" at a random moment of a step, "save" while a checkpoint is written (right
# after a checkpoint step finished), "setup" while a restarted attempt sets up (imports, rendezvous, loading).
KINDS = ("step", "save", "setup")
POLL_S = 0.02
EVERY = "callbacks.model_checkpoint.every_n_train_steps"


@dataclass
class Kill:
    """One planned kill: its kind, the rank, and `fraction` (how far into what is left of the attempt's steps, or into
    the set-up for "setup"); what it hit is filled in when it fires."""

    kind: str
    rank: int
    fraction: float
    pid: int | None = None
    attempt: int | None = None  # torchrun's TORCHELASTIC_RESTART_COUNT of the killed worker
    after_step: int | None = None  # the last step rank 0 had finished (progress.json): the kill hit the next one
    attempt_s: float | None = None  # seconds since the attempt's workers started
    saving: bool | None = None  # a `.partial` checkpoint write was under way


def schedule(seed: int, strategy: str, kills: int) -> list[Kill]:
    """The kills of one run, reproducible from (seed, strategy): each kind at least once for 3+ kills, "setup" never
    first (it hits a restart), ranks and fractions drawn."""
    rng = random.Random(f"{seed}-{strategy}")
    kinds = [KINDS[i % len(KINDS)] for i in range(kills)]
    rng.shuffle(kinds)
    if kinds[0] == "setup" and kills > 1:
        kinds[0], kinds[1] = kinds[1], kinds[0]
    return [Kill(kind=kind, rank=rng.randrange(2), fraction=rng.random()) for kind in kinds]


def target_step(kill: Kill, resumed: int, steps: int, every: int) -> int:
    """The step after which a "step" or "save" kill fires in an attempt that resumed from `resumed`: `fraction` of the
    way to the end; a "save" kill moves to the next checkpoint step (the last one before the end)."""
    step = resumed + 1 + int(kill.fraction * (steps - 1 - resumed))
    if kill.kind == "save":
        step = min(-(-step // every) * every, (steps - 1) // every * every)
    return max(step, resumed + 1) if kill.kind == "step" else step


# ---- the job's processes, seen from outside ------------------------------------------------------------------------
def agent_pid(run_dir: Path) -> int | None:
    """torchrun's agent of the job writing `run_dir` (its command line names the directory), once it is running."""
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except OSError:  # gone meanwhile
            continue
        if b"torch.distributed.run" in line and f"hydra.run.dir={run_dir}".encode() in line:
            return int(proc.name)
    return None


def workers(agent: int) -> dict[int, tuple[int, int]]:
    """rank -> (pid, attempt) of the agent's live workers (attempt: their TORCHELASTIC_RESTART_COUNT)."""
    found: dict[int, tuple[int, int]] = {}
    for children in Path(f"/proc/{agent}/task").glob("*/children"):
        for pid in children.read_text().split() if children.exists() else []:
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone meanwhile
                continue
            env = dict(v.split(b"=", 1) for v in raw if b"=" in v)
            if b"RANK" in env and state != "Z":  # not a zombie nor a fork still before exec
                found[int(env[b"RANK"])] = (int(pid), int(env.get(b"TORCHELASTIC_RESTART_COUNT", b"0")))
    return found


def progress(run_dir: Path) -> dict[str, Any]:
    """progress.json (ResumeRecord, rank 0): the last finished step, when, the resumes so far; {} before the first."""
    try:
        found = json.loads((run_dir / "progress.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def saving(run_dir: Path) -> bool:
    return any((run_dir / "checkpoints").glob("*.partial"))


class Killer(threading.Thread):
    """Fires `kills` in order into the job writing `run_dir`, one per attempt; records each attempt's start."""

    def __init__(self, run_dir: Path, kills: list[Kill], *, steps: int, every: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.kills, self.steps, self.every = run_dir, kills, steps, every
        self.done = threading.Event()
        self.attempts: list[dict[str, Any]] = []  # {"attempt", "started_s", "setup_s"}
        self.started = time.perf_counter()
        self.agent: int | None = None

    def run(self) -> None:
        """Each kill in the first attempt it can hit (one that ends by itself first is passed over), then the
        attempts that follow are only recorded, until the job ends."""
        pending = list(self.kills)
        while (attempt := self._next_attempt()) is not None:
            if pending and self._fire(pending[0], attempt):
                pending.pop(0)

    def _next_attempt(self) -> dict[str, Any] | None:
        """Wait for a new attempt's workers (both ranks up, a restart count not seen yet)."""
        seen = {a["attempt"] for a in self.attempts}
        while not self.done.is_set():
            self.agent = self.agent or agent_pid(self.run_dir)
            found = workers(self.agent) if self.agent else {}
            counts = {attempt for _, attempt in found.values()}
            if len(found) == 2 and len(counts) == 1 and not counts & seen:
                entry = {"attempt": counts.pop(), "started_s": self.elapsed(), "started": time.time()}
                self.attempts.append(entry)
                return entry
            time.sleep(POLL_S)
        return None

    def _fire(self, kill: Kill, attempt: dict[str, Any]) -> bool:
        """Wait for the kill's moment in this attempt, then SIGKILL its rank; False if the job ended first."""
        while not self.done.is_set() and self._alive(attempt):
            now = progress(self.run_dir)
            trained = now.get("time", 0) >= attempt["started"]  # written by this attempt: it trains
            if kill.kind == "setup":
                setup_s = self.attempts[0].get("setup_s") or 10.0
                if trained or self.elapsed() - attempt["started_s"] >= kill.fraction * setup_s:
                    return self._kill(kill, attempt, now)
            elif trained:
                attempt.setdefault("setup_s", self.elapsed() - attempt["started_s"])
                attempt.setdefault("first_step", now.get("step", 0))  # on_train_start: the step it resumed from
                if now.get("step", 0) >= target_step(kill, attempt["first_step"], self.steps, self.every):
                    return self._kill(kill, attempt, now)
            time.sleep(POLL_S)
        return False

    def _alive(self, attempt: dict[str, Any]) -> bool:
        """Some worker of `attempt` still runs."""
        return any(found == attempt["attempt"] for _, found in workers(self.agent).values()) if self.agent else False

    def _kill(self, kill: Kill, attempt: dict[str, Any], now: dict[str, Any]) -> bool:
        worker = workers(self.agent).get(kill.rank) if self.agent else None
        if worker is None or worker[1] != attempt["attempt"]:
            return False  # this attempt already ended
        kill.saving = saving(self.run_dir)
        os.kill(worker[0], signal.SIGKILL)
        kill.pid, kill.attempt = worker
        kill.after_step = now.get("step") if now.get("time", 0) >= attempt["started"] else None
        kill.attempt_s = self.elapsed() - attempt["started_s"]
        print(f"  killed rank {kill.rank} ({kill.kind}) of attempt {kill.attempt} after step {kill.after_step}")
        return True

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


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


# ---- what a chaos run cost against the straight one --------------------------------------------------------------
def max_difference(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The largest absolute difference between two state dicts of the same keys; None if the keys differ."""
    if a.keys() != b.keys():
        return None
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


def compare(straight: dict[str, Any], chaos: dict[str, Any], steps: int) -> dict[str, Any]:
    """One row: kills, restarts, resumes, steps and wall time lost, final loss and weights against `straight`."""
    row: dict[str, Any] = {"kills": len(chaos["kills"]), "planned": chaos["planned"], "restarts": chaos["restarts"]}
    done = [run.get("summary", {}).get("steps") == steps for run in (straight, chaos)]
    row["completed"] = all(done)
    if not row["completed"]:
        return row | {"error": chaos.get("error") or straight.get("error") or f"stopped before step {steps}"}
    resumes = chaos["summary"]["resumes"]
    row["resumes"] = [(r["from_step"], r["steps_lost"]) for r in resumes]
    row["steps_lost"] = sum(r["steps_lost"] or 0 for r in resumes)
    row["wall_lost_recorded_s"] = sum(r["wall_time_lost_s"] or 0.0 for r in resumes)
    row["wall_s"] = (straight["wall_s"], chaos["wall_s"])
    row["wall_lost_s"] = chaos["wall_s"] - straight["wall_s"]
    want = straight["summary"]["metrics"]["train/loss"]["history"]
    got = chaos["summary"]["metrics"]["train/loss"]["history"]  # the last attempt's steps only
    row["final_loss"] = (want[-1], got[-1])
    row["loss_max_diff"] = max(abs(a - b) for a, b in zip(got, want[-len(got) :], strict=True))
    row["weights_max_diff"] = max_difference(straight["weights"], chaos["weights"])
    row["other_cores"] = (straight["other_cores"], chaos["other_cores"])
    return row


def kill_text(kill: dict[str, Any]) -> str:
    """e.g. 'r1 step@17', 'r0 save@20 (writing)', 'r1 setup 3.2s'."""
    where = f" {kill['attempt_s']:.1f}s" if kill["after_step"] is None else f"@{kill['after_step']}"
    return f"r{kill['rank']} {kill['kind']}{where}" + (" (writing)" if kill["saving"] else "")


def table(report: dict[str, Any]) -> str:
    """The markdown report: one row per strategy, then how to read it."""
    lines = [f"# Chaos: random SIGKILLs under torchrun ({report['machine']})", ""]
    size = report["size"]
    lines += [f"{report['date']}; seed {report['seed']}; {size['steps']} steps, a checkpoint every {size['every']}; "
              f"model=transformer {' '.join(size['model'])}".rstrip(), ""]  # fmt: skip
    head = ["strategy", "completed", "kills (rank kind@after step)", "restarts", "resumes: from step (steps lost)",
            "steps lost", "wall straight / chaos s", "wall lost s (recorded)", "final loss straight / chaos",
            "loss max diff", "weights max diff", "other cores"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in report["strategies"].items():
        row, kills = entry["row"], ", ".join(kill_text(k) for k in entry["chaos"]["kills"])
        if row["kills"] < row["planned"]:
            kills += f" ({row['kills']} of {row['planned']} fired)"
        if not row["completed"]:
            lines.append(f"| {name} | no: {row['error']} | {kills} | {row['restarts']} |" + " |" * 8)
            continue
        cells = [name, "yes", kills, str(row["restarts"]), ", ".join(f"{f} ({s})" for f, s in row["resumes"]),
                 str(row["steps_lost"]), "{:.0f} / {:.0f}".format(*row["wall_s"]),
                 f"{row['wall_lost_s']:.0f} ({row['wall_lost_recorded_s']:.0f})",
                 "{:.5f} / {:.5f}".format(*row["final_loss"]), f"{row['loss_max_diff']:.1e}",
                 f"{row['weights_max_diff']:.1e}", "{:.1f} / {:.1f}".format(*row["other_cores"])]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", NOTES, ""])


NOTES = """Each strategy runs the same torchrun command twice (2 CPU processes, `--max-restarts` = kills + 1,
`ckpt_path=last`): straight, and with a thread SIGKILLing a worker: `step` at a random step, `save` right after a
checkpoint step finished (while the checkpoint is written; "(writing)": a `.partial` write was seen), `setup` while a
restarted attempt imports, rendezvouses and loads its checkpoint (seconds after its workers started). "after step": the
last step rank 0 had finished. Resumes, steps lost and "recorded" wall time lost are summary.json's `resumes` (from
each checkpoint's save until training again; a resume from step 0: no checkpoint was complete yet, timed from the lost
attempt's start of training); a kill in a restart's setup adds no resume of its own, its time falls in the next one.
"wall lost" is the chaos run's wall time less the straight run's. Loss max diff: over the steps of the last attempt;
weights: the final checkpoints. Wall times are noisy: the machine is shared, and "other cores" is how many cores other
processes kept busy (straight / chaos)."""


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
