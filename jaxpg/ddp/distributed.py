"""``DistributedDataParallel`` for Flax NNX modules (or a Linen parameter pytree) with optax.

torch's DDP wraps a module whose ``backward`` triggers bucketed all-reduces; jaxpg's is a
holder of replicated state plus a jitted :meth:`train_step` (see
:mod:`jaxpg.ddp.train_step`): per-rank loss and gradients, the bucketed reducer with a
communication hook, then the optax update, all in one ``shard_map`` over the group.

Decisions (the full table is in ``docs/ddp.md``):

- **Models.** An ``nnx.Module`` is split into ``graphdef``, parameters (``nnx.Param``) and
  the rest (BatchNorm statistics, RNG state); ``loss_fn(model, batch)`` gets the merged
  module. Any other pytree is a *parameter pytree*, which is how Linen is supported: pass
  ``variables["params"]`` and a ``loss_fn(params, batch)`` calling ``model.apply``.
- **Construction** checks every rank's parameter shapes and dtypes (naming the first that
  differs and the ranks) and replicates rank 0's values over ``pg.mesh`` (``P()``).
- **Batches** are this process's part of the global batch, samples first; rank ``i`` of the
  group trains on the ``i``-th equal slice of what its process passes.
- **Hook state** is per rank, stacked on a leading rank axis laid out ``P(axis)``.
- **no_sync** sums local gradients over micro-steps (torch's ``.grad`` accumulation); the
  first step outside reduces once and steps the optimizer.
- :attr:`module` is a new NNX module with a *copy* of the state (steps donate buffers).
- **Tensor-parallel models** (arrays laid out on a larger mesh, e.g. by
  ``jaxpg.tensor_parallel.parallelize_module`` on a ``("dp", "tp")`` DeviceMesh): the group
  must be one dimension of that mesh, and the step runs over the whole mesh with the arrays'
  layouts (:mod:`jaxpg.ddp.step_mesh`).

Example:
    >>> ddp = DistributedDataParallel(model, optax.adam(1e-3))
    >>> def loss_fn(model, batch):
    ...     logits = model(batch["x"])
    ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    >>> metrics = ddp.train_step(loss_fn, {"x": x, "y": y})
    >>> float(metrics["loss"])
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.leaf_split import make_leaf_splits
from jaxpg.data_parallel.settle import settle_placement
from jaxpg.data_parallel.step_cache import StepCache
from jaxpg.data_parallel.zero import init_sharded_opt_state, resolve_zero_stage
from jaxpg.ddp import param_sync
from jaxpg.ddp.bucket_plan import BucketPlan, make_bucket_plan
from jaxpg.ddp.comm_hooks import make_comm_hook
from jaxpg.ddp.join import Join
from jaxpg.ddp.step_mesh import (
    StepMesh,
    dense_leaves,
    place_on_step_mesh,
    place_per_rank,
    place_step_batch,
    step_mesh,
)
from jaxpg.ddp.train_step import REDUCTIONS, StepMode, ZeroSharding, build_train_step
from jaxpg.supervision.step_recording import recorded_step

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel:
    """Data-parallel training of one model over a process group.

    Args:
        module: an ``nnx.Module``, or a parameter pytree (Linen's ``variables['params']``).
        optimizer: an ``optax.GradientTransformation``.
        group: the group to average over: a ProcessGroup, a 1-D DeviceMesh (``mesh["dp"]``,
            ``ParallelDims(...)["dp"]``) or None for the world.
        device_mesh: torch's spelling of ``group`` (a 1-D DeviceMesh); pass one of them.
        bucket_cap_mb: gradient bucket cap in MiB (torch's default 25).
        first_bucket_mb: size of the first bucket in MiB (torch's default 1).
        comm_hook: ``None`` (average), a hook name (``'allreduce'``, ``'fp16_compress'``,
            ``'bf16_compress'``, ``'noop'``, ``'powerSGD'``) or a hook callable
            ``hook(state, GradBucket) -> (buffer, state)``.
        comm_hook_config: keyword arguments for the hook (``PowerSGDConfig`` fields for
            ``'powerSGD'``; ``init_state_fn`` for a callable).
        broadcast_params: make every rank start from rank 0's parameters.
        reduction: ``'buckets'`` (the reducer and hook) or ``'fused_pmean'`` (one
            ``pmean`` per gradient, no hook; a baseline for benchmarks).
        donate: let the step reuse the state's buffers (on CPU the step is compiled with
            XLA's region-based copy insertion, so donated parameters are updated in place
            instead of copied first).
        zero_stage: 0 (the default: everything replicated) or 1, ZeRO-1 as torch's
            ``ZeroRedundancyOptimizer``: the optimizer state is split on dim 0 over the group
            (padded to a multiple of the rank count, :mod:`jaxpg.data_parallel.zero`), the
            gradients are still reduced by the bucketed reducer and its hook, each rank
            steps its shard, and the new parameters are all-gathered. ``opt_state`` then
            holds sharded global arrays. Stages 2 and 3 are ``FullyShardedDataParallel``'s.
        shard_optimizer_state: ``True`` is ``zero_stage=1`` (an alias; pass one of them).
        expert_axes: expert parallelism (``jaxpg.expert_parallel.MoELayer`` on a
            ``("dp", "ep")`` mesh, DDP over the whole mesh: ``expert_axes=("ep",)``): the
            data-parallel axes that parameters (the experts) may be split over. The batch
            is split over every data-parallel axis; an expert's gradient is summed over
            the data-parallel axes that replicate it only (its ``all_to_all`` already
            brought it the gradients of every token of its ep group) and divided by the
            group's size, like every other gradient. The experts' gradients skip the
            buckets and the hook (one ``psum``); ZeRO-1 does not take expert parameters.
        context_parallel: context parallelism (torch's ``context_parallel`` buffers, as
            torchtitan composes it with DDP): the cp group (``mesh["cp"]``, a
            ``ParallelDims``) or a :class:`~jaxpg.context_parallel.SequenceSplit`. The
            step runs over the cp group's mesh, ``group`` must span cp and the
            data-parallel axes (``mesh["dp", "cp"].flatten("dp_cp")``, ``dims["dp_cp"]``),
            and each process passes its samples with whole sequences: every leaf's
            sequence dimension (1 by default) is laid out load-balanced over cp (by
            default), the samples over the other axes. Put the position ids in the batch.

    Raises:
        TypeError: for a module or optimizer of the wrong kind.
        ValueError: if parameter shapes differ across ranks, or for bad options.
    """

    def __init__(
        self,
        module: Any,
        optimizer: optax.GradientTransformation,
        *,
        group: Any = None,
        bucket_cap_mb: float = 25,
        first_bucket_mb: float = 1,
        comm_hook: Any = None,
        comm_hook_config: dict[str, Any] | None = None,
        broadcast_params: bool = True,
        reduction: str = "buckets",
        donate: bool = True,
        zero_stage: int | None = None,
        shard_optimizer_state: bool | None = None,
        device_mesh: Any = None,
        expert_axes: tuple[str, ...] = (),
        context_parallel: Any = None,
    ) -> None:
        from jaxpg.context_parallel.sequence_split import resolve_sequence_split
        from jaxpg.groups.resolve import one_of, resolve_group

        api = "DistributedDataParallel"
        given = one_of(api, group=group, device_mesh=device_mesh)
        if context_parallel is not None and getattr(given, "ndim", 1) > 1:
            from jaxpg.ddp.step_mesh import cp_group_fix

            raise ValueError(
                f"{api}: group={given!r} with context_parallel=: DDP averages over one "
                "dimension; pass the data-parallel and cp dimensions flattened, e.g. "
                f"{cp_group_fix('dp_cp', tuple(given.mesh_dim_names))}.")
        self.group = resolve_group(given, api=api)
        if not self.group.local_members():
            raise ValueError(
                f"DistributedDataParallel: this process holds no rank of {self.group!r}; "
                "only members of the group may wrap a model for it."
            )
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                "DistributedDataParallel: optimizer must be an optax.GradientTransformation "
                f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__}."
            )
        if reduction not in REDUCTIONS:
            raise ValueError(f"DistributedDataParallel: {reduction=} must be one of {REDUCTIONS}.")
        if reduction == "fused_pmean" and comm_hook is not None:
            raise ValueError(
                f"DistributedDataParallel: reduction='fused_pmean' uses no hook; got {comm_hook=}."
            )
        if shard_optimizer_state is not None and not isinstance(shard_optimizer_state, bool):
            raise TypeError(f"DistributedDataParallel: {shard_optimizer_state=} must be a bool.")
        zero_stage = resolve_zero_stage(
            api, (0, 1), 0, zero_stage,
            hint=" ZeRO-2 and -3 are FullyShardedDataParallel(..., zero_stage=2 or 3).",
            shard_optimizer_state=None if shard_optimizer_state is None
            else int(shard_optimizer_state))
        shard_optimizer_state = zero_stage == 1
        self.optimizer = optimizer
        self.reduction = reduction
        self.donate = donate
        self._graphdef, params, rest = param_sync.split_model(module)
        if isinstance(expert_axes, str) or not all(isinstance(a, str) for a in expert_axes):
            raise TypeError(f"DistributedDataParallel: {expert_axes=} must be a tuple of axis "
                            "names, e.g. expert_axes=('ep',).")
        sequence = None if context_parallel is None else \
            resolve_sequence_split(context_parallel, api)
        self.step_mesh: StepMesh = step_mesh(self.group, params, rest,
                                              expert_axes=tuple(expert_axes),
                                              sequence=sequence)
        signatures = param_sync.gather_param_signatures(params, self.group)
        param_sync.verify_param_shapes(signatures, list(self.group.ranks))
        local = self.step_mesh.local_struct(params, self.step_mesh.param_specs)
        dense = dense_leaves(local, self.step_mesh)  # the experts go by their own axes
        self.bucket_plan: BucketPlan = make_bucket_plan(dense, bucket_cap_mb, first_bucket_mb)
        if shard_optimizer_state and dense is not local:
            raise ValueError(
                "DistributedDataParallel: zero_stage=1 (ZeRO-1) does not take "
                f"expert parameters (split over expert_axes={tuple(expert_axes)}); leave it "
                "at 0, or use FullyShardedDataParallel for the dense part.")
        self._opt_specs: Any = None
        if self.step_mesh.sharded:  # laid out on a larger mesh (tensor parallel)
            self.params = place_on_step_mesh(params, self.step_mesh.param_specs, self.step_mesh,
                                          broadcast=broadcast_params)
            self.rest = place_on_step_mesh(rest, self.step_mesh.rest_specs, self.step_mesh,
                                        broadcast=broadcast_params)
        else:
            self.params = param_sync.replicate_from_rank0(params, self.group,
                                                          broadcast=broadcast_params)
            self.rest = param_sync.replicate_from_rank0(rest, self.group,
                                                        broadcast=broadcast_params)
        self._zero: ZeroSharding | None = None
        if shard_optimizer_state:
            self.opt_state, self._zero = self._init_zero_opt_state()
        elif self.step_mesh.sharded:
            self.opt_state, self._opt_specs = self._init_sharded_opt_state()
        else:
            replicated = NamedSharding(self.group.mesh, P())
            self.opt_state = jax.jit(optimizer.init, out_shardings=replicated)(self.params)
        self._comm_hook, init_state = make_comm_hook(comm_hook or "allreduce",
                                                     **(comm_hook_config or {}))
        self.hook_state = self._per_rank(init_state(self.bucket_plan))
        settle_placement((self.params, self.rest, self.opt_state, self.hook_state))
        self.step = 0
        self._acc: Any = None
        self._no_sync = False
        self._join: Join | None = None
        self._last_batch: Any = None
        self._last_loss: tuple[Callable[..., Any], bool] | None = None
        self._compiled = StepCache("DistributedDataParallel.train_step")

    def _init_zero_opt_state(self) -> tuple[Any, ZeroSharding]:
        """ZeRO-1's optimizer state: split on dim 0 over the data-parallel axes, on top of
        any tensor-parallel split of the parameter it follows (:mod:`jaxpg.data_parallel.zero`)."""
        lay = self.step_mesh
        axes = lay.dp_axes
        if lay.sharded:
            layouts = make_leaf_splits(self.params, self.group.size(), lay.param_specs,
                                   dict(lay.mesh.shape))
        else:
            layouts = make_leaf_splits(self.params, self.group.size())
        opt_state, shardings = init_sharded_opt_state(
            self.optimizer, self.params, layouts, lay.mesh, axes, params_padded=False)
        return opt_state, ZeroSharding(layouts=layouts, mesh=lay.mesh, axes=axes,
                                       opt_shardings=shardings)

    def _init_sharded_opt_state(self) -> tuple[Any, Any]:
        """The optimizer state laid out as the parameters it follows (the rest replicated)."""
        mesh = self.step_mesh.mesh
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.step_mesh.param_specs)
        struct = jax.eval_shape(self.optimizer.init, self.params)
        try:
            opt_shardings = optax.tree_map_params(
                self.optimizer, lambda _, s: s, struct, shardings,
                transform_non_params=lambda _: NamedSharding(mesh, P()))
        except Exception as err:
            raise ValueError(
                "DistributedDataParallel: cannot tell which parts of the optimizer state "
                "follow the parameters' tensor-parallel layout (optax.tree_map_params failed: "
                f"{err}); use an optimizer built from optax's transformations."
            ) from err
        opt_state = jax.jit(self.optimizer.init, out_shardings=opt_shardings)(self.params)
        return opt_state, jax.tree.map(lambda s: s.spec, opt_shardings)

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        """The number of ranks in the DDP group."""
        return self.group.size()

    @property
    def _all_local(self) -> bool:
        return param_sync.all_local(self.group)

    @property
    def module(self) -> Any:
        """A new NNX module holding a copy of the current state (NNX only)."""
        if self._graphdef is None:
            raise TypeError(
                "DistributedDataParallel.module: this DDP wraps a parameter pytree; use .params."
            )
        from flax import nnx

        if self.step_mesh.sharded:  # the full arrays, gathered (every process must call this)
            whole = NamedSharding(self.step_mesh.mesh, P())
            copy = jax.tree.map(lambda x: jax.device_put(x, whole).copy(),
                                (self.params, self.rest))
        else:
            copy = jax.tree.map(lambda x: x.copy(), (self.params, self.rest))
        return nnx.merge(self._graphdef, *copy)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module's forward with the current parameters, as torch's DDP
        forwards: ``ddp(x)`` is ``module(x)`` (NNX modules).

        It runs on this process's own replica (its first device), on its own input, with no
        communication: every rank holds the same parameters after each step. Training goes
        through :meth:`train_step`; state a forward changes (BatchNorm statistics in
        training mode, RNG counts) is not kept, unlike torch's forward, which writes its
        buffers. A parameter pytree (Linen) has no forward to call: use
        ``model.apply({"params": ddp.params}, x)``.
        """
        if self._graphdef is None:
            raise TypeError(
                "DistributedDataParallel: this DDP wraps a parameter pytree (Linen), which has "
                "no forward of its own; call model.apply({'params': ddp.params}, x).")
        if self.step_mesh.sharded:  # one device holds only its shard of the model
            raise NotImplementedError(
                "DistributedDataParallel.__call__: this model is split over more axes than the "
                f"data-parallel group's ({self.step_mesh.mesh.axis_names}, tensor parallelism), "
                "so no one device holds a replica to run the forward on; use ddp.module(x) "
                "(the whole model, gathered), or run the forward inside your own SPMD code."
            )
        from flax import nnx

        def local(leaf: Any) -> Any:
            return leaf.addressable_data(0) if isinstance(leaf, jax.Array) else leaf

        params, rest = jax.tree.map(local, (self.params, self.rest))
        return nnx.merge(self._graphdef, params, rest)(*args, **kwargs)

    def _per_rank(self, tree: Any) -> Any:
        if tree is None:
            return None
        if self.step_mesh.sharded:
            return place_per_rank(tree, self.step_mesh)
        return param_sync.per_rank(tree, self.group)

    def _shard_batch(self, batch: Any) -> Any:
        if self.step_mesh.sharded:
            return place_step_batch(batch, self.step_mesh)
        return param_sync.shard_batch(batch, self.group)

    # ------------------------------------------------------------------ configuration
    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """torch's ``register_comm_hook``: ``hook(state, GradBucket) -> (buffer, state)``.

        ``state`` is one rank's initial hook state (``None`` for stateless hooks); every
        rank starts from a copy. Register before the first step.
        """
        if self.step or self._acc is not None or self._compiled:
            raise RuntimeError(
                "register_comm_hook must be called before the first train_step, as in torch."
            )
        if not callable(hook):
            raise TypeError(f"register_comm_hook: {hook=} must be callable.")
        if self.reduction != "buckets":
            raise ValueError("register_comm_hook needs reduction='buckets'.")
        self._comm_hook = hook
        self.hook_state = self._per_rank(state)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside accumulate local gradients; the next step outside reduces them."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """The uneven-inputs context (torch's ``ddp.join()``); see :mod:`jaxpg.ddp.join`."""
        if self.step_mesh.sharded:
            raise ValueError(
                "DistributedDataParallel.join: uneven inputs are not supported for a model "
                "laid out on a tensor-parallel mesh; give every data-parallel replica the same "
                "number of batches (DistributedSampler(..., drop_last=True))."
            )
        return Join(
            self,
            enable=enable,
            divide_by_initial_world_size=divide_by_initial_world_size,
            throw_on_early_termination=throw_on_early_termination,
        )

    # ------------------------------------------------------------------ the step
    def _step_fn(self, loss_fn: Callable[..., Any], mode: StepMode) -> Callable[..., Any]:
        def build() -> Callable[..., Any]:
            fn = build_train_step(
                loss_fn, graphdef=self._graphdef, optimizer=self.optimizer,
                plan=self.bucket_plan, comm_hook=self._comm_hook, pg=self.group, mode=mode,
                reduction=self.reduction, donate=self.donate,
                step_mesh=self.step_mesh if self.step_mesh.sharded else None,
                opt_specs=self._opt_specs, zero=self._zero,
            )  # fmt: skip
            # a launch is a recorded collective call on the group: numbered, in the flight
            # recorder, and a hang inside names the ranks that never started it
            return recorded_step(fn, self.group, name="DistributedDataParallel.train_step")

        return self._compiled.get(loss_fn, mode, build)

    def _active_flags(self, active: Any) -> Any:
        n_local = len(self.group.local_members())
        flags = np.asarray(active, dtype=bool).reshape(-1)
        if flags.shape != (n_local,):
            raise ValueError(
                f"train_step: active={active!r} must hold one bool per rank of the group in "
                f"this process ({n_local})."
            )
        return self._shard_batch(flags)

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        batch: Any,
        *,
        has_aux: bool = False,
        active: Any = None,
    ) -> dict[str, Any]:
        """Runs one step on this process's part of the global batch; returns the metrics.

        Args:
            loss_fn: ``loss_fn(model, batch)`` (NNX) or ``loss_fn(params, batch)``
                (parameter pytree) returning the mean loss over the rank's samples, or
                ``(loss, aux)`` with ``has_aux``. The compiled step is cached per function
                code and closure contents (:func:`~jaxpg.data_parallel.step_cache.function_key`), so
                a fresh lambda of the same code each step reuses it.
            batch: a pytree of arrays, sample dimension first, divisible by this
                process's rank count; ``None`` inside :meth:`join` when this process is
                out of data (a shadow step on zeros).
            has_aux: ``loss_fn`` returns ``(loss, aux)``.
            active: inside :meth:`join`, one flag per local rank (False: out of data).

        Returns:
            ``{"loss": mean over active ranks, "num_active": int, "aux": ...}`` as arrays.
        """
        join = self._join
        if (batch is None or active is not None) and join is None:
            raise ValueError(
                "train_step: batch=None and active= describe uneven inputs; call them inside "
                "`with ddp.join():`."
            )
        if batch is None:
            if self._last_batch is None:
                raise ValueError(
                    "train_step(batch=None): this process has not run a step yet, so the "
                    "shape of the zeros to shadow with is unknown; run one step first."
                )
            batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), self._last_batch)
            active = [False] * len(self.group.local_members())
        else:
            self._last_batch = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch
            )
        self._last_loss = (loss_fn, has_aux)
        if join is not None and active is None:
            active = [True] * len(self.group.local_members())
        mode = StepMode(
            sync=not self._no_sync,
            has_acc=self._acc is not None,
            join=join is not None,
            divide_by_initial_world_size=join is None or join.divide_by_initial_world_size,
            throw_on_early_termination=join is not None and join.throw_on_early_termination,
            has_aux=has_aux,
        )
        fn = self._step_fn(loss_fn, mode)
        flags = None if join is None else self._active_flags(active)
        out = fn(self.params, self.rest, self.opt_state, self.hook_state, self._acc,
                 self._shard_batch(batch), flags)
        self.params, self.rest, self.opt_state, self.hook_state, self._acc, metrics = out
        if mode.sync:
            self.step += 1
        if join is not None:
            join.observe(int(metrics["num_active"]))
        return metrics

    def _shadow_step(self) -> None:
        """One step with every local rank inactive (see :mod:`jaxpg.ddp.join`)."""
        if self._last_loss is None:
            raise RuntimeError(
                "join: this process ran no step, so it cannot shadow the others' steps; "
                "give every process at least one batch."
            )
        loss_fn, has_aux = self._last_loss
        self.train_step(loss_fn, None, has_aux=has_aux)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The training state: params, rest, opt_state, hook_state (per rank) and step."""
        if self._acc is not None:
            raise RuntimeError(
                "state_dict: gradients accumulated under no_sync are pending; take the "
                "state after a synchronising step."
            )
        return {
            "params": self.params,
            "rest": self.rest,
            "opt_state": self.opt_state,
            "hook_state": self.hook_state,
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the training state by ``state`` (as :meth:`state_dict` returns)."""
        missing = {"params", "rest", "opt_state", "hook_state", "step"} - set(state)
        if missing:
            raise ValueError(f"load_state_dict: state lacks {sorted(missing)}.")
        for name in ("params", "rest", "opt_state", "hook_state"):
            old, new = jax.tree.structure(getattr(self, name)), jax.tree.structure(state[name])
            if old != new:
                raise ValueError(
                    f"load_state_dict: {name} has structure {new}, this model's is {old}; "
                    "build the same model, optimizer and hook before loading."
                )
            setattr(self, name, state[name])
        self.step = int(state["step"])
        self._acc = None

    def __repr__(self) -> str:
        return (
            f"DistributedDataParallel(group={self.group!r}, buckets={len(self.bucket_plan)}, "
            f"reduction={self.reduction!r}, zero_stage={int(self._zero is not None)}, "
            f"step={self.step})"
        )
