"""``python -m normflat``: the ``normflat`` command line (see :mod:`normflat.cli`)."""

import sys

from normflat.cli import main

if __name__ == "__main__":
    sys.exit(main())
