"""Uneven inputs: torch's ``DistributedDataParallel.join()`` context manager.

When ranks hold different numbers of batches, torch's ranks that run out of data
*shadow* the collectives of the ranks still training (all-reducing zeros) until every
rank is out. jaxpg's step is one SPMD program that every rank runs together, so the same
idea becomes a per-rank ``active`` flag:

- With several ranks in one process, pass ``active=[...]`` (one flag per local rank) to
  :meth:`~jaxpg.ddp.DistributedDataParallel.train_step`; inactive ranks' data is ignored.
- With one rank per process (``jaxpg-run``), a process out of data leaves its loop; on
  leaving the ``with ddp.join():`` block it keeps calling the step with zeros (a *shadow*
  step, ``train_step(loss_fn, None)``) until the step reports that no rank is active. So
  every process runs the same number of steps, and none blocks.

Inactive ranks contribute zero gradients. With ``divide_by_initial_world_size=True``
(torch's default) the sum is divided by the initial world size, so the active ranks'
gradients are weighted down; with False it is divided by the number of active ranks.
With ``throw_on_early_termination=True`` the first step in which some rank is out of
data changes nothing and raises ``RuntimeError`` on every rank (torch's behaviour).

Example (several ranks in one process)::

    with ddp.join():
        for step in range(max_len):
            active = [step < n for n in per_rank_lengths]
            ddp.train_step(loss_fn, batch_for(step), active=active)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Join", "EARLY_TERMINATION_MESSAGE"]

EARLY_TERMINATION_MESSAGE = (
    "Detected at least one rank that exhausted inputs. Throwing across all ranks."
)


class Join:
    """The context ``DistributedDataParallel.join()`` returns; see the module docstring.

    Attributes:
        enable: whether uneven-input handling is on (False: a no-op context).
        divide_by_initial_world_size: average over all ranks (True) or active ranks.
        throw_on_early_termination: raise on every rank once any rank is out of data.
        num_active: the number of active ranks the last step reported.
    """

    def __init__(
        self,
        ddp: Any,
        *,
        enable: bool = True,
        divide_by_initial_world_size: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        for name, value in (
            ("enable", enable),
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"join: {name}={value!r} must be a bool.")
        self._ddp = ddp
        self.enable = enable
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw_on_early_termination = throw_on_early_termination
        self.num_active = ddp.world_size

    def __enter__(self) -> Join:
        if self.enable:
            if self._ddp._join is not None:
                raise RuntimeError("join: this DistributedDataParallel is already in a join().")
            self._ddp._join = self
        return self

    def observe(self, num_active: int) -> None:
        """Records the active-rank count of a step; raises on early termination."""
        self.num_active = num_active
        if self.throw_on_early_termination and num_active < self._ddp.world_size:
            raise RuntimeError(EARLY_TERMINATION_MESSAGE)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enable:
            return
        try:
            if exc_type is not None or self._ddp._all_local:
                # With every rank in this process the caller's loop ran every rank's steps.
                return
            while self.num_active > 0:
                self._ddp._shadow_step()
        finally:
            self._ddp._join = None
