"""ParallelDims, its Paddle face (HybridCommunicateGroup) and the one resolver, against the
rank arithmetic they stand for (numpy over the world's ranks)."""

import itertools

import numpy as np
import pytest
from jax.sharding import Mesh

import jaxpg
from jaxpg.groups.parallel_dims import PADDLE_AXIS_NAMES
from jaxpg.groups.resolve import resolve_group, resolve_mesh

ORDER = ("dp_replicate", "pp", "dp_shard", "cp", "tp")


def _reference_groups(degrees, joined):
    """Every group of the dimensions ``joined``: ranks with equal other coordinates, in
    row-major order over ``joined`` (rank = row-major index over ORDER)."""
    ranks = np.arange(8).reshape([degrees[n] for n in ORDER])
    groups = {}
    for coord in itertools.product(*(range(degrees[n]) for n in ORDER)):
        key = tuple(c for n, c in zip(ORDER, coord) if n not in joined)
        groups.setdefault(key, []).append(int(ranks[coord]))
    return sorted(tuple(g) for g in groups.values())


@pytest.mark.parametrize("degrees", [
    dict(dp_replicate=2, dp_shard=2, tp=2),
    dict(pp=2, dp_shard=2, cp=2),
    dict(dp_shard=1, cp=2, tp=4),
])
def test_dims_and_flattened_dims_are_the_rank_arithmetic(degrees):
    dims = jaxpg.ParallelDims(**degrees)
    full = {n: getattr(dims, n) for n in ORDER}
    assert dims.device_mesh.shape == tuple(full[n] for n in ORDER)
    assert dims.jax_mesh.axis_names == ORDER
    named = {n: (n,) for n in ORDER}
    named.update(dp=("dp_replicate", "dp_shard"), dp_shard_cp=("dp_shard", "cp"),
                 dp_cp=("dp_replicate", "dp_shard", "cp"))
    for name, joined in named.items():
        family = sorted(dims.get_group(name).family)
        assert family == _reference_groups(full, joined), name
        for rank in (0, 5):
            with jaxpg.as_rank(rank):
                row = dims[name].mesh.tolist()
                assert rank in row and tuple(row) in family
                assert dims.device_mesh.get_local_rank(name) == row.index(rank)
    # two named dims: the 2-D sub-mesh of the acting rank, torch's mesh["dp_shard", "cp"]
    sub = dims["dp_shard", "cp"]
    assert sub.shape == (full["dp_shard"], full["cp"])


def test_dp_shard_minus_one_takes_what_the_others_leave():
    assert jaxpg.ParallelDims(tp=2).dp_shard == 4
    assert jaxpg.ParallelDims(dp_replicate=2, pp=2).dp_shard == 2
    assert jaxpg.ParallelDims(dp_replicate=2, tp=2).dp == 4


