"""Worker: ``python file_store_adder.py PATH ADDS``.

Adds 1 to the counter ``count`` ADDS times in the FileStore at PATH, then races
for ``leader`` with compare_set and prints ``WON`` or ``LOST``.
"""

import os
import sys
import types
from pathlib import Path

# Keep this worker light: load jaxpg.stores without jaxpg/__init__.py, which imports jax.
_package = types.ModuleType("jaxpg")
_package.__path__ = [str(Path(__file__).resolve().parents[3] / "jaxpg")]
sys.modules.setdefault("jaxpg", _package)

from jaxpg.stores import FileStore  # noqa: E402

path, adds = sys.argv[1], int(sys.argv[2])
store = FileStore(path, timeout=20)
store.add("ready", 1)
store.wait(["go"])
for _ in range(adds):
    store.add("count", 1)
mine = f"pid{os.getpid()}".encode()
print("WON" if store.compare_set("leader", b"", mine) == mine else "LOST", flush=True)
