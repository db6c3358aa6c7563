"""PipelineStage with data parallelism, run by pipeline_stage_worker.py with 4 processes: a
("dp", "pp") = (2, 2) mesh, two pipelines of the two unequal stages of its hetero model
(pieces 0-1 | 2-3), each on its own half of the batch, ``data_parallel_group=mesh["dp"]``.

Two ``Schedule1F1B`` steps with Adam through ``ZeroRedundancyOptimizer`` over dp between
them: at every step each process's stage gradients must equal its pieces' gradients of the
whole batch's mean loss (the un-pipelined model, one program in this process) and its
replica's microbatch losses the reference's; after the steps its parameters must equal
Adam's on the whole batch, both for ZeRO-1 (on the ``data_parallel_group``-averaged
gradients) and ZeRO-2 (``reduce_gradients=True``, on each replica's own gradients, no
``data_parallel_group``). Prints ``CHECK <name> ok``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from device_forms_worker import allclose, check, close
from flax import nnx
from pipeline_stage_worker import B, Chain, ce_loss, piece

import jaxpg
from jaxpg.ddp import ZeroRedundancyOptimizer
from jaxpg.pipeline import PipelineStage, Schedule1F1B

M = 2  # microbatches per replica: 2 of 2 rows from each replica's 4
STEPS = 2
PIECES = {0: [0, 1], 1: [2, 3]}


def reference(tokens, labels, tx):
    """Per step: the 2M microbatch losses and the pieces' gradients of their mean, with
    ``tx``'s update between steps (the un-pipelined model on the whole batch), and the
    final parameters (run by rank 0, the others get its results)."""
    gd, params = nnx.split(Chain([piece(i) for i in range(4)]), nnx.Param)
    opt_state = tx.init(params)
    rows = B // (2 * M)

    @jax.jit
    def grads_of(params):
        def mean_loss(p):
            model = nnx.merge(gd, p)
            per = jnp.stack([ce_loss(model(tokens[i * rows:(i + 1) * rows]),
                                     labels[i * rows:(i + 1) * rows]) for i in range(2 * M)])
            return per.mean(), per
        return jax.value_and_grad(mean_loss, has_aux=True)(params)

    @jax.jit  # one program, not one per operation of the update
    def update(g, opt_state, params):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    out = []
    for _ in range(STEPS):
        (_, per), g = grads_of(params)
        out.append((np.asarray(per), nnx.to_pure_dict(g)["pieces"],
                    nnx.to_pure_dict(params)["pieces"]))
        params, opt_state = update(g, opt_state, params)
    return out, nnx.to_pure_dict(params)["pieces"]


def _numpy(tree):
    return jax.tree.map(np.asarray, tree)


def run_data_parallel(tokens: np.ndarray, labels: np.ndarray) -> None:
    """The checks above, in a world of 4 (pipeline_stage_worker.py's)."""
    mesh = jaxpg.init_device_mesh((2, 2), ("dp", "pp"))
    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    # the reference runs on rank 0, the others get its results: one compile instead of four
    mine = _numpy(reference(jnp.asarray(tokens), jnp.asarray(labels), optax.adam(0.05))) \
        if jaxpg.get_rank() == 0 else (None, None)
    steps, final = jaxpg.broadcast_object_list(list(mine), src=0)
    half = slice(dp * B // 2, (dp + 1) * B // 2)  # this replica's samples
    for zero2 in (False, True):
        # ZeRO-1 on gradients averaged by data_parallel_group (checked every step), or
        # ZeRO-2 on each replica's own gradients, reduced by the optimizer
        stage = PipelineStage(Chain([piece(i) for i in PIECES[pp]]), pp, 2, group=mesh["pp"],
                              data_parallel_group=None if zero2 else mesh["dp"])
        schedule = Schedule1F1B(stage, M, loss_fn=ce_loss)
        zero = ZeroRedundancyOptimizer(optax.adam(0.05), stage.params(), group=mesh["dp"],
                                       reduce_gradients=zero2)
        for step, (want_losses, want_grads, _) in enumerate(steps):
            losses = []
            if stage.is_first:
                schedule.step(jnp.asarray(tokens[half]))
            else:
                schedule.step(target=jnp.asarray(labels[half]), losses=losses)
                if not zero2:
                    check(f"replica_losses_step{step}", allclose(
                        [float(x) for x in losses], want_losses[dp * M:(dp + 1) * M],
                        rtol=1e-5, atol=1e-6))
            if not zero2:
                got = nnx.to_pure_dict(stage.grads)["pieces"]
                check(f"dp_averaged_grads_step{step}",
                      close([got[j] for j in range(2)], [want_grads[i] for i in PIECES[pp]]))
            nnx.update(stage.submod, zero.step(stage.grads, stage.params()))
            stage.zero_grad()
        got = nnx.to_pure_dict(stage.params())["pieces"]
        check(f"zero{2 if zero2 else 1}_adam_equals_whole_batch",
              close([got[j] for j in range(2)], [final[i] for i in PIECES[pp]]))


def layer_reference(tokens, labels, lr):
    """Paddle's layer list un-pipelined on the whole batch, two SGD steps: each step's mean
    loss of each half of the batch (a replica's samples), and the final parameters of
    every module layer (by its index in the list)."""
    from pipeline_stage_worker import paddle_layers

    built = [d.build_layer() if hasattr(d, "build_layer") else d for d in paddle_layers()]
    index = [i for i, b in enumerate(built) if isinstance(b, nnx.Module)]
    gd, params = nnx.split(nnx.List([built[i] for i in index]), nnx.Param)
    halves = [slice(0, B // 2), slice(B // 2, B)]

    @jax.jit
    def step(params):
        def loss_of(params):
            layers = iter(nnx.merge(gd, params))
            h = tokens
            for b in built:
                h = next(layers)(h) if isinstance(b, nnx.Module) else b(h)
            per = jnp.stack([ce_loss(h[s], labels[s]) for s in halves])
            return per.mean(), per
        (_, per), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        return per, jax.tree.map(lambda p, g: p - lr * g, params, g)

    losses = []
    for _ in range(2):
        per, params = step(params)
        losses.append(np.asarray(per))
    final = nnx.to_pure_dict(params)
    return np.stack(losses), {i: final[j] for j, i in enumerate(index)}


def run_pipeline_layer_data_parallel(tokens: np.ndarray, labels: np.ndarray) -> None:
    """Paddle's PipelineLayer + train_batch under a HybridCommunicateGroup of dp = 2 (the
    pipeline group passed, as a Paddle port passes it) and of sharding = 2 (group=None: the
    hybrid group's), pp = 2: each replica trains on its half of the batch with SGD, and
    after two steps every stage's parameters are whole-batch SGD's, each replica's losses
    its half's (``CHECK layer_<dp|sharding>_...``)."""
    from pipeline_stage_worker import LR, paddle_layers

    from jaxpg.pipeline import PipelineLayer

    mine = _numpy(layer_reference(jnp.asarray(tokens), jnp.asarray(labels), LR)) \
        if jaxpg.get_rank() == 0 else (None, None)  # rank 0's, as above
    want_losses, want_params = jaxpg.broadcast_object_list(list(mine), src=0)
    for name, degrees in (("dp", dict(dp_degree=2)), ("sharding", dict(sharding_degree=2))):
        hcg = jaxpg.HybridCommunicateGroup(pp_degree=2, **degrees)
        replica = (hcg.get_data_parallel_rank() if name == "dp"
                   else hcg.get_sharding_parallel_rank())
        half = slice(replica * B // 2, (replica + 1) * B // 2)
        model = PipelineLayer(layers=paddle_layers(), num_stages=2, loss_fn=ce_loss,
                              seg_method="layer:PBlock", accumulate_steps=2,
                              group=hcg.get_pipe_parallel_group() if name == "dp" else None)
        tx = optax.sgd(LR)
        losses = [float(model.train_batch([jnp.asarray(tokens[half]),
                                           jnp.asarray(labels[half])], tx))
                  for _ in range(2)]
        check(f"layer_{name}_replica_losses",
              allclose(losses, want_losses[:, replica], rtol=1e-5, atol=1e-6))
        got = nnx.to_pure_dict(model.parameters())
        lo, hi = model.segment_parts[model.stage_id], model.segment_parts[model.stage_id + 1]
        mine = {i - lo: want_params[i] for i in range(lo, hi) if i in want_params}
        check(f"layer_{name}_params_equal_whole_batch_sgd",
              sorted(mine) == sorted(int(k.split("_")[1]) for k in got)
              and close([got[f"layer_{i}"] for i in sorted(mine)],
                        [mine[i] for i in sorted(mine)]))
