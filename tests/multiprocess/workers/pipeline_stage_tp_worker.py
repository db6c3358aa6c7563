"""PipelineStage with tensor-parallel stages, run by pipeline_stage_worker.py with 4 processes:
a ("pp", "tp") = (2, 2) mesh, two unequal stages (a vocabulary-parallel embedding and a
Megatron MLP block | a block, a norm and a column-parallel head), each parallelized over
``mesh["tp"]`` and held by its two tp processes (``tensor_parallel_group=mesh["tp"]``).

A ``Schedule1F1B`` step, an optax SGD step over ``stage.grads``, then a ``ScheduleGPipe``
step: at each step the last stage's microbatch losses (on both its tp ranks) and every
stage's gradients, gathered from their tp shards, must equal the un-pipelined, un-sharded
model's on the whole batch (one jitted program, on rank 0), the gradients must keep
the parameters' own tp-sharded layout, and the parameters after the SGD step must equal
the reference's. Then a ``ScheduleInterleaved1F1B`` step over 4 tensor-parallel stages,
two per process (stages ``r`` and ``r + 2`` on pp coordinate ``r``): every stage's
gradients, gathered, must equal the un-pipelined, un-sharded chain's. Prints
``CHECK <name> ok``.

Then the same two stages fully sharded (FSDP) on a ``("pp", "dp_shard") = (2, 2)`` mesh
(``fsdp_group=mesh["dp_shard"]``), each dp_shard process feeding its own half of the batch:
a ``Schedule1F1B`` step, SGD over the sharded ``stage.grads``, a ``ScheduleGPipe`` step
(``reshard_after_forward=False``: the parameters gathered once for the step) give the
un-pipelined model's losses, gradients and parameters, which stay split over dp_shard.
Prints ``FSDP <name> ok`` (a failure raises, failing the launch).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from device_forms_worker import allclose, check
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from pipeline_stage_worker import LR, Block, Chain, V, ce_loss

import jaxpg
from jaxpg.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from jaxpg.tensor_parallel import ColwiseParallel, Replicate, RowwiseParallel, parallelize_module

M = 2  # microbatches
D = 16  # the width (hidden: 32); the tutorial's, whose initializers are compiled already


class EmbedBlock(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = Block(D, rngs)

    def __call__(self, tokens):
        return self.block(self.embed(tokens))


class BlockHead(nnx.Module):
    def __init__(self, rngs):
        self.block = Block(D, rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(self.block(h)))


def stage_module(s: int) -> nnx.Module:
    return (EmbedBlock, BlockHead)[s](nnx.Rngs(20 + s))


MLP_PLAN_FLAT = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
MLP_PLAN = {f"block.{name}": style for name, style in MLP_PLAN_FLAT.items()}
PLANS = {0: {"embed": RowwiseParallel(input_layouts=Replicate()), **MLP_PLAN},
         1: {**MLP_PLAN, "out": ColwiseParallel(output_layouts=Replicate())}}


@functools.cache
def _gather(mesh):
    return jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))


def gathered(stage: PipelineStage, state) -> dict:
    """``state``'s arrays gathered from their tp shards, as numpy (one program per mesh)."""
    full = _gather(stage.tp.mesh)(state)
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), nnx.to_pure_dict(full))


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def close(got, want, tol=1e-5):
    """Every leaf of the reference's shape, within ``tol`` scaled by the reference's
    magnitude (test_pipeline_stage's ``_close``)."""
    def one(a, b):
        return allclose(a, b, rtol=0, atol=tol * max(1.0, float(np.max(np.abs(b)))))

    return all(one(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                                          strict=True))


