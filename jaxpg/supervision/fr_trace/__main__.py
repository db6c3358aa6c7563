"""``python -m jaxpg.supervision.fr_trace DIR``: the same as ``jaxpg-fr-trace DIR``."""

import sys

from jaxpg.supervision.fr_trace.cli import main

if __name__ == "__main__":  # not when a tool (the docs build) imports the module
    sys.exit(main())
