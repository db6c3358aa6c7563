"""Reading the world a launcher made: torchrun's, a Slurm step's, Open MPI's, MPICH's
variables, in torch's order, and what init_process_group and jaxpg-run make of them."""

from __future__ import annotations

import pytest

from jaxpg.rendezvous import RendezvousInfo, rendezvous
from jaxpg.rendezvous.cluster_env import detect_launcher, first_host, tasks_per_node

# What srun -n 4 (2 nodes x 2) gives the task of rank 3, as Slurm 22.05 sets it.
SLURM = dict(SLURM_JOB_ID="812", SLURM_STEP_ID="0", SLURM_PROCID="3", SLURM_NTASKS="4",
             SLURM_STEP_NUM_TASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1",
             SLURM_STEP_NODELIST="gpu[007-008]", SLURM_STEP_TASKS_PER_NODE="2(x2)")
# What Open MPI 4.1's mpirun -n 2 gives rank 1 on one machine.
OMPI = dict(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK="1",
            OMPI_COMM_WORLD_LOCAL_SIZE="2", PMIX_NAMESPACE="1589444609",
            OMPI_MCA_orte_hnp_uri="1589444608.0;tcp://192.0.2.2:43447;tcp6://[fd00::2]:46461")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", *SLURM, *OMPI, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                 "MPI_LOCALNRANKS", "SLURM_TASKS_PER_NODE")


@pytest.fixture(autouse=True)
def env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def set_env(env, values):
    for name, value in values.items():
        env.setenv(name, value)


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"), ("node001,host2", "node001"), ("node[001-015],host2", "node001"),
    ("node[007,001-003]", "node007"), ("r[1-2]n[07-08]-ib,x", "r1n07-ib"), ("a-b,c", "a-b"),
])
def test_first_host_of_a_slurm_host_list(nodelist, first):
    assert first_host(nodelist) == first


def test_bad_host_lists_and_task_counts_are_named():
    with pytest.raises(ValueError, match="unbalanced"):
        first_host("node[1-2")
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_per_node("two")


def test_slurm_step(env):
    set_env(env, SLURM)
    found = detect_launcher()
    assert (found.launcher, found.rank, found.world_size) == ("slurm", 3, 4)
    assert (found.local_rank, found.local_world_size) == (1, 2)
    host, port = found.coordinator.split(":")
    assert host == "gpu007" and 61440 <= int(port) < 65536
    other = dict(SLURM, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    assert detect_launcher(other).coordinator == found.coordinator  # every task agrees
    env.setenv("MASTER_PORT", "29500")
    env.setenv("MASTER_ADDR", "10.0.0.7")
    assert detect_launcher().coordinator == "10.0.0.7:29500"


def test_a_batch_script_is_one_process_not_the_allocation(env):
    set_env(env, {k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")})
    assert detect_launcher() is None


def test_torchrun_variables_win_over_slurm_and_mpi(env):
    set_env(env, {**SLURM, **OMPI, "RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h",
                  "MASTER_PORT": "1234"})
    found = detect_launcher()
    assert (found.launcher, found.rank, found.world_size, found.coordinator) == (
        "torchrun", 5, 8, "h:1234")
    env.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="WORLD_SIZE is not"):
        detect_launcher()


def test_open_mpi_on_one_machine_and_on_several(env):
    set_env(env, OMPI)
    found = detect_launcher()
    assert (found.launcher, found.rank, found.world_size) == ("openmpi", 1, 2)
    assert found.coordinator.startswith("127.0.0.1:")
    env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")  # ranks on two machines: mpirun's host
    assert detect_launcher().coordinator.startswith("192.0.2.2:")
    assert detect_launcher().coordinator.split(":")[1] == found.coordinator.split(":")[1]


def test_mpich_needs_master_addr_across_machines(env):
    set_env(env, dict(PMI_RANK="2", PMI_SIZE="4", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="2"))
    found = detect_launcher()
    assert (found.launcher, found.rank, found.world_size, found.coordinator) == (
        "mpich", 2, 4, None)
    with pytest.raises(ValueError, match="Set MASTER_ADDR"):
        rendezvous()
    env.setenv("MASTER_ADDR", "node0")
    env.setenv("MASTER_PORT", "29400")
    assert rendezvous().coordinator_address == "node0:29400"


def test_mpirun_inside_an_allocation_takes_mpiruns_world(env):
    # mpirun -n 2 inside a one-task batch step: the ranks inherit the step's variables
    set_env(env, {**SLURM, "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                  "SLURM_STEP_NUM_TASKS": "1", **OMPI})
    assert detect_launcher().launcher == "openmpi"
    # srun --mpi=pmi2 sets both, agreeing: Slurm's node list names the coordinator
    set_env(env, {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                  "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"})
    assert detect_launcher().launcher == "slurm"


def test_bad_values_are_named(env):
    set_env(env, dict(SLURM, SLURM_PROCID="three"))
    with pytest.raises(ValueError, match="SLURM_PROCID='three'"):
        detect_launcher()
    set_env(env, dict(SLURM, SLURM_PROCID="4"))
    with pytest.raises(ValueError, match="rank 4 outside"):
        detect_launcher()
    set_env(env, dict(SLURM, WORLD_SIZE="2"))
    with pytest.raises(ValueError, match="WORLD_SIZE=2 disagrees"):
        detect_launcher()


def test_rendezvous_reads_the_launchers_world_after_explicit_arguments(env):
    set_env(env, SLURM)
    info = rendezvous()
    assert info == RendezvousInfo(coordinator_address=detect_launcher().coordinator, rank=3,
                                  world_size=4, local_rank=1, local_world_size=2,
                                  init_method="env://", launcher="slurm")
    assert rendezvous(rank=0).rank == 0
    tcp = rendezvous("tcp://10.0.0.1:29500")  # rank and world size from srun
    assert (tcp.coordinator_address, tcp.rank, tcp.world_size) == ("10.0.0.1:29500", 3, 4)


def test_init_process_group_never_makes_a_launchers_world_a_world_of_one(env):
    from jaxpg.groups import world

    assert not world._wants_multiprocess(None, None, -1)
    set_env(env, {**SLURM, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1",
                  "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    assert not world._wants_multiprocess(None, None, -1)  # srun -n 1: one process
    set_env(env, SLURM)
    assert world._wants_multiprocess(None, None, -1)
    for name in SLURM:
        env.delenv(name)
    set_env(env, OMPI)
    assert world._wants_multiprocess(None, None, -1)


@pytest.mark.cpu_only  # 2 local processes: jaxpg-run counts the GPUs on a GPU host
def test_jaxpg_run_under_srun_takes_its_nodes_from_the_step(env, capsys):
    from jaxpg.run.cli import parse_args

    set_env(env, dict(SLURM, SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2",
                      SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    args = parse_args(["--nproc-per-node", "2", "train.py"])
    assert (args.nnodes, args.node_rank, args.master_addr) == (2, 1, "gpu007")
    assert args.master_port == int(detect_launcher().coordinator.split(":")[1])
    args = parse_args(["--nnodes", "1", "train.py"])  # the user lays out the nodes
    assert (args.nnodes, args.node_rank, args.master_addr) == (1, 0, "127.0.0.1")
    args = parse_args(["--master-port", "29500", "train.py"])
    assert (args.nnodes, args.node_rank, args.master_port) == (2, 1, 29500)
    args = parse_args(["--standalone", "train.py"])
    assert (args.nnodes, args.node_rank, args.master_addr) == (1, 0, "127.0.0.1")
