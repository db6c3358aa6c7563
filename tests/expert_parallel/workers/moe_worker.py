"""``moe`` with one rank per process (4 processes under jaxpg-run), against the one-device
reference each process computes for its ep group. Prints ``CHECK <name> ok``."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _arrays import allclose  # noqa: E402
from _ep_ddp_net import Net, loss_fn  # noqa: E402
from _moe_reference import reference_loss_and_grads, reference_moe  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpg  # noqa: E402
from jaxpg.ddp import DistributedDataParallel  # noqa: E402
from jaxpg.expert_parallel import moe  # noqa: E402

TOL = 1e-5
T, D, F, E = 6, 8, 16, 8


def check(name, cond=True):
    if not cond:
        raise AssertionError(f"{name} failed on process {jax.process_index()}")
    print(f"CHECK {name} ok", flush=True)


def rank_inputs(seed, rank, ep):
    """Rank ``rank``'s tokens and cotangent; the router and all experts (same everywhere)."""
    shared = np.random.default_rng(seed)
    gate_w = shared.normal(size=(D, E)).astype(np.float32)
    w1 = (shared.normal(size=(E, D, F)) / 3).astype(np.float32)
    w2 = (shared.normal(size=(E, F, D)) / 3).astype(np.float32)
    own = np.random.default_rng([seed, rank])
    return (own.normal(size=(T, D)).astype(np.float32), gate_w, w1, w2,
            own.normal(size=(T, D)).astype(np.float32))


def stacked(group, local):
    """The group's stacked global array (one row per rank) from this process's row."""
    sharding = NamedSharding(group.family_mesh, P(group.axis_name))
    return jax.make_array_from_process_local_data(sharding, np.asarray(local)[None])


def mine(global_array):
    return np.asarray(global_array.addressable_shards[0].data[0])


def case(name, group, ep, top_k, capacity_factor, seed):
    rank = jaxpg.get_rank()
    me = rank % ep  # ep is the mesh's last dimension (or the world): group rank
    first = rank - me
    x, gate_w, w1, w2, cot = rank_inputs(seed, rank, ep)
    local = E // ep
    options = dict(top_k=top_k, capacity_factor=capacity_factor)

    def per_rank(x, gate_w, w1, w2, cot):
        def loss(x, gate_w, w1, w2):
            y, aux = moe(x, gate_w, w1, w2, group=group, **options)
            return jnp.sum(y * cot) + aux.loss / ep, (y, aux)
        (_, (y, aux)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                  has_aux=True)(x, gate_w, w1, w2)
        return y, aux, grads

    args = [stacked(group, a) for a in (x, gate_w, w1[me * local:(me + 1) * local],
                                        w2[me * local:(me + 1) * local], cot)]
    y, aux, grads = jaxpg.spmd(per_rank, group=group)(*args)
    group_data = [rank_inputs(seed, r, ep) for r in range(first, first + ep)]
    xs = np.concatenate([d[0] for d in group_data])
    cots = np.concatenate([d[4] for d in group_data])

    y_ref, loss_ref, counts_ref, dropped_ref = reference_moe(xs, gate_w, w1, w2, **options)
    _, want = reference_loss_and_grads(xs, gate_w, w1, w2, cots, **options)
    rows = slice(me * T, (me + 1) * T)
    experts = slice(me * local, (me + 1) * local)
    gate_sum = jaxpg.all_reduce(jnp.asarray(mine(grads[1])), group=group)  # ranks' parts
    ok = (allclose(mine(y), y_ref[rows], rtol=TOL, atol=TOL)
          and allclose(mine(aux.loss), loss_ref, rtol=TOL)
          and np.array_equal(mine(aux.counts), counts_ref)
          and int(mine(aux.dropped)) == dropped_ref
          and allclose(mine(grads[0]), want[0][rows], rtol=TOL, atol=TOL)
          and allclose(np.asarray(gate_sum), want[1], rtol=TOL, atol=TOL)
          and allclose(mine(grads[2]), want[2][experts], rtol=TOL, atol=TOL)
          and allclose(mine(grads[3]), want[3][experts], rtol=TOL, atol=TOL))
    check(name, ok and (capacity_factor is None or dropped_ref > 0))  # the capacity drops


