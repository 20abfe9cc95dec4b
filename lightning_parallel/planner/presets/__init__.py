"""Hardware presets shipped inside the package (`hardware/<name>.yaml`), so `strategy=auto` works from an installed
wheel. The plan command reads the same files as its Hydra group `hardware` (search path
`pkg://lightning_parallel.planner.presets` in `conf/plan.yaml`); here they are read with PyYAML, without Hydra.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import yaml

from lightning_parallel.planner.hardware import Hardware, Network


class _Loader(yaml.SafeLoader):
    """Reads floats as YAML 1.2 (and OmegaConf) do: ``60.0e9`` without a sign in the exponent is a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def hardware_presets() -> list[str]:
    """Names of the shipped presets (``cpu``, ``h100``, ...)."""
    folder = resources.files(__name__) / "hardware"
    return sorted(entry.name.removesuffix(".yaml") for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def hardware_preset(name: str, *, memory: int | str | None = None) -> Hardware:
    """The ``Hardware`` of a shipped preset, with its memory per device replaced when ``memory`` is given.

    Raises:
        ValueError: An unknown preset; the message lists the known ones.
    """
    path = resources.files(__name__) / "hardware" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown hardware {name!r}. HINT: use one of {', '.join(hardware_presets())}")
    fields: dict[str, Any] = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # a SafeLoader
    fields.pop("_target_", None)  # Hydra's; the classes are known here
    network = {key: value for key, value in fields.pop("network", {}).items() if key != "_target_"}
    if memory is not None:
        fields["memory"] = memory
    return Hardware(**fields, network=Network(**network))
