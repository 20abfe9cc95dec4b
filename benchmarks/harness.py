"""The harness every benchmark here runs on: a case in its own process (`train.py` with overrides, the script's own
`--case` mode, or its `--worker` mode on N ranks under torchrun), the command line and `results/<name>.{json,md}`;
timing.py holds how steps are timed and others' load recorded. A benchmark is then its cases and what it compares.

It knows no model, strategy or report layout. Imported by the scripts next to it (`python benchmarks/<name>.py` puts
this folder on sys.path).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from timing import LoadMeter, children_cpu_s

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
THREADS_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one torch thread per process, output unbuffered


def machine() -> str:
    """e.g. 'x86_64, 2 CPUs, torch 2.13.0+cpu': the machine a results file was measured on."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"


# ---- a case in its own process ------------------------------------------------------------------------------------
def one_line(text: str, returncode: int | None = None) -> str:
    """The line of a failed process's output that says why: a signal that killed a rank, else the last line naming
    an error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    signals = [line for line in lines if "Signal " in line and "received by PID" in line]
    telling = [line for line in lines if "Error" in line or line.startswith("error")]
    if signals:
        return signals[-1]
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return (telling or lines or [f"exit code {returncode}"])[-1]


def run(command: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `command` in a new session, with `env` (default THREADS_ENV) over this
    process's environment; on timeout the whole session is killed (torchrun's ranks too, not only the agent) and the
    output ends with a line saying so."""
    full_env = {**os.environ, **(THREADS_ENV if env is None else env)}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
            note = ""
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code, note = proc.wait(), f"\nerror: timed out after {timeout:.0f} s"
        log.seek(0)
        return code, log.read() + note


def with_benchmarks_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` with this folder on PYTHONPATH: train.py's ranks import callbacks from here (`+callbacks.x._target_`)."""
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {**(env or {}), "PYTHONPATH": path}


def train_py(overrides: list[str], *, timeout: float = 600, step_times: bool = False,
             env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One `train.py` run in a scratch directory, one torch thread per rank: its summary.json with the run's wall
    seconds (`run_s`), and with `step_times` each rank's `StepTimes` record; or {"error": the line that says why}."""
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["+callbacks.step_times._target_=timing.StepTimes"] if step_times else []
        command = [sys.executable, str(ROOT / "train.py"), *overrides, *extra, f"hydra.run.dir={tmp}/run"]
        started = time.perf_counter()
        code, output = run(
            command, timeout=timeout, env=with_benchmarks_path({**THREADS_ENV, **(env or {})}), cwd=Path(tmp)
        )
        summary = Path(tmp) / "run" / "summary.json"
        if code != 0 or not summary.exists():
            return {"error": one_line(output, code), "output_tail": output[-3000:]}
        result = json.loads(summary.read_text()) | {"run_s": time.perf_counter() - started}
        if step_times:
            ranks = sorted((Path(tmp) / "run").glob("step_times_rank*.json"), key=lambda p: int(p.stem[15:]))
            result["step_times"] = [json.loads(p.read_text()) for p in ranks]
        return result


def run_case(script: str | Path, arguments: list[str], *, timeout: float,
             env: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """`python script --case ... --out FILE` in a fresh process: the JSON it wrote (or {"error": why}), with the
    cores other processes kept busy meanwhile and the process's wall seconds. The child writes with `write_case`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        meter, before, started = LoadMeter(), children_cpu_s(), time.perf_counter()
        meter.start()
        code, output = run([sys.executable, str(script), *arguments, "--out", str(out)], timeout=timeout, env=env)
        result = json.loads(out.read_text()) if out.exists() else {"error": one_line(output, code)}
    own = children_cpu_s() - before
    return {**result, "other_cores": meter.other_cores(own), "process_s": time.perf_counter() - started}


def error_line(error: BaseException) -> str:
    """`ValueError: the first line of its message`: what a row of a report says when a case stopped."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def write_case(out: Path, measure: Callable[[], dict[str, Any]]) -> None:
    """In a `run_case` child: write what `measure` returns, or the one line it stopped with, as JSON to `out`."""
    try:
        result = measure()
    except Exception as error:  # the row says why; the other cases go on
        result = {"error": error_line(error)}
    out.write_text(json.dumps(result))


# ---- a worker on N ranks ------------------------------------------------------------------------------------------
class RanksFailed(RuntimeError):
    """A torchrun launch that did not finish: `line` says why in one line; the message adds the log's tail."""

    def __init__(self, line: str, log: str) -> None:
        super().__init__(f"ranks failed: {line}; log:\n{log[-4000:]}")
        self.line = line


def launch(script: str | Path, nprocs: int, arguments: list[str], *, timeout: float,
           load: Callable[[Path], Any] | None = None) -> list[Any]:  # fmt: skip
    """Run `script --worker DIR *arguments` on `nprocs` local ranks under torchrun; return what each rank wrote to
    `DIR/rank<r>.json` (or `load(that path)`, for a worker that writes other files beside it). Raises RanksFailed."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
                   str(script), "--worker", tmp, *arguments]  # fmt: skip
        code, output = run(command, timeout=timeout)
        (Path(tmp) / "ranks.log").write_text(output)
        if code != 0:
            raise RanksFailed(one_line(output, code), output)
        read = load or (lambda path: json.loads(path.read_text()))
        return [read(Path(tmp) / f"rank{rank}.json") for rank in range(nprocs)]


def worker_setup(timeout: timedelta = timedelta(minutes=5), backend: str = "gloo") -> int:
    """In a launched rank: one torch thread, Lightning's and torch's chatter off, the process group (gloo unless
    `backend` says otherwise) from torchrun's environment (the strategies reuse it). Returns the rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    quiet()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank()


def worker_done(out: Path, rank: int, result: Any) -> None:
    """In a launched rank, last: write what it measured where `launch` reads it, and leave the process group."""
    import torch.distributed as dist

    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def quiet() -> None:
    """Warnings and Lightning's info lines off: a benchmark's output is its own progress lines."""
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


# ---- arguments and results ----------------------------------------------------------------------------------------
def arguments(description: str, *, steps: int, warmup: int, repeats: int, timeout: float,
              extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:  # fmt: skip
    """Measured steps, warm-up steps and interleaved repeats per run, a timeout, the script's own options (`extra`),
    and the hidden modes of a launched process: `--worker DIR` (a rank) and `--case NAME --out FILE` (one case)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=warmup, help="steps per run left out of the statistics")
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats of every run")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before a run's processes are killed")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def counts(args: argparse.Namespace, names: Iterable[str] = ("steps", "warmup", "repeats")) -> list[str]:
    """The options a launched rank or case gets back: `--steps 8 --warmup 2 --repeats 10`."""
    return [part for name in names for part in (f"--{name}", str(getattr(args, name)))]


def write_results(name: str, report: Any, table: str, wall_s: float | None = None, *, results: Path = RESULTS,
                  indent: int = 1, show: bool = True) -> None:  # fmt: skip
    """results/<name>.json (the whole report) and results/<name>.md (the table), and the table on stdout (`show`)."""
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(report, indent=indent))
    (results / f"{name}.md").write_text(table)
    if show:
        print(table)
    print(f"wrote {results}/{name}.{{json,md}}" + (f" in {wall_s:.0f} s" if wall_s is not None else ""))
