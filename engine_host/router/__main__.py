"""``python -m engine_host.router``: see :mod:`engine_host.router.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
