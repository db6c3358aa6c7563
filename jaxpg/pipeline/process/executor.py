"""The process executor: each pipeline rank is a process that runs its own actions.

The SPMD executor (``jaxpg.pipeline.lockstep.executor``) runs a timetable as one program on all
ranks, in lockstep: every tick lasts as long as its slowest action, and a collective at
its end waits for every rank. Across processes (one pipeline rank each, torch's and
Paddle's layout) this executor does what torch's does instead:

* each rank runs its own actions in its timetable order (``rank_ops``), each as
  one asynchronously dispatched program on its device (``action_programs``), as soon as
  the message it reads has arrived;
* activations and gradients travel by point-to-point transfers, one in-order lane per
  neighbour (``p2p_lanes``): a send starts when the action that made it is done, a
  receive is posted ahead and waited for right before the action that reads it;
* buffer shapes come from the metadata the lanes exchange on their first step.

The arguments, results and numerics are the SPMD executor's: the loss and gradients come
back as the same global arrays (stages sharded over ``pp_axis``, the rest replicated), the
embedding's and head's gradients are summed over the pipeline ranks and every gradient
goes through ``grad_reducer`` (default: ``pmean`` over the data-parallel axis) in one
closing program over the whole mesh. ``pipeline_value_and_grad(..., executor="mpmd")``
selects it; ``executor="auto"`` does when called outside ``jax.jit`` on a mesh whose
devices are all in different processes.

Limits: every process holds exactly one device of the mesh (one rank of one pipeline);
the stage parameters of a chunk are read in place when the stack is in rank order (or
``v == 1``) and placed ``P(pp_axis)``, else they are gathered by a resharding program
first, as the SPMD executor does on every call.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.groups import callbacks, world
from jaxpg.pipeline.process.action_programs import action_programs
from jaxpg.pipeline.process.action_walk import run_beside_lanes, walk_actions
from jaxpg.pipeline.process.p2p_lanes import StepMail
from jaxpg.pipeline.process.rank_plan import RankPlan, rank_plan
from jaxpg.pipeline.process.step_timeline import recording
from jaxpg.pipeline.stage.config import PipelineConfig
from jaxpg.pipeline.stage.hoist import HoistedStage, hoist_stage
from jaxpg.pipeline.stage.metadata import batch_stage_metadata
from jaxpg.pipeline.stage.order import loop_view, stacked
from jaxpg.pipeline.stage.params import StagedParams

__all__ = ["mpmd_unsupported_reason", "run_mpmd"]

_DEFAULT_TIMEOUT_S = 1800.0


@callbacks.on_reset
def _forget_plans() -> None:
    """``destroy_process_group``: the plans' lanes belong to the old world."""
    _plans.cache_clear()
    _finisher.cache_clear()


def mpmd_unsupported_reason(mesh: Mesh, pp_axis: str = "pp", dp_axis: str | None = "dp",
                            param_specs: Any = None) -> str | None:
    """Why the process executor cannot run on ``mesh`` in this process (None: it can).

    It runs each stage on one device, so it refuses a mesh with another axis of size > 1
    than ``pp_axis`` and ``dp_axis`` (a tensor-parallel ``mp`` one) and parameters split
    by ``param_specs``: such stages need their axis' collectives inside every action.
    """
    if not isinstance(mesh, Mesh):
        return f"mesh is a {type(mesh).__name__}, not a jax.sharding.Mesh"
    other = {n: s for n, s in mesh.shape.items() if n not in (pp_axis, dp_axis) and s > 1}
    if other:
        return (f"the mesh has axes {other} besides the pipeline ({pp_axis!r}) and "
                f"data-parallel ({dp_axis!r}) ones; the process executor runs each stage on "
                "one device and cannot run a stage split over another axis (tensor "
                "parallelism)")
    if param_specs is not None:
        return ("param_specs split the stages' parameters over another mesh axis; the "
                "process executor runs each stage on one device, without that axis' "
                "collectives")
    if jax.process_count() == 1:
        return "the job has one process (the process executor needs one per pipeline rank)"
    procs = [d.process_index for d in mesh.devices.flat]
    if len(set(procs)) != len(procs):
        return (f"some processes hold several devices of the mesh (processes {procs}); the "
                "process executor needs every device of the mesh in a process of its own")
    if jax.process_index() not in procs:
        return f"this process ({jax.process_index()}) holds no device of the mesh"
    return None


