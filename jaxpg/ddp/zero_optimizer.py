"""torch's ``ZeroRedundancyOptimizer`` for a host-driven training loop: each rank of a
data-parallel group keeps the optimizer state of its share of the parameters only.

``DistributedDataParallel(zero_stage=1)`` is ZeRO-1 inside DDP's jitted step.
Loops that hold their gradients on the host side, one rank per process (a
:class:`~jaxpg.pipeline.PipelineStage`'s ``grads``, a hand-written ``jax.grad`` loop), use
this class instead, as torch's users do:

* **Partition** (torch's rule): the parameters, largest first, each go to the rank whose
  share is smallest so far (ties to the lower rank); a parameter is never split, so an
  optimizer that treats parameters one by one (Adam, weight decay masks, per-layer trust
  ratios) sees whole ones. Transformations that look across parameters (global-norm
  clipping) see only the rank's share, as in torch.
* :meth:`step` updates this rank's share with its optax transformation, then every rank's
  new parameters are broadcast from their owner (one broadcast per owner and dtype).
* ``reduce_gradients=True`` is ZeRO-2: ``step`` takes each rank's *local* gradients and
  sums each share onto its owner only (one ``reduce`` per owner and dtype), divided by the
  group's size, so no rank holds the whole averaged gradient. Otherwise the gradients must
  already be averaged over the group (DDP's, or a ``PipelineStage`` with
  ``data_parallel_group``).

Example (one rank per process)::

    zero = ZeroRedundancyOptimizer(optax.adam(1e-3), params, group=mesh["dp"])
    params = zero.step(grads, params)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from jaxpg.collectives.gathers import broadcast
from jaxpg.collectives.reductions import reduce
from jaxpg.groups.resolve import resolve_group
from jaxpg.reduce_op import ReduceOp

__all__ = ["ZeroRedundancyOptimizer", "partition_parameters"]

_API = "ZeroRedundancyOptimizer"


def partition_parameters(sizes: list[int], n: int) -> list[list[int]]:
    """torch's partition: leaf indices per rank, largest leaves first, each to the rank
    with the smallest total so far (ties to the lower rank); each rank's indices sorted."""
    totals, owned = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (totals[r], r))
        owned[r].append(i)
        totals[r] += sizes[i]
    return [sorted(o) for o in owned]


