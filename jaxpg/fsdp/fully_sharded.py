"""``FullyShardedDataParallel``: ZeRO stages 1 to 3 and torch FSDP2's ``fully_shard`` for
Flax NNX modules (or a Linen parameter pytree) with optax.

DDP's surface (``train_step(loss_fn, batch)``, ``.module``, ``state_dict``,
``load_state_dict``, ``no_sync``), with the parameters (stage 3), gradients (stage 2) and
optimizer state (stage 1) split over the group instead of replicated. See
``docs/fsdp.md`` for the decisions; the step is :mod:`jaxpg.fsdp.train_step`.

Example:
    >>> fsdp = FullyShardedDataParallel(model, optax.adam(1e-3), units=Block,
    ...                                 mp_policy=MixedPrecisionPolicy(jnp.bfloat16))
    >>> metrics = fsdp.train_step(loss_fn, {"x": x, "y": y})
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax

from jaxpg.data_parallel.leaf_split import LeafSplit, leaf_split_bytes, make_leaf_splits
from jaxpg.data_parallel.settle import settle_placement
from jaxpg.data_parallel.step_cache import StepCache
from jaxpg.data_parallel.zero import abstract_sharded_opt_state, init_sharded_opt_state
from jaxpg.ddp import param_sync
from jaxpg.fsdp import placement
from jaxpg.fsdp.collectives import Comm
from jaxpg.fsdp.mixed_precision import MixedPrecisionPolicy
from jaxpg.fsdp.model_parallel import compose_with_model_mesh, has_block_padding
from jaxpg.fsdp.shard_group import resolve_shard_group
from jaxpg.fsdp.train_step import StepMode, StepPlan, build_train_step
from jaxpg.fsdp.units import path_str, resolve_units, wrap_model
from jaxpg.supervision.step_recording import recorded_step

__all__ = ["FullyShardedDataParallel"]

_API = "FullyShardedDataParallel"
STATE_PARTS = ("params", "rest", "opt_state")


def _leaf_keys(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                 for k in path)


def _owners(params: Any, units: tuple[str, ...]) -> tuple[str, ...]:
    owners = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        dotted = path_str(_leaf_keys(path))
        owners.append(next((u for u in units if dotted.startswith(u + ".")), ""))
    return tuple(owners)


class FullyShardedDataParallel:
    """Sharded data parallelism of one model over a group (see the module docstring).

    Args:
        module: an ``nnx.Module``, or a parameter pytree (Linen's ``variables['params']``).
        optimizer: an ``optax.GradientTransformation``.
        group: ``None`` (the world), a ``ProcessGroup``, a 1-D ``DeviceMesh``, a 2-D
            ``DeviceMesh`` (HSDP: replicate over dim 0, shard over dim 1), a
            ``HybridCommunicateGroup`` (replicate over ``dp``, shard over ``sharding``) or
            a ``ParallelDims`` (replicate over ``dp_replicate``, shard over ``dp_shard``).
        device_mesh: torch's spelling of ``group`` (FSDP's ``device_mesh=``, fully_shard's
            ``mesh=``); pass one of them.
        zero_stage: 1 shards the optimizer state, 2 also the gradients, 3 (the default)
            also the parameters.
        stage: an alias of ``zero_stage`` (DeepSpeed's spelling); pass one of them.
        level: Paddle's ``group_sharded_parallel`` spelling of the stage: ``'os'`` (1),
            ``'os_g'`` (2) or ``'p_g_os'`` (3); an alias of ``zero_stage``.
        reshard_after_forward: stage 3: drop each unit's gathered parameters after its
            forward and gather them again for its backward (False: keep them).
        mp_policy: a :class:`MixedPrecisionPolicy` (None: compute in the stored dtypes).
        units: the submodules gathered one at a time (stage 3): module paths, a module
            class or a predicate ``(path, module) -> bool``; the root holds the rest.
        broadcast_params: start every rank from rank 0's parameters.
        donate: let the step reuse the state's buffers.
        context_parallel: context parallelism, as torchtitan's FSDP over ``dp_shard_cp``:
            the cp group (``mesh["cp"]``, a ``ParallelDims``) or a
            :class:`~jaxpg.context_parallel.SequenceSplit`. ``group`` must be the shard
            and cp dimensions flattened (``mesh["dp_shard", "cp"].flatten(...)``,
            ``dims["dp_shard_cp"]``); parameters are sharded over both, and each process
            passes its samples with whole sequences, laid out over cp as DDP's are.
        expert_axes: expert parallelism (``jaxpg.expert_parallel.MoELayer`` on a
            ``("dp", "ep")`` mesh, ``group`` its data-parallel ranks over both axes, e.g.
            the world or ``mesh["dp", "ep"].flatten()``): ``expert_axes=("ep",)``. The
            batch is split over both axes; parameters are sharded over the others, the
            experts on top of their ep split; the experts' gradients are averaged over
            those axes only, every other one over ep too (torchtitan's and Paddle's rule).

    Raises:
        TypeError: for a module, optimizer, policy or group of the wrong kind.
        ValueError: for a bad stage, contradicting options, ``units`` that match
            nothing, parameters that differ across ranks, or a group without a rank of
            this process.
    """

    def __init__(self, module: Any, optimizer: optax.GradientTransformation, *,
                 group: Any = None, zero_stage: int | None = None, stage: int | None = None,
                 level: str | None = None, reshard_after_forward: bool = True,
                 mp_policy: MixedPrecisionPolicy | None = None, units: Any = None,
                 broadcast_params: bool = True, donate: bool = True,
                 device_mesh: Any = None, context_parallel: Any = None,
                 expert_axes: tuple[str, ...] = ()) -> None:
        from jaxpg.context_parallel.sequence_split import resolve_sequence_split
        from jaxpg.groups.resolve import one_of

        group = one_of(_API, group=group, device_mesh=device_mesh)
        from jaxpg.data_parallel.zero import PADDLE_LEVELS, resolve_zero_stage

        if level is not None and level not in PADDLE_LEVELS:
            raise ValueError(f"{_API}: {level=} is not one of Paddle's levels "
                             f"{tuple(PADDLE_LEVELS)}; or pass zero_stage=1, 2 or 3.")
        stage = resolve_zero_stage(
            _API, (1, 2, 3), 3, zero_stage, hint=" Stage 0 (no sharding) is "
            "DistributedDataParallel's.", stage=stage,
            level=None if level is None else PADDLE_LEVELS[level])
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"{_API}: {reshard_after_forward=} must be a bool.")
        if stage != 3 and not reshard_after_forward:
            raise ValueError(
                f"{_API}: reshard_after_forward=False contradicts zero_stage={stage}: only "
                "stage 3 shards the parameters, so there is nothing to reshard; drop the option or "
                "use zero_stage=3."
            )
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"{_API}: mp_policy must be a MixedPrecisionPolicy or None, got "
                            f"{type(mp_policy).__name__}.")
        if isinstance(expert_axes, str) or not all(isinstance(a, str) for a in expert_axes):
            raise TypeError(f"{_API}: {expert_axes=} must be a tuple of axis names, e.g. "
                            "expert_axes=('ep',).")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"{_API}: optimizer must be an optax.GradientTransformation "
                            f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__}.")
        self.group = resolve_shard_group(group, _API)
        self.stage, self.optimizer, self.donate = stage, optimizer, donate
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        graphdef, params, rest = param_sync.split_model(module)
        sequence = None if context_parallel is None else \
            resolve_sequence_split(context_parallel, _API)
        self.group, self._model_layout = compose_with_model_mesh(
            self.group, group, params, rest, _API, sequence, tuple(expert_axes))
        signatures = param_sync.gather_param_signatures(params, self.group.process_group)
        param_sync.verify_param_shapes(signatures, list(self.group.process_group.ranks))
        self.units = resolve_units(module, units)
        self._graphdef = graphdef
        tp = self._model_layout
        self.layouts = make_leaf_splits(params, self.group.num_shards) if tp is None else \
            make_leaf_splits(params, self.group.num_shards, tp.param_specs, dict(tp.mesh.shape))
        owners = _owners(params, self.units)
        for unit in self.units:
            if unit not in owners:
                raise ValueError(f"{_API}: unit {unit!r} holds no parameter (nnx.Param); "
                                 "choose modules with parameters as units.")
        mesh, axes = self.group.mesh, self.group.shard_axes
        self.abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        if self.abstract:  # nnx.eval_shape's model: plan and measure, nothing allocated
            self.params, self.rest, self.opt_state, opt_shardings = self._abstract_state(
                params, rest)
        elif tp is not None:  # tensor parallel: each leaf keeps its layout on the mesh
            from jaxpg.ddp.step_mesh import place_on_step_mesh

            whole = place_on_step_mesh(params, tp.param_specs, tp, broadcast=broadcast_params)
            self.params = placement.shard_params(whole, self.layouts, mesh, axes) \
                if stage == 3 else whole
            self.rest = place_on_step_mesh(rest, tp.rest_specs, tp, broadcast=broadcast_params)
        else:
            whole = (self.group.replicate_from_rank0(params) if broadcast_params
                     else self._place_whole(params))
            self.params = placement.shard_params(whole, self.layouts, mesh, axes) \
                if stage == 3 else whole
            self.rest = self.group.replicate_from_rank0(rest)
        if not self.abstract:
            self.opt_state, opt_shardings = init_sharded_opt_state(
                optimizer, self.params, self.layouts, mesh, axes, params_padded=stage == 3)
            settle_placement((self.params, self.rest, self.opt_state))
        wrapped = None
        if graphdef is not None:
            wrap_root = mp_policy is not None
            wrapped = wrap_model(graphdef, (params, rest), self.units, wrap_root)
        self._plan = StepPlan(
            graphdef=wrapped, layouts=self.layouts, owners=owners,
            units=self.units, stage=stage,
            reshard_after_forward=reshard_after_forward,
            comm=Comm(axes, self.group.replicate_axes, self.group.size, self.mp_policy,
                      self.group.expert_axes),
            group=self.group, optimizer=optimizer, opt_shardings=opt_shardings,
            rest_specs=None if tp is None else tp.rest_specs)
        self.step = 0
        self._acc: Any = None
        self._no_sync = False
        self._compiled = StepCache(f"{_API}.train_step")

    def _abstract_state(self, params: Any, rest: Any) -> tuple[Any, Any, Any, Any]:
        mesh, axes = self.group.mesh, self.group.shard_axes
        replicated = self.group.sharding(jax.sharding.PartitionSpec())
        if self.stage == 3:
            structs = jax.tree.map(lambda lay: jax.ShapeDtypeStruct(
                lay.padded_shape, lay.dtype, sharding=self.group.sharding(lay.spec(axes))),
                self.layouts)
        else:
            structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=replicated), params)
        rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=replicated), rest)
        opt, shardings = abstract_sharded_opt_state(
            self.optimizer, structs, self.layouts, mesh, axes, params_padded=self.stage == 3)
        return structs, rest, opt, shardings

    def _place_whole(self, tree: Any) -> Any:
        replicated = self.group.sharding(jax.sharding.PartitionSpec())
        return jax.tree.map(lambda x: placement.fit_leaf(np.asarray(x), jax.ShapeDtypeStruct(
            np.shape(x), x.dtype, sharding=replicated)), tree)

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        """The number of ranks in the group (shards x replicas)."""
        return self.group.size

    @property
    def module(self) -> Any:
        """A new NNX module holding whole (gathered) copies of the parameters."""
        if self._graphdef is None:
            raise TypeError(f"{_API}.module: this FSDP wraps a parameter pytree; use "
                            ".full_params().")
        from flax import nnx

        rest = jax.tree.map(lambda x: x.copy(), self.rest)
        params = self.full_params()
        if self._model_layout is not None:  # the full, unsharded model (as DDP's)
            whole = self.group.sharding(jax.sharding.PartitionSpec())
            params, rest = jax.tree.map(lambda x: jax.device_put(x, whole), (params, rest))
        return nnx.merge(self._graphdef, params, rest)

    def full_params(self) -> Any:
        """The parameters as whole arrays (unpadded), replicated over the group (a
        tensor-parallel model's keep their tensor-parallel split)."""
        if self.stage == 3:
            return placement.gather_params(self.params, self.layouts, self.group.mesh)
        return jax.tree.map(lambda x: x.copy(), self.params)

    def describe(self) -> str:
        """A table of the units, their parameters, bytes per rank and padding."""
        leaves = jax.tree_util.tree_flatten_with_path(self.layouts)[0]
        rows = [f"{_API}: stage {self.stage}, {self.group.describe()}, "
                f"reshard_after_forward={self.reshard_after_forward}"]
        shape = dict(self.group.mesh.shape)
        by_unit: dict[str, list[LeafSplit]] = {}
        for owner, (_, lay) in zip(self._plan.owners, leaves, strict=True):
            by_unit.setdefault(owner or "<root>", []).append(lay)
        for unit, lays in by_unit.items():
            pad = sum(lay.padding for lay in lays)
            rows.append(f"  {unit}: {len(lays)} params, {leaf_split_bytes(lays, per_rank=False)} "
                        f"bytes, {leaf_split_bytes(lays, per_rank=True, mesh_shape=shape)} per "
                        "rank, "
                        f"{pad} padding rows")
        return "\n".join(rows)

    # ------------------------------------------------------------------ the step
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside add their local, unreduced gradients to a per-rank accumulator
        (as large as the parameters, as torch's); the next step outside reduces them."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def _step_fn(self, loss_fn: Callable[..., Any], mode: StepMode) -> Callable[..., Any]:
        def build() -> Callable[..., Any]:
            fn = build_train_step(loss_fn, self._plan, mode, donate=self.donate)
            # a launch is a recorded collective call on the group of the mesh's ranks:
            # numbered, in the flight recorder, and a hang inside names the ranks at fault
            return recorded_step(fn, self.group.process_group, name=f"{_API}.train_step")

        return self._compiled.get(loss_fn, mode, build)

    def train_step(self, loss_fn: Callable[..., Any], batch: Any, *,
                   has_aux: bool = False) -> dict[str, Any]:
        """Runs one step on this process's part of the global batch; returns the metrics.

        Args:
            loss_fn: ``loss_fn(model, batch)`` (NNX) or ``loss_fn(params, batch)``
                (parameter pytree) returning the mean loss over the rank's samples, or
                ``(loss, aux)`` with ``has_aux``. The compiled step is cached per function
                code and closure contents, so a fresh lambda of the same code reuses it.
            batch: a pytree of arrays, sample dimension first, divisible by this
                process's rank count.
            has_aux: ``loss_fn`` returns ``(loss, aux)``.

        Returns:
            ``{"loss": mean over ranks, "aux": ...}`` as arrays.
        """
        if self.abstract:
            raise RuntimeError(
                f"{_API}.train_step: this FSDP was built from an abstract model "
                "(nnx.eval_shape) to plan memory; build it from a real module to train."
            )
        mode = StepMode(sync=not self._no_sync, has_acc=self._acc is not None,
                        has_aux=has_aux)
        fn = self._step_fn(loss_fn, mode)
        out = fn(self.params, self.rest, self.opt_state, self._acc,
                 self.group.place_batch(batch))
        self.params, self.rest, self.opt_state, self._acc, metrics = out
        if mode.sync:
            self.step += 1
        return metrics

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The training state in its stored (sharded, padded) form, and the step."""
        if self._acc is not None:
            raise RuntimeError("state_dict: gradients accumulated under no_sync are pending; "
                               "take the state after a synchronising step.")
        return {"params": self.params, "rest": self.rest, "opt_state": self.opt_state,
                "step": self.step}

    def full_state_dict(self) -> dict[str, Any]:
        """The training state as whole (unpadded) arrays: DDP's layout, for a
        ``DistributedDataParallel`` of the same model and optimizer."""
        from jaxpg.fsdp.state_shapes import true_shapes, unpad_to

        self.check_resharding("full_state_dict")
        state = self.state_dict()
        shapes = true_shapes(self)
        parts = {k: state[k] for k in STATE_PARTS}
        leaves, treedef = jax.tree.flatten(parts)
        whole = [unpad_to(x, s, self.group.mesh) for x, s in zip(leaves, shapes, strict=True)]
        return {**jax.tree.unflatten(treedef, whole), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the training state by ``state``: this FSDP's :meth:`state_dict`, one
        saved at another world size or stage, or whole arrays (:meth:`full_state_dict`,
        a DDP's ``state_dict``); values are padded or cut on dim 0 and resharded.

        Raises:
            ValueError: if a part is missing, or names or shapes differ from this model's.
        """
        from jaxpg.fsdp.state_shapes import true_shapes

        missing = set((*STATE_PARTS, "step")) - set(state)
        if missing:
            raise ValueError(f"load_state_dict: state lacks {sorted(missing)}.")
        current = self.state_dict()
        targets = {k: current[k] for k in STATE_PARTS}
        given = {k: state[k] for k in STATE_PARTS}
        t_leaves, t_def = jax.tree_util.tree_flatten_with_path(targets)
        g_leaves, g_def = jax.tree_util.tree_flatten_with_path(given)
        if t_def != g_def:
            t_paths = [jax.tree_util.keystr(p) for p, _ in t_leaves]
            g_paths = [jax.tree_util.keystr(p) for p, _ in g_leaves]
            diff = next((i for i, (a, b) in enumerate(zip(g_paths, t_paths)) if a != b),
                        min(len(g_paths), len(t_paths)))
            raise ValueError(
                f"load_state_dict: the state holds {len(g_paths)} arrays, this model "
                f"{len(t_paths)}; the first difference is array {diff} "
                f"({g_paths[diff:diff + 1]} vs {t_paths[diff:diff + 1]}). Build the same "
                "model and optimizer as the state's."
            )
        shapes = true_shapes(self)
        new = []
        for (path, target), (_, value), true in zip(t_leaves, g_leaves, shapes, strict=True):
            got = tuple(np.shape(value))
            if got != tuple(target.shape):
                self.check_resharding("load_state_dict")
            placement.check_fits(jax.tree_util.keystr(path), got,
                                 true if got == tuple(target.shape) else None, true,
                                 "load_state_dict")
            new.append(placement.fit_leaf(value, target))
        loaded = jax.tree.unflatten(t_def, new)
        self.params, self.rest, self.opt_state = (loaded[k] for k in STATE_PARTS)
        self.step = int(state["step"])
        self._acc = None

    def check_resharding(self, what: str) -> None:
        """Raises if the stored form cannot be converted to whole arrays by cutting dim 0.

        A tensor-parallel parameter split on its sharded dimension (a row-parallel
        kernel) whose blocks do not divide by the shard count holds zero rows *inside*
        the array, one run per block; whole-array checkpoints and loading at another
        world size only cut or pad the end.

        Raises:
            ValueError: naming ``what`` and the way out.
        """
        if has_block_padding(self.layouts):
            raise ValueError(
                f"{what}: this tensor-parallel model has parameters whose tensor-parallel "
                f"blocks are padded to a multiple of the {self.group.num_shards} shards "
                "(a row-parallel dimension / tp not divisible by the dp size); converting "
                "them to whole arrays or another world size is not supported. Save with "
                "state_dict() / save_checkpoint(full=False) and load onto the same layout, "
                "or choose sizes whose tensor-parallel blocks divide by the dp size."
            )

    def __repr__(self) -> str:
        return (f"{_API}(zero_stage={self.stage}, {self.group.describe()}, "
                f"units={len(self.units)}, step={self.step})")
