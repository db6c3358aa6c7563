"""Where DDP's step runs: the group's own mesh, or the mesh tensor-parallel parameters live on.

A plain model runs on the DDP group's one-axis mesh with replicated parameters. A model
parallelized over another dimension of a larger mesh (``jaxpg.tensor_parallel`` on a
``("dp", "tp")`` DeviceMesh) holds global arrays laid out on that mesh; the step then runs
over the *whole* mesh:

* the DDP group must be one (or several) of its axes, the data-parallel axes;
* each parameter keeps its layout (split over ``"tp"``, replicated over ``"dp"``); every
  other leaf is replicated over the mesh;
* the batch is split over the data-parallel axes and replicated over the others (every tp
  rank of a replica trains on the same samples);
* per-rank state (hook state, ``no_sync`` accumulators) has one row per device;
* bucket plans are made from each device's local shapes, and gradients are reduced over
  the data-parallel axes only;
* with ``expert_axes`` (expert parallelism: experts split over ``"ep"``, which is also a
  data-parallel axis, since ep ranks see different tokens), a parameter split over those
  axes is reduced over the other data-parallel axes only: the ``all_to_all`` that used it
  already brought it the gradients of every token of its ep group.
* with ``sequence`` (context parallelism, the wrappers' ``context_parallel=``) the step
  runs over the cp group's mesh even for a replicated model; cp is one of the
  data-parallel axes (its ranks hold different tokens of the same samples, so gradients
  are averaged over it too), and each batch leaf is split over the other data-parallel
  axes on dim 0 and over cp on its sequence dimension
  (:mod:`jaxpg.data_parallel.sequence_batch`).

Values are taken from data-parallel rank 0 for each leaf, over the axes it is replicated on
(torch's ``broadcast_params``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.context_parallel.sequence_split import ResolvedSequenceSplit
from jaxpg.data_parallel.batch_placement import place_batch
from jaxpg.data_parallel.leaf_split import spec_axes
from jaxpg.data_parallel.prng_keys import is_key
from jaxpg.data_parallel.sequence_batch import (
    place_sequence_batch,
    sample_axes,
    sequence_batch_specs,
)

__all__ = ["StepMesh", "step_mesh", "place_on_step_mesh", "place_step_batch", "place_per_rank",
           "dense_leaves", "with_experts_reduced"]


@dataclasses.dataclass(frozen=True)
class StepMesh:
    """The mesh of DDP's step and how each part of the state is laid out on it.

    Attributes:
        mesh: the mesh the step's ``shard_map`` runs over.
        dp_axes: the data-parallel axes of ``mesh`` (the DDP group).
        param_specs: a ``PartitionSpec`` per parameter leaf.
        rest_specs: a ``PartitionSpec`` per leaf of the rest of the module state.
        sharded: whether the state lives on a larger mesh than the group's (tensor parallel).
        reduce_axes: per parameter leaf, the data-parallel axes its gradient is summed over:
            all of them, but for an expert parameter (split over ``expert_axes``) the others.
        sequence: the batch's sequence split over a cp axis (one of ``dp_axes``), or None.
    """

    mesh: Mesh
    dp_axes: tuple[str, ...]
    param_specs: Any
    rest_specs: Any
    sharded: bool
    reduce_axes: Any = None
    sequence: ResolvedSequenceSplit | None = None

    @property
    def sample_axes(self) -> tuple[str, ...]:
        """The data-parallel axes the samples (dim 0 of the batch) are split over."""
        return sample_axes(self.dp_axes, self.sequence)

    def batch_specs(self, batch: Any) -> Any:
        """The batch's ``PartitionSpec`` (a prefix, or one per leaf with ``sequence``)."""
        if self.sequence is None:
            return P(self.axis)
        return sequence_batch_specs(batch, self.sample_axes, self.sequence)

    def is_expert(self, leaf_axes: tuple[str, ...]) -> bool:
        """Whether a leaf reduced over ``leaf_axes`` is split over data-parallel axes."""
        return tuple(leaf_axes) != tuple(self.dp_axes)

    @property
    def axis(self) -> Any:
        """The data-parallel axis name (or tuple of names) for ``lax`` collectives."""
        return self.dp_axes[0] if len(self.dp_axes) == 1 else self.dp_axes

    @property
    def rank_spec(self) -> P:
        """Per-rank state: a leading axis with one row per device of the mesh."""
        return P(tuple(self.mesh.axis_names)) if self.sharded else P(self.axis)

    def local_struct(self, tree: Any, specs: Any) -> Any:
        """Shape structs of each device's part of ``tree`` laid out by ``specs``."""
        def local(x, spec):
            shape = list(np.shape(x))
            for d, entry in enumerate(spec):
                for a in (entry if isinstance(entry, tuple) else (entry,)) if entry else ():
                    shape[d] //= self.mesh.shape[a]
            return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

        return jax.tree.map(local, tree, specs)


