"""Every option of every config group composes and instantiates; bad combinations fail early."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import CONF
from hydra.utils import instantiate

from train import ConfigError, build_model, build_strategy, check_config

GROUPS = ["model", "data", "strategy", "trainer", "callbacks", "logger", "experiment"]
IMAGE_DATA = "data=synthetic_images data.image_size=16 data.num_classes=10 data.num_samples=64"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    return path


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert options(group), f"conf/{group}/ is empty"


@pytest.mark.parametrize("option", options("model"))
def test_model_options_instantiate(compose_cfg, option: str) -> None:
    data = "data=synthetic_tokens" if option == "transformer" else IMAGE_DATA
    cfg = compose_cfg(f"model={option}", *data.split())
    check_config(cfg)
    hints = instantiate(cfg.data).model_hints
    with torch.device("meta"):  # ResNet-152 in 20 ms
        model = build_model(cfg, hints)
    assert type(model).__name__ == cfg.model._target_.rsplit(".", 1)[-1]


@pytest.mark.parametrize("option", options("data"))
def test_data_options_instantiate(compose_cfg, text_file: Path, option: str) -> None:
    cfg = compose_cfg(f"data={option}", *([f"data.path={text_file}"] if option == "text" else []))
    data = instantiate(cfg.data)
    assert data.kind in ("image", "tokens") and data.num_train_samples > 0


@pytest.mark.parametrize("option", options("strategy"))
def test_strategy_options_instantiate(compose_cfg, option: str) -> None:
    strategy = build_strategy(compose_cfg(f"strategy={option}"))
    assert type(strategy).__name__.endswith("Strategy")


@pytest.mark.parametrize("group", ["trainer", "callbacks", "logger"])
def test_trainer_side_options_instantiate(compose_cfg, group: str) -> None:
    for option in options(group):
        cfg = compose_cfg(f"{group}={option}")
        node = cfg[group]
        built = (
            [instantiate(n) for n in node.values() if n is not None]
            if group == "callbacks"
            else instantiate(node, **({"accelerator": "cpu"} if group == "trainer" else {}))
        )
        assert built is not None


@pytest.mark.parametrize("option", options("experiment"))
def test_experiments_compose(compose_cfg, option: str) -> None:
    cfg = compose_cfg(f"experiment={option}")
    check_config(cfg)


def test_incompatible_model_and_data_is_one_clear_line(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"GPT takes tokens input but the data gives image .*HINT"):
        check_config(compose_cfg("model=transformer", "data=digits"))


def test_zero_devices_rejected(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"trainer.devices=0.*HINT: trainer.devices=1"):
        check_config(compose_cfg("trainer.devices=0"))
