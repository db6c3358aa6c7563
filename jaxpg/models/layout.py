"""A model's parallel layout on a ``ParallelDims`` mesh: which axis splits which parameter.

:func:`parallelize` lays a ``CausalLM`` out on the one mesh:

* **tp**: the family's plan (:func:`~jaxpg.models.tp_plan`) through
  :func:`jaxpg.tensor_parallel.attach_plan`, the styles' splits of each weight;
* **dp_shard x cp** (FSDP, torchtitan's ``dp_shard_cp``): each parameter is also split on
  a dimension that no other axis splits and that the FSDP degree divides (its first; a
  kernel's last, the rows of Hugging Face's transposed weight; a parameter with none stays
  replicated); the forward all-gathers it over those axes;
* **cp**: every attention core becomes ring (or all-to-all) attention over the cp group,
  and the model then needs each token's global position;
* **ep**: the experts' dimension of ``w1``/``w2`` over the expert-parallel group (which
  borrows its ranks from ``dp_shard x cp``; its experts are not FSDP-split over them).

The result is a :class:`ModelLayout` (hashable data: the mesh, the axes and each
parameter's ``PartitionSpec``) that the model keeps and its host call runs on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups.parallel_dims import ParallelDims
from jaxpg.models.layers import MoE
from jaxpg.models.plans import check_tp_degree, tp_plan
from jaxpg.tensor_parallel import attach_plan

__all__ = ["ModelLayout", "parallelize", "param_paths", "value_of"]

API = "jaxpg.models.parallelize"


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """Where a model's parameters and activations live.

    Attributes:
        mesh: the ``jax.sharding.Mesh`` of the ``ParallelDims``.
        dims: the degrees ``(dp_replicate, dp_shard, cp, tp, pp, ep)``.
        tp_axis, cp_axis_name: the mesh's tp and cp axis names.
        batch_axes: the axes the batch is split over (``dp_replicate``, ``dp_shard``).
        fsdp_axes: the axes the parameters are FSDP-split over.
        ep_axes: the axes the experts are split over.
        sequence_parallel: the residual stream split along the sequence over tp.
        cp_method: ``"ring"`` or ``"all_to_all"``.
        specs: ``(path, PartitionSpec)`` of every parameter.
        fsdp_dims: ``(path, dim)`` of every parameter FSDP-split over ``fsdp_axes``.
    """

    mesh: Mesh
    dims: tuple[int, int, int, int, int, int]
    tp_axis: str
    cp_axis_name: str
    batch_axes: tuple[str, ...]
    fsdp_axes: tuple[str, ...]
    ep_axes: tuple[str, ...]
    sequence_parallel: bool
    cp_method: str
    specs: tuple[tuple[str, P], ...]
    fsdp_dims: tuple[tuple[str, int], ...] = ()

    @property
    def tp(self) -> int:
        return self.dims[3]

    @property
    def cp(self) -> int:
        return self.dims[2]

    @property
    def ep(self) -> int:
        return self.dims[5]

    def spec(self, path: str) -> P:
        """The ``PartitionSpec`` of parameter ``path`` (``"layers.0.mlp.up_proj.kernel"``)."""
        return dict(self.specs)[path]

    def sharding(self, path: str) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(path))


def param_paths(model: nnx.Module) -> dict[str, Any]:
    """``{"dotted.path": nnx.Variable}`` of every parameter of ``model``."""
    return {".".join(str(p) for p in path): var for path, var in nnx.iter_graph(model)
            if isinstance(var, nnx.Param)}


def value_of(var: nnx.Variable) -> Any:
    """A variable's value: an array, or a ``ShapeDtypeStruct`` of an abstract model."""
    return var.get_value() if hasattr(var, "get_value") else var.value


def _ep_axes(dims: ParallelDims) -> tuple[str, ...]:
    """The mesh axes whose product is the ep group (consecutive ranks of dp_shard x cp)."""
    if dims.ep == 1:
        return ()
    shard, cp = dims.axis("dp_shard"), dims.axis("cp")
    if dims.ep == dims.cp:
        return (cp,)
    if dims.ep == dims.dp_shard * dims.cp:
        return tuple(a for a, n in ((shard, dims.dp_shard), (cp, dims.cp)) if n > 1)
    raise ValueError(
        f"{API}: ep={dims.ep} must equal cp={dims.cp} or dp_shard x cp="
        f"{dims.dp_shard * dims.cp}, so that the experts split over whole mesh axes; "
        "change ep or the degrees.")


def _fsdp_entry(spec: list, shape: tuple[int, ...], axes: tuple[str, ...], n: int,
                transposed: bool) -> int | None:
    # a kernel is Hugging Face's [out, in] weight transposed: its last dimension first, so
    # that each device's block is whole rows of the file's tensor (a contiguous read)
    dims = range(len(shape) - 1, -1, -1) if transposed else range(len(shape))
    for d in dims:
        size = shape[d]
        if spec[d] is None and size % n == 0:
            spec[d] = axes if len(axes) > 1 else axes[0]
            return d
    return None


