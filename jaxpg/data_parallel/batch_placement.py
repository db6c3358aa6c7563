"""A batch laid out over a data-parallel group: each process passes its own samples."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding


def place_batch(batch: Any, sharding: NamedSharding, n_local: int, local: bool,
                where: str) -> Any:
    """Lays out each leaf of ``batch`` with ``sharding``, its dim 0 split among this
    process's ``n_local`` positions (``local``: the mesh is all on this process).

    Raises:
        ValueError: naming the leaf whose leading dimension does not divide; ``where``
            ends the message (what the positions are, and what to do).
    """

    def place(path, x):
        if isinstance(x, jax.Array) and (x.sharding == sharding or (
                x.ndim and x.sharding.is_equivalent_to(sharding, x.ndim))):
            return x  # already laid out so (one device's array, on a group of that one)
        shape = np.shape(x)
        if not shape or shape[0] % n_local:
            raise ValueError(
                f"batch leaf {jax.tree_util.keystr(path)} has shape {tuple(shape)}; its leading "
                f"(sample) dimension must divide evenly among this process's {n_local} {where}"
            )
        if local:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree_util.tree_map_with_path(place, batch)
