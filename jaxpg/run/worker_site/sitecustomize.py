"""Loaded at startup by ``jaxpg-run``'s Python workers (the launcher puts this folder first on
their ``PYTHONPATH``): an uncaught exception is written to the worker's error file
(``jaxpg/run/error_file.py``, loaded by path: nothing of jaxpg or JAX is imported here), then
the next ``sitecustomize`` on the path, if any, runs as it would have.

It acts only in the launcher's own children (``JAXPG_RUN_LAUNCHER_PID`` is their parent's
pid): a process that a worker starts keeps its exceptions to itself.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _install():
    if os.environ.get("JAXPG_RUN_LAUNCHER_PID") != str(os.getppid()):
        return
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        _load("_jaxpg_error_file", os.path.join(os.path.dirname(_HERE), "error_file.py")
              ).install_excepthook()


def _next_sitecustomize():
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


try:
    _install()
except Exception:  # noqa: BLE001 (never stop the worker from starting)
    pass
_next_sitecustomize()
