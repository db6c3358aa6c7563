"""jaxpg's layers, bottom-up, and no import cycles: read from the source with ``ast``.

Layers (docs/design.md): errors/reduce_op/_jax_compat -> runtime -> stores -> rendezvous ->
supervision -> groups -> collectives (and spmd_lowering) -> tensor_parallel/context_parallel/
expert_parallel -> models -> ddp/fsdp -> pipeline -> plan -> run -> the ``jaxpg`` package's own
``__init__`` (the torch.distributed-style surface, which re-exports everything). A module's
layer is its package's; only the base modules and ``spmd_lowering`` sit loose at jaxpg's root.

Every ``import`` and ``from ... import`` counts, wherever it is: at module level, inside a
function (a lazy import), or under ``if TYPE_CHECKING:``. As in grimp/import-linter, importing
``jaxpg.a.b`` is an edge to ``jaxpg.a.b`` only, not to the packages ``jaxpg.a`` and ``jaxpg``
whose ``__init__`` Python runs on the way (those re-export modules, they are not the
module's dependency); ``from jaxpg.a import b`` is an edge to ``jaxpg.a.b`` when ``b`` is a
module, else to ``jaxpg.a``.
"""

from __future__ import annotations

import ast
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpg"

# Bottom-up; a module may import from its own layer and the layers below it. A layer is a set
# of packages (``jaxpg.<name>`` and everything under it); the only modules at jaxpg's root are
# the base ones below, ``spmd_lowering`` (beside the collectives) and ``jaxpg`` itself (the
# surface).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # _jax_compat holds every private jax API jaxpg uses; it imports only jaxpg.errors.
    ("base", ("errors", "reduce_op", "_jax_compat")),
    # the processes' machinery: JAX's coordination service (its client, its hosting, rank 0's
    # service child), gloo's network interface and the MPI library.
    ("runtime", ("runtime",)),
    ("stores", ("stores",)),
    ("rendezvous", ("rendezvous",)),
    # watchdog, liveness, progress, desync, hang diagnosis, recorded steps, the flight
    # recorder and its analyzer: below the world model, which registers what they need of it
    # (jaxpg.supervision.world_link).
    ("supervision", ("supervision",)),
    ("groups", ("groups",)),
    ("collectives", ("collectives", "spmd_lowering")),
    ("tensor_parallel", ("tensor_parallel", "context_parallel", "expert_parallel")),
    # the data-parallel core ddp and fsdp share (batch placement, checkpoint format, ZeRO)
    ("data_parallel", ("data_parallel",)),
    # the model families, their parallel plans and Hugging Face checkpoints
    ("models", ("models",)),
    ("ddp/fsdp", ("ddp", "fsdp")),
    ("pipeline", ("pipeline",)),
    # the layout planner and preflight: specs, memory and time models over the timetables
    ("plan", ("plan",)),
    # the launcher, and the training recipe (python -m jaxpg.train)
    ("run", ("run", "train")),
    # the internal tier (helpers for jaxpg's tests, benchmarks and tools) gathers from all
    ("internal", ("internal",)),
]
# besides jaxpg/__init__.py:
ROOT_MODULES = {"errors", "reduce_op", "_jax_compat", "spmd_lowering"}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) for every module of jaxpg."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


MODULES = _modules()


@functools.cache
def _nodes(name: str) -> list[ast.AST]:
    """Every node of module ``name``'s syntax tree (parsed once)."""
    path, _ = MODULES[name]
    return list(ast.walk(ast.parse(path.read_text(), str(path))))


def _imports(name: str) -> set[tuple[str, int]]:
    """(imported jaxpg module, line) for every import in module ``name``, at any depth."""
    path, is_package = MODULES[name]
    edges = set()
    for node in _nodes(name):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, up level - 1 packages
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "jaxpg" or target.startswith("jaxpg."):
                edges.add((_known_module(target), node.lineno))
    return edges


def _known_module(target: str) -> str:
    """The longest prefix of ``target`` that is a jaxpg module (``import a.b.c`` of a name)."""
    while target not in MODULES and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def _layer(name: str) -> int:
    """The index of the layer ``name`` belongs to: its package's (``jaxpg.<package>...``);
    ``jaxpg`` itself is the surface, above every layer; -1 for a module of no layer."""
    if name == "jaxpg":
        return len(LAYERS)
    package = name.split(".")[1]
    for index, (_, packages) in enumerate(LAYERS):
        if package in packages:
            return index
    return -1


