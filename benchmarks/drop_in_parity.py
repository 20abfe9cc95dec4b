"""Drop-in parity table: user-written modules (tests/user_modules.py: the tutorial CNN and four-Linear MLP with
their own forward, an nn.Sequential MLP; self.criterion, F.cross_entropy with metrics, a scaled loss) under the
pipeline and tensor-parallel strategies by registry name on 2 and 4 CPU processes, each against one process
(12 SGD steps, same seed, plain shuffle=False loaders). Writes results/drop_in_parity.{json,md}.
Usage: .venv/bin/python benchmarks/drop_in_parity.py  (~2 min)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from harness import ROOT, write_results

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "workers")]
from distributed import run_workers  # noqa: E402
from user_modules import build, fit  # noqa: E402

STEPS = 12
CASES = [  # (devices, strategy, network, training_step, strategy arguments, loader batch size)
    (2, "pipeline", "tutorial_cnn", "criterion", {"schedule": "1f1b"}, 16),
    (2, "pipeline", "tutorial_cnn", "criterion", {"schedule": "zbv"}, 16),
    (2, "pipeline", "tutorial_cnn", "criterion", {"schedule": "1f1b"}, 20),
    (2, "pipeline", "four_linear_mlp", "functional_with_metrics", {}, 16),
    (2, "pipeline", "sequential_mlp", "scaled", {}, 16),
    (2, "tensor_parallel", "tutorial_cnn", "criterion", {}, 16),
    (2, "tensor_parallel", "four_linear_mlp", "functional_with_metrics", {}, 16),
    (2, "tensor_parallel", "sequential_mlp", "criterion", {}, 16),
    (4, "pipeline", "tutorial_cnn", "criterion", {"schedule": "gpipe"}, 16),
    (4, "pipeline", "four_linear_mlp", "criterion", {"schedule": "1f1b"}, 16),
]


def main() -> None:
    rows = []
    for devices in (2, 4):
        cases = [case for case in CASES if case[0] == devices]
        configs = [
            {"strategy": s, "devices": d, "steps": STEPS, "net": n, "step": st, "kwargs": kw, "batch_size": b}
            for d, s, n, st, kw, b in cases
        ]
        with tempfile.TemporaryDirectory() as tmp:
            ranks = run_workers("drop_in", devices, configs, Path(tmp))
        for config, results in zip(configs, zip(*ranks, strict=True), strict=True):
            ref = fit(
                build(config["net"], config["step"]),
                strategy="auto",
                devices=1,
                steps=STEPS,
                shuffle=False,
                batch_size=config["batch_size"],
            )
            loss = max(abs(a - b) for r in results for a, b in zip(r["losses"], ref["losses"], strict=True))
            merged = {k: v for r in results for k, v in r["state"].items()}
            params = max((merged[k] - v).abs().max().item() for k, v in ref["state"].items())
            rows.append(
                {
                    **{k: config[k] for k in ("devices", "strategy", "net", "step", "kwargs", "batch_size")},
                    "max_loss_diff": loss,
                    "max_param_diff": params,
                }
            )
    lines = [
        "| devices | strategy | network | training_step | arguments | batch | max loss diff | max param diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['devices']} | {r['strategy']} | {r['net']} | {r['step']} | {r['kwargs'] or '-'} | "
            f"{r['batch_size']} | {r['max_loss_diff']:.1e} | {r['max_param_diff']:.1e} |"
        )
    write_results("drop_in_parity", rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
