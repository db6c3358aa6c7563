"""rendezvous(): parsing init_method, validation, file:// through threads."""

from __future__ import annotations

import threading

import jax
import pytest

from jaxpg.errors import DistError
from jaxpg.rendezvous import RendezvousInfo, initialize_jax_distributed, rendezvous
from jaxpg.stores import FileStore, HashStore

ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_env_names_every_missing_variable(clean_env):
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match="missing: RANK, WORLD_SIZE, MASTER_PORT"):
        rendezvous("env://")


def test_env_reads_the_launcher_variables(clean_env):
    values = dict(
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29500",
        RANK="3",
        WORLD_SIZE="4",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
    )
    for name, value in values.items():
        clean_env.setenv(name, value)
    info = rendezvous()  # env:// is the default
    assert info == RendezvousInfo(
        coordinator_address="10.0.0.1:29500",
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        init_method="env://",
    )
    assert rendezvous("env://", rank=0).rank == 0  # arguments win over the environment


def test_env_single_process_needs_no_coordinator(clean_env):
    info = rendezvous("env://", rank=0, world_size=1)
    assert info.coordinator_address is None and info.local_world_size == 1


def test_env_bad_integer_names_the_variable(clean_env):
    clean_env.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK='zero'"):
        rendezvous("env://")


def test_tcp(clean_env):
    info = rendezvous("tcp://127.0.0.1:1234", rank=1, world_size=2)
    assert (info.coordinator_address, info.rank, info.world_size) == ("127.0.0.1:1234", 1, 2)
    assert rendezvous("tcp://h:5?rank=2&world_size=3").rank == 2
    with pytest.raises(ValueError, match="needs rank and world_size"):
        rendezvous("tcp://127.0.0.1:1234")
    with pytest.raises(ValueError, match="tcp://host:port"):
        rendezvous("tcp://127.0.0.1", rank=0, world_size=2)


def test_validation(clean_env, tmp_path):
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        rendezvous("tcp://h:1", rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size=0"):
        rendezvous("tcp://h:1", rank=0, world_size=0)
    with pytest.raises(ValueError, match="Cannot specify both"):
        rendezvous("env://", store=HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="pass rank and world_size"):
        rendezvous(store=HashStore())
    with pytest.raises(ValueError, match="not supported"):
        rendezvous("mpi://", rank=0, world_size=1)
    with pytest.raises(TypeError, match="rank='0'"):
        rendezvous("tcp://h:1", rank="0", world_size=1)


def test_file_meets_through_the_file(tmp_path):
    url = f"file://{tmp_path / 'rdzv'}"
    infos: dict[int, RendezvousInfo] = {}

    def join(rank: int) -> None:
        infos[rank] = rendezvous(url, rank=rank, world_size=2, timeout=10)

    threads = [threading.Thread(target=join, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert infos[0].coordinator_address == infos[1].coordinator_address
    assert infos[0].coordinator_address.startswith("127.0.0.1:")
    assert isinstance(infos[0].store, FileStore)
    with pytest.raises(DistError, match="rank=1 was already claimed"):
        rendezvous(f"file://{tmp_path / 'rdzv'}", rank=1, world_size=3, timeout=1)


def test_one_process_world_starts_nothing(tmp_path):
    info = rendezvous(f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    assert info.coordinator_address is None
    assert initialize_jax_distributed(info) is info.store
    assert isinstance(
        initialize_jax_distributed(rendezvous("env://", rank=0, world_size=1)), HashStore
    )
    assert not jax.distributed.is_initialized()
