"""``parallelize_module``: torch's plan API for Flax NNX modules.

``parallelize_module(model, tp_mesh, {"blocks.*.attn.qkv": ColwiseParallel(), ...})``
changes ``model`` in place and returns it:

* Plan keys are NNX attribute paths, dot-separated, each part matched with ``fnmatch``
  (``"blocks.*.mlp.up"``: ``*`` is one part, a list index or an attribute name).
* Every key must match at least one submodule, no submodule may match two keys, and every
  style must fit its module; all of this is checked before anything changes.
* A matched module keeps its full weights: each parameter becomes a global array of the same
  values, sharded as its style says (torch's ``distribute_tensor`` from the full tensor; by
  default every rank takes tp rank 0's values, ``src_data_rank=0``). Its class is swapped
  for a subclass whose ``__call__`` runs the style (torch registers forward hooks), so
  ``isinstance`` checks and ``nnx.split``/``nnx.merge`` keep working.
* Every other array of ``model`` (the parameters no style names, RNG state) is replicated on
  the same mesh. torch leaves them local; in JAX every array of a computation over the mesh
  must live on it, and DDP, FSDP and the pipeline then find all of them there.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.mesh_axis import MeshAxis, resolve_mesh_axis
from jaxpg.tensor_parallel.head_check import check_heads
from jaxpg.tensor_parallel.sharded_params import distribute_tensor
from jaxpg.tensor_parallel.styles import ParallelStyle

__all__ = ["parallelize_module", "parallel_style_of", "attach_plan"]

_HOOKED: dict[type, type] = {}
_ATTR = "_jaxpg_parallel_style"


def _hooked_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` runs the module's parallel style."""
    if getattr(cls, "_jaxpg_tp_hooked", False):
        return cls
    sub = _HOOKED.get(cls)
    if sub is None:
        original = cls.__call__

        def __call__(self, *args, **kwargs):  # noqa: N807
            style, tp = getattr(self, _ATTR)
            return style.call(self, original, tp, args, kwargs)

        sub = type(cls.__name__, (cls,), {
            "__call__": __call__, "_jaxpg_tp_hooked": True, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
        _HOOKED[cls] = sub
    return sub


def parallel_style_of(module: nnx.Module) -> tuple[ParallelStyle, MeshAxis] | None:
    """The ``(style, MeshAxis)`` a module was parallelized with, or None."""
    return getattr(module, _ATTR, None)


def _submodules(module: nnx.Module) -> dict[str, nnx.Module]:
    return {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Module) and path}


def _match(key: str, paths: dict[str, nnx.Module]) -> list[str]:
    parts = key.split(".")
    return [p for p in paths if len(p.split(".")) == len(parts)
            and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p.split("."), parts))]


def _resolve_plan(module: nnx.Module, plan: Any) -> list[tuple[str, nnx.Module, ParallelStyle]]:
    api = "parallelize_module"
    if isinstance(plan, ParallelStyle):
        return [("", module, plan)]
    if plan is None:
        plan = {}
    if not isinstance(plan, dict):
        raise TypeError(f"{api}: parallelize_plan must be a ParallelStyle or a dict of module "
                        f"paths to styles; got {type(plan).__name__}.")
    paths = _submodules(module)
    found: dict[str, tuple[str, ParallelStyle]] = {}
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{api}: plan key {key!r} must be a non-empty attribute path "
                            "such as 'blocks.*.mlp.up'.")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"{api}: plan[{key!r}]={style!r} is not a parallel style "
                            "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ...).")
        matches = _match(key, paths)
        if not matches:
            shown = ", ".join(sorted(paths)[:12]) + (", ..." if len(paths) > 12 else "")
            raise ValueError(f"{api}: plan key {key!r} matches no submodule of "
                             f"{type(module).__name__}; its submodules are: {shown}.")
        for path in matches:
            if path in found:
                raise ValueError(f"{api}: submodule {path!r} matches plan keys "
                                 f"{found[path][0]!r} and {key!r}; give it one style (combine "
                                 "input and output preparation with PrepareModuleInputOutput).")
            found[path] = (key, style)
    return [(path, paths[path], style) for path, (_, style) in found.items()]


