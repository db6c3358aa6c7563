"""World and group API: ranks, sizes, sub-groups, torch's sentinels, bad input."""

import datetime

import jax
import numpy as np
import pytest
from _require import import_or_skip

import jaxpg
from jaxpg import GroupMember


def test_world_is_the_devices():
    assert jaxpg.is_initialized()
    assert jaxpg.get_world_size() == len(jax.devices()) == 8
    assert jaxpg.get_rank() == 0
    assert jaxpg.get_backend() == "gloo"
    assert GroupMember.WORLD.size() == 8
    assert jaxpg.get_process_group_ranks(GroupMember.WORLD) == list(range(8))


def test_destroy_then_init_again():
    jaxpg.destroy_process_group()
    assert not jaxpg.is_initialized()
    assert GroupMember.WORLD is None
    jaxpg.init_process_group(backend="gloo")
    assert jaxpg.get_world_size() == 8


def test_call_before_init_uses_torch_wording():
    jaxpg.destroy_process_group()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        jaxpg.get_rank()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        jaxpg.all_reduce([1.0])


def test_second_init_raises():
    with pytest.raises(ValueError, match="twice"):
        jaxpg.init_process_group()


@pytest.mark.parametrize("backend", ["nccl", "NCCL", "cuda:nccl"])
def test_impossible_backend(backend):
    jaxpg.destroy_process_group()
    with pytest.raises(ValueError, match="cannot run on JAX's 'cpu' platform|names no backend"):
        jaxpg.init_process_group(backend=backend)


def test_unknown_backend():
    jaxpg.destroy_process_group()
    with pytest.raises(ValueError, match="backend='ucc' is not known"):
        jaxpg.init_process_group(backend="ucc")


@pytest.mark.parametrize("backend", ["gloo", "mpi", "xla", "cpu:gloo,cuda:nccl"])
def test_possible_backends(backend):
    jaxpg.destroy_process_group()
    jaxpg.init_process_group(backend=backend)
    assert jaxpg.get_backend() in ("gloo", "mpi", "xla")


def test_bad_timeout_type():
    jaxpg.destroy_process_group()
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta"):
        jaxpg.init_process_group(timeout=30)


def test_new_group_ranks_and_translation():
    g = jaxpg.new_group([5, 0, 3])
    assert jaxpg.get_process_group_ranks(g) == [0, 3, 5]  # sorted, as torch
    assert g.size() == 3 and jaxpg.get_world_size(g) == 3
    assert jaxpg.get_rank(g) == 0  # acting rank 0 is group rank 0
    assert jaxpg.get_group_rank(g, 5) == 2
    assert jaxpg.get_global_rank(g, 1) == 3
    with pytest.raises(ValueError, match="global_rank=4 is not part of group"):
        jaxpg.get_group_rank(g, 4)
    h = jaxpg.new_group([2, 4])
    assert jaxpg.get_rank(h) == -1  # acting rank 0 is not a member
    with jaxpg.as_rank(4):
        assert jaxpg.get_rank(h) == 1 and jaxpg.get_rank() == 4


def test_new_group_timeout_and_default():
    g = jaxpg.new_group(timeout=datetime.timedelta(seconds=5))
    assert g.ranks == tuple(range(8)) and g.timeout.total_seconds() == 5
    assert jaxpg.new_group([0, 1]).timeout == datetime.timedelta(minutes=30)  # the world's
    with pytest.raises(TypeError, match="new_group: timeout must be a datetime.timedelta; got 5"):
        jaxpg.new_group(timeout=5)
    jaxpg.destroy_process_group()
    jaxpg.init_process_group(timeout=datetime.timedelta(seconds=7))
    assert jaxpg.new_group([0, 1]).timeout == datetime.timedelta(seconds=7)  # inherited


def test_default_timeout_is_torchs():
    torch = import_or_skip("torch", "torch's default_pg_timeout is the reference")
    assert jaxpg.default_pg_timeout == torch.distributed.default_pg_timeout
    assert jaxpg.GroupMember.WORLD.timeout == torch.distributed.default_pg_timeout


@pytest.mark.parametrize("ranks,match", [
    ([0, 8], r"rank 8 in ranks=\[0, 8\] is out of range"),
    ([-1], "rank -1 in ranks"),
    ([1, 1, 2], r"lists rank\(s\) \[1\] more than once"),
    (list(range(9)), "out of range"),
    ([], "empty"),
    ([0.5], "integer ranks"),
])
def test_new_group_bad_ranks(ranks, match):
    with pytest.raises((ValueError, TypeError), match=match):
        jaxpg.new_group(ranks)