def _global_ranks() -> dict[int, int]:
    state = world.current(required=False)
    devices = (state.devices if state is not None else
               sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    return {d.id: i for i, d in enumerate(devices)}


def _timeout_s() -> float:
    state = world.current(required=False)
    return _DEFAULT_TIMEOUT_S if state is None else state.timeout.total_seconds()


@functools.lru_cache(maxsize=64)
def _plans(cfg: PipelineConfig) -> RankPlan:
    mesh, tt = cfg.mesh, cfg.timetable
    names = list(mesh.axis_names)
    here = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    coords = np.unravel_index(here[0], mesh.devices.shape)
    pos = dict(zip(names, (int(c) for c in coords)))

    def device_at(rank: int) -> Any:
        return mesh.devices[tuple(rank if n == cfg.pp_axis else pos[n] for n in names)]

    ranks = _global_ranks()
    devices = [device_at(q) for q in range(tt.num_stages)]
    global_of = {q: ranks[d.id] for q, d in enumerate(devices)}
    replica = pos.get(cfg.dp_axis, 0) if cfg.dp_axis else 0
    return rank_plan(tt, pos[cfg.pp_axis], devices, global_of, replica=replica)


# --------------------------------------------------------------------------- local data
def _shard_on(leaf: jax.Array, device: Any) -> Any:
    for shard in leaf.addressable_shards:
        if shard.device == device:
            return shard
    return None


def _rows_of(shard: Any, shape: tuple) -> tuple[int, int] | None:
    """The rows (dim 0) a shard holds, if it holds every other dimension whole."""
    index = shard.index
    for dim, sl in enumerate(index[1:], 1):
        if (sl.start or 0) != 0 or (sl.stop if sl.stop is not None else shape[dim]) != shape[dim]:
            return None
    sl = index[0] if index else slice(None)
    return sl.start or 0, sl.stop if sl.stop is not None else shape[0]


@functools.lru_cache(maxsize=64)
def _prepare(v: int, squeeze: bool, hoisted: HoistedStage | None):
    """``[v, (1,) ...]`` blocks -> per chunk the programs' parameters, each leaf ``[1, ...]``:
    the chunk's own parameters, or what ``hoisted.prepare`` makes of them (one program a
    step; with ``v == 1`` and nothing hoisted the block is used as it is)."""

    def chunk(block, c):
        one = jax.tree.map(lambda a: a[c, 0] if squeeze else a[c], block)
        if hoisted is None:
            return jax.tree.map(lambda a: a[None], one)
        return tuple(a[None] for a in hoisted.prepare(one))

    return jax.jit(lambda block: tuple(chunk(block, c) for c in range(v)))


@functools.cache
def _reshard(mesh: Mesh, tt: Any, order: str, pp_axis: str):
    """Any stage stack -> the loop view ``[v, p, ...]`` placed ``P(None, pp)`` (collective)."""
    return jax.jit(lambda a: jax.tree.map(lambda x: loop_view(x, tt, order), a),
                   out_shardings=NamedSharding(mesh, P(None, pp_axis)))


def _local_chunks(stages: Any, cfg: PipelineConfig, plan: RankPlan,
                  hoisted: HoistedStage | None) -> tuple:
    """This rank's chunks' parameters as the action programs take them: per chunk a pytree
    of ``[1, ...]`` arrays (the hoisted ``q`` of :mod:`jaxpg.pipeline.stage.hoist`, if any)."""
    tt, r, device = cfg.timetable, plan.rank, plan.device
    v = tt.num_chunks
    rows = ([r * v + c for c in range(v)] if cfg.stage_order == "rank" or v == 1 else
            [tt.stage_of(r, c) for c in range(v)])
    leaves, treedef = jax.tree.flatten(stages)
    if all(not isinstance(a, jax.Array) for a in leaves):  # host arrays: slice here
        block = jax.tree.unflatten(treedef, [
            jax.device_put(np.asarray(a)[np.asarray(rows)], device) for a in leaves])
        return _prepare(v, False, hoisted)(block)
    blocks = []
    for a in leaves:
        shard = _shard_on(a, device) if isinstance(a, jax.Array) else None
        span = shard and _rows_of(shard, a.shape)
        if span is None or rows != list(range(rows[0], rows[0] + v)):
            break
        if span == (rows[0], rows[0] + v):
            blocks.append(shard.data)  # placed P(pp): read in place
        elif span[0] <= rows[0] and rows[-1] < span[1]:
            blocks.append(shard.data[rows[0] - span[0]:rows[0] - span[0] + v])
        else:
            break
    else:
        block = jax.tree.unflatten(treedef, blocks)
        return (block,) if v == 1 and hoisted is None else _prepare(v, False, hoisted)(block)
    loop = _reshard(cfg.mesh, tt, cfg.stage_order, cfg.pp_axis)(stages)
    local = jax.tree.map(lambda a: _shard_on(a, device).data, loop)  # [v, 1, ...]
    return _prepare(v, True, hoisted)(local)


def _local_batch(tree: Any, cfg: PipelineConfig, plan: RankPlan, dp: int) -> tuple[Any, int]:
    """This replica's part of a batch on this device, and the row where it starts."""
    leaves, treedef = jax.tree.flatten(tree)
    size = leaves[0].shape[0]
    per = size // dp
    lo = plan.replica * per
    out, starts = [], []
    for a in leaves:
        shard = _shard_on(a, plan.device) if isinstance(a, jax.Array) else None
        span = shard and _rows_of(shard, a.shape)
        if span is None and isinstance(a, jax.Array) and not a.is_fully_addressable:
            spec = P(cfg.dp_axis) if cfg.dp_axis else P()
            a = jax.jit(lambda x: x, out_shardings=NamedSharding(cfg.mesh, spec))(a)
            shard = _shard_on(a, plan.device)
            span = _rows_of(shard, a.shape)
        if span is not None and span[0] <= lo and lo + per <= span[1]:
            out.append(shard.data)
            starts.append(lo - span[0])
        else:
            out.append(jax.device_put(np.asarray(a)[lo:lo + per], plan.device))
            starts.append(0)
    if len(set(starts)) > 1:  # leaves start at different rows: cut each to the replica's part
        out = [x[s:s + per] for x, s in zip(out, starts, strict=True)]
        return jax.tree.unflatten(treedef, out), 0
    return jax.tree.unflatten(treedef, out), starts[0]


def _local_replicated(tree: Any, device: Any) -> Any:
    def one(a):
        shard = _shard_on(a, device) if isinstance(a, jax.Array) else None
        if shard is not None and shard.data.shape == a.shape:
            return shard.data
        return jax.device_put(np.asarray(a), device)

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------- the closing program
@functools.lru_cache(maxsize=64)
def _finisher(cfg: PipelineConfig, hoisted: HoistedStage | None):
    """One program over the whole mesh: the chunks' weight gradients turned back from
    ``q`` into the stage parameters' (``hoisted.grad_back``), the loss and the embedding's
    and head's gradients summed over the pipeline, ``grad_reducer`` over data parallel,
    the stacks restored."""
    pp, dp = cfg.pp_axis, cfg.dp_axis
    spec = P((dp, pp)) if dp else P(pp)

    def stage_grad(g):
        if hoisted is None:
            return g
        return jax.tree.map(lambda a: a[None], hoisted.grad_back([a[0] for a in g]))

    def body(loss, chunks, g_first, g_last):
        loss = lax.psum(loss[0], pp)
        stages = jax.tree.map(lambda *c: jnp.concatenate(c), *map(stage_grad, chunks))
        grads = StagedParams(stages, lax.psum(jax.tree.map(lambda a: a[0], g_first), pp),
                             lax.psum(jax.tree.map(lambda a: a[0], g_last), pp))
        if dp is not None:
            loss = lax.pmean(loss, dp)
            reducer = cfg.grad_reducer or functools.partial(lax.pmean, axis_name=dp)
            grads = reducer(grads)
        elif cfg.grad_reducer is not None:
            grads = cfg.grad_reducer(grads)
        return loss, grads._replace(stages=jax.tree.map(lambda a: a[:, None], grads.stages))

    def run(loss, chunks, g_first, g_last):
        out_specs = (P(), StagedParams(P(None, pp), P(), P()))
        loss, grads = jax.shard_map(body, mesh=cfg.mesh, in_specs=spec, out_specs=out_specs,
                                    check_vma=False)(loss, chunks, g_first, g_last)
        return loss, grads._replace(stages=jax.tree.map(
            lambda a: stacked(a, cfg.timetable, cfg.stage_order), grads.stages))

    return jax.jit(run, donate_argnums=(1,))  # the chunk gradients: ours, become the result


def _global(tree: Any, cfg: PipelineConfig) -> Any:
    n = cfg.mesh.shape[cfg.pp_axis] * (cfg.mesh.shape[cfg.dp_axis] if cfg.dp_axis else 1)
    spec = P((cfg.dp_axis, cfg.pp_axis)) if cfg.dp_axis else P(cfg.pp_axis)
    sharding = NamedSharding(cfg.mesh, spec)
    return jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
        (n * a.shape[0], *a.shape[1:]), sharding, [a]), tree)  # fmt: skip