def parallelize(model: nnx.Module, dims: ParallelDims, *, sequence_parallel: bool = False,
                cp_method: str = "ring", fsdp: bool = True, place: bool = True
                ) -> ModelLayout:
    """Lays ``model`` (a ``CausalLM``) out on ``dims``'s mesh, in place.

    Args:
        model: the model; its arrays may be concrete (they are placed on their layout,
            each device taking its slice of this process's copy) or abstract
            (``nnx.eval_shape``; ``place=False`` and the caller fills them).
        dims: the ``ParallelDims`` (pp is left to the pipeline: parameters are replicated
            over it here).
        sequence_parallel: Megatron's sequence parallelism inside the tp plan.
        cp_method: the context-parallel attention, ``"ring"`` or ``"all_to_all"``.
        fsdp: split the parameters over ``dp_shard x cp``; False leaves them replicated
            there (tp and ep splits only), for a data-parallel wrapper
            (``jaxpg.fsdp.FullyShardedDataParallel``) that shards them itself.
        place: put the concrete arrays on their layout.

    Returns:
        The :class:`ModelLayout`, also stored as ``model.layout``.

    Raises:
        ValueError: a tp that does not split the heads whole (naming the degrees that
            do), a model laid out twice, an ep that is not a union of mesh axes, an
            unknown ``cp_method``.
        TypeError: ``dims`` not a ParallelDims.
    """
    if not isinstance(dims, ParallelDims):
        raise TypeError(f"{API}: dims must be a jaxpg.ParallelDims; got "
                        f"{type(dims).__name__}.")
    if getattr(model, "layout", None) is not None:
        raise ValueError(f"{API}: the model is laid out already ({model.layout.dims}); build "
                         "a fresh one for another layout, or write it with to_hf and load it.")
    if cp_method not in ("ring", "all_to_all"):
        raise ValueError(f"{API}: cp_method={cp_method!r} must be 'ring' or 'all_to_all'.")
    config = model.config
    check_tp_degree(config, dims.tp)
    mesh = dims.jax_mesh
    tp_specs = {}
    if dims.tp > 1:
        plan = tp_plan(config, sequence_parallel=sequence_parallel)
        tp_specs = attach_plan(model, dims, plan)
    ep_axes = _ep_axes(dims)
    fsdp_axes = tuple(dims.axis(n) for n in ("dp_shard", "cp") if getattr(dims, n) > 1)
    fsdp = fsdp_axes if fsdp else ()
    specs, fsdp_dims = {}, {}
    for path, var in param_paths(model).items():
        shape = tuple(value_of(var).shape)
        spec = list(tp_specs.get(path, P())) + [None] * len(shape)
        spec = spec[:len(shape)]
        axes = fsdp
        if path.endswith((".w1", ".w2")) and ep_axes:
            spec[0] = ep_axes if len(ep_axes) > 1 else ep_axes[0]
            axes = tuple(a for a in fsdp if a not in ep_axes)
        if axes:
            dim = _fsdp_entry(spec, shape, axes, math.prod(mesh.shape[a] for a in axes),
                              path.endswith((".kernel", ".gate")))
            if dim is not None:
                if axes != fsdp:
                    raise ValueError(f"{API}: parameter {path} would be FSDP-split over "
                                     f"{axes} only; use ep equal to dp_shard x cp or to cp.")
                fsdp_dims[path] = dim
        specs[path] = P(*spec)
    cp_group = dims.device_mesh[dims.axis("cp")] if dims.cp > 1 else False
    ep_group = dims.device_mesh[dims.axis("ep")]
    for layer in model.layers:
        layer.self_attn.core.group = cp_group
        layer.self_attn.core.method = cp_method
        if isinstance(layer.mlp, MoE):
            layer.mlp.group = ep_group
    batch = tuple(dims.axis(n) for n in ("dp_replicate", "dp_shard") if getattr(dims, n) > 1)
    layout = ModelLayout(
        mesh=mesh, dims=(dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep),
        tp_axis=dims.axis("tp"), cp_axis_name=dims.axis("cp"), batch_axes=batch,
        fsdp_axes=fsdp, ep_axes=ep_axes, sequence_parallel=bool(sequence_parallel),
        cp_method=cp_method, specs=tuple(specs.items()), fsdp_dims=tuple(fsdp_dims.items()))
    if place:
        for path, var in param_paths(model).items():
            host = np.asarray(jax.device_get(value_of(var)))
            var.set_value(jax.make_array_from_callback(
                host.shape, layout.sharding(path), lambda index, h=host: h[index]))
    model.layout = layout
    return layout