def parallelize_module(module: nnx.Module, device_mesh: Any = None,
                       parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
                       *, src_data_rank: int | None = 0) -> nnx.Module:
    """Applies a tensor-parallel plan to ``module`` in place and returns it (torch's API).

    Args:
        module: the ``nnx.Module`` to parallelize.
        device_mesh: the tensor-parallel group: a 1-D DeviceMesh (``mesh["tp"]``), a
            ProcessGroup of a mesh dimension, a ParallelDims (its ``tp`` axis), a
            HybridCommunicateGroup (its model-parallel group), or None for the latest
            HybridCommunicateGroup's.
        parallelize_plan: a style for ``module`` itself, or ``{path: style}`` for its
            submodules (paths may use ``fnmatch`` wildcards per part).
        src_data_rank: the tp rank whose copy of each weight every rank takes its shard of
            (torch's default 0); None: each rank slices its own copy.

    Returns:
        ``module``, changed in place.

    Raises:
        ValueError: for a key that matches nothing, a submodule matched twice, a dimension
            the tp size does not divide, a multi-dimensional mesh, a process outside the group.
        TypeError: for a style on a module it cannot shard, or a malformed plan.

    Example:
        >>> tp_mesh = jaxpg.init_device_mesh((2, 4), ("dp", "tp"))["tp"]
        >>> parallelize_module(model, tp_mesh, {"blocks.*.up": ColwiseParallel(),
        ...                                     "blocks.*.down": RowwiseParallel()})
    """
    api = "parallelize_module"
    tp, entries = _checked_entries(module, device_mesh, parallelize_plan, api)
    for _, sub, style in entries:
        for name, spec in style.param_specs(sub, tp).items():
            var = getattr(sub, name)
            var.set_value(distribute_tensor(var[...], tp, spec, src_data_rank=src_data_rank))
        setattr(sub, _ATTR, (style, tp))
        sub.__class__ = _hooked_class(type(sub))
    _replicate_the_rest(module, tp, src_data_rank)
    return module


def _checked_entries(module: Any, device_mesh: Any, plan: Any, api: str
                     ) -> tuple[MeshAxis, list[tuple[str, nnx.Module, ParallelStyle]]]:
    if not isinstance(module, nnx.Module):
        raise TypeError(f"{api}: module must be an nnx.Module; got {type(module).__name__}.")
    tp = resolve_mesh_axis(device_mesh, "tp", api=api, arg="device_mesh")
    entries = _resolve_plan(module, plan)
    for path, sub, style in entries:
        if parallel_style_of(sub) is not None:
            raise ValueError(f"{api}: submodule {path or '(root)'!r} is already parallelized "
                             f"with {parallel_style_of(sub)[0]!r}; a module takes one style.")
        style.check(sub, path or "(root)", tp)
    check_heads(module, entries, tp, api)  # whole heads per rank, where the modules say
    return tp, entries


def attach_plan(module: nnx.Module, device_mesh: Any,
                parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None
                ) -> dict[str, P]:
    """Applies a plan's styles to ``module``'s calls without touching its arrays.

    For code that places the parameters itself (a checkpoint loader reading each rank's
    slice, a module built abstractly by ``nnx.eval_shape``): the same checks and class swap
    as :func:`parallelize_module`, and the layout each style gives its parameters.

    Args:
        module, device_mesh, parallelize_plan: as :func:`parallelize_module`.

    Returns:
        ``{"path.to.param": PartitionSpec}`` for every parameter a style splits (the caller
        lays those out, and every other array replicated over the tp axis).
    """
    tp, entries = _checked_entries(module, device_mesh, parallelize_plan, "attach_plan")
    specs = {}
    for path, sub, style in entries:
        for name, spec in style.param_specs(sub, tp).items():
            specs[f"{path}.{name}" if path else name] = spec
        setattr(sub, _ATTR, (style, tp))
        sub.__class__ = _hooked_class(type(sub))
    return specs


def _on_mesh(value: Any, tp: MeshAxis) -> bool:
    sharding = getattr(value, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == tp.mesh


def _replicate_the_rest(module: nnx.Module, tp: MeshAxis, src_data_rank: int | None) -> None:
    for _, var in nnx.iter_graph(module):
        if not isinstance(var, nnx.Variable):
            continue
        value = var.get_value() if hasattr(var, "get_value") else var[...]
        if not isinstance(value, jax.Array) or _on_mesh(value, tp):
            continue
        var.set_value(distribute_tensor(value, tp, P(), src_data_rank=src_data_rank))