@functools.lru_cache(maxsize=64)
def _zeros_like(key: tuple, device: Any) -> Any:
    treedef, leaves = key
    return jax.tree.unflatten(treedef, [jax.device_put(np.zeros((1, *s), d), device)
                                        for s, d in leaves])


def _zeros_key(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in leaves)


# --------------------------------------------------------------------------- one step
def run_mpmd(cfg: PipelineConfig, params: StagedParams, inputs: Any,
             targets: Any) -> tuple[jax.Array, StagedParams]:
    """One step of the process executor (a
    :class:`~jaxpg.pipeline.stage.config.PipelineExecutor`).

    Returns:
        ``(loss, grads)`` as ``pipeline_value_and_grad`` returns them.
    """
    tt = cfg.timetable
    m = tt.num_microbatches
    dp = cfg.mesh.shape[cfg.dp_axis] if cfg.dp_axis is not None else 1
    metas, rows = batch_stage_metadata(cfg, params, inputs, targets)
    act = metas[0].input
    plan = _plans(cfg)
    one_stage = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params.stages)
    hoisted = hoist_stage(cfg.stage_fn, one_stage, act)
    if hoisted is not None:  # the programs run the stage on q = prepare(p) (stage_hoist)
        stage_fn, one_stage = hoisted.stage, hoisted.q_structs
    else:
        stage_fn = cfg.stage_fn
    progs = action_programs(stage_fn, cfg.loss_fn, cfg.first_fn, remat=cfg.remat,
                            split_backward=tt.split_backward, one_stage=one_stage, act=act,
                            rows=rows)  # fmt: skip
    timeline = recording()
    started = time.perf_counter()

    chunks = _local_chunks(params.stages, cfg, plan, hoisted)
    holds_first = any(op.first for op in plan.ops)
    holds_last = any(op.last for op in plan.ops)
    fp = _local_replicated(params.first, plan.device) if holds_first else None
    lp = _local_replicated(params.last, plan.device) if holds_last else None
    x_in, row_in = _local_batch(inputs, cfg, plan, dp) if holds_first else (None, 0)
    t_in, row_t = _local_batch(targets, cfg, plan, dp) if holds_last else (None, 0)

    what = f"pipeline {tt.name} (process executor)"
    mail = StepMail(plan.me, _timeout_s(), what, plan.process_of)
    actions = _StackedActions(plan, progs, chunks, fp, lp, x_in, row_in, t_in, row_t, rows, m,
                              timeline)  # fmt: skip
    on_wait = None if timeline is None else (
        lambda key, start, end: timeline.add("wait", f"{key[0]} {key[1]} {key[2]}", start, end))

    def walk():
        walk_actions(plan, actions, mail, on_wait)
        return actions.finish()

    loss, g_chunks, g_first, g_last = run_beside_lanes(
        plan, mail, lambda lane, transfers: _lane_step(lane, transfers, mail, act, what,
                                                       timeline), walk)
    finishing = time.perf_counter()
    zero_first = _zeros_like(_zeros_key(params.first), plan.device)
    zero_last = _zeros_like(_zeros_key(params.last), plan.device)
    out = _finisher(cfg, hoisted)(
        _global(loss if loss is not None else _zeros_like(_zeros_key(jnp.float32(0)),
                                                          plan.device), cfg),
        _global(tuple(g_chunks), cfg),
        _global(g_first if g_first is not None else zero_first, cfg),
        _global(g_last if g_last is not None else zero_last, cfg),
    )  # fmt: skip
    if timeline is not None:
        timeline.flush()
        jax.block_until_ready(out)
        timeline.add("finish", "reduce", finishing, time.perf_counter())
        timeline.add("step", tt.name, started, time.perf_counter())
    return out


