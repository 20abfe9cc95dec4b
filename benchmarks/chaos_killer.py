"""chaos.py's killer: the kills of a run drawn from a seed (`schedule`, `target_step`), and the thread that fires them
into a running torchrun job, found and watched from outside through /proc, progress.json and the checkpoint folder.
It starts no job and judges nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One kill of each kind per run: "step" at a random moment of a step, "save" while a checkpoint is written (right
# after a checkpoint step finished), "setup" while a restarted attempt sets up (imports, rendezvous, loading).
KINDS = ("step", "save", "setup")
POLL_S = 0.02


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
