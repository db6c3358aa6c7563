"""Real cluster software for the tests: a one-node Slurm (munged, slurmctld, slurmd) in a
temporary directory, a two-node one (a slurmd in each of two network namespaces), and
MPIwrapper built for this machine's Open MPI.

Both need Debian packages (``.ci/install_cluster_deps.sh`` installs them and builds
MPIwrapper into the cache this module reads). Where something is missing, the fixtures skip
with the reason, unless ``JAXPG_REQUIRE_CLUSTER_TESTS=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import _require
from _child_env import xla_flags
from _procs import stop

ROOT = Path(__file__).resolve().parents[2]
MPIWRAPPER = "MPIwrapper-2.11.1"


def unavailable(reason: str) -> NoReturn:
    """Skips the test with ``reason``, or fails it where the cluster tests must run (CI)."""
    _require.unavailable(reason, _require.CLUSTER)


def missing_programs(*names: str) -> list[str]:
    return [n for n in names if shutil.which(n) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``.

    ``PYTHONFAULTHANDLER``: a worker that dies of a fatal signal (an abort in C++) prints
    every Python thread's traceback, which names the thread at fault."""
    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "JAXPG_COORDINATOR_HOSTED"}
    env = {k: v for k, v in os.environ.items()
           if k not in names and not k.startswith(prefixes)}
    env.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(), **extra)
    return env


# ------------------------------------------------------------------------------ MPIwrapper
def vendor_dir() -> Path:
    """Where MPIwrapper's source is: ``JAXPG_VENDOR_DIR``, else the project's
    ``../shared/vendor``, else ``/work/shared/vendor``."""
    given = os.environ.get("JAXPG_VENDOR_DIR")
    if given:
        return Path(given)
    beside = ROOT.parent / "shared" / "vendor"
    return beside if beside.is_dir() else Path("/work/shared/vendor")


def mpiwrapper_cache() -> Path:
    """Where MPIwrapper is built: ``JAXPG_MPIWRAPPER_DIR``, else ``~/.cache/jaxpg/``."""
    given = os.environ.get("JAXPG_MPIWRAPPER_DIR")
    return Path(given) if given else Path.home() / ".cache" / "jaxpg" / MPIWRAPPER


def build_mpiwrapper() -> Path:
    """``libmpiwrapper.so`` for this machine's mpiexec, built once into the cache.

    The same steps as ``.ci/install_cluster_deps.sh``. Skips (or fails under
    ``JAXPG_REQUIRE_CLUSTER_TESTS=1``) when the tools or the source are missing.
    """
    lib = mpiwrapper_cache() / "inst" / "lib" / "libmpiwrapper.so"
    if lib.is_file():
        return lib
    missing = missing_programs("mpiexec", "mpicc", "mpicxx", "mpifort", "cmake")
    if missing:
        unavailable(f"building MPIwrapper needs {missing} (apt-get install openmpi-bin "
                    "libopenmpi-dev gfortran cmake)")
    source = vendor_dir() / f"{MPIWRAPPER}.tar.gz"
    if not source.is_file():
        unavailable(f"MPIwrapper's source {source} is missing (set JAXPG_VENDOR_DIR)")
    cache = mpiwrapper_cache()
    work = cache.with_name(cache.name + f".build-{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(source) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work, **safe)
    steps = [
        ["cmake", "-S", str(work / MPIWRAPPER), "-B", str(work / "build"),
         f"-DMPIEXEC_EXECUTABLE={shutil.which('mpiexec')}", "-DCMAKE_BUILD_TYPE=Release",
         f"-DCMAKE_INSTALL_PREFIX={work / 'inst'}"],
        ["cmake", "--build", str(work / "build"), "-j2"],
        ["cmake", "--install", str(work / "build")],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed:\n{done.stdout[-3000:]}"
                               f"{done.stderr[-3000:]}")
    cache.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache / "inst", ignore_errors=True)
    (work / "inst").rename(cache / "inst")  # atomic: a parallel build cannot half-write it
    shutil.rmtree(work, ignore_errors=True)
    return lib


def mpirun_command(n: int, *, env: dict[str, str], forward: list[str]) -> list[str]:
    """``mpirun -n N`` on this machine, as root if need be, forwarding ``forward``."""
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--tag-output", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for name in forward:
        cmd += ["-x", name]
    return cmd


# --------------------------------------------------------------------------------- Slurm
_SLURM_CONF = """\
ClusterName=jaxpgtest
SlurmctldHost={ctld_host}({ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
# job ids (and so the coordinator port jaxpg derives from them when MASTER_PORT is unset)
# differ between clusters that run at once on this machine, as the two CI legs' do
FirstJobId={first_job_id}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# sbatch --wait polls every 2 s, then 8 s, then 32 s while the wait is under MinJobAge / 2;
# 0 (job records never purged: a test cluster runs few jobs) keeps it at 2 s
MinJobAge=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""

TWO_NODES = ("jpgnode0", "jpgnode1")  # resolve to 192.0.2.1 and 192.0.2.2 in the namespaces


class Slurm:
    """A running Slurm: ``env`` is what ``srun``/``sbatch`` need (``SLURM_CONF``), and
    :meth:`command` puts a client command where the controller is reachable (inside the
    first node's network namespace for :func:`two_node_slurm`)."""

    def __init__(self, root: Path, env: dict[str, str], daemons: list[subprocess.Popen],
                 prefix: list[str], nodes: list[str]):
        self.root, self.env, self.daemons = root, env, daemons
        self.prefix, self.nodes = prefix, nodes

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, *args]

    def srun(self, args: list[str], timeout: float = 300, **extra: str) -> str:
        """``srun --label ARGS`` to its end; its output (stdout then stderr), which must
        exit 0 (else the assertion shows the output and the daemons' logs)."""
        env = dict(self.env, **extra)
        cmd = self.command("srun", "--overcommit", "--label", "--kill-on-bad-exit=1", *args)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-5000:] + "\n" + self.logs()
        return output

    def logs(self) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")):
            out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(out)


