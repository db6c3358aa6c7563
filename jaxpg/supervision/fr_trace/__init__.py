"""``jaxpg-fr-trace``: merges a job's flight-recorder dumps and names the rank at fault."""

from jaxpg.supervision.fr_trace.analysis import analyze, load_dumps
from jaxpg.supervision.fr_trace.cli import main

__all__ = ["analyze", "load_dumps", "main"]
