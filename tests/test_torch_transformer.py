"""torch's `nn.Transformer` family under the strategies: Lightning's demo `LightningTransformer` (`nn.Transformer`,
a causal target mask) and a causal LM on `nn.TransformerEncoder` (causal and padding masks) pipeline on 2 stages and
train at tensor_parallel_size 2 (the automatic plan: each layer's linear1 / linear2, attention whole), matching one
device (losses and final weights within 1e-5); sharding inside an nn.MultiheadAttention is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
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
    configs = [
        {"name": name, "strategy": strategy, "devices": 2, "steps": STEPS}
        for strategy in ("pipeline", "tensor_parallel")
        for name in names
    ]
    ranks = run_workers("torch_transformer", 2, configs, tmp_path)
    for index, config in enumerate(configs):
        ref = fit(build(config["name"]), strategy="auto", devices=1, steps=STEPS, shuffle=False,
                  data=loader(config["name"]))  # fmt: skip
        results = [rank[index] for rank in ranks]
        loss_gap, weight_gap = gaps(results, ref)
        print(f"{config['name']} {config['strategy']}: loss gap {loss_gap:.1e}, weight gap {weight_gap:.1e}")
        assert loss_gap < TOL and weight_gap < TOL
        if config["strategy"] == "tensor_parallel":  # the plan was applied: every feed-forward pair sharded
            layers = 4 if config["name"] == "demo" else 3
            assert len(results[0]["sharded"]) == 4 * layers, results[0]["sharded"]
            assert all(".linear1." in name or ".linear2." in name for name in results[0]["sharded"])


def test_a_plan_sharding_inside_multihead_attention_is_one_line() -> None:
    from lightning_parallel.parallelize.plan import resolve_plan

    network = build("encoder").model
    plan = {"encoder.layers.*.self_attn.out_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"inside the nn\.MultiheadAttention encoder\.layers\.0\.self_attn") as error:
        resolve_plan(network, plan, tensor_parallel_size=2, sequence_parallel=False)
    assert "HINT: leave encoder.layers.0.self_attn whole" in str(error.value) and "\n" not in str(error.value)


class CpuMask(torch.nn.Module):
    """A TransformerEncoder whose causal mask is made on the CPU, whatever the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(8, 8)
        layer = torch.nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=8, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(ids.size(1))
        return self.encoder(self.embedding(ids), mask=mask)


def test_a_mask_made_on_a_fixed_device_is_named_in_one_line() -> None:
    from lightning_parallel.pipeline.call import network_call
    from lightning_parallel.pipeline.traced import TracedNetwork

    network = CpuMask()
    call, flat = network_call(network, (torch.zeros(2, 4, dtype=torch.long),), {})
    with pytest.raises(ValueError, match="makes a tensor on a fixed device") as error:
        TracedNetwork(network, flat, call)
    message = str(error.value)
    assert "test_torch_transformer.py" in message and "mask=mask" in message and "device=x.device" in message
    assert "\n" not in message


def test_masks_are_taken_as_given_only_while_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nn.modules import transformer

    from lightning_parallel import seams

    causal = torch.nn.Transformer.generate_square_subsequent_mask(4)
    detect = transformer._detect_is_causal_mask
    assert detect(causal) is True  # torch compares the mask's values: a branch on data
    with seams.transformer_masks_as_given():
        assert transformer._detect_is_causal_mask(causal) is False  # taken as given: the mask still applies
        assert transformer._detect_is_causal_mask(causal, True) is True  # the caller's is_causal is kept
        assert not torch.backends.mha.get_fastpath_enabled()
    assert transformer._detect_is_causal_mask is detect and torch.backends.mha.get_fastpath_enabled()
    monkeypatch.setattr(transformer, "_detect_is_causal_mask", lambda mask, is_causal=None: False)
    with pytest.raises(seams.SeamChanged, match="_detect_is_causal_mask"), seams.transformer_masks_as_given():
        pass
