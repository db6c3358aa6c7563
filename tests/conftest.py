"""Test setup: 8 simulated CPU devices, set before JAX is imported.

Under ``JAXPG_TEST_PLATFORM=gpu`` (tools/gpu_check.sh) JAX keeps its default platform (the
GPU), and the tests that need the 8 simulated CPU devices or CPU worker processes are marked
``cpu_only`` (deselected there with ``-m "not cpu_only"``).
"""

import os
import resource

GPU_RUN = os.environ.get("JAXPG_TEST_PLATFORM", "") == "gpu"
_flags = os.environ.get("XLA_FLAGS", "")
if not GPU_RUN:
    _flags += " --xla_force_host_platform_device_count=8"
if not GPU_RUN and "xla_backend_optimization_level" not in _flags:
    # The suite compiles thousands of small CPU programs and runs each a few times: LLVM's
    # optimizations cost more than they save (about a quarter of the suite's time). Worker
    # processes inherit it (tests/_child_env.py). Results do not depend on it.
    _flags += " --xla_backend_optimization_level=0"


def _jaxlib_before(major: int, minor: int) -> bool:
    """Whether the installed jaxlib is older than ``major.minor`` (read without importing it)."""
    from importlib.metadata import version

    return tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (major, minor)


if not GPU_RUN and "xla_cpu_use_fusion_emitters" not in _flags and _jaxlib_before(0, 11):
    # jaxlib 0.10's XLA:CPU emits fusions through MLIR by default; its older emitters compile
    # the suite's programs in about 0.6x the CPU time (tests/pipeline/test_executor.py, both
    # ways, docs/development.md), with the same results. jaxlib 0.12 no longer has the flag
    # (an unknown XLA flag ends the process), and its MLIR emitters compile as fast.
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()
if not GPU_RUN:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# The notebook's kernel trains on 8 simulated CPU devices (and the GPU image has no nbformat)
collect_ignore = ["test_notebook.py"] if GPU_RUN else []

jax.config.update("jax_enable_x64", False)


@pytest.fixture
def world():
    """An initialised 8-rank world on this process's simulated devices."""
    import jaxpg

    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()
    jaxpg.init_process_group()
    yield jaxpg.GroupMember.WORLD
    if jaxpg.is_initialized():
        jaxpg.destroy_process_group()


