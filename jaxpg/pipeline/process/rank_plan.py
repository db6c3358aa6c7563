"""One process's part of a timetable, for both process executors (stacked stages and
``PipelineStage`` s): its pipeline rank, its ops, a lane and the transfers to each peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxpg.pipeline.process.p2p_lanes import PairLane, lane_between
from jaxpg.pipeline.process.rank_ops import RankOp, pair_transfers, peers_of, rank_ops
from jaxpg.pipeline.schedule.timetable import Timetable

__all__ = ["RankPlan", "rank_plan"]


class RankPlan(NamedTuple):
    """What one process runs of a timetable (made once per timetable and group)."""

    rank: int  # pipeline rank
    me: int  # global rank
    ops: list[RankOp]
    pairs: dict[int, tuple[PairLane, list]]  # peer pipeline rank -> (lane, transfers)
    global_of: dict[int, int]  # pipeline rank -> global rank (this replica)
    process_of: dict[int, int]  # global rank -> process
    device: Any  # this rank's device
    replica: int = 0  # data-parallel index


def rank_plan(tt: Timetable, rank: int, devices: Sequence[Any], global_of: dict[int, int], *,
              replica: int = 0) -> RankPlan:
    """The :class:`RankPlan` of pipeline rank ``rank``.

    Args:
        tt: the timetable.
        rank: this process's pipeline rank.
        devices: each pipeline rank's device (this replica's).
        global_of: each pipeline rank's global rank (this replica's).
        replica: the data-parallel index of this pipeline.
    """
    me = global_of[rank]
    pairs = {}
    for q in peers_of(tt, rank):
        lane = lane_between(devices[rank], devices[q], me, global_of[q])
        pairs[q] = (lane, [t._replace(src=global_of[t.src], dst=global_of[t.dst])
                           for t in pair_transfers(tt, rank, q)])  # in global ranks
    process_of = {global_of[q]: devices[q].process_index for q in range(tt.num_stages)}
    return RankPlan(rank, me, rank_ops(tt, rank), pairs, global_of, process_of,
                    devices[rank], replica)
