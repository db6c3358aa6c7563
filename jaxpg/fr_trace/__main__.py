"""``python -m jaxpg.fr_trace DIR``: the same as ``jaxpg-fr-trace DIR``."""

import sys

from jaxpg.fr_trace.cli import main

sys.exit(main())
