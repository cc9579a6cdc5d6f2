"""``python -m numattn``: the command line of :mod:`numattn.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
