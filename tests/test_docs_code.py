"""Every Python block of README.md and docs/*.md runs as written.

The convention, for whoever writes the docs:

* A fenced block opened with ```` ```python ```` (or ```` ```py ````) is run. The blocks of
  one page run in order in one fresh Python process, sharing one namespace (a later block
  may use what an earlier one defined), with the repository as the working directory,
  ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (eight
  simulated ranks, as a notebook would have). A block may set ``XLA_FLAGS`` itself before
  importing JAX.
* A block whose first line is ``# launch: jaxpg-run --nproc-per-node N`` (more launcher
  flags may follow) is a script of its own: it runs under the launcher with ``N``
  processes, each with one simulated CPU device, and must exit 0 on every rank.
* A block opened with ```` ```{code-block} python ```` is not run: use it for illustrative
  snippets (a fragment, a signature, something that needs a GPU or a cluster).
* Inside the blocks, a discarded collective result (``DiscardedResultWarning``) and a
  float64 input narrowed to float32 are errors: the docs must show code that is right.

The pages are found when the tests are collected (``README.md`` and ``docs/**/*.md``), so a
new page is tested without being listed here. A failure names the page and the block's
line, and the traceback's line numbers are the page's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _child_env import xla_flags

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)\s*(.*)$")
_LAUNCH = re.compile(r"^#\s*launch:\s*jaxpg-run\s+(.*)$")
_RUNNER = r'''
import json, sys, traceback, warnings
import jaxpg
warnings.simplefilter("error", jaxpg.DiscardedResultWarning)
warnings.filterwarnings("error", message=r"\w+: [\w\[\]]+ is (float64|complex128) and becomes")
namespace = {"__name__": "__main__"}
for path, line, code in json.load(open(sys.argv[1])):
    try:
        exec(compile("\n" * (line - 1) + code, path, "exec"), namespace)
    except BaseException:
        print(f"BLOCK FAILED {path}:{line}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    print(f"BLOCK OK {path}:{line}", flush=True)
'''


@dataclass(frozen=True)
class Block:
    """One fenced Python block: its page, the line of its first code line, its code."""

    page: str
    line: int
    code: str

    @property
    def launch_args(self) -> list[str] | None:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        found = _LAUNCH.match(first.strip())
        return shlex.split(found.group(1)) if found else None


def blocks_of(path: Path) -> list[Block]:
    """The runnable Python blocks of a Markdown page (``{code-block}`` ones left out)."""
    out, lines, i = [], path.read_text().splitlines(), 0
    page = str(path.relative_to(ROOT))
    while i < len(lines):
        found = _FENCE.match(lines[i])
        if not found:
            i += 1
            continue
        indent, fence, info = found.group(1), found.group(2), found.group(3)
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        if info in ("python", "py"):
            body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[start:i]]
            out.append(Block(page, start + 1, "\n".join(body) + "\n"))
        i += 1
    return out


# what the docs build writes (ignored by git): built pages, copies, generated API pages
_GENERATED = {"_build", "_generated", "api"}


def _pages() -> list[Path]:
    docs = ROOT / "docs"
    written = [p for p in sorted(docs.rglob("*.md"))
               if not _GENERATED & set(p.relative_to(docs).parts[:-1])]
    return [p for p in [ROOT / "README.md", *written] if p.is_file()]


def _cases() -> list:
    cases = []
    for page in _pages():
        blocks = blocks_of(page)
        inline = [b for b in blocks if b.launch_args is None]
        rel = str(page.relative_to(ROOT))
        if inline:
            cases.append(pytest.param(inline, id=rel))
        for b in blocks:
            if b.launch_args is not None:
                cases.append(pytest.param([b], id=f"{rel}:{b.line}-launch"))
    return cases


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "JAXPG_COORDINATOR_HOSTED", "JAXPG_RUN_LOBBY")}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "XLA_FLAGS": xla_flags(),
                **extra})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def test_the_convention_is_read_as_documented(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\na = 1\n```\n```{code-block} python\nnot run\n```\n"
                    "```bash\nls\n```\n- item\n\n  ```python\n  b = a\n  ```\n"
                    "```python\n# launch: jaxpg-run --nproc-per-node 3\nc = 2\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = blocks_of(page)
    assert [(b.line, b.code, b.launch_args) for b in found] == [
        (3, "a = 1\n", None), (14, "b = a\n", None),
        (17, "# launch: jaxpg-run --nproc-per-node 3\nc = 2\n", ["--nproc-per-node", "3"])]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("blocks", _cases())
def test_docs_code_runs_as_written(blocks, tmp_path):
    block = blocks[0]
    if block.launch_args is not None:
        script = tmp_path / "block.py"
        script.write_text("\n" * (block.line - 1) + block.code)
        result = subprocess.run(
            [sys.executable, "-m", "jaxpg.run", *block.launch_args, str(script)], cwd=ROOT,
            capture_output=True, text=True, timeout=240, env=_env())
        assert result.returncode == 0, (
            f"{block.page}:{block.line} failed under jaxpg-run {' '.join(block.launch_args)} "
            f"(exit {result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        return
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([[b.page, b.line, b.code] for b in blocks]))
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(spec)], cwd=ROOT, capture_output=True, text=True,
        timeout=240, env=_env(XLA_FLAGS=xla_flags(8)))
    failed = re.search(r"BLOCK FAILED (\S+)", result.stdout)
    assert result.returncode == 0, (
        f"{failed.group(1) if failed else block.page} does not run as written:\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    assert result.stdout.count("BLOCK OK") == len(blocks)
