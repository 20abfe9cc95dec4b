"""Family table: every decoder family transformers ships that builds offline from a tiny config (tests/hf_families.py)
trained on padded text (-100 labels, a last batch of 6 rows, AdamW) under pipeline 2, tensor 2 and pp2 x tp2 on 2 and 4
CPU processes, each against one process with the same seed and batches: exact (losses and final weights within
1e-5), refused before launch in one line, or a failure (which this table exists to show). Writes
results/families.{json,md}.
Usage: .venv/bin/python benchmarks/families.py [--only gpt_neox,qwen2_tied]  (~30 min on 2 busy cores; --only reruns
those families and replaces their rows in the existing results)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import RESULTS, ROOT, machine, one_line, quiet, write_results

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "workers")]
from distributed import run_workers  # noqa: E402
from hf_families import FAMILIES, build  # noqa: E402
from padded_modules import padded_loader  # noqa: E402
from user_modules import fit  # noqa: E402

STEPS = 3  # the padded loader's 3 batches: 8 rows of 16 tokens, 8 of 15, 6 of 16
TOL = 1e-5
LAYOUTS = {  # name -> (processes, strategy kind, constructor arguments)
    "pp2": (2, "pipeline", {"microbatches": 2}),
    "tp2": (2, "tensor", {"tensor_parallel_size": 2}),
    "pp2 x tp2": (4, "pipeline", {"microbatches": 2, "tensor_parallel_size": 2}),
}


def reference(family: str) -> dict[str, Any]:
    """One process, the same seed and batches."""
    return fit(build(family), strategy="auto", devices=1, steps=STEPS, shuffle=False, data=padded_loader())


def gaps(ranks: list[dict[str, Any]], ref: dict[str, Any]) -> tuple[float, float, str]:
    """(largest loss gap on any rank, largest final-weight gap of the ranks' merged weights, the parameter that has
    it) against one process."""
    losses = torch.tensor([rank["losses"] for rank in ranks])
    loss = float((losses - torch.tensor(ref["losses"])).abs().max())
    merged = {name: value for rank in ranks for name, value in rank["state"].items()}
    if merged.keys() != ref["state"].keys():
        raise RuntimeError(f"parameter names differ from one process's: {sorted(merged.keys() ^ ref['state'].keys())}")
    weight, worst = max((float((merged[name] - value).abs().max()), name) for name, value in ref["state"].items())
    return loss, weight, worst


def case(family: str, layout: str, ref: dict[str, Any]) -> dict[str, Any]:
    """One family under one layout: its gaps and what the strategy reported, or the line it stopped with."""
    devices, kind, strategy = LAYOUTS[layout]
    config = {"family": family, "devices": devices, "steps": STEPS, "kind": kind, "strategy": strategy}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = [rank[0] for rank in run_workers("families", devices, [config], Path(tmp), timeout=600)]
        except AssertionError:  # a rank failed: the line of its log that says why
            logs = [p.read_text() for p in sorted(Path(tmp).glob("rank*.log"))]
            lines = [one_line(log) for log in logs if "Error" in log]
            return {"outcome": "error", "line": (lines or ["no error printed"])[0], "s": time.perf_counter() - started}
    loss, weight, worst = gaps(ranks, ref)
    parallel = ranks[0]["parallel"]
    kept = parallel.get("replicated_why", {})
    return {
        "outcome": "exact" if loss < TOL and weight < TOL else "differs",
        "loss_gap": loss,
        "weight_gap": weight,
        "worst_parameter": worst,
        "plan_source": parallel.get("plan_source"),
        "sharded": len(parallel.get("sharded", {})),
        "kept_whole": {name: why for name, why in kept.items() if "tied" in why},
        "s": time.perf_counter() - started,
    }


def refused(line: str) -> bool:
    """A refusal before launch: one of our ValueErrors, with its fix."""
    return line.startswith("ValueError") and "HINT" in line


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Decoder families on padded text, {STEPS} AdamW steps, each against one process (tolerance {TOL:g}); "
        f"{machine()}.",
        "",
        "| family | transformers class | tied | layout | outcome | loss gap | weight gap | plan | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        outcome = "refused" if r["outcome"] == "error" and refused(r["line"]) else r["outcome"]
        gap = [f"{r[k]:.1e}" if k in r else "-" for k in ("loss_gap", "weight_gap")]
        plan = f"{r['plan_source']} ({r['sharded']} layers)" if r.get("plan_source") else "-"
        note = r.get("line", "") or "; ".join(f"{n} whole: {why}" for n, why in r.get("kept_whole", {}).items())
        lines.append(
            f"| {r['family']} | {r['model_class']} | {r['tied']} | {r['layout']} | {outcome} | {gap[0]} | {gap[1]} | "
            f"{plan} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="comma-separated families to rerun (their rows replace the saved ones)")
    args = parser.parse_args()
    families = args.only.split(",") if args.only else list(FAMILIES)
    saved = RESULTS / "families.json"
    previous = json.loads(saved.read_text())["rows"] if args.only and saved.exists() else []
    rows = [r for r in previous if r["family"] not in families]
    started = time.perf_counter()
    for family in families:
        ref = reference(family)
        model = build(family).model
        tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
        for layout in LAYOUTS:
            row = {"family": family, "model_class": type(model).__name__, "tied": tied, "layout": layout}
            row.update(case(family, layout, ref))
            print(json.dumps(row), flush=True)
            rows.append(row)
        order = list(FAMILIES)  # written after every family: a run stopped early keeps what it measured
        rows.sort(key=lambda r: (order.index(r["family"]), list(LAYOUTS).index(r["layout"])))
        report = {"machine": machine(), "steps": STEPS, "tolerance": TOL, "rows": rows}
        write_results("families", report, table(rows), time.perf_counter() - started, show=False)


if __name__ == "__main__":
    torch.set_num_threads(1)
    quiet()
    main()
