"""torch's `nn.Transformer` family under the strategies: Lightning's demo `LightningTransformer` (`nn.Transformer`,
a causal target mask) and a causal LM on `nn.TransformerEncoder` (causal and padding masks) pipeline on 2 stages
and match one device (losses and final weights within 1e-5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from distributed import run_workers

sys.path.insert(0, str(Path(__file__).parent))
from transformer_modules import build, loader  # noqa: E402
from user_modules import fit  # noqa: E402

STEPS = 4
TOL = 1e-5


def gaps(results: list[dict], ref: dict) -> tuple[float, float]:
    """(largest loss gap, largest weight gap) of every rank against one device; fails on an error."""
    for result in results:
        assert "error" not in result, result["error"]
        assert len(result["losses"]) == STEPS
    loss_gap = max(abs(a - b) for result in results for a, b in zip(result["losses"], ref["losses"], strict=True))
    merged = {name: value for result in results for name, value in result["state"].items()}
    assert merged.keys() == ref["state"].keys()
    return loss_gap, max(float((merged[name] - value).abs().max()) for name, value in ref["state"].items())


@pytest.mark.slow
def test_torch_transformer_modules_match_one_device(tmp_path: Path) -> None:
    names = ["demo", "encoder"]
    configs = [{"name": name, "strategy": "pipeline", "devices": 2, "steps": STEPS} for name in names]
    ranks = run_workers("torch_transformer", 2, configs, tmp_path)
    for index, config in enumerate(configs):
        ref = fit(build(config["name"]), strategy="auto", devices=1, steps=STEPS, shuffle=False,
                  data=loader(config["name"]))  # fmt: skip
        loss_gap, weight_gap = gaps([rank[index] for rank in ranks], ref)
        print(f"{config['name']} {config['strategy']}: loss gap {loss_gap:.1e}, weight gap {weight_gap:.1e}")
        assert loss_gap < TOL and weight_gap < TOL
