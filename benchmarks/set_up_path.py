"""How far the set-up order travels through the package's files (issue 26's "a parameter followed through it visits
18 files and returns to them 21 times"), for three runs: GPT-2 (transformers) at pp2 x tp2 (traced stages), an
nn.Sequential at pp2 and GPT-2 under the tensor strategy at tp2. Rank 0 records every call into and return out of a
function in `lightning_parallel/` from `MeshStrategy.setup` until precision (`mesh_precision`): the network's own
order. Property accessors and the network lookup (`network_of`, `find_network`) are left out, with what they call.
A file counts once when control first enters it; every later entry (by a call or by a return) is a "return". Counted
down to each call depth below `setup` (0) and with no limit. Measures whatever `lightning_parallel` is importable, so
run it once per tree (`before`: `git archive` of the older commit into a folder, this script copied in). Not a
timing. Writes results/set_up_path_<label>.{json,md}.
Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/set_up_path.py [--label after]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import types
from pathlib import Path
from typing import Any

from harness import ROOT, launch, worker_setup, write_results

import lightning_parallel

PACKAGE = str(Path(lightning_parallel.__file__).parent)
DEPTHS = (2, 3, 4, None)  # None: no limit
CASES = {"gpt2 pp2 x tp2 (traced)": 4, "nn.Sequential pp2": 2, "tensor tp2": 2}
HIDDEN_NAMES = {"network_of", "find_network"}


class PathTracer:
    """The files control passes through, per depth limit, as `sys.setprofile` sees calls and returns."""

    def __init__(self, hidden: set[types.CodeType]) -> None:
        self.hidden, self.frames, self.done = hidden, {}, False
        self.paths: dict[int | None, list[str]] = {depth: [] for depth in DEPTHS}

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if self.done or event not in ("call", "return") or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        if event == "call" and frame.f_code.co_name == "mesh_precision":
            self.done = True  # precision onwards is not the network's order
            return
        if event == "call":
            self.frames[id(frame)] = self._place(frame)
        depth, hidden, chain = self.frames.get(id(frame), (0, True, ()))
        if event == "return":
            self.frames.pop(id(frame), None)  # a frame's id is reused once it is gone
        if hidden:
            return
        here = chain if event == "call" else chain[:-1]  # (depth, file) of each visible frame, outermost first
        for limit, path in self.paths.items():
            visible = [file for d, file in here if limit is None or d <= limit]
            if visible and (not path or path[-1] != visible[-1]):
                path.append(visible[-1])

    def _place(self, frame: types.FrameType) -> tuple[int, bool, tuple[tuple[int, str], ...]]:
        parent = frame.f_back
        while parent is not None and id(parent) not in self.frames:
            parent = parent.f_back
        depth, hidden, chain = self.frames[id(parent)] if parent is not None else (-1, False, ())
        hidden = hidden or frame.f_code in self.hidden or frame.f_code.co_name in HIDDEN_NAMES
        file = str(Path(frame.f_code.co_filename).relative_to(PACKAGE))
        return depth + 1, hidden, (*chain, (depth + 1, file))


def property_codes() -> set[types.CodeType]:
    """The code of every property getter defined in the package's classes."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("lightning_parallel"):
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            for value in vars(cls).values():
                if isinstance(value, property) and value.fget is not None and hasattr(value.fget, "__code__"):
                    codes.add(value.fget.__code__)
    return codes


def counts(path: list[str]) -> dict[str, Any]:
    files = list(dict.fromkeys(path))
    return {"files": len(files), "returns": len(path) - len(files), "path": path}


def worker(out: Path, case: str) -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "workers")]
    from user_modules import CausalLM, build, fit, tiny_gpt2, token_loader

    from lightning_parallel import PipelineParallelStrategy, TensorParallelStrategy
    from lightning_parallel.strategies.base import MeshStrategy

    rank = worker_setup()
    if case == "tensor tp2":
        module, data = CausalLM(tiny_gpt2()), token_loader(batch_size=8)
        strategy: Any = TensorParallelStrategy(tensor_parallel_size=2)
    elif case == "nn.Sequential pp2":
        module, data = build("sequential_mlp", "criterion"), None
        strategy = PipelineParallelStrategy(microbatches=2)
    else:
        plan = {f"transformer.h.*.{name}": style for name, style in
                [("attn.c_attn", "colwise"), ("attn.c_proj", "rowwise"), ("mlp.c_fc", "colwise"),
                 ("mlp.c_proj", "rowwise")]}  # fmt: skip
        module, data = CausalLM(tiny_gpt2()), token_loader(batch_size=8)
        strategy = PipelineParallelStrategy(tensor_parallel_size=2, microbatches=2, plan=plan)
    tracer = PathTracer(property_codes())
    setup = MeshStrategy.setup

    def traced_setup(self: Any, trainer: Any) -> None:
        sys.setprofile(tracer.profile if rank == 0 else None)
        try:
            setup(self, trainer)
        finally:
            sys.setprofile(None)

    MeshStrategy.setup = traced_setup  # type: ignore[method-assign]
    fit(module, strategy=strategy, devices=CASES[case], steps=1, shuffle=False, batch_size=8, data=data)
    report = {str(depth): counts(path) for depth, path in tracer.paths.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="now", help="what this tree is (before / after)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker, args.case)
    report = {case: launch(__file__, n, ["--case", case], timeout=600)[0] for case, n in CASES.items()}
    header = "| run | " + " | ".join(f"depth {d}" if d else "all" for d in DEPTHS) + " |"
    rows = [
        f"| {case} | " + " | ".join(f"{r[str(d)]['files']} / {r[str(d)]['returns']}" for d in DEPTHS) + " |"
        for case, r in report.items()
    ]
    table = f"{args.label}: files / returns\n\n{header}\n|---|{'---|' * len(DEPTHS)}\n" + "\n".join(rows) + "\n"
    write_results(f"set_up_path_{args.label}", {"package": PACKAGE, "cases": report}, table)


if __name__ == "__main__":
    main()