def test_new_subgroups():
    cur, subs = jaxpg.new_subgroups(2)
    assert [s.ranks for s in subs] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert cur is subs[0]
    with jaxpg.as_rank(5):
        cur5, _ = jaxpg.new_subgroups(4)
        assert cur5.ranks == (4, 5, 6, 7) and jaxpg.get_rank(cur5) == 1
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        jaxpg.new_subgroups(3)
    with pytest.raises(ValueError, match="larger than the group's size"):
        jaxpg.new_subgroups(16)


def test_new_subgroups_by_enumeration():
    cur, subs = jaxpg.new_subgroups_by_enumeration([[6, 1], [0, 2, 7]])
    assert [s.ranks for s in subs] == [(1, 6), (0, 2, 7)]
    assert cur is subs[1]
    assert subs[0].family == subs[1].family
    overlap = r"rank 2 appears in ranks_per_subgroup_list\[0\] and \[1\]"
    with pytest.raises(ValueError, match=overlap):
        jaxpg.new_subgroups_by_enumeration([[1, 2], [2, 3]])


def test_non_group_member_sentinel():
    assert jaxpg.get_rank(GroupMember.NON_GROUP_MEMBER) == -1
    assert jaxpg.get_world_size(GroupMember.NON_GROUP_MEMBER) == -1
    # torch 2.13's _warn_not_in_group: the exact text, and no call; the input comes back
    # unchanged (torch leaves its tensors as they were)
    text = "Running all_gather_single on global rank 0 which does not belong to the given group."
    x = np.arange(3.0)
    with pytest.warns(UserWarning) as seen:
        assert jaxpg.all_gather_into_tensor(x, group=GroupMember.NON_GROUP_MEMBER) is x
    assert [str(w.message) for w in seen] == [text]
    with pytest.warns(UserWarning, match="Running all_reduce on global rank 0"):
        assert jaxpg.all_reduce(x, group=GroupMember.NON_GROUP_MEMBER, async_op=True) is None
    with pytest.warns(UserWarning, match="Running isend on global rank 0 which does not"):
        assert jaxpg.isend(np.ones(3), 1, GroupMember.NON_GROUP_MEMBER) is None
    # this process holds every rank, so it was left out of no group: torch's "not registered"
    with pytest.raises(ValueError, match="NON_GROUP_MEMBER is not registered"):
        jaxpg.get_group_rank(GroupMember.NON_GROUP_MEMBER, 0)


def test_destroy_subgroup_only():
    g = jaxpg.new_group([0, 1])
    jaxpg.destroy_process_group(g)
    assert jaxpg.is_initialized()
    assert g.group_name not in jaxpg.groups.world.current().groups


def test_stale_group_from_destroyed_world():
    g = jaxpg.new_group([0, 1])
    jaxpg.destroy_process_group()
    jaxpg.init_process_group()
    with pytest.raises(ValueError, match="destroyed world"):
        jaxpg.all_reduce([[1.0], [2.0]], group=g)


def test_as_rank_rejects_foreign_rank():
    with pytest.raises(ValueError, match="rank=9 is not one of this process's ranks"):
        with jaxpg.as_rank(9):
            pass


def test_new_group_keeps_the_order_with_sort_ranks_false_and_torch_keywords():
    g = jaxpg.new_group([3, 1, 2], sort_ranks=False, group_desc="mine", device_id=None)
    assert jaxpg.get_process_group_ranks(g) == [3, 1, 2] and g.group_desc == "mine"
    with jaxpg.as_rank(1):
        assert g.rank() == 1
    rows = np.stack([np.full(2, r, np.float32) for r in (1, 2, 3)])  # local ranks 1, 2, 3
    gathered = jaxpg.all_gather(rows, group=g)
    assert [float(x[0, 0]) for x in gathered] == [3.0, 1.0, 2.0]  # group-rank order
    assert jaxpg.get_process_group_ranks(jaxpg.new_group([3, 1, 2])) == [1, 2, 3]
    local = jaxpg.new_group([4, 5], use_local_synchronization=True)
    assert local.group_name.startswith("local") and local.group_desc == local.group_name
