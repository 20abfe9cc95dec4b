"""Name-keyed weight initialisation and materialisation: each module's random draws depend only on (seed, its
qualified name), so a pipeline stage that materialises a few blocks of a meta-device model, or a tensor rank
that materialises one layer at a time and shards it at once, gets exactly the weights one process would build.
Which distribution to draw from stays each model's own choice. Torch only: no process groups here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from lightning_parallel.one_process_ranks import local_part


def init_by_name(root: nn.Module, init_module: Callable[[nn.Module], None], *, seed: int | None = None) -> None:
    """Run ``init_module`` on every submodule that directly owns parameters or buffers.

    Each call runs with the global RNG seeded from ``(seed, qualified module name)``, so the result does not
    depend on which other modules exist or in which order they were built. The caller's RNG state is restored
    afterwards. Modules still on the meta device are skipped: there is nothing to fill in yet.

    Values are reproducible per device type: a block initialised on CPU equals the same block of a full model
    initialised on CPU. To match a CPU-built model on an accelerator, initialise on CPU and move.

    Args:
        root: The model; names are relative to it, as in ``root.named_modules()``.
        init_module: Fills the direct parameters and buffers of one module in place, drawing from the global RNG.
        seed: Base seed. ``None`` means ``torch.initial_seed()``, i.e. what ``torch.manual_seed`` last set.
    """
    base = torch.initial_seed() if seed is None else seed
    only = _ONLY.get()
    if only is not None:
        only.called = True
    for name, module in root.named_modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not tensors or any(t.is_meta for t in tensors) or (only is not None and id(module) not in only.ids):
            continue
        with _seeded_rng(tensors[0].device, _name_seed(base, name)), torch.no_grad():
            init_module(module)


class _Only:
    """The modules `init_by_name` may initialise while a part is materialised, and whether it ran at all."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.ids = {id(m) for m in modules}
        self.called = False


_ONLY: ContextVar[_Only | None] = ContextVar("init_by_name_only", default=None)


@contextmanager
def _initialising_only(modules: Sequence[nn.Module]) -> Iterator[_Only]:
    only = _Only(modules)
    token = _ONLY.set(only)
    try:
        yield only
    finally:
        _ONLY.reset(token)


def init_default(module: nn.Module) -> None:
    """PyTorch's own default initialisation: ``module.reset_parameters()`` (BatchNorm also resets its stats).

    Raises:
        RuntimeError: If the module has no ``reset_parameters``; its tensors would stay uninitialised after
            ``to_empty``.
    """
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise RuntimeError(
            f"{type(module).__name__} owns parameters or buffers but has no reset_parameters(). "
            "HINT: handle this module type explicitly in the model's per-module init function."
        )
    reset()


def _name_seed(seed: int, name: str) -> int:
    # Python's hash() is salted per process; a digest is stable across ranks and runs. 64 well-mixed bits
    # matter because the CPU generator keeps only the low 32 bits of its seed.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@contextmanager
def _seeded_rng(device: torch.device, seed: int) -> Iterator[None]:
    # torch.manual_seed would also reseed every accelerator without restoring it, so seed only the
    # generators that are forked here: CPU always, plus the one accelerator the module lives on.
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    device_mod = torch.get_device_module(device.type)
    index = device.index if device.index is not None else device_mod.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type), device_mod.device(index):
        torch.default_generator.manual_seed(seed)
        device_mod.manual_seed(seed)
        yield


def materialize(network: nn.Module, device: torch.device) -> None:
    """Give meta-device parameters real storage and name-keyed initial values; move the rest.

    The network's own `init_weights()` decides the values when it has one; otherwise every module's
    `reset_parameters()` (PyTorch's default initialisation) runs, seeded by its name, so each stage of a split
    gets the same values on any layout.
    """
    on_meta = any(t.is_meta for t in [*network.parameters(), *network.buffers()])
    if not on_meta:
        network.to(device)
        return
    check_resettable(network)
    network.to_empty(device=device)
    _initialise(network)


