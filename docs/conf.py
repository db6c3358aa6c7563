"""Sphinx configuration: the jaxpg documentation site.

Built with Sphinx, MyST (Markdown pages), myst-nb (the quickstart notebook, executed at build
time so its outputs are shown) and sphinx-book-theme, the toolchain of jax, flax and optax.
Build it with ``sphinx-build -W -b html docs docs/_build/html`` (warnings are errors).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The notebook lives in examples/ (where Colab opens it); Sphinx reads only its source folder.
_GENERATED = pathlib.Path(__file__).parent / "_generated"
_GENERATED.mkdir(exist_ok=True)
shutil.copyfile(ROOT / "examples" / "quickstart.ipynb", _GENERATED / "quickstart.ipynb")

project = "jaxpg"
author = "the jaxpg developers"
copyright = "2026, the jaxpg developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]

autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: autodoc documents the members once

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("JAXPG_DOCS_NB_EXECUTION", "force")  # "off" to iterate
nb_execution_timeout = 600
nb_execution_raise_on_error = True

html_theme = "sphinx_book_theme"
html_title = "jaxpg"
html_theme_options = {"show_toc_level": 2, "collapse_navbar": True, "max_navbar_depth": 2}

# The API reference: one page per public package, every name of its __all__ (docs/_api_pages.py).
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _api_pages import write_api_pages  # noqa: E402

write_api_pages(pathlib.Path(__file__).parent / "api")


def _data_docstring(app, what, name, obj, options, lines) -> None:
    """A re-exported constant's ``#:`` comment from the module that defines it.

    autodoc reads ``#:`` comments from the module it documents, which for ``jaxpg.KIND_CODES``
    re-exported by a package ``__init__`` is not where the comment is; without this it shows
    the docstring of the value's type (``dict``).
    """
    import importlib
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    if what != "data":
        return
    package, _, attr = name.rpartition(".")
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), prefix=f"{package}."):
        try:
            docs = ModuleAnalyzer.for_module(info.name).find_attr_docs()
        except Exception:  # noqa: BLE001 (a module without source)
            continue
        if ("", attr) in docs:
            lines[:] = list(docs[("", attr)])
            return


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _data_docstring)
