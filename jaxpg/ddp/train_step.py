"""The DDP training step: one jitted ``shard_map`` over the group's mesh.

Per rank (axis ``pg.axis_name``), the step

1. takes the replicated parameters ``P()`` and this rank's slice of the batch ``P(axis)``;
2. computes the local loss and gradients (``jax.value_and_grad``; for an NNX module the
   parameters are merged back into the module with ``nnx.merge``);
3. adds the gradients accumulated under ``no_sync`` (a per-rank buffer, ``P(axis)``);
4. reduces the gradients bucket by bucket through the communication hook
   (:func:`~jaxpg.ddp.reduce_gradients`), or with one ``pmean`` per leaf
   (``reduction='fused_pmean'``);
5. applies the optax update, identically on every rank, so the new parameters and
   optimizer state stay replicated.

Inside ``loss_fn``, ``jaxpg.get_rank()`` is the traced rank and jaxpg collectives lower
to ``lax`` collectives on the group's axis, as in ``jaxpg.spmd``. Module RNG state is
replicated, so a module's dropout draws the same mask on every rank (each on its own data);
fold ``jaxpg.get_rank()`` into a key in ``loss_fn`` for per-rank masks.

The step runs under ``shard_map(check_vma=False)``: gradients taken *inside* the per-rank
function are the local ones (with ``check_vma=True`` JAX would insert the ``psum`` itself
when differentiating a replicated input), and the reducer is the only place gradients are
communicated.

Non-parameter module state (BatchNorm statistics, RNG counters) leaves the step with rank
0's values, as torch's ``broadcast_buffers=True`` broadcasts rank 0's buffers at every
forward. With synchronised BatchNorm (:func:`~jaxpg.ddp.convert_sync_batchnorm`) the
statistics are already equal on every rank.

Under ``join`` each rank also gets an ``active`` flag. An inactive rank (out of data) runs
the step on zeros and contributes zero gradients, a zero loss weight, and a zero to
``num_active``; the gradient average divides by the initial world size, or with
``divide_by_initial_world_size=False`` by the number of active ranks. A step in which no
rank is active (or, with ``throw_on_early_termination``, not every rank) leaves the
parameters, optimizer and hook state unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxpg.data_parallel.grad_norm import global_grad_norm
from jaxpg.data_parallel.local_loss import local_loss
from jaxpg.data_parallel.loss_check import LossCheck
from jaxpg.data_parallel.zero import sharded_update
from jaxpg.ddp._axis import axis_size
from jaxpg.ddp.bucket_plan import BucketPlan
from jaxpg.ddp.comm_hooks import CommHook
from jaxpg.ddp.reducer import fused_pmean, reduce_gradients
from jaxpg.ddp.step_mesh import dense_leaves, with_experts_reduced

__all__ = ["StepMode", "ZeroSharding", "build_train_step", "REDUCTIONS"]

REDUCTIONS = ("buckets", "fused_pmean")

CPU_COMPILER_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
"""XLA options of the DDP step on CPU. With its default copy insertion, XLA:CPU copies each
donated parameter that the backward reads before the update may overwrite it in place; the
region-based analysis sees that the reads come first and drops the copies."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMode:
    """The static switches of one compiled step (each combination compiles once).

    Attributes:
        sync: reduce and apply the optimizer (False: accumulate locally, ``no_sync``).
        has_acc: a ``no_sync`` accumulator is passed in and added to the gradients.
        join: per-rank ``active`` flags are passed in (uneven inputs).
        divide_by_initial_world_size: under ``join``, average over all ranks (True) or
            over the active ones (False).
        throw_on_early_termination: under ``join``, skip the update unless every rank is
            active (the host then raises).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is averaged over active ranks.
    """

    sync: bool = True
    has_acc: bool = False
    join: bool = False
    divide_by_initial_world_size: bool = True
    throw_on_early_termination: bool = False
    has_aux: bool = False


def _from_rank0(tree: Any, axis: str) -> Any:
    if axis_size(axis) == 1:
        return tree
    first = jax.lax.axis_index(axis) == 0

    def pick(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) or x.dtype == jnp.bool_:
            return x
        return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axis)

    return jax.tree.map(pick, tree)