def _leaf_mesh(x: Any) -> Mesh | None:
    sharding = getattr(x, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _group_axes(mesh: Mesh, pg: Any) -> tuple[str, ...] | None:
    """The axes of ``mesh`` whose partition of its ranks is the group's family, if any."""
    world = pg._world
    ranks = np.vectorize(world.rank_of_device, otypes=[np.int64])(np.asarray(mesh.devices))
    want = sorted(tuple(sorted(f)) for f in pg.family)
    names = mesh.axis_names
    for r in range(1, len(names) + 1):
        for chosen in itertools.combinations(range(len(names)), r):
            others = [i for i in range(len(names)) if i not in chosen]
            moved = np.transpose(ranks, others + list(chosen)).reshape(
                -1, int(np.prod([ranks.shape[i] for i in chosen])))
            if sorted(tuple(sorted(int(v) for v in row)) for row in moved) == want:
                return tuple(names[i] for i in chosen)
    return None



def cp_group_fix(flat: str, axes: tuple[str, ...] = ()) -> str:
    """The group to pass with context parallelism: the data-parallel and cp dimensions
    flattened into ``flat`` (``"dp_cp"``, DDP's; ``"dp_shard_cp"``, FSDP's), as
    ``group=mesh[...].flatten(flat)`` over ``axes`` (the mesh's dimensions to flatten), and
    its ``ParallelDims`` name."""
    axes = axes or (("dp_shard", "cp") if flat == "dp_shard_cp" else ("dp", "cp"))
    return (f"group=mesh[{', '.join(repr(a) for a in axes)}].flatten({flat!r}) "
            f"(ParallelDims: dims[{flat!r}])")


def step_mesh(pg: Any, params: Any, rest: Any, *, api: str = "DistributedDataParallel",
                expert_axes: tuple[str, ...] = (),
                sequence: ResolvedSequenceSplit | None = None,
                cp_flat: str = "dp_cp") -> StepMesh:
    """The layout of DDP's (or FSDP's, ``api``) step for a model whose state is ``params``
    and ``rest``.

    Args:
        pg: the data-parallel group.
        params, rest: the model's parameters and the rest of its state.
        api: the caller's name, for errors.
        expert_axes: data-parallel axes that parameters may be split over (expert
            parallelism's ``"ep"``); such a parameter is reduced over the other ones.
        sequence: the batch's sequence split (``context_parallel=``); the step then runs
            over its mesh, whose cp axis must be one of the group's.
        cp_flat: the flattened dimension the errors name for a group without the cp axis
            (``"dp_cp"``, DDP's; ``"dp_shard_cp"``, FSDP's shard group).

    Raises:
        ValueError: if the state lives on several larger meshes, on one the group is not a
            dimension of (or not the cp group's), is split over the data-parallel axes
            themselves (other than ``expert_axes``, for parameters), or if the group does
            not span the cp axis.
    """
    leaves = jax.tree.leaves((params, rest))
    def elsewhere(x):  # laid out on another mesh than the group's: larger, or split on it
        m = _leaf_mesh(x)
        split = m is not None and any(e is not None for e in x.sharding.spec)
        return m is not None and m != pg.mesh and (m.devices.size > pg.size() or split)

    meshes = {_leaf_mesh(x) for x in leaves if elsewhere(x)}
    replicated = lambda tree: jax.tree.map(lambda _: P(), tree)
    if not meshes and sequence is None:
        return StepMesh(pg.mesh, (pg.axis_name,), replicated(params), replicated(rest), False)
    if sequence is not None:
        meshes.add(sequence.mesh)
    if len(meshes) > 1:
        raise ValueError(
            f"{api}: the model's arrays live on {len(meshes)} different "
            f"meshes ({[dict(m.shape) for m in meshes]}); lay them all out on one mesh"
            + (" (the context_parallel group's)." if sequence is not None else ".")
        )
    mesh = meshes.pop()
    axes = _group_axes(mesh, pg)
    if axes is None:
        raise ValueError(
            f"{api}: the model's arrays are laid out on a mesh with axes "
            f"{dict(mesh.shape)} (tensor parallel), but group {pg!r} is not one dimension of "
            "it; pass the data-parallel dimension's group, e.g. group=mesh.get_group('dp')."
            if sequence is None else
            f"{api}: group {pg!r} is not made of dimensions of the context_parallel group's "
            f"mesh {dict(mesh.shape)}; pass its data-parallel and cp dimensions flattened, "
            f"e.g. {cp_group_fix(cp_flat)}."
        )
    if sequence is not None and sequence.axis not in axes:
        raise ValueError(
            f"{api}: group {pg!r} spans the axes {list(axes)} of the mesh "
            f"{dict(mesh.shape)}, not the cp axis {sequence.axis!r}: the cp ranks hold "
            "different tokens of the same samples, so the gradients are averaged over them "
            "too; pass the data-parallel and cp dimensions flattened, e.g. "
            f"{cp_group_fix(cp_flat, (*axes, sequence.axis))}."
        )
    unknown = [a for a in expert_axes if a not in axes]
    if unknown:
        raise ValueError(
            f"{api}: expert_axes={tuple(expert_axes)} names {unknown}, which are not "
            f"data-parallel axes of the group ({list(axes)}); name the expert-parallel axis "
            "the batch is also split over, e.g. expert_axes=('ep',).")

    def spec(path, x, allowed=()):
        if _leaf_mesh(x) != mesh:
            return P()
        s = x.sharding.spec
        split = spec_axes(s) & set(axes) - set(allowed)
        if split:
            why = ("DDP replicates parameters over them (sharded data parallelism is FSDP's; "
                   "experts split over an expert-parallel axis: name it in expert_axes)"
                   if api == "DistributedDataParallel" else
                   f"{api} shards them over those axes itself; pass the data-parallel "
                   "dimension's group, e.g. group=mesh.get_group('dp')")
            raise ValueError(
                f"{api}: {jax.tree_util.keystr(path)} is split over the "
                f"data-parallel axes {sorted(split)} ({s}); {why}."
            )
        return s

    with_path = jax.tree_util.tree_map_with_path
    param_specs = with_path(lambda p, x: spec(p, x, expert_axes), params)
    reduce_axes = jax.tree.map(lambda s: tuple(a for a in axes if a not in spec_axes(s)),
                               param_specs, is_leaf=lambda s: isinstance(s, P))
    return StepMesh(mesh, axes, param_specs, with_path(spec, rest), True, reduce_axes,
                      sequence)


def _expert_flags(tree: Any, layout: StepMesh | None) -> tuple[list, Any, list] | None:
    """``(leaves, treedef, reduce axes per leaf)`` of a parameter-shaped tree, or None when
    no leaf is an expert parameter."""
    if layout is None or layout.reduce_axes is None:
        return None
    leaves, treedef = jax.tree.flatten(tree)
    axes = treedef.flatten_up_to(layout.reduce_axes)
    if not any(layout.is_expert(a) for a in axes):
        return None
    return leaves, treedef, axes


def dense_leaves(tree: Any, layout: StepMesh | None) -> Any:
    """``tree`` (parameter-shaped) with its expert leaves replaced by None: the part the
    bucketed reducer takes. ``tree`` itself when it has no expert leaf."""
    flags = _expert_flags(tree, layout)
    if flags is None:
        return tree
    leaves, treedef, axes = flags
    return treedef.unflatten([None if layout.is_expert(a) else x
                              for x, a in zip(leaves, axes, strict=True)])


def with_experts_reduced(grads: Any, reduced_dense: Any, layout: StepMesh | None,
                         n: int) -> Any:
    """The reduced gradients: ``reduced_dense`` (from :func:`dense_leaves`'s part) with
    each expert leaf of ``grads`` summed over the data-parallel axes that replicate it and
    divided by ``n``, the group's size (inside the step's ``shard_map``)."""
    flags = _expert_flags(grads, layout)
    if flags is None:
        return reduced_dense
    leaves, treedef, axes = flags
    dense = iter(jax.tree.leaves(reduced_dense))
    out = []
    for g, a in zip(leaves, axes, strict=True):
        if layout.is_expert(a):
            total = jax.lax.psum(g, a) if a else g
            out.append(total / jnp.asarray(n, g.dtype))
        else:
            out.append(next(dense))
    return treedef.unflatten(out)


def _all_local(mesh: Mesh) -> bool:
    local = {d.id for d in jax.local_devices()}
    return all(d.id in local for d in mesh.devices.flat)


def place_on_step_mesh(tree: Any, specs: Any, layout: StepMesh, *, broadcast: bool = True) -> Any:
    """Fresh arrays of ``tree`` laid out by ``specs`` on ``layout.mesh``.

    In one process this is a copy. Across processes, with ``broadcast``, each leaf takes the
    values of data-parallel rank 0 (a leaf already on the mesh) or of mesh position 0 (a
    process-local leaf), over the axes it is replicated on; one kernel does every leaf.
    """
    mesh = layout.mesh
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    impls = [jax.random.key_impl(x) if is_key(x) else None for x in leaves]
    raw = [jax.random.key_data(x) if i is not None else x for x, i in zip(leaves, impls)]
    if _all_local(mesh):
        out = [jax.device_put(jnp.array(x, copy=True), NamedSharding(mesh, P(*s)))
               for x, s in zip(raw, spec_leaves)]
    else:
        out = [None] * len(raw)
        on_mesh = [i for i, x in enumerate(raw) if _leaf_mesh(x) == mesh]
        local = [i for i in range(len(raw)) if _leaf_mesh(raw[i]) != mesh]
        if on_mesh:
            moved = _from_first([raw[i] for i in on_mesh], [P(*spec_leaves[i]) for i in on_mesh],
                                layout.dp_axes, mesh, broadcast)
            for i, x in zip(on_mesh, moved):
                out[i] = x
        if local and not broadcast:
            for i in local:
                out[i] = jax.make_array_from_process_local_data(
                    NamedSharding(mesh, P()), np.asarray(raw[i]))
        elif local:
            for i, x in zip(local, _stacked_from_first([np.asarray(raw[i]) for i in local],
                                                       mesh)):
                out[i] = x
    out = [jax.random.wrap_key_data(x, impl=i) if i is not None else x
           for x, i in zip(out, impls)]
    return treedef.unflatten(out)


def _from_first(xs: list, specs: list, axes: tuple[str, ...], mesh: Mesh,
                broadcast: bool) -> list:
    """Fresh copies of global arrays; with ``broadcast``, data-parallel rank 0's values over
    the data-parallel axes each is replicated on (an expert keeps its own block over ep)."""
    leaf_axes = [tuple(a for a in axes if a not in spec_axes(P(*s))) for s in specs]

    def first_of(v, over):
        if not over:
            return v * jnp.ones((), v.dtype)
        first = jax.lax.axis_index(over) == 0
        return jax.lax.psum(jnp.where(first, v, jnp.zeros_like(v)), over)

    def body(vs):
        if not broadcast:
            return [v * jnp.ones((), v.dtype) for v in vs]  # a computed (fresh) buffer
        return [first_of(v, over) for v, over in zip(vs, leaf_axes, strict=True)]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False)
    return jax.jit(fn)(xs)