def _forbid_skip(report) -> None:
    """Under ``JAXPG_FORBID_SKIPS=1`` (CI's 3.11 leg) a skip is reported as a failure."""
    if (report.skipped and not hasattr(report, "wasxfail")
            and os.environ.get("JAXPG_FORBID_SKIPS", "") == "1"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"JAXPG_FORBID_SKIPS=1, but this skipped: {reason}"


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


_CPU_START = pytest.StashKey[tuple]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Notes the CPU seconds so far, before the test's fixtures are set up."""
    item.stash[_CPU_START] = (_cpu_seconds(resource.RUSAGE_SELF),
                              _cpu_seconds(resource.RUSAGE_CHILDREN))


def _record_cpu(item, call) -> None:
    """After teardown, the test's CPU seconds as JUnit properties: ``cpu_s``, this
    process's, and ``children_cpu_s``, its finished child processes' (and theirs), which
    ``.ci/file_times.py`` sums per file: CI's two legs share two busy cores, so CPU, not
    wall time, is what a test costs the run."""
    start = item.stash.get(_CPU_START, None)
    if call.when != "teardown" or start is None:
        return
    own, children = start
    item.user_properties.append(
        ("cpu_s", round(_cpu_seconds(resource.RUSAGE_SELF) - own, 3)))
    item.user_properties.append(
        ("children_cpu_s", round(_cpu_seconds(resource.RUSAGE_CHILDREN) - children, 3)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _record_cpu(item, call)  # before the teardown report is made, which carries them
    outcome = yield
    _forbid_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _forbid_skip(outcome.get_result())


# Fixtures that give a test the 8-rank world of simulated CPU devices. The directories'
# ``fresh_world`` fixtures request ``world``, so it is in their tests' fixture closure; one
# that overrides it without (tests/expert_parallel/kernels) leaves its tests to the GPU too.
_EIGHT_DEVICE_FIXTURES = {"world", "mesh"}


# CI's two legs (.ci/run sets ``JAXPG_CI_LEG``) share two cores. Each of these costly
# multi-process files runs on one leg only; every other file, the in-process tests of the
# same features and the multi-process collectives, launcher, hang and supervision tests
# among them, runs on both. The torch comparisons are on the leg that has torch.
# docs/development.md ("One leg") says how the files were chosen.
ONE_LEG_FILES = {
    "oldest": (
        "tests/multiprocess/test_pipeline_stage.py",
        "tests/tensor_parallel/test_multiprocess.py",
        "tests/fsdp/test_fsdp_multiprocess.py",
        "tests/multiprocess/test_c10d_conformance.py",
        "tests/train/test_recipe_multiprocess.py",
        "tests/train/test_recipe_pipeline.py",
        "tests/multiprocess/test_ddp_fsdp_two_devices_mp.py",
        "tests/multiprocess/test_pipeline_mp.py",
        "tests/multiprocess/test_elastic.py",
    ),
    "newest": (
        "tests/test_docs_code.py",
        "tests/expert_parallel/test_ep_multiprocess.py",
        "tests/context_parallel/test_cp_multiprocess.py",
        "tests/multiprocess/test_mpirun.py",
        "tests/multiprocess/test_pipeline_mpmd.py",
        "tests/multiprocess/test_elastic_nodes.py",
        "tests/multiprocess/test_elastic_etcd.py",
    ),
}


def other_legs_files(leg: str, root) -> set:
    """The files ``ONE_LEG_FILES`` gives to CI legs other than ``leg``, as paths.

    Raises:
        pytest.UsageError: ``leg`` is not a leg, a listed file is missing or listed twice,
            or a file of a leg without torch compares with torch.
    """
    if leg not in ONE_LEG_FILES:
        raise pytest.UsageError(
            f"JAXPG_CI_LEG={leg!r} is not a CI leg: use one of {sorted(ONE_LEG_FILES)}, or "
            "unset it to run every file")
    named = [f for files in ONE_LEG_FILES.values() for f in files]
    twice = sorted({f for f in named if named.count(f) > 1})
    missing = [f for f in named if not (root / f).is_file()]
    with_torch = [f for f in ONE_LEG_FILES["newest"] if f not in missing
                  and 'import_or_skip("torch"' in (root / f).read_text()]
    for problem, files in (("is listed for two legs", twice), ("does not exist", missing),
                           ("compares with torch, which the newest leg lacks", with_torch)):
        if files:
            raise pytest.UsageError(
                f"tests/conftest.py ONE_LEG_FILES: {', '.join(files)} {problem}; "
                "correct the table")
    return {root / f for other, files in ONE_LEG_FILES.items() if other != leg
            for f in files}


def pytest_terminal_summary(terminalreporter, config):
    """Under ``JAXPG_CI_LEG``, names the leg and the files left to the other one."""
    leg = os.environ.get("JAXPG_CI_LEG", "")
    if leg:
        elsewhere = sorted(str(p.relative_to(config.rootpath))
                           for p in other_legs_files(leg, config.rootpath))
        terminalreporter.write_line(
            f"CI leg {leg}: the other leg runs {', '.join(elsewhere)} "
            "(tests/conftest.py ONE_LEG_FILES)")


def pytest_collection_modifyitems(config, items):
    """Marks ``cpu_only`` the tests that need 8 simulated CPU devices or CPU worker processes
    (tests/multiprocess/, the fixtures above, ``@pytest.mark.slow``); under
    ``JAXPG_CI_LEG``, deselects the files ``ONE_LEG_FILES`` gives to the other leg."""
    for item in items:
        needs = set(getattr(item, "fixturenames", ())) & _EIGHT_DEVICE_FIXTURES
        if needs or "multiprocess" in item.path.parts or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.cpu_only)
    leg = os.environ.get("JAXPG_CI_LEG", "")
    if not leg:
        return
    elsewhere = other_legs_files(leg, config.rootpath)
    deselected = [item for item in items if item.path in elsewhere]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.path not in elsewhere]