class ZeroRedundancyOptimizer:
    """ZeRO-1 (or ZeRO-2) over a group of one rank per process.

    Args:
        optimizer: the optax transformation each rank applies to its share.
        params: the parameters (any pytree of arrays; an ``nnx.State``), the same shapes
            on every rank.
        group: the data-parallel group (a ProcessGroup, ``mesh["dp"]``; None: the world).
        zero_stage: 1 (the default): :meth:`step` takes gradients already averaged over
            the group; 2: it takes each rank's local gradients and reduces each share onto
            its owner. (Stage 3 is ``FullyShardedDataParallel``'s.)
        reduce_gradients: ``True`` is ``zero_stage=2`` (an alias; pass one of them).

    Raises:
        ValueError: this process holds no rank, or several ranks, of the group.
        TypeError: ``optimizer`` is not an optax transformation.
    """

    def __init__(self, optimizer: optax.GradientTransformation, params: Any, *,
                 group: Any = None, zero_stage: int | None = None,
                 reduce_gradients: bool | None = None) -> None:
        from jaxpg.data_parallel.zero import resolve_zero_stage

        stage = resolve_zero_stage(
            _API, (1, 2), 1, zero_stage,
            hint=" ZeRO-3 is FullyShardedDataParallel(..., zero_stage=3).",
            reduce_gradients=None if reduce_gradients is None else 1 + bool(reduce_gradients))
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"{_API}: optimizer must be an optax.GradientTransformation "
                            f"(e.g. optax.adam(1e-3)), got {type(optimizer).__name__}.")
        self.group = resolve_group(group, api=_API)
        local = self.group.local_members()
        if len(local) != 1:
            raise ValueError(
                f"{_API}: this process holds {len(local)} ranks of {self.group!r}; it steps "
                "on the host with one rank per process. With several ranks in one process "
                "use DistributedDataParallel(..., zero_stage=1) or "
                "FullyShardedDataParallel(..., zero_stage=1).")
        self.optimizer = optimizer
        self.reduce_gradients = stage == 2
        leaves, self._treedef = jax.tree.flatten(params)
        self._structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in leaves]
        self._owned = partition_parameters([int(np.prod(s.shape)) for s in self._structs],
                                           self.group.size())
        self._me = self.group.rank()
        self.opt_state = optimizer.init([leaves[i] for i in self._owned[self._me]])

    @property
    def owned(self) -> list[int]:
        """The indices (in ``jax.tree.leaves`` order) of the parameters this rank steps."""
        return list(self._owned[self._me])

    def _leaves(self, tree: Any, name: str) -> list:
        try:
            leaves = self._treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{_API}.step: {name} does not have the parameters' structure "
                             f"({err}).") from None
        for x, s in zip(leaves, self._structs, strict=True):
            if np.shape(x) != s.shape:
                raise ValueError(f"{_API}.step: {name} has a leaf of shape {np.shape(x)} "
                                 f"where the parameters have {s.shape}.")
        return leaves

    def _by_dtype(self, indices: list[int]) -> dict[Any, list[int]]:
        groups: dict[Any, list[int]] = {}
        for i in indices:
            groups.setdefault(self._structs[i].dtype, []).append(i)
        return groups

    @staticmethod
    def _put(flat: Any, unravel: Any, indices: list[int], out: list) -> None:
        """Writes ``unravel(flat)``'s leaves into ``out`` at ``indices``."""
        for i, x in zip(indices, unravel(jnp.asarray(flat)), strict=True):
            out[i] = x

    def _reduced_share(self, grads: list) -> list:
        """ZeRO-2: each owner's share of the local gradients, summed onto it and averaged."""
        n, ranks = self.group.size(), self.group.ranks
        mine: list = list(grads)
        for r, indices in enumerate(self._owned):
            for dtype, idx in self._by_dtype(indices).items():
                flat, unravel = ravel_pytree([jnp.asarray(grads[i], dtype) for i in idx])
                total = reduce(flat, dst=ranks[r], op=ReduceOp.SUM, group=self.group)
                if r == self._me:
                    self._put(jnp.asarray(total) / jnp.asarray(n, dtype), unravel, idx, mine)
        return mine

    def step(self, grads: Any, params: Any) -> Any:
        """One optimizer step; returns the new parameters (the same on every rank).

        Args:
            grads: the gradients, structured as the parameters: averaged over the group,
                or (``reduce_gradients=True``) this rank's own.
            params: the current parameters.
        """
        g_leaves = self._leaves(grads, "grads")
        p_leaves = self._leaves(params, "params")
        if self.reduce_gradients:
            g_leaves = self._reduced_share(g_leaves)
        mine = self._owned[self._me]
        new = list(p_leaves)
        if mine:
            owned_p = [p_leaves[i] for i in mine]
            updates, self.opt_state = self.optimizer.update(
                [g_leaves[i] for i in mine], self.opt_state, owned_p)
            for i, x in zip(mine, optax.apply_updates(owned_p, updates), strict=True):
                new[i] = x
        ranks = self.group.ranks
        for r, indices in enumerate(self._owned):
            for dtype, idx in self._by_dtype(indices).items():
                # every rank flattens its own copy (the owner's is the new one): same layout
                flat, unravel = ravel_pytree([jnp.asarray(new[i], dtype) for i in idx])
                self._put(broadcast(flat, src=ranks[r], group=self.group), unravel, idx, new)
        return self._treedef.unflatten(new)
