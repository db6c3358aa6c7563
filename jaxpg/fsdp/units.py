"""FSDP units: the submodules whose parameters are gathered together, as torch's nested
``fully_shard`` calls make them.

``units`` names them in one of three ways:

* a sequence of dotted module paths, as ``nnx.iter_graph`` spells them
  (``["blocks.0", "blocks.1"]``; ``"*"`` matches one path element: ``"blocks.*"``);
* a module class or tuple of classes: every instance is a unit ("every transformer
  block", torch's ``for block in model.blocks: fully_shard(block)``);
* a predicate ``units(path: str, module) -> bool``.

The model itself is the root and holds every parameter outside the units. Units may not
nest (a unit inside another is refused with both paths), and a unit must own its
parameters (a parameter shared with the root or another unit is refused).

Each unit instance's class is replaced, in FSDP's private copy of the model, by a
subclass (``FSDP<Name>``) whose ``__call__`` hands the call to the active step (see
:mod:`jaxpg.fsdp.unit_call`); outside a step it behaves exactly as the original class.
The user's model is never modified.
"""

from __future__ import annotations

import contextvars
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["resolve_units", "wrap_model", "active_step", "path_str"]

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxpg_fsdp_step", default=None)


def active_step() -> contextvars.ContextVar[Any]:
    """The context variable holding the step being traced (None outside a step)."""
    return _ACTIVE


def path_str(path: Sequence[Any]) -> str:
    """``('blocks', 0)`` -> ``'blocks.0'`` (the root is ``''``)."""
    return ".".join(str(p) for p in path)


def _modules(model: Any) -> list[tuple[str, Any]]:
    from flax import nnx

    return [(path_str(p), m) for p, m in nnx.iter_graph(model)
            if isinstance(m, nnx.Module) and p]


def _path_matches(path: str, pattern: str) -> bool:
    return pattern.count(".") == path.count(".") and fnmatch.fnmatchcase(path, pattern)


def _matcher(units: Any) -> tuple[Callable[[str, Any], bool], list[str]]:
    """``(match(path, module), the path patterns given)``."""
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)):
        return (lambda path, module: isinstance(module, units)), []
    if isinstance(units, str):
        units = [units]
    if isinstance(units, Sequence) and units and all(isinstance(u, str) for u in units):
        patterns = list(units)
        return (lambda path, module: any(_path_matches(path, p) for p in patterns)), patterns
    if callable(units):
        return (lambda path, module: bool(units(path, module))), []
    raise TypeError(
        f"FullyShardedDataParallel: units={units!r} must be None, a sequence of module paths "
        "(e.g. ['blocks.0', 'blocks.*']), a module class (or tuple of classes), or a "
        "predicate units(path, module) -> bool."
    )


def resolve_units(model: Any, units: Any) -> tuple[str, ...]:
    """The sorted dotted paths of ``model``'s units.

    Raises:
        TypeError: for ``units`` of another kind.
        ValueError: if ``units`` (or one of its paths) matches no submodule, or makes
            units that nest or share parameters.
    """
    if units is None:
        return ()
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(
            "FullyShardedDataParallel: units= needs an nnx.Module; a parameter pytree has "
            "no submodules to gather one at a time."
        )
    modules = _modules(model)
    paths = [p for p, _ in modules]
    match, patterns = _matcher(units)
    for pattern in patterns:
        if not any(_path_matches(p, pattern) for p in paths):
            raise ValueError(
                f"FullyShardedDataParallel: units entry {pattern!r} matches no submodule of "
                f"{type(model).__name__}; its module paths are {paths[:20]}."
            )
    found = sorted({p for p, m in modules if match(p, m)})
    if not found:
        raise ValueError(
            f"FullyShardedDataParallel: units={units!r} matches no submodule of "
            f"{type(model).__name__}; its module paths are {paths[:20]}."
        )
    for a in found:
        for b in found:
            if b.startswith(a + "."):
                raise ValueError(
                    f"FullyShardedDataParallel: units nest: {b!r} is inside {a!r}. Nested "
                    "units are not supported; choose one level (e.g. only the blocks)."
                )
    _check_owned(model, found)
    return tuple(found)


def _check_owned(model: Any, found: list[str]) -> None:
    from flax import nnx

    seen: dict[int, str] = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            seen.setdefault(id(var), path_str(path))
    for unit, module in ((p, m) for p, m in _modules(model) if p in found):
        for sub, var in nnx.iter_graph(module):
            if isinstance(var, nnx.Param):
                owner = seen.get(id(var), "")
                full = f"{unit}.{path_str(sub)}" if sub else unit
                if owner != full:
                    raise ValueError(
                        f"FullyShardedDataParallel: parameter {full!r} of unit {unit!r} is "
                        f"shared with {owner!r}; a unit must own its parameters (tie them "
                        "in the root instead)."
                    )


def _wrapper_class(base: type, unit: str) -> type:
    def __call__(self, *args, **kwargs):  # noqa: N807
        step = _ACTIVE.get()
        if step is None:
            return base.__call__(self, *args, **kwargs)
        return step.call_unit(unit, self, base.__call__, args, kwargs)

    return type(base)(f"FSDP{base.__name__}", (base,), {
        "__call__": __call__, "__module__": base.__module__,
        "__qualname__": f"FSDP{base.__qualname__}", "_jaxpg_fsdp_unit": unit,
    })


def wrap_model(graphdef: Any, state: tuple[Any, ...], units: tuple[str, ...],
               wrap_root: bool) -> Any:
    """A graphdef like ``graphdef`` whose units (and root, with ``wrap_root``) call through
    the active step; ``state`` is any state that merges with ``graphdef``."""
    from flax import nnx

    copy = nnx.merge(graphdef, *state, copy=True)
    by_path = dict(_modules(copy))
    for unit in units:
        module = by_path[unit]
        module.__class__ = _wrapper_class(type(module), unit)
    if wrap_root:
        copy.__class__ = _wrapper_class(type(copy), "")
    return nnx.split(copy, nnx.Param, ...)[0]
