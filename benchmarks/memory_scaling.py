"""Memory scaling: a ladder of GPTs trained by train.py at pp2 x tp2 and in one process, per-rank model state
(parameters, gradients, AdamW state), set-up peak parameter bytes and peak RSS, against what one process needs.
Writes results/memory_scaling.{json,md}. Usage: .venv/bin/python benchmarks/memory_scaling.py [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch
from harness import machine, write_results
from memory_by_strategy import DATA, MODELS, RUN, STATE_KEYS, Layout, MiB, mib_span, run_train, train_overrides

from lightning_parallel.models import GPT

GiB = 2**30
SIZES = [(8, 512), (8, 1024), (8, 1792)]  # (depth, width), heads = width / 64; about 25M, 100M and 310M parameters
VOCAB = CONTEXT = 32  # conf/data/synthetic_tokens.yaml: vocab_size and seq_len
LAYOUTS = {"pp2 x tp2": Layout(dp=1, pp=2, tp=2, schedule="1f1b", microbatches=4), "single": Layout(dp=1)}
# Largest summed peak RSS a run may be predicted to need: pp2 x tp2 is the subject (its 4 processes together);
# one process is run where it fits on this 24 GiB machine shared with other work
BUDGET = {"pp2 x tp2": 10 * GiB, "single": 12 * GiB}
BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and AdamW's two moments


def model_overrides(depth: int, width: int) -> list[str]:
    return ["model=transformer", f"model.depth={depth}", f"model.width={width}", f"model.heads={width // 64}"]


def count_parameters(depth: int, width: int) -> int:
    with torch.device("meta"):  # the head count does not change the parameters
        gpt = GPT(vocab_size=VOCAB, context_length=CONTEXT, depth=depth, width=width, heads=1)
    return sum(p.numel() for p in gpt.parameters())


def extrapolate(points: list[tuple[int, int]], parameters: int) -> float | None:
    """Summed peak RSS at `parameters`, on the line through the two largest measured (parameters, RSS) points."""
    if len(points) < 2:
        return None
    (n0, r0), (n1, r1) = sorted(points)[-2:]
    return r1 + (r1 - r0) / (n1 - n0) * (parameters - n1)


def run_layout(name: str, model: list[str], steps: int, tiny: dict[str, Any]) -> dict[str, Any]:
    """One train.py run of the layout; model state, set-up peak and RSS per rank, less the tiny run's RSS."""
    summary = run_train(model, train_overrides(LAYOUTS[name]), steps)
    if "error" in summary:
        print(f"  {name} FAILED: {summary['error']}", flush=True)
        return summary
    keys = (*STATE_KEYS, "parameter_bytes_peak_setup_per_rank", "peak_memory_bytes", "parameters", "run_s")
    row = {key: summary[key] for key in keys}
    row["model_state_bytes_per_rank"] = [sum(v) for v in zip(*(summary[k] for k in STATE_KEYS), strict=True)]
    pairs = zip(summary["peak_memory_bytes"], tiny["peak_memory_bytes"], strict=True)
    row["added_bytes_per_rank"] = [big - small for big, small in pairs]
    print(f"  {name}: model state {mib_span(row['model_state_bytes_per_rank'])} MiB, peak RSS "
          f"{mib_span(row['peak_memory_bytes'])} MiB ({summary['run_s']:.0f} s)", flush=True)  # fmt: skip
    return row


