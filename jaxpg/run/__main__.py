"""``python -m jaxpg.run``: the launcher."""

import sys

from jaxpg.run.agent import main

if __name__ == "__main__":  # not when a tool (the docs build) imports the module
    sys.exit(main())
