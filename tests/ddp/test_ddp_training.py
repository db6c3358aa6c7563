"""DistributedDataParallel against single-device training on the concatenated batch."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ddp_models import MLP, Reference, assert_trees_close, group, loss_fn, make_batches
from flax import linen, nnx

from jaxpg.ddp import DistributedDataParallel, GradBucket, param_sync

BUCKETS = [(25, 1), (0.0005, 0.0002), (1e-6, 1e-6)]  # one bucket, two, one per parameter


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("cap_mb, first_mb", BUCKETS)
def test_ddp_equals_single_process_training(world, n, cap_mb, first_mb):
    opt = optax.sgd(0.5, momentum=0.9)  # linear in the gradient: a wrong average shows
    ddp = DistributedDataParallel(
        MLP(0), opt, group=group(n), bucket_cap_mb=cap_mb, first_bucket_mb=first_mb
    )
    ref = Reference(MLP(0), opt)
    for batch in make_batches(3, 4 * n, seed=n):
        metrics = ddp.train_step(loss_fn, batch)
        want = ref.step(batch)
        np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
    assert ddp.step == 3
    assert_trees_close(ddp.params, ref.params)
    assert_trees_close(ddp.opt_state, ref.opt_state)


def test_fused_pmean_reduction_equals_reference(world):
    opt = optax.sgd(0.1, momentum=0.9)
    ddp = DistributedDataParallel(MLP(0), opt, group=group(4), reduction="fused_pmean")
    ref = Reference(MLP(0), opt)
    for batch in make_batches(3, 16):
        ddp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(ddp.params, ref.params)


def test_linen_parameter_pytree(world):
    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(4)(jax.nn.relu(linen.Dense(16)(x)))

    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]

    def linen_loss(p, batch):
        logits = net.apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    opt = optax.sgd(0.1)
    ddp = DistributedDataParallel(params, opt, group=group(2), bucket_cap_mb=1e-6)
    ref_params, ref_state = params, opt.init(params)
    for batch in make_batches(3, 8):
        ddp.train_step(linen_loss, batch)
        g = jax.grad(linen_loss)(ref_params, batch)
        updates, ref_state = opt.update(g, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    assert_trees_close(ddp.params, ref_params)
    with pytest.raises(TypeError, match="parameter pytree"):
        ddp.module  # noqa: B018


@pytest.mark.parametrize(
    "hook, config, tol",
    [
        ("allreduce", None, 1e-5),
        ("fp16_compress", None, 2e-3),
        ("bf16_compress", None, 2e-2),
        ("powerSGD", {"start_powerSGD_iter": 100}, 1e-5),  # vanilla phase: exact
    ],
)
def test_each_hook_through_ddp(world, hook, config, tol):
    opt = optax.sgd(0.1)
    ddp = DistributedDataParallel(
        MLP(0), opt, group=group(4), comm_hook=hook, comm_hook_config=config,
        bucket_cap_mb=0.0005, first_bucket_mb=0.0002,
    )  # fmt: skip
    ref = Reference(MLP(0), opt)
    for batch in make_batches(3, 16):
        ddp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(ddp.params, ref.params, rtol=tol, atol=tol)


def test_noop_hook_runs_without_communication(world):
    # No gradient exchange: rank 0 steps on the gradient of its own 4 rows only, so its
    # parameters equal one-device training on those rows, not on the whole batch.
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(2), comm_hook="noop")
    batch = make_batches(1, 8)[0]
    metrics = ddp.train_step(loss_fn, batch)
    assert np.isfinite(float(metrics["loss"]))
    own, whole = Reference(MLP(0), optax.sgd(0.1)), Reference(MLP(0), optax.sgd(0.1))
    own.step({k: v[:4] for k, v in batch.items()})
    whole.step(batch)
    assert_trees_close(ddp.params, own.params)
    with pytest.raises(AssertionError):  # the two references differ: the check can fail
        assert_trees_close(ddp.params, whole.params)


def test_register_comm_hook_threads_per_rank_state(world):
    def counting_hook(count, bucket: GradBucket):
        n = jax.lax.axis_size(bucket.axis_name)
        return jax.lax.psum(bucket.buffer / n, bucket.axis_name), count + 1

    opt = optax.sgd(0.1)
    ddp = DistributedDataParallel(MLP(0), opt, group=group(4), bucket_cap_mb=1e-6)
    ddp.register_comm_hook(jnp.int32(0), counting_hook)
    ref = Reference(MLP(0), opt)
    for batch in make_batches(2, 16):
        ddp.train_step(loss_fn, batch)
        ref.step(batch)
    assert_trees_close(ddp.params, ref.params)
    # one count per bucket per step, on each of the 4 ranks
    assert np.asarray(ddp.hook_state).tolist() == [2 * len(ddp.bucket_plan)] * 4
    with pytest.raises(RuntimeError, match="before the first train_step"):
        ddp.register_comm_hook(None, counting_hook)


def _regression_batches(steps, n, seed=0):
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal((16, 8)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((8 * n, 16)).astype(np.float32)
        out.append({"x": x, "y": x @ w_true})
    return out


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros((16, 8)))

    def __call__(self, x):
        return x @ self.w


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_powersgd_with_error_feedback_converges(world):
    # A rank-8 linear target learnt with rank-1 PowerSGD: error feedback carries what each
    # step's approximation leaves out, so it tracks plain allreduce; without it, it stalls.
    n, steps = 4, 100
    batches = _regression_batches(steps, n)
    config = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}

    def train(**kwargs):
        ddp = DistributedDataParallel(Linear(), optax.sgd(0.1), group=group(n), **kwargs)
        return [float(ddp.train_step(_mse, b)["loss"]) for b in batches]

    exact = train()
    psgd = train(comm_hook="powerSGD", comm_hook_config=config)
    no_feedback = train(comm_hook="powerSGD", comm_hook_config={
        **config, "use_error_feedback": False, "warm_start": False})
    assert psgd[-1] < 1e-2 * psgd[0]
    assert psgd[-1] < 2 * exact[-1]
    assert no_feedback[-1] > 10 * psgd[-1]


def test_module_snapshot_survives_donated_steps(world):
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(2))
    batches = make_batches(2, 8)
    ddp.train_step(loss_fn, batches[0])
    snapshot = ddp.module
    before = np.asarray(snapshot.l1.kernel[...])
    ddp.train_step(loss_fn, batches[1])
    np.testing.assert_array_equal(np.asarray(snapshot.l1.kernel[...]), before)
    logits = ddp.module(jnp.asarray(batches[0]["x"]))
    assert logits.shape == (8, 4)


class _Deep(nnx.Module):
    def __init__(self, widths=(256, 1024, 1024, 256, 10)):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(widths[:-1], widths[1:], strict=True)])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _deep_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def test_cpu_step_updates_donated_parameters_without_copying_them(world):
    # Issue 12: with XLA:CPU's default copy insertion the step copied donated kernels that
    # the backward reads (here with the no-communication hook); the region analysis the
    # step is compiled with on CPU drops the copies, and the parameters are still donated.
    from jaxpg.ddp.train_step import StepMode

    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 256)).astype(np.float32),
             "y": rng.integers(0, 10, 8).astype(np.int32)}
    ddp = DistributedDataParallel(_Deep(), optax.sgd(0.1, momentum=0.9), group=group(1),
                                  comm_hook="noop")
    args = (ddp.params, ddp.rest, ddp.opt_state, ddp.hook_state, None,
            param_sync.shard_batch(batch, ddp.group), None)
    hlo = ddp._step_fn(_deep_loss, StepMode()).lower(*args).compile().as_text()
    assert [line for line in hlo.splitlines() if " copy(" in line and "kernel" in line] == []
    params = ddp.params
    ddp.train_step(_deep_loss, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))


def test_bad_arguments(world):
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        DistributedDataParallel(MLP(0), "adam", group=group(2))
    with pytest.raises(TypeError, match="Linen module"):
        DistributedDataParallel(linen.Dense(3), optax.sgd(0.1))
    with pytest.raises(TypeError, match="nnx.Module or a non-empty pytree"):
        DistributedDataParallel({}, optax.sgd(0.1))
    with pytest.raises(ValueError, match="reduction="):
        DistributedDataParallel(MLP(0), optax.sgd(0.1), reduction="ring")
    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    with pytest.raises(ValueError, match=r"shape \(6, 6\).*divide evenly among this process's 4"):
        ddp.train_step(loss_fn, {"x": np.zeros((6, 6), np.float32), "y": np.zeros(6, np.int32)})
    with pytest.raises(ValueError, match="inside `with ddp.join"):
        ddp.train_step(loss_fn, None)
    with pytest.raises(ValueError, match="scalar loss"):
        ddp.train_step(lambda m, b: m(b["x"]), make_batches(1, 8)[0])


def test_has_aux_metrics_are_averaged(world):
    def loss_with_aux(model, batch):
        logits = model(batch["x"])
        acc = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
        return loss_fn(model, batch), {"accuracy": acc}

    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=group(4))
    batch = make_batches(1, 16)[0]
    logits = MLP(0)(jnp.asarray(batch["x"]))
    want = float(jnp.mean(jnp.argmax(logits, -1) == batch["y"]))
    metrics = ddp.train_step(loss_with_aux, batch, has_aux=True)
    np.testing.assert_allclose(float(metrics["aux"]["accuracy"]), want, rtol=1e-6)




def test_rank_and_collectives_inside_loss_fn(world):
    import jaxpg

    pg = group(4)

    def loss_with_rank(model, batch):
        rank = jaxpg.get_rank(pg)
        total = jaxpg.all_reduce(jnp.float32(1), group=pg)  # lowers to psum on the DDP axis
        return loss_fn(model, batch), {"rank": rank.astype(jnp.float32), "size": total}

    ddp = DistributedDataParallel(MLP(0), optax.sgd(0.1), group=pg)
    metrics = ddp.train_step(loss_with_rank, make_batches(1, 16)[0], has_aux=True)
    assert float(metrics["aux"]["rank"]) == 1.5  # mean of ranks 0..3
    assert float(metrics["aux"]["size"]) == 4