def materialize_in_parts(
    network: nn.Module, device: torch.device, parts: Sequence[str], after_each: Callable[[str], None]
) -> int:
    """Materialise `network` one named part at a time, calling `after_each(name)` (e.g. sharding it) before the
    next part gets storage; everything else last. Returns the most parameter bytes this process held on the way.

    Values are the ones `materialize` gives: the network's `init_weights()` (or every module's
    `reset_parameters()`) restricted to the part, which holds when that initialisation is name-keyed
    (`init_by_name`). An `init_weights()` that does not go through `init_by_name` cannot be restricted: the
    network is then materialised whole and every part handed to `after_each` afterwards.
    """
    if not any(t.is_meta for t in [*network.parameters(), *network.buffers()]):
        network.to(device)
        peak = parameter_bytes(network)
        for name in parts:
            after_each(name)
        return peak
    check_resettable(network)
    peak = 0
    for index, name in enumerate(parts):
        fresh = _give_storage(network.get_submodule(name), device)  # a part inside an earlier one is done already
        with _initialising_only(fresh) as only:
            _initialise(network)
        if index == 0 and not only.called:  # not name-keyed: nothing is sharded yet, so fall back to whole
            _give_storage(network, device)  # the rest (the first part has its storage; re-allocating it gains nothing)
            _initialise(network)
            peak = parameter_bytes(network)
            for each in parts:
                after_each(each)
            return peak
        peak = max(peak, parameter_bytes(network))
        after_each(name)
    with _initialising_only(_give_storage(network, device)):
        _initialise(network)
    return max(peak, parameter_bytes(network))


def _give_storage(root: nn.Module, device: torch.device) -> list[nn.Module]:
    """Uninitialised storage for the modules under `root` still on the meta device; returns them."""
    fresh = [m for m in root.modules() if any(t.is_meta for t in [*m.parameters(False), *m.buffers(False)])]
    for module in fresh:
        module.to_empty(device=device, recurse=False)
    return fresh


def parameter_bytes(network: nn.Module) -> int:
    """Bytes of the parameters this process holds (a DTensor's local shard; nothing for the meta device)."""
    total = 0
    for p in network.parameters():
        local = local_part(p)
        total += 0 if local.is_meta else local.numel() * local.element_size()
    return total


def _initialise(network: nn.Module) -> None:
    init_weights = getattr(network, "init_weights", None)
    if callable(init_weights):
        with _ties_held_here(network), _hf_init_keyed_by_name(network):
            init_weights()
    else:
        init_by_name(network, init_default)


@contextmanager
def _hf_init_keyed_by_name(network: nn.Module) -> Iterator[None]:
    """transformers' `init_weights()` draws every module's values from the global RNG in module order, so a pruned
    pipeline rank would draw others than one process: each `_init_weights(module)` call is seeded here from
    (seed, the module's name), as `init_by_name` does. Nothing for a network that is not a transformers model."""
    models = [
        m
        for m in network.modules()
        if callable(getattr(m, "_init_weights", None)) and hasattr(m, "all_tied_weights_keys")
    ]
    base, names = torch.initial_seed(), {id(m): name for name, m in network.named_modules()}

    def keyed(original: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def init(module: nn.Module) -> None:
            tensors = [*module.parameters(), *module.buffers()]
            device = next((t.device for t in tensors if not t.is_meta), torch.device("cpu"))
            with _seeded_rng(device, _name_seed(base, names.get(id(module), ""))):
                original(module)

        return init

    for model in models:
        wrapped = keyed(model._init_weights)  # type: ignore[arg-type]
        model._init_weights = wrapped  # type: ignore[assignment]  # the instance's, shadowing its class's method
    try:
        yield
    finally:
        for model in models:
            del model._init_weights


@contextmanager
def _ties_held_here(network: nn.Module) -> Iterator[None]:
    """transformers' `init_weights()` ties each `all_tied_weights_keys` pair (target -> source) after drawing and raises
    where a pipeline rank was pruned to one end; such a pair is left to `parallelize/tie.py`. A pair held here is tied
    before drawing, so it keeps the last module's draw, the value that step gives every holder (`TiedGroup.source`)."""
    tied = getattr(network, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        yield
        return
    here = dict(network.named_parameters(remove_duplicate=False))
    held = {t: s for t, s in tied.items() if t in here and s in here}
    for target, source in held.items():  # tied before drawing: one tensor, the last module initialised keeps it
        if here[target] is not here[source]:
            parent, _, leaf = target.rpartition(".")
            setattr(network.get_submodule(parent), leaf, here[source])
    network.all_tied_weights_keys = held  # type: ignore[assignment]
    try:
        yield
    finally:
        network.all_tied_weights_keys = tied  # type: ignore[assignment]


def check_resettable(network: nn.Module) -> None:
    """Before launch: a meta-built network without `init_weights()` needs `reset_parameters()` on every module
    that owns tensors, or those tensors would stay uninitialised."""
    if callable(getattr(network, "init_weights", None)):
        return
    missing = sorted(
        {
            type(module).__name__
            for module in network.modules()
            if [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            and not callable(getattr(module, "reset_parameters", None))
        }
    )
    if missing:
        raise RuntimeError(
            f"{type(network).__name__} was built on the meta device (trainer.init_module()), but {missing} own "
            "parameters or buffers and have no reset_parameters() to initialise them. HINT: build the network "
            "outside trainer.init_module(), or give it an init_weights() method"
        )
