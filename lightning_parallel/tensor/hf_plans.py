"""A `transformers` model's own tensor plan in our style names: composed as transformers composes it (the class's
`_tp_plan`, its base model's `config.base_model_tp_plan` under the base model's attribute name) and translated with the
style table's `transformers` names (`styles.STYLE_TRAITS`). A style no row runs (mixture-of-experts, latent attention)
is one line naming the module and the style. It never imports transformers: a model is recognised by class name.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_parallel.tensor.plans import matches
from lightning_parallel.tensor.styles import STYLE_TRAITS, TRANSFORMERS_REFUSED

__all__ = ["TRANSFORMERS_STYLES", "compose_plan", "is_transformers_model", "transformers_plan"]

# transformers' style name -> the row that runs it (read from the one style table)
TRANSFORMERS_STYLES: dict[str, str] = {name: row.name for row in STYLE_TRAITS.values() for name in row.transformers}


def is_transformers_model(network: nn.Module) -> bool:
    """Whether `network` is a transformers `PreTrainedModel` (by class name: transformers is never imported)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(network).__mro__)


def compose_plan(model: nn.Module) -> dict[str, str]:
    """The full plan in transformers' words, as transformers 5 composes it (`init_parallel_plans`): the class's
    `_tp_plan`; for a base model, `config.base_model_tp_plan` and its input embeddings over the vocabulary; each
    child's own plan under the child's name."""
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    if getattr(model, "base_model", None) is model:
        plan.update(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})
        if plan and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
            plan = {"embed_tokens": "embedding_rowwise", **plan}
    for name, child in model.named_children():
        if is_transformers_model(child):
            plan.update({f"{name}.{key}": style for key, style in compose_plan(child).items()})
    return plan


def transformers_plan(network: nn.Module) -> dict[str, str] | None:
    """`network`'s own plan translated to our style names, patterns that match no module left out (transformers only
    warns about those); None when `network` is not a transformers model.

    Raises:
        ValueError: A style no row of ours runs, or an entry naming a parameter rather than a module; one line.
    """
    if not is_transformers_model(network):
        return None
    own = getattr(network, "tp_plan", None)  # transformers >= 5 keeps the composed plan on the instance
    plan = dict(own) if isinstance(own, Mapping) else compose_plan(network)
    modules = [name for name, _ in network.named_modules() if name]
    parameters = [name for name, _ in network.named_parameters()]
    where = f"{type(network).__name__}.tp_plan"
    translated: dict[str, str] = {}
    for pattern, style in plan.items():
        named = next((name for name in modules if matches(pattern, name)), None)
        if named is None and not any(matches(pattern, name) for name in parameters):
            continue
        if style not in TRANSFORMERS_STYLES:
            why = TRANSFORMERS_REFUSED.get(style, "it is not a transformers style this library knows")
            raise ValueError(
                f"{where} maps {named or pattern} to transformers' style {style!r}, which lightning_parallel cannot "
                f"run yet ({why}). HINT: pass plan={{...}} with our styles for the layers to shard (see "
                "lightning_parallel.tensor.STYLES), or plan='auto'"
            )
        if named is None:
            raise ValueError(
                f"{where} maps the parameter {pattern!r} to {style!r}; our plans shard modules. HINT: pass "
                "plan={...} naming modules, or plan='auto'"
            )
        translated[pattern] = TRANSFORMERS_STYLES[style]
        if translated[pattern] == "colwise_gather" and named == _output_embeddings(network):
            translated[pattern] = "vocab_head"  # the LM head: a step's cross-entropy reads its logits sharded
    return translated


def _output_embeddings(network: nn.Module) -> str | None:
    """The qualified name of the model's LM head (`get_output_embeddings()`), if it has one."""
    get = getattr(network, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((name for name, module in network.named_modules() if module is head), None) if head else None
