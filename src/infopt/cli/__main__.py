"""``python -m infopt.cli``: the same command line as the ``infopt`` console script and ``python -m infopt``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