def _layer_name(index: int) -> str:
    return LAYERS[index][0] if index < len(LAYERS) else "the jaxpg surface"


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_read():
    # The parser sees module-level, function-level and TYPE_CHECKING imports alike, and
    # resolves relative ones: a few edges that must be there.
    edges = {(m, t) for m, targets in GRAPH.items() for t, _ in targets}
    assert ("jaxpg.collectives.eager", "jaxpg.spmd_lowering") in edges
    assert ("jaxpg.groups.world", "jaxpg.groups.multiprocess") in edges  # a lazy import
    assert ("jaxpg", "jaxpg.runtime.mpi_library") in edges  # the package's own imports
    assert len(MODULES) > 40


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"], ["e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_has_a_layer():
    assert [m for m in MODULES if _layer(m) < 0] == []
    assert _layer("jaxpg.supervision.watchdog") < _layer("jaxpg.groups.world")
    assert _layer("jaxpg.runtime.service_client") < _layer("jaxpg.stores.tcp_store")
    assert _layer("jaxpg.spmd_lowering") == _layer("jaxpg.collectives.eager")
    assert _layer("jaxpg.groups.world") < _layer("jaxpg.collectives.eager")


def test_the_root_holds_only_the_base_modules():
    # A new module goes into the package of its layer, not loose at jaxpg's root.
    loose = {name.split(".")[1] for name, (_, is_package) in MODULES.items()
             if name.count(".") == 1 and not is_package}
    assert loose == ROOT_MODULES, f"put {sorted(loose - ROOT_MODULES)} in a package"


def test_no_import_cycles():
    graph = {m: {t for t, _ in targets} for m, targets in GRAPH.items()}
    assert _cycles(graph) == []


def test_no_module_imports_from_a_higher_layer():
    upward = [
        f"{name}:{line} imports {target} ({_layer_name(_layer(target))} is above "
        f"{_layer_name(_layer(name))})"
        for name, targets in sorted(GRAPH.items())
        for target, line in sorted(targets, key=lambda e: e[1])
        if _layer(target) > _layer(name)
    ]
    assert upward == []


def test_no_private_name_crosses_packages():
    # ``from jaxpg.<package>... import _name`` only inside <package>: what another package
    # needs is public in its module (the shared data-parallel core, say), not borrowed.
    borrowed = []
    for name in sorted(MODULES):
        own = name.split(".")[1] if "." in name else ""
        for node in _nodes(name):
            if isinstance(node, ast.ImportFrom) and not node.level \
                    and (node.module or "").startswith("jaxpg."):
                package = node.module.split(".")[1]
                borrowed += [f"{name}:{node.lineno} imports {node.module}.{a.name}"
                             for a in node.names
                             if a.name.startswith("_") and a.name != "__all__"
                             and package != own]
    assert borrowed == []


def test_jax_compat_stays_at_the_bottom():
    assert {t for t, _ in GRAPH["jaxpg._jax_compat"]} <= {"jaxpg.errors"}


def test_private_jax_apis_only_in_the_compat_module():
    # jax._src and jaxlib._jax, anywhere in the text (imports, strings, docstrings), so that
    # `grep -rlE 'jax\._src|jaxlib\._jax' jaxpg/` lists one file.
    import re

    private = re.compile(r"jax\._src|jaxlib\._jax")
    users = sorted(str(path.relative_to(ROOT)) for path, _ in MODULES.values()
                   if private.search(path.read_text()))
    assert users == ["jaxpg/_jax_compat.py"]


def _absolute_import_roots(name: str) -> list[tuple[int, str]]:
    """Each absolute import's line and top-level package (``jax`` of ``jax.numpy``)."""
    roots = []
    for node in _nodes(name):
        if isinstance(node, ast.Import):
            roots += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.append((node.lineno, (node.module or "").split(".")[0]))
    return roots


def test_the_library_imports_neither_torch_nor_transformers():
    # torch and transformers are the tests' and benchmarks' references, never the library's
    found = [f"{name}:{line} imports {root}" for name in sorted(MODULES)
             for line, root in _absolute_import_roots(name)
             if root in ("torch", "transformers")]
    assert found == []


