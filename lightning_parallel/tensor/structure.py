"""The structural tensor plan: attention and MLP layers recognised by the module tree (child names, module types,
in/out widths), for transformers that ship no plan and that torch.fx cannot trace (transformers' GPT-2, BERT, ViT).

Attention: q/k/v (separate, or a fused q | k | v split block by block) column-parallel with whole heads per rank, the
output projection row-parallel, the module's head counts made local ("local_heads"). MLP: the projections from the
hidden width to the intermediate width column-parallel, the one back row-parallel. It reads names and widths, not the
data flow (`pairing.py` follows an fx trace), and shards nothing: its plan is checked and applied like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_parallel.tensor.local_heads import local_attributes
from lightning_parallel.tensor.pairing import AutoPlan
from lightning_parallel.tensor.plans import HEAD_SIZES
from lightning_parallel.tensor.transposed_linear import Conv1D

__all__ = ["structural_plan"]

# Child names of separate query, key and value projections, per naming family.
QKV_NAMES = (
    ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("q_lin", "k_lin", "v_lin"),
    ("wq", "wk", "wv"),
)  # fmt: skip
# Fused projections whose output is q | k | v side by side (GPT-2's Conv1D `c_attn`).
FUSED_QKV_NAMES = ("c_attn",)
# Output projections of an attention module: a child of it, or `dense` inside its parent's `output` (BERT).
OUT_NAMES = ("o_proj", "out_proj", "c_proj", "proj", "o", "out_lin", "wo", "dense")
# Head counts an attention module may keep instead of a per-head size.
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads")


@dataclass(frozen=True)
class _Found:
    styles: dict[str, str]  # module name -> style
    why: dict[str, str]  # module name -> why it stays whole


def structural_plan(model: nn.Module, *, tensor_parallel_size: int, mlp_alone: bool = False) -> AutoPlan | None:
    """Attention and MLP layers found in `model`'s structure; None when it has no attention module to shard (then
    other planners are asked), or with `mlp_alone` (asked last, when no other planner answers) when it has no MLP
    either: its attention then stays whole (Falcon's, Bloom's fused per-head `query_key_value`, GPTBigCode's multi-query
    `c_attn`). Every other module with parameters stays whole, with the reason."""
    modules = dict(model.named_modules())
    attention = _attention(modules, tensor_parallel_size)
    taken = set(attention.styles) | set(attention.why)
    mlp = _mlp(modules, tensor_parallel_size, taken)
    if not attention.styles and not (mlp_alone and mlp.styles):
        return None
    styles = {**attention.styles, **mlp.styles}
    why = {**attention.why, **mlp.why}
    order = {name: index for index, name in enumerate(modules)}
    plan = dict(sorted(styles.items(), key=lambda item: order[item[0]]))
    for name, module in modules.items():
        if name not in plan and name not in why and any(True for _ in module.parameters(recurse=False)):
            why[name] = f"{type(module).__name__} is not an attention or MLP projection"
            if not attention.styles and _projection(module):
                why[name] += " (no q/k/v or q | k | v projection named as the structural plan knows was found)"
    return AutoPlan(plan=plan, replicated={name: why[name] for name in sorted(why, key=order.__getitem__)})


def _projection(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear | Conv1D)


def _width(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear or a Conv1D (weight stored (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return int(getattr(module, "nx")), int(getattr(module, "nf"))  # noqa: B009 - not attributes of nn.Module


def _attention(modules: dict[str, nn.Module], tp: int) -> _Found:
    styles: dict[str, str] = {}
    why: dict[str, str] = {}
    for name, module in modules.items():
        children = dict(module.named_children())
        separate = [list(names) for names in QKV_NAMES if all(_projection(children.get(n)) for n in names)]
        fused = [[n] for n in FUSED_QKV_NAMES if _projection(children.get(n))]
        if not separate + fused:
            continue
        inputs = (separate + fused)[0]
        found = _plan_attention(name, module, modules, inputs, tp)
        members = [_join(name, n) for n in inputs]
        if isinstance(found, str):
            why.update(dict.fromkeys(members, found))
        else:
            styles.update(found)
    return _Found(styles, why)


def _plan_attention(
    name: str, module: nn.Module, modules: dict[str, nn.Module], inputs: list[str], tp: int
) -> dict[str, str] | str:
    """The styles of one attention module's projections and of itself, or why it stays whole."""
    children = dict(module.named_children())
    fused = len(inputs) == 1
    (width_in, q_out), *others = [_width(children[n]) for n in inputs]
    if fused and q_out != 3 * width_in:
        return f"{inputs[0]} has {q_out} output features, not q | k | v of {width_in} each"
    q_out = q_out // 3 if fused else q_out
    head = _head_size(module, q_out)
    if head is None:
        return f"{type(module).__name__} keeps no head size ({', '.join(HEAD_SIZES)}) or head count"
    for features in [q_out, *(out for _, out in others)]:
        if features % head or (features // head) % tp:
            return f"{features // head} heads of {head} features are not divisible by tensor_parallel_size {tp}"
    out = _output_projection(name, module, modules, q_out, set(inputs))
    if out is None:
        return f"no output projection ({', '.join(OUT_NAMES)}) takes its {q_out} features"
    extra = [n for n, child in children.items() if _projection(child) and n not in inputs and _join(name, n) != out]
    if extra:
        return f"{type(module).__name__} has other projections too ({', '.join(extra)})"
    sizes = local_attributes(module)
    if any(value % tp for value in sizes.values()):
        return f"its {sizes} are not all divisible by tensor_parallel_size {tp}"
    styles = {_join(name, n): "qkv_colwise" if fused else "colwise" for n in inputs}
    styles[out] = "rowwise"
    if sizes:  # the module keeps global head counts or widths: make them this rank's
        styles[name] = "local_heads"
    return styles


def _head_size(module: nn.Module, q_out: int) -> int | None:
    size = next((v for key in HEAD_SIZES if isinstance(v := getattr(module, key, None), int) and v > 0), None)
    if size is not None:
        return size
    heads = next((v for key in HEAD_COUNTS if isinstance(v := getattr(module, key, None), int) and v > 0), None)
    return q_out // heads if heads and q_out % heads == 0 else None


def _output_projection(
    name: str, module: nn.Module, modules: dict[str, nn.Module], q_out: int, inputs: set[str]
) -> str | None:
    """The projection taking the attention's q_out features: a child of it, or `<parent>.output.dense` (BERT)."""
    for child_name, child in module.named_children():
        if child_name in OUT_NAMES and child_name not in inputs and _projection(child) and _width(child)[0] == q_out:
            return _join(name, child_name)
    parent = name.rpartition(".")[0]
    dense = modules.get(_join(parent, "output.dense")) if "." in name else None
    return _join(parent, "output.dense") if _projection(dense) and _width(dense)[0] == q_out else None  # type: ignore[arg-type]


def _mlp(modules: dict[str, nn.Module], tp: int, taken: set[str]) -> _Found:
    """Up (and gate) projections hidden -> intermediate and the one down projection back, inside one module
    (`mlp.c_fc` / `mlp.c_proj`, `mlp.up_proj` / `mlp.down_proj`) or as `intermediate.dense` / `output.dense` (BERT)."""
    styles: dict[str, str] = {}
    why: dict[str, str] = {}
    for name, module in modules.items():
        children = {_join(name, n): c for n, c in module.named_children() if _projection(c)}
        if "intermediate" in dict(module.named_children()):
            children = {
                _join(name, n): modules[_join(name, n)]
                for n in ("intermediate.dense", "output.dense")
                if _projection(modules.get(_join(name, n)))
            }
        pair = _up_down({n: c for n, c in children.items() if n not in taken})
        if pair is None:
            continue
        ups, down = pair
        intermediate = _width(children[down])[0]
        if intermediate % tp:
            why.update(dict.fromkeys([*ups, down], f"intermediate width {intermediate} not divisible by {tp}"))
            continue
        styles.update({**dict.fromkeys(ups, "colwise"), down: "rowwise"})
    return _Found(styles, why)


def _up_down(projections: dict[str, nn.Module]) -> tuple[list[str], str] | None:
    """(up projections, the down projection) when `projections`, in registration order, are one or two hidden ->
    intermediate (up, or gate and up) and last the one intermediate -> hidden, the two widths different."""
    if not 2 <= len(projections) <= 3:
        return None
    *ups, down = projections
    intermediate, hidden = _width(projections[down])
    if intermediate == hidden or any(_width(projections[up]) != (hidden, intermediate) for up in ups):
        return None
    return ups, down


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child
