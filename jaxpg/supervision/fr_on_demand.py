"""``jaxpg.supervision.dump_flight_recorder()``: the flight recorder's dump, on demand."""

from __future__ import annotations

from jaxpg.supervision import fr_dump, fr_requests, world_link

__all__ = ["dump_flight_recorder"]


def dump_flight_recorder(path: str | None = None, *, all_ranks: bool = False) -> str:
    """Writes this process's flight-recorder dump now and returns the file's path.

    The dump holds the last ``JAXPG_FR_BUFFER_SIZE`` calls (with the recorder off, each
    group's last call only); read a job's dumps with ``jaxpg-fr-trace DIR``
    (docs/debugging.md).

    Args:
        path: the file (default: ``$JAXPG_FR_DUMP_DIR/jaxpg_fr_rank_<rank>``, see
            docs/debugging.md).
        all_ranks: also ask every other live process of the job to dump (through the store;
            each does so within a second).

    Example:
        >>> path = jaxpg.supervision.dump_flight_recorder()
    """
    state = world_link.current_world()
    written = fr_dump.write_dump("dump_flight_recorder()", state, path)
    if all_ranks and state.multiprocess:
        fr_requests.request("dump", f"rank {state.local_ranks[0]} called "
                                  "dump_flight_recorder(all_ranks=True)")
    return written
