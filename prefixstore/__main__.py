"""``python -m prefixstore``: the same command as the ``prefixstore`` console script."""

import sys

from .cli import main

sys.exit(main())
