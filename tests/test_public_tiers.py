"""Public tiers: ``import jaxpg`` is the light torch.distributed surface (no flax, optax or
orbax until a parallelism package is used), and internals stay out of the public ``__all__``.
"""

from __future__ import annotations

import json
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
    loaded = _loaded_after("import jaxpg, jaxpg.run, jaxpg.errors\nfrom jaxpg import DistError")
    assert not any(loaded.values()), loaded


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


def test_parallelism_packages_are_attributes_of_jaxpg():
    for name in ("ddp", "fsdp", "models", "pipeline", "plan", "tensor_parallel", "train"):
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

    public = ["jaxpg", "jaxpg.ddp", "jaxpg.fsdp", "jaxpg.models", "jaxpg.pipeline",
              "jaxpg.plan",
              "jaxpg.tensor_parallel", "jaxpg.train",
              "jaxpg.rendezvous", "jaxpg.stores", "jaxpg.run"]
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
