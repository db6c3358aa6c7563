"""Eager semantics across processes (started by tests/multiprocess/test_eager_semantics_mp.py).

Modes (argv[1]):

* ``async``: ``all_reduce(y, async_op=True)`` where ``y`` depends on queued device work
  returns before that work is done (``y.is_ready()`` still False) and ``wait()`` gives the
  sum; the plain gloo call blocks (its result is ready on return); then rank 1 leaves and
  rank 0's ``Work.wait()`` raises the named DistTimeoutError.
* ``watchdog``: run with ``_JAXPG_STREAM_SEMANTICS=1`` (the accelerator rules on CPU):
  collectives return and give the right values; then rank 1 stops calling them, and rank
  0's watchdog must end the process with the named error.
* ``desync``: under ``JAXPG_DEBUG=DETAIL``, a shape mismatch and an op mismatch must raise
  DistDesyncError on every rank, naming the odd rank, before anything runs.
* ``desync_plain``: with the default signature check off (``JAXPG_DEBUG=OFF``), an op
  mismatch times out and the error says what each rank is running.

In ``async`` and ``watchdog``, rank 1 leaves only once rank 0 has ended (a handshake through
rank 0's pid in ``TEST_HANDSHAKE_DIR``): with a fixed sleep instead, a slow rank 0 on a loaded
machine would see rank 1's exit rather than its absence.
"""

import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: _arrays

import jax
import jax.numpy as jnp
import numpy as np
from _arrays import allclose

import jaxpg

mode = sys.argv[1]
timeout = datetime.timedelta(seconds=float(os.environ.get("TEST_TIMEOUT_S", "3")))
# The world starts with a generous timeout (on a loaded machine the processes may take
# longer than the short one to start); its collectives then get the short one.
jaxpg.init_process_group(timeout=max(timeout, datetime.timedelta(seconds=120)))
if mode != "async":
    jaxpg.GroupMember.WORLD.timeout = timeout
rank, n = jaxpg.get_rank(), jaxpg.get_world_size()


def say(text: str) -> None:
    print(f"[rank {rank}] {text}", flush=True)


HANDSHAKE = Path(os.environ.get("TEST_HANDSHAKE_DIR", "."))
if rank == 0:
    (HANDSHAKE / "rank0.pid.tmp").write_text(str(os.getpid()))
    (HANDSHAKE / "rank0.pid.tmp").rename(HANDSHAKE / "rank0.pid")


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] in "ZX"
    except FileNotFoundError:
        return True


def leave_after_rank_0() -> None:
    """Exits once rank 0's process has ended (or after 100 s): rank 1's exit must not be
    what rank 0 sees."""
    deadline, pid_file = time.monotonic() + 100, HANDSHAKE / "rank0.pid"
    while time.monotonic() < deadline:
        if pid_file.exists() and ended(int(pid_file.read_text())):
            break
        time.sleep(0.05)
    os._exit(0)


@jax.jit
def slow(x):
    def step(_, a):
        return jnp.tanh(a @ a) * 0.5 + 0.5
    return jax.lax.fori_loop(0, 40, step, x)


if mode == "async":
    base = jnp.full((600, 600), 0.001 * (rank + 1), jnp.float32)
    y = slow(base)  # queued: ~1 s of matmuls on this machine
    work = jaxpg.all_reduce(y, async_op=True)
    say(f"ASYNC returned, input ready: {y.is_ready()}")
    got = np.asarray(work.result())
    want = sum(np.asarray(slow(jnp.full((600, 600), 0.001 * (r + 1), jnp.float32)))
               for r in range(n))
    say(f"ASYNC values ok: {allclose(got, want, rtol=1e-5)}")
    z = slow(base)
    out = jaxpg.all_reduce(z)
    say(f"PLAIN result ready on return: {out.is_ready()}")
    w = jaxpg.broadcast(np.arange(3.0) + rank, src=1, async_op=True)
    say(f"ASYNC broadcast ok: {allclose(np.asarray(w.result()), np.arange(3.0) + 1)}")
    if rank == 1:
        leave_after_rank_0()
    # The short timeout only now: the ~1 s of queued matmuls above may take several seconds
    # on a loaded machine, which is not what this test is about.
    jaxpg.GroupMember.WORLD.timeout = timeout
    work = jaxpg.all_reduce(np.ones(4, np.float32), async_op=True)
    say("ASYNC timeout returned")
    for limit in (1.0, None):
        start = time.monotonic()
        try:
            work.wait(limit)
            say("NO ERROR")
        except jaxpg.DistError as err:
            say(f"WAIT({limit}) raised after {time.monotonic() - start:.1f} s: "
                f"{type(err).__name__}: {err}")
    os._exit(0)

if mode == "watchdog":
    x = np.arange(4, dtype=np.float32) + rank
    out = jaxpg.all_reduce(x)
    want = sum(np.arange(4) + r for r in range(n))
    say(f"STREAM values ok: {allclose(np.asarray(out), want)}")
    work = jaxpg.all_gather_into_tensor(jnp.asarray(x), async_op=True)
    want = np.concatenate([np.arange(4) + r for r in range(n)])
    say(f"STREAM async ok: {allclose(np.asarray(work.result()), want)}")
    if rank == 1:
        leave_after_rank_0()
    jaxpg.all_reduce(x)
    say("STREAM returned")
    time.sleep(20)
    say("WATCHDOG DID NOT FIRE")
    os._exit(1)

if mode in ("desync", "desync_plain"):
    cases = [("shape", 2), ("op", 1)] if mode == "desync" else [("op", 1)]
    for case, odd in cases:
        start = time.monotonic()
        try:
            if case == "shape":
                jaxpg.all_reduce(np.ones(8 if rank == odd else 4, np.float32))
            elif rank == odd:
                jaxpg.all_gather_into_tensor(np.ones(4, np.float32))
            else:
                jaxpg.all_reduce(np.ones(4, np.float32))
            say(f"CASE {case} NO ERROR")
        except jaxpg.DistError as err:
            say(f"CASE {case} raised after {time.monotonic() - start:.1f} s: "
                f"{type(err).__name__}: {err}")
    if mode == "desync":  # the world still works after a caught desync
        out = jaxpg.all_reduce(np.ones(2, np.float32))
        say(f"AFTER ok: {allclose(np.asarray(out), np.full(2, n))}")
    # rank 0 hosts the coordination service: leave only once every rank has reported
    store = jaxpg.GroupMember.WORLD.store
    store.set(f"pid{rank}", str(os.getpid()))
    store.add("reported", 1)
    deadline = time.monotonic() + 30
    while int(store.get("reported")) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank != 0:
        os._exit(0)
    others = [int(store.get(f"pid{r}")) for r in range(1, n)]
    while not all(ended(pid) for pid in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)