# Inside the pipeline package (docs/design.md, "The pipeline's folders"): ``schedule/`` is plain
# Python; ``stage/`` builds on it; the two executors, ``lockstep/`` (executor="spmd") and
# ``process/`` (executor="mpmd"), build on both and never on each other; the modules beside
# the folders (the API, the training step, torch's and Paddle's faces) sit on top, and no
# folder imports them.
PIPELINE = "jaxpg.pipeline"
PIPELINE_FOLDERS = {
    "schedule": {"schedule"},
    "stage": {"stage", "schedule"},
    "lockstep": {"lockstep", "stage", "schedule"},
    "process": {"process", "stage", "schedule"},
}
PIPELINE_TOP = {"api", "train_step", "zero", "fully_sharded", "param_placement",
                "dp_grad_reducer",
                "torch_api", "paddle_api", "layer_groups"}
NOT_PLAIN_PYTHON = ("jax", "jaxlib", "flax", "optax", "orbax")


def _pipeline_place(name: str) -> str | None:
    """A pipeline module's folder, ``""`` for the package's own top level, None outside."""
    if name == PIPELINE:
        return ""
    if not name.startswith(PIPELINE + "."):
        return None
    part = name.split(".")[2]
    return part if part in PIPELINE_FOLDERS else ""


def test_every_pipeline_module_has_a_place():
    # a new module goes into a folder, or is one of the few beside them on purpose
    loose = sorted(name for name, (_, is_package) in MODULES.items()
                   if _pipeline_place(name) == "" and name != PIPELINE
                   and name.split(".")[2] not in PIPELINE_TOP)
    assert loose == []
    assert set(PIPELINE_FOLDERS) <= {name.split(".")[2] for name in MODULES
                                     if name.startswith(PIPELINE + ".")}


def _folder_crossings(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    """Every import of a pipeline folder's module from a folder it may not use, or from the
    package's top level."""
    wrong = []
    for name in sorted(graph):
        folder = _pipeline_place(name)
        if not folder:
            continue
        for target, line in sorted(graph[name], key=lambda e: e[1]):
            place = _pipeline_place(target)
            if place is not None and place not in PIPELINE_FOLDERS[folder]:
                wrong.append(f"{name}:{line} imports {target} "
                             f"({place + '/' if place else 'the top level'})")
    return wrong


def test_pipeline_folders_import_only_their_own_and_lower_folders():
    assert _folder_crossings(GRAPH) == []


def test_the_schedule_folder_is_plain_python():
    # timetables, their builders, checker, costs and pictures: no jax, and of jaxpg only
    # themselves and the error classes
    found = []
    for name in sorted(MODULES):
        if _pipeline_place(name) != "schedule":
            continue
        found += [f"{name}:{line} imports {root}"
                  for line, root in _absolute_import_roots(name) if root in NOT_PLAIN_PYTHON]
        found += [f"{name}:{line} imports {target}" for target, line in GRAPH[name]
                  if _pipeline_place(target) != "schedule" and target != "jaxpg.errors"]
    assert found == []


def test_the_pipeline_layout_rules_catch_a_crossing():
    # an executor reaching into the other, a stage module reaching up to the API, and the
    # allowed edges (an executor on stage/ and schedule/, the API on everything) left alone
    graph = {
        "jaxpg.pipeline.process.executor": {("jaxpg.pipeline.lockstep.executor", 3),
                                            ("jaxpg.pipeline.stage.split", 4)},
        "jaxpg.pipeline.stage.split": {("jaxpg.pipeline.api", 5),
                                       ("jaxpg.pipeline.schedule.timetable", 6)},
        "jaxpg.pipeline.schedule.timetable": {("jaxpg.pipeline", 7)},
        "jaxpg.pipeline.api": {("jaxpg.pipeline.process.executor", 8)},
    }
    assert _folder_crossings(graph) == [
        "jaxpg.pipeline.process.executor:3 imports jaxpg.pipeline.lockstep.executor "
        "(lockstep/)",
        "jaxpg.pipeline.schedule.timetable:7 imports jaxpg.pipeline (the top level)",
        "jaxpg.pipeline.stage.split:5 imports jaxpg.pipeline.api (the top level)",
    ]
