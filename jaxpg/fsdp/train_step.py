"""The FSDP / ZeRO training step: one ``jit`` of a ``shard_map`` and a sharded update.

Per rank (inside ``shard_map`` over the group's mesh) the step

* stage 3: all-gathers the root's parameters at the start (kept to the end, as torch's
  root), runs ``loss_fn`` on a model whose units gather their own parameters when called
  (:mod:`jaxpg.fsdp.unit_call`), and gets each parameter's gradient already
  reduce-scattered and averaged: this rank's shard, padded, ``P(shard axes)``;
* stage 1 and 2: runs ``loss_fn`` on the whole (replicated) parameters, cast to
  ``param_dtype``, then all-reduces (stage 1) or reduce-scatters (stage 2) the gradients
  in ``reduce_dtype``.

Then, on the global arrays after the ``shard_map``
(:func:`jaxpg.data_parallel.zero.sharded_update`), the optax update runs on each rank's
shard of the optimizer state; stage 1 and 2 all-gather the new parameters, stage 3 keeps
them sharded. Under ``no_sync`` each rank adds its unreduced, unsharded gradients to a
per-rank accumulator instead (torch's ``set_requires_gradient_sync(False)``: that
accumulator is as large as the parameters), and the next synchronising step adds it before
reducing.

Inside ``loss_fn``, ``jaxpg.get_rank()`` is the traced rank and jaxpg collectives lower
onto the group's mesh, as in DDP's step.
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
from jaxpg.fsdp import units as _units
from jaxpg.fsdp.collectives import Comm, accumulate, allreduce_leaf, gather_param, reduce_leaf
from jaxpg.fsdp.model_parallel import local_block_shape
from jaxpg.fsdp.shard_group import ShardGroup, from_rank0
from jaxpg.fsdp.unit_call import StepContext

__all__ = ["StepMode", "StepPlan", "build_train_step"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepMode:
    """The static switches of one compiled step.

    Attributes:
        sync: reduce and update (False: accumulate local gradients, ``no_sync``).
        has_acc: a ``no_sync`` accumulator is passed in.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
    """

    sync: bool = True
    has_acc: bool = False
    has_aux: bool = False


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StepPlan:
    """Everything about a wrapped model that the step is built from (no arrays).

    Attributes:
        graphdef: the NNX graphdef whose units call through the step (None for a
            parameter pytree).
        layouts: a ``LeafSplit`` per parameter (the parameters' pytree structure).
        owners: per flattened parameter, the unit path that owns it ('' for the root).
        units: the units' dotted paths.
        stage: 1, 2 or 3.
        reshard_after_forward: see ``FullyShardedDataParallel``.
        comm: the collectives' static facts.
        group: the shard group.
        optimizer: the optax transformation.
        opt_shardings: the optimizer state's shardings.
        rest_specs: the ``PartitionSpec`` of each leaf of the rest of the module state
            (a tensor-parallel model's; None: replicated).
    """

    graphdef: Any
    layouts: Any
    owners: tuple[str, ...]
    units: tuple[str, ...]
    stage: int
    reshard_after_forward: bool
    comm: Comm
    group: ShardGroup
    optimizer: optax.GradientTransformation
    opt_shardings: Any
    rest_specs: Any = None

    def param_specs(self) -> Any:
        """How the stored parameters enter the ``shard_map``."""
        axes = self.group.shard_axes
        if self.stage == 3:
            return jax.tree.map(lambda lay: lay.spec(axes), self.layouts)
        return jax.tree.map(lambda lay: lay.base_spec, self.layouts)

    def grad_specs(self) -> Any:
        """How the reduced gradients leave the ``shard_map``."""
        axes = self.group.shard_axes
        if self.stage >= 2:
            return jax.tree.map(lambda lay: lay.spec(axes), self.layouts)
        return jax.tree.map(lambda lay: lay.base_spec, self.layouts)

    def unit_subtrees(self, tree: Any) -> dict[str, list[Any]]:
        """``tree`` (shaped like the parameters) cut into each unit's leaves."""
        leaves = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
        out: dict[str, list[Any]] = {u: [] for u in self.units}
        for owner, leaf in zip(self.owners, leaves, strict=True):
            if owner:
                out[owner].append(leaf)
        return out


def _local_loss(loss_fn, plan: StepPlan, params, rest, batch, has_aux, ctx: StepContext):
    """Per-rank ``(loss, (aux, new_rest))`` with ``ctx`` active for the units."""
    token = _units.active_step().set(ctx)
    try:
        return local_loss(loss_fn, plan.graphdef, params, rest, batch, has_aux)
    finally:
        _units.active_step().reset(token)


def _stage3_grads(loss_fn, plan: StepPlan, mode: StepMode, shards, rest, acc, batch,
                  check: LossCheck):
    comm = plan.comm
    layout_leaves = jax.tree.leaves(plan.layouts)
    no_sync = not mode.sync
    unit_layouts = plan.unit_subtrees(plan.layouts)

    def loss_of(shards, acc):
        s_leaves, s_def = jax.tree.flatten(shards)
        a_leaves = jax.tree.leaves(acc) if acc is not None else [None] * len(s_leaves)
        mixed = [gather_param(s, a, lay, comm, no_sync) if not owner else s
                 for s, a, lay, owner in zip(s_leaves, a_leaves, layout_leaves, plan.owners,
                                             strict=True)]
        ctx = StepContext(comm, stage=3, reshard_after_forward=plan.reshard_after_forward,
                          unit_layouts=unit_layouts,
                          unit_accs=plan.unit_subtrees(acc) if acc is not None else None,
                          no_sync=no_sync)
        params = jax.tree.unflatten(s_def, mixed)
        return _local_loss(loss_fn, plan, params, rest, batch, mode.has_aux, ctx)

    argnums = 1 if no_sync else 0
    (loss, (aux, new_rest)), grads = check.value_and_grad(loss_of, shards, acc,
                                                          argnums=argnums)
    if no_sync:
        grads = jax.tree.map(jnp.add, acc, grads)
    return loss, aux, new_rest, grads


def _stage12_grads(loss_fn, plan: StepPlan, mode: StepMode, params, rest, acc, batch,
                   check: LossCheck):
    comm = plan.comm
    ctx = StepContext(comm, stage=plan.stage, reshard_after_forward=False, unit_layouts={},
                      unit_accs=None, no_sync=not mode.sync)

    def loss_of(p):
        cast = jax.tree.map(lambda x, lay: x.astype(comm.policy.compute_dtype_for(lay.dtype)),
                            p, plan.layouts)
        return _local_loss(loss_fn, plan, cast, rest, batch, mode.has_aux, ctx)

    (loss, (aux, new_rest)), grads = check.value_and_grad(loss_of, params)
    grads = jax.tree.map(accumulate, grads, acc) if acc is not None else grads
    if not mode.sync:
        return loss, aux, new_rest, grads
    reduce = reduce_leaf if plan.stage == 2 else allreduce_leaf
    grads = jax.tree.map(lambda g, lay: reduce(g, lay, comm), grads, plan.layouts)
    return loss, aux, new_rest, grads


def _zero_acc(plan: StepPlan) -> Any:
    """Zero ``no_sync`` accumulators (each device's unsharded block, in each parameter's
    reduce dtype)."""
    mesh_shape = dict(plan.group.mesh.shape)
    return jax.tree.map(
        lambda lay: jnp.zeros(local_block_shape(lay, mesh_shape),
                              plan.comm.policy.reduce_dtype_for(lay.dtype)),
        plan.layouts)


def build_train_step(loss_fn: Callable[..., Any], plan: StepPlan, mode: StepMode, *,
                     donate: bool = True) -> Callable[..., Any]:
    """Returns the jitted ``step(params, rest, opt_state, acc, batch)``.

    It returns ``(params, rest, opt_state, acc, metrics)``: parameters and optimizer state
    as stored (see :class:`~jaxpg.fsdp.FullyShardedDataParallel`), ``acc`` the per-rank
    ``no_sync`` accumulator (None after a synchronising step), ``metrics`` the mean loss
    over ranks, ``grad_norm`` (the global L2 norm of the averaged gradients, summed over
    every shard; synchronising steps only) and, with ``has_aux``, the averaged ``aux``.
    """
    group = plan.group
    axes = group.batch_axes
    rank_spec = group.rank_spec
    rest_spec = P() if plan.rest_specs is None else plan.rest_specs
    # the first trace checks that the loss depends on the parameters (then no cost)
    loss_check = LossCheck(loss_fn, api="FullyShardedDataParallel.train_step",
                           model="model" if plan.graphdef is not None else "parameter")

    def body(params, rest, acc, batch):
        acc = jax.tree.map(lambda x: x[0], acc)
        if not mode.sync and acc is None:
            acc = _zero_acc(plan)
        grads_fn = _stage3_grads if plan.stage == 3 else _stage12_grads
        loss, aux, new_rest, grads = grads_fn(loss_fn, plan, mode, params, rest, acc, batch,
                                              loss_check)
        metrics = {"loss": jax.lax.pmean(loss.astype(jnp.float32), axes)}
        if mode.has_aux:
            metrics["aux"] = jax.tree.map(
                lambda a: jax.lax.pmean(jnp.asarray(a, jnp.float32), axes), aux)
        new_rest = jax.tree.map(lambda x: from_rank0(x, axes), new_rest)
        if not mode.sync:
            return None, new_rest, jax.tree.map(lambda g: g[None], grads), metrics
        metrics["grad_norm"] = global_grad_norm(grads, plan.grad_specs())
        return grads, new_rest, None, metrics

    def body_in_context(*args):
        from jaxpg.spmd_lowering import SpmdContext

        with SpmdContext(group.mesh, group.world):
            return body(*args)

    def mapped(params, rest, acc, batch):
        # with context parallelism the batch's specs follow its leaves (the sequence
        # dimension over cp), so the shard_map is built when the batch is traced
        return jax.shard_map(
            body_in_context, mesh=group.mesh,
            in_specs=(plan.param_specs(), rest_spec, rank_spec, group.batch_specs(batch)),
            out_specs=(plan.grad_specs() if mode.sync else None, rest_spec, rank_spec, P()),
            check_vma=False,
        )(params, rest, acc, batch)

    def step(params, rest, opt_state, acc, batch):
        grads, new_rest, new_acc, metrics = mapped(params, rest, acc, batch)
        if not mode.sync:
            return params, new_rest, opt_state, new_acc, metrics
        new_params, new_opt = sharded_update(
            plan.optimizer, grads, opt_state, params, plan.layouts, mesh=group.mesh,
            axes=group.shard_axes, opt_shardings=plan.opt_shardings,
            grads_padded=plan.stage >= 2, params_padded=plan.stage == 3)
        return new_params, new_rest, new_opt, None, metrics

    on_cpu = group.mesh.devices.flat[0].platform == "cpu"
    options = {"xla_cpu_copy_insertion_use_region_analysis": True} if on_cpu and donate else None
    return jax.jit(step, donate_argnums=(0, 1, 2, 3) if donate else (),
                   compiler_options=options)