def ddp_case(mesh, ep2):
    """DDP over the (dp, ep) world with expert_axes=("ep",), against one-device SGD. The
    dp = 1 ranks (2, 3) build their model from another seed: DDP starts every rank from dp
    rank 0's parameters, each ep position from its own experts (dp rank 0's of its column)."""
    rng = np.random.default_rng(7)
    data = [(rng.normal(size=(8, D)).astype(np.float32),
             rng.normal(size=(8, D)).astype(np.float32)) for _ in range(2)]
    rank = jaxpg.get_rank()
    ddp = DistributedDataParallel(Net(ep2, nnx.Rngs(0 if rank < 2 else 1)), optax.sgd(0.5),
                                  expert_axes=("ep",))
    for x, t in data:
        ddp.train_step(loss_fn, (x[rank * 2:rank * 2 + 2], t[rank * 2:rank * 2 + 2]))
    one, _ = jaxpg.new_subgroups(group_size=1)
    graphdef, state = nnx.split(Net(one, nnx.Rngs(0)))
    # The leaves not placed on the group's mesh yet (uncommitted) are put there replicated,
    # as the step returns them: one compile of the step, not one per input placement.
    placed = next(a.sharding for a in jax.tree.leaves(state) if a.committed)
    state = jax.tree.map(lambda a: a if a.committed else jax.device_put(
        a, NamedSharding(placed.mesh, P())), state)
    opt = optax.sgd(0.5)
    opt_state = opt.init(state)

    @jax.jit  # one program, not one per primitive (each process compiles it)
    def sgd_step(state, opt_state, batch):
        grads = jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), batch))(state)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    for batch in data:
        state, opt_state = sgd_step(state, opt_state, batch)
    whole = nnx.state(ddp.module)  # gathered: every process holds the full arrays
    got, want = jax.tree.leaves(whole), jax.tree.leaves(state)
    check("ddp_expert_axes", len(got) == len(want) and all(
        allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)
        for g, w in zip(got, want, strict=True)))


def main():
    jaxpg.init_process_group()
    start = time.monotonic()
    world = jaxpg.new_group([0, 1, 2, 3])
    mesh = jaxpg.init_device_mesh((2, 2), ("dp", "ep"))
    ep2 = mesh.get_group("ep")
    # The routing options (top_k, capacity or dropless) are checked one by one in process
    # (tests/expert_parallel/test_moe.py); across processes, one case per group kind.
    case("ep4_top2_capacity", world, 4, 2, 1.0, 2)
    case("ep2_top1_dropless", ep2, 2, 1, None, 3)
    # Host code, one rank per process: plain local arrays in and out.
    rank = jaxpg.get_rank()
    x, gate_w, w1, w2, _ = rank_inputs(5, rank, 4)
    y, aux = moe(x, gate_w, w1[rank * 2:rank * 2 + 2], w2[rank * 2:rank * 2 + 2], group=world)
    xs = np.concatenate([rank_inputs(5, r, 4)[0] for r in range(4)])
    y_ref, loss_ref, _, _ = reference_moe(xs, gate_w, w1, w2, top_k=2)
    check("host_call", allclose(np.asarray(y), y_ref[rank * T:(rank + 1) * T], atol=TOL)
          and allclose(float(aux.loss), loss_ref, rtol=TOL))
    # Experts of another shape on one rank: a clear error on every rank, before running.
    narrow = rank == 0  # rank 0's experts are 8 wide, the others' 16: each valid alone
    try:
        moe(x, gate_w, w1[:2, :, :8] if narrow else w1[:2], w2[:2, :8] if narrow else w2[:2],
            group=world)
    except ValueError as err:
        check("mismatched_shapes_error", "different shapes" in str(err))
    else:
        raise AssertionError("mismatched expert shapes ran")
    ddp_case(mesh, ep2)
    print(f"moe worker took {time.monotonic() - start:.1f}s", flush=True)
    jaxpg.destroy_process_group()


if __name__ == "__main__":
    main()