def reference(tokens, labels, pieces=None, extra=(), m=M):
    """The whole model on the whole batch: per step, the ``m`` microbatch losses and each
    stage's gradients of their mean, with an SGD step between; and the parameters after it
    (run by rank 0, the others get its results: one compile instead of four). ``pieces``:
    the stage modules (default this file's), the first taking ``(tokens, *extra)``."""
    gd, params = nnx.split(Chain(pieces or [stage_module(s) for s in range(2)]), nnx.Param)
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), params)  # on this device

    @jax.jit
    def sgd_step(params):
        def mean_loss(p):  # one forward of the batch; each microbatch's loss from its rows
            out = (tokens, *extra)
            for piece in nnx.merge(gd, p).pieces:
                out = piece(*out)
                out = out if isinstance(out, tuple) else (out,)
            per = optax.softmax_cross_entropy_with_integer_labels(out[0], labels)
            per = per.reshape(m, -1).mean(axis=1)
            return per.mean(), per

        (_, per), g = jax.value_and_grad(mean_loss, has_aux=True)(params)
        return per, g, jax.tree.map(lambda p, g: p - LR * g, params, g)

    steps = []
    for _ in range(2):
        per, g, params = sgd_step(params)
        steps.append((np.asarray(per), _numpy(nnx.to_pure_dict(g)["pieces"])))
        if len(steps) == 1:
            after_sgd = _numpy(nnx.to_pure_dict(params)["pieces"])
    return steps, after_sgd


def split_order(rows: int, parts: int, m: int = M) -> np.ndarray:
    """The whole batch's rows in the order a pipeline over ``parts`` processes that each
    feed their own consecutive ``rows / parts`` rows sees them: microbatch ``i`` is every
    process's ``i``-th microbatch, in process order."""
    part = rows // parts
    per = part // m
    return np.concatenate([np.arange(h * part + i * per, h * part + (i + 1) * per)
                           for i in range(m) for h in range(parts)])


