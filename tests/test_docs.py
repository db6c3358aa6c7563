"""The documentation covers every public name, and its pages exist where the README points."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re
import sys

import jaxpg

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))

from _api_pages import API_PACKAGES, write_api_pages  # noqa: E402


def _public_packages() -> set[str]:
    """jaxpg and its subpackages whose names do not start with "_" and that define __all__."""
    found = {"jaxpg"}
    for info in pkgutil.iter_modules(jaxpg.__path__, prefix="jaxpg."):
        if info.ispkg and not info.name.rpartition(".")[2].startswith("_"):
            module = importlib.import_module(info.name)
            if hasattr(module, "__all__"):
                found.add(info.name)
    return found


REEXPORTED_WHOLE = {"jaxpg.groups", "jaxpg.collectives"}
INTERNAL = {"jaxpg.internal"}  # the internal tier, as equinox.internal: no API page


def test_every_public_package_has_an_api_page():
    # groups and collectives are re-exported whole by jaxpg itself (their names are on
    # the jaxpg page); every other public package has a page of its own.
    missing = _public_packages() - set(API_PACKAGES) - REEXPORTED_WHOLE - INTERNAL
    assert missing == set()
    for package in REEXPORTED_WHOLE:
        assert set(importlib.import_module(package).__all__) <= set(jaxpg.__all__), package


def test_every_public_name_is_on_an_api_page(tmp_path):
    listed = write_api_pages(tmp_path)
    for package in API_PACKAGES:
        module = importlib.import_module(package)  # a package that is gone fails here
        page = (tmp_path / f"{package.replace('.', '_')}.md").read_text()
        entries = set(re.findall(r"^   (\w+)$", page, re.M))
        entries |= set(re.findall(r"^\* `(\w+)`: \{py:obj\}", page, re.M))
        modules = {n for n in module.__all__ if n not in listed[package]}
        assert set(module.__all__) - modules <= entries, package
        assert modules <= {"ddp", "pipeline", "fsdp", "tensor_parallel", "run"}, modules


def test_the_readme_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)", readme)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_the_readme_is_an_entry_point():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


_HISTORY = re.compile(
    r"\b((first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|\d+(st|nd|rd|th)|this|last|next|previous) session|stop \d+\b|issue \d+\b"
    r"|the issue (asks|asked|says|is silent)|(this|last|previous) stop\b)", re.I)


def test_no_page_or_module_narrates_the_projects_history():
    # the manual and the code say what jaxpg does and why; the history is CHANGELOG.md's
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder, pattern in (("jaxpg", "**/*.py"), ("bench", "**/*.py"), ("bench", "*.md"),
                            ("examples", "**/*.py"), ("examples", "**/*.toml"), (".ci", "*")):
        paths += [p for p in sorted((ROOT / folder).glob(pattern)) if p.is_file()]
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
             for p in paths for i, line in enumerate(p.read_text(errors="ignore").splitlines(), 1)
             if _HISTORY.search(line)]
    assert found == []
