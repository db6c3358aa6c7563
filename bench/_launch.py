"""How every benchmark starts its worker processes: :func:`launch`.

``launch(script, args, nproc=N)`` runs ``python -m jaxpg.run --nproc-per-node N script
args`` (one process per rank, the launcher's CPU pinning and environment), and
``launch(script, args)`` runs ``python script args`` as one plain process (a benchmark's own
single-process part in a fresh interpreter, e.g. with other XLA flags). Either way the child
gets this environment without the variables of an enclosing launch (``RANK``, ...), with
``JAX_PLATFORMS=cpu`` (``platform=``), without the simulated-device flag this process may
have set for itself, with the checkout and ``bench/`` first on ``PYTHONPATH``, and with
``env``'s overrides on top. A failure raises :class:`LaunchError` naming the command, the exit
code and the last lines of the output.

:func:`free_port` is ``jaxpg.internal.free_port`` (for a worker's second rendezvous, such
as torch's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
# what an enclosing launch (jaxpg-run, torchrun, SLURM's srun) sets for its own workers
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")
_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\S*")


class LaunchError(RuntimeError):
    """A launched benchmark worker failed; the message ends with its last output lines."""


@dataclass
class Launched:
    """A finished launch: the command, its exit code, its output (``None`` when it went
    to the terminal) and its wall time."""

    cmd: list[str]
    returncode: int
    output: str | None
    seconds: float

    def tail(self, lines: int = 40) -> str:
        return "\n".join((self.output or "").splitlines()[-lines:])


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (``jaxpg.internal.free_port``)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from jaxpg.internal import free_port as port

    return port()


def child_env(env: Mapping[str, str | None] | None = None,
              platform: str | None = "cpu") -> dict[str, str]:
    """The environment :func:`launch` gives its children (see the module's docstring); a
    ``None`` value in ``env`` removes that variable."""
    out = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    flags = _DEVICE_COUNT.sub("", out.get("XLA_FLAGS", "")).strip()
    if flags:
        out["XLA_FLAGS"] = " ".join(flags.split())
    else:
        out.pop("XLA_FLAGS", None)
    if platform is not None:
        out["JAX_PLATFORMS"] = platform
    path = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCH), *path])
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def launch(script: str | Path, args: Sequence[object] = (), *, nproc: int | None = None,
           launcher_args: Sequence[object] = (), env: Mapping[str, str | None] | None = None,
           platform: str | None = "cpu", timeout: float = 1800, capture: bool = True,
           echo: Callable[[str], None] | None = None, check: bool = True,
           expect: Sequence[str | Path] = (), cwd: str | Path = ROOT,
           what: str | None = None) -> Launched:
    """Runs ``script`` with ``args``: ``nproc`` processes under ``python -m jaxpg.run`` (with
    ``launcher_args`` before the script), or, with ``nproc=None``, one plain process.

    Args:
        env: environment overrides (``None`` removes a variable); see :func:`child_env`.
        platform: ``JAX_PLATFORMS`` for the children (``None``: the environment's).
        timeout: seconds before the whole process group is killed (a failure).
        capture: collect stdout and stderr (``Launched.output``; its tail goes into the
            error); without it they go to this process's terminal.
        echo: with ``capture``, called with every output line as it comes (progress).
        check: raise :class:`LaunchError` on a non-zero exit, a timeout, or a file of
            ``expect`` missing afterwards; without it the caller reads ``returncode``.
        what: the name in the error (default: the script's file name).

    Returns:
        :class:`Launched`.
    """
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "jaxpg.run", "--nproc-per-node", str(nproc), *map(str, launcher_args)]
    cmd += [str(script), *map(str, args)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(env, platform),
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None,
                            text=True, start_new_session=True)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    lines: list[str] = []
    try:
        if capture:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if echo is not None:
                    echo(line.rstrip("\n"))
        code = proc.wait()
    except BaseException:
        kill()
        raise
    finally:
        timer.cancel()
    done = Launched(cmd, code, "".join(lines) if capture else None,
                    time.perf_counter() - start)
    missing = [str(p) for p in expect if not Path(p).exists()]
    if check and (code != 0 or timed_out.is_set() or missing):
        name = what or Path(script).name
        why = (f"timed out after {timeout:.0f} s" if timed_out.is_set()
               else f"exit code {code}" if code else f"wrote no {', '.join(missing)}")
        shown = (f"last lines of its output:\n{done.tail()}" if capture
                 else "its output is above")
        raise LaunchError(f"{name} failed ({why}, {done.seconds:.0f} s): "
                          f"{' '.join(cmd)}\n{shown}")
    return done
