"""examples/quickstart.ipynb runs top to bottom, on this interpreter, in a fresh kernel.

The kernel is an ipykernel started with ``sys.executable`` (a kernel spec written for the
test), so it sees exactly the packages of the environment that runs pytest (the CI's fresh
``.venv``), whatever kernel specs the machine has installed. The notebook itself asserts
its results against references (numpy for the collectives, one-device training for DDP,
the un-pipelined model for the pipeline); this test also checks what it printed.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
# Bulky outputs (images, long logs) must not be stored in the repository.
MAX_STORED_OUTPUT_BYTES = 2_000


def _kernel_manager(folder: pathlib.Path) -> KernelManager:
    spec = folder / "kernels" / "jaxpg-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxpg test (this interpreter)",
        "language": "python",
    }))
    specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
    return KernelManager(kernel_name="jaxpg-test", kernel_spec_manager=specs)


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def test_notebook_is_stored_without_bulky_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    stored = sum(len(json.dumps(c.get("outputs", []))) for c in nb.cells if c.cell_type == "code")
    assert stored <= MAX_STORED_OUTPUT_BYTES
    assert nb.metadata.kernelspec.name == "python3"  # what Colab and Jupyter expect


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # The notebook installs jaxpg only when it cannot import it; here it must import the
    # checkout under test, first on the kernel's path, and never pip install anything.
    monkeypatch.delenv("JAXPG_SOURCE", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb, km=_kernel_manager(tmp_path), timeout=240, allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute(cleanup_kc=True)  # shut the kernel down and close its sockets
    printed = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "installing" not in printed
    assert f"jaxpg from {ROOT / 'jaxpg'}" in printed
    assert "8 devices on cpu" in printed  # a CPU runtime simulates 8 devices
    assert "XLA ops: ['all-reduce', 'collective-permute']" in printed
    assert "test accuracy" in printed
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the loss plot and two timetables
    assert "initialized: False" in printed
