"""Composition at no cost: DDP and FSDP over a one-rank "dp" axis of a ("dp", "tp") mesh add no
collective to a tensor-parallel model's step (XLA:CPU would run, and copy every gradient
through, an all-reduce, all-gather or reduce-scatter whose replica groups hold one device
each), and the step still matches one-device training."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpg.ddp import DistributedDataParallel
from jaxpg.fsdp import FullyShardedDataParallel
from jaxpg.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter)(?:-start)?\(.*?"
                        r"replica_groups=(\{[^ ]*?\}\}|\[[0-9,]+\]<=\[[0-9,]+\]"
                        r"|mesh\[[^\]]*\] \{[^}]*\})")


class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _group_sizes(groups: str) -> set[int]:
    if groups.startswith("["):  # iota form [groups,size]<=[n]
        return {int(groups[1:].split("]")[0].split(",")[1])}
    if groups.startswith("mesh["):  # newer XLA: mesh['dp'=1,'tp'=8] {'tp'}
        sizes = dict((name, int(n)) for name, n in re.findall(r"'(\w+)'=(\d+)", groups))
        return {int(np.prod([sizes[a] for a in re.findall(r"'(\w+)'", groups.split("] ")[1])]))}
    return {len(g.split(",")) for g in re.findall(r"\{([0-9,]+)\}", groups)}


def collectives(text: str) -> list[tuple[str, set[int]]]:
    """(op, the sizes of its replica groups) for each collective of a compiled program that
    moves more than a scalar (a step's loss and rank count are scalars)."""
    return [(m.group(2), _group_sizes(m.group(3))) for m in COLLECTIVE.finditer(text)
            if not re.fullmatch(r"[a-z0-9]+\[\](\{\})?", m.group(1))]


def _reference_losses(batches):
    graphdef, params, rest = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param, ...)
    opt = optax.sgd(0.1)
    state = opt.init(params)
    losses = []
    for batch in batches:
        loss, grads = jax.value_and_grad(
            lambda p, b=batch: loss_fn(nnx.merge(graphdef, p, rest), b))(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("mesh", [8], indirect=True, ids=["dp1-tp8"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_a_one_rank_dp_axis_adds_no_collective(mesh, wrapper):
    model = parallelize_module(Mlp(nnx.Rngs(0)), mesh["tp"],
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    cls = DistributedDataParallel if wrapper == "ddp" else FullyShardedDataParallel
    wrapped = cls(model, optax.sgd(0.1), group=mesh.get_group("dp"))
    rng = np.random.default_rng(0)
    batches = [{k: rng.normal(size=(8, 16)).astype(np.float32) for k in "xy"}
               for _ in range(2)]
    got = [float(wrapped.train_step(loss_fn, b)["loss"]) for b in batches]
    np.testing.assert_allclose(got, _reference_losses(batches), rtol=1e-5)

    (step,) = wrapped._compiled._steps.values()
    if wrapper == "ddp":
        args = (wrapped.params, wrapped.rest, wrapped.opt_state, wrapped.hook_state, None,
                wrapped._shard_batch(batches[0]), None)
    else:
        args = (wrapped.params, wrapped.rest, wrapped.opt_state, None,
                wrapped.group.place_batch(batches[0]))
    found = collectives(step.fn.lower(*args).compile().as_text())
    assert found, "the step must hold the tensor-parallel all-reduce"
    # every collective spans the tp ranks: none runs over the one-rank dp axis
    assert all(sizes == {8} for _, sizes in found), found
    assert [op for op, _ in found if op == "all-reduce"]
