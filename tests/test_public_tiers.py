"""Public tiers: ``import jaxpg`` is the light torch.distributed surface (no flax, optax or
orbax until a parallelism package is used), and internals stay out of the public ``__all__``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jaxpg

HEAVY = ("flax", "optax", "orbax")


def _loaded_after(code: str) -> dict[str, bool]:
    """Which of HEAVY a fresh interpreter holds in ``sys.modules`` after running ``code``."""
    probe = (f"import sys\n{code}\nimport json\n"
             f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_jaxpg_loads_no_flax_optax_or_orbax():
    # one subprocess: the light import first, then a parallelism package through the lazy
    # attribute (which must load it: the probe can see a module arrive)
    loaded = _loaded_after(
        "import jaxpg\n"
        "light = {m: m in sys.modules for m in ('flax', 'optax', 'orbax')}\n"
        "assert not any(light.values()), light\n"
        "assert callable(jaxpg.all_reduce) and 'jaxpg.ddp' not in sys.modules\n"
        "jaxpg.fsdp.FullyShardedDataParallel\n")
    assert loaded["optax"], loaded  # FullyShardedDataParallel steps an optax optimizer


def test_parallelism_packages_are_attributes_of_jaxpg():
    for name in ("ddp", "fsdp", "pipeline", "tensor_parallel"):
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

    public = ["jaxpg", "jaxpg.ddp", "jaxpg.fsdp", "jaxpg.pipeline", "jaxpg.tensor_parallel",
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
