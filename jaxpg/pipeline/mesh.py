"""The pipeline mesh: devices arranged as ``("dp", "pp")`` for data x pipeline parallelism.

Example:
    >>> mesh = pipeline_mesh(4)  # with 8 devices: dp=2, pp=4
    >>> dict(mesh.shape)
    {'dp': 2, 'pp': 4}
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["pipeline_mesh"]


def pipeline_mesh(
    num_stages: int,
    data_parallel: int | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
    pp_axis: str = "pp",
    dp_axis: str = "dp",
) -> Mesh:
    """Builds a ``(dp_axis, pp_axis)`` mesh of ``data_parallel x num_stages`` devices.

    Consecutive devices form one pipeline (a row of the mesh), so stage neighbours are
    device neighbours.

    Args:
        num_stages: pipeline ranks ``p`` (size of ``pp_axis``).
        data_parallel: data-parallel replicas (size of ``dp_axis``); default: all the
            devices left, ``len(devices) // num_stages``.
        devices: the devices to use; default ``jax.devices()``.
        pp_axis: name of the pipeline axis.
        dp_axis: name of the data-parallel axis.

    Raises:
        TypeError: if a size is not an int.
        ValueError: if ``num_stages`` does not divide the number of devices, or
            ``data_parallel * num_stages`` is more than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("num_stages", num_stages), ("data_parallel", data_parallel)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {value!r}.")
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    if data_parallel is None:
        if len(devices) % num_stages:
            raise ValueError(
                f"num_stages={num_stages} does not divide the {len(devices)} devices; choose "
                f"a stage count that divides {len(devices)}, or pass data_parallel= and a "
                "subset of devices=."
            )
        data_parallel = len(devices) // num_stages
    if data_parallel * num_stages > len(devices):
        raise ValueError(
            f"data_parallel={data_parallel} x num_stages={num_stages} needs "
            f"{data_parallel * num_stages} devices, but only {len(devices)} are available."
        )
    grid = np.array(devices[: data_parallel * num_stages]).reshape(data_parallel, num_stages)
    return Mesh(grid, (dp_axis, pp_axis))
