"""tests/forked_ranks.py: the ranks Lightning's own launcher starts in the tests' script launches (`run_cli`,
`run_script(fork_ranks=True)`) are forks of the launching process, not fresh interpreters (a silent fallback to
those would only show as ~9 s of CPU more per rank), and are children as Popen's: own pid, exit status, wait."""

from __future__ import annotations

import json
import os
from pathlib import Path

from distributed import run_script

# Run as `python launch.py`: Lightning's subprocess launcher starts rank 1 running this same script, as it does for
# train.py. Each rank records what it is; rank 0 also what Popen reports of rank 1. A progress bar left open before
# the launch starts tqdm's monitor thread, which forked_ranks ends (else the rank would be a fresh interpreter).
SCRIPT = """
import json, os, sys
from pathlib import Path
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from tqdm import tqdm

bar = tqdm(total=1, disable=False, file=sys.stderr)  # open at launch, as in the examples: tqdm's monitor thread runs
environment = LightningEnvironment()
launcher = _SubprocessScriptLauncher(environment, num_processes=2, num_nodes=1)
launcher.launch(lambda: None)
facts = {"pid": os.getpid(), "ppid": os.getppid(), "fork": "forked_ranks" in sys.modules, "argv": sys.argv[1:]}
facts["children"] = [(proc.pid, proc.wait(timeout=60)) for proc in launcher.procs]
Path(f"rank{environment.local_rank()}.json").write_text(json.dumps(facts))
"""


def test_launched_ranks_are_forks_with_their_own_pid_and_exit_status(tmp_path: Path) -> None:
    (tmp_path / "launch.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = run_script(tmp_path / "launch.py", ["x=1"], cwd=tmp_path, env=env, timeout=120, fork_ranks=True)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # the module marks a fork: the launching process imported it, a fresh interpreter running launch.py never does
    assert first["fork"] and second["fork"], (first, second)
    assert second["ppid"] == first["pid"] != second["pid"] and second["argv"] == ["x=1"]
    assert first["children"] == [[second["pid"], 0]] and second["children"] == []