def two_steps(stage, inputs, target, ref, loss_fn, verify, laid_out, again=None, m=M):
    """A ``Schedule1F1B`` step, SGD over ``stage.grads``, a ``ScheduleGPipe`` step (on
    ``again(stage)``'s stage, if given), ``m`` microbatches each, of a stage whose group
    splits the data: each check against ``ref`` (:func:`reference`'s, the stage's own part
    of the batch given as ``inputs`` (the first stage) or ``target`` (the last)) passed to
    ``verify(name, ok)``, every state ``laid_out``."""
    steps, after_sgd = ref
    s, tx = stage.stage_index, optax.sgd(LR)

    def full(state):  # the whole arrays, gathered from the stage's mesh
        return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)),
                            nnx.to_pure_dict(_gather(stage.layout.mesh)(state)))

    @jax.jit
    def sgd(grads, params):  # plain SGD: each parameter's update in its own layout
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    for step, (name, cls) in enumerate((("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe))):
        want_losses, want_grads = steps[step]
        schedule = cls(stage, m, loss_fn=loss_fn)
        if stage.is_first:
            schedule.step(*inputs)
        elif not stage.is_last:
            schedule.step()
        else:
            losses = []
            out = schedule.step(target=target, losses=losses)  # this process's part
            verify(f"losses_{name}", out.shape[:-1] == target.shape and
                   close(np.array([float(x) for x in losses]), want_losses))
        verify(f"grads_{name}", close(full(stage.grads), want_grads[s]) and
               laid_out(stage.grads))
        if step == 0:
            nnx.update(stage.submod, sgd(stage.grads, stage.params()))
            stage.zero_grad()
            verify("sgd_params", close(full(stage.params()), after_sgd[s]) and
                   laid_out(stage.params()))
            stage = again(stage) if again is not None else stage


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def run_tensor_parallel(tokens: np.ndarray, labels: np.ndarray) -> None:
    """The checks above, in a world of 4 (pipeline_stage_worker.py's)."""
    mesh = jaxpg.init_device_mesh((2, 2), ("pp", "tp"))
    s = mesh.get_local_rank("pp")
    mine = reference(jnp.asarray(tokens), jnp.asarray(labels)) if jaxpg.get_rank() == 0 \
        else (None, None)
    steps, after_sgd = jaxpg.broadcast_object_list(list(mine), src=0)
    # every process builds the same weights: each takes its shard of its own copy
    module = parallelize_module(stage_module(s), mesh["tp"], PLANS[s], src_data_rank=None)
    stage = PipelineStage(module, s, 2, group=mesh["pp"], tensor_parallel_group=mesh["tp"])

    tx = optax.sgd(LR)
    opt_state = tx.init(stage.params())

    @jax.jit
    def sgd(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for step, (name, cls) in enumerate((("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe))):
        want_losses, want_grads = steps[step]
        schedule = cls(stage, M, loss_fn=ce_loss)
        losses = []
        if stage.is_first:
            schedule.step(jnp.asarray(tokens))
        else:
            logits = schedule.step(target=jnp.asarray(labels), losses=losses)
            check(f"tp_losses_{name}", logits.shape == (*tokens.shape, V) and
                  close(np.array([float(x) for x in losses]), want_losses))
        check(f"tp_grads_{name}", close(gathered(stage, stage.grads), want_grads[s]))
        if step == 0:
            pairs = list(zip(jax.tree.leaves(stage.grads), jax.tree.leaves(stage.params()),
                             strict=True))
            check("tp_grads_keep_the_param_layout", all(
                g.sharding.is_equivalent_to(p.sharding, p.ndim) for g, p in pairs) and {
                p.sharding.spec for _, p in pairs} >= {P(None, "tp"), P("tp", None)})
            params, opt_state = sgd(stage.grads, opt_state, stage.params())
            nnx.update(stage.submod, params)
            stage.zero_grad()
            check("tp_sgd_params", close(gathered(stage, stage.params()), after_sgd[s]))
    run_interleaved(mesh)
    run_fully_sharded(tokens, labels)


def run_interleaved(mesh) -> None:
    """``ScheduleInterleaved1F1B`` over 4 tp stages (Megatron MLP blocks), 2 per process."""
    r = mesh.get_local_rank("pp")
    x, t = (np.random.default_rng(seed).standard_normal((8, D)).astype(np.float32)
            for seed in (1, 2))
    gd, params = nnx.split(nnx.List([Block(D, nnx.Rngs(30 + s)) for s in range(4)]),
                           nnx.Param)

    @jax.jit
    def grads(params):
        def loss(p):
            h = jnp.asarray(x)
            for block in nnx.merge(gd, p):
                h = block(h)
            return mse(h, t)

        return jax.grad(loss)(params)

    want = _numpy(nnx.to_pure_dict(grads(params)))
    order = (r, r + 2)
    stages = [PipelineStage(parallelize_module(Block(D, nnx.Rngs(30 + s)), mesh["tp"],
                                               MLP_PLAN_FLAT, src_data_rank=None),
                            s, 4, group=mesh["pp"], tensor_parallel_group=mesh["tp"])
              for s in order]
    schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=mse)
    if r == 0:
        schedule.step(jnp.asarray(x))
    else:
        schedule.step(target=jnp.asarray(t))
    check("tp_interleaved_grads", all(close(gathered(st, st.grads), want[s])
                                      for s, st in zip(order, stages, strict=True)))


def _verify(name: str, cond: bool) -> None:
    """Raises unless ``cond`` (failing the launch); prints ``FSDP <name> ok``."""
    if not cond:
        raise AssertionError(f"FSDP {name} failed on process {jax.process_index()}")
    print(f"FSDP {name} ok", flush=True)


def run_fully_sharded(tokens: np.ndarray, labels: np.ndarray, k: int = 2) -> None:
    """FSDP stages: pp = 2 x dp_shard = ``k``, each process its ``k``-th of the batch."""
    mesh = jaxpg.init_device_mesh((2, k), ("pp", "dp_shard"))
    s, d = mesh.get_local_rank("pp"), mesh.get_local_rank("dp_shard")
    part = len(tokens) // k
    mine = slice(d * part, (d + 1) * part)
    # microbatch i of the step is every part's i-th microbatch: the reference's batch in
    # that order has them as its i-th M-th
    order = split_order(len(tokens), k)
    ref = reference(jnp.asarray(tokens[order]), jnp.asarray(labels[order])) \
        if jaxpg.get_rank() == 0 else (None, None)
    steps, after_sgd = jaxpg.broadcast_object_list(list(ref), src=0)
    stage = PipelineStage(stage_module(s), s, 2, group=mesh["pp"],
                          fsdp_group=mesh["dp_shard"])

    def split_over_dp_shard(state):
        return all(a.sharding.spec == P("dp_shard") for a in jax.tree.leaves(state))

    def gathered_once(stage):  # the GPipe step gathers the parameters once a step (torch's
        return PipelineStage(stage.submod, s, 2, group=mesh["pp"],  # reshard_after_forward)
                             fsdp_group=mesh["dp_shard"], reshard_after_forward=False)

    _verify("params_split", split_over_dp_shard(stage.params()))
    two_steps(stage, (jnp.asarray(tokens[mine]),), jnp.asarray(labels[mine]),
              (steps, after_sgd), ce_loss, _verify, split_over_dp_shard, gathered_once)
