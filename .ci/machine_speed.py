#!/usr/bin/env python3
"""Prints how fast this machine's cores are, on the work the suite does, so that a CI log's
times can be compared across machines: the same code has taken 19 and 51 minutes on
different 2-core machines. Three fixed workloads, in CPU seconds of this process:

* ``import``: ``import jax, flax.nnx, optax`` and ``jax.devices()`` (what every worker
  process pays before its work), in a child process, best of three;
* ``python``: a fixed pure-Python loop, best of three;
* ``compile``: jitting and running 12 small distinct programs (the suite's typical work is
  XLA compiling), at the suite's optimization level 0 (tests/conftest.py).

Usage: ``.ci/machine_speed.py`` with the leg's interpreter, from the repository root. The
reference figures, and the per-file budgets measured with them, are in docs/development.md
("Time").
"""

import os
import resource
import subprocess
import sys
import time


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def import_seconds() -> float:
    """CPU s of a child process that imports jax, flax.nnx and optax and lists the devices."""
    code = "import jax, flax.nnx, optax; jax.devices()"
    best = float("inf")
    for _ in range(3):
        before = _children_cpu()
        subprocess.run([sys.executable, "-c", code], check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        best = min(best, _children_cpu() - before)
    return best


def python_seconds() -> float:
    """CPU s of a fixed pure-Python loop."""
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        total = 0
        for i in range(10_000_000):
            total += i % 7 * (i & 3)
        best = min(best, time.process_time() - t0)
    return best


def compile_seconds() -> float:
    """CPU s to jit and run 12 small distinct programs (forward and gradient of an MLP)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0").strip()
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)  # time compiles, not reads
    t0 = time.process_time()
    for width in range(32, 32 + 12 * 8, 8):
        w = jnp.ones((width, width)) / width

        def loss(w, x):
            for _ in range(3):
                x = jnp.tanh(x @ w)
            return jnp.mean(x ** 2)

        jax.jit(jax.value_and_grad(loss))(w, jnp.ones((16, width)))[1].block_until_ready()
    return time.process_time() - t0


def main() -> None:
    imports, python = import_seconds(), python_seconds()
    compiles = compile_seconds()
    print(f"== machine speed (CPU s, lower is faster; see docs/development.md, 'Time'): "
          f"import {imports:.2f}, python {python:.2f}, compile {compiles:.2f}")


if __name__ == "__main__":
    main()