def _select(pred: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def build_train_step(
    loss_fn: Callable[..., Any],
    *,
    graphdef: Any,
    optimizer: optax.GradientTransformation,
    plan: BucketPlan,
    comm_hook: CommHook,
    pg: Any,
    mode: StepMode,
    reduction: str = "buckets",
    donate: bool = True,
    step_mesh: Any = None,
    opt_specs: Any = None,
    zero: ZeroSharding | None = None,
) -> Callable[..., Any]:
    """Returns the jitted step.

    ``step(params, rest, opt_state, hook_state, acc, batch, active)`` returns
    ``(params, rest, opt_state, hook_state, acc, metrics)``. ``params``, ``rest`` and
    ``opt_state`` are replicated (``P()``); ``hook_state``, ``acc`` and ``active`` carry a
    leading rank axis (``P(axis)``); the batch is split on its leading dimension (and on
    its sequence dimension over cp with ``step_mesh.sequence``). ``acc``
    is ``None`` unless ``mode.has_acc``; the returned ``acc`` is ``None`` unless
    ``mode.sync`` is False. ``metrics`` holds ``loss`` (mean over active ranks),
    ``num_active``, ``grad_norm`` (the global L2 norm of the averaged gradients, over every
    parameter's whole gradient whatever its layout; synchronising steps only) and, with
    ``has_aux``, ``aux``.

    Args:
        loss_fn: ``loss_fn(model, batch)`` for NNX (``graphdef`` given) or
            ``loss_fn(params, batch)`` for a parameter pytree; returns the scalar mean loss
            over the rank's batch (or ``(loss, aux)`` with ``mode.has_aux``).
        graphdef: the NNX graph definition, or None for a parameter pytree.
        optimizer: the optax transformation.
        plan: the bucket plan of the parameters.
        comm_hook: the communication hook.
        pg: the DDP process group.
        mode: the static switches.
        reduction: ``'buckets'`` (the reducer and hook) or ``'fused_pmean'``.
        donate: donate the state buffers to the step. On CPU the step is compiled with
            XLA's region-based copy insertion (``xla_cpu_copy_insertion_use_region_analysis``):
            with the default analysis XLA:CPU copies every donated parameter the backward
            still reads (80 MB a step for the 25M-parameter benchmark MLP) so that the
            update can write in place (docs/design.md, "CPU all_reduce: where the time goes").
        step_mesh: a :class:`~jaxpg.ddp.step_mesh.StepMesh` for state laid out on a larger
            mesh (tensor parallelism): the step runs over that mesh, parameters keep their
            specs, and gradients are reduced over its data-parallel axes (an expert
            parameter's over those that replicate it). None: the group's own mesh,
            everything replicated.
        opt_specs: the optimizer state's ``PartitionSpec`` tree, with ``step_mesh``.
        zero: ZeRO-1 (``zero_stage=1``): the optimizer state is split over
            the group (:mod:`jaxpg.data_parallel.zero`; with ``step_mesh``, over its
            data-parallel axes on top of each parameter's tensor-parallel split) and never
            enters the ``shard_map``; the per-rank function returns the reduced gradients,
            and the update runs on the global arrays after it, each rank stepping its
            shard, then the new parameters are all-gathered.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"{reduction=} must be one of {REDUCTIONS}.")
    mesh = pg.mesh if step_mesh is None else step_mesh.mesh
    axis = pg.axis_name if step_mesh is None else step_mesh.axis
    n = pg.size()
    # XLA:CPU merges a step's all-reduces into one after the backward anyway (its
    # all-reduce combiner), so flat bucket buffers only add copies there: on CPU the
    # default hook reduces each bucket's gradients as they are (docs/design.md, "CPU
    # all_reduce: where the time goes"; custom hooks still get flat buffers).
    on_cpu = pg.mesh.devices.flat[0].platform == "cpu"
    # the first trace checks that the loss depends on the parameters (then no cost)
    loss_check = LossCheck(loss_fn, api="DistributedDataParallel.train_step",
                           model="model" if graphdef is not None else "parameter")

    def body(params, rest, opt_state, hook_state, acc, batch, active):
        # opt_state is None under ZeRO-1: the update then runs after the shard_map.
        hook_state = jax.tree.map(lambda x: x[0], hook_state)
        acc = jax.tree.map(lambda x: x[0], acc)
        if mode.join:
            on = active[0]
            batch = jax.tree.map(lambda x: jnp.where(on, x, jnp.zeros_like(x)), batch)
            weight = on.astype(jnp.float32)
        else:
            weight = jnp.float32(1)
        (loss, (aux, new_rest)), grads = loss_check.value_and_grad(
            lambda p: local_loss(loss_fn, graphdef, p, rest, batch, mode.has_aux), params)
        if mode.join:
            grads = jax.tree.map(lambda g: jnp.where(on, g, jnp.zeros_like(g)), grads)
        if acc is not None:
            grads = jax.tree.map(jnp.add, grads, acc)
        n_active = jax.lax.psum(weight, axis)
        denom = jnp.maximum(n_active, 1.0)
        metrics = {
            "loss": jax.lax.psum(loss.astype(jnp.float32) * weight, axis) / denom,
            "num_active": n_active.astype(jnp.int32),
        }
        if mode.has_aux:
            metrics["aux"] = jax.tree.map(
                lambda a: jax.lax.psum(jnp.asarray(a, jnp.float32) * weight, axis) / denom, aux
            )
        new_rest = _from_rank0(new_rest, axis)
        if not mode.sync:
            expand = jax.tree.map(lambda x: x[None], (hook_state, grads))
            return params, new_rest, opt_state, expand[0], expand[1], metrics

        dense = dense_leaves(grads, step_mesh)  # expert parameters go by their own axes
        if reduction == "fused_pmean":
            reduced, new_hook = fused_pmean(dense, axis), hook_state
        else:
            reduced, new_hook = reduce_gradients(dense, plan, axis, comm_hook, hook_state,
                                                 flat_buffers=not on_cpu)
        reduced = with_experts_reduced(grads, reduced, step_mesh, n)
        if mode.join and not mode.divide_by_initial_world_size:
            scale = n / denom
            reduced = jax.tree.map(lambda g: g * scale.astype(g.dtype), reduced)
        specs = None if step_mesh is None else step_mesh.param_specs
        metrics["grad_norm"] = global_grad_norm(reduced, specs)
        apply = n_active >= (n if mode.throw_on_early_termination else 1)
        if zero is not None:  # ZeRO-1: the caller steps the sharded state
            if mode.join:
                new_hook = _select(apply, new_hook, hook_state)
            new_hook = jax.tree.map(lambda x: x[None], new_hook)
            return reduced, new_rest, apply, new_hook, None, metrics
        updates, new_opt = optimizer.update(reduced, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if mode.join:
            new_params = _select(apply, new_params, params)
            new_opt = _select(apply, new_opt, opt_state)
            new_hook = _select(apply, new_hook, hook_state)
        new_hook = jax.tree.map(lambda x: x[None], new_hook)
        return new_params, new_rest, new_opt, new_hook, None, metrics

    def body_in_context(*args):
        # jaxpg collectives and jaxpg.get_rank() inside loss_fn lower onto this mesh.
        from jaxpg.spmd_lowering import SpmdContext

        with SpmdContext(mesh, pg._world):
            return body(*args)

    rank_axis = P(axis) if step_mesh is None else step_mesh.rank_spec
    params_spec = P() if step_mesh is None else step_mesh.param_specs
    rest_spec = P() if step_mesh is None else step_mesh.rest_specs
    opt_spec = P() if opt_specs is None or zero is not None else opt_specs

    def mapped(params, rest, opt_state, hook_state, acc, batch, active):
        # the batch's specs follow its leaves with context parallelism (the sequence
        # dimension over cp), so the shard_map is built when the batch is traced
        batch_spec = P(axis) if step_mesh is None else step_mesh.batch_specs(batch)
        return jax.shard_map(
            body_in_context,
            mesh=mesh,
            in_specs=(params_spec, rest_spec, opt_spec, rank_axis, rank_axis, batch_spec,
                      rank_axis),
            out_specs=(params_spec, rest_spec, opt_spec, rank_axis, rank_axis, P()),
            check_vma=False,
        )(params, rest, opt_state, hook_state, acc, batch, active)
    if zero is not None:
        mapped = _zero_step(mapped, optimizer, zero, mode)
    return jax.jit(mapped, donate_argnums=(0, 1, 2, 3, 4) if donate else (),
                   compiler_options=CPU_COMPILER_OPTIONS if on_cpu and donate else None)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ZeroSharding:
    """Where DDP's ZeRO-1 optimizer state lives (see :mod:`jaxpg.data_parallel.zero`).

    Attributes:
        layouts: a ``LeafSplit`` per parameter.
        mesh: the group's mesh.
        axes: the mesh axes the state is split over.
        opt_shardings: the optimizer state's shardings.
    """

    layouts: Any
    mesh: Any
    axes: tuple[Any, ...]
    opt_shardings: Any


def _zero_step(mapped: Callable[..., Any], optimizer: optax.GradientTransformation,
               zero: ZeroSharding, mode: StepMode) -> Callable[..., Any]:
    """The ZeRO-1 step: the per-rank reduction, then the update on the sharded state."""

    def step(params, rest, opt_state, hook_state, acc, batch, active):
        out = mapped(params, rest, None, hook_state, acc, batch, active)
        if not mode.sync:
            return (params, out[1], opt_state, *out[3:])
        reduced, new_rest, apply, new_hook, new_acc, metrics = out
        new_params, new_opt = sharded_update(
            optimizer, reduced, opt_state, params, zero.layouts, mesh=zero.mesh,
            axes=zero.axes, opt_shardings=zero.opt_shardings, grads_padded=False,
            params_padded=False)
        if mode.join:
            new_params = _select(apply, new_params, params)
            new_opt = _select(apply, new_opt, opt_state)
        return new_params, new_rest, new_opt, new_hook, new_acc, metrics

    return step
