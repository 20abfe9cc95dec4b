"""Ranks that Lightning's launcher starts as forks of the launching process instead of fresh interpreters, for the
tests' train.py launches (`run_cli`): each saves the ~9 s of CPU a fresh interpreter spends importing torch, Lightning
and the library. The rank still runs the launcher's own command line from the start; failure tests keep fresh ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Sequence


class ForkedRank(subprocess.Popen):
    """`subprocess.Popen([sys.executable, script, *args], env=, cwd=)` as Lightning's launcher calls it, but the
    child is a fork of this process that runs the script in place (`run`): a real child process with its own pid, exit
    status and signals, which `poll`, `wait`, `kill` and `send_signal` (Popen's own) read and send as for any child."""

    run: Callable[[str, list[str], str, dict[str, str]], None]  # distributed._run_as_script, set by fork_launched_ranks

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        if list(args[:1]) != [sys.executable] or args[1] == "-m":
            raise RuntimeError(f"ForkedRank runs `python <script> ...` only, not {list(args)}")
        # what Popen's poll / wait / kill / __del__ read (CPython 3.11's subprocess.Popen; its __init__ is not called)
        self.args, self.stdin, self.stdout, self.stderr = list(args), None, None, None
        self.returncode: int | None = None
        self._waitpid_lock = threading.Lock()
        self._sigint_wait_secs = 0.25
        self._child_created = False
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here is written twice by the child
        pid = os.fork()
        if pid == 0:
            os._exit(self._run_child(list(args[2:]), args[1], dict(env or os.environ), cwd or os.getcwd()))
        self.pid = pid
        self._child_created = True

    @staticmethod
    def _run_child(args: list[str], script: str, env: dict[str, str], cwd: str) -> int:
        """In the child: the script from the start, as a fresh interpreter would run it; its exit status."""
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the handlers a fresh interpreter starts with
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            from hydra.core.global_hydra import GlobalHydra
            from hydra.core.hydra_config import HydraConfig

            GlobalHydra.instance().clear()  # the launching process is inside its @hydra.main; this rank starts anew
            HydraConfig.instance().cfg = None  # type: ignore[assignment]
            ForkedRank.run(script, args, cwd, env)
            code = 0
        except SystemExit as exit:
            if isinstance(exit.code, int) or exit.code is None:
                code = exit.code or 0
            else:
                print(exit.code, file=sys.stderr)  # as the interpreter prints sys.exit("message")
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        return code


def _end_tqdm_monitor() -> None:
    """End tqdm's monitor thread, which a process's first progress bar starts (the examples make one before launch)
    and which takes tqdm's lock every 10 s: a fork must not copy that lock held. tqdm starts a new one with its next
    bar."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    monitor = getattr(tqdm, "monitor", None)
    if monitor is not None and monitor.is_alive():
        threads = _threads()
        monitor.exit()  # joined: its Python side is done, and the thread itself ends a moment later
        deadline = time.monotonic() + 30  # usually ms; on a loaded machine the thread may wait to be scheduled
        while _threads() >= threads and time.monotonic() < deadline:
            time.sleep(0.01)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rank(args: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    """A ForkedRank while this process runs one thread (tqdm's monitor ended first); else (a later job of a sweep,
    whose first job left gloo's and the store's threads behind) a fresh interpreter: a fork copies locks those threads
    may hold, and it hung on one."""
    _end_tqdm_monitor()
    if _threads() > 1:
        return subprocess.Popen(args, env=env, cwd=cwd)
    return ForkedRank(args, env=env, cwd=cwd)


def fork_launched_ranks(run: Callable[[str, list[str], str, dict[str, str]], None]) -> None:
    """In a process about to run train.py: the ranks Lightning's subprocess launcher starts become ForkedRanks that
    run the script with `run` (the launcher's module sees a `subprocess` whose Popen is ForkedRank)."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    ForkedRank.run = staticmethod(run)  # type: ignore[assignment]
    forking = types.ModuleType("subprocess")
    forking.__dict__.update(vars(subprocess))
    forking.Popen = _rank  # type: ignore[attr-defined]
    subprocess_script.subprocess = forking  # type: ignore[attr-defined]
