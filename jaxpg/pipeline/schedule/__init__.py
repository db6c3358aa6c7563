"""Schedules as data, in plain Python (no jax): timetables and their simulation
(``timetable``, ``_simulate``), the schedule builders (``builders``), the checker with the
papers' bubbles (``checker``), cost-weighted replay (``costs``) and pictures (``render``)."""
