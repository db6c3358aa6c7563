"""The one way a test may skip something CI must run: skip locally, fail where required.

A skip that CI must not take goes through :func:`unavailable` (or :func:`import_or_skip`),
naming the ``JAXPG_REQUIRE_*`` variable that makes it a failure instead:

* ``JAXPG_REQUIRE_TORCH=1``: the torch comparisons must run (CI's Python 3.11 leg).
* ``JAXPG_REQUIRE_CLUSTER_TESTS=1``: the Slurm, mpirun and network-namespace tests must run
  (both CI legs).

Independently, ``JAXPG_FORBID_SKIPS=1`` (tests/conftest.py) turns every skip of the session
into a failure, whatever its cause: CI's 3.11 leg runs with it.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import NoReturn

import pytest

TORCH = "JAXPG_REQUIRE_TORCH"
CLUSTER = "JAXPG_REQUIRE_CLUSTER_TESTS"


def required(variable: str) -> bool:
    """Whether ``variable`` (a ``JAXPG_REQUIRE_*`` name) is set to 1 here."""
    return os.environ.get(variable, "") == "1"


def unavailable(reason: str, variable: str) -> NoReturn:
    """Skips the test with ``reason``, or fails it where ``variable`` is 1 (CI)."""
    __tracebackhide__ = True
    if required(variable):
        pytest.fail(f"{variable}=1, but {reason}", pytrace=False)
    # the suite's one skip: a local run without torch or the cluster tools says why and goes on;
    # CI sets the JAXPG_REQUIRE_* variables (and JAXPG_FORBID_SKIPS on 3.11), so it fails there
    pytest.skip(reason)


def import_or_skip(module: str, reason: str, variable: str = TORCH) -> ModuleType:
    """``pytest.importorskip(module)``, failing instead where ``variable`` is 1."""
    __tracebackhide__ = True
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as e:
        why = f"{module} cannot be imported ({e}): {reason}"
    unavailable(why, variable)
