"""A context-parallel step's batch: samples over the data-parallel axes, sequences over cp.

Each process passes its own samples with their **whole** sequences, as the ranks of one
data-parallel replica load the same batch in torchtitan. Every leaf with a sequence
dimension (``split.seq_dim``) is reordered on the host into the load-balanced chunk order
(with ``load_balance``) and laid out ``P(samples, ..., "cp")``: each cp rank holds its
shard, as :func:`jaxpg.context_parallel.shard_sequence` would give it. Position ids are a
batch leaf like any other (``np.arange(seq)`` per sample), so they are split the same way.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpg.context_parallel.chunks import chunk_order
from jaxpg.context_parallel.sequence_split import ResolvedSequenceSplit

__all__ = ["sample_axes", "sequence_batch_specs", "place_sequence_batch"]


def sample_axes(axes: tuple[Any, ...], split: ResolvedSequenceSplit | None) -> tuple:
    """The data-parallel ``axes`` the samples (dim 0 of the batch) are split over: all but
    the cp axis (all of them without a split)."""
    return tuple(a for a in axes if split is None or a != split.axis)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _leaf_spec(ndim: int, sample_axes: tuple[str, ...], split: ResolvedSequenceSplit) -> P:
    if ndim <= split.seq_dim:
        return P(_entry(sample_axes))
    return P(_entry(sample_axes), *([None] * (split.seq_dim - 1)), split.axis)


def sequence_batch_specs(batch: Any, sample_axes: tuple[str, ...],
                         split: ResolvedSequenceSplit) -> Any:
    """A ``PartitionSpec`` per leaf of ``batch`` (arrays or shape structs)."""
    return jax.tree.map(lambda x: _leaf_spec(np.ndim(x), sample_axes, split), batch)


def _balanced(x: np.ndarray, split: ResolvedSequenceSplit) -> np.ndarray:
    """``x`` with its sequence chunks in the order the cp ranks hold them."""
    if not split.load_balance:
        return x
    chunks = np.split(x, split.chunks, axis=split.seq_dim)
    return np.concatenate([chunks[c] for c in chunk_order(split.size, True)],
                          axis=split.seq_dim)


def place_sequence_batch(batch: Any, mesh: Mesh, sample_axes: tuple[str, ...],
                         split: ResolvedSequenceSplit, where: str) -> Any:
    """Lays ``batch`` (this process's samples, whole sequences) out on ``mesh``.

    Args:
        batch: a pytree of host arrays, samples first.
        mesh: the step's mesh.
        sample_axes: the data-parallel axes other than cp (the samples are split over them).
        split: the sequence split.
        where: what the sample positions are, ending the sample-dimension error.

    Raises:
        ValueError: naming the leaf whose sample dimension does not divide among this
            process's sample positions, or whose sequence does not divide into
            ``split.chunks`` chunks.
    """
    index = [mesh.axis_names.index(a) for a in sample_axes]
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(mesh.devices)
    n_local = len({tuple(int(c[i]) for i in index) for c in np.argwhere(mine)})
    n_total = int(np.prod([mesh.shape[a] for a in sample_axes]))
    all_local = bool(mine.all())

    def place(path, x):
        x = np.asarray(x)
        name = jax.tree_util.keystr(path)
        if x.ndim == 0 or x.shape[0] % n_local:
            raise ValueError(
                f"batch leaf {name} has shape {x.shape}; its leading (sample) dimension must "
                f"divide evenly among this process's {n_local} {where}")
        if x.ndim > split.seq_dim:
            seq = x.shape[split.seq_dim]
            if seq % split.chunks:
                layout = (f"2·cp = {split.chunks} chunks (load_balance=True)"
                          if split.load_balance else f"cp = {split.chunks} shards")
                raise ValueError(
                    f"batch leaf {name} has shape {x.shape}: its sequence dimension "
                    f"(seq_dim={split.seq_dim}) of {seq} does not divide into {layout}; pad "
                    f"or cut the sequence to a multiple of {split.chunks}.")
            x = _balanced(x, split)
        sharding = NamedSharding(mesh, _leaf_spec(x.ndim, sample_axes, split))
        if all_local:
            return jax.device_put(x, sharding)
        global_shape = (x.shape[0] * n_total // n_local, *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree_util.tree_map_with_path(place, batch)