def measure_size(depth: int, width: int, steps: int, tiny: dict[str, Any], points: dict[str, list]) -> dict[str, Any]:
    """Both layouts for one GPT, each unless its summed peak RSS, predicted from the smaller sizes, is over budget."""
    parameters = count_parameters(depth, width)
    model = model_overrides(depth, width)
    print(f"{' '.join(model)}: {parameters:,} parameters", flush=True)
    size: dict[str, Any] = {"depth": depth, "width": width, "heads": width // 64, "parameters": parameters}
    size["one_process_model_state_bytes"] = BYTES_PER_PARAMETER * parameters
    for name in LAYOUTS:
        predicted = extrapolate(points[name], parameters)
        size[f"{name} predicted_rss_bytes"] = predicted
        if predicted is not None and predicted > BUDGET[name]:
            size[name] = {"skipped": f"predicted {predicted / GiB:.1f} GiB > {BUDGET[name] / GiB:.0f} GiB budget"}
            print(f"  {name}: skipped, {size[name]['skipped']}", flush=True)
            continue
        size[name] = run_layout(name, model, steps, tiny[name])
        if "peak_memory_bytes" in size[name]:
            points[name].append((parameters, sum(size[name]["peak_memory_bytes"])))
    return size


# ---- report --------------------------------------------------------------------------------------------------------
def ideal_bytes(size: dict[str, Any]) -> float:
    """A pp2 x tp2 rank's share of the fp32 parameters."""
    return 4 * size["parameters"] / (LAYOUTS["pp2 x tp2"].pp * LAYOUTS["pp2 x tp2"].tp)


def span_and_top(values: list[float]) -> str:
    """The fullest rank, then the range when the ranks differ: ``96.4 (96.1-96.4)``."""
    span = mib_span(values)
    return span if "-" not in span else f"{max(values) / MiB:,.1f} ({span})"


def one_process_row(s: dict[str, Any]) -> str:
    single, need = s["single"], s["one_process_model_state_bytes"]
    head = f"| {s['label']} | {s['parameters']:,} | {need / MiB:,.1f} ({need / GiB:.2f} GiB) | "
    predicted = s["single predicted_rss_bytes"]
    predicted_text = f"{predicted / MiB:,.0f}" if predicted else "-"
    if "peak_memory_bytes" not in single:
        return head + f"{predicted_text} | {single.get('skipped') or single.get('error')} | | | |"
    state, added = single["model_state_bytes_per_rank"][0], single["added_bytes_per_rank"][0]
    measured = (state, single["peak_memory_bytes"][0], added, added - state)
    return head + f"{predicted_text} | " + " | ".join(f"{v / MiB:,.1f}" for v in measured) + " |"


def sharded_row(s: dict[str, Any]) -> str:
    row = s["pp2 x tp2"]
    predicted = s["pp2 x tp2 predicted_rss_bytes"]
    head = f"| {s['label']} | {predicted / MiB:,.0f} | " if predicted else f"| {s['label']} | - | "
    if "peak_memory_bytes" not in row:
        return head + f"{row.get('skipped') or row.get('error')} |" + " |" * 9
    state, added = row["model_state_bytes_per_rank"], row["added_bytes_per_rank"]
    single = s["single"].get("model_state_bytes_per_rank", [s["one_process_model_state_bytes"]])[0]
    ideal = ideal_bytes(s)
    setup = max(row["parameter_bytes_peak_setup_per_rank"])
    rest = [a - m for a, m in zip(added, state, strict=True)]
    return (
        head
        + " | ".join(span_and_top(row[k]) for k in STATE_KEYS)
        + f" | {span_and_top(state)} | **{max(state) / single:.3f}** | {setup / MiB:,.1f} / {ideal / MiB:,.1f} = "
        f"**{setup / ideal:.2f}** | {span_and_top(row['peak_memory_bytes'])} | "
        f"{sum(row['peak_memory_bytes']) / MiB:,.0f} | {span_and_top(added)} | {span_and_top(rest)} |"
    )


def largest_within(points: list[tuple[int, int]], budget: float) -> float:
    """Parameters at which the line through the two largest measured runs reaches `budget`."""
    (n0, r0), (n1, r1) = sorted(points)[-2:]
    return n1 + (budget - r1) * (n1 - n0) / (r1 - r0)


def notes(sizes: list[dict[str, Any]], tiny: dict[str, Any], points: dict[str, list]) -> list[str]:
    """What the tables show, in numbers taken from them."""
    sharded = [s for s in sizes if "peak_memory_bytes" in s["pp2 x tp2"]]
    both = [s for s in sharded if "peak_memory_bytes" in s["single"]]
    found = ["## Notes", ""]
    if not sharded:
        return found + ["- No pp2 x tp2 run finished."]
    ratios = [max(s["pp2 x tp2"]["model_state_bytes_per_rank"]) / s["one_process_model_state_bytes"] for s in sharded]
    setup = [max(s["pp2 x tp2"]["parameter_bytes_peak_setup_per_rank"]) / ideal_bytes(s) for s in sharded]
    found.append(
        f"- Model state shards as designed: the fullest rank holds {min(ratios):.3f}-{max(ratios):.3f} of one "
        f"process's {BYTES_PER_PARAMETER} bytes per parameter, and at most {max(setup):.2f} x its share while "
        "materialising and sharding its part (target <= 1.15), at every size."
    )
    for s in both[-1:]:
        pp, single = s["pp2 x tp2"], s["single"]
        rss, total = max(pp["peak_memory_bytes"]), sum(pp["peak_memory_bytes"])
        rest = max(a - m for a, m in zip(pp["added_bytes_per_rank"], pp["model_state_bytes_per_rank"], strict=True))
        single_rest = single["added_bytes_per_rank"][0] - single["model_state_bytes_per_rank"][0]
        one = single["peak_memory_bytes"][0]
        found.append(
            f"- Peak RSS shards less well ({s['label']}): the fullest rank's is {rss / one:.2f} x one process's, not "
            f"0.25: each of the 4 processes carries the framework's own "
            f"{min(tiny['pp2 x tp2']['peak_memory_bytes']) / MiB:,.0f} MiB (the tiny run), and its rest is "
            f"{rest / MiB:,.0f} MiB against one process's {single_rest / MiB:,.0f} MiB for 4 x the model state. "
            f"Summed over the ranks, pp2 x tp2 holds {total / one:.2f} x what one process does: on one machine it "
            "costs memory; it pays where each rank has its own device."
        )
    if all(len(p) >= 2 for p in points.values()):
        found.append(
            "- Largest GPT within budget, extrapolating the two largest runs: "
            + ", ".join(
                f"{name} ~{largest_within(points[name], BUDGET[name]) / 1e6:,.0f}M parameters "
                f"({BUDGET[name] / GiB:.0f} GiB)"
                for name in LAYOUTS
            )
            + "."
        )
    errors = [
        sum(s[name]["peak_memory_bytes"]) / s[f"{name} predicted_rss_bytes"] - 1
        for s in sizes
        for name in LAYOUTS
        if "peak_memory_bytes" in s[name] and s[f"{name} predicted_rss_bytes"]
    ]
    if errors:
        found.append(f"- Predicted summed peak RSS was within {max(map(abs, errors)):.1%} of the measured one.")
    found.append(
        "- A few steps only: RSS may still grow in a longer run, so these peaks are lower bounds; the sum over ranks "
        "is an upper bound on what the 4 processes held at one moment."
    )
    return found


def write_report(result: dict[str, Any]) -> None:
    saved = copy.deepcopy(result)  # the JSON as measured, without the labels added here for the tables
    sizes = result["sizes"]
    for s in sizes:
        s["label"] = f"d{s['depth']} w{s['width']} h{s['heads']}"
    tiny = result["tiny"]
    lines = [
        "# Memory scaling: pp2 x tp2 vs one process",
        "",
        f"`benchmarks/memory_scaling.py --steps {result['steps']}`, {result['when']}, {result['machine']}; "
        f"{result['wall_s'] / 60:.1f} min. One `train.py` run per GPT and layout: "
        f"`train.py model=transformer model.depth=D model.width=W model.heads=W/64 {' '.join(DATA)} <layout> "
        f"{' '.join(RUN)} trainer.limit_train_batches={result['steps']}` (fp32, AdamW as in `conf/train.yaml`; CPU, "
        f"gloo, one thread per process), with `<layout>` = `{' '.join(result['overrides']['pp2 x tp2'])}` "
        f"(**pp2 x tp2**, 4 processes) or `{' '.join(result['overrides']['single'])}` (**one process**).",
        "",
        "- **model state**: summary.json's `parameter_bytes_per_rank` + `gradient_bytes_per_rank` + "
        "`optimizer_state_bytes_per_rank` (the tensors a rank holds after the last step, DTensor shards counted "
        f"locally). **one process needs**: {BYTES_PER_PARAMETER} bytes per parameter (fp32 weight, gradient, two "
        "AdamW moments). Per-rank columns show the fullest rank, then the range when ranks differ.",
        "- **set-up peak / ideal**: the most parameter bytes the fullest rank held while its part was materialised "
        "and sharded (`parameter_bytes_peak_setup_per_rank`) over 4 bytes x parameters / (pp x tp). Target <= 1.15.",
        "- **peak RSS**: summary.json's `peak_memory_bytes` (each process's `ru_maxrss`); **sum** over the 4 ranks "
        "bounds what the run held at once from above (peaks need not coincide; shared library pages count in each). "
        "**added by training**: peak RSS minus that of the same layout with a tiny GPT (`"
        + " ".join(MODELS["tiny"][1:])
        + f"`: {mib_span(tiny['single']['peak_memory_bytes'])} MiB one process, "
        f"{mib_span(tiny['pp2 x tp2']['peak_memory_bytes'])} MiB per pp2 x tp2 rank: Python, torch, Lightning, "
        "gloo); **rest** = added - model state (activations, temporaries, allocator slack).",
        "- **predicted**: summed peak RSS on the line through the two largest smaller runs of the layout (the tiny "
        "run included) before the run; a run predicted over "
        + ", ".join(f"{v / GiB:.0f} GiB ({k})" for k, v in BUDGET.items())
        + " is skipped.",
        "",
        "## One process",
        "",
        "| GPT | parameters | one process needs: model state MiB | predicted peak RSS MiB | measured model state "
        "MiB | peak RSS MiB | added by training MiB | rest MiB |",
        "|---|---|---|---|---|---|---|---|",
        *(one_process_row(s) for s in sizes),
        "",
        "## pp2 x tp2, per rank",
        "",
        "| GPT | predicted sum of peak RSS MiB | params MiB | grads MiB | optimizer MiB | model state MiB | "
        "fullest vs one process | set-up peak / ideal MiB | peak RSS MiB | sum of peak RSS MiB | "
        "added by training MiB | rest MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(sharded_row(s) for s in sizes),
        "",
        *notes(sizes, tiny, result["summed_rss_points"]),
    ]
    write_results("memory_scaling", saved, "\n".join(lines) + "\n", result["wall_s"], indent=2, show=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--quick", action="store_true", help="the smallest GPT only (a smoke run)")
    args = parser.parse_args()
    started = time.perf_counter()
    tiny_sizes = dict(override.split("=") for override in MODELS["tiny"][1:])
    tiny_parameters = count_parameters(int(tiny_sizes["model.depth"]), int(tiny_sizes["model.width"]))
    print("tiny GPT (framework baseline per layout)", flush=True)
    tiny = {name: run_train(MODELS["tiny"], train_overrides(layout), args.steps) for name, layout in LAYOUTS.items()}
    failed = {name: run["error"] for name, run in tiny.items() if "error" in run}
    if failed:
        raise SystemExit(f"tiny-model runs failed: {failed}")
    points = {name: [(tiny_parameters, sum(run["peak_memory_bytes"]))] for name, run in tiny.items()}
    ladder = SIZES[:1] if args.quick else SIZES
    sizes = [measure_size(depth, width, args.steps, tiny, points) for depth, width in ladder]
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "steps": args.steps, "data": DATA, "run": RUN,
        "overrides": {name: train_overrides(layout) for name, layout in LAYOUTS.items()},
        "budget_bytes": BUDGET,
        "tiny": {name: {"peak_memory_bytes": r["peak_memory_bytes"]} for name, r in tiny.items()},
        "summed_rss_points": points, "sizes": sizes, "wall_s": time.perf_counter() - started,
    }  # fmt: skip
    write_report(result)


if __name__ == "__main__":
    main()
