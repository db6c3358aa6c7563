"""Supervision of a multi-process run: watchdog, liveness, progress records, desync checks,
hang diagnosis, recorded steps, the flight recorder and its analyzer (``fr_trace``).

The public names (``dump_flight_recorder``, ``recorded_step``, ``RecordedStep``) are
re-exported by ``jaxpg`` itself; this package's ``__init__`` imports nothing, so that
importing one of its modules does not load the others.
"""
