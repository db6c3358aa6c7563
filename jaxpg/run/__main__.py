"""``python -m jaxpg.run``: the launcher."""

import sys

from jaxpg.run.agent import main

sys.exit(main())
