"""Public tiers: ``import jaxpg`` is the light torch.distributed surface (no flax, optax or
orbax until a parallelism package is used), and internals stay out of the public ``__all__``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jaxpg

HEAVY = ("jax", "flax", "optax", "orbax")


def _loaded_after(code: str) -> dict[str, bool]:
    """Which of HEAVY a fresh interpreter holds in ``sys.modules`` after running ``code``."""
    probe = (f"import sys\n{code}\nimport json\n"
             f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_launcher_and_import_jaxpg_load_no_jax():
    # the launcher (python -m jaxpg.run) starts once per node and job: jaxlib only
    # (and it imports supervision modules: jaxpg.supervision binds its names on first use)
    loaded = _loaded_after("import jaxpg, jaxpg.run, jaxpg.errors, jaxpg.supervision\n"
                           "from jaxpg import DistError\n"
                           "assert 'recorded_step' in dir(jaxpg.supervision)")
    assert not any(loaded.values()), loaded


def test_supervision_is_reached_through_its_own_package():
    from jaxpg.supervision import fr_on_demand, step_recording

    assert jaxpg.supervision.recorded_step is step_recording.recorded_step
    assert jaxpg.supervision.RecordedStep is step_recording.RecordedStep
    assert jaxpg.supervision.dump_flight_recorder is fr_on_demand.dump_flight_recorder
    assert set(jaxpg.supervision.__all__) == {"recorded_step", "RecordedStep",
                                              "dump_flight_recorder"}
    assert set(jaxpg.supervision.__all__) & set(jaxpg.__all__) == set()
    assert not hasattr(jaxpg.groups, "recorded_step")
    try:
        jaxpg.supervision.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("jaxpg.supervision.no_such_name did not raise AttributeError")


def test_the_api_is_bound_on_first_use_and_spmd_is_the_function():
    # the API's modules imported first (by jaxpg.ddp) bind only their own names
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, jaxpg.ddp, jaxpg.spmd_lowering, jaxpg\n"
         "assert callable(jaxpg.spmd), jaxpg.spmd\n"
         "assert jaxpg.spmd.__module__ == 'jaxpg.spmd_lowering', jaxpg.spmd\n"
         "from jaxpg import *\n"
         "assert init_process_group is jaxpg.groups.init_process_group\n"
         "assert spmd is sys.modules['jaxpg.spmd_lowering'].spmd\n"
         "print(len(jaxpg.__all__))"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == len(jaxpg.__all__) > 60


def test_import_jaxpg_loads_no_flax_optax_or_orbax():
    # one subprocess: the light import first, then a parallelism package through the lazy
    # attribute (which must load it: the probe can see a module arrive)
    loaded = _loaded_after(
        "import jaxpg\n"
        "light = {m: m in sys.modules for m in ('jax', 'flax', 'optax', 'orbax')}\n"
        "assert not any(light.values()), light\n"
        "assert callable(jaxpg.all_reduce) and 'jaxpg.ddp' not in sys.modules\n"
        "jaxpg.fsdp.FullyShardedDataParallel\n")
    assert loaded["jax"] and loaded["optax"], loaded  # FSDP steps an optax optimizer


def test_every_package_is_in_exactly_one_tier():
    # a new package must be classified: public (dir(jaxpg), an API page) or internal
    root = pathlib.Path(jaxpg.__file__).parent
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    public, internal = set(jaxpg._SUBPACKAGES), set(jaxpg._INTERNAL_PACKAGES)
    assert len(public) == len(jaxpg._SUBPACKAGES), jaxpg._SUBPACKAGES  # no repeats
    assert len(internal) == len(jaxpg._INTERNAL_PACKAGES), jaxpg._INTERNAL_PACKAGES
    assert public & internal == set()
    assert packages - public - internal == set(), "packages in no tier"
    assert (public | internal) - packages == set(), "tiers name packages that are gone"
    sys.path.insert(0, str(root.parent / "docs"))
    try:
        from _api_pages import API_PACKAGES
    finally:
        sys.path.remove(str(root.parent / "docs"))
    assert {f"jaxpg.{name}" for name in public} - set(API_PACKAGES) == set()
    assert {f"jaxpg.{name}" for name in internal} & set(API_PACKAGES) == set()
    assert public <= set(dir(jaxpg))


def test_parallelism_packages_are_attributes_of_jaxpg():
    for name in jaxpg._SUBPACKAGES:
        assert getattr(jaxpg, name).__name__ == f"jaxpg.{name}"
        assert name in dir(jaxpg)
    try:
        jaxpg.no_such_package  # noqa: B018
    except AttributeError as error:
        assert "no_such_package" in str(error)
    else:
        raise AssertionError("jaxpg.no_such_package did not raise AttributeError")


def test_internals_are_out_of_every_public_all():
    import importlib

    import jaxpg.internal

    public = ["jaxpg", *(f"jaxpg.{name}" for name in jaxpg._SUBPACKAGES)]
    assert {"jaxpg.context_parallel", "jaxpg.expert_parallel", "jaxpg.supervision"} <= set(public)
    exported = {name for package in public
                for name in importlib.import_module(package).__all__}
    assert set(jaxpg.internal.__all__) & exported == set()
    # each internal name is the defining module's object, not a copy
    from jaxpg.ddp.reducer import fused_pmean
    from jaxpg.rendezvous.init_method import free_port
    from jaxpg.tensor_parallel.hlo_counts import collective_counts

    assert jaxpg.internal.fused_pmean is fused_pmean
    assert jaxpg.internal.free_port is free_port
    assert jaxpg.internal.collective_counts is collective_counts
