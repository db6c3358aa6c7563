"""examples/quickstart.ipynb runs top to bottom in Colab's flow, in a fresh kernel.

Colab's flow: a fresh runtime that lacks jaxpg, and a clone of the repository beside the
notebook (``!git clone <repository>`` makes ``./jaxpg``). The test builds that: a copy of
the repository's files as git sees them (tracked and new, not ignored) in ``jaxpg/`` next
to a copy of the notebook, and a kernel whose Python has every package of the environment
that runs pytest (the CI's fresh ``.venv``) except jaxpg. The notebook's first cell must
find the clone, ``pip install`` it, and import it from there. The notebook itself asserts
its results against references (numpy for the collectives, one-device training for DDP,
the un-pipelined model for the pipeline); this test also checks what it printed, and that
the repository URL in ``pyproject.toml`` is the one the notebook and the docs use.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
# Bulky outputs (images, long logs) must not be stored in the repository.
MAX_STORED_OUTPUT_BYTES = 2_000


def _kernel_manager(folder: pathlib.Path, python: str) -> KernelManager:
    spec = folder / "kernels" / "jaxpg-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jaxpg test (a fresh environment without jaxpg)",
        "language": "python",
    }))
    specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
    return KernelManager(kernel_name="jaxpg-test", kernel_spec_manager=specs)


def _environment_without_jaxpg(folder: pathlib.Path) -> str:
    """A virtual environment with this interpreter's packages (linked) but not jaxpg."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = str(folder / "bin" / "python")
    theirs = pathlib.Path(sysconfig.get_paths()["purelib"])
    ours = pathlib.Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    for entry in theirs.iterdir():
        if not entry.name.startswith(("jaxpg", "__editable__")):
            (ours / entry.name).symlink_to(entry)
    found = subprocess.run([python, "-c", "import importlib.util as u; "
                            "print(u.find_spec('jaxpg') is None, u.find_spec('jax') is None)"],
                           capture_output=True, text=True, cwd=folder)
    assert found.stdout.split() == ["True", "False"], found  # no jaxpg; jax is there
    return python


def _clone(target: pathlib.Path) -> None:
    """The repository's files as a fresh clone of this working tree would hold them."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _repository() -> str:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


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


def test_one_repository_url_everywhere():
    repository = _repository()
    owner_repo = repository.removeprefix("https://github.com/")
    colab = f"https://colab.research.google.com/github/{owner_repo}/blob/main/examples/" \
            "quickstart.ipynb"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first, install = nb.cells[0].source, nb.cells[2].source
    assert f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]" \
           f"({colab})" in first
    assert f'REPOSITORY = "{repository}"' in install
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["urls"]["Quickstart"] == colab
    # any Colab address, and any GitHub address of a repository named jaxpg, in the notebook,
    # the README or the docs is this one (links to other projects' repositories may stay)
    texts = {"notebook": json.dumps(nb), **{str(p.relative_to(ROOT)): p.read_text() for p in
                                            [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]}}
    checked = 0
    for where, text in texts.items():
        for site, found in re.findall(r"(github\.com|colab\.research\.google\.com/github)/"
                                      r"([\w.-]+/[\w.-]+)", text):
            found = found.removesuffix(".git")
            if site != "github.com" or found.split("/")[1].lower() == "jaxpg":
                assert found == owner_repo, (where, found)
                checked += 1
    assert checked >= 3  # the notebook's badge and clone, the README's badge


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quickstart_notebook_runs_in_colabs_flow(tmp_path, monkeypatch):
    # a fresh runtime: no jaxpg, a clone beside the notebook, nothing on PYTHONPATH
    monkeypatch.delenv("JAXPG_SOURCE", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    python = _environment_without_jaxpg(tmp_path / "env")
    content = tmp_path / "content"  # Colab's working folder
    (content / "jaxpg").mkdir(parents=True)
    _clone(content / "jaxpg")
    shutil.copy2(NOTEBOOK, content / "quickstart.ipynb")
    nb = nbformat.read(content / "quickstart.ipynb", as_version=4)
    client = NotebookClient(
        nb, km=_kernel_manager(tmp_path, python), timeout=300, allow_errors=False,
        resources={"metadata": {"path": str(content)}},
    )
    client.execute(cleanup_kc=True)  # shut the kernel down and close its sockets
    printed = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert f"installing {(content / 'jaxpg').resolve()}" in printed  # the clone, no URL
    installed = pathlib.Path(printed.split("jaxpg from ", 1)[1].split()[0])
    assert installed.is_relative_to(tmp_path / "env"), installed  # pip put it in the env
    assert "8 devices on cpu" in printed  # a CPU runtime simulates 8 devices
    assert "XLA ops: ['all-reduce', 'collective-permute']" in printed
    assert "test accuracy" in printed
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the loss plot and two timetables
    assert "initialized: False" in printed