def by_label(output: str) -> dict[int, list[str]]:
    """srun --label's lines, per task: ``3: text``."""
    lines: dict[int, list[str]] = {}
    for m in re.finditer(r"^\s*(\d+): (.*)$", output, re.M):
        lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


def _wait_until_idle(slurm: Slurm, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    states: list[str] = []
    done = None
    while time.monotonic() < deadline:
        done = subprocess.run(slurm.command("sinfo", "-h", "-N", "-o", "%N %T"),
                              capture_output=True, text=True, env=slurm.env, timeout=30)
        states = sorted(done.stdout.split("\n")[:-1])
        if states == sorted(f"{n} idle" for n in slurm.nodes):
            return
        time.sleep(0.5)
    why = done.stderr.strip()[-500:] if done else ""
    raise RuntimeError(f"Slurm's nodes did not become idle within {timeout} s ({states}; "
                       f"{why}); logs in {slurm.root}\n{slurm.logs()}")


@contextlib.contextmanager
def _slurm(root: Path, nodes: list[tuple[str, str, list[str]]],
           ctld: tuple[str, list[str]]) -> Iterator[Slurm]:
    """munged, slurmctld and one slurmd per node (foreground, as children) in ``root``.

    ``nodes``: (name, address, prefix) per node, ``prefix`` the command that puts its slurmd
    where ``address`` is its own (:func:`_netns.inside`, or nothing); ``ctld``: the
    controller's (address, prefix), the clients' prefix too. munged's socket is a file, so
    one munged serves every namespace.
    """
    missing = missing_programs("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
    if missing:
        unavailable(f"a Slurm needs {missing} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        unavailable("slurmd must run as root to start job steps")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for sub in ["state", "munge", *(f"spool-{name}" for name, _, _ in nodes)]:
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = root / "munge" / "munge.sock"
    cpus = os.cpu_count() or 1
    conf = root / "slurm.conf"
    conf.write_text(_SLURM_CONF.format(
        ctld_host=socket.gethostname(), ctld_addr=ctld[0], ctld_port=free_port(),
        d_port=free_port(), first_job_id=random.randrange(1, 60_000_000),
        munge_socket=socket_path, root=root,
        nodes="\n".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN"
                        for name, addr, _ in nodes)))
    env = clean_env(SLURM_CONF=str(conf))
    daemons: list[subprocess.Popen] = []

    def start(cmd: list[str], log: str) -> None:
        with open(root / log, "ab") as out:
            daemons.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))

    try:
        start(["munged", "--foreground", "--force", f"--socket={socket_path}",
               f"--key-file={key}", f"--log-file={root / 'munged.log'}",
               f"--pid-file={root / 'munge' / 'munged.pid'}",
               f"--seed-file={root / 'munge' / 'munged.seed'}"], "munged.out")
        deadline = time.monotonic() + 30
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        start([*ctld[1], "slurmctld", "-D", "-f", str(conf)], "slurmctld.out")
        for name, _, prefix in nodes:
            start([*prefix, "slurmd", "-D", "-f", str(conf), "-N", name], f"slurmd-{name}.out")
        slurm = Slurm(root, env, daemons, ctld[1], [name for name, _, _ in nodes])
        _wait_until_idle(slurm, 90)
        yield slurm
    finally:
        for proc in reversed(daemons):  # the slurmds, slurmctld, munged
            stop(proc, 15)


@contextlib.contextmanager
def one_node_slurm(root: Path) -> Iterator[Slurm]:
    """A one-node Slurm on 127.0.0.1 (the node is this machine's hostname); stopped after."""
    with _slurm(root, [(socket.gethostname(), "127.0.0.1", [])], ("127.0.0.1", [])) as slurm:
        yield slurm


@contextlib.contextmanager
def two_node_slurm(root: Path) -> Iterator[Slurm]:
    """A two-node Slurm: nodes ``jpgnode0`` (192.0.2.1) and ``jpgnode1`` (192.0.2.2), each
    slurmd in its own network namespace (:func:`_netns.two_hosts`, where the node names
    resolve), slurmctld in the first; clients run there too (:meth:`Slurm.command`).
    Everything is stopped and deleted after, even on failure."""
    from _netns import HOST_ADDRESSES, inside, two_hosts, why_no_namespaces

    reason = why_no_namespaces()
    if reason is not None:
        unavailable(f"a two-node Slurm needs network namespaces: {reason}")
    missing = missing_programs("nsenter", "unshare")
    if missing:
        unavailable(f"a two-node Slurm needs {missing} (apt-get install util-linux)")
    with two_hosts(TWO_NODES) as namespaces:
        prefixes = [inside(ns) for ns in namespaces]
        nodes = list(zip(TWO_NODES, HOST_ADDRESSES, prefixes))
        with _slurm(root, nodes, (HOST_ADDRESSES[0], prefixes[0])) as slurm:
            yield slurm
