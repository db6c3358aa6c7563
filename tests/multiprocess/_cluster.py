"""Real cluster software for the tests: a one-node Slurm (munged, slurmctld, slurmd) in a
temporary directory, and MPIwrapper built for this machine's Open MPI.

Both need Debian packages (``.ci/install_cluster_deps.sh`` installs them and builds
MPIwrapper into the cache this module reads). Where something is missing, the fixtures skip
with the reason, unless ``JAXPG_REQUIRE_CLUSTER_TESTS=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import os
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
    """This environment without any launcher's variables, plus ``extra``."""
    prefixes = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "JAXPG_COORDINATOR_HOSTED"}
    env = {k: v for k, v in os.environ.items()
           if k not in names and not k.startswith(prefixes)}
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(), **extra)
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
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class Slurm:
    """A running one-node Slurm: ``env`` is what ``srun``/``sbatch`` need (``SLURM_CONF``)."""

    def __init__(self, root: Path, env: dict[str, str], daemons: list[subprocess.Popen]):
        self.root, self.env, self.daemons = root, env, daemons

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / name
            if path.is_file():
                out.append(f"--- {name}\n" + path.read_text(errors="replace")[-2000:])
        return "\n".join(out)


def _wait_until_idle(env: dict[str, str], root: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                              env=env, timeout=30)
        state = done.stdout.strip()
        if state.startswith("idle"):
            return
        time.sleep(0.5)
    raise RuntimeError(f"Slurm's node did not become idle within {timeout} s (state "
                       f"{state!r}); logs in {root}")


@contextlib.contextmanager
def one_node_slurm(root: Path) -> Iterator[Slurm]:
    """Starts munged, slurmctld and slurmd (foreground, as children) in ``root``; stops them."""
    missing = missing_programs("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
    if missing:
        unavailable(f"a one-node Slurm needs {missing} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        unavailable("slurmd must run as root to start job steps")
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    socket_path = root / "munge" / "munge.sock"
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(_SLURM_CONF.format(host=host, ctld_port=free_port(), d_port=free_port(),
                                       munge_socket=socket_path, root=root,
                                       cpus=os.cpu_count() or 1))
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
        start(["slurmctld", "-D", "-f", str(conf)], "slurmctld.out")
        start(["slurmd", "-D", "-f", str(conf), "-N", host], "slurmd.out")
        _wait_until_idle(env, root, 90)
        yield Slurm(root, env, daemons)
    finally:
        for proc in reversed(daemons):  # slurmd, slurmctld, munged
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
