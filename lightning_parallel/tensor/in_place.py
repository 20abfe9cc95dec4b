"""Where a model's own code changes a row-parallel projection's output in place, known by class name (transformers
is never imported): that projection takes "rowwise_own_output", whose output is a tensor of its own, and every other
row-parallel projection keeps torch's output (a view, no copy). It shards nothing and finds no other plan.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["OWN_OUTPUT", "changed_in_place", "row_style"]

OWN_OUTPUT = "rowwise_own_output"
# class name -> the module, by its name under that class, whose output the class's forward changes in place (through
# the modules between, which hand it on as is): Falcon's decoder layer adds its attention's output to its MLP's,
# `mlp_output += attention_output`, and FalconMLP returns its down projection's output
CHANGES_OUTPUT_OF: dict[str, str] = {"FalconDecoderLayer": "mlp.dense_4h_to_h"}


def changed_in_place(modules: Mapping[str, nn.Module], name: str) -> str | None:
    """The class of the module whose forward changes module `name`'s output in place, or None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        owner = modules.get(".".join(parts[:cut]))
        if owner is not None and CHANGES_OUTPUT_OF.get(type(owner).__name__) == ".".join(parts[cut:]):
            return type(owner).__name__
    return None


def row_style(modules: Mapping[str, nn.Module], name: str) -> str:
    """The row-parallel style for projection `name`: "rowwise", or "rowwise_own_output" where its output is changed
    in place."""
    return OWN_OUTPUT if changed_in_place(modules, name) else "rowwise"