def _lane_step(lane, transfers, mail, act, what, timeline) -> None:
    if timeline is None:
        lane.run_step(transfers, mail, act, what)
    else:
        lane.run_step(transfers, mail, act, what, timeline.add)


class _StackedActions:
    """This rank's actions over its chunks of the stacked stages (a ``RankActions``):
    activations, residuals and gradients kept per (stage, microbatch) between them, the
    chunks' gradient accumulators, and the loss accumulator of the last stage."""

    def __init__(self, plan, progs, chunks, fp, lp, x_in, row_in, t_in, row_t, rows, m,
                 timeline) -> None:
        self.progs, self.chunks, self.fp, self.lp = progs, chunks, fp, lp
        self.x_in, self.row_in, self.t_in, self.row_t = x_in, row_in, t_in, row_t
        self.rows, self.m, self.timeline = rows, m, timeline
        self.x, self.res, self.dy, self.wres = {}, {}, {}, {}
        self.split = any(op.kind == "W" for op in plan.ops)
        self.g = [None] * len(chunks)
        self.g_first = self.acc = None
        self.pending = {}  # timeline: chunk -> (future, gradient) of an action only it came out of

    def settle(self, chunk) -> None:
        """Timeline only: before a chunk's gradient is donated, its last writer's end."""
        if chunk in self.pending:
            future, value = self.pending.pop(chunk)
            jax.block_until_ready(value)
            future.set_result(time.perf_counter())

    def forward(self, op, received):
        k, pc, row = (op.stage, op.microbatch), self.chunks[op.chunk], op.microbatch * self.rows
        if op.first and op.last:
            self.x[k], self.acc, self.dy[k], self.res[k] = self.progs.forward_first_last(
                pc, self.fp, self.lp, self.x_in, self.t_in, self.row_in + row, self.m,
                self.acc)  # fmt: skip
            return self.dy[k]
        if op.first:
            self.x[k], out, self.res[k] = self.progs.forward_first(pc, self.fp, self.x_in,
                                                                   self.row_in + row)
            return out
        self.x[k] = received
        if op.last:
            self.acc, self.dy[k], self.res[k] = self.progs.forward_last(
                pc, self.lp, received, self.t_in, self.row_t + row, self.m, self.acc)
            return self.dy[k]
        out, self.res[k] = self.progs.forward(pc, received)
        return out

    def backward(self, op, received):
        k, pc, row = (op.stage, op.microbatch), self.chunks[op.chunk], op.microbatch * self.rows
        if self.timeline is not None and not self.split:
            self.settle(op.chunk)
        if not op.last:
            self.dy[k] = received
        if self.split:
            if op.first:
                self.wres[k], self.g_first = self.progs.backward_input_first(
                    pc, self.fp, self.x[k], self.dy[k], self.res[k], self.g_first, self.x_in,
                    self.row_in + row)  # fmt: skip
                return self.wres[k]
            out, self.wres[k] = self.progs.backward_input(pc, self.x[k], self.dy[k],
                                                          self.res[k])
            return out
        xk, dyk, rk = self.x.pop(k), self.dy.pop(k), self.res.pop(k)
        if op.first:
            self.g[op.chunk], self.g_first = self.progs.backward_first(
                pc, self.fp, xk, dyk, rk, self.g[op.chunk], self.g_first, self.x_in,
                self.row_in + row)  # fmt: skip
            return self.g[op.chunk]
        out, self.g[op.chunk] = self.progs.backward(pc, xk, dyk, rk, self.g[op.chunk])
        return out

    def weight(self, op):
        k = (op.stage, op.microbatch)
        if self.timeline is not None:
            self.settle(op.chunk)
        self.g[op.chunk] = self.progs.weight(
            self.g[op.chunk], self.chunks[op.chunk], self.x.pop(k), self.dy.pop(k),
            self.res.pop(k), self.wres.pop(k), True)  # fmt: skip
        return self.g[op.chunk]

    def done(self, op, out) -> None:
        if self.timeline is None:
            return
        # a chunk's gradient, which the next writer donates: the host settles its end (the
        # watcher cannot wait on a donated array)
        if op.kind == "W" or (op.kind == "B" and op.first and not self.split):
            future = concurrent.futures.Future()
            self.pending[op.chunk] = (future, out)
            self.timeline.action(op.label, time.perf_counter(), future)
        else:
            self.timeline.action(op.label, time.perf_counter(), out)

    def finish(self):
        """``(loss, chunk gradients, first's gradient, last's gradient)`` after the walk."""
        for chunk in list(self.pending):
            self.settle(chunk)
        loss = None if self.acc is None else self.acc[0]
        g_last = None if self.acc is None else self.acc[1]
        return loss, self.g, self.g_first, g_last

