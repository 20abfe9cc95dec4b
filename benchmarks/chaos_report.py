"""chaos.py's report: what a chaos run cost against the straight one (restarts, resumes, steps and wall time lost,
final loss and weights), and the markdown table with how to read it. It runs nothing.
"""

from __future__ import annotations

from typing import Any


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
