"""``python -m control``: see :mod:`control.cli`."""

import sys

from control.cli import main

if __name__ == "__main__":
    sys.exit(main())