def _stacked_from_first(locals_: list, mesh: Mesh) -> list:
    """Process-local values, replicated on the mesh with mesh position 0's values."""
    axes = tuple(mesh.axis_names)
    n_local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    stacked = [jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(axes)), np.broadcast_to(x[None], (n_local, *x.shape)))
        for x in locals_]

    def body(vs):
        first = jax.lax.axis_index(axes) == 0
        return [jax.lax.psum(jnp.where(first, v[0], jnp.zeros_like(v[0])), axes) for v in vs]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes),), out_specs=P(), check_vma=False)
    return jax.jit(fn)(stacked)


def place_step_batch(batch: Any, layout: StepMesh) -> Any:
    """This process's part of the batch, split over the data-parallel axes of the mesh
    (with ``layout.sequence``, its sequences over cp).

    Raises:
        ValueError: if a leaf's leading dimension does not divide among this process's
            data-parallel positions.
    """
    mesh = layout.mesh
    if layout.sequence is not None:
        return place_sequence_batch(
            batch, mesh, layout.sample_axes, layout.sequence,
            "data-parallel position(s) of the mesh other than cp (the cp ranks of a replica "
            "get the same samples, each its part of their sequences).")
    sharding = NamedSharding(mesh, P(layout.axis))
    index = [mesh.axis_names.index(a) for a in layout.dp_axes]
    coords = {tuple(int(c[i]) for i in index) for c in np.argwhere(
        np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices))}
    return place_batch(batch, sharding, len(coords), _all_local(mesh),
                       "data-parallel position(s) of the mesh (every tensor-parallel rank of a "
                       "replica gets the same samples).")


def place_per_rank(tree: Any, layout: StepMesh) -> Any:
    """One copy of ``tree`` per device of the mesh, laid out ``layout.rank_spec``."""
    mesh = layout.mesh
    n_local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    sharding = NamedSharding(mesh, layout.rank_spec)

    def place(x):
        stacked = jnp.broadcast_to(jnp.asarray(x)[None], (n_local, *np.shape(x)))
        if _all_local(mesh):
            return jax.device_put(jnp.array(stacked, copy=True), sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(stacked))

    return jax.tree.map(place, tree)
