"""``jaxpg-run``: a torchrun-style launcher for JAX programs.

It starts ``--nproc-per-node`` copies of a script on this machine, gives each the
environment that ``init_process_group("env://")`` reads, and watches them::

    jaxpg-run --nproc-per-node 4 train.py --lr 0.1
    python -m jaxpg.run --nproc-per-node 2 --devices-per-proc 2 -m mypkg.train
    jaxpg-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 2 --max-restarts 3 train.py

Each worker gets torchrun's variables: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node rank), ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (this attempt's coordinator),
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``; and
``PYTHONUNBUFFERED=1`` and its devices: on CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` with ``N`` from
``--devices-per-proc`` (default 1, or ``JAXPG_DEVICES_PER_PROC``); with NVIDIA GPUs,
``CUDA_VISIBLE_DEVICES`` set to the worker's own ``N`` GPUs. Other variables
(``NCCL_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``, ...) pass through untouched.

The launcher of node 0 hosts JAX's coordination service for the workers (see
:mod:`jaxpg.run.coordination`), so the death of any worker, rank 0 included, leaves it up.

Output: every line and every carriage-return redraw a worker prints comes out whole as soon
as it ends (a partial line after a moment of quiet), prefixed with ``[rank N]``, so one
rank's ``print`` is never split by another's; ``--local-ranks-filter`` shows only some local
ranks, ``--log-dir`` (with ``--tee``/``--redirect``) writes per-rank log files. gloo's
connection chatter and, once the job fails, C++ log lines are left out unless
``JAXPG_DEBUG`` is set (:mod:`jaxpg.run.output`). When a worker fails, the launcher prints a
one-line diagnosis after its output: the jaxpg error it raised, or what a C++ abort means
(:mod:`jaxpg.run.diagnosis`).

Failures: when a worker exits with a non-zero code (or raised and cannot exit), the launcher
stops the others (SIGTERM, then SIGKILL for what is alive after ``--grace-period`` seconds).
With ``--max-restarts N`` it then starts the whole group again with a fresh rendezvous (a
new coordinator port), up to N times, on every node together; otherwise it exits with that
code, and its last lines name the first failure: rank, exit code and exception, from the
worker's error file (:mod:`jaxpg.run.error_file`, :func:`record`). On Ctrl-C it forwards
SIGINT to the workers and exits 130 (SIGTERM: 143). Workers die with the launcher (Linux).
"""

from jaxpg.run.agent import main
from jaxpg.run.env import worker_env
from jaxpg.run.error_file import record

__all__ = ["main", "record", "worker_env"]
