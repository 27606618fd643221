"""``python -m infopt``: the same command line as the ``infopt`` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
