"""The environment of a test's worker processes: this process's, without its 8 devices.

The test process runs with conftest's ``XLA_FLAGS`` (8 simulated devices, and the CPU
compiler settings that compile the suite's many small programs faster: optimization level 0,
and on jaxlib 0.10 the older fusion emitters). A worker gets the same flags without the
device count, so that it has one device unless it (or ``jaxpg-run``) sets its own.
"""

from __future__ import annotations

import os
import re

DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def xla_flags(devices: int | None = None) -> str:
    """This process's ``XLA_FLAGS`` without its device count, plus ``devices`` if given."""
    flags = DEVICE_COUNT.sub("", os.environ.get("XLA_FLAGS", "")).split()
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without ``RANK``/``WORLD_SIZE`` or the device count, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["XLA_FLAGS"] = xla_flags()
    env.update(extra)
    return env