def test_expert_parallel_groups_borrow_dp_shard_x_cp():
    dims = jaxpg.ParallelDims(dp_shard=4, cp=2, ep=4)
    rows = np.arange(8).reshape(4, 2).reshape(-1)  # dp_shard x cp, cp innermost: 0..7
    want_ep = sorted(tuple(int(r) for r in c) for c in rows.reshape(2, 4))
    want_mod = sorted(tuple(int(r) for r in c) for c in rows.reshape(2, 4).T)
    assert sorted(dims.get_group("ep").family) == want_ep
    assert sorted(dims.get_group("dp_shard_mod_ep").family) == want_mod


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3), r"dp_replicate=1 x cp=1 x tp=3 x pp=1 = 3 does not divide the world size 8"),
    (dict(dp_shard=3, tp=2), r"dp_replicate=1 x pp=1 x dp_shard=3 x cp=1 x tp=2 = 6 must "
                             r"equal the world size 8"),
    (dict(dp_shard=8, ep=3), r"ep=3 must divide dp_shard x cp = 8"),
    (dict(tp=0), r"tp=0 must be an int >= 1"),
    (dict(dp_shard=0), r"dp_shard=0 must be an int >= 1 \(or -1"),
    (dict(pp=True), r"pp=True must be an int"),
    (dict(dp_shard=2, world_size=4, tp=4), r"= 8 must equal the world size 4"),
])
def test_bad_degrees_name_the_degrees_and_the_world(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxpg.ParallelDims(**kwargs)


def test_hybrid_communicate_group_is_paddles_face_of_parallel_dims():
    hcg = jaxpg.HybridCommunicateGroup(sharding_degree=2, sep_degree=2, mp_degree=2,
                                       ep_degree=2)
    dims = jaxpg.ParallelDims(dp_shard=2, cp=2, tp=2, ep=2, axis_names=PADDLE_AXIS_NAMES)
    assert hcg.device_mesh.mesh_dim_names == ("dp", "pp", "sharding", "sep", "mp")
    assert hcg.device_mesh.mesh.tolist() == dims.device_mesh.mesh.tolist()
    assert hcg.sep_degree == 2 and hcg.get_sep_parallel_world_size() == 2
    with jaxpg.as_rank(6):  # sharding=1, sep=1, mp=0: rank = sharding*4 + sep*2 + mp
        assert hcg.get_sep_parallel_group().ranks == (4, 6)
        assert hcg.get_sep_parallel_rank() == 1
        assert hcg.get_sharding_parallel_group().ranks == (2, 6)
        # ep=2 of sharding x sep = (0, 2, 4, 6) for mp=0: runs of 2, then the same position
        assert hcg.get_expert_parallel_group().ranks == (4, 6)
        assert hcg.get_expert_parallel_rank() == 1
        assert hcg.get_moe_sharding_parallel_group().ranks == (2, 6)
        assert hcg.get_dp_sep_parallel_group().ranks == (4, 6)  # dp=1: the sep group
    assert hcg.get_expert_parallel_world_size() == 2
    assert hcg.get_moe_sharding_parallel_world_size() == 2
    assert jaxpg.HybridCommunicateGroup(mesh=dims).device_mesh is dims.device_mesh


def test_one_resolver_and_one_error_text():
    dims = jaxpg.ParallelDims(dp_shard=4, tp=2)
    mesh = dims.device_mesh
    pg = mesh.get_group("tp")
    for form in (pg, mesh["tp"]):
        assert resolve_group(form, api="x") is pg
    assert resolve_group(None, api="x") is jaxpg.GroupMember.WORLD
    assert resolve_group(dims["dp"], api="x") is dims.get_group("dp")
    jm = dims.jax_mesh
    hcg = jaxpg.HybridCommunicateGroup(sharding_degree=4, mp_degree=2)
    for form in (mesh, dims, jm):
        assert resolve_mesh(form, api="x") == jm
    assert resolve_mesh(hcg, api="x").axis_names == ("dp", "pp", "sharding", "sep", "mp")
    assert np.array_equal(np.asarray(resolve_mesh(hcg, api="x").devices),
                          np.asarray(jm.devices))
    forms = r"takes a ProcessGroup, a 1-D DeviceMesh \(mesh\['dp'\]\) or None \(the world\)"
    for api, call in [("all_reduce", lambda: jaxpg.all_reduce(np.ones(8), group=dims)),
                      ("get_world_size", lambda: jaxpg.get_world_size(jm)),
                      ("DistributedDataParallel", lambda: _ddp(group="dp"))]:
        with pytest.raises(TypeError, match=rf"{api}: group= {forms}; got "):
            call()
    with pytest.raises(ValueError, match=r"all_reduce: group= runs over one axis, but got a "
                                         r"5-D DeviceMesh .* group=mesh\['tp'\]"):
        jaxpg.all_reduce(np.ones(8), group=mesh)
    mesh_forms = ("takes a DeviceMesh, a HybridCommunicateGroup, a ParallelDims or a "
                  "jax.sharding.Mesh; got ProcessGroup ProcessGroup")
    with pytest.raises(TypeError, match=f"spmd: mesh= {mesh_forms}"):
        jaxpg.spmd(lambda x: x, mesh=pg, in_specs=None, out_specs=None)
    with pytest.raises(TypeError, match=f"pipeline_value_and_grad: mesh= {mesh_forms}"):
        from jaxpg.pipeline import pipeline_value_and_grad

        pipeline_value_and_grad(None, None, {}, 0, 0, mesh=pg)
    with pytest.raises(ValueError, match="pass one of group=, device_mesh=, not group= and "
                                         "device_mesh="):
        _ddp(group=pg, device_mesh=mesh["tp"])
    assert isinstance(jm, Mesh)


def _ddp(**kwargs):
    import optax
    from flax import nnx

    from jaxpg.ddp import DistributedDataParallel

    return DistributedDataParallel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1),
                                   **kwargs)


@pytest.mark.parametrize("topology", ["dims", "hcg"])
def test_context_and_expert_parallel_apis_take_the_whole_topology(world, topology):
    """``group=dims`` (or the HybridCommunicateGroup) means its cp/sep and ep groups: the same
    groups, axes, sizes and meshes as passing those groups themselves."""
    from jaxpg.groups.mesh_axis import resolve_mesh_axis

    if topology == "dims":
        top = jaxpg.ParallelDims(dp_shard=4, cp=2, ep=4)
        cp, ep = top.get_group("cp"), top.get_group("ep")
    else:
        top = jaxpg.HybridCommunicateGroup(sharding_degree=4, sep_degree=2, ep_degree=4)
        cp, ep = top.get_sep_parallel_group(), top.get_expert_parallel_group()
    whole = resolve_mesh_axis(top, "cp", api="test")
    alone = resolve_mesh_axis(cp, "cp", api="test")
    assert (whole.axis, whole.size, whole.mesh) == (alone.axis, alone.size, alone.mesh)
    assert list(whole.group.ranks) == list(cp.ranks) == [0, 1]
    assert ep.size() == 4
    mine = resolve_mesh_axis(top, "ep", api="test")
    given = resolve_mesh_axis(ep, "ep", api="test")
    assert mine.group is ep  # the very group: moe and MoELayer then run as with group=ep
    assert (mine.axis, mine.size, mine.mesh) == (given.axis, given.size, given.mesh)
