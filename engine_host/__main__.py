"""``python -m engine_host``: see :mod:`engine_host.launcher`."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
